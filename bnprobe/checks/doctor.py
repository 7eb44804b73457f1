"""bnprobe doctor: the expert's checklist for a BatchNorm kernel, with the known bug each failure matches.

The adapter runs on an input made to tell the classic bugs apart (channels whose variance is near
eps, R = 32 so that R/(R-1) is visible, momentum 0.1 so that 1-m is visible).  Each group of its
outputs — the training y, the saved statistics, the running statistics, the inference y, the
gradients — is compared with an FP64 model of BatchNorm and with the same model carrying one known
bug.  A bug is diagnosed when the adapter matches that bug's model and not the correct one.

On a recording (:func:`doctor_recorded`) the inputs are the recorded ones and cannot be changed: each
call's recorded outputs are judged against the FP64 golden on its own inputs, at the tolerance of the
format each was returned in, and matched against the bug models on those same inputs; the items that
need reruns on other data are listed as skipped, and bugs that the call's data cannot tell apart from
correct BatchNorm are named.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter, get_adapter
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.checks.gradcheck import _axes, _channels_first, _col
from bnprobe.checks.recorded import CallRun, PerCall, Recorded, check_options, runs
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.numerics.rounding import round_to
from bnprobe.tolerances import grad_tolerance

__all__ = ["BUGS", "Item", "DoctorReport", "doctor", "doctor_recorded", "model", "SKIPPED_ON_RECORDINGS"]

# Each known bug, with the outputs it changes
BUGS: dict[str, tuple[str, ...]] = {
    "eps added to sigma instead of sigma^2": ("y_train", "saved", "y_infer", "backward"),
    "eps missing": ("y_train", "saved", "y_infer", "backward"),
    "unbiased variance used for normalisation": ("y_train", "saved", "backward"),
    "running_var updated with the biased variance": ("running",),
    "momentum applied as 1-m (Keras convention)": ("running",),
    "inference uses batch statistics": ("y_infer",),
    "training uses running statistics": ("y_train", "saved"),
    "dgamma missing the rstd factor": ("backward",),
    "dbeta is the mean of dy instead of the sum": ("backward",),
    "dx factor without the square root (the seed's formula)": ("backward",),
    "dx uses x instead of x-hat": ("backward",),
}


def model(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, rm: np.ndarray, rv: np.ndarray, dy: np.ndarray,
          momentum: float, eps: float, bug: str | None = None, *, training: bool = True) -> dict[str, np.ndarray]:
    """BatchNorm in FP64 (NC... layout), correct or with one bug from BUGS; ``training=False``: the backward
    is that of inference (normalised with the running statistics)."""
    if bug is not None and bug not in BUGS:
        raise BNProbeError(f"unknown bug model {bug!r}")
    ax = _axes(x)
    n = x.ndim
    r = x.size // x.shape[1]
    mean, var = x.mean(axis=ax), x.var(axis=ax)
    unbiased = var * r / (r - 1)

    def rstd_of(v: np.ndarray) -> np.ndarray:
        if bug == "eps added to sigma instead of sigma^2":
            return 1 / (np.sqrt(v) + eps)
        if bug == "eps missing":
            return 1 / np.sqrt(v)
        return 1 / np.sqrt(v + eps)

    m_t, v_t = (rm, rv) if bug == "training uses running statistics" else (mean, var)
    if bug == "unbiased variance used for normalisation":
        v_t = unbiased
    rstd = rstd_of(v_t)
    xhat = (x - _col(m_t, n)) * _col(rstd, n)
    y = _col(gamma, n) * xhat + _col(beta, n)
    if bug == "momentum applied as 1-m (Keras convention)":
        new_rm, new_rv = momentum * rm + (1 - momentum) * mean, momentum * rv + (1 - momentum) * unbiased
    else:
        new_rm = (1 - momentum) * rm + momentum * mean
        new_rv = (1 - momentum) * rv + momentum * (var if bug == "running_var updated with the biased variance"
                                                   else unbiased)
    mi, vi = (mean, var) if bug == "inference uses batch statistics" else (rm, rv)
    y_inf = _col(gamma, n) * (x - _col(mi, n)) * _col(rstd_of(vi), n) + _col(beta, n)
    dbeta = dy.mean(axis=ax) if bug == "dbeta is the mean of dy instead of the sum" else dy.sum(axis=ax)
    dgamma = (dy * (x - _col(m_t, n))).sum(axis=ax) if bug == "dgamma missing the rstd factor" else \
        (dy * xhat).sum(axis=ax)
    factor = gamma / (v_t + eps) if bug == "dx factor without the square root (the seed's formula)" else gamma * rstd
    z = x if bug == "dx uses x instead of x-hat" else xhat
    dx = _col(factor, n) * (dy - dy.mean(axis=ax, keepdims=True) - z * (dy * z).mean(axis=ax, keepdims=True))
    if not training:  # y = γ·(x - rm)·rstd(rv) + β: the statistics are constants
        rs = rstd_of(rv)
        dgamma = (dy * (x - _col(rm, n))).sum(axis=ax) if bug == "dgamma missing the rstd factor" else \
            (dy * (x - _col(rm, n)) * _col(rs, n)).sum(axis=ax)
        factor = gamma / (rv + eps) if bug == "dx factor without the square root (the seed's formula)" else gamma * rs
        dx = _col(factor, n) * dy
    return {"y_train": y, "saved_mean": m_t, "saved_invstd": rstd, "running_mean": new_rm, "running_var": new_rv,
            "y_infer": y_inf, "dx": dx, "dgamma": dgamma, "dbeta": dbeta}


GROUPS = {"y_train": ("y_train",), "saved": ("saved_mean", "saved_invstd"), "running": ("running_mean", "running_var"),
          "y_infer": ("y_infer",), "backward": ("dx", "dgamma", "dbeta")}


@dataclass(frozen=True)
class Item:
    name: str
    status: str  # PASS, WARN, FAIL
    evidence: str
    matches: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matches"] = list(self.matches)
        return d


@dataclass
class DoctorReport:
    adapter: str
    dtype: str
    items: list[Item]
    diagnosis: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    call: str | None = None  # the recorded call diagnosed (its label), None for the diagnostic inputs

    @property
    def healthy(self) -> bool:
        return all(i.status != "FAIL" for i in self.items)

    def __bool__(self) -> bool:
        return self.healthy

    def to_dict(self) -> dict[str, Any]:
        return {**({} if self.call is None else {"call": self.call}), "adapter": self.adapter, "dtype": self.dtype,
                "healthy": self.healthy, "diagnosis": self.diagnosis, "items": [i.to_dict() for i in self.items],
                "notes": self.notes}


def _rel_dist(a: dict[str, np.ndarray], b: dict[str, np.ndarray], keys: tuple[str, ...]) -> float:
    """The largest error of a against b over the keys, each relative to b's largest magnitude."""
    worst = 0.0
    for k in keys:
        if k not in a or a[k] is None:
            continue
        x, y = np.asarray(a[k], dtype=np.float64), np.asarray(b[k], dtype=np.float64)
        with np.errstate(all="ignore"):
            d = float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-300)
        worst = max(worst, d if math.isfinite(d) else math.inf)
    return worst


def _inputs(seed: int) -> dict[str, Any]:
    """x with channels whose variance is near eps, R = 32, gamma/beta/running stats distinct from 1/0."""
    rng = np.random.default_rng([seed, 0xD0C])
    c = 6
    std = np.array([2.0, 1.0, 0.5, 1e-2, 4e-3, 2e-3])  # var 4 ... 4e-6 (eps = 1e-5)
    # small-variance channels are centred: the correctness items must see bugs, not cancellation
    # (precision loss is the stability item's business)
    shift = np.where(std >= 0.5, rng.normal(0, 1, c), 0.0)
    x = rng.standard_normal((8, c, 2, 2)) * std.reshape(1, c, 1, 1) + shift.reshape(1, c, 1, 1)
    return {"x": x, "gamma": rng.uniform(0.5, 1.5, c), "beta": rng.normal(0, 0.3, c),
            "rm": rng.normal(0, 0.5, c), "rv": rng.uniform(0.5, 2.0, c) * std**2, "dy": rng.standard_normal(x.shape),
            "momentum": 0.1, "eps": 1e-5}


def doctor(adapter: str | KernelAdapter = "reference", dtype: str | None = None, *, seed: int = 0,
           stability: bool = True) -> DoctorReport:
    """Run the checklist on ``adapter`` in ``dtype`` (default: fp64 when it runs it, else fp32).  A dump
    adapter of one call is diagnosed on its recorded inputs (:func:`doctor_recorded` does every call)."""
    a = get_adapter(adapter) if isinstance(adapter, str) else adapter
    if isinstance(a, DumpAdapter):
        if len(a.calls.calls) != 1:
            raise BNProbeError(f"{a.name} holds {len(a.calls.calls)} BatchNorm calls: doctor_recorded diagnoses each "
                               "(or select one with dump:DIR#NAME)")
        return doctor_recorded(Recorded(a, a.calls), dtype=dtype).results[0]
    caps = a.capabilities()
    fmt = get_format(dtype).name if dtype else ("fp64" if "fp64" in caps.formats else caps.formats[0])
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    inp = _inputs(seed)
    pf = "fp64" if fmt == "fp64" else "fp32"
    x, dy = round_to(inp["x"], fmt), round_to(inp["dy"], fmt)
    g, b, rm, rv = (round_to(inp[k], pf) for k in ("gamma", "beta", "rm", "rv"))
    m, eps = inp["momentum"], inp["eps"]
    common = dict(dtype=fmt, eps=eps)
    out_t = a.forward_train(x, g, b, rm, rv, momentum=m, **common)
    got: dict[str, np.ndarray] = {"y_train": out_t.y, "running_mean": out_t.running_mean,
                                  "running_var": out_t.running_var}
    if out_t.saved is not None:
        got["saved_mean"], got["saved_invstd"] = out_t.saved.mean, out_t.saved.invstd(eps)
    got["y_infer"] = a.forward_infer(x, g, b, rm, rv, **common).y
    if out_t.saved is not None and "backward" in caps.modes:
        bw = a.backward(dy, x, g, out_t.saved, **common)
        got.update(dx=bw.dx, dgamma=bw.dgamma, dbeta=bw.dbeta)
    rtol, _ = grad_tolerance(fmt)
    tol = max(4 * rtol, 1e-9)  # outputs are compared relative to their largest magnitude
    correct = model(x, g, b, rm, rv, dy, m, eps)
    models = {bug: model(x, g, b, rm, rv, dy, m, eps, bug) for bug in BUGS}
    items: list[Item] = []
    diagnosis: list[str] = []

    def check(name: str, group: str, what: str) -> None:
        keys = GROUPS[group]
        d0 = _rel_dist(got, correct, keys)
        if d0 <= tol:
            items.append(Item(name, "PASS", f"{what} match FP64 BatchNorm (largest relative error {d0:.2g}, "
                                            f"tolerance {tol:.2g})"))
            return
        matches = tuple(bug for bug, groups in BUGS.items() if group in groups
                        and _rel_dist(got, models[bug], keys) <= tol)
        diagnosis.extend(bg for bg in matches if bg not in diagnosis)
        items.append(Item(name, "FAIL", f"{what} differ from FP64 BatchNorm by {d0:.3g} (relative)"
                          + (f"; they match the model of: {'; '.join(matches)}" if matches else
                             "; no known bug model matches"), matches))

    check("training forward: batch statistics, epsilon inside the square root", "y_train", "training outputs y")
    if "saved_mean" in got:
        check("saved statistics: mean and 1/sqrt(biased variance + eps)", "saved", "saved mean and 1/sqrt(var+eps)")
    if out_t.running_mean is not None:
        check("running statistics: PyTorch momentum convention, unbiased running_var", "running",
              "updated running_mean / running_var")
    check("train/eval switch: inference normalises with the running statistics", "y_infer", "inference outputs y")
    if "dx" in got:
        check("backward: dx, dgamma, dbeta", "backward", "gradients")
    # momentum=None: PyTorch's cumulative average; for a first batch the running stats become the batch's
    try:
        none = a.forward_train(x, g, b, rm, rv, momentum=None, **common)
        if none.running_mean is not None:
            want = model(x, g, b, rm, rv, dy, 1.0, eps)
            d = _rel_dist({"running_mean": none.running_mean, "running_var": none.running_var}, want, GROUPS["running"])
            items.append(Item("momentum=None is a cumulative average", "PASS" if d <= tol else "FAIL",
                              f"first batch with momentum=None: running stats vs the batch's, relative error {d:.2g}"))
    except BNProbeError as exc:
        items.append(Item("momentum=None is a cumulative average", "WARN", f"not supported: {exc}"))
    # epsilon sane for the format the statistics are computed in
    stat_fmt = get_format(a.policy_for(x, dtype=fmt).accumulate) if isinstance(a, PolicyAdapter) else \
        get_format("fp64" if fmt == "fp64" else "fp32")
    if eps < stat_fmt.eps / 2:
        items.append(Item("epsilon is resolvable in the statistics' format", "WARN",
                          f"eps {eps:g} is below half the {stat_fmt.name} spacing at 1 ({stat_fmt.eps / 2:.3g}): "
                          "var + eps == var for var >= 1, so eps only acts on small variances"))
    else:
        items.append(Item("epsilon is resolvable in the statistics' format", "PASS",
                          f"eps {eps:g} vs {stat_fmt.name} spacing at 1 {stat_fmt.eps:.3g}"))
    # determinism
    again = a.forward_train(x, g, b, rm, rv, momentum=m, **common)
    same = np.array_equal(np.asarray(again.y), np.asarray(out_t.y), equal_nan=True)
    if same:
        items.append(Item("determinism", "PASS", "the same inputs twice give the same bits"))
    else:
        with np.errstate(all="ignore"):
            diff = float(np.nanmax(np.abs(np.asarray(again.y, dtype=np.float64)
                                          - np.asarray(out_t.y, dtype=np.float64))))
        items.append(Item("determinism", "WARN", f"two runs on the same inputs differ by up to {diff:.3g} "
                                                 "(non-deterministic reduction order)"))
    if stability and fmt != "fp64":
        items.append(_stability(a, fmt))
    notes = ["no update of the running statistics in inference mode cannot be observed through the adapter "
             "interface (forward_infer returns none); it is guaranteed for bnprobe's own kernels"]
    return DoctorReport(a.name, fmt, items, diagnosis, notes)


def _stability(a: KernelAdapter, fmt: str) -> Item:
    """Low-precision stability: the overflow scan and compare-precision on stress inputs."""
    from bnprobe.checks.compare import compare_precision, stress_cases

    cases = [c for c in stress_cases() if c.name in ("stress/normal", "stress/mean/std=100", "stress/heavy-tails")]
    r = compare_precision([a], (fmt,), cases, mode="train", budget=False)
    fails = r.rows[r.rows.verdict == "FAIL"]
    findings: list[str] = []
    if isinstance(a, PolicyAdapter):
        from bnprobe.checks.overflow import scan
        from bnprobe.inputs import make_input

        rep = scan(a, make_input((8, 16, 8, 8), mean=100.0), dtype=fmt, remedies=False)
        findings = [f"{f.anomaly} at {f.stage}" for f in rep.findings]
    if not len(fails) and not findings:
        return Item("low-precision stability (stress inputs)", "PASS",
                    "compare-precision within standard on normal, mean/std = 100 and heavy-tailed inputs; "
                    "overflow scan clean")
    what = [f"{row.tensor} on {row.case}" for row in fails.itertuples()][:4]
    return Item("low-precision stability (stress inputs)", "WARN",
                "; ".join(filter(None, [("over the standard: " + ", ".join(what)) if what else "",
                                        ("overflow scan: " + ", ".join(findings)) if findings else ""])))


# ---- recorded calls ---------------------------------------------------------------------------------

SKIPPED_ON_RECORDINGS = (
    "momentum=None is a cumulative average (needs a rerun with momentum=None)",
    "determinism (needs a second run on the same inputs)",
    "low-precision stability on stress inputs (needs runs on other data)",
    "bug models on the designed diagnostic input (variance near eps, R = 32): only the recorded inputs are used",
)
OUTPUT_GROUP = {"y_train": "y_train", "saved_mean": "saved", "saved_invstd": "saved", "running_mean": "running",
                "running_var": "running", "y_infer": "y_infer", "dx": "backward", "dgamma": "backward",
                "dbeta": "backward"}
# the outputs whose natural scale (what they are formed from) bounds the error of a correct kernel
# where the value itself cancels toward zero
NATURAL = ("saved_mean", "running_mean", "dx", "dgamma", "dbeta")


def doctor_recorded(recorded: Recorded, *, dtype: str | None = None) -> PerCall:
    """The checklist on every selected call of a recording, in forward order, one at a time, on its own
    recorded inputs and scalars: each output the call returned (for a dump: the recorded one) against the
    FP64 golden, at the tolerance of the format it was returned in, and against the bug models on the same
    inputs.  One :class:`DoctorReport` per call; the items a recording cannot run are in the notes."""
    recorded.calls.require_tensors("doctor")
    check_options(recorded, dtype=dtype)
    reports = [_doctor_call(recorded, run) for _, _, run in runs(recorded)]
    notes = [f"skipped on a recording: {s}" for s in SKIPPED_ON_RECORDINGS
             if not (s.startswith("determinism") and not recorded.replay)]
    return PerCall("doctor", recorded.kernel.name, recorded.calls.source, recorded.calls.kind, reports,
                   notes + list(recorded.calls.notes))


def _distance(got: Any, want: Any, natural: float) -> float:
    """max |got - want| over max(max |want|, natural): NaN/inf in the same places count as equal."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    with np.errstate(all="ignore"):
        d = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, np.abs(a - b))
        worst = float(np.max(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0
        fb = np.abs(b[np.isfinite(b)])
        scale = max(float(fb.max()) if fb.size else 0.0, natural if math.isfinite(natural) else 0.0, 1e-300)
    return worst / scale


def _doctor_call(recorded: Recorded, run: CallRun) -> DoctorReport:
    rec, ci, fmt, eps = run.rec, run.inputs, run.fmt, run.eps
    layout = rec.layout
    cf = lambda a: None if a is None else np.asarray(_channels_first(np.asarray(a, dtype=np.float64), layout))  # noqa: E731
    x = cf(ci["x"])
    c = x.shape[1]
    g = np.ones(c) if ci["gamma"] is None else np.asarray(ci["gamma"], dtype=np.float64)
    b = np.zeros(c) if ci["beta"] is None else np.asarray(ci["beta"], dtype=np.float64)
    have_running = ci["running_mean"] is not None and ci["running_var"] is not None
    rm = np.asarray(ci["running_mean"], dtype=np.float64) if have_running else np.zeros(c)
    rv = np.asarray(ci["running_var"], dtype=np.float64) if have_running else np.ones(c)
    dy = cf(rec.tensors.get("backward", {}).get("inputs", {}).get("dy"))
    mom = rec.momentum
    got = {k: cf(v) if k in ("y_train", "y_infer", "dx") else np.asarray(v, dtype=np.float64)
           for k, v in run.got.items()}
    gold = {k: cf(v) if k in ("y_train", "y_infer", "dx") else v for k, v in run.gold.items()}
    natural = {k: float(np.nanmax(v)) if np.size(v) else 0.0 for k, v in run.scales.items() if k in NATURAL}
    tol = {k: max(4 * grad_tolerance(run.formats[k])[0], 1e-9) for k in got}
    training = rec.training
    items: list[Item] = []
    diagnosis: list[str] = []
    notes = list(run.notes)
    if "running_mean" in got and mom is None:
        notes.append("momentum None (cumulative average): the running statistics' update is not checked")
        got.pop("running_mean"), got.pop("running_var")
    keys_of = {group: tuple(k for k in keys if k in got) for group, keys in GROUPS.items()}

    def ratio(vals: dict[str, np.ndarray], keys: tuple[str, ...], against: dict[str, np.ndarray]) -> float:
        return max(_distance(against[k], vals[k], natural.get(k, 0.0)) / tol[k] for k in keys)

    # per bug model and checked group: (the kernel's outputs against the model, whether the model is within
    # tolerance of the golden — then this call's data cannot show the bug); one model in memory at a time
    fit: dict[str, dict[str, tuple[float, bool]]] = {}
    with np.errstate(all="ignore"):
        args = (x, g, b, rm, rv, np.zeros_like(x) if dy is None else dy, 0.1 if mom is None else mom, eps)
        for bug, affected in BUGS.items():
            todo = [gr for gr in affected if keys_of[gr]]
            if not todo or (bug == "training uses running statistics" and not have_running):
                continue
            m = model(*args, bug, training=training)
            fit[bug] = {gr: (ratio(m, keys_of[gr], got), ratio(m, keys_of[gr], gold) <= 1) for gr in todo}
            del m

    def check(name: str, group: str, what: str) -> None:
        keys = keys_of[group]
        if not keys:
            return
        r0 = ratio(gold, keys, got)
        bugs = [bug for bug in fit if group in fit[bug]]
        fmts = ", ".join(dict.fromkeys(run.formats[k] for k in keys))
        if r0 <= 1:
            items.append(Item(name, "PASS", f"{what} match the FP64 golden on the recorded inputs (largest error "
                                            f"{100 * r0:.3g}% of the {fmts} tolerance)"))
            return
        matches = tuple(bug for bug in bugs if fit[bug][group][0] <= 1)
        diagnosis.extend(bg for bg in matches if bg not in diagnosis)
        items.append(Item(name, "FAIL", f"{what} differ from the FP64 golden on the recorded inputs by {r0:.3g}x "
                                        f"the {fmts} tolerance"
                          + (f"; they match the model of: {'; '.join(matches)}" if matches else
                             "; no known bug model matches"), matches))

    check("training forward: batch statistics, epsilon inside the square root", "y_train", "training outputs y")
    check("saved statistics: mean and 1/sqrt(biased variance + eps)", "saved", "saved mean and 1/sqrt(var+eps)")
    check("running statistics: PyTorch momentum convention, unbiased running_var", "running",
          "updated running_mean / running_var")
    check("train/eval switch: inference normalises with the running statistics", "y_infer", "inference outputs y")
    check("backward: dx, dgamma, dbeta", "backward", "gradients")
    if training and "train" in rec.tensors and "running_mean" not in run.got:
        notes.append("the updated running statistics are not in the recording: their momentum and unbiased "
                     "variance are not checked")
    if "backward" not in rec.tensors:
        notes.append("no backward recorded: the gradients are not checked")
    stat_fmt = get_format(recorded.kernel.policy_for(x, dtype=fmt).accumulate) \
        if isinstance(recorded.kernel, PolicyAdapter) else get_format("fp64" if fmt == "fp64" else "fp32")
    items.append(Item("epsilon is resolvable in the statistics' format", "WARN" if eps < stat_fmt.eps / 2 else "PASS",
                      f"eps {eps:g} is below half the {stat_fmt.name} spacing at 1 ({stat_fmt.eps / 2:.3g}): var + eps "
                      "== var for var >= 1, so eps only acts on small variances" if eps < stat_fmt.eps / 2 else
                      f"eps {eps:g} vs {stat_fmt.name} spacing at 1 {stat_fmt.eps:.3g}"))
    if not recorded.replay and "train" in rec.tensors:
        ins = rec.tensors["train"]["inputs"]
        again = [recorded.kernel.forward_train(ins["x"], ins.get("gamma"), ins.get("beta"), dtype=fmt, eps=eps,
                                               layout=layout, params=ci["params"]).y for _ in range(2)]
        same = np.array_equal(np.asarray(again[0]), np.asarray(again[1]), equal_nan=True)
        items.append(Item("determinism", "PASS" if same else "WARN", "the recorded inputs twice give the same bits"
                          if same else "two runs on the recorded inputs differ (non-deterministic reduction order)"))
    unseen = [bug for bug, groups in fit.items() if all(hidden for _, hidden in groups.values())]
    if unseen:
        notes.append("on this call's data these bugs look like correct BatchNorm (within tolerance) and cannot be "
                     "seen: " + "; ".join(unseen))
    return DoctorReport(run.kernel, fmt, items, diagnosis, notes, run.label)

"""Where, in which channel and why a BatchNorm goes non-finite or silently wrong.

From the Trace of an instrumented run (any policy-backed adapter) every anomaly class is located at
the first stage where it appears, with channels, the first element and the input values there:
NaN, ±inf, overflow past the format's max (also when saturation hid it), underflow to zero,
subnormal results, flush-to-zero, negative variance, and catastrophic cancellation (decimal digits
lost in E[x²] − E[x]² or in x − mean, estimated from the statistics).  NaN/inf already in the input
is reported as input-borne.  Before running, the headroom of each stage is predicted from the
input's per-channel statistics alone; after, each finding's remedies are verified by rerunning.
Adapters without a trace (torch, dumps) are checked at their outputs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.adapters import KernelAdapter, get_adapter
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.kernels import backward, forward_infer, forward_train
from bnprobe.kernels.layout import layout_of
from bnprobe.kernels.policy import Policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.rounding import round_to

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Finding", "Headroom", "OverflowReport", "scan", "predict_headroom", "ANOMALIES"]

ANOMALIES = ("input_nonfinite", "nan", "inf", "overflow", "saturated", "underflow", "flushed", "subnormal",
             "negative_var", "cancellation")
# a channel of an elementwise stage is flagged for subnormal/underflow results only when more than this
# share of its values (and at least ELEMENTWISE_MIN of them) are: isolated tiny values of ordinary
# data are harmless, a channel working in the subnormal range is not
ELEMENTWISE_SHARE = 0.01
ELEMENTWISE_MIN = 3
VARIANCE_STAGES = ("var", "var_eps", "sum_sq_dev", "m2")


@dataclass(frozen=True)
class Remedy:
    name: str
    change: str
    fixed: bool
    y_error: float  # max |y - golden| with the remedy
    detail: str = ""


@dataclass(frozen=True)
class Finding:
    anomaly: str
    stage: str
    format: str
    channels: tuple[int, ...]
    count: int
    first_element: str
    inputs: str
    detail: str
    input_borne: bool = False
    remedies: tuple[Remedy, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        d["remedies"] = [asdict(r) for r in self.remedies]
        return d


@dataclass(frozen=True)
class Headroom:
    stage: str
    format: str
    predicted_max: float
    headroom_binades: float  # log2(format max / predicted magnitude); < 0 predicts overflow
    overflows: bool
    actual_max: float | None = None
    actually_overflowed: bool | None = None


@dataclass
class OverflowReport:
    adapter: str
    dtype: str
    mode: str
    policy: str
    findings: list[Finding]
    headroom: list[Headroom]
    saturation: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for f in self.findings:
            d = f.to_dict()
            d["channels"] = ",".join(map(str, f.channels[:8])) + ("..." if len(f.channels) > 8 else "")
            d["remedies"] = "; ".join(f"{r.name}: {'fixes' if r.fixed else 'does not fix'}" for r in f.remedies)
            rows.append(d)
        return pd.DataFrame(rows, columns=["anomaly", "stage", "format", "channels", "count", "first_element",
                                           "inputs", "detail", "input_borne", "remedies"])

    def to_dict(self) -> dict[str, Any]:
        return {"adapter": self.adapter, "dtype": self.dtype, "mode": self.mode, "policy": self.policy,
                "clean": self.clean, "findings": [f.to_dict() for f in self.findings],
                "headroom": [asdict(h) for h in self.headroom], "saturation": self.saturation, "notes": self.notes}


# ---- prediction from the input alone ----------------------------------------------------------------

def predict_headroom(x: np.ndarray, policy: Policy, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
                     eps: float = 1e-5, layout: str = "channels_first") -> list[Headroom]:
    """Predicted magnitude of each stage from per-channel statistics, and its headroom in binades."""
    lay = layout_of(x, layout)
    cr = lay.to_cr(x)
    r = lay.reduce_size
    with np.errstate(all="ignore"):
        mu = np.nanmean(cr, axis=1)
        var = np.nanvar(cr, axis=1)
        ex2 = np.nanmean(cr * cr, axis=1)
    acc, st = get_format(policy.accumulate), get_format(policy.storage)
    g = np.ones(lay.channels) if gamma is None else np.abs(np.asarray(gamma, dtype=np.float64))
    b = np.zeros(lay.channels) if beta is None else np.abs(np.asarray(beta, dtype=np.float64))
    pre = 2.0 ** -int(r - 1).bit_length() if policy.mean_by == "prescaled" else 1.0
    xmax = _nanmax_abs(cr) if cr.size else 0.0
    with np.errstate(all="ignore"):
        dev = np.abs(cr - mu[:, None])
        xhat_max = np.where(np.isnan(dev), -np.inf, dev).max(axis=1) / np.sqrt(var + eps)
    stages = [("x", st, xmax), ("sum", acc, float(np.nanmax(np.abs(mu)) * r * pre))]
    if policy.variance == "naive":
        stages += [("sum_sq", acc, float(np.nanmax(ex2)) * r * pre), ("mean_sq", acc, float(np.nanmax(mu**2)))]
    elif policy.variance == "two_pass":
        stages.append(("sum_sq_dev", acc, float(np.nanmax(var)) * r * pre))
    stages.append(("y", st, _nanmax_abs(g * xhat_max + b)))
    out = []
    for name, fmt, mag in stages:
        head = math.log2(fmt.max / mag) if mag > 0 and math.isfinite(mag) else math.inf
        out.append(Headroom(name, fmt.name, mag, head, head < 0))
    return out


# ---- locating anomalies in a trace ----------------------------------------------------------------------

def _index_str(flat_index: int, lay: Any, elementwise: bool) -> str:
    if not elementwise:
        return f"channel {flat_index}"
    c, k = divmod(flat_index, lay.reduce_size)
    rest = list(np.unravel_index(k, tuple(s for i, s in enumerate(lay.shape) if i != lay.channel_axis)))
    rest.insert(lay.channel_axis, c)
    return f"index {tuple(int(v) for v in rest)} (channel {c})"


def _input_at(flat_index: int, x_cr: np.ndarray, elementwise: bool) -> str:
    c = flat_index // x_cr.shape[1] if elementwise else flat_index
    row = x_cr[c]
    with np.errstate(all="ignore"):
        s = f"channel {c}: mean {np.nanmean(row):.4g}, std {np.nanstd(row):.4g}, max|x| {_nanmax_abs(row):.4g}"
    if elementwise:
        s = f"x = {x_cr.reshape(-1)[flat_index]:.6g}; " + s
    return s


def _mask(stage: Any, anomaly: str) -> np.ndarray | None:
    v = stage.value
    if v is None:
        return None
    fmt = get_format(stage.format)
    with np.errstate(invalid="ignore"):
        if anomaly == "nan":
            return np.isnan(v)
        if anomaly == "inf":
            return np.isinf(v)
        if anomaly in ("overflow", "saturated"):
            w = stage.wide if stage.wide is not None else v
            return (np.abs(w) > fmt.max) | np.isinf(v) | ((np.abs(v) == fmt.max) & (anomaly == "saturated"))
        if anomaly == "subnormal":
            return (v != 0) & (np.abs(v) < fmt.tiny)
        if anomaly in ("underflow", "flushed"):
            w = stage.wide if stage.wide is not None else v
            return (w != 0) & (v == 0)
        if anomaly == "negative_var":
            w = stage.wide if stage.wide is not None else v
            return w < 0
    return None


COUNTER_OF = {"nan": ("nan",), "inf": ("posinf", "neginf"), "overflow": ("overflow",), "saturated": ("saturated",),
              "underflow": ("underflow",), "flushed": ("flushed",), "subnormal": ("subnormal",),
              "negative_var": ("negative",)}


def _locate(trace: Trace, lay: Any, x_cr: np.ndarray, cancel_digits: float) -> list[Finding]:
    findings: list[Finding] = []
    input_bad = np.zeros(lay.channels, dtype=bool)
    if "x" in trace:
        xs = trace["x"]
        bad = xs.counters["nan"] + xs.counters["posinf"] + xs.counters["neginf"]
        if bad.any():
            input_bad = bad > 0
            m = ~np.isfinite(xs.value) if xs.value is not None else None
            first = int(np.flatnonzero(m.reshape(-1))[0]) if m is not None and m.any() else 0
            findings.append(Finding("input_nonfinite", "x", xs.format, tuple(np.flatnonzero(input_bad).tolist()),
                                    int(bad.sum()), _index_str(first, lay, True), _input_at(first, x_cr, True),
                                    "NaN/inf present in the input itself: input-borne, not a kernel fault", True))
    for anomaly, counters in COUNTER_OF.items():
        for st in trace:
            if st.name == "x" and anomaly in ("nan", "inf"):
                continue
            per_ch = sum(st.counters[k] for k in counters)
            if anomaly in ("subnormal", "underflow", "flushed") and st.elementwise:
                limit = max(ELEMENTWISE_SHARE * (st.size // lay.channels), ELEMENTWISE_MIN - 1)
                per_ch = np.where(per_ch > limit, per_ch, 0)
            if not per_ch.any():
                continue
            chans = np.flatnonzero(per_ch)
            borne = bool(anomaly in ("nan", "inf") and input_bad[chans].all())
            m = _mask(st, anomaly)
            if m is not None and st.elementwise:  # the first element in a flagged channel
                m = m.reshape(lay.channels, -1) & (per_ch > 0)[:, None]
            first = int(np.flatnonzero(m.reshape(-1))[0]) if m is not None and m.any() else int(chans[0])
            elementwise = st.elementwise and m is not None and m.any()
            detail = {
                "nan": "NaN produced", "inf": "±inf produced",
                "overflow": f"a result beyond the {st.format} maximum {get_format(st.format).max:.6g}",
                "saturated": "clamped to ±max (or NaN set to 0): a finite, plausible-looking wrong number",
                "underflow": "nonzero results stored as zero", "flushed": "subnormal results flushed to zero",
                "subnormal": f"results below the smallest {st.format} normal {get_format(st.format).tiny:.3g}",
                "negative_var": "the variance came out negative before any clamp (cancellation)",
            }[anomaly] + (" (follows from NaN/inf in the input)" if borne else "")
            findings.append(Finding(anomaly, st.name, st.format, tuple(chans.tolist()), int(per_ch.sum()),
                                    _index_str(first, lay, elementwise), _input_at(first, x_cr, elementwise),
                                    detail, borne))
            break  # the first stage where this anomaly appears
    # cancellation: decimal digits lost, from the statistics of the golden-quality input
    with np.errstate(all="ignore"):
        mu, var = np.nanmean(x_cr, axis=1), np.nanvar(x_cr, axis=1)
        lost = np.log10(1.0 + mu**2 / np.where(var > 0, var, np.nan))
    where = "var" if "ex2" in trace else ("centered" if "centered" in trace else "sum_sq_dev")
    if where in trace:
        fmt = get_format(trace[where].format)
        digits = fmt.precision * math.log10(2)
        bad = np.flatnonzero(np.nan_to_num(lost) >= cancel_digits * digits)
        if bad.size:
            c = int(bad[np.argmax(lost[bad])])
            what = "E[x²] − E[x]²" if where == "var" else "x − mean"
            findings.append(Finding("cancellation", where, fmt.name, tuple(bad.tolist()), int(bad.size),
                                    f"channel {c}", _input_at(c, x_cr, False),
                                    f"{what} loses ~{lost[c]:.1f} of {digits:.1f} decimal digits "
                                    f"(mean²/var = {mu[c] ** 2 / var[c]:.3g})"))
    return findings


# ---- remedies ---------------------------------------------------------------------------------------------

def _remedies_for(anomaly: str, stage: str, pol: Policy) -> list[tuple[str, dict[str, Any], float]]:
    """(name, policy changes, eps multiplier) worth trying for a finding."""
    out: list[tuple[str, dict[str, Any], float]] = []
    wide = "fp32" if get_format(pol.accumulate).precision < 24 else "fp64"
    if anomaly in ("overflow", "saturated", "inf", "nan", "underflow", "subnormal", "flushed"):
        out.append((f"wider accumulator ({wide})", {"accumulate": wide, "compute": wide}, 1.0))
        if pol.variance in ("naive", "two_pass") and pol.mean_by != "prescaled":
            out.append(("pre-scale sums by 2^-k", {"mean_by": "prescaled"}, 1.0))
    if anomaly in ("overflow", "saturated", "negative_var", "cancellation", "nan", "inf") and pol.variance == "naive":
        out.append(("two-pass variance", {"variance": "two_pass"}, 1.0))
        out.append(("Welford variance", {"variance": "welford"}, 1.0))
    if anomaly == "negative_var" and not pol.clamp_var:
        out.append(("clamp negative variance at 0", {"clamp_var": True}, 1.0))
    if anomaly in ("cancellation",) and pol.variance != "naive":
        out.append((f"wider accumulator ({wide})", {"accumulate": wide, "compute": wide}, 1.0))
    if anomaly in ("nan", "inf", "negative_var") or stage in ("rstd", "var_eps"):
        out.append(("larger eps (x100)", {}, 100.0))
    return out


def _nanmax_abs(a: np.ndarray) -> float:
    """max |a| over the non-NaN values, NaN when there are none (without numpy's warning)."""
    a = np.abs(np.asarray(a, dtype=np.float64))
    ok = ~np.isnan(a)
    return float(a[ok].max()) if ok.any() else math.nan


def _run(policy: Policy, mode: str, x: np.ndarray, g: np.ndarray, b: np.ndarray, rm: np.ndarray, rv: np.ndarray,
         dy: np.ndarray, eps: float, layout: str) -> tuple[np.ndarray, Trace]:
    if mode == "train":
        r = forward_train(x, g, b, rm, rv, eps=eps, policy=policy, layout=layout)
        return r.y, r.trace
    if mode == "infer":
        r = forward_infer(x, g, b, rm, rv, eps=eps, policy=policy, layout=layout)
        return r.y, r.trace
    f = forward_train(x, g, b, eps=eps, policy=policy, layout=layout, keep_arrays=False)
    r = backward(dy, x, g, f.mean.astype(np.float64), f.invstd.astype(np.float64), policy=policy, layout=layout,
                 saved_var=f.var.astype(np.float64), eps=eps)
    return r.dx, r.trace


def scan(
    adapter: str | KernelAdapter = "emulated",
    x: np.ndarray | None = None,
    *,
    dtype: str = "fp16",
    accumulate: str | None = None,
    mode: str = "train",
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    layout: str = "channels_first",
    seed: int = 0,
    cancel_digits: float = 0.75,
    remedies: bool = True,
) -> OverflowReport:
    """Find anomalies of one BatchNorm run.  ``accumulate`` (emulated adapters) sets the accumulator
    and compute format, e.g. fp16 for a naive port.  ``cancel_digits``: flag cancellation when this
    share of the accumulator's decimal digits is lost."""
    if mode not in ("train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")
    if x is None:
        raise BNProbeError("scan needs an input tensor x")
    a = get_adapter(adapter) if isinstance(adapter, str) else adapter
    fmt = get_format(dtype).name
    lay = layout_of(x, layout)
    c = lay.channels
    rng = np.random.default_rng([seed, 9])
    g = np.ones(c) if gamma is None else np.asarray(gamma, dtype=np.float64)
    b = np.zeros(c) if beta is None else np.asarray(beta, dtype=np.float64)
    x_cr = lay.to_cr(x)
    with np.errstate(all="ignore"):
        rm, rv = np.nan_to_num(np.nanmean(x_cr, axis=1)), np.nan_to_num(np.nanvar(x_cr, axis=1), nan=1.0)
    dy = rng.standard_normal(x.shape)
    if not isinstance(a, PolicyAdapter):
        return _scan_outputs(a, x, fmt, mode, g, b, rm, rv, dy, eps, layout, lay, x_cr)
    pol = a.policy_for(round_to(x, fmt), dtype=fmt, mode=mode, layout=layout)
    if accumulate is not None:
        pol = pol.with_options(accumulate=get_format(accumulate).name, compute=get_format(accumulate).name)
    xs = round_to(x, fmt)
    pf = pol.params_format
    g, b, rm, rv = (round_to(v, pf) for v in (g, b, rm, rv))
    head = predict_headroom(xs, pol, g, b, eps, layout)
    y, trace = _run(pol, mode, xs, g, b, rm, rv, round_to(dy, fmt), eps, layout)
    for i, h in enumerate(head):
        if h.stage in trace:
            st = trace[h.stage]
            over = bool(st.counters["overflow"].any() or st.counters["posinf"].any() or st.counters["neginf"].any())
            head[i] = replace(h, actual_max=st.absmax, actually_overflowed=over)
    findings = _locate(trace, lay, x_cr, cancel_digits)
    gold_y, _ = _run(pol.golden(), mode, xs, g, b, rm, rv, round_to(dy, fmt), eps, layout)
    with np.errstate(all="ignore"):
        base_err = _nanmax_abs(np.asarray(y, dtype=np.float64) - gold_y)
    if remedies:
        findings = [_with_remedies(f, pol, mode, xs, g, b, rm, rv, round_to(dy, fmt), eps, layout, gold_y, lay,
                                   x_cr, cancel_digits) for f in findings]
    sat = []
    if pol.overflow == "ieee" and any(f.anomaly in ("overflow", "inf") for f in findings):
        for mode_name in ("ieee", "saturate"):
            p2 = pol.with_options(overflow=mode_name)
            y2, _ = _run(p2, mode, xs, g, b, rm, rv, round_to(dy, fmt), eps, layout)
            y2 = np.asarray(y2, dtype=np.float64)
            with np.errstate(all="ignore"):
                sat.append({"overflow_mode": mode_name, "finite_share": float(np.mean(np.isfinite(y2))),
                            "max_abs_output": _nanmax_abs(np.where(np.isfinite(y2), y2, np.nan)),
                            "max_abs_error": _nanmax_abs(y2 - gold_y)})
    notes = [f"policy: {pol.describe()}", f"max |output - FP64 golden| = {base_err:.4g}"]
    return OverflowReport(a.name, fmt, mode, pol.name, findings, head, sat, notes)


def _with_remedies(f: Finding, pol: Policy, mode: str, xs: np.ndarray, g: np.ndarray, b: np.ndarray,
                   rm: np.ndarray, rv: np.ndarray, dy: np.ndarray, eps: float, layout: str, gold_y: np.ndarray,
                   lay: Any, x_cr: np.ndarray, cancel_digits: float) -> Finding:
    if f.input_borne or f.anomaly == "input_nonfinite":
        return f
    tried = []
    for name, change, eps_mult in _remedies_for(f.anomaly, f.stage, pol):
        try:
            p2 = pol.with_options(**change)
            y2, tr2 = _run(p2, mode, xs, g, b, rm, rv, dy, eps * eps_mult, layout)
        except BNProbeError as exc:
            tried.append(Remedy(name, str(change), False, math.nan, f"not applicable: {exc}"))
            continue
        after = _locate(tr2, lay, x_cr, cancel_digits)
        still = [h for h in after if h.anomaly == f.anomaly]
        if f.anomaly == "cancellation" and change.get("variance") in ("two_pass", "welford"):
            still = []  # two-pass and Welford do not form E[x²] - E[x]²: that cancellation is gone
        if change.get("clamp_var"):
            # the negative value is still formed (it is measured before the clamp); what the clamp
            # fixes is what follows from it: NaN or inf downstream
            still = [h for h in after if h.anomaly in ("nan", "inf") and not h.input_borne]
        with np.errstate(all="ignore"):
            err = _nanmax_abs(np.asarray(y2, dtype=np.float64) - gold_y)
        tried.append(Remedy(name, ", ".join(f"{k}={v}" for k, v in change.items()) or f"eps x{eps_mult:g}",
                            not still and math.isfinite(err), err,
                            "anomaly gone" if not still else f"still at {still[0].stage}"))
    return replace(f, remedies=tuple(tried))


def _scan_outputs(a: KernelAdapter, x: np.ndarray, fmt: str, mode: str, g: np.ndarray, b: np.ndarray,
                  rm: np.ndarray, rv: np.ndarray, dy: np.ndarray, eps: float, layout: str, lay: Any,
                  x_cr: np.ndarray) -> OverflowReport:
    """An adapter without a trace: NaN/inf/saturation at its outputs only."""
    from bnprobe.kernels.trace import Trace as _Trace

    xs = round_to(x, fmt)
    if mode == "train":
        out = a.forward_train(xs, g, b, rm, rv, dtype=fmt, eps=eps, layout=layout).y
    elif mode == "infer":
        out = a.forward_infer(xs, g, b, rm, rv, dtype=fmt, eps=eps, layout=layout).y
    else:
        saved = a.forward_train(xs, g, b, dtype=fmt, eps=eps, layout=layout).saved
        out = a.backward(round_to(dy, fmt), xs, g, saved, dtype=fmt, eps=eps, layout=layout).dx
    tr = _Trace(lay.channels)
    tr.record("x", lay.to_cr(xs), fmt)
    tr.record("output", lay.to_cr(np.asarray(out, dtype=np.float64)), a.capabilities().output or fmt)
    findings = _locate(tr, lay, x_cr, cancel_digits=math.inf)
    return OverflowReport(a.name, fmt, mode, "(no trace: outputs only)", findings, [], [],
                          [f"{a.name} exposes no trace: only its outputs were scanned"])

"""Where, in which channel and why a BatchNorm goes non-finite or silently wrong.

From the Trace of an instrumented run (any policy-backed adapter) every anomaly class is located at
the first stage where it appears, with channels, the first element and the input values there:
NaN, ±inf, overflow past the format's max (also when saturation hid it), underflow to zero,
subnormal results, flush-to-zero, negative variance, and catastrophic cancellation (decimal digits
lost in E[x²] − E[x]² or in x − mean, estimated from the statistics).  NaN/inf already in the input
is reported as input-borne.  Before running, the headroom of each stage is predicted from the
input's per-channel statistics alone; after, each finding's remedies are verified by rerunning.
Adapters without a trace (torch, plugins) are judged by their outputs against the FP64 golden on the
same rounded inputs, exactly as a recording's are (below), and in training also by the inference the
step's running statistics give (an inf running_var destroys it).

A recording (:func:`scan_recorded`) has no trace and cannot be rerun: each call's recorded outputs are
compared with the FP64 golden on the call's own inputs — NaN/inf where the golden is finite (and
finite values where it is not), values beyond the format (overflow) or held at its maximum
(saturation), outputs (channels) entirely zero or constant where the golden is not, the running
statistics' update beyond its format, a saved invstd or running_var that underflows (to zero or to a
subnormal), NaN/inf already in the inputs (input-borne) — with the headroom predicted from the recorded
input.  An msprobe statistics-only dump is read from its summaries (max/min/mean/norm per tensor).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.adapters import KernelAdapter, get_adapter
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.call import BNCall
from bnprobe.checks.recorded import PerCall, Recorded, check_options, check_params
from bnprobe.checks.run import CallRun, generated_call, run_call, runs
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.kernels import backward, forward_infer, forward_train, get_policy
from bnprobe.kernels.layout import layout_of
from bnprobe.kernels.policy import Policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.rounding import round_to
from bnprobe.recordings import CallRef

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["OverflowFinding", "Headroom", "OverflowReport", "scan", "scan_recorded", "predict_headroom", "ANOMALIES"]

ANOMALIES = ("input_nonfinite", "nan", "inf", "overflow", "saturated", "underflow", "flushed", "subnormal",
             "negative_var", "cancellation", "hidden_nonfinite", "zero_output", "constant_output")
# a channel of an elementwise stage is flagged for subnormal/underflow results only when more than this
# share of its values (and at least ELEMENTWISE_MIN of them) are: isolated tiny values of ordinary
# data are harmless, a channel working in the subnormal range is not
ELEMENTWISE_SHARE = 0.01
ELEMENTWISE_MIN = 3


@dataclass(frozen=True)
class Remedy:
    name: str
    change: str
    fixed: bool
    y_error: float  # max |y - golden| with the remedy
    detail: str = ""


@dataclass(frozen=True)
class OverflowFinding:
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
    findings: list[OverflowFinding]
    headroom: list[Headroom]
    saturation: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    call: str | None = None  # the recorded call scanned (its label), None for a given input

    @property
    def passed(self) -> bool:
        """No finding (every result type answers with ``.passed`` and ``bool``)."""
        return not self.findings

    @property
    def clean(self) -> bool:
        """The same as :attr:`passed` (the name its JSON report keeps)."""
        return self.passed

    def __bool__(self) -> bool:
        return self.passed

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for f in self.findings:
            d = f.to_dict()
            d["channels"] = ",".join(map(str, f.channels[:8])) + ("..." if len(f.channels) > 8 else "")
            d["remedies"] = "; ".join(f"{r.name}: {'fixes' if r.fixed else 'does not fix'}" for r in f.remedies)
            rows.append(d)
        frame = pd.DataFrame(rows, columns=["anomaly", "stage", "format", "channels", "count", "first_element",
                                            "inputs", "detail", "input_borne", "remedies"])
        if self.call is not None:
            frame.insert(0, "call", self.call)
        return frame

    def to_dict(self) -> dict[str, Any]:
        return {**({} if self.call is None else {"call": self.call}), "adapter": self.adapter, "dtype": self.dtype,
                "mode": self.mode, "policy": self.policy,
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


def _locate(trace: Trace, lay: Any, x_cr: np.ndarray, cancel_digits: float) -> list[OverflowFinding]:
    findings: list[OverflowFinding] = []
    input_bad = np.zeros(lay.channels, dtype=bool)
    if "x" in trace:
        xs = trace["x"]
        bad = xs.counters["nan"] + xs.counters["posinf"] + xs.counters["neginf"]
        if bad.any():
            input_bad = bad > 0
            m = ~np.isfinite(xs.value) if xs.value is not None else None
            first = int(np.flatnonzero(m.reshape(-1))[0]) if m is not None and m.any() else 0
            findings.append(OverflowFinding("input_nonfinite", "x", xs.format,
                                            tuple(np.flatnonzero(input_bad).tolist()),
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
            findings.append(OverflowFinding(anomaly, st.name, st.format, tuple(chans.tolist()), int(per_ch.sum()),
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
            findings.append(OverflowFinding("cancellation", where, fmt.name, tuple(bad.tolist()), int(bad.size),
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
         dy: np.ndarray, eps: float, layout: str, momentum: float | None = 0.1) -> tuple[np.ndarray, Trace]:
    if mode == "train":
        r = forward_train(x, g, b, rm, rv, momentum=momentum, eps=eps, policy=policy, layout=layout)
        return r.y, r.trace
    if mode == "infer":
        r = forward_infer(x, g, b, rm, rv, eps=eps, policy=policy, layout=layout)
        return r.y, r.trace
    f = forward_train(x, g, b, eps=eps, policy=policy, layout=layout, keep_arrays=False)
    r = backward(dy, x, g, f.mean.astype(np.float64), f.invstd.astype(np.float64), policy=policy, layout=layout,
                 saved_var=f.var.astype(np.float64), eps=eps)
    return r.dx, r.trace


def _check_mode(mode: str | None) -> None:
    """``mode`` must be None (each call's own, or train) or one of train, infer and backward."""
    if mode not in (None, "train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")


def scan(
    adapter: str | KernelAdapter = "emulated",
    x: np.ndarray | None = None,
    *,
    dtype: str | None = None,
    accumulate: str | None = None,
    mode: str | None = None,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float | None = None,
    layout: str = "channels_first",
    seed: int = 0,
    cancel_digits: float = 0.75,
    remedies: bool = True,
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    dy: np.ndarray | None = None,
    momentum: float | None = 0.1,
    params: str | None = None,
) -> OverflowReport:
    """Find anomalies of one BatchNorm run of ``x`` in ``dtype`` (default fp16), ``mode`` (default train),
    with ``eps`` (default 1e-5).  ``accumulate`` (emulated adapters) sets the accumulator and compute
    format, e.g. fp16 for a naive port.  ``cancel_digits``: flag cancellation when this share of the
    accumulator's decimal digits is lost.  The running statistics (default: x's per-channel mean and
    variance) and dy (default: seeded standard normal) can be given, as a recording has them; ``params``:
    γ, β and the running and saved statistics in fp32 (default) or the input's format (same).

    A dump adapter of one call is scanned on its recorded inputs, ``x`` None (:func:`scan_recorded`
    scans every call of a dump)."""
    _check_mode(mode)
    a = get_adapter(adapter) if isinstance(adapter, str) else adapter
    if isinstance(a, DumpAdapter):
        inputs = dict(x=x, accumulate=accumulate, gamma=gamma, beta=beta, eps=eps, running_mean=running_mean,
                      running_var=running_var, dy=dy)
        return _scan_dump_call(a, inputs, dtype=dtype, mode=mode, params=params)
    check_params(params)
    params = params or "fp32"
    if x is None:
        raise BNProbeError("scan needs an input tensor x")
    fmt = get_format(dtype or "fp16").name
    mode = mode or "train"
    eps = 1e-5 if eps is None else eps
    lay = layout_of(x, layout)
    x_cr = lay.to_cr(x)
    g, b, rm, rv, dy = _run_inputs(x, x_cr, lay.channels, seed, gamma, beta, running_mean, running_var, dy)
    if not isinstance(a, PolicyAdapter):
        if accumulate is not None:
            raise BNProbeError(f"--accumulate sets the accumulator of an emulated kernel; {a.name} computes in its "
                               "own: drop it")
        return _scan_outputs(a, x, fmt, mode, g, b, rm, rv, dy, eps, layout, momentum, params)
    xs = round_to(x, fmt)
    pol = _traced_policy(a, xs, fmt, mode, layout, params, accumulate)
    pf = pol.params_format
    g, b, rm, rv = (round_to(v, pf) for v in (g, b, rm, rv))
    args = (xs, g, b, rm, rv, round_to(dy, fmt), eps, layout, momentum)
    return _scan_traced(a.name, fmt, pol, mode, args, lay, x_cr, cancel_digits, remedies)


def _scan_dump_call(a: DumpAdapter, inputs: dict[str, Any], *, dtype: str | None, mode: str | None,
                    params: str | None) -> OverflowReport:
    """A dump adapter of one call scanned on its recorded inputs.  ``inputs`` (scan's input options by name) must
    all be None: a recording brings its own; ``dtype``, ``mode`` and ``params`` must agree with it."""
    given = tuple(n for n, v in inputs.items() if v is not None)
    recorded = Recorded(a, a.calls)
    check_options(recorded, given=given, dtype=dtype, mode=mode, params=params)
    if len(a.calls.calls) != 1:
        raise BNProbeError(f"{a.name} holds {len(a.calls.calls)} BatchNorm calls: scan_recorded scans each "
                           "(or select one with dump:DIR#NAME)")
    return scan_recorded(recorded, mode=mode).results[0]


def _traced_policy(a: PolicyAdapter, xs: np.ndarray, fmt: str, mode: str, layout: str, params: str,
                   accumulate: str | None) -> Policy:
    """The policy ``a`` runs ``xs`` with, its accumulator and compute format set to ``accumulate`` when given."""
    pol = a.policy_for(xs, dtype=fmt, mode=mode, layout=layout, params=params)
    if accumulate is None:
        return pol
    return pol.with_options(accumulate=get_format(accumulate).name, compute=get_format(accumulate).name)


def _run_inputs(x: np.ndarray, x_cr: np.ndarray, channels: int, seed: int, gamma: np.ndarray | None,
                beta: np.ndarray | None, running_mean: np.ndarray | None, running_var: np.ndarray | None,
                dy: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """γ, β, the running statistics and dy of a run of x (``x_cr``: channel-first (C, R)), in float64: as given, or
    the defaults (γ = 1, β = 0, x's per-channel mean and variance, dy seeded standard normal)."""
    rng = np.random.default_rng([seed, 9])
    g = np.ones(channels) if gamma is None else np.asarray(gamma, dtype=np.float64)
    b = np.zeros(channels) if beta is None else np.asarray(beta, dtype=np.float64)
    with np.errstate(all="ignore"):
        rm = np.nan_to_num(np.nanmean(x_cr, axis=1)) if running_mean is None else \
            np.asarray(running_mean, dtype=np.float64)
        rv = np.nan_to_num(np.nanvar(x_cr, axis=1), nan=1.0) if running_var is None else \
            np.asarray(running_var, dtype=np.float64)
    dy = rng.standard_normal(x.shape) if dy is None else np.asarray(dy, dtype=np.float64)
    return g, b, rm, rv, dy


def _scan_traced(adapter: str, fmt: str, pol: Policy, mode: str, args: tuple[Any, ...], lay: Any, x_cr: np.ndarray,
                 cancel_digits: float, remedies: bool) -> OverflowReport:
    """A traced kernel run in ``fmt`` with ``pol`` on ``args`` (:func:`_run`'s x, γ, β, running statistics and dy,
    each rounded to its format, then eps, layout, momentum): the headroom predicted and measured, the anomalies
    located at their first stage, each one's remedies tried (``remedies``), and IEEE against saturating overflow
    compared when it overflowed."""
    xs, g, b, rm, rv, dy, eps, layout, momentum = args
    head = predict_headroom(xs, pol, g, b, eps, layout)
    y, trace = _run(pol, mode, *args)
    head = _measured(head, trace)
    findings = _locate(trace, lay, x_cr, cancel_digits)
    gold_y, _ = _run(pol.golden(), mode, *args)
    with np.errstate(all="ignore"):
        base_err = _nanmax_abs(np.asarray(y, dtype=np.float64) - gold_y)
    if remedies:
        findings = [_with_remedies(f, pol, mode, xs, g, b, rm, rv, dy, eps, layout, gold_y, lay, x_cr, cancel_digits,
                                   momentum) for f in findings]
    sat = []
    if pol.overflow == "ieee" and any(f.anomaly in ("overflow", "inf") for f in findings):
        sat = [_overflow_mode_run(pol, overflow, mode, args, gold_y) for overflow in ("ieee", "saturate")]
    notes = [f"policy: {pol.describe()}", f"max |output - FP64 golden| = {base_err:.4g}"]
    return OverflowReport(adapter, fmt, mode, pol.name, findings, head, sat, notes)


def _measured(head: list[Headroom], trace: Trace) -> list[Headroom]:
    """The predicted headroom with each traced stage's actual maximum and whether it overflowed."""
    for i, h in enumerate(head):
        if h.stage in trace:
            st = trace[h.stage]
            over = bool(st.counters["overflow"].any() or st.counters["posinf"].any() or st.counters["neginf"].any())
            head[i] = replace(h, actual_max=st.absmax, actually_overflowed=over)
    return head


def _overflow_mode_run(pol: Policy, overflow: str, mode: str, args: tuple[Any, ...],
                       gold_y: np.ndarray) -> dict[str, Any]:
    """The run with ``pol`` in the overflow mode ``overflow`` (ieee or saturate): the share of finite outputs, the
    largest finite output and the largest error against the golden ``gold_y``."""
    y2, _ = _run(pol.with_options(overflow=overflow), mode, *args)
    y2 = np.asarray(y2, dtype=np.float64)
    with np.errstate(all="ignore"):
        return {"overflow_mode": overflow, "finite_share": float(np.mean(np.isfinite(y2))),
                "max_abs_output": _nanmax_abs(np.where(np.isfinite(y2), y2, np.nan)),
                "max_abs_error": _nanmax_abs(y2 - gold_y)}


def _with_remedies(f: OverflowFinding, pol: Policy, mode: str, xs: np.ndarray, g: np.ndarray, b: np.ndarray,
                   rm: np.ndarray, rv: np.ndarray, dy: np.ndarray, eps: float, layout: str, gold_y: np.ndarray,
                   lay: Any, x_cr: np.ndarray, cancel_digits: float, momentum: float | None = 0.1) -> OverflowFinding:
    if f.input_borne or f.anomaly == "input_nonfinite":
        return f
    tried = []
    for name, change, eps_mult in _remedies_for(f.anomaly, f.stage, pol):
        try:
            p2 = pol.with_options(**change)
            y2, tr2 = _run(p2, mode, xs, g, b, rm, rv, dy, eps * eps_mult, layout, momentum)
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
                  rm: np.ndarray, rv: np.ndarray, dy: np.ndarray, eps: float, layout: str,
                  momentum: float | None = 0.1, params: str = "fp32") -> OverflowReport:
    """An adapter without a trace on generated inputs: its outputs against the FP64 golden on the same
    rounded inputs, exactly as a recorded call's are judged (:func:`_scan_call`); in training also the
    inference the step's running statistics give (``y_eval``)."""
    modes = {"train": ("train",), "infer": ("infer",), "backward": ("backward",)}[mode]
    call = BNCall(x, g, b, rm, rv, dy, eps, momentum, dtype=fmt, params=params, layout=layout)
    rec = generated_call(call, modes=("train", "backward") if mode == "backward" else modes, label="generated")
    run = run_call(a, rec, modes=modes, label=a.name, after_step=mode == "train")
    rep = _scan_call(run, policy="(no trace: outputs vs the FP64 golden)")
    rep.call = None
    rep.mode = mode
    rep.notes.insert(0, f"{a.name} exposes no trace: its outputs were compared with the FP64 golden on the same "
                        "rounded inputs" + (", and the inference the step's running statistics give (y_eval)"
                                            if "y_eval" in run.got else ""))
    return rep


# ---- recorded calls: outputs against the golden ---------------------------------------------------------

ELEMENTWISE_OUTPUTS = ("y", "y_infer", "dx", "y_eval")
# per-channel outputs that are positive by nature: a zero is an underflow, a subnormal a loss of precision
POSITIVE_OUTPUTS = ("saved_invstd", "running_var")
WHERE = {"y_eval": "inference with the running statistics the training step left: "}
_INPUTS = ("x", "gamma", "beta", "running_mean", "running_var", "dy")


def scan_recorded(recorded: Recorded, *, mode: str | None = None, params: str | None = None) -> PerCall:
    """Every selected call of a recording, in forward order, one at a time: its outputs (the recorded ones,
    for a dump) against the FP64 golden on its own recorded inputs, and its inputs; ``mode`` (train, infer
    or backward) restricts the outputs to that call's; ``params`` (same or fp32), when given, must be every
    call's parameter format.  An msprobe statistics-only dump is read from its
    summaries.  A runnable adapter on the recorded inputs is scanned with :func:`scan` (its trace), one
    report per call and mode.  One :class:`OverflowReport` per call (and mode)."""
    _check_mode(mode)
    calls = recorded.calls
    check_options(recorded, mode=mode, params=params)
    if calls.task == "statistics":
        if not recorded.replay:
            calls.require_tensors(f"running {recorded.kernel.name} on the recorded inputs")
        reports = [_scan_summaries(recorded.kernel.name, c, c.load(), mode) for c in calls.calls]
        notes = ["a statistics-only dump (max/min/mean/norm per tensor): comparing the outputs with the FP64 golden, "
                 "locating NaN/inf, constant channels, the running statistics' values and the headroom of the sums "
                 "need a tensor dump (msprobe task \"tensor\")"]
        return PerCall("overflow", recorded.kernel.name, calls.source, calls.kind, reports, notes + list(calls.notes))
    if not recorded.replay:
        reports = []
        for c in calls.calls:
            rec = c.load()
            for m in (mode,) if mode else rec.modes:
                reports.append(_scan_runnable(recorded.kernel, rec, m, f"{c.label} [{m}]"))
        return PerCall("overflow", recorded.kernel.name, calls.source, calls.kind, reports, list(calls.notes))
    reports = [_scan_call(run) for _, _, run in runs(recorded, modes=(mode,) if mode else None)]
    notes = ["a recording has no trace and cannot be rerun: findings come from its outputs against the FP64 golden "
             "on the same inputs; no remedies are tried"]
    return PerCall("overflow", recorded.kernel.name, calls.source, calls.kind, reports, notes + list(calls.notes))


def _scan_runnable(a: KernelAdapter, rec: Any, mode: str, label: str) -> OverflowReport:
    """A runnable adapter scanned on one recorded call's inputs and scalars in one of its modes."""
    ins = rec.tensors[mode]["inputs"]
    ci = rec.call()
    dy = rec.tensors.get("backward", {}).get("inputs", {}).get("dy")
    rep = scan(a, ins["x"], dtype=rec.dtype, mode=mode, gamma=ins.get("gamma", ci.gamma),
               beta=ins.get("beta", ci.beta), eps=rec.eps, layout=rec.layout,
               running_mean=ins.get("running_mean", ci.running_mean),
               running_var=ins.get("running_var", ci.running_var), dy=dy, momentum=rec.momentum,
               params=ci.params)
    rep.call = label
    return rep


def _finding(anomaly: str, stage: str, fmt: str, mask: np.ndarray, elementwise: bool, lay: Any, x_cr: np.ndarray,
             detail: str, input_borne: bool = False) -> OverflowFinding:
    """A finding from a mask of the output (channel-first (C, R) for elementwise outputs, (C,) otherwise)."""
    per_ch = mask.reshape(mask.shape[0], -1).sum(axis=1)
    chans = np.flatnonzero(per_ch)
    first = int(np.flatnonzero(mask.reshape(-1))[0])
    return OverflowFinding(anomaly, stage, fmt, tuple(chans.tolist()), int(per_ch.sum()),
                   _index_str(first, lay, elementwise), _input_at(first, x_cr, elementwise), detail, input_borne)


def _output_findings(key: str, got: Any, gold: Any, fmt: str, lay: Any, x_cr: np.ndarray,
                     input_bad: bool) -> list[OverflowFinding]:
    """Anomalies of one output against the golden's value of it on the same inputs."""
    elementwise = key in ELEMENTWISE_OUTPUTS
    conv = (lambda a: lay.to_cr(np.asarray(a, dtype=np.float64))) if elementwise else \
        (lambda a: np.asarray(a, dtype=np.float64))  # noqa: E731
    a, g = conv(got), conv(gold)
    f = get_format(fmt)
    with np.errstate(all="ignore"):
        gr = round_to(g, fmt)  # the golden as the format holds it: inf where the exact value is beyond it
        g_bad, a_fin = ~np.isfinite(g), np.isfinite(a)
        over = np.isfinite(g) & ~np.isfinite(gr)
        plain = ~g_bad & ~over
    out: list[OverflowFinding] = []

    def add(anomaly: str, mask: np.ndarray, detail: str, borne: bool = False) -> None:
        if mask.any():
            out.append(_finding(anomaly, key, f.name, mask, elementwise, lay, x_cr, WHERE.get(key, "") + detail,
                                borne))

    add("nan", plain & np.isnan(a), "NaN where the FP64 golden on the same inputs is finite")
    add("inf", plain & np.isinf(a), f"±inf where the FP64 golden on the same inputs is finite and within {f.name}")
    add("overflow", over & ~a_fin, f"the exact value is beyond the {f.name} maximum {f.max:.6g}: the format cannot "
                                   "hold it")
    add("saturated", (over & a_fin) | (plain & a_fin & (np.abs(a) == f.max) & (np.abs(gr) != f.max)),
        f"held at ±{f.max:.6g} (the {f.name} maximum) where the exact value is not: a finite, plausible-looking "
        "wrong number")
    add("hidden_nonfinite", g_bad & a_fin, "finite where the FP64 golden is NaN/inf: a NaN/inf replaced by a "
                                           "plausible-looking number")
    if key in POSITIVE_OUTPUTS:
        with np.errstate(all="ignore"):
            under = plain & (a == 0) & (g != 0)
            sub = plain & a_fin & (a != 0) & (np.abs(a) < f.tiny)
        lost = under & (gr == 0)
        add("underflow", under, "zero where the FP64 golden is not" + (
            f" (the exact value is below half the smallest {f.name} subnormal {f.smallest_subnormal:.3g}: the format "
            "cannot hold it)" if lost.all() else "" if not lost.any() else
            f" (some exact values are below what {f.name} can hold)"))
        add("subnormal", sub, f"a subnormal {f.name} value (below the smallest normal {f.tiny:.3g}): bits of "
                              "precision lost wherever it is used")
    add("nan" if np.isnan(a[g_bad & ~a_fin]).any() else "inf", g_bad & ~a_fin,
        "NaN/inf as the FP64 golden has them" + (" (follows from NaN/inf in the input)" if input_bad else ""),
        input_bad)
    with np.errstate(all="ignore"):
        fin_g = np.where(np.isfinite(gr), np.abs(gr), 0.0)
        if elementwise:
            zero_a = np.all(a == 0, axis=1)
            gold_nonzero = fin_g.max(axis=1) >= f.tiny
            ok_a = np.all(a_fin, axis=1)
            const_a = ok_a & np.all(a == a[:, :1], axis=1) & ~zero_a & (a.shape[1] > 1)
            fin = np.isfinite(gr)
            spread = np.where(fin, gr, -np.inf).max(axis=1) - np.where(fin, gr, np.inf).min(axis=1)
            varied = np.where(np.isfinite(spread), spread, 0.0) > 4 * f.eps * fin_g.max(axis=1)
            zero_ch, const_ch = zero_a & gold_nonzero, const_a & varied
        else:
            zero_ch = np.zeros(a.shape[0], dtype=bool)
            if np.all(a == 0) and fin_g.max(initial=0.0) >= f.tiny:
                zero_ch = fin_g >= f.tiny
            const_ch = np.zeros(a.shape[0], dtype=bool)
    if zero_ch.any():
        mask = np.broadcast_to(zero_ch[:, None], a.shape) if elementwise else zero_ch
        add("zero_output", mask & True, "entirely zero where the FP64 golden is not" +
            (" (per channel)" if elementwise else ""))
    if const_ch.any():
        add("constant_output", np.broadcast_to(const_ch[:, None], a.shape) & True,
            "one value over the whole channel where the FP64 golden varies")
    return out


def _scan_call(run: CallRun, policy: str = "(recorded outputs vs the FP64 golden)") -> OverflowReport:
    rec, ci, fmt = run.recording, run.inputs, run.fmt
    lay = layout_of(ci.x, rec.layout)
    x_cr = lay.to_cr(ci.x)
    dy = rec.tensors.get("backward", {}).get("inputs", {}).get("dy")
    findings: list[OverflowFinding] = []
    inputs = {**{k: getattr(ci, k) for k in _INPUTS if k != "dy"}, "dy": dy if "dx" in run.got else None}
    bad_inputs = []
    for name, v in inputs.items():
        if v is None:
            continue
        elementwise = name in ("x", "dy")
        m = ~np.isfinite(lay.to_cr(v) if elementwise else np.asarray(v, dtype=np.float64))
        if m.any():
            bad_inputs.append(name)
            vf = rec.params if not elementwise else fmt
            findings.append(_finding("input_nonfinite", name, vf, m, elementwise, lay, x_cr,
                                     "NaN/inf present in the input itself: input-borne, not a kernel fault",
                                     True))
    got_, gold_, formats_ = run.invstd_view()
    for key, got in got_.items():
        findings += _output_findings(key, got, gold_[key], formats_[key], lay, x_cr, bool(bad_inputs))
    notes = list(run.notes)
    for key in ("running_mean", "running_var"):
        if key in run.gold and key not in run.got:
            g = run.gold[key]
            with np.errstate(all="ignore"):
                over = np.isfinite(g) & ~np.isfinite(round_to(g, rec.params))
            if over.any():
                findings.append(_finding("overflow", key, rec.params, over, False, lay, x_cr,
                                         f"(not in the recording) the FP64 update is beyond the {rec.params} maximum: "
                                         "the kernel's running statistic cannot be finite", bool(bad_inputs)))
    head: list[Headroom] = []
    y = run.got.get("y", run.got.get("y_infer"))
    if y is not None:
        g = None if ci.gamma is None else np.asarray(ci.gamma, dtype=np.float64)
        b = None if ci.beta is None else np.asarray(ci.beta, dtype=np.float64)
        pol = get_policy(fmt).with_options(params=rec.params)
        head = predict_headroom(np.asarray(ci.x, dtype=np.float64), pol, g, b, run.eps, rec.layout)
        if "y" not in run.got:  # inference computes no statistics: only x and y apply
            head = [h for h in head if h.stage in ("x", "y")]
        actual = {"x": np.asarray(ci.x, dtype=np.float64), "y": np.asarray(y, dtype=np.float64)}
        for i, h in enumerate(head):
            if h.stage in actual:
                v = actual[h.stage]
                head[i] = replace(h, actual_max=_nanmax_abs(np.where(np.isfinite(v), v, np.nan)),
                                  actually_overflowed=bool(np.isinf(v).any()))
        notes.append(f"headroom of the sums is predicted for bnprobe's {fmt} preset ({pol.describe()}): the "
                     "kernel's intermediates are not seen")
    return OverflowReport(run.kernel, fmt, "+".join(run.modes), policy, findings,
                          head, [], notes, run.label)


def _scan_summaries(adapter: str, call: CallRef, summaries: dict[str, dict[str, Any]],
                    mode: str | None) -> OverflowReport:
    """An msprobe statistics-only call: findings from each tensor's max/min/mean/norm."""
    findings: list[OverflowFinding] = []
    notes: list[str] = []
    keep = {None: ("forward", "backward"), "train": ("forward",), "infer": ("forward",),
            "backward": ("forward.input", "backward")}[mode]
    items = {k: v for k, v in summaries.items() if k.startswith(keep)}

    def nonfinite(s: dict[str, Any]) -> bool:
        return any(not math.isfinite(s.get(k, math.nan)) for k in ("Max", "Min"))

    def summary(s: dict[str, Any]) -> str:
        return ", ".join(f"{k} {s.get(k, math.nan):.6g}" for k in ("Max", "Min", "Mean", "Norm"))

    x = summaries.get("forward.input.x", {})
    dy = summaries.get("backward.input.dy", {})
    for key, s in items.items():
        kind, io, name = key.split(".", 2)
        try:
            f = get_format(str(s.get("dtype")))
        except BNProbeError:
            continue
        stats = [s.get(k, math.nan) for k in ("Max", "Min", "Mean", "Norm")]
        if all(math.isfinite(v) for v in stats[:2]) and not all(math.isfinite(v) for v in stats[2:]):
            notes.append(f"{key}: Max and Min are finite but the Mean/Norm summary is not: the summary overflowed "
                         "in its own arithmetic, the tensor is finite")
        elif nonfinite(s):
            what = "nan" if any(math.isnan(v) for v in stats[:2]) else "inf"
            if io == "input":
                findings.append(OverflowFinding("input_nonfinite", name, f.name, (), 0, "(summaries only)", summary(s),
                                        f"the {kind} input {name} is already NaN/inf: input-borne, not a kernel "
                                        "fault", True))
            else:
                borne = nonfinite(x) if x else False
                if kind == "backward" and dy:
                    borne = borne or nonfinite(dy)
                findings.append(OverflowFinding(what, name, f.name, (), 0, "(summaries only)", summary(s),
                                        f"the {kind} output {name} holds {'NaN' if what == 'nan' else '±inf'}"
                                        + (" (follows from NaN/inf in the input)" if borne else ""), borne))
            continue
        if io == "output" and any(abs(v) == f.max for v in stats[:2] if math.isfinite(v)):
            findings.append(OverflowFinding("saturated", name, f.name, (), 0, "(summaries only)", summary(s),
                                    f"the {kind} output {name} reaches ±{f.max:.6g}, the {f.name} maximum: saturated "
                                    "or overflowed (a tensor dump tells which)"))
    y = items.get("forward.output.y")
    g = summaries.get("forward.input.gamma")
    if y and x and y.get("Max") == 0 and y.get("Min") == 0 and x.get("Max") != x.get("Min") and \
            not (g and g.get("Max") == 0 and g.get("Min") == 0):
        findings.append(OverflowFinding("zero_output", "y", str(y.get("dtype")), (), 0, "(summaries only)", summary(y),
                                "y is entirely zero (Max = Min = 0) while x varies (Max != Min)"))
    return OverflowReport(adapter, call.dtype, mode or "statistics", "(msprobe summaries: max/min/mean/norm)",
                          findings, [], [], notes, call.label)

"""The overflow check of LayerNorm, RMSNorm, GroupNorm and InstanceNorm: where, in which row and why a family
layer goes non-finite or silently loses accuracy.

A row is what the layer takes its statistics over (:class:`~bnprobe.kernels.layout.NormShape`): a token of a
LayerNorm or RMSNorm, a (sample, group) of a GroupNorm, a (sample, channel) of an InstanceNorm.  A traced kernel
(bnprobe's instrumented family kernels, :mod:`bnprobe.kernels.norms`, under the adapter's policy) has every
anomaly located at the first stage where it appears, with its rows, the first element and the input there — a sum
of squares beyond the format's largest value (RMSNorm's Σx² in 16 bits: rstd 0, y all zeros), a variance formed as
E[x²] − E[x]² that cancels at a large mean or goes negative, ε lost in the format it is added in (GroupNorm's 1e-12
in fp16) — its remedies tried by rerunning; then its outputs, as every kernel's, against the FP64 golden on the same
inputs, row by row, within what a correct kernel's accumulation can err by
(:func:`~bnprobe.checks.overflow.observe.family_findings`).  A kernel without a trace (torch, a plugin) is judged
by its outputs alone, as a recorded call's are (:func:`~bnprobe.checks.overflow.outputs.scan_call`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import FamilyPrepared
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.checks.overflow.outputs import scan_call
from bnprobe.checks.overflow.report import (
    OverflowFinding,
    OverflowReport,
    Remedy,
    RowLayout,
    describe_rows,
    family_headroom,
    index_str,
    input_at,
    nanmax_abs,
)
from bnprobe.checks.overflow.trace import locate, measured, remedies_for, remedy_result
from bnprobe.core.call import NORM_NAMES, BNCall
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import params_format
from bnprobe.engine.run import generated_call, run_call
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.norms import backward as family_backward
from bnprobe.kernels.norms import forward as family_forward
from bnprobe.kernels.policy import Policy, get_policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.rounding import round_to

__all__ = ["scan_family"]

# the anomalies the outputs check adds to a traced scan: what its trace does not show (y entirely zero where the
# sums overflowed, a result off the golden beyond a correct kernel's bound); its NaN/inf the trace locates first
_FROM_OUTPUTS = ("zero_output", "constant_output", "hidden_nonfinite", "saturated", "mean_error", "variance_error",
                 "y_error", "dx_error")
# the stages of a row's sums: an overflow there is told with the row's exact sum
_SUMS = {"squares": "x²", "sum_squares": "Σx²", "sum_sq": "Σx²", "sum": "Σx", "sum_sq_dev": "Σ(x − μ)²"}


def _inputs(call: BNCall, sh: NormShape, seed: int, dy: str | None) -> BNCall:
    """``call`` with γ = 1, β = 0 (none for RMSNorm) and dy (of the kind ``dy``, default ``shifted``: a mean per
    row) where it has none, in float64."""
    from bnprobe.engine.cases import dy_of_kind

    g = np.ones(sh.param_shape) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64)
    b = None if sh.norm == "rms" else np.zeros(sh.param_shape) if call.beta is None else \
        np.asarray(call.beta, dtype=np.float64)
    d = call.dy
    if d is None:  # made in the (rows, R) view, so that its means are per row
        d = sh.from_rows(dy_of_kind(dy or "shifted", (1, sh.rows, sh.r), seed)[0])
    return call.with_(gamma=g, beta=b, dy=np.asarray(d, dtype=np.float64))


def _policy(a: KernelAdapter, call: BNCall, sh: NormShape, mode: str, accumulate: str | None) -> Policy:
    """The policy the traced adapter ``a`` runs the family ``call`` with (its accumulator and compute format set to
    ``accumulate`` when given)."""
    caps = a.capabilities()
    if call.norm not in caps.norms:
        runs = ", ".join(NORM_NAMES[n] for n in caps.norms)
        raise BNProbeError(f"adapter {a.name} runs {runs} only, not {NORM_NAMES[call.norm]}")
    fmt = get_format(call.dtype).name
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    pf = params_format(fmt, call.params)
    prm = [None if v is None else round_to(np.asarray(v, dtype=np.float64).reshape(-1), pf)
           for v in (call.gamma, call.beta)]
    pol = a.policy(FamilyPrepared(sh, fmt, pf, round_to(call.x, fmt), *prm, call), mode)  # type: ignore[attr-defined]
    if accumulate is None:
        return pol
    acc = get_format(accumulate).name
    return pol.with_options(accumulate=acc, compute=acc)


def _run(pol: Policy, mode: str, call: BNCall, sh: NormShape) -> tuple[np.ndarray, Trace, float]:
    """One run of ``call`` (inputs rounded to their formats) under ``pol`` in ``mode``: (y, or dx for the backward;
    the trace; ε as the forward added it)."""
    f = family_forward(call.x, call.gamma, call.beta, shape=sh, eps=call.eps, policy=pol,
                       weight_offset=call.weight_offset, keep_arrays=mode == "train")
    eps_added = float(f.trace.meta.get("eps_effective", call.eps))
    if mode == "train":
        return f.y, f.trace, eps_added
    mean = None if f.mean is None else f.mean.astype(np.float64)
    b = family_backward(call.dy, call.x, call.gamma, mean, f.rstd.astype(np.float64), shape=sh, policy=pol,
                        weight_offset=call.weight_offset)
    return b.dx, b.trace, eps_added


def _eps_format(pol: Policy) -> str:
    """The format ε is rounded to before it is added: the policy's ``eps_format``, else the format of the addition."""
    return get_format(pol.eps_format or pol.rstd_format or pol.accumulate).name


def _eps_finding(eps: float, added: float, pol: Policy, lay: RowLayout, rows: np.ndarray) -> OverflowFinding | None:
    """ε lost where the kernel adds it: zero in the format it is rounded to (a subnormal ε is said in a note)."""
    if added != 0.0:
        return None
    fmt = get_format(_eps_format(pol))
    with np.errstate(all="ignore"):
        spread = np.nanvar(rows, axis=1) if lay.norm_shape.norm != "rms" else np.nanmean(rows * rows, axis=1)
    k = int(np.nanargmin(spread)) if np.isfinite(spread).any() else 0
    return OverflowFinding(
        "eps_underflow", "eps", fmt.name, tuple(range(lay.channels)), lay.channels, index_str(k, lay, False),
        input_at(k, rows, False, lay),
        f"ε = {eps:g} is 0 in {fmt.name} (below half its smallest subnormal {fmt.smallest_subnormal:.3g}): every "
        f"row's var + ε is its variance alone, and a row of equal values divides by zero (the least spread: "
        f"{spread[k]:.3g}, at {lay.row(k)})")


def _why_sum(f: OverflowFinding, rows: np.ndarray, lay: RowLayout) -> OverflowFinding:
    """An overflow of a row's sum told with that row's exact sum (float64 of the stored x, summed exactly)."""
    if f.anomaly not in ("overflow", "inf") or f.stage not in _SUMS or not f.channels:
        return f
    k = f.channels[0]
    row = rows[k]
    exact = {"x²": float(np.nanmax(row * row)), "Σx²": math.fsum(row * row), "Σx": math.fsum(row),
             "Σ(x − μ)²": math.fsum((row - math.fsum(row) / row.size) ** 2)}[_SUMS[f.stage]]
    what = "largest x²" if f.stage == "squares" else f"exact {_SUMS[f.stage]}"
    return replace(f, detail=f"{f.detail}: {lay.row(k)}'s {what} is {exact:.6g}")


def _family_remedies(f: OverflowFinding, pol: Policy, norm: str) -> list[tuple[str, dict[str, Any], float]]:
    """What is worth trying for a finding of a family kernel: BatchNorm's remedies a family kernel runs (RMSNorm
    has no variance to take otherwise), and ε added in the accumulator, rstd not rounded, where the policy does."""
    out = [(n, c, m) for n, c, m in remedies_for(f.anomaly, f.stage, pol)
           if c.get("mean_by") != "prescaled" and not (norm == "rms" and ("variance" in c or "clamp_var" in c))]
    if pol.eps_format is not None and (f.stage in ("eps", "var_eps", "rstd") or f.anomaly in ("nan", "inf")):
        out.append((f"ε added in {pol.accumulate}", {"eps_format": None}, 1.0))
    if pol.rstd_cast is not None and f.anomaly not in ("input_nonfinite",):
        out.append(("rstd not rounded", {"rstd_cast": None}, 1.0))
    if f.anomaly == "eps_underflow" and get_format(pol.accumulate).precision < 24:
        out.append(("wider accumulator (fp32)", {"accumulate": "fp32", "compute": "fp32"}, 1.0))
    return out


def _with_remedies(f: OverflowFinding, pol: Policy, mode: str, call: BNCall, sh: NormShape, gold: np.ndarray,
                   rows: np.ndarray, cancel_digits: float) -> OverflowFinding:
    """``f`` with its remedies tried: each a rerun with the policy changed, judged by whether the anomaly is gone
    (ε: whether it is still lost) and by the output's error against ``gold``."""
    if f.input_borne or f.anomaly == "input_nonfinite":
        return f
    lay = RowLayout(sh)
    tried = []
    for name, change, eps_mult in _family_remedies(f, pol, sh.norm):
        try:
            p2 = pol.with_options(**change)
            c2 = call.with_(eps=call.eps * eps_mult)
            out, tr2, added = _run(p2, mode, c2, sh)
        except BNProbeError as exc:
            tried.append(Remedy(name, str(change), False, math.nan, f"not applicable: {exc}"))
            continue
        after = locate(tr2, lay, rows, cancel_digits)
        still = ([] if _eps_finding(c2.eps, added, p2, lay, rows) is None else [f]) \
            if f.anomaly == "eps_underflow" else None
        tried.append(remedy_result(f, (name, change, eps_mult), after, out, gold, still=still))
    return replace(f, remedies=tuple(tried))


def scan_family(a: KernelAdapter, call: BNCall, *, mode: str | None, seed: int, dy: str | None,
                accumulate: str | None, cancel_digits: float, remedies: bool) -> OverflowReport:
    """The overflow scan of one family call (``call``: x, and the γ, β and dy it has, its layer, ε, format and
    parameter format) on the kernel ``a`` in ``mode`` (train, the default, or backward): see the module.  What the
    call lacks is made: γ = 1, β = 0 (none for RMSNorm), dy seeded from ``seed`` of the kind ``dy`` (a mean per
    row)."""
    name = NORM_NAMES[call.norm]
    if mode == "infer":
        raise BNProbeError(f"{name} keeps no running statistics: its inference is its training forward; scan "
                           f"{named('mode')} train or backward")
    mode = mode or "train"
    sh = NormShape.of(call.norm, np.shape(call.x), call.normalized_shape, call.groups)
    lay = RowLayout(sh)
    full = _inputs(call, sh, seed, dy)
    rows = sh.to_rows(full.x)
    modes = ("train", "backward") if mode == "backward" else ("train",)
    if not a.capabilities().staged:
        if accumulate is not None:
            raise BNProbeError(f"{named('accumulate')} sets the accumulator of an emulated kernel; {a.name} computes "
                               "in its own: drop it")
        run = run_call(a, generated_call(full, modes=modes, label="generated"), modes=(mode,), label=a.name)
        rep = scan_call(run, policy="(no trace: outputs vs the FP64 golden)")
        rep.call, rep.mode = None, mode
        rep.notes.insert(0, f"{a.name} exposes no trace: its outputs were compared with the FP64 golden on the same "
                            "rounded inputs, row by row")
        return replace(rep, layer=describe_rows(sh))
    pol = _policy(a, full, sh, mode, accumulate)
    fmt, pf = get_format(full.dtype).name, pol.params_format
    rounded = full.with_(x=round_to(full.x, fmt), dy=round_to(full.dy, fmt),
                         gamma=round_to(full.gamma, pf), beta=None if full.beta is None else round_to(full.beta, pf))
    head = family_headroom(sh.to_rows(rounded.x), pol, sh.norm, rounded.gamma, rounded.beta, full.eps)
    out, trace, added = _run(pol, mode, rounded, sh)
    head = measured(head, trace)
    stored = sh.to_rows(rounded.x)
    findings = [_why_sum(f, stored, lay) for f in locate(trace, lay, rows, cancel_digits)]
    if (e := _eps_finding(full.eps, added, pol, lay, rows)) is not None:
        findings.append(e)
    gold, _, _ = _run(get_policy("fp64"), mode, rounded, sh)
    with np.errstate(all="ignore"):
        base_err = nanmax_abs(np.asarray(out, dtype=np.float64) - gold)
    notes = [f"policy: {pol.describe()}", f"max |output - FP64 golden| = {base_err:.4g}"]
    if added != 0.0 and abs(added) < get_format(_eps_format(pol)).tiny:
        notes.append(f"ε = {full.eps:g} is added as {added:.6g}, a subnormal {_eps_format(pol)} value")
    # x − mean of a two-pass kernel is exact: the digits it "loses" are the mean's own rounding (as BatchNorm's scan)
    for f in [f for f in findings if f.anomaly == "cancellation" and f.stage != "var"]:
        findings.remove(f)
        notes.append(f"cancellation at {f.stage} ({f.format}, rows {','.join(map(str, f.channels[:8]))}"
                     f"{'...' if len(f.channels) > 8 else ''}): {f.detail}; a kernel holding the mean in {f.format} "
                     "cannot keep them, and this one's results are judged against that bound")
    if remedies:
        findings = [_with_remedies(f, pol, mode, rounded, sh, gold, rows, cancel_digits) for f in findings]
    kernel = PolicyAdapter(a.name, lambda p, m: pol, a.capabilities())
    run = run_call(kernel, generated_call(full, modes=modes), modes=(mode,), label=a.name, quiet=True)
    seen = {f.anomaly for f in findings}
    extra = [f for f in scan_call(run).findings if f.anomaly in _FROM_OUTPUTS and f.anomaly not in seen]
    if pol.variance == "naive" and sh.norm != "rms":
        extra = [replace(f, detail=f.detail.replace("variance off", "cancellation in the variance (E[x²] − E[x]²)", 1))
                 if f.anomaly == "variance_error" else f for f in extra]
    return OverflowReport(a.name, fmt, mode, pol.name, findings + extra, head, [], notes, None, layer=describe_rows(sh))

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

A recording (a :class:`~bnprobe.engine.recorded.Recorded`, given to :func:`scan` in place of the kernel) has no
trace and cannot be rerun: each call's recorded outputs are compared with the FP64 golden on the call's own
inputs — NaN/inf where the golden is finite (and finite values where it is not), values beyond the format
(overflow) or held at its maximum (saturation), outputs (channels) entirely zero or constant where the golden is
not, the running statistics' update beyond its format, a saved invstd or running_var that underflows (to zero or
to a subnormal), NaN/inf already in the inputs (input-borne) — with the headroom predicted from the recorded
input.  An msprobe statistics-only dump is read from its summaries (max/min/mean/norm per tensor).

This module is the check's entry point; its parts: ``overflow_trace`` scans a traced run, ``overflow_outputs``
what has no trace (outputs on generated inputs, recorded calls, msprobe summaries), and ``overflow_report``
holds the report types (re-exported here) and what both scanners share.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.checks.overflow.family import scan_family
from bnprobe.checks.overflow.outputs import scan_call, scan_outputs, scan_summaries
from bnprobe.checks.overflow.report import (
    ANOMALIES,
    Headroom,
    OverflowFinding,
    OverflowReport,
    predict_headroom,
)
from bnprobe.checks.overflow.trace import scan_traced
from bnprobe.engine.recorded import PerCall, Recorded, check_options, check_params, given_to, only_call
from bnprobe.engine.recorded import given as given_names  # (scan's own `given` is the call it runs)
from bnprobe.checks.overflow.observe import observed_findings
from bnprobe.engine.run import each_call, each_run, generated_call, run_call
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import modes_left_out, one_mode
from bnprobe.inputs import SEED
from bnprobe.kernels.layout import layout_of
from bnprobe.kernels.policy import Policy
from bnprobe.numerics.rounding import round_to

__all__ = ["OverflowFinding", "Headroom", "OverflowReport", "scan", "predict_headroom", "ANOMALIES"]


def _check_mode(mode: str | None) -> None:
    """``mode`` must be None (each call's own, or train) or one of train, infer and backward."""
    if mode not in (None, "train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")


def scan(
    adapter: str | KernelAdapter | Recorded = "emulated",
    x: np.ndarray | BNCall | None = None,
    *,
    dtype: str | None = None,
    accumulate: str | None = None,
    mode: str | None = None,
    seed: int | None = None,
    params: str | None = None,
    dy: str | None = None,
    cancel_digits: float = 0.75,
    remedies: bool = True,
) -> OverflowReport | PerCall:
    """Find anomalies of one BatchNorm run of ``x`` in ``dtype`` (default fp16), ``mode`` (default train),
    parameters and dy drawn from ``seed`` (default 0).  ``x`` is the input tensor, or the whole call (a
    :class:`~bnprobe.core.call.BNCall`: x with the γ, β, running statistics and dy it has, ε, momentum and layout;
    its dtype, params and training flag are not read: ``dtype``, ``params`` and ``mode`` say how it runs); ε 1e-5,
    momentum 0.1 and channels_first for a tensor alone.  What the call lacks is made: γ = 1, β = 0, the running
    statistics x's per-channel mean and variance, dy seeded of the kind ``dy`` (a kind of
    :func:`~bnprobe.engine.cases.dy_of_kind`, default ``shifted``: a mean per channel, as real losses give).
    ``accumulate`` (emulated adapters) sets the accumulator and compute format, e.g. fp16 for a naive port.
    ``cancel_digits``: flag cancellation when this share of the accumulator's decimal digits is lost.  ``params``:
    γ, β and the running and saved statistics in fp32 (default) or the input's format (same).

    A call of another layer (``x`` a BNCall whose ``norm`` is layer, rms, group or instance) is scanned row by row,
    in train or backward mode (:func:`~bnprobe.checks.overflow.family.scan_family`).

    Given a recording (a :class:`~bnprobe.engine.recorded.Recorded`) in place of the kernel, every selected call of
    it is scanned on its own recorded inputs: a :class:`~bnprobe.engine.recorded.PerCall` of one
    :class:`OverflowReport` per call (and mode).  A dump adapter of one call is scanned on its recorded inputs (its
    one report).  On a recording ``x`` (None), ``accumulate`` and ``dy`` contradict it, and ``dtype``, ``mode`` and
    ``params`` must agree."""
    _check_mode(mode)
    a, recorded = given_to(adapter)
    if recorded is not None:
        check_options(recorded, given=given_names(x=x, accumulate=accumulate, dy=dy), dtype=dtype, mode=mode,
                      params=params)
        if recorded is not adapter:
            only_call(recorded, "scan")
        run = _scan_calls(recorded, mode=mode)
        return run if recorded is adapter else run.results[0]
    check_params(params)
    asked, params = params, params or "fp32"
    if x is None:
        raise BNProbeError("scan needs an input tensor x")
    fmt = get_format(dtype or "fp16").name
    if isinstance(x, BNCall) and x.norm != "batch":  # a LayerNorm, RMSNorm, GroupNorm or InstanceNorm call
        rep = scan_family(a, x.with_(dtype=fmt, params=params), mode=mode, seed=SEED if seed is None else seed,
                          dy=dy, accumulate=accumulate, cancel_digits=cancel_digits, remedies=remedies)
        return replace(rep, params=asked)
    mode, left_out = one_mode(a.name, a.capabilities().modes, mode)  # an inference-only kernel: inference
    seed = SEED if seed is None else seed
    call = x if isinstance(x, BNCall) else BNCall(x)
    layout = call.layout
    lay = layout_of(call.x, layout)
    x_cr = lay.to_cr(call.x)
    given = _run_inputs(call, x_cr, seed, dy)
    if not a.capabilities().staged:
        if accumulate is not None:
            raise BNProbeError(f"{named('accumulate')} sets the accumulator of an emulated kernel; {a.name} computes "
                               "in its own: drop it")
        rep = scan_outputs(a, fmt, mode, given, params=params)
        rep.notes[:0] = [] if left_out is None else [left_out]
        return replace(rep, params=asked)
    xs = round_to(call.x, fmt)
    pol = _traced_policy(a, xs, fmt, mode, layout, params, accumulate)
    pf = pol.params_format
    g, b, rm, rv = (round_to(v, pf) for v in (given.gamma, given.beta, given.running_mean, given.running_var))
    rounded = replace(given, x=xs, gamma=g, beta=b, running_mean=rm, running_var=rv, dy=round_to(given.dy, fmt))
    try:
        rep = scan_traced(a.name, fmt, pol, mode, rounded, lay, x_cr, cancel_digits=cancel_digits, remedies=remedies)
    except BNProbeError as exc:
        if accumulate is None:
            raise
        # the policy is the user's: say which option made it one the kernel cannot run
        raise BNProbeError(f"{named('accumulate')} {get_format(accumulate).name}: {a.name} cannot run with its "
                           f"accumulator and compute format there: {exc}") from None
    rep.findings += _observed(a, pol, mode, given.with_(dtype=fmt, params=params))
    rep.notes[:0] = [] if left_out is None else [left_out]
    return replace(rep, params=asked)


def _observed(a: PolicyAdapter, pol: Policy, mode: str, call: BNCall) -> list[OverflowFinding]:
    """A traced kernel's observable results (saved statistics, y, dx) on ``call`` against the FP64 golden, through
    the one engine (:func:`~bnprobe.checks.overflow.observe.observed_findings`), run with the policy ``pol`` the
    trace was taken with."""
    if mode == "infer":
        return []
    kernel = PolicyAdapter(a.name, lambda p, m: pol, a.capabilities())
    modes = ("train", "backward") if mode == "backward" else ("train",)
    run = run_call(kernel, generated_call(call, modes=modes), modes=(mode,), label=a.name, quiet=True)
    name = "cancellation in the variance (E[x²] − E[x]²)" if pol.variance == "naive" else "variance off"
    return observed_findings(run, name)


def _traced_policy(a: PolicyAdapter, xs: np.ndarray, fmt: str, mode: str, layout: str, params: str,
                   accumulate: str | None) -> Policy:
    """The policy ``a`` runs ``xs`` with, its accumulator and compute format set to ``accumulate`` when given."""
    pol = a.policy_for(xs, dtype=fmt, mode=mode, layout=layout, params=params)
    if accumulate is None:
        return pol
    acc = get_format(accumulate).name
    try:
        return pol.with_options(accumulate=acc, compute=acc)
    except BNProbeError as exc:
        raise BNProbeError(f"{named('accumulate')} {acc}: {pol.name} cannot accumulate and compute in {acc} "
                           f"({exc})") from None


def _run_inputs(call: BNCall, x_cr: np.ndarray, seed: int, dy: str | None) -> BNCall:
    """``call`` (x as ``x_cr``: channel-first (C, R)) with γ, β, the running statistics and dy in float64: its own,
    or the defaults (γ = 1, β = 0, x's per-channel mean and variance, dy seeded of the kind ``dy``, default
    ``shifted``)."""
    from bnprobe.engine.cases import dy_of_kind

    channels = x_cr.shape[0]
    g = np.ones(channels) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64)
    b = np.zeros(channels) if call.beta is None else np.asarray(call.beta, dtype=np.float64)
    with np.errstate(all="ignore"):
        rm = np.nan_to_num(np.nanmean(x_cr, axis=1)) if call.running_mean is None else \
            np.asarray(call.running_mean, dtype=np.float64)
        rv = np.nan_to_num(np.nanvar(x_cr, axis=1), nan=1.0) if call.running_var is None else \
            np.asarray(call.running_var, dtype=np.float64)
    d = call.dy
    if d is None:  # made channel-first (C, R), so the means are per channel in any layout
        d = layout_of(call.x, call.layout).from_cr(dy_of_kind(dy or "shifted", (1,) + x_cr.shape, seed)[0])
    return BNCall(call.x, g, b, rm, rv, d, call.eps, call.momentum, layout=call.layout)


def _scan_calls(recorded: Recorded, *, mode: str | None = None) -> PerCall:
    """Every selected call of a recording, in forward order, one at a time: its outputs (the recorded ones,
    for a dump) against the FP64 golden on its own recorded inputs, and its inputs; ``mode`` (train, infer
    or backward) restricts the outputs to that call's.  An msprobe statistics-only dump is read from its
    summaries.  A runnable adapter on the recorded inputs is scanned with :func:`scan` (its trace), one
    report per call and mode.  One :class:`OverflowReport` per call (and mode)."""
    calls = recorded.calls
    if calls.task == "statistics":
        if not recorded.replay:
            calls.require_tensors(f"running {recorded.kernel.name} on the recorded inputs")
        reports = each_call(recorded, lambda _, c, summaries: scan_summaries(recorded.kernel.name, c, summaries, mode))
        notes = ["a statistics-only dump (max/min/mean/norm per tensor): comparing the outputs with the FP64 golden, "
                 "locating NaN/inf, constant channels, the running statistics' values and the headroom of the sums "
                 "need a tensor dump (msprobe task \"tensor\")"]
        return PerCall.of("overflow", recorded, reports, notes)
    if not recorded.replay:
        name, runs = recorded.kernel.name, recorded.kernel.capabilities().modes
        if mode is not None:
            one_mode(name, runs, mode)  # (a mode the kernel does not run is refused, in one line)
        left: dict[str, None] = {}  # the notes of the modes recorded that the kernel does not run

        def modes_of(rec: Any) -> tuple[str, ...]:
            if mode is not None:
                return (mode,)
            if (note := modes_left_out(name, runs, rec.modes)) is not None:
                left[note] = None
            return tuple(m for m in rec.modes if m in runs)

        per_call = each_call(recorded, lambda _, c, rec: [_scan_runnable(recorded.kernel, rec, m, f"{c.label} [{m}]")
                                                          for m in modes_of(rec)])
        return PerCall.of("overflow", recorded, [rep for reps in per_call for rep in reps], list(left))
    reports = each_run(recorded, lambda _, run: scan_call(run), modes=(mode,) if mode else None)
    notes = ["a recording has no trace and cannot be rerun: findings come from its outputs against the FP64 golden "
             "on the same inputs; no remedies are tried"]
    return PerCall.of("overflow", recorded, reports, notes)


def _scan_runnable(a: KernelAdapter, rec: Any, mode: str, label: str) -> OverflowReport:
    """A runnable adapter scanned on one recorded call's inputs and scalars in one of its modes."""
    ins = rec.tensors[mode]["inputs"]
    ci = rec.call()
    dy = rec.tensors.get("backward", {}).get("inputs", {}).get("dy")
    call = BNCall(ins["x"], ins.get("gamma", ci.gamma), ins.get("beta", ci.beta),
                  ins.get("running_mean", ci.running_mean), ins.get("running_var", ci.running_var), dy, rec.eps,
                  rec.momentum, layout=rec.layout, norm=ci.norm, normalized_shape=ci.normalized_shape,
                  groups=ci.groups, weight_offset=ci.weight_offset)
    rep = scan(a, call, dtype=rec.dtype, mode=mode, params=ci.params)
    rep.call = label
    return rep

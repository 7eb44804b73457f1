"""The overflow check of an adapter with a trace (bnprobe's instrumented kernels): every anomaly located at the
first stage where it appears, the headroom predicted and measured, each finding's remedies verified by
rerunning, and IEEE against saturating overflow compared when a run overflowed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.checks.overflow.report import (
    Headroom,
    OverflowFinding,
    OverflowReport,
    Remedy,
    input_at,
    index_str,
    nanmax_abs,
    predict_headroom,
)
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels import Execution, backward, forward_infer, forward_train
from bnprobe.kernels.policy import Policy
from bnprobe.kernels.trace import Trace

# a channel of an elementwise stage is flagged for subnormal/underflow results only when more than this
# share of its values (and at least ELEMENTWISE_MIN of them) are: isolated tiny values of ordinary
# data are harmless, a channel working in the subnormal range is not
ELEMENTWISE_SHARE = 0.01
ELEMENTWISE_MIN = 3


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


def locate(trace: Trace, lay: Any, x_cr: np.ndarray, cancel_digits: float) -> list[OverflowFinding]:
    """Each anomaly of ``trace`` at the first stage where it appears, with its channels (a family layer's rows:
    ``lay`` a :class:`~bnprobe.checks.overflow.report.RowLayout`, ``x_cr`` its rows), and the cancellation the
    input's statistics predict where the kernel forms E[x²] − E[x]² or x − mean (``cancel_digits`` of the format's
    decimal digits lost)."""
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
                                    int(bad.sum()), index_str(first, lay, True), input_at(first, x_cr, True, lay),
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
                                    index_str(first, lay, elementwise), input_at(first, x_cr, elementwise, lay),
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
        need = cancel_digits * digits
        shown = ""
        if where == "var" and "y" in trace:
            # E[x²] − E[x]² keeps digits − lost of the variance; y shows the loss once fewer remain than y's format
            # holds, with a digit to spare (a tenfold error): at a mean/σ of 10 in fp32, not only at 1000 (x − mean
            # of a two-pass kernel loses nothing the input's own rounding had not: that stays at cancel_digits)
            y_digits = get_format(trace["y"].format).precision * math.log10(2)
            if max(1.0, digits - y_digits) < need:
                need, shown = max(1.0, digits - y_digits), f", fewer than y's {trace['y'].format} holds: the loss shows"
        bad = np.flatnonzero(np.nan_to_num(lost) >= need)
        if bad.size:
            c = int(bad[np.argmax(lost[bad])])
            what = "E[x²] − E[x]²" if where == "var" else "x − mean"
            left = f"; {digits - lost[c]:.1f} left{shown}" if shown else ""
            findings.append(OverflowFinding("cancellation", where, fmt.name, tuple(bad.tolist()), int(bad.size),
                                    index_str(c, lay, False), input_at(c, x_cr, False, lay),
                                    f"{what} loses ~{lost[c]:.1f} of {digits:.1f} decimal digits "
                                    f"(mean²/var = {mu[c] ** 2 / var[c]:.3g}){left}"))
    return findings


# ---- remedies ---------------------------------------------------------------------------------------------

def remedies_for(anomaly: str, stage: str, pol: Policy) -> list[tuple[str, dict[str, Any], float]]:
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


def _run(policy: Policy, mode: str, inputs: BNCall) -> tuple[np.ndarray, Trace]:
    """One run of ``inputs`` with ``policy`` in ``mode``: (y, or dx for the backward; the trace)."""
    x, g, b, rm, rv, dy = inputs.x, inputs.gamma, inputs.beta, inputs.running_mean, inputs.running_var, inputs.dy
    eps, layout, momentum = inputs.eps, inputs.layout, inputs.momentum
    if mode == "train":
        r = forward_train(x, g, b, rm, rv, momentum=momentum, eps=eps, policy=policy,
                          execution=Execution(layout=layout))
        return r.y, r.trace
    if mode == "infer":
        r = forward_infer(x, g, b, rm, rv, eps=eps, policy=policy, execution=Execution(layout=layout))
        return r.y, r.trace
    f = forward_train(x, g, b, eps=eps, policy=policy, execution=Execution(layout=layout, keep_arrays=False))
    r = backward(dy, x, g, f.mean.astype(np.float64), f.invstd.astype(np.float64), policy=policy,
                 saved_var=f.var.astype(np.float64), eps=eps, execution=Execution(layout=layout))
    return r.dx, r.trace


def scan_traced(adapter: str, fmt: str, pol: Policy, mode: str, inputs: BNCall, lay: Any, x_cr: np.ndarray, *,
                cancel_digits: float, remedies: bool) -> OverflowReport:
    """A traced kernel run in ``fmt`` with ``pol`` on ``inputs`` (x, γ, β, the running statistics and dy each
    rounded to its format; ``lay`` x's layout, ``x_cr`` x channel-first (C, R)): the headroom predicted and
    measured, the anomalies located at their first stage, each one's remedies tried (``remedies``), and IEEE
    against saturating overflow compared when it overflowed."""
    head = predict_headroom(inputs.x, pol, inputs.gamma, inputs.beta, inputs.eps, inputs.layout)
    y, trace = _run(pol, mode, inputs)
    head = measured(head, trace)
    findings = locate(trace, lay, x_cr, cancel_digits)
    gold_y, _ = _run(pol.golden(), mode, inputs)
    with np.errstate(all="ignore"):
        base_err = nanmax_abs(np.asarray(y, dtype=np.float64) - gold_y)
    if remedies:
        findings = [_with_remedies(f, pol, mode, inputs, gold_y=gold_y, lay=lay, x_cr=x_cr,
                                   cancel_digits=cancel_digits) for f in findings]
    sat = []
    if pol.overflow == "ieee" and any(f.anomaly in ("overflow", "inf") for f in findings):
        sat = [_overflow_mode_run(pol, overflow, mode, inputs, gold_y) for overflow in ("ieee", "saturate")]
    notes = [f"policy: {pol.describe()}", f"max |output - FP64 golden| = {base_err:.4g}"]
    # x − mean of a two-pass (or Welford) kernel is exact: the digits it "loses" are the mean's own rounding, which
    # every kernel holding the mean in this format pays; said, and a finding only where the results show more
    # (the observable checks, against the careful bound)
    for f in [f for f in findings if f.anomaly == "cancellation" and f.stage != "var"]:
        findings.remove(f)
        notes.append(f"cancellation at {f.stage} ({f.format}, channels {','.join(map(str, f.channels[:8]))}"
                     f"{'...' if len(f.channels) > 8 else ''}): {f.detail}; a kernel holding the mean in {f.format} "
                     "cannot keep them, and this one's results are judged against that bound")
    return OverflowReport(adapter, fmt, mode, pol.name, findings, head, sat, notes)


def measured(head: list[Headroom], trace: Trace) -> list[Headroom]:
    """The predicted headroom with each traced stage's actual maximum and whether it overflowed."""
    for i, h in enumerate(head):
        if h.stage in trace:
            st = trace[h.stage]
            over = bool(st.counters["overflow"].any() or st.counters["posinf"].any() or st.counters["neginf"].any())
            head[i] = replace(h, actual_max=st.absmax, actually_overflowed=over)
    return head


def _overflow_mode_run(pol: Policy, overflow: str, mode: str, inputs: BNCall,
                       gold_y: np.ndarray) -> dict[str, Any]:
    """The run with ``pol`` in the overflow mode ``overflow`` (ieee or saturate): the share of finite outputs, the
    largest finite output and the largest error against the golden ``gold_y``."""
    y2, _ = _run(pol.with_options(overflow=overflow), mode, inputs)
    y2 = np.asarray(y2, dtype=np.float64)
    with np.errstate(all="ignore"):
        return {"overflow_mode": overflow, "finite_share": float(np.mean(np.isfinite(y2))),
                "max_abs_output": nanmax_abs(np.where(np.isfinite(y2), y2, np.nan)),
                "max_abs_error": nanmax_abs(y2 - gold_y)}


def _with_remedies(f: OverflowFinding, pol: Policy, mode: str, inputs: BNCall, *, gold_y: np.ndarray, lay: Any,
                   x_cr: np.ndarray, cancel_digits: float) -> OverflowFinding:
    """``f`` with its remedies (:func:`remedies_for`) tried: each a rerun of ``inputs`` with the policy changed,
    judged by whether the anomaly is gone and by the output's error against ``gold_y``."""
    if f.input_borne or f.anomaly == "input_nonfinite":
        return f
    tried = []
    for name, change, eps_mult in remedies_for(f.anomaly, f.stage, pol):
        try:
            p2 = pol.with_options(**change)
            y2, tr2 = _run(p2, mode, replace(inputs, eps=inputs.eps * eps_mult))
        except BNProbeError as exc:
            tried.append(Remedy(name, str(change), False, math.nan, f"not applicable: {exc}"))
            continue
        tried.append(remedy_result(f, (name, change, eps_mult), locate(tr2, lay, x_cr, cancel_digits), y2, gold_y))
    return replace(f, remedies=tuple(tried))


def remedy_result(f: OverflowFinding, remedy: tuple[str, dict[str, Any], float], after: list[OverflowFinding],
                  out: Any, gold: np.ndarray, *, still: list[OverflowFinding] | None = None) -> Remedy:
    """How one remedy (its name, its policy change, its ε multiplier) fared against ``f``: the findings of its rerun
    (``after``; ``still``: the ones that count, when the caller tells them otherwise) and its output's largest error
    against ``gold``.  Fixed: the anomaly gone and the output finite."""
    name, change, eps_mult = remedy
    if still is None:
        still = [h for h in after if h.anomaly == f.anomaly]
    if f.anomaly == "cancellation" and change.get("variance") in ("two_pass", "welford"):
        still = []  # two-pass and Welford do not form E[x²] - E[x]²: that cancellation is gone
    if change.get("clamp_var"):
        # the negative value is still formed (it is measured before the clamp); what the clamp
        # fixes is what follows from it: NaN or inf downstream
        still = [h for h in after if h.anomaly in ("nan", "inf") and not h.input_borne]
    with np.errstate(all="ignore"):
        err = nanmax_abs(np.asarray(out, dtype=np.float64) - gold)
    return Remedy(name, ", ".join(f"{k}={v}" for k, v in change.items()) or f"eps x{eps_mult:g}",
                  not still and math.isfinite(err), err, "anomaly gone" if not still else f"still at {still[0].stage}")

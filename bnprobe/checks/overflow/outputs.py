"""The overflow check of what has no trace: an adapter's outputs on generated inputs, a recorded call's outputs,
and an msprobe statistics-only call's summaries, each against the FP64 golden on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.checks.overflow.report import (
    Headroom,
    OverflowFinding,
    OverflowReport,
    RowLayout,
    describe_rows,
    family_headroom,
    index_str,
    input_at,
    nanmax_abs,
    predict_headroom,
)
from bnprobe.checks.overflow.observe import observed_findings
from bnprobe.engine.family import family_shape
from bnprobe.engine.rules import all_finite, bound_used
from bnprobe.engine.run import CallRun, forgiven, generated_call, run_call
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels import get_policy
from bnprobe.kernels.layout import layout_of
from bnprobe.numerics.rounding import round_to
from bnprobe.recordings import CallRef

ELEMENTWISE_OUTPUTS = ("y", "y_infer", "dx", "y_eval")
# per-channel outputs that are positive by nature: a zero is an underflow, a subnormal a loss of precision
POSITIVE_OUTPUTS = ("saved_invstd", "running_var", "saved_rstd")
WHERE = {"y_eval": "inference with the running statistics the training step left: "}
_INPUTS = ("x", "gamma", "beta", "running_mean", "running_var", "dy")


def scan_outputs(a: KernelAdapter, fmt: str, mode: str, inputs: BNCall, *, params: str = "fp32") -> OverflowReport:
    """An adapter without a trace on generated inputs (``inputs``, float64, not rounded; ``params`` their parameter
    format): its outputs against the FP64 golden on the same rounded inputs, exactly as a recorded call's are
    judged (:func:`scan_call`); in training also the inference the step's running statistics give (``y_eval``)."""
    modes = {"train": ("train",), "infer": ("infer",), "backward": ("backward",)}[mode]
    rec = generated_call(inputs.with_(dtype=fmt, params=params),
                         modes=("train", "backward") if mode == "backward" else modes, label="generated")
    run = run_call(a, rec, modes=modes, label=a.name, after_step=mode == "train")
    rep = scan_call(run, policy="(no trace: outputs vs the FP64 golden)")
    rep.call = None
    rep.mode = mode
    rep.notes.insert(0, f"{a.name} exposes no trace: its outputs were compared with the FP64 golden on the same "
                        "rounded inputs" + (", and the inference the step's running statistics give (y_eval)"
                                            if "y_eval" in run.got else ""))
    return rep


def _finding(anomaly: str, stage: str, fmt: str, mask: np.ndarray, *, elementwise: bool, lay: Any, x_cr: np.ndarray,
             detail: str, input_borne: bool = False) -> OverflowFinding:
    """A finding from a mask of the output (channel-first (C, R) for elementwise outputs, (C,) otherwise)."""
    per_ch = mask.reshape(mask.shape[0], -1).sum(axis=1)
    chans = np.flatnonzero(per_ch)
    first = int(np.flatnonzero(mask.reshape(-1))[0])
    return OverflowFinding(anomaly, stage, fmt, tuple(chans.tolist()), int(per_ch.sum()),
                   index_str(first, lay, elementwise), input_at(first, x_cr, elementwise, lay), detail, input_borne)


def _nothing_to_find(key: str, got: Any, gold: Any, fmt: str, lay: Any) -> bool:
    """Whether :func:`_output_findings` can find nothing, told by a few reductions of the output as it is stored:
    every value of it finite and below the format's largest, the golden within the format's range (so it rounds
    to a finite value), no zero or subnormal value where the output is positive, and no channel of one value
    (elementwise outputs; an all-zero one otherwise).  False where any might fail, or the output is not a
    float16/32/64 array: the whole check then runs."""
    a, g, f = got, np.asarray(gold, dtype=np.float64), get_format(fmt)
    if not (isinstance(a, np.ndarray) and a.dtype in (np.float16, np.float32, np.float64) and a.size
            and a.shape == g.shape and all_finite(a)):
        return False
    with np.errstate(all="ignore"):
        # (Python floats: a format's limits may not exist in the storage's dtype, fp32's largest in float16)
        if not (g.max() <= f.max and g.min() >= -f.max and float(a.max()) < f.max and float(a.min()) > -f.max):
            return False
        if key in POSITIVE_OUTPUTS and not (np.abs(a.astype(np.float64)) >= f.tiny).all():
            return False
        if key not in ELEMENTWISE_OUTPUTS:
            return not (a == 0).all()
        if a.shape != tuple(lay.shape):
            return False
        v = lay.view3(a)
        return not (v.max(axis=(0, 2)) == v.min(axis=(0, 2))).any()


def _output_findings(key: str, got: Any, gold: Any, fmt: str, lay: Any, x_cr: np.ndarray,
                     input_bad: bool, forgiven: np.ndarray | None = None) -> list[OverflowFinding]:
    """Anomalies of one output against the golden's value of it on the same inputs; ``forgiven`` (channel-first,
    elementwise outputs): the error a correct kernel may make per element where the output cancels
    (:func:`~bnprobe.engine.run.forgiven`) — a channel zero or constant within it is what compare-precision
    passes, not an anomaly."""
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
            out.append(_finding(anomaly, key, f.name, mask, elementwise=elementwise, lay=lay, x_cr=x_cr,
                                detail=WHERE.get(key, "") + detail, input_borne=borne))

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
            if forgiven is not None:  # zero beyond a correct kernel's error somewhere in the channel
                gold_nonzero &= np.any(bound_used(0.0, fin_g, forgiven, fmt) > 1, axis=1)
            ok_a = np.all(a_fin, axis=1)
            const_a = ok_a & np.all(a == a[:, :1], axis=1) & ~zero_a & (a.shape[1] > 1)
            fin = np.isfinite(gr)
            spread = np.where(fin, gr, -np.inf).max(axis=1) - np.where(fin, gr, np.inf).min(axis=1)
            varied = np.where(np.isfinite(spread), spread, 0.0) > 4 * f.eps * fin_g.max(axis=1)
            if forgiven is not None:  # the golden varies by more than a correct kernel's error
                fg_max = np.where(np.isfinite(forgiven), forgiven, 0.0).max(axis=1)
                varied &= np.where(np.isfinite(spread), spread, 0.0) > 2 * fg_max
            zero_ch, const_ch = zero_a & gold_nonzero, const_a & varied
        else:
            zero_ch = np.zeros(a.shape[0], dtype=bool)
            if np.all(a == 0) and fin_g.max(initial=0.0) >= f.tiny:
                zero_ch = fin_g >= f.tiny
            const_ch = np.zeros(a.shape[0], dtype=bool)
    if zero_ch.any():
        mask = np.broadcast_to(zero_ch[:, None], a.shape) if elementwise else zero_ch
        unit = "row" if isinstance(lay, RowLayout) else "channel"
        add("zero_output", mask & True, "entirely zero where the FP64 golden is not" +
            (f" (per {unit})" if elementwise else ""))
    if const_ch.any():
        add("constant_output", np.broadcast_to(const_ch[:, None], a.shape) & True,
            f"one value over the whole {'row' if isinstance(lay, RowLayout) else 'channel'} where the FP64 golden "
            "varies")
    return out


def _headroom(run: CallRun, x_cr: np.ndarray, notes: list[str]) -> list[Headroom]:
    """The headroom of a run call's stages predicted from its x (``x_cr``: channel-first, a family layer's rows) for
    bnprobe's preset of its format, x's and y's measured; its note appended to ``notes``."""
    rec, ci, fmt = run.recording, run.inputs, run.fmt
    head: list[Headroom] = []
    y = run.got.get("y", run.got.get("y_infer"))
    if y is not None and ci.norm != "batch":
        pol = get_policy(fmt).with_options(params=rec.params)
        head = family_headroom(x_cr, pol, ci.norm, ci.gamma, ci.beta, run.eps)
        actual = {"x": np.asarray(ci.x, dtype=np.float64), "y": np.asarray(y, dtype=np.float64)}
        head = [replace(h, actual_max=nanmax_abs(np.where(np.isfinite(actual[h.stage]), actual[h.stage], np.nan)),
                        actually_overflowed=bool(np.isinf(actual[h.stage]).any())) if h.stage in actual else h
                for h in head]
        notes.append(f"headroom of the sums is predicted for bnprobe's {fmt} preset ({pol.describe()}): the "
                     "kernel's intermediates are not seen")
    elif y is not None:
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
                head[i] = replace(h, actual_max=nanmax_abs(np.where(np.isfinite(v), v, np.nan)),
                                  actually_overflowed=bool(np.isinf(v).any()))
        notes.append(f"headroom of the sums is predicted for bnprobe's {fmt} preset ({pol.describe()}): the "
                     "kernel's intermediates are not seen")
    return head


def scan_call(run: CallRun, policy: str = "(recorded outputs vs the FP64 golden)") -> OverflowReport:
    """One run call's outputs against the FP64 golden on its own inputs, and its inputs; the headroom predicted
    from its x (``policy`` is what the report names as the policy)."""
    rec, ci, fmt = run.recording, run.inputs, run.fmt
    family = ci.norm != "batch"
    lay = RowLayout(family_shape(ci)) if family else layout_of(ci.x, rec.layout)
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
        if family and not elementwise:  # γ, β of a family layer: per parameter, not per row
            if m.any():
                bad_inputs.append(name)
                k = int(np.flatnonzero(m.reshape(-1))[0])
                findings.append(OverflowFinding("input_nonfinite", name, rec.params, (), int(m.sum()),
                                                f"{name} index {k}", f"{name} = {np.asarray(v).reshape(-1)[k]}",
                                                "NaN/inf present in the input itself: input-borne, not a kernel fault",
                                                True))
            continue
        if m.any():
            bad_inputs.append(name)
            vf = rec.params if not elementwise else fmt
            findings.append(_finding("input_nonfinite", name, vf, m, elementwise=elementwise, lay=lay, x_cr=x_cr,
                                     detail="NaN/inf present in the input itself: input-borne, not a kernel fault",
                                     input_borne=True))
    got_, gold_, formats_ = run.invstd_view()
    for key, got in got_.items():
        if _nothing_to_find(key, got, gold_[key], formats_[key], lay):
            continue
        if family and key in ("dgamma", "dbeta"):
            findings += _parameter_findings(key, got, gold_[key], formats_[key], bool(bad_inputs))
            continue
        fg = _family_forgiven(run, key) if family else forgiven(run, key)
        fg = None if fg is None else lay.to_cr(np.broadcast_to(fg, np.shape(ci.x)))
        findings += _output_findings(key, got, gold_[key], formats_[key], lay, x_cr, bool(bad_inputs), fg)
    if not bad_inputs:
        findings += observed_findings(run)
    notes = list(run.notes)
    for key in ("running_mean", "running_var"):
        if key in run.gold and key not in run.got:
            g = run.gold[key]
            with np.errstate(all="ignore"):
                over = np.isfinite(g) & ~np.isfinite(round_to(g, rec.params))
            if over.any():
                findings.append(_finding("overflow", key, rec.params, over, elementwise=False, lay=lay, x_cr=x_cr,
                                         detail=f"(not in the recording) the FP64 update is beyond the {rec.params} "
                                         "maximum: the kernel's running statistic cannot be finite",
                                         input_borne=bool(bad_inputs)))
    head = _headroom(run, x_cr, notes)
    layer = None
    if family:
        layer = describe_rows(lay.norm_shape)
    return OverflowReport(run.kernel, fmt, "+".join(run.modes), policy, findings,
                          head, [], notes, run.label, layer=layer)


def _family_forgiven(run: CallRun, key: str) -> np.ndarray | None:
    """:func:`~bnprobe.engine.run.forgiven` of a family call: y's as it is; dx's per row (its natural scale and
    bound are a row's), as an x-shaped array."""
    if key != "dx":
        return forgiven(run, key)
    if run.fmt not in ("fp16", "bf16", "fp32") or "dx" not in run.scales:
        return None
    from bnprobe.core.tolerances import SMALL_VALUE_ULPS, accumulation_format
    from bnprobe.engine.family import per_row_element

    u = SMALL_VALUE_ULPS * get_format(accumulation_format(run.fmt)).unit_roundoff
    b = run.bounds.get("dx")
    per_row = u * run.scales["dx"] if b is None else np.maximum(u * run.scales["dx"], np.nan_to_num(b[0]))
    return per_row_element(run.inputs, per_row)


def _parameter_findings(key: str, got: Any, gold: Any, fmt: str, input_bad: bool) -> list[OverflowFinding]:
    """A family layer's dγ or dβ (per parameter): NaN/inf where the FP64 golden is finite, or the other way round,
    and values beyond the format."""
    a, g = np.asarray(got, dtype=np.float64).reshape(-1), np.asarray(gold, dtype=np.float64).reshape(-1)
    f = get_format(fmt)
    with np.errstate(all="ignore"):
        gr = round_to(g, fmt)
        checks = (("nan", np.isfinite(gr) & np.isnan(a), "NaN where the FP64 golden is finite", False),
                  ("inf", np.isfinite(gr) & np.isinf(a), "±inf where the FP64 golden is finite", False),
                  ("overflow", np.isfinite(g) & ~np.isfinite(gr) & ~np.isfinite(a),
                   f"the exact value is beyond the {f.name} maximum {f.max:.6g}: the format cannot hold it", False),
                  ("hidden_nonfinite", ~np.isfinite(g) & np.isfinite(a), "finite where the FP64 golden is NaN/inf",
                   False),
                  ("nan" if np.isnan(a[~np.isfinite(g)]).any() else "inf", ~np.isfinite(g) & ~np.isfinite(a),
                   "NaN/inf as the FP64 golden has them" + (" (follows from NaN/inf in the input)" if input_bad
                                                            else ""), input_bad))
    out = []
    for anomaly, mask, detail, borne in checks:
        if mask.any():
            k = int(np.flatnonzero(mask)[0])
            out.append(OverflowFinding(anomaly, key, f.name, (), int(mask.sum()), f"{key} index {k}",
                                       f"{key} = {a[k]:.6g}, golden {g[k]:.6g}", detail, borne))
    return out


def scan_summaries(adapter: str, call: CallRef, summaries: dict[str, dict[str, Any]],
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

"""Stage-by-stage comparison of an emulated run against its FP64 golden on the same rounded inputs
(generated ones, or a recorded call's own inputs and scalars: :func:`trace_run` given a recording) — of a BatchNorm
call, or of a call of one of its siblings (LayerNorm, RMSNorm, GroupNorm, InstanceNorm: :mod:`bnprobe.kernels.norms`'
stages, per row of statistics, and those shaped as γ)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM, NORM_NAMES, BNCall
from bnprobe.adapters.base import MODES, params_format
from bnprobe.core.errors import BNProbeError, named
from bnprobe.engine.recorded import Recorded, require_one
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import one_value_per_row
from bnprobe.kernels import Execution, backward, forward_infer, forward_train, get_policy
from bnprobe.kernels.norms import backward as family_backward
from bnprobe.kernels.norms import check_family_policy
from bnprobe.kernels.norms import forward as family_forward
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.policy import Policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.rounding import is_representable, round_to

__all__ = ["StageError", "TraceComparison", "stage_errors", "trace_run", "MODES", "FAMILY_MODES"]

#: the modes a family layer is traced in: it keeps no running statistics, so its inference is its training forward
FAMILY_MODES = ("train", "backward")


@dataclass(frozen=True)
class StageError:
    """Error of one stage against the golden's stage of the same name (NaN where not comparable)."""

    stage: str
    format: str
    kind: str
    size: int
    vmin: float
    vmax: float
    max_abs_err: float
    max_rel_err: float
    max_ulp_err: float
    mismatched_nonfinite: int
    anomalies: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["min"], d["max"] = d.pop("vmin"), d.pop("vmax")
        return d


@dataclass(frozen=True)
class TraceComparison:
    policy: Policy
    mode: str
    shape: tuple[int, ...]
    meta: dict[str, Any]
    rows: list[StageError] = field(default_factory=list)
    trace: Trace | None = None
    golden: Trace | None = None
    eps: float = EPS  # the scalars the layer ran with (a report states them)
    momentum: float | None = MOMENTUM
    layer: NormShape | None = None  # a family layer's: where its statistics and parameters sit (None: BatchNorm)
    weight_offset: float = 0.0  # a family layer's γ offset (γ applied as offset + w)
    param_trace: Trace | None = None  # a family layer's stages shaped as γ (γ's offset, dγ, dβ), the run's
    golden_params: Trace | None = None  # and the golden's

    def to_dict(self) -> dict[str, Any]:
        out = {"policy": self.policy.name, "policy_detail": self.policy.to_dict(), "mode": self.mode,
               "shape": list(self.shape), "meta": self.meta, "stages": [r.to_dict() for r in self.rows]}
        if self.layer is not None:
            sh = self.layer
            out.update(norm=sh.norm, normalized_shape=list(sh.normalized) if sh.norm in ("layer", "rms") else None,
                       groups=sh.groups if sh.norm == "group" else None, weight_offset=self.weight_offset,
                       rows=sh.rows, r=sh.r)
        return out


def _errors(a: np.ndarray, g: np.ndarray, fmt: str) -> tuple[float, float, float, int]:
    f = get_format(fmt)
    with np.errstate(all="ignore"):
        fa, fg = np.isfinite(a), np.isfinite(g)
        mismatch = int(np.sum(fa != fg) + np.sum(~fa & ~fg & ~((a == g) | (np.isnan(a) & np.isnan(g)))))
        both = fa & fg
        if not both.any():
            return float("nan"), float("nan"), float("nan"), mismatch
        d = np.abs(a[both] - g[both])
        gb = np.abs(g[both])
        nz = gb > 0
        rel = float(np.max(d[nz] / gb[nz])) if nz.any() else (0.0 if not d.any() else float("inf"))
        ulp = float(np.max(d / f.ulp(g[both])))
        return float(d.max()), rel, ulp, mismatch


def stage_errors(trace: Trace, golden: Trace, kinds: tuple[str, str] = ("element", "channel")) -> list[StageError]:
    """Per stage of ``trace``: range, anomalies, and the error against ``golden``'s stage of the same name; its kind
    ``kinds[0]`` for an elementwise stage, ``kinds[1]`` for the others (BatchNorm's per channel)."""
    rows = []
    for s in trace:
        abs_e = rel_e = ulp_e = float("nan")
        mism = 0
        if s.name in golden and s.value is not None:
            gs = golden[s.name]
            if gs.value is not None and gs.value.shape == s.value.shape:
                abs_e, rel_e, ulp_e, mism = _errors(s.value, gs.value, s.format)
        rows.append(StageError(s.name, s.format, kinds[0] if s.elementwise else kinds[1], s.size,
                               s.vmin, s.vmax, abs_e, rel_e, ulp_e, mism, s.anomalies))
    return rows


def trace_run(x: np.ndarray | BNCall | Recorded, *, policy: str | Policy | None = None, mode: str | None = None,
              params: str | None = None) -> TraceComparison:
    """Run one BatchNorm layer (or the call's LayerNorm, RMSNorm, GroupNorm or InstanceNorm: its ``norm``) under
    ``policy`` (default fp16) and under its FP64 golden on the same rounded inputs, in ``mode`` (default train).
    ``x`` is the input tensor (γ, β, the running statistics and dy none, ε 1e-5, momentum 0.1, channels_first), or
    the whole call (a :class:`~bnprobe.core.call.BNCall`: x with its γ, β, running statistics and dy, ε, momentum —
    None a cumulative average — and layout; its dtype, params and training flag are not read: ``policy``,
    ``params`` and ``mode`` say how it runs).

    The inputs are first rounded to the policy's storage (x, dy) and params
    formats; the golden (same algorithm, every format fp64) sees exactly those
    values, so the errors reported are the kernel's own.  ``params`` (fp32 or
    same) sets the params format of the policy (default: the policy's own).

    Given a recording of one call (a :class:`~bnprobe.engine.recorded.Recorded`, e.g.
    :func:`~bnprobe.engine.recorded.one_call`) in place of x, that call is traced on its own inputs and scalars
    (x, γ, β, running statistics, dy, eps, momentum, layout; the recording's kernel is not run: a trace is of a
    policy) under ``policy`` — default: the preset of the recorded format with the recorded parameter format — in
    ``mode`` (default: the call's own).  A policy that would round the recorded inputs, a mode the call did not
    record, or ``params`` (same or fp32) other than the recorded parameter format, contradict it.

    A call of a family layer (``call.norm`` layer, rms, group or instance, with its normalised shape, groups and γ's
    offset; γ and β of its parameter shape, none for its running statistics) is traced by
    :mod:`bnprobe.kernels.norms` in ``mode`` train or backward (:data:`FAMILY_MODES`: its inference is its training
    forward): the stages per row of statistics (kind ``row``) and those shaped as γ (``param``: γ's offset, dγ,
    dβ)."""
    if isinstance(x, Recorded):
        return _trace_call(x, policy=policy, mode=mode, params=params)
    call = x if isinstance(x, BNCall) else BNCall(x)
    if call.norm != "batch":
        return _trace_family(call, policy=policy, mode=mode, params=params)
    pol = get_policy("fp16" if policy is None else policy)
    mode, eps, momentum, layout = mode or "train", call.eps, call.momentum, call.layout
    if params is not None:
        pol = pol.with_options(params=params_format(pol.storage, params))
    if mode not in MODES:
        raise BNProbeError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    gold = pol.golden()
    with np.errstate(all="ignore"):
        xs = round_to(call.x, pol.storage)
        rp = lambda v: None if v is None else round_to(np.asarray(v, dtype=np.float64), pol.params_format)  # noqa: E731
        g, b, rm, rv = rp(call.gamma), rp(call.beta), rp(call.running_mean), rp(call.running_var)
    common = dict(eps=eps, execution=Execution(layout=layout))
    if mode == "train":
        res = forward_train(xs, g, b, rm, rv, momentum=momentum, policy=pol, **common)
        ref = forward_train(xs, g, b, rm, rv, momentum=momentum, policy=gold, **common)
    elif mode == "infer":
        res = forward_infer(xs, g, b, rm, rv, policy=pol, **common)
        ref = forward_infer(xs, g, b, rm, rv, policy=gold, **common)
    else:
        fw = forward_train(xs, g, b, policy=pol, eps=eps, execution=Execution(layout=layout, keep_arrays=False))
        mean = fw.mean.astype(np.float64)
        invstd = fw.invstd.astype(np.float64)
        var = fw.var.astype(np.float64)
        dys = round_to(call.dy if call.dy is not None else np.zeros_like(xs), pol.storage)
        res = backward(dys, xs, g, mean, invstd, policy=pol, saved_var=var, **common)
        ref = backward(dys, xs, g, mean, invstd, policy=gold, saved_var=var, **common)
    meta = dict(res.trace.meta)
    meta.pop("policy_detail", None)
    return TraceComparison(policy=pol, mode=mode, shape=tuple(np.shape(call.x)), meta=meta,
                           rows=stage_errors(res.trace, ref.trace), trace=res.trace, golden=ref.trace, eps=eps,
                           momentum=momentum)


def _trace_call(recorded: Recorded, *, policy: str | Policy | None, mode: str | None,
                params: str | None) -> TraceComparison:
    """The one call of ``recorded`` traced on its own inputs and scalars (see :func:`trace_run`)."""
    c = require_one(recorded.calls, "trace")
    rec = c.load()
    name = c.label or str(rec.meta.get("call") or rec.source or "the recorded call")
    fmt = rec.dtype
    if params is not None and params != rec.params_mode:
        raise BNProbeError(f"{named('params')} {params} contradicts the recording: {name} was recorded with "
                           f"{rec.params} parameters in {fmt} ({rec.params_mode})")
    pol = get_policy(policy) if policy is not None else get_policy(fmt).with_options(params=rec.params)
    if pol.storage != fmt:
        raise BNProbeError(f"policy {pol.name} stores {pol.storage}, but {name} was recorded in {fmt}: its inputs "
                           f"would be rounded; give a {fmt} policy (or leave {named('policy')} out)")
    ci = rec.call()
    for key in ("gamma", "beta", "running_mean", "running_var"):
        v = getattr(ci, key)
        if v is not None and not is_representable(np.asarray(v, dtype=np.float64), pol.params_format).all():
            raise BNProbeError(f"policy {pol.name} keeps parameters in {pol.params_format}, but {name}'s {key} is "
                               f"{rec.params}: it would be rounded; give a policy with params={rec.params}")
    if ci.norm != "batch":  # a family layer's call: its forward's inputs, and dy where its backward is traced
        mode = mode or "train"
        if mode == "backward" and "backward" not in rec.tensors:
            raise BNProbeError(f"{named('mode')} backward contradicts the recording: {name} has no backward (it "
                               f"recorded {', '.join(rec.modes)})")
        src = rec.tensors[next(m for m in ("train", "infer", "backward") if m in rec.tensors)]["inputs"]
        dy = rec.tensors["backward"]["inputs"]["dy"] if mode == "backward" else None
        return trace_run(ci.with_(x=src["x"], gamma=src.get("gamma", ci.gamma), beta=src.get("beta", ci.beta),
                                  running_mean=None, running_var=None, dy=dy), policy=pol, mode=mode)
    mode = mode or ("train" if rec.training else "infer")
    if mode not in MODES:
        raise BNProbeError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if mode == "backward" and not ("backward" in rec.tensors and rec.training):
        raise BNProbeError(f"{named('mode')} backward contradicts the recording: {name} has no training-mode backward "
                           f"(it recorded {', '.join(rec.modes)})")
    if mode != "backward" and mode not in rec.tensors:
        raise BNProbeError(f"{named('mode')} {mode} contradicts the recording: {name} recorded no {mode} call (it "
                           f"recorded {', '.join(rec.modes)})")
    src = rec.tensors["infer" if mode == "infer" else ("train" if "train" in rec.tensors else "backward")]["inputs"]
    dy = rec.tensors["backward"]["inputs"]["dy"] if mode == "backward" else None
    return trace_run(BNCall(src["x"], src.get("gamma", ci.gamma), src.get("beta", ci.beta), src.get("running_mean"),
                            src.get("running_var"), dy, eps=rec.eps, momentum=rec.momentum, layout=rec.layout),
                     policy=pol, mode=mode)


def _trace_family(call: BNCall, *, policy: str | Policy | None, mode: str | None, params: str | None
                  ) -> TraceComparison:
    """A family layer's call traced under ``policy`` and its FP64 golden on the same rounded inputs (see
    :func:`trace_run`)."""
    name = NORM_NAMES.get(call.norm, call.norm)
    mode = mode or "train"
    if mode == "infer":
        raise BNProbeError(f"{named('mode')} infer: {name} keeps no running statistics, so its inference is its "
                           f"training forward: give {' or '.join(FAMILY_MODES)}", field="mode")
    if mode not in FAMILY_MODES:
        raise BNProbeError(f"unknown mode {mode!r}; valid: {', '.join(FAMILY_MODES)} ({name})")
    if call.running_mean is not None or call.running_var is not None:
        raise BNProbeError(f"{name} keeps no running statistics: give none")
    if call.layout != "channels_first":
        raise BNProbeError(f"{name} takes x as it is laid out (layout channels_first), not {call.layout}",
                           field="layout")
    if call.norm == "rms" and call.beta is not None:
        raise BNProbeError("RMSNorm has no β (bias): give none")
    sh = NormShape.of(call.norm, np.shape(call.x), call.normalized_shape, call.groups)
    if sh.r < 2 and mode == "backward":
        raise BNProbeError(one_value_per_row(name, sh.shape, "'s backward"))
    pol = check_family_policy(get_policy("fp16" if policy is None else policy))
    if params is not None:
        pol = pol.with_options(params=params_format(pol.storage, params))
    gold = pol.golden()
    with np.errstate(all="ignore"):
        xs = round_to(np.asarray(call.x, dtype=np.float64), pol.storage)
        rp = lambda v: None if v is None else round_to(np.asarray(v, dtype=np.float64), pol.params_format)  # noqa: E731
        g, b = rp(call.gamma), rp(call.beta)
    common = dict(shape=sh, eps=call.eps, weight_offset=call.weight_offset)
    # (the backward's statistics alone are read of its forward: no arrays kept)
    fw = family_forward(xs, g, b, policy=pol, keep_arrays=mode == "train", **common)
    if mode == "train":
        res, ref = fw, family_forward(xs, g, b, policy=gold, **common)
    else:
        # both backwards from the statistics the policy's forward saved, as a kernel's backward reads them
        dys = round_to(np.asarray(call.dy if call.dy is not None else np.zeros_like(xs), dtype=np.float64),
                       pol.storage)
        grads = dict(shape=sh, weight_offset=call.weight_offset)
        res = family_backward(dys, xs, g, fw.mean, fw.rstd, policy=pol, **grads)
        ref = family_backward(dys, xs, g, fw.mean, fw.rstd, policy=gold, **grads)
    meta = {**res.trace.meta, "eps_effective": fw.trace.meta["eps_effective"]}  # (ε as the forward added it)
    meta.pop("policy_detail", None)
    rows = stage_errors(res.trace, ref.trace, ("element", "row")) + \
        stage_errors(res.param_trace, ref.param_trace, ("param", "param"))
    return TraceComparison(policy=pol, mode=mode, shape=sh.shape, meta=meta, rows=rows, trace=res.trace,
                           golden=ref.trace, eps=call.eps, momentum=None, layer=sh, weight_offset=call.weight_offset,
                           param_trace=res.param_trace, golden_params=ref.param_trace)

"""Checks over the BatchNorm calls of a recording, each call on its own recorded inputs and scalars.

A recording (the ``dump:DIR`` adapter, or ``--input DIR`` with a runnable adapter) holds calls made
with their own x, γ, β, running statistics, eps, momentum, training flag, parameter format and dy.
Each call is loaded, run through the kernel under test (the recording replayed, or a runnable adapter
on the recorded inputs) and through the FP64 golden on exactly those inputs, checked and dropped:
memory stays bounded by one call.  Options that describe generated input contradict a recording;
:func:`check_options` rejects them before any work.
"""

from __future__ import annotations

import math

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.adapters import ForwardOutput, KernelAdapter, Saved, get_adapter
from bnprobe.adapters.base import PARAM_PRECISIONS, counters_only, params_format
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.kernels.layout import Layout, layout_of
from bnprobe.recordings import CALLS_NAME, META_NAME, CallRef, RecordedCalls, Recording, open_dump

__all__ = ["Recorded", "CallRun", "PerCall", "recording_of", "is_dump_path", "check_options", "check_params", "runs",
           "run_call", "generated_call", "given", "refuse", "one_call", "OUTPUT_MODE"]

# each output a check can judge, and the mode whose call returns it
OUTPUT_MODE = {"y_train": "train", "saved_mean": "train", "saved_invstd": "train", "running_mean": "train",
               "running_var": "train", "y_infer": "infer", "dx": "backward", "dgamma": "backward",
               "dbeta": "backward", "y_eval": "train"}


@dataclass(frozen=True)
class Recorded:
    """What a check runs over: the kernel under test and the recorded calls that give its inputs."""

    kernel: KernelAdapter
    calls: RecordedCalls

    @property
    def replay(self) -> bool:
        """True when the kernel is the recording itself (its outputs are the recorded ones)."""
        return isinstance(self.kernel, DumpAdapter)


def is_dump_path(path: str | Path) -> bool:
    """Whether ``--input`` names a dump (a folder, ``DIR#NAME``, or a dump's JSON) rather than a tensor file."""
    head = Path(str(path).partition("#")[0])
    return head.is_dir() or head.name in (META_NAME, CALLS_NAME, "dump.json")


def require_calls(command: str, calls: list[CallRef]) -> None:
    """Refuse ``command`` over recorded ``calls`` when its largest call (they are loaded one at a time) would not
    fit in memory (:mod:`bnprobe.guard`); nothing is loaded."""
    from bnprobe.guard import require_run

    biggest = max(calls, key=lambda c: math.prod(c.shape), default=None)
    if biggest is not None:
        require_run(command, tuple(biggest.shape), f"{command} on {biggest.label} (shape {tuple(biggest.shape)})")


def recording_of(adapter: str | KernelAdapter, input: str | Path | None = None,
                 calls: str | None = None, guard: str | None = None) -> Recorded | None:
    """The recording a command runs over: ``adapter`` when it is a dump, or the dump ``input`` names (with
    a runnable adapter); ``calls`` selects calls by glob.  None when neither is a recording.  With ``guard`` (a
    command of :data:`bnprobe.guard.PER_ELEMENT`) refused when that command would not fit (:func:`require_calls`)."""
    a = get_adapter(adapter) if isinstance(adapter, str) else adapter
    dump_input = input is not None and is_dump_path(input)
    if isinstance(a, DumpAdapter):
        if input is not None:
            raise BNProbeError(f"--input and the dump adapter {a.name} both give the inputs: a dump runs on its own "
                               "recorded inputs; drop --input")
        found = Recorded(a, a.calls.select(calls))
    elif dump_input:
        found = Recorded(a, open_dump(input, calls))  # type: ignore[arg-type]
    elif calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    else:
        return None
    if guard is not None:
        require_calls(guard, found.calls.calls)
    return found


def given(**options: Any) -> tuple[str, ...]:
    """The command-line names (``--shape``, ...) of the options that were given (not None)."""
    return tuple(f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None)


def one_call(spec: str | Path, calls: str | None = None, what: str = "this command",
             guard: str | None = None) -> tuple[CallRef, Recording]:
    """The one recorded call a dump (``DIR``, ``DIR#NAME``; ``calls`` a glob) selects, loaded; with ``guard`` (a
    command of :data:`bnprobe.guard.PER_ELEMENT`) refused before loading when that command would not fit."""
    found = open_dump(spec, calls)
    found.require_tensors(what)
    if len(found.calls) != 1:
        shown = ", ".join(c.label for c in found.calls[:4]) + (", ..." if len(found.calls) > 4 else "")
        raise BNProbeError(f"{found.source} holds {len(found.calls)} BatchNorm calls ({shown}); {what} takes one: "
                           "select it with DIR#NAME or --calls")
    c = found.calls[0]
    if guard is not None:
        require_calls(guard, [c])
    return c, c.load()


def refuse(names: tuple[str, ...], source: str) -> None:
    """Options of generated input (``names``, as given) contradict a recording: a one-line error naming them."""
    if names:
        raise BNProbeError(f"{', '.join(names)} contradict{'s' if len(names) == 1 else ''} the recording {source}: "
                           "its calls bring their own inputs and scalars")


def check_params(params: str | None) -> None:
    """``params`` must be None (a recording's own, or fp32) or one of ``fp32`` and ``same``."""
    if params is not None and params not in PARAM_PRECISIONS:
        raise BNProbeError(f"--params takes {' or '.join(PARAM_PRECISIONS)}, got {params!r}")


def check_options(recorded: Recorded, *, given: tuple[str, ...] = (), dtype: str | None = None,
                  mode: str | None = None, params: str | None = None) -> None:
    """Refuse, before any work, options that contradict the recording: ``given`` names options of generated
    input that were set; ``dtype`` must be every selected call's format; ``mode`` one every call recorded;
    ``params`` (same or fp32) every call's parameter format."""
    refuse(given, recorded.calls.source)
    check_params(params)
    calls = recorded.calls.calls
    if params is not None:
        for c in calls:
            rec = c.load()
            if isinstance(rec, Recording) and rec.params_mode != params:
                raise BNProbeError(f"--params {params} contradicts the recording: {c.label} was recorded with "
                                   f"{rec.params} parameters in {rec.dtype} ({rec.params_mode})")
    if dtype is not None:
        fmt = get_format(dtype).name
        off = [c for c in calls if c.dtype != fmt]
        if off:
            more = f" (and {len(off) - 1} more)" if len(off) > 1 else ""
            raise BNProbeError(f"--dtype {fmt} contradicts the recording: {off[0].label} was recorded in "
                               f"{off[0].dtype}{more}; select calls with --calls")
    if not recorded.replay:
        runs_ = recorded.kernel.capabilities().formats
        off = [c for c in calls if c.dtype not in runs_]
        if off:
            raise BNProbeError(f"adapter {recorded.kernel.name} does not run {off[0].dtype} (it runs "
                               f"{', '.join(runs_)}), the format of recorded call {off[0].label}")
    if mode is not None:
        for c in calls:
            why = ("was recorded in eval mode" if mode == "train" and not c.training else
                   "has no recorded backward" if mode == "backward" and not c.has_backward else "")
            if mode == "infer" and c.training:  # a bnprobe dump may hold a training call's inference too
                has_infer = recorded.calls.kind != "msprobe" and "infer" in getattr(c.load(), "tensors", {})
                why = "" if has_infer else "was recorded in training mode (no inference call)"
            if why:
                raise BNProbeError(f"--mode {mode} contradicts the recording: {c.label} {why}; leave --mode out "
                                   "to check what each call recorded, or select calls with --calls")


@dataclass
class CallRun:
    """One recorded call through the kernel under test and through the FP64 golden, on the recorded inputs.

    ``got`` and ``gold`` map the outputs (names of :data:`OUTPUT_MODE`) to arrays: the kernel's in the
    dtype it returned them in, the golden's in float64 (``gold`` may also hold the running statistics'
    update that a recording lacks).  ``scales`` holds, per channel, the natural magnitude of the outputs
    that can cancel to near zero (what they are formed from)."""

    index: int
    label: str
    kernel: str
    recording: Recording  # the call as recorded: its inputs, scalars, formats and outputs
    modes: tuple[str, ...]
    got: dict[str, np.ndarray] = field(default_factory=dict)
    gold: dict[str, np.ndarray] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # the format each output was returned in
    gold_saved: Saved | None = None  # the golden's statistics of a training call (its batch mean and variance)
    scales: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def fmt(self) -> str:
        return self.recording.dtype

    @property
    def eps(self) -> float:
        return self.recording.eps

    @property
    def inputs(self) -> dict[str, Any]:
        """The recorded inputs and scalars (``Recording.call_inputs``)."""
        return self.recording.call_inputs()

    def put(self, key: str, got: Any, gold: Any, fmt: str) -> None:
        """Keep an output of both; ``fmt`` is the format it was returned in unless its dtype says otherwise."""
        dt = np.asarray(got).dtype
        self.got[key], self.gold[key] = got, np.asarray(gold, dtype=np.float64)
        self.formats[key] = fmt if dt == np.float64 else get_format(dt).name


def generated_call(x: np.ndarray, *, gamma: np.ndarray | None, beta: np.ndarray | None, running_mean: np.ndarray,
                   running_var: np.ndarray, dy: np.ndarray | None, dtype: str, params: str = "fp32", eps: float = 1e-5,
                   momentum: float | None = 0.1, layout: str = "channels_first",
                   modes: tuple[str, ...] = ("train", "infer", "backward"), label: str = "generated",
                   meta: dict[str, Any] | None = None) -> Recording:
    """Generated inputs as a call without outputs, each tensor rounded to its format (x, dy to ``dtype``; γ, β
    and the running statistics to the ``params`` format): what :func:`run_call` runs a kernel and the golden
    on, as it runs a recorded call.  ``modes`` with ``backward`` is a training call (it needs ``dy``)."""
    from bnprobe.numerics.rounding import round_to

    fmt = get_format(dtype).name
    pf = params_format(fmt, params)
    c = layout_of(x, layout).channels
    with np.errstate(all="ignore"):
        vec = {k: round_to(np.full(c, d) if v is None else np.asarray(v, dtype=np.float64), pf)
               for k, v, d in (("gamma", gamma, 1.0), ("beta", beta, 0.0), ("running_mean", running_mean, 0.0),
                               ("running_var", running_var, 1.0))}
        xs = round_to(np.asarray(x, dtype=np.float64), fmt)
    training = "train" in modes or "backward" in modes
    rec = Recording(label, fmt, pf, layout, eps, momentum, None,
                    meta={**(meta or {}), "training": training, "call": label})
    for mode in modes:
        if mode == "backward":
            if dy is None:
                raise BNProbeError("a backward call needs dy")
            named = {"dy": round_to(np.asarray(dy, dtype=np.float64), fmt), "x": xs, "gamma": vec["gamma"]}
        else:
            named = {"x": xs, **vec}
        rec.tensors[mode] = {"inputs": named, "outputs": {}}
        rec.formats.update({f"{mode}.inputs.{k}": fmt if k in ("x", "dy") else pf for k in named})
    return rec


@dataclass(frozen=True)
class _Call:
    """What every part of one call's run shares: the kernel (a dump bound to the call), the golden, the call with its
    recorded inputs and scalars, the keywords of every kernel call and the formats the outputs are returned in."""

    kernel: KernelAdapter
    ref: KernelAdapter
    rec: Recording
    ci: dict[str, Any]  # rec.call_inputs()
    eps: float
    momentum: float | None
    training: bool
    common: dict[str, Any]  # dtype, eps, layout and params of every kernel call
    out_fmt: str  # y and dx (the reference returns float64 values)
    vec_fmt: str  # the running statistics, dγ and dβ

    def kernel_train(self, ins: dict[str, Any]) -> ForwardOutput:
        """The kernel's training step on the inputs ``ins`` (x, and γ, β, running statistics where given)."""
        return self.kernel.forward_train(ins["x"], ins.get("gamma"), ins.get("beta"), ins.get("running_mean"),
                                         ins.get("running_var"), momentum=self.momentum, **self.common)


def _call_of(kernel: KernelAdapter, ref: KernelAdapter, rec: Recording) -> _Call:
    """The shared setting of one call's run with ``kernel`` (already bound to the call)."""
    ci = rec.call_inputs()
    out_fmt = kernel.capabilities().output or rec.dtype
    vec_fmt = "fp64" if kernel.capabilities().output == "fp64" else rec.params
    eps, mom, training = rec.eps, rec.momentum, rec.training
    common: dict[str, Any] = dict(dtype=rec.dtype, eps=eps, layout=rec.layout, params=ci["params"])
    return _Call(kernel, ref, rec, ci, eps, mom, training, common, out_fmt, vec_fmt)


def _wanted_modes(rec: Recording, modes: tuple[str, ...] | None, skip_missing: bool, name: str) -> tuple[str, ...]:
    """The modes to run: ``modes`` (default every mode the call recorded); one it did not record is an error, or
    with ``skip_missing`` left out."""
    wanted = rec.modes if modes is None else tuple(modes)
    if skip_missing:
        return tuple(m for m in wanted if m in rec.tensors)
    missing = [m for m in wanted if m not in rec.tensors]
    if missing:
        raise BNProbeError(f"{name} recorded no {missing[0]} call (it recorded {', '.join(rec.modes)})")
    return wanted


def _train_golden(c: _Call, run: CallRun, reduce_size: int) -> ForwardOutput | None:
    """The golden's training step on the call's inputs, for a training call run in train or backward mode (None
    otherwise).  With one value per channel (N*H*W = 1) it is undefined: only inference is left to check."""
    if not (c.training and ("train" in run.modes or "backward" in run.modes)):
        return None
    if reduce_size < 2:
        run.notes.append("N*H*W = 1: the training golden is undefined; training outputs not checked")
        run.modes = tuple(m for m in run.modes if m == "infer")
        return None
    ci = c.ci
    gold_t = c.ref.forward_train(ci["x"], ci["gamma"], ci["beta"], ci["running_mean"], ci["running_var"],
                                 momentum=c.momentum, **c.common)
    run.gold_saved = gold_t.saved
    return gold_t


def _run_train(c: _Call, run: CallRun, gold_t: ForwardOutput, after_step: bool) -> Saved | None:
    """The kernel's training step on the recorded train inputs against the golden's: y, the saved statistics and
    the running statistics' update (the golden's alone when the recording lacks it), with ``after_step`` also
    ``y_eval``.  Returns the statistics the kernel saved."""
    ins = c.rec.tensors["train"]["inputs"]
    out = c.kernel_train(ins)
    run.put("y_train", out.y, gold_t.y, c.out_fmt)
    if out.saved is not None:
        sf = get_format(np.asarray(out.saved.value).dtype).name
        run.put("saved_mean", out.saved.mean, gold_t.saved.mean, sf)
        inv = out.saved.invstd(c.eps)  # a saved variance is judged through the invstd it stands for
        run.put("saved_invstd", inv.astype(np.asarray(out.saved.value).dtype) if out.saved.kind == "invstd"
                else inv, gold_t.saved.invstd(c.eps), sf)
    if out.running_mean is not None and out.running_var is not None and gold_t.running_mean is not None:
        run.put("running_mean", out.running_mean, gold_t.running_mean, c.vec_fmt)
        run.put("running_var", out.running_var, gold_t.running_var, c.vec_fmt)
    elif gold_t.running_mean is not None:  # not recorded (updated in place): the golden's update only
        run.gold["running_mean"] = np.asarray(gold_t.running_mean, dtype=np.float64)
        run.gold["running_var"] = np.asarray(gold_t.running_var, dtype=np.float64)
    if after_step and not isinstance(c.kernel, DumpAdapter) and "running_var" in run.got:
        _run_eval_after_step(c, run, ins, out, gold_t)
    return out.saved


def _run_eval_after_step(c: _Call, run: CallRun, ins: dict[str, Any], out: ForwardOutput,
                         gold_t: ForwardOutput) -> None:
    """``y_eval``: the kernel's inference on the step's x with the running statistics its step left, against the
    golden's inference with the golden's update."""
    wide = dict(c.common, params="fp32")  # holds every fp16/bf16 value and the update beyond them
    y_eval = c.kernel.forward_infer(ins["x"], ins.get("gamma"), ins.get("beta"), out.running_mean, out.running_var,
                                    **c.common).y
    g_eval = c.ref.forward_infer(ins["x"], ins.get("gamma"), ins.get("beta"), gold_t.running_mean,
                                 gold_t.running_var, **wide).y
    run.put("y_eval", y_eval, g_eval, c.out_fmt)


def _run_infer(c: _Call, run: CallRun) -> None:
    """The kernel's inference on the recorded infer inputs against the golden's."""
    ins = c.rec.tensors["infer"]["inputs"]
    args = (ins["x"], ins.get("gamma"), ins.get("beta"), ins.get("running_mean"), ins.get("running_var"))
    run.put("y_infer", c.kernel.forward_infer(*args, **c.common).y, c.ref.forward_infer(*args, **c.common).y,
            c.out_fmt)


def _backward_stats(c: _Call, bw_ins: dict[str, Any], gold_t: ForwardOutput | None,
                    saved: Saved | None) -> tuple[Saved, Saved]:
    """The statistics the kernel's and the golden's backward use.  Training: the saved ones (the kernel's from its
    training step, run here when the train mode was not; the golden's where the kernel has none); eval: the
    recorded running statistics, for both."""
    if c.training:
        if saved is None and c.kernel.capabilities().saved != "none" and ("train" in c.rec.tensors or
                                                                         not isinstance(c.kernel, DumpAdapter)):
            saved = c.kernel_train(c.rec.tensors.get("train", {}).get("inputs", {"x": bw_ins["x"],
                                                                               "gamma": bw_ins.get("gamma")})).saved
        # a call recorded without its saved statistics (msprobe's functional batch_norm) recomputes them
        return (saved if saved is not None else gold_t.saved), gold_t.saved  # type: ignore[union-attr]
    rm = bw_ins.get("saved_mean", c.ci["running_mean"])
    rv = bw_ins.get("saved_value", c.ci["running_var"])
    both = Saved(np.asarray(rm, dtype=np.float64), "var", np.asarray(rv, dtype=np.float64))
    return both, both


def _run_backward(c: _Call, run: CallRun, gold_t: ForwardOutput | None, saved: Saved | None) -> None:
    """The kernel's dx, dγ and dβ against the golden's on the recorded backward inputs, and the scales they are
    formed from; a note when the backward cannot run (no dy recorded, or no training golden)."""
    bw_ins = c.rec.tensors.get("backward", {}).get("inputs", {})
    if bw_ins.get("dy") is None or (gold_t is None and c.training):
        run.notes.append("no backward recorded (no dy)")
        return
    x, g, dy = bw_ins["x"], bw_ins.get("gamma"), bw_ins["dy"]
    mine, gold_saved = _backward_stats(c, bw_ins, gold_t, saved)
    got = c.kernel.backward(dy, x, g, mine, training=c.training, **c.common)
    gb = c.ref.backward(dy, x, g, gold_saved, training=c.training, **c.common)
    missing = got.meta.get("missing", ())  # gradients the recorded kernel did not compute (affine=False...)
    for name, mine_g, gold_g, fmt_g in (("dx", got.dx, gb.dx, c.out_fmt), ("dgamma", got.dgamma, gb.dgamma, c.vec_fmt),
                                        ("dbeta", got.dbeta, gb.dbeta, c.vec_fmt)):
        if name not in missing and (name == "dx" or got.meta.get("affine") is not False):
            run.put(name, mine_g, gold_g, fmt_g)
    run.scales.update(_backward_scales(x, dy, g, gold_saved, c.eps, c.rec.layout))


def _mean_scales(c: _Call, run: CallRun, lay: Layout) -> None:
    """Per channel, the scales of the saved mean (mean |x|) and of the running mean's update (|running mean|, or
    momentum * mean |x| when larger), when either was checked."""
    ci = c.ci
    if "x" in ci and ("saved_mean" in run.got or "running_mean" in run.got):
        xcr = lay.to_cr(ci["x"])
        with np.errstate(all="ignore"):
            mean_abs = np.nanmean(np.abs(xcr), axis=1)
        run.scales["saved_mean"] = mean_abs
        rm = ci["running_mean"]
        m = 0.0 if c.momentum is None else c.momentum
        run.scales["running_mean"] = np.maximum(np.abs(rm) if rm is not None else 0.0, m * mean_abs)


def run_call(kernel: KernelAdapter, rec: Recording, *, modes: tuple[str, ...] | None = None, index: int = 0,
             label: str | None = None, ref: KernelAdapter | None = None, skip_missing: bool = False,
             after_step: bool = False) -> CallRun:
    """Run one recorded call: the kernel (a dump is bound to this call and replays it) and the golden, each
    on the call's recorded inputs, scalars and formats, in ``modes`` (default: every mode it recorded).
    A mode the call did not record is an error, or with ``skip_missing`` left out.  ``after_step`` (a
    runnable kernel's training call that updates running statistics): also ``y_eval``, the inference on the
    same x with the running statistics the step left, against the golden's inference with the FP64 update
    (not rounded to the parameter format: an update beyond the format shows where it is used)."""
    ref = ref or get_adapter("reference")
    name = label or str(rec.meta.get("call") or rec.source or rec.adapter)
    k = kernel.bind(rec) if isinstance(kernel, DumpAdapter) else kernel
    run = CallRun(index, name, k.name, rec, _wanted_modes(rec, modes, skip_missing, name))
    c = _call_of(k, ref, rec)
    lay = layout_of(c.ci["x"], rec.layout)
    gold_t = _train_golden(c, run, lay.reduce_size)
    saved = _run_train(c, run, gold_t, after_step) if "train" in run.modes and gold_t is not None else None
    if "infer" in run.modes:
        _run_infer(c, run)
    if "backward" in run.modes:
        _run_backward(c, run, gold_t, saved)
    _mean_scales(c, run, lay)
    return run


def _backward_scales(x: np.ndarray, dy: np.ndarray, gamma: np.ndarray | None, saved: Saved, eps: float,
                     layout: str) -> dict[str, np.ndarray]:
    """Per channel, the magnitudes the gradients are formed from: dβ = Σdy against Σ|dy|, dγ = Σdy·x̂ against
    Σ|dy·x̂|, dx against γ·rstd·(max|dy| + |mean dy| + max|x̂|·|mean(dy·x̂)|)."""
    lay = layout_of(x, layout)
    xcr, dycr = lay.to_cr(x), lay.to_cr(dy)
    mean, var = np.asarray(saved.mean, dtype=np.float64), saved.var(eps)
    with np.errstate(all="ignore"):
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = (xcr - mean[:, None]) * rstd[:, None]
        g = np.ones(lay.channels) if gamma is None else np.abs(np.asarray(gamma, dtype=np.float64))
        prod = dycr * xhat
        dx = g * rstd * (np.nanmax(np.abs(dycr), axis=1) + np.abs(np.nanmean(dycr, axis=1))
                         + np.nanmax(np.abs(xhat), axis=1) * np.abs(np.nanmean(prod, axis=1)))
        return {"dx": dx, "dgamma": np.nansum(np.abs(prod), axis=1), "dbeta": np.nansum(np.abs(dycr), axis=1)}


def runs(recorded: Recorded, modes: tuple[str, ...] | None = None,
         skip_missing: bool = False) -> Iterator[tuple[int, CallRef, CallRun]]:
    """(index, CallRef, CallRun) for every selected call in forward order, one call in memory at a time
    (``modes``: the modes to run, None for every mode each call recorded; see :func:`run_call`)."""
    recorded.calls.require_tensors("running a recorded call")
    # only outputs are compared: the instrumented kernels keep counters, not every intermediate (on copies: the
    # caller's kernel is unchanged)
    ref = counters_only(get_adapter("reference"))
    kernel = counters_only(recorded.kernel)
    for i, c in enumerate(recorded.calls.calls):
        rec = c.load()
        yield i, c, run_call(kernel, rec, modes=modes, index=i, label=c.label, ref=ref, skip_missing=skip_missing)


@dataclass
class PerCall:
    """A check's results over the calls of a recording, in forward order: one result per call, each
    truthy when its call passed; truthy when every call passed."""

    check: str
    kernel: str
    source: str
    kind: str
    results: list[Any]
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return all(bool(r) for r in self.results)

    @property
    def passed(self) -> bool:
        return bool(self)

    def to_frame(self):  # -> pandas.DataFrame
        """The results' frames (each with its call column) one after the other."""
        import pandas as pd

        frames = [r.to_frame() for r in self.results if hasattr(r, "to_frame")]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "adapter": self.kernel, "source": self.source, "kind": self.kind,
                "passed": bool(self), "notes": self.notes, "calls": [r.to_dict() for r in self.results]}

"""The run engine: a kernel and the FP64 golden on one BatchNorm call, every output in one vocabulary.

Every check (compare-precision, doctor, gradcheck, overflow, shrink, sweeps) runs its kernels here: a call —
recorded (a dump's) or generated (:func:`generated_call`) — goes through the kernel under test (a dump is bound
to the call and replays it) and through the golden on exactly the call's inputs, scalars and formats, in the
modes asked for.  The result, a :class:`CallRun`, names each output by :data:`OUTPUT_MODE`'s keys: ``y`` (the
training forward's), ``saved_mean`` and ``saved_invstd`` or ``saved_var`` (as the kernel saved it),
``running_mean``, ``running_var``, ``y_infer``, ``y_eval`` (inference after the step), ``dx``, ``dgamma``,
``dbeta``; and per channel the natural scale of the outputs that can cancel to near zero (what they are formed
from).  The golden of a call is computed once however many kernels run on it (:class:`Golden`).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.adapters import BackwardOutput, ForwardOutput, KernelAdapter, Saved
from bnprobe.adapters.base import outputs_only, params_format
from bnprobe.adapters.convention import reference_for
from bnprobe.core.conventions import convention_of
from bnprobe.recordings import Recording
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import modes_left_out, needs_modes
from bnprobe.kernels.layout import layout_of
from bnprobe.core.tolerances import accumulation_bound, accumulation_format, accumulation_words, variance_bound

T = TypeVar("T")
LARGE_CALL = 1 << 20  # values of x beyond which a call's arrays are collected before the next is read

__all__ = ["CallCollector", "CallRun", "Golden", "OUTPUT_MODE", "generated_call", "family_meta", "run_call",
           "each_call", "each_run", "natural_scales", "cancellation_bounds", "statistics_bounds", "forgiven",
           "running_stats", "y_natural"]

# each output a check can judge, and the mode whose call returns it
OUTPUT_MODE = {"y": "train", "saved_mean": "train", "saved_invstd": "train", "saved_var": "train",
               "saved_rstd": "train", "running_mean": "train", "running_var": "train", "y_infer": "infer",
               "dx": "backward", "dgamma": "backward", "dbeta": "backward", "y_eval": "train"}


@dataclass
class CallRun:
    """One call through the kernel under test and through the FP64 golden.

    ``got`` and ``gold`` map the outputs (names of :data:`OUTPUT_MODE`) to arrays: the kernel's in the dtype it
    returned them in, the golden's in float64 (``gold`` may also hold the running statistics' update that a
    recording lacks).  ``formats``: the format each output was returned in.  ``scales``: per channel, the natural
    magnitude of the outputs that can cancel to near zero (:func:`natural_scales`); ``bounds``: per channel, the
    error a correct kernel's accumulation can put into the gradients, with the formula in words
    (:func:`cancellation_bounds`)."""

    index: int
    label: str
    kernel: str
    recording: Recording  # the call as recorded (or generated): its inputs, scalars, formats and outputs
    modes: tuple[str, ...]
    got: dict[str, np.ndarray] = field(default_factory=dict)
    gold: dict[str, np.ndarray] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    gold_saved: Saved | None = None  # the golden's statistics of a training call (its batch mean and variance)
    saved: Saved | None = None  # the statistics the kernel's training forward saved (what its backward used)
    scales: dict[str, np.ndarray] = field(default_factory=dict)
    bounds: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # :func:`cancellation_bounds`
    notes: list[str] = field(default_factory=list)
    call: BNCall | None = None

    @property
    def fmt(self) -> str:
        return self.recording.dtype

    @property
    def eps(self) -> float:
        return self.recording.eps

    @property
    def inputs(self) -> BNCall:
        """The call's inputs and scalars."""
        if self.call is None:
            self.call = self.recording.call()
        return self.call

    def put(self, key: str, got: Any, gold: Any, fmt: str) -> None:
        """Keep an output of both; ``fmt`` is the format it was returned in unless its dtype says otherwise."""
        dt = np.asarray(got).dtype
        self.got[key], self.gold[key] = got, np.asarray(gold, dtype=np.float64)
        self.formats[key] = fmt if dt == np.float64 else get_format(dt).name

    def invstd_view(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, str]]:
        """(got, gold, formats) with a saved variance replaced by the 1/sqrt(var + eps) it stands for (float64,
        judged in the format it was saved in): for checks that judge every kernel's saved statistics as invstd."""
        got, gold, formats = dict(self.got), dict(self.gold), dict(self.formats)
        if "saved_var" in got:
            got["saved_invstd"] = Saved(got["saved_mean"], "var", got.pop("saved_var")).invstd(self.eps)
            gold.pop("saved_var")
            gold["saved_invstd"] = self.gold_saved.invstd(self.eps)  # type: ignore[union-attr]
            formats["saved_invstd"] = formats.pop("saved_var")
        return got, gold, formats


def generated_call(call: BNCall, *, modes: tuple[str, ...] = ("train", "infer", "backward"),
                   label: str = "generated", meta: dict[str, Any] | None = None) -> Recording:
    """Generated inputs (``call``: x, γ, β, running statistics, dy in float64, with the format, parameter format,
    scalars and layout to run them in) as a call without outputs, each tensor rounded to its format (x, dy to
    ``call.dtype``; γ, β and the running statistics to the parameter format; γ, β, the running statistics 1, 0,
    0, 1 where None): what :func:`run_call` runs a kernel and the golden on, as it runs a recorded call.
    ``modes`` with ``backward`` is a training call (it needs ``dy``)."""
    from bnprobe.numerics.rounding import round_to

    fmt = get_format(call.dtype).name
    pf = params_format(fmt, call.params)
    family = call.norm != "batch"
    if family:  # γ and β of the layer's parameter shape (β none for RMSNorm); no running statistics
        from bnprobe.engine.family import family_shape

        shape = family_shape(call).param_shape
        defaults = (("gamma", call.gamma, 1.0),) + ((("beta", call.beta, 0.0),) if call.norm != "rms" else ())
    else:
        shape = (layout_of(call.x, call.layout).channels,)
        defaults = (("gamma", call.gamma, 1.0), ("beta", call.beta, 0.0),
                    ("running_mean", call.running_mean, 0.0), ("running_var", call.running_var, 1.0))
    with np.errstate(all="ignore"):
        vec = {k: round_to(np.full(shape, d) if v is None else np.asarray(v, dtype=np.float64), pf)
               for k, v, d in defaults}
        xs = round_to(np.asarray(call.x, dtype=np.float64), fmt)
    training = "train" in modes or "backward" in modes
    rec = Recording(label, fmt, pf, call.layout, call.eps, call.momentum, None,
                    meta={**(meta or {}), "training": training, "call": label, **family_meta(call)})
    for mode in modes:
        if mode == "backward":
            if call.dy is None:
                raise BNProbeError("a backward call needs dy")
            named = {"dy": round_to(np.asarray(call.dy, dtype=np.float64), fmt), "x": xs, "gamma": vec["gamma"]}
            if "train" not in modes:  # the inputs of the training forward that saves the backward's statistics
                named.update({k: vec[k] for k in ("beta", "running_mean", "running_var") if k in vec})
        else:
            named = {"x": xs, **vec}
        rec.tensors[mode] = {"inputs": named, "outputs": {}}
        rec.formats.update({f"{mode}.inputs.{k}": fmt if k in ("x", "dy") else pf for k in named})
    return rec


def family_meta(call: BNCall) -> dict[str, Any]:
    """What a recording keeps of a family call's layer (its norm, normalised shape, groups and γ's offset), so that
    :meth:`~bnprobe.recordings.Recording.call` gives it back; {} for BatchNorm."""
    if call.norm == "batch":
        return {}
    return {"norm": call.norm, "normalized_shape": None if call.normalized_shape is None else
            [int(d) for d in np.atleast_1d(call.normalized_shape)], "groups": call.groups,
            "weight_offset": call.weight_offset}


class Golden:
    """The FP64 golden's outputs on one call, each computed once, when first asked for: every kernel run on the
    call (and the bench) is judged against the same arrays."""

    def __init__(self, ref: KernelAdapter, rec: Recording) -> None:
        self.ref, self.rec, self.call = ref, rec, rec.call()
        self._cache: dict[str, Any] = {}

    @property
    def reduce_size(self) -> int:
        """R: the values each statistic sees (a channel's; a family layer's row's)."""
        if self.call.norm != "batch":
            from bnprobe.engine.family import family_shape

            return family_shape(self.call).r
        return layout_of(self.call.x, self.rec.layout).reduce_size

    def train(self, convention: str | None = None) -> ForwardOutput:
        """The golden's training step on the call's inputs, its running variance updated as ``convention`` says
        (:mod:`bnprobe.core.conventions`; default the golden's own, torch's unless it was made for another)."""
        own = convention_of(self.ref).name
        conv = own if convention is None else convention
        key = "train" if conv == own else f"train:{conv}"
        if key not in self._cache:
            c = self.call
            ref = self.ref if conv == own else outputs_only(reference_for(conv))
            self._cache[key] = ref.train(c)
        return self._cache[key]

    def train_for(self, modes: tuple[str, ...], convention: str | None = None) -> ForwardOutput | None:
        """The golden's training step when ``modes`` need it (a training call run in train or backward mode) and
        it is defined (N*H*W > 1); else None."""
        if self.call.training and self.reduce_size > 1 and ("train" in modes or "backward" in modes):
            return self.train(convention)
        return None

    def infer(self, ins: dict[str, Any]) -> np.ndarray:
        """The golden's inference y on the recorded inference inputs ``ins``."""
        if "infer" not in self._cache:
            self._cache["infer"] = self.ref.infer(self.call.with_inputs(ins)).y
        return self._cache["infer"]

    def backward_of(self, call: BNCall, saved: Saved) -> BackwardOutput:
        """The golden's backward of ``call`` (the recorded backward's) from ``saved`` (the golden's own statistics:
        the same for every kernel)."""
        if "backward" not in self._cache:
            self._cache["backward"] = self.ref.backward_of(call, saved)
        return self._cache["backward"]

    def bounds(self, gold_saved: Saved | None, stats: Saved | None, dy: np.ndarray | None
               ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, str]]]:
        """The call's natural scales and bounds (:func:`natural_scales`, :func:`cancellation_bounds`,
        :func:`statistics_bounds`; a family layer's :func:`~bnprobe.engine.family.family_bounds`) from the golden's
        training statistics ``gold_saved``, the statistics ``stats`` the golden's backward used and the backward's
        ``dy``: computed once for every kernel run on the call with the same three (they depend on nothing else)."""
        key = ("bounds", id(gold_saved), id(stats), id(dy))
        hit = self._cache.get(key)
        if hit is not None and hit[0] is gold_saved and hit[1] is stats and hit[2] is dy:
            return hit[3], hit[4]
        call = self.call
        if call.norm != "batch":
            from bnprobe.engine.family import family_bounds

            scales, bounds = family_bounds(call, gold_saved, stats, dy)
        else:
            scales = natural_scales(call, stats, dy)
            bounds = cancellation_bounds(call, stats, scales)
            if gold_saved is not None and layout_of(call.x, call.layout).reduce_size > 1:
                bounds.update(statistics_bounds(call, gold_saved, scales.get("saved_mean")))
        self._cache[key] = (gold_saved, stats, dy, scales, bounds)
        return scales, bounds


@dataclass(frozen=True)
class _Setting:
    """What every part of one call's run shares: the kernel (a dump bound to the call), the golden, the call and
    the formats the outputs are returned in."""

    kernel: KernelAdapter
    golden: Golden
    rec: Recording
    call: BNCall
    out_fmt: str  # y and dx (the reference returns float64 values)
    vec_fmt: str  # the running statistics, dγ and dβ

    def kernel_train(self, ins: dict[str, Any]) -> ForwardOutput:
        """The kernel's training step on the inputs ``ins`` (x, and γ, β, running statistics where given)."""
        return self.kernel.train(self.call.with_inputs(ins))


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


def _train_golden(s: _Setting, run: CallRun, quiet: bool) -> ForwardOutput | None:
    """The golden's training step on the call's inputs, for a training call run in train or backward mode (None
    otherwise).  With one value per channel (N*H*W = 1) it is undefined: only inference is left to check."""
    gold_t = s.golden.train_for(run.modes, convention_of(s.kernel).name)
    if gold_t is None and s.call.training and ("train" in run.modes or "backward" in run.modes):
        if not quiet:
            run.notes.append("N*H*W = 1: the training golden is undefined; training outputs not checked")
        run.modes = tuple(m for m in run.modes if m == "infer")
    run.gold_saved = None if gold_t is None else gold_t.saved
    return gold_t


def _run_train(s: _Setting, run: CallRun, gold_t: ForwardOutput, after_step: bool) -> None:
    """The kernel's training step on the recorded train inputs against the golden's: y, the saved statistics (as
    saved) and the running statistics' update (the golden's alone when the recording lacks it), with
    ``after_step`` also ``y_eval``."""
    ins = s.rec.tensors["train"]["inputs"]
    out = s.kernel_train(ins)
    run.put("y", out.y, gold_t.y, s.out_fmt)
    run.saved = out.saved
    if out.saved is not None and s.call.norm != "batch":  # a family layer's statistics per row: mean (none for
        # RMSNorm) and rstd
        sf = get_format(np.asarray(out.saved.value).dtype).name
        if out.saved.mean is not None:
            run.put("saved_mean", out.saved.mean, gold_t.saved.mean, sf)
        run.put("saved_rstd", out.saved.value, gold_t.saved.invstd(s.call.eps), sf)
    elif out.saved is not None:
        kind, eps = out.saved.kind, s.call.eps
        sf = get_format(np.asarray(out.saved.value).dtype).name
        run.put("saved_mean", out.saved.mean, gold_t.saved.mean, sf)
        run.put(f"saved_{kind}", out.saved.value,
                gold_t.saved.var(eps) if kind == "var" else gold_t.saved.invstd(eps), sf)
    if out.running_mean is not None and out.running_var is not None and gold_t.running_mean is not None:
        run.put("running_mean", out.running_mean, gold_t.running_mean, s.vec_fmt)
        run.put("running_var", out.running_var, gold_t.running_var, s.vec_fmt)
    elif gold_t.running_mean is not None:  # not recorded (updated in place): the golden's update only
        run.gold["running_mean"] = np.asarray(gold_t.running_mean, dtype=np.float64)
        run.gold["running_var"] = np.asarray(gold_t.running_var, dtype=np.float64)
    if after_step and not s.kernel.capabilities().recorded and "running_var" in run.got:
        _run_eval_after_step(s, run, ins, out, gold_t)


def _run_eval_after_step(s: _Setting, run: CallRun, ins: dict[str, Any], out: ForwardOutput,
                         gold_t: ForwardOutput) -> None:
    """``y_eval``: the kernel's inference on the step's x with the running statistics its step left, against the
    golden's inference with the golden's update (not rounded to the parameter format: an update beyond the
    format shows where it is used)."""
    step = s.call.with_inputs(ins)
    y_eval = s.kernel.infer(step.with_(running_mean=out.running_mean, running_var=out.running_var)).y
    # the golden's parameters in fp32: it holds every fp16/bf16 value and the update beyond them
    g_eval = s.golden.ref.infer(step.with_(running_mean=gold_t.running_mean, running_var=gold_t.running_var,
                                           params="fp32")).y
    run.put("y_eval", y_eval, g_eval, s.out_fmt)


def _run_infer(s: _Setting, run: CallRun) -> None:
    """The kernel's inference on the recorded infer inputs against the golden's."""
    ins = s.rec.tensors["infer"]["inputs"]
    y = s.kernel.infer(s.call.with_inputs(ins)).y
    run.put("y_infer", y, s.golden.infer(ins), s.out_fmt)


def _backward_stats(s: _Setting, run: CallRun, bw_ins: dict[str, Any], gold_t: ForwardOutput | None,
                    ) -> tuple[Saved, Saved]:
    """The statistics the kernel's and the golden's backward use.  Training: the saved ones (the kernel's from its
    training step, run here when the train mode was not; the golden's where the kernel saves none — a call
    recorded without its saved statistics, such as msprobe's functional batch_norm, recomputes them); eval: the
    recorded statistics of the backward, else the running statistics, for both."""
    caps = s.kernel.capabilities()
    if s.call.training:
        if run.saved is None and caps.saved != "none" and "train" not in run.modes and \
                ("train" in s.rec.tensors or not caps.recorded):
            ins = s.rec.tensors["train"]["inputs"] if "train" in s.rec.tensors else bw_ins
            run.saved = s.kernel_train(ins).saved
        return (run.saved if run.saved is not None else gold_t.saved), gold_t.saved  # type: ignore[union-attr]
    rm = bw_ins.get("saved_mean", s.call.running_mean)
    rv = bw_ins.get("saved_value", s.call.running_var)
    both = Saved(np.asarray(rm, dtype=np.float64), "var", np.asarray(rv, dtype=np.float64))
    return both, both


def _run_backward(s: _Setting, run: CallRun, gold_t: ForwardOutput | None) -> Saved | None:
    """The kernel's dx, dγ and dβ against the golden's on the recorded backward inputs; a note when the backward
    cannot run (no dy recorded, or no training golden).  Returns the statistics the golden's backward used."""
    bw_ins = s.rec.tensors.get("backward", {}).get("inputs", {})
    if bw_ins.get("dy") is None or (gold_t is None and s.call.training):
        run.notes.append("no backward recorded (no dy)")
        return None
    bw = s.call.with_(dy=bw_ins["dy"], x=bw_ins["x"], gamma=bw_ins.get("gamma"))
    mine, gold_saved = _backward_stats(s, run, bw_ins, gold_t)
    got = s.kernel.backward_of(bw, mine)
    gb = s.golden.backward_of(bw, gold_saved)
    missing = got.meta.get("missing", ())  # gradients the recorded kernel did not compute (affine=False...)
    for name, mine_g, gold_g, fmt_g in (("dx", got.dx, gb.dx, s.out_fmt), ("dgamma", got.dgamma, gb.dgamma, s.vec_fmt),
                                        ("dbeta", got.dbeta, gb.dbeta, s.vec_fmt)):
        if name not in missing and (name == "dx" or got.meta.get("affine") is not False):
            run.put(name, mine_g, gold_g, fmt_g)
    return gold_saved


def y_natural(call: BNCall, stats: Saved) -> np.ndarray:
    """Per element of y, the magnitude it is formed from: |x·rstd·γ| + |μ·rstd·γ| + |β| (golden statistics)."""
    if call.norm != "batch":
        from bnprobe.engine.family import family_y_natural

        return family_y_natural(call, stats)
    lay = layout_of(call.x)
    r = stats.invstd(call.eps).astype(np.float64)
    g = np.ones(lay.channels) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64)
    b = np.zeros(lay.channels) if call.beta is None else np.asarray(call.beta, dtype=np.float64)
    rg = np.abs(r * g)
    mu = np.abs(stats.mean.astype(np.float64)) * rg + np.abs(b)
    return np.abs(np.asarray(call.x, dtype=np.float64)) * lay.column(rg) + lay.column(mu)


def running_stats(call: BNCall) -> Saved | None:
    """The running statistics inference normalises with, as :class:`Saved` (mean and variance), or None."""
    if call.running_mean is None or call.running_var is None:
        return None
    return Saved(np.asarray(call.running_mean, dtype=np.float64), "var", np.asarray(call.running_var, dtype=np.float64))


def forgiven(run: CallRun, key: str) -> np.ndarray | None:
    """Per element of elementwise output ``key`` (y, y_infer or dx, broadcastable to it in the call's layout), the
    error a correct kernel's rounding and accumulation can put there, as compare-precision's rules forgive it where the
    output cancels to near zero (SMALL_VALUE_ULPS of the accumulation format times the magnitude the element is
    formed from; for dx also the accumulation bound of its sums); None when there is none to forgive."""
    from bnprobe.core.tolerances import SMALL_VALUE_ULPS

    if run.fmt not in ("fp16", "bf16", "fp32"):
        return None
    u = SMALL_VALUE_ULPS * get_format(accumulation_format(run.fmt)).unit_roundoff
    call = run.inputs
    if key == "y" and run.gold_saved is not None:
        return u * y_natural(call, run.gold_saved)
    if key == "y_infer" and (st := running_stats(call)) is not None:
        return u * y_natural(call, st)
    if key == "dx" and "dx" in run.scales:
        b = run.bounds.get("dx")
        per_channel = u * run.scales["dx"] if b is None else np.maximum(u * run.scales["dx"], np.nan_to_num(b[0]))
        return layout_of(call.x).column(per_channel)
    return None


def _reductions(a: np.ndarray) -> tuple[Callable[..., Any], ...]:
    """(mean, sum, max) leaving NaN out: numpy's plain ones where ``a`` holds no NaN (the nan* ones then sum,
    count and compare the same values in the same order, NaN replaced by 0 in a copy: the same figures bit for
    bit, without the copies), else the nan* ones."""
    return (np.mean, np.sum, np.max) if not np.isnan(a).any() else (np.nanmean, np.nansum, np.nanmax)


def natural_scales(call: BNCall, stats: Saved | None, dy: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per channel, the magnitudes the outputs that can cancel to near zero are formed from: the saved mean's,
    mean |x|; the running mean's update, |running mean| or momentum · mean |x| when larger; with the statistics
    ``stats`` the backward used and ``dy``: dβ = Σdy against Σ|dy|, dγ = Σdy·x̂ against Σ|dy·x̂|, dx against
    |γ|·rstd·(max|dy| + |mean dy| + max|x̂|·|mean(dy·x̂)|).  NaN values are left out."""
    lay = layout_of(call.x, call.layout)
    back = stats is not None and dy is not None
    gv = stats.var(call.eps) if back else None  # type: ignore[union-attr]
    # a channel whose values are all NaN has a NaN scale (numpy warns of the empty slice: not a finding)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_abs, grads = _figures_compiled(call, lay, stats, gv, dy) or _figures(call, lay, stats, gv, dy)
        m = 0.0 if call.momentum is None else call.momentum
        rm = call.running_mean
        out = {"saved_mean": mean_abs, "running_mean": np.maximum(np.abs(rm) if rm is not None else 0.0, m * mean_abs)}
        if grads is None:
            return out
        dsum_abs, psum_abs, dmean, pmean, dmax_abs, xhat_max = grads
        g = np.ones(lay.channels) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64)
        out["dbeta"], out["dgamma"] = dsum_abs, psum_abs
        gr = np.abs(g) / np.sqrt(gv + call.eps)
        out["dx"] = gr * (dmax_abs + np.abs(dmean) + xhat_max * np.abs(pmean))
    return out


#: what the natural scales are formed from: per channel mean |x|, and with a backward Σ|dy|, Σ|dy·x̂|, mean dy,
#: mean dy·x̂, max |dy| and max |x̂| (None without one)
_Figures = tuple[np.ndarray, "tuple[np.ndarray, ...] | None"]


def _figures(call: BNCall, lay: Any, stats: Saved | None, gv: np.ndarray | None, dy: np.ndarray | None) -> _Figures:
    """:func:`natural_scales`' per-channel figures by numpy's reductions of the channel-first data, NaN left out."""
    xcr = lay.to_cr(call.x)
    mean_abs = _reductions(xcr)[0](np.abs(xcr), axis=1)
    if stats is None or dy is None:
        return mean_abs, None
    gm = np.asarray(stats.mean, dtype=np.float64)
    xhat = (xcr - gm[:, None]) / np.sqrt(gv[:, None] + call.eps)  # type: ignore[index]
    del xcr
    dycr = lay.to_cr(dy)
    prod = dycr * xhat
    dmean, dsum, dmax = _reductions(dycr)
    pmean, psum, pmax = _reductions(prod)  # (a NaN in x̂ is one in dy·x̂)
    return mean_abs, (dsum(np.abs(dycr), axis=1), psum(np.abs(prod), axis=1), dmean(dycr, axis=1),
                      pmean(prod, axis=1), dmax(np.abs(dycr), axis=1), pmax(np.abs(xhat), axis=1))


def _figures_compiled(call: BNCall, lay: Any, stats: Saved | None, gv: np.ndarray | None,
                      dy: np.ndarray | None) -> _Figures | None:
    """:func:`_figures` of a large call in one compiled pass: each channel's sums are numpy's pairwise sums of its
    row, reproduced, and its means those sums over R, so the same figures bit for bit; None where the call takes
    numpy's route.  Only for C-contiguous float64 (N, C, S...) x and dy without NaN, with S > 1: numpy reduces a
    row pairwise where :meth:`~bnprobe.kernels.layout.Layout.to_cr` gives contiguous rows, which it does for these
    (a copy, or a view when N or C is 1); channels-last data, (N, C) and (N, C, 1, ...) it hands over as a view
    with the channels innermost, and adds each row in order.  Statistics of another length than C (numpy would
    broadcast them) take numpy's route too."""
    x = call.x
    back = stats is not None and dy is not None

    def plain(a: Any) -> bool:
        return isinstance(a, np.ndarray) and a.dtype == np.float64 and a.flags.c_contiguous and a.shape == x.shape

    if not (plain(x) and x.ndim >= 3 and lay.channel_axis == 1 and math.prod(x.shape[2:]) > 1 and jit_for(x.size)) \
            or (back and not plain(dy)):
        return None
    gm = np.asarray(stats.mean, dtype=np.float64) if back else np.zeros(lay.channels)  # type: ignore[union-attr]
    if back and (gm.shape != (lay.channels,) or np.shape(gv) != (lay.channels,)):
        return None
    from bnprobe.compiled.rules import scale_sums

    sums = scale_sums(lay.view3(x), lay.view3(dy) if back else None, gm,
                      np.sqrt(gv + call.eps) if back else np.zeros(lay.channels))  # type: ignore[operator]
    if sums is None:
        return None
    r = np.intp(lay.reduce_size)
    grads = (sums[:, 1].copy(), sums[:, 4].copy(), sums[:, 2] / r, sums[:, 3] / r, sums[:, 5], sums[:, 6])
    return sums[:, 0] / r, grads if back else None


def cancellation_bounds(call: BNCall, stats: Saved | None, scales: dict[str, np.ndarray],
                        ) -> dict[str, tuple[np.ndarray, str]]:
    """Per channel, the largest error a correct kernel's accumulation can put into the gradients' sums, whatever
    their summation order, when the sums cancel (a constant channel's dγ is 0 exactly): with R terms per channel
    and γ_R = R·u/(1 − R·u), u the unit roundoff of the accumulation format (:func:`~bnprobe.core.tolerances
    .accumulation_bound`), dβ = Σdy errs by at most γ_R·Σ|dy|; dγ = Σdy·x̂ by γ_R·(2·Σ|dy·x̂| + rstd·mean|x|·Σ|dy|)
    (its own sum and the rstd it uses give one γ_R of Σ|dy·x̂| each; the mean's error, γ_R·mean|x|, enters every
    x̂ times rstd — also the bound of dγ formed as rstd·(Σdy·x − μ·Σdy), whose terms are that large);
    dx = γ·rstd·(dy − Σdy/R − x̂·Σ(dy·x̂)/R) by |γ|·rstd·(dβ's bound + max|x̂|·dγ's bound)/R.
    ``scales``: :func:`natural_scales` of the same call (Σ|dy|, Σ|dy·x̂|, mean|x|); {} without a backward."""
    if stats is None or "dgamma" not in scales:
        return {}
    lay = layout_of(call.x, call.layout)
    r = lay.reduce_size
    acc = accumulation_format(call.dtype)
    gr = accumulation_bound(call.dtype, r)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gm = np.asarray(stats.mean, dtype=np.float64)
        rstd = 1 / np.sqrt(stats.var(call.eps) + call.eps)
        xhat_max = _deviation_peaks(call, lay, gm) * rstd
        g = np.ones(lay.channels) if call.gamma is None else np.abs(np.asarray(call.gamma, dtype=np.float64))
        b_beta = gr * scales["dbeta"]
        b_gamma = gr * (2 * scales["dgamma"] + rstd * scales["saved_mean"] * scales["dbeta"])
        b_dx = g * rstd * (b_beta + xhat_max * b_gamma) / r
    u_exp = int(np.log2(get_format(acc).unit_roundoff))
    g_r, rhs = accumulation_words(r)
    how = f"{g_r} = {rhs}, u = 2^{u_exp} ({acc} accumulation, any order)"
    return {"dbeta": (b_beta, f"{g_r}·Σ|dy|, {how}"),
            "dgamma": (b_gamma, f"{g_r}·(2·Σ|dy·x̂| + rstd·mean|x|·Σ|dy|), {how}"),
            "dx": (b_dx, f"|γ|·rstd·(dβ's bound + max|x̂|·dγ's bound)/{r}, {how}")}


def _deviation_peaks(call: BNCall, lay: Any, gm: np.ndarray) -> np.ndarray:
    """Per channel, the largest |x - gm| (NaN left out): in one compiled pass over a large float64 x."""
    x = call.x
    if isinstance(x, np.ndarray) and x.dtype == np.float64 and x.size and jit_for(x.size) and \
            gm.shape == (lay.channels,):
        from bnprobe.compiled.rules import deviation_peaks

        return deviation_peaks(lay.view3(x), gm)
    return np.nanmax(np.abs(lay.to_cr(x) - gm[:, None]), axis=1)


def statistics_bounds(call: BNCall, stats: Saved, mean_abs: np.ndarray | None = None
                      ) -> dict[str, tuple[np.ndarray, str]]:
    """Per channel, the largest error a correct kernel's saved invstd (and variance) can have, however it orders its
    sums: with δμ = γ_R·mean|x| its mean's error, a two-pass variance about that mean errs by
    (γ_R + 3u)·(σ² + δμ²) + δμ² (the bound :class:`~bnprobe.checks.overflow.observe.CarefulBounds` holds a
    normalising scale to), and invstd = 1/sqrt(σ² + ε) by ½·that/(σ² + ε) of itself plus SMALL_VALUE_ULPS·u for
    the rsqrt; u the unit roundoff of the accumulation format.  ``stats``: the golden's batch mean and variance;
    ``mean_abs``: each channel's mean |x| (NaN left out) when known (:func:`natural_scales`' saved_mean)."""
    from bnprobe.core.tolerances import SMALL_VALUE_ULPS

    lay = layout_of(call.x, call.layout)
    r = lay.reduce_size
    acc = accumulation_format(call.dtype)
    u = get_format(acc).unit_roundoff
    gam = accumulation_bound(call.dtype, r)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dmean = gam * (np.nanmean(np.abs(lay.to_cr(call.x)), axis=1) if mean_abs is None else mean_abs)
        var = np.asarray(stats.var(call.eps), dtype=np.float64)
        b_var = variance_bound(gam, u, var, dmean)
        invstd = 1.0 / np.sqrt(var + call.eps)
        b_inv = invstd * (0.5 * b_var / (var + call.eps) + SMALL_VALUE_ULPS * u)
    g_r, rhs = accumulation_words(r)
    how = f"δμ = {g_r}·mean|x|, {g_r} = {rhs}, u = 2^{int(np.log2(u))} ({acc} accumulation, any order)"
    return {"saved_var": (b_var, f"({g_r} + 3u)·(σ² + δμ²) + δμ², {how}"),
            "saved_invstd": (b_inv, f"invstd·(½·the variance's bound/(σ² + ε) + {SMALL_VALUE_ULPS:g}u), the variance's "
                                    f"bound ({g_r} + 3u)·(σ² + δμ²) + δμ², {how}")}


def run_call(kernel: KernelAdapter, rec: Recording, *, modes: tuple[str, ...] | None = None, index: int = 0,
             label: str | None = None, skip_missing: bool = False,
             after_step: bool = False, golden: Golden | None = None, quiet: bool = False,
             replay: Recording | None = None) -> CallRun:
    """Run one call: the kernel (a dump is bound to this call and replays it) and the golden, each on the call's
    inputs, scalars and formats, in ``modes`` (default: every mode it recorded).  A mode the call did not record
    is an error, or with ``skip_missing`` left out.  ``after_step`` (a runnable kernel's training call that updates
    running statistics): also ``y_eval``.  ``golden``: the call's :class:`Golden`, shared between the kernels run
    on it (default: a new one on the kernel's reference adapter).  ``quiet``: no note for what is not checked.
    ``replay``: the recording a dump adapter replays, when not ``rec`` itself (another dump's call of the name)."""
    name = label or str(rec.meta.get("call") or rec.source or rec.adapter)
    caps = kernel.capabilities()
    k = kernel.bind(replay or rec) if caps.recorded else kernel
    golden = golden or Golden(reference_for(kernel), rec)
    call = golden.call
    wanted = _wanted_modes(rec, modes, skip_missing, name)
    left_out = None
    if modes is None and not caps.recorded:  # every mode recorded: those the kernel runs, the others said
        left_out = modes_left_out(k.name, caps.modes, wanted)
        if left_out is not None and not any(m in caps.modes for m in wanted):
            raise BNProbeError(needs_modes(f"the recorded call {name}", wanted, k.name, caps.modes))
        wanted = tuple(m for m in wanted if m in caps.modes)
    run = CallRun(index, name, k.name, rec, wanted, call=call)
    if left_out is not None and not quiet:
        run.notes.append(left_out)
    out_fmt = caps.output or rec.dtype
    s = _Setting(k, golden, rec, call, out_fmt, "fp64" if caps.output == "fp64" else rec.params)
    gold_t = _train_golden(s, run, quiet)
    if "train" in run.modes and gold_t is not None:
        _run_train(s, run, gold_t, after_step)
    if "infer" in run.modes:
        _run_infer(s, run)
    stats = _run_backward(s, run, gold_t) if "backward" in run.modes else None
    bw_dy = rec.tensors.get("backward", {}).get("inputs", {}).get("dy") if stats is not None else None
    scales, bounds = golden.bounds(run.gold_saved, stats, bw_dy)
    # (each run its own dicts: a caller may add to them; the arrays are shared, never written)
    run.scales, run.bounds = dict(scales), dict(bounds)
    return run


class CallCollector:
    """The collections a loop over large calls runs between them (``with CallCollector() as c: ... c.collect()``),
    each walking only the objects made since the last one: after a collection what is left is frozen (``gc.freeze``;
    thawed when the loop ends), so the modules' objects (torch's, pandas', matplotlib's: about 1 M) are not walked
    again at every call.  The caller holds none of the last call's objects when it collects (they would be frozen
    with the rest, and a cycle among them kept until the loop ends).  A process that froze objects itself keeps its
    own: its collections are plain ones."""

    def __init__(self) -> None:
        self._freeze = gc.get_freeze_count() == 0
        self._frozen = False

    def __enter__(self) -> CallCollector:
        return self

    def collect(self) -> None:
        """The last call's arrays caught in reference cycles (closures, a traceback's frames) go now, not when the
        collector next runs."""
        gc.collect()
        if self._freeze:
            gc.freeze()
            self._frozen = True

    def before(self, shape: tuple[int, ...]) -> None:
        """Before a call of ``shape``: :meth:`collect` when it is large (more than :data:`LARGE_CALL` values)."""
        if math.prod(shape) > LARGE_CALL:
            self.collect()

    def __exit__(self, *exc: object) -> None:
        if self._frozen:
            gc.unfreeze()


def each_call(recorded: Any, judge: Callable[[int, Any, Any], T]) -> list[T]:
    """``judge(index, call, loaded)`` for every selected call of ``recorded`` (a :class:`~bnprobe.engine.recorded
    .Recorded`) in forward order: ``call`` its :class:`~bnprobe.recordings.CallRef`, ``loaded`` what it loads (a
    :class:`Recording`, or an msprobe statistics dump's summaries), let go before the next call is read, so one
    call is in memory at a time.  ``judge`` returns what is kept of the call (a report: no tensors of it).  The one
    loop over a recording's calls every check runs (:func:`each_run` runs each through the kernel and the golden)."""
    out: list[T] = []
    # a large call's arrays caught in reference cycles (closures, a traceback's frames) go after it, not when the
    # collector next runs: doctor on 2.4 M-value calls held 1.7 GB more per call (each collection walking only what
    # the last call made: :class:`CallCollector`)
    with CallCollector() as collector:
        for i, c in enumerate(recorded.calls.calls):
            out.append(judge(i, c, c.load()))
            if math.prod(c.shape) > LARGE_CALL:
                collector.collect()
    return out


def each_run(recorded: Any, judge: Callable[[int, CallRun], T], modes: tuple[str, ...] | None = None,
             skip_missing: bool = False) -> list[T]:
    """``judge(index, run)`` for every selected call of ``recorded`` (a :class:`~bnprobe.engine.recorded
    .Recorded`) in forward order, each call run through its kernel and the golden (:func:`run_call`) and let go
    before the next call is read (:func:`each_call`; ``modes``: the modes to run, None for every mode each call
    recorded).  ``judge`` returns what is kept of the call (a report: no tensors of it)."""
    recorded.calls.require_tensors("running a recorded call")
    # only outputs are compared: the instrumented kernels record no trace (on copies: the caller's kernel is
    # unchanged)
    kernel = outputs_only(recorded.kernel)
    ref = outputs_only(reference_for(kernel))

    def one(i: int, c: Any, rec: Recording) -> T:
        run = run_call(kernel, rec, modes=modes, index=i, label=c.label, golden=Golden(ref, rec),
                       skip_missing=skip_missing)
        # what the reader assumed (MindSpore's ε, ...), said by every command
        run.notes[:0] = recording_notes(run.recording)
        return judge(i, run)

    return each_call(recorded, one)


def recording_notes(rec: Recording) -> list[str]:
    """What the dump's reader noted on this call (a scalar it assumed, a gradient it told apart), as notes."""
    return [str(n) for n in rec.meta.get("notes", ()) if isinstance(n, str)]

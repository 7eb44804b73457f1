"""bnprobe shrink: reduce a failing BatchNorm case to a minimal one that still fails.

Channels first (they are independent in BatchNorm, so bisection keeps a failing half), then the
batch, then each spatial axis, then the values: the coarsest rounding (fewest significant bits)
that still fails, then element by element toward the channel's mean.  Deterministic, bounded in
time.  The result is written as ``x.npy``, a bnprobe dump of the adapter on it, and the exact
command that replays the failure.

A recorded call's x can be shrunk with its own γ, β, running statistics, eps, momentum and parameter
format (:class:`RecordedParams`): the per-channel values follow the channels that are kept.  A dump
itself cannot be shrunk (it answers only its own inputs); shrink reruns a runnable adapter.

A LayerNorm, RMSNorm, GroupNorm or InstanceNorm input (:class:`FamilyLayer`) is shrunk in the layer's (rows, R)
view: fewer rows first (the leading dims of a LayerNorm or RMSNorm, the batch and whole groups of a GroupNorm, the
batch and channels of an InstanceNorm), then a shorter R (the normalised trailing dims, which the layer's
normalised shape follows; the spatial dims of the others), then the values, toward each row's mean.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnprobe._loading import binds, load_callable, raised
from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.registry import as_adapter
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.kernel import one_mode
from bnprobe.engine.result import Analysis

__all__ = ["ShrinkResult", "shrink", "compare_predicate", "overflow_predicate", "load_predicate", "recorded_case",
           "generated_case", "predicate_for",
           "RecordedParams", "runnable", "check_x", "FamilyLayer"]

Predicate = Callable[..., bool]  # f(x) -> True when the case fails (built-in ones also take channels=)


@dataclass(frozen=True)
class RecordedParams:
    """A recorded call's per-channel parameters and scalars, kept with its x while it shrinks."""

    gamma: np.ndarray | None
    beta: np.ndarray | None
    running_mean: np.ndarray | None
    running_var: np.ndarray | None
    eps: float
    momentum: float | None
    params: str  # same or fp32
    source: str = ""

    @classmethod
    def of(cls, rec: Any, source: str = "") -> RecordedParams:
        """The parameters and scalars of a :class:`~bnprobe.recordings.Recording`."""
        ci = rec.call()
        return cls(ci.gamma, ci.beta, ci.running_mean, ci.running_var, rec.eps, rec.momentum,
                   ci.params, source)

    def channels(self, idx: np.ndarray | None) -> RecordedParams:
        """The same parameters for the kept channels ``idx`` (all when None)."""
        if idx is None:
            return self
        pick = lambda v: None if v is None else np.asarray(v, dtype=np.float64)[idx]  # noqa: E731
        return RecordedParams(pick(self.gamma), pick(self.beta), pick(self.running_mean), pick(self.running_var),
                              self.eps, self.momentum, self.params, self.source)

    def inputs(self, x: np.ndarray) -> dict[str, np.ndarray | None]:
        """x with these parameters, running statistics (0 and 1 where none were recorded) and dy (seeded by x's
        shape: the same for the predicate, the dump written and its replay)."""
        c = x.shape[1]
        return {"x": x, "gamma": self.gamma, "beta": self.beta,
                "running_mean": np.zeros(c) if self.running_mean is None else self.running_mean,
                "running_var": np.ones(c) if self.running_var is None else self.running_var,
                "dy": np.random.default_rng([0, 3]).standard_normal(x.shape)}

    def call(self, x: np.ndarray, dtype: str) -> Any:
        """The call of x in ``dtype`` with the inputs of :meth:`inputs`, these scalars and parameter format (a
        :class:`~bnprobe.core.call.BNCall`)."""
        from bnprobe.core.call import BNCall

        ins = self.inputs(x)
        return BNCall(x, self.gamma, self.beta, ins["running_mean"], ins["running_var"], ins["dy"], self.eps,
                      self.momentum, dtype=dtype, params=self.params)

    def recording(self, x: np.ndarray, dtype: str, modes: tuple[str, ...]) -> Any:
        """The inputs of :meth:`inputs` as a Recording without outputs: what compare-precision runs an adapter
        on (``--input DIR``), each tensor rounded to its format."""
        from bnprobe.engine.run import generated_call

        return generated_call(self.call(x, dtype), modes=modes, label=self.source or "shrink")

    def record(self, adapter: KernelAdapter, x: np.ndarray, dtype: str, modes: tuple[str, ...]) -> Any:
        """A recording of ``adapter`` on :meth:`inputs`."""
        from bnprobe.recordings import record

        return record(adapter, self.call(x, dtype), modes=modes,
                      meta={"training": mode_training(modes), "shrunk_from": self.source})


@dataclass(frozen=True)
class FamilyLayer:
    """A LayerNorm, RMSNorm, GroupNorm or InstanceNorm whose input is shrunk, described so that it follows x's shape
    as x shrinks: LayerNorm and RMSNorm normalise x's last ``trailing`` dims, GroupNorm puts ``per_group`` channels
    in each group."""

    norm: str
    trailing: int = 1
    per_group: int = 1

    @classmethod
    def of(cls, norm: str, shape: tuple[int, ...], normalized_shape: tuple[int, ...] | None = None,
           groups: int | None = None) -> FamilyLayer:
        """The layer of a ``norm`` call on x of ``shape`` (checked: each problem in one line)."""
        from bnprobe.kernels.layout import NormShape

        sh = NormShape.of(norm, shape, normalized_shape, groups)
        return cls(norm, len(sh.normalized) if norm in ("layer", "rms") else 1,
                   shape[1] // sh.groups if norm == "group" else 1)

    def shape(self, x_shape: tuple[int, ...]) -> Any:
        """The layer's :class:`~bnprobe.kernels.layout.NormShape` on x of ``x_shape``."""
        from bnprobe.kernels.layout import NormShape

        return NormShape.of(self.norm, x_shape, **self.options(x_shape))

    def options(self, x_shape: tuple[int, ...]) -> dict[str, Any]:
        """normalized_shape and groups on x of ``x_shape``."""
        if self.norm in ("layer", "rms"):
            return {"normalized_shape": tuple(x_shape[len(x_shape) - self.trailing:]), "groups": None}
        return {"normalized_shape": None, "groups": x_shape[1] // self.per_group if self.norm == "group" else None}

    def flags(self, x_shape: tuple[int, ...]) -> str:
        """The command-line options naming the layer on x of ``x_shape``."""
        o = self.options(x_shape)
        if self.norm in ("layer", "rms"):
            return f"--norm {self.norm} --normalized-shape {','.join(map(str, o['normalized_shape']))}"
        return f"--norm {self.norm}" + (f" --num-groups {o['groups']}" if self.norm == "group" else "")

    def axes(self, ndim: int) -> list[tuple[int, int, str]]:
        """(axis, step, what) to bisect in order: the rows' axes first, then R's (GroupNorm's channels in whole
        groups)."""
        if self.norm in ("layer", "rms"):
            lead = ndim - self.trailing
            return [(a, 1, f"rows (axis {a})") for a in range(lead)] + \
                [(a, 1, f"R (axis {a})") for a in range(lead, ndim)]
        second = (1, self.per_group, "rows (groups)") if self.norm == "group" else (1, 1, "rows (channels)")
        return [(0, 1, "rows (batch)"), second] + [(a, 1, f"R (axis {a})") for a in range(2, ndim)]


def mode_training(modes: tuple[str, ...]) -> bool:
    """Whether a recording of ``modes`` is of a training call (an inference-only one is not)."""
    return "train" in modes or "backward" in modes


def runnable(adapter: str | KernelAdapter) -> KernelAdapter:
    """The adapter to rerun on smaller inputs; a dump (it answers only its own inputs) is an error."""
    a = as_adapter(adapter)
    if a.capabilities().recorded:
        raise BNProbeError(f"{a.name} cannot be rerun on smaller inputs: shrink needs a runnable adapter; give the "
                           f"recording as {named('input')} DIR[#CALL] with {named('adapter')} torch, emulated:fp16, "
                           "... to shrink its x")
    return a


def check_x(x: np.ndarray) -> None:
    """Refuse an input shrink cannot run: not 2 to 5 dimensions, or an empty dimension (no channel, batch or
    spatial extent)."""
    shape = np.shape(x)
    if not 2 <= len(shape) <= 5:
        raise BNProbeError(f"x must have 2 to 5 dimensions (N, C[, ...]), got shape {shape}")
    if 0 in shape:
        raise BNProbeError(f"x has shape {shape}: shrink needs at least one value along every dimension")


def _record_modes(mode: str) -> tuple[str, ...]:
    return {"train": ("train",), "infer": ("infer",), "backward": ("train", "backward")}[mode]


def _predicate(fails_on: Callable[[np.ndarray, np.ndarray | None], bool], mode: str) -> Predicate:
    """A predicate on x (and the channels kept) from ``fails_on``: x checked first; a training batch of one
    value per channel (no batch statistics) never fails."""

    def fails(x: np.ndarray, channels: np.ndarray | None = None) -> bool:
        check_x(x)
        if mode != "infer" and x.size // x.shape[1] < 2:
            return False
        return fails_on(x, channels)

    fails.takes_channels = True  # type: ignore[attr-defined]
    return fails


def _family_predicate(fails_on: Callable[[np.ndarray], bool], layer: FamilyLayer, mode: str) -> Predicate:
    """A predicate on a family layer's x from ``fails_on``: x checked first; a shape the layer does not take, or
    rows of one value (no statistics to judge), never fails."""
    if mode == "infer":
        from bnprobe.core.call import NORM_NAMES

        raise BNProbeError(f"{NORM_NAMES[layer.norm]} keeps no running statistics: its inference is its training "
                           f"forward; shrink {named('mode')} train or backward")

    def fails(x: np.ndarray) -> bool:
        check_x(x)
        try:
            if layer.shape(x.shape).r < 2:
                return False
        except BNProbeError:
            return False
        return fails_on(x)

    return fails


def compare_predicate(adapter: str | KernelAdapter, against: str = "reference", dtype: str = "fp16",
                      mode: str = "train", *, recorded: RecordedParams | None = None,
                      params: str = "fp32", layer: FamilyLayer | None = None) -> Predicate:
    """Fails when compare-precision finds an output of ``adapter`` over the standard on x (with a recorded
    call's parameters and scalars when ``recorded`` is given, else parameters in fp32 or, ``params`` same,
    in the input's format; ``layer``: x is that layer's input, its γ, β and dy seeded as compare-precision's)."""
    from bnprobe.recordings import CallRef, RecordedCalls
    from bnprobe.engine.cases import Case, recorded_cases
    from bnprobe.checks.compare.precision import CallOptions, compare_precision

    if against != "reference":
        raise BNProbeError(f"shrink compares against the FP64 reference ({named('against')} reference)")
    a = runnable(adapter)
    if layer is not None:
        if recorded is not None:
            raise BNProbeError("a recorded call brings its own layer: shrink it without a family layer")

        def family_fails(x: np.ndarray) -> bool:
            r = compare_precision([a], (dtype,), [Case("shrink", tuple(x.shape), x=x)], mode=mode, budget=False,
                                  options=CallOptions(params=params, norm=layer.norm, **layer.options(x.shape)))
            return bool((r.rows["verdict"] == "FAIL").any())

        return _family_predicate(family_fails, layer, mode)

    def fails(x: np.ndarray, channels: np.ndarray | None) -> bool:
        if recorded is None:
            r = compare_precision([a], (dtype,), [Case("shrink", tuple(x.shape), x=x)], mode=mode, budget=False,
                                  options=CallOptions(params=params))
        else:  # the adapter on the recorded call's parameters and scalars, as compare-precision --input DIR runs it
            rec = recorded.channels(channels).recording(x, dtype, _record_modes(mode))
            call = CallRef(str(rec.meta["call"]), None, tuple(x.shape), rec.dtype, rec.training,
                           "backward" in rec.tensors, "tensor", lambda: rec)
            r = compare_precision([a], None, recorded_cases(RecordedCalls("shrink", "bnprobe", (call,))), mode=mode,
                                  budget=False)
        return bool((r.rows["verdict"] == "FAIL").any())

    return _predicate(fails, mode)


def overflow_predicate(adapter: str | KernelAdapter, dtype: str = "fp16", mode: str = "train", *,
                       recorded: RecordedParams | None = None, params: str = "fp32",
                       layer: FamilyLayer | None = None) -> Predicate:
    """Fails when the overflow scan finds an anomaly (input-borne ones excluded); ``params`` and ``layer`` as in
    :func:`compare_predicate`."""
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.core.call import BNCall

    a = runnable(adapter)
    if layer is not None:
        if recorded is not None:
            raise BNProbeError("a recorded call brings its own layer: shrink it without a family layer")

        def family_fails(x: np.ndarray) -> bool:
            rep = scan(a, BNCall(x, norm=layer.norm, **layer.options(x.shape)), dtype=dtype, mode=mode,
                       remedies=False, params=params)
            return any(not f.input_borne for f in rep.findings)

        return _family_predicate(family_fails, layer, mode)

    def fails(x: np.ndarray, channels: np.ndarray | None) -> bool:
        if recorded is None:
            rep = scan(a, x, dtype=dtype, mode=mode, remedies=False, params=params)
        else:  # as overflow --input DIR scans the dump written
            p = recorded.channels(channels)
            rep = scan(a, p.call(x, dtype), dtype=dtype, mode=mode, remedies=False, params=p.params)
        return any(not f.input_borne for f in rep.findings)

    return _predicate(fails, mode)


def load_predicate(spec: str) -> Predicate:
    """The user's predicate ``module:function``, f(x) -> True when the case fails (f(x, channels=...) when the
    function sets ``takes_channels``), checked before it is called; what it raises is a one-line error."""
    if ":" not in spec:
        raise BNProbeError(f"{named('predicate')} takes compare, overflow or module:function, got {spec!r}")
    fn = load_callable(spec, "predicate", ("x",))
    takes = bool(getattr(fn, "takes_channels", False))
    if takes and not binds(fn, None, channels=None):
        raise BNProbeError(f"predicate {spec!r} sets takes_channels but has no channels= parameter")

    def fails(x: np.ndarray, channels: np.ndarray | None = None) -> bool:
        try:
            return bool(fn(x, channels=channels) if takes else fn(x))
        except Exception as exc:  # noqa: BLE001 - a user's predicate may fail in any way
            raise BNProbeError(raised(f"predicate {spec!r}", exc)) from None

    fails.takes_channels = takes  # type: ignore[attr-defined]
    return fails


@dataclass
class ShrinkResult(Analysis):
    """The smallest failing input shrink found (``x``), the steps that got there, and the effort.  A search, not a
    check: it has no verdict of its own (``Verdict.NONE``) and passes (shrink exits 0); the check still fails on
    ``x``."""

    x: np.ndarray
    original_shape: tuple[int, ...]
    steps: list[str] = field(default_factory=list)
    evaluations: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    channels: np.ndarray | None = None  # the original channels kept, in order
    notes: list[str] = field(default_factory=list)

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per step taken."""
        import pandas as pd

        return pd.DataFrame({"step": self.steps})

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.x.shape), "elements": int(self.x.size), "original_shape": list(self.original_shape),
                "channels": None if self.channels is None else self.channels.tolist(),
                "steps": self.steps, "evaluations": self.evaluations, "seconds": round(self.seconds, 3),
                "timed_out": self.timed_out, "x": self.x.tolist(), "notes": self.notes}


def shrink(x: np.ndarray, fails: Predicate, *, seconds: float = 120.0,
           progress: Callable[[str], None] | None = None, layer: FamilyLayer | None = None) -> ShrinkResult:
    """The smallest input found that still fails ``fails`` (which must fail on ``x``); ``layer``: x is that family
    layer's input, shrunk in its (rows, R) view (:func:`shrink_family`)."""
    x = np.asarray(x, dtype=np.float64)
    check_x(x)
    if not 0 <= seconds < math.inf:
        raise BNProbeError(f"seconds must be a finite number >= 0, got {seconds}")
    if layer is not None:
        return shrink_family(x, fails, layer, seconds=seconds, progress=progress)
    res = ShrinkResult(x, tuple(x.shape))
    t0 = time.monotonic()
    chans = np.arange(x.shape[1])
    per_channel = bool(getattr(fails, "takes_channels", False))

    def test(candidate: np.ndarray, kept: np.ndarray | None = None) -> bool:
        res.evaluations += 1
        if per_channel:
            return bool(fails(np.ascontiguousarray(candidate), channels=chans if kept is None else kept))
        return bool(fails(np.ascontiguousarray(candidate)))

    if not test(x):
        raise BNProbeError("the check passes on this input: nothing to shrink")

    def out_of_time() -> bool:
        res.timed_out = time.monotonic() - t0 > seconds
        return res.timed_out

    def bisect(axis: int, label: str) -> None:
        nonlocal x, chans
        while x.shape[axis] > 1 and not out_of_time():
            h = x.shape[axis] // 2
            lo, hi = np.take(x, range(h), axis=axis), np.take(x, range(h, x.shape[axis]), axis=axis)
            c_lo, c_hi = (chans[:h], chans[h:]) if axis == 1 else (chans, chans)
            if test(lo, c_lo):
                x, chans = lo, c_lo
            elif test(hi, c_hi):
                x, chans = hi, c_hi
            else:
                break
            res.steps.append(f"{label} -> {x.shape[axis]}: shape {x.shape}")
            if progress:
                progress(res.steps[-1])

    bisect(1, "channels")
    bisect(0, "batch")
    for ax in range(2, x.ndim):
        bisect(ax, f"axis {ax}")
    # values: the coarsest rounding that still fails, then element by element toward the channel mean
    for bits in range(1, 24):
        if out_of_time():
            break
        cand = _round_bits(x, bits)
        if not np.array_equal(cand, x) and test(cand):
            x = cand
            res.steps.append(f"values rounded to {bits} significant bit(s)")
            break
    flat_idx = list(np.ndindex(*x.shape))
    if len(flat_idx) <= 256:
        for idx in flat_idx:
            if out_of_time():
                break
            channel = np.moveaxis(x, 1, 0)[idx[1]]
            target = float(_round_bits(np.array([channel.mean()]), 4)[0])
            for value in (0.0, target):
                if x[idx] == value:
                    continue
                cand = x.copy()
                cand[idx] = value
                if test(cand):
                    x = cand
                    res.steps.append(f"x{idx} -> {value:g}")
                    break
    res.x = x
    res.channels = chans
    res.seconds = time.monotonic() - t0
    return res


def shrink_family(x: np.ndarray, fails: Predicate, layer: FamilyLayer, *, seconds: float = 120.0,
                  progress: Callable[[str], None] | None = None) -> ShrinkResult:
    """The smallest input of the family ``layer`` found that still fails ``fails`` (which must fail on ``x``): each
    axis of its rows, then of R, bisected (a failing half kept; GroupNorm's channels in whole groups), then the
    coarsest rounding of the values that still fails, then value by value toward 0 or its row's mean."""
    x = np.asarray(x, dtype=np.float64)
    layer.shape(x.shape)  # (x must be the layer's input: each problem in one line)
    res = ShrinkResult(x, tuple(x.shape))
    t0 = time.monotonic()

    def test(candidate: np.ndarray) -> bool:
        res.evaluations += 1
        return bool(fails(np.ascontiguousarray(candidate)))

    if not test(x):
        raise BNProbeError("the check passes on this input: nothing to shrink")

    def out_of_time() -> bool:
        res.timed_out = time.monotonic() - t0 > seconds
        return res.timed_out

    def step(text: str) -> None:
        res.steps.append(text)
        if progress:
            progress(text)

    for axis, unit, label in layer.axes(x.ndim):
        while x.shape[axis] >= 2 * unit and not out_of_time():
            h = x.shape[axis] // unit // 2 * unit
            halves = (np.take(x, range(h), axis=axis), np.take(x, range(h, x.shape[axis]), axis=axis))
            kept = next((half for half in halves if test(half)), None)
            if kept is None:
                break
            x = kept
            step(f"{label} -> {x.shape[axis]}: shape {x.shape}")
    for bits in range(1, 24):
        if out_of_time():
            break
        cand = _round_bits(x, bits)
        if not np.array_equal(cand, x) and test(cand):
            x = cand
            step(f"values rounded to {bits} significant bit(s)")
            break
    if x.size <= 256:
        sh = layer.shape(x.shape)
        for k in range(x.size):
            if out_of_time():
                break
            i, j = divmod(k, sh.r)
            target = float(_round_bits(np.array([sh.to_rows(x)[i].mean()]), 4)[0])
            for value in (0.0, target):
                rows = sh.to_rows(x).copy()  # (to_rows may be a view of x: a candidate is a copy)
                if rows[i, j] == value:
                    continue
                rows[i, j] = value
                cand = sh.from_rows(rows)
                if test(cand):
                    x = cand
                    step(f"{_x_index(sh, i, j)} -> {value:g}")
                    break
    res.x = x
    res.seconds = time.monotonic() - t0
    return res


def _x_index(sh: Any, i: int, j: int) -> str:
    """Value ``j`` of row ``i`` of the (rows, R) view ``sh`` as x's index: ``x(n, t, d) (row i)``."""
    flat = sh.to_rows(np.arange(int(np.prod(sh.shape)), dtype=np.float64).reshape(sh.shape))[i, j]
    return f"x{tuple(int(v) for v in np.unravel_index(int(flat), sh.shape))} (row {i})"


def _round_bits(x: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e)


def recorded_case(recorded: Any, *, given: tuple[str, ...] = (), dtype: str | None = None, mode: str | None = None,
                  params: str | None = None) -> tuple[np.ndarray, RecordedParams, str, str, list[str]]:
    """The one call a recording selects (a :class:`~bnprobe.engine.recorded.Recorded`), to shrink: its x
    (channels first), its parameters and scalars, its format, the mode (``mode``, else the call's own, or where the
    kernel does not run that the first it runs: :func:`~bnprobe.core.kernel.one_mode`) and the notes of what that
    leaves out.  Refused: a recording of several calls or without tensors, options (``given``, ``dtype``,
    ``mode``, ``params``) that contradict it, and a mode the kernel does not run."""
    from bnprobe.engine.recorded import check_options

    recorded.calls.require_tensors("shrink")
    found = recorded.calls.calls
    if len(found) != 1:
        shown = ", ".join(c.label for c in found[:4]) + (", ..." if len(found) > 4 else "")
        raise BNProbeError(f"{recorded.calls.source} holds {len(found)} BatchNorm calls ({shown}); shrink takes "
                           f"one: select it with DIR#NAME or {named('calls')}")
    check_options(recorded, given=given, dtype=dtype, mode=mode, params=params)
    rec = found[0].load()
    x = rec.call().x
    x = x if rec.layout == "channels_first" or x.ndim <= 2 else np.moveaxis(x, -1, 1)
    k = recorded.kernel
    mode, left_out = one_mode(k.name, k.capabilities().modes, mode, "train" if rec.training else "infer")
    return x, RecordedParams.of(rec, found[0].label), rec.dtype, mode, [] if left_out is None else [left_out]


def generated_case(dtype: str | None = None, mode: str | None = None, params: str | None = None, *,
                   kernel: KernelAdapter | None = None) -> tuple[str, str, str, list[str]]:
    """The format, mode and parameter format to shrink a generated or given x in: as given, else fp16, train (or
    where ``kernel`` does not run it the first mode it runs: :func:`~bnprobe.core.kernel.one_mode`) and fp32 (a
    recorded call's are its own: :func:`recorded_case`); and the notes of what the mode leaves out."""
    left_out = None
    if kernel is not None:
        mode, left_out = one_mode(kernel.name, kernel.capabilities().modes, mode)
    return dtype or "fp16", mode or "train", params or "fp32", [] if left_out is None else [left_out]


def predicate_for(name: str, adapter: KernelAdapter, *, dtype: str, mode: str, recorded: RecordedParams | None,
                  params: str, layer: FamilyLayer | None = None) -> Predicate:
    """The failure to keep while shrinking: ``compare`` (vs the reference), ``overflow``, or a user's
    ``module:function``; ``layer``: of that family layer's input."""
    if name == "compare":
        return compare_predicate(adapter, dtype=dtype, mode=mode, recorded=recorded, params=params, layer=layer)
    if name == "overflow":
        return overflow_predicate(adapter, dtype=dtype, mode=mode, recorded=recorded, params=params, layer=layer)
    return load_predicate(name)

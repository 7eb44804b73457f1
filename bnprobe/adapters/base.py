"""The kernel adapter interface: one small Protocol every BatchNorm implementation is run through.

An adapter takes the call: ``train(call)``, ``infer(call)`` and ``backward_of(call, saved)`` are each handed one
:class:`~bnprobe.core.call.BNCall` (its tensors, scalars and formats), never its fields one by one, so a field
the call gains reaches every adapter without a change of their signatures.  Subclasses of :class:`BaseAdapter`
fill in ``_forward_train_impl``, ``_forward_infer_impl`` and ``_backward_impl``; the base validates the call
(shapes, channels, eps, dtype, mode), converts its inputs to the requested formats once, and checks what the
implementation returns.  The loose signature of earlier releases (``forward_train(x, gamma, ..., dtype=...)``,
``forward_infer``, ``backward``) is kept on :class:`BaseAdapter` for one release, each making the call; a plugin
that implements only those is run through :mod:`bnprobe.adapters.loose`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM, NORM_NAMES, NORMS, BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import MODES, PARAM_PRECISIONS, SAVED_KINDS, Capabilities, Saved, params_format, params_mode, \
    one_value_per_channel
from bnprobe.kernels.layout import Layout, NormShape, as_channel_vector, check_eps, check_momentum, layout_of
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.rounding import round_to

__all__ = ["Capabilities", "ForwardOutput", "BackwardOutput", "KernelAdapter", "BaseAdapter", "PARAM_PRECISIONS",
           "SAVED_KINDS", "Saved", "params_format", "params_mode", "stored_inputs", "MODES",
           "counters_only", "outputs_only", "FamilyPrepared"]


def stored_inputs(dtype: str, params: str, x: Any, dy: Any = None, gamma: Any = None, beta: Any = None,
                  running_mean: Any = None, running_var: Any = None) -> tuple[Any, ...]:
    """The inputs as a kernel in ``dtype`` stores them: x and dy rounded to ``dtype``; γ, β and the running
    statistics to the parameter format (:func:`params_format`); ``None`` stays ``None``.  (x, dy, γ, β, running
    mean, running var)."""
    pf = params_format(dtype, params)
    fmt = get_format(dtype).name
    return tuple(None if v is None else round_to(v, f) for v, f in ((x, fmt), (dy, fmt), (gamma, pf), (beta, pf),
                                                                    (running_mean, pf), (running_var, pf)))


@dataclass(frozen=True)
class ForwardOutput:
    y: np.ndarray
    saved: Saved | None = None  # training only
    running_mean: np.ndarray | None = None
    running_var: np.ndarray | None = None
    trace: Trace | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackwardOutput:
    dx: np.ndarray
    dgamma: np.ndarray
    dbeta: np.ndarray
    trace: Trace | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class KernelAdapter(Protocol):
    """What every BatchNorm implementation offers bnprobe's checks: each method takes the call."""

    name: str

    def capabilities(self) -> Capabilities: ...

    def train(self, call: BNCall) -> ForwardOutput:
        """The training forward of ``call``: its x, γ, β, running statistics, momentum, ε, dtype, params and
        layout (y, the saved statistics and the updated running statistics)."""

    def infer(self, call: BNCall) -> ForwardOutput:
        """The inference forward of ``call`` (its running statistics normalise x)."""

    def backward_of(self, call: BNCall, saved: Saved) -> BackwardOutput:
        """The backward of ``call`` (its dy, x, γ and training flag) from the statistics ``saved``."""


@dataclass(frozen=True)
class Prepared:
    """Validated inputs: x (and dy) rounded to dtype, per-channel vectors rounded to the params format."""

    lay: Layout
    dtype: str
    params: str
    x: np.ndarray
    vectors: dict[str, np.ndarray | None]
    call: BNCall | None = None  # the call these were prepared from (None for a policy's lookup)


@dataclass(frozen=True)
class FamilyPrepared:
    """A LayerNorm, RMSNorm, GroupNorm or InstanceNorm call's validated inputs: where its statistics sit
    (``shape``), x rounded to ``dtype``, γ and β (flat; None where the call gives none) rounded to the parameter
    format ``params``."""

    shape: NormShape
    dtype: str
    params: str
    x: np.ndarray
    gamma: np.ndarray | None
    beta: np.ndarray | None
    call: BNCall


@contextmanager
def _implements(adapter: Any, what: str) -> Iterator[None]:
    """A NotImplementedError from an adapter's own method (a plugin's stub) is a one-line error naming it."""
    try:
        yield
    except NotImplementedError as exc:
        text = str(exc).strip()
        raise BNProbeError(f"adapter {getattr(adapter, 'name', type(adapter).__name__)} does not implement {what}"
                           + (f" ({text.splitlines()[0]})" if text else "")) from None


class BaseAdapter:
    """Input checks and conversions shared by every adapter."""

    name: str = "base"

    def capabilities(self) -> Capabilities:
        raise BNProbeError(f"adapter {self.name} does not implement capabilities()")

    def __repr__(self) -> str:
        return f"<adapter {self.name}>"

    # ---- checks ------------------------------------------------------------------------------
    def _prepare(self, mode: str, x: np.ndarray, dtype: str, layout: str, params: str,
                 vectors: dict[str, tuple[Any, float | None, bool]], exact: tuple[str, ...] = (),
                 call: BNCall | None = None) -> Prepared:
        """Validate; round x to dtype and the per-channel vectors to the params format (those named
        in ``exact`` are kept as given: saved statistics are whatever the kernel saved)."""
        caps = self.capabilities()
        if mode not in caps.modes:
            raise BNProbeError(f"adapter {self.name} does not support {mode} (it supports {', '.join(caps.modes)})")
        fmt = get_format(dtype).name
        if fmt not in caps.formats:
            raise BNProbeError(f"adapter {self.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
        if layout not in caps.layouts:
            raise BNProbeError(f"adapter {self.name} does not support layout {layout}")
        lay = layout_of(x, layout)
        pf = params_format(fmt, params)
        out: dict[str, np.ndarray | None] = {}
        for name, (value, default, required) in vectors.items():
            if value is None and not required and default is None:
                out[name] = None
                continue
            v = as_channel_vector(name, value, lay, default)
            out[name] = v if name in exact else round_to(v, pf)
        with np.errstate(invalid="ignore"):
            xr = round_to(np.asarray(x, dtype=np.float64), fmt)
        return Prepared(lay, fmt, pf, xr, out, call)

    # ---- the public, checked entry points: each takes the call -------------------------------
    def train(self, call: BNCall) -> ForwardOutput:
        """The training forward of ``call`` (x, γ, β, running statistics, momentum, ε, dtype, params, layout)."""
        c = call
        if c.norm != "batch":
            return self._family_forward(c, training=True)
        if (c.running_mean is None) != (c.running_var is None):
            raise BNProbeError("give both running_mean and running_var, or neither")
        p = self._prepare("train", c.x, c.dtype, c.layout, c.params, {
            "gamma": (c.gamma, 1.0, False), "beta": (c.beta, 0.0, False),
            "running_mean": (c.running_mean, None, False), "running_var": (c.running_var, None, False)}, call=c)
        if p.lay.reduce_size < 2 and not self.capabilities().training_r1:
            raise BNProbeError(one_value_per_channel(p.lay.shape))
        with _implements(self, "training forward"):
            out = self._forward_train_impl(p, momentum=check_momentum(c.momentum), eps=check_eps(c.eps))
        self._check_forward(out, p, training=True)
        return out

    def infer(self, call: BNCall) -> ForwardOutput:
        """The inference forward of ``call`` (x, γ, β and the running statistics it normalises with; ε, dtype,
        params, layout)."""
        c = call
        if c.norm != "batch":
            return self._family_forward(c, training=False)
        p = self._prepare("infer", c.x, c.dtype, c.layout, c.params, {
            "gamma": (c.gamma, 1.0, False), "beta": (c.beta, 0.0, False),
            "running_mean": (c.running_mean, None, True), "running_var": (c.running_var, None, True)}, call=c)
        with _implements(self, "inference forward"):
            out = self._forward_infer_impl(p, eps=check_eps(c.eps))
        self._check_forward(out, p, training=False)
        return out

    def backward_of(self, call: BNCall, saved: Saved) -> BackwardOutput:
        """The backward of ``call`` (dy, x, γ, the training flag; ε, dtype, params, layout) from the statistics
        ``saved`` (a training forward's, or the running statistics as a variance for an inference call)."""
        c = call
        if np.shape(c.dy) != np.shape(c.x):
            raise BNProbeError(f"dy has shape {np.shape(c.dy)} but x has shape {np.shape(c.x)}")
        if c.norm != "batch":
            return self._family_backward(c, saved)
        if not isinstance(saved, Saved) or saved.kind not in SAVED_KINDS:
            raise BNProbeError("saved must be a Saved(mean, kind='invstd'|'var', value) from a training forward")
        p = self._prepare("backward", c.x, c.dtype, c.layout, c.params, {
            "gamma": (c.gamma, 1.0, False), "saved_mean": (saved.mean, None, True),
            "saved_value": (saved.value, None, True)}, exact=("saved_mean", "saved_value"), call=c)
        if c.training and p.lay.reduce_size < 2 and not self.capabilities().training_r1:
            raise BNProbeError("training-mode backward needs more than one value per channel")
        dyr = round_to(np.asarray(c.dy, dtype=np.float64), p.dtype)
        sv = Saved(p.vectors["saved_mean"], saved.kind, p.vectors["saved_value"])  # type: ignore[arg-type]
        with _implements(self, "backward"):
            out = self._backward_impl(p, dyr, sv, eps=check_eps(c.eps), training=c.training)
        if out.dx.shape != p.lay.shape or out.dgamma.shape != (p.lay.channels,) or \
                out.dbeta.shape != (p.lay.channels,):
            raise BNProbeError(f"adapter {self.name} returned gradients of the wrong shape")
        return out

    # ---- the family layers: LayerNorm, RMSNorm, GroupNorm and InstanceNorm calls -------------------------------
    def _family_prepare(self, mode: str, call: BNCall) -> FamilyPrepared:
        """Validate a family call (the layer, its format, shape, parameters) and round its inputs, each problem in
        one line."""
        c, caps = call, self.capabilities()
        if c.norm not in NORMS:
            raise BNProbeError(f"norm must be one of {', '.join(NORMS)}, got {c.norm!r}")
        if c.norm not in caps.norms:
            runs = ", ".join(NORM_NAMES[n] for n in NORMS if n in caps.norms)
            raise BNProbeError(f"adapter {self.name} runs {runs} only, not {NORM_NAMES[c.norm]}")
        if mode not in caps.modes:
            raise BNProbeError(f"adapter {self.name} does not support {mode} (it supports {', '.join(caps.modes)})")
        fmt = get_format(c.dtype).name
        if fmt not in caps.formats:
            raise BNProbeError(f"adapter {self.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
        if c.layout != "channels_first":
            raise BNProbeError(f"{NORM_NAMES[c.norm]} takes x as it is laid out (layout channels_first), not "
                               f"{c.layout}")
        if c.running_mean is not None or c.running_var is not None:
            raise BNProbeError(f"{NORM_NAMES[c.norm]} is run without running statistics (InstanceNorm's "
                               "track_running_stats is not run)")
        if c.norm == "rms" and c.beta is not None:
            raise BNProbeError("RMSNorm has no β (bias): give none")
        shape = NormShape.of(c.norm, np.shape(c.x), c.normalized_shape, c.groups)
        if not math.isfinite(c.weight_offset):
            raise BNProbeError(f"weight_offset must be finite, got {c.weight_offset}")
        pf = params_format(fmt, c.params)
        vec: dict[str, np.ndarray | None] = {}
        for name, v in (("gamma", c.gamma), ("beta", c.beta)):
            if v is None:
                vec[name] = None
                continue
            a = np.asarray(v, dtype=np.float64)
            if a.shape != shape.param_shape and not (a.ndim == 1 and a.size == math.prod(shape.param_shape)):
                raise BNProbeError(f"{name} must have shape {list(shape.param_shape)} for this "
                                   f"{NORM_NAMES[c.norm]}, got {list(a.shape)}")
            vec[name] = round_to(a.reshape(-1), pf)
        with np.errstate(invalid="ignore"):
            xr = round_to(np.asarray(c.x, dtype=np.float64), fmt)
        return FamilyPrepared(shape, fmt, pf, xr, vec["gamma"], vec["beta"], c)

    def _family_forward(self, call: BNCall, *, training: bool) -> ForwardOutput:
        """A family call's forward: its statistics are the input's own in training and in inference alike (no
        running statistics), so inference is the same forward without the saved statistics."""
        p = self._family_prepare("train" if training else "infer", call)
        with _implements(self, f"{NORM_NAMES[call.norm]}'s forward"):
            out = self._family_forward_impl(p, eps=check_eps(call.eps))
        if np.shape(out.y) != p.shape.shape:
            raise BNProbeError(f"adapter {self.name} returned y of shape {np.shape(out.y)}, not {p.shape.shape}")
        rows = p.shape.rows
        if out.saved is None and self._family_unsaved(call.norm):  # (a recording of a composite: none saved)
            return out if training else ForwardOutput(out.y, None, None, None, out.trace, out.meta)
        if out.saved is None or np.size(out.saved.value) != rows or \
                (out.saved.mean is None) != (call.norm == "rms") or \
                (out.saved.mean is not None and np.size(out.saved.mean) != rows):
            raise BNProbeError(f"adapter {self.name} must return {NORM_NAMES[call.norm]}'s statistics, one per row "
                               f"({rows})")
        return out if training else ForwardOutput(out.y, None, None, None, out.trace, out.meta)

    def _family_unsaved(self, norm: str) -> bool:
        """Whether the adapter's forward of layer ``norm`` returns no statistics (it declares so)."""
        caps = self.capabilities()
        return caps.saved == "none" or norm in caps.unsaved_norms

    def _family_backward(self, call: BNCall, saved: Saved | None) -> BackwardOutput:
        """A family call's dx, dγ and dβ from the statistics its forward saved (per row: mean, None for RMSNorm, and
        rstd; None where the adapter's forward of the layer saves none)."""
        p = self._family_prepare("backward", call)
        rows = p.shape.rows
        # (saved None from a forward that saves none: its backward recomputes them)
        unsaved = saved is None and self._family_unsaved(call.norm)
        if not unsaved and (not isinstance(saved, Saved) or saved.kind != "invstd" or np.size(saved.value) != rows or
                            (saved.mean is None) != (call.norm == "rms") or
                            (saved.mean is not None and np.size(saved.mean) != rows)):
            raise BNProbeError(f"saved must be {NORM_NAMES[call.norm]}'s forward statistics: Saved(mean, 'invstd', "
                               f"rstd) with one value per row ({rows}){', mean None' if call.norm == 'rms' else ''}")
        dyr = round_to(np.asarray(call.dy, dtype=np.float64), p.dtype)
        with _implements(self, f"{NORM_NAMES[call.norm]}'s backward"):
            out = self._family_backward_impl(p, dyr, saved, eps=check_eps(call.eps))
        ps = p.shape.param_shape
        if np.shape(out.dx) != p.shape.shape or np.shape(out.dgamma) != ps or \
                (out.dbeta is not None and np.shape(out.dbeta) != ps):
            raise BNProbeError(f"adapter {self.name} returned gradients of the wrong shape")
        return out

    # ---- the loose signature of earlier releases, kept for one release: each makes the call ---------------
    def forward_train(self, x: np.ndarray, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
                      running_mean: np.ndarray | None = None, running_var: np.ndarray | None = None, *,
                      dtype: str, momentum: float | None = MOMENTUM, eps: float = EPS,
                      layout: str = "channels_first", params: str = "fp32") -> ForwardOutput:
        """``train`` of the call these make (the loose signature: kept for one release)."""
        return self.train(BNCall(x, gamma, beta, running_mean, running_var, eps=eps, momentum=momentum,
                                 dtype=dtype, params=params, layout=layout))

    def forward_infer(self, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
                      running_mean: np.ndarray, running_var: np.ndarray, *, dtype: str, eps: float = EPS,
                      layout: str = "channels_first", params: str = "fp32") -> ForwardOutput:
        """``infer`` of the call these make (the loose signature: kept for one release)."""
        return self.infer(BNCall(x, gamma, beta, running_mean, running_var, eps=eps, training=False, dtype=dtype,
                                 params=params, layout=layout))

    def backward(self, dy: np.ndarray, x: np.ndarray, gamma: np.ndarray | None, saved: Saved, *, dtype: str,
                 eps: float = EPS, training: bool = True, layout: str = "channels_first",
                 params: str = "fp32") -> BackwardOutput:
        """``backward_of`` the call these make (the loose signature: kept for one release)."""
        return self.backward_of(BNCall(x, gamma, dy=dy, eps=eps, training=training, dtype=dtype, params=params,
                                       layout=layout), saved)

    def _check_forward(self, out: ForwardOutput, p: Prepared, *, training: bool) -> None:
        """The base promises these shapes to every check; an adapter that breaks them is a bug."""
        if np.shape(out.y) != p.lay.shape:
            raise BNProbeError(f"adapter {self.name} returned y of shape {np.shape(out.y)}, not {p.lay.shape}")
        if training and self.capabilities().saved != "none":
            if out.saved is None or out.saved.kind != self.capabilities().saved:
                raise BNProbeError(f"adapter {self.name} must return the saved statistics it declares")
            for v in (out.saved.mean, out.saved.value):
                if np.shape(v) != (p.lay.channels,):
                    raise BNProbeError(f"adapter {self.name} returned saved statistics of the wrong shape")

    # ---- to implement -------------------------------------------------------------------------
    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        raise BNProbeError(f"adapter {self.name} does not implement training forward")

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        raise BNProbeError(f"adapter {self.name} does not implement inference forward")

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        raise BNProbeError(f"adapter {self.name} does not implement backward")

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        raise BNProbeError(f"adapter {self.name} does not implement {NORM_NAMES[p.shape.norm]}")

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved | None, *,
                              eps: float) -> BackwardOutput:
        raise BNProbeError(f"adapter {self.name} does not implement {NORM_NAMES[p.shape.norm]}'s backward")


def counters_only(adapter: Any) -> Any:
    """``adapter``, or for one that keeps its traces' arrays (``keep_arrays``) a copy keeping counters and ranges
    only: for checks that compare outputs and need no intermediates.  The caller's adapter is not changed."""
    if not getattr(adapter, "keep_arrays", False):
        return adapter
    twin = copy.copy(adapter)
    twin.keep_arrays = False
    return twin


def outputs_only(adapter: Any) -> Any:
    """``adapter``, or for one that traces its runs (``counters``) a copy keeping no trace at all: the same outputs
    bit for bit, without counting every stage's events, for checks that read the outputs alone.  The caller's
    adapter is not changed."""
    if not getattr(adapter, "counters", False):
        return counters_only(adapter)
    twin = copy.copy(adapter)
    twin.keep_arrays = False
    twin.counters = False
    return twin

"""Tensor layouts and input validation for the kernels: BatchNorm's channels, and where the family layers
(LayerNorm, RMSNorm, GroupNorm, InstanceNorm) take their statistics (:class:`NormShape`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.call import NORM_NAMES, NORMS
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.numerics.arith import fits_float32

__all__ = ["LAYOUTS", "Layout", "layout_of", "as_channel_vector", "check_eps", "check_momentum", "reduce_axes",
           "channel_column", "to_channels_first", "element_at", "FAMILY", "NormShape"]

LAYOUTS: tuple[str, ...] = ("channels_first", "channels_last")


FAMILY: tuple[str, ...] = tuple(n for n in NORMS if n != "batch")  # the layers this module runs


@dataclass(frozen=True)
class NormShape:
    """Where a family layer's statistics and parameters sit in x of ``shape`` (channels first): ``rows`` groups of
    ``r`` values each normalised by their own statistics, and γ, β of ``param_shape``."""

    norm: str
    shape: tuple[int, ...]
    normalized: tuple[int, ...] = ()  # layer, rms: the normalised trailing dims
    groups: int = 1  # group: the channel groups (instance: one per channel)

    @classmethod
    def of(cls, norm: str, shape: Iterable[int], normalized_shape: Iterable[int] | int | None = None,
           groups: int | None = None) -> NormShape:
        """The validated shape of a ``norm`` call on x of ``shape`` (each problem in one line)."""
        shape = tuple(int(d) for d in shape)
        if norm not in FAMILY:
            raise BNProbeError(f"norm must be one of {', '.join(FAMILY)} here, got {norm!r}")
        if any(d < 1 for d in shape):
            raise BNProbeError(f"x has an empty dimension (shape {shape})")
        if norm in ("layer", "rms"):
            if groups is not None:
                raise BNProbeError(f"groups apply to GroupNorm, not to {NORM_NAMES[norm]}")
            if not shape:
                raise BNProbeError("x must have at least one dimension")
            ns = (shape[-1],) if normalized_shape is None else (
                (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer))
                else tuple(int(d) for d in normalized_shape))
            if not ns or len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
                raise BNProbeError(f"normalized_shape {list(ns)} is not x's trailing dimensions (x has shape "
                                   f"{list(shape)})")
            return cls(norm, shape, ns)
        if normalized_shape is not None:
            raise BNProbeError(f"normalized_shape applies to LayerNorm and RMSNorm, not to {NORM_NAMES[norm]}")
        if len(shape) < (2 if norm == "group" else 3):
            raise BNProbeError(f"{NORM_NAMES[norm]} takes x as (N, C{', ...' if norm == 'group' else ', L, ...'}), got "
                               f"shape {list(shape)}")
        c = shape[1]
        if norm == "instance":
            if groups is not None:
                raise BNProbeError("groups apply to GroupNorm, not to the instance norm")
            return cls(norm, shape, (), c)
        if groups is None:
            raise BNProbeError("GroupNorm needs its number of groups (groups)")
        if isinstance(groups, bool) or int(groups) != groups or not 1 <= groups <= c or c % groups:
            raise BNProbeError(f"groups must divide the {c} channels, got {groups}")
        return cls(norm, shape, (), int(groups))

    @property
    def rows(self) -> int:
        """How many statistics: one per leading index (layer, rms), per (sample, group) or (sample, channel)."""
        return math.prod(self.shape) // self.r

    @property
    def r(self) -> int:
        """R: the values each statistic sees."""
        if self.norm in ("layer", "rms"):
            return math.prod(self.normalized)
        return self.shape[1] // self.groups * math.prod(self.shape[2:])

    @property
    def param_shape(self) -> tuple[int, ...]:
        """γ's and β's shape: the normalised dims (layer, rms) or (C,)."""
        return self.normalized if self.norm in ("layer", "rms") else (self.shape[1],)

    def to_rows(self, a: Any) -> np.ndarray:
        """x-shaped ``a`` as its ``(rows, R)`` view (float64)."""
        a = np.asarray(a, dtype=np.float64)
        if a.shape != self.shape:
            raise BNProbeError(f"expected shape {list(self.shape)}, got {list(a.shape)}")
        return a.reshape(self.rows, self.r)

    def from_rows(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a).reshape(self.shape)

    def expand(self, p: np.ndarray) -> np.ndarray:
        """A parameter (flat, ``param_shape``'s size) as the ``(rows, R)`` array of the value each x meets."""
        p = np.asarray(p, dtype=np.float64).reshape(-1)
        if self.norm in ("layer", "rms"):
            return np.broadcast_to(p[None, :], (self.rows, self.r))
        n, c = self.shape[0], self.shape[1]
        per_group = np.repeat(p.reshape(self.groups, c // self.groups), math.prod(self.shape[2:]), axis=1)
        return np.tile(per_group, (n, 1))

    def gather(self, a: np.ndarray) -> np.ndarray:
        """A ``(rows, R)`` array as ``(P, K)``: per parameter (flat), the K values it touches, in x's order."""
        if self.norm in ("layer", "rms"):
            return np.ascontiguousarray(a.T)
        n, c = self.shape[0], self.shape[1]
        return np.ascontiguousarray(a.reshape(n, c, -1).transpose(1, 0, 2).reshape(c, -1))



@dataclass(frozen=True)
class Layout:
    """Where the channels are in x, and how to move to and from channel-first ``(C, R)``."""

    shape: tuple[int, ...]
    layout: str

    @property
    def channel_axis(self) -> int:
        return 1 if self.layout == "channels_first" or len(self.shape) == 2 else len(self.shape) - 1

    @property
    def channels(self) -> int:
        return self.shape[self.channel_axis]

    @property
    def reduce_size(self) -> int:
        """R = N * (spatial sizes): the number of values each channel's statistics see."""
        return math.prod(self.shape) // max(self.channels, 1)

    def column(self, v: object) -> np.ndarray:
        """A per-channel vector shaped to broadcast against x along the channel axis."""
        return np.asarray(v).reshape([-1 if ax == self.channel_axis else 1 for ax in range(len(self.shape))])

    def to_cr(self, a: np.ndarray, channels: slice = slice(None), carrier: type = np.float64) -> np.ndarray:
        """The given channels of ``a`` as a channel-first ``(k, R)`` copy: float64, or float32 when
        ``carrier`` is float32 and ``a`` holds values that float32 represents exactly (float32, float16,
        bfloat16); a wider ``a`` stays float64 so that its values are not rounded here."""
        a = np.asarray(a)
        if a.shape != self.shape:
            raise BNProbeError(f"expected shape {self.shape}, got {a.shape}")
        part = np.moveaxis(a, self.channel_axis, 0)[channels]
        dtype = np.float32 if carrier is np.float32 and _exact_in_float32(a.dtype) else np.float64
        with np.errstate(invalid="ignore"):
            flat = part.reshape(part.shape[0], -1)  # a copy unless the block is contiguous already
            if np.may_share_memory(flat, a):
                return flat.astype(dtype)
            return flat.astype(dtype, copy=False)

    def view3(self, a: np.ndarray) -> np.ndarray:
        """``a`` as ``(N, C, S)`` with S the product of the other axes: a view for both layouts (a copy only
        when ``a`` itself is strided so that no view exists); row c of :meth:`to_cr` is ``[:, c, :]``
        read in order."""
        a = np.asarray(a)
        if a.shape != self.shape:
            raise BNProbeError(f"expected shape {self.shape}, got {a.shape}")
        moved = np.moveaxis(a, self.channel_axis, 1)
        return moved.reshape(moved.shape[0], moved.shape[1], -1)

    def from_cr(self, a: np.ndarray) -> np.ndarray:
        """A channel-first ``(C, R)`` array back in this layout."""
        out = np.empty(self.shape, dtype=np.asarray(a).dtype)
        self.place(out, a)
        return out

    def place(self, out: np.ndarray, a: np.ndarray, channels: slice = slice(None)) -> None:
        """Write a channel-first ``(k, R)`` block into ``out`` (shaped like x) at ``channels``."""
        view = np.moveaxis(out, self.channel_axis, 0)[channels]
        with np.errstate(invalid="ignore"):
            view[...] = a.reshape(view.shape)

    def chunks(self, max_elements: int | None) -> list[slice]:
        """Channel blocks of at most ``max_elements`` values each (one channel at least), nearly equal."""
        c, r = self.channels, self.reduce_size
        if max_elements is None or c * r <= max_elements:
            return [slice(0, c)]
        per = max(1, max_elements // r)
        n = -(-c // per)
        per = -(-c // n)
        return [slice(i, min(i + per, c)) for i in range(0, c, per)]


def _exact_in_float32(dtype: np.dtype) -> bool:
    """True when every value of ``dtype`` is exactly a float32 (float32, float16, bfloat16, FP8)."""
    try:
        return fits_float32(get_format(dtype))
    except BNProbeError:
        return False


def layout_of(x: np.ndarray, layout: str | None = None) -> Layout:
    """Validate x's rank and the layout name (None: channels_first); return the Layout."""
    layout = "channels_first" if layout is None else layout
    if layout not in LAYOUTS:
        raise BNProbeError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    shape = tuple(int(s) for s in np.shape(x))
    if not 2 <= len(shape) <= 5:
        raise BNProbeError(
            f"x must have 2 to 5 dimensions (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W); got shape {shape}")
    out = Layout(shape, layout)
    if out.channels == 0 or out.reduce_size == 0:
        raise BNProbeError(f"x has no elements to normalise (shape {shape})")
    return out


def as_channel_vector(name: str, v: object, lay: Layout, default: float | None = None) -> np.ndarray:
    """A per-channel parameter as float64 ``(C,)``; None becomes ``default`` when one is given."""
    if v is None:
        if default is None:
            raise BNProbeError(f"{name} is required")
        return np.full(lay.channels, default, dtype=np.float64)
    a = np.asarray(v)
    if a.ndim != 1 or a.shape[0] != lay.channels:
        raise BNProbeError(
            f"{name} has shape {a.shape} but x has {lay.channels} channels "
            f"(x shape {lay.shape}, {lay.layout}); expected ({lay.channels},)")
    try:
        return a.astype(np.float64)
    except (TypeError, ValueError):
        raise BNProbeError(f"{name} must hold numbers, got dtype {a.dtype}") from None


def element_at(flat: int, shape: tuple[int, ...], channel_axis: int = 1) -> str:
    """Where element ``flat`` of a tensor of ``shape`` is, as torch.testing says it: ``index (n, c, h, w)
    (channel c)``; ``channel i`` for a per-channel vector."""
    if len(shape) <= 1:
        return f"channel {flat}"
    idx = tuple(int(v) for v in np.unravel_index(flat, shape))
    return f"index {idx} (channel {idx[channel_axis]})"


def reduce_axes(x: np.ndarray) -> tuple[int, ...]:
    """The axes BatchNorm reduces over in a channels-first tensor: all but axis 1."""
    return (0,) + tuple(range(2, np.ndim(x)))


def channel_column(v: np.ndarray, ndim: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast against a channels-first tensor of ``ndim`` dimensions."""
    return np.asarray(v).reshape((1, -1) + (1,) * (ndim - 2))


def to_channels_first(a: np.ndarray | None, layout: str) -> np.ndarray | None:
    """``a`` in channels-first order (``None`` and 1-D/2-D tensors as they are)."""
    if a is None or layout == "channels_first" or np.ndim(a) <= 2:
        return a
    return np.moveaxis(np.asarray(a), -1, 1)


def check_eps(eps: float) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise BNProbeError(f"eps must be a number, got {eps!r}") from None
    if not math.isfinite(e) or e <= 0:
        raise BNProbeError(f"eps must be a finite number > 0, got {eps!r}")
    if e > 65504.0:  # BatchNorm's eps is a small regulariser; above fp16's largest value it is not even stored
        raise BNProbeError(f"eps must be at most 65504 (the largest fp16 value), got {eps!r}")
    return e


def check_momentum(momentum: float | None) -> float | None:
    if momentum is None:
        return None
    try:
        m = float(momentum)
    except (TypeError, ValueError):
        raise BNProbeError(f"momentum must be a number in [0, 1] or None, got {momentum!r}") from None
    if not 0.0 <= m <= 1.0:
        raise BNProbeError(f"momentum must be in [0, 1] (PyTorch convention) or None, got {momentum!r}")
    return m

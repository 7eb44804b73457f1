"""The monitor's per-channel profile of a tensor: min, max and the counts of NaN, ±inf, values at the format's
largest finite magnitude, zeros and subnormals.

On torch's route (:func:`reductions`, then :func:`finish`) the tensor's device reduces it to min, max and min |t| per
channel, brought to the host with the call's other numbers in one transfer; the counts take passes of their own only
where a channel has them (a non-finite or format-maximum extreme, a magnitude below the smallest normal).  torch has no
fused reduction for all of them: that is |t| and three reductions (four passes over the tensor, one of them a write).
In one pass instead, on a contiguous CPU tensor of float64, float32, float16 or bfloat16 this
module reads each value once, as the integer of its bits: |t|'s bits are the bits with the sign cleared (their
integer order is the magnitudes' order, NaN above inf), and the bits with the lower ones flipped where the sign
is set are an integer whose order is the values' order (-0 just below +0).  Integer compares and sums are exact
and vectorise, so the counts are exact and min/max are the tensor's own values: NaN where a channel has one, as
torch's ``amin``/``amax`` give.

numba is imported when the first profile is taken this way (``BNPROBE_JIT`` off, as read when the monitor
starts, or numba missing: the torch route); tensors of fewer than :data:`MIN_ELEMENTS` values take the torch
route, where the passes are cheap.  The compiled pass runs on the calling thread (:mod:`bnprobe.compiled.profile`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["MIN_ELEMENTS", "MIN_ROW", "FIELDS", "one_pass", "profile_bits", "profile_tensor", "reductions", "finish",
           "nan_inf"]

#: below this many values a tensor takes the torch route until the compiled pass is loaded for a larger one: the pass
#: is faster at every size where rows hold two values or more (9 us against torch's 50 us on 256 values, 25 against
#: 190 us on (16, 64, 4, 4)), but loading numba costs about 0.8 s and 130 MB, which a model whose tensors are all
#: small does not pay
MIN_ELEMENTS = 1 << 15
#: under ``auto``, a row (the values of one sample and channel) shorter than this takes the torch route: a (N, C)
#: input has one value per row, a channel's values lie far apart, and the kernel can be slower than torch there
#: (2.4x on (64, 2048)); from two values a row it is faster (8x on ResNet-50's (8, 2048, 4, 4) at 112x112)
MIN_ROW = 2
#: what a profile holds per channel, in order
FIELDS = ("min", "max", "nan", "inf", "at_max", "zero", "subnormal")

# a float format's bits: (its code for the kernel, the integer dtype of its width, the mask clearing the sign, inf's
# bits, the largest finite value's bits, the smallest normal's bits)
_BITS: dict[str, tuple[int, Any, int, int, int, int]] = {
    "float64": (0, np.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000, 0x7FEF_FFFF_FFFF_FFFF,
                0x0010_0000_0000_0000),
    "float32": (1, np.int32, 0x7FFF_FFFF, 0x7F80_0000, 0x7F7F_FFFF, 0x0080_0000),
    "float16": (2, np.int16, 0x7FFF, 0x7C00, 0x7BFF, 0x0400),
    "bfloat16": (3, np.int16, 0x7FFF, 0x7F80, 0x7F7F, 0x0080),
}


def one_pass(t: torch.Tensor, mode: str) -> bool:
    """Whether ``t``'s profile is taken in one pass here: a contiguous CPU tensor of a known format, large enough
    (:data:`MIN_ELEMENTS`, or any size once the pass is loaded in this process), with rows of at least
    :data:`MIN_ROW` values, the compiled route allowed (``mode``: :func:`bnprobe.compiled.jit.jit_mode`'s, read when
    the monitor started)."""
    return (t.dtype in _torch_bits() and t.device.type == "cpu" and t.dim() >= 2 and t.is_contiguous()
            and not t.is_neg() and mode != "off"
            and (mode == "on" or ((_STATE["kernel"] is not None or t.numel() >= MIN_ELEMENTS)
                                  and t.numel() >= MIN_ROW * t.shape[0] * t.shape[1])))


def profile_bits(bits: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """The profile of a tensor given as its bit patterns ``bits`` (shape (N, C, S), the integer dtype of ``dtype``'s
    width), per channel: :data:`FIELDS` as float64 arrays of C values."""
    kind, width, mask, inf, big, tiny = _BITS[dtype]
    if bits.dtype != width or bits.ndim != 3:
        raise ValueError(f"profile_bits takes (N, C, S) {np.dtype(width).name} bits of {dtype}, not "
                         f"{bits.ndim}-d {bits.dtype.name}")
    out = np.empty((7, bits.shape[1]))
    kernel = _STATE["kernel"]
    if kernel is None:  # the first call: numba imported, the kernel loaded (said on a terminal if it compiles)
        from bnprobe.compiled.profile import profile
        from bnprobe.kernels.fused import call_compiled

        call_compiled(profile, np.ascontiguousarray(bits), kind, mask, inf, big, tiny, out)
        _STATE["kernel"] = profile
    else:  # (no lock: the kernel runs on its caller's thread, with no pool of threads to share)
        kernel(np.ascontiguousarray(bits), kind, mask, inf, big, tiny, out)
    return dict(zip(FIELDS, out))


def profile_tensor(t: torch.Tensor) -> dict[str, np.ndarray]:
    """:func:`profile_bits` of a tensor :func:`one_pass` accepts (channels on dim 1)."""
    width, name = _torch_bits()[t.dtype]
    return profile_bits(t.detach().view(width).numpy().reshape(t.shape[0], t.shape[1], -1), name)


# the compiled pass once loaded in this process (numba imported, the kernel read from its cache or compiled)
_STATE: dict[str, Any] = {"kernel": None}


def dims(t: torch.Tensor) -> tuple[int, ...]:
    """The dimensions a per-channel reduction of ``t`` (channels on dim 1) runs over."""
    return (0, *range(2, t.dim()))


def reductions(t: torch.Tensor) -> list[torch.Tensor]:
    """torch's route, on ``t``'s device and in its dtype: min, max and min |t| per channel (NaN propagates), for
    :func:`finish` once they are on the host (a non-empty tensor)."""
    import torch

    d = dims(t)
    return [torch.amin(t, dim=d), torch.amax(t, dim=d), torch.amin(t.abs(), dim=d)]


def finish(t: torch.Tensor, lo: np.ndarray, hi: np.ndarray, small: np.ndarray) -> dict[str, np.ndarray]:
    """The profile of ``t`` (:data:`FIELDS`, float64 per channel) from :func:`reductions`' values on the host: the
    counts are zero where min, max and min |t| show that no channel has any, else counted on the device."""
    import torch

    fi = torch.finfo(t.dtype)
    zeros = np.zeros(t.shape[1])
    out = {"min": lo, "max": hi, "nan": zeros, "inf": zeros, "at_max": zeros, "zero": zeros, "subnormal": zeros}
    with np.errstate(invalid="ignore"):  # (a NaN extreme hides the others: counted too)
        finite = np.isfinite(lo).all() and np.isfinite(hi).all()
        below_max = (np.abs(lo) < fi.max).all() and (np.abs(hi) < fi.max).all()
        normal = (small >= fi.tiny).all()
    if finite and below_max and normal:
        return out
    d = dims(t)
    with torch.no_grad():
        if not finite:
            out["nan"], out["inf"] = nan_inf(t)
        if not below_max:
            out["at_max"] = _host(((t.abs() == fi.max).sum(dim=d)))
        if not normal:
            zero = (t == 0).sum(dim=d)
            out["zero"] = _host(zero)
            out["subnormal"] = _host((t.abs() < fi.tiny).sum(dim=d) - zero)
    return out


def nan_inf(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The counts of NaN and of ±inf per channel of ``t``."""
    import torch

    d = dims(t)
    return _host(torch.isnan(t).sum(dim=d)), _host(torch.isinf(t).sum(dim=d))


def _host(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.to("cpu", dtype=torch.float64).numpy()


@functools.cache
def _torch_bits() -> dict[Any, tuple[Any, str]]:
    """torch's float dtypes profiled here: (the integer dtype of their width, their name)."""
    import torch

    return {torch.float64: (torch.int64, "float64"), torch.float32: (torch.int32, "float32"),
            torch.float16: (torch.int16, "float16"), torch.bfloat16: (torch.int16, "bfloat16")}

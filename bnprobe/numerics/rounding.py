"""Rounding real values (held in float64) to a narrower floating-point format.

Every function here takes and returns float64 arrays: a "value of format F" is a
float64 that is exactly representable in F.  Keeping the carrier wide makes each
rounding explicit and lets callers see the value before and after rounding.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import FP64, Format, get_format

__all__ = [
    "ROUNDINGS",
    "OVERFLOWS",
    "SUBNORMALS",
    "RoundingSpec",
    "round_to",
    "round_detail",
    "to_odd_fp32",
    "is_representable",
    "fp16_as",
    "held_exactly",
]


ROUNDINGS: tuple[str, ...] = ("nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic")
OVERFLOWS: tuple[str, ...] = ("ieee", "saturate")
SUBNORMALS: tuple[str, ...] = ("keep", "flush")

_ROUNDING_ALIASES = {
    "nearest": "nearest_even", "rne": "nearest_even", "even": "nearest_even", "nearest_even": "nearest_even",
    "away": "nearest_away", "rna": "nearest_away", "nearest_away": "nearest_away", "ties_away": "nearest_away",
    "zero": "toward_zero", "rz": "toward_zero", "trunc": "toward_zero", "toward_zero": "toward_zero",
    "up": "up", "ru": "up", "ceil": "up", "down": "down", "rd": "down", "floor": "down",
    "stochastic": "stochastic", "sr": "stochastic",
}


def _check_mode(rounding: str, overflow: str, subnormals: str) -> str:
    key = str(rounding).lower().replace("-", "_")
    if key not in _ROUNDING_ALIASES:
        raise BNProbeError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if overflow not in OVERFLOWS:
        raise BNProbeError(f"unknown overflow mode {overflow!r}; valid: {', '.join(OVERFLOWS)}")
    if subnormals not in SUBNORMALS:
        raise BNProbeError(f"unknown subnormal mode {subnormals!r}; valid: {', '.join(SUBNORMALS)}")
    return _ROUNDING_ALIASES[key]


@dataclass(frozen=True)
class RoundingSpec:
    """How results are rounded: mode, overflow behaviour and subnormal handling."""

    rounding: str = "nearest_even"
    overflow: str = "ieee"
    subnormals: str = "keep"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounding", _check_mode(self.rounding, self.overflow, self.subnormals))


def to_odd_fp32(values: np.ndarray) -> np.ndarray:
    """Round float64 values to float32 with round-to-odd (returned as float32).

    Round-to-odd to p' bits followed by any rounding to p <= p' - 2 bits equals
    direct rounding (Boldo & Melquiond 2008).  binary32 has p' = 24, so this
    lets bf16 (p = 8) be rounded correctly from float64 through a float32 cast.
    """
    v = np.asarray(values, dtype=np.float64)
    y = v.astype(np.float32)  # nearest-even
    with np.errstate(invalid="ignore"):
        inexact = (y.astype(np.float64) != v) & np.isfinite(y)
    bits = y.view(np.uint32)
    even = (bits & np.uint32(1)) == 0
    fix = inexact & even
    if fix.any():
        # The two float32 neighbours of v differ in the last bit, so exactly one
        # is odd; when nearest-even picked the even one, step one ulp toward v.
        toward_zero = np.abs(y.astype(np.float64)) > np.abs(v)
        step = np.where(toward_zero, np.uint32(0xFFFFFFFF), np.uint32(1))  # -1 or +1 on the magnitude
        bits = bits.copy()
        bits[fix] = bits[fix] + step[fix]
        y = bits.view(np.float32)
    return y


def _cast_nearest_even(v: np.ndarray, fmt: Format) -> np.ndarray | None:
    """float32/float64 ``v`` rounded to nearest-even in ``fmt``'s own dtype by one cast known to be correct,
    or None if none applies."""
    name = fmt.name
    if name in ("fp64", "fp32", "fp16"):
        # numpy rounds float64->float32/float16 and float32->float16 directly and correctly
        return v.astype(fmt.dtype)
    if name == "bf16":
        # ml_dtypes' float64->bf16 cast double-rounds through float32; round to odd first.
        src = v if v.dtype == np.float32 else to_odd_fp32(v)
        return src.astype(get_format("bf16").dtype)
    return None


def fp16_as(x: np.ndarray, dtype: Any) -> np.ndarray:
    """``x.astype(np.float16).astype(dtype)`` (numpy's correctly rounded cast, held in float32 or float64): a large
    float64 or float32 array in one compiled pass, without the float16 array between."""
    if x.dtype in (np.float32, np.float64) and jit_for(x.size, cheap=True):
        from bnprobe.compiled.bits import half

        return half(x, dtype)
    return x.astype(np.float16).astype(dtype)


def _nearest_even_as(v: np.ndarray, fmt: Format, dtype: Any) -> np.ndarray | None:
    """:func:`_cast_nearest_even` held in ``dtype`` (float32 or float64, wide enough for fmt's values)."""
    if fmt.name == "fp16" and v.dtype in (np.float32, np.float64):
        return fp16_as(v, dtype)
    r = _cast_nearest_even(v, fmt)
    return None if r is None else r.astype(dtype, copy=False)


def _fast_nearest_even(v: np.ndarray, fmt: Format) -> np.ndarray | None:
    """Correct nearest-even rounding as float64 carriers, or None if no correct cast applies."""
    return _nearest_even_as(v, fmt, np.float64)


def _round_generic(a: np.ndarray, fmt: Format, rounding: str, negative: np.ndarray,
                   rng: np.random.Generator | None) -> np.ndarray:
    """Round finite magnitudes ``a >= 0`` to fmt's precision with an unbounded exponent range.

    The magnitude is scaled by a power of two so that the format's significand
    becomes the integer part (exact in float64), rounded to an integer, and
    scaled back (exact again).  Below the smallest normal the exponent is held
    at emin, which gives gradual underflow.
    """
    with np.errstate(divide="ignore"):
        _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1): leading bit has exponent e - 1
    e = np.maximum(e - 1, fmt.emin)
    shift = fmt.mantissa_bits - e
    s = np.ldexp(a, shift)
    if rounding == "nearest_even":
        r = np.rint(s)
    elif rounding == "nearest_away":
        f = np.floor(s)
        r = f + ((s - f) >= 0.5)  # s - f is exact
    elif rounding == "toward_zero":
        r = np.floor(s)
    elif rounding == "up":
        r = np.where(negative, np.floor(s), np.ceil(s))
    elif rounding == "down":
        r = np.where(negative, np.ceil(s), np.floor(s))
    elif rounding == "stochastic":
        if rng is None:
            raise BNProbeError("stochastic rounding needs a seeded generator (pass rng= or seed=)")
        f = np.floor(s)
        r = f + (rng.random(s.shape) < (s - f))  # up with probability equal to the distance from below
    else:  # pragma: no cover - guarded by _check_mode
        raise AssertionError(rounding)
    return np.ldexp(r, -shift)


def round_detail(
    values: np.ndarray | float,
    fmt: str | Format,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    subnormals: str = "keep",
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Round and report what happened: ``(result, overflowed, saturated, flushed)``.

    ``overflowed`` marks finite inputs whose rounding with an unbounded exponent
    exceeds the format's max; ``saturated`` marks results clamped to ±max (or a
    NaN set to 0) in saturate mode; ``flushed`` marks nonzero subnormal results
    replaced by zero.
    """
    fmt = get_format(fmt)
    rounding = _check_mode(rounding, overflow, subnormals)
    v = np.asarray(values)
    with np.errstate(all="ignore"):
        if v.dtype != np.float64 and not (v.dtype == np.float32 and fmt.name == "bf16"):
            v = v.astype(np.float64)
        finite = np.isfinite(v)
        fast = None
        if rounding == "nearest_even" and fmt.has_inf:
            fast = _fast_nearest_even(v, fmt)
        if fast is not None:
            r = fast
            overflowed = finite & ~np.isfinite(r)
        else:
            v = v.astype(np.float64, copy=False)
            negative = np.signbit(v)
            mag = _round_generic(np.where(finite, np.abs(v), 0.0), fmt, rounding, negative, rng)
            overflowed = finite & (mag > fmt.max)
            r = np.where(finite, np.copysign(mag, v), v)
            if overflowed.any():
                # IEEE 754 section 7.4: directed roundings that point back toward zero give ±max.
                to_max = {"toward_zero": np.ones_like(negative), "up": negative, "down": ~negative}.get(
                    rounding, np.zeros_like(negative))
                big = np.inf if fmt.has_inf else np.nan
                r = np.where(overflowed, np.where(to_max, np.copysign(fmt.max, v), np.copysign(big, v)), r)
        r = np.asarray(r, dtype=np.float64)
        saturated = np.zeros(r.shape, dtype=bool)
        if overflow == "saturate":
            nan = np.isnan(r)
            big = np.isinf(r) | (overflowed & nan)
            saturated = nan | big
            if saturated.any():
                r = np.where(big, np.copysign(fmt.max, v), r)
                r = np.where(np.isnan(r), 0.0, r)
        flushed = np.zeros(r.shape, dtype=bool)
        if subnormals == "flush":
            flushed = (r != 0) & (np.abs(r) < fmt.tiny)
            if flushed.any():
                r = np.where(flushed, np.copysign(0.0, r), r)
    return r, overflowed, saturated, flushed


# read-only float64 arrays known to hold values of a format only (id -> (a weak reference to the array, the format)):
# rounding them to that format, or a wider one, is the array itself
_HELD: dict[int, tuple[weakref.ref, Format]] = {}


def held_exactly(a: np.ndarray, fmt: str | Format) -> np.ndarray:
    """``a``, a float64 array read from a tensor stored in ``fmt`` (each value exactly one of ``fmt``'s, no NaN), made
    read-only and noted as such: :func:`round_to` to ``fmt`` or a format holding it returns ``a`` itself (what the
    correct cast returns, value for value), instead of a rounded copy of it — the kernels and the golden run on a
    dump's call round its x and dy once each otherwise.  Returns ``a``."""
    if a.dtype == np.float64 and a.ndim and not np.isnan(a).any():
        a.flags.writeable = False
        key = id(a)
        _HELD[key] = (weakref.ref(a, lambda _ref, k=key: _HELD.pop(k, None)), get_format(fmt))
    return a


def _held_in(v: np.ndarray, f: Format) -> bool:
    """Whether ``v`` is an array :func:`held_exactly` noted, of a format that ``f`` holds, and still read-only."""
    seen = _HELD.get(id(v))
    return seen is not None and seen[0]() is v and not v.flags.writeable and f.holds(seen[1])


def round_to(
    values: np.ndarray | float,
    fmt: str | Format,
    *,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    subnormals: str = "keep",
    rng: np.random.Generator | None = None,
    seed: int | None = None,
    dtype: object = None,
) -> np.ndarray:
    """Round ``values`` to ``fmt`` and return them as float64 (each exactly a value of ``fmt``).

    dtype: the result's numpy dtype instead of float64: any dtype that holds every value of ``fmt``
    exactly, e.g. the format's own (``np.float16``, ``ml_dtypes.bfloat16``) to store the result
    compactly, or ``np.float32`` for float32 carriers.  The values are the same.

    rounding: ``nearest_even`` (default), ``nearest_away`` (ties away from zero, how
    Ascend casts BF16 outputs), ``toward_zero``, ``up``, ``down``, ``stochastic``
    (round up with probability equal to the fraction; pass ``rng`` or ``seed``).
    overflow: ``ieee`` (to ±inf; NaN for formats without inf) or ``saturate``
    (to ±max, inf to ±max, NaN to 0, as saturation-mode NPUs do).
    subnormals: ``keep`` (gradual underflow) or ``flush`` (nonzero subnormal results to ±0).
    Rounding from float64 is correct in every mode, bf16 included.
    """
    if rng is None and seed is not None:
        rng = np.random.default_rng(seed)
    if dtype is not None:
        return _round_into(values, get_format(fmt), np.dtype(dtype), rounding=rounding, overflow=overflow,
                           subnormals=subnormals, rng=rng)
    if rounding == "nearest_even" and overflow == "ieee" and subnormals == "keep":
        # the default spec needs no event masks: the correct cast alone (see _fast_nearest_even)
        f = get_format(fmt)
        v = np.asarray(values)
        if v.dtype == np.float64 and _HELD and _held_in(v, f):
            return v
        if f.has_inf and v.dtype in (np.float64, np.float32):
            with np.errstate(all="ignore"):
                fast = _fast_nearest_even(v if (v.dtype == np.float64 or f.name in ("bf16", "fp16", "fp32"))
                                          else v.astype(np.float64), f)
            if fast is not None:
                return fast
    return round_detail(values, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals, rng=rng)[0]


def _round_into(values: np.ndarray | float, fmt: Format, dtype: np.dtype, **modes: object) -> np.ndarray:
    """round_to with a result dtype other than float64 (see round_to)."""
    try:
        holder = FP64 if dtype == np.float64 else get_format(dtype)
    except BNProbeError:
        raise BNProbeError(f"dtype {dtype} cannot hold {fmt.name} values exactly") from None
    if not holder.holds(fmt):
        raise BNProbeError(f"dtype {dtype} cannot hold {fmt.name} values exactly; use a dtype at least as wide")
    v = np.asarray(values)
    default = modes["rounding"] == "nearest_even" and modes["overflow"] == "ieee" and modes["subnormals"] == "keep"
    if default and v.dtype in (np.float32, np.float64) and fmt.name in ("fp16", "bf16", "fp32"):
        with np.errstate(all="ignore"):
            out = _cast_nearest_even(v, fmt)  # straight into the format's dtype
            return out if out.dtype == dtype else out.astype(dtype)
    r = round_to(values, fmt, **modes)  # type: ignore[arg-type]
    with np.errstate(all="ignore"):
        return r.astype(dtype)


def is_representable(values: np.ndarray, fmt: str | Format) -> np.ndarray:
    """True where a float64 (or float32) value is exactly a value of ``fmt`` (NaN and ±inf count when the format has
    them)."""
    fmt = get_format(fmt)
    v = np.asarray(values)
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    if v.dtype == np.float32 and fmt.name in ("fp16", "bf16") and v.ndim and v.flags.c_contiguous \
            and jit_for(v.size, cheap=True):
        from bnprobe.compiled.bits import held_by

        return held_by(v, fmt.name)  # the same answer from the bits, in one pass
    with np.errstate(all="ignore"):
        # a value is in the format exactly when a correct nearest-even cast leaves it unchanged (beyond the largest
        # value the cast gives ±max or ±inf, not the value); other formats: rounding toward zero, any exponent
        if fmt is FP64:
            r = v
        elif not fmt.has_inf or (r := _nearest_even_as(v, fmt, v.dtype)) is None:
            v = v.astype(np.float64, copy=False)
            r = round_to(v, fmt, rounding="toward_zero")
        same = (r == v) | (np.isnan(v) & np.isnan(r))
        if fmt.has_inf:
            same |= np.isinf(v)
        else:
            same &= ~np.isinf(v)
    return same


"""Floating-point formats bnprobe emulates: their dtypes, limits and names.

The limits are written exactly (``float.fromhex``) and checked against numpy /
ml_dtypes ``finfo`` in the tests, so a typo cannot silently shift a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.core.errors import BNProbeError

__all__ = ["Format", "FORMATS", "get_format", "format_names", "FP64", "FP32", "FP16", "BF16"]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format with IEEE-style gradual underflow.

    ``mantissa_bits`` counts the stored fraction bits (10 for fp16), so the
    precision in bits is ``mantissa_bits + 1``.  ``emin`` is the exponent of the
    smallest normal number and ``emax`` that of the largest finite one.
    """

    name: str
    dtype_of: Any  # the numpy dtype, or the name of ml_dtypes' type (imported on first use: it takes 0.7 s to load)
    mantissa_bits: int
    exponent_bits: int
    emin: int
    emax: int
    max: float
    tiny: float  # smallest positive normal
    smallest_subnormal: float
    has_inf: bool = True

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype holding this format's values (ml_dtypes' for bf16 and fp8, imported here)."""
        d = self.dtype_of
        return _ml_dtype(d) if isinstance(d, str) else d

    @property
    def precision(self) -> int:
        return self.mantissa_bits + 1

    def holds(self, other: Format) -> bool:
        """True when every value of ``other`` is exactly a value of this format."""
        return self.precision >= other.precision and self.emax >= other.emax and self.emin <= other.emin

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger number: 2**-mantissa_bits."""
        return 2.0 ** -self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """u = eps / 2, the bound on the relative error of one rounding to nearest."""
        return 2.0 ** -self.precision

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def ulps_apart(self, a: Any, b: Any) -> np.ndarray:
        """How many of this format's values lie between ``a`` and ``b`` (values of this format, in any float
        dtype), element by element: the distance of their places in the format's ordered bit patterns (±0 the
        same place); inf where either is NaN or infinite.  Bounded by the format's count of values — unlike
        |a − b|/ulp(a), which at a = 0 divides by the smallest subnormal."""
        a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        uint = np.dtype(f"u{self.itemsize}")

        def place(v: np.ndarray) -> np.ndarray:
            with np.errstate(all="ignore"):
                bits = np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0).astype(self.dtype).view(uint)
            bits = bits.astype(np.uint64)
            sign = np.uint64(1) << np.uint64(8 * self.itemsize - 1)
            mag = (bits & ~sign).astype(np.float64)
            return np.where(bits & sign, -mag, mag)

        with np.errstate(all="ignore"):
            d = np.abs(place(a64) - place(b64))
        return np.where(np.isfinite(a64) & np.isfinite(b64), d, np.inf)

    @property
    def torch_dtype(self) -> Any:
        """The matching ``torch.dtype``; raises if torch is missing or has none."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise BNProbeError(f"torch is not installed, so {self.name} has no torch dtype") from exc
        table = {
            "fp64": torch.float64,
            "fp32": torch.float32,
            "fp16": torch.float16,
            "bf16": torch.bfloat16,
            "fp8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
            "fp8_e5m2": getattr(torch, "float8_e5m2", None),
        }
        dt = table.get(self.name)
        if dt is None:  # pragma: no cover - old torch builds
            raise BNProbeError(f"this torch build has no dtype for {self.name}")
        return dt

    def ulp(self, values: np.ndarray) -> np.ndarray:
        """Spacing of the format at each |value| (the ulp of the binade; subnormal spacing below tiny)."""
        v = np.asarray(values, dtype=np.float64)
        if jit_for(v.size, cheap=True) and v.flags.c_contiguous:  # the same, in one compiled pass (a large array)
            from bnprobe.compiled.bits import ulp

            return ulp(v, self.emin, self.mantissa_bits)
        # the binade's exponent from the float64 bits (float64 subnormals fall below every emin here)
        e = ((v.view(np.uint64) >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023
        e = np.maximum(e, self.emin) - self.mantissa_bits
        if self.name == "fp64":
            with np.errstate(over="ignore"):
                return np.ldexp(1.0, e)
        return ((e + 1023).astype(np.uint64) << np.uint64(52)).view(np.float64)  # 2**e, normal for e >= -1022

    def __str__(self) -> str:
        return self.name


@lru_cache(maxsize=None)
def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


FP64 = Format(
    "fp64", np.dtype(np.float64), 52, 11, -1022, 1023,
    max=float.fromhex("0x1.fffffffffffffp+1023"),  # 1.7976931348623157e308
    tiny=float.fromhex("0x1p-1022"),  # 2.2250738585072014e-308
    smallest_subnormal=float.fromhex("0x1p-1074"),  # 5e-324
)
FP32 = Format(
    "fp32", np.dtype(np.float32), 23, 8, -126, 127,
    max=float.fromhex("0x1.fffffep+127"),  # 3.4028234663852886e38
    tiny=float.fromhex("0x1p-126"),  # 1.1754943508222875e-38
    smallest_subnormal=float.fromhex("0x1p-149"),  # 1.401298464324817e-45
)
FP16 = Format(
    "fp16", np.dtype(np.float16), 10, 5, -14, 15,
    max=float.fromhex("0x1.ffcp+15"),  # 65504
    tiny=float.fromhex("0x1p-14"),  # 6.103515625e-05
    smallest_subnormal=float.fromhex("0x1p-24"),  # 5.960464477539063e-08
)
BF16 = Format(
    "bf16", "bfloat16", 7, 8, -126, 127,
    max=float.fromhex("0x1.fep+127"),  # 3.3895313892515355e38
    tiny=float.fromhex("0x1p-126"),
    smallest_subnormal=float.fromhex("0x1p-133"),  # 9.183549615799121e-41
)
# FP8 formats are storage formats only (ml_dtypes semantics).  e4m3fn has no
# infinity: its largest finite value 448 is 0x1.cp+8 because the all-ones
# pattern is NaN; overflow in "ieee" mode therefore gives NaN, as ml_dtypes casts do.
FP8_E4M3FN = Format(
    "fp8_e4m3fn", "float8_e4m3fn", 3, 4, -6, 8,
    max=float.fromhex("0x1.cp+8"),  # 448
    tiny=float.fromhex("0x1p-6"),  # 0.015625
    smallest_subnormal=float.fromhex("0x1p-9"),  # 0.001953125
    has_inf=False,
)
FP8_E5M2 = Format(
    "fp8_e5m2", "float8_e5m2", 2, 5, -14, 15,
    max=float.fromhex("0x1.cp+15"),  # 57344
    tiny=float.fromhex("0x1p-14"),
    smallest_subnormal=float.fromhex("0x1p-16"),  # 1.52587890625e-05
)

FORMATS: dict[str, Format] = {f.name: f for f in (FP64, FP32, FP16, BF16, FP8_E4M3FN, FP8_E5M2)}

_ALIASES: dict[str, str] = {
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "f64": "fp64",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "single": "fp32", "f32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp8_e4m3fn": "fp8_e4m3fn", "float8_e4m3fn": "fp8_e4m3fn", "e4m3fn": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}


def format_names() -> list[str]:
    """Every name :func:`get_format` accepts."""
    return sorted(_ALIASES)


def get_format(spec: str | Format | np.dtype | type) -> Format:
    """Look a format up by name (``fp16``, ``half``, ``bfloat16``…), numpy dtype or Format."""
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_").removeprefix("torch.")
        if key in _ALIASES:
            return FORMATS[_ALIASES[key]]
        raise BNProbeError(
            f"unknown format {spec!r}; valid names: "
            "fp64/float64/double, fp32/float32/float, fp16/float16/half, bf16/bfloat16, "
            "fp8_e4m3fn/e4m3, fp8_e5m2/e5m2"
        )
    try:
        dt = np.dtype(spec)
    except TypeError as exc:
        raise BNProbeError(f"cannot interpret {spec!r} as a floating-point format") from exc
    for f in FORMATS.values():
        if f.dtype == dt:
            return f
    raise BNProbeError(f"dtype {dt} is not a floating-point format bnprobe emulates")

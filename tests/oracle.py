"""Independent oracles: exact rational rounding with Python's fractions.

Nothing here imports bnprobe; these functions are the yardstick the package is
measured against.
"""

from __future__ import annotations

import math
from fractions import Fraction

# (precision p including the implicit bit, emin, max finite) per format
SPECS = {
    "fp32": (24, -126, Fraction(2**24 - 1, 2**23) * 2**127),
    "fp16": (11, -14, Fraction(65504)),
    "bf16": (8, -126, Fraction(2**8 - 1, 2**7) * 2**127),
    "fp8_e4m3fn": (4, -6, Fraction(448)),
    "fp8_e5m2": (3, -14, Fraction(57344)),
}


def round_fraction(v: Fraction, fmt: str, mode: str = "nearest_even") -> float:
    """Round an exact rational to ``fmt`` with an unbounded exponent, then apply IEEE overflow."""
    p, emin, vmax = SPECS[fmt]
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = math.floor(math.log2(a.numerator) - math.log2(a.denominator))
    # fix the floor(log2) estimate exactly
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, emin)
    quantum = Fraction(2) ** (e - p + 1)
    q = a / quantum
    fl = q.numerator // q.denominator
    frac = q - fl
    if mode == "nearest_even":
        n = fl + (1 if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and fl % 2 == 1) else 0)
    elif mode == "nearest_away":
        n = fl + (1 if frac >= Fraction(1, 2) else 0)
    elif mode == "toward_zero":
        n = fl
    else:
        raise ValueError(mode)
    r = n * quantum
    if r > vmax:
        if mode == "toward_zero":
            return sign * float(vmax)
        return sign * math.inf if fmt != "fp8_e4m3fn" else math.nan
    return sign * float(r)


def _sqrt_fraction(v: Fraction, t: int = 400) -> Fraction:
    """sqrt(v) truncated at 2**-t, plus a half-step sticky bit when inexact (so rounding stays correct)."""
    n = v.numerator * 4**t
    q, rem = divmod(n, v.denominator)
    r0 = math.isqrt(q)
    exact = rem == 0 and r0 * r0 == q
    return Fraction(r0, 2**t) + (0 if exact else Fraction(1, 2 ** (t + 1)))


def round_sqrt(x: float, fmt: str) -> float:
    """Correctly rounded sqrt(x) (nearest-even) of a nonnegative float, by integer square roots."""
    return round_fraction(_sqrt_fraction(Fraction(x)), fmt) if x > 0 else 0.0


def round_rsqrt(x: float, fmt: str) -> float:
    """Correctly rounded 1/sqrt(x) (nearest-even) of a positive finite float, by integer square roots."""
    return round_fraction(_sqrt_fraction(1 / Fraction(x)), fmt)

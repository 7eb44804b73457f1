"""Reciprocal square root, correctly rounded.

Special inputs follow IEEE 754 rSqrt: +0 -> +inf, -0 -> -inf, negative -> NaN,
+inf -> +0, NaN -> NaN.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from bnprobe.formats import Format, get_format
from bnprobe.numerics.rounding import round_to

__all__ = ["rsqrt_exact", "succ", "pred"]


def succ(q: np.ndarray, fmt: Format) -> np.ndarray:
    """The next larger value of ``fmt`` after each positive finite ``q``."""
    return q + fmt.ulp(q)


def pred(q: np.ndarray, fmt: Format) -> np.ndarray:
    """The next smaller value of ``fmt`` before each positive finite ``q``."""
    gap = fmt.ulp(q)
    with np.errstate(divide="ignore"):
        mant, _ = np.frexp(q)
    # just below a power of two (above the subnormal range) the spacing halves
    return q - np.where((mant == 0.5) & (q > fmt.tiny), gap / 2, gap)


def rsqrt_exact(v: np.ndarray, fmt: str | Format) -> np.ndarray:
    """1/sqrt(v) rounded to nearest-even in ``fmt`` (correct for every input; fp64 within 1.5 ulp).

    float64's 1/sqrt has a relative error below 2**-52, so rounding it to a
    format of at most 24 bits is wrong only when it lies within that distance of
    a midpoint between two values of the format.  Those few cases are decided
    exactly: 1/sqrt(v) > m  <=>  m*m*v < 1, compared with rationals.  An exact
    tie is impossible (1/sqrt(v) is never a dyadic midpoint).
    """
    fmt = get_format(fmt)
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(all="ignore"):
        r = 1.0 / np.sqrt(v)
        r = np.where(v == 0, np.copysign(np.inf, v), r)
    if fmt.name == "fp64":
        return r
    q = round_to(r, fmt)
    ok = np.isfinite(q) & (q > 0) & np.isfinite(r)
    if not ok.any():
        return q
    with np.errstate(all="ignore"):
        hi = np.where(ok, (q + succ(np.where(ok, q, 1.0), fmt)) / 2, np.nan)
        lo = np.where(ok, (q + pred(np.where(ok, q, 1.0), fmt)) / 2, np.nan)
        tol = 2.0 ** -50 * np.abs(r)
        near = ok & ((np.abs(r - hi) <= tol) | (np.abs(r - lo) <= tol))
    if near.any():
        q = q.copy()
        qf = q.reshape(-1)
        for i in np.flatnonzero(near.reshape(-1)):
            vi = Fraction(float(v.reshape(-1)[i]))
            m_hi = Fraction(float(hi.reshape(-1)[i]))
            m_lo = Fraction(float(lo.reshape(-1)[i]))
            if m_hi * m_hi * vi < 1:  # exact value above the upper midpoint
                qf[i] = float(succ(np.array(qf[i]), fmt))
            elif m_lo * m_lo * vi > 1:  # exact value below the lower midpoint
                qf[i] = float(pred(np.array(qf[i]), fmt))
    return q

"""msprobe's scaled and accumulated absolute rules (:func:`bnprobe.checks.rules.absolute`) over a large output in
one compiled pass: the error beyond the format's rounding, its ratio to the floored golden, the worst ratio, where
it is, and how many elements exceed the limit; the same IEEE float64 operations, in the same order, as the numpy
route, so the same figures bit for bit.

Imported by the rules only for arrays that take the compiled route (:func:`bnprobe._jit.jit_for`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from bnprobe._jit import KERNEL_LOCK
from bnprobe._jit_bits import ulp_bits

__all__ = ["worst_ratio"]


@njit(cache=True, nogil=True)
def _half_ulp(g, emin, mant):  # pragma: no cover - compiled
    """Half of Format.ulp(g), as float64 arithmetic gives 0.5 * ulp (a power of two; half the smallest subnormal
    rounds to 0)."""
    return 0.5 * np.int64(ulp_bits(np.float64(g).view(np.int64), emin, mant)).view(np.float64)


@njit(cache=True, nogil=True, error_model="numpy")
def _worst(a, g, mag, floor, emin, mant, limit):  # pragma: no cover - compiled
    """(worst ratio, its first index, how many ratios exceed ``limit``) of d / max(|g|, floor_i), d = max(|a - g|
    - ulp(g)/2, 0) and floor_i = ``floor`` * (mag_i if mag_i > 0 else 1) where ``mag`` has elements, else
    ``floor``: as numpy's max, argmax and sum give them, a NaN ratio (0/0 where the floor underflows to 0) the
    worst, at its first place; a division by 0 IEEE's, as numpy's (``error_model``)."""
    worst, at, over, nan_at = -np.inf, 0, 0, -1
    per = mag.size > 0
    for i in range(a.size):
        d = max(abs(a[i] - g[i]) - _half_ulp(g[i], emin, mant), 0.0)
        f = floor * (mag[i] if mag[i] > 0 else 1.0) if per else floor
        r = d / max(abs(g[i]), f)
        if r != r:
            if nan_at < 0:
                nan_at = i
        elif r > worst or i == 0:
            worst, at = r, i
        if r > limit:
            over += 1
    if nan_at >= 0:
        return np.nan, nan_at, over
    return worst, at, over


def worst_ratio(a: np.ndarray, g: np.ndarray, mag: np.ndarray | None, floor: float, emin: int, mant: int,
                limit: float) -> tuple[float, int, int]:
    """The scaled (``mag`` per element) or accumulated (``mag`` None) rule's worst ratio over finite float64 ``a``
    against ``g`` (1-D), its first index and the count over ``limit``."""
    m = np.empty(0) if mag is None else np.ascontiguousarray(mag, dtype=np.float64)
    with KERNEL_LOCK:
        w, at, over = _worst(np.ascontiguousarray(a), np.ascontiguousarray(g), m, floor, emin, mant, limit)
    return float(w), int(at), int(over)

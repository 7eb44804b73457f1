"""msprobe's scaled and accumulated absolute rules (:func:`bnprobe.engine.rules.absolute`) over a large output in
one compiled pass: the error beyond the format's rounding, its ratio to the floored golden, the worst ratio, where
it is, and how many elements exceed the limit; the same IEEE float64 operations, in the same order, as the numpy
route, so the same figures bit for bit.  The doctor's per-channel rule (:func:`bnprobe.engine.rules.channel_rule`)
likewise, in two passes: each channel's largest finite |golden|, then the error beyond rounding over the channel's
allowance.  The kernel against the bench (:func:`bnprobe.engine.rules.versus_bench`: numpy's pairwise sums of its
squares, reproduced) and a bug model's y, x̂ and last expression of dx (:mod:`bnprobe.checks.doctor.bugs`), each in one
pass; the shares a compare row reports beside its verdict (:func:`bnprobe.engine.rules.output_shares`) as counts,
in one; the per-channel sums and largest values the natural scales are formed from
(:func:`bnprobe.engine.run.natural_scales`: numpy's pairwise sums of each channel's row, reproduced), in one, and
each channel's largest |x - mean|.

Imported by the rules only for arrays that take the compiled route (:func:`bnprobe.compiled.jit.jit_for`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bnprobe.compiled.jit import KERNEL_LOCK
from bnprobe.compiled.bits import block_sum, ulp_bits

__all__ = ["worst_ratio", "channel_peaks", "channel_worst", "versus_sums", "affine_dx", "share_counts",
           "scale_sums", "deviation_peaks", "affine_y"]


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


@njit(parallel=True, cache=True, nogil=True)
def _peaks(w, batch, channels, inner, out):  # pragma: no cover - compiled
    """``out[c]``: the largest |w| of channel c of (batch, channels, inner) ``w`` (flat) over its finite values,
    0 where it has none: numpy's max of |w| with the non-finite values set to 0."""
    for c in prange(channels):
        m = 0.0
        for n in range(batch):
            base = (n * channels + c) * inner
            for j in range(inner):
                v = abs(w[base + j])
                if v - v == 0.0 and v > m:  # (finite: inf - inf and NaN - NaN are NaN)
                    m = v
        out[c] = m


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _channel_worst(a, w, dims, allowed, fmt, out):  # pragma: no cover - compiled
    """Per channel c of (batch, channels, inner) ``a`` and ``w`` (flat; ``dims`` = (batch, inner)), in ``out[c]``:
    the worst of excess_i / allowed_c, its first flat index, how many exceed 1, and 1 where an excess is not finite
    (the caller then judges the non-finite values numpy's way), with excess_i = max(|a_i - w_i| - ulp(w_i)/2, 0)
    for ``fmt`` = (emin, mantissa bits): numpy's max, argmax and count of the same float64 operations."""
    batch, inner = dims
    emin, mant = fmt
    channels = allowed.size
    for c in prange(channels):
        top, where, n_over, stop = -np.inf, 0, 0, False
        allow = allowed[c]
        for n in range(batch):
            base = (n * channels + c) * inner
            for j in range(inner):
                i = base + j
                d = abs(a[i] - w[i]) - _half_ulp(w[i], emin, mant)
                if not (d - d == 0.0):
                    stop = True
                    break
                if d < 0.0:
                    d = 0.0
                u = d / allow
                if u > top:
                    top, where = u, i
                if u > 1.0:
                    n_over += 1
            if stop:
                break
        out[c, 0], out[c, 1], out[c, 2], out[c, 3] = top, where, n_over, 1.0 if stop else 0.0


def channel_peaks(w: np.ndarray, channels: int) -> np.ndarray:
    """Per channel of C-contiguous (N, C, ...) float64 ``w``, its largest finite |value| (0 where none)."""
    out = np.empty(channels, dtype=np.float64)
    with KERNEL_LOCK:
        _peaks(w.reshape(-1), w.shape[0], channels, _batch_inner(w)[1], out)
    return out


def channel_worst(a: np.ndarray, w: np.ndarray, allowed: np.ndarray, emin: int, mant: int
                  ) -> tuple[float, int, int] | None:
    """(worst ratio, its first flat index, how many ratios exceed 1) of the doctor's rule over C-contiguous (N, C,
    ...) float64 ``a`` against ``w`` with each channel's ``allowed`` error; None where an excess is not finite."""
    # worst, its first flat index (held exactly: indices < 2^53), the count over 1, a non-finite excess
    out = np.empty((allowed.size, 4))
    with KERNEL_LOCK:
        _channel_worst(a.reshape(-1), w.reshape(-1), _batch_inner(a), np.ascontiguousarray(allowed, dtype=np.float64),
                       (emin, mant), out)
    worst, at, over, bad = out.T
    if bad.any():
        return None
    top = worst.max()
    return float(top), int(at[worst == top].min()), int(over.sum())  # the first place of the worst, as argmax's


@njit(cache=True, nogil=True)
def _versus_leaf(arrs, lo, n, fmt, bufs, tops):  # pragma: no cover - compiled
    """``bufs[:, :n]``: (|a - g|^2, |b - g|^2, ulp(g)^2) over [lo, lo + n), the largest |a - g|, |b - g| kept in
    ``tops``; False where a value is not finite (the caller then takes numpy's route)."""
    a, b, g = arrs
    emin, mant = fmt
    for t in range(n):
        i = lo + t
        ea, eb = abs(a[i] - g[i]), abs(b[i] - g[i])
        if not (ea - ea == 0.0 and eb - eb == 0.0 and g[i] - g[i] == 0.0):
            return False
        u = np.int64(ulp_bits(np.float64(g[i]).view(np.int64), emin, mant)).view(np.float64)
        bufs[0, t], bufs[1, t], bufs[2, t] = ea * ea, eb * eb, u * u
        if ea > tops[0]:
            tops[0] = ea
        if eb > tops[1]:
            tops[1] = eb
    return True


@njit(cache=True, nogil=True)
def _versus_sums(arrs, lo, n, fmt, bufs, tops, sums):  # pragma: no cover - compiled
    """numpy's pairwise sums of :func:`_versus_leaf`'s three values over [lo, lo + n), added into ``sums``; False
    where a value is not finite."""
    if n <= 128:
        if not _versus_leaf(arrs, lo, n, fmt, bufs, tops):
            return False
        for j in range(3):
            sums[j] = block_sum(bufs[j], n, -0.0)
        return True
    n2 = n // 2
    n2 -= n2 % 8
    left = np.zeros(3)
    if not _versus_sums(arrs, lo, n2, fmt, bufs, tops, left):
        return False
    if not _versus_sums(arrs, lo + n2, n - n2, fmt, bufs, tops, sums):
        return False
    for j in range(3):
        sums[j] = left[j] + sums[j]
    return True


def versus_sums(a: np.ndarray, b: np.ndarray, g: np.ndarray, emin: int, mant: int
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """For 1-D C-contiguous float64 ``a``, ``b`` against ``g``: numpy's sums of |a - g|^2, |b - g|^2 and ulp(g)^2
    and the largest |a - g|, |b - g|; None where a value is not finite (numpy's route leaves those out)."""
    bufs, tops, sums = np.empty((3, 128)), np.zeros(2), np.zeros(3)
    with KERNEL_LOCK:
        done = _versus_sums((a, b, g), 0, a.size, (emin, mant), bufs, tops, sums)
    return (sums, tops) if done else None


@njit(parallel=True, cache=True, nogil=True)
def _affine_dx(dy, z, coef, dims, out):  # pragma: no cover - compiled
    """``out_i = f_c * ((dy_i - t1_c) + ((s * z_i) * t2_c))`` over (batch, channels, inner) arrays (flat; ``dims`` =
    (batch, inner)), ``coef[c]`` = (f, t1, t2, s): numpy's ``f * (dy - t1 + s * z * t2)`` operation by operation."""
    batch, inner = dims
    channels = coef.shape[0]
    for c in prange(channels):
        f, t1, t2, s = coef[c, 0], coef[c, 1], coef[c, 2], coef[c, 3]
        for n in range(batch):
            base = (n * channels + c) * inner
            for j in range(inner):
                i = base + j
                out[i] = f * ((dy[i] - t1) + ((s * z[i]) * t2))


def affine_dx(dy: np.ndarray, z: np.ndarray, f: np.ndarray, t1: np.ndarray, t2: np.ndarray, sign: float) -> np.ndarray:
    """``f * (dy - t1 + sign * z * t2)`` for C-contiguous (N, C, ...) float64 ``dy`` and ``z`` and per-channel ``f``,
    ``t1``, ``t2`` (each broadcast over its channel), in one compiled pass: the same float64 operations in the same
    order as numpy's expression."""
    out = np.empty_like(dy)
    with KERNEL_LOCK:
        _affine_dx(dy.reshape(-1), z.reshape(-1), _coefficients(dy, f, t1, t2, sign), _batch_inner(dy),
                   out.reshape(-1))
    return out


def _coefficients(x: np.ndarray, *vectors: object) -> np.ndarray:
    """A (C, k) table for a per-channel kernel over (N, C, ...) ``x``: column k holds ``vectors[k]``, each one value
    per channel or one for all, as float64."""
    c = x.shape[1]
    coef = np.empty((c, len(vectors)))
    for k, v in enumerate(vectors):
        coef[:, k] = np.broadcast_to(np.asarray(v, dtype=np.float64).reshape(-1), (c,))
    return coef


def _batch_inner(x: np.ndarray) -> tuple[int, int]:
    """(N, the product of the axes after the channels) of (N, C, ...) ``x``: how the per-channel kernels walk it."""
    return x.shape[0], int(np.prod(x.shape[2:], dtype=np.int64))


@njit(parallel=True, cache=True, nogil=True)
def _share_counts(ulps, g, limits, out):  # pragma: no cover - compiled
    """``out``: how many ``ulps`` are finite, how many of those exceed limits[0]; how many |g| are at most
    limits[1], in (0, limits[2]), above limits[3] (a NaN limit counts none: every comparison with it is false)."""
    fin, over = 0, 0
    for i in prange(ulps.size):
        u = ulps[i]
        if u - u == 0.0:
            fin += 1
            if u > limits[0]:
                over += 1
    small, sub, big = 0, 0, 0
    for i in prange(g.size):
        v = abs(g[i])
        if v <= limits[1]:
            small += 1
        if v > 0.0 and v < limits[2]:
            sub += 1
        if v > limits[3]:
            big += 1
    out[0], out[1], out[2], out[3], out[4] = fin, over, small, sub, big


def share_counts(ulps: np.ndarray, g: np.ndarray, ulp_limit: float, small: float, tiny: float, largest: float
                 ) -> tuple[int, int, int, int, int]:
    """For 1-D float64 ``ulps`` and ``g``: (finite ULP errors, those over ``ulp_limit``, |g| <= ``small``,
    0 < |g| < ``tiny``, |g| > ``largest``); a NaN limit counts nothing."""
    out = np.zeros(5, dtype=np.int64)
    with KERNEL_LOCK:
        _share_counts(np.ascontiguousarray(ulps), np.ascontiguousarray(g),
                      np.array([ulp_limit, small, tiny, largest], dtype=np.float64), out)
    return int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4])


@njit(cache=True, nogil=True, error_model="numpy")
def _scale_leaf(x3, dy3, c, lo, n, k, bufs, tops):  # pragma: no cover - compiled
    """``bufs[:, :n]``: |x|, |dy|, dy, dy·x̂ and |dy·x̂| at positions [lo, lo + n) of channel c's row (x̂ = (x -
    k[0]) / k[1]; only |x| where k[2] is 0); ``tops``: the largest |dy| and |x̂|, and 1 in tops[2] at a NaN in x or
    dy·x̂."""
    inner = x3.shape[2]
    b, j = lo // inner, lo % inner
    for t in range(n):
        v = x3[b, c, j]
        bufs[0, t] = abs(v)
        if v != v:
            tops[2] = 1.0
        if k[2] != 0.0:
            d = dy3[b, c, j]
            z = (v - k[0]) / k[1]
            p = d * z
            bufs[1, t], bufs[2, t], bufs[3, t], bufs[4, t] = abs(d), d, p, abs(p)
            if abs(d) > tops[0]:
                tops[0] = abs(d)
            if abs(z) > tops[1]:
                tops[1] = abs(z)
            if p != p:
                tops[2] = 1.0
        j += 1
        if j == inner:
            j, b = 0, b + 1


@njit(cache=True, nogil=True)
def _scale_row(x3, dy3, c, k, bufs, tops, sums):  # pragma: no cover - compiled
    """``sums``: numpy's pairwise sums over channel c's row of each of :func:`_scale_leaf`'s five values: its
    recursion (a block sum at 128 values or fewer, else the halves split at a multiple of 8, left + right) unrolled
    over an explicit stack (numba's cache crashed loading a parallel loop that called a recursive function)."""
    nq = 5 if k[2] != 0.0 else 1
    los, ns, st = np.zeros(64, np.int64), np.zeros(64, np.int64), np.zeros(64, np.int64)
    part, val = np.empty((64, 5)), np.empty(5)
    d = 0
    ns[0] = x3.shape[0] * x3.shape[2]
    while True:
        n = ns[d]
        if n > 128:  # descend into the left half
            h = n // 2
            h -= h % 8
            st[d] = 1
            los[d + 1], ns[d + 1] = los[d], h
            d += 1
            continue
        _scale_leaf(x3, dy3, c, los[d], n, k, bufs, tops)
        for q in range(nq):
            val[q] = block_sum(bufs[q], n, -0.0)
        while d > 0:  # hand the value up: a left half waits for its right, a right half is added to its left
            p = d - 1
            if st[p] == 1:
                for q in range(nq):  # (element by element: a slice assignment compiles numba's shape-error path)
                    part[p, q] = val[q]
                st[p] = 2
                h = ns[p] // 2
                h -= h % 8
                los[d], ns[d] = los[p] + h, ns[p] - h
                break
            for q in range(nq):
                val[q] = part[p, q] + val[q]
            d = p
        if d == 0:
            for q in range(nq):
                sums[q] = val[q]
            return


@njit(parallel=True, cache=True, nogil=True)
def _scale_sums(x3, dy3, mean, scale, backward, out):  # pragma: no cover - compiled
    """``out[c]``: channel c's pairwise sums of |x|, |dy|, dy, dy·x̂, |dy·x̂|, its largest |dy| and |x̂|, and 1 at a
    NaN (see :func:`_scale_leaf`)."""
    for c in prange(x3.shape[1]):
        bufs, tops, sums = np.empty((5, 128)), np.zeros(3), np.zeros(5)
        _scale_row(x3, dy3, c, (mean[c], scale[c], backward), bufs, tops, sums)
        for q in range(5):  # (element by element: a slice assignment compiles numba's shape-error path, 7-11 s)
            out[c, q] = sums[q]
        for q in range(3):
            out[c, 5 + q] = tops[q]


def scale_sums(x3: np.ndarray, dy3: np.ndarray | None, mean: np.ndarray, scale: np.ndarray) -> np.ndarray | None:
    """For float64 ``x3`` (and ``dy3``) viewed as (N, C, S) (row c of the channel-first data is [:, c, :] in order;
    N * S >= 1) and per-channel ``mean`` and ``scale`` (x̂ = (x - mean) / scale): per channel (C, 7), numpy's
    pairwise sums of each row of |x|, |dy|, dy, dy·x̂ and |dy·x̂| and the largest |dy| and |x̂| (without ``dy3``
    only the first); None where x or dy·x̂ holds a NaN (numpy's route leaves those out)."""
    out = np.zeros((x3.shape[1], 8))
    back = dy3 is not None
    with KERNEL_LOCK:
        _scale_sums(x3, dy3 if back else x3, np.ascontiguousarray(mean, dtype=np.float64),
                    np.ascontiguousarray(scale, dtype=np.float64), 1.0 if back else 0.0, out)
    return None if out[:, 7].any() else out[:, :7]


@njit(parallel=True, cache=True, nogil=True)
def _deviation_peaks(x3, mean, out):  # pragma: no cover - compiled
    """``out[c]``: the largest |x - mean[c]| of channel c of (N, C, S) ``x3``, NaN left out (NaN when all are)."""
    for c in prange(x3.shape[1]):
        top = -1.0
        for b in range(x3.shape[0]):
            for j in range(x3.shape[2]):
                a = abs(x3[b, c, j] - mean[c])
                if a > top:
                    top = a
        out[c] = top if top >= 0.0 else np.nan


def deviation_peaks(x3: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """numpy's ``nanmax(|x - mean|)`` of each channel of float64 ``x3`` viewed as (N, C, S) (a maximum: the same in
    any order)."""
    out = np.empty(x3.shape[1])
    with KERNEL_LOCK:
        _deviation_peaks(x3, np.ascontiguousarray(mean, dtype=np.float64), out)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _centred(x, coef, dims, out):  # pragma: no cover - compiled
    """``out_i = p_c * ((x_i - m_c) * s_c) + q_c`` over (batch, channels, inner) ``x`` (flat; ``dims`` = (batch,
    inner)), ``coef[c]`` = (m, s, p, q): numpy's ``p * ((x - m) * s) + q`` operation by operation."""
    batch, inner = dims
    channels = coef.shape[0]
    for c in prange(channels):
        m, s, p, q = coef[c, 0], coef[c, 1], coef[c, 2], coef[c, 3]
        for n in range(batch):
            base = (n * channels + c) * inner
            for j in range(inner):
                out[base + j] = p * ((x[base + j] - m) * s) + q


def affine_y(x: np.ndarray, m: np.ndarray | None, s: np.ndarray | None, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p * ((x - m) * s) + q`` (``m`` None: ``p * x + q``) for C-contiguous (N, C, ...) float64 ``x`` and
    per-channel ``m``, ``s``, ``p``, ``q`` (each broadcast over its channel), in one compiled pass: the same float64
    operations in the same order as numpy's expression (x̂ alone: p = 1 and q = -0.0; ``p * x + q``: m = +0.0 and
    s = 1; none of these changes a value, -0.0 and NaN included)."""
    coef = _coefficients(x, 0.0, 1.0, p, q) if m is None else _coefficients(x, m, s, p, q)
    out = np.empty_like(x)
    with KERNEL_LOCK:
        _centred(x.reshape(-1), coef, _batch_inner(x), out.reshape(-1))
    return out

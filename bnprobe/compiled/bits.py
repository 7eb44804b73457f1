"""Bit-level array helpers compiled with numba, for arrays large enough to take the compiled route
(:func:`bnprobe.compiled.jit.jit_for`): one pass over the values' bits where numpy takes several, the same values
bit for bit (integer arithmetic on the exponent field only).  Imported only when such an array comes, so that
``import bnprobe`` never loads numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bnprobe.compiled.jit import KERNEL_LOCK

__all__ = ["ulp", "ulp_bits", "ulp_scaled", "half", "checker_sums", "held_by"]


@njit(cache=True, nogil=True)
def ulp_bits(bits, emin, mant):  # pragma: no cover - compiled
    """The bits of 2^(max(e, emin) - mant), e the binade exponent of the float64 whose bits are ``bits`` (the
    exponent field less the bias: float64 subnormals and zero at -1023, inf/NaN at 1024); a float64 subnormal
    where that power is below 2^-1022, 0 below 2^-1074."""
    e = max(((bits >> 52) & 0x7FF) - 1023, emin) - mant
    if e >= -1022:
        return np.int64(e + 1023) << 52
    if e >= -1074:
        return np.int64(1) << (e + 1074)
    return np.int64(0)


@njit(parallel=True, cache=True, nogil=True)
def _ulp(bits, emin, mant, out):  # pragma: no cover - compiled
    """``out[i]``: :func:`ulp_bits` of ``bits[i]``."""
    for i in prange(bits.size):
        out[i] = ulp_bits(bits[i], emin, mant)


def ulp(values: np.ndarray, emin: int, mant: int) -> np.ndarray:
    """The spacing 2^(max(e, emin) - mant) at each |value| of float64 ``values`` (C-contiguous, any shape), e its
    binade's exponent: :meth:`bnprobe.core.formats.Format.ulp` in one pass.  (Only C-contiguous arrays come here: numpy
    lays out an elementwise result in its input's memory order, and a later float32 sum adds in that order.)"""
    v = np.asarray(values, dtype=np.float64)
    if not v.flags.c_contiguous:
        raise ValueError("ulp takes a C-contiguous array")
    out = np.empty(v.shape, dtype=np.float64)
    with KERNEL_LOCK:
        _ulp(v.reshape(-1).view(np.int64), emin, mant, out.reshape(-1).view(np.int64))
    return out[()] if out.ndim == 0 else out  # a scalar for a scalar, as numpy's ufuncs give


@njit(parallel=True, cache=True, nogil=True)
def _scaled(bits, err, table, lo, mant, bias, mask, near, min_exp, shift, out, rest):  # pragma: no cover - compiled
    """``out[i] = err[i] * table[clip(shift - max(e_i, min_exp)) - lo]``, e_i the exponent field of ``bits[i]`` less
    ``bias``, where that is floor(log2) of the value beyond any rounding of log2: a mantissa field neither 0 nor
    at least ``near``, a field neither 0 nor all ones.  Elsewhere ``rest[i]`` is set and ``out[i]`` left 0."""
    top = lo + table.size - 1
    for i in prange(bits.size):
        b = np.int64(bits[i])
        field = (b >> mant) & mask
        frac = b & ((np.int64(1) << mant) - 1)
        if frac == 0 or frac >= near or field == 0 or field == mask:
            rest[i] = True
            out[i] = 0
        else:
            rest[i] = False
            out[i] = err[i] * table[min(max(shift - max(field - bias, min_exp), lo), top) - lo]


def ulp_scaled(abs_bench: np.ndarray, err: np.ndarray, table: np.ndarray, lo: int, layout: tuple[int, int, int, int],
               near: int, min_exp: int, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """``err * 2^(shift - max(floor(log2 abs_bench), min_exp))`` (1-D arrays of one float dtype, the power of two
    looked up in ``table``, whose first entry is 2^``lo``) where floor(log2) is the exponent field beyond doubt;
    ``layout``: the dtype's (int view, mantissa bits, bias, field mask).  Returns (out, rest): the elements of
    ``rest`` are left 0 for the caller (powers of two, mantissas within ``near`` of the next one, subnormals,
    zeros, inf and NaN: numpy's log2 decides those)."""
    view, mant, bias, mask = layout
    out = np.empty_like(err)
    rest = np.empty(err.shape, dtype=np.bool_)
    with KERNEL_LOCK:
        _scaled(abs_bench.view(view), err, table, lo, mant, bias, mask, near, min_exp, shift, out, rest)
    return out, rest


@njit(parallel=True, cache=True, nogil=True)
def _half(x, out):  # pragma: no cover - compiled
    """``out[i]``: ``x[i]`` (float64 or float32) rounded to the nearest binary16, ties to even, ±inf from
    65520 (max + half its ulp) up: numpy's ``x.astype(float16)``, held in ``out``'s dtype; NaN left as it is
    (the caller gives it numpy's payload).  Returns how many NaN it met."""
    nan = 0
    for i in prange(x.size):
        v = np.float64(x[i])
        a = abs(v)
        if a != a:
            out[i] = v
            nan += 1
        elif a >= 65520.0:
            out[i] = -np.inf if v < 0 else np.inf
        else:
            e = max(((np.float64(a).view(np.int64) >> 52) & 0x7FF) - 1023, -14) - 10  # the quantum's exponent
            q = np.int64(e + 1023) << 52
            inv = np.int64(1023 - e) << 52
            r = np.rint(a * np.int64(inv).view(np.float64)) * np.int64(q).view(np.float64)
            out[i] = -r if (np.float64(v).view(np.int64) < 0) else r
    return nan


def half(x: np.ndarray, dtype: type) -> np.ndarray:
    """``x.astype(np.float16).astype(dtype)`` (x float64 or float32, any shape; dtype float32 or float64) in one
    pass: numpy's correctly rounded cast, without the float16 array between (a C-contiguous array; another is
    cast by numpy, whose result keeps its memory order)."""
    src = np.asarray(x)
    if not src.flags.c_contiguous:  # numpy's own cast keeps the input's memory order (see ulp)
        return src.astype(np.float16).astype(dtype)
    out = np.empty(src.shape, dtype=dtype)
    flat, inp = out.reshape(-1), src.reshape(-1)
    with KERNEL_LOCK:
        nan = _half(inp, flat)
    if nan:  # numpy's cast keeps a NaN's top payload bits through float16: its own cast for those
        at = np.isnan(flat)
        flat[at] = inp[at].astype(np.float16).astype(dtype)
    return out


# ---- msprobe's accuracy-checker metrics over one output, in two passes ------------------------------------------
# ``arrs`` = (dev, bench, bdev), flat: the device output (float32), the golden held one level up (float32 or
# float64) and the golden as the device holds it (float32); ``k`` = (small value, relative eps, small-value atol,
# +0, -0): the checker's constants in numpy's types (the first two in bench's dtype, the rest in the error's).
# Each element's figures are numpy's elementwise operations on the same types; the sums are numpy's pairwise sums
# (blocks of 8 accumulators up to 128 values, halves split at a multiple of 8), so the means are numpy's to the
# last bit.

@njit(cache=True, nogil=True)
def block_sum(buf, n, neg0):  # pragma: no cover - compiled
    """numpy's pairwise sum of ``buf[:n]``, n <= 128: one loop under 8 values, else 8 accumulators."""
    if n < 8:
        res = neg0
        for i in range(n):
            res += buf[i]
        return res
    r0, r1, r2, r3, r4, r5, r6, r7 = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7]
    i = 8
    m = n - (n % 8)
    while i < m:
        r0 += buf[i]
        r1 += buf[i + 1]
        r2 += buf[i + 2]
        r3 += buf[i + 3]
        r4 += buf[i + 4]
        r5 += buf[i + 5]
        r6 += buf[i + 6]
        r7 += buf[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += buf[i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _left_out(d, b, bd, sv):  # pragma: no cover - compiled
    """(finite, small) of one element: the device's value and the golden as the device holds it both finite
    (get_finite_and_infinite_mask), and the golden a small value among those (get_small_value_mask); an element
    either is not or is left out of the relative errors and the RMSE."""
    finite = (d - d == 0.0) and (bd - bd == 0.0)
    return finite, (abs(b) <= sv) and finite


@njit(cache=True, nogil=True)
def _squares_leaf(arrs, lo, n, k, counts, buf):  # pragma: no cover - compiled
    """``buf[:n]``: q_i^2 over [lo, lo + n), q_i = |dev - bench| where element i is kept (finite, not a small
    value), else 0 (get_rmse's); adds to the counts [small, small and erring, left out, dev > bdev, dev < bdev,
    relative errors kept] and keeps the largest kept relative error in ``counts``' companion (returned)."""
    dev, bench, bdev = arrs
    sv, eps, atol, zero, _ = k
    small_n = small_err = left = larger = smaller = kept = 0
    top = zero
    for t in range(n):
        i = lo + t
        d, b, bd = dev[i], bench[i], bdev[i]
        finite, small = _left_out(d, b, bd, sv)
        e = abs(d - b)
        if small:
            small_n += 1
            if e > atol:
                small_err += 1
        if d > bd:
            larger += 1
        elif d < bd:
            smaller += 1
        if not finite or small:
            left += 1
            buf[t] = zero
            continue
        r = e / (abs(b) + eps)
        if r >= 0.0:
            kept += 1
            if r > top:  # (r >= 0: the +0 start is no kept value's rival)
                top = r
        buf[t] = e * e
    counts[0] += small_n
    counts[1] += small_err
    counts[2] += left
    counts[3] += larger
    counts[4] += smaller
    counts[5] += kept
    return top


@njit(cache=True, nogil=True)
def _squares(arrs, lo, n, k, counts, buf, top):  # pragma: no cover - compiled
    """numpy's pairwise sum of :func:`_squares_leaf`'s values over [lo, lo + n); ``top[0]``: the largest kept
    relative error."""
    if n <= 128:
        t = _squares_leaf(arrs, lo, n, k, counts, buf)
        if t > top[0]:
            top[0] = t
        return block_sum(buf, n, k[4])
    n2 = n // 2
    n2 -= n2 % 8
    left = _squares(arrs, lo, n2, k, counts, buf, top)
    return left + _squares(arrs, lo + n2, n - n2, k, counts, buf, top)


@njit(cache=True, nogil=True)
def _rels_leaf(arrs, n, k, cursor, buf):  # pragma: no cover - compiled
    """``buf[:n]``: the next ``n`` kept relative errors from ``cursor[0]`` on (get_rel_err where it is not -1, and
    >= 0)."""
    dev, bench, bdev = arrs
    sv, eps = k[0], k[1]
    i = cursor[0]
    t = 0
    while t < n:
        d, b, bd = dev[i], bench[i], bdev[i]
        i += 1
        finite, small = _left_out(d, b, bd, sv)
        if not finite or small:
            continue
        r = abs(d - b) / (abs(b) + eps)
        if r >= 0.0:
            buf[t] = r
            t += 1
    cursor[0] = i


@njit(cache=True, nogil=True)
def _rels(arrs, n, k, cursor, buf):  # pragma: no cover - compiled
    """numpy's pairwise sum of the next ``n`` kept relative errors (the compacted array get_mean_rel_err means)."""
    if n <= 128:
        _rels_leaf(arrs, n, k, cursor, buf)
        return block_sum(buf, n, k[4])
    n2 = n // 2
    n2 -= n2 % 8
    left = _rels(arrs, n2, k, cursor, buf)
    return left + _rels(arrs, n - n2, k, cursor, buf)


def checker_sums(dev: np.ndarray, bench: np.ndarray, bdev: np.ndarray, small_value: float, rel_eps: float,
                 atol: float) -> dict:
    """What msprobe's checker metrics need of one output (1-D C-contiguous arrays, see above), in two passes: the
    counts, the pairwise sum of the kept squared errors, the largest kept relative error and the pairwise sum of the
    kept relative errors, in the error's type (float32, or float64 where the golden is held in float64)."""
    err = np.result_type(dev.dtype, bench.dtype)
    k = (bench.dtype.type(small_value), bench.dtype.type(rel_eps), err.type(atol), err.type(0.0), err.type(-0.0))
    counts = np.zeros(6, dtype=np.int64)
    top, buf = np.zeros(1, dtype=err), np.empty(128, dtype=err)
    arrs = (dev, bench, bdev)
    with KERNEL_LOCK:
        sq = _squares(arrs, 0, dev.size, k, counts, buf, top)
        kept = int(counts[5])
        rel = _rels(arrs, kept, k, np.zeros(1, dtype=np.int64), buf) if kept else k[4]
    return {"small": int(counts[0]), "small_err": int(counts[1]), "left_out": int(counts[2]), "larger": int(counts[3]),
            "smaller": int(counts[4]), "kept": kept, "squares": err.type(sq), "max_rel": top[0], "rels": err.type(rel)}


@njit(parallel=True, cache=True, nogil=True)
def _held_by(bits, narrow, out):  # pragma: no cover - compiled
    """``out[i]``: whether the float32 whose bits are ``bits[i]`` is exactly a value of fp16 (``narrow`` 16) or bf16
    (8), inf and NaN included: bf16 keeps a float32's exponent and its top 7 fraction bits; fp16 has 10 fraction
    bits from 2^-14 up to 2^15, and below 2^-14 its subnormals end at 2^-24."""
    for i in prange(bits.size):
        b = bits[i]
        exp = (b >> 23) & 0xFF
        if exp == 255:
            out[i] = True
        elif narrow == 8:
            out[i] = (b & 0xFFFF) == 0
        elif exp == 0:
            out[i] = (b & 0x7FFFFF) == 0  # zero; a float32 subnormal is below fp16's smallest
        else:
            e = exp - 127
            if e > 15 or e < -24:
                out[i] = False
            elif e >= -14:
                out[i] = (b & 0x1FFF) == 0
            else:  # an fp16 subnormal: e + 24 fraction bits
                out[i] = (b & ((np.uint32(1) << np.uint32(-1 - e)) - np.uint32(1))) == 0


def held_by(values: np.ndarray, fmt: str) -> np.ndarray:
    """Whether each value of C-contiguous float32 ``values`` is exactly a value of ``fmt`` (fp16 or bf16), in one pass
    over its bits."""
    out = np.empty(values.shape, dtype=np.bool_)
    with KERNEL_LOCK:
        _held_by(values.reshape(-1).view(np.uint32), 16 if fmt == "fp16" else 8, out.reshape(-1))
    return out

"""The compiled route of LayerNorm and RMSNorm (bnprobe.kernels.norms_compiled chooses and calls it): binary32
kernels over the ``(rows, R)`` view of x for runs whose every operation is an fp32 one with the default rounding
(the fp32, fp16 and bf16 presets, the careful kernel's policy), x, dy, y and dx stored in fp32, fp16 or bf16 by
nearest-even.  Each fp32 operation of the numpy route (float64 carriers, each result rounded once) is the CPU's
binary32 operation on the same values: +, −, × and ÷ of binary32 values rounded through binary64 give the
correctly rounded binary32 result (53 ≥ 2·24 + 2), so the kernels compute in float32 directly.

Every row is computed by one thread from start to end (``prange`` over rows), its sums by the numpy route's
pairwise tree (:func:`bnprobe.numerics.reduce.tree_sum`: the values past the largest power of two P ≤ n added onto
the first ones, then halves added until one is left), so results do not depend on the thread count.  Besides the
values, each kernel returns per row and stage what a trace that keeps no arrays records: the least and greatest
value and the stored tensors' common counts (subnormals, values lost to zero); anything rarer — a non-finite
value, an overflow, a binary32 subnormal or underflow in an fp32 stage — flags the row, and the caller computes
the flagged rows again by the numpy route, whose counting is complete.  dγ's and dβ's sums run over the rows of
each column (column blocks in parallel), counting their additions' overflows.

16-bit tensors are held as their bit patterns (fp16 in uint16, bf16 in int16 arrays: compiled.fast's tags).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bnprobe.compiled.codes import JIT_OPTIONS as _opts
from bnprobe.compiled.fast import count_if, decode, encode, format_tiny, from_key, mark_if, order_key

__all__ = ["layer_sums", "deviation_sums", "rms_sums", "normalise_rows", "backward_sums", "backward_dx",
           "param_sums", "ROW_STAGES"]

_F32_TINY = np.float32(1.1754943508222875e-38)
_F32_MAX = np.float32(3.4028234663852886e38)
_KEY_LO, _KEY_HI = np.int32(np.iinfo(np.int32).max), np.int32(np.iinfo(np.int32).min)  # an empty range
_I0 = np.int32(0)
#: the columns of a kernel's per-row counts: the stage's subnormals, its values lost to zero
ROW_STAGES = 2


@njit(**_opts)
def _ok32(v):
    """v is a finite binary32 that is zero or normal (no flag)."""
    a = abs(v)
    return (a <= _F32_MAX) & ((a >= _F32_TINY) | (v == 0))


@njit(**_opts)
def _lost(p, a, b):
    """Binary32 product p = a·b of nonzero operands is subnormal or zero."""
    return (abs(p) < _F32_TINY) & (a != 0) & (b != 0)


@njit(**_opts)
def _halve(buf, p):
    """The pairwise tree's halving of buf[:p] (p a power of two): buf[0] is the sum."""
    h = p
    while h > 1:
        h //= 2
        for i in range(h):
            buf[i] = buf[i] + buf[i + h]
    return buf[0]


@njit(**_opts)
def _range(rg, r, j, klo, khi):
    rg[r, j, 0] = from_key(klo)
    rg[r, j, 1] = from_key(khi)


@njit(**_opts)
def _new(rows, stages):
    cnt = np.zeros((rows, stages, 2), dtype=np.int64)
    rg = np.empty((rows, stages, 2), dtype=np.float32)
    rg[:, :, 0] = np.inf
    rg[:, :, 1] = -np.inf
    return cnt, rg


@njit(parallel=True, **_opts)
def layer_sums(xv, lut, p):
    """Σx of each row of x (its bits, (rows, n)) by the pairwise tree; the stage x's counts and range:
    (sums float32 (rows,), cnt, rg, flag)."""
    rows, n = xv.shape
    sums = np.empty(rows, dtype=np.float32)
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 1)
    tiny = format_tiny(xv)
    for r in prange(rows):
        buf = np.empty(p, dtype=np.float32)
        klo, khi, sub, bad = _KEY_LO, _KEY_HI, _I0, _I0
        for i in range(n):
            v = np.float32(decode(xv[r, i], lut))
            k = order_key(v)
            klo, khi = min(klo, k), max(khi, k)
            bad = mark_if(bad, abs(v) > _F32_MAX)
            sub = count_if(sub, (abs(v) < tiny) & (v != 0))
            if i < p:
                buf[i] = v
            else:
                buf[i - p] = buf[i - p] + v
        s = _halve(buf, p)
        sums[r] = s
        flag[r] = bad | (abs(s) > _F32_MAX)
        cnt[r, 0, 0] = sub
        _range(rg, r, 0, klo, khi)
    return sums, cnt, rg, flag


@njit(parallel=True, **_opts)
def deviation_sums(xv, lut, p, mean):
    """Σ(x − mean)² of each row, every difference and square rounded to binary32, by the pairwise tree:
    (sums, flag)."""
    rows, n = xv.shape
    sums = np.empty(rows, dtype=np.float32)
    flag = np.zeros(rows, dtype=np.int64)
    for r in prange(rows):
        buf = np.empty(p, dtype=np.float32)
        m = mean[r]
        bad = _I0
        for i in range(n):
            d = np.float32(decode(xv[r, i], lut)) - m
            q = d * d
            bad = mark_if(bad, _lost(q, d, d) | (abs(q) > _F32_MAX))
            if i < p:
                buf[i] = q
            else:
                buf[i - p] = buf[i - p] + q
        s = _halve(buf, p)
        sums[r] = s
        flag[r] = bad | (abs(s) > _F32_MAX)
    return sums, flag


@njit(parallel=True, **_opts)
def rms_sums(xv, lut, p):
    """Σx² of each row (each square rounded to binary32) by the pairwise tree; the stages x and squares:
    (sums, cnt, rg, flag)."""
    rows, n = xv.shape
    sums = np.empty(rows, dtype=np.float32)
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 2)
    tiny = format_tiny(xv)
    for r in prange(rows):
        buf = np.empty(p, dtype=np.float32)
        klo, khi, qlo, qhi, sub, bad = _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI, _I0, _I0
        for i in range(n):
            v = np.float32(decode(xv[r, i], lut))
            q = v * v
            k, kq = order_key(v), order_key(q)
            klo, khi, qlo, qhi = min(klo, k), max(khi, k), min(qlo, kq), max(qhi, kq)
            bad = mark_if(bad, (abs(v) > _F32_MAX) | _lost(q, v, v) | (abs(q) > _F32_MAX))
            sub = count_if(sub, (abs(v) < tiny) & (v != 0))
            if i < p:
                buf[i] = q
            else:
                buf[i - p] = buf[i - p] + q
        s = _halve(buf, p)
        sums[r] = s
        flag[r] = bad | (abs(s) > _F32_MAX)
        cnt[r, 0, 0] = sub
        _range(rg, r, 0, klo, khi)
        _range(rg, r, 1, qlo, qhi)
    return sums, cnt, rg, flag


@njit(parallel=True, **_opts)
def normalise_rows(xv, lut, mean, centre, rstd, gamma, beta, add, yv):
    """y of each row into yv (bits of the storage format): centered = x − mean (``centre``), x̂ = centered·rstd,
    affine = x̂·γ (+ β where ``add``), y = affine stored; the stages centered, xhat, affine, y (counts of y's
    subnormals and values lost to zero): (cnt, rg, flag)."""
    rows, n = xv.shape
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 4)
    tiny = format_tiny(yv)
    for r in prange(rows):
        m, s = mean[r], rstd[r]
        k0lo, k0hi, k1lo, k1hi, k2lo, k2hi, k3lo, k3hi = (_KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI,
                                                          _KEY_LO, _KEY_HI)
        sub, lost, bad = _I0, _I0, _I0
        for i in range(n):
            x = np.float32(decode(xv[r, i], lut))
            c = x - m if centre else x
            xh = c * s
            g = gamma[i]
            a = xh * g
            bad = mark_if(bad, ~_ok32(c) | ~_ok32(xh) | _lost(xh, c, s) | _lost(a, xh, g))
            if add:
                a = a + beta[i]
            bad = mark_if(bad, ~_ok32(a))
            yf, yb = encode(a, yv, lut)
            yv[r, i] = yb
            bad = mark_if(bad, abs(yf) > _F32_MAX)
            sub = count_if(sub, (abs(yf) < tiny) & (yf != 0))
            lost = count_if(lost, (yf == 0) & (a != 0))
            kc, kx, ka, ky = order_key(c), order_key(xh), order_key(a), order_key(yf)
            k0lo, k0hi, k1lo, k1hi = min(k0lo, kc), max(k0hi, kc), min(k1lo, kx), max(k1hi, kx)
            k2lo, k2hi, k3lo, k3hi = min(k2lo, ka), max(k2hi, ka), min(k3lo, ky), max(k3hi, ky)
        flag[r] = bad
        cnt[r, 3, 0], cnt[r, 3, 1] = sub, lost
        _range(rg, r, 0, k0lo, k0hi)
        _range(rg, r, 1, k1lo, k1hi)
        _range(rg, r, 2, k2lo, k2hi)
        _range(rg, r, 3, k3lo, k3hi)
    return cnt, rg, flag


@njit(parallel=True, **_opts)
def backward_sums(dyv, xv, lut, mean, centre, inv, gamma, p, with_g):
    """The backward's first pass over each row: dy and x loaded, centered = x − mean (``centre``), x̂ =
    centered·rstd, g = dy·γ, and Σ g·x̂ (each product rounded) and (``with_g``) Σ g by the pairwise tree; the
    stages dy, x, centered, xhat, dy_gamma: (Σ g·x̂, Σ g, cnt, rg, flag)."""
    rows, n = xv.shape
    sgx = np.empty(rows, dtype=np.float32)
    sg = np.zeros(rows, dtype=np.float32)
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 5)
    tiny = format_tiny(xv)
    for r in prange(rows):
        b1 = np.empty(p, dtype=np.float32)
        b2 = np.empty(p, dtype=np.float32)
        m, s = mean[r], inv[r]
        lo = np.full(5, _KEY_LO, dtype=np.int32)
        hi = np.full(5, _KEY_HI, dtype=np.int32)
        sdy, sx, bad = _I0, _I0, _I0
        for i in range(n):
            dy = np.float32(decode(dyv[r, i], lut))
            x = np.float32(decode(xv[r, i], lut))
            c = x - m if centre else x
            xh = c * s
            g = dy * gamma[i]
            t = g * xh
            bad = mark_if(bad, (abs(dy) > _F32_MAX) | (abs(x) > _F32_MAX) | ~_ok32(c) | ~_ok32(xh) | ~_ok32(g)
                          | ~_ok32(t) | _lost(xh, c, s) | _lost(g, dy, gamma[i]) | _lost(t, g, xh))
            sdy = count_if(sdy, (abs(dy) < tiny) & (dy != 0))
            sx = count_if(sx, (abs(x) < tiny) & (x != 0))
            k0, k1, k2, k3, k4 = order_key(dy), order_key(x), order_key(c), order_key(xh), order_key(g)
            lo[0], hi[0] = min(lo[0], k0), max(hi[0], k0)
            lo[1], hi[1] = min(lo[1], k1), max(hi[1], k1)
            lo[2], hi[2] = min(lo[2], k2), max(hi[2], k2)
            lo[3], hi[3] = min(lo[3], k3), max(hi[3], k3)
            lo[4], hi[4] = min(lo[4], k4), max(hi[4], k4)
            if i < p:
                b1[i] = t
                b2[i] = g
            else:
                b1[i - p] = b1[i - p] + t
                b2[i - p] = b2[i - p] + g
        s1 = _halve(b1, p)
        sgx[r] = s1
        bad = mark_if(bad, abs(s1) > _F32_MAX)
        if with_g:
            s2 = _halve(b2, p)
            sg[r] = s2
            bad = mark_if(bad, abs(s2) > _F32_MAX)
        flag[r] = bad
        cnt[r, 0, 0], cnt[r, 1, 0] = sdy, sx
        for j in range(5):
            _range(rg, r, j, lo[j], hi[j])
    return sgx, sg, cnt, rg, flag


@njit(parallel=True, **_opts)
def backward_dx(dyv, xv, lut, mean, centre, inv, gamma, m2, m1, dxv):
    """dx of each row into dxv (bits of the storage format): x̂ and g = dy·γ formed again, d = g − x̂·m2 (− m1 where
    ``centre``), dx = d·rstd stored; the stages dx_compute and dx (counts of dx's subnormals and values lost to
    zero): (cnt, rg, flag)."""
    rows, n = xv.shape
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 2)
    tiny = format_tiny(dxv)
    for r in prange(rows):
        m, s, a2, a1 = mean[r], inv[r], m2[r], m1[r]
        klo, khi, dlo, dhi, sub, lost, bad = _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI, _I0, _I0, _I0
        for i in range(n):
            dy = np.float32(decode(dyv[r, i], lut))
            x = np.float32(decode(xv[r, i], lut))
            c = x - m if centre else x
            xh = c * s
            g = dy * gamma[i]
            t = xh * a2
            d = g - t
            if centre:
                d = d - a1
            dc = d * s
            bad = mark_if(bad, ~_ok32(t) | ~_ok32(d) | ~_ok32(dc) | _lost(t, xh, a2) | _lost(dc, d, s))
            df, db = encode(dc, dxv, lut)
            dxv[r, i] = db
            bad = mark_if(bad, abs(df) > _F32_MAX)
            sub = count_if(sub, (abs(df) < tiny) & (df != 0))
            lost = count_if(lost, (df == 0) & (dc != 0))
            k1, k2 = order_key(dc), order_key(df)
            klo, khi, dlo, dhi = min(klo, k1), max(khi, k1), min(dlo, k2), max(dhi, k2)
        flag[r] = bad
        cnt[r, 1, 0], cnt[r, 1, 1] = sub, lost
        _range(rg, r, 0, klo, khi)
        _range(rg, r, 1, dlo, dhi)
    return cnt, rg, flag


@njit(**_opts)
def _add_counted(a, b, over):
    """a + b in binary32, with over + 1 where finite addends overflowed."""
    s = a + b
    if abs(s) > _F32_MAX and abs(a) <= _F32_MAX and abs(b) <= _F32_MAX:
        over += 1
    return s, over


@njit(parallel=True, **_opts)
def param_sums(dyv, xv, lut, mean, centre, inv, p, with_beta, width):
    """dγ = Σ over the rows of dy·x̂ (each product rounded to binary32) and dβ = Σ dy (``with_beta``) for each
    column, by the pairwise tree over the rows, columns in blocks of ``width`` in parallel; with the overflows
    of each column's additions: (dγ, dβ, overflows of dγ, of dβ)."""
    rows, n = xv.shape
    dg = np.zeros(n, dtype=np.float32)
    dbt = np.zeros(n, dtype=np.float32)
    og = np.zeros(n, dtype=np.int64)
    ob = np.zeros(n, dtype=np.int64)
    blocks = -(-n // width)
    for blk in prange(blocks):
        c0 = blk * width
        w = min(width, n - c0)
        bg = np.empty((p, w), dtype=np.float32)
        bb = np.empty((p, w), dtype=np.float32)
        cg = np.zeros(w, dtype=np.int64)
        cb = np.zeros(w, dtype=np.int64)
        for r in range(rows):
            m, s = mean[r], inv[r]
            q = r if r < p else r - p
            for j in range(w):
                dy = np.float32(decode(dyv[r, c0 + j], lut))
                x = np.float32(decode(xv[r, c0 + j], lut))
                c = x - m if centre else x
                t = dy * (c * s)
                if r < p:
                    bg[q, j] = t
                    bb[q, j] = dy
                else:
                    bg[q, j], cg[j] = _add_counted(bg[q, j], t, cg[j])
                    if with_beta:
                        bb[q, j], cb[j] = _add_counted(bb[q, j], dy, cb[j])
        h = p
        while h > 1:
            h //= 2
            for i in range(h):
                for j in range(w):
                    bg[i, j], cg[j] = _add_counted(bg[i, j], bg[i + h, j], cg[j])
                    if with_beta:
                        bb[i, j], cb[j] = _add_counted(bb[i, j], bb[i + h, j], cb[j])
        for j in range(w):
            dg[c0 + j], og[c0 + j] = bg[0, j], cg[j]
            dbt[c0 + j], ob[c0 + j] = bb[0, j], cb[j]
    return dg, dbt, og, ob

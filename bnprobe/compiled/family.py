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

__all__ = ["layer_sums", "rms_sums", "normalise_rows", "backward"]

_F32_TINY = np.float32(1.1754943508222875e-38)
_F32_MAX = np.float32(3.4028234663852886e38)
_KEY_LO, _KEY_HI = np.int32(np.iinfo(np.int32).max), np.int32(np.iinfo(np.int32).min)  # an empty range
_I0 = np.int32(0)


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
def _tree(buf, n, p):
    """The pairwise tree's sum of buf[:n] (p the largest power of two <= n): buf[i] + buf[i + p] for i < n - p, then
    halves added until one is left (buf is overwritten)."""
    for i in range(n - p):
        buf[i] = buf[i] + buf[i + p]
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


@njit(**_opts)
def _ends(rg, r, j, a, b):
    """Stage j's range from its values at the two ends of the range of the value it is monotone in (a correctly
    rounded x − c, x·c and a rounding to a format never reverse the order of two values: a product by a negative c
    turns it round, whence min and max)."""
    rg[r, j, 0], rg[r, j, 1] = min(a, b), max(a, b)


@njit(parallel=True, **_opts)
def layer_sums(xv, lut, p):
    """Σx and Σ(x − mean)² of each row of x (its bits, (rows, n)) by the pairwise tree, mean = Σx / n in binary32
    (one correctly rounded division, as the numpy route's float64 division rounded to fp32: n < 2^24), each
    difference and square rounded; the stage x's counts and range: (Σx, mean, Σ(x − mean)², cnt, rg, flag), the
    sums and mean float32 (rows,).  The row is read twice while it is in cache."""
    rows, n = xv.shape
    sums = np.empty(rows, dtype=np.float32)
    means = np.empty(rows, dtype=np.float32)
    devs = np.empty(rows, dtype=np.float32)
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 1)
    tiny = format_tiny(xv)
    count = np.float32(n)
    for r in prange(rows):
        buf = np.empty(n, dtype=np.float32)
        klo, khi, sub, bad = _KEY_LO, _KEY_HI, _I0, _I0
        for i in range(n):
            v = np.float32(decode(xv[r, i], lut))
            k = order_key(v)
            klo, khi = min(klo, k), max(khi, k)
            bad = mark_if(bad, abs(v) > _F32_MAX)
            sub = count_if(sub, (abs(v) < tiny) & (v != 0))
            buf[i] = v
        s = _tree(buf, n, p)
        m = s / count
        for i in range(n):
            d = np.float32(decode(xv[r, i], lut)) - m
            q = d * d
            bad = mark_if(bad, _lost(q, d, d) | (abs(q) > _F32_MAX))
            buf[i] = q
        sq = _tree(buf, n, p)
        sums[r], means[r], devs[r] = s, m, sq
        flag[r] = bad | (abs(s) > _F32_MAX) | (abs(sq) > _F32_MAX)
        cnt[r, 0, 0] = sub
        _range(rg, r, 0, klo, khi)
    return sums, means, devs, cnt, rg, flag


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
        buf = np.empty(n, dtype=np.float32)
        klo, khi, qlo, qhi, sub, bad = _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI, _I0, _I0
        for i in range(n):
            v = np.float32(decode(xv[r, i], lut))
            q = v * v
            k, kq = order_key(v), order_key(q)
            klo, khi, qlo, qhi = min(klo, k), max(khi, k), min(qlo, kq), max(qhi, kq)
            bad = mark_if(bad, (abs(v) > _F32_MAX) | _lost(q, v, v) | (abs(q) > _F32_MAX))
            sub = count_if(sub, (abs(v) < tiny) & (v != 0))
            buf[i] = q
        s = _tree(buf, n, p)
        sums[r] = s
        flag[r] = bad | (abs(s) > _F32_MAX)
        cnt[r, 0, 0] = sub
        _range(rg, r, 0, klo, khi)
        _range(rg, r, 1, qlo, qhi)
    return sums, cnt, rg, flag


@njit(**_opts)
def _small(s, gmin):
    """The |x − mean| below which a nonzero centered value of a row, its x̂ = centered·s or x̂·γ (γ's least nonzero
    magnitude ``gmin``) may be a binary32 subnormal or zero (with margin): one test per value in place of one per
    stage, as each is monotone in |centered| (s > 0: rstd)."""
    t = _F32_TINY * np.float32(4.0)
    sg = s * gmin
    if not (s > 0 and sg > 0):  # (the row is flagged anyway; numba's division by zero raises)
        return np.float32(np.inf)
    return max(t, t / s, t / sg)


@njit(parallel=True, **_opts)
def normalise_rows(xv, lut, xr, mean, centre, rstd, gamma, gmin, beta, add, yv):
    """y of each row into yv (bits of the storage format): centered = x − mean (``centre``), x̂ = centered·rstd,
    affine = x̂·γ (+ β where ``add``), y = affine stored; the stages centered, xhat, affine, y (counts of y's
    subnormals and values lost to zero), the ranges of centered and xhat from the row's range of x ``xr`` (rows, 2)
    and y's from affine's (:func:`_ends`): (cnt, rg, flag).  A row is flagged where a centered value is nonzero but
    small enough for a later stage to be subnormal or lost (:func:`_small`), where centered or x̂ is not finite (at
    the ends of their ranges), and where affine is not finite, is subnormal, or y overflows."""
    rows, n = xv.shape
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 4)
    tiny = format_tiny(yv)
    zero = np.float32(0.0)
    for r in prange(rows):
        m = mean[r] if centre else zero
        s = rstd[r]
        small = _small(s, gmin)
        klo, khi, sub, lost, bad = _KEY_LO, _KEY_HI, _I0, _I0, _I0
        for i in range(n):
            x = np.float32(decode(xv[r, i], lut))
            c = x - m  # (x − 0 is x: RMSNorm's x̂ = x·rstd)
            p = (c * s) * gamma[i]
            a = p + beta[i] if add else p
            bad = mark_if(bad, ((abs(c) < small) & (c != 0)) | ~_ok32(a))
            yf, yb = encode(a, yv, lut)
            yv[r, i] = yb
            bad = mark_if(bad, abs(yf) > _F32_MAX)
            sub = count_if(sub, (abs(yf) < tiny) & (yf != 0))
            lost = count_if(lost, (yf == 0) & (a != 0))
            ka = order_key(a)
            klo, khi = min(klo, ka), max(khi, ka)
        x0, x1 = xr[r, 0], xr[r, 1]
        c0, c1 = x0 - m, x1 - m
        h0, h1 = c0 * s, c1 * s
        flag[r] = bad | ~(_ok32(c0) & _ok32(c1) & _ok32(h0) & _ok32(h1)) | ~(s > 0)
        cnt[r, 3, 0], cnt[r, 3, 1] = sub, lost
        _ends(rg, r, 0, c0, c1)
        _ends(rg, r, 1, h0, h1)
        _range(rg, r, 2, klo, khi)
        _ends(rg, r, 3, encode(from_key(klo), yv, lut)[0], encode(from_key(khi), yv, lut)[0])
    return cnt, rg, flag


@njit(**_opts)
def _back_row(dyv, xv, lut, r, m, s, centre, gamma, count, dxv, b1, b2, tg, tb, per_row, cnt, rg, flag, tiny):
    """Row r of the backward: Σ g·x̂ and Σ g (g = dy·γ, x̂ = (x − mean)·rstd, RMSNorm x·rstd) by the pairwise tree,
    m2 = Σ g·x̂ / R and m1 = Σ g / R (one correctly rounded binary32 division each: R < 2^24), then (the row in
    cache) dx = ((g − x̂·m2) − m1)·rstd stored into dxv; per_row[r] gets (Σ g·x̂, Σ g, m2, m1), tg and tb the row's
    terms of dγ (dy·x̂) and dβ (dy).  Stages dy, x, centered, xhat, dy_gamma, dx_compute, dx."""
    n = xv.shape[1]
    p = 1
    while (p << 1) <= n:
        p <<= 1
    l0, h0, l1, h1, l4, h4 = _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI
    sdy, sx, bad = _I0, _I0, _I0
    small = _small(s, np.float32(1.0))
    for i in range(n):
        dy = np.float32(decode(dyv[r, i], lut))
        x = np.float32(decode(xv[r, i], lut))
        c = x - m
        xh = c * s
        gm = gamma[i]
        g = dy * gm
        t = g * xh
        # (a small centered value: x̂ may be subnormal or lost; g = dy·γ and g·x̂ subnormal or lost; the stages'
        # non-finite values show at the ends of their ranges, the products' in the sums)
        bad = mark_if(bad, ((abs(c) < small) & (c != 0)) | ((abs(g) < _F32_TINY) & (dy != 0) & (gm != 0))
                      | ((abs(t) < _F32_TINY) & (g != 0) & (xh != 0)))
        sdy = count_if(sdy, (abs(dy) < tiny) & (dy != 0))
        sx = count_if(sx, (abs(x) < tiny) & (x != 0))
        k0, k1, k4 = order_key(dy), order_key(x), order_key(g)
        l0, h0, l1, h1, l4, h4 = min(l0, k0), max(h0, k0), min(l1, k1), max(h1, k1), min(l4, k4), max(h4, k4)
        b1[i] = t
        b2[i] = g
    s1 = _tree(b1, n, p)
    s2 = _tree(b2, n, p) if centre else np.float32(0.0)
    a2 = s1 / count
    a1 = s2 / count
    per_row[r, 0], per_row[r, 1], per_row[r, 2], per_row[r, 3] = s1, s2, a2, a1
    klo, khi, sub, lost = _KEY_LO, _KEY_HI, _I0, _I0
    for i in range(n):
        dy = np.float32(decode(dyv[r, i], lut))
        xh = (np.float32(decode(xv[r, i], lut)) - m) * s
        g = dy * gamma[i]
        t = xh * a2
        d0 = g - t
        d = d0 - a1 if centre else d0
        dc = d * s
        # (x̂·m2 lost or subnormal; dx_compute subnormal or lost; its non-finite values show at its range's ends)
        bad = mark_if(bad, ((abs(t) < _F32_TINY) & (xh != 0) & (a2 != 0)) | ((abs(dc) < _F32_TINY) & (d != 0)))
        df, db = encode(dc, dxv, lut)
        dxv[r, i] = db
        bad = mark_if(bad, abs(df) > _F32_MAX)
        sub = count_if(sub, (abs(df) < tiny) & (df != 0))
        lost = count_if(lost, (df == 0) & (dc != 0))
        k1 = order_key(dc)
        klo, khi = min(klo, k1), max(khi, k1)
        tg[i] = dy * xh
        tb[i] = dy
    x0, x1, d0, d1 = from_key(l1), from_key(h1), from_key(klo), from_key(khi)
    c0, c1 = x0 - m, x1 - m
    ends = (from_key(l0), from_key(h0), x0, x1, c0, c1, c0 * s, c1 * s, from_key(l4), from_key(h4), d0, d1)
    ok = ~(s > 0)
    for v in ends:
        ok = ok | ~_ok32(v)
    flag[r] = bad | ok | (abs(s1) > _F32_MAX) | (abs(s2) > _F32_MAX)
    cnt[r, 0, 0], cnt[r, 1, 0], cnt[r, 6, 0], cnt[r, 6, 1] = sdy, sx, sub, lost
    _range(rg, r, 0, l0, h0)
    _range(rg, r, 1, l1, h1)
    _ends(rg, r, 2, c0, c1)
    _ends(rg, r, 3, c0 * s, c1 * s)
    _range(rg, r, 4, l4, h4)
    _range(rg, r, 5, klo, khi)
    _ends(rg, r, 6, encode(d0, dxv, lut)[0], encode(d1, dxv, lut)[0])


@njit(**_opts)
def _bitrev(j, bits):
    out = 0
    for _ in range(bits):
        out = (out << 1) | (j & 1)
        j >>= 1
    return out


@njit(parallel=True, **_opts)
def backward(dyv, xv, lut, mean, centre, inv, gamma, dxv, parts):
    """The standard backward of each row in one pass over dy and x (:func:`_back_row`: its sums, then dx while the
    row is in cache), dx written into dxv (bits of the storage format), and in the same pass dγ = Σ over the rows
    of dy·x̂ and dβ = Σ dy per column by the pairwise tree over the rows (numerics.reduce.tree_sum): (per-row
    (Σ g·x̂, Σ g, m2, m1) float32 (rows, 4), cnt, rg, flag, dγ, dβ).

    That tree adds row i to row i + P/2 first (P the largest power of two <= rows, after rows P.. were added onto
    the first ones), so it is the tree of contiguous halves over the rows in bit-reversed order: the rows are taken
    in that order, ``parts`` (a power of two) contiguous runs of it in parallel, each summed by a stack of partial
    sums (a binary counter: each completed pair of halves added left + right), the parts' sums then added in
    adjacent pairs.  No addition of finite binary32 values underflows and an overflow cannot be undone: a column
    whose sum is finite had no event (the caller sums the others again, counting)."""
    rows, n = xv.shape
    flag = np.zeros(rows, dtype=np.int64)
    cnt, rg = _new(rows, 7)
    per_row = np.zeros((rows, 4), dtype=np.float32)
    tiny = format_tiny(dxv)
    zero = np.float32(0.0)
    count = np.float32(n)
    bits = 0
    while (2 << bits) <= rows:
        bits += 1
    p = 1 << bits
    per = p // parts
    levels = 0
    while (1 << levels) < per:
        levels += 1
    res_g = np.empty((parts, n), dtype=np.float32)
    res_b = np.empty((parts, n), dtype=np.float32)
    for part in prange(parts):
        sg = np.empty((levels + 1, n), dtype=np.float32)
        sb = np.empty((levels + 1, n), dtype=np.float32)
        b1 = np.empty(n, dtype=np.float32)
        b2 = np.empty(n, dtype=np.float32)
        tg = np.empty(n, dtype=np.float32)
        tb = np.empty(n, dtype=np.float32)
        ug = np.empty(n, dtype=np.float32)
        ub = np.empty(n, dtype=np.float32)
        for jj in range(per):
            i = _bitrev(part * per + jj, bits)
            _back_row(dyv, xv, lut, i, mean[i] if centre else zero, inv[i], centre, gamma, count, dxv, b1, b2, tg,
                      tb, per_row, cnt, rg, flag, tiny)
            if i + p < rows:  # the leaf is row i + row i + P
                k = i + p
                _back_row(dyv, xv, lut, k, mean[k] if centre else zero, inv[k], centre, gamma, count, dxv, b1, b2,
                          ug, ub, per_row, cnt, rg, flag, tiny)
                for c in range(n):
                    tg[c] = tg[c] + ug[c]
                    tb[c] = tb[c] + ub[c]
            level = 0
            while (jj >> level) & 1:
                for c in range(n):
                    tg[c] = sg[level, c] + tg[c]
                    tb[c] = sb[level, c] + tb[c]
                level += 1
            sg[level, :] = tg
            sb[level, :] = tb
        res_g[part, :] = sg[levels]
        res_b[part, :] = sb[levels]
    h = parts
    while h > 1:
        h //= 2
        for k in range(h):
            for c in range(n):
                res_g[k, c] = res_g[2 * k, c] + res_g[2 * k + 1, c]
                res_b[k, c] = res_b[2 * k, c] + res_b[2 * k + 1, c]
    return per_row, cnt, rg, flag, res_g[0].copy(), res_b[0].copy()

"""The compiled route's general kernels: BatchNorm's elementwise passes and reductions on float64 blocks, in
every format and rounding the route takes, rounded in float64 exactly as the numpy route rounds.

Semantics are the float64 route's, operation for operation: each operation is formed in float64
(exact for +, -, x of values of formats up to fp32; +, -, x, / rounded twice, float64 then the target,
equal to one rounding since 53 >= 2p + 2, see numerics/arith.py) and rounded once to its format by
:func:`_rnd`, which reproduces ``numerics.rounding.round_detail`` (every mode but stochastic, IEEE or
saturating overflow, kept or flushed subnormals) and ``Arith.round``'s events: overflow, saturated,
underflow, flushed.  Reductions add in the policy's order (``numerics.reduce``).  Each pass also counts,
per channel and stage, what ``Trace.record`` counts: NaN, +inf, -inf, the events, subnormals, and the
range of the finite values.  That counting is complete: the caller also computes again with these kernels
the channels a fast kernel (``compiled_fast``) flagged.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bnprobe.compiled.codes import (
    ADD_DEV_SQUARE,
    ADD_SQUARE,
    ADD_X,
    DX_ASCEND,
    DX_STANDARD,
    EV_FLUSHED,
    EV_OVERFLOW,
    EV_SATURATED,
    EV_UNDERFLOW,
    N_AFFINE,
    N_CENTERED,
    N_X_COMPUTE,
    N_XHAT,
    N_Y,
    Y_AFFINE,
    Y_XHAT,
    new_stats,
)
from bnprobe.compiled.codes import JIT_OPTIONS as _opts

_MAXF64 = 1.7976931348623157e308
_FRAC = (1 << 52) - 1

# No helper these kernels call per value takes an array: a call counts references to its array arguments
# (atomic adds), which made passes 20x slower; counters are carried in tuples instead (see _note) and written
# to arrays once per channel.  (LLVM inlines those counter helpers, _stat0, _ev, _note, _put and _tally, into their
# callers; the rounding, _rnd, stays a call per rounding (no inline option is set on it).)


@njit(**_opts)
def _pow2(q):
    """2.0**q for -1022 <= q <= 1023, from its bits."""
    return np.int64((q + 1023) << 52).view(np.float64)


@njit(**_opts)
def _round_bits(v, s):
    """Finite, nonzero v rounded to the format of spec s with an unbounded exponent above and gradual
    underflow below, then overflow to inf or max as round_detail does; (value, overflowed)."""
    mant = np.int64(s[1])
    emin = np.int64(s[2])
    mode = np.int64(s[3])
    neg = v < 0.0
    u = np.float64(abs(v)).view(np.int64)
    big_e = u >> 52
    if big_e == 0:  # a float64 subnormal: far below every format rounded here
        e = np.int64(-1022)
        m = u
    else:
        e = big_e - 1023
        m = (u & _FRAC) | (np.int64(1) << 52)
    sh = 52 - mant
    if e < emin:
        sh += emin - e
    if sh > 60:  # below a quarter of the smallest subnormal: only its nonzero-ness matters
        m = np.int64(1)
        sh = np.int64(60)
    r = m >> sh
    rem = m & ((np.int64(1) << sh) - 1)
    half = np.int64(1) << (sh - 1)
    if mode == 0:
        if rem > half or (rem == half and (r & 1) == 1):
            r += 1
    elif mode == 1:
        if rem >= half:
            r += 1
    elif mode == 3:
        if rem != 0 and not neg:
            r += 1
    elif mode == 4:
        if rem != 0 and neg:
            r += 1
    q = (e if e > emin else emin) - mant
    mag = np.float64(r) * _pow2(q)
    over = mag > s[6]
    if over:  # IEEE 754 7.4: roundings that point back toward zero give max
        to_max = mode == 2 or (mode == 3 and neg) or (mode == 4 and not neg)
        mag = s[6] if to_max else np.inf
    return (-mag if neg else mag), over


@njit(**_opts)
def _round_nearest_even(v, s):
    """_round_bits for nearest-even, by one float64 addition: adding C = 1.5 * 2^(q + 52), with 2^q the
    format's quantum at v, rounds v to a multiple of 2^q (ties to even: C / 2^q is even), and
    subtracting C is exact.  Values from 2^128 up overflow every format rounded here."""
    e = ((np.float64(v).view(np.int64) >> 52) & 0x7FF) - 1023
    if e >= 128:
        return (-np.inf if v < 0.0 else np.inf), True
    emin = np.int64(s[2])
    q = (e if e > emin else emin) - np.int64(s[1])
    c = np.int64((q + 1075) << 52 | (np.int64(1) << 51)).view(np.float64)
    r = (v + c) - c
    if r == 0.0:
        return (-0.0 if v < 0.0 else 0.0), False
    if abs(r) > s[6]:
        return (-np.inf if v < 0.0 else np.inf), True
    return r, False


@njit(**_opts)
def _rnd(v, s):
    """v (a float64) rounded to the format of spec s: (value, event bits), as Arith.round with a tally."""
    kind = s[0]
    if kind == 0.0:
        return v, 0
    ev = 0
    r = v
    if abs(v) <= _MAXF64 and v != 0.0:
        if kind == 1.0:
            r = np.float64(np.float32(v))
            if abs(r) > _MAXF64:
                ev = EV_OVERFLOW
        else:
            r, over = _round_nearest_even(v, s) if s[3] == 0.0 else _round_bits(v, s)
            if over:
                ev = EV_OVERFLOW
    if s[4] != 0.0:  # saturate: inf to +-max, NaN to 0
        if r != r:
            r = 0.0
            ev |= EV_SATURATED
        elif abs(r) > _MAXF64:
            r = -s[6] if v < 0.0 else s[6]
            ev |= EV_SATURATED
    if s[5] != 0.0 and r != 0.0 and abs(r) < s[7]:
        r = -0.0 if r < 0.0 else 0.0
        ev |= EV_FLUSHED
    if r == 0.0 and v != 0.0 and abs(v) <= _MAXF64:
        ev |= EV_UNDERFLOW
    return r, ev


# ---- counters, carried per stage as a tuple (nan, posinf, neginf, overflow, saturated, underflow, flushed,
# subnormal, least finite, greatest finite) and written once per channel

@njit(**_opts)
def _stat0():
    z = np.int64(0)
    return (z, z, z, z, z, z, z, z, np.inf, -np.inf)


@njit(**_opts)
def _ev(st, ev):
    """st with one rounding's events added."""
    if ev == 0:
        return st
    return (st[0], st[1], st[2], st[3] + (ev & EV_OVERFLOW), st[4] + ((ev >> 1) & 1), st[5] + ((ev >> 2) & 1),
            st[6] + ((ev >> 3) & 1), st[7], st[8], st[9])


@njit(**_opts)
def _note(st, r, ev, tiny):
    """st with stored value r (and the events of the rounding that made it) counted."""
    a = abs(r)
    nan, pos, neg, sub, lo, hi = st[0], st[1], st[2], st[7], st[8], st[9]
    if a <= _MAXF64:
        if r < lo:
            lo = r
        if r > hi:
            hi = r
        if a < tiny and a != 0.0:
            sub += 1
    elif r != r:
        nan += 1
    elif r > 0.0:
        pos += 1
    else:
        neg += 1
    return _ev((nan, pos, neg, st[3], st[4], st[5], st[6], sub, lo, hi), ev)


@njit(**_opts)
def _put(cnt, rg, c, j, st):
    cnt[c, j, 0], cnt[c, j, 1], cnt[c, j, 2], cnt[c, j, 3] = st[0], st[1], st[2], st[3]
    cnt[c, j, 4], cnt[c, j, 5], cnt[c, j, 6], cnt[c, j, 7] = st[4], st[5], st[6], st[7]
    rg[c, j, 0], rg[c, j, 1] = st[8], st[9]


@njit(**_opts)
def _tally(t, ev):
    """A reduction's tally (overflow, saturated, underflow, flushed) with one rounding's events added."""
    if ev == 0:
        return t
    return (t[0] + (ev & EV_OVERFLOW), t[1] + ((ev >> 1) & 1), t[2] + ((ev >> 2) & 1), t[3] + ((ev >> 3) & 1))


@njit(**_opts)
def _fma_wide(a, b, c, native):
    """a*b + c as a float64 that rounds correctly to any narrower format (numerics.arith.fma_wide)."""
    p = a * b
    s = p + c
    if native:
        return s
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    if abs(s) <= _MAXF64 and abs(err) <= _MAXF64 and err != 0.0:
        bits = np.float64(s).view(np.int64)
        if (bits & 1) == 0:
            s = np.nextafter(s, np.inf if err > 0 else -np.inf)
    return s

@njit(parallel=True, **_opts)
def cast(src, dst, s):
    """Round a (k, R) float64 block to the format of s into dst, counting the stage (the general kernels take
    and give float64 blocks only, so that each is compiled once: the caller converts)."""
    k, rr = src.shape
    cnt, rg = new_stats(k, 1)
    tiny = s[7]
    for c in prange(k):
        st = _stat0()
        for i in range(rr):
            r, ev = _rnd(np.float64(src[c, i]), s)
            dst[c, i] = r
            st = _note(st, r, ev, tiny)
        _put(cnt, rg, c, 0, st)
    return cnt, rg


@njit(**_opts)
def _seq(buf, start, step, count, s, kahan, t):
    """Sequential sum of buf[start], buf[start + step], ... (count values), one rounding per addition."""
    acc, ev = _rnd(buf[start], s)
    t = _tally(t, ev)
    comp = 0.0
    for j in range(1, count):
        xj = buf[start + j * step]
        if kahan:
            y, ev = _rnd(xj - comp, s)
            t = _tally(t, ev)
            tt, ev = _rnd(acc + y, s)
            t = _tally(t, ev)
            d, _ = _rnd(tt - acc, s)
            comp, _ = _rnd(d - y, s)
            acc = tt
        else:
            acc, ev = _rnd(acc + xj, s)
            t = _tally(t, ev)
    return acc, t


@njit(**_opts)
def _tree(buf, n, s, t):
    """numerics.reduce.tree_sum over buf[:n] in place: the top n - P onto the first, then halving."""
    p = np.int64(1)
    while p * 2 <= n:
        p *= 2
    for i in range(n - p):
        buf[i], ev = _rnd(buf[i] + buf[p + i], s)
        t = _tally(t, ev)
    h = p
    while h > 1:
        h //= 2
        for i in range(h):
            buf[i], ev = _rnd(buf[i] + buf[i + h], s)
            t = _tally(t, ev)
    return buf[0], t


@njit(**_opts)
def _addend(x, bv, mv, op, s, t):
    """One addend of a reduction (x, x², (x - m)² or x·round(b)), rounded, and the tally with its events."""
    if op == ADD_X:
        return x, t
    if op == ADD_SQUARE:
        v, ev = _rnd(x * x, s)
    elif op == ADD_DEV_SQUARE:
        d, ev = _rnd(x - mv, s)
        t = _tally(t, ev)
        v, ev = _rnd(d * d, s)
    else:
        bb, ev = _rnd(bv, s)
        t = _tally(t, ev)
        v, ev = _rnd(x * bb, s)
    return v, _tally(t, ev)


@njit(parallel=True, **_opts)
def reduce(a, b, m, op, s, order, lanes, kahan, prescale):
    """Per-channel sums of a (k, R) block's addends (op: x, x², (x - m)², x·round(b)) in the accumulator
    format s, by order (sequential, pairwise, lanes), each addend first scaled by ``prescale`` (rounded,
    events not counted) when it is not 0; (sums, tally [overflow, saturated, underflow, flushed])."""
    k, rr = a.shape
    sums = np.empty(k, dtype=np.float64)
    tallies = np.zeros((k, 4), dtype=np.int64)
    width = rr
    if order == 2:
        width = -(-rr // lanes) * lanes
    for c in prange(k):
        z = np.int64(0)
        t = (z, z, z, z)
        buf = np.zeros(width, dtype=np.float64)
        mv = m[c]
        for i in range(rr):
            v, t = _addend(np.float64(a[c, i]), np.float64(b[c, i]), mv, op, s, t)
            if prescale != 0.0:
                v, _ = _rnd(v * prescale, s)
            buf[i] = v
        if order == 0:
            total, t = _seq(buf, 0, 1, rr, s, kahan, t)
        elif order == 1:
            total, t = _tree(buf, rr, s, t)
        else:
            reps = width // lanes
            per_lane = np.empty(lanes, dtype=np.float64)
            for ln in range(lanes):
                per_lane[ln], t = _seq(buf, ln, lanes, reps, s, kahan, t)
            total, t = _tree(per_lane, lanes, s, t)
        sums[c] = total
        tallies[c, 0], tallies[c, 1], tallies[c, 2], tallies[c, 3] = t[0], t[1], t[2], t[3]
    return sums, tallies


@njit(**_opts)
def _mac(a, b, c, fma, native, s):
    """a*b + c in the format of s, fused (one rounding) or as two roundings: (value, the product's events,
    the sum's events)."""
    if fma:
        r, ev = _rnd(_fma_wide(a, b, c, native), s)
        return r, 0, ev
    p, ev1 = _rnd(a * b, s)
    r, ev2 = _rnd(p + c, s)
    return r, ev1, ev2


@njit(parallel=True, **_opts)
def normalise(xs, cols, formula, fma, xcast, comp, out, y_out):
    """y from a (k, R) block of storage values: x_compute (when xcast), centered, xhat and the affine
    by the y formula, then y rounded to the output spec into the (k, R) block y_out; cols are the
    per-channel values the formula needs, already in the compute format:
    xhat (mean, rstd, gamma, beta), scale (mean, w, beta), affine (mult, addend)."""
    k, rr = xs.shape
    cnt, rg = new_stats(k, 5)
    ct, ot = comp[7], out[7]
    native = comp[0] == 0.0
    for c in prange(k):
        c0, c1, c2, c3 = cols[c, 0], cols[c, 1], cols[c, 2], cols[c, 3]
        s_x, s_c, s_h, s_a, s_y = _stat0(), _stat0(), _stat0(), _stat0(), _stat0()
        for i in range(rr):
            x = xs[c, i]
            if xcast:
                x, ev = _rnd(x, comp)
                s_x = _note(s_x, x, ev, ct)
            if formula == Y_AFFINE:
                a, e1, e2 = _mac(x, c0, c1, fma, native, comp)
            else:
                d, ev = _rnd(x - c0, comp)
                s_c = _note(s_c, d, ev, ct)
                if formula == Y_XHAT:
                    h, ev = _rnd(d * c1, comp)
                    s_h = _note(s_h, h, ev, ct)
                    a, e1, e2 = _mac(h, c2, c3, fma, native, comp)
                else:
                    a, e1, e2 = _mac(d, c1, c2, fma, native, comp)
            s_a = _note(_ev(s_a, e1), a, e2, ct)
            y, ev = _rnd(a, out)
            s_y = _note(s_y, y, ev, ot)
            y_out[c, i] = y
        _put(cnt, rg, c, N_X_COMPUTE, s_x)
        _put(cnt, rg, c, N_CENTERED, s_c)
        _put(cnt, rg, c, N_XHAT, s_h)
        _put(cnt, rg, c, N_AFFINE, s_a)
        _put(cnt, rg, c, N_Y, s_y)
    return cnt, rg


@njit(parallel=True, **_opts)
def center_scale(xc, mean, invstd, comp, xhat):
    """centered = x - mean and xhat = centered * invstd in the compute format (the backward's), xhat
    written to a (k, R) block; two stages."""
    k, rr = xc.shape
    cnt, rg = new_stats(k, 2)
    ct = comp[7]
    for c in prange(k):
        mu, iv = mean[c], invstd[c]
        s_c, s_h = _stat0(), _stat0()
        for i in range(rr):
            d, ev = _rnd(xc[c, i] - mu, comp)
            s_c = _note(s_c, d, ev, ct)
            h, ev = _rnd(d * iv, comp)
            s_h = _note(s_h, h, ev, ct)
            xhat[c, i] = h
        _put(cnt, rg, c, 0, s_c)
        _put(cnt, rg, c, 1, s_h)
    return cnt, rg


@njit(parallel=True, **_opts)
def dx(dyc, xhat, xc, cols, formula, comp, out, dx_out):
    """dx_compute by the dx formula and dx rounded to the output spec into the (k, R) block dx_out; two
    stages.  standard: (dy - mean_dy - xhat·mean_dy_xhat)·scale, cols (mean_dy, mean_dy_xhat, scale);
    ascend: (dy + x·mult + addend)·scale, cols (mult, addend, scale); constant: dy·scale, cols (scale)."""
    k, rr = dyc.shape
    cnt, rg = new_stats(k, 2)
    ct, ot = comp[7], out[7]
    for c in prange(k):
        c0, c1, c2 = cols[c, 0], cols[c, 1], cols[c, 2]
        s_d, s_y = _stat0(), _stat0()
        for j in range(rr):
            g = dyc[c, j]
            if formula == DX_STANDARD:
                d, e1 = _rnd(g - c0, comp)
                p, e2 = _rnd(xhat[c, j] * c1, comp)
                d, e3 = _rnd(d - p, comp)
                v, e4 = _rnd(d * c2, comp)
            elif formula == DX_ASCEND:
                p, e1 = _rnd(xc[c, j] * c0, comp)
                d, e2 = _rnd(g + p, comp)
                d, e3 = _rnd(d + c1, comp)
                v, e4 = _rnd(d * c2, comp)
            else:
                e1, e2, e3 = 0, 0, 0
                v, e4 = _rnd(g * c0, comp)
            s_d = _note(_ev(_ev(_ev(s_d, e1), e2), e3), v, e4, ct)
            y, ev = _rnd(v, out)
            s_y = _note(s_y, y, ev, ot)
            dx_out[c, j] = y
        _put(cnt, rg, c, 0, s_d)
        _put(cnt, rg, c, 1, s_y)
    return cnt, rg

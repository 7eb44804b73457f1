"""The compiled route's fast kernels: binary32 arithmetic where every operation is an fp32 one with the default
rounding (the fp32, fp16 and bf16 presets and their common variants), tensors stored in fp32, fp16 or bf16 by
nearest-even.  An fp32 operation on binary32 values is the CPU's own binary32 operation (see numerics/arith.py),
so the values are computed in float32 directly.

Their loops are written to be vectorised by LLVM:

- a pass's ranges come from one per-value minimum and maximum, taken on integer keys (_key: integer
  min/max vectorise, float ones do not); the other stages' ranges are those bounds carried through the
  same operations after the loop, since each stage is a monotone function of that value (a correctly
  rounded x - c, x·c, x + c and a rounding to a format never reverse the order of two values);
- what a 16-bit stored tensor commonly has (subnormals, values lost to zero) is counted;
- anything rarer (a non-finite value, an overflow, a binary32 subnormal stage value, a product lost to
  underflow) flags the channel, and the caller computes that channel again with the general kernel
  (``compiled_general``), whose counting is complete.

An unflagged channel therefore gives the general kernel's values, ranges and counters.

A 16-bit tensor is held as its bit patterns, fp16 in uint16 and bf16 in int16 arrays, so that an array's dtype
tells its format when a kernel is compiled (a format known then is worth 1.5x per pass: no branch on it in the
loop); fused._TAGS names those dtypes, the overloads _value, _store and _tiny read them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.extending import intrinsic, overload

from bnprobe.compiled.codes import (
    ADD_DEV_SQUARE,
    ADD_SQUARE,
    ADD_X,
    COUNT_SUBNORMAL,
    COUNT_UNDERFLOW,
    DX_ASCEND,
    DX_CONSTANT,
    DX_STANDARD,
    N_AFFINE,
    N_CENTERED,
    N_XHAT,
    N_Y,
    Y_AFFINE,
    Y_XHAT,
    new_stats,
)
from bnprobe.compiled.codes import JIT_OPTIONS as _opts

_F32_TINY = np.float32(1.1754943508222875e-38)
_F32_MAX = np.float32(3.4028234663852886e38)
_F16_TINY = np.float32(6.103515625e-05)


@njit(**_opts)
def _f16_rne_bits(a):
    """float32 a rounded to the nearest-even fp16, as its bit pattern (F. Giesen's float_to_half_fast3_rtne)."""
    u = np.int64(np.float32(a).view(np.int32))
    sign = (u >> 16) & 0x8000
    f = u & 0x7FFFFFFF
    if f >= 0x47800000:  # 65536 and up, inf, NaN
        o = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:  # below 2^-14: the subnormal range, rounded by adding 0.5 in binary32
        v = np.float32(np.int32(f).view(np.float32) + np.float32(0.5))
        o = np.int64(v.view(np.int32)) - 0x3F000000
    else:
        f = f - 939524096 + 0xFFF + ((f >> 13) & 1)  # rebias the exponent (15 - 127 << 23), round to even
        o = f >> 13
    return np.uint16(sign | o)


def _host_converts_half() -> bool:
    """Whether the CPU numba compiles for converts binary32 <-> fp16 in hardware (x86 F16C, every AArch64), so
    that LLVM's fptrunc/fpext to half compile to instructions (vcvtps2ph/vcvtph2ps, fcvt) and vectorise;
    elsewhere they would be calls to compiler-rt's __truncsfhf2, which numba does not link (the process
    aborts), and the bit arithmetic and table above are used.  numba's target is this CPU unless
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another (e.g. ``generic``, for caches shared between CPUs)."""
    import platform

    from llvmlite import binding
    from numba.core import config

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES:
        return "+f16c" in (config.CPU_FEATURES or "").replace(" ", "").split(",")
    return bool(binding.get_host_cpu_features().get("f16c", False))


# numba's cache is keyed by the CPU and its features, so a kernel cached with one choice is not loaded on
# a CPU that needs the other
HALF_NATIVE = _host_converts_half()


@intrinsic
def _f32_to_half(typingctx, v):
    """binary32 v rounded to fp16 (IEEE nearest-even, overflow to inf, subnormals kept), as its bit pattern."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _half_to_f32(typingctx, h):
    """The fp16 bit pattern h as a binary32 (exact)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _f16_bits(a):
    """float32 a rounded to the nearest-even fp16's bit pattern: the hardware's conversion or _f16_rne_bits."""
    raise NotImplementedError  # pragma: no cover - only its compiled overload runs


@overload(_f16_bits)
def _f16_bits_impl(a):
    if HALF_NATIVE:
        return lambda a: _f32_to_half(np.float32(a))
    return lambda a: _f16_rne_bits(a)


def _f16_value(h, lut):
    """An fp16 bit pattern's value as a binary32: the hardware's conversion or the 65,536-entry table."""
    raise NotImplementedError  # pragma: no cover - only its compiled overload runs


@overload(_f16_value)
def _f16_value_impl(h, lut):
    if HALF_NATIVE:
        return lambda h, lut: _half_to_f32(np.uint16(h))
    return lambda h, lut: lut[h]


@njit(**_opts)
def _bf16_rne_bits(a):
    """float32 a rounded to the nearest-even bf16, as its bit pattern (NaN stays a NaN, made quiet).  In uint32
    arithmetic, every step narrowed back (numba widens it to 64 bits, which halves a loop's vector width):
    no finite or infinite pattern carries out of 32 bits."""
    b = np.float32(a).view(np.uint32)
    r = np.uint32(b + np.uint32(np.uint32(0x7FFF) + np.uint32(np.uint32(b >> np.uint32(16)) & np.uint32(1))))
    q = np.uint32(np.uint32(b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16(q if a != a else np.uint32(r >> np.uint32(16)))


@njit(**_opts)
def _bf16_value(h):
    """The bf16 bit pattern h (uint16) as a binary32 (exact)."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


def _value(v, lut):
    """One source value as a float64 (compiled for each source dtype by the overload below)."""
    raise NotImplementedError  # pragma: no cover - only its compiled overload runs


@overload(_value)
def _value_impl(v, lut):
    if v == types.uint16:  # fp16 bits
        return lambda v, lut: np.float64(_f16_value(v, lut))
    if v == types.int16:  # bf16 bits
        return lambda v, lut: np.float64(_bf16_value(np.uint16(v)))
    return lambda v, lut: np.float64(v)


def _store(a, tag, lut):
    """float32 a stored nearest-even in the format of ``tag``'s dtype (float32, uint16 fp16 bits, int16 bf16 bits):
    (its value as a float32, what an array of that dtype holds)."""
    raise NotImplementedError  # pragma: no cover - only its compiled overload runs


@overload(_store)
def _store_impl(a, tag, lut):
    if tag.dtype == types.uint16:
        def fp16(a, tag, lut):
            h = _f16_bits(a)
            return _f16_value(h, lut), h
        return fp16
    if tag.dtype == types.int16:
        def bf16(a, tag, lut):
            h = _bf16_rne_bits(a)
            return _bf16_value(h), np.int16(h)
        return bf16
    return lambda a, tag, lut: (np.float32(a), np.float32(a))


def _tiny(tag):
    """The smallest normal of the format of ``tag``'s dtype, as a float32."""
    raise NotImplementedError  # pragma: no cover - only its compiled overload runs


@overload(_tiny)
def _tiny_impl(tag):
    tiny = _F16_TINY if tag.dtype == types.uint16 else _F32_TINY
    return lambda tag: tiny


@njit(**_opts)
def _key(v):
    """An int32 ordered as binary32 values compare (-0 just below +0; NaN is flagged elsewhere)."""
    b = np.float32(v).view(np.int32)
    return np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))


@njit(**_opts)
def _unkey(k):
    """The binary32 value of a _key."""
    return np.int32(k ^ ((k >> 31) & 0x7FFFFFFF)).view(np.float32)


_KEY_LO, _KEY_HI = np.int32(np.iinfo(np.int32).max), np.int32(np.iinfo(np.int32).min)  # empty range
_I0 = np.int32(0)


@njit(**_opts)
def _count(a, cond):
    """int32 count a, plus one where cond.  The loops keep their per-value keys, counts and flags in int32 (a
    row's counts, added to a channel's int64 total after each row: rows are shorter than 2^31, see
    fused.ROW_MAX): an int64 one halves the vector width of the whole loop (numba widens int32 arithmetic
    to int64 unless it is narrowed back: backward_fast took 12 ms per 2^22.6 values so, 8 ms with int32)."""
    return np.int32(a + np.int32(cond))


@njit(**_opts)
def _mark(a, cond):
    """int32 flag a, set where cond (a flag is only tested for nonzero: no count to overflow)."""
    return np.int32(a | np.int32(cond))


@njit(**_opts)
def _finite32(v):
    return abs(v) <= _F32_MAX


@njit(**_opts)
def _small32(v):
    """v is a binary32 subnormal."""
    return (abs(v) < _F32_TINY) & (v != 0)


@njit(**_opts)
def _gone32(p, a, b):
    """Binary32 product p = a·b of nonzero operands is subnormal or zero (an underflow, or a subnormal that a
    stage would count)."""
    return (abs(p) < _F32_TINY) & (a != 0) & (b != 0)


@njit(**_opts)
def _put_range(rg, c, j, a, b):
    """Stage j's range from its values at the two ends of the range of the value it is monotone in."""
    rg[c, j, 0], rg[c, j, 1] = min(a, b), max(a, b)


@njit(**_opts)
def _stored(cnt, c, j, sub, lost):
    """A stored tensor's counts: subnormals and nonzero values stored as zero (underflow)."""
    cnt[c, j, COUNT_SUBNORMAL], cnt[c, j, COUNT_UNDERFLOW] = sub, lost


@njit(parallel=True, **_opts)
def load_fast(src, off, lut, dst, tag):
    """Round channels off..off+k of a float32 or 16-bit source tensor (N, C, S) to the storage format of
    ``tag``'s dtype (nearest-even) into dst (k, N*S), counting the loaded tensor's stage; (cnt, rg, flag).  The
    whole tensor is passed, not a slice of it, so that numba knows a channels-first tensor's rows are
    contiguous."""
    nn, ss, k = src.shape[0], src.shape[2], dst.shape[0]
    cnt, rg = new_stats(k, 1)
    flag = np.zeros(k, dtype=np.int64)
    tiny = _tiny(tag)
    same = src.dtype == tag.dtype  # a 16-bit tensor in its own format: nothing to round
    for c in prange(k):
        klo, khi, sub, lost, bad = _KEY_LO, _KEY_HI, 0, 0, _I0
        for n in range(nn):
            base = n * ss
            rsub, rlost = _I0, _I0
            for i in range(ss):
                x = np.float32(_value(src[n, off + c, i], lut))
                v = x if same else _store(x, tag, lut)[0]
                dst[c, base + i] = v
                kx = _key(x)
                klo, khi = min(klo, kx), max(khi, kx)
                bad = _mark(bad, not _finite32(v))
                rsub = _count(rsub, (abs(v) < tiny) & (v != 0))
                rlost = _count(rlost, (v == 0) & (x != 0))
            sub += rsub
            lost += rlost
        flag[c] = bad
        if nn * ss > 0:
            lo, hi = _unkey(klo), _unkey(khi)
            if not same:
                lo, hi = _store(lo, tag, lut)[0], _store(hi, tag, lut)[0]
            _put_range(rg, c, 0, lo, hi)
        _stored(cnt, c, 0, sub, lost)
    return cnt, rg, flag


@njit(parallel=True, **_opts)
def reduce_fast(a, b, m, op, order, lanes, prescale, slots):
    """reduce() in binary32 (no Kahan): (sums, tallies (zero), flag)."""
    k, rr = a.shape
    sums = np.empty(k, dtype=np.float64)
    tallies = np.zeros((k, 4), dtype=np.int64)
    flag = np.zeros(k, dtype=np.int64)
    pre = np.float32(prescale)
    scratch = _scratch(rr, order, lanes, 1, slots)
    for c in prange(k):
        buf = _buffer(scratch, 0)
        buf[rr:] = 0.0  # the lanes' padding
        mv = np.float32(m[c])
        lost = _I0  # a product of nonzero addends lost to zero: an underflow event (a flag)
        if op == ADD_X:
            for i in range(rr):
                buf[i] = a[c, i]
        elif op == ADD_SQUARE:
            for i in range(rr):
                x = a[c, i]
                v = x * x
                lost = _mark(lost, (v == 0) & (x != 0))
                buf[i] = v
        elif op == ADD_DEV_SQUARE:
            for i in range(rr):
                d = a[c, i] - mv
                v = d * d
                lost = _mark(lost, (v == 0) & (d != 0))
                buf[i] = v
        else:
            for i in range(rr):
                x, bv = a[c, i], b[c, i]
                v = x * bv
                lost = _mark(lost, (v == 0) & (x != 0) & (bv != 0))
                buf[i] = v
        if prescale != 0.0:
            for i in range(rr):
                buf[i] *= pre
        s = _sum32(buf, rr, order, lanes)
        sums[c] = s
        flag[c] = lost + (not _finite32(s))  # an inf or NaN addend, or an overflow, leaves the sum not finite
    return sums, tallies, flag


@njit(**_opts)
def _scratch(rr, order, lanes, count, slots):
    """``count`` buffers of addends for each of ``slots`` threads (a fresh buffer per channel is mapped and
    faulted in each time), each as wide as the order needs (lanes: whole rows, the last padded with zeros)."""
    width = -(-rr // lanes) * lanes if order == 2 else rr
    return np.empty((slots, count, width), dtype=np.float32)


@njit(**_opts)
def _buffer(scratch, j):
    """The calling thread's buffer j of _scratch (a fresh one should its thread id be beyond them)."""
    tid = get_thread_id()
    if tid < scratch.shape[0]:
        return scratch[tid, j]
    return np.zeros(scratch.shape[2], dtype=np.float32)


@njit(**_opts)
def _sum32(buf, rr, order, lanes):
    """The binary32 sum of addends buf[:rr] in the policy's order (numerics.reduce); buf is overwritten (and
    read to its end, zeros after rr, for the lanes order)."""
    if order == 0:
        s = buf[0]
        for j in range(1, rr):
            s += buf[j]
        return s
    n = rr
    if order == 2:  # lane l adds buf[l], buf[l + lanes], ... in turn: all lanes at once, row by row
        for j in range(1, buf.size // lanes):
            row = j * lanes
            for ln in range(lanes):
                buf[ln] += buf[row + ln]
        n = lanes
    p = 1
    while p * 2 <= n:
        p *= 2
    for i in range(n - p):
        buf[i] += buf[p + i]
    h = p
    while h > 1:
        h //= 2
        for i in range(h):
            buf[i] += buf[i + h]
    return buf[0]


@njit(parallel=True, **_opts)
def backward_fast(dy_src, x_src, off, k, lut, tag, mean, invstd, order, lanes, slots):
    """The backward's first pass in binary32, over channels off..off+k of the tensors dy and x (N, C, S): both
    loaded (rounded to the storage format of ``tag``'s dtype), centered = x - mean, xhat = centered·invstd,
    and the sums of dy and of dy·xhat by the order; (cnt, rg of the stages dy, x, centered, xhat; sums (k, 2);
    flag).  Nothing is stored: dx_source_fast computes the values again.  For runs whose compute and
    accumulator formats are fp32 (no cast between the stages)."""
    nn, ss = x_src.shape[0], x_src.shape[2]
    rr = nn * ss
    cnt, rg = new_stats(k, 4)
    sums = np.empty((k, 2), dtype=np.float64)
    flag = np.zeros(k, dtype=np.int64)
    tiny = _tiny(tag)
    same_dy, same_x = dy_src.dtype == tag.dtype, x_src.dtype == tag.dtype
    scratch = _scratch(rr, order, lanes, 2, slots)
    for c in prange(k):
        mu, iv = np.float32(mean[c]), np.float32(invstd[c])
        b_dy, b_dyh = _buffer(scratch, 0), _buffer(scratch, 1)
        b_dy[rr:] = 0.0
        b_dyh[rr:] = 0.0
        kglo, kghi, kxlo, kxhi = _KEY_LO, _KEY_HI, _KEY_LO, _KEY_HI
        gsub, glost, xsub, xlost, bad = 0, 0, 0, 0, _I0
        for n in range(nn):
            base = n * ss
            rgsub, rglost, rxsub, rxlost = _I0, _I0, _I0, _I0
            for i in range(ss):
                j = base + i
                g0 = np.float32(_value(dy_src[n, off + c, i], lut))
                g = g0 if same_dy else _store(g0, tag, lut)[0]
                x0 = np.float32(_value(x_src[n, off + c, i], lut))
                x = x0 if same_x else _store(x0, tag, lut)[0]
                kg, kx = _key(g0), _key(x0)
                kglo, kghi, kxlo, kxhi = min(kglo, kg), max(kghi, kg), min(kxlo, kx), max(kxhi, kx)
                rgsub = _count(rgsub, (abs(g) < tiny) & (g != 0))
                rglost = _count(rglost, (g == 0) & (g0 != 0))
                rxsub = _count(rxsub, (abs(x) < tiny) & (x != 0))
                rxlost = _count(rxlost, (x == 0) & (x0 != 0))
                d = x - mu
                h = d * iv
                p = g * h
                b_dy[j], b_dyh[j] = g, p
                bad = _mark(bad, _small32(d) | _gone32(h, d, iv) | ((p == 0) & (g != 0) & (h != 0)))
            gsub, glost, xsub, xlost = gsub + rgsub, glost + rglost, xsub + rxsub, xlost + rxlost
        s_dy, s_dyh = _sum32(b_dy, rr, order, lanes), _sum32(b_dyh, rr, order, lanes)
        sums[c, 0], sums[c, 1] = s_dy, s_dyh
        # a non-finite dy or x (or an overflow: loading, centering, scaling, the sums) leaves a sum not finite
        flag[c] = bad + (not _finite32(s_dy)) + (not _finite32(s_dyh))
        if rr > 0:
            glo, ghi, xlo, xhi = _unkey(kglo), _unkey(kghi), _unkey(kxlo), _unkey(kxhi)
            if not same_dy:
                glo, ghi = _store(glo, tag, lut)[0], _store(ghi, tag, lut)[0]
            if not same_x:
                xlo, xhi = _store(xlo, tag, lut)[0], _store(xhi, tag, lut)[0]
            _put_range(rg, c, 0, glo, ghi)
            _put_range(rg, c, 1, xlo, xhi)
            d0, d1 = xlo - mu, xhi - mu
            _put_range(rg, c, 2, d0, d1)
            _put_range(rg, c, 3, d0 * iv, d1 * iv)
        _stored(cnt, c, 0, gsub, glost)
        _stored(cnt, c, 1, xsub, xlost)
    return cnt, rg, sums, flag


@njit(inline="always", **_opts)
def _dx_row(dy_src, x_src, n, ch, ss, lut, tag, mu, iv, c0, c1, c2, dst, formula, st):
    """dx_source_fast over row n of channel ch; st: (key range of dx_compute, the row's subnormals and values
    lost to zero of dx, flag), all int32 (_count).  Inlined by numba at each call with ``formula`` a constant,
    so that LLVM folds the formula's branches and vectorises the loop (a branch on it in the loop kept it
    scalar: 2x slower)."""
    otiny = _tiny(dst)
    same_dy, same_x = dy_src.dtype == tag.dtype, x_src.dtype == tag.dtype
    for i in range(ss):
        g0 = np.float32(_value(dy_src[n, ch, i], lut))
        g = g0 if same_dy else _store(g0, tag, lut)[0]
        xv = np.float32(0.0)
        if formula != DX_CONSTANT:  # (x is not read where the formula does not need it)
            x0 = np.float32(_value(x_src[n, ch, i], lut))
            xv = x0 if same_x else _store(x0, tag, lut)[0]
        v, rare = _dx32(g, (xv - mu) * iv, xv, c0, c1, c2, formula)
        st = _dx_out(v, rare, dst, n, ch, i, lut, otiny, st)
    return st


@njit(**_opts)
def _dx32(g, hx, xv, c0, c1, c2, formula):
    """dx_compute of one dy by the dx formula in binary32 (xhat hx, x xv), and whether it is rare: a product
    lost to underflow, or subnormal."""
    if formula == DX_STANDARD:
        p = hx * c1
        d = (g - c0) - p
        v = d * c2
        return v, _gone32(p, hx, c1) | _gone32(v, d, c2)
    if formula == DX_ASCEND:
        p = xv * c0
        d = (g + p) + c1
        v = d * c2
        return v, _gone32(p, xv, c0) | _gone32(v, d, c2)
    v = g * c0
    return v, _gone32(v, g, c0)


@njit(**_opts)
def _dx_out(v, rare, dst, n, ch, i, lut, otiny, st):
    """dx_compute v stored as dx at dst[n, ch, i]; st (key range of dx_compute, the row's subnormals and values
    lost to zero of dx, flag; int32) with it counted."""
    klo, khi, sub, lost, bad = st
    kv = _key(v)  # dx_compute's range; dx is monotone in it
    y, bits = _store(v, dst, lut)
    dst[n, ch, i] = bits
    return (min(klo, kv), max(khi, kv), _count(sub, (abs(y) < otiny) & (y != 0)), _count(lost, (y == 0) & (v != 0)),
            _mark(bad, rare | (not _finite32(y))))  # v not finite leaves y not finite


@njit(parallel=True, **_opts)
def dx_source_fast(dy_src, x_src, off, lut, tag, mean, invstd, cols, formula, dst):
    """dx_fast() reading dy and x from the tensors (N, C, S) as backward_fast does (rounded to the storage
    format of ``tag``'s dtype; xhat formed again as there), dx stored into the same channels of dst in the
    format of its dtype; (cnt, rg, flag)."""
    nn, ss = x_src.shape[0], x_src.shape[2]
    k = mean.shape[0]
    cnt, rg = new_stats(k, 2)
    flag = np.zeros(k, dtype=np.int64)
    for c in prange(k):
        c0, c1, c2 = np.float32(cols[c, 0]), np.float32(cols[c, 1]), np.float32(cols[c, 2])
        mu, iv = np.float32(mean[c]), np.float32(invstd[c])
        klo, khi, sub, lost, bad = _KEY_LO, _KEY_HI, 0, 0, _I0
        for n in range(nn):
            st = (klo, khi, _I0, _I0, bad)
            if formula == DX_STANDARD:
                st = _dx_row(dy_src, x_src, n, off + c, ss, lut, tag, mu, iv, c0, c1, c2, dst, DX_STANDARD, st)
            elif formula == DX_ASCEND:
                st = _dx_row(dy_src, x_src, n, off + c, ss, lut, tag, mu, iv, c0, c1, c2, dst, DX_ASCEND, st)
            else:
                st = _dx_row(dy_src, x_src, n, off + c, ss, lut, tag, mu, iv, c0, c1, c2, dst, DX_CONSTANT, st)
            klo, khi, rsub, rlost, bad = st
            sub += rsub
            lost += rlost
        flag[c] = bad
        if nn * ss > 0:
            v0, v1 = _unkey(klo), _unkey(khi)
            _put_range(rg, c, 0, v0, v1)
            _put_range(rg, c, 1, _store(v0, dst, lut)[0], _store(v1, dst, lut)[0])
        _stored(cnt, c, 1, sub, lost)
    return cnt, rg, flag


@njit(**_opts)
def _y32(x, c0, c1, c2, c3, formula):
    """normalise's binary32 stages of one stored x by the y formula, (centered, xhat, affine, rare): rare when
    a stage value is subnormal or a product lost to underflow (unused stages repeat another)."""
    if formula == Y_AFFINE:
        p = x * c0
        av = p + c1
        return x, x, av, _gone32(p, x, c0) | _small32(av)
    d = x - c0
    if formula == Y_XHAT:
        h = d * c1
        p = h * c2
        av = p + c3
        return d, h, av, _small32(d) | _gone32(h, d, c1) | _gone32(p, h, c2) | _small32(av)
    p = d * c1
    av = p + c2
    return d, d, av, _small32(d) | _gone32(p, d, c1) | _small32(av)


@njit(parallel=True, **_opts)
def normalise_fast(xs, cols, formula, dst, off, lut):
    """normalise() in binary32 (no FMA, no cast of x), y stored nearest-even in the format of dst's dtype;
    (cnt, rg, flag)."""
    k, rr = xs.shape
    nn, _, ss = dst.shape
    cnt, rg = new_stats(k, 5)
    flag = np.zeros(k, dtype=np.int64)
    otiny = _tiny(dst)
    for c in prange(k):
        c0, c1 = np.float32(cols[c, 0]), np.float32(cols[c, 1])
        c2, c3 = np.float32(cols[c, 2]), np.float32(cols[c, 3])
        klo, khi, sub, lost, bad = _KEY_LO, _KEY_HI, 0, 0, _I0
        for n in range(nn):  # (the formula's branch is not unswitched as in dx_source_fast: 1.06x for +3 s compiling)
            base = n * ss
            rsub, rlost = _I0, _I0
            for i in range(ss):
                x = xs[c, base + i]
                kx = _key(x)
                klo, khi = min(klo, kx), max(khi, kx)
                _, _, av, rare = _y32(x, c0, c1, c2, c3, formula)
                y, bits = _store(av, dst, lut)
                bad = _mark(bad, rare | (not _finite32(y)))  # av not finite leaves y not finite
                rsub = _count(rsub, (abs(y) < otiny) & (y != 0))
                rlost = _count(rlost, (y == 0) & (av != 0))
                dst[n, off + c, i] = bits
            sub += rsub
            lost += rlost
        flag[c] = bad
        if rr > 0:
            d0, h0, a0, _ = _y32(_unkey(klo), c0, c1, c2, c3, formula)
            d1, h1, a1, _ = _y32(_unkey(khi), c0, c1, c2, c3, formula)
            _put_range(rg, c, N_CENTERED, d0, d1)
            _put_range(rg, c, N_XHAT, h0, h1)
            _put_range(rg, c, N_AFFINE, a0, a1)
            _put_range(rg, c, N_Y, _store(a0, dst, lut)[0], _store(a1, dst, lut)[0])
        _stored(cnt, c, N_Y, sub, lost)
    return cnt, rg, flag


@njit(parallel=True, **_opts)
def center_scale_fast(xc, mean, invstd, xhat):
    """center_scale() in binary32; (cnt, rg, flag)."""
    k, rr = xc.shape
    cnt, rg = new_stats(k, 2)
    flag = np.zeros(k, dtype=np.int64)
    for c in prange(k):
        mu, iv = np.float32(mean[c]), np.float32(invstd[c])
        klo, khi, bad = _KEY_LO, _KEY_HI, _I0
        for i in range(rr):
            x = xc[c, i]
            kx = _key(x)
            klo, khi = min(klo, kx), max(khi, kx)
            d = x - mu
            h = d * iv
            xhat[c, i] = h
            bad = _mark(bad, _small32(d) | _gone32(h, d, iv) | (not _finite32(h)))
        flag[c] = bad
        if rr > 0:
            d0, d1 = _unkey(klo) - mu, _unkey(khi) - mu
            _put_range(rg, c, 0, d0, d1)
            _put_range(rg, c, 1, d0 * iv, d1 * iv)
    return cnt, rg, flag


@njit(parallel=True, **_opts)
def dx_fast(dyc, xhat, xc, cols, formula, dst, off, lut):
    """dx() in binary32, dx stored nearest-even in the format of dst's dtype; (cnt, rg, flag)."""
    k, rr = dyc.shape
    nn, _, ss = dst.shape
    cnt, rg = new_stats(k, 2)
    flag = np.zeros(k, dtype=np.int64)
    otiny = _tiny(dst)
    for c in prange(k):
        c0, c1, c2 = np.float32(cols[c, 0]), np.float32(cols[c, 1]), np.float32(cols[c, 2])
        klo, khi, sub, lost, bad = _KEY_LO, _KEY_HI, 0, 0, _I0
        for n in range(nn):
            base = n * ss
            st = (klo, khi, _I0, _I0, bad)
            for i in range(ss):
                j = base + i
                v, rare = _dx32(dyc[c, j], xhat[c, j], xc[c, j], c0, c1, c2, formula)
                st = _dx_out(v, rare, dst, n, off + c, i, lut, otiny, st)
            klo, khi, rsub, rlost, bad = st
            sub += rsub
            lost += rlost
        flag[c] = bad
        if rr > 0:
            v0, v1 = _unkey(klo), _unkey(khi)
            _put_range(rg, c, 0, v0, v1)
            _put_range(rg, c, 1, _store(v0, dst, lut)[0], _store(v1, dst, lut)[0])
        _stored(cnt, c, 1, sub, lost)
    return cnt, rg, flag


# the per-value helpers the family's kernels (compiled.family) share with these, by public names
decode = _value
encode = _store
format_tiny = _tiny
order_key = _key
from_key = _unkey
count_if = _count
mark_if = _mark

"""Reciprocal square root, reciprocal, division and square root as accelerators compute them.

A hardware-style estimate (bit-trick seed, a k-bit table, or ARM's FRSQRTE /
FRECPE bit for bit) refined by Newton steps, each operation rounded in a working
format, plus the correctly rounded references.

Special inputs follow IEEE 754 and what vector units do for them; the estimate
paths patch them after the Newton steps (as kernels do, since a Newton step on
0 or inf gives NaN): rsqrt: +0 -> +inf, -0 -> -inf, negative -> NaN, +inf -> +0;
reciprocal: ±0 -> ±inf, ±inf -> ±0; sqrt: ±0 -> ±0, +inf -> +inf, negative -> NaN.
With ``subnormals="zero"`` a subnormal input is treated as zero (as x86
RSQRTPS and flush-to-zero units do).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import Format, get_format
from bnprobe.numerics.arith import Arith, Tally, fma_wide
from bnprobe.numerics.rounding import round_to

__all__ = [
    "RSQRT_ESTIMATES", "RECIP_ESTIMATES", "SQRT_METHODS", "NEWTON_FORMS", "MAGIC_RSQRT", "MAGIC_RECIP",
    "Working", "rsqrt_exact", "rsqrt", "rsqrt_ascend950", "reciprocal", "divide", "sqrt", "rsqrt_estimate",
    "recip_estimate", "succ", "pred", "sqrt_eigen_fast",
]

# rsqrtps: x86 RSQRTPS / VRSQRTPS as Intel's cores compute it (AMD's differ): 1/sqrt of the midpoint of the input's
# interval of 2^-10 (its exponent's parity and the first 10 bits of its significand), rounded to 12 fraction bits;
# a subnormal input is taken as zero.  Checked against the instruction on every such interval (tests).
RSQRT_ESTIMATES: tuple[str, ...] = ("exact", "magic", "table", "frsqrte", "rsqrtps")
RECIP_ESTIMATES: tuple[str, ...] = ("exact", "magic", "table", "frecpe")
SQRT_METHODS: tuple[str, ...] = ("exact", "rsqrt", "exp_log", "eigen_fast")
# standard: Quake order, h = x/2; y <- y*(1.5 - (h*y)*y), every product rounded
#           (reciprocal: r <- r*(2 - a*r))
# fma:      Ascend 950 style, residual with one rounding: s = fma(-x, y*y, 1); y <- fma(y/2, s, y)
#           (reciprocal: e = fma(-a, r, 1); r <- fma(r, e, r))
# arm:      FRSQRTS: t = x*y; s = (3 - t*y)/2 fused; y <- y*s  (FRECPS: s = 2 - a*r fused; r <- r*s)
# xla:      XLA's CPU rsqrt (its LLVM IR, with the fused multiply-adds LLVM forms on an FMA machine):
#           a = x*y; h = -0.5*y; y <- fma(h, fma(a, y, -1), y)  (rsqrt only)
NEWTON_FORMS: tuple[str, ...] = ("standard", "fma", "arm", "eigen", "xla")

# Bit-trick constants i = C - (i >> 1) (rsqrt) and i = C - i (reciprocal).  fp32 rsqrt is
# the classic 0x5f3759df.  The others were chosen by exhaustive search over every input
# of one period ([1, 4) for rsqrt, [1, 2) for the reciprocal) as the constant minimising
# the maximum relative error after one Newton step computed in float64 (Lomont's
# criterion); tests/numerics/test_rsqrt.py repeats the search.
MAGIC_RSQRT: dict[str, int] = {"fp32": 0x5F3759DF, "fp16": 0x59BA, "bf16": 0x5F37}
MAGIC_RECIP: dict[str, int] = {"fp32": 0x7EF311C2, "fp16": 0x7798, "bf16": 0x7EF3}


def succ(q: np.ndarray, fmt: Format) -> np.ndarray:
    """The next larger value of ``fmt`` after each positive finite ``q``."""
    return q + fmt.ulp(q)


def pred(q: np.ndarray, fmt: Format) -> np.ndarray:
    """The next smaller value of ``fmt`` before each positive finite ``q``."""
    gap = fmt.ulp(q)
    # just below a power of two (above the subnormal range) the spacing halves
    power_of_two = (np.asarray(q, dtype=np.float64).view(np.uint64) & np.uint64((1 << 52) - 1)) == 0
    return q - np.where(power_of_two & (q > fmt.tiny), gap / 2, gap)


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
        qf, vf, hf, lf = q.reshape(-1), v.reshape(-1), hi.reshape(-1), lo.reshape(-1)
        for i in np.flatnonzero(near.reshape(-1)):
            vi, m_hi, m_lo = Fraction(float(vf[i])), Fraction(float(hf[i])), Fraction(float(lf[i]))
            if m_hi * m_hi * vi < 1:  # exact value above the upper midpoint
                qf[i] = float(succ(np.array(qf[i]), fmt))
            elif m_lo * m_lo * vi > 1:  # exact value below the lower midpoint
                qf[i] = float(pred(np.array(qf[i]), fmt))
    return q


# ---- estimates ---------------------------------------------------------------------------------

def _uint(fmt: Format) -> type:
    return {2: np.uint16, 4: np.uint32}.get(fmt.itemsize) or _no_bits(fmt)


def _no_bits(fmt: Format) -> type:
    raise BNProbeError(f"bit-trick estimates need a 16- or 32-bit format, not {fmt.name}")


def _magic(x: np.ndarray, fmt: Format, constant: int, shift: int) -> np.ndarray:
    """i = C - (i >> shift) on the bit pattern of |x| in ``fmt``."""
    ut = _uint(fmt)
    with np.errstate(all="ignore"):
        bits = np.abs(x).astype(fmt.dtype).view(ut).astype(np.int64)
        i = np.int64(constant) - (bits >> shift)
        out = (i & np.int64((1 << (8 * fmt.itemsize)) - 1)).astype(ut).view(fmt.dtype).astype(np.float64)
    return out


def _round_sig(v: np.ndarray, fraction_bits: int) -> np.ndarray:
    """Round positive values to ``fraction_bits`` bits after the leading one (nearest-even)."""
    m, e = np.frexp(v)  # m in [0.5, 1)
    return np.ldexp(np.rint(np.ldexp(m, fraction_bits + 1)), e - fraction_bits - 1)


def _table_rsqrt(a: np.ndarray, bits: int) -> np.ndarray:
    """k-bit table, ARM-style: a = sig * 4^k with sig in [0.25, 1); sig quantised to 2^-k on [0.5, 1)
    and 2^-(k+1) on [0.25, 0.5) (exponent parity + k-1 fraction bits of the significand); the entry is
    1/sqrt(interval midpoint) rounded to k fraction bits."""
    m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1)
    even = (e % 2) == 0
    sig = np.where(even, m, m / 2)
    k = np.where(even, e // 2, (e + 1) // 2)
    step = np.where(even, 2.0 ** -bits, 2.0 ** -(bits + 1))
    mid = np.floor(sig / step) * step + step / 2
    return _round_sig(1.0 / np.sqrt(mid), bits) * np.ldexp(1.0, -k)


def _table_recip(a: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1)
    step = 2.0 ** -bits  # (k-1) fraction bits of the significand 2m in [1, 2)
    mid = np.floor(m / step) * step + step / 2
    return _round_sig(1.0 / mid, bits) * np.ldexp(1.0, -e)


def _arm_rsqrt_table() -> np.ndarray:
    """ARMv8 RecipSqrtEstimate for every u0.9 input in [128, 512): the 8-bit result in [256, 512)."""
    out = np.zeros(512, dtype=np.int64)
    for a9 in range(128, 512):
        a = a9 * 2 + 1 if a9 < 256 else (a9 | 1) * 2  # u0.10, forced to the interval's midpoint
        b = 512  # u0.9; the largest b with a * b^2 < 1, i.e. b < 1/sqrt(a)
        while a * (b + 1) * (b + 1) < (1 << 28):
            b += 1
        out[a9] = (b + 1) // 2  # round to u0.8 with the implied integer bit
    return out


def _arm_recip_table() -> np.ndarray:
    """ARMv8 RecipEstimate for every u0.9 input in [256, 512): the 8-bit result in [256, 512)."""
    out = np.zeros(512, dtype=np.int64)
    for a9 in range(256, 512):
        a = a9 * 2 + 1
        b = (1 << 19) // a
        out[a9] = (b + 1) // 2
    return out


_ARM_RSQRT = _arm_rsqrt_table()
_ARM_RECIP = _arm_recip_table()


def _frsqrte(a: np.ndarray) -> np.ndarray:
    m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1)
    even = (e % 2) == 0
    sig = np.where(even, m, m / 2)  # a = sig * 4^k, sig in [0.25, 1)
    k = np.where(even, e // 2, (e + 1) // 2)
    idx = np.floor(sig * 512).astype(np.int64)
    return (_ARM_RSQRT[idx] / 256.0) * np.ldexp(1.0, -k)


def _frecpe(a: np.ndarray) -> np.ndarray:
    m, e = np.frexp(a)
    idx = np.floor(m * 512).astype(np.int64)
    return (_ARM_RECIP[idx] / 256.0) * np.ldexp(1.0, -e)


def _rsqrtps(a: np.ndarray) -> np.ndarray:
    """Intel's RSQRTPS on positive normal values (see :data:`RSQRT_ESTIMATES`)."""
    m, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1): significand 2m in [1, 2), exponent e - 1
    odd = (e - 1) % 2
    j = np.floor((2 * m - 1) * 1024)  # the significand's first 10 fraction bits
    mid = (1 + (j + 0.5) / 1024) * 2.0 ** odd  # the interval's midpoint, in [1, 4)
    return _round_sig(1.0 / np.sqrt(mid), 12) * np.ldexp(1.0, -((e - 1 - odd) // 2))


def sqrt_eigen_fast(x: np.ndarray, fmt: str | Format | Arith, *, tally: Tally | None = None) -> np.ndarray:
    """sqrt(x) as Eigen 3.3's ``psqrt`` computes a packet of floats under ``EIGEN_FAST_MATH`` (its default) on SSE and
    AVX: y = rsqrtps(x) (Intel's, :data:`RSQRT_ESTIMATES`), one Newton step y·(1.5 − (x/2)·(y·y)), then x·y, each
    operation rounded in ``fmt``; inputs from 0 up to the smallest normal give 0.  (Eigen's scalar path, for
    what does not fill a packet, is the exact sqrt.)"""
    ar, _ = _arith(fmt, None)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        tiny = (x >= 0) & (x < ar.fmt.tiny)
        pos = np.where((x > 0) & np.isfinite(x), x, 1.0)
        y = np.where(x > 0, ar.round(_rsqrtps(pos)), np.nan)  # (rsqrtps: +inf gives 0, a negative NaN)
        y = np.where(np.isposinf(x), 0.0, y)
        half = ar.mul(x, 0.5, tally)
        y = ar.mul(y, ar.sub(1.5, ar.mul(half, ar.mul(y, y, tally), tally), tally), tally)
        out = ar.mul(x, y, tally)
        return np.where(tiny, 0.0, out)


def _positive_normalish(x: np.ndarray, fmt: Format, subnormals: str) -> tuple[np.ndarray, np.ndarray]:
    """Magnitudes with zeros / non-finite replaced by 1 (patched later), and the 'treated as zero' mask."""
    a = np.abs(x)
    zero = a == 0
    if subnormals == "zero":
        zero |= a < fmt.tiny
    elif subnormals != "keep":
        raise BNProbeError(f"subnormals must be 'keep' or 'zero', got {subnormals!r}")
    bad = zero | ~np.isfinite(a)
    return np.where(bad, 1.0, a), zero


def _estimate(op: str, x: np.ndarray, fmt: str | Format, method: str, constant: int | None, bits: int,
              subnormals: str) -> np.ndarray:
    """The first approximation of 1/sqrt(|x|) (op rsqrt) or 1/|x| (op recip) as values of ``fmt``."""
    rsq = op == "rsqrt"
    fmt = get_format(fmt)
    a, _ = _positive_normalish(np.asarray(x, dtype=np.float64), fmt, subnormals)
    valid = RSQRT_ESTIMATES if rsq else RECIP_ESTIMATES
    with np.errstate(all="ignore"):
        if method == "exact":
            return rsqrt_exact(a, fmt) if rsq else round_to(1.0 / a, fmt)
        if method == "magic":
            defaults = MAGIC_RSQRT if rsq else MAGIC_RECIP
            if constant is None:
                if fmt.name not in defaults:
                    raise BNProbeError(f"no default {op} constant for {fmt.name}; pass constant=")
                constant = defaults[fmt.name]
            return _magic(a, fmt, constant, 1 if rsq else 0)
        if method == "table":
            if not 1 <= bits <= fmt.mantissa_bits:
                raise BNProbeError(f"table bits must be in 1..{fmt.mantissa_bits} for {fmt.name}, got {bits}")
            return round_to(_table_rsqrt(a, bits) if rsq else _table_recip(a, bits), fmt)
        if method == ("frsqrte" if rsq else "frecpe"):
            return round_to(_frsqrte(a) if rsq else _frecpe(a), fmt)
        if method == "rsqrtps" and rsq:
            if fmt.name != "fp32":
                raise BNProbeError(f"rsqrtps takes fp32 values, not {fmt.name}")
            return np.where(a < fmt.tiny, np.inf, _rsqrtps(a))
    raise BNProbeError(f"unknown {'rsqrt' if rsq else 'reciprocal'} method {method!r}; valid: {', '.join(valid)}")


def rsqrt_estimate(x: np.ndarray, fmt: str | Format, method: str = "magic", *, constant: int | None = None,
                   bits: int = 12, subnormals: str = "keep") -> np.ndarray:
    """The hardware-style first approximation of 1/sqrt(|x|) as values of ``fmt`` (specials not patched)."""
    return _estimate("rsqrt", x, fmt, method, constant, bits, subnormals)


def recip_estimate(x: np.ndarray, fmt: str | Format, method: str = "magic", *, constant: int | None = None,
                   bits: int = 12, subnormals: str = "keep") -> np.ndarray:
    """The hardware-style first approximation of 1/|x| as values of ``fmt`` (specials not patched)."""
    return _estimate("recip", x, fmt, method, constant, bits, subnormals)


# ---- Newton refinement ---------------------------------------------------------------------------

def _newton_rsqrt(x: np.ndarray, y: np.ndarray, ar: Arith, form: str, t: Tally | None) -> np.ndarray:
    if form == "standard":
        h = ar.mul(0.5, x, t)
        r = ar.mul(ar.mul(h, y, t), y, t)
        return ar.mul(y, ar.sub(1.5, r, t), t)
    if form == "fma":
        s = ar.fma(-x, ar.mul(y, y, t), np.ones_like(y), t)
        return ar.fma(ar.mul(0.5, y, t), s, y, t)
    if form == "arm":
        p = ar.mul(x, y, t)
        s = ar.round(fma_wide(-p, y, np.full_like(y, 3.0), native=ar.native) * 0.5, t)  # (3 - p*y)/2, one rounding
        return ar.mul(y, s, t)
    if form == "eigen":
        h = ar.sub(ar.mul(ar.mul(x, y, t), y, t), 1.0, t)
        out = ar.add(ar.mul(ar.mul(y, -0.5, t), h, t), y, t)
        return np.where(np.isnan(out), y, out)
    if form == "xla":
        e = ar.fma(ar.mul(x, y, t), y, np.full_like(y, -1.0), t)
        return ar.fma(ar.mul(y, -0.5, t), e, y, t)
    raise BNProbeError(f"unknown Newton form {form!r}; valid: {', '.join(NEWTON_FORMS)}")


def _newton_recip(a: np.ndarray, r: np.ndarray, ar: Arith, form: str, t: Tally | None) -> np.ndarray:
    if form == "standard":
        return ar.mul(r, ar.sub(2.0, ar.mul(a, r, t), t), t)
    if form == "fma":
        e = ar.fma(-a, r, np.ones_like(r), t)
        return ar.fma(r, e, r, t)
    if form == "arm":
        s = ar.fma(-a, r, np.full_like(r, 2.0), t)  # FRECPS: 2 - a*r fused
        return ar.mul(r, s, t)
    if form == "eigen":
        raise BNProbeError("the eigen Newton form refines a reciprocal square root, not a reciprocal")
    raise BNProbeError(f"unknown Newton form {form!r}; valid: {', '.join(NEWTON_FORMS)}")


@dataclass(frozen=True)
class Working:
    """Where an estimate's Newton steps are computed: in ``format`` (None: the result's format), their last iterate
    rounded to the result's format, or with ``round_result=False`` returned in the working format (how the
    literature measures seeds with float64 Newton steps)."""

    format: str | Format | None = None
    round_result: bool = True


def _arith(fmt: str | Format | Arith, working: str | Format | None) -> tuple[Arith, Arith]:
    """(result arithmetic, working arithmetic) from a format or an Arith and an optional working format."""
    res = fmt if isinstance(fmt, Arith) else Arith(fmt)
    work = res if working is None else Arith(working, res.spec, res.rng)
    return res, work


def rsqrt(x: np.ndarray, fmt: str | Format | Arith, *, method: str = "exact", newton: int = 0,
          form: str = "standard", constant: int | None = None, bits: int = 12, subnormals: str = "keep",
          working: Working = Working(), tally: Tally | None = None) -> np.ndarray:
    """1/sqrt(x) in ``fmt``: an estimate refined by ``newton`` steps computed as ``working`` says (default: in fmt).

    method ``exact`` is the correctly rounded value (Newton steps are not applied to it).
    ``Working(round_result=False)`` returns the last Newton iterate in the working format
    (how the literature measures seeds with float64 Newton steps).
    """
    res, work = _arith(fmt, working.format)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        if method == "exact":
            y = res.round(rsqrt_exact(x, res.fmt), tally)
        else:
            if newton < 0:
                raise BNProbeError(f"newton steps must be >= 0, got {newton}")
            # (RSQRTPS takes a subnormal input as 0 whatever the mode: XLA's rsqrt gives +inf for one)
            a, zero = _positive_normalish(x, res.fmt, "zero" if method == "rsqrtps" else subnormals)
            y = rsqrt_estimate(a, res.fmt, method, constant=constant, bits=bits)
            y = work.round(y)
            for _ in range(newton):
                y = _newton_rsqrt(a, y, work, form, tally)
            if working.round_result:
                y = res.round(y, tally)
            y = np.where(zero, np.copysign(np.inf, x), y)
            y = np.where(np.isposinf(x), 0.0, y)
            y = np.where(np.isnan(x) | (x < 0) & ~zero, np.nan, y)
    return y


def rsqrt_ascend950(v: np.ndarray, fmt: str | Format | Arith, *, tally: Tally | None = None) -> np.ndarray:
    """rstd as Ascend 950's BatchNorm computes it (from the public arch35 sources of BatchNormV3, hicann/ops-nn
    ``norm/batch_norm_v3/op_kernel/arch35``): r = 1/v; y = sqrt(r); y <- y*(1.5 - 0.5*v*y*y); then an FMA-compensated
    residual s = 1 - v*y*y (one rounding) and y <- y + 0.5*y*s.  v = 0 -> +inf; v >= FLT_MAX -> 0."""
    ar, _ = _arith(fmt, None)
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(all="ignore"):
        pos = np.where((v > 0) & np.isfinite(v), v, 1.0)
        r = ar.div(np.ones_like(pos), pos, tally)
        y = ar.sqrt(r, tally)
        h = ar.mul(0.5, pos, tally)
        y = ar.mul(y, ar.sub(1.5, ar.mul(ar.mul(h, y, tally), y, tally), tally), tally)
        s = ar.fma(-pos, ar.mul(y, y, tally), np.ones_like(y), tally)
        y = ar.fma(ar.mul(0.5, y, tally), s, y, tally)
        y = np.where(v == 0, np.inf, y)
        y = np.where(v >= ar.fmt.max, 0.0, y)
        y = np.where(np.isnan(v) | (v < 0), np.nan, y)
    return y


def reciprocal(x: np.ndarray, fmt: str | Format | Arith, *, method: str = "exact", newton: int = 0,
               form: str = "standard", constant: int | None = None, bits: int = 12, subnormals: str = "keep",
               working: Working = Working(), tally: Tally | None = None) -> np.ndarray:
    """1/x in ``fmt``: correctly rounded (``exact``) or an estimate refined by Newton steps (computed as
    ``working`` says, as in :func:`rsqrt`)."""
    res, work = _arith(fmt, working.format)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        if method == "exact":
            return res.div(np.ones_like(x), x, tally)
        if newton < 0:
            raise BNProbeError(f"newton steps must be >= 0, got {newton}")
        a, zero = _positive_normalish(x, res.fmt, subnormals)
        r = work.round(recip_estimate(a, res.fmt, method, constant=constant, bits=bits))
        for _ in range(newton):
            r = _newton_recip(a, r, work, form, tally)
        r = np.copysign(res.round(r, tally) if working.round_result else r, x)
        r = np.where(zero, np.copysign(np.inf, x), r)
        r = np.where(np.isinf(x), np.copysign(0.0, x), r)
        r = np.where(np.isnan(x), np.nan, r)
    return r


def divide(a: np.ndarray, b: np.ndarray, fmt: str | Format | Arith, *, method: str = "exact",
           recip_method: str = "table", newton: int = 2, form: str = "standard", constant: int | None = None,
           bits: int = 12, tally: Tally | None = None) -> np.ndarray:
    """a / b in ``fmt``: ``exact`` (one correctly rounded division) or ``reciprocal``: a · r, with r
    an estimate of 1/b (``recip_method``) refined by ``newton`` steps, as units without a divider do."""
    res, _ = _arith(fmt, None)
    if method == "exact":
        return res.div(a, b, tally)
    if method == "reciprocal":
        r = reciprocal(b, res, method=recip_method, newton=newton, form=form, constant=constant, bits=bits,
                       tally=tally)
        return res.mul(a, r, tally)
    raise BNProbeError(f"unknown division method {method!r}; valid: exact, reciprocal")


def sqrt(x: np.ndarray, fmt: str | Format | Arith, *, method: str = "exact", heron: int = 3,
         rsqrt_method: str = "magic", newton: int = 2, form: str = "standard", constant: int | None = None,
         bits: int = 12, tally: Tally | None = None) -> np.ndarray:
    """sqrt(x) in ``fmt``: ``exact``; ``rsqrt`` = 1/rsqrt(x) (fast mode: an rsqrt estimate with
    ``newton`` steps, then a correctly rounded reciprocal); ``exp_log`` = exp(ln(x)/2) + ``heron``
    steps y <- (y + x/y)/2, with ln, the halving and exp each correctly rounded to the format.
    """
    res, _ = _arith(fmt, None)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        if method == "exact":
            return res.sqrt(x, tally)
        if method == "eigen_fast":
            return sqrt_eigen_fast(x, res, tally=tally)
        if method == "rsqrt":
            r = rsqrt(x, res, method=rsqrt_method, newton=newton, form=form, constant=constant, bits=bits,
                      tally=tally)
            y = res.div(np.ones_like(r), r, tally)
        elif method == "exp_log":
            pos = np.where(x > 0, x, 1.0)
            y = res.round(np.exp(res.mul(0.5, res.round(np.log(pos), tally), tally)), tally)
            for _ in range(heron):
                y = res.mul(0.5, res.add(y, res.div(pos, y, tally), tally), tally)
        else:
            raise BNProbeError(f"unknown sqrt method {method!r}; valid: {', '.join(SQRT_METHODS)}")
        y = np.where(x == 0, x, y)
        y = np.where(np.isposinf(x), np.inf, y)
        y = np.where(np.isnan(x) | (x < 0), np.nan, y)
    return y

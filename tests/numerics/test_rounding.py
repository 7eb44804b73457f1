from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from oracle import SPECS, round_fraction

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.numerics.rounding import held_exactly, is_representable, round_detail, round_to, to_odd_fp32

NARROW = ["fp16", "bf16"]
ALL = ["fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"]
MODES = ["nearest_even", "nearest_away", "toward_zero"]


def all_patterns(name):
    dt = get_format(name).dtype
    bits = np.arange(2 ** (8 * dt.itemsize), dtype=np.uint16 if dt.itemsize == 2 else np.uint8)
    return bits.view(dt)


@pytest.mark.parametrize("name", NARROW + ["fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("overflow", ["ieee", "saturate"])
def test_every_bit_pattern_round_trips(name, overflow):
    vals = all_patterns(name)
    with np.errstate(invalid="ignore"):
        wide = vals.astype(np.float64)
    finite = np.isfinite(wide)
    out = round_to(wide, name, overflow=overflow)
    np.testing.assert_array_equal(out[finite], wide[finite])
    back = out[finite].astype(get_format(name).dtype)
    np.testing.assert_array_equal(back.view(np.uint8), vals[finite].view(np.uint8))  # same bits, signed zeros too
    if overflow == "ieee":
        assert np.isnan(out[np.isnan(wide)]).all()
        np.testing.assert_array_equal(out[np.isinf(wide)], wide[np.isinf(wide)])


def dense_samples(name, rng, n=4000):
    """Values of the format, the midpoints between neighbours (ties), and points just off them."""
    p, emin, vmax = SPECS[name]
    f = get_format(name)
    with np.errstate(invalid="ignore"):
        patterns = all_patterns(name).astype(np.float64) if f.itemsize <= 2 else None
    vals = patterns if patterns is not None else (
        rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)).astype(np.float32).astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    vals = rng.choice(vals, size=min(n, vals.size), replace=False)
    gap = f.ulp(vals)
    ties = vals + gap / 2  # exact midpoints (also above max, giving the overflow boundary)
    near = np.concatenate([np.nextafter(ties, 0), np.nextafter(ties, np.inf)])
    mixed = np.concatenate([vals, ties, near, -ties, -near, rng.standard_normal(n) * 1e3, [f.max + gap[0]]])
    return mixed[np.isfinite(mixed)]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("mode", MODES)
def test_rounding_from_float64_matches_exact_rationals(name, mode):
    rng = np.random.default_rng(7)
    xs = dense_samples(name, rng)
    got = round_to(xs, name, rounding=mode)
    want = np.array([round_fraction(Fraction(float(v)), name, mode) for v in xs])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_rounding_from_float32_matches_exact_rationals(name):
    rng = np.random.default_rng(3)
    xs = dense_samples(name, rng).astype(np.float32)
    got = round_to(xs, name)
    want = np.array([round_fraction(Fraction(float(v)), name) for v in xs])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("src", [np.float64, np.float32])
@pytest.mark.parametrize("mode", ["nearest_even", "nearest_away", "toward_zero"])
def test_result_dtype_option_matches_exact_rationals(name, src, mode):
    rng = np.random.default_rng(11)
    with np.errstate(over="ignore"):
        xs = np.concatenate([dense_samples(name, rng), [np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(src)
    want = np.array([round_fraction(Fraction(float(v)), name, mode) if np.isfinite(v) and v != 0 else float(v)
                     for v in xs])
    for dtype in {get_format(name).dtype, np.dtype(np.float32), np.dtype(np.float64)}:
        got = round_to(xs, name, rounding=mode, dtype=dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float64), want)
        num = ~np.isnan(want)
        assert np.array_equal(np.signbit(got.astype(np.float64))[num], np.signbit(want)[num])


def test_result_dtype_must_hold_the_format():
    x = np.ones(3)
    for name, dtype in (("fp32", np.float16), ("fp16", ml_dtypes.bfloat16), ("bf16", np.float16),
                        ("fp32", np.int32)):
        with pytest.raises(BNProbeError, match="cannot hold"):
            round_to(x, name, dtype=dtype)


def _bf16_by_bits(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 nearest-even by integer arithmetic on the float64 bit pattern (an oracle independent of
    bnprobe and ml_dtypes): valid where |x| and its rounding are bf16 normals."""
    bits = x.view(np.uint64)
    rem = bits & np.uint64((1 << 45) - 1)  # the 45 bits below bf16's 8-bit significand
    kept = bits >> np.uint64(45)
    half = np.uint64(1 << 44)
    up = (rem > half) | ((rem == half) & (kept & np.uint64(1) == 1))
    return ((kept + up.astype(np.uint64)) << np.uint64(45)).view(np.float64)


def _near_bf16_ties(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values within 2^-30 (relative) of a bf16 rounding tie, both sides: where rounding through float32 first
    (double rounding) goes wrong."""
    base = rng.standard_normal(n).astype(ml_dtypes.bfloat16).astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.abs(base))) - 7)
    off = rng.choice([-1.0, 1.0], n) * rng.integers(1, 64, n) * np.exp2(-30) * np.abs(base)
    return base + ulp / 2 * rng.choice([-1.0, 1.0], n) + off


def test_bf16_from_float64_is_correctly_rounded():
    x = np.array([1 + 2.0**-8 + 2.0**-30])  # the facts file's example: rounding through float32 gives 1.0
    assert round_to(x, "bf16")[0] == 1.0078125 == float(round_fraction(Fraction(float(x[0])), "bf16"))
    rng = np.random.default_rng(0)
    y = np.concatenate([rng.standard_normal(2_000_000), _near_bf16_ties(rng, 200_000)])
    np.testing.assert_array_equal(round_to(y, "bf16"), _bf16_by_bits(y))
    for v in y[2_000_000:2_000_040]:
        assert round_to(np.array([v]), "bf16")[0] == float(round_fraction(Fraction(float(v)), "bf16"))


def test_ml_dtypes_float32_to_bf16_cast_is_correctly_rounded():
    # bnprobe's bf16 rounding relies on ml_dtypes for one step only: the float32 -> bf16 cast (after rounding
    # float64 to odd in float32). Its float64 -> bf16 cast double-rounds through float32 before 0.7.0 and is
    # correct from 0.7.0 on; bnprobe does not use it, so its rounding is right with every version allowed.
    bits = np.arange(0, 2**32, 389, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    with np.errstate(invalid="ignore"):  # NaN patterns
        wide = f.astype(np.float64)
    keep = np.isfinite(wide) & (np.abs(wide) >= 2.0**-126) & (np.abs(wide) < 3.38e38)
    theirs = f[keep].astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(theirs, _bf16_by_bits(wide[keep]))


def test_to_odd_fp32():
    x = np.array([1 + 2.0**-30, 1 + 2.0**-24 + 2.0**-40, 1.0, -(1 + 2.0**-30), 1e-50])
    got = to_odd_fp32(x).astype(np.float64)
    np.testing.assert_array_equal(got, [1 + 2.0**-23, 1 + 2.0**-23, 1.0, -(1 + 2.0**-23), 2.0**-149])


@pytest.mark.parametrize("name", ALL)
def test_ties_away_differs_from_nearest_even_exactly_on_ties(name):
    rng = np.random.default_rng(11)
    xs = dense_samples(name, rng)
    f = get_format(name)
    lo = round_to(xs, name, rounding="toward_zero")
    is_tie = np.isfinite(lo) & (np.abs(xs) - np.abs(lo) == f.ulp(lo) / 2)
    differ = round_to(xs, name) != round_to(xs, name, rounding="nearest_away")
    both_nan = np.isnan(round_to(xs, name)) & np.isnan(round_to(xs, name, rounding="nearest_away"))
    differ &= ~both_nan
    assert is_tie.any()
    # on a tie they differ exactly when nearest-even went down (the lower neighbour is even)
    lower_even = np.array([int(v.astype(f.dtype).view(np.uint16 if f.itemsize == 2 else (
        np.uint8 if f.itemsize == 1 else np.uint32))) % 2 == 0 for v in np.abs(lo)])
    np.testing.assert_array_equal(differ, is_tie & lower_even)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_saturate_clamps_and_zeroes_nan(name):
    f = get_format(name)
    x = np.array([f.max * 4, -f.max * 4, np.inf, -np.inf, np.nan, 1.0])
    out, over, sat, _ = round_detail(x, name, overflow="saturate")
    np.testing.assert_array_equal(out, [f.max, -f.max, f.max, -f.max, 0.0, 1.0])
    np.testing.assert_array_equal(over, [True, True, False, False, False, False])
    np.testing.assert_array_equal(sat, [True, True, True, True, True, False])
    ieee, over, _, _ = round_detail(x, name)
    assert np.isinf(ieee[:2]).all() and over[:2].all()


def test_overflow_threshold_is_max_plus_half_ulp():
    f = get_format("fp16")
    half = f.ulp(f.max) / 2
    out = round_to(np.array([f.max + half, np.nextafter(f.max + half, 0)]), "fp16")
    np.testing.assert_array_equal(out, [np.inf, f.max])
    # toward zero never overflows to inf (IEEE 754 7.4)
    assert round_to(np.array([1e9]), "fp16", rounding="toward_zero")[0] == f.max


def test_directed_roundings():
    x = np.array([1 + 2.0**-12, -(1 + 2.0**-12)])
    np.testing.assert_array_equal(round_to(x, "fp16", rounding="up"), [1 + 2.0**-10, -1.0])
    np.testing.assert_array_equal(round_to(x, "fp16", rounding="down"), [1.0, -(1 + 2.0**-10)])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_subnormals_kept_or_flushed(name):
    f = get_format(name)
    x = np.array([f.smallest_subnormal * 3, -f.tiny / 2, f.tiny, f.smallest_subnormal / 4])
    kept = round_to(x, name)
    np.testing.assert_array_equal(kept, [f.smallest_subnormal * 3, -f.tiny / 2, f.tiny, 0.0])
    flushed, _, _, fl = round_detail(x, name, subnormals="flush")
    np.testing.assert_array_equal(flushed, [0.0, -0.0, f.tiny, 0.0])
    assert np.signbit(flushed[1])
    np.testing.assert_array_equal(fl, [True, True, False, False])


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_stochastic_rounding_is_unbiased(name):
    f = get_format(name)
    rng = np.random.default_rng(1234)
    base = 1.0 + 3 * f.eps
    frac = np.array([0.1, 0.25, 0.5, 0.9])
    x = base + frac * f.eps
    reps = 40_000
    out = round_to(np.repeat(x, reps), name, rounding="stochastic", rng=rng).reshape(len(x), reps)
    assert set(np.unique(out[0])) <= {base, base + f.eps}
    p_up = (out == base + f.eps).mean(axis=1)
    # binomial standard error sqrt(p(1-p)/n) <= 0.0025; allow 5 sigma
    np.testing.assert_allclose(p_up, frac, atol=0.0125)
    np.testing.assert_allclose(out.mean(axis=1), x, atol=5 * 0.5 * f.eps / np.sqrt(reps))


def test_stochastic_needs_and_honours_seed():
    x = np.full(1000, 1 + 2.0**-12)
    a = round_to(x, "fp16", rounding="stochastic", seed=5)
    b = round_to(x, "fp16", rounding="stochastic", seed=5)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(BNProbeError, match="seeded generator"):
        round_to(x, "fp16", rounding="stochastic")


def test_bad_modes_are_errors():
    with pytest.raises(BNProbeError, match="unknown rounding"):
        round_to(1.0, "fp16", rounding="banker")
    with pytest.raises(BNProbeError, match="unknown overflow"):
        round_to(1.0, "fp16", overflow="wrap")


def test_is_representable():
    x = np.array([1.0, 1 + 2.0**-10, 1 + 2.0**-11, 65504.0, 65536.0, np.inf, np.nan])
    np.testing.assert_array_equal(is_representable(x, "fp16"), [True, True, False, True, False, True, True])


def _exactly_in(v: float, fmt) -> bool:
    """Exact oracle: finite v is a value of fmt when |v| <= max and v * 2**(p - 1 - e) is an integer, with e the
    exponent of v's leading bit held at emin (Python integers, no floating point)."""
    import math

    if math.isnan(v) or math.isinf(v):
        return True
    if v == 0:
        return True
    if abs(v) > fmt.max:
        return False
    num, den = abs(v).as_integer_ratio()
    e = num.bit_length() - den.bit_length()  # floor(log2(num/den)) is e or e - 1
    if (num if e >= 0 else num << -e) < (den << e if e >= 0 else den):
        e -= 1
    e = max(e, fmt.emin)
    shift = fmt.mantissa_bits - e
    return (num << shift) % den == 0 if shift >= 0 else num % (den << -shift) == 0


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("carrier", [np.float64, np.float32])
def test_is_representable_agrees_with_exact_arithmetic_at_every_edge(name, carrier):
    from bnprobe.core.formats import get_format

    fmt = get_format(name)
    edges = [fmt.max, fmt.tiny, fmt.tiny * fmt.eps, 1.0, 1.5, 3.0]
    vals = []
    for e in edges:
        for k in range(-3, 4):  # values a few float64 (float32) ulps and format half-ulps either side
            vals += [e + k * e * 2.0**-53, e + k * e * fmt.eps / 2, e * (1 + k * 2.0**-24)]
    rng = np.random.default_rng(5)
    vals += list(rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000))
    with np.errstate(over="ignore"):  # beyond float32's range a float32 carrier holds inf
        vals += list(np.asarray(vals, np.float64).astype(np.float32).astype(np.float64))
        v = np.array(vals + [-x for x in vals], dtype=np.float64).astype(carrier)
    got = is_representable(v, fmt)
    want = np.array([_exactly_in(float(x), fmt) for x in v])
    np.testing.assert_array_equal(got, want)
    assert got.sum() > 20 and ((~got).sum() > 20 or (name == "fp32" and carrier is np.float32))  # both outcomes


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_float32_values_held_by_a_16_bit_format_are_the_same_on_both_routes(fmt, monkeypatch):
    """Whether float32 values are fp16/bf16 values, read from their bits in one compiled pass, is numpy's cast-back
    answer for every fp16 value and its float32 neighbours (±3 ulp), every float32 exponent with each single low
    bit and each low run of bits set, either sign, and random bit patterns (NaN payloads included); every value of
    the format itself is held, and no finite float32 next to one is."""
    rng = np.random.default_rng(11)
    own = (np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32) if fmt == "fp16"
           else (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32))
    wide = own.view(np.uint32).astype(np.int64)
    parts = [((wide + d) % 2**32).astype(np.uint32) for d in (-3, -2, -1, 1, 2, 3)]
    exps = np.arange(256, dtype=np.uint32) << np.uint32(23)
    for k in range(24):
        for extra in (np.uint32(1) << np.uint32(k), np.uint32((1 << 23) - (1 << k))):
            parts += [exps | extra, exps | extra | np.uint32(1 << 31)]
    parts.append(rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32))
    v = np.concatenate([own.view(np.uint32), *parts]).view(np.float32)
    got = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        got[jit] = is_representable(v, fmt)
    np.testing.assert_array_equal(got["1"], got["0"])
    assert got["1"][:65536].all()
    neighbours = np.concatenate(parts[2:4]).view(np.float32)  # ±1 ulp of float32 from each value of the format
    monkeypatch.setenv("BNPROBE_JIT", "1")
    held = is_representable(neighbours, fmt)
    assert not held[np.isfinite(neighbours)].any()


def test_an_array_held_exactly_is_its_own_rounding():
    """A float64 array noted as holding fp16 values (a dump's tensor) is read-only and round_to fp16 or fp32 returns
    it as it is — the values the correct cast gives —, while bf16 (which does not hold fp16) rounds a copy; a
    writable array, or one with NaN, is not noted."""
    rng = np.random.default_rng(5)
    v = (rng.standard_normal(5000) * 1e3).astype(np.float16).astype(np.float64)
    v[:3] = (np.inf, -0.0, 3 * 2.0**-24)  # inf, a signed zero and a subnormal stay what they are
    a = held_exactly(v.copy(), "fp16")
    assert not a.flags.writeable
    for fmt in ("fp16", "fp32"):
        r = round_to(a, fmt)
        assert r is a
        fresh = round_to(v.copy(), fmt)
        assert fresh is not v and np.array_equal(np.signbit(fresh), np.signbit(a)) and np.array_equal(fresh, a)
    b = round_to(a, "bf16")
    assert b is not a and not np.array_equal(b, a)
    np.testing.assert_array_equal(b, round_to(v.copy(), "bf16"))
    with_nan = held_exactly(np.array([1.0, np.nan]), "fp16")
    assert with_nan.flags.writeable and round_to(with_nan, "fp16") is not with_nan
    w = v.copy()
    held_exactly(w, "fp16")
    w.flags.writeable = True  # (no longer read-only: not trusted)
    assert round_to(w, "fp16") is not w

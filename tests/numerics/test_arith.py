import zlib
from fractions import Fraction

import numpy as np
import pytest
from oracle import round_fraction, round_rsqrt, round_sqrt

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.numerics import arith
from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.rounding import round_to
from bnprobe.numerics.rsqrt import rsqrt_exact

FORMATS = ["fp32", "fp16", "bf16"]


def operands(name, n, rng):
    f = get_format(name)
    scale = {"fp32": 30, "fp16": 6, "bf16": 30}[name]
    a = rng.standard_normal(n) * 10.0 ** rng.integers(-scale, scale, n)
    a = np.concatenate([a, rng.standard_normal(n)])  # same-binade operands exercise ties and cancellation
    a = round_to(a, f)
    return a[np.isfinite(a)]


OPS = {
    "add": lambda a, b: Fraction(a) + Fraction(b),
    "sub": lambda a, b: Fraction(a) - Fraction(b),
    "mul": lambda a, b: Fraction(a) * Fraction(b),
    "div": lambda a, b: Fraction(a) / Fraction(b),
}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("op", list(OPS))
def test_binary_ops_are_correctly_rounded(name, op):
    rng = np.random.default_rng(zlib.crc32(repr((name, op)).encode()))
    a, b = operands(name, 1500, rng), operands(name, 1500, rng)
    a, b = a[: min(a.size, b.size)], b[: min(a.size, b.size)]
    got = getattr(arith, op)(a, b, fmt=name)
    for x, y, g in zip(a, b, got):
        if op == "div" and y == 0:
            continue
        want = round_fraction(OPS[op](x, y), name)
        if not np.isfinite(g):
            assert not np.isfinite(want) or abs(want) > get_format(name).max, (op, x, y, g, want)
            continue
        assert g == want or (np.isnan(g) and np.isnan(want)), (op, x, y, g, want)


@pytest.mark.parametrize("name", FORMATS)
def test_sqrt_is_correctly_rounded(name):
    rng = np.random.default_rng(5)
    a = np.abs(operands(name, 2000, rng))
    got = arith.sqrt(a, fmt=name)
    np.testing.assert_array_equal(got, [round_sqrt(float(v), name) for v in a])


@pytest.mark.parametrize("name", FORMATS)
def test_fma_has_one_rounding(name):
    rng = np.random.default_rng(9)
    a, b, c = (operands(name, 1500, rng) for _ in range(3))
    k = min(a.size, b.size, c.size)
    a, b, c = a[:k], b[:k], c[:k]
    # make the product and addend nearly cancel to force the hard cases
    c[:500] = round_to(-(a[:500] * b[:500]) * (1 + rng.standard_normal(500) * 2.0**-20), name)
    keep = np.isfinite(c)
    a, b, c = a[keep], b[keep], c[keep]
    got = arith.fma(a, b, c, fmt=name)
    want = np.array([round_fraction(Fraction(x) * Fraction(y) + Fraction(z), name) for x, y, z in zip(a, b, c)])
    np.testing.assert_array_equal(got, want)  # overflow to inf included (the oracle gives inf too)


def test_fma_differs_from_two_roundings():
    # (1 + 2^-6)^2 - 1 = 2^-5 + 2^-12 is an fp16 value; mul-then-add loses the 2^-12
    a = np.array([1 + 2.0**-6])
    c = np.array([-1.0])
    fused = arith.fma(a, a, c, fmt="fp16")[0]
    two = arith.add(arith.mul(a, a, fmt="fp16"), c, fmt="fp16")[0]
    assert fused == 2.0**-5 + 2.0**-12
    assert two == 2.0**-5


def test_operands_must_be_format_values():
    with pytest.raises(BNProbeError, match="operands must already be fp16 values"):
        arith.add(np.array([0.1]), np.array([1.0]), fmt="fp16")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_rsqrt_exact_every_input(name):
    f = get_format(name)
    bits = np.arange(2**16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        v = bits.view(f.dtype).astype(np.float64)
    v = v[np.isfinite(v) & (v > 0)]
    got = rsqrt_exact(v, name)
    want = np.array([round_rsqrt(float(x), name) for x in v])
    np.testing.assert_array_equal(got, want)


def test_rsqrt_exact_fp32_samples_and_near_ties():
    rng = np.random.default_rng(2)
    v = round_to(np.exp(rng.uniform(-80, 80, 20000)), "fp32")
    # inputs whose rsqrt lies within 2^-40 relative of a midpoint: the hard cases
    r = 1 / np.sqrt(v)
    q = round_to(r, "fp32")
    mid = q + np.sign(r - q) * get_format("fp32").ulp(q) / 2
    hard = v[np.abs(r - mid) < 2.0**-40 * r]
    sample = np.concatenate([v[:3000], hard])
    got = rsqrt_exact(sample, "fp32")
    np.testing.assert_array_equal(got, [round_rsqrt(float(x), "fp32") for x in sample])


def test_rsqrt_specials():
    out = rsqrt_exact(np.array([0.0, -0.0, -1.0, np.inf, np.nan]), "fp16")
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] == 0 and np.isnan(out[4])


def test_tally_counts_per_channel():
    ar = Arith("fp16")
    t = Tally(2)
    ar.mul(np.array([[300.0, 1.0], [300.0, 300.0]]), np.array([[300.0, 1.0], [300.0, 300.0]]), t)
    np.testing.assert_array_equal(t.counts["overflow"], [1, 2])
    ar.mul(np.array([[2.0**-14, 1.0], [1.0, 1.0]]), np.array([[2.0**-14, 1.0], [1.0, 1.0]]), t)
    np.testing.assert_array_equal(t.counts["underflow"], [1, 0])

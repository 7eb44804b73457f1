import ml_dtypes
import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.reduce import reduce_sum
from bnprobe.numerics.rounding import RoundingSpec, round_to

SCALAR = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}


def scalar_sequential(row, name, kahan=False):
    """Left-to-right sum with the format's own numpy scalar arithmetic (an independent implementation)."""
    t = SCALAR[name]
    s = t(row[0])
    c = t(0)
    for v in row[1:]:
        if kahan:
            y = t(v) - c
            u = s + y
            c = (u - s) - y
            s = u
        else:
            s = s + t(v)
    return float(s)


def scalar_tree(vals, name):
    t = SCALAR[name]
    a = [t(v) for v in vals]
    n = len(a)
    p = 1 << (n.bit_length() - 1)
    a = [a[i] + a[p + i] for i in range(n - p)] + a[n - p: p]
    while len(a) > 1:
        h = len(a) // 2
        a = [a[i] + a[h + i] for i in range(h)]
    return float(a[0])


def data(name, c=3, r=777, seed=0, mean=3.0):
    rng = np.random.default_rng(seed)
    return round_to(rng.standard_normal((c, r)) + mean, name)


@pytest.mark.parametrize("name", list(SCALAR))
@pytest.mark.parametrize("kahan", [False, True])
def test_sequential_matches_scalar_loop(name, kahan):
    x = data(name)
    got = reduce_sum(x, Arith(name), order="sequential", kahan=kahan)
    np.testing.assert_array_equal(got, [scalar_sequential(row, name, kahan) for row in x])


@pytest.mark.parametrize("name", list(SCALAR))
@pytest.mark.parametrize("r", [1, 2, 7, 64, 777, 1024])
def test_pairwise_matches_scalar_tree(name, r):
    x = data(name, r=r)
    got = reduce_sum(x, Arith(name), order="pairwise")
    np.testing.assert_array_equal(got, [scalar_tree(row, name) for row in x])


@pytest.mark.parametrize("order", ["pairwise", "sequential", "lanes"])
@pytest.mark.parametrize("r", [1, 2, 7, 777, 1024])
def test_float32_carriers_sum_like_the_scalar_loops_and_count_the_same_events(order, r):
    x = data("fp32", c=4, r=r).astype(np.float32)
    x[1, 0] = 3e38  # overflows the sum (an event the float32 route must count like the float64 one)
    x[1, -1] = 3e38
    x[2, r // 2] = np.nan
    t32, t64 = Tally(4), Tally(4)
    got = reduce_sum(x, Arith("fp32"), order=order, lanes=8, tally=t32)
    ref = reduce_sum(x.astype(np.float64), Arith("fp32"), order=order, lanes=8, tally=t64)
    np.testing.assert_array_equal(got, ref)
    for k in t64.counts:
        np.testing.assert_array_equal(t32.counts[k], t64.counts[k])
    if order == "pairwise":  # rows without specials: the scalar tree itself
        np.testing.assert_array_equal(got[[0, 3]], [scalar_tree(x[i], "fp32") for i in (0, 3)])
        assert r < 2 or t64.counts["overflow"][1] > 0


@pytest.mark.parametrize("name", list(SCALAR))
@pytest.mark.parametrize("lanes", [1, 8, 64, 100])
def test_lanes_match_scalar_loops(name, lanes):
    x = data(name, r=1000)
    got = reduce_sum(x, Arith(name), order="lanes", lanes=lanes)
    want = []
    for row in x:
        per_lane = [scalar_sequential(row[j::lanes], name) if row[j::lanes].size else 0.0 for j in range(lanes)]
        want.append(scalar_tree(per_lane, name))
    np.testing.assert_array_equal(got, want)


def test_fp16_sequential_stalls_where_pairwise_does_not():
    ones = np.ones((1, 3000))
    assert reduce_sum(ones, Arith("fp16"), order="sequential")[0] == 2048.0  # 2048 + 1 rounds back to 2048
    assert reduce_sum(ones, Arith("fp16"), order="pairwise")[0] == 3000.0
    assert reduce_sum(ones, Arith("bf16"), order="sequential")[0] == 256.0


def test_saturating_sum_matches_saturating_loop():
    x = np.array([[60000.0, 60000.0, -60000.0, 1000.0], [1.0, 2.0, 3.0, 4.0]])
    t = Tally(2)
    got = reduce_sum(x, Arith("fp16", RoundingSpec(overflow="saturate")), order="sequential", tally=t)
    # 60000 + 60000 saturates at 65504; 65504 - 60000 = 5504; + 1000 = 6504
    np.testing.assert_array_equal(got, [6504.0, 10.0])
    np.testing.assert_array_equal(t.counts["overflow"], [1, 0])
    np.testing.assert_array_equal(t.counts["saturated"], [1, 0])
    ieee = reduce_sum(x, Arith("fp16"), order="sequential", tally=(t2 := Tally(2)))
    assert np.isnan(ieee[0]) or np.isinf(ieee[0])
    np.testing.assert_array_equal(t2.counts["overflow"], [1, 0])


@pytest.mark.parametrize("order", ["sequential", "pairwise", "lanes"])
def test_overflow_is_tallied_in_every_order(order):
    x = np.full((2, 200), 1000.0)
    x[1] = 1.0
    t = Tally(2)
    s = reduce_sum(x, Arith("fp16"), order=order, lanes=4, tally=t)
    assert np.isinf(s[0]) and s[1] == 200.0
    assert t.counts["overflow"][0] >= 1 and t.counts["overflow"][1] == 0


def test_stochastic_rounding_sum_is_reproducible_and_unbiased():
    x = np.full((1, 4096), 1.0 + 2.0**-8)
    a1 = reduce_sum(x, Arith("fp16", RoundingSpec("stochastic"), np.random.default_rng(1)), order="sequential")
    a2 = reduce_sum(x, Arith("fp16", RoundingSpec("stochastic"), np.random.default_rng(1)), order="sequential")
    assert a1[0] == a2[0]
    exact = 4096 * (1 + 2.0**-8)
    rne = reduce_sum(x, Arith("fp16"), order="sequential")[0]
    assert abs(a1[0] - exact) < abs(rne - exact)  # nearest-even stalls, stochastic does not


def test_bad_arguments():
    with pytest.raises(BNProbeError, match="unknown reduction order"):
        reduce_sum(np.ones((1, 4)), Arith("fp32"), order="random")
    with pytest.raises(BNProbeError, match="kahan"):
        reduce_sum(np.ones((1, 4)), Arith("fp32"), order="pairwise", kahan=True)
    with pytest.raises(BNProbeError, match=r"\(C, R\)"):
        reduce_sum(np.ones(4), Arith("fp32"))


def test_accumulator_format_limits():
    f = get_format("fp16")
    assert reduce_sum(np.array([[f.max, f.max]]), Arith("fp32"))[0] == 2 * f.max

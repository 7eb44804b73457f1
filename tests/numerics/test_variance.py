"""Variance algorithms against exact rational variances and the Chan-Golub-LeVeque bounds."""

from fractions import Fraction
from math import log2, sqrt

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.rounding import round_to
from bnprobe.numerics.variance import MomentsMethod, moments

N = 10_000
U = 2.0**-24  # fp32 unit roundoff
RATIOS = [0.0, 10.0, 100.0, 1e3, 1e4]


def exact_var(row):
    xs = [Fraction(float(v)) for v in row]
    m = sum(xs) / len(xs)
    return float(sum((v - m) ** 2 for v in xs) / len(xs))


@pytest.fixture(scope="module")
def cases():
    rng = np.random.default_rng(42)
    out = {}
    for ratio in RATIOS:
        x = round_to(rng.standard_normal((2, N)) + ratio, "fp32")
        out[ratio] = (x, np.array([exact_var(r) for r in x]))
    return out


def kappa(row):
    m = row.mean()
    return float(np.sqrt((row**2).sum() / ((row - m) ** 2).sum()))


def bound(algorithm, order, k):
    if algorithm == "naive":
        return (N if order == "sequential" else log2(N)) * k**2 * U
    if algorithm == "two_pass":
        return N * U + N**2 * k**2 * U**2
    return (N if order == "sequential" else log2(N)) * k * U


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("algorithm,order", [
    ("naive", "sequential"), ("naive", "pairwise"), ("two_pass", "sequential"), ("two_pass", "pairwise"),
    ("welford", "sequential"), ("chan", "pairwise")])
def test_error_within_published_bound(cases, ratio, algorithm, order):
    x, exact = cases[ratio]
    # welford is per-lane; with lanes=1 it is the textbook sequential update
    m = moments(x, Arith("fp32"), MomentsMethod(algorithm=algorithm, order=order,
                                               lanes=1 if order == "sequential" else 64))
    rel = np.abs(m.var - exact) / exact
    for i, row in enumerate(x):
        b = bound(algorithm if algorithm != "chan" else "two_pass", order, kappa(row))
        assert rel[i] <= b, (algorithm, order, ratio, rel[i], b)


def test_naive_cancels_where_two_pass_and_welford_do_not(cases):
    x, exact = cases[1e3]
    rel = {a: np.abs(moments(x, Arith("fp32"), MomentsMethod(algorithm=a, order="sequential", lanes=1)).var - exact)
           / exact
           for a in ("naive", "two_pass", "welford")}
    assert rel["naive"].max() > 1e-2  # the facts file measured 5.9 at this ratio
    assert rel["two_pass"].max() < 1e-5 and rel["welford"].max() < 1e-4


def test_naive_goes_negative_and_clamp_fixes_it():
    # near-constant channels far from zero: E[x^2] - E[x]^2 is mostly rounding noise
    rng = np.random.default_rng(0)
    x = round_to(1000.0 + rng.standard_normal((512, 8)) * 1e-4, "fp32")
    naive = moments(x, Arith("fp32"), MomentsMethod(algorithm="naive"))
    negative = naive.var < 0
    assert negative.sum() > 10
    assert naive.stages[-1].name == "var" and (naive.stages[-1].wide[negative] < 0).all()
    assert (moments(x, Arith("fp32"), MomentsMethod(algorithm="naive", clamp=True)).var[negative] == 0).all()
    assert (moments(x, Arith("fp32"), MomentsMethod(algorithm="two_pass")).var >= 0).all()


@pytest.mark.parametrize("algorithm", ["naive", "two_pass", "welford", "chan"])
@pytest.mark.parametrize("r", [2, 3, 63, 64, 65, 1000])
def test_fp64_algorithms_agree_with_exact(algorithm, r):
    rng = np.random.default_rng(r)
    x = rng.standard_normal((3, r)) * 3 + 1
    m = moments(x, Arith("fp64"), MomentsMethod(algorithm=algorithm, tiles=4))
    np.testing.assert_allclose(m.var, [exact_var(row) for row in x], rtol=1e-12)
    np.testing.assert_allclose(m.mean, [float(sum(Fraction(float(v)) for v in row) / r) for row in x], rtol=1e-13)


def test_mean_by_reciprocal_can_differ_in_the_last_bit():
    # s * fl(1/3) vs s / 3 in fp32: the reciprocal is inexact, so some means move by one ulp, never more
    rng = np.random.default_rng(0)
    xs = round_to(rng.standard_normal((4096, 3)), "fp32")
    a = moments(xs, Arith("fp32"), MomentsMethod(mean_by="divide")).mean
    b = moments(xs, Arith("fp32"), MomentsMethod(mean_by="reciprocal")).mean
    differ = a != b
    assert 0 < differ.sum() < differ.size
    one_ulp = np.spacing(np.abs(a[differ]).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(a - b)[differ] <= one_ulp)


def test_unknown_algorithm():
    with pytest.raises(BNProbeError, match="unknown variance algorithm"):
        moments(np.ones((1, 4)), Arith("fp32"), MomentsMethod(algorithm="fancy"))


def test_kappa_helper_sanity():
    row = np.array([1.0, 3.0])
    assert abs(kappa(row) - sqrt(10 / 2)) < 1e-12

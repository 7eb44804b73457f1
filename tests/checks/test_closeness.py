"""The judge's general rules of closeness (bnprobe.engine.closeness), each at its edge in fp16, bf16 and fp32: a value
one step of the format inside the tolerance passes and one step outside fails, the edge found by an oracle written
here in numpy float64 (never by the code under test)."""

import math

import numpy as np
import pytest

from bnprobe.engine.closeness import (
    allclose_rule,
    bench_ratio_rule,
    bound_shares,
    bounded_rule,
    error_within,
    off_by,
    scaled_rule,
)

OUTPUT_FORMATS = ("fp16", "bf16", "fp32")
# the spacing of each format's values in [1, 2) (its ulp there), written out: 2^-10, 2^-7, 2^-23
ULP_1_2 = {"fp16": 2.0**-10, "bf16": 2.0**-7, "fp32": 2.0**-23}
# (rtol, atol) of gradcheck's table, by value, and msprobe's error floors (fp16 2^-11, bf16 2^-8, fp32 2^-14)
GRAD = {"fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2), "fp32": (1e-5, 1e-5)}
ERROR_FLOOR = {"fp16": 2.0**-11, "bf16": 2.0**-8, "fp32": 2.0**-14}


def _edge_steps(expected: np.ndarray, allowed: np.ndarray, ulp: float) -> np.ndarray:
    """The most whole steps of ``ulp`` above each expected value that |a - e| <= allowed still admits (float64)."""
    k = np.floor(allowed / ulp)
    assert np.all(k * ulp <= allowed) and np.all((k + 1) * ulp > allowed)
    return k


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
@pytest.mark.parametrize("tol", ["table", "rtol>atol"])
def test_allclose_rule_at_its_edge(fmt, tol):
    """|a - e| <= atol + rtol·|e|: the last value of the format inside passes, the next one fails, with torch.testing's
    words and the smallest atol and rtol that pass (by hand); a tolerance with rtol != atol catches the two swapped."""
    rtol, atol = GRAD[fmt] if tol == "table" else (GRAD[fmt][0] * 8, GRAD[fmt][1] / 4)
    ulp = ULP_1_2[fmt]
    e = np.array([1.0, 1.25, 1.5, 1.75])  # values of every format, all in [1, 2): one ulp
    allowed = atol + rtol * np.abs(e)
    k = _edge_steps(e, allowed, ulp)
    inside = e + k * ulp
    outside = inside.copy()
    outside[2] += ulp
    assert np.all(np.abs(inside - e) <= atol + rtol * np.abs(e))
    assert np.abs(outside - e)[2] > atol + rtol * 1.5
    v = allclose_rule(inside, e, rtol, atol)
    assert v.passed and v.used <= 1.0
    assert v.need_atol == pytest.approx(float(np.max(np.abs(inside - e) - rtol * np.abs(e))), rel=1e-12)
    assert v.need_rtol == pytest.approx(float(np.max((np.abs(inside - e) - atol) / np.abs(e))), rel=1e-12)
    bad = allclose_rule(outside, e, rtol, atol, where=lambda i: f"element {i}")
    assert not bad.passed and bad.used > 1.0 and bad.worst == 2 and bad.where == "element 2"
    assert bad.why.startswith("Mismatched elements: 1 / 4 (25%")
    assert f"at element 2: {outside[2]:.6g} vs 1.5 expected ({atol + rtol * 1.5:.3g} allowed)" in bad.why
    # atol in units of a per-element scale: a scale that widens atol's share by two ulps lets the outside value pass
    scale = np.array([1.0, 1.0, 1.0 + 2 * ulp / atol, 1.0])
    assert (np.abs(outside - e) <= atol * scale + rtol * np.abs(e)).all()
    assert allclose_rule(outside, e, rtol, atol, scale=scale).passed


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_allclose_rule_nonfinite(fmt):
    """An infinity or NaN fails; with ``equal_nan`` the same infinity where the expected value has it passes (its
    allowance is inf) but a NaN still fails (its allowance is NaN: gradcheck's rows have always read so)."""
    rtol, atol = GRAD[fmt]
    e = np.array([1.0, np.inf, 2.0])
    assert not allclose_rule(e, e, rtol, atol).passed
    v = allclose_rule(e, e, rtol, atol, equal_nan=True)
    assert v.passed and v.max_abs == 0.0
    bad = allclose_rule(np.array([1.0, 1.0, 2.0]), e, rtol, atol, equal_nan=True)
    assert not bad.passed and bad.worst == 1 and math.isinf(bad.need_atol)
    n = np.array([1.0, np.nan, 2.0])
    nan = allclose_rule(n, n, rtol, atol, equal_nan=True)
    assert not nan.passed and nan.max_abs == 0.0 and "Mismatched elements: 1 / 3" in nan.why and " at 1:" in nan.why


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_scaled_rule_at_its_edge(fmt):
    """|a - e| / scale / condition <= tol per value: the last format value inside passes, the next fails; a NaN
    fails as the worst, infinitely far off."""
    tol, _ = GRAD[fmt]
    ulp = ULP_1_2[fmt]
    e = np.array([1.0, 1.5, 1.75])
    scale = np.array([2.0, 3.0, 0.0])  # 0: the scale is taken as 1
    cond = np.array([1.0, 1.5, 1.0])
    allowed = tol * np.where(scale > 0, scale, 1.0) * cond
    k = np.floor(allowed / ulp)
    # the format's values above e stay in [1, 2) where its spacing is one ulp
    assert np.all(e + (k + 1) * ulp < 2.0)
    inside = e + k * ulp
    outside = inside.copy()
    outside[1] += ulp
    assert np.all(np.abs(inside - e) / np.where(scale > 0, scale, 1.0) / cond <= tol)
    assert np.abs(outside[1] - e[1]) / scale[1] / cond[1] > tol
    v = scaled_rule(inside, e, scale, tol, condition=cond)
    assert v.passed and v.max_rel <= tol and v.used == v.max_rel / tol
    assert v.max_abs == float(np.max(np.abs(inside - e)))
    bad = scaled_rule(outside, e, scale, tol, condition=cond, where=lambda i: f"channel {i}")
    assert not bad.passed and bad.where == "channel 1" and bad.why.startswith("Mismatched elements: 1 / 3")
    nan = scaled_rule(np.array([1.0, np.nan, 1.75]), e, scale, tol, condition=cond, where=lambda i: f"channel {i}")
    assert not nan.passed and nan.where == "channel 1 (NaN/inf)" and math.isinf(nan.max_rel)


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_bounded_rule_at_its_edge(fmt):
    """|a - e| <= bound: an error of exactly the bound (two ulps) passes, three ulps fail; equal infinities err by
    nothing whatever the bound, a NaN or a different infinity fails."""
    ulp = ULP_1_2[fmt]
    e = np.array([1.0, 1.25, 1.5])
    bound = np.full(3, 2 * ulp)
    inside = e + np.array([2 * ulp, -2 * ulp, ulp])
    outside = inside + np.array([0.0, 0.0, 2 * ulp])  # 3 ulps at element 2
    assert np.all(np.abs(inside - e) <= bound) and np.abs(outside - e)[2] > bound[2]
    v = bounded_rule(inside, e, bound)
    assert v.passed and v.used == 1.0 and list(v.shares) == [1.0, 1.0, 0.5]
    bad = bounded_rule(outside, e, bound)
    assert not bad.passed and bad.worst == 2 and bad.used == 1.5
    assert bad.why.startswith("Mismatched elements: 1 / 3 (33.3%")
    shares = bound_shares(np.array([np.inf, np.inf, np.nan, 1.0]), np.array([np.inf, -np.inf, 1.0, 1.0]),
                          np.array([0.0, 1.0, 1.0, np.nan]))
    assert list(shares) == [0.0, np.inf, np.inf, 0.0]
    assert off_by("W'[3] element 4", 1.5 + 3 * ulp, 1.5, 2 * ulp) == \
        f"W'[3] element 4 off by {3 * ulp:.3g} (allowed {2 * ulp:.3g})"


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_error_within_at_its_edge(fmt):
    """error <= allowed·(1 + slack) per row: the error at the slackened allowance passes, the next float64 above
    fails, and a NaN error fails."""
    ulp = ULP_1_2[fmt]
    allowed = np.array([[2 * ulp, 3 * ulp], [ulp, ulp]])
    slack = 1e-9
    edge = allowed * (1 + slack)
    err = edge.copy()
    assert error_within(err, allowed, slack=slack, axis=1).tolist() == [True, True]
    err[1, 0] = np.nextafter(edge[1, 0], np.inf)
    assert err[1, 0] > allowed[1, 0] * (1 + slack)
    assert error_within(err, allowed, slack=slack, axis=1).tolist() == [True, False]
    err[0, 1] = np.nan
    assert error_within(err, allowed, slack=slack, axis=1).tolist() == [False, False]
    assert not error_within(err, allowed, slack=slack)


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
@pytest.mark.parametrize("floored", [False, True])
def test_bench_ratio_rule_at_its_edge(fmt, floored):
    """RMSE over the bench's at most 2 (largest error 10), each denominator floored at the format's error floor
    times the golden's RMS: 1.99 times the bench's error passes, 2.01 fails; with an exact bench the floor is the
    denominator.  A non-finite output fails."""
    g = np.array([1.0, -1.5, 0.5, 2.0])
    rms = float(np.sqrt(np.mean(g * g)))
    floor = ERROR_FLOOR[fmt] * rms
    err_b = 0.0 if floored else 4 * floor
    denom = max(err_b, floor)
    bench = g + err_b
    for share, ok in ((1.99, True), (2.01, False)):
        actual = g + share * denom
        rmse = float(np.sqrt(np.mean((actual - g) ** 2)))
        assert (rmse / denom <= 2.0) is ok  # the oracle
        v = bench_ratio_rule(actual, bench, g, fmt, what="folded", bench_name="unfused")
        assert v.passed is ok, v.why
        assert v.why == f"folded/unfused error: RMSE x{rmse / denom:.3g} (limit 2), max x{rmse / denom:.3g} (limit 10)"
    spike = g.copy()
    spike[0] += 10.5 * denom  # RMSE 10.5/2 = 5.25x, over 2; the largest error 10.5x, over 10
    assert not bench_ratio_rule(spike, bench, g, fmt)
    bad = bench_ratio_rule(np.array([1.0, np.inf, 0.5, 2.0]), bench, g, fmt, what="folded")
    assert not bad.passed and bad.why == "non-finite folded output"
    # fp64: msprobe has no standard: finite passes whatever the ratios
    assert bench_ratio_rule(g + 1.0, g + 0.25, g, "fp64").passed

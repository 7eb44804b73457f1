"""msprobe's metric definitions against values computed by hand."""

import math

import numpy as np
import pytest

from bnprobe.metrics import compare, cosine, min_atol, min_rtol, ulp_error


def test_metrics_by_hand():
    g = np.array([1.0, 2.0, -4.0, 0.0])
    a = np.array([1.0011, 2.0, -4.04, 0.0])
    m = compare(a, g, "fp32")
    assert m.max_abs == pytest.approx(0.04)
    assert m.max_rel == pytest.approx(0.01)  # 0.04 / 4; the zero golden contributes 0/eps = 0
    assert m.mean_rel == pytest.approx((0.0011 + 0 + 0.01 + 0) / 4)
    assert m.rmse == pytest.approx(math.sqrt((0.0011**2 + 0.04**2) / 4))
    assert m.ratio_1e3 == pytest.approx(0.5)  # 2 and 0 are exact; 1.0011 (1.1e-3) and -4.04 (1e-2) are not
    assert m.ratio_5e3 == pytest.approx(0.75)
    assert m.error_balance == pytest.approx(0.0)  # one above (1.0011), one below (-4.04)
    assert m.euclidean == pytest.approx(math.sqrt(0.0011**2 + 0.04**2))
    dot = 1.0011 + 4 + 16.16
    assert m.cosine == pytest.approx(dot / (math.sqrt(1.0011**2 + 4 + 4.04**2) * math.sqrt(21)))
    assert m.accuracy_reached == "Yes" and not m.nan_mismatch


def test_accuracy_verdict_rules():
    g = np.ones(100)
    assert compare(g * 1.5, g).accuracy_reached == "Yes"  # cos = 1, MaxAbsErr 0.5 <= 1
    assert compare(g * 2.5, g).accuracy_reached == "No"  # MaxAbsErr > 1
    a = g.copy()
    a[:50] = -1
    assert compare(a, g).accuracy_reached == "No"  # cos = 0 < 0.9


def test_nan_inf_as_msprobe_defines_them():
    g = np.array([1.0, np.inf, np.nan, 2.0])
    same = compare(np.array([1.0, np.inf, np.nan, 2.0]), g)
    assert not same.nan_mismatch and same.accuracy_reached == "Yes" and same.max_abs == 0  # zeroed, then compared
    moved = compare(np.array([1.0, np.inf, 3.0, 2.0]), g)
    assert moved.nan_mismatch and moved.accuracy_reached == "Nan"


def test_cosine_both_zero_is_one():
    assert cosine(np.zeros(5), np.zeros(5)) == 1.0
    assert cosine(np.zeros(5), np.ones(5)) == 0.0


def test_ulp_definition():
    # fp16: (d - b) * 2^(10 - e), e = floor(log2 |b|), clamped at -14
    assert ulp_error(np.array([1.0 + 2**-10]), np.array([1.0]), "fp16")[0] == 1.0
    assert ulp_error(np.array([3.0 + 2**-9]), np.array([3.0]), "fp16")[0] == 1.0  # e = 1
    assert ulp_error(np.array([2.0**-20]), np.array([0.0]), "fp16")[0] == pytest.approx(2.0**-20 * 2.0**24)
    assert ulp_error(np.array([1.0]), np.array([1.0 + 2**-52]), "fp64")[0] == 1.0
    assert ulp_error(np.array([1e-300]), np.array([0.0]), "fp64")[0] > 0  # no overflow to inf*0


def test_smallest_passing_tolerances():
    g = np.array([1.0, 10.0, 0.0])
    a = np.array([1.1, 10.5, 0.01])
    assert min_atol(a, g, rtol=0.0) == pytest.approx(0.5)
    assert min_atol(a, g, rtol=0.04) == pytest.approx(0.1)  # 0.5 - 0.4, 0.1 - 0.04 = 0.06, 0.01
    assert min_rtol(a, g, atol=0.01) == pytest.approx(0.09)  # (0.1 - 0.01) / 1
    assert min_rtol(a, g, atol=0.0) == math.inf  # 0.01 error where the golden is 0

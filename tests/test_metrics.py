"""msprobe's metric definitions against values computed by hand."""

import math

import numpy as np
import pytest

from bnprobe.engine.metrics import (BENCHMARK_METRICS, MSPROBE_CHECKER, benchmark, benchmark_level, benchmark_verdict,
                             compare, cosine, min_atol, min_rtol, ulp_error)
from bnprobe.core.tolerances import MSPROBE_STANDARDS


def test_metrics_by_hand():
    g = np.array([1.0, 2.0, -4.0, 0.0])
    a = np.array([1.0011, 2.0, -4.04, 0.0])
    m = compare(a, g, "fp64")  # 1.0011 and -4.04 are fp64 data: the relative errors are float64 figures
    assert m.max_abs == pytest.approx(0.04)
    assert m.max_rel == pytest.approx(0.01)  # 0.04 / 4; the zero golden contributes 0/eps = 0
    # the accuracy checker's mean relative error and RMSE leave out small values (|golden| <= 2^-20 here, the
    # zero), and RMSE takes msprobe's correction mse * (n / (n - left_out + 1e-4) + 1e-4)
    assert m.mean_rel == pytest.approx((0.0011 + 0 + 0.01) / 3)
    assert m.rmse == pytest.approx(math.sqrt((0.0011**2 + 0.04**2) / 4 * (4 / (4 - 1 + 1e-4) + 1e-4)))
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
    # msprobe's compare reports N/A for every figure, and its check_accuracy turns N/A into "No"
    assert moved.nan_mismatch and moved.accuracy_reached == "No" and math.isnan(moved.max_abs)


def test_cosine_both_zero_is_one():
    assert cosine(np.zeros(5), np.zeros(5)) == 1.0
    assert math.isnan(cosine(np.zeros(5), np.ones(5)))  # msprobe: "Nan", "All the data is Zero in npu dump data"


def test_ulp_definition():
    # fp16: (d - b) * 2^(10 - e), e = floor(log2 |b|), clamped at -14
    assert ulp_error(np.array([1.0 + 2**-10]), np.array([1.0]), "fp16")[0] == 1.0
    assert ulp_error(np.array([3.0 + 2**-9]), np.array([3.0]), "fp16")[0] == 1.0  # e = 1
    # where the golden is 0 msprobe's get_ulp_err takes e = 0 (np.where(abs_bench == 0, 0, ...)), not the minimum
    assert ulp_error(np.array([2.0**-20]), np.array([0.0]), "fp16")[0] == 2.0**-20 * 2.0**10
    assert ulp_error(np.array([1.0]), np.array([1.0 + 2**-52]), "fp64")[0] == 1.0
    assert ulp_error(np.array([1e-300]), np.array([0.0]), "fp64")[0] > 0  # no overflow to inf*0


def test_smallest_passing_tolerances():
    g = np.array([1.0, 10.0, 0.0])
    a = np.array([1.1, 10.5, 0.01])
    assert min_atol(a, g, rtol=0.0) == pytest.approx(0.5)
    assert min_atol(a, g, rtol=0.04) == pytest.approx(0.1)  # 0.5 - 0.4, 0.1 - 0.04 = 0.06, 0.01
    assert min_rtol(a, g, atol=0.01) == pytest.approx(0.09)  # (0.1 - 0.01) / 1
    assert min_rtol(a, g, atol=0.0) == math.inf  # 0.01 error where the golden is 0


@pytest.mark.parametrize("actual, golden, fmt, accuracy", [
    (np.ones(3), np.ones(4), "fp32", "Unmatched"),  # msprobe: "shape unmatched" in every column
    (np.ones((2, 3)), np.ones((3, 2)), "fp32", "Unmatched"),
    (np.zeros(0), np.zeros(0), "fp32", "None"),  # empty: "unsupported"
    (np.array(["a", "b"]), np.ones(2), "fp32", "None"),
    (np.ones(2), np.ones(2), "fp12", "None"),
], ids=["size", "shape", "empty", "strings", "unknown-format"])
def test_compare_never_raises(actual, golden, fmt, accuracy):
    m = compare(actual, golden, fmt)
    assert m.accuracy_reached == accuracy and m.problem and math.isnan(m.max_rel) and m.worst_index == -1
    assert set(m.to_dict()) >= {"cosine", "euclidean", "max_abs", "max_rel", "mean_rel", "rmse", "ratio_1e3",
                                "ratio_5e3", "error_balance", "ulp_max", "ulp_mean", "worst_index", "nan_mismatch",
                                "accuracy_reached"}


def test_size_one_dims_are_squeezed_as_msprobe_reads_them():
    m = compare(np.ones((1, 4, 1)), np.ones(4))
    assert m.accuracy_reached == "Yes" and m.max_abs == 0 and not m.problem


def test_torch_bf16_tensors_are_read_as_float32():
    torch = pytest.importorskip("torch")
    g = torch.tensor([1.0, 2.0, 0.0, -3.0]).to(torch.bfloat16)
    a = torch.tensor([1.0, 2.0, 2.0**-9, -3.0]).to(torch.bfloat16)  # the one error where the golden is 0
    m = compare(a, g, "bf16")
    assert m.max_abs == 2.0**-9 and m.max_rel == 2.0**-9 / 2.0**-23  # float32's eps where the golden is 0


def test_benchmark_floor_is_on_the_bench_metric_not_the_ratio():
    bench = dict.fromkeys(BENCHMARK_METRICS, 0.0)
    dev = {**bench, "rmse": 1e-4}
    r = benchmark_verdict(dev, bench, "fp16")
    assert r.ratios["rmse"] == 1e-4 / 2.0**-11 and r.result == "pass" and r
    assert r.needed == pytest.approx(1e-4 / 2.0**-11 / 2.0)  # the share of the L0 rmse limit (2) used


def test_benchmark_skips_what_msprobe_does_not_judge():
    assert benchmark_verdict({}, {}, "fp64").result == "skip"
    assert benchmark(np.ones(4), np.ones(4), np.ones(4), "fp16", level="L7").result == "skip"
    assert benchmark(np.ones(4), np.ones(3), np.ones(4), "fp16").result == "error"  # a bench of another shape
    assert benchmark_level("batch_norm") == "L0" and benchmark_level("layer_norm") == "L2"


def test_benchmark_of_identical_outputs_passes_with_ratio_one_or_less():
    rng = np.random.default_rng([7, 1])
    g = rng.standard_normal(200)
    out = g.astype(np.float16).astype(np.float64)
    r = benchmark(out, out, g, "fp16")
    assert r and r.result == "pass" and all(v <= 1.0 for v in r.ratios.values())


def test_checker_table_agrees_with_the_tolerance_table():
    # the values both tables carry (bnprobe.core.tolerances.MSPROBE_STANDARDS came from the same msprobe source);
    # small-value atol differs on purpose for fp16: 2^-16 is msprobe's absolute-threshold atol, the benchmark's 1e-16
    for fmt, std in MSPROBE_STANDARDS.items():
        assert MSPROBE_CHECKER[fmt].small_value == std.small_threshold
        assert MSPROBE_CHECKER[fmt].error_floor == std.error_floor
    assert MSPROBE_CHECKER["fp16"].small_value_atol == 1e-16 != MSPROBE_STANDARDS["fp16"].small_atol


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp64"])
def test_a_comparison_keeps_the_checker_metrics_and_ulps_as_computed_alone(fmt):
    """compare() keeps what the benchmark verdict and the ULP rule need: the same values checker_metrics and
    ulp_error give (None where checker_metrics gives none: msprobe's benchmark skips float64)."""
    from bnprobe.engine.metrics import checker_metrics, compare, ulp_error
    from bnprobe.numerics.rounding import round_to

    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 4, 5)) * 10.0 ** rng.integers(-3, 3, (3, 4, 5))
    a = round_to(g * (1 + 1e-3 * rng.standard_normal(g.shape)), fmt)
    m = compare(a, g, fmt)
    alone = checker_metrics(a, g, fmt)
    if alone is None:
        assert m.checker_metrics is None
    else:
        assert m.checker_metrics.keys() == alone.keys()
        assert all(np.array_equal(m.checker_metrics[k], alone[k]) for k in alone)
    np.testing.assert_array_equal(m.ulps, ulp_error(a, g, fmt))


# ---- the ULP's exponent and factor, by cheaper operations than msprobe's, equal element for element -------------

def _msprobe_eb(b: np.ndarray, min_exp: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.maximum(np.where(b == 0, 0, np.floor(np.log2(b))), min_exp)


def _edges(dtype) -> np.ndarray:
    """Every power of two of ``dtype`` (subnormals included), the 2^13 values just below each and the 4 just above,
    0, the smallest subnormal, inf and NaN: where floor(log2) can round differently from the exponent field."""
    fi = np.finfo(dtype)
    view = np.int32 if dtype == np.float32 else np.int64
    powers = np.ldexp(np.ones(1, dtype), np.arange(fi.minexp - fi.nmant, fi.maxexp)).astype(dtype)
    bits = powers.view(view)
    around = (bits[:, None] + np.arange(-(1 << 13), 5, dtype=view)[None, :]).reshape(-1)
    around = around[(around >= 0) & (around <= np.array([np.inf], dtype).view(view)[0])]
    return np.concatenate([around.view(dtype), np.array([0, fi.smallest_subnormal, np.inf, np.nan], dtype)])


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
def test_floor_log2_is_numpys_at_every_power_of_two(fmt):
    from bnprobe.engine.metrics import _floor_log2

    std = MSPROBE_CHECKER[fmt]
    b = _edges(std.bench)
    rng = np.random.default_rng(5)
    b = np.concatenate([b, np.abs(rng.standard_normal(10**5)).astype(std.bench) * 10.0 ** rng.integers(-30, 30)])
    got, want = _floor_log2(b, std.ulp_min_exp), _msprobe_eb(b, std.ulp_min_exp)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_floor_log2_is_numpys_on_every_float32():
    """Exhaustive: every non-negative float32 bit pattern (2^31, in blocks)."""
    from bnprobe.engine.metrics import _floor_log2

    for lo in range(0, 1 << 31, 1 << 24):
        b = np.arange(lo, lo + (1 << 24), dtype=np.int64).astype(np.int32).view(np.float32)
        np.testing.assert_array_equal(_floor_log2(b, -126), _msprobe_eb(b, -126))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pow2_is_exp2_on_every_integer_exponent(dtype):
    """Exhaustive over every integer exponent from below the subnormals to beyond overflow."""
    from bnprobe.engine.metrics import _pow2

    fi = np.finfo(dtype)
    k = np.arange(fi.minexp - fi.nmant - 3, fi.maxexp + 4).astype(dtype)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_pow2(k, dtype), np.exp2(k).astype(dtype))

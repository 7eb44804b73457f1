"""The Ascend presets against small cases worked by hand from the published formulas
(numpy float32 arithmetic, never the emulator itself)."""

from fractions import Fraction

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.numerics.rounding import round_to

f32 = np.float32


def test_tbe_mean_multiplies_by_the_fp32_reciprocal():
    # R = 3, exact sum 7: TBE's mean = fl(7 * fl(1/3)) differs from the true fl(7/3) in the last bit
    x = np.array([[1.0, 2.0, 4.0]]).T  # (N=3, C=1)
    by_hand_tbe = f32(7) * (f32(1) / f32(3))
    by_hand_div = f32(7) / f32(3)
    assert by_hand_tbe != by_hand_div  # the case is a real last-bit difference
    tbe = get_adapter("ascend-tbe").forward_train(x, dtype="fp32")
    assert tbe.saved.mean[0] == by_hand_tbe
    plain = get_adapter("emulated:fp32").forward_train(x, dtype="fp32")
    assert plain.saved.mean[0] == by_hand_div


def single_pass_var(x1, x2):
    """TBE BNTrainingUpdate for R = 2 by hand: sums in fp32, mean = sum*fl(1/2), var = E[x^2] - mean^2."""
    s = f32(x1) + f32(x2)
    q = f32(x1) * f32(x1) + f32(x2) * f32(x2)
    half = f32(0.5)
    mean = s * half
    return (q * half) - mean * mean, mean


def crafted_negative_channel():
    rng = np.random.default_rng(0)
    for _ in range(10000):
        a = f32(1000.0 + rng.uniform(-1, 1))
        b = np.nextafter(a, f32(2000))  # two neighbours: true variance tiny, single pass cancels
        v, _ = single_pass_var(a, b)
        if v < 0:
            return a, b, v
    raise AssertionError("no negative single-pass variance found")


@pytest.mark.parametrize("chip,clamps", [("910", False), ("910b", True), ("310p", True), ("310", False)])
def test_tbe_single_pass_variance_goes_negative_and_is_clamped_only_where_the_chip_clamps(chip, clamps):
    a, b, v = crafted_negative_channel()
    x = np.array([[a], [b]], dtype=np.float64)
    out = get_adapter(f"ascend-tbe:chip={chip}").forward_train(x, dtype="fp32")
    assert out.saved.kind == "var"
    if clamps:
        assert out.saved.value[0] == 0.0
    else:
        assert out.saved.value[0] == v < 0


def test_tbe_atomic_adds_change_last_bits_across_runs_but_950_is_bit_identical():
    rng = np.random.default_rng(5)
    x = round_to(rng.standard_normal((48, 16, 8, 8)) * 3 + 50, "fp32")  # C1 = 1 < cores: N split over cores
    tbe = get_adapter("ascend-tbe")
    runs = [tbe.forward_train(x, dtype="fp32").saved for _ in range(6)]
    means = np.array([r.mean for r in runs])
    assert not (means == means[0]).all()  # the arrival order of the partial sums changed the bits...
    exact = x.mean(axis=(0, 2, 3))
    assert np.abs(means - exact).max() <= 64 * np.spacing(f32(50))  # ...within a few ulps of the true mean
    c950 = get_adapter("ascend-950")
    a, b = c950.forward_train(x, dtype="fp32"), c950.forward_train(x, dtype="fp32")
    assert np.array_equal(a.y, b.y) and np.array_equal(a.saved.value, b.saved.value)
    assert not get_adapter("ascend-tbe").capabilities().deterministic and c950.capabilities().deterministic


def test_tbe_splits_channels_across_cores_when_there_are_enough_blocks():
    # C = 32 * 16 = 512 channels: C1 = 32 >= 24 cores, so each core owns whole channels: deterministic
    x = round_to(np.random.default_rng(1).standard_normal((4, 512, 2, 2)) + 3, "fp32")
    tbe = get_adapter("ascend-tbe")
    a, b = tbe.forward_train(x, dtype="fp32"), tbe.forward_train(x, dtype="fp32")
    assert np.array_equal(a.saved.mean, b.saved.mean)


def test_bnv3_prescaled_mean_by_hand():
    # R = 3 < 8192: mean = fl(fl(sum of x*2^-2) * fl(4/3)); with x = 1, 2, 4 the sum is exact (7/4)
    x = np.array([[1.0, 2.0, 4.0]]).T
    by_hand = f32(7 / 4) * f32(4 / 3)
    out = get_adapter("ascend-bnv3").forward_train(x, dtype="fp32")
    assert out.saved.mean[0] == by_hand != f32(7) / f32(3)


def test_bnv3_switches_to_welford_at_8192():
    rng = np.random.default_rng(2)
    small = get_adapter("ascend-bnv3").forward_train(rng.standard_normal((8191, 2)), dtype="fp32")
    big = get_adapter("ascend-bnv3").forward_train(rng.standard_normal((8192, 2)), dtype="fp32")
    assert small.trace.meta["policy"].endswith("full-reduce") and big.trace.meta["policy"].endswith("welford")
    assert "m2" in big.trace.names() and "sum_sq_dev" in small.trace.names()


def test_bnv3_bf16_output_rounds_half_away_from_zero():
    # gamma = 0 makes y = beta exactly; beta = ±(1 + 2^-8) and 1 + 3*2^-8 are bf16 ties (fp32 values)
    beta = np.array([1 + 2.0**-8, -(1 + 2.0**-8), 1 + 3 * 2.0**-8])
    x = np.random.default_rng(3).standard_normal((16, 3))
    out = get_adapter("ascend-bnv3").forward_train(x, np.zeros(3), beta, dtype="bf16")
    y = out.y.astype(np.float64)
    np.testing.assert_array_equal(y[0], [1 + 2.0**-7, -(1 + 2.0**-7), 1 + 2 * 2.0**-7])  # away from zero
    assert (round_to(beta, "bf16") != y[0]).sum() == 2  # nearest-even would give 1, -1 and 1 + 2*2^-7
    rng = np.random.default_rng(4)
    big = get_adapter("ascend-bnv3").forward_train(rng.standard_normal((512, 4)), dtype="bf16")
    y2 = np.moveaxis(big.y.astype(np.float64), 1, 0).reshape(4, -1)
    np.testing.assert_array_equal(y2, round_to(big.trace["affine"].value, "bf16", rounding="nearest_away"))


def test_r1_running_variance_tbe_zero_bnv3_nan():
    x = np.array([[1.0, 2.0]])  # N = 1, C = 2: R = 1
    tbe = get_adapter("ascend-tbe").forward_train(x, None, None, np.zeros(2), np.ones(2), dtype="fp32")
    np.testing.assert_array_equal(tbe.running_var, f32(0.9) * f32(1))  # (1-m)*rv + m*var*0
    bnv3 = get_adapter("ascend-bnv3").forward_train(x, None, None, np.zeros(2), np.ones(2), dtype="fp32")
    assert np.isnan(bnv3.running_var).all()
    with pytest.raises(Exception, match="more than one value per channel"):
        get_adapter("torch").forward_train(x, dtype="fp32")


def fma32(a, b, c):
    """fl32(a*b + c) with one rounding, by exact rationals."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    return f32(round_to(np.array([float(exact)]), "fp32")[0]) if exact == Fraction(float(exact)) else \
        f32(_round_fraction32(exact))


def _round_fraction32(v):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from oracle import round_fraction

    return round_fraction(v, "fp32")


def test_950_rstd_sequence_by_hand():
    rng = np.random.default_rng(4)
    x = round_to(rng.standard_normal((64, 6)) * rng.uniform(0.5, 3, 6), "fp32")
    out = get_adapter("ascend-950").forward_train(x, dtype="fp32")
    var_eps = out.trace["var_eps"].value
    for v, got in zip(var_eps, out.saved.value):
        v = f32(v)
        r = f32(1) / v
        y = np.sqrt(r, dtype=np.float32)
        y = y * (f32(1.5) - (f32(0.5) * v * y) * y)
        s = fma32(-v, y * y, f32(1))
        y = fma32(f32(0.5) * y, s, y)
        assert got == y


def test_chip_overflow_modes_on_the_output_cast():
    x = np.array([[-1.0], [1.0]] * 8)
    g = np.array([1e5])  # y = ±1e5 > fp16 max
    sat = get_adapter("ascend-tbe:chip=910").forward_train(x, g, dtype="fp16")
    ieee = get_adapter("ascend-tbe:chip=910b").forward_train(x, g, dtype="fp16")
    assert np.abs(sat.y.astype(np.float64)).max() == 65504.0 and np.isfinite(sat.y.astype(np.float64)).all()
    assert np.isinf(ieee.y.astype(np.float64)).all()


def test_bninfer_is_a_times_x_plus_b():
    x = round_to(np.random.default_rng(6).standard_normal((8, 3)), "fp16")
    rm, rv, g, b = np.array([0.5, -1, 2]), np.array([1.5, 0.25, 4]), np.array([1, 2, 0.5]), np.array([0.1, 0, -1])
    out = get_adapter("ascend-tbe").forward_infer(x, g, b, rm, rv, dtype="fp16")
    # by hand in fp32: A = g / sqrt(rv + eps) (the reciprocal-estimate division agrees to ~1e-7), B = b - A*rm
    a = f32(g) / np.sqrt(f32(rv) + f32(1e-5), dtype=np.float32)
    bb = f32(b) - a * f32(rm)
    by_hand = (f32(x) * a + bb).astype(np.float16)
    assert np.abs(out.y.astype(np.float64) - by_hand.astype(np.float64)).max() <= 2 * 2.0**-10 * 4
    assert "mult" in out.trace.names() and "addend" in out.trace.names()


def test_unknown_chip_and_options():
    with pytest.raises(Exception, match="unknown Ascend chip 'h100'"):
        get_adapter("ascend-tbe:chip=h100")
    with pytest.raises(Exception, match="unknown ascend option"):
        get_adapter("ascend-tbe:colour=red")


@pytest.mark.parametrize("name", ["ascend-tbe", "ascend-tbe:chip=910", "ascend-bnv3", "ascend-950"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_counters_only_traces_give_the_same_results_as_full_traces(name, dtype):
    """Without kept arrays the kernels may carry float32 (see kernels/batchnorm.py): same bits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 20, 9, 9)) * 3 + 1
    x[0, 2, 0, 0] = 7e4  # overflows fp16 storage
    dy = rng.standard_normal(x.shape)
    for big in (False, True):  # bnv3 switches to Welford from R = 8192
        xs, dys = (np.tile(x, (16, 1, 1, 1)), np.tile(dy, (16, 1, 1, 1))) if big else (x, dy)
        outs = []
        for keep in (True, False):
            a = get_adapter(name + (",seed=5" if ":" in name else ":seed=5"))
            a.keep_arrays = keep
            f = a.forward_train(xs, None, None, np.zeros(20), np.ones(20), dtype=dtype)
            b = a.backward(dys, xs, None, f.saved, dtype=dtype)
            i = a.forward_infer(xs, None, None, f.running_mean, f.running_var, dtype=dtype)
            outs.append([f.y, f.saved.mean, f.saved.value, f.running_mean, f.running_var, b.dx, b.dgamma,
                         b.dbeta, i.y])
        for u, v in zip(*outs):
            np.testing.assert_array_equal(np.asarray(u, np.float64), np.asarray(v, np.float64))

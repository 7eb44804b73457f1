"""Eigen's packet rsqrt (TensorFlow's ``tf.math.rsqrt`` on whole packets): Intel's RSQRTPS refined by Eigen's
generic_rsqrt_newton_step, against a float32 replay written here with numpy's own binary32 arithmetic."""

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.rsqrt import reciprocal, rsqrt, rsqrt_estimate

f32 = np.float32


def _eigen_replay(v: np.ndarray, y0: np.ndarray) -> np.ndarray:
    """Eigen's generic_rsqrt_newton_step (one step, no FMA) in numpy float32 arithmetic."""
    v, y = v.astype(f32), y0.astype(f32)
    r2 = v * y
    half_r = y * f32(-0.5)
    h = r2 * y - f32(1)
    out = half_r * h + y
    return np.where(np.isnan(out), y, out)


def test_eigen_newton_step_against_a_float32_replay():
    rng = np.random.default_rng(1)
    v = (2.0 ** rng.uniform(-60, 60, 100_000)).astype(np.float32).astype(np.float64)
    y0 = rsqrt_estimate(v, "fp32", "rsqrtps")
    got = rsqrt(v, "fp32", method="rsqrtps", newton=1, form="eigen")
    assert np.array_equal(got, _eigen_replay(v, y0).astype(np.float64))
    exact = (1 / np.sqrt(v)).astype(np.float32).astype(np.float64)
    off = got != exact
    assert 0 < off.mean() < 0.6  # (an estimate refined once: close to, but not, the correctly rounded value)
    worst = np.max(np.abs(got / exact - 1))
    assert 2.0 ** -24 < worst < 6 * 2.0 ** -24  # (a few ulps: 3 at most were measured against TensorFlow's rsqrt)


def test_the_eigen_step_is_not_the_standard_one():
    """Guard: Eigen's residual form rounds apart from the Quake-order step on these inputs."""
    rng = np.random.default_rng(2)
    v = (2.0 ** rng.uniform(-20, 20, 20_000)).astype(np.float32).astype(np.float64)
    eigen = rsqrt(v, "fp32", method="rsqrtps", newton=1, form="eigen")
    quake = rsqrt(v, "fp32", method="rsqrtps", newton=1, form="standard")
    assert not np.array_equal(eigen, quake)


def test_eigen_form_is_for_rsqrt_only():
    with pytest.raises(BNProbeError, match="eigen"):
        reciprocal(np.array([3.0]), "fp32", method="table", newton=1, form="eigen")

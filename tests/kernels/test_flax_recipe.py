"""flax's BatchNorm as JAX runs it on the CPU (eager: one XLA computation per primitive of its jaxpr) — the recipe
``identify --adapter jax`` finds — against a float32 replay of that jaxpr written here without bnprobe: the training
forward (mean and E[x²] from one sum each, times fl(1/R); var = max(0, E[x²] − mean²); y = ((x − mean)·(rstd·γ)) + β;
the running statistics m·old + (1 − m)·batch), inference, and the vjp JAX derives (its steps are the jaxpr's, listed
in _replay_backward).  The shapes here stay under 4096 values with no axis over 32, where XLA sums in row-major
order from +0 (the other paths of order=xla: tests/numerics/test_xla_cpu.py); against jax itself:
tests/adapters/test_flax_xla.py."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from oracle import round_fraction

from bnprobe.kernels.batchnorm import Execution, backward, forward_infer, forward_train

f32 = np.float32
RECIPE = ("{fmt}:variance=naive,clamp_var=true,mean_by=reciprocal,order=xla,rsqrt=rsqrtps,rsqrt_newton=2,"
          "newton_form=xla,y_formula=scale,running_momentum=old,running_var=biased,backward_formula=jax")
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
LAST = Execution(layout="channels_last", keep_arrays=False)


def _sum(a: np.ndarray) -> np.ndarray:
    """Σ over all but the last axis from +0, row-major (XLA's loop)."""
    s = np.zeros(a.shape[-1], dtype=f32)
    for row in a.reshape(-1, a.shape[-1]):
        s = (s + row).astype(f32)
    return s


def _rsqrt(v: float) -> float:
    """XLA's CPU rsqrt of a positive normal float32: RSQRTSS (1/sqrt of the midpoint of v's interval — exponent
    parity and 10 fraction bits — to 12 fraction bits), then twice y = fma(fl(−y/2), fma(fl(v·y), y, −1), y)."""
    k = math.floor(math.log(v, 4))
    while 4.0**k > v:
        k -= 1
    while 4.0 ** (k + 1) <= v:
        k += 1
    m = Fraction(v) / Fraction(4) ** k  # in [1, 4)
    width = Fraction(1, 1024) if m < 2 else Fraction(1, 512)
    mid = (m // width) * width + width / 2
    q = Fraction(round(2**13 / math.sqrt(mid)), 2**13)  # (float64 decides the 13-bit rounding: no tie is near)
    y = float(q * Fraction(2) ** -k)
    for _ in range(2):
        a, h = float(f32(v * y)), float(f32(-0.5 * y))
        e = round_fraction(Fraction(a) * Fraction(y) - 1, "fp32")
        y = round_fraction(Fraction(h) * Fraction(e) + Fraction(y), "fp32")
    return y


def _stats(xf: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    r = f32(1) / f32(xf.size // xf.shape[-1])
    mu = (_sum(xf) * r).astype(f32)
    raw = ((_sum((xf * xf).astype(f32)) * r).astype(f32) - (mu * mu).astype(f32)).astype(f32)
    var = np.maximum(raw, f32(0))
    ve = (var + f32(eps)).astype(f32)
    return mu, raw, var, ve, np.array([_rsqrt(float(v)) for v in ve], dtype=f32), r


def _replay_train(x: np.ndarray, g, b, rm, rv, keep: float, eps: float):  # noqa: ANN001, ANN202
    xf = x.astype(f32)
    mu, _, var, _, rstd, _ = _stats(xf, eps)
    y = (((xf - mu).astype(f32) * (rstd * g).astype(f32)).astype(f32) + b).astype(f32).astype(x.dtype)
    k, f = f32(keep), f32(1 - keep)
    return y, ((k * rm).astype(f32) + (f * mu).astype(f32)).astype(f32), \
        ((k * rv).astype(f32) + (f * var).astype(f32)).astype(f32)


def _replay_backward(x: np.ndarray, dy: np.ndarray, g: np.ndarray, eps: float):  # noqa: ANN202
    """The vjp's jaxpr, step by step (fp32): w = rstd·γ; u = dy·w; dγ = rstd·Σ(x − mean)dy; dβ = Σdy;
    by = ((Σ(x − mean)dy)·γ)·(−0.5·(rstd / (var + ε))) times the clamp's derivative (1, ½ at 0, 0 below);
    k2 = by·fl(1/R); k1 = (−Σu + (−by)·(2 mean))·fl(1/R); dx = (u + k1) + k2·2x in fp32, and for 16-bit x
    fl16(u) + fl16(k1 + k2·2x), added in the 16-bit format."""
    xf, dyf = x.astype(f32), dy.astype(f32)
    mu, raw, _, ve, rstd, r = _stats(xf, eps)
    slope = np.where(raw > 0, f32(1), np.where(raw == 0, f32(0.5), f32(0))).astype(f32)
    w = (rstd * g).astype(f32)
    dot = _sum(((xf - mu).astype(f32) * dyf).astype(f32))
    u = (dyf * w).astype(f32)
    by = ((((dot * g).astype(f32)) * (f32(-0.5) * (rstd / ve).astype(f32)).astype(f32)).astype(f32) * slope)
    k2 = (by.astype(f32) * r).astype(f32)
    k1 = ((-_sum(u) + (-by * (f32(2) * mu)).astype(f32)).astype(f32) * r).astype(f32)
    spread = (k2 * (f32(2) * xf)).astype(f32)
    if x.dtype == np.float32:
        dx = ((u + k1).astype(f32) + spread).astype(f32)
    else:
        dx = (u.astype(x.dtype).astype(f32) + (k1 + spread).astype(f32).astype(x.dtype).astype(f32)).astype(x.dtype)
    return dx, (rstd * dot).astype(f32), _sum(dyf)


def _inputs(fmt: str, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = (rng.standard_normal(shape) * rng.uniform(0.05, 3, c) + rng.normal(0, 20, c)).astype(DTYPES[fmt])
    dy = (rng.standard_normal(shape) + rng.normal(0, 1, c)).astype(DTYPES[fmt])
    vec = [rng.uniform(0.3, 3, c), rng.normal(0, 1, c), rng.normal(0, 1, c), rng.uniform(0.5, 2, c)]
    return (x, dy, *(v.astype(f32) for v in vec))


SHAPES = [(3, 7, 11, 6), (2, 8, 5, 6), (4, 5, 9, 3), (2, 1, 3, 3)]


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_training_forward_and_running_statistics_replay_the_jaxpr(fmt, shape):
    x, _, g, b, rm, rv = _inputs(fmt, shape, sum(shape))
    res = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.9, eps=1e-5, policy=RECIPE.format(fmt=fmt),
                        execution=LAST)
    y, new_rm, new_rv = _replay_train(x, g, b, rm, rv, 0.9, 1e-5)
    assert np.array_equal(res.y.astype(np.float64), y.astype(np.float64))
    assert np.array_equal(res.running_mean, new_rm) and np.array_equal(res.running_var, new_rv)


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_inference_replays_the_jaxpr(fmt):
    x, _, g, b, rm, rv = _inputs(fmt, (3, 7, 11, 6), 5)
    res = forward_infer(x.astype(np.float64), g, b, rm, rv, eps=1e-5, policy=RECIPE.format(fmt=fmt), execution=LAST)
    xf = x.astype(f32)
    rstd = np.array([_rsqrt(float(v)) for v in (rv + f32(1e-5)).astype(f32)], dtype=f32)
    y = (((xf - rm).astype(f32) * (rstd * g).astype(f32)).astype(f32) + b).astype(f32).astype(x.dtype)
    assert np.array_equal(res.y.astype(np.float64), y.astype(np.float64))


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_replays_jax_s_vjp(fmt, shape):
    x, dy, g, b, rm, rv = _inputs(fmt, shape, 3 * sum(shape))
    pol = RECIPE.format(fmt=fmt)
    fwd = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.9, eps=1e-5, policy=pol, execution=LAST)
    res = backward(dy.astype(np.float64), x.astype(np.float64), g, fwd.mean, fwd.invstd, policy=pol, eps=1e-5,
                   execution=LAST)
    dx, dg, db = _replay_backward(x, dy, g, 1e-5)
    assert np.array_equal(res.dx.astype(np.float64), dx.astype(np.float64))
    assert np.array_equal(res.dgamma, dg) and np.array_equal(res.dbeta, db)


def test_backward_takes_the_clamp_s_derivative():
    """A channel whose one-pass variance rounds negative (clamped to 0) has no variance term in its dx: k2 = 0, so
    dx = u + k1 there; the same channel without the clamp's derivative would differ (the case shows it)."""
    x = np.full((2, 3, 4, 2), 999.9, dtype=f32)  # channel 0 constant: E[x²] − mean² rounds to −0.4375
    x[..., 1] = np.linspace(-1, 1, 24, dtype=f32).reshape(2, 3, 4)
    _, raw, _, _, _, _ = _stats(x, 1e-5)
    assert raw[0] < 0 < raw[1]  # (the case: channel 0's one-pass variance is negative)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(f32)
    g = np.array([1.5, 0.7], dtype=f32)
    pol = RECIPE.format(fmt="fp32")
    fwd = forward_train(x.astype(np.float64), g, None, policy=pol, execution=LAST)
    res = backward(dy.astype(np.float64), x.astype(np.float64), g, fwd.mean, fwd.invstd, policy=pol,
                   execution=LAST)
    dx, _, _ = _replay_backward(x, dy, g, 1e-5)
    assert np.array_equal(res.dx, dx)
    unclamped = backward(dy.astype(np.float64), x.astype(np.float64), g, fwd.mean, fwd.invstd,
                         policy=pol.replace("clamp_var=true", "clamp_var=false"), execution=LAST)
    assert not np.array_equal(unclamped.dx[..., 0], res.dx[..., 0]) and np.array_equal(unclamped.dx[..., 1],
                                                                                     res.dx[..., 1])


def test_evaluation_backward_is_dy_times_w_and_rstd_times_the_dot():
    """use_running_average=True: dx = fl(dy·fl(rstd·γ)), dγ = fl(rstd·Σ fl((x − mean)·dy)) — not the standard
    formula's Σ dy·fl((x − mean)·rstd)."""
    x, dy, g, _, rm, rv = _inputs("fp32", (3, 7, 11, 6), 9)
    pol = RECIPE.format(fmt="fp32")
    ve = (rv + f32(1e-5)).astype(f32)
    rstd = np.array([_rsqrt(float(v)) for v in ve], dtype=f32)
    res = backward(dy.astype(np.float64), x.astype(np.float64), g, rm, rstd, policy=pol, training=False,
                   execution=LAST)
    assert np.array_equal(res.dx, (dy * (rstd * g).astype(f32)).astype(f32))
    assert np.array_equal(res.dgamma, (rstd * _sum(((x - rm).astype(f32) * dy).astype(f32))).astype(f32))
    with_var = backward(dy.astype(np.float64), x.astype(np.float64), g, rm, rstd, policy=pol, training=False,
                        saved_var=rv, execution=LAST)
    assert np.array_equal(with_var.dx, res.dx)

"""The recipes identify finds for Paddle's and MindSpore's CPU BatchNorm, run by bnprobe's kernel, against scalar
float32 replays of the frameworks' source loops written here without bnprobe (Paddle: phi/kernels/cpu/
batch_norm_kernel.cc and batch_norm_grad_kernel.cc on Eigen 3.3; MindSpore: oneDNN's ncsp_batch_normalization.cpp as
GCC lowers its omp-simd loops).  The same replays were checked bit for bit against Paddle 3.3.1 and MindSpore 2.10
on this machine; the frameworks themselves are compared in tests/adapters/test_frameworks_identified.py."""

import numpy as np
import pytest

from bnprobe.kernels.batchnorm import backward, forward_train
from bnprobe.kernels.policy import get_policy

f32 = np.float32
PADDLE = ("fp32:order=eigen,lanes=8,y_formula=affine_mr,rsqrt=sqrt_recip,sqrt=eigen_fast,backward_formula=paddle,"
          "running_momentum=keep,running_var=biased,infer_rsqrt=sqrt_div")
MINDSPORE = "fp32:order=omp_simd,lanes=4,y_formula=scale,rsqrt=sqrt_div,backward_formula=onednn,backward_lanes=1"
EPS, M = 1e-5, 0.1


def eigen_sum(v, start: int, lanes: int = 8) -> f32:
    """Eigen's LinearVectorizedTraversal sum of one row (two packet accumulators, halves-first fold, head and tail
    added after)."""
    n = len(v)
    start = min(start, n)
    s1, s2 = (n - start) // lanes * lanes, (n - start) // (2 * lanes) * (2 * lanes)
    if not s1:
        r = f32(v[0])
        for a in v[1:]:
            r = f32(r + a)
        return r
    p0 = v[start:start + lanes].copy()
    if s1 > lanes:
        p1 = v[start + lanes:start + 2 * lanes].copy()
        for i in range(start + 2 * lanes, start + s2, 2 * lanes):
            p0, p1 = p0 + v[i:i + lanes], p1 + v[i + lanes:i + 2 * lanes]
        p0 = p0 + p1
        if s1 > s2:
            p0 = p0 + v[start + s2:start + s2 + lanes]
    while len(p0) > 1:
        p0 = p0[:len(p0) // 2] + p0[len(p0) // 2:]
    r = p0[0]
    for a in list(v[:start]) + list(v[start + s1:]):
        r = f32(r + a)
    return r


def rsqrtps(v: f32) -> f32:
    m, e = np.frexp(float(v))
    odd = (e - 1) % 2
    mid = (1 + (np.floor((2 * m - 1) * 1024) + 0.5) / 1024) * 2.0**odd
    return f32(round(2**13 / np.sqrt(mid)) / 2**13 * 2.0 ** (-((e - 1 - odd) // 2)))


def eigen_fast_sqrt(x: f32) -> f32:
    y = rsqrtps(x)
    y = f32(y * f32(f32(1.5) - f32(f32(x * f32(0.5)) * f32(y * y))))
    return f32(x * y)


def replay_paddle(x, dy, g, b, rm, rv):
    """NCHW forward (mean, inv_std, y, running statistics) and backward (dx, dγ, dβ) of Paddle's CPU kernel."""
    n_, c_, hw = x.shape
    r = f32(n_ * hw)
    mean, var, inv = (np.zeros(c_, f32) for _ in range(3))
    for c in range(c_):
        for n in range(n_):  # x.col(nc).sum(): packets from the first 32-byte aligned value
            mean[c] = f32(mean[c] + eigen_sum(x[n, c], (-((n * c_ + c) * hw)) % 8))
        mean[c] = f32(mean[c] / r)
        for n in range(n_):  # (x.col(nc) - mean).squaredNorm(): an expression, packets from its first value
            d = x[n, c] - mean[c]
            var[c] = f32(var[c] + eigen_sum(d * d, 0))
        var[c] = f32(var[c] / r)
        rec = f32(f32(1) / f32(var[c] + f32(EPS)))  # (var + eps).inverse().sqrt(): packets of 8 channels fast
        inv[c] = eigen_fast_sqrt(rec) if c < c_ // 8 * 8 else f32(np.sqrt(rec))
    col = lambda v: v[None, :, None]  # noqa: E731
    y = x * col(inv * g) + col(b - mean * inv * g)
    keep = f32(1 - M)
    w = f32(1.0 - float(keep))
    out = {"mean": mean, "invstd": inv, "y": y, "running_mean": rm * keep + mean * w,
           "running_var": rv * keep + var * w}
    sdy, dot = np.zeros(c_, f32), np.zeros(c_, f32)
    for c in range(c_):
        for n in range(n_):
            sdy[c] = f32(sdy[c] + eigen_sum(dy[n, c], (-((n * c_ + c) * hw)) % 8))
            dot[c] = f32(dot[c] + eigen_sum((x[n, c] - mean[c]) * inv[c] * dy[n, c], 0))
    s = g * inv / r
    out["dx"] = col(s) * (dy * f32(n_) * f32(hw) - col(sdy) - (x - col(mean)) * col(dot) * col(inv))
    out["dgamma"], out["dbeta"] = dot, sdy
    return out


def omp_simd_sum(rows, lanes: int) -> f32:
    s = f32(0)
    for v in rows:
        lane = np.zeros(lanes, f32)
        whole = len(v) // lanes * lanes
        for i in range(0, whole, lanes):
            lane = lane + v[i:i + lanes]
        for a in v[whole:]:
            lane[0] = f32(lane[0] + a)
        for a in lane:
            s = f32(s + a)
    return s


def replay_mindspore(x, dy, g, b, rm, rv):
    """oneDNN ncsp forward (4-lane omp-simd sums) with MindSpore's running update, and the ncsp backward (its sums
    not vectorised: 1 lane)."""
    n_, c_, hw = x.shape
    r = f32(n_ * hw)
    mean = np.array([omp_simd_sum(x[:, c], 4) for c in range(c_)], f32) / r
    var = np.array([omp_simd_sum([(v - mean[c]) * (v - mean[c]) for v in x[:, c]], 4) for c in range(c_)], f32) / r
    col = lambda v: v[None, :, None]  # noqa: E731
    sm = g / np.sqrt(var + f32(EPS))
    y = col(sm) * (x - col(mean)) + col(b)
    m = f32(M)
    unbiased = var * f32((n_ * hw) / (n_ * hw - 1))
    out = {"mean": mean, "var": var, "y": y, "running_mean": rm * (f32(1) - m) + mean * m,
           "running_var": rv * (f32(1) - m) + unbiased * m}
    inv = f32(1) / np.sqrt(var + f32(EPS))
    dg = np.array([omp_simd_sum([(x[n, c] - mean[c]) * dy[n, c] for n in range(n_)], 1) for c in range(c_)], f32)
    db = np.array([omp_simd_sum(dy[:, c], 1) for c in range(c_)], f32)
    dg = dg * inv
    out["dx"] = (dy - (col(db / r) + (x - col(mean)) * col(dg) * col(inv) / r)) * col(g * inv)
    out["dgamma"], out["dbeta"] = dg, db
    return out


def _inputs(seed: int, shape: tuple[int, ...]):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.normal(0, 30, c)[None, :, None] + rng.standard_normal(shape) * 2.0 ** rng.uniform(-3, 3, shape))
    dy = rng.standard_normal(shape) + rng.normal(0, 1, c)[None, :, None]
    vec = [rng.uniform(0.3, 3, c), rng.normal(0, 1, c), rng.normal(0, 1, c), rng.uniform(0.5, 2, c)]
    return [a.astype(f32) for a in (x, dy, *vec)]


SHAPES = [(3, 10, 77), (2, 9, 64), (4, 3, 21), (2, 17, 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel", ["paddle", "mindspore"])
def test_recipe_replays_the_framework_s_loops(kernel: str, shape: tuple[int, ...]) -> None:
    x, dy, g, b, rm, rv = _inputs(shape[2], shape)
    want = (replay_paddle if kernel == "paddle" else replay_mindspore)(x, dy, g, b, rm, rv)
    pol = get_policy(PADDLE if kernel == "paddle" else MINDSPORE)
    x4, dy4 = x[:, :, None, :].astype(np.float64), dy[:, :, None, :].astype(np.float64)
    t = forward_train(x4, g, b, rm, rv, momentum=M, eps=EPS, policy=pol)
    got = {"mean": t.mean, "y": t.y[:, :, 0, :], "running_mean": t.running_mean, "running_var": t.running_var,
           "invstd" if kernel == "paddle" else "var": t.invstd if kernel == "paddle" else t.var}
    bw = backward(dy4, x4, g, t.mean, t.invstd, policy=pol, saved_var=t.var, eps=EPS)
    got.update(dx=bw.dx[:, :, 0, :], dgamma=bw.dgamma, dbeta=bw.dbeta)
    for k, v in got.items():
        assert np.array_equal(np.asarray(v, dtype=np.float64), want[k].astype(np.float64)), k


def test_each_framework_field_shows_on_these_inputs() -> None:
    """(the guard: without the order, the fast sqrt or the formulas, the replays are missed)"""
    x, dy, g, b, rm, rv = _inputs(1, (3, 10, 77))
    want = replay_paddle(x, dy, g, b, rm, rv)
    x4 = x[:, :, None, :].astype(np.float64)
    for drop in ("order=eigen,", "sqrt=eigen_fast,", "y_formula=affine_mr,", "running_momentum=keep,"):
        t = forward_train(x4, g, b, rm, rv, momentum=M, eps=EPS, policy=PADDLE.replace(drop, ""))
        assert not all(np.array_equal(a, w) for a, w in ((t.mean, want["mean"]), (t.invstd, want["invstd"]),
                                                         (t.y[:, :, 0, :], want["y"]),
                                                         (t.running_mean, want["running_mean"]))), drop

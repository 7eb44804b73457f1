"""LayerNorm, RMSNorm, GroupNorm and InstanceNorm kernels (bnprobe.kernels.norms), each against something
independent: the FP64 golden against torch's float64 functions and autograd; the fp32, fp16 and bf16 emulations
against a plain-Python replay of the same formulas, one numpy scalar operation at a time in the order the policy
names, with 1/√ correctly rounded by exact rational comparison."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.batchnorm import forward_train
from bnprobe.kernels.norms import NormShape, backward, forward

torch = pytest.importorskip("torch")
F = torch.nn.functional

STORAGE = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _torch_of(norm: str, sh: NormShape, eps: float):  # noqa: ANN202
    if norm == "layer":
        return lambda x, g, b: F.layer_norm(x, sh.normalized, g, b, eps)
    if norm == "rms":
        return lambda x, g, b: F.rms_norm(x, sh.normalized, g, eps)
    if norm == "group":
        return lambda x, g, b: F.group_norm(x, sh.groups, g, b, eps)
    return lambda x, g, b: F.instance_norm(x, weight=g, bias=b, eps=eps)


CASES = [("layer", (4, 9, 16), {}), ("layer", (2, 3, 4, 5), {"normalized_shape": (4, 5)}),
         ("rms", (3, 7, 32), {}), ("rms", (5, 6), {"normalized_shape": 6}),
         ("group", (2, 6, 4, 5), {"groups": 3}), ("group", (3, 8, 7), {"groups": 1}),
         ("group", (2, 4, 3, 3), {"groups": 4}), ("instance", (2, 5, 6, 7), {}), ("instance", (3, 4, 9), {})]


@pytest.mark.parametrize("norm,shape,kw", CASES, ids=lambda v: str(v))
def test_the_golden_is_torch_float64(norm, shape, kw) -> None:  # noqa: ANN001
    rng = np.random.default_rng(len(shape) * 7 + sum(shape))
    sh = NormShape.of(norm, shape, **kw)
    x = rng.standard_normal(shape) * rng.uniform(0.1, 10) + rng.normal(0, 5)
    g = rng.uniform(0.3, 3, sh.param_shape)
    b = None if norm == "rms" else rng.normal(0, 1, sh.param_shape)
    dy = rng.standard_normal(shape)
    f = forward(x, g, b, shape=sh, eps=1e-5, policy="fp64")
    grads = backward(dy, x, g, f.mean, f.rstd, shape=sh, policy="fp64")
    xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    yt = _torch_of(norm, sh, 1e-5)(xt, gt, bt)
    yt.backward(torch.tensor(dy))
    scale = np.abs(yt.detach().numpy()).max()
    np.testing.assert_allclose(f.y, yt.detach().numpy(), rtol=0, atol=1e-13 * scale)
    np.testing.assert_allclose(grads.dx, xt.grad.numpy(), rtol=1e-11, atol=1e-12 * np.abs(xt.grad.numpy()).max())
    np.testing.assert_allclose(grads.dgamma, gt.grad.numpy(), rtol=1e-11, atol=1e-12)
    if b is not None:
        np.testing.assert_allclose(grads.dbeta, bt.grad.numpy(), rtol=1e-11, atol=1e-12)
    else:
        assert grads.dbeta is None
    # the statistics saved are torch's own (its native functions return them)
    if norm == "layer":
        _, mean, rstd = torch.native_layer_norm(torch.tensor(x), list(sh.normalized), torch.tensor(g),
                                                torch.tensor(b), 1e-5)
        np.testing.assert_allclose(f.mean, mean.numpy().reshape(-1), rtol=1e-14)
        np.testing.assert_allclose(f.rstd, rstd.numpy().reshape(-1), rtol=1e-13)
    if norm == "group":
        _, mean, rstd = torch.native_group_norm(torch.tensor(x), torch.tensor(g), torch.tensor(b), shape[0],
                                                shape[1], math.prod(shape[2:]), sh.groups, 1e-5)
        np.testing.assert_allclose(f.mean, mean.numpy().reshape(-1), rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(f.rstd, rstd.numpy().reshape(-1), rtol=1e-13)


def test_gemma_offset_applies_one_plus_w() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16))
    w = rng.normal(0, 0.1, 16)
    sh = NormShape.of("rms", x.shape)
    dy = rng.standard_normal(x.shape)
    f = forward(x, w, shape=sh, eps=1e-6, policy="fp64", weight_offset=1.0)
    grads = backward(dy, x, w, None, f.rstd, shape=sh, policy="fp64", weight_offset=1.0)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt = F.rms_norm(xt, (16,), 1.0 + wt, 1e-6)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(f.y, yt.detach().numpy(), atol=1e-14)
    np.testing.assert_allclose(grads.dgamma, wt.grad.numpy(), atol=1e-13)
    np.testing.assert_allclose(grads.dx, xt.grad.numpy(), atol=1e-13)


# ---- the emulations against a plain-Python replay -----------------------------------------------------------------

def _rsqrt32(v: np.float32) -> np.float32:
    """1/√v correctly rounded to fp32: the nearer of two neighbours, decided by exact rational comparison."""
    q = np.float32(1.0 / math.sqrt(float(v)))
    cands = [np.nextafter(q, np.float32(0)), q, np.nextafter(q, np.float32(np.inf))]
    t2 = 1 / Fraction(float(v))  # (1/√v)² exactly

    def dist_sq_sign(a: np.float32, b: np.float32) -> bool:  # whether a is nearer 1/√v than b (a < b)
        m = (Fraction(float(a)) + Fraction(float(b))) / 2
        return m * m > t2  # the target lies below the midpoint: a is nearer

    best = cands[0]
    for c in cands[1:]:
        if not dist_sq_sign(best, c):
            best = c
    return np.float32(best)


def _replay_forward(norm: str, x: np.ndarray, g: np.ndarray, b: np.ndarray | None, sh: NormShape, eps: float,
                    storage: type, y_formula: str, cast_point: str) -> tuple[np.ndarray, np.ndarray]:
    """y and rstd by hand: fp32 arithmetic on numpy float32 scalars, sums left to right, two-pass variance, 1/R by
    division, ε rounded to fp32 and added, 1/√ correctly rounded, y by the named formula with two roundings per
    multiply-add, cast once to storage (or x̂ first, before γ)."""
    f32 = np.float32
    rows = x.astype(storage).astype(np.float64).reshape(sh.rows, sh.r)
    ge, be = sh.expand(g), None if b is None else sh.expand(b)
    y = np.empty(rows.shape)
    rstds = []
    for i, row in enumerate(rows):
        xs = [f32(v) for v in row]
        n = f32(sh.r)
        if norm == "rms":
            s = f32(0)
            for v in xs:
                s = f32(s + f32(v * v))
            mean, var = f32(0), f32(s / n)
        else:
            s = f32(0)
            for v in xs:
                s = f32(s + v)
            mean = f32(s / n)
            q = f32(0)
            for v in xs:
                d = f32(v - mean)
                q = f32(q + f32(d * d))
            var = f32(q / n)
        rstd = _rsqrt32(f32(var + f32(eps)))
        rstds.append(rstd)
        for j, v in enumerate(xs):
            gj, bj = f32(ge[i, j]), None if be is None else f32(be[i, j])
            if y_formula == "xhat":
                c = v if norm == "rms" else f32(v - mean)
                h = f32(c * rstd)
                if cast_point == "before_gamma":
                    h = f32(storage(h))
                out = f32(h * gj) if bj is None else f32(f32(h * gj) + bj)
            elif y_formula == "scale":
                c = v if norm == "rms" else f32(v - mean)
                w = f32(gj * rstd)
                out = f32(c * w) if bj is None else f32(f32(c * w) + bj)
            elif norm in ("layer", "rms"):
                shift = f32(-(mean * rstd))
                a = f32(f32(v * rstd) + shift) if norm != "rms" else f32(v * rstd)
                out = f32(a * gj) if bj is None else f32(f32(a * gj) + bj)
            else:
                m = f32(gj * rstd)
                addend = f32(bj - f32(m * mean))
                out = f32(f32(v * m) + addend)
            y[i, j] = float(storage(out))
    return y.reshape(sh.shape), np.array(rstds, dtype=np.float64)


REPLAYED = [("layer", (3, 2, 24), {}), ("rms", (4, 33), {}), ("group", (2, 6, 3, 4), {"groups": 2}),
            ("instance", (2, 3, 5, 3), {})]


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("y_formula,cast_point", [("xhat", "after_gamma"), ("scale", "after_gamma"),
                                                  ("affine", "after_gamma"), ("xhat", "before_gamma")])
@pytest.mark.parametrize("norm,shape,kw", REPLAYED, ids=lambda v: str(v))
def test_the_emulation_is_the_replay_bit_for_bit(norm, shape, kw, fmt, y_formula, cast_point) -> None:  # noqa: ANN001
    rng = np.random.default_rng(sum(shape) + len(fmt))
    sh = NormShape.of(norm, shape, **kw)
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-3, 3, shape) + rng.normal(0, 3)
    g = rng.uniform(0.3, 3, sh.param_shape).astype(np.float32).astype(np.float64)
    b = None if norm == "rms" else rng.normal(0, 1, sh.param_shape).astype(np.float32).astype(np.float64)
    pol = f"{fmt}:order=sequential,variance=two_pass,y_formula={y_formula},cast_point={cast_point}"
    f = forward(x, g, b, shape=sh, eps=1e-5, policy=pol)
    want_y, want_rstd = _replay_forward(norm, x, g, b, sh, 1e-5, STORAGE[fmt], y_formula, cast_point)
    assert f.y.dtype == np.dtype(STORAGE[fmt])
    np.testing.assert_array_equal(f.y.astype(np.float64), want_y)
    np.testing.assert_array_equal(f.rstd.astype(np.float64), want_rstd)


def test_the_backward_is_the_replay_bit_for_bit() -> None:
    """LayerNorm's fp32 backward by hand: g = dy·γ, Σg and Σg·x̂ left to right, dx = ((g − Σg/R) − x̂·(Σg·x̂/R))·rstd,
    dγ = Σ dy·x̂ and dβ = Σ dy down each column."""
    f32 = np.float32
    rng = np.random.default_rng(11)
    x, dy = rng.standard_normal((5, 12)).astype(np.float32), rng.standard_normal((5, 12)).astype(np.float32)
    g = rng.uniform(0.5, 2, 12).astype(np.float32)
    sh = NormShape.of("layer", x.shape)
    pol = "fp32:order=sequential"
    f = forward(x, g, None, shape=sh, policy=pol)
    grads = backward(dy, x, g, f.mean, f.rstd, shape=sh, policy=pol)
    n = f32(12)
    dx = np.empty((5, 12), dtype=np.float32)
    xh = np.empty((5, 12), dtype=np.float32)
    for i in range(5):
        mu, r = f32(f.mean[i]), f32(f.rstd[i])
        h = [f32(f32(x[i, j] - mu) * r) for j in range(12)]
        xh[i] = h
        gg = [f32(dy[i, j] * g[j]) for j in range(12)]
        s1 = s2 = f32(0)
        for j in range(12):
            s2 = f32(s2 + f32(gg[j] * h[j]))
        for j in range(12):
            s1 = f32(s1 + gg[j])
        a, c = f32(s1 / n), f32(s2 / n)
        for j in range(12):
            dx[i, j] = f32(f32(f32(gg[j] - f32(h[j] * c)) - a) * r)
    dgam = np.empty(12, dtype=np.float32)
    dbet = np.empty(12, dtype=np.float32)
    for j in range(12):
        s1 = s2 = f32(0)
        for i in range(5):
            s1 = f32(s1 + f32(dy[i, j] * xh[i, j]))
            s2 = f32(s2 + dy[i, j])
        dgam[j], dbet[j] = s1, s2
    np.testing.assert_array_equal(grads.dx, dx)
    np.testing.assert_array_equal(grads.dgamma, dgam)
    np.testing.assert_array_equal(grads.dbeta, dbet)


# ---- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm,shape,kw,says", [
    ("layer", (3, 4), {"normalized_shape": (3,)}, "not x's trailing dimensions"),
    ("group", (2, 6, 4), {"groups": 4}, "groups must divide the 6 channels"),
    ("group", (2, 6, 4), {}, "needs its number of groups"),
    ("instance", (2, 6), {}, "takes x as (N, C, L, ...)"),
    ("rms", (2, 6), {"groups": 2}, "groups apply to GroupNorm"),
    ("group", (2, 6), {"groups": 2, "normalized_shape": (6,)}, "normalized_shape applies to LayerNorm"),
    ("batch", (2, 6), {}, "norm must be one of"),
])
def test_a_shape_that_does_not_fit_is_refused_in_one_line(norm, shape, kw, says) -> None:  # noqa: ANN001
    with pytest.raises(BNProbeError, match=None) as e:
        NormShape.of(norm, shape, **kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_policy_choice_of_the_other_kernel_is_refused() -> None:
    sh = NormShape.of("layer", (2, 8))
    with pytest.raises(BNProbeError, match="backward_formula=ascend is a BatchNorm kernel's choice"):
        forward(np.ones((2, 8)), shape=sh, policy="fp16:backward_formula=ascend")
    with pytest.raises(BNProbeError, match="thread_split='samples' is a BatchNorm kernel's choice"):
        forward(np.ones((2, 8)), shape=sh, policy="fp16:threads=2,order=sequential,thread_split=samples")
    with pytest.raises(BNProbeError, match="cast_point=before_gamma is a LayerNorm/RMSNorm/GroupNorm/InstanceNorm"):
        forward_train(np.ones((2, 3, 4)), policy="fp16:cast_point=before_gamma")


def test_the_trace_holds_every_stage() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 16))
    sh = NormShape.of("rms", x.shape)
    f = forward(x, rng.uniform(0.5, 2, 16), shape=sh, policy="bf16:cast_point=before_gamma", weight_offset=1.0)
    # (bf16 values are fp32 ones: the casts to the accumulator and compute formats round nothing and are not stages)
    assert [s.name for s in f.trace.stages] == ["x", "squares", "sum_squares", "mean_square", "var_eps", "rstd",
                                                "xhat", "xhat_stored", "affine", "y"]
    assert [s.name for s in f.param_trace.stages] == ["gamma_offset"]
    assert f.mean is None and f.rstd.shape == (3,)

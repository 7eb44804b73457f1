"""The policy fields doctor's family defect models are made of (bnprobe.kernels.norms: eps_format, rstd_cast,
grad_sum_format with and without threads), each against a plain-numpy replay written from the defect's description,
one float32/float16/bfloat16 scalar operation at a time; and each left at its default changes nothing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from bnprobe.kernels.norms import NormShape, backward, forward
from tests.kernels.test_norms import _replay_forward, _rsqrt32

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
NARROW = {"fp16": F16, "bf16": BF16}


@pytest.mark.parametrize("norm,shape,kw", [("rms", (4, 33), {}), ("layer", (3, 2, 24), {}),
                                           ("group", (2, 6, 3, 4), {"groups": 2})], ids=str)
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_eps_format_adds_eps_as_rounded_to_that_format(norm, shape, kw, fmt) -> None:  # noqa: ANN001
    """pytorch/pytorch#140092: ε cast to x's dtype, then added in fp32 — the replay with ε = fp32(fmt(1e-5))."""
    rng = np.random.default_rng(len(shape) + len(fmt))
    sh = NormShape.of(norm, shape, **kw)
    x = rng.standard_normal(shape) * 3e-3  # mean square near ε, where ε's rounding shows
    g = rng.uniform(0.5, 2, sh.param_shape).astype(F32).astype(np.float64)
    b = None if norm == "rms" else rng.normal(0, 1, sh.param_shape).astype(F32).astype(np.float64)
    eps = float(NARROW[fmt](1e-5))
    assert eps != float(F32(1e-5))  # (the case tells the two apart)
    f = forward(x, g, b, shape=sh, eps=1e-5, policy=f"{fmt}:order=sequential,eps_format={fmt}")
    want_y, want_rstd = _replay_forward(norm, x, g, b, sh, eps, NARROW[fmt], "xhat", "after_gamma")
    np.testing.assert_array_equal(f.rstd.astype(np.float64), want_rstd)
    np.testing.assert_array_equal(f.y.astype(np.float64), want_y)
    plain = forward(x, g, b, shape=sh, eps=1e-5, policy=f"{fmt}:order=sequential")
    assert not np.array_equal(plain.rstd, f.rstd)


def test_rstd_cast_multiplies_by_rstd_rounded_to_bf16() -> None:
    """amd/IRON#139: RMSNorm's inv_rms cast to bf16 before x·inv_rms (fp32 arithmetic otherwise), y cast once."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 40))
    g = rng.uniform(0.5, 2, 40).astype(F32)
    sh = NormShape.of("rms", x.shape)
    f = forward(x, g.astype(np.float64), shape=sh, eps=1e-5, policy="bf16:order=sequential,rstd_cast=bf16")
    want = np.empty(x.shape)
    for i, row in enumerate(x.astype(BF16).astype(F32)):
        s = F32(0)
        for v in row:
            s = F32(s + F32(v * v))
        rstd = _rsqrt32(F32(F32(s / F32(40)) + F32(1e-5)))
        assert f.rstd[i] == rstd  # (the saved rstd is the one computed)
        r16 = F32(BF16(rstd))
        for j, v in enumerate(row):
            want[i, j] = float(BF16(F32(F32(v * r16) * g[j])))
    np.testing.assert_array_equal(f.y.astype(np.float64), want)


def _terms(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, rstd: np.ndarray) -> np.ndarray:
    """dy·x̂ per element in fp32, x̂ = (x − μ)·rstd."""
    xh = ((x - mean[:, None].astype(F32)).astype(F32) * rstd[:, None].astype(F32)).astype(F32)
    return (dy * xh).astype(F32)


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_grad_sum_format_with_threads_is_per_thread_buffers(fmt, threads) -> None:  # noqa: ANN001
    """PyTorch CPU LayerNorm's dγ and dβ: ⌈M/T⌉ contiguous rows per thread, each thread's buffer of x's dtype
    updated row by row as fp32(buffer) + term then cast back, the buffers added in fp32 in thread order."""
    rng = np.random.default_rng(threads)
    m, d = 21, 16
    dt = NARROW[fmt]
    x = rng.standard_normal((m, d)).astype(dt).astype(F32)
    dy = (rng.standard_normal((m, d)) + 1).astype(dt).astype(F32)
    sh = NormShape.of("layer", x.shape)
    pol = f"{fmt}:grad_sum_format={fmt},order=sequential,threads={threads}"
    f = forward(x, shape=sh, policy=pol)
    gr = backward(dy, x, np.ones(d), f.mean, f.rstd, shape=sh, policy=pol)
    for got, terms in ((gr.dgamma, _terms(x, dy, f.mean, f.rstd)), (gr.dbeta, dy)):
        k = -(-m // min(threads, m))
        total = np.zeros(d, F32)
        for s in range(0, m, k):
            buf = np.zeros(d, dt)
            for i in range(s, min(m, s + k)):
                buf = (buf.astype(F32) + terms[i]).astype(dt)
            total = (total + buf.astype(F32)).astype(F32)
        np.testing.assert_array_equal(got, total)


def test_grad_sum_format_without_threads_rounds_each_term_and_sums_pairwise_in_it() -> None:
    """Liger-Kernel#950: dγ's products rounded to bf16 and reduced in bf16 (the pairwise tree: the top rows folded
    onto the first when the count is not a power of two, then halves added)."""
    rng = np.random.default_rng(5)
    m, d = 13, 8
    x = rng.standard_normal((m, d)).astype(BF16).astype(F32)
    dy = rng.standard_normal((m, d)).astype(BF16).astype(F32)
    sh = NormShape.of("rms", x.shape)
    pol = "bf16:grad_sum_format=bf16"
    f = forward(x, shape=sh, policy=pol)
    gr = backward(dy, x, np.ones(d), None, f.rstd, shape=sh, policy=pol)
    a = _terms(x, dy, np.zeros(m), f.rstd).astype(BF16)
    p = 1 << (m.bit_length() - 1)
    a = np.concatenate([(a[: m - p].astype(F32) + a[p:].astype(F32)).astype(BF16), a[m - p: p]])
    while len(a) > 1:
        h = len(a) // 2
        a = (a[:h].astype(F32) + a[h:].astype(F32)).astype(BF16)
    np.testing.assert_array_equal(gr.dgamma, a[0].astype(F32))


def test_the_new_fields_at_their_defaults_change_nothing() -> None:
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((6, 20)), rng.standard_normal((6, 20))
    sh = NormShape.of("layer", x.shape)
    base = "fp16"
    same = "fp16:eps_format=none,rstd_cast=none,grad_sum_format=none,threads=none"
    f0, f1 = forward(x, shape=sh, policy=base), forward(x, shape=sh, policy=same)
    np.testing.assert_array_equal(f0.y, f1.y)
    g0 = backward(dy, x, None, f0.mean, f0.rstd, shape=sh, policy=base)
    g1 = backward(dy, x, None, f1.mean, f1.rstd, shape=sh, policy=same)
    for a, b in ((g0.dx, g1.dx), (g0.dgamma, g1.dgamma), (g0.dbeta, g1.dbeta)):
        np.testing.assert_array_equal(a, b)

"""torch 2.13's eager CPU LayerNorm, RMSNorm and GroupNorm reproduced bit for bit by their recipes (policies of
bnprobe.kernels.norms): y, the saved mean and rstd, dx, dγ and dβ against torch's own ops, in fp32, fp16 and bf16
with fp32 parameters and with parameters in the input's format, on rows of every length the kernels branch on
(shorter than a vector, whole vectors and not, one RowwiseMoments chunk and several, long rows), and on 1 to 4
threads where the numbers depend on them (LayerNorm's dγ/dβ buffers, ATen's split of one long row).  Each choice of
a recipe is then shown to matter: changed alone, it misses torch somewhere (so these tests can fail).

The recipes were read from torch's sources (the shipped headers ATen/native/cpu/moments_utils.h and
ATen/cpu/vec/functional*.h; layer_norm_kernel.cpp, group_norm_kernel.cpp, SumKernel.cpp, layer_norm.cpp's
rms_norm_composite) and their contractions (which a + b·c GCC fused) measured on torch's outputs; torch dispatches
these kernels to its AVX2 build on an AVX-512 machine: 8 float lanes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from bnprobe.kernels.norms import NormShape, backward, forward

torch = pytest.importorskip("torch")

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = [("fp32", "fp32"), ("fp16", "fp32"), ("bf16", "fp32"), ("fp16", "same"), ("bf16", "same")]


def recipe(norm: str, fmt: str, params: str, threads: int) -> str:
    """torch 2.13's eager CPU kernel of ``norm`` on ``fmt`` input with ``params`` parameters, as a policy spec."""
    spec = [f"params={fmt}"] if params == "same" else []
    if norm == "layer":
        spec += ["variance=rowwise", "lanes=8", f"y_formula={'xhat' if fmt == 'fp32' else 'affine'}", "fma=true",
                 "rsqrt=sqrt_div", "backward_formula=torch", f"threads={threads}", f"grad_sum_format={fmt}"]
        spec += ["variance_fma=true"] if fmt == "fp16" else []
    elif norm == "group":
        spec += ["variance=rowwise", "lanes=8", "clamp_var=true", "y_formula=affine", "fma=true", "rsqrt=sqrt_div",
                 "rstd_format=fp64", "backward_formula=torch", f"threads={threads}"]
        spec += ["variance_fma=true"] if fmt == "fp16" else ["dx_fuses=dy"]
    else:
        spec += ["order=aten", "lanes=8", "rsqrt=sqrt_div", "saved_format=fp32", "backward_formula=torch",
                 f"threads={threads}"]
    return f"{fmt}:" + ",".join(spec)


def torch_run(norm: str, sh: NormShape, x, g, b, dy, eps: float):  # noqa: ANN001, ANN201
    """torch's outputs: y, mean (None for RMSNorm), rstd, dx, dγ, dβ (None for RMSNorm)."""
    ops = torch.ops.aten
    if norm == "layer":
        y, mean, rstd = ops.native_layer_norm(x, list(sh.normalized), g, b, eps)
        dx, dg, db = ops.native_layer_norm_backward(dy, x, list(sh.normalized), mean, rstd, g, b, [True] * 3)
        return y, mean, rstd, dx, dg, db
    if norm == "group":
        n, c = sh.shape[0], sh.shape[1]
        hw = sh.r * sh.groups // c
        y, mean, rstd = ops.native_group_norm(x, g, b, n, c, hw, sh.groups, eps)
        dx, dg, db = ops.native_group_norm_backward(dy, x, mean, rstd, g, n, c, hw, sh.groups, [True] * 3)
        return y, mean, rstd, dx, dg, db
    xg, gg = x.clone().requires_grad_(True), g.clone().requires_grad_(True)
    with warnings.catch_warnings():  # (mixed dtypes take the composite: torch warns once)
        warnings.simplefilter("ignore", UserWarning)
        y = torch.rms_norm(xg, list(sh.normalized), gg, eps)
    dx, dg = torch.autograd.grad(y, (xg, gg), dy)
    dims = tuple(range(x.ndim - len(sh.normalized), x.ndim))
    xo = x.float() if x.dtype != torch.float32 else x
    rstd = torch.rsqrt(xo.pow(2).mean(dims, keepdim=True) + eps)  # rms_norm_composite's, which autograd saves
    return y.detach(), None, rstd, dx, dg, None


def inputs(norm: str, shape: tuple[int, ...], fmt: str, params: str, seed: int, kw: dict):  # noqa: ANN201
    rng = np.random.default_rng(seed)
    sh = NormShape.of(norm, shape, **kw)
    dt = TORCH_DTYPES[fmt]
    pdt = torch.float32 if params == "fp32" else dt
    scale, shift = rng.choice([0.01, 1.0, 30.0]), rng.choice([0.0, 1.0, 100.0])
    x = torch.from_numpy(rng.standard_normal(shape) * scale + shift).to(dt)
    g = torch.from_numpy(rng.uniform(0.5, 2, sh.param_shape)).to(pdt)
    b = None if norm == "rms" else torch.from_numpy(rng.normal(0, 1, sh.param_shape)).to(pdt)
    dy = torch.from_numpy(rng.standard_normal(shape)).to(dt)
    return sh, x, g, b, dy


def mismatches(norm: str, shape: tuple[int, ...], fmt: str, params: str, threads: int, spec: str, seed: int = 0,
               **kw: int) -> dict[str, int]:
    """How many values of each output the policy ``spec`` gets wrong against torch on ``threads`` threads."""
    sh, x, g, b, dy = inputs(norm, shape, fmt, params, seed, kw)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = torch_run(norm, sh, x, g, b, dy, 1e-5)
    finally:
        torch.set_num_threads(before)

    def arr(t):  # noqa: ANN001, ANN202
        return t.float().numpy().astype(np.float64)

    f = forward(arr(x), arr(g), None if b is None else arr(b), shape=sh, eps=1e-5, policy=spec, keep_arrays=False)
    grads = backward(arr(dy), arr(x), arr(g), f.mean, f.rstd, shape=sh, policy=spec, keep_arrays=False)
    got = (f.y, f.mean, f.rstd, grads.dx, grads.dgamma, grads.dbeta)
    out = {}
    for name, mine, theirs in zip(("y", "mean", "rstd", "dx", "dgamma", "dbeta"), got, want):
        assert (mine is None) == (theirs is None), name
        if theirs is not None:
            out[name] = int(np.sum(np.asarray(mine, dtype=np.float64).reshape(-1) != arr(theirs).reshape(-1)))
    return out


# rows of every length the kernels branch on: R < 8 lanes, < 16 (a 16-bit vector), whole vectors and not, one
# RowwiseMoments chunk (16 vectors) and several, a cascade of more levels, long rows
LAYER_SHAPES = [(9, 1), (5, 3), (7, 8), (4, 13), (6, 16), (3, 37), (4, 2, 64), (3, 300), (2, 1031), (1, 4099),
                (2, 3, 5)]
RMS_SHAPES = [(37, 1), (5, 3), (7, 8), (9, 13), (3, 37), (4, 2, 64), (3, 300), (2, 1031), (1, 4099), (40, 7)]
GROUP_SHAPES = [((2, 6, 5), 3), ((3, 6, 5, 7), 3), ((2, 16, 33), 2), ((4, 12, 19), 4), ((2, 40, 3), 2),
                ((2, 8, 1), 8), ((1, 4, 300), 1), ((3, 30, 11), 3), ((6, 18, 20), 3), ((1, 13, 30), 1),
                ((2, 54, 6), 2)]


def _case_id(v: object) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("fmt,params", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=_case_id)
def test_layer_norm_is_reproduced(shape: tuple[int, ...], fmt: str, params: str) -> None:
    normalized = shape[1:] if len(shape) == 3 and shape[1] == 3 else shape[-1:]
    for threads in (1, 2, 3):
        got = mismatches("layer", shape, fmt, params, threads, recipe("layer", fmt, params, threads),
                         seed=sum(shape) + threads, normalized_shape=normalized)
        assert not any(got.values()), (threads, got)


@pytest.mark.parametrize("fmt,params", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=_case_id)
def test_rms_norm_is_reproduced(shape: tuple[int, ...], fmt: str, params: str) -> None:
    got = mismatches("rms", shape, fmt, params, 2, recipe("rms", fmt, params, 2), seed=sum(shape))
    assert not any(got.values()), got


@pytest.mark.parametrize("fmt,params", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape,groups", GROUP_SHAPES, ids=_case_id)
def test_group_norm_is_reproduced(shape: tuple[int, ...], groups: int, fmt: str, params: str) -> None:
    for threads in (1, 2):
        got = mismatches("group", shape, fmt, params, threads, recipe("group", fmt, params, threads),
                         seed=sum(shape) + threads, groups=groups)
        assert not any(got.values()), (threads, got)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_one_long_rms_row_is_split_as_torch_splits_it(fmt: str, threads: int) -> None:
    """ATen sums a single row of at least 32768 values in per-thread parts (its two-pass reduction)."""
    got = mismatches("rms", (1, 70001), fmt, "fp32", threads, recipe("rms", fmt, "fp32", threads), seed=threads)
    assert not any(got.values()), got


# Each choice of a recipe, changed alone, and a call whose outputs show it (many values and a large mean, so that
# 16-bit roundings and cancellations expose one-ulp differences in the float intermediates)
CHOICES = [
    ("layer", "fp32", "fp32", "lanes=16", (40, 300), {}),
    ("layer", "fp32", "fp32", "y_formula=affine", (40, 300), {}),
    ("layer", "fp32", "fp32", "fma=false", (40, 300), {}),
    ("layer", "fp32", "fp32", "threads=1", (40, 300), {}),
    ("layer", "fp32", "fp32", "dx_fuses=dy", (40, 300), {}),
    ("layer", "bf16", "fp32", "grad_sum_format=fp32", (40, 300), {}),
    ("layer", "fp16", "fp32", "y_formula=xhat", (100, 1000), {}),
    ("layer", "fp16", "fp32", "variance_fma=false", (400, 13), {}),
    ("layer", "fp16", "same", "lanes=16", (300, 37), {}),
    ("rms", "fp32", "fp32", "order=sequential", (40, 300), {}),
    ("rms", "fp32", "fp32", "lanes=16", (40, 300), {}),
    ("rms", "bf16", "fp32", "saved_format=bf16", (40, 300), {}),
    ("group", "fp32", "fp32", "rstd_format=none", (60, 32, 7), {"groups": 4}),
    ("group", "fp32", "fp32", "dx_fuses=x", (30, 48, 37), {"groups": 2}),
    ("group", "fp16", "fp32", "dx_fuses=dy", (30, 48, 37), {"groups": 2}),
    ("group", "fp16", "fp32", "variance_fma=false", (300, 4, 3), {"groups": 1}),
    ("group", "fp32", "fp32", "y_formula=xhat", (30, 48, 37), {"groups": 2}),
    ("group", "fp32", "fp32", "threads=1", (30, 18, 20), {"groups": 3}),
]


@pytest.mark.parametrize("norm,fmt,params,change,shape,kw", CHOICES, ids=lambda v: _case_id(v) if v else "")
def test_each_choice_of_a_recipe_shows_in_torch_s_outputs(norm: str, fmt: str, params: str, change: str,
                                                          shape: tuple[int, ...], kw: dict) -> None:
    spec = recipe(norm, fmt, params, 2)
    key = change.split("=")[0]
    parts = [p for p in spec.split(":", 1)[1].split(",") if p.split("=")[0] != key]
    changed = spec.split(":", 1)[0] + ":" + ",".join(parts + [change])
    for seed in range(3):
        if any(mismatches(norm, shape, fmt, params, 2, changed, seed=seed, **kw).values()):
            return
    pytest.fail(f"{change} reproduced torch's {norm} {fmt} as well as the recipe does")

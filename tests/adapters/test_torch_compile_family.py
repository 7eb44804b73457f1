"""The torch-compile adapter's LayerNorm, RMSNorm and GroupNorm against torch.compile run here on F.layer_norm,
F.rms_norm and F.group_norm (y, and dx, dγ, dβ by autograd through the compiled forward), and the family recipes
against the adapter's compiled kernels bit for bit.  Each compiles: slow."""

import warnings

import numpy as np
import pytest

from bnprobe.adapters.registry import get_adapter
from bnprobe.core.call import BNCall
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.norms import backward, forward
from bnprobe.numerics.rounding import round_to

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")]
TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = {"layer": (12, 37), "rms": (9, 300), "group": (3, 6, 13)}


def _call(norm, fmt, seed=0):
    rng = np.random.default_rng(seed)
    shape = SHAPES[norm]
    ps = shape[1:2] if norm == "group" else shape[-1:]
    return BNCall(rng.standard_normal(shape) * 2 + 3, gamma=rng.uniform(0.3, 3, ps),
                  beta=None if norm == "rms" else rng.normal(0, 1, ps), dy=rng.standard_normal(shape) + 0.5,
                  dtype=fmt, params="fp32", norm=norm, groups=2 if norm == "group" else None)


def _compiled_here(call):
    """y, dx, dγ, dβ of torch.compile(F.<layer>) run here, backward by autograd."""
    t = lambda a, fmt: torch.tensor(round_to(np.asarray(a, dtype=np.float64), fmt)).to(TORCH[fmt])  # noqa: E731
    x = t(call.x, call.dtype).requires_grad_(True)
    w = t(call.gamma, "fp32").requires_grad_(True)
    b = None if call.beta is None else t(call.beta, "fp32").requires_grad_(True)
    n = list(np.shape(call.x)[-1:])
    fn = {"layer": lambda x, w, b: torch.nn.functional.layer_norm(x, n, w, b, call.eps),
          "rms": lambda x, w, b: torch.nn.functional.rms_norm(x, n, w, call.eps),
          "group": lambda x, w, b: torch.nn.functional.group_norm(x, call.groups, w, b, call.eps)}[call.norm]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = torch.compile(fn, fullgraph=True, dynamic=False)(x, w, b)
        grads = torch.autograd.grad(y, [v for v in (x, w, b) if v is not None], t(call.dy, call.dtype))
    return [y.detach().double().numpy()] + [g.double().numpy() for g in grads]


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("norm", ["layer", "rms", "group"])
def test_the_adapter_is_torch_compile_of_the_functional(norm, fmt):
    call = _call(norm, fmt)
    a = get_adapter("torch-compile")
    f = a.train(call)
    g = a.backward_of(call, f.saved)
    mine = [f.y, g.dx, g.dgamma] + ([] if g.dbeta is None else [g.dbeta])
    for got, want in zip(mine, _compiled_here(call)):
        assert np.array_equal(np.asarray(got, dtype=np.float64).reshape(-1), want.reshape(-1))
    assert a.compiles > 0 and a.compile_seconds > 0


RECIPE = "{fmt}:variance=inductor,order=inductor,lanes=16,unroll={u},rsqrt=sqrt_div,backward_formula=inductor," \
         "threads=2,params=fp32"


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("norm,shape", [("layer", (300, 9)), ("layer", (9, 777)), ("layer", (2, 2067)),
                                        ("layer", (1, 5)), ("layer", (1, 1100)), ("layer", (2, 40000)),
                                        ("rms", (1, 40000)), ("rms", (1, 1100)), ("rms", (64, 11)), ("rms", (5, 3))],
                         ids=["layer-300x9", "layer-9x777", "layer-2x2067", "layer-1x5", "layer-1x1100",
                              "layer-2x40000", "rms-1x40000", "rms-1x1100", "rms-64x11", "rms-5x3"])
def test_the_recipe_reproduces_the_compiled_kernel(norm, shape, fmt):
    rng = np.random.default_rng(7)
    call = BNCall(rng.standard_normal(shape) * 0.3 + 100.0, gamma=rng.uniform(0.3, 3, shape[-1:]),
                  beta=None if norm == "rms" else rng.normal(0, 1, shape[-1:]), dy=rng.standard_normal(shape) + 1,
                  dtype=fmt, params="fp32", norm=norm)
    a = get_adapter("torch-compile")
    f = a.train(call)
    g = a.backward_of(call, f.saved)
    pol = RECIPE.format(fmt=fmt, u=1 if fmt == "fp32" else 2)
    if norm == "rms":
        pol = pol.replace("variance=inductor,", "")
    elif fmt != "fp32":
        pol += f",saved_format={fmt}"
    sh = NormShape.of(norm, shape)
    x, gm = round_to(call.x, fmt), round_to(call.gamma, "fp32")
    e = forward(x, gm, None if call.beta is None else round_to(call.beta, "fp32"), shape=sh, policy=pol)
    eb = backward(round_to(call.dy, fmt), x, gm, f.saved.mean, f.saved.value, shape=sh, policy=pol)
    same = lambda u, v: np.array_equal(np.asarray(u, np.float64).reshape(-1), np.asarray(v, np.float64).reshape(-1))  # noqa: E731
    assert same(e.y, f.y) and same(e.rstd, f.saved.value) and (e.mean is None or same(e.mean, f.saved.mean))
    assert same(eb.dx, g.dx) and same(eb.dgamma, g.dgamma) and (eb.dbeta is None or same(eb.dbeta, g.dbeta))


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape,groups", [((3, 6, 13), 2), ((9, 32, 50), 4), ((2, 40, 3), 2), ((1, 8, 5), 1),
                                          ((600, 2, 3), 1), ((1, 4, 200), 1), ((1, 4, 300), 1), ((2, 64, 20), 32)],
                         ids=["3x6x13-g2", "9x32x50-g4", "2x40x3-g2", "1x8x5-g1", "600x2x3-g1", "1x4x200-g1",
                              "1x4x300-g1", "2x64x20-g32"])
def test_the_group_recipe_reproduces_the_compiled_kernel(shape, groups, fmt):
    """Planes of 8 positions or more and of fewer (their sums recomputed where the channels are summed), groups of
    1 to 20 channels, one (sample, group) (its Welford, split across threads at 1200 values), 600 samples (dγ's and
    dβ's sums split across threads)."""
    rng = np.random.default_rng(7)
    c = shape[1]
    call = BNCall(rng.standard_normal(shape) * 0.3 + 100.0, gamma=rng.uniform(0.3, 3, (c,)),
                  beta=rng.normal(0, 1, (c,)), dy=rng.standard_normal(shape) + 1, dtype=fmt, params="fp32",
                  norm="group", groups=groups)
    a = get_adapter("torch-compile")
    f = a.train(call)
    g = a.backward_of(call, f.saved)
    pol = RECIPE.format(fmt=fmt, u=1 if fmt == "fp32" else 2) + ",y_formula=affine"
    if fmt != "fp32":
        pol += f",saved_format={fmt}"
    sh = NormShape.of("group", shape, groups=groups)
    x, gm, bt = round_to(call.x, fmt), round_to(call.gamma, "fp32"), round_to(call.beta, "fp32")
    e = forward(x, gm, bt, shape=sh, policy=pol)
    eb = backward(round_to(call.dy, fmt), x, gm, f.saved.mean, f.saved.value, shape=sh, policy=pol)
    same = lambda u, v: np.array_equal(np.asarray(u, np.float64).reshape(-1), np.asarray(v, np.float64).reshape(-1))  # noqa: E731
    assert same(e.y, f.y) and same(e.rstd, f.saved.value) and same(e.mean, f.saved.mean)
    assert same(eb.dx, g.dx) and same(eb.dgamma, g.dgamma) and same(eb.dbeta, g.dbeta)

"""flax's BatchNorm on JAX's CPU backend, bit for bit: bnprobe's recipe for it (order=xla, rsqrt=rsqrtps with XLA's
Newton steps, backward_formula=jax) against jax itself, on shapes that take each of XLA's reduction paths, in fp32,
fp16 and bf16; identify finding that recipe; and guards that the compiled program is still the one the recipe
describes (what XLA hands to YNNPACK, its windows, flax's primitives).

Needs jax and flax (the ``jax`` extra): skipped elsewhere; ``.ci/frameworks`` runs it in the jax environment."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.kernels.batchnorm import Execution, backward, forward_infer, forward_train
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import CallShape, reduce_sum
from bnprobe.numerics.rsqrt import rsqrt

if why_unavailable("jax"):
    pytest.skip(why_unavailable("jax"), allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402

jax.config.update("jax_platforms", "cpu")
f32 = np.float32
RECIPE = ("{fmt}:variance=naive,clamp_var=true,mean_by=reciprocal,order=xla,rsqrt=rsqrtps,rsqrt_newton=2,"
          "newton_form=xla,y_formula=scale,running_momentum=old,running_var=biased,backward_formula=jax")
DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
LAST = Execution(layout="channels_last", keep_arrays=False)
# one shape per path of order=xla: XLA's loop (small, tiny, an innermost extent of 5), its windows (an axis of 100;
# of 40 with windows over N too), YNNPACK's one call (2 blocks; 3 with the Kahan step), its tiles of 8 n and its
# pairs of single n
SHAPES = [(3, 7, 11, 6), (2, 8, 5, 6), (2, 1, 3, 3), (1, 1, 100, 3), (2, 3, 40, 5), (3, 7, 23, 19), (1, 31, 31, 16),
          (9, 16, 16, 16), (5, 20, 20, 100)]


def _inputs(fmt: str, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = np.asarray((rng.standard_normal(shape) * rng.uniform(0.05, 3, c) + rng.normal(0, 20, c)), dtype=DTYPES[fmt])
    dy = np.asarray(rng.standard_normal(shape) + rng.normal(0, 1, c), dtype=DTYPES[fmt])
    vec = [rng.uniform(0.3, 3, c), rng.normal(0, 1, c), rng.normal(0, 1, c), rng.uniform(0.5, 2, c)]
    return (x, dy, *(v.astype(f32) for v in vec))


def _flax(fmt: str, train: bool) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, axis=-1, momentum=0.9, epsilon=1e-5, dtype=DTYPES[fmt],
                        param_dtype=jnp.float32)


def _same(a, b) -> bool:  # noqa: ANN001
    return np.array_equal(np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64), equal_nan=True)


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_training_step_and_its_vjp_are_jax_s_bit_for_bit(fmt, shape):
    x, dy, g, b, rm, rv = _inputs(fmt, shape, sum(shape))
    bn = _flax(fmt, True)

    def step(x, g, b):  # noqa: ANN001, ANN202
        return bn.apply({"params": {"scale": g, "bias": b}, "batch_stats": {"mean": rm, "var": rv}}, x,
                        mutable=["batch_stats"])

    (y, upd), vjp = jax.vjp(step, jnp.asarray(x), jnp.asarray(g), jnp.asarray(b))
    dx, dg, db = vjp((jnp.asarray(dy), jax.tree_util.tree_map(jnp.zeros_like, upd)))
    pol = RECIPE.format(fmt=fmt)
    x64 = np.asarray(x).astype(np.float64)
    res = forward_train(x64, g, b, rm, rv, momentum=0.9, eps=1e-5, policy=pol, execution=LAST)
    bw = backward(np.asarray(dy).astype(np.float64), x64, g, res.mean, res.invstd, policy=pol, eps=1e-5,
                  execution=LAST)
    assert _same(res.y, y) and _same(res.running_mean, upd["batch_stats"]["mean"]) and \
        _same(res.running_var, upd["batch_stats"]["var"])
    assert _same(bw.dx, dx) and _same(bw.dgamma, dg) and _same(bw.dbeta, db)


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_inference_is_jax_s_bit_for_bit(fmt):
    x, _, g, b, rm, rv = _inputs(fmt, (3, 7, 23, 19), 4)
    y = _flax(fmt, False).apply({"params": {"scale": g, "bias": b}, "batch_stats": {"mean": rm, "var": rv}},
                                jnp.asarray(x))
    res = forward_infer(np.asarray(x).astype(np.float64), g, b, rm, rv, eps=1e-5, policy=RECIPE.format(fmt=fmt),
                        execution=LAST)
    assert _same(res.y, y)


def test_rsqrt_is_jax_s_on_every_binade_and_the_specials():
    rng = np.random.default_rng(0)
    v = np.concatenate([(2.0 ** rng.uniform(-126, 127, 20000)), [0.0, -0.0, 1e-40, np.inf, -1.0, np.nan]])
    v = v.astype(f32)
    assert _same(rsqrt(v.astype(np.float64), "fp32", method="rsqrtps", newton=2, form="xla"), jax.lax.rsqrt(v))


def test_order_xla_is_jax_s_sum_where_the_docstring_says_it_is():
    """jnp.sum over every axis but the last, on a grid of shapes on every path (3 or more channels, innermost
    extent 3 or more: where XLA's loop keeps its order)."""
    acc = Arith("fp32")
    rng = np.random.default_rng(1)
    shapes = [(n, h, w, c) for n in (1, 2, 5) for h in (3, 8, 31) for w in (3, 7, 40) for c in (3, 19)]
    shapes += [(12, 16, 16, 16), (40, 16, 16, 16), (5, 31, 31, 16), (7, 20, 20, 100), (200, 5), (3, 300, 4)]
    for shape in shapes:
        x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-14, 14, shape)).astype(f32)
        got = reduce_sum(np.moveaxis(x, -1, 0).reshape(shape[-1], -1).astype(np.float64), acc, order="xla",
                         row=CallShape(shape[:-1], shape[-1]))
        assert _same(got, jnp.sum(x, axis=tuple(range(x.ndim - 1)))), shape


@pytest.mark.parametrize("shape", [(4, 4, 2, 8), (2, 16, 2, 3), (8, 8, 4, 1), (35, 40, 2)])
def test_the_departures_the_docstring_names_are_real(shape):
    """Where LLVM reassociates XLA's loop (an innermost extent of 2 with 3 or more channels; one channel; a 2×2 grid
    of windows), order=xla is not jax's sum: the docstring's caveat is true, and identify would say so."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-14, 14, shape)).astype(f32)
    got = reduce_sum(np.moveaxis(x, -1, 0).reshape(shape[-1], -1).astype(np.float64), Arith("fp32"), order="xla",
                     row=CallShape(shape[:-1], shape[-1]))
    assert not _same(got, jnp.sum(x, axis=tuple(range(x.ndim - 1))))


def test_the_compiled_program_is_the_one_the_recipe_describes():
    """XLA hands a reduce of 4096 values or more to YNNPACK (a fusion of kind __ynn_fusion), rewrites a smaller one
    with an axis over 32 into a reduce-window of 32 with kSame padding, and flax's BatchNorm runs as the primitives
    the recipe replays (square; reduce_sum; div by R; sub; max 0; rsqrt; mul; add)."""
    def hlo(shape):  # noqa: ANN001, ANN202
        f = jax.jit(lambda x: jnp.sum(x, axis=tuple(range(len(shape) - 1))))
        return f.lower(jnp.zeros(shape, jnp.float32)).compile().as_text()

    assert "__ynn_fusion" in hlo((3, 7, 23, 19)) and "__ynn_fusion" in hlo((2, 16, 16, 8)) \
        and "__ynn_fusion" not in hlo((2, 16, 16, 7))  # (4096 values and more; 3584 not)
    windows = hlo((1, 1, 100, 3))
    assert "reduce-window" in windows and "size=1x1x32x1" in windows and "pad=0_0x0_0x14_14x0_0" in windows
    bn = _flax("fp32", True)
    x = jnp.zeros((3, 7, 11, 6), jnp.float32)
    v = bn.init(jax.random.PRNGKey(0), x)
    prims = [e.primitive.name for e in jax.make_jaxpr(lambda v, x: bn.apply(v, x, mutable=["batch_stats"]))(v, x)
             .jaxpr.eqns]
    assert prims[:9] == ["square", "reduce_sum", "div", "reduce_sum", "div", "square", "sub", "max", "mul"]
    assert "rsqrt" in prims


@pytest.mark.parametrize("fmt", ["fp32"])
def test_identify_finds_the_recipe_bit_for_bit(fmt):
    from bnprobe.checks.identify.search import identify

    res = identify("jax", fmt)
    assert res.departs is None, res.departs
    p = res.policy
    assert (p.order, p.variance, p.clamp_var, p.mean_by, p.rsqrt, p.rsqrt_newton, p.newton_form,
            p.backward_formula) == ("xla", "naive", True, "reciprocal", "rsqrtps", 2, "xla", "jax")
    assert all(o.probes_exact and o.fresh_exact for o in res.outputs)

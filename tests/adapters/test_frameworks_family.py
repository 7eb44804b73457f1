"""The frameworks' own LayerNorm, RMSNorm, GroupNorm and InstanceNorm layers through their adapters (``jax``:
flax.linen; ``keras``: keras.layers on TensorFlow): the adapter's outputs are the layer's, called directly the way a
user calls it (channels last), bit for bit; and, judged independently against the FP64 golden by
compare-precision, a layer that computes correctly passes in every format while each defect found fails where it
shows, its cause checked by a plain replay:

- flax (fp16, bf16): JAX's vjp rounds x's two cotangents — dy·γ·rstd and the statistics' term — to x's format and
  adds them there, so dx carries up to three roundings (its dx fails where the two terms cancel);
- flax GroupNorm (fp32): ``use_fast_variance`` (flax's default) is E[x²] − E[x]², which cancels on rows with a large
  mean over a small spread (fails there; two-pass, ``fast_variance=false``, passes);
- Keras RMSNormalization under a mixed policy (fp32 variables, 16-bit x): its scale is autocast to x's format (the
  other layers set ``autocast=False``), so γ is applied and dγ returned rounded to that format (fails; with the
  parameters in x's format it passes).

Each framework is an optional extra: these tests skip where it is not installed, and .ci/frameworks runs them in
the framework's own environment."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.checks.compare.precision import CallOptions, compare_precision
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.cases import family_cases

CASES = [("layer", (4, 6, 32), {}), ("rms", (3, 5, 48), {}), ("group", (2, 8, 5, 5), {"groups": 4}),
         ("instance", (2, 3, 6, 7), {})]
# (format, parameter format): fp32; 16-bit x with fp32 parameters (flax's param_dtype, Keras's mixed policy); 16-bit
# parameters (Keras's float16 / bfloat16 policy)
FORMATS = [("fp32", "fp32"), ("fp16", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]
PARAM_SHAPE = {"layer": lambda s: s[-1:], "rms": lambda s: s[-1:], "group": lambda s: s[1:2],
               "instance": lambda s: s[1:2]}


def _adapter(name: str, opts: str = ""):  # noqa: ANN202
    why = why_unavailable(name)
    if why:
        pytest.skip(why)
    return get_adapter(name + (f":{opts}" if opts else ""))


def _failing(res) -> list[str]:  # noqa: ANN001
    return [f"{r.adapter} {r.dtype} {r.case} {r.tensor}" for r in res.rows.itertuples()
            if str(r.verdict).endswith("FAIL")]


# ---- the framework's layer called directly, channels last -----------------------------------------------------------
def _inputs(norm: str, shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    ps = PARAM_SHAPE[norm](shape)
    return (rng.standard_normal(shape) * 2 + 1, rng.uniform(0.5, 2, ps), rng.normal(0, 1, ps),
            rng.standard_normal(shape))


def _flax_direct(norm: str, kw: dict, fmt: str, pf: str, x, g, b, dy) -> tuple:  # noqa: ANN001
    """y, dx, dγ, dβ of flax.linen's layer with its default axes (GroupNorm and InstanceNorm channels last), its
    gradients by jax.vjp; and the inputs rounded as jax rounds them."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    dt = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
    last = norm in ("group", "instance")
    to = (lambda a: np.moveaxis(a, 1, -1)) if last else (lambda a: a)
    back = (lambda a: np.moveaxis(np.asarray(a), -1, 1)) if last else np.asarray
    common = {"epsilon": 1e-5, "dtype": dt[fmt], "param_dtype": dt[pf]}
    layer = {"layer": lambda: nn.LayerNorm(**common), "rms": lambda: nn.RMSNorm(**common),
             "group": lambda: nn.GroupNorm(num_groups=kw.get("groups"), **common),
             "instance": lambda: nn.InstanceNorm(**common)}[norm]()
    xs, dys = (jnp.asarray(to(a), jnp.float32).astype(dt[fmt]) for a in (x, dy))
    gs, bs = (jnp.asarray(a, jnp.float32).astype(dt[pf]) for a in (g, b))

    def f(x, g, b):  # noqa: ANN001, ANN202
        return layer.apply({"params": {"scale": g, **({} if norm == "rms" else {"bias": b})}}, x)

    y, vjp = jax.vjp(f, xs, gs, bs)
    dx, dg, db = vjp(dys)
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return ((f64(back(xs)), f64(gs), f64(bs), f64(back(dys))),
            (back(f64(y)), back(f64(dx)), f64(dg), None if norm == "rms" else f64(db)))


def _keras_direct(norm: str, kw: dict, fmt: str, pf: str, x, g, b, dy) -> tuple:  # noqa: ANN001
    """The same for keras.layers (default axis -1, channels last; InstanceNorm as GroupNormalization(groups=-1)),
    its gradients by tf.GradientTape; its dtype policy: float32, mixed_float16 / mixed_bfloat16 (fp32 parameters) or
    float16 / bfloat16."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    policy = "float32" if fmt == "fp32" else (f"mixed_{name[fmt]}" if pf == "fp32" else name[fmt])
    last = norm in ("group", "instance")
    to = (lambda a: np.moveaxis(a, 1, -1)) if last else (lambda a: a)
    back = (lambda a: np.moveaxis(np.asarray(a, dtype=np.float64), -1, 1)) if last else \
        (lambda a: np.asarray(a, dtype=np.float64))
    L = keras.layers  # noqa: N806
    layer = {"layer": lambda: L.LayerNormalization(epsilon=1e-5, dtype=policy),
             "rms": lambda: L.RMSNormalization(epsilon=1e-5, dtype=policy),
             "group": lambda: L.GroupNormalization(groups=kw.get("groups"), epsilon=1e-5, dtype=policy),
             "instance": lambda: L.GroupNormalization(groups=-1, epsilon=1e-5, dtype=policy)}[norm]()
    xs, dys = (tf.cast(tf.constant(to(a), tf.float32), name[fmt]) for a in (x, dy))
    layer.build(xs.shape)
    params = [tf.cast(tf.constant(a, tf.float32), name[pf]).numpy() for a in ((g,) if norm == "rms" else (g, b))]
    layer.set_weights(params)
    weights = [w.value for w in layer.trainable_weights]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y = layer(xs)
    grads = tape.gradient(y, [xs, *weights], output_gradients=dys)
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return ((back(xs), f64(params[0]), f64(params[-1]), back(dys)),
            (back(y), back(grads[0]), f64(grads[1]), None if norm == "rms" else f64(grads[2])))


DIRECT = {"jax": _flax_direct, "keras": _keras_direct}


@pytest.mark.parametrize("fmt,pf", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("norm,shape,kw", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", ["jax", "keras"])
def test_the_adapter_is_the_layer_called_directly(name, norm, shape, kw, fmt, pf) -> None:  # noqa: ANN001
    a = _adapter(name)
    (x, g, b, dy), want = DIRECT[name](norm, kw, fmt, pf, *_inputs(norm, shape))
    c = BNCall(x, gamma=g, beta=None if norm == "rms" else b, dy=dy, eps=1e-5, dtype=fmt,
               params="fp32" if pf == "fp32" else "same", norm=norm, **kw)
    out = a.train(c)
    grads = a.backward_of(c, get_adapter("reference").train(c).saved)
    assert out.saved is None  # (it saves nothing: its backward recomputes the statistics)
    got = (out.y, grads.dx, grads.dgamma, grads.dbeta)
    for what, mine, theirs in zip(("y", "dx", "dgamma", "dbeta"), got, want):
        if theirs is None:
            assert mine is None, what
            continue
        np.testing.assert_array_equal(np.asarray(mine, dtype=np.float64), theirs, err_msg=what)


@pytest.mark.parametrize("name", ["jax", "keras"])
def test_what_the_layer_has_not_is_refused_in_one_line(name) -> None:  # noqa: ANN001
    a = _adapter(name)
    x = np.random.default_rng(0).standard_normal((2, 4, 16))
    with pytest.raises(BNProbeError, match="has no weight offset"):
        a.train(BNCall(x, norm="rms", weight_offset=1.0, dtype="fp32"))
    assert set(a.capabilities().norms) == {"batch", "layer", "rms", "group", "instance"}


def test_tensorflow_has_no_family_op_and_says_so() -> None:
    a = _adapter("tensorflow")
    with pytest.raises(BNProbeError, match="runs BatchNorm only, not LayerNorm"):
        a.train(BNCall(np.ones((2, 8)), norm="layer", dtype="fp32"))


# ---- compare-precision against the FP64 golden: the independent check -----------------------------------------------
def _cases(norm: str, names: tuple[str, ...] | None = None) -> list:
    return [c for c in family_cases(norm) if names is None or c.name in names]


def _judged(name: str, fmts: tuple[str, ...], norm: str, names: tuple[str, ...] | None = None, params: str = "fp32"):  # noqa: ANN202
    groups = 32 if norm == "group" else None
    return compare_precision([name], fmts, _cases(norm, names), options=CallOptions(norm=norm, groups=groups,
                                                                                     params=params))


@pytest.mark.parametrize("norm", ["layer", "group", "instance"])
def test_keras_layernorm_and_groupnorm_pass_in_every_format(norm) -> None:  # noqa: ANN001
    _adapter("keras")
    res = _judged("keras", ("fp32", "fp16", "bf16"), norm)
    assert len(res.rows) > 0 and not _failing(res), _failing(res)


def test_keras_rmsnormalization_autocasts_its_scale_under_a_mixed_policy() -> None:
    """fp32 passes, and 16-bit x with its parameters in x's format (policy float16 / bfloat16) too; under
    mixed_float16 / mixed_bfloat16 the scale, an fp32 variable, is read in x's format: dγ fails in both formats (it
    holds only x's format's values: checked without bnprobe below), and dx with it."""
    _adapter("keras")
    assert not _failing(_judged("keras", ("fp32",), "rms"))
    assert not _failing(_judged("keras", ("fp16", "bf16"), "rms", params="same"))
    res = _judged("keras", ("fp16", "bf16"), "rms", ("hidden/768", "stress/mean=100"))
    failing = set(_failing(res))
    assert {f"keras {f} stress/mean=100 dgamma" for f in ("fp16", "bf16")} <= failing
    assert not [f for f in failing if f.endswith(" y")], failing  # (y, rounded to x's format anyway, passes)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_keras_rmsnormalization_applies_its_scale_in_xs_format(fmt) -> None:
    """The cause, replayed in float64 numpy: Keras's dγ holds only values of x's format, and its dx is the exact
    dx of γ rounded to x's format, rounded once — not the exact dx of the fp32 γ it was given."""
    a = _adapter("keras")
    x, dy, g = _replay_inputs(fmt)
    got = a.backward_of(BNCall(x, gamma=g, dy=dy, eps=1e-5, dtype=fmt, norm="rms"), _no_saved(x, "rms"))
    dg = np.asarray(got.dgamma, dtype=np.float64)
    assert np.array_equal(_round(dg, fmt), dg)
    as_given, rounded = _rms_dx(x, dy, g), _rms_dx(x, dy, _round(g, fmt))
    dx = np.asarray(got.dx, dtype=np.float64)
    assert np.mean(dx == _round(rounded, fmt)) > 0.999
    assert np.mean(dx == _round(as_given, fmt)) < 0.9  # (the two are told apart on these inputs)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_flax_passes_in_fp32(norm) -> None:  # noqa: ANN001
    _adapter("jax")
    res = _judged("jax", ("fp32",), norm, ("hidden/768", "stress/mean=100", "stress/mean-square-near-eps"))
    assert len(res.rows) > 0 and not _failing(res), _failing(res)


def test_flax_groupnorm_fast_variance_cancels_on_a_large_mean() -> None:
    """flax's default one-pass variance fails y and dx in fp32 on the rows with a large mean over a small spread,
    and only there; the two-pass variance (use_fast_variance=False) passes every input."""
    _adapter("jax")
    for norm in ("group", "instance"):
        res = _judged("jax", ("fp32",), norm)
        cases = {f.split()[2] for f in _failing(res)}
        assert cases == {"stress/mean=100", "stress/var-near-eps"}, _failing(res)
        assert {f.split()[3] for f in _failing(res)} <= {"y", "dx"}
        assert not _failing(_judged("jax:fast_variance=false", ("fp32",), norm))


@pytest.mark.parametrize("norm", ["layer", "rms", "group"])
def test_flax_16_bit_dx_fails_and_nothing_else(norm) -> None:  # noqa: ANN001
    """In fp16 and bf16 (two-pass, so that the variance does not cancel) y, dγ and dβ pass and dx fails: JAX's
    vjp adds x's two cotangents in x's format (its cause replayed below)."""
    _adapter("jax")
    res = _judged("jax:fast_variance=false", ("fp16", "bf16"), norm,
                  ("hidden/768", "stress/dy-shifted", "activations"))
    failing = _failing(res)
    assert failing and {f.split()[3] for f in failing} == {"dx"}, failing
    assert {f.split()[1] for f in failing} == {"fp16", "bf16"}


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_flax_16_bit_dx_is_two_cotangents_rounded_then_added(norm, fmt) -> None:  # noqa: ANN001
    """The cause, replayed in float64 numpy: dx = fl(fl(dy·γ·rstd) + fl(rest)), each term of the exact dx rounded to
    x's format and their sum rounded again, is flax's dx on nearly every element; the exact dx rounded once is not."""
    a = _adapter("jax")
    x, dy, g = _replay_inputs(fmt)
    got = a.backward_of(BNCall(x, gamma=g, dy=dy, eps=1e-5, dtype=fmt, norm=norm), _no_saved(x, norm))
    exact, direct = (_rms_dx if norm == "rms" else _layer_dx)(x, dy, g, both=True)
    two = _round(_round(direct, fmt) + _round(exact - direct, fmt), fmt)
    dx = np.asarray(got.dx, dtype=np.float64)
    assert np.mean(dx == two) > 0.999
    assert np.mean(dx == _round(exact, fmt)) < 0.9


# ---- the plain replays (float64 numpy, ml_dtypes for the rounding) --------------------------------------------------
def _round(a: np.ndarray, fmt: str) -> np.ndarray:
    import ml_dtypes

    dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}[fmt]
    return np.asarray(a, dtype=np.float64).astype(dt).astype(np.float64)


def _replay_inputs(fmt: str) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    shape = (4, 32, 768)
    return (_round(rng.standard_normal(shape), fmt), _round(rng.standard_normal(shape), fmt),
            _round(rng.uniform(0.5, 2, 768), "fp32"))


def _no_saved(x: np.ndarray, norm: str):  # noqa: ANN202
    """Statistics of the right shape for backward_of (these adapters recompute their own and read none)."""
    from bnprobe.adapters.base import Saved

    rows = x.size // x.shape[-1]
    return Saved(None if norm == "rms" else np.zeros(rows), "invstd", np.ones(rows))


def _layer_dx(x, dy, g, both: bool = False):  # noqa: ANN001, ANN202
    """LayerNorm's exact dx over the last axis, ε 1e-5: rstd·(dy·γ − mean(dy·γ) − x̂·mean(dy·γ·x̂)) (and its first
    term dy·γ·rstd)."""
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    xh, gg = (x - x.mean(-1, keepdims=True)) * rstd, dy * g
    dx = rstd * (gg - gg.mean(-1, keepdims=True) - xh * (gg * xh).mean(-1, keepdims=True))
    return (dx, gg * rstd) if both else dx


def _rms_dx(x, dy, g, both: bool = False):  # noqa: ANN001, ANN202
    """RMSNorm's exact dx: rstd·(dy·γ − x̂·mean(dy·γ·x̂)), x̂ = x·rstd, rstd = 1/√(mean(x²) + ε)."""
    rstd = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    xh, gg = x * rstd, dy * g
    dx = rstd * (gg - xh * (gg * xh).mean(-1, keepdims=True))
    return (dx, gg * rstd) if both else dx

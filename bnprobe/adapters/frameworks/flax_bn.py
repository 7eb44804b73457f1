"""``jax``: flax.linen.BatchNorm on JAX's CPU backend.

flax's convention: the running variance is updated with the biased variance, its ``momentum`` is the old value's
weight (k = 1 − m, 0.99 by default), it saves nothing (its backward is JAX's autodiff through the forward) and
its feature axis is last.  ``dtype`` is the run's format and ``param_dtype`` the parameter format (γ, β); the
running statistics are float32 whatever the formats (``force_float32_reductions``, which also computes the
statistics of 16-bit x in float32).  Options: ``fast_variance`` (flax's ``use_fast_variance``: true, the default,
is E[x²] − E[x]² clamped at 0; false is two-pass) and ``force_float32`` (``force_float32_reductions``).

JAX runs ``apply`` and its vjp eagerly here: one XLA computation per primitive of flax's jaxpr, so no two of its
operations are fused.  With the default options identify reproduces it bit for bit (jaxlib 0.10.2 on an AVX-512
Xeon): XLA's reduction orders (``order=xla``), its rsqrt (``rsqrt=rsqrtps``, ``newton_form=xla``) and JAX's
autodiff of the one-pass statistics (``backward_formula=jax``); docs/policies.md gives the recipe.

The family: ``flax.linen.LayerNorm`` and ``RMSNorm`` over the call's normalised trailing dims (``reduction_axes`` and
``feature_axes`` both those dims, so γ and β have ``normalized_shape``), ``GroupNorm`` (its feature axis last: x is
moved to channels-last and back) and ``InstanceNorm`` (``feature_axes=1``).  The same options apply
(``use_fast_variance``, ``force_float32_reductions``); ``dtype`` is x's format and ``param_dtype`` the parameter
format.  flax's ε default is 1e-6 for all four; none saves its statistics (the backward is JAX's vjp through the
forward, which recomputes them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, FamilyPrepared, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options

__all__ = ["FlaxAdapter"]

_JNP = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class FlaxAdapter(FrameworkAdapter):
    convention = "flax"
    formats = ("fp32", "fp16", "bf16")
    same_params = ("fp16", "bf16")
    family = ("layer", "rms", "group", "instance")
    #: flax.linen's class of each family layer
    family_class = {"layer": "LayerNorm", "rms": "RMSNorm", "group": "GroupNorm", "instance": "InstanceNorm"}

    def __init__(self, opts: str = "") -> None:
        o = parse_options("jax", opts, {"fast_variance": ("true", "false"), "force_float32": ("true", "false")})
        self.fast_variance = o.get("fast_variance", "true") == "true"
        self.force_float32 = o.get("force_float32", "true") == "true"
        self.name = "jax" + (f":{opts}" if opts else "")
        import jax

        self._jax = jax
        jax.config.update("jax_platforms", "cpu")

    def _module(self, p: Prepared, *, train: bool, momentum: float, eps: float) -> Any:
        import flax.linen as nn
        import jax.numpy as jnp

        return nn.BatchNorm(use_running_average=not train, axis=-1, momentum=momentum, epsilon=eps,
                            dtype=getattr(jnp, _JNP[p.dtype]), param_dtype=getattr(jnp, _JNP[p.params]),
                            use_fast_variance=self.fast_variance, force_float32_reductions=self.force_float32)

    def _variables(self, p: Prepared, g: Any, b: Any, rm: np.ndarray | None, rv: np.ndarray | None) -> dict:
        c = p.lay.channels
        stats_fmt = "fp32" if self.force_float32 else p.params
        return {"params": {"scale": g, "bias": b},
                "batch_stats": {"mean": self.stored(np.zeros(c) if rm is None else rm, stats_fmt),
                                "var": self.stored(np.ones(c) if rv is None else rv, stats_fmt)}}

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        bn = self._module(p, train=True, momentum=self._momentum(momentum, p), eps=eps)
        variables = self._variables(p, self.stored(v["gamma"], p.params), self.stored(v["beta"], p.params),
                                    v["running_mean"], v["running_var"])
        y, upd = bn.apply(variables, self.stored(self.to_native(p.x, p), p.dtype), mutable=["batch_stats"])
        have = v["running_mean"] is not None
        stats = upd["batch_stats"]
        return ForwardOutput(self.from_native(y, p), None, np.asarray(stats["mean"]) if have else None,
                             np.asarray(stats["var"]) if have else None)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        bn = self._module(p, train=False, momentum=0.99, eps=eps)
        variables = self._variables(p, self.stored(v["gamma"], p.params), self.stored(v["beta"], p.params),
                                    v["running_mean"], v["running_var"])
        y = bn.apply(variables, self.stored(self.to_native(p.x, p), p.dtype))
        return ForwardOutput(self.from_native(y, p))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        """JAX's vjp through the forward (training: it recomputes the batch statistics, ``saved`` unused; eval:
        ``saved`` is the mean and variance inference normalises with)."""
        self._check_params(p)
        jax = self._jax
        bn = self._module(p, train=training, momentum=0.99, eps=eps)
        rm, rv = (None, None) if training else (saved.mean, saved.var(eps))

        def f(x: Any, g: Any, b: Any) -> Any:
            out = bn.apply(self._variables(p, g, b, rm, rv), x, mutable=["batch_stats"] if training else False)
            return out[0] if training else out

        x = self.stored(self.to_native(p.x, p), p.dtype)
        g = self.stored(p.vectors["gamma"], p.params)
        b = self.stored(np.zeros(p.lay.channels), p.params)
        _, vjp = jax.vjp(f, x, g, b)
        dx, dg, db = vjp(self.stored(self.to_native(dy, p), p.dtype))
        return BackwardOutput(self.from_native(dx, p), np.asarray(dg), np.asarray(db))

    # ---- the family layers -------------------------------------------------------------------------------------
    def _family_module(self, p: FamilyPrepared, eps: float) -> Any:
        """flax's layer for the call, its axes set so that it normalises what the call's layer does."""
        import flax.linen as nn
        import jax.numpy as jnp

        sh = p.shape
        common: dict[str, Any] = {
            "epsilon": eps, "dtype": getattr(jnp, _JNP[p.dtype]), "param_dtype": getattr(jnp, _JNP[p.params]),
            "use_fast_variance": self.fast_variance, "force_float32_reductions": self.force_float32}
        if sh.norm == "rms":
            axes = tuple(range(len(sh.shape) - len(sh.normalized), len(sh.shape)))
            return nn.RMSNorm(reduction_axes=axes, feature_axes=axes, **common)
        common["use_bias"] = p.beta is not None
        if sh.norm == "layer":
            axes = tuple(range(len(sh.shape) - len(sh.normalized), len(sh.shape)))
            return nn.LayerNorm(reduction_axes=axes, feature_axes=axes, **common)
        if sh.norm == "group":
            return nn.GroupNorm(num_groups=sh.groups, group_size=None, **common)
        return nn.InstanceNorm(feature_axes=1, **common)

    def _family_native(self, a: np.ndarray, p: FamilyPrepared) -> np.ndarray:
        """x or dy as flax's layer takes it: channels-last for GroupNorm (its feature axis is the last), as it is
        otherwise; in x's format."""
        a = np.moveaxis(a, 1, -1) if p.shape.norm == "group" else a
        return self.stored(np.ascontiguousarray(a), p.dtype)  # type: ignore[return-value]

    def _family_back(self, a: Any, p: FamilyPrepared) -> np.ndarray:
        a = np.asarray(a)
        return np.moveaxis(a, -1, 1) if p.shape.norm == "group" else a

    def _family_params(self, p: FamilyPrepared) -> tuple[Any, Any]:
        """γ (ones where the call gives none, so that dγ is returned) and β (None where the call gives none) in the
        parameter format, shaped as flax holds them."""
        ps = p.shape.param_shape
        g = self.stored(np.ones(ps) if p.gamma is None else p.gamma.reshape(ps), p.params)
        return g, None if p.beta is None else self.stored(p.beta.reshape(ps), p.params)

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        self._refuse_offset(p, f"flax.linen.{self.family_class[p.shape.norm]}")
        g, b = self._family_params(p)
        params = {"scale": g, **({} if b is None else {"bias": b})}
        y = self._family_module(p, eps).apply({"params": params}, self._family_native(p.x, p))
        return ForwardOutput(self._family_back(y, p), None, meta={"jax": self._jax.__version__})

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved | None, *,
                              eps: float) -> BackwardOutput:
        """JAX's vjp through the layer (it recomputes the statistics: ``saved`` is not read)."""
        self._refuse_offset(p, f"flax.linen.{self.family_class[p.shape.norm]}")
        module = self._family_module(p, eps)
        g, b = self._family_params(p)

        def f(x: Any, g: Any, b: Any) -> Any:
            return module.apply({"params": {"scale": g, **({} if b is None else {"bias": b})}}, x)

        _, vjp = self._jax.vjp(f, self._family_native(p.x, p), g, b)
        dx, dg, db = vjp(self._family_native(dy, p))
        meta: dict[str, Any] = {"jax": self._jax.__version__,
                                "note": "JAX's vjp recomputes the statistics: the saved ones are not read"}
        if db is None:
            meta["missing"] = ("dbeta",)
        return BackwardOutput(self._family_back(dx, p), np.asarray(dg), None if db is None else np.asarray(db),
                              meta=meta)

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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options

__all__ = ["FlaxAdapter"]

_JNP = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class FlaxAdapter(FrameworkAdapter):
    convention = "flax"
    formats = ("fp32", "fp16", "bf16")
    same_params = ("fp16", "bf16")

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

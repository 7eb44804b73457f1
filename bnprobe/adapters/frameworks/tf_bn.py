"""``tensorflow``: tf.nn.fused_batch_norm's kernel (FusedBatchNormV3, and FusedBatchNormGradV3 for the backward);
``keras``: keras.layers.BatchNormalization on the TensorFlow backend.

TensorFlow's fused kernel: NHWC on the CPU, x in fp32, fp16 or bf16 with scale, offset and the statistics always
fp32; the running variance is updated with the unbiased variance, ``exponential_avg_factor`` is bnprobe's m (the
batch's weight); it saves the mean and the biased variance (reserve_space_1, reserve_space_2), which its gradient op
takes.  Keras: channels last, the biased variance, ``momentum`` the old value's weight (k = 1 − m), nothing saved
(its backward is TensorFlow's autodiff); the run's format and parameter format choose the dtype policy — fp32:
``float32``; fp16 / bf16 with fp32 parameters: ``mixed_float16`` / ``mixed_bfloat16``; with parameters in x's format:
``float16`` / ``bfloat16``.

The family (Keras only: TensorFlow has no LayerNorm, RMSNorm or GroupNorm op of its own — its raw ops hold
BatchNorm's alone — so the ``tensorflow`` adapter runs BatchNorm only): ``keras.layers.LayerNormalization`` and
``RMSNormalization`` with ``axis`` the call's normalised trailing dims, ``GroupNormalization`` channels last, as Keras
runs it by default (x moved there and back: with ``axis=1`` on channels-first x its dγ is summed in another order)
and, for InstanceNorm, ``GroupNormalization(groups=-1)`` (Keras's instance normalisation).  ε defaults: 1e-3,
RMSNormalization's 1e-6.  The dtype policy as for BatchNorm; each layer computes in at least float32 and casts y to
x's format, RMSNormalization's scale read in the compute dtype (it is autocast).  None saves its statistics (the
backward is TensorFlow's autodiff).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, FamilyPrepared, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options

__all__ = ["TensorFlowAdapter", "KerasAdapter"]

_TF = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up chatter is not a finding
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    return tf


class TensorFlowAdapter(FrameworkAdapter):
    convention = "tensorflow"
    formats = ("fp32", "fp16", "bf16")

    def __init__(self, opts: str = "") -> None:
        parse_options("tensorflow", opts, {})
        self.name = "tensorflow"
        self._tf = _tf()

    def _x(self, a: np.ndarray, p: Prepared) -> Any:
        return self._tf.constant(self.stored(self.to_native(a, p), p.dtype))

    def _vec(self, a: np.ndarray | None, default: float, p: Prepared) -> np.ndarray:
        return self.stored(np.full(p.lay.channels, default) if a is None else a, "fp32")  # type: ignore[return-value]

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        have = v["running_mean"] is not None
        out = self._tf.raw_ops.FusedBatchNormV3(
            x=self._x(p.x, p), scale=self._vec(v["gamma"], 1.0, p), offset=self._vec(v["beta"], 0.0, p),
            mean=self._vec(v["running_mean"], 0.0, p), variance=self._vec(v["running_var"], 1.0, p), epsilon=eps,
            exponential_avg_factor=self._momentum(momentum, p), data_format="NHWC", is_training=True)
        y, rm, rv, mean, var = (np.asarray(t) for t in out[:5])
        return ForwardOutput(self.from_native(y, p), Saved(mean, "var", var), rm if have else None,
                             rv if have else None)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        out = self._tf.raw_ops.FusedBatchNormV3(
            x=self._x(p.x, p), scale=self._vec(v["gamma"], 1.0, p), offset=self._vec(v["beta"], 0.0, p),
            mean=self._vec(v["running_mean"], 0.0, p), variance=self._vec(v["running_var"], 1.0, p), epsilon=eps,
            data_format="NHWC", is_training=False)
        return ForwardOutput(self.from_native(np.asarray(out[0]), p))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        """FusedBatchNormGradV3 from the saved mean and biased variance (eval: the running statistics)."""
        self._check_params(p)
        var = saved.var(eps)
        out = self._tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=self._x(dy, p), x=self._x(p.x, p), scale=self._vec(p.vectors["gamma"], 1.0, p),
            reserve_space_1=self.stored(saved.mean, "fp32"), reserve_space_2=self.stored(var, "fp32"),
            reserve_space_3=np.float32(0.0), epsilon=eps, data_format="NHWC", is_training=training)
        dx, dg, db = (np.asarray(t) for t in out[:3])
        return BackwardOutput(self.from_native(dx, p), dg, db)


class KerasAdapter(FrameworkAdapter):
    convention = "keras"
    formats = ("fp32", "fp16", "bf16")
    same_params = ("fp16", "bf16")
    family = ("layer", "rms", "group", "instance")
    #: Keras's layer of each family layer
    family_class = {"layer": "LayerNormalization", "rms": "RMSNormalization", "group": "GroupNormalization",
                    "instance": "GroupNormalization(groups=-1)"}

    def __init__(self, opts: str = "") -> None:
        parse_options("keras", opts, {})
        self.name = "keras"
        self._tf = _tf()
        import keras

        self._keras = keras

    def _policy(self, p: Prepared | FamilyPrepared) -> str:
        if p.dtype == "fp32":
            return "float32"
        return f"mixed_{_TF[p.dtype]}" if p.params == "fp32" else _TF[p.dtype]

    def _layer(self, p: Prepared, *, momentum: float, eps: float, rm: Any, rv: Any, g: Any, b: Any) -> Any:
        c = p.lay.channels
        layer = self._keras.layers.BatchNormalization(axis=-1, momentum=momentum, epsilon=eps, dtype=self._policy(p))
        layer.build((None,) * (p.x.ndim - 1) + (c,))
        vec = lambda a, d: self.stored(np.full(c, d) if a is None else a, p.params)  # noqa: E731
        layer.set_weights([vec(g, 1.0), vec(b, 0.0), vec(rm, 0.0), vec(rv, 1.0)])
        return layer

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        layer = self._layer(p, momentum=self._momentum(momentum, p), eps=eps, rm=v["running_mean"],
                            rv=v["running_var"], g=v["gamma"], b=v["beta"])
        y = layer(self.stored(self.to_native(p.x, p), p.dtype), training=True)
        have = v["running_mean"] is not None
        rm, rv = (np.asarray(w) for w in (layer.moving_mean.value, layer.moving_variance.value))
        return ForwardOutput(self.from_native(np.asarray(y), p), None, rm if have else None, rv if have else None)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        layer = self._layer(p, momentum=0.99, eps=eps, rm=v["running_mean"], rv=v["running_var"], g=v["gamma"],
                            b=v["beta"])
        y = layer(self.stored(self.to_native(p.x, p), p.dtype), training=False)
        return ForwardOutput(self.from_native(np.asarray(y), p))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        """TensorFlow's autodiff through the layer (training: its own batch statistics, ``saved`` unused; eval:
        ``saved`` is the mean and variance it normalises with)."""
        self._check_params(p)
        tf = self._tf
        rm, rv = (None, None) if training else (saved.mean, saved.var(eps))
        layer = self._layer(p, momentum=0.99, eps=eps, rm=rm, rv=rv, g=p.vectors["gamma"], b=None)
        x = tf.constant(self.stored(self.to_native(p.x, p), p.dtype))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
        dx, dg, db = tape.gradient(y, [x, layer.gamma.value, layer.beta.value],
                                   output_gradients=tf.constant(self.stored(self.to_native(dy, p), p.dtype)))
        return BackwardOutput(self.from_native(np.asarray(dx), p), np.asarray(dg), np.asarray(db))

    # ---- the family layers -------------------------------------------------------------------------------------
    def _family_layer(self, p: FamilyPrepared, eps: float) -> Any:
        """Keras's layer for the call, built on x's shape with the call's γ and β (γ 1 where the call gives none, so
        that dγ is returned; no β where it gives none)."""
        self._refuse_offset(p, f"keras.layers.{self.family_class[p.shape.norm]}")
        sh, layers = p.shape, self._keras.layers
        nd, policy, center = len(sh.shape), self._policy(p), p.beta is not None
        if sh.norm in ("layer", "rms"):
            axes = list(range(nd - len(sh.normalized), nd))
            layer = layers.RMSNormalization(axis=axes, epsilon=eps, dtype=policy) if sh.norm == "rms" else \
                layers.LayerNormalization(axis=axes, epsilon=eps, center=center, dtype=policy)
        else:
            layer = layers.GroupNormalization(groups=sh.groups if sh.norm == "group" else -1, epsilon=eps,
                                              center=center, dtype=policy)
        last = sh.norm in ("group", "instance")
        layer.build((sh.shape[0], *sh.shape[2:], sh.shape[1]) if last else sh.shape)
        ps = sh.param_shape
        g = np.ones(ps) if p.gamma is None else p.gamma.reshape(ps)
        layer.set_weights([self.stored(g, p.params)] + ([] if p.beta is None else
                                                         [self.stored(p.beta.reshape(ps), p.params)]))
        return layer

    def _family_native(self, a: np.ndarray, p: FamilyPrepared) -> np.ndarray:
        """x or dy as Keras's layer takes it: channels last for GroupNormalization, as it is otherwise."""
        return np.ascontiguousarray(np.moveaxis(a, 1, -1) if p.shape.norm in ("group", "instance") else a)

    def _family_back(self, a: Any, p: FamilyPrepared) -> np.ndarray:
        a = np.asarray(a)
        return np.moveaxis(a, -1, 1) if p.shape.norm in ("group", "instance") else a

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        layer = self._family_layer(p, eps)
        y = layer(self._tf.constant(self.stored(self._family_native(p.x, p), p.dtype)))
        return ForwardOutput(self._family_back(y, p), None, meta={"keras": self._keras.__version__})

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved | None, *,
                              eps: float) -> BackwardOutput:
        """TensorFlow's autodiff through the layer (it recomputes the statistics: ``saved`` is not read)."""
        tf = self._tf
        layer = self._family_layer(p, eps)
        x = tf.constant(self.stored(self._family_native(p.x, p), p.dtype))
        weights = [w.value for w in layer.trainable_weights]  # γ (scale), then β where the layer has one
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        grads = tape.gradient(y, [x, *weights], output_gradients=tf.constant(self.stored(self._family_native(dy, p),
                                                                                           p.dtype)))
        meta: dict[str, Any] = {"keras": self._keras.__version__,
                                "note": "TensorFlow's autodiff recomputes the statistics: the saved ones are not read"}
        if len(weights) == 1:
            meta["missing"] = ("dbeta",)
        return BackwardOutput(self._family_back(grads[0], p), np.asarray(grads[1]),
                              np.asarray(grads[2]) if len(weights) > 1 else None, meta=meta)

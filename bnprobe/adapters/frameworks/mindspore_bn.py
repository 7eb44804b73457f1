"""``mindspore``: mindspore.ops.BatchNorm (the primitive nn.BatchNorm2d calls) in PyNative mode on the CPU.

MindSpore's convention: NCHW; the running variance is updated with the unbiased variance, in place on the mean /
variance Parameters; the primitive's ``momentum`` is bnprobe's m (the batch's weight) while nn.BatchNorm2d's
``momentum`` is the old value's (k = 1 − m, 0.9 by default, passed to the primitive as 1 − k); it saves the mean and
the biased variance (reserve_space_1, reserve_space_2; on the CPU its batch_mean / batch_variance outputs are
zeros).  x in fp32 or fp16 (no bf16 on the CPU), the parameters in fp32.  The backward is MindSpore's vjp through
the primitive with the given dy (it recomputes the statistics from x; eval: normalised with the given ones).

What its CPU kernel computes (oneDNN v3.10's ncsp batch_normalization, its C++ loops as GCC vectorised them for SSE;
an fp16 x is converted to fp32 and y back), as identify finds it bit for bit
(tests/adapters/test_frameworks_identified.py): each row of H·W values summed in 4 lanes with the row's remainder in
lane 0, the lanes added in order into a sum carried across rows (``order=omp_simd, lanes=4``); the biased variance the
same way; y = (γ/√(var + ε))·(x − mean) + β; the backward's sums not vectorised (``backward_lanes=1``) and oneDNN's dx
formula (``backward_formula=onednn``).

Its LayerNorm (ops.LayerNorm, nn.LayerNorm's primitive, ε 1e-7 there by default; fp32 γ, β or x's format, as
nn.LayerNorm casts them; it saves the mean and the variance, so the adapter returns none) and GroupNorm (the primitive
ops.group_norm and nn.GroupNorm call: γ, β in x's format; its mean and rstd, in x's format) with their backward by
vjp.  ops.rms_norm has no CPU kernel; ops.layer_norm's LayerNormExt fails to build one here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, FamilyPrepared, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options
from bnprobe.core.errors import BNProbeError

__all__ = ["MindSporeAdapter"]


class MindSporeAdapter(FrameworkAdapter):
    convention = "mindspore"
    formats = ("fp32", "fp16")
    family = ("layer", "group")  # (ops.rms_norm: "The kernel RmsNorm unregistered" on the CPU)
    unsaved = ("layer",)  # (its LayerNorm saves the mean and the variance; its GroupNorm the mean and rstd)

    def __init__(self, opts: str = "") -> None:
        parse_options("mindspore", opts, {})
        self.name = "mindspore"
        os.environ.setdefault("GLOG_v", "3")  # its start-up warnings are not findings
        import mindspore as ms

        ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
        self._ms = ms

    def _t(self, a: np.ndarray | None, default: float, p: Prepared) -> Any:
        return self._ms.Tensor(self.stored(np.full(p.lay.channels, default) if a is None else a, "fp32"))

    def _run(self, p: Prepared, rm: np.ndarray | None, rv: np.ndarray | None, *, training: bool, m: float,
             eps: float) -> tuple[Any, Any, Any, Any]:
        """The primitive, x as a Tensor and the running statistics as the Parameters it updates in place."""
        ms = self._ms
        bn = ms.ops.BatchNorm(is_training=training, epsilon=eps, momentum=m)
        pm = ms.Parameter(self._t(rm, 0.0, p), name="moving_mean")
        pv = ms.Parameter(self._t(rv, 1.0, p), name="moving_variance")
        xt = ms.Tensor(self.stored(self.to_native(p.x, p), p.dtype))
        return bn, xt, pm, pv

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_params(p)
        # the primitive's momentum is m itself (nn.BatchNorm2d passes it 1 - k)
        m = 1.0 - self._momentum(momentum, p)
        v = p.vectors
        bn, xt, pm, pv = self._run(p, v["running_mean"], v["running_var"], training=True, m=m,
                                   eps=eps)
        out = bn(xt, self._t(v["gamma"], 1.0, p), self._t(v["beta"], 0.0, p), pm, pv)
        have = v["running_mean"] is not None
        return ForwardOutput(self.from_native(out[0].asnumpy(), p), Saved(out[3].asnumpy(), "var", out[4].asnumpy()),
                             pm.asnumpy() if have else None, pv.asnumpy() if have else None)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_params(p)
        v = p.vectors
        bn, xt, pm, pv = self._run(p, v["running_mean"], v["running_var"], training=False, m=0.1,
                                   eps=eps)
        y = bn(xt, self._t(v["gamma"], 1.0, p), self._t(v["beta"], 0.0, p), pm, pv)[0]
        return ForwardOutput(self.from_native(y.asnumpy(), p))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        self._check_params(p)
        ms = self._ms
        rm, rv = (None, None) if training else (saved.mean, saved.var(eps))
        bn, xt, pm, pv = self._run(p, rm, rv, training=training, m=0.1, eps=eps)
        _, vjp = ms.vjp(lambda x, g, b: bn(x, g, b, pm, pv)[0], xt, self._t(p.vectors["gamma"], 1.0, p),
                        self._t(None, 0.0, p))
        dx, dg, db = vjp(ms.Tensor(self.stored(self.to_native(dy, p), p.dtype)))
        return BackwardOutput(self.from_native(dx.asnumpy(), p), dg.asnumpy(), db.asnumpy())

    # ---- the family layers ----------------------------------------------------------------------------
    def _family_run(self, p: FamilyPrepared, *, eps: float) -> tuple[Any, list[Any]]:
        """The function of MindSpore's own op for the call's layer (of x, γ and β, where the call gives one; its
        outputs y and the saved statistics) and those arguments as Tensors."""
        ms, sh = self._ms, p.shape
        if sh.norm == "group" and p.params != p.dtype:
            raise BNProbeError(f"adapter mindspore: MindSpore's GroupNorm takes γ and β in x's format (nn.GroupNorm "
                               f"casts them to it): use params same, not {p.params} parameters with {p.dtype} x")
        args = [ms.Tensor(self.stored(p.x, p.dtype)), ms.Tensor(self.family_gamma(p).reshape(sh.param_shape))]
        if p.beta is not None:
            args.append(ms.Tensor(self.stored(p.beta.reshape(sh.param_shape), p.params)))
        off = p.call.weight_offset
        if sh.norm == "layer":  # ops.LayerNorm, nn.LayerNorm's primitive (ops.layer_norm's LayerNormExt fails here)
            axis = len(sh.shape) - len(sh.normalized)
            op = ms.ops.LayerNorm(begin_norm_axis=axis, begin_params_axis=axis, epsilon=eps)
        else:  # GroupNorm's primitive, what ops.group_norm and nn.GroupNorm call (its y, mean and rstd)
            from mindspore.ops.auto_generate.gen_ops_prim import group_norm_op

            def op(x: Any, w: Any, b: Any) -> Any:
                return group_norm_op(x, sh.groups, w, b, eps)

        def run(x: Any, w: Any, b: Any = None) -> Any:
            # (β zeros where the call gives none, as ops.group_norm and nn.LayerNorm's default do; Gemma's 1 + w
            # formed by MindSpore in γ's dtype)
            return op(x, w + off if off else w, ms.ops.zeros_like(w) if b is None else b)
        return run, args

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        run, args = self._family_run(p, eps=eps)
        y, mean, stat = (t.asnumpy() for t in run(*args))
        meta = {"mindspore": self._ms.__version__}
        if p.shape.norm == "layer":  # its third output is the variance: not the rstd the interface takes
            return ForwardOutput(y, None, meta=meta)
        return ForwardOutput(y, Saved(mean.reshape(-1), "invstd", stat.reshape(-1)), meta=meta)

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved | None, *,
                              eps: float) -> BackwardOutput:
        ms = self._ms
        run, args = self._family_run(p, eps=eps)
        _, vjp = ms.vjp(lambda *a: run(*a)[0], *args)
        grads = vjp(ms.Tensor(self.stored(dy, p.dtype)))
        ps = p.shape.param_shape
        return BackwardOutput(grads[0].asnumpy(), grads[1].asnumpy().reshape(ps),
                              grads[2].asnumpy().reshape(ps) if len(grads) > 2 else None,
                              meta={"mindspore": ms.__version__,
                                    "note": "MindSpore's vjp recomputes the statistics: the saved ones are not read"})

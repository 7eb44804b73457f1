"""``paddle``: paddle.nn.functional.batch_norm's kernel on the CPU, through ``_C_ops.batch_norm`` (what the
functional API calls in dynamic mode, which also returns the saved statistics the functional API drops).

Paddle's convention: NCHW; the running variance is updated with the biased variance; ``momentum`` is the old
value's weight (k = 1 − m, 0.9 by default); it saves the mean and 1/√(var + ε).  Its CPU kernel runs fp32 and
fp64 only (fp16 / bf16: "kernel batch_norm is not registered"), with the parameters in x's format; in fp64
it keeps its ε and momentum attributes as float32 (ε = 1e-3 acts as float32(1e-3) = 1e-3·(1 + 2.1e-8)), so its
fp64 outputs differ from the exact ones by about that much: a fact of the framework, within fp64's tolerances.
The backward is Paddle's autograd through the op with the given dy (it recomputes the statistics the forward
saved: the same op on the same inputs; eval: normalised with the given mean and variance).

What its fp32 kernel computes (phi's CPU batch_norm on Eigen 3.3, built for AVX; no oneDNN unless FLAGS_use_mkldnn),
as identify finds it bit for bit (tests/adapters/test_frameworks_identified.py): each (n, c) row summed by Eigen's
dense redux (``order=eigen, lanes=8``: packets from 32-byte aligned addresses), the rows added in order; the biased
variance the same way from (x − mean)²; rstd = √(1/(var + ε)) with Eigen's fast packet sqrt on whole packets of 8
channels (``rsqrt=sqrt_recip, sqrt=eigen_fast``: Intel's rsqrtps and one Newton step); y = x·(rstd·γ) +
(β − (mean·rstd)·γ); its own backward; inference 1/√(var + ε).  The adapter hands it NCHW whatever the call's layout.

Its LayerNorm, RMSNorm and GroupNorm (a call's ``norm``): paddle.nn.functional.layer_norm and group_norm (fp32, fp64,
γ and β in x's format, ε 1e-5 by default) and paddle.incubate.nn.functional.fused_rms_norm (fp32 and forward only on
the CPU; paddle.nn.functional.rms_norm has no CPU kernel), the backward by Paddle's autograd.  They save the mean and
the variance, not the rstd the family's interface takes: the adapter returns no statistics for them
(``Capabilities.unsaved_norms``).  Its GroupNorm's variance is one pass, max(E[x²] − E[x]², 0) in x's format.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, FamilyPrepared, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options
from bnprobe.core.errors import BNProbeError

__all__ = ["PaddleAdapter"]


class PaddleAdapter(FrameworkAdapter):
    convention = "paddle"
    formats = ("fp64", "fp32")
    family = ("layer", "rms", "group")
    unsaved = family  # (it saves the mean and the variance, or none: not the rstd the family's interface takes)

    def __init__(self, opts: str = "") -> None:
        parse_options("paddle", opts, {})
        self.name = "paddle"
        os.environ.setdefault("GLOG_minloglevel", "2")
        with warnings.catch_warnings():  # its import warns of a missing ccache: nothing of bnprobe's
            warnings.simplefilter("ignore")
            import paddle
            import paddle.incubate.nn.functional as incubate
            from paddle import _C_ops
        paddle.set_device("cpu")
        self._paddle, self._ops, self._incubate = paddle, _C_ops, incubate

    def _t(self, a: np.ndarray | None, default: float, p: Prepared, fmt: str, grad: bool = False) -> Any:
        v = np.full(p.lay.channels, default) if a is None else a
        return self._paddle.to_tensor(self.stored(v, fmt), stop_gradient=not grad)

    def _op(self, x: Any, rm: Any, rv: Any, g: Any, b: Any, *, test: bool, k: float, eps: float) -> Any:
        return self._ops.batch_norm(x, rm, rv, g, b, test, k, eps, "NCHW", test, False)

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        v, pf = p.vectors, p.params
        have = v["running_mean"] is not None
        rm, rv = self._t(v["running_mean"], 0.0, p, pf), self._t(v["running_var"], 1.0, p, pf)
        x = self._paddle.to_tensor(self.stored(self.to_native(p.x, p), p.dtype))
        out = self._op(x, rm, rv, self._t(v["gamma"], 1.0, p, pf), self._t(v["beta"], 0.0, p, pf), test=False,
                       k=self._momentum(momentum, p), eps=eps)
        y, new_rm, new_rv, mean, invstd = (t.numpy() for t in out[:5])
        return ForwardOutput(self.from_native(y, p), Saved(mean, "invstd", invstd), new_rm if have else None,
                             new_rv if have else None)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        v, pf = p.vectors, p.params
        x = self._paddle.to_tensor(self.stored(self.to_native(p.x, p), p.dtype))
        out = self._op(x, self._t(v["running_mean"], 0.0, p, pf), self._t(v["running_var"], 1.0, p, pf),
                       self._t(v["gamma"], 1.0, p, pf), self._t(v["beta"], 0.0, p, pf), test=True, k=0.9, eps=eps)
        return ForwardOutput(self.from_native(out[0].numpy(), p))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        pf = p.params
        rm = self._t(None if training else saved.mean, 0.0, p, pf)
        rv = self._t(None if training else saved.var(eps), 1.0, p, pf)
        x = self._paddle.to_tensor(self.stored(self.to_native(p.x, p), p.dtype), stop_gradient=False)
        g, b = self._t(p.vectors["gamma"], 1.0, p, pf, grad=True), self._t(None, 0.0, p, pf, grad=True)
        y = self._op(x, rm, rv, g, b, test=not training, k=0.9, eps=eps)[0]
        dyt = self._paddle.to_tensor(self.stored(self.to_native(dy, p), p.dtype))
        dx, dg, db = self._paddle.grad([y], [x, g, b], [dyt])
        return BackwardOutput(self.from_native(dx.numpy(), p), dg.numpy(), db.numpy())

    # ---- the family layers ----------------------------------------------------------------------------
    def _family_check(self, p: FamilyPrepared) -> None:
        """Refuse, in one line, a call Paddle's CPU kernels do not run."""
        sh = p.shape
        if sh.norm in ("layer", "rms") and len(sh.normalized) == len(sh.shape):
            raise BNProbeError(f"adapter paddle: Paddle's {'layer_norm' if sh.norm == 'layer' else 'fused_rms_norm'} "
                               f"normalises after a leading dimension (begin_norm_axis > 0): normalized_shape "
                               f"{list(sh.normalized)} is all of x's shape {list(sh.shape)}")
        if sh.norm == "rms" and p.dtype != "fp32":
            raise BNProbeError(f"adapter paddle: Paddle's RMSNorm on the CPU (paddle.incubate.nn.functional."
                               f"fused_rms_norm; paddle.nn.functional.rms_norm has no CPU kernel) runs fp32 only, not "
                               f"{p.dtype}")

    def _family_run(self, p: FamilyPrepared, *, eps: float, grad: bool) -> tuple[Any, list[Any]]:
        """y of Paddle's own function for the call's layer, and the leaves a backward differentiates (x, γ, and β
        where the call gives one)."""
        paddle, sh = self._paddle, p.shape
        self._family_check(p)
        x = paddle.to_tensor(self.stored(p.x, p.dtype), stop_gradient=not grad)
        w = paddle.to_tensor(self.family_gamma(p), stop_gradient=not grad)
        b = None if p.beta is None else paddle.to_tensor(self.stored(p.beta, p.params), stop_gradient=not grad)
        leaves = [x, w] + ([] if b is None else [b])
        if p.call.weight_offset:  # Gemma's 1 + w, formed by Paddle in γ's dtype (its gradient is w's)
            w = w + p.call.weight_offset
        if sh.norm == "layer":  # (γ and β flat: Paddle's LayerNorm holds them so)
            y = paddle.nn.functional.layer_norm(x, list(sh.normalized), w, b, eps)
        elif sh.norm == "rms":
            y = self._incubate.fused_rms_norm(x, w, None, eps, len(sh.shape) - len(sh.normalized))[0]
        else:  # (data_format NCHW stands for any channels-first rank: Paddle reads only whether it is channels-last)
            y = paddle.nn.functional.group_norm(x, sh.groups, eps, w, b, "NCHW")
        return y, leaves

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        y, _ = self._family_run(p, eps=eps, grad=False)
        return ForwardOutput(y.numpy(), None, meta={"paddle": self._paddle.__version__})

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved | None, *,
                              eps: float) -> BackwardOutput:
        if p.shape.norm == "rms":
            raise BNProbeError("adapter paddle: Paddle has no CPU backward for RMSNorm (fused_rms_norm's gradient "
                               "kernel is not registered on the CPU): run its forward only (--mode train)")
        y, leaves = self._family_run(p, eps=eps, grad=True)
        grads = self._paddle.grad([y], leaves, [self._paddle.to_tensor(self.stored(dy, p.dtype))])
        ps = p.shape.param_shape
        return BackwardOutput(grads[0].numpy(), grads[1].numpy().reshape(ps),
                              grads[2].numpy().reshape(ps) if len(grads) > 2 else None,
                              meta={"paddle": self._paddle.__version__,
                                    "note": "Paddle's autograd recomputes the statistics: none are saved or read"})

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
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import FrameworkAdapter, parse_options

__all__ = ["PaddleAdapter"]


class PaddleAdapter(FrameworkAdapter):
    convention = "paddle"
    formats = ("fp64", "fp32")

    def __init__(self, opts: str = "") -> None:
        parse_options("paddle", opts, {})
        self.name = "paddle"
        os.environ.setdefault("GLOG_minloglevel", "2")
        with warnings.catch_warnings():  # its import warns of a missing ccache: nothing of bnprobe's
            warnings.simplefilter("ignore")
            import paddle
            from paddle import _C_ops
        paddle.set_device("cpu")
        self._paddle, self._ops = paddle, _C_ops

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

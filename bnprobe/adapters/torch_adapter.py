"""PyTorch's own BatchNorm (aten native_batch_norm and its backward) on CPU, CUDA or an Ascend NPU, and its
LayerNorm, RMSNorm, GroupNorm and InstanceNorm (native_layer_norm, rms_norm, native_group_norm, instance_norm as
batch_norm on the (1, N·C, ...) view) with their backward."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from bnprobe.adapters.base import (BackwardOutput, BaseAdapter, Capabilities, FamilyPrepared, ForwardOutput, Prepared,
                                   Saved)
from bnprobe.core.call import NORMS
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["TorchAdapter", "torch_unavailable"]


def torch_unavailable(device: str = "cpu") -> str | None:
    """Why torch on ``device`` cannot run here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'bnprobe[torch]')"
    if device == "cuda" and not torch.cuda.is_available():
        return "torch has no CUDA device on this machine"
    if device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return "torch_npu is not installed (Ascend's PyTorch plugin)"
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return "torch_npu finds no Ascend NPU on this machine"
    return None


class TorchAdapter(BaseAdapter):
    """``torch`` (CPU), ``torch:cuda``, ``torch_npu``: the framework's kernels in the requested dtype."""

    def __init__(self, device: str = "cpu") -> None:
        why = torch_unavailable(device)
        if why:
            raise BNProbeError(why)
        import torch

        self.torch = torch
        self.device = device
        self.name = {"cpu": "torch", "cuda": "torch:cuda", "npu": "torch_npu"}[device]
        # the family layers run through aten's own ops (a subclass that runs BatchNorm another way, compiled, says
        # whether it runs them)
        self._family_ops = True

    def capabilities(self) -> Capabilities:
        # CUDA and NPU reductions use atomics in some configurations; CPU is deterministic, its channels-last
        # statistics split across the threads torch runs with
        return Capabilities(formats=("fp64", "fp32", "fp16", "bf16"), saved="invstd",
                            deterministic=self.device == "cpu",
                            threads=self.torch.get_num_threads() if self.device == "cpu" else None,
                            norms=NORMS if self._family_ops else ("batch",))

    # ---- conversions ---------------------------------------------------------------------------
    def _tensor(self, a: np.ndarray | None, fmt: str, p: Prepared | None = None) -> Any:
        if a is None:
            return None
        t = self.torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float64)))
        t = t.to(get_format(fmt).torch_dtype)  # exact: the values already belong to the format
        if p is not None and p.lay.layout == "channels_last" and t.ndim > 2:
            t = t.movedim(-1, 1)  # torch takes NC...; keep the channels-last memory format where it has one
            fmt_map = {4: self.torch.channels_last, 5: self.torch.channels_last_3d}
            if t.ndim in fmt_map:
                t = t.contiguous(memory_format=fmt_map[t.ndim])
        return t.to(self.device)

    def _array(self, t: Any, fmt: str, p: Prepared | None = None) -> np.ndarray:
        if p is not None and p.lay.layout == "channels_last" and t.ndim > 2:
            t = t.movedim(1, -1)
        a = t.detach().to("cpu").to(self.torch.float64).contiguous().numpy()
        return a.astype(get_format(fmt).dtype)

    def _stats_format(self, p: Prepared) -> str:
        """aten keeps the saved statistics in the parameters' dtype (fp32 under mixed precision)."""
        return p.params

    def _op(self, kind: str, *args: Any) -> Any:
        """aten's BatchNorm op of ``kind`` on ``args``: ``train`` and ``infer`` are native_batch_norm's (x, w, b,
        running mean, running var, training, momentum, eps), ``backward`` native_batch_norm_backward's (dy, x, w,
        running mean, running var, saved mean, saved invstd, training, eps).  A subclass runs them another way
        (compiled)."""
        ops = self.torch.ops.aten
        with self.torch.no_grad():
            if kind == "backward":
                return ops.native_batch_norm_backward(*args, [True, True, True])
            return ops.native_batch_norm(*args)

    def _meta(self, train: Prepared | None = None) -> dict[str, Any]:
        """What the adapter says of a call it ran (``train``: the training forward's call, whose meta also names the
        device)."""
        # (on the CPU the channels-last kernels' results depend on the thread count)
        threads = {"threads": self.torch.get_num_threads()} if self.device == "cpu" else {}
        return {"torch": self.torch.__version__, **threads, **({"device": self.device} if train is not None else {})}

    # ---- kernels ---------------------------------------------------------------------------------
    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        v = p.vectors
        x = self._tensor(p.x, p.dtype, p)
        w, b = self._tensor(v["gamma"], p.params), self._tensor(v["beta"], p.params)
        rm, rv = self._tensor(v["running_mean"], p.params), self._tensor(v["running_var"], p.params)
        # momentum=None is PyTorch's cumulative average; for the first batch its factor is 1
        y, smean, sinv = self._op("train", x, w, b, rm, rv, True, 1.0 if momentum is None else momentum, eps)
        sf = self._stats_format(p)
        return ForwardOutput(
            self._array(y, p.dtype, p), Saved(self._array(smean, sf), "invstd", self._array(sinv, sf)),
            None if rm is None else self._array(rm, p.params), None if rv is None else self._array(rv, p.params),
            meta=self._meta(train=p))

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        v = p.vectors
        x = self._tensor(p.x, p.dtype, p)
        y, _, _ = self._op("infer", x, self._tensor(v["gamma"], p.params), self._tensor(v["beta"], p.params),
                           self._tensor(v["running_mean"], p.params), self._tensor(v["running_var"], p.params), False,
                           0.0, eps)
        return ForwardOutput(self._array(y, p.dtype, p), meta=self._meta())

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        sf = self._stats_format(p)
        x = self._tensor(p.x, p.dtype, p)
        g = self._tensor(dy, p.dtype, p)
        w = self._tensor(p.vectors["gamma"], p.params)
        mean = saved.mean
        if training:
            args = (None, None, self._tensor(mean, sf), self._tensor(saved.invstd(eps), sf))
        else:  # inference: torch reads the running statistics
            args = (self._tensor(mean, p.params), self._tensor(saved.var(eps), p.params), None, None)
        dx, dw, db = self._op("backward", g, x, w, *args, training, eps)
        return BackwardOutput(self._array(dx, p.dtype, p), self._array(dw, p.params), self._array(db, p.params),
                              meta=self._meta())

    # ---- the family layers ----------------------------------------------------------------------------
    def _family_tensors(self, p: FamilyPrepared) -> tuple[Any, Any, Any]:
        """x, γ and β as torch tensors (γ, β shaped as the layer holds them; γ 1 where the call gives none, so that
        dγ is returned)."""
        sh = p.shape
        x = self._tensor(p.x, p.dtype)
        g = np.ones(sh.param_shape) if p.gamma is None else p.gamma.reshape(sh.param_shape)
        w = self._tensor(g, p.params)
        if p.call.weight_offset:  # Gemma's 1 + w, formed by torch in γ's dtype
            w = w + p.call.weight_offset
        b = None if p.beta is None else self._tensor(p.beta.reshape(sh.param_shape), p.params)
        return x, w, b

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        torch, ops, sh = self.torch, self.torch.ops.aten, p.shape
        x, w, b = self._family_tensors(p)
        with torch.no_grad():
            if sh.norm == "layer":
                y, mean, rstd = ops.native_layer_norm(x, list(sh.normalized), w, b, eps)
            elif sh.norm == "rms":
                with warnings.catch_warnings():  # (torch warns once that mixed dtypes take its composite kernel)
                    warnings.simplefilter("ignore", UserWarning)
                    y = torch.rms_norm(x, list(sh.normalized), w, eps)
                mean, rstd = None, self._rms_rstd(x, w, sh, eps)
            elif sh.norm == "group":
                n, c = sh.shape[0], sh.shape[1]
                y, mean, rstd = ops.native_group_norm(x, w, b, n, c, sh.r * sh.groups // c, sh.groups, eps)
            else:  # instance: batch_norm on the (1, N·C, ...) view, γ and β repeated per sample (torch's instance_norm)
                n = sh.shape[0]
                xv = x.reshape(1, sh.rows, *sh.shape[2:])
                y, mean, rstd = ops.native_batch_norm(xv, w.repeat(n), None if b is None else b.repeat(n), None,
                                                      None, True, 0.0, eps)
                y = y.reshape(sh.shape)
        sf = self._format_of(rstd)
        saved = Saved(None if mean is None else self._array(mean.reshape(-1), sf), "invstd",
                      self._array(rstd.reshape(-1), sf))
        return ForwardOutput(self._array(y, p.dtype), saved, meta=self._meta())

    def _format_of(self, t: Any) -> str:
        """The format of a torch tensor's dtype."""
        torch = self.torch
        return {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[t.dtype]

    def _rms_rstd(self, x: Any, w: Any, sh: Any, eps: float) -> Any:
        """RMSNorm's rstd as torch computes it: _fused_rms_norm's where torch runs it (γ in x's dtype), else
        rms_norm_composite's — rsqrt(mean(x²) + ε) of x upcast to its op-math type."""
        torch = self.torch
        if w.dtype == x.dtype:
            return torch.ops.aten._fused_rms_norm(x, list(sh.normalized), w, eps)[1]
        xo = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        dims = tuple(range(x.ndim - len(sh.normalized), x.ndim))
        return torch.rsqrt(xo.pow(2).mean(dims, keepdim=True) + eps)

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved, *, eps: float) -> BackwardOutput:
        torch, ops, sh = self.torch, self.torch.ops.aten, p.shape
        x, w, b = self._family_tensors(p)
        g = self._tensor(dy, p.dtype)
        sf = get_format(np.asarray(saved.value).dtype).name
        lead = sh.shape[:len(sh.shape) - len(sh.normalized)]
        meta = self._meta()
        with torch.no_grad():
            if sh.norm == "layer":
                stat_shape = (*lead, *(1,) * len(sh.normalized))
                mean = self._tensor(np.reshape(saved.mean, stat_shape), sf)
                rstd = self._tensor(np.reshape(saved.value, stat_shape), sf)
                dx, dw, db = ops.native_layer_norm_backward(g, x, list(sh.normalized), mean, rstd, w, b,
                                                            [True, True, b is not None])
            elif sh.norm == "group":
                n, c = sh.shape[0], sh.shape[1]
                mean = self._tensor(np.reshape(saved.mean, (n, sh.groups)), sf)
                rstd = self._tensor(np.reshape(saved.value, (n, sh.groups)), sf)
                dx, dw, db = ops.native_group_norm_backward(g, x, mean, rstd, w, n, c, sh.r * sh.groups // c,
                                                            sh.groups, [True, True, True])
            elif sh.norm == "instance":
                n = sh.shape[0]
                xv, gv = x.reshape(1, sh.rows, *sh.shape[2:]), g.reshape(1, sh.rows, *sh.shape[2:])
                dx, dwr, dbr = ops.native_batch_norm_backward(
                    gv, xv, w.repeat(n), None, None, self._tensor(np.asarray(saved.mean), sf),
                    self._tensor(np.asarray(saved.value), sf), True, eps, [True, True, True])
                dx = dx.reshape(sh.shape)
                dw, db = dwr.reshape(n, -1).sum(0), dbr.reshape(n, -1).sum(0)  # (the repeated γ's grads summed)
            else:
                dx = dw = db = None
        if sh.norm == "rms":  # torch's RMSNorm backward through autograd: it recomputes its statistics
            xg, wg = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dx, dw = torch.autograd.grad(torch.rms_norm(xg, list(sh.normalized), wg, eps), (xg, wg), g)
            meta["missing"] = ("dbeta",)
            meta["note"] = "torch's RMSNorm backward (autograd) recomputes its statistics: the saved ones are not read"
        dw = dw.reshape(-1)
        return BackwardOutput(self._array(dx, p.dtype), self._array(dw, p.params).reshape(sh.param_shape),
                              None if db is None else self._array(db.reshape(-1), p.params).reshape(sh.param_shape),
                              meta=meta)

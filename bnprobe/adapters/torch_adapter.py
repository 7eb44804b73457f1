"""PyTorch's own BatchNorm (aten native_batch_norm and its backward) on CPU, CUDA or an Ascend NPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, BaseAdapter, Capabilities, ForwardOutput, Prepared, Saved
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

    def capabilities(self) -> Capabilities:
        # CUDA and NPU reductions use atomics in some configurations; CPU is deterministic, its channels-last
        # statistics split across the threads torch runs with
        return Capabilities(formats=("fp64", "fp32", "fp16", "bf16"), saved="invstd",
                            deterministic=self.device == "cpu",
                            threads=self.torch.get_num_threads() if self.device == "cpu" else None)

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

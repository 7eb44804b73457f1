"""msprobe dumps of torch_npu's fused RMSNorm calls (``NPU.npu_rms_norm``, ``NPU.npu_add_rms_norm``), written by hand in
exactly the layout msprobe writes, for bnprobe's tests: there is no NPU here to make them.

This module imports nothing from bnprobe (an independent oracle).  The layout follows mindstudio-probe 26.2's own
code (paths under ``msprobe/``):

- the record name: ``api_registry.py:88`` joins the prefix and the API (``NPU.npu_rms_norm``), the prefix of
  torch_npu's APIs being ``NPU`` (``core/common/const.py:444, 490``); ``core/dump/hook_manager.py:229`` appends the
  call's count and ``.forward`` (the backward: ``.backward``);
- a forward record: ``input_args`` (positional), ``input_kwargs`` and ``output``
  (``core/dump/data_dump/data_processor/base.py:547-576``); a tensor entry holds type, dtype, shape, Max, Min, Mean,
  Norm, requires_grad and data_name (``pytorch_processor.py:478-546``), a float ``{"type": "float", "value": ...}``
  (``base.py:221-240``); the data_name is ``<record>.<input|kwargs|output>.<index>.pt`` (``base.py:664-672``), the
  file a ``torch.save`` of the tensor's contiguous clone (``pytorch_processor.py:189-194``, ``pytorch/common/
  utils.py:337-341``);
- the backward record: msprobe hooks the autograd node behind the call's first output
  (``pytorch/dump/api_dump/pt_hook_manager.py:110-150``) and records that node's output gradients as ``input`` and
  its input gradients as ``output`` (``core/dump/hook_manager.py:325-346``).  torch_npu's ``npu_rms_norm`` derivative
  (``Ascend/op-plugin op_plugin/config/derivatives.yaml``: ``output_differentiability: [true, false]``,
  ``self, gamma: npu_rms_norm_backward(grad, self, gamma, result1)``) makes that ``input: [dy]``,
  ``output: [dx, dgamma]``; ``npu_add_rms_norm`` has no derivative there: its records are forward only;
- ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)`` (the AddRmsNorm op's outputs, ``hicann/ops-nn
  norm/add_rms_norm/op_graph/add_rms_norm_proto.h``): x = x1 + x2, the normalised input; rstd is fp32 and keeps γ's
  dims as ones (``[*leading, 1, ...]``).

The values come from a CPU stand-in of a correct kernel, in torch float32 (the ops-nn golden's formulas):
rstd = rsqrt(mean(x²) + ε), y = x·rstd·γ rounded once; dx = (dy·γ − x·rstd·mean(dy·γ·x·rstd))·rstd,
dγ = Σ x·rstd·dy (``aclnnRmsNormGrad``'s formula).  ``bug="rstd-bf16"`` rounds rstd to bf16 before it multiplies
(a premature rounding, as vllm-project/vllm-xpu-kernels#536 reports of an RMSNorm kernel).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Writer:
    """One dump.json under construction and its tensor files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
        self.data: dict = {}

    def tensor(self, t: torch.Tensor, name: str, requires_grad: bool) -> dict:
        t = t.detach()
        torch.save(t.clone().contiguous(), self.folder / "dump_tensor_data" / name)
        return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": t.max().item(),
                "Min": t.min().item(), "Mean": t.mean().item(), "Norm": t.norm().item(),
                "requires_grad": requires_grad, "data_name": name}

    def finish(self) -> None:
        doc = {"task": "tensor", "level": "L1", "framework": "pytorch",
               "dump_data_dir": str(self.folder / "dump_tensor_data"), "data": self.data}
        (self.folder / "dump.json").write_text(json.dumps(doc, indent=1))
        (self.folder / "stack.json").write_text("{}")
        (self.folder / "construct.json").write_text("{}")


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float, bug: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """y (x's dtype) and rstd (fp32, γ's dims kept as ones) of a correct kernel (or of ``bug``'s)."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + eps)
    used = rstd.bfloat16().float() if bug == "rstd-bf16" else rstd
    return (x32 * used * gamma.float()).to(x.dtype), rstd


def _rms_grad(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype) and dγ (γ's dtype) by aclnnRmsNormGrad's formula, in fp32."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    dy32, x32, g32 = dy.float(), x.float(), gamma.float()
    mean_gy = (dy32 * g32 * x32 * rstd).mean(dim=dims, keepdim=True)
    dx = (dy32 * g32 - x32 * rstd * mean_gy) * rstd
    dgamma = (x32 * rstd * dy32).reshape(-1, *gamma.shape).sum(0)
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def write_npu_dump(root: Path, dtype: str = "fp32", *, bug: str | None = None, seed: int = 0) -> dict:
    """An msprobe dump (``root/step0/rank0/``) of three calls: ``NPU.npu_rms_norm.0`` (x (2, 5, 64), γ (64,),
    ``epsilon=1e-6`` as a keyword) with its backward, ``NPU.npu_rms_norm.1`` over γ (5, 64)'s two dims (ε left to the
    default) with its backward, and ``NPU.npu_add_rms_norm.0`` (x1, x2 (2, 5, 64), γ (64,), ε 1e-5 positional);
    returns the values written, per call, as float32 arrays."""
    g = torch.Generator().manual_seed(seed)
    dt = TORCH[dtype]
    folder = Path(root) / "step0" / "rank0"
    w = _Writer(folder)
    truth: dict = {}

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=g) + shift).to(dt)

    for n, (gshape, eps) in enumerate((((64,), 1e-6), ((5, 64), None))):
        name = f"NPU.npu_rms_norm.{n}"
        x, gamma, dy = randn(2, 5, 64, scale=1.5, shift=0.3), randn(*gshape, scale=0.2, shift=1.0), randn(2, 5, 64)
        y, rstd = _rms(x, gamma, 1e-6 if eps is None else eps, bug)
        dx, dgamma = _rms_grad(dy, x, gamma, rstd)
        args = [w.tensor(x, f"{name}.forward.input.0.pt", True), w.tensor(gamma, f"{name}.forward.input.1.pt", True)]
        kwargs = {}
        if eps is not None:
            kwargs["epsilon"] = {"type": "float", "value": eps}
        w.data[f"{name}.forward"] = {"input_args": args, "input_kwargs": kwargs,
                                     "output": [w.tensor(y, f"{name}.forward.output.0.pt", True),
                                                w.tensor(rstd, f"{name}.forward.output.1.pt", False)]}
        w.data[f"{name}.backward"] = {"input": [w.tensor(dy, f"{name}.backward.input.0.pt", False)],
                                      "output": [w.tensor(dx, f"{name}.backward.output.0.pt", False),
                                                 w.tensor(dgamma, f"{name}.backward.output.1.pt", False)]}
        truth[name] = {"x": x, "gamma": gamma, "y": y, "rstd": rstd, "dy": dy, "dx": dx, "dgamma": dgamma,
                       "eps": 1e-6 if eps is None else eps, "normalized_shape": list(gshape)}
    name = "NPU.npu_add_rms_norm.0"
    x1, x2, gamma = randn(2, 5, 64, shift=0.5), randn(2, 5, 64, scale=0.5), randn(64, scale=0.2, shift=1.0)
    x = (x1.float() + x2.float()).to(dt)  # the residual sum, rounded once to the inputs' format
    y, rstd = _rms(x, gamma, 1e-5, bug)
    w.data[f"{name}.forward"] = {
        "input_args": [w.tensor(x1, f"{name}.forward.input.0.pt", False),
                       w.tensor(x2, f"{name}.forward.input.1.pt", False),
                       w.tensor(gamma, f"{name}.forward.input.2.pt", False), {"type": "float", "value": 1e-5}],
        "input_kwargs": {},
        "output": [w.tensor(y, f"{name}.forward.output.0.pt", False),
                   w.tensor(rstd, f"{name}.forward.output.1.pt", False),
                   w.tensor(x, f"{name}.forward.output.2.pt", False)]}
    truth[name] = {"x1": x1, "x2": x2, "x": x, "gamma": gamma, "y": y, "rstd": rstd, "eps": 1e-5,
                   "normalized_shape": [64]}
    w.finish()
    return {call: {k: (v.detach().float().numpy() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
            for call, d in truth.items()}

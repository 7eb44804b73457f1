"""The normalisation family's modules in a live PyTorch model, recognised and recorded as a capture records
BatchNorm's: ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm``, ``torch.nn.GroupNorm``, ``torch.nn.InstanceNorm1d/2d/3d``
(without running statistics) and Hugging Face-style RMSNorm modules — a class whose name ends in ``RMSNorm`` with a
1-D ``weight`` and an ``eps`` or ``variance_epsilon`` (Llama's, Qwen's, Mistral's...; Gemma's applies γ as 1 + w).

What each call records: x, γ and β as the module holds them, ε; y; in training the statistics the kernel saved
(LayerNorm's and GroupNorm's mean and rstd from their autograd node, InstanceNorm's from the BatchNorm node under
its view; RMSNorm's composite saves none); and with a backward dy and dx, dγ, dβ from that node's hook (RMSNorm's:
dx and dy from the module's backward hook, dγ from its weight's).  Each call's layer, normalised shape, groups and
weight offset go into its dump's meta, so that every command reads it back as that layer's call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError

__all__ = ["FamilyModule", "family_module", "FAMILY_NODES", "saved_statistics", "record_family_grads",
           "kernel_node", "kernel_node_of"]

# the autograd nodes whose saved results are a family kernel's mean and rstd (_saved_result1, _saved_result2)
FAMILY_NODES = ("NativeLayerNormBackward0", "NativeGroupNormBackward0")
_INSTANCE_NODE = "NativeBatchNormBackward0"  # InstanceNorm's kernel, under a view of y


@dataclass(frozen=True)
class FamilyModule:
    """What a family module is: its layer (``norm``), normalised shape or groups, ε (None: torch's default for the
    input's format, resolved per call), whether it holds γ and β, and γ's offset."""

    norm: str
    normalized_shape: tuple[int, ...] | None
    groups: int | None
    eps: float | None
    affine: bool
    has_bias: bool
    weight_offset: float = 0.0

    def eps_for(self, x: Any) -> float:
        """ε as the kernel uses it on ``x``: the module's, or torch's RMSNorm default, the machine epsilon of the
        input's op-math format (float for fp16 and bf16)."""
        if self.eps is not None:
            return float(self.eps)
        import torch

        dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        return float(torch.finfo(dt).eps)

    def meta(self, x: Any) -> dict[str, Any]:
        return {"norm": self.norm, "normalized_shape": None if self.normalized_shape is None else
                list(self.normalized_shape), "groups": self.groups, "weight_offset": self.weight_offset,
                **({"eps_default": True} if self.eps is None else {})}


def family_module(m: Any) -> FamilyModule | None:
    """``m`` as a family module, or None (BatchNorm's, or not a normalisation).  InstanceNorm with running
    statistics is not one here (its running update is not recorded)."""
    import torch.nn as nn

    if isinstance(m, nn.LayerNorm):
        return FamilyModule("layer", tuple(m.normalized_shape), None, float(m.eps), m.weight is not None,
                            m.bias is not None)
    if isinstance(m, getattr(nn, "RMSNorm", ())):
        return FamilyModule("rms", tuple(m.normalized_shape), None, None if m.eps is None else float(m.eps),
                            m.weight is not None, False)
    if isinstance(m, nn.GroupNorm):
        return FamilyModule("group", None, int(m.num_groups), float(m.eps), m.weight is not None, m.bias is not None)
    if isinstance(m, nn.modules.instancenorm._InstanceNorm):
        if m.track_running_stats:
            return None
        return FamilyModule("instance", None, None, float(m.eps), m.weight is not None, m.bias is not None)
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if type(m).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter) and w.dim() == 1 and \
            isinstance(eps, (int, float)):
        return FamilyModule("rms", (int(w.shape[0]),), None, float(eps), True, False,
                            1.0 if "Gemma" in type(m).__name__ else 0.0)
    return None


def kernel_node(y: Any) -> tuple[Any, str | None]:
    """y's autograd node that saved the family kernel's statistics (InstanceNorm's BatchNorm node under y's view),
    and its name; (y's node, None) when there is none (RMSNorm's composite, no autograd)."""
    return kernel_node_of(getattr(y, "grad_fn", None))


def kernel_node_of(node: Any) -> tuple[Any, str | None]:
    """:func:`kernel_node` from y's autograd node ``node`` (a monitor keeps the node, not y)."""
    name = type(node).__name__ if node is not None else None
    if name in FAMILY_NODES:
        return node, name
    if name == "ViewBackward0" and node.next_functions and node.next_functions[0][0] is not None and \
            type(node.next_functions[0][0]).__name__ == _INSTANCE_NODE:
        return node.next_functions[0][0], _INSTANCE_NODE
    return node, None


def saved_statistics(node: Any) -> tuple[Any, Any]:
    """The mean and rstd a family kernel's node saved, as tensors."""
    return node._saved_result1, node._saved_result2


def record_family_grads(grad_inputs: tuple[Any, ...], samples: int, kind: str | None) -> dict[str, Any]:
    """dx, dγ, dβ from a family kernel node's hook (``grad_inputs``), by name; InstanceNorm's BatchNorm node gives
    dγ and dβ for γ repeated over the ``samples``, summed here as its autograd sums them."""
    out: dict[str, Any] = {}
    for i, name in enumerate(("dx", "dgamma", "dbeta")):
        g = grad_inputs[i] if i < len(grad_inputs) else None
        if g is None:
            continue
        if kind == _INSTANCE_NODE and name != "dx":
            g = g.reshape(samples, -1).sum(0)
        out[name] = g
    if kind == _INSTANCE_NODE and "dx" in out:
        out["dx_view"] = True
    return out


def check_input(name: str, x: Any) -> None:
    """A family module's input as the capture takes it: a floating-point tensor."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise BNProbeError(f"{name}: called without a tensor input")


def ones_like_params(fm: FamilyModule, x: Any, dtype: Any) -> np.ndarray:
    """γ of a module without one: ones of its parameter shape in ``dtype``."""
    shape = fm.normalized_shape if fm.norm in ("layer", "rms") else (int(x.shape[1]),)
    return np.ones(shape, dtype=dtype)

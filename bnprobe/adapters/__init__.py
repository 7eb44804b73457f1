"""Kernel adapters: every BatchNorm implementation behind one small interface."""

from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    ForwardOutput,
    KernelAdapter,
    Saved,
)
from bnprobe.adapters.registry import get_adapter, list_adapters

__all__ = ["KernelAdapter", "BaseAdapter", "Capabilities", "ForwardOutput", "BackwardOutput", "Saved",
           "get_adapter", "list_adapters"]

"""Kernel adapters: every BatchNorm implementation behind one small interface.

A plugin needs only this module: subclass :class:`BaseAdapter` (fill in ``_forward_train_impl``,
``_forward_infer_impl``, ``_backward_impl``, each taking a :class:`Prepared` call), declare what it does in
:class:`Capabilities` (formats, modes, layouts, the statistics it saves, determinism, traces) and return
:class:`ForwardOutput` / :class:`BackwardOutput` with :class:`Saved` statistics; checks read the capabilities,
never the adapter's class.  :func:`get_adapter` resolves a spec (``emulated:fp16``, ``torch``, ``dump:DIR``,
``module:Class``).
"""

from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    ForwardOutput,
    KernelAdapter,
    Prepared,
    Saved,
)
from bnprobe.adapters.registry import get_adapter, list_adapters

__all__ = ["KernelAdapter", "BaseAdapter", "Capabilities", "ForwardOutput", "BackwardOutput", "Prepared", "Saved",
           "get_adapter", "list_adapters"]

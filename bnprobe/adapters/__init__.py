"""Kernel adapters: every BatchNorm implementation behind one small interface.

A plugin needs only this module: subclass :class:`BaseAdapter` (fill in ``_forward_train_impl``,
``_forward_infer_impl``, ``_backward_impl``, each taking a :class:`Prepared` call), declare what it does in
:class:`Capabilities` (formats, modes, layouts, the statistics it saves, determinism, traces) and return
:class:`ForwardOutput` / :class:`BackwardOutput` with :class:`Saved` statistics; checks read the capabilities,
never the adapter's class.  An adapter takes the call: ``train(call)``, ``infer(call)`` and
``backward_of(call, saved)``, each given one :class:`BNCall`; a plugin written to the loose signature of earlier
releases (``forward_train(x, gamma, ..., dtype=...)``, ``forward_infer``, ``backward``) still runs, for one release
(:mod:`bnprobe.adapters.loose`).  :func:`get_adapter` resolves a spec (``emulated:fp16``, ``torch``, ``dump:DIR``,
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
from bnprobe.core.call import BNCall

__all__ = ["KernelAdapter", "BaseAdapter", "BNCall", "Capabilities", "ForwardOutput", "BackwardOutput", "Prepared",
           "Saved", "get_adapter", "list_adapters"]

"""Plugins written to the loose signature of earlier releases, run through the call-taking interface (kept for one
release).

An adapter takes the call (:class:`~bnprobe.adapters.base.KernelAdapter`: ``train(call)``, ``infer(call)``,
``backward_of(call, saved)``).  A plugin that implements only the loose methods — ``forward_train(x, gamma, beta,
running_mean, running_var, *, dtype, momentum, eps, layout, params)``, ``forward_infer(x, gamma, beta,
running_mean, running_var, *, dtype, eps, layout, params)`` and ``backward(dy, x, gamma, saved, *, dtype, eps,
training, layout, params)``, or a :class:`~bnprobe.adapters.base.BaseAdapter` subclass overriding those rather
than their ``_impl`` hooks — is wrapped here by the registry (:func:`with_call_methods`): :class:`LooseSignature`
unpacks each call into those arguments.  This module is the only place bnprobe calls the loose signature
(``tests/adapters/test_loose.py`` checks it).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from bnprobe.adapters.base import BackwardOutput, Capabilities, ForwardOutput, Saved
from bnprobe.core.call import BNCall

__all__ = ["LOOSE_METHODS", "CALL_METHODS", "LooseKernelAdapter", "LooseSignature", "is_loose", "with_call_methods"]

# each call-taking method and the loose one it replaces
CALL_METHODS = ("train", "infer", "backward_of")
LOOSE_METHODS = ("forward_train", "forward_infer", "backward")


@runtime_checkable
class LooseKernelAdapter(Protocol):
    """An adapter of earlier releases: the call's fields as arguments (see the module's docstring)."""

    name: str

    def capabilities(self) -> Capabilities: ...

    def forward_train(self, *args: Any, **kwargs: Any) -> ForwardOutput: ...

    def forward_infer(self, *args: Any, **kwargs: Any) -> ForwardOutput: ...

    def backward(self, *args: Any, **kwargs: Any) -> BackwardOutput: ...


def _defined_in(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name`` (None: none does)."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def is_loose(obj: object) -> bool:
    """Whether ``obj`` (an adapter instance) answers a call through a loose method: it lacks a call-taking method
    that it has the loose one of, or its loose method overrides the call-taking one it inherits (a
    ``BaseAdapter`` subclass of earlier releases overriding ``forward_train``)."""
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    cls = type(obj)
    for new, old in zip(CALL_METHODS, LOOSE_METHODS):
        if old in own and new not in own:
            return True
        n, o = _defined_in(cls, new), _defined_in(cls, old)
        if o is not None and new not in own and (n is None or (o is not n and issubclass(o, n))):
            return True
    return False


class LooseSignature:
    """A loose-signature adapter ``inner`` behind the call-taking interface: each call unpacked into the loose
    method's arguments; everything else (name, capabilities, policy_for, keep_arrays...) is the inner adapter's."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def capabilities(self) -> Capabilities:
        # a loose plugin computes its outputs itself, even one built on a PolicyAdapter: never staged
        return replace(self._inner.capabilities(), staged=False)

    def train(self, call: BNCall) -> ForwardOutput:
        c = call
        return self._inner.forward_train(c.x, c.gamma, c.beta, c.running_mean, c.running_var, dtype=c.dtype,
                                          momentum=c.momentum, eps=c.eps, layout=c.layout, params=c.params)

    def infer(self, call: BNCall) -> ForwardOutput:
        c = call
        return self._inner.forward_infer(c.x, c.gamma, c.beta, c.running_mean, c.running_var, dtype=c.dtype,
                                          eps=c.eps, layout=c.layout, params=c.params)

    def backward_of(self, call: BNCall, saved: Saved) -> BackwardOutput:
        c = call
        return self._inner.backward(c.dy, c.x, c.gamma, saved, dtype=c.dtype, eps=c.eps, training=c.training,
                                    layout=c.layout, params=c.params)

    def unwrapped(self) -> Any:
        """The plugin's own object."""
        return self._inner

    def __getattr__(self, name: str) -> Any:  # name, policy_for, keep_arrays...: the inner adapter's
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        if name == "bind":  # a recording's adapter binds to one call: that one wrapped too
            bind = self._inner.bind
            return lambda rec: with_call_methods(bind(rec))
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # keep_arrays, counters (outputs_only): the inner's
        setattr(self._inner, name, value)

    def __copy__(self) -> LooseSignature:
        return LooseSignature(copy.copy(self._inner))

    def __repr__(self) -> str:
        return repr(self._inner)


def with_call_methods(adapter: Any) -> Any:
    """``adapter`` itself when it takes the call, else wrapped in :class:`LooseSignature` (one that has neither
    interface is returned as it is: the caller's checks say what it lacks)."""
    if isinstance(adapter, LooseSignature) or isinstance(adapter, type) or not is_loose(adapter):
        return adapter
    if not all(callable(getattr(adapter, m, None)) for m in LOOSE_METHODS):
        return adapter
    return LooseSignature(adapter)

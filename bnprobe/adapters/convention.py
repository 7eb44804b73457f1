"""Adapters in a framework's convention: ``--convention`` for a plugin or a dump, and the golden and the bench a
kernel is judged against in the convention it declares (:mod:`bnprobe.core.conventions`)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from bnprobe.adapters.base import BackwardOutput, Capabilities, ForwardOutput, KernelAdapter, Saved
from bnprobe.core.call import BNCall
from bnprobe.core.conventions import Convention, convention_of, get_convention

__all__ = ["in_convention", "reference_for", "bench_for"]


class _InConvention:
    """``inner`` with the convention ``conv`` declared in place of its own: everything else is the inner adapter's
    (its computations are not touched: a convention changes what the kernel is judged against, not the kernel)."""

    def __init__(self, inner: Any, conv: Convention) -> None:
        self._inner, self._conv = inner, conv
        self.name = inner.name

    def capabilities(self) -> Capabilities:
        return replace(self._inner.capabilities(), convention=self._conv.name)

    def train(self, call: BNCall) -> ForwardOutput:
        return self._inner.train(call)  # type: ignore[no-any-return]

    def infer(self, call: BNCall) -> ForwardOutput:
        return self._inner.infer(call)  # type: ignore[no-any-return]

    def backward_of(self, call: BNCall, saved: Saved) -> BackwardOutput:
        return self._inner.backward_of(call, saved)  # type: ignore[no-any-return]

    def bind(self, rec: Any) -> _InConvention:
        return _InConvention(self._inner.bind(rec), self._conv)

    def __getattr__(self, name: str) -> Any:  # calls, policy_for, keep_arrays...: the inner adapter's
        if name.startswith("__") or name in ("_inner", "_conv"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_inner", "_conv", "name"):
            object.__setattr__(self, name, value)
        else:  # keep_arrays, counters (outputs_only): the inner adapter's, on this view's own copy of it
            setattr(self._inner, name, value)

    def __copy__(self) -> _InConvention:
        return _InConvention(copy.copy(self._inner), self._conv)

    def __repr__(self) -> str:
        return f"<adapter {self.name}, {self._conv.name} convention>"


def in_convention(adapter: KernelAdapter, convention: str | Convention | None) -> KernelAdapter:
    """``adapter`` judged in ``convention`` (None: as it declares)."""
    if convention is None:
        return adapter
    from bnprobe.adapters.dump import DumpAdapter

    conv = get_convention(convention)
    if isinstance(adapter, _InConvention):
        adapter = adapter._inner  # type: ignore[assignment]
    if convention_of(adapter) is conv:
        return adapter
    if isinstance(adapter, DumpAdapter):  # the recording's own convention (kept by select and bind)
        twin = copy.copy(adapter)
        twin.calls = replace(adapter.calls, convention=conv.name)
        return twin
    return _InConvention(adapter, conv)  # type: ignore[return-value]


def reference_for(adapter: Any) -> KernelAdapter:
    """The FP64 golden in the convention ``adapter`` declares (an adapter, or a convention or its name)."""
    from bnprobe.adapters.emulated import ReferenceAdapter

    conv = get_convention(adapter) if isinstance(adapter, (str, Convention)) or adapter is None \
        else convention_of(adapter)
    return ReferenceAdapter(conv.name)


def bench_for(bench: Any, adapter: Any) -> Any:
    """The bench a kernel is judged against, in its convention: ``careful`` becomes the careful kernel in that
    convention; any other bench (torch, a plugin) is as given."""
    from bnprobe.adapters.emulated import CarefulAdapter

    conv = convention_of(adapter)
    if conv.name == "torch" or not (bench == "careful" or isinstance(bench, CarefulAdapter)):
        return bench
    return CarefulAdapter(convention=conv.name)

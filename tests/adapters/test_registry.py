import sys
import types

import numpy as np
import pytest

from bnprobe.adapters import BaseAdapter, Capabilities, ForwardOutput, Saved, get_adapter, list_adapters
from bnprobe.adapters import registry
from bnprobe.errors import BNProbeError


def test_list_has_every_builtin_with_availability():
    rows = {r["name"]: r for r in list_adapters()}
    for name in ("reference", "emulated", "careful", "ascend-tbe", "ascend-bnv3", "ascend-950", "torch", "torch:cuda",
                 "torch_npu", "dump"):
        assert name in rows
        assert rows[name]["available"] or rows[name]["why"]
    assert rows["reference"]["available"] and rows["ascend-tbe"]["available"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(BNProbeError,
                       match=r"unknown adapter 'nvidia'; known: reference, emulated, careful, ascend-tbe"):
        get_adapter("nvidia")


def test_unavailable_adapter_says_why():
    row = next(r for r in list_adapters() if r["name"] == "torch:cuda")
    if not row["available"]:
        with pytest.raises(BNProbeError, match="unavailable here: torch has no CUDA"):
            get_adapter("torch:cuda")


class Tiny(BaseAdapter):
    name = "tiny"

    def capabilities(self):
        return Capabilities(formats=("fp32",))

    def _forward_train_impl(self, p, *, momentum, eps):
        c = p.lay.channels
        return ForwardOutput(np.zeros(p.lay.shape, np.float32), Saved(np.zeros(c), "invstd", np.ones(c)))


def test_plugin_by_module_path(monkeypatch):
    mod = types.ModuleType("my_kernels")
    mod.Tiny = Tiny
    mod.not_an_adapter = object()
    monkeypatch.setitem(sys.modules, "my_kernels", mod)
    a = get_adapter("my_kernels:Tiny")
    assert a.name == "tiny" and a.forward_train(np.ones((4, 2)), dtype="fp32").y.shape == (4, 2)
    with pytest.raises(BNProbeError, match="is not a KernelAdapter"):
        get_adapter("my_kernels:not_an_adapter")
    with pytest.raises(BNProbeError, match="has no 'Nope'"):
        get_adapter("my_kernels:Nope")
    with pytest.raises(BNProbeError, match="cannot import plugin module 'no_such.module'"):
        get_adapter("no_such.module:X")


def test_plugin_by_entry_point(monkeypatch):
    class EP:
        name, value = "vendor-bn", "vendor.bn:Tiny"

        def load(self):
            return Tiny

    class Broken(EP):
        name, value = "broken-bn", "vendor.broken:X"

        def load(self):
            raise ImportError("vendor SDK missing")

    monkeypatch.setattr(registry, "_entry_points", lambda: {"vendor-bn": EP(), "broken-bn": Broken()})
    assert get_adapter("vendor-bn").name == "tiny"
    rows = {r["name"]: r for r in list_adapters()}
    assert rows["vendor-bn"]["available"] and not rows["broken-bn"]["available"]
    assert "vendor SDK missing" in rows["broken-bn"]["why"]
    with pytest.raises(BNProbeError, match="failed to load: vendor SDK missing"):
        get_adapter("broken-bn")


def test_base_checks_what_an_adapter_returns():
    class Wrong(Tiny):
        def _forward_train_impl(self, p, *, momentum, eps):
            return ForwardOutput(np.zeros((1,)), None)

    with pytest.raises(AssertionError, match="returned y of shape"):
        Wrong().forward_train(np.ones((4, 2)), dtype="fp32")

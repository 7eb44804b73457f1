import abc
import math
import os
import re
import sys
import types

import numpy as np
import pytest

from bnprobe.adapters import BaseAdapter, Capabilities, ForwardOutput, Saved, get_adapter, list_adapters
from bnprobe.adapters import registry
from bnprobe.core.errors import BNProbeError


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


@pytest.mark.parametrize("typo,meant", [("emulatd", "emulated"), ("ascend-bnv2", "ascend-bnv3"),
                                        ("refrence", "reference"), ("emulatd:fp16", "emulated")])
def test_a_misspelt_name_is_told_the_nearest(typo, meant):
    with pytest.raises(BNProbeError, match=rf"unknown adapter '{typo}': did you mean '{meant}'\?"):
        get_adapter(typo)


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
    with pytest.raises(BNProbeError, match="is an object, not a KernelAdapter"):
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
    with pytest.raises(BNProbeError, match="failed to load: ImportError: vendor SDK missing"):
        get_adapter("broken-bn")


def test_base_checks_what_an_adapter_returns():
    class Wrong(Tiny):
        def _forward_train_impl(self, p, *, momentum, eps):
            return ForwardOutput(np.zeros((1,)), None)

    with pytest.raises(BNProbeError, match="returned y of shape"):
        Wrong().forward_train(np.ones((4, 2)), dtype="fp32")


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert type(exc_info.value) is BNProbeError and msg and "\n" not in msg
    return msg


@pytest.fixture
def plugin_modules(monkeypatch, tmp_path):
    """A module of plugin candidates, one that does not parse and one that raises as it is imported."""
    called = []
    mod = types.ModuleType("cand_kernels")

    def factory():
        called.append("factory")
        return Tiny()

    def wants_args(opts):
        called.append("wants_args")
        return Tiny()

    def makes_int():
        return 3

    def boom():
        raise RuntimeError("no device\nsecond line")

    class Loud(Tiny):
        def __init__(self):
            raise KeyError("vendor_lib")

    class NotAdapter:
        def __init__(self):
            called.append("NotAdapter")

    for f in (factory, wants_args, makes_int, boom):
        f.__module__ = "cand_kernels"
    mod.__dict__.update(factory=factory, wants_args=wants_args, makes_int=makes_int, boom=boom, Loud=Loud,
                        NotAdapter=NotAdapter, instance=Tiny(), sqrt=math.sqrt, abort=os.abort,
                        foreign=registry.list_adapters, number=3)
    monkeypatch.setitem(sys.modules, "cand_kernels", mod)
    (tmp_path / "cand_broken.py").write_text("def f(:\n")
    (tmp_path / "cand_raises.py").write_text("raise RuntimeError('vendor SDK not configured')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return called


@pytest.mark.parametrize("spec, message", [
    (":Name", r"':Name' is not package.module:name"),
    (".:X", r"'.:X' is not package.module:name"),
    ("a..b:X", r"'a..b:X' is not package.module:name"),
    ("cand_kernels:", r"is not package.module:name"),
    ("cand_kernels:a.b", r"is not package.module:name"),
    ("math:sqrt", r"'math:sqrt' is in the standard library \(math\)"),
    ("os:abort", r"'os:abort' is in the standard library \(os\)"),
    ("cand_broken:f", r"cannot import plugin module 'cand_broken': SyntaxError: "),
    ("cand_raises:f", r"cannot import plugin module 'cand_raises': RuntimeError: vendor SDK not configured"),
    ("cand_kernels:sqrt", r"is a built-in function, not a KernelAdapter class or instance, nor a factory function"),
    ("cand_kernels:abort", r"is a built-in function, not a KernelAdapter"),
    ("cand_kernels:foreign", r"is a function of module bnprobe.adapters.registry, not a KernelAdapter"),
    ("cand_kernels:number", r"is an int, not a KernelAdapter"),
    ("cand_kernels:NotAdapter", r"is the class NotAdapter, not a KernelAdapter"),
    ("cand_kernels:wants_args", r"cannot be called without arguments"),
    ("cand_kernels:makes_int", r"'cand_kernels:makes_int' made an int, not a KernelAdapter"),
    ("cand_kernels:boom", r"^plugin 'cand_kernels:boom' raised RuntimeError: no device$"),
    ("cand_kernels:Loud", r"^plugin 'cand_kernels:Loud' raised KeyError: 'vendor_lib'$"),
])
def test_plugin_of_the_wrong_kind_is_refused_before_it_is_called(plugin_modules, spec, message):
    with pytest.raises(BNProbeError) as e:
        get_adapter(spec)
    assert re.search(message, _one_line(e))
    assert plugin_modules == []  # neither the wrong kind nor a class that is no adapter was called


def test_plugin_factory_function_and_instance(plugin_modules):
    assert get_adapter("cand_kernels:factory").name == "tiny" and plugin_modules == ["factory"]
    assert get_adapter("cand_kernels:instance").name == "tiny"


def test_entry_point_of_the_wrong_kind(monkeypatch):
    loaded = []

    class EP:
        name, value, module = "vendor-bn", "os:abort", "os"

        def load(self):
            loaded.append(self.value)
            return os.abort

    class Builtin(EP):
        name, value, module = "vendor-sqrt", "cand_kernels:sqrt", "cand_kernels"

        def load(self):
            return math.sqrt

    monkeypatch.setattr(registry, "_entry_points", lambda: {"vendor-bn": EP(), "vendor-sqrt": Builtin()})
    with pytest.raises(BNProbeError, match=r"'vendor-bn' \(os:abort\) is in the standard library \(os\)") as e:
        get_adapter("vendor-bn")
    _one_line(e)
    assert loaded == []  # refused by its name, not even imported
    with pytest.raises(BNProbeError, match="is a built-in function, not a KernelAdapter") as e:
        get_adapter("vendor-sqrt")
    _one_line(e)


def seven(dy, x, gamma, mean, var, eps, extra):
    return dy


def halves(x):
    return x.shape[1] > 1


def by_channel(x, channels=None):
    return x.shape[1] > 1


by_channel.takes_channels = True


def no_channels(x):
    return True


no_channels.takes_channels = True


def crashes(x):
    raise ZeroDivisionError("division by zero\nin the user's code")


@pytest.mark.parametrize("spec, message", [
    ("os:getcwd", r"predicate 'os:getcwd' is in the standard library"),
    (":f", r"predicate ':f' is not package.module:name"),
    ("tests.adapters.test_registry:Tiny", r"is the class Tiny, not a Python function f\(x\)"),
    ("tests.adapters.test_registry:seven", r"takes \(dy, x, gamma, mean, var, eps, extra\): it is called as f\(x\)"),
    ("tests.adapters.test_registry:no_channels", r"sets takes_channels but has no channels= parameter"),
])
def test_predicate_of_the_wrong_kind(spec, message):
    from bnprobe.checks.shrink.shrinking import load_predicate

    with pytest.raises(BNProbeError) as e:
        load_predicate(spec)
    assert re.search(message, _one_line(e))


def test_user_predicate_runs_and_what_it_raises_is_one_line():
    from bnprobe.checks.shrink.shrinking import load_predicate, shrink

    x = np.random.default_rng(0).standard_normal((4, 6, 2))
    assert shrink(x, load_predicate("tests.adapters.test_registry:halves"), seconds=5).x.shape[1] == 2
    assert shrink(x, load_predicate("tests.adapters.test_registry:by_channel"), seconds=5).x.shape[1] == 2
    with pytest.raises(BNProbeError) as e:
        shrink(x, load_predicate("tests.adapters.test_registry:crashes"))
    assert _one_line(e) == ("predicate 'tests.adapters.test_registry:crashes' raised ZeroDivisionError: "
                            "division by zero")


@pytest.mark.parametrize("spec, message", [
    ("math:sqrt", r"formula 'math:sqrt' is in the standard library"),
    ("tests.adapters.test_registry:halves",
     r"takes \(x\): it is called as f\(dy, x, gamma, mean, var, eps\)"),
    ("tests.adapters.test_registry:seven", r"takes \(dy, x, gamma, mean, var, eps, extra\)"),
    ("tests.adapters.test_registry:np", r"is a module, not a Python function"),
])
def test_formula_of_the_wrong_kind(spec, message):
    from bnprobe.checks.gradcheck.gradients import check_formula

    with pytest.raises(BNProbeError) as e:
        check_formula(spec)
    assert re.search(message, _one_line(e))


# ---- abstract and unimplemented adapters; entry points listed without calling them -----------------------------

class OnlyCapabilities(BaseAdapter):
    name = "only-caps"

    def capabilities(self):
        return Capabilities(formats=("fp32",))


class Stubbed(Tiny):
    name = "stubbed"

    def _backward_impl(self, p, dy, saved, *, eps, training):
        raise NotImplementedError("coming in v2\nsecond line")


class ProtocolStub:
    """Has every method of the protocol, but capabilities() is a stub."""

    name = "protocol-stub"

    def capabilities(self):
        raise NotImplementedError

    forward_train = forward_infer = backward = capabilities


def makes_base():
    return BaseAdapter()


class Abstract(BaseAdapter, abc.ABC):
    @abc.abstractmethod
    def capabilities(self):
        ...


@pytest.mark.parametrize("spec, message", [
    ("bnprobe.adapters.base:BaseAdapter", r"is the class BaseAdapter, an adapter base class that does not implement "
                                          r"capabilities\(\)$"),
    ("tests.adapters.test_registry:Abstract", r"is the class Abstract, an abstract class \(it does not implement "
                                              r"capabilities\)$"),
    ("tests.adapters.test_registry:OnlyCapabilities", r"implements none of train, infer and backward_of"),
    ("tests.adapters.test_registry:makes_base", r"made an instance of BaseAdapter, an adapter base class that does "
                                                r"not implement capabilities\(\)$"),
    ("tests.adapters.test_registry:ProtocolStub", r"^plugin 'tests.adapters.test_registry:ProtocolStub': adapter "
                                                  r"'protocol-stub' does not implement capabilities\(\)$"),
])
def test_an_abstract_or_unimplemented_adapter_is_refused_before_it_runs(spec, message):
    """The base class itself used to be made and then fail with a bare NotImplementedError at run time."""
    with pytest.raises(BNProbeError) as e:
        get_adapter(spec)
    assert re.search(message, _one_line(e))
    with pytest.raises(BNProbeError, match="does not implement capabilities"):
        BaseAdapter().capabilities()


def test_a_not_implemented_method_at_run_time_is_one_line():
    a = get_adapter("tests.adapters.test_registry:Stubbed")
    f = a.forward_train(np.ones((4, 2)), dtype="fp32")
    with pytest.raises(BNProbeError) as e:
        a.backward(np.ones((4, 2)), np.ones((4, 2)), None, f.saved, dtype="fp32")
    assert _one_line(e) == "adapter stubbed does not implement backward (coming in v2)"


def test_listing_entry_points_calls_no_factory(monkeypatch):
    """``bnprobe adapters`` loads each entry point's object and judges its kind, but never calls it: a factory,
    a class's constructor or a standard-library function (os.abort) would run the plugin's code just to list it."""
    called, loaded = [], []
    mod = types.ModuleType("vendor_eps")

    def factory():
        called.append("factory")
        return Tiny()

    def takes_args(x):
        called.append("takes_args")

    class Made(Tiny):
        def __init__(self):
            called.append("Made")

    factory.__module__ = takes_args.__module__ = "vendor_eps"
    mod.__dict__.update(factory=factory, takes_args=takes_args, Made=Made, foreign=registry.list_adapters)
    monkeypatch.setitem(sys.modules, "vendor_eps", mod)

    class EP:
        def __init__(self, name, value):
            self.name, self.value = name, value
            self.module, _, self.attr = value.partition(":")

        def load(self):
            loaded.append(self.value)
            return getattr(sys.modules[self.module], self.attr) if self.module == "vendor_eps" else os.abort

    eps = {n: EP(n, v) for n, v in (("f", "vendor_eps:factory"), ("c", "vendor_eps:Made"),
                                    ("args", "vendor_eps:takes_args"), ("foreign", "vendor_eps:foreign"),
                                    ("abort", "os:abort"), ("base", "bnprobe.adapters.base:BaseAdapter"))}
    eps["base"].load = lambda: BaseAdapter
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    rows = {r["name"]: r for r in list_adapters()}
    assert called == [] and "os:abort" not in loaded
    assert rows["f"]["available"] and rows["c"]["available"]
    assert re.search(r"'abort' \(os:abort\) is in the standard library", rows["abort"]["why"])
    assert "cannot be called without arguments" in rows["args"]["why"]
    assert "not a KernelAdapter class or instance, nor a factory function of vendor_eps" in rows["foreign"]["why"]
    assert "an adapter base class" in rows["base"]["why"]
    assert not any(rows[n]["available"] for n in ("abort", "args", "foreign", "base"))
    assert all("\n" not in r["why"] for r in rows.values())
    # asking for one refuses it before calling it, too; the good ones are made on request
    for name in ("abort", "args", "foreign", "base"):
        with pytest.raises(BNProbeError):
            get_adapter(name)
    assert called == [] and "os:abort" not in loaded
    assert get_adapter("f").name == "tiny" and called == ["factory"]

"""Plugins of earlier releases, written to the loose signature (``forward_train(x, gamma, ..., dtype=...)``,
``forward_infer``, ``backward``), still run in every command for one release, through the one shim
(bnprobe.adapters.loose), and pass or fail exactly as the same kernel written to the call-taking interface.

The loose plugins here run tests/checks/bn_plugins.py's NumpyBN (a BaseAdapter) through its loose methods, under
its own name: a command's output on one is the output on the other, byte for byte."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import bnprobe
from bnprobe.adapters import BaseAdapter, BNCall, get_adapter
from bnprobe.adapters.loose import LOOSE_METHODS, LooseSignature, with_call_methods
from bnprobe.cli import main
from tests.checks.bn_plugins import NumpyBN

HERE = "tests.adapters.test_loose"


class Loose:
    """A plugin of earlier releases: not a BaseAdapter, only the loose methods (each running NumpyBN's)."""

    def __init__(self, bug: str | None = None) -> None:
        self.bn = NumpyBN(bug)
        self.name = self.bn.name
        self.seen: list[str] = []

    def capabilities(self):
        return self.bn.capabilities()

    def forward_train(self, x, gamma=None, beta=None, running_mean=None, running_var=None, *, dtype, momentum=0.1,
                      eps=1e-5, layout="channels_first", params="fp32"):
        self.seen.append("forward_train")
        return self.bn.forward_train(x, gamma, beta, running_mean, running_var, dtype=dtype, momentum=momentum,
                                     eps=eps, layout=layout, params=params)

    def forward_infer(self, x, gamma, beta, running_mean, running_var, *, dtype, eps=1e-5, layout="channels_first",
                      params="fp32"):
        self.seen.append("forward_infer")
        return self.bn.forward_infer(x, gamma, beta, running_mean, running_var, dtype=dtype, eps=eps, layout=layout,
                                     params=params)

    def backward(self, dy, x, gamma, saved, *, dtype, eps=1e-5, training=True, layout="channels_first",
                 params="fp32"):
        self.seen.append("backward")
        return self.bn.backward(dy, x, gamma, saved, dtype=dtype, eps=eps, training=training, layout=layout,
                                params=params)


class OverridesForwardTrain(NumpyBN):
    """A BaseAdapter subclass of earlier releases overriding the public forward_train (not its _impl hook): the
    override is what runs."""

    def __init__(self) -> None:
        super().__init__("eps-ignored")
        self.name = "overrides-forward-train"

    def forward_train(self, x, gamma=None, beta=None, running_mean=None, running_var=None, *, dtype, momentum=0.1,
                      eps=1e-5, layout="channels_first", params="fp32"):
        out = super().forward_train(x, gamma, beta, running_mean, running_var, dtype=dtype, momentum=momentum,
                                    eps=eps, layout=layout, params=params)
        return type(out)(np.zeros_like(out.y), out.saved, out.running_mean, out.running_var)


def LooseGood():  # noqa: N802 - plugin factories, named like classes for the command line
    return Loose()


def LooseEpsIgnored():  # noqa: N802
    return Loose("eps-ignored")


def LooseDropsTerm():  # noqa: N802
    return Loose("dx-drops-xhat-term")


def _call(seed: int = 0) -> BNCall:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 3, 5, 5)) * 2 + 1
    return BNCall(x, rng.uniform(0.5, 2, 3), rng.standard_normal(3), np.zeros(3), np.ones(3),
                  rng.standard_normal(x.shape), dtype="fp32")


def test_the_registry_wraps_a_loose_plugin_and_leaves_a_call_taking_one_as_it_is():
    a = get_adapter(f"{HERE}:LooseGood")
    assert isinstance(a, LooseSignature) and a.name == "numpy-bn"
    for name in ("emulated", "reference", "ascend-tbe", "syncbn", "careful", "tests.checks.bn_plugins:DropsTerm"):
        assert not isinstance(get_adapter(name), LooseSignature), name
    assert with_call_methods(NumpyBN()).__class__ is NumpyBN
    assert isinstance(get_adapter(Loose()), LooseSignature)  # an object handed to the library, too
    assert isinstance(get_adapter(f"{HERE}:OverridesForwardTrain"), LooseSignature)


def test_the_shim_gives_the_same_bits_as_the_kernel_itself():
    c = _call()
    loose, bn = get_adapter(f"{HERE}:LooseGood"), NumpyBN()
    f, g = loose.train(c), bn.train(c)
    assert np.array_equal(f.y, g.y) and np.array_equal(f.running_var, g.running_var)
    assert np.array_equal(loose.infer(c.with_(training=False)).y, bn.infer(c.with_(training=False)).y)
    b, d = loose.backward_of(c, f.saved), bn.backward_of(c, g.saved)
    assert all(np.array_equal(getattr(b, k), getattr(d, k)) for k in ("dx", "dgamma", "dbeta"))
    assert loose.unwrapped().seen == ["forward_train", "forward_infer", "backward"]
    # the loose methods of a BaseAdapter are the call-taking ones, for one release
    assert np.array_equal(bn.forward_train(c.x, c.gamma, c.beta, c.running_mean, c.running_var, dtype="fp32").y, g.y)


def test_an_override_of_the_public_loose_method_is_what_runs():
    a = get_adapter(f"{HERE}:OverridesForwardTrain")
    assert not a.train(_call()).y.any()  # its forward_train zeroes y
    assert a.infer(_call().with_(training=False)).y.any()  # the rest is BaseAdapter's, on the call


def _masked(text: str, out: Path) -> str:
    """``text`` with its timings and the report folder ``out`` masked."""
    return re.sub(r"\d+\.\d+ s\b", "<T> s", text.replace(str(out), "<OUT>"))


@pytest.mark.parametrize("loose, same, args, code", [
    ("LooseGood", "tests.checks.bn_plugins:NumpyBN",
     ["compare-precision", "--dtypes", "fp32", "--shape", "8,4,6,6", "--no-stress", "--no-budget"], 0),
    ("LooseDropsTerm", "tests.checks.bn_plugins:DropsTerm",
     ["compare-precision", "--dtypes", "bf16", "--shape", "8,4,6,6", "--no-stress", "--no-budget"], 1),
    ("LooseEpsIgnored", "tests.checks.bn_plugins:EpsIgnored",
     ["doctor", "--dtype", "fp32", "--no-stability"], 0),
    ("LooseEpsIgnored", "tests.checks.bn_plugins:EpsIgnored",
     ["doctor", "--dtype", "fp32", "--no-stability", "--eps", "1e-3"], 1),
    ("LooseDropsTerm", "tests.checks.bn_plugins:DropsTerm", ["gradcheck", "--dtype", "fp32"], 1),
    ("LooseGood", "tests.checks.bn_plugins:NumpyBN", ["overflow", "--dtype", "fp16", "--mean", "300"], 0),
    ("LooseGood", "tests.checks.bn_plugins:NumpyBN", ["shrink", "--dtype", "fp16", "--shape", "4,2,3,3"], 2),
])
def test_a_loose_plugin_passes_and_fails_exactly_as_before(capsys, tmp_path, loose, same, args, code):
    """The loose plugin's run and the call-taking kernel's run end as before (shrink: the check passes, nothing to
    shrink) and say the same, in the same words (compare-precision's timing and report folder aside)."""
    compare = args[0] == "compare-precision"
    outs = []
    for i, spec in enumerate((f"{HERE}:{loose}", same)):
        out = ["--out", str(tmp_path / str(i)), "--format", "md"] if compare else []
        assert main([args[0], "--adapters" if compare else "--adapter", spec, *args[1:], *out]) == code
        text = capsys.readouterr()
        outs.append((_masked(text.out, tmp_path / str(i)), text.err))
        if compare:
            outs.append(_masked((tmp_path / str(i) / "summary.md").read_text(), tmp_path / str(i)))
    assert outs[: len(outs) // 2] == outs[len(outs) // 2:]


def _loose_calls(path: Path) -> list[int]:
    """The lines of ``path`` calling a method by a loose name (``x.forward_train(...)``...)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in LOOSE_METHODS]


def test_the_shim_is_the_only_place_bnprobe_calls_the_loose_signature():
    """bnprobe's own code hands adapters the call; only bnprobe.adapters.loose unpacks it into the loose methods
    (the kernels' own functions, forward_train(x, ...) of bnprobe.kernels, are called by name, not as methods)."""
    root = Path(bnprobe.__file__).parent
    shim = root / "adapters" / "loose.py"
    found = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py")) if p != shim
             for lines in [_loose_calls(p)] if lines}
    assert found == {}
    assert len(_loose_calls(shim)) == 3
    # the check sees one, planted
    planted = root.parent / "tests" / "adapters" / "test_loose.py"
    assert _loose_calls(planted)


def test_a_base_adapter_is_never_shimmed():
    class Plain(BaseAdapter):
        name = "plain"

    assert with_call_methods(Plain()).__class__ is Plain


def test_a_loose_adapter_object_handed_to_a_check_runs_in_its_shim():
    """A library call given the plugin's object (not its spec) runs it as the command line does."""
    from bnprobe.checks.compare.precision import compare_precision
    from bnprobe.engine.cases import Case

    case = [Case("c", (8, 4, 6, 6), mean=1.0, std=2.0, seed=3)]
    loose = Loose("dx-drops-xhat-term")
    got = compare_precision([loose], ("bf16",), case, budget=False).rows
    want = compare_precision([NumpyBN("dx-drops-xhat-term")], ("bf16",), case, budget=False).rows
    assert loose.seen and "FAIL" in set(got.verdict)
    cols = [c for c in want.columns if c not in ("seconds",)]
    assert got[cols].equals(want[cols])

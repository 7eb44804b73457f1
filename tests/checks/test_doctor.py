"""doctor on deliberately buggy kernels (written independently through the adapter API, not with the
doctor's own models), on healthy ones, and shrink on a failing layer."""

import json
import numpy as np
import pytest

from bnprobe.adapters import BackwardOutput, ForwardOutput, Saved
from bnprobe.adapters.emulated import ReferenceAdapter
from bnprobe.checks.doctor import BUGS, doctor
from bnprobe.checks.shrink import compare_predicate, shrink
from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.inputs import make_input


class Buggy(ReferenceAdapter):
    """The FP64 reference with one classic bug patched into what it returns."""

    def __init__(self, bug):
        super().__init__()
        self.bug = bug
        self.name = f"buggy:{bug}"

    def _stats(self, x):
        ax = (0,) + tuple(range(2, x.ndim))
        return x.mean(axis=ax), x.var(axis=ax), x.size // x.shape[1]

    def _forward_train_impl(self, p, *, momentum, eps):
        m = momentum if momentum is not None else 1.0
        if self.bug == "momentum as 1-m":
            out = super()._forward_train_impl(p, momentum=1 - m, eps=eps)
            return out
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        x = p.x
        mean, var, r = self._stats(x)
        col = lambda v: v.reshape((1, -1) + (1,) * (x.ndim - 2))  # noqa: E731
        g, b = p.vectors["gamma"], p.vectors["beta"]
        if self.bug == "biased running var":
            rv = (1 - m) * p.vectors["running_var"] + m * var
            return ForwardOutput(out.y, out.saved, out.running_mean, rv)
        if self.bug == "eps on sigma":
            inv = 1 / (np.sqrt(var) + eps)
            y = (x - col(mean)) * col(inv * g) + col(b)
            return ForwardOutput(y, Saved(mean, "invstd", inv), out.running_mean, out.running_var)
        if self.bug == "training uses running stats":
            rm, rv = p.vectors["running_mean"], p.vectors["running_var"]
            inv = 1 / np.sqrt(rv + eps)
            y = (x - col(rm)) * col(inv * g) + col(b)
            return ForwardOutput(y, Saved(rm, "invstd", inv), out.running_mean, out.running_var)
        return out

    def _forward_infer_impl(self, p, *, eps):
        if self.bug == "inference uses batch stats":
            x = p.x
            mean, var, _ = self._stats(x)
            col = lambda v: v.reshape((1, -1) + (1,) * (x.ndim - 2))  # noqa: E731
            return ForwardOutput((x - col(mean)) / np.sqrt(col(var) + eps) * col(p.vectors["gamma"])
                                 + col(p.vectors["beta"]))
        return super()._forward_infer_impl(p, eps=eps)

    def _backward_impl(self, p, dy, saved, *, eps, training):
        out = super()._backward_impl(p, dy, saved, eps=eps, training=training)
        if self.bug == "dgamma without rstd":
            return BackwardOutput(out.dx, out.dgamma / saved.invstd(eps), out.dbeta)
        if self.bug == "dbeta mean":
            return BackwardOutput(out.dx, out.dgamma, out.dbeta / (p.x.size // p.x.shape[1]))
        return out


CASES = {
    "biased running var": "running_var updated with the biased variance",
    "momentum as 1-m": "momentum applied as 1-m (Keras convention)",
    "eps on sigma": "eps added to sigma instead of sigma^2",
    "inference uses batch stats": "inference uses batch statistics",
    "training uses running stats": "training uses running statistics",
    "dgamma without rstd": "dgamma missing the rstd factor",
    "dbeta mean": "dbeta is the mean of dy instead of the sum",
}


@pytest.mark.parametrize("bug,expected", list(CASES.items()))
def test_each_buggy_kernel_is_diagnosed_as_exactly_its_bug(bug, expected):
    rep = doctor(Buggy(bug), stability=False)
    assert not rep.healthy
    assert rep.diagnosis == [expected], rep.diagnosis
    assert expected in BUGS


@pytest.mark.parametrize("adapter,dtype", [("reference", None), ("torch", None), ("torch", "fp32"),
                                           ("emulated", "fp16"), ("emulated", "bf16"), ("ascend-bnv3", "fp16")])
def test_healthy_kernels_get_a_clean_bill(adapter, dtype):
    if adapter == "torch":
        pytest.importorskip("torch")
    rep = doctor(adapter, dtype)
    assert rep.healthy and not rep.diagnosis, [(i.name, i.status, i.evidence) for i in rep.items]


def test_non_determinism_and_stress_are_warnings_not_failures():
    rep = doctor("ascend-tbe", "fp32")
    st = {i.name: i.status for i in rep.items}
    assert rep.healthy and st["determinism"] == "WARN"


def test_eps_below_the_statistics_resolution_warns():
    rep = doctor("emulated:fp16-acc16", "fp16", stability=False)
    st = {i.name: i for i in rep.items}
    assert st["epsilon is resolvable in the statistics' format"].status == "WARN"


def test_shrink_turns_a_large_failing_case_into_a_handful_of_elements(tmp_path, monkeypatch):
    x = make_input((16, 64, 28, 28), mean=100.0, seed=0)
    fails = compare_predicate("emulated:fp16-acc16:variance=naive", dtype="fp16")
    res = shrink(x, fails, seconds=60)
    assert res.x.size <= 8 and fails(res.x)
    assert shrink(x, fails, seconds=60).x.tolist() == res.x.tolist()  # deterministic
    with pytest.raises(BNProbeError, match="nothing to shrink"):  # a sound kernel on ordinary data passes
        shrink(make_input((4, 2, 3, 3), seed=1), compare_predicate("emulated", dtype="fp16"))


def test_shrink_cli_writes_a_replay_that_reproduces(tmp_path, capsys):
    out = tmp_path / "s"
    code = main(["shrink", "--adapter", "emulated:fp16-acc16:variance=naive", "--mean", "100", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "replay: bnprobe compare-precision" in text
    doc = json.loads((out / "shrink.json").read_text())
    assert doc["elements"] <= 8 and (out / "x.npy").exists() and (out / "dump" / "bnprobe-dump.json").exists()
    args = doc["replay"].split()[1:]
    assert main(args) == 1  # the replay fails the same way
    capsys.readouterr()


def test_doctor_cli(capsys):
    assert main(["doctor"]) == 0
    assert "healthy" in capsys.readouterr().out
    assert main(["doctor", "--adapter", "ascend-tbe", "--dtype", "fp64"]) == 2
    assert "does not run fp64" in capsys.readouterr().err

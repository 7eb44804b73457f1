"""msprobe's MindSpore dumps (real ones, made with mindstudio-probe 26.2.0 and MindSpore 2.10: tests/data/
msprobe_mindspore/README.md), read like the PyTorch ones by every command; checked against float64 numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.recordings import open_dump

DATA = Path(__file__).resolve().parent.parent / "data" / "msprobe_mindspore"
DUMPS = ("L1-fp32", "L1-fp16", "mix-fp32", "mix-fp16")
# the second layer was built with eps 1e-3 and nn.BatchNorm2d momentum 0.8 (m = 0.2); the dump records neither
SECOND = ",eps=1e-3,momentum=0.2"


def _numpy_bn(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> dict[str, np.ndarray]:
    ax = (0, 2, 3)
    mean, var = x.mean(axis=ax), x.var(axis=ax)
    col = lambda v: v[None, :, None, None]  # noqa: E731
    return {"y": col(g) * (x - col(mean)) / np.sqrt(col(var) + eps) + col(b), "mean": mean, "var": var}


@pytest.mark.parametrize("name", DUMPS)
def test_every_batchnorm_primitive_is_read_in_mindspores_convention(name: str) -> None:
    found = open_dump(DATA / name)
    assert [c.name for c in found.calls] == ["Primitive.bn_train.BatchNorm.0", "Primitive.bn_train.BatchNorm.1"]
    assert found.convention == "mindspore"
    if name.startswith("mix"):
        assert [c.module for c in found.calls] == ["Cell.bn1.BatchNorm2d.forward.0", "Cell.bn2.BatchNorm2d.forward.0"]
    fmt = name.split("-")[1]
    for c, eps in zip(found.calls, (1e-5, 1e-3)):
        rec = c.load()
        # (net.to_float(float16) casts γ and β to fp16 too; the moving statistics stay fp32)
        assert rec.dtype == fmt and rec.params == fmt and rec.saved_kind == "var" and rec.training
        ins, outs = rec.tensors["train"]["inputs"], rec.tensors["train"]["outputs"]
        want = _numpy_bn(ins["x"], ins["gamma"], ins["beta"], eps)
        u = 2.0**-11 if fmt == "fp16" else 2.0**-24
        assert np.abs(outs["y"] - want["y"]).max() <= 8 * u * np.abs(want["y"]).max()
        # saved in the format of x (reserve spaces), so to its rounding
        np.testing.assert_allclose(outs["saved_mean"], want["mean"], rtol=4 * u, atol=1e-6)
        np.testing.assert_allclose(outs["saved_value"], want["var"], rtol=max(4 * u, 1e-4))  # the biased variance
        bw = rec.tensors["backward"]
        dy = bw["inputs"]["dy"]
        # msprobe lists MindSpore's channel gradients as dβ, dγ: told apart by content, dβ = Σdy
        np.testing.assert_allclose(bw["outputs"]["dbeta"], dy.sum(axis=(0, 2, 3)), rtol=1e-2, atol=1e-3)
        xhat = (ins["x"] - want["mean"][None, :, None, None]) / np.sqrt(want["var"][None, :, None, None] + eps)
        np.testing.assert_allclose(bw["outputs"]["dgamma"], (dy * xhat).sum(axis=(0, 2, 3)), rtol=5e-2, atol=1e-2)
        if name.startswith("mix"):  # the cell's parameters_grad is the kernel's dγ and dβ
            assert all("equals" in s for s in rec.meta["checks"])


@pytest.mark.parametrize("name", DUMPS)
@pytest.mark.parametrize("command", ["compare-precision", "doctor", "gradcheck", "overflow"])
def test_every_command_passes_the_dump_with_the_layers_scalars(name: str, command: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    opt = "--adapters" if command == "compare-precision" else "--adapter"
    extra = ["--no-budget", "--out", str(tmp_path / "r"), "--format", "json"] if command == "compare-precision" else []
    first = main([command, opt, f"dump:{DATA / name}#*BatchNorm.0", *extra])
    second = main([command, opt, f"dump:{DATA / name}#*BatchNorm.1{SECOND}", *extra[:-4]])
    out = capsys.readouterr().out
    assert (first, second) == (0, 0), out
    if command == "compare-precision":
        assert "ε 0.001 as given; momentum 0.2 as given" in out


@pytest.mark.parametrize("command", ["compare-precision", "doctor"])
def test_mindspores_assumed_default_is_said_and_a_wrong_one_fails(command: str, capsys: pytest.CaptureFixture,
                                                                  tmp_path: Path) -> None:
    """Without the layer's ε the second layer is judged with MindSpore's default 1e-5: y fails, and the output
    says the ε was assumed (every command on the same call gives the same verdict)."""
    opt = "--adapters" if command == "compare-precision" else "--adapter"
    extra = ["--no-budget", "--out", str(tmp_path / "r"), "--format", "json"] if command == "compare-precision" else []
    rc = main([command, opt, f"dump:{DATA / 'L1-fp32'}#*BatchNorm.1", *extra])
    out = capsys.readouterr().out
    assert rc == 1, out
    if command == "compare-precision":
        assert "MindSpore's defaults assumed: ε 1e-05, momentum 0.1" in out


def test_a_scalar_that_contradicts_a_recorded_one_is_refused() -> None:
    with pytest.raises(BNProbeError, match="dump option 'foo=1'"):
        open_dump(f"{DATA / 'L1-fp32'},foo=1")
    with pytest.raises(BNProbeError, match="not a number"):
        open_dump(f"{DATA / 'L1-fp32'},eps=x")


def test_cell_level_l0_dump_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", "--adapter", f"dump:{DATA / 'L0-fp32'}"]) == 2
    err = capsys.readouterr().err
    assert "only module-level (L0) BatchNorm records (Cell.bn1.BatchNorm2d.forward.0" in err
    assert len(err.strip().splitlines()) == 1


def test_the_convention_can_be_overridden_and_then_the_running_variance_is_judged_so(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--convention on a dump: the running statistics are not in msprobe's MindSpore dump (updated in place), so
    a convention changes nothing judged here, and the verdict is the same."""
    args = ["compare-precision", "--adapters", f"dump:{DATA / 'L1-fp32'}#*BatchNorm.0", "--no-budget", "--out",
            str(tmp_path / "r"), "--format", "json"]
    assert main(args) == 0
    assert main([*args[:-4], "--convention", "flax", "--out", str(tmp_path / "s"), "--format", "json"]) == 0
    capsys.readouterr()

"""msprobe's MindSpore dumps (real ones, made with mindstudio-probe 26.2.0 and MindSpore 2.10: tests/data/
msprobe_mindspore/README.md), read like the PyTorch ones by every command; checked against float64 numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
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


def test_cell_level_l0_dump_is_read_cell_by_cell_against_numpy() -> None:
    """L0 holds cells only: x, y, γ, β, the moving statistics after the update, dy, dx and parameters_grad."""
    found = open_dump(DATA / "L0-fp32")
    assert [c.name for c in found.calls] == ["Cell.bn1.BatchNorm2d.0", "Cell.bn2.BatchNorm2d.0"]
    assert found.convention == "mindspore" and all(c.training and c.has_backward for c in found.calls)
    for c, eps in zip(found.calls, (1e-5, 1e-3)):
        rec = c.load()
        ins, y = rec.tensors["train"]["inputs"], rec.tensors["train"]["outputs"]["y"]
        ref = _numpy_bn(ins["x"], ins["gamma"], ins["beta"], eps)
        np.testing.assert_allclose(y, ref["y"], rtol=0, atol=1e-5)
        bw = rec.tensors["backward"]
        dy = bw["inputs"]["dy"]
        np.testing.assert_allclose(bw["outputs"]["dbeta"], dy.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
        xhat = (ins["x"] - ref["mean"][None, :, None, None]) / np.sqrt(ref["var"][None, :, None, None] + eps)
        np.testing.assert_allclose(bw["outputs"]["dgamma"], (dy * xhat).sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
        assert any("taken as training" in n for n in rec.meta["notes"])
        assert any("running statistics are not checked" in n for n in rec.meta["notes"])


@pytest.mark.parametrize("command", ["compare-precision", "doctor", "gradcheck", "overflow"])
def test_every_command_runs_the_l0_dump_and_the_second_cell_needs_its_eps(command: str, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    opt = "--adapters" if command == "compare-precision" else "--adapter"
    extra = ["--no-budget", "--out", str(tmp_path / "r"), "--format", "json"] if command == "compare-precision" else []
    assert main([command, opt, f"dump:{DATA / 'L0-fp32'}#*bn1*", *extra]) == 0
    assert main([command, opt, f"dump:{DATA / 'L0-fp32'}#*bn2*", "--eps", "1e-3", *extra[:-4]]) == 0
    out = capsys.readouterr().out
    assert "ε and momentum are not in a MindSpore cell's record" in out and "ε 0.001 as given" in out
    if command in ("compare-precision", "doctor"):  # y is judged with the ε: MindSpore's default fails it
        assert main([command, opt, f"dump:{DATA / 'L0-fp32'}#*bn2*", *extra[:-4]]) == 1


def test_an_l0_cell_in_inference_is_told_by_its_y(tmp_path: Path) -> None:
    """A cell whose y is the moving statistics' (an eval-mode call) is read as inference, and checked so."""
    import shutil

    shutil.copytree(DATA / "L0-fp32", tmp_path / "d")
    data = tmp_path / "d" / "step0" / "proc0" / "dump_tensor_data"
    p = lambda n: data / f"Cell.bn1.BatchNorm2d.forward.0.{n}.npy"  # noqa: E731
    x, g, b = (np.load(p(n)).astype(np.float64) for n in ("input.0", "parameters.gamma", "parameters.beta"))
    rm, rv = (np.load(p(f"parameters.{n}")).astype(np.float64) for n in ("moving_mean", "moving_variance"))
    col = lambda v: v[None, :, None, None]  # noqa: E731
    np.save(p("output.0"), (col(g) * (x - col(rm)) / np.sqrt(col(rv) + 1e-5) + col(b)).astype(np.float32))
    c = open_dump(f"{tmp_path / 'd'}#*bn1*").calls[0]
    rec = c.load()
    assert not c.training and rec.modes == ("infer", "backward")
    assert any("taken as inference" in n for n in rec.meta["notes"])
    assert main(["compare-precision", "--adapters", f"dump:{tmp_path / 'd'}#*bn1*", "--mode", "infer",
                 "--no-budget", "--out", str(tmp_path / "r"), "--format", "json"]) == 0


def test_an_l0_statistics_dump_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json
    import shutil

    shutil.copytree(DATA / "L0-fp32", tmp_path / "d")
    dj = tmp_path / "d" / "step0" / "proc0" / "dump.json"
    doc = json.loads(dj.read_text())
    doc["task"] = "statistics"
    dj.write_text(json.dumps(doc))
    assert main(["doctor", "--adapter", f"dump:{tmp_path / 'd'}"]) == 2
    err = capsys.readouterr().err
    assert "only module-level (L0) BatchNorm records (Cell.bn1.BatchNorm2d.forward.0" in err
    assert "statistics dump" in err and len(err.strip().splitlines()) == 1


def test_the_convention_can_be_overridden_and_then_the_running_variance_is_judged_so(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--convention on a dump: the running statistics are not in msprobe's MindSpore dump (updated in place), so
    a convention changes nothing judged here, and the verdict is the same."""
    args = ["compare-precision", "--adapters", f"dump:{DATA / 'L1-fp32'}#*BatchNorm.0", "--no-budget", "--out",
            str(tmp_path / "r"), "--format", "json"]
    assert main(args) == 0
    assert main([*args[:-4], "--convention", "flax", "--out", str(tmp_path / "s"), "--format", "json"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["compare-precision", "doctor", "gradcheck", "overflow", "identify"])
def test_eps_and_momentum_flags_give_the_layers_scalars_to_a_dump(command: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """--eps / --momentum on a dump are the layer's own (the dump records neither): the second layer passes with
    them, as with dump:DIR,eps=E,momentum=M; given both ways they are refused in one line."""
    opt = "--adapters" if command == "compare-precision" else "--adapter"
    extra = ["--no-budget", "--out", str(tmp_path / "r"), "--format", "json"] if command == "compare-precision" else []
    scalars = ["--eps", "1e-3"] + (["--momentum", "0.2"] if command in ("compare-precision", "doctor", "identify")
                                   else [])
    rc = main([command, opt, f"dump:{DATA / 'L1-fp32'}#*BatchNorm.1", *scalars, *extra])
    out = capsys.readouterr().out
    if command == "identify":  # identify names a policy rather than passing or failing: the scalars must be used
        assert rc in (0, 1) and "ε 0.001 as given" in out, out
    else:
        assert rc == 0, out
    assert main([command, opt, f"dump:{DATA / 'L1-fp32'}#*BatchNorm.1,eps=1e-3", "--eps", "1e-3", *extra]) == 2
    err = capsys.readouterr().err
    assert "eps given twice" in err and len(err.strip().splitlines()) == 1


def test_eps_flag_reaches_a_dump_given_as_input_to_a_runnable_kernel(capsys: pytest.CaptureFixture) -> None:
    args = ["doctor", "--adapter", "reference", "--input", f"{DATA / 'L1-fp32'}#*BatchNorm.1"]
    assert main([*args, "--eps", "1e-3", "--momentum", "0.2"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main(["trace", "--input", f"{DATA / 'L1-fp32'}#*BatchNorm.1", "--eps", "1e-3", "--momentum", "0.2"]) == 0
    assert "eps 0.001 (as used: 0.001), momentum 0.2" in capsys.readouterr().out


def test_a_dump_that_records_its_scalars_refuses_other_ones(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["dump", "--adapter", "reference", "--out", str(tmp_path / "d"), "--dtype", "fp32", "--shape",
                 "2,3,2,2"]) == 0
    assert main(["doctor", "--adapter", f"dump:{tmp_path / 'd'}", "--eps", "1e-5"]) in (0, 1)
    capsys.readouterr()
    assert main(["doctor", "--adapter", f"dump:{tmp_path / 'd'}", "--eps", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "records eps = 1e-05; eps=0.001 contradicts it" in err and len(err.strip().splitlines()) == 1


def test_a_pytorch_l0_dump_is_still_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """PyTorch's module records hold no running statistics (buffers are not parameters), ε, momentum or training
    flag: they are refused, naming the levels that work."""
    import json

    t = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 3, 4, 4], "data_name": "x.pt"}
    (tmp_path / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L0", "framework": "pytorch", "data": {
        "Module.bn.BatchNorm2d.forward.0": {"input_args": [t], "input_kwargs": {}, "output": [t]}}}))
    assert main(["doctor", "--adapter", f"dump:{tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "only module-level (L0) BatchNorm records (Module.bn.BatchNorm2d.forward.0" in err and "L1 or mix" in err
    assert len(err.strip().splitlines()) == 1


GRAPH = DATA / "graph-fp32"  # GRAPH_MODE, msprobe level L2: MindSpore's kernel-by-kernel dump (README.md)


def test_a_graph_mode_dump_is_read_kernel_by_kernel_against_numpy() -> None:
    """ε and momentum are kernel inputs there; each BatchNormGrad is paired with its forward by content (MindSpore
    names bn1's gradient after bn2's scope); the moving statistics are dumped after the in-place update."""
    found = open_dump(GRAPH)
    assert found.convention == "mindspore" and len(found.calls) == 2
    assert ["bn1" in c.name for c in found.calls] == [True, False] and all(c.has_backward for c in found.calls)
    for c, eps, m in zip(found.calls, (1e-5, 1e-3), (0.1, 0.2)):
        rec = c.load()
        assert rec.eps == pytest.approx(eps, rel=1e-7) and rec.momentum == pytest.approx(m, rel=1e-7)
        assert rec.saved_kind == "var" and rec.dtype == "fp32"
        ins, outs = rec.tensors["train"]["inputs"], rec.tensors["train"]["outputs"]
        ref = _numpy_bn(ins["x"], ins["gamma"], ins["beta"], rec.eps)
        np.testing.assert_allclose(outs["y"], ref["y"], rtol=0, atol=2e-6)
        np.testing.assert_allclose(outs["saved_mean"], ref["mean"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(outs["saved_value"], ref["var"], rtol=1e-5, atol=1e-7)
        bw = rec.tensors["backward"]
        assert np.array_equal(bw["inputs"]["x"], ins["x"])  # its own forward's x
        dy = bw["inputs"]["dy"]
        np.testing.assert_allclose(bw["outputs"]["dbeta"], dy.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-7)
        # the moving statistics were dumped after the update: (1 − m)·initial + m·batch (initial 0 and 1)
        n = ins["x"].size / ins["x"].shape[1]
        np.testing.assert_allclose(ins["running_mean"], m * ref["mean"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ins["running_var"], (1 - m) + m * ref["var"] * n / (n - 1), rtol=1e-5)
        assert any("running statistics are not checked" in n for n in rec.meta["notes"])


@pytest.mark.parametrize("command", ["compare-precision", "doctor", "gradcheck", "overflow"])
def test_every_command_passes_the_graph_dump(command: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    opt = "--adapters" if command == "compare-precision" else "--adapter"
    extra = ["--no-budget", "--out", str(tmp_path / "r"), "--format", "json"] if command == "compare-precision" else []
    rc = main([command, opt, f"dump:{GRAPH}", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert main([command, opt, f"dump:{GRAPH}#*bn2*", "--eps", "1e-4", *extra]) == 2
    assert "records eps = 0.0010000000474974513; eps=0.0001 contradicts it" in capsys.readouterr().err


def test_the_fp16_graph_dump_fails_where_its_y_holds_fp32_bytes_under_an_fp16_label(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A finding of MindSpore 2.10's CPU graph mode (cells to_float(float16)): bn1 is given fp32 x and its y file,
    labelled Float16, holds the first half of an fp32 y's bytes (checked here by numpy alone); bnprobe fails y."""
    found = open_dump(DATA / "graph-fp16")
    rec = found.calls[0].load()
    ins, y = rec.tensors["train"]["inputs"], rec.tensors["train"]["outputs"]["y"]
    assert rec.formats["train.outputs.y"] == "fp16" and rec.formats["train.inputs.x"] == "fp32"
    ref = _numpy_bn(ins["x"], ins["gamma"], ins["beta"], rec.eps)["y"].ravel()
    as32 = np.ascontiguousarray(y.astype(np.float16)).view(np.float32).ravel()
    np.testing.assert_allclose(as32, ref[: as32.size], rtol=0, atol=1e-6)
    assert main(["compare-precision", "--adapters", f"dump:{DATA / 'graph-fp16'}#*bn1*", "--no-budget",
                 "--format", "json", "--out", str(tmp_path / "r")]) == 1
    assert "y, dx" in capsys.readouterr().out  # the gradient's dx, labelled Float16, holds fp32 bytes too
    bw = rec.tensors["backward"]
    x, dy, g = bw["inputs"]["x"], bw["inputs"]["dy"], bw["inputs"]["gamma"]
    col = lambda v: v[None, :, None, None]  # noqa: E731
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    xhat = (x - col(mean)) / np.sqrt(col(var) + rec.eps)
    dx = col(g) / np.sqrt(col(var) + rec.eps) * (dy - col(dy.mean(axis=(0, 2, 3)))
                                                 - xhat * col((dy * xhat).mean(axis=(0, 2, 3))))
    as32 = np.ascontiguousarray(bw["outputs"]["dx"].astype(np.float16)).view(np.float32).ravel()
    np.testing.assert_allclose(as32, dx.ravel()[: as32.size], rtol=0, atol=1e-7)


def test_overflow_takes_the_convention_as_the_other_commands_do(capsys: pytest.CaptureFixture) -> None:
    spec = f"dump:{DATA / 'L1-fp32'}#*BatchNorm.0"
    assert main(["overflow", "--adapter", spec, "--convention", "flax"]) == 0
    assert main(["overflow", "--adapter", spec]) == 0
    capsys.readouterr()
    assert main(["overflow", "--adapter", spec, "--convention", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown convention 'nope'" in err and len(err.strip().splitlines()) == 1

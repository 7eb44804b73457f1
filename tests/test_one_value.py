"""One value per channel (R = N·H·W = 1) and rows of one value, in every command that takes a shape (issue 57 item 8).

Training is undefined there (the unbiased running variance divides by R − 1 = 0).  A command that judges several
modes at once (compare-precision, doctor) judges the input's inference and says in its headline and report what it
left out and why; a command asked for training by name (``--mode train``/``backward``), or whose one mode is
training (trace, gradcheck, overflow, shrink, dump, identify by default), refuses in one line that names the cause.
A family layer (--norm) keeps no running statistics, so it has no inference to fall back on: a row of one value is
refused by every command.  Which modes ran is read from the rows and files the run wrote, not from the note."""

import json

import numpy as np
import pytest

from bnprobe.cli import main

CAUSE = "R = N·H·W = 1 value per channel"
CP = ["compare-precision", "--no-stress", "--no-budget", "--adapters", "emulated", "--dtypes", "fp16"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "", (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bnprobe: error: "), err
    return lines[0]


@pytest.mark.parametrize("shape", ["1,3", "1,3,1,1", "1,4,1,1,1"])
def test_compare_precision_judges_inference_and_says_what_it_left_out(shape, tmp_path, capsys):
    code, out, err = run(capsys, *CP, "--shape", shape, "--out", str(tmp_path / "r"))
    assert code == 0 and err == "", err
    head = out.splitlines()[0]
    assert f"training forward and backward not judged on 1 input ({CAUSE})" in head, head
    assert any(line.startswith("note: ") and CAUSE in line and "R − 1 = 0" in line for line in out.splitlines())
    doc = json.loads((tmp_path / "r" / "compare.json").read_text())
    assert {r["tensor"] for r in doc["rows"]} == {"y_infer"}  # inference alone was judged
    assert doc["meta"]["left_out"]["modes"] == ["train", "backward"]
    for page in ("summary.md", "report.html"):
        assert "Not judged: the training forward and backward" in (tmp_path / "r" / page).read_text(), page


def test_compare_precision_with_two_values_per_channel_judges_training_and_says_nothing_of_it(tmp_path, capsys):
    code, out, _ = run(capsys, *CP, "--shape", "2,3", "--out", str(tmp_path / "r"))
    assert code in (0, 1) and "not judged" not in out.splitlines()[0]
    doc = json.loads((tmp_path / "r" / "compare.json").read_text())
    assert {"y", "dx", "y_infer"} <= {r["tensor"] for r in doc["rows"]} and "left_out" not in doc["meta"]
    assert "Not judged" not in (tmp_path / "r" / "summary.md").read_text()


@pytest.mark.parametrize("mode", ["train", "backward"])
def test_compare_precision_refuses_training_asked_for_by_name(mode, capsys):
    line = refused(capsys, *CP, "--format", "json", "--shape", "1,3", "--mode", mode, "--out", "{tmp}")
    assert f"--mode {mode} needs more than one value per channel" in line and CAUSE in line and "--mode infer" in line


def test_compare_precision_infer_on_one_value_says_nothing_left_out(tmp_path, capsys):
    code, out, _ = run(capsys, *CP, "--format", "json", "--shape", "1,3", "--mode", "infer", "--out", str(tmp_path))
    assert code == 0 and "not judged" not in out


@pytest.mark.parametrize("how", ["shape", "input"])
def test_doctor_judges_an_input_of_one_value_in_inference_and_says_so(how, tmp_path, capsys):
    if how == "shape":
        args, name = ["--shape", "1,3"], "generated"
    else:
        np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((1, 3, 1, 1)))
        args, name = ["--input", str(tmp_path / "x.npy")], "input"
    code, out, err = run(capsys, "doctor", "--adapter", "emulated", "--no-stability", "--json", *args)
    assert code == 0, err
    doc = json.loads(out)
    assert any(n.startswith(f"{name}: {CAUSE}") for n in doc["notes"]), doc["notes"]
    code, out, _ = run(capsys, "doctor", "--adapter", "emulated", "--no-stability", *args)
    assert f"not judged on {name} ({CAUSE})" in out.splitlines()[0]
    # the checklist's own evidence agrees: inference judged on both inputs, the training forward on one
    assert "on 2 inputs" in next(v for v in out.splitlines() if "train/eval switch" in v)
    assert "on 2 inputs" not in next(v for v in out.splitlines() if "training forward:" in v)


def test_doctor_with_two_values_per_channel_says_nothing_left_out(capsys):
    code, out, _ = run(capsys, "doctor", "--adapter", "emulated", "--no-stability", "--shape", "2,3")
    assert code == 0 and "not judged" not in out and CAUSE not in out


# the commands of one mode (training by default): refused in one line naming the cause, and run in inference when
# asked (what the refusal points at)
ONE_MODE = {
    "trace": (["trace", "--shape", "1,3"], ["--mode", "infer"]),
    "gradcheck": (["gradcheck", "--shape", "1,3,1,1"], ["--mode", "infer"]),
    "overflow": (["overflow", "--shape", "1,3"], ["--mode", "infer"]),
    "shrink": (["shrink", "--adapter", "emulated:fp16-acc16", "--shape", "1,3", "--mean", "1000", "--seconds", "5",
                "--out", "{tmp}/s"], ["--mode", "infer"]),
    "dump": (["dump", "--adapter", "emulated", "--out", "{tmp}/d", "--shape", "1,3"], ["--modes", "infer"]),
    "identify": (["identify", "--adapter", "emulated:fp16", "--shape", "1,3"], None),
}


@pytest.mark.parametrize("command", ONE_MODE)
def test_a_command_of_one_mode_refuses_training_on_one_value_per_channel(command, tmp_path, capsys):
    args, infer = ONE_MODE[command]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = refused(capsys, *args)
    assert "needs more than one value per channel" in line and CAUSE in line, line
    assert not list(tmp_path.iterdir())  # nothing written
    for mode in ("train", "backward") if command in ("trace", "overflow") else ():
        assert CAUSE in refused(capsys, *args, "--mode", mode)
    if infer is not None:
        assert infer[0] + " infer" in line  # the refusal says what runs instead, and it does run
        code, out, err = run(capsys, *args, *infer)
        assert code in (0, 1) and err == "", err


def test_a_kernel_that_defines_training_at_one_value_is_recorded(tmp_path, capsys):
    """A policy whose unbiased running variance at R = 1 is defined (0, as TensorFlow's) is no refusal's business."""
    code, out, err = run(capsys, "dump", "--adapter", "emulated:fp16:unbiased_r1=zero", "--out", str(tmp_path / "d"),
                         "--shape", "1,3")
    assert code == 0 and "(train, infer, backward)" in out, err


FAMILY = [("layer", "2,1", []), ("rms", "3,1", []), ("instance", "2,3,1", []), ("group", "2,4,1,1", ["--num-groups",
                                                                                                      "4"])]
COMMANDS = {
    "trace": ["trace"],
    "gradcheck": ["gradcheck"],
    "overflow": ["overflow"],
    "compare-precision": CP + ["--format", "json", "--out", "{tmp}/c"],
    "dump": ["dump", "--adapter", "emulated", "--out", "{tmp}/d"],
    "shrink": ["shrink", "--adapter", "emulated:fp16-acc16", "--seconds", "5", "--out", "{tmp}/s"],
    "doctor": ["doctor", "--adapter", "emulated", "--dtype", "fp16", "--no-stability"],
    "identify": ["identify", "--adapter", "emulated:fp16"],
}


@pytest.mark.parametrize("command,norm,shape,more", [
    (c, *f) for c in COMMANDS for f in FAMILY if (c, f[0]) != ("identify", "instance")],  # (identify: no InstanceNorm)
    ids=lambda v: v if isinstance(v, str) else None)
def test_a_family_layer_with_rows_of_one_value_is_refused_by_every_command(command, norm, shape, more, tmp_path,
                                                                           capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]]
    line = refused(capsys, *args, "--norm", norm, *more, "--shape", shape)
    assert "needs more than one value per row of its statistics" in line and "R = 1 value per row" in line, line
    # the same layer with two values per row is taken (the refusal is the row's size, not the layer)
    wider = shape.rsplit(",", 1)[0] + ",2" if norm in ("layer", "rms", "instance") else "2,4,1,2"
    if command in ("trace", "gradcheck", "dump"):
        code, _, err = run(capsys, *[a.replace("/d", "/d2") for a in args], "--norm", norm, *more, "--shape", wider)
        assert code in (0, 1), err

"""Kernels that run some modes only, through every command that takes a kernel: an inference-only one (onnxruntime
where it imports; everywhere, bnprobe's emulated kernel behind a wrapper declaring ``infer`` alone, and numpy kernels
with a planted inference bug, bn_plugins.py) and a forward-only one (train and infer, no backward).  A command that
can judge such a kernel judges the modes it runs and names the others in its notes, in one set of words; one that
cannot (gradcheck needs a backward) refuses it in one line, exit 2, nothing written.  The expected words are written
out here, not built by the function that builds them."""

import json

import numpy as np
import pytest

from bnprobe.checks.doctor import bugs as D
from bnprobe.checks.doctor.bugs import describe
from bnprobe.checks.doctor.diagnosis import doctor
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.core.kernel import MODES, modes_left_out, needs_modes, one_mode

from .bn_plugins import ForwardOnly, InferOnly, InferOnlyEpsMissing, InferOnlyUsesBatch, NumpyBN, Restricted

PLUGINS = "tests.checks.bn_plugins"
INFER_ONLY = f"{PLUGINS}:InferOnly"
FORWARD_ONLY = f"{PLUGINS}:ForwardOnly"

#: what a check says it left out of each kind of kernel (the kernel's name first)
LEFT_OUT = {
    "infer": " runs inference only: its training forward (y, saved and running statistics) and backward "
             "(dx, dgamma, dbeta) are not judged",
    "forward": " runs the training forward and inference only: its backward (dx, dgamma, dbeta) is not judged",
}
INFER_CHECK = D.CHECKS["y_infer"][0]


def _ort():
    pytest.importorskip("onnxruntime")
    return "onnxruntime"


def _items(rep):
    return {i.name: i.status for i in rep.items}


# ---- the words, in one place ---------------------------------------------------------------------------------------

def test_the_words_of_what_is_left_out_and_of_a_refusal():
    assert modes_left_out("k", ("infer",)) == "k" + LEFT_OUT["infer"]
    assert modes_left_out("k", ("train", "infer")) == "k" + LEFT_OUT["forward"]
    assert modes_left_out("k", MODES) is None
    assert modes_left_out("k", ("infer",), ("infer",)) is None  # only what was asked for is said
    assert modes_left_out("k", ("infer",), ("train", "infer"), verb="recorded") == (
        "k runs inference only: its training forward (y, saved and running statistics) is not recorded")
    assert needs_modes("gradcheck", ("backward",), "onnxruntime", ("infer",)) == (
        "gradcheck needs the kernel's backward; onnxruntime runs inference only")


def test_one_mode_takes_the_asked_one_the_default_or_the_first_the_kernel_runs():
    assert one_mode("k", MODES, None) == ("train", None)
    assert one_mode("k", ("infer",), None) == ("infer", "k" + LEFT_OUT["infer"])
    assert one_mode("k", ("infer",), "infer") == ("infer", None)  # asked: nothing more to say
    with pytest.raises(BNProbeError, match="^mode train needs the kernel's training forward; k runs inference only$"):
        one_mode("k", ("infer",), "train")
    with pytest.raises(BNProbeError, match="^mode backward needs the kernel's backward; k runs the training forward "
                                           "and inference only$"):
        one_mode("k", ("train", "infer"), "backward")


# ---- doctor: the inference checks run, a planted inference bug fails, a correct kernel passes ----------------------

@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_doctor_gives_a_correct_inference_only_kernel_a_clean_bill_on_its_inference(fmt):
    rep = doctor(InferOnly(), fmt)
    assert rep.passed, [i.evidence for i in rep.items]
    assert _items(rep) == {INFER_CHECK: "PASS", "epsilon is resolvable in the statistics' format": "PASS",
                           "determinism": "PASS"}
    infer = next(i for i in rep.items if i.name == INFER_CHECK)
    assert f"on {len(rep.inputs)} inputs" in infer.evidence  # judged on every input it was given
    assert "stress/eval-after-steps" not in rep.inputs  # (steps of training: not an input of this kernel)
    assert "emulated-infer-only" + LEFT_OUT["infer"] in rep.notes


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("kernel,bug", [(InferOnlyEpsMissing, D.EPS_MISSING), (InferOnlyUsesBatch, D.INFER_BATCH)])
def test_doctor_finds_and_names_a_planted_inference_bug_of_an_inference_only_kernel(kernel, bug, fmt):
    rep = doctor(kernel(), fmt)
    assert not rep.passed and rep.diagnosis == [describe(bug)]
    assert {n for n, s in _items(rep).items() if s == "FAIL"} == {INFER_CHECK}
    # the same bug in a kernel that runs every mode is named the same, on its inference
    full = doctor(NumpyBN(kernel().inner.bug), fmt)
    assert describe(bug) in full.diagnosis and dict(_items(full))[INFER_CHECK] == "FAIL"


def test_doctor_judges_onnxruntime_on_inference():
    ort = _ort()
    for fmt in ("fp32", "fp16"):
        rep = doctor(ort, fmt, params="same")
        assert rep.passed and set(_items(rep)) == {INFER_CHECK, "epsilon is resolvable in the statistics' format",
                                                   "determinism"}
        assert "onnxruntime" + LEFT_OUT["infer"] in rep.notes


def test_doctor_fails_onnxruntime_with_a_planted_bug():
    """onnxruntime's own node with ε left out of its attribute: the inference check fails on the inputs whose
    variance is near ε and names it."""
    pytest.importorskip("onnxruntime")
    from bnprobe.adapters.onnxruntime_bn import OnnxRuntimeAdapter

    class NoEps(OnnxRuntimeAdapter):
        def _session(self, fmt, eps):
            return super()._session(fmt, 0.0)

    rep = doctor(NoEps(), "fp32", params="same")
    assert not rep.passed and rep.diagnosis == [describe(D.EPS_MISSING)]


def test_doctor_judges_a_forward_only_kernel_without_its_backward():
    rep = doctor(ForwardOnly(), "fp16")
    assert rep.passed
    assert D.CHECKS["backward"][0] not in _items(rep) and D.CHECKS["y_eval"][0] in _items(rep)
    assert "emulated-forward-only" + LEFT_OUT["forward"] in rep.notes


def test_doctor_cli_on_an_inference_only_kernel(capsys):
    assert main(["doctor", "--adapter", INFER_ONLY, "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("doctor emulated-infer-only in fp32, params fp32: healthy")
    assert f"note: emulated-infer-only{LEFT_OUT['infer']}\n" in out
    assert main(["doctor", "--adapter", f"{PLUGINS}:InferOnlyUsesBatch", "--dtype", "fp16"]) == 1
    assert f"diagnosis: {describe(D.INFER_BATCH)}" in capsys.readouterr().out


# ---- overflow -------------------------------------------------------------------------------------------------------

def test_overflow_scans_an_inference_only_kernel_on_inference_and_refuses_training(capsys, tmp_path):
    assert main(["overflow", "--adapter", INFER_ONLY, "--shape", "4,3,4,4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("overflow scan of emulated-infer-only in fp16 (infer): clean")
    assert f"note: emulated-infer-only{LEFT_OUT['infer']}\n" in out
    out_dir = tmp_path / "o"
    assert main(["overflow", "--adapter", INFER_ONLY, "--mode", "train", "--out", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err == ("bnprobe: error: --mode train needs the kernel's training forward; emulated-infer-only runs "
                   "inference only\n")
    assert not out_dir.exists()


def test_overflow_finds_what_is_wrong_in_an_inference_only_kernels_output():
    """A NaN channel of y in inference: the scan of the inference it runs sees it."""
    from bnprobe.checks.overflow.scan import scan

    x = np.random.default_rng(0).standard_normal((4, 3, 4, 4))
    rep = scan(Restricted(NumpyBN("nan-channel"), ("infer",), "nan-infer"), x, dtype="fp16")
    assert rep.mode == "infer" and any(f.stage == "y_infer" and f.channels == (0,) for f in rep.findings), rep.findings
    assert rep.notes[0] == "nan-infer" + LEFT_OUT["infer"]


def test_overflow_of_a_forward_only_kernel_in_backward_is_refused(capsys):
    assert main(["overflow", "--adapter", FORWARD_ONLY, "--mode", "backward"]) == 2
    assert capsys.readouterr().err.strip() == ("bnprobe: error: --mode backward needs the kernel's backward; "
                                               "emulated-forward-only runs the training forward and inference only")


def test_overflow_of_onnxruntime(capsys):
    _ort()
    assert main(["overflow", "--adapter", "onnxruntime", "--dtype", "fp32", "--params", "same"]) == 0
    out = capsys.readouterr().out
    assert "(infer, params same): clean" in out.splitlines()[0] and f"note: onnxruntime{LEFT_OUT['infer']}" in out


# ---- gradcheck refuses: it needs a backward --------------------------------------------------------------------------

@pytest.mark.parametrize("adapter,runs", [(INFER_ONLY, "inference only"),
                                          (FORWARD_ONLY, "the training forward and inference only")])
@pytest.mark.parametrize("mode", [[], ["--mode", "infer"]])
def test_gradcheck_refuses_a_kernel_without_a_backward_in_one_line_writing_nothing(adapter, runs, mode, capsys,
                                                                                    tmp_path):
    out = tmp_path / "g"
    assert main(["gradcheck", "--adapter", adapter, "--out", str(out), *mode]) == 2
    name = "emulated-infer-only" if adapter == INFER_ONLY else "emulated-forward-only"
    assert capsys.readouterr().err == f"bnprobe: error: gradcheck needs the kernel's backward; {name} runs {runs}\n"
    assert not out.exists()


def test_gradcheck_refuses_onnxruntime(capsys):
    _ort()
    assert main(["gradcheck", "--adapter", "onnxruntime", "--dtype", "fp32", "--params", "same"]) == 2
    assert capsys.readouterr().err == ("bnprobe: error: gradcheck needs the kernel's backward; onnxruntime runs "
                                       "inference only\n")


def test_gradcheck_refuses_an_inference_only_kernel_on_a_dumps_inputs(tmp_path, capsys):
    assert main(["dump", "--adapter", "emulated", "--out", str(tmp_path / "d"), "--shape", "4,3,4,4"]) == 0
    capsys.readouterr()
    assert main(["gradcheck", "--adapter", INFER_ONLY, "--input", str(tmp_path / "d")]) == 2
    assert "gradcheck needs the kernel's backward; emulated-infer-only runs inference only" in capsys.readouterr().err


# ---- dump records the modes the kernel runs --------------------------------------------------------------------------

def test_dump_of_an_inference_only_kernel_records_its_inference_and_says_so(tmp_path, capsys):
    d = tmp_path / "d"
    assert main(["dump", "--adapter", INFER_ONLY, "--out", str(d), "--shape", "4,3,4,4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recorded emulated-infer-only (infer) in fp16:")
    recorded = ("emulated-infer-only runs inference only: its training forward (y, saved and running statistics) "
                "and backward (dx, dgamma, dbeta) are not recorded")
    assert f"note: {recorded}\n" in out
    doc = json.loads((d / "bnprobe-dump.json").read_text())
    assert set(doc["records"]) == {"infer"} and doc["meta"]["notes"] == [recorded] and not doc["meta"]["training"]
    # every command run on the dump says it
    assert main(["compare-precision", "--adapters", f"dump:{d}", "--out", str(tmp_path / "c")]) == 0
    assert recorded in capsys.readouterr().out


def test_dump_of_modes_the_kernel_does_not_run_is_refused_writing_nothing(tmp_path, capsys):
    d = tmp_path / "d"
    assert main(["dump", "--adapter", INFER_ONLY, "--out", str(d), "--modes", "train,backward"]) == 2
    assert capsys.readouterr().err == ("bnprobe: error: --modes train,backward needs the kernel's training forward "
                                       "and backward; emulated-infer-only runs inference only\n")
    assert not d.exists()


def test_dump_of_onnxruntime(tmp_path, capsys):
    _ort()
    assert main(["dump", "--adapter", "onnxruntime", "--dtype", "fp32", "--params", "same", "--out",
                 str(tmp_path / "d"), "--shape", "2,3,4,4"]) == 0
    assert capsys.readouterr().out.startswith("recorded onnxruntime (infer) in fp32:")


# ---- shrink shrinks the inference it runs ----------------------------------------------------------------------------

def test_shrink_of_an_inference_only_kernel_shrinks_its_inference(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["shrink", "--adapter", f"{PLUGINS}:InferOnlyUsesBatch", "--shape", "4,8,4,4", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "note: infer-only:infer-uses-batch" + LEFT_OUT["infer"] in text
    doc = json.loads((out / "shrink.json").read_text())
    assert doc["mode"] == "infer" and doc["notes"] == ["infer-only:infer-uses-batch" + LEFT_OUT["infer"]]
    assert "--mode infer" in doc["replay"] and np.load(out / "x.npy").size < 4 * 8 * 4 * 4
    assert main(doc["replay"].split()[1:]) == 1  # the replay fails, on inference
    capsys.readouterr()


def test_shrink_in_a_mode_the_kernel_does_not_run_is_refused_writing_nothing(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["shrink", "--adapter", f"{PLUGINS}:InferOnlyUsesBatch", "--mode", "backward", "--out",
                 str(out)]) == 2
    assert capsys.readouterr().err == ("bnprobe: error: --mode backward needs the kernel's training forward and "
                                       "backward; infer-only:infer-uses-batch runs inference only\n")
    assert not out.exists()


# ---- compare-precision and identify ----------------------------------------------------------------------------------

@pytest.mark.parametrize("factory,judged,kind", [(InferOnly, {"y_infer"}, "infer"),
                                                 (ForwardOnly, {"y", "saved_mean", "saved_invstd", "running_mean",
                                                                "running_var", "y_infer"}, "forward")])
def test_compare_precision_judges_the_modes_a_kernel_runs(factory, judged, kind):
    from bnprobe.checks.compare.precision import compare_precision
    from bnprobe.engine.cases import select_cases

    kernel = factory()
    _, cases, _ = select_cases([kernel], shape="2,3,4,4")
    res = compare_precision([kernel], ("fp16",), cases)
    assert set(res.rows["tensor"]) == judged and (res.rows["verdict"] == "PASS").all()
    assert res.meta["notes"] == [kernel.name + LEFT_OUT[kind]]


def test_identify_reproduces_an_inference_only_kernel_and_says_what_it_did_not_identify():
    from bnprobe.checks.identify.search import identify

    res = identify(InferOnly(), "fp16")
    assert res.reproduced and [o.output for o in res.outputs] == ["y_infer"]
    assert res.notes[0] == ("emulated-infer-only runs inference only: its training forward (y, saved and running "
                            "statistics) and backward (dx, dgamma, dbeta) are not identified")


# ---- a runnable inference-only kernel on a training call's recorded inputs -------------------------------------------

def test_an_inference_only_kernel_on_a_training_dumps_inputs_is_judged_on_inference(tmp_path, capsys):
    d = tmp_path / "d"
    assert main(["dump", "--adapter", "emulated", "--out", str(d), "--shape", "4,3,4,4"]) == 0
    capsys.readouterr()
    for cmd in (["doctor"], ["overflow"], ["compare-precision", "--out", str(tmp_path / "c")]):
        flag = "--adapters" if cmd[0] == "compare-precision" else "--adapter"
        assert main([*cmd, flag, INFER_ONLY, "--input", str(d)]) == 0, cmd
        out = capsys.readouterr().out
        assert "emulated-infer-only" + LEFT_OUT["infer"] in out, (cmd, out)
        assert "[train]" not in out and "[backward]" not in out
    assert main(["overflow", "--adapter", INFER_ONLY, "--input", str(d), "--mode", "train"]) == 2
    assert "--mode train needs the kernel's training forward" in capsys.readouterr().err


# ---- every command that takes a kernel is one of these ---------------------------------------------------------------

def test_every_command_taking_an_adapter_is_covered_here():
    """The commands with --adapter: each judges an inference-only kernel above (doctor, overflow, dump, shrink,
    compare-precision, identify) or refuses it (gradcheck); the others (trace, fold, plot-stats, rsqrt, adapters)
    take no kernel."""
    import typer

    from bnprobe.cli import app

    group = typer.main.get_command(app)
    taking = {name for name, cmd in group.commands.items()
              if any("--adapter" in p.opts or "--adapters" in p.opts for p in cmd.params)}
    assert taking == {"doctor", "overflow", "dump", "shrink", "compare-precision", "identify", "gradcheck"}

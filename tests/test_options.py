"""Every value the options of every command accept runs: it answers (exit 0 or 1) or refuses in one line (exit 2);
a crash is never read as a verdict (exit 3, one line, no traceback)."""

import pytest

from bnprobe.adapters.base import MODES, PARAM_PRECISIONS
from bnprobe.engine.rules import RULES
from bnprobe.cli import INTERNAL_ERROR, main
from bnprobe.core.formats import FORMATS
from bnprobe.inputs import DISTRIBUTIONS

SMALL = ["--shape", "2,3,4,4"]
FMTS = sorted(FORMATS)
# each command with the options that take one of a declared set of values, and those values
MATRIX = [
    *[(["compare-precision", *SMALL, "--no-budget", "--dtypes", f], f) for f in FMTS],
    *[(["compare-precision", *SMALL, "--no-budget", "--dtypes", "fp16", "--mode", m], m) for m in (*MODES, "all")],
    *[(["compare-precision", *SMALL, "--no-budget", "--dtypes", "fp16", "--rule", r], r) for r in RULES],
    *[(["compare-precision", *SMALL, "--no-budget", "--dtypes", "bf16", "--params", p], p) for p in PARAM_PRECISIONS],
    *[(["doctor", "--adapter", "emulated", "--dtype", f, "--no-stability"], f) for f in FMTS],
    *[(["doctor", "--adapter", "emulated", "--dtype", "fp16", "--no-stability", *SMALL, "--dist", d], d)
      for d in DISTRIBUTIONS],
    *[(["gradcheck", *SMALL, "--dtype", "fp32", "--dist", d, "--mean", "3", "--std", "0.5"], d) for d in DISTRIBUTIONS],
    *[(["gradcheck", *SMALL, "--dtype", f], f) for f in FMTS],
    *[(["gradcheck", *SMALL, "--dtype", "fp32", "--mode", m], m) for m in ("train", "infer")],
    *[(["overflow", *SMALL, "--dtype", f], f) for f in FMTS],
    *[(["overflow", *SMALL, "--dtype", "fp16", "--mode", m], m) for m in MODES],
    *[(["trace", *SMALL, "--policy", f], f) for f in FMTS],
    *[(["trace", *SMALL, "--policy", "fp16", "--mode", m], m) for m in MODES],
    *[(["fold", "--dtype", f], f) for f in FMTS],
    *[(["rsqrt", "--format", f, "--samples", "2000"], f) for f in FMTS],
]


@pytest.mark.parametrize("args", [a for a, _ in MATRIX], ids=[f"{a[0]}-{v}" for a, v in MATRIX])
def test_every_declared_value_runs_or_is_refused_in_one_line(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), (code, err[-2000:])
    assert "Traceback" not in out + err and "internal error" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("bnprobe"), err


def test_a_crash_exits_3_in_one_line(monkeypatch, capsys):
    """An exception bnprobe did not expect is a bug of bnprobe's: one line naming it and where, exit 3 — not 1, the
    exit status of a verdict that fails, nor 0."""
    import bnprobe.checks.compare.precision as precision

    def boom(*a, **k):
        raise ValueError("Encountered all NA values")

    monkeypatch.setattr(precision, "summarize", boom)  # (the CLI imports it when it reports)
    code = main(["compare-precision", *SMALL, "--no-budget", "--no-stress", "--dtypes", "fp16"])
    err = capsys.readouterr().err
    assert code == INTERNAL_ERROR == 3
    assert "internal error" in err and "ValueError: Encountered all NA values" in err and "Traceback" not in err


def test_fp64_outputs_are_said_to_be_unjudged(capsys):
    """msprobe's benchmark skips float64 outputs: the run does not crash and says that nothing was judged."""
    code = main(["compare-precision", *SMALL, "--no-budget", "--no-stress", "--dtypes", "fp64"])
    out = capsys.readouterr().out
    assert code == 0 and "9 output(s) not judged" in out


@pytest.mark.parametrize("command", ["trace", "overflow", "gradcheck", "compare-precision", "doctor"])
def test_an_empty_shape_is_refused_not_replaced_by_the_default(command, capsys):
    assert main([command, "--shape", ""]) == 2
    assert capsys.readouterr().err.strip() == "bnprobe: error: shape '' must have 2 to 5 dimensions (N,C[,L|H,W|D,H,W])"


def test_an_accumulator_the_kernel_cannot_use_is_named_as_the_option(capsys):
    code = main(["overflow", "--adapter", "ascend-tbe", "--accumulate", "fp16", *SMALL])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("bnprobe: error: --accumulate fp16: ascend-tbe cannot run") and \
        len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("option", [["--eps", "1e-3"], ["--momentum", "0.3"], ["--shape", "2,3,4"], ["--mean", "5"],
                                    ["--std", "2"], ["--dist", "uniform"]])
def test_doctor_refuses_generated_input_options_on_a_dump(option, tmp_path, capsys):
    """Options of generated input contradict a dump; --eps / --momentum are the layer's scalars there (for a dump
    that does not record them), refused when they differ from the recorded ones."""
    assert main(["dump", "--adapter", "reference", "--out", str(tmp_path / "d"), *SMALL, "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--adapter", f"dump:{tmp_path / 'd'}", *option]) == 2
    err = capsys.readouterr().err
    key = option[0][2:]
    want = f"records {key} = {1e-5 if key == 'eps' else 0.1}; {key}={float(option[1]):g} contradicts it" \
        if key in ("eps", "momentum") else f"bnprobe: error: {option[0]} contradicts the recording"
    assert want in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("option", [["--mean", "5"], ["--std", "2"], ["--dist", "uniform"]])
def test_gradcheck_refuses_generated_input_options_on_a_dump(option, tmp_path, capsys):
    assert main(["dump", "--adapter", "reference", "--out", str(tmp_path / "d"), *SMALL, "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert main(["gradcheck", "--adapter", f"dump:{tmp_path / 'd'}", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bnprobe: error: {option[0]} contradicts the recording") and len(err.splitlines()) == 1


def test_doctor_with_the_layers_eps_fails_a_kernel_that_ignores_it(capsys):
    plugin = "tests.checks.bn_plugins:EpsIgnored"
    assert main(["doctor", "--adapter", plugin, "--dtype", "fp32", "--no-stability"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--adapter", plugin, "--dtype", "fp32", "--no-stability", "--eps", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert "eps ignored (uses 1e-05)" in out and "FAIL" in out


def test_doctor_and_gradcheck_take_the_generated_input_options(capsys):
    assert main(["doctor", "--adapter", "reference", "--no-stability", "--shape", "2,3,4", "--mean", "100",
                 "--std", "0.5", "--json"]) == 0
    assert '"generated"' in capsys.readouterr().out
    assert main(["gradcheck", "--adapter", "reference", "--dtype", "fp32", *SMALL, "--mean", "100", "--std", "3"]) == 0

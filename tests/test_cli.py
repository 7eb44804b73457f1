import json
import subprocess
import sys

import numpy as np
import pytest

from bnprobe.cli import main


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("policy", ["fp16", "bf16", "fp32", "fp16-acc16"])
@pytest.mark.parametrize("mode", ["train", "infer", "backward"])
def test_trace_prints_stage_table(capsys, policy, mode):
    code, out, err = run(capsys, "trace", "--policy", policy, "--mode", mode, "--shape", "4,3,5,5")
    assert code == 0, err
    assert err == ""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    stages = [line.split()[0] for line in lines[header + 2:] if line.strip() and not line.startswith("note")]
    final = {"train": "y", "infer": "y", "backward": "dx"}[mode]
    assert final in stages
    assert "max abs err" in lines[header]
    storage = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "fp16-acc16": "fp16"}[policy]
    row = next(line for line in lines[header + 2:] if line.split()[0] == final)
    assert row.split()[1] == storage


def test_trace_json_is_valid_and_complete(capsys):
    code, out, _ = run(capsys, "trace", "--json", "--shape", "4,2,3,3", "--policy", "bf16")
    assert code == 0
    doc = json.loads(out)
    names = [s["stage"] for s in doc["stages"]]
    assert names[0] == "x" and "rstd" in names and "running_var" in names
    y = next(s for s in doc["stages"] if s["stage"] == "y")
    assert y["format"] == "bf16" and 0 < y["max_abs_err"] < 0.05 and y["max_ulp_err"] <= 1.0


def test_trace_reports_overflow_of_fp16_accumulation(capsys):
    code, out, _ = run(capsys, "trace", "--policy", "fp16-acc16:variance=naive", "--shape", "8,4,8,8",
                       "--mean", "100")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("sum_sq "))
    assert "overflow=" in row and "posinf=4" in row


def test_trace_with_input_file_and_nan(tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    x[0, 1, 2] = np.nan
    p = tmp_path / "x.npy"
    np.save(p, x)
    code, out, _ = run(capsys, "trace", "--input", str(p))
    assert code == 0
    assert "input-borne" in out
    x_row = next(line for line in out.splitlines() if line.startswith("x "))
    assert "nan=1" in x_row


@pytest.mark.parametrize("args,message", [
    (["trace", "--foo"], "No such option: --foo"),
    (["trace", "--shape", "3"], "must have 2 to 5 dimensions"),
    (["trace", "--shape", "a,b"], "comma-separated list of integers"),
    (["trace", "--policy", "fp12"], "unknown policy 'fp12'"),
    (["trace", "--eps", "0"], "eps must be a finite number > 0"),
    (["trace", "--eps", "-1"], "eps must be a finite number > 0"),
    (["trace", "--mode", "sideways"], "unknown mode 'sideways'"),
    (["trace", "--shape", "1,4"], "more than one value per channel"),
    (["trace", "--input", "/nonexistent/x.npy"], "does not exist"),
    (["trace", "--seed", "x"], "--seed"),
    (["trace", "--dist", "cauchy"], "unknown distribution 'cauchy'"),
    (["trace", "--layout", "nhwc"], "unknown layout 'nhwc'"),
    (["trace", "--momentum", "2"], "momentum must be in [0, 1]"),
    (["frobnicate"], "No such command"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_corrupt_input_file(tmp_path, capsys):
    p = tmp_path / "x.npy"
    p.write_bytes(b"not numpy at all")
    code, _, err = run(capsys, "trace", "--input", str(p))
    assert code == 2 and "not a .npy or .npz file" in err
    q = tmp_path / "y.npy"
    np.save(q, np.ones((4, 3)))
    q.write_bytes(q.read_bytes()[:-8])  # truncated
    code, _, err = run(capsys, "trace", "--input", str(q))
    assert code == 2 and "truncated or forged" in err


def test_console_script_and_module_entry_points():
    for cmd in (["bnprobe"], [sys.executable, "-m", "bnprobe"]):
        help_ = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=60)
        assert help_.returncode == 0 and "trace" in help_.stdout
        bad = subprocess.run(cmd + ["trace", "--nope"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


def test_cli_start_up_does_not_import_pandas_matplotlib_torch_numba_or_dask():
    code = ("import sys; from bnprobe.cli import app; "
            "print(' '.join(m for m in ('pandas', 'matplotlib', 'torch', 'numba', 'dask') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == ""


def test_rsqrt_reproduces_the_literature_table(capsys):
    code, out, err = run(capsys, "rsqrt", "--format", "fp32", "--method", "magic", "--newton", "0,1,2",
                         "--working", "fp64", "--samples", "200000")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line[:6].strip() in ("0", "1", "2")]
    max_rel = [float(r[4]) for r in rows]
    assert abs(max_rel[0] - 3.44e-2) < 0.01e-2 and abs(max_rel[1] - 1.752e-3) < 0.003e-3
    assert abs(max_rel[2] - 4.60e-6) < 0.01e-6


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_rsqrt_exhaustive_16_bit(capsys, fmt):
    code, out, _ = run(capsys, "rsqrt", "--format", fmt, "--method", "exact")
    assert code == 0 and "domain exhaustive" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    assert row.split()[2] in ("0.5", "0.4999", "0.5000") or float(row.split()[2]) <= 0.5
    assert float(row.split()[5]) == 100.0


def test_rsqrt_writes_files_and_refuses_to_overwrite(tmp_path, capsys):
    args = ["rsqrt", "--format", "bf16", "--method", "table", "--bits", "7", "--out", str(tmp_path)]
    code, out, _ = run(capsys, *args)
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rsqrt-bf16-table.csv", "rsqrt-bf16-table.json", "rsqrt-bf16-table.png"]
    assert (tmp_path / "rsqrt-bf16-table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import pandas as pd

    df = pd.read_csv(tmp_path / "rsqrt-bf16-table.csv")
    assert list(df["newton"]) == [0, 1, 2] and (df["inputs"] == 32639).all()
    doc = json.loads((tmp_path / "rsqrt-bf16-table.json").read_text())
    assert doc["steps"][0]["histogram"] and doc["steps"][2]["worst"]
    code, _, err = run(capsys, *args)
    assert code == 2 and "refusing to overwrite" in err
    code, _, _ = run(capsys, *args, "--force")
    assert code == 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("args,message", [
    (["rsqrt", "--method", "guess", "--samples", "10"], "unknown rsqrt method"),
    (["rsqrt", "--format", "fp64"], "supports fp32, fp16 and bf16"),
    (["rsqrt", "--format", "fp8"], "supports fp32, fp16 and bf16 (or float32, float16, bfloat16), not 'fp8'"),
    (["rsqrt", "--constant", "zz"], "--constant must be an integer"),
    (["rsqrt", "--newton", "a"], "--newton must be a comma-separated list"),
    (["rsqrt", "--exhaustive", "--samples", "5"], "not both"),
    (["rsqrt", "--op", "exp"], "unknown op"),
    (["rsqrt", "--samples", "0"], "--samples must be >= 1"),
])
def test_rsqrt_bad_input(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_adapters_lists_every_adapter(capsys):
    code, out, _ = run(capsys, "adapters")
    assert code == 0
    for name in ("reference", "emulated", "ascend-tbe", "ascend-bnv3", "ascend-950", "torch", "torch:cuda",
                 "torch_npu", "dump"):
        assert any(line.split()[0] == name for line in out.splitlines() if line.strip())
    assert "no: torch has no CUDA device" in out or "yes" in out
    code, out, _ = run(capsys, "adapters", "--json")
    assert code == 0 and {r["name"] for r in json.loads(out)} >= {"reference", "ascend-tbe"}


def test_dump_records_and_replays(tmp_path, capsys):
    out_dir = tmp_path / "d"
    code, out, err = run(capsys, "dump", "--adapter", "ascend-tbe", "--out", str(out_dir), "--dtype", "bf16",
                         "--shape", "4,8,3,3")
    assert code == 0, err
    assert (out_dir / "bnprobe-dump.json").exists() and (out_dir / "tensors.npz").exists()
    from bnprobe.adapters import get_adapter

    rep = get_adapter(f"dump:{out_dir}")
    assert rep.capabilities().formats == ("bf16",) and rep.capabilities().saved == "var"
    code, _, err = run(capsys, "dump", "--adapter", "ascend-tbe", "--out", str(out_dir))
    assert code == 2 and "refusing to overwrite" in err


@pytest.mark.parametrize("args,message", [
    (["dump", "--adapter", "nvidia", "--out", "/tmp/x"], "unknown adapter 'nvidia'"),
    (["dump", "--adapter", "torch:cuda", "--out", "/tmp/x"], "torch:cuda"),
    (["dump", "--adapter", "emulated:fp16", "--dtype", "bf16", "--out", "/tmp/x"], "does not run bf16 (it runs fp16)"),
    (["dump", "--adapter", "reference", "--modes", "sideways", "--out", "/tmp/x"], "--modes takes"),
    (["dump", "--out", "/tmp/x"], "--adapter"),
])
def test_dump_bad_input(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, why", [
    (["trace", "--seed", "-1"], "--seed"),
    (["compare-precision", "--seed", "-1"], "--seed"),
    (["trace", "--eps", "1e300"], "at most 65504"),
    (["trace", "--eps", "0"], "eps must be a finite number > 0"),
    (["trace", "--policy", "fp16:lanes=1000000000"], "lanes must be 1 to 4096"),
    (["trace", "--policy", "fp16:rsqrt_newton=99"], "Newton step counts must be 0 to 8"),
    (["compare-precision", "--batch", "0"], "--batch"),
    (["compare-precision", "--batch", "10000000"], "--batch"),
    (["plot-stats", "--steps", "1000000000"], "--steps"),
    (["plot-stats", "--policies", " , "], "--policies is empty"),
    (["shrink", "--adapter", "emulated", "--seconds", "-1"], "--seconds must be > 0"),
    (["shrink", "--adapter", "emulated", "--seconds", "nan"], "--seconds must be > 0"),
])
def test_bounded_options_are_one_line_errors(capsys, tmp_path, monkeypatch, argv, why):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and why in err, err
    assert list(tmp_path.iterdir()) == []


def test_plot_stats_escapes_layer_names(capsys, tmp_path):
    import csv

    log = tmp_path / "log.csv"
    with open(log, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "layer", "channel", "mean", "var"])
        for step in range(4):
            for layer in ('<script>alert(1)</script>', 'a"b', "../../evil"):
                w.writerows([step, layer, c, 0.1 * step, 1.0] for c in range(2))
    code, _, err = run(capsys, "plot-stats", "--log", str(log), "--out", str(tmp_path / "o"))
    assert code in (0, 1), err
    page = (tmp_path / "o" / "index.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and 'a"b' not in page
    names = [p.name for p in (tmp_path / "o").iterdir()]
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") for n in names)
    assert not (tmp_path / "evil.png").exists() and len([n for n in names if n.startswith("stats-")]) == 3


def test_doctor_says_when_your_input_is_not_finite(capsys, tmp_path):
    p = tmp_path / "nan.npy"
    np.save(p, np.full((2, 3, 4, 4), np.nan))
    code, out, err = run(capsys, "doctor", "--input", str(p), "--no-stability")
    assert code in (0, 1) and "your input holds 96 NaN/inf value(s) of 96" in out
    assert "Warning" not in err


def test_a_plugin_that_is_not_a_base_adapter_and_lacks_a_method(capsys, tmp_path, monkeypatch):
    """A duck-typed plugin (not a BaseAdapter) raising NotImplementedError at run time is one line, exit 2."""
    (tmp_path / "duckplug.py").write_text(
        "from bnprobe.adapters import Capabilities\n"
        "class Duck:\n"
        "    name = 'duck'\n"
        "    def capabilities(self):\n"
        "        return Capabilities(formats=('fp32',), modes=('train', 'infer', 'backward'))\n"
        "    def forward_train(self, *a, **k):\n"
        "        raise NotImplementedError('training forward (duck)')\n"
        "    def forward_infer(self, *a, **k):\n"
        "        raise NotImplementedError\n"
        "    def backward(self, *a, **k):\n"
        "        raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "gradcheck", "--adapter", "duckplug:Duck", "--dtype", "fp32")
    assert code == 2 and err.count("\n") == 1 and "does not implement" in err, err


def test_a_module_in_the_current_folder_is_named_with_pythonpath(tmp_path):
    """The bnprobe command does not search the current folder: a plugin or formula module there is named, with
    PYTHONPATH=. (which then works); one found nowhere is told to be installed or put on PYTHONPATH."""
    import os
    from pathlib import Path

    script = Path(sys.executable).parent / "bnprobe"
    if not script.is_file():
        pytest.skip("the bnprobe command is not installed beside this Python")
    (tmp_path / "mymod.py").write_text("def f(dy, x, gamma, mean, invstd):\n    return dy\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(script), "gradcheck", "--formula", "mymod:f"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "./mymod is here" in r.stderr and "PYTHONPATH=." in r.stderr
    assert r.stderr.count("\n") == 1
    r = subprocess.run([str(script), "gradcheck", "--formula", "mymod:f"], cwd=tmp_path,
                       env={**env, "PYTHONPATH": "."}, capture_output=True, text=True)
    assert "cannot import" not in r.stderr
    r = subprocess.run([str(script), "gradcheck", "--formula", "elsewhere:f"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "install it, or put its folder on PYTHONPATH" in r.stderr


@pytest.mark.parametrize("args,verdict", [(["fold"], 0), (["overflow", "--accumulate", "fp16", "--mean", "100",
                                                             "--shape", "8,4,8,8"], 1)])
def test_the_exit_status_is_the_verdict_when_stdouts_reader_has_gone(args, verdict):
    """``bnprobe ... | head -1``: the reader closes the pipe before the report is written; the exit status is still
    the verdict's (click made a broken pipe exit 1: a pass read as a failure) and nothing is said on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "bnprobe", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line
    with p.stderr:
        err = p.stderr.read().decode()
    assert p.wait(timeout=120) == verdict, err
    assert err == ""


def test_a_command_started_with_stdout_closed_ends_with_its_verdict():
    """``bnprobe fold >&-``: Python starts with no sys.stdout; nothing to write to, no crash, the verdict's status."""
    r = subprocess.run(f"{sys.executable} -m bnprobe fold >&-", shell=True, capture_output=False,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("call,args,field,says", [
    (lambda: __import__("bnprobe").doctor("reference", params="half"), ["doctor", "--params", "half"], "params",
     "params takes same or fp32, got 'half'"),
    (lambda: __import__("bnprobe.checks.fold.onnx_model", fromlist=["x"]).check_onnx("m.onnx", fuse="zz"),
     ["fold", "--onnx", "m.onnx", "--fuse", "zz"], "fuse", "fuse 'zz': valid: ort, ort-basic, ort-all"),
    (lambda: __import__("bnprobe.engine.cases", fromlist=["x"]).select_cases([], calls="*layer1*"),
     ["compare-precision", "--calls", "*layer1*"], "calls",
     "calls selects recorded calls: give a dump (adapters dump:DIR or input DIR)"),
])
def test_a_library_error_names_the_parameter_and_the_command_line_its_flag(call, args, field, says, capsys):
    """The library's error reads in its own words (the parameter's name) and carries the parameter as ``field``;
    the same bad value given on the command line is worded with its flags."""
    from bnprobe.core.errors import BNProbeError

    with pytest.raises(BNProbeError) as exc:
        call()
    assert str(exc.value) == says and exc.value.field == field and "--" not in str(exc.value)
    assert main(args) == 2
    flagged = says.replace(f"{field} ", f"--{field} ", 1).replace("(adapters", "(--adapters").replace("or input",
                                                                                                      "or --input")
    assert capsys.readouterr().err == f"bnprobe: error: {flagged}\n"


def test_an_error_keeps_the_parameters_it_names_across_processes():
    """A sweep's worker raises, its error is pickled back, and the command line still words it as its flags."""
    import pickle

    from bnprobe.cli import flag
    from bnprobe.core.errors import BNProbeError, named

    exc = pickle.loads(pickle.dumps(BNProbeError(f"{named('max_memory')} 1K: drop {named('x')}")))
    assert (str(exc), exc.field, exc.worded(flag)) == ("max_memory 1K: drop x", "max_memory",
                                                       "--max-memory 1K: drop --input")
    assert BNProbeError("no parameter named").field is None and BNProbeError("x", field="eps").field == "eps"

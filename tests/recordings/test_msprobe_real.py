"""bnprobe reads real msprobe 26.x dumps (made by msprobe's own PrecisionDebugger in tests/msprobe_dumps.py):
every BatchNorm call is found, its inputs, scalars and outputs are torch's bit for bit, a replay returns
them, and every command runs on every dump."""

import numpy as np
import pytest

from bnprobe.adapters.dump import DumpAdapter
from bnprobe.adapters import Saved
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import open_dump

TENSOR_DUMPS = ("L1-fp32", "L1-fp16", "L1-bf16", "mix-fp32", "mix-fp16", "eval-fp32")


def expected(root, call, field):
    return np.load(root / call["expected"][field]).astype(np.float64)


@pytest.mark.parametrize("name", TENSOR_DUMPS + ("stats-bf16",))
def test_every_batchnorm_call_is_found_in_forward_order(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    calls = open_dump(root / d["dump_path"])
    assert len(calls.calls) == d["n_bn_calls"] == len(d["calls"])
    assert [c.name for c in calls.calls] == [c["api_name"] for c in d["calls"]]
    assert calls.task == d["task"]
    for got, want in zip(calls.calls, d["calls"]):
        assert got.shape == tuple(want["x_shape"]) and got.training == want["training"]
        assert got.dtype == d["dtype"] and got.has_backward == want["has_backward"]
        if d["level"] == "mix" and want["mix_module"]:
            assert got.module.startswith(want["mix_module"] + ".forward.") and got.module in got.label


@pytest.mark.parametrize("name", TENSOR_DUMPS)
def test_each_call_reads_and_replays_torch_bit_for_bit(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    dump = DumpAdapter(open_dump(root / d["dump_path"]))
    for ref, want in zip(dump.calls.calls, d["calls"]):
        rec = ref.load()
        ci = rec.call()
        assert ci.eps == want["eps"] and ci.momentum == want["momentum"] and ci.training == want["training"]
        assert rec.params == d["dtype"] and ci.params == "same"  # model.half(): parameters in the input's format
        for ours, theirs in (("x", "x"), ("gamma", "weight"), ("beta", "bias"), ("running_mean", "running_mean"),
                             ("running_var", "running_var"), ("dy", "dy")):
            np.testing.assert_array_equal(getattr(ci, ours), expected(root, want, theirs), err_msg=f"{ref.name} {ours}")
        a = dump.bind(rec)
        common = dict(dtype=rec.dtype, eps=ci.eps, params=ci.params)
        if ci.training:
            out = a.forward_train(ci.x, ci.gamma, ci.beta, ci.running_mean, ci.running_var,
                                  momentum=ci.momentum, **common)
            saved = out.saved or Saved(np.zeros(ci.x.shape[1]), "invstd", np.ones(ci.x.shape[1]))
        else:
            out = a.forward_infer(ci.x, ci.gamma, ci.beta, ci.running_mean, ci.running_var, **common)
            saved = Saved(ci.running_mean, "var", ci.running_var)
        np.testing.assert_array_equal(out.y.astype(np.float64), expected(root, want, "y"), err_msg=ref.name)
        if "save_mean" in want["expected"] and ci.training:
            np.testing.assert_array_equal(out.saved.mean.astype(np.float64), expected(root, want, "save_mean"))
            np.testing.assert_array_equal(out.saved.value.astype(np.float64), expected(root, want, "save_invstd"))
        bw = a.backward(ci.dy, ci.x, ci.gamma, saved, training=ci.training, **common)
        for ours, theirs in (("dx", "dx"), ("dgamma", "dweight"), ("dbeta", "dbias")):
            np.testing.assert_array_equal(getattr(bw, ours).astype(np.float64), expected(root, want, theirs),
                                          err_msg=f"{ref.name} {ours}")
        with pytest.raises(BNProbeError, match="eps"):  # never the outputs of another call
            a.backward(ci.dy, ci.x, ci.gamma, saved, training=ci.training,
                       **{**common, "eps": ci.eps * 2})


@pytest.mark.parametrize("name", ["mix-fp32", "mix-fp16"])
def test_mix_level_parameter_gradients_are_checked_against_the_kernel(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    for ref, want in zip(open_dump(root / d["dump_path"]).calls, d["calls"]):
        rec = ref.load()
        if want["mix_module"] and want["has_backward"]:
            assert rec.meta["checks"] == [f"{ref.module.replace('.forward.', '.parameters_grad.')} {p} equals {g}"
                                          for p, g in (("weight", "dgamma"), ("bias", "dbeta"))]
            assert not rec.meta.get("notes")


def test_a_dump_json_path_and_a_call_selection(msprobe_dumps):
    root, manifest = msprobe_dumps
    d = manifest["dumps"]["mix-fp32"]
    dj = next((root / d["dump_path"]).glob("step0/proc*/dump.json"))
    assert len(open_dump(dj).calls) == d["n_bn_calls"]
    picked = open_dump(f"{dj}#*native_batch_norm*").calls
    assert [c.name for c in picked] == ["Torch.native_batch_norm.0"]
    bn2 = [c for c in d["calls"] if c["module"] == "bn2"][0]
    assert [c.name for c in open_dump(root / d["dump_path"], "*.bn2.*").calls] == [bn2["api_name"]]


@pytest.mark.parametrize("name", TENSOR_DUMPS)
def test_compare_precision_runs_on_every_call_of_every_dump(msprobe_dumps, name, tmp_path, capsys):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    rc = main(["compare-precision", "--adapters", f"dump:{root / d['dump_path']},torch", "--out", str(tmp_path / "r"),
               "--format", "json"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    assert f"{d['n_bn_calls']} recorded call(s)" in out and "first call that fails:" in out
    for c in d["calls"]:
        assert c["api_name"] in out


def test_statistics_dump_is_refused_by_compare_with_one_line(msprobe_dumps, tmp_path, capsys):
    root, manifest = msprobe_dumps
    d = manifest["dumps"]["stats-bf16"]
    rc = main(["compare-precision", "--adapters", f"dump:{root / d['dump_path']}", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "statistics-only msprobe dump" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option", [["--shape", "2,3,4,4"], ["--eps", "0.5"], ["--dtypes", "bf16"],
                                    ["--params", "fp32"], ["--std", "2"]])
def test_options_contradicting_a_recording_name_the_conflict(msprobe_dumps, option, tmp_path, capsys):
    root, manifest = msprobe_dumps
    d = manifest["dumps"]["L1-fp16"]
    rc = main(["compare-precision", "--adapters", f"dump:{root / d['dump_path']}", "--out", str(tmp_path / "r"),
               *option])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and ("contradict" in err), err
    assert not (tmp_path / "r").exists()


def test_a_mode_no_call_recorded_is_refused_not_passed(msprobe_dumps, tmp_path, capsys):
    root, manifest = msprobe_dumps
    d = manifest["dumps"]["L1-fp32"]  # training calls only
    rc = main(["compare-precision", "--adapters", f"dump:{root / d['dump_path']}", "--mode", "infer", "--out",
               str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "--mode infer: no call" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()

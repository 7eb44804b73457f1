"""bnprobe reads real msprobe 26.x dumps of the normalisation family (made by msprobe's own PrecisionDebugger in
tests/msprobe_family_dumps.py: nn.GroupNorm, nn.InstanceNorm2d(affine=True), nn.LayerNorm, F.layer_norm with
keywords and torch.native_layer_norm beside an nn.BatchNorm2d, fp32 and bf16, L1, mix and statistics): every call is
found with its layer, its tensors are torch's bit for bit (computed before msprobe was imported), compare-precision
judges every call and passes the fp32 dumps, and what cannot be read says why in one line."""

import ast
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from bnprobe.checks.compare.precision import compare_precision
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import open_dump

TENSOR_DUMPS = ("L1-fp32", "L1-bf16", "mix-fp32", "mix-bf16")


def expected(root, call, field):
    return np.load(root / call["expected"][field]).astype(np.float64)


def dump_of(root, manifest, name):
    return root / manifest["dumps"][name]["dump_path"]


def test_generator_is_independent_of_bnprobe_and_keeps_msprobe_out_of_this_process(msprobe_family_dumps):
    tree = ast.parse((Path(__file__).parents[1] / "msprobe_family_dumps.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and not [m for m in imported if m.split(".")[0] == "bnprobe"], imported
    assert not [m for m in sys.modules if m.startswith("msprobe.")]


def test_the_expected_values_are_not_trivial(msprobe_family_dumps):
    """γ and β are not the modules' initial ones and every gradient is mostly nonzero: a reader that mixed them up
    (or took γ for ones) could not match them."""
    root, manifest = msprobe_family_dumps
    for c in manifest["dumps"]["L1-fp32"]["calls"]:
        e = {f: expected(root, c, f) for f in ("weight", "bias", "dy", "dx", "dweight", "dbias")}
        assert not np.all(e["weight"] == 1) and not np.all(e["bias"] == 0)
        assert not np.array_equal(e["dweight"], e["dbias"])
        for f in ("dy", "dx", "dweight", "dbias"):
            assert np.count_nonzero(e[f]) > e[f].size // 2, (c["api_name"], f)


@pytest.mark.parametrize("name", TENSOR_DUMPS + ("stats-fp32",))
def test_every_call_is_found_in_forward_order_with_its_layer(msprobe_family_dumps, name):
    root, manifest = msprobe_family_dumps
    d = manifest["dumps"][name]
    calls = open_dump(dump_of(root, manifest, name))
    assert [c.name for c in calls.calls] == [c["api_name"] for c in d["calls"]]
    assert calls.task == d["task"]
    for got, want in zip(calls.calls, d["calls"]):
        assert got.shape == tuple(want["x_shape"]) and got.dtype == d["dtype"] and got.training
        assert got.has_backward == want["has_backward"], got.name
        if d["level"] == "mix" and want["mix_module"]:
            assert got.module == want["mix_module"] + ".forward.0"
        if d["task"] == "tensor":
            ci = got.load().call()
            assert (ci.norm, ci.normalized_shape, ci.groups, ci.weight_offset) == (
                want["norm"], None if want["normalized_shape"] is None else tuple(want["normalized_shape"]),
                want["groups"], 0.0)
            assert ci.eps == want["eps"] and ci.training


@pytest.mark.parametrize("name", TENSOR_DUMPS)
def test_each_call_holds_torchs_values_bit_for_bit(msprobe_family_dumps, name):
    """x, γ, β, y, dy, dx, dγ, dβ (and the native call's mean and rstd) as read are the values torch computed for
    the call before msprobe was imported, each in the model's format."""
    root, manifest = msprobe_family_dumps
    d = manifest["dumps"][name]
    for ref, want in zip(open_dump(dump_of(root, manifest, name)).calls, d["calls"]):
        rec = ref.load()
        ci = rec.call()
        assert rec.dtype == rec.params == d["dtype"]
        pairs = [(ci.x, "x"), (ci.gamma, "weight"), (ci.beta, "bias"), (rec.get("train", "outputs", "y"), "y")]
        if want["has_backward"]:
            out = rec.tensors["backward"]["outputs"]
            pairs += [(ci.dy, "dy"), (out["dx"], "dx"), (out["dgamma"], "dweight"), (out["dbeta"], "dbias")]
        else:
            assert "backward" not in rec.tensors and ci.dy is None
        if "mean" in want["expected"]:
            pairs += [(rec.get("train", "outputs", "saved_mean"), "mean"),
                      (rec.get("train", "outputs", "saved_value"), "rstd")]
            assert rec.saved_kind == "invstd"
        for got, field in pairs:
            want_a = expected(root, want, field)
            assert np.array_equal(np.asarray(got).reshape(want_a.shape), want_a), (ref.name, field)
        for io in ("inputs", "outputs"):
            for k, f in ((k, rec.formats[f"train.{io}.{k}"]) for k in rec.tensors["train"][io]):
                assert f == d["dtype"], (ref.name, k, f)


@pytest.mark.parametrize("name", ["L1-fp32", "mix-fp32"])
def test_an_rms_norm_module_is_no_call_and_the_dump_says_why(msprobe_family_dumps, name):
    """msprobe hooks no rms_norm: the model's nn.RMSNorm leaves no API record, and at the mix level its module record
    (no ε in it) is named in a note."""
    root, manifest = msprobe_family_dumps
    d = manifest["dumps"][name]
    path = dump_of(root, manifest, name)
    data = json.loads(next(path.glob("step0/proc*/dump.json")).read_text())["data"]
    assert not [k for k in data if "rms_norm" in k.lower()]
    assert [k for k in data if k.startswith("Module.") and "RMSNorm.forward" in k] == d["rms_modules"]
    notes = open_dump(path).notes
    assert notes == ((f"1 RMSNorm module record ({d['rms_modules'][0]}) not read: msprobe hooks no rms_norm API, and "
                      "a module's record holds x, y and γ but not ε",) if d["rms_modules"] else ())


def test_a_dump_of_rms_norm_modules_alone_is_refused_with_the_reason(msprobe_family_dumps, tmp_path):
    root, manifest = msprobe_family_dumps
    copy = _damaged(root, manifest, tmp_path, lambda data: [data.pop(k) for k in list(data)
                                                            if not k.startswith("Module.rms.")], "mix-fp32")
    with pytest.raises(BNProbeError, match=r"1 RMSNorm module record \(Module.rms.RMSNorm.forward.0\) not read: "
                                           "msprobe hooks no rms_norm API"):
        open_dump(copy)


def test_instance_norm_at_L1_is_read_forward_only_and_says_why(msprobe_family_dumps):
    root, manifest = msprobe_family_dumps
    ref = open_dump(dump_of(root, manifest, "L1-fp32"), "Functional.instance_norm.*").calls[0]
    rec = ref.load()
    assert rec.modes == ("train",) and ref.modes == ("train",)
    note = [n for n in rec.meta["notes"] if "backward is not read" in n]
    assert len(note) == 1 and "(1, N·C, ...)" in note[0] and "mix-level" in note[0]
    # what the note says is so: the record's only backward output is dy reshaped, not dx
    data = json.loads(next(dump_of(root, manifest, "L1-fp32").glob("step0/proc*/dump.json")).read_text())["data"]
    outs = data["Functional.instance_norm.0.backward"]["output"]
    assert [o["shape"] for o in outs if o] == [[1, 3 * 8, 4, 4]]


@pytest.mark.parametrize("name", ["mix-fp32", "mix-bf16"])
def test_mix_level_checks_the_modules_gradients_and_gives_instance_norm_its_backward(msprobe_family_dumps, name):
    root, manifest = msprobe_family_dumps
    for ref in open_dump(dump_of(root, manifest, name)).calls:
        rec = ref.load()
        if ref.name.startswith(("Functional.group_norm", "Functional.layer_norm.0", "Functional.batch_norm")):
            assert rec.meta["checks"] == [f"{ref.module.replace('.forward.', '.parameters_grad.')} {p} equals {g}"
                                          for p, g in (("weight", "dgamma"), ("bias", "dbeta"))]
        if ref.name.startswith("Functional.instance_norm"):
            assert rec.modes == ("train", "backward") and sorted(rec.tensors["backward"]["outputs"]) == [
                "dbeta", "dgamma", "dx"]
            assert any("from Module.inorm.InstanceNorm2d.backward.0" in n for n in rec.meta["notes"])


@pytest.mark.parametrize("name", ["L1-fp32", "mix-fp32"])
def test_compare_precision_judges_every_call_and_a_correct_fp32_dump_passes(msprobe_family_dumps, name):
    from bnprobe.adapters import get_adapter

    root, manifest = msprobe_family_dumps
    d = manifest["dumps"][name]
    res = compare_precision([get_adapter(f"dump:{dump_of(root, manifest, name)}")], budget=False)
    rows = res.rows
    judged = {c: set(rows[rows.case.astype(str).str.startswith(c)].tensor) for c in (w["api_name"] for w in d["calls"])}
    for want in d["calls"]:
        outs = {"y"} | ({"dx", "dgamma", "dbeta"} if want["has_backward"] else set())
        outs |= {"saved_mean", "saved_rstd"} if "mean" in want["expected"] else set()
        if want["norm"] == "batch":
            outs |= {"saved_mean", "saved_invstd", "running_mean", "running_var"} & judged[want["api_name"]]
        assert judged[want["api_name"]] == outs, (want["api_name"], judged[want["api_name"]])
    failing = rows[rows.verdict.astype(str).str.endswith("FAIL")]
    assert failing.empty, failing[["case", "tensor", "why"]].to_string()


@pytest.mark.parametrize("name", ["L1-bf16", "mix-bf16"])
def test_compare_precision_runs_on_the_bf16_dumps(msprobe_family_dumps, name, tmp_path, capsys):
    root, manifest = msprobe_family_dumps
    d = manifest["dumps"][name]
    rc = main(["compare-precision", "--adapters", f"dump:{dump_of(root, manifest, name)}", "--no-budget", "--out",
               str(tmp_path / "r"), "--format", "json"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    assert f"{len(d['calls'])} recorded call(s)" in out and all(c["api_name"] in out for c in d["calls"])


def test_statistics_dump_gives_each_family_calls_summaries(msprobe_family_dumps):
    root, manifest = msprobe_family_dumps
    d = manifest["dumps"]["stats-fp32"]
    for ref, want in zip(open_dump(dump_of(root, manifest, "stats-fp32")).calls, d["calls"]):
        s = ref.load()
        pairs = {"forward.input.x": "x", "forward.input.gamma": "weight", "forward.input.beta": "bias",
                 "forward.output.y": "y", "backward.input.dy": "dy"}
        if want["has_backward"]:
            pairs.update({"backward.output.dx": "dx", "backward.output.dgamma": "dweight",
                          "backward.output.dbeta": "dbias"})
        if "mean" in want["expected"]:
            pairs.update({"forward.output.saved_mean": "mean", "forward.output.saved_rstd": "rstd"})
        if want["norm"] == "batch":
            pairs.update({"forward.input.running_mean": "running_mean", "forward.input.running_var": "running_var"})
        assert set(s) == set(pairs), (ref.name, sorted(s))
        for key, field in pairs.items():
            a = expected(root, want, field)
            assert s[key]["dtype"] == "fp32" and s[key]["shape"] == list(a.shape), (ref.name, key)
            assert s[key]["Max"] == a.max() and s[key]["Min"] == a.min(), (ref.name, key)


def test_overflow_reads_the_statistics_dump(msprobe_family_dumps, capsys):
    root, manifest = msprobe_family_dumps
    rc = main(["overflow", "--adapter", f"dump:{dump_of(root, manifest, 'stats-fp32')}"])
    out = capsys.readouterr().out
    assert rc == 0 and "6 recorded call(s)" in out and ": clean" in out, out


def _damaged(root, manifest, tmp_path, change, name="L1-fp32"):
    """A copy of dump ``name`` whose dump.json ``change`` edits."""
    copy = tmp_path / "dump"
    shutil.copytree(dump_of(root, manifest, name), copy)
    dj = next(copy.glob("step0/proc*/dump.json"))
    doc = json.loads(dj.read_text())
    change(doc["data"])
    dj.write_text(json.dumps(doc))
    return copy


def _set(record, index, value):
    def f(data):
        data[f"{record}.forward"]["input_args"][index] = value
    return f


@pytest.mark.parametrize("change, call, why", [
    (_set("Functional.layer_norm.0", 1, [{"type": "int", "value": 5}]), "Functional.layer_norm.0",
     "normalized_shape [5] is not x's trailing dimensions"),
    (_set("Functional.layer_norm.1", 1, {"type": "str", "value": "4,32"}), "Functional.layer_norm.1",
     "records normalized_shape as an object of type 'str', not a list of integers"),
    (_set("Functional.group_norm.0", 1, {"type": "int", "value": 3}), "Functional.group_norm.0",
     "groups must divide the 8 channels, got 3"),
    (_set("Functional.instance_norm.0", 5, {"type": "bool", "value": False}), "Functional.instance_norm.0",
     "normalises with its running statistics (use_input_stats false)"),
    (lambda data: data["Torch.native_layer_norm.0.forward"]["input_args"].pop(), "Torch.native_layer_norm.0",
     "records no eps"),
    (lambda data: data["Functional.layer_norm.1.forward"]["input_kwargs"].update(weight="weights"),
     "Functional.layer_norm.1",
     "weight is the string 'weights', not a tensor record or null"),
    (lambda data: data["Functional.layer_norm.0.forward"]["input_args"].__setitem__(
        2, data["Functional.group_norm.0.forward"]["input_args"][2]),
     "Functional.layer_norm.0", "weight has shape [8], the layer's parameters [32]"),
])
def test_a_record_that_cannot_be_read_says_why_in_one_line(msprobe_family_dumps, tmp_path, capsys, change, call, why):
    root, manifest = msprobe_family_dumps
    copy = _damaged(root, manifest, tmp_path, change)
    with pytest.raises(BNProbeError) as err:
        [c.load() for c in open_dump(copy, call).calls]
    assert why in str(err.value) and call in str(err.value) and "\n" not in str(err.value)
    rc = main(["compare-precision", "--adapters", f"dump:{copy}", "--no-budget", "--out", str(tmp_path / "r")])
    stderr = capsys.readouterr().err
    assert rc == 2 and why in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "r").exists()


def test_a_given_eps_that_contradicts_a_recorded_one_is_refused(msprobe_family_dumps):
    root, manifest = msprobe_family_dumps
    ref = open_dump(f"{dump_of(root, manifest, 'L1-fp32')},eps=0.5", "Functional.group_norm.*").calls[0]
    with pytest.raises(BNProbeError, match=r"Functional.group_norm.0 records eps = 1e-05; eps=0.5 contradicts it"):
        ref.load()


def test_an_instance_norm_module_run_twice_gives_dx_but_not_its_summed_parameter_gradients(msprobe_family_dumps,
                                                                                           tmp_path):
    """A module that ran twice has one parameters_grad, the sum of its calls' (msprobe 26.2 records it once): the
    call's dγ and dβ are then not read from it."""
    root, manifest = msprobe_family_dumps
    key = "Module.inorm.InstanceNorm2d.forward."
    copy = _damaged(root, manifest, tmp_path, lambda data: data.update({key + "1": data[key + "0"]}), "mix-fp32")
    rec = open_dump(copy, "Functional.instance_norm.*").calls[0].load()
    assert sorted(rec.tensors["backward"]["outputs"]) == ["dx"]
    assert any("dγ, dβ not read: the module ran 2 times" in n for n in rec.meta["notes"])


def test_aten_records_are_read_with_the_native_schema(msprobe_family_dumps, tmp_path):
    """Aten.native_layer_norm (as msprobe's ACL-graph dumper names aten ops) takes torch.native_layer_norm's
    arguments: the same record under that name is the same call."""
    root, manifest = msprobe_family_dumps

    def rename(data):
        for k in [k for k in data if k.startswith("Torch.native_layer_norm.0.")]:
            data["Aten" + k[len("Torch"):]] = data.pop(k)

    copy = _damaged(root, manifest, tmp_path, rename)
    aten = open_dump(copy, "Aten.*").calls[0].load()
    torch_rec = open_dump(dump_of(root, manifest, "L1-fp32"), "Torch.native_layer_norm.*").calls[0].load()
    assert aten.call().normalized_shape == (32,) and aten.eps == torch_rec.eps == 1e-4
    for mode in ("train", "backward"):
        for io in ("inputs", "outputs"):
            assert sorted(aten.tensors[mode][io]) == sorted(torch_rec.tensors[mode][io])
            for k, v in aten.tensors[mode][io].items():
                assert np.array_equal(v, torch_rec.tensors[mode][io][k]), (mode, io, k)

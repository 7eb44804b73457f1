"""Dumps of every kind read and written: bnprobe's own (round trip, damaged and hostile metadata and tensors),
model dumps, and small msprobe dumps built here (layouts, steps, damaged and hostile dump.json, .npy and .pt
files); every malformed file is a one-line error naming it, and nothing is unpickled."""

import json
import os
import pickle
import re
import zipfile
from io import BytesIO

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import load_dump, open_dump, read_msprobe, record, write_dump
from bnprobe.core.call import BNCall


def recorded(tmp_path, adapter="emulated", dtype="fp16"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5))
    rec = record(get_adapter(adapter), BNCall(x=x, gamma=rng.uniform(0.5, 1.5, 3), beta=rng.normal(0, 0.1, 3),
                                              running_mean=np.zeros(3), running_var=np.ones(3),
                                              dy=rng.standard_normal(x.shape), dtype=dtype), meta={"seed": 0})
    write_dump(rec, tmp_path)
    return rec


@pytest.mark.parametrize("adapter,dtype", [("emulated", "fp16"), ("emulated", "bf16"), ("ascend-tbe", "fp32"),
                                           ("reference", "fp64"), ("torch", "bf16")])
def test_round_trip_gives_identical_arrays(tmp_path, adapter, dtype):
    if adapter == "torch":
        pytest.importorskip("torch")
    rec = recorded(tmp_path, adapter, dtype)
    back = load_dump(tmp_path)
    assert back.modes == ("train", "infer", "backward") and back.dtype == rec.dtype and back.eps == rec.eps
    for mode, ios in rec.tensors.items():
        for io, named in ios.items():
            for name, a in named.items():
                np.testing.assert_array_equal(back.tensors[mode][io][name], a)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    assert meta["adapter"] == get_adapter(adapter).name and meta["meta"]["seed"] == 0
    # replaying: the dump adapter returns the recorded outputs bit for bit
    rep = DumpAdapter(back)
    i = rep.inputs("train")
    out = rep.forward_train(i["x"], i["gamma"], i["beta"], i["running_mean"], i["running_var"], dtype=dtype)
    np.testing.assert_array_equal(out.y.astype(np.float64), rec.tensors["train"]["outputs"]["y"])


def test_a_version_1_dump_is_still_read(tmp_path):
    rec = recorded(tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    assert meta["version"] == 2
    meta["version"] = 1
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    x = rec.tensors["train"]["inputs"]["x"]
    np.testing.assert_array_equal(load_dump(tmp_path).tensors["train"]["inputs"]["x"], x)


def test_an_array_recorded_twice_is_stored_once_and_read_back_under_both_names(tmp_path):
    rec = recorded(tmp_path / "a")
    x = rec.tensors["train"]["inputs"]["x"]
    rec.tensors["backward"]["inputs"]["x"] = x  # as a capture records it: the same array
    rec.tensors["backward"]["inputs"]["dy"] = rec.tensors["backward"]["inputs"]["dy"].copy()
    write_dump(rec, tmp_path / "b")
    with zipfile.ZipFile(tmp_path / "b" / "tensors.npz") as zf:
        names = sorted(zf.namelist())
    assert "train.inputs.x.npy" in names and "backward.inputs.x.npy" not in names
    assert "backward.inputs.dy.npy" in names  # an equal copy is its own array
    back = load_dump(tmp_path / "b")
    for mode, ios in rec.tensors.items():
        for io, named in ios.items():
            for name, a in named.items():
                np.testing.assert_array_equal(back.tensors[mode][io][name], a)
                assert back.formats[f"{mode}.{io}.{name}"] == rec.formats[f"{mode}.{io}.{name}"]


def test_dump_refuses_to_overwrite(tmp_path):
    rec = recorded(tmp_path)
    with pytest.raises(BNProbeError, match="refusing to overwrite"):
        write_dump(rec, tmp_path)
    write_dump(rec, tmp_path, force=True)


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / "tensors.npz").unlink(), r"tensors.npz: missing"),
    (lambda d: (d / "tensors.npz").write_bytes(b"PK\x03\x04 broken"), r"tensors.npz: corrupt"),
    (lambda d: (d / "bnprobe-dump.json").write_text("{not json"), r"not readable JSON"),
    (lambda d: (d / "bnprobe-dump.json").write_text('{"format": "other"}'), r"not a bnprobe dump"),
])
def test_damaged_dumps_are_clear_errors(tmp_path, damage, match):
    recorded(tmp_path)
    damage(tmp_path)
    with pytest.raises(BNProbeError, match=match):
        load_dump(tmp_path)


def test_metadata_disagreeing_with_tensors(tmp_path):
    recorded(tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    meta["records"]["train"]["inputs"]["x"]["shape"] = [4, 3, 5, 6]
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    with pytest.raises(BNProbeError, match=r"tensor 'train.inputs.x' has shape \[4, 3, 5, 5\] but"):
        load_dump(tmp_path)
    meta["records"]["train"]["inputs"]["x"]["shape"] = [4, 3, 5, 5]
    meta["records"]["train"]["inputs"]["x"]["key"] = "train.inputs.nope"
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    with pytest.raises(BNProbeError, match="'train.inputs.nope' named in bnprobe-dump.json is missing"):
        load_dump(tmp_path)


def tensor_entry(name, a, dtype="torch.float16"):
    return {"type": "torch.Tensor", "dtype": dtype, "shape": list(a.shape), "Max": float(a.max()),
            "Min": float(a.min()), "Mean": float(a.mean()), "Norm": float(np.linalg.norm(a)),
            "requires_grad": False, "data_name": name}


def build_msprobe(folder, suffix=".npy"):
    """A small msprobe dump: Functional.batch_norm and aten native_batch_norm, forward and backward."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float16)
    w, b = rng.uniform(0.5, 1.5, 3).astype(np.float32), rng.normal(0, 0.1, 3).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    ref = get_adapter("reference")
    f = ref.forward_train(x.astype(np.float64), w, b, rm, rv, dtype="fp16")
    dy = rng.standard_normal(x.shape).astype(np.float16)
    bw = ref.backward(dy.astype(np.float64), x.astype(np.float64), w, f.saved, dtype="fp16")
    rank = folder / "step0" / "rank0"
    data_dir = rank / "dump_tensor_data"
    data_dir.mkdir(parents=True)
    tensors = {}

    def save(name, a):
        fname = name + suffix
        if suffix == ".pt":
            import torch

            torch.save(torch.from_numpy(np.ascontiguousarray(a)), data_dir / fname)
        else:
            np.save(data_dir / fname, a)
        tensors[name] = a
        return fname

    y = f.y.astype(np.float16)
    sm, si = f.saved.mean.astype(np.float32), f.saved.value.astype(np.float32)
    api = "Aten.native_batch_norm.0"
    data = {
        "Functional.relu.0.forward": {"input_args": [tensor_entry(save("Functional.relu.0.forward.input.0", x), x)],
                                      "input_kwargs": {}, "output": []},
        f"{api}.forward": {
            "input_args": [tensor_entry(save(f"{api}.forward.input.0", x), x),
                           tensor_entry(save(f"{api}.forward.input.1", w), w, "torch.float32"),
                           tensor_entry(save(f"{api}.forward.input.2", b), b, "torch.float32"),
                           tensor_entry(save(f"{api}.forward.input.3", rm), rm, "torch.float32"),
                           tensor_entry(save(f"{api}.forward.input.4", rv), rv, "torch.float32"),
                           {"type": "bool", "value": True}, {"type": "float", "value": 0.1},
                           {"type": "float", "value": 1e-5}],
            "input_kwargs": {},
            "output": [tensor_entry(save(f"{api}.forward.output.0", y), y),
                       tensor_entry(save(f"{api}.forward.output.1", sm), sm, "torch.float32"),
                       tensor_entry(save(f"{api}.forward.output.2", si), si, "torch.float32")]},
        f"{api}.backward": {
            "input": [tensor_entry(save(f"{api}.backward.input.0", dy), dy)],
            "output": [tensor_entry(save(f"{api}.backward.output.0", bw.dx.astype(np.float16)),
                                    bw.dx.astype(np.float16)),
                       tensor_entry(save(f"{api}.backward.output.1", bw.dgamma.astype(np.float32)),
                                    bw.dgamma.astype(np.float32), "torch.float32"),
                       tensor_entry(save(f"{api}.backward.output.2", bw.dbeta.astype(np.float32)),
                                    bw.dbeta.astype(np.float32), "torch.float32")]},
        "Functional.batch_norm.1.forward": {
            "input_args": [tensor_entry(save("Functional.batch_norm.1.forward.input.0", x), x),
                           tensor_entry(save("Functional.batch_norm.1.forward.input.1", rm), rm, "torch.float32"),
                           tensor_entry(save("Functional.batch_norm.1.forward.input.2", rv), rv, "torch.float32")],
            "input_kwargs": {"weight": tensor_entry(save("Functional.batch_norm.1.forward.input.3", w), w,
                                                    "torch.float32"),
                             "training": {"type": "bool", "value": False}, "eps": {"type": "float", "value": 1e-3}},
            "output": [tensor_entry(save("Functional.batch_norm.1.forward.output.0", y), y)]},
    }
    (rank / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch",
                                                "dump_data_dir": str(data_dir), "data": data}))
    return tensors, f, bw


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_msprobe_directory_is_read(tmp_path, suffix):
    if suffix == ".pt":
        pytest.importorskip("torch")
    tensors, f, bw = build_msprobe(tmp_path, suffix)
    rec = load_dump(tmp_path)  # finds step0/rank0/dump.json and the first BatchNorm call
    assert rec.adapter == "msprobe:Aten.native_batch_norm.0" and rec.dtype == "fp16" and rec.params == "fp32"
    assert rec.modes == ("train", "backward") and rec.saved_kind == "invstd" and rec.eps == 1e-5
    np.testing.assert_array_equal(rec.tensors["train"]["inputs"]["x"],
                                  tensors["Aten.native_batch_norm.0.forward.input.0"])
    np.testing.assert_array_equal(rec.tensors["train"]["outputs"]["saved_value"], f.saved.value.astype(np.float32))
    np.testing.assert_array_equal(rec.tensors["backward"]["outputs"]["dgamma"], bw.dgamma.astype(np.float32))
    # the second call, by name: functional batch_norm in inference with eps from kwargs
    rec2 = read_msprobe(tmp_path, "Functional.batch_norm.1")
    assert rec2.modes == ("infer",) and rec2.eps == 1e-3 and "gamma" in rec2.tensors["infer"]["inputs"]
    rep = get_adapter(f"dump:{tmp_path}#Functional.batch_norm.1")
    i = rep.inputs("infer")
    out = rep.forward_infer(i["x"], i["gamma"], None, i["running_mean"], i["running_var"], dtype="fp16", eps=1e-3)
    assert out.y.dtype == np.float16


def test_msprobe_errors_name_the_file(tmp_path):
    build_msprobe(tmp_path)
    victim = tmp_path / "step0/rank0/dump_tensor_data/Aten.native_batch_norm.0.forward.input.1.npy"
    victim.unlink()
    with pytest.raises(BNProbeError, match="forward.input.1.npy: missing"):
        load_dump(tmp_path)
    np.save(victim, np.ones(4, np.float32))
    with pytest.raises(BNProbeError, match=r"forward.input.1.npy: shape \[4\] disagrees"):
        load_dump(tmp_path)
    victim.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(BNProbeError, match="forward.input.1.npy: corrupt"):
        load_dump(tmp_path)
    with pytest.raises(BNProbeError, match="no BatchNorm call matches 'Functional.batch_norm.7'"):
        read_msprobe(tmp_path, "Functional.batch_norm.7")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BNProbeError, match="neither a bnprobe dump"):
        load_dump(empty)


def test_msprobe_layouts_as_msprobe_26_writes_them(tmp_path):
    """step0/proc<pid>/ (one process), the folder holding dump.json, and the path of dump.json itself."""
    build_msprobe(tmp_path)
    (tmp_path / "step0" / "rank0").rename(tmp_path / "step0" / "proc4242")
    base = tmp_path / "step0" / "proc4242"
    for spec in (tmp_path, base, base / "dump.json", f"{base / 'dump.json'}#Functional.batch_norm.*"):
        calls = open_dump(spec)
        assert calls.kind == "msprobe"
        names = [c.name for c in calls.calls]
        assert names == (["Functional.batch_norm.1"] if "#" in str(spec) else
                         ["Aten.native_batch_norm.0", "Functional.batch_norm.1"])
    calls = open_dump(tmp_path)
    assert [c.training for c in calls.calls] == [True, False] and [c.has_backward for c in calls.calls] == [True, False]
    assert calls.calls[0].shape == (4, 3, 2, 2) and calls.calls[0].dtype == "fp16"
    with pytest.raises(BNProbeError, match="no BatchNorm call matches 'nope'"):
        open_dump(tmp_path, "nope")


def test_several_steps_are_all_read_and_named_by_folder(tmp_path):
    build_msprobe(tmp_path / "a")
    (tmp_path / "a" / "step0").rename(tmp_path / "step0")
    build_msprobe(tmp_path / "b")
    (tmp_path / "b" / "step0").rename(tmp_path / "step1")
    calls = open_dump(tmp_path)
    assert [c.name for c in calls.calls] == [f"step{s}/rank0/{n}" for s in (0, 1)
                                             for n in ("Aten.native_batch_norm.0", "Functional.batch_norm.1")]
    assert any("2 dump.json files" in n for n in calls.notes)


@pytest.mark.parametrize("damage,match", [
    (lambda d: d.write_text("{broken"), "not readable JSON"),
    (lambda d: d.write_text('{"task": "tensor"}'), r"no \"data\" object"),
    (lambda d: d.write_text(json.dumps({"data": {"Functional.batch_norm.0.forward": {"input_args": {}}}})),
     "input_args/input_kwargs of the wrong JSON type"),
    (lambda d: d.write_text(json.dumps({"data": {"Functional.batch_norm.0.forward": {"input_args": [3]}}})),
     "has no input tensor"),
    (lambda d: d.write_text(json.dumps({"data": {"Functional.relu.0.forward": {}}})), "no BatchNorm call"),
    (lambda d: d.write_text(json.dumps({"data": {"Module.bn.BatchNorm2d.forward.0": {}}})), "module-level"),
])
def test_broken_msprobe_metadata_is_one_line(tmp_path, damage, match):
    build_msprobe(tmp_path)
    damage(tmp_path / "step0" / "rank0" / "dump.json")
    with pytest.raises(BNProbeError, match=match) as info:
        [c.load() for c in open_dump(tmp_path).calls]
    assert "\n" not in str(info.value)


def test_backward_without_its_gradients_is_an_error(tmp_path):
    build_msprobe(tmp_path)
    dj = tmp_path / "step0" / "rank0" / "dump.json"
    doc = json.loads(dj.read_text())
    doc["data"]["Aten.native_batch_norm.0.backward"]["output"] = []
    dj.write_text(json.dumps(doc))
    with pytest.raises(BNProbeError, match="backward lacks its gradient tensors"):
        open_dump(tmp_path).calls[0].load()


@pytest.mark.parametrize("bad,match", [
    ({"records": []}, "records"),
    ({"records": {"train": {"inputs": {"x": {"shape": [1]}}, "outputs": {}}}}, "lacks its key"),
    ({"records": {"train": {"inputs": {}}}}, "lack their inputs or outputs"),
    ({"eps": "1e-5"}, "eps = '1e-5'"), ({"eps": None}, "eps = None"), ({"momentum": "x"}, "momentum = 'x'"),
    ({"dtype": "int8"}, "int8"),
])
def test_malformed_bnprobe_metadata_is_one_line(tmp_path, bad, match):
    recorded(tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    meta.update(bad)
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    with pytest.raises(BNProbeError, match=match):
        load_dump(tmp_path)


def test_a_call_lists_the_modes_it_recorded_without_loading(tmp_path):
    recorded(tmp_path)
    (call,) = open_dump(tmp_path).calls
    assert call.modes == ("train", "infer", "backward")


def test_a_backward_only_recording_is_a_training_call(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5))
    rec = record(get_adapter("reference"), BNCall(x, None, None, np.zeros(3), np.ones(3), rng.standard_normal(x.shape),
                                                  dtype="fp32"), modes=("backward",))
    assert rec.training and rec.call().running_mean is None


def test_an_empty_model_dump_is_one_line(tmp_path):
    (tmp_path / "bnprobe-calls.json").write_text(json.dumps({"format": "bnprobe-calls", "calls": []}))
    with pytest.raises(BNProbeError, match="holds no BatchNorm call"):
        load_dump(tmp_path)


# ---- hostile dumps: every malformed file a one-line error, nothing unpickled ------------------------------------

def one_line(info):
    msg = str(info.value)
    assert type(info.value) is BNProbeError and msg and "\n" not in msg
    return msg


def _set(path, value):
    """A change to a JSON document: ``value`` at ``path`` (a list of keys), or the key removed (value KeyError)."""
    def change(doc):
        for k in path[:-1]:
            doc = doc[k]
        if value is KeyError:
            del doc[path[-1]]
        else:
            doc[path[-1]] = value
    return change


X = ["records", "train", "inputs", "x"]


@pytest.mark.parametrize("change,match", [
    (_set(["records"], {}), '"records" must map'), (_set(["records"], "s"), '"records" must map'),
    (_set(["records"], None), '"records" must map'), (_set(["records", "train"], []), "not objects of tensors"),
    (_set(X, KeyError), "records of train lack the inputs x"),
    (_set(["records", "train", "outputs", "y"], KeyError), "records of train lack the outputs y"),
    (_set(["records", "infer", "inputs", "running_var"], KeyError), "records of infer lack the inputs running_var"),
    (_set(["records", "backward", "inputs", "dy"], KeyError), "records of backward lack the inputs dy"),
    (_set(X + ["key"], KeyError), "train.inputs.x lacks its key"),
    (_set(X + ["shape"], [-4, 3, 5, 5]), r"has shape \[-4, 3, 5, 5\], not a list of integers >= 0"),
    (_set(X + ["shape"], [4.5, 3, 5, 5]), "not a list of integers >= 0"),
    (_set(X + ["shape"], [True, 3, 5, 5]), "not a list of integers >= 0"),
    (_set(X + ["shape"], [100000, 100000]), r"has shape \[4, 3, 5, 5\] but bnprobe-dump.json says \[100000, 100000\]"),
    (_set(X + ["key"], "train.inputs.gamma"), r"has shape \[3\] but bnprobe-dump.json says \[4, 3, 5, 5\] for train"),
    (_set(X + ["format"], "int8"), r"tensor train.inputs.x: unknown format 'int8'"),
    (_set(["eps"], "NaN"), "records eps = 'NaN', not a number > 0"), (_set(["eps"], float("nan")), "eps = nan"),
    (_set(["eps"], -1e-5), "eps = -1e-05"), (_set(["eps"], 0), "eps = 0,"),
    (_set(["eps"], 1e300), r"eps = 1e\+300, not a number > 0 within the range of fp32"),
    (_set(["momentum"], -1), r"momentum = -1, not a number in \[0, 1\] or null"),
    (_set(["momentum"], [0.1]), r"momentum = \[0.1\]"),
    (_set(["layout"], "weird"), "layout is 'weird', not one of channels_first, channels_last"),
    (_set(["dtype"], 3), "dtype is 3, not a string"), (_set(["adapter"], [1]), "adapter is"),
    (_set(["saved_kind"], "mean"), "saved_kind is 'mean'"),
    (_set(["meta"], [1]), '"meta" must be an object'), (_set(["meta", "training"], "no"), "training, when given"),
    (_set(["version"], 3), r"a bnprobe dump of version 3; this bnprobe reads versions 1 to 2 \(a newer bnprobe"),
    (_set(["version"], "2"), "a bnprobe dump of version '2'"), (_set(["version"], True), "version True"),
])
def test_hostile_bnprobe_metadata_is_one_line(tmp_path, change, match):
    recorded(tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    change(meta)
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    with pytest.raises(BNProbeError) as info:
        [c.load() for c in open_dump(tmp_path).calls]
    assert re.search(match, one_line(info))


@pytest.mark.parametrize("value,match", [
    (np.ones((4, 3, 5, 5), np.complex64), "stored as complex64, not float32 or float64"),
    (np.ones((4, 3, 5, 5), np.int32), "stored as int32"), (np.full((4, 3, 5, 5), "a"), "stored as <U1"),
    (np.ones((2, 3), np.float32), r"has shape \[2, 3\] but bnprobe-dump.json says \[4, 3, 5, 5\]"),
])
def test_hostile_tensors_npz_is_one_line_and_nothing_is_cast_away(tmp_path, value, match):
    recorded(tmp_path)
    with np.load(tmp_path / "tensors.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["train.inputs.x"] = value
    np.savez(tmp_path / "tensors.npz", **arrays)
    with pytest.raises(BNProbeError) as info:
        load_dump(tmp_path)
    assert re.search(match, one_line(info))


def test_a_huge_shape_in_an_npz_header_is_refused_before_reading(tmp_path):
    """A member whose header declares 100000 x 100000 in a few bytes: refused from its header."""
    recorded(tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())
    meta["records"]["train"]["inputs"]["x"]["shape"] = [100000, 100000]
    (tmp_path / "bnprobe-dump.json").write_text(json.dumps(meta))
    with np.load(tmp_path / "tensors.npz") as z:
        arrays = {k: z[k] for k in z.files if k != "train.inputs.x"}
    np.savez(tmp_path / "tensors.npz", **arrays)
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (100000, 100000)})
    with zipfile.ZipFile(tmp_path / "tensors.npz", "a") as zf:
        zf.writestr("train.inputs.x.npy", header.getvalue())
    with pytest.raises(BNProbeError) as info:
        load_dump(tmp_path)
    assert re.search(r"tensor 'train.inputs.x': 128 bytes, shorter than the 40000000128 its header declares",
                     one_line(info))


A = ["data", "Aten.native_batch_norm.0.forward"]
B = ["data", "Aten.native_batch_norm.0.backward"]


@pytest.mark.parametrize("change,match", [
    (_set(["data"], []), r"no \"data\" object"), (_set(["data"], None), r"no \"data\" object"),
    (_set(["task"], []), r"\"task\" is \[\], not a string"),
    (_set(A, "s"), "forward is not a JSON object"),
    (_set(A + ["input_kwargs"], []), "input_args/input_kwargs of the wrong JSON type"),
    (_set(A + ["output"], "s"), r"forward has output of the wrong JSON type \(str, not a list\)"),
    (_set(A + ["output"], 3), "forward has output of the wrong JSON type"),
    (_set(B + ["input"], 3), r"backward has input of the wrong JSON type \(int, not a list\)"),
    (_set(B + ["output"], "s"), "backward has output of the wrong JSON type"),
    (_set(A + ["input_args", 0, "shape"], [-4, 3, 2, 2]), "tensor record has no valid shape"),
    (_set(A + ["input_args", 7, "value"], "1e-5"), "records eps = '1e-5', not a number > 0"),
    (_set(A + ["input_args", 7, "value"], None), "records eps = null"),
    (_set(A + ["input_args", 7], None), "records eps = null"),
    (_set(A + ["input_args", 7, "value"], -1e-5), "records eps = -1e-05"),
    (_set(A + ["input_args", 7, "value"], 0), "records eps = 0,"),
    (_set(A + ["input_args", 7, "value"], 1e300), r"eps = 1e\+300, not a number > 0 within the range of fp32"),
    (_set(A + ["input_args", 6, "value"], None), "records momentum = null"),
    (_set(A + ["input_args", 6, "value"], -3), r"records momentum = -3, not a number in \[0, 1\]"),
    (_set(A + ["input_args", 6, "value"], [0.1]), "records momentum = \\[0.1\\]"),
    (_set(A + ["input_args", 5, "value"], "maybe"), "records training = 'maybe', not true or false"),
    (_set(A + ["input_args", 5, "value"], None), "records training = null"),
    (_set(["data", "Functional.batch_norm.1.forward", "input_kwargs", "training", "value"], None),
     "Functional.batch_norm.1 records training = null"),
    (_set(A + ["input_args", 0, "data_name"], "../../../../../../../../etc/passwd"),
     r"data_name '\.\./(\.\./)*etc/passwd' points outside the dump's dump_tensor_data folder; refused"),
    (_set(A + ["input_args", 0, "data_name"], "/etc/passwd"), "'/etc/passwd' points outside"),
    (_set(A + ["input_args", 0, "data_name"], "../dump.json"), "'../dump.json' points outside"),
])
def test_hostile_msprobe_metadata_is_one_line(tmp_path, change, match):
    build_msprobe(tmp_path)
    dj = tmp_path / "step0" / "rank0" / "dump.json"
    doc = json.loads(dj.read_text())
    change(doc)
    dj.write_text(json.dumps(doc))
    with pytest.raises(BNProbeError) as info:
        [c.load() for c in open_dump(tmp_path).calls]
    assert re.search(match, one_line(info))


def _npy_header_only(path, shape, descr="<f2"):
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": descr, "fortran_order": False, "shape": shape})


@pytest.mark.parametrize("damage,match", [
    (lambda p: _npy_header_only(p, (100000, 100000)),
     r"128 bytes, shorter than the 20000000128 its header declares for shape \[100000, 100000\]"),
    (lambda p: _npy_header_only(p, (4, 3, 2, 2)), "128 bytes, shorter than the 224 its header declares"),
    (lambda p: np.save(p, np.ones((4, 3, 2, 3), np.float16)), r"shape \[4, 3, 2, 3\] disagrees with dump.json's"),
    (lambda p: np.save(p, np.array([None] * 48).reshape(4, 3, 2, 2), allow_pickle=True),
     r"holds Python objects \(a pickle\); bnprobe refuses to unpickle"),
    (lambda p: np.save(p, np.ones((4, 3, 2, 2), np.complex64)),
     "holds complex64 data but dump.json says torch.float16"),
    (lambda p: (p.unlink(), p.symlink_to("/etc/passwd")), "points outside the dump's dump_tensor_data folder"),
])
def test_hostile_npy_tensor_is_one_line(tmp_path, damage, match):
    build_msprobe(tmp_path)
    damage(tmp_path / "step0/rank0/dump_tensor_data/Aten.native_batch_norm.0.forward.input.0.npy")
    with pytest.raises(BNProbeError) as info:
        open_dump(tmp_path).calls[0].load()
    assert re.search(match, one_line(info))


class _Malicious:
    def __reduce__(self):
        return (os.system, ("echo unpickled > unpickled.txt",))


@pytest.mark.parametrize("how", ["zip", "legacy", "compressed"])
def test_a_malicious_pt_is_refused_and_never_run(tmp_path, monkeypatch, how):
    torch = pytest.importorskip("torch")
    build_msprobe(tmp_path, ".pt")
    victim = tmp_path / "step0/rank0/dump_tensor_data/Aten.native_batch_norm.0.forward.input.0.pt"
    if how == "zip":
        torch.save({"x": _Malicious()}, victim)
    elif how == "legacy":
        victim.write_bytes(pickle.dumps(_Malicious()))
    else:  # deflated members, which torch.save never writes
        plain = zipfile.ZipFile(BytesIO(victim.read_bytes()))
        with zipfile.ZipFile(victim, "w", zipfile.ZIP_DEFLATED) as zf:
            for info in plain.infolist():
                zf.writestr(info.filename, plain.read(info))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BNProbeError) as info:
        open_dump(tmp_path).calls[0].load()
    msg = one_line(info)
    assert not (tmp_path / "unpickled.txt").exists()
    assert "weights_only" not in msg and "False" not in msg
    assert ("has compressed members" if how == "compressed" else
            "refused to unpickle, it is not a plain tensor file") in msg
    if how == "zip":
        assert "GLOBAL posix.system" in msg


@pytest.mark.parametrize("command", [["compare-precision", "--no-budget"], ["overflow"]])
def test_the_cli_says_a_hostile_dump_in_one_line(tmp_path, capsys, command):
    from bnprobe.cli import main

    build_msprobe(tmp_path / "dump")
    dj = tmp_path / "dump" / "step0" / "rank0" / "dump.json"
    doc = json.loads(dj.read_text())
    doc["data"]["Aten.native_batch_norm.0.backward"]["input"] = 3
    dj.write_text(json.dumps(doc))
    out = ["--out", str(tmp_path / "report")] if command[0] == "compare-precision" else []
    assert main([*command, "--input", str(tmp_path / "dump"), *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnprobe: error: ") and err.count("\n") == 1 and "wrong JSON type" in err
    assert not (tmp_path / "report").exists()


# ---- JSON that does not parse: nested too deeply, bad bytes -- one line naming the file ------------------------

DEEP = "[" * 200_000 + "]" * 200_000


def _model_dump(tmp_path):
    recorded(tmp_path / "calls" / "bn1")
    (tmp_path / "bnprobe-calls.json").write_text(json.dumps(
        {"format": "bnprobe-calls", "calls": [{"name": "bn1", "dir": "calls/bn1", "module": "bn1"}]}))
    return tmp_path / "bnprobe-calls.json"


@pytest.mark.parametrize("where,text", [
    ("bnprobe", DEEP), ("bnprobe", '{"format": "bnprobe-dump", "meta": ' + DEEP + "}"),
    ("calls", DEEP), ("msprobe", DEEP),
    ("msprobe", '{"task": "tensor", "data": {"Aten.native_batch_norm.0.forward": ' + DEEP + "}}"),
    ("construct", DEEP), ("construct", "{broken"),
])
def test_json_nested_too_deeply_or_broken_is_one_line_naming_the_file(tmp_path, where, text):
    if where == "bnprobe":
        recorded(tmp_path)
        victim = tmp_path / "bnprobe-dump.json"
    elif where == "calls":
        victim = _model_dump(tmp_path)
    else:
        build_msprobe(tmp_path)
        victim = tmp_path / "step0" / "rank0" / ("dump.json" if where == "msprobe" else "construct.json")
    victim.write_text(text)
    with pytest.raises(BNProbeError) as info:
        [c.load() for c in open_dump(tmp_path).calls]
    msg = one_line(info)
    assert msg.startswith(f"{victim}: not readable JSON"), msg
    if text.startswith("[") or "[[" in text:
        assert "nested too deeply" in msg


def test_an_empty_construct_json_is_no_module_map(tmp_path):
    """msprobe writes construct.json empty below the mix level: that is no error."""
    build_msprobe(tmp_path)
    (tmp_path / "step0" / "rank0" / "construct.json").write_text("")
    assert [c.module for c in open_dump(tmp_path).calls] == [None, None]


@pytest.mark.parametrize("where,value,match", [
    (("input_args", 1), [1, 2, 3], r"forward weight \(input_args\[1\]\) is a list of 3 values, not a tensor record"),
    (("input_args", 2), "bias", r"forward bias \(input_args\[2\]\) is the string 'bias'"),
    (("input_args", 3), 0.5, r"forward running_mean \(input_args\[3\]\) is the number 0.5"),
    (("input_kwargs", "running_var"), True, r"forward running_var \(input_kwargs.running_var\) is a boolean true"),
    (("input_args", 1), {"type": "float", "value": 1.0}, r"forward weight \(input_args\[1\]\) is an object of type "
                                                          "'float'"),
])
def test_an_msprobe_tensor_argument_that_is_no_tensor_record_is_one_line(tmp_path, where, value, match):
    """weight, bias and the running statistics are tensor records or null (None): anything else is a damaged
    dump, not a call without them (which read on would have γ = 1 and a backward that does not fit)."""
    build_msprobe(tmp_path)
    dj = tmp_path / "step0" / "rank0" / "dump.json"
    doc = json.loads(dj.read_text())
    doc["data"]["Aten.native_batch_norm.0.forward"][where[0]][where[1]] = value
    dj.write_text(json.dumps(doc))
    with pytest.raises(BNProbeError) as info:
        [c.load() for c in open_dump(tmp_path).calls]
    assert re.search(r"dump.json: Aten.native_batch_norm.0." + match, one_line(info))


@pytest.mark.parametrize("none", [None, {}, {"type": "NoneType", "value": None}])
def test_an_msprobe_tensor_argument_recorded_as_none_is_no_argument(tmp_path, none):
    build_msprobe(tmp_path)
    dj = tmp_path / "step0" / "rank0" / "dump.json"
    doc = json.loads(dj.read_text())
    fwd = doc["data"]["Functional.batch_norm.1.forward"]
    fwd["input_kwargs"]["weight"] = none
    dj.write_text(json.dumps(doc))
    rec = read_msprobe(tmp_path, "Functional.batch_norm.1")
    assert "gamma" not in rec.tensors["infer"]["inputs"]


@pytest.mark.parametrize("spec,dtype", [("bf16-acc16", "bf16"), ("fp16-acc16", "fp16")])
def test_a_fixed_policys_recording_says_which_parameter_format_it_read(spec, dtype):
    """emulated:<preset> reads γ, β and the running statistics in its own parameter format whatever it is given:
    the recording keeps the call as given (fp32 parameters: the kernel's rounding of them is its error) and says
    what the kernel read, as trace's policy line does; its running statistics come back in that format."""
    from bnprobe.kernels import get_policy

    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(4, 3, 5, 5)), rng.uniform(0.5, 1.5, 3) + 1e-3
    rec = record(get_adapter(f"emulated:{spec}"), BNCall(x=x, gamma=g, beta=rng.normal(size=3),
                                                         running_mean=np.zeros(3), running_var=np.ones(3),
                                                         dy=rng.normal(size=x.shape), dtype=dtype, params="fp32"))
    pf = get_policy(spec).params_format
    assert pf == dtype and rec.params == "fp32" and rec.meta["kernel_params"] == pf
    assert rec.formats["train.inputs.gamma"] == "fp32" and rec.formats["train.outputs.running_var_out"] == pf
    assert f"reads γ, β and the running statistics in {pf}" in rec.meta["params_note"]
    np.testing.assert_array_equal(rec.tensors["train"]["inputs"]["gamma"], g.astype(np.float32))
    # an adapter that takes the run's parameter format says nothing
    rec = record(get_adapter("emulated"), BNCall(x=x, gamma=g, beta=None, running_mean=np.zeros(3),
                                                 running_var=np.ones(3), dy=rng.normal(size=x.shape), dtype=dtype,
                                                 params="fp32"))
    assert rec.params == "fp32" and "kernel_params" not in rec.meta


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_plain_pt_tensor_is_read_without_torch_bit_for_bit(tmp_path, monkeypatch, dtype):
    """msprobe's .pt files of plain float tensors read without importing torch: the same float64 bits and format
    torch.load gives (a subnormal, a signed zero and inf included); a tensor that is not plain (a view with an offset
    and strides) is left to torch — with torch blocked, the one-line error that asks for it."""
    torch = pytest.importorskip("torch")
    from bnprobe.recordings.msprobe_records import load_pt

    base = torch.randn(4, 3, 5, 6, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    base.view(-1)[:3] = torch.tensor([float("inf"), -0.0, 2.0**-24]).to(base.dtype)
    plain, view = tmp_path / "plain.pt", tmp_path / "view.pt"
    torch.save(base, plain)
    torch.save(base[1:, :, ::2], view)  # (torch.save keeps the view's storage, offset and strides)
    want = base.to(torch.float64).numpy()
    fmt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}[dtype]
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # any import of torch now fails
    got, stored = load_pt(plain, f"torch.{dtype}")
    assert stored == fmt and got.dtype == np.float64 and got.shape == want.shape
    assert np.array_equal(got.view(np.int64), want.view(np.int64))
    with pytest.raises(BNProbeError, match="needs torch"):
        load_pt(view, f"torch.{dtype}")

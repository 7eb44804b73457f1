import json

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.dump import DumpAdapter, load_dump, read_msprobe, record, write_dump
from bnprobe.errors import BNProbeError


def recorded(tmp_path, adapter="emulated", dtype="fp16"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5))
    rec = record(get_adapter(adapter), x=x, gamma=rng.uniform(0.5, 1.5, 3), beta=rng.normal(0, 0.1, 3),
                 running_mean=np.zeros(3), running_var=np.ones(3), dy=rng.standard_normal(x.shape), dtype=dtype,
                 meta={"seed": 0})
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

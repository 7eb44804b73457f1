"""The msprobe_dumps fixture itself (tests/msprobe_dumps.py), independent of bnprobe: real msprobe dumps agree
with the manifest written from the model, and every BatchNorm tensor msprobe recorded equals torch's own
independently computed values bit for bit."""

import ast
import glob
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

NAMES = ("L1-fp32", "L1-fp16", "L1-bf16", "mix-fp32", "mix-fp16", "stats-bf16", "eval-fp32")
TENSOR_NAMES = tuple(n for n in NAMES if not n.startswith("stats"))
DTYPES = {"torch.float32": torch.float32, "torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16}


def proc_dir(root, name):
    found = glob.glob(str(root / name / "step0" / "proc*"))
    assert len(found) == 1, found
    return Path(found[0])


def dump_json(root, name):
    return json.loads((proc_dir(root, name) / "dump.json").read_text())


def expected(root, call, field):
    a = np.load(root / call["expected"][field])
    assert a.dtype == np.float32
    return a


def bits_equal(a, b):
    """Same shape and same float32 bit patterns (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def load_pt(root, name, rec, torch_dtype):
    """The tensor a dump.json record points to, checked against the record's dtype and shape."""
    t = torch.load(proc_dir(root, name) / "dump_tensor_data" / rec["data_name"], weights_only=True)
    assert str(t.dtype) == rec["dtype"] == torch_dtype and list(t.shape) == rec["shape"]
    return t


def np32(t):
    return t.detach().float().numpy()


def arg_order(call):
    # F.batch_norm(x, running_mean, running_var, weight, bias, ...); native_batch_norm(x, weight, bias, mean, var, ...)
    if call["api"] == "Functional.batch_norm":
        return ("x", "running_mean", "running_var", "weight", "bias")
    return ("x", "weight", "bias", "running_mean", "running_var")


def calls_of(manifest, name):
    return manifest["dumps"][name]["calls"]


# --------------------------------------------------------------------------------------------------- manifest ---

def test_manifest_describes_every_dump(msprobe_dumps):
    root, manifest = msprobe_dumps
    assert tuple(manifest["dumps"]) == NAMES
    assert manifest["msprobe_version"] and manifest["torch_version"]
    for name, d in manifest["dumps"].items():
        assert d["name"] == name and (root / d["dump_path"]).is_dir() and (root / d["expected_dir"]).is_dir()
        assert d["level"] == ("mix" if name.startswith("mix") else "L1")
        assert d["task"] == ("statistics" if name.startswith("stats") else "tensor")
        assert d["dtype"] == name.split("-")[1] and d["mode"] == ("eval" if name.startswith("eval") else "train")
        assert d["n_bn_calls"] == len(d["calls"]) == 5
        assert [c["module"] for c in d["calls"]] == ["bn1", "bn2", "head.1", "vol.1", None]
        assert [c["api_name"] for c in d["calls"]] == [
            "Functional.batch_norm.0", "Functional.batch_norm.1", "Functional.batch_norm.2",
            "Functional.batch_norm.3", "Torch.native_batch_norm.0"]
        assert [len(c["x_shape"]) for c in d["calls"]] == [4, 4, 2, 5, 4]
        assert {(c["eps"], c["momentum"]) for c in d["calls"]} == {(1e-5, 0.1), (1e-3, 0.3), (1e-2, 0.25)}
        for c in d["calls"]:
            assert c["training"] is (d["mode"] == "train") and c["has_backward"]
            assert c["channels"] == c["x_shape"][1] and c["param_dtype"] == c["x_dtype"] == d["torch_dtype"]
            fields = {"x", "running_mean", "running_var", "weight", "bias", "y", "dy", "dx", "dweight", "dbias"}
            fields |= {"running_mean_after", "running_var_after"} if c["training"] else set()
            fields |= {"save_mean", "save_invstd"} if c["module"] is None else set()
            assert set(c["expected"]) == fields
            assert all((root / p).is_file() for p in c["expected"].values())


def test_generator_is_independent_of_bnprobe_and_keeps_msprobe_out_of_this_process(msprobe_dumps):
    tree = ast.parse((Path(__file__).parents[1] / "msprobe_dumps.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and not [m for m in imported if m.split(".")[0] == "bnprobe"], imported
    assert not [m for m in sys.modules if m.startswith("msprobe.")]  # only the bare package (importorskip)


@pytest.mark.parametrize("name", NAMES)
def test_expected_values_are_non_trivial_and_exact_in_the_dtype(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    dtype = DTYPES[manifest["dumps"][name]["torch_dtype"]]
    for c in calls_of(manifest, name):
        e = {f: expected(root, c, f) for f in c["expected"]}
        assert e["x"].shape == tuple(c["x_shape"]) and e["weight"].shape == (c["channels"],)
        assert not np.all(e["weight"] == 1) and not np.all(e["bias"] == 0)
        assert not np.any(e["running_mean"] == 0) and not np.any(e["running_var"] == 1)
        for f in ("dy", "dx", "dweight", "dbias"):
            assert np.count_nonzero(e[f]) > e[f].size // 4, f  # bn1's dy went back through a ReLU
        if c["training"]:
            assert not np.array_equal(e["running_mean"], e["running_mean_after"])
            assert not np.array_equal(e["running_var"], e["running_var_after"])
        for f, a in e.items():  # 16-bit values stored as float32 round-trip exactly
            assert bits_equal(torch.from_numpy(a).to(dtype).float().numpy(), a), f


def test_eval_dump_runs_on_running_statistics_a_training_step_moved(msprobe_dumps):
    root, manifest = msprobe_dumps
    for c_eval, c_train in zip(calls_of(manifest, "eval-fp32"), calls_of(manifest, "L1-fp32")):
        for f in ("running_mean", "running_var", "weight"):
            assert not np.array_equal(expected(root, c_eval, f), expected(root, c_train, f)), (c_eval["index"], f)


# ------------------------------------------------------------------------------------------------ dump layout ---

@pytest.mark.parametrize("name", NAMES)
def test_dump_has_msprobes_layout(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    assert [p.name for p in (root / name).iterdir()] == ["step0"]
    proc = proc_dir(root, name)
    assert proc.name[len("proc"):].isdigit()
    files = {p.name for p in proc.iterdir()}
    dump = dump_json(root, name)
    assert dump["task"] == d["task"] and dump["level"] == d["level"] and dump["framework"] == "pytorch"
    if d["task"] == "tensor":
        assert files == {"dump.json", "stack.json", "construct.json", "dump_tensor_data"}
        assert Path(dump["dump_data_dir"]) == proc / "dump_tensor_data"
        named = {rec["data_name"] for rec in _records(dump["data"]) if rec.get("data_name")}
        assert named and named <= {p.name for p in (proc / "dump_tensor_data").iterdir()}
    else:
        assert files == {"dump.json", "stack.json", "construct.json"}
        assert dump["dump_data_dir"] is None
        assert not [rec for rec in _records(dump["data"]) if "data_name" in rec]


def _records(node):
    """Every tensor record (a dict with a dtype) anywhere in a dump.json subtree."""
    if isinstance(node, dict):
        if "dtype" in node and "shape" in node:
            yield node
        else:
            for v in node.values():
                yield from _records(v)
    elif isinstance(node, list):
        for v in node:
            yield from _records(v)


# ---------------------------------------------------------------------------------------- dump.json vs manifest ---

@pytest.mark.parametrize("name", NAMES)
def test_every_bn_call_is_recorded_with_the_manifests_shapes_dtypes_and_scalars(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    data = dump_json(root, name)["data"]
    # exactly the manifest's BN calls, forward entries in forward order
    bn = [k for k in data if k.startswith(("Functional.batch_norm.", "Torch.native_batch_norm."))]
    assert [k for k in bn if k.endswith(".forward")] == [c["api_name"] + ".forward" for c in d["calls"]]
    assert sorted(k for k in bn if k.endswith(".backward")) == sorted(c["api_name"] + ".backward" for c in d["calls"])
    for c in d["calls"]:
        fwd = data[c["api_name"] + ".forward"]
        assert fwd["input_kwargs"] == {}
        args = fwd["input_args"]
        assert len(args) == 8
        assert args[5:] == [{"type": "bool", "value": c["training"]}, {"type": "float", "value": c["momentum"]},
                            {"type": "float", "value": c["eps"]}]
        for field, rec in zip(arg_order(c), args[:5]):
            shape = c["x_shape"] if field == "x" else [c["channels"]]
            want = c["x_dtype"] if field == "x" else c["running_dtype"] if field.startswith("running") else c[
                "param_dtype"]
            assert rec["type"] == "torch.Tensor" and rec["shape"] == shape and rec["dtype"] == want, (field, rec)
        outs = [c["x_shape"]]
        if c["module"] is None:  # native_batch_norm also returns save_mean, save_invstd (empty in eval)
            outs += [[c["channels"]] if c["training"] else [0]] * 2
        assert rec_shapes(fwd["output"]) == outs
        bwd = data[c["api_name"] + ".backward"]
        assert rec_shapes(bwd["input"]) == [c["x_shape"]]
        assert rec_shapes(bwd["output"]) == [c["x_shape"], [c["channels"]], [c["channels"]]]
        assert {r["dtype"] for r in list(_records(fwd["output"])) + list(_records(bwd))} == {c["x_dtype"]}


def rec_shapes(recs):
    return [r["shape"] for r in recs]


@pytest.mark.parametrize("name", NAMES)
def test_num_batches_tracked_increments_are_recorded_as_tensor_add_(msprobe_dumps, name):
    """nn.BatchNormNd in training adds 1 to num_batches_tracked just before its F.batch_norm: Tensor.add_ entries."""
    root, manifest = msprobe_dumps
    d = manifest["dumps"][name]
    data = dump_json(root, name)["data"]
    adds = [k for k in data if k.startswith("Tensor.add_.")]
    n_modules = sum(c["module"] is not None for c in d["calls"])
    assert len(adds) == (n_modules if d["mode"] == "train" else 0)
    for k in adds:
        assert data[k]["input_args"][0]["dtype"] == "torch.int64" and data[k]["input_args"][0]["shape"] == []
        assert data[k]["input_args"][1] == {"type": "int", "value": 1}
    keys = list(data)
    for k, c in zip(adds, [c for c in d["calls"] if c["module"] is not None]):
        assert keys.index(k) < keys.index(c["api_name"] + ".forward")


# ---------------------------------------------------------------------------------- recorded tensors vs torch ---

def _recorded(root, name, c):
    """{field: tensor} of one BN call as msprobe recorded it (forward inputs/outputs, backward dy/dx/dw/db)."""
    data = dump_json(root, name)["data"]
    fwd, bwd = data[c["api_name"] + ".forward"], data[c["api_name"] + ".backward"]
    got = {}
    for field, rec in zip(arg_order(c), fwd["input_args"][:5]):
        got[field] = load_pt(root, name, rec, c["param_dtype"] if field != "x" else c["x_dtype"])
    outs = ("y", "save_mean", "save_invstd") if c["module"] is None else ("y",)
    for field, rec in zip(outs, fwd["output"]):
        if rec["shape"] != [0]:  # eval: native_batch_norm's empty save_mean/save_invstd are not saved
            got[field] = load_pt(root, name, rec, c["x_dtype"])
    got["dy"] = load_pt(root, name, bwd["input"][0], c["x_dtype"])
    for field, rec in zip(("dx", "dweight", "dbias"), bwd["output"]):
        got[field] = load_pt(root, name, rec, c["x_dtype"])
    return got


@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_recorded_tensors_equal_torchs_independent_values_bit_for_bit(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    for c in calls_of(manifest, name):
        got = _recorded(root, name, c)
        want = {f for f in c["expected"] if not f.endswith("_after")}
        if not c["training"]:
            want -= {"save_mean", "save_invstd"}
        assert set(got) == want
        for field, t in got.items():
            # running_mean/var are recorded as they were BEFORE the call (the call updates them in place)
            assert bits_equal(np32(t), expected(root, c, field)), (c["index"], field)


@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_batch_norm_on_the_recorded_inputs_reproduces_the_recorded_outputs(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    for c in calls_of(manifest, name):
        got = _recorded(root, name, c)
        x = got["x"].clone().requires_grad_()
        w, b = got["weight"].clone().requires_grad_(), got["bias"].clone().requires_grad_()
        rm, rv = got["running_mean"].clone(), got["running_var"].clone()
        y = F.batch_norm(x, rm, rv, w, b, c["training"], c["momentum"], c["eps"])
        assert y.dtype == got["y"].dtype and torch.equal(y, got["y"]), c["index"]
        y.backward(got["dy"])
        for field, t in (("dx", x.grad), ("dweight", w.grad), ("dbias", b.grad)):
            assert t.dtype == got[field].dtype and torch.equal(t, got[field]), (c["index"], field)
        if c["training"]:
            assert bits_equal(np32(rm), expected(root, c, "running_mean_after"))
            assert bits_equal(np32(rv), expected(root, c, "running_var_after"))
        else:
            assert torch.equal(rm, got["running_mean"]) and torch.equal(rv, got["running_var"])
        if c["module"] is None and c["training"]:
            _, mean, invstd = torch.native_batch_norm(got["x"], got["weight"], got["bias"], got["running_mean"].clone(),
                                                      got["running_var"].clone(), True, c["momentum"], c["eps"])
            assert torch.equal(mean, got["save_mean"]) and torch.equal(invstd, got["save_invstd"])


@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_recorded_summaries_match_the_tensors(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    data = dump_json(root, name)["data"]
    for c in calls_of(manifest, name):
        rec = data[c["api_name"] + ".forward"]["output"][0]
        y = expected(root, c, "y")
        assert rec["Max"] == float(y.max()) and rec["Min"] == float(y.min())


# -------------------------------------------------------------------------------------------------- mix level ---

@pytest.mark.parametrize("name", ("mix-fp32", "mix-fp16"))
def test_mix_level_adds_module_records_and_construct_maps_calls_to_modules(msprobe_dumps, name):
    root, manifest = msprobe_dumps
    data = dump_json(root, name)["data"]
    construct = json.loads((proc_dir(root, name) / "construct.json").read_text())
    # every submodule of the model (written from its definition) has a forward record; the root module has none
    paths = {k[len("Module."):].rsplit(".", 3)[0] for k in data if k.startswith("Module.") and ".forward." in k}
    assert paths == {"conv1", "bn1", "relu", "conv2", "bn2", "head", "head.0", "head.1", "vol", "vol.0", "vol.1",
                     "side"}
    for c in calls_of(manifest, name):
        if c["module"] is None:  # the direct call sits in the root module, so it maps to no module
            assert construct[c["api_name"] + ".forward"] is None and construct[c["api_name"] + ".backward"] is None
            continue
        mod = c["mix_module"]
        assert construct[c["api_name"] + ".forward"] == mod + ".forward.0"
        assert construct[c["api_name"] + ".backward"] == mod + ".backward.0"
        fwd, bwd, pgrad = data[mod + ".forward.0"], data[mod + ".backward.0"], data[mod + ".parameters_grad.0"]
        dt = c["x_dtype"]
        pairs = [(fwd["input_args"][0], "x"), (fwd["output"][0], "y"), (fwd["parameters"]["weight"], "weight"),
                 (fwd["parameters"]["bias"], "bias"), (bwd["input"][0], "dy"), (bwd["output"][0], "dx"),
                 (pgrad["weight"][0], "dweight"), (pgrad["bias"][0], "dbias")]
        assert len(fwd["input_args"]) == len(fwd["output"]) == len(bwd["input"]) == len(bwd["output"]) == 1
        assert set(fwd["parameters"]) == set(pgrad) == {"weight", "bias"}
        for rec, field in pairs:
            assert bits_equal(np32(load_pt(root, name, rec, dt)), expected(root, c, field)), (c["index"], field)


# ------------------------------------------------------------------------------------------------- statistics ---

def test_statistics_dump_records_summaries_in_the_tensors_dtype(msprobe_dumps):
    root, manifest = msprobe_dumps
    data = dump_json(root, "stats-bf16")["data"]
    for c in calls_of(manifest, "stats-bf16"):
        fwd, bwd = data[c["api_name"] + ".forward"], data[c["api_name"] + ".backward"]
        pairs = [*zip(arg_order(c), fwd["input_args"][:5]), ("y", fwd["output"][0]), ("dy", bwd["input"][0]),
                 *zip(("dx", "dweight", "dbias"), bwd["output"])]
        for field, rec in pairs:
            assert set(rec) == {"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"}, rec
            a = expected(root, c, field)
            assert rec["dtype"] == "torch.bfloat16" and rec["shape"] == list(a.shape)
            assert rec["Max"] == float(a.max()) and rec["Min"] == float(a.min()), field
            a64 = a.astype(np.float64)
            scale = float(np.abs(a64).max())
            assert abs(rec["Mean"] - a64.mean()) <= 2 ** -7 * scale, field
            assert abs(rec["Norm"] - np.linalg.norm(a64)) <= 2 ** -7 * np.linalg.norm(a64), field
            # msprobe's Mean and Norm are torch's, computed in bfloat16
            t = torch.from_numpy(a).bfloat16()
            assert rec["Mean"] == t.mean().item() and rec["Norm"] == t.norm().item(), field

"""torch_npu's fused RMSNorm records (``NPU.npu_rms_norm``, ``NPU.npu_add_rms_norm``) in msprobe's layout, written by
tests/msprobe_npu_dumps.py as msprobe's own code writes them (no NPU here): read as RMSNorm calls (γ's dims
normalised, ε from the record or torch_npu's default, the kernel's rstd as the saved statistic, the residual sum x1 +
x2 as npu_add_rms_norm's x), their values the writer's bit for bit, a correct fp32 kernel passing compare-precision
and a kernel that rounds rstd to bf16 failing it."""

import json

import numpy as np
import pytest

from bnprobe.checks.compare.precision import compare_precision
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import open_dump

torch = pytest.importorskip("torch")

from msprobe_npu_dumps import write_npu_dump  # noqa: E402  (needs torch)

CALLS = ("NPU.npu_rms_norm.0", "NPU.npu_rms_norm.1", "NPU.npu_add_rms_norm.0")


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def npu_dump(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"npu-{request.param}")
    return root, request.param, write_npu_dump(root, request.param)


def test_the_dump_has_msprobes_layout(npu_dump):
    root, dtype, _ = npu_dump
    doc = json.loads((root / "step0/rank0/dump.json").read_text())
    assert doc["framework"] == "pytorch" and doc["task"] == "tensor"
    assert [k for k in doc["data"]] == ["NPU.npu_rms_norm.0.forward", "NPU.npu_rms_norm.0.backward",
                                        "NPU.npu_rms_norm.1.forward", "NPU.npu_rms_norm.1.backward",
                                        "NPU.npu_add_rms_norm.0.forward"]
    rstd = doc["data"]["NPU.npu_rms_norm.0.forward"]["output"][1]
    assert rstd["dtype"] == "torch.float32" and rstd["shape"] == [2, 5, 1]
    assert doc["data"]["NPU.npu_rms_norm.1.forward"]["output"][1]["shape"] == [2, 1, 1]
    assert all((root / "step0/rank0/dump_tensor_data" / e["data_name"]).is_file()
               for r in doc["data"].values() for k in ("input_args", "output", "input", "output")
               for e in r.get(k, []) if isinstance(e, dict) and "data_name" in e)


def test_each_call_is_an_rms_norm_call_holding_the_written_values(npu_dump):
    root, dtype, truth = npu_dump
    calls = open_dump(root)
    assert [c.name for c in calls.calls] == list(CALLS)
    assert [c.has_backward for c in calls.calls] == [True, True, False]
    for ref in calls.calls:
        t = truth[ref.name]
        rec = ref.load()
        ci = rec.call()
        assert (ci.norm, ci.normalized_shape, ci.groups, ci.weight_offset) == (
            "rms", tuple(t["normalized_shape"]), None, 0.0)
        assert ci.eps == pytest.approx(t["eps"], rel=0, abs=0) and ci.beta is None and rec.dtype == dtype
        assert rec.saved_kind == "invstd" and rec.formats["train.outputs.saved_value"] == "fp32"
        pairs = [(ci.x, t["x"]), (ci.gamma, t["gamma"]), (rec.get("train", "outputs", "y"), t["y"]),
                 (rec.get("train", "outputs", "saved_value"), t["rstd"].reshape(-1))]
        if ref.has_backward:
            out = rec.tensors["backward"]["outputs"]
            assert sorted(out) == ["dgamma", "dx"]
            pairs += [(ci.dy, t["dy"]), (out["dx"], t["dx"]), (out["dgamma"], t["dgamma"])]
        for got, want in pairs:
            assert np.array_equal(np.asarray(got, dtype=np.float64), want.astype(np.float64)), ref.name


def test_npu_add_rms_norm_normalises_the_residual_sum_and_says_so(npu_dump):
    root, dtype, truth = npu_dump
    rec = open_dump(root, "NPU.npu_add_rms_norm.0").calls[0].load()
    t = truth["NPU.npu_add_rms_norm.0"]
    assert np.array_equal(rec.call().x, t["x"]) and not np.array_equal(t["x"], t["x1"])
    assert any(f"residual sum x1 + x2 the kernel returned (its third output, in {dtype})" in n
               for n in rec.meta["notes"])


def test_a_correct_fp32_kernel_passes_and_a_premature_rounding_fails(tmp_path):
    from bnprobe.adapters import get_adapter

    write_npu_dump(tmp_path / "good", "fp32")
    write_npu_dump(tmp_path / "bad", "fp32", bug="rstd-bf16")
    good = compare_precision([get_adapter(f"dump:{tmp_path / 'good'}")], budget=False).rows
    assert set(good.case.astype(str)) == set(CALLS)
    assert set(good.tensor) == {"y", "saved_rstd", "dx", "dgamma"}
    assert not good.verdict.astype(str).str.endswith("FAIL").any(), good[["case", "tensor", "why"]].to_string()
    bad = compare_precision([get_adapter(f"dump:{tmp_path / 'bad'}")], budget=False).rows
    failing = bad[bad.verdict.astype(str).str.endswith("FAIL")]
    assert set(zip(failing.case.astype(str), failing.tensor)) == {(c, "y") for c in CALLS}


def test_compare_precision_runs_on_the_bf16_dump(tmp_path, capsys):
    write_npu_dump(tmp_path / "d", "bf16")
    rc = main(["compare-precision", "--adapters", f"dump:{tmp_path / 'd'}", "--no-budget", "--out",
               str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "3 recorded call(s)" in out and all(c in out for c in CALLS), out


def _edit(root, change):
    dj = root / "step0/rank0/dump.json"
    doc = json.loads(dj.read_text())
    change(doc["data"])
    dj.write_text(json.dumps(doc))


def test_npu_add_rms_norm_without_its_sum_output_rounds_x1_plus_x2_once(tmp_path):
    truth = write_npu_dump(tmp_path, "bf16")
    _edit(tmp_path, lambda data: data["NPU.npu_add_rms_norm.0.forward"]["output"].pop())
    rec = open_dump(tmp_path, "NPU.npu_add_rms_norm.0").calls[0].load()
    t = truth["NPU.npu_add_rms_norm.0"]
    want = torch.tensor(t["x1"]).double().add(torch.tensor(t["x2"]).double()).bfloat16().double().numpy()
    assert np.array_equal(rec.call().x, want)
    assert any("x1 + x2 rounded once to bf16 (the record lacks the kernel's third output)" in n
               for n in rec.meta["notes"])


def test_an_npu_add_rms_norm_sum_that_is_not_x1_plus_x2_is_counted(tmp_path):
    write_npu_dump(tmp_path, "fp32")
    f = tmp_path / "step0/rank0/dump_tensor_data/NPU.npu_add_rms_norm.0.forward.output.2.pt"
    x = torch.load(f)
    x.view(-1)[:3] += 1.0
    torch.save(x, f)
    rec = open_dump(tmp_path, "NPU.npu_add_rms_norm.0").calls[0].load()
    assert any("it differs from x1 + x2 rounded once at 3 of 640 elements" in n for n in rec.meta["notes"])


@pytest.mark.parametrize("change, why", [
    (lambda data: data["NPU.npu_rms_norm.0.forward"]["input_args"].pop(),
     "NPU.npu_rms_norm.0 records no gamma tensor, whose dims are the ones normalised"),
    (lambda data: data["NPU.npu_rms_norm.0.forward"]["input_args"][1].update(shape=[32]),
     "NPU.npu_rms_norm.0: normalized_shape [32] is not x's trailing dimensions"),
    (lambda data: data["NPU.npu_rms_norm.0.forward"]["output"][1].update(
        data["NPU.npu_rms_norm.1.forward"]["output"][1]),
     "NPU.npu_rms_norm.0.forward output 1 (rstd) has 2 values; the layer has 10 rows"),
    (lambda data: data["NPU.npu_rms_norm.0.forward"]["input_kwargs"].update(epsilon={"type": "float", "value": -1}),
     "NPU.npu_rms_norm.0 records eps = -1, not a number > 0"),
    (lambda data: data["NPU.npu_rms_norm.0.backward"]["output"][1].update(
        data["NPU.npu_rms_norm.0.backward"]["output"][0]),
     "NPU.npu_rms_norm.0.backward output 1 (dgamma) has shape [2, 5, 64], not [64]"),
])
def test_a_record_that_cannot_be_read_says_why_in_one_line(tmp_path, capsys, change, why):
    write_npu_dump(tmp_path / "d", "fp32")
    _edit(tmp_path / "d", change)
    with pytest.raises(BNProbeError) as err:
        [c.load() for c in open_dump(tmp_path / "d").calls]
    assert why in str(err.value) and "\n" not in str(err.value), str(err.value)
    rc = main(["compare-precision", "--adapters", f"dump:{tmp_path / 'd'}", "--no-budget", "--out",
               str(tmp_path / "r")])
    assert rc == 2 and why in capsys.readouterr().err

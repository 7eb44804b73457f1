"""bnprobe dumps of LayerNorm, RMSNorm, GroupNorm and InstanceNorm calls (dump --norm): the call's layer — norm,
normalised shape, groups, γ's offset — written and read back; the dump adapter replays the recorded outputs, and
the engine compare-precision runs gets from it exactly what a direct run of the adapter returns, bit for bit; the
replay refuses another layer's call; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.cli import main
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.run import run_call
from bnprobe.recordings import load_dump, record, write_dump

# (norm, x shape, normalized_shape, groups, weight_offset): each layer, LayerNorm over two dims, Gemma's RMSNorm
LAYERS = [("layer", (3, 5, 16), None, None, 0.0), ("layer", (2, 3, 4, 6), (4, 6), None, 0.0),
          ("rms", (3, 5, 16), None, None, 1.0), ("group", (2, 6, 3, 4), None, 3, 0.0),
          ("instance", (2, 4, 3, 5), None, None, 0.0)]
IDS = ["layer", "layer-2d", "rms-offset", "group", "instance"]
ADAPTERS = [("emulated", "fp16"), ("reference", "fp32"), ("torch", "bf16"), ("emulated:bf16-acc16", "bf16")]


def _call(norm, shape, ns, groups, offset, dtype="fp16") -> BNCall:  # noqa: ANN001
    rng = np.random.default_rng(3)
    pshape = (tuple(ns) if ns else shape[-1:]) if norm in ("layer", "rms") else shape[1:2]
    return BNCall(rng.standard_normal(shape) * 2 + 1, rng.uniform(0.5, 1.5, pshape),
                  None if norm == "rms" else rng.normal(0, 0.1, pshape), dy=rng.standard_normal(shape), eps=1e-3,
                  momentum=None, dtype=dtype, norm=norm, normalized_shape=ns, groups=groups, weight_offset=offset)


def _bits(a, b) -> None:  # noqa: ANN001
    """The same values in the same format, bit for bit."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape or a.size == b.size
    np.testing.assert_array_equal(a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1))


@pytest.mark.parametrize("norm,shape,ns,groups,offset", LAYERS, ids=IDS)
@pytest.mark.parametrize("adapter,dtype", ADAPTERS, ids=[f"{a}-{d}" for a, d in ADAPTERS])
def test_a_family_call_round_trips_and_replays_bit_for_bit(tmp_path, norm, shape, ns, groups, offset, adapter,  # noqa: ANN001
                                                           dtype) -> None:
    if adapter == "torch":
        pytest.importorskip("torch")
    a = get_adapter(adapter)
    call = _call(norm, shape, ns, groups, offset, dtype)
    write_dump(record(a, call, modes=("train", "backward"), meta={"seed": 3}), tmp_path)
    meta = json.loads((tmp_path / "bnprobe-dump.json").read_text())["meta"]
    resolved = list(ns or shape[-1:]) if norm in ("layer", "rms") else None
    assert (meta["norm"], meta["normalized_shape"], meta["groups"], meta["weight_offset"]) == \
        (norm, resolved, groups, offset)
    back = load_dump(tmp_path)
    assert back.modes == ("train", "backward") and back.momentum is None
    c = back.call()
    assert (c.norm, c.normalized_shape, c.groups, c.weight_offset) == \
        (norm, None if resolved is None else tuple(resolved), groups, offset)
    # the direct run of the adapter on the same call
    direct = a.train(call)
    grads = a.backward_of(call, direct.saved)
    # the dump adapter's replay of the call read back
    rep = DumpAdapter(back)
    out = rep.train(c)
    _bits(out.y, direct.y)
    assert out.y.dtype == np.asarray(direct.y).dtype
    _bits(out.saved.value, direct.saved.value)
    assert (out.saved.mean is None) == (norm == "rms")
    bw = rep.backward_of(c, out.saved)
    _bits(bw.dx, grads.dx)
    _bits(bw.dgamma, grads.dgamma)
    if norm != "rms":
        _bits(bw.dbeta, grads.dbeta)
    # the engine (what compare-precision, doctor and gradcheck run) gets the same outputs from the dump
    run = run_call(rep, back)
    expected = {"y": direct.y, "saved_rstd": direct.saved.value, "dx": grads.dx, "dgamma": grads.dgamma}
    if norm != "rms":
        expected.update(saved_mean=direct.saved.mean, dbeta=grads.dbeta)
    for key, want in expected.items():
        _bits(run.got[key], want)


def test_a_replay_answers_only_its_own_layer(tmp_path) -> None:
    call = _call("layer", (3, 5, 16), None, None, 0.0)
    write_dump(record(get_adapter("emulated"), call, modes=("train", "backward")), tmp_path)
    rep = DumpAdapter(load_dump(tmp_path))
    with pytest.raises(BNProbeError, match="a recording answers only its own call"):
        rep.train(call.with_(norm="rms", beta=None))
    with pytest.raises(BNProbeError, match="a recording answers only its own call"):
        rep.train(call.with_(weight_offset=1.0, normalized_shape=(16,)))
    with pytest.raises(BNProbeError, match="differs from the recorded one"):
        rep.train(call.with_(x=call.x + 1, normalized_shape=(16,)))


def test_a_backward_only_recording_keeps_every_input(tmp_path) -> None:
    call = _call("group", (2, 6, 3, 4), None, 2, 0.0)
    write_dump(record(get_adapter("emulated"), call, modes=("backward",)), tmp_path)
    back = load_dump(tmp_path)
    c = back.call()
    assert back.modes == ("backward",) and c.beta is not None
    res = compare_precision([f"dump:{tmp_path}"], None)
    assert set(res.rows.tensor) == {"dx", "dgamma", "dbeta"}


@pytest.mark.parametrize("modes,match", [(("infer",), "its inference is its training forward"),
                                         (("train", "infer"), "its inference is its training forward")])
def test_record_refuses_an_inference_of_a_family_layer(modes, match) -> None:  # noqa: ANN001
    with pytest.raises(BNProbeError, match=match):
        record(get_adapter("emulated"), _call("rms", (2, 3, 8), None, None, 0.0), modes=modes)


def test_record_refuses_running_statistics_and_another_layout() -> None:
    call = _call("layer", (2, 3, 8), None, None, 0.0)
    with pytest.raises(BNProbeError, match="keeps no running statistics"):
        record(get_adapter("emulated"), call.with_(running_mean=np.zeros(3), running_var=np.ones(3)))
    with pytest.raises(BNProbeError, match="layout channels_first"):
        record(get_adapter("emulated"), call.with_(layout="channels_last"), modes=("train",))


def run(capsys, *args):  # noqa: ANN001, ANN002, ANN201
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,shape", [(["--norm", "layer", "--shape", "2,8,32"], [2, 8, 32]),
                                        (["--norm", "rms", "--normalized-shape", "4,8", "--shape", "2,4,8"],
                                         [2, 4, 8]),
                                        (["--norm", "group", "--num-groups", "4", "--shape", "2,8,3,3"],
                                         [2, 8, 3, 3]),
                                        (["--norm", "instance", "--shape", "2,3,4,4"], [2, 3, 4, 4])])
def test_the_cli_dumps_a_family_call_that_compare_precision_replays(tmp_path, capsys, args, shape) -> None:  # noqa: ANN001
    out = tmp_path / "d"
    code, text, err = run(capsys, "dump", "--adapter", "emulated", *args, "--out", out)
    assert code == 0 and err == "", err
    assert text.splitlines()[0].startswith("recorded emulated (train, backward) in fp16")
    meta = json.loads((out / "bnprobe-dump.json").read_text())
    assert meta["meta"]["norm"] == args[1] and meta["records"]["train"]["inputs"]["x"]["shape"] == shape
    code, text, err = run(capsys, "compare-precision", "--adapters", f"dump:{out}", "--no-budget", "--out",
                          tmp_path / "r")
    assert code == 0 and "all pass" in text.splitlines()[0], text + err


def test_the_cli_default_shape_of_a_family_layer_is_its_own(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "dump", "--adapter", "emulated", "--norm", "rms", "--out", tmp_path / "d")
    assert code == 0, err
    meta = json.loads((tmp_path / "d" / "bnprobe-dump.json").read_text())
    assert meta["records"]["train"]["inputs"]["x"]["shape"] == [4, 128, 768]
    assert meta["meta"]["normalized_shape"] == [768] and "beta" not in meta["records"]["train"]["inputs"]


@pytest.mark.parametrize("args,message", [
    (["--norm", "layer", "--modes", "infer"], "--modes infer: LayerNorm keeps no running statistics"),
    (["--norm", "layer", "--normalized-shape", "5"], "normalized_shape [5] is not x's trailing dimensions"),
    (["--norm", "group", "--num-groups", "3"], "groups must divide the 64 channels, got 3"),
    (["--norm", "layer", "--num-groups", "3"], "--num-groups applies to --norm group"),
    (["--norm", "rms", "--normalized-shape", "2,768", "--shape", "4,3,768"],
     "normalized_shape [2, 768] is not x's trailing dimensions"),
    (["--norm", "group"], "--norm group needs --num-groups"),
    (["--norm", "rms", "--momentum", "0.2"], "--momentum applies to BatchNorm's running statistics"),
    (["--norm", "rms", "--layout", "channels_last"], "--layout channels_last: RMSNorm takes x as it is laid out"),
    (["--norm", "layer", "--adapter", "ascend-tbe"], "runs BatchNorm only, not LayerNorm"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, args, message) -> None:  # noqa: ANN001
    full = ["--adapter", "emulated", *args] if "--adapter" not in args else args
    code, out, err = run(capsys, "dump", *full, "--out", tmp_path / "d")
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "d").exists()

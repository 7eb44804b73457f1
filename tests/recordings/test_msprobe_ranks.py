"""bnprobe reads real multi-rank, multi-step msprobe 26.x dumps (made by msprobe's own PrecisionDebugger under
torch.distributed with gloo and DistributedDataParallel, two processes on localhost, in tests/msprobe_ranks.py):
every BatchNorm call of every step and rank is found in order, named by its folder, and its forward and backward
tensors are torch's bit for bit."""

from itertools import product

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import open_dump
from bnprobe.recordings.msprobe import find_dump_jsons, msprobe_calls

STEPS, WORLD = 2, 2
RECORDED = (("x", "x"), ("gamma", "weight"), ("beta", "bias"), ("running_mean", "running_mean"),
            ("running_var", "running_var"), ("dy", "dy"))  # call() key -> expected field


@pytest.fixture(scope="module")
def ranks(msprobe_ranks):
    """(root, manifest): 2 ranks x 2 steps, a tensor dump and a statistics dump of the same training run (made once
    per session: tests/conftest.py)."""
    return msprobe_ranks


def dump_path(root, manifest, name="tensor"):
    return root / manifest["dumps"][name]["dump_path"]


def expected(root, record, field):
    a = np.load(root / record["expected"][field])
    assert a.dtype == np.float32
    return a


def bits_equal(got, want):
    """bnprobe's float64 array holds exactly the float32 values of want, sign of zero included."""
    got = np.asarray(got)
    g32 = got.astype(np.float32)
    return (got.shape == want.shape and np.array_equal(g32.astype(np.float64), got, equal_nan=True)
            and np.array_equal(g32.view(np.uint32), np.ascontiguousarray(want).view(np.uint32)))


def records(manifest, step=None, rank=None):
    return [r for r in manifest["records"] if step in (None, r["step"]) and rank in (None, r["rank"])]


def test_msprobe_wrote_one_folder_per_step_and_rank(ranks):
    root, manifest = ranks
    assert manifest["world"] == WORLD and manifest["steps"] == STEPS and manifest["backend"] == "gloo"
    folders = [f"step{k}/rank{r}" for k in range(STEPS) for r in range(WORLD)]
    for name in manifest["dumps"]:
        base = dump_path(root, manifest, name)
        assert [p.parent.relative_to(base).as_posix() for p in find_dump_jsons(base)] == folders
        assert not list(base.glob("step*/proc*"))  # under torch.distributed msprobe names the folder by the rank
    for f in folders:
        assert list((dump_path(root, manifest) / f / "dump_tensor_data").glob("Functional.batch_norm.*.pt"))
    assert not (dump_path(root, manifest, "statistics") / folders[0] / "dump_tensor_data").exists()


@pytest.mark.parametrize("name", ["tensor", "statistics"])
def test_every_call_of_every_step_and_rank_in_forward_order(ranks, name):
    root, manifest = ranks
    found = open_dump(dump_path(root, manifest, name))
    want = [f"{r['folder']}/{r['api_name']}" for r in manifest["records"]]
    assert [c.name for c in found.calls] == want
    assert len(want) == STEPS * WORLD * len(manifest["calls"])
    assert found.kind == "msprobe" and found.task == manifest["dumps"][name]["task"]
    assert any(f"{STEPS * WORLD} dump.json files" in n for n in found.notes)
    calls = manifest["calls"]
    for got, rec in zip(found.calls, manifest["records"]):
        call = calls[rec["index"]]
        assert got.shape == tuple(rec["x_shape"]) == (manifest["ranks"][rec["rank"]]["batch"],
                                                      *call["sample_shape"])
        assert got.training == call["training"] and got.has_backward == call["has_backward"]
        assert got.dtype == "fp32" and call["dtype"] == "torch.float32"
        assert got.module is None  # level L1 writes no construct.json entries
    # the lower-level reader agrees, and each call points at its own step's and rank's dump.json
    ms, notes = msprobe_calls(dump_path(root, manifest, name))
    assert [c.ref.name for c in ms] == want and notes == list(found.notes)
    for c, rec in zip(ms, manifest["records"]):
        assert c.api == rec["api_name"]
        assert c.dump_json == dump_path(root, manifest, name) / rec["folder"] / "dump.json"


@pytest.mark.parametrize("step,rank", list(product(range(STEPS), range(WORLD))))
def test_each_call_holds_torchs_values_bit_for_bit(ranks, step, rank):
    root, manifest = ranks
    found = open_dump(dump_path(root, manifest), f"step{step}/rank{rank}/*")
    want = records(manifest, step, rank)
    assert [c.name for c in found.calls] == [f"{r['folder']}/{r['api_name']}" for r in want]
    for ref, rec in zip(found.calls, want):
        call = manifest["calls"][rec["index"]]
        r = ref.load()
        where = ref.name
        ci = r.call()
        assert (ci.eps, ci.momentum, ci.training) == (call["eps"], call["momentum"], call["training"]), where
        assert (ci.dtype, ci.params, ci.layout) == ("fp32", "same", "channels_first"), where
        assert r.meta["call"] == rec["api_name"] and r.meta["task"] == "tensor" and r.meta["level"] == "L1"
        assert r.modes == ("train", "backward"), where
        for ours, theirs in RECORDED:
            assert bits_equal(getattr(ci, ours), expected(root, rec, theirs)), f"{where} {ours}"
        outs = r.tensors["train"]["outputs"]
        assert set(outs) == {"y"}  # F.batch_norm returns y only: no saved statistics in the dump
        assert bits_equal(outs["y"], expected(root, rec, "y")), f"{where} y"
        bw = r.tensors["backward"]
        assert set(bw["outputs"]) == {"dx", "dgamma", "dbeta"}, where
        for ours, theirs in (("dx", "dx"), ("dgamma", "dweight"), ("dbeta", "dbias")):
            assert bits_equal(bw["outputs"][ours], expected(root, rec, theirs)), f"{where} {ours}"
        for ours, theirs in (("dy", "dy"), ("x", "x"), ("gamma", "weight")):
            assert bits_equal(bw["inputs"][ours], expected(root, rec, theirs)), f"{where} backward {ours}"
        assert all(f == "fp32" for f in r.formats.values()), r.formats


def test_each_rank_reads_its_own_data_and_what_ddp_broadcast(ranks):
    """The per-rank folders are not mixed up: each rank's batch size and data, and DDP's buffer broadcast from rank 0
    (broadcast_buffers=True) as the BatchNorm calls of step 1 received it."""
    root, manifest = ranks
    calls = {c.name: c for c in open_dump(dump_path(root, manifest)).calls}

    def load(step, rank, i):
        return calls[f"step{step}/rank{rank}/{manifest['calls'][i]['api_name']}"].load().call()

    assert [manifest["ranks"][r]["batch"] for r in range(WORLD)] == [4, 3]
    big = next(r for r in manifest["ranks"] if r["input_offset"])
    for step in range(STEPS):
        for r in range(WORLD):
            x = load(step, r, 0).x
            assert x.shape[0] == manifest["ranks"][r]["batch"]
            channel_means = np.abs(x.mean(axis=(0, 2, 3)))
            # rank 1's input channel is shifted by a large offset: bn1's channels have large means there only
            assert (channel_means.max() > 50) == (r == big["rank"]), (step, r, channel_means)
    for i in range(len(manifest["calls"])):
        got = [load(1, r, i) for r in range(WORLD)]
        rank0_after = records(manifest, 0, 0)[i]
        own_after = records(manifest, 0, 1)[i]
        for key in ("running_mean", "running_var"):
            assert bits_equal(getattr(got[1], key), expected(root, rank0_after, f"{key}_after"))
            assert np.array_equal(getattr(got[0], key), getattr(got[1], key))
            assert not np.array_equal(getattr(got[1], key), expected(root, own_after, f"{key}_after"))
        # parameters are all-reduced: every rank starts step 1 with the same weight and bias
        assert np.array_equal(got[0].gamma, got[1].gamma) and np.array_equal(got[0].beta, got[1].beta)


def test_statistics_dump_summarises_the_same_tensors(ranks):
    root, manifest = ranks
    found = open_dump(dump_path(root, manifest, "statistics"))
    with pytest.raises(BNProbeError, match="statistics-only"):
        found.require_tensors("replaying a call")
    for ref, rec in zip(found.calls, manifest["records"]):
        s = ref.load()
        assert set(s) == {"forward.input.x", "forward.input.gamma", "forward.input.beta", "forward.input.running_mean",
                          "forward.input.running_var", "forward.output.y", "backward.input.dy", "backward.output.dx",
                          "backward.output.dgamma", "backward.output.dbeta"}, ref.name
        for key, field in (("forward.input.x", "x"), ("forward.output.y", "y"), ("backward.input.dy", "dy"),
                           ("backward.output.dx", "dx"), ("backward.output.dgamma", "dweight"),
                           ("forward.input.running_mean", "running_mean")):
            e = expected(root, rec, field)
            assert s[key]["dtype"] == "fp32" and s[key]["shape"] == list(e.shape), (ref.name, key)
            assert s[key]["Max"] == float(e.max()) and s[key]["Min"] == float(e.min()), (ref.name, key)
            assert s[key]["Mean"] == pytest.approx(float(e.astype(np.float64).mean()), rel=1e-4, abs=1e-5)


def test_one_step_one_rank_or_one_dump_json(ranks):
    root, manifest = ranks
    base = dump_path(root, manifest)
    apis = [c["api_name"] for c in manifest["calls"]]
    # one dump.json: the names carry no folder
    assert [c.name for c in open_dump(base / "step1" / "rank1" / "dump.json").calls] == apis
    assert [c.name for c in open_dump(base / "step1" / "rank1").calls] == apis
    # a step folder: its rank folders
    assert [c.name for c in open_dump(base / "step0").calls] == [f"rank{r}/{a}" for r in range(WORLD) for a in apis]
    # a selection across steps: the same call of every step and rank
    assert [c.name for c in open_dump(base, f"*/{apis[2]}").calls] == [
        f"step{k}/rank{r}/{apis[2]}" for k in range(STEPS) for r in range(WORLD)]


def test_steps_and_ranks_past_nine_stay_in_numeric_order(ranks, tmp_path):
    """msprobe names its folders step<k>/rank<r> with no padding: step10 and rank10 must come after step2 and
    rank2 (the real folders of the 2-step, 2-rank dump, copied to steps 0..10 and ranks 0, 1, 2, 10)."""
    import shutil

    root, manifest = ranks
    base = dump_path(root, manifest)
    order = [(k, r) for k in range(11) for r in (0, 1, 2, 10)]
    for k, r in reversed(order):  # created in reverse, so no file-system order can pass for the right one
        shutil.copytree(base / f"step{k % 2}" / f"rank{r % 2}", tmp_path / f"step{k}" / f"rank{r}")
    assert [p.parent.relative_to(tmp_path).as_posix() for p in find_dump_jsons(tmp_path)] == [
        f"step{k}/rank{r}" for k, r in order]
    calls = open_dump(tmp_path).calls
    assert len(calls) == len(order) * len(manifest["calls"])  # every call is found, in step, rank, forward order
    assert [c.name for c in calls] == [f"step{k}/rank{r}/{call['api_name']}" for k, r in order
                                       for call in manifest["calls"]]

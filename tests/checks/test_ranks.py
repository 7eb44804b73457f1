"""check_ranks on per-rank recordings of one step: SyncBatchNorm (the syncbn adapter's rank_recordings), plain
BatchNorm per rank (torch's own kernel on each slice), and wrong merges, each judged against the golden
statistics computed here with numpy float64 on the concatenated batch.  Every rule is shown failing as well as
passing: an unweighted merge with unequal ranks, a cancelling E[x²]−E[x]² in fp16, ranks that disagree, running
statistics that differ, and a tolerance edge just inside and just outside."""

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.syncbn import rank_recordings
from bnprobe.checks.ranks.check import check_ranks, statistics_tolerance
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import load_dump, record, write_dump
from bnprobe.core.call import BNCall

DTYPES = ["fp32", "fp16", "bf16"]
EPS = 1e-5
C = 4


def batch(shape=(16, C, 3, 3), mean=0.5, std=1.5, seed=0, shift=(2, 0.5)):
    """x with its first ``shift[0]`` samples moved by ``shift[1]``·std (ranks with different means), γ, β, running
    statistics, dy."""
    rng = np.random.default_rng(seed)
    x = rng.normal(mean, std, shape)
    x[: shift[0]] += shift[1] * std
    c = shape[1]
    return x, rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), np.zeros(c), np.ones(c), rng.normal(size=shape)


def sync(spec, dtype, **kw):
    x, g, b, rm, rv, dy = batch(**kw)
    return rank_recordings(spec, BNCall(x, g, b, rm, rv, dy, dtype=dtype))


def per_rank_torch(sizes, dtype, **kw):
    """Plain BatchNorm under DDP: torch's kernel on each rank's slice alone."""
    pytest.importorskip("torch")
    x, g, b, rm, rv, dy = batch(**kw)
    edges = np.cumsum((0, *sizes))
    return {r: record(get_adapter("torch"),
                      BNCall(x=x[lo:hi], gamma=g, beta=b, running_mean=rm, running_var=rv, dy=dy[lo:hi], dtype=dtype),
                      modes=("train",))
            for r, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))}


def without_saved(recs):
    for rec in recs.values():
        for k in ("saved_mean", "saved_value"):
            rec.tensors["train"]["outputs"].pop(k, None)
        rec.saved_kind = None
    return recs


def golden(recs):
    """numpy float64 over the concatenated batch: (mean, biased var) per channel."""
    x = np.concatenate([recs[r].get("train", "inputs", "x") for r in sorted(recs)])
    return x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["syncbn:ranks=3+8+5", "syncbn:ranks=1+15", "syncbn:world=4"])
def test_syncbn_with_chan_uses_the_global_statistics_on_every_rank(dtype, spec):
    recs = sync(spec, dtype)
    rep = check_ranks(recs)
    assert rep and rep.passed and rep.kind == "syncbn" and not rep.failures
    assert all(r.used == "global" and r.source == "saved" and r.global_ratio <= 1 < r.local_ratio for r in rep.rows)
    mean, var = golden(recs)
    np.testing.assert_allclose(rep.golden["mean"], mean, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(rep.golden["var"], var, rtol=1e-12)
    assert rep.golden["count"] == 16 * 9
    assert rep.running["after"]["identical"] and rep.running["before"]["identical"]
    frame = rep.to_frame()
    assert list(frame["rank"]) == sorted(recs) and set(frame["status"]) == {"PASS"}
    d = rep.to_dict()
    assert d["passed"] and d["kind"] == "syncbn" and len(d["rows"]) == len(recs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_batchnorm_per_rank_is_local_and_not_a_failure(dtype):
    recs = per_rank_torch((3, 8, 5), dtype)
    rep = check_ranks(recs)
    assert rep.passed and rep.kind == "local" and all(r.used == "local" for r in rep.rows)
    assert any("plain BatchNorm per rank" in n for n in rep.notes)
    assert any("different running statistics after the step" in n for n in rep.notes)
    strict = check_ranks(recs, expect="sync")
    assert not strict and "used their own statistics where SyncBatchNorm uses the global ones" in strict.failures[0]
    assert not any(r.passed for r in strict.rows)
    assert not check_ranks(sync("syncbn:ranks=3+8+5", dtype), expect="local")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unweighted_merge_with_unequal_ranks_is_named_and_fails(dtype):
    rep = check_ranks(sync("syncbn:ranks=2+14,merge=unweighted", dtype))
    assert not rep and rep.kind == "merge"
    assert all(r.used == "neither" and r.merge.startswith("unweighted/") and not r.passed for r in rep.rows)
    assert "unweighted average of the rank means and variances" in rep.failures[0]
    assert "ranks have 2 and 14 samples" in rep.failures[0]


# mean 100 with a spread of a few ulps of each input format; (4, C) keeps Σx² below fp16's largest value
CANCELLING = {"fp32": 0.01, "fp16": 0.25, "bf16": 2.0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_sums_in_fp16_on_data_with_a_large_mean_is_caught_as_cancellation(dtype):
    kw = dict(shape=(4, C), mean=100.0, std=CANCELLING[dtype], shift=(0, 0.0), seed=5)
    rep = check_ranks(sync("syncbn:ranks=2+2,merge=sums,reduce=fp16", dtype, **kw))
    assert not rep and all(r.used == "neither" and r.merge == "sums/fp16" for r in rep.rows)
    assert "which cancels here" in rep.failures[0] and "E[x²]−E[x]²" in rep.failures[0]
    # the same data through a correct merge passes: a correct kernel never fails
    assert check_ranks(sync("syncbn:ranks=2+2", dtype, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unweighted_with_equal_ranks_passes_only_when_the_rank_means_agree(dtype):
    x, g, b, rm, rv, dy = batch(shift=(0, 0.0), seed=6)
    m = x[:8].mean(axis=(0, 2, 3), keepdims=True)
    x[8:] = m + 2 * (x[:8] - m)  # equal counts and rank means, rank 1 four times rank 0's variance
    rep = check_ranks(rank_recordings("syncbn:ranks=8+8,merge=unweighted", BNCall(x, g, b, rm, rv, dy, dtype=dtype)))
    assert rep and rep.kind == "syncbn" and all(r.used == "global" for r in rep.rows)
    x[8:] += 0.5  # now the rank means differ: the average of the rank variances misses their spread
    rep = check_ranks(rank_recordings("syncbn:ranks=8+8,merge=unweighted", BNCall(x, g, b, rm, rv, dy, dtype=dtype)))
    assert not rep and all(r.merge.startswith("unweighted/") for r in rep.rows)
    assert "misses the spread of the rank means" in rep.failures[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_chan_with_a_bf16_all_gather_is_named(dtype):
    rep = check_ranks(sync("syncbn:ranks=3+8+5,reduce=bf16", dtype))
    assert not rep and all(r.merge == "chan/bf16" for r in rep.rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what", ["mean", "invstd"])
def test_the_tolerance_holds_at_its_edge(dtype, what):
    """Every rank's saved statistics set to the golden ones moved by 0.9 and by 1.1 of the tolerance on channel 1."""
    recs = sync("syncbn:ranks=3+8+5", dtype)
    mean, var = golden(recs)
    inv = 1 / np.sqrt(var + EPS)
    tol = statistics_tolerance(mean, inv, 16 * 9, dtype, "fp32")
    for k, used in ((0.9, "global"), (1.1, "neither")):
        m, i = mean.copy(), inv.copy()
        if what == "mean":
            m[1] += k * tol[1] / inv[1]
        else:
            i[1] *= 1 + k * tol[1]
        for rec in recs.values():
            rec.tensors["train"]["outputs"]["saved_mean"] = m.astype(np.float32).astype(np.float64)
            rec.tensors["train"]["outputs"]["saved_value"] = i.astype(np.float32).astype(np.float64)
        rep = check_ranks(recs)
        assert [r.used for r in rep.rows] == [used] * 3, (k, [r.global_ratio for r in rep.rows])
        assert rep.passed == (used == "global")
        assert rep.rows[0].global_ratio == pytest.approx(k, rel=0.05) and rep.rows[0].channel == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_statistics_recovered_from_y_when_none_are_saved(dtype):
    rep = check_ranks(without_saved(sync("syncbn:ranks=3+8+5", dtype)))
    assert rep and all(r.source == "y" and r.used == "global" for r in rep.rows)
    rep = check_ranks(without_saved(per_rank_torch((3, 8, 5), dtype)))
    assert rep.kind == "local" and all(r.source == "y" for r in rep.rows)
    rep = check_ranks(without_saved(sync("syncbn:ranks=2+14,merge=unweighted", dtype)))
    assert not rep and all(r.used == "neither" and r.merge.startswith("unweighted/") for r in rep.rows)


def test_a_rank_without_statistics_or_y_is_not_checked():
    recs = without_saved(sync("syncbn:ranks=3+8+5", "fp16"))
    for rec in recs.values():
        del rec.tensors["train"]["outputs"]["y"]
    rep = check_ranks(recs)
    assert rep.passed and rep.kind == "unchecked" and all(r.used == "unknown" for r in rep.rows)
    assert any("not checked" in n for n in rep.notes)


def test_ranks_that_disagree_fail():
    recs = per_rank_torch((3, 8, 5), "fp32")
    recs[1] = sync("syncbn:ranks=3+8+5", "fp32")[1]
    rep = check_ranks(recs)
    assert not rep and rep.kind == "mixed"
    assert "ranks disagree: rank 1 used the global statistics, ranks 0, 2 their own" in rep.failures


@pytest.mark.parametrize("dtype", DTYPES)
def test_running_statistics_must_agree_after_a_synchronised_step(dtype):
    recs = sync("syncbn:ranks=3+8+5", dtype)
    out = recs[1].tensors["train"]["outputs"]
    rv_in = recs[1].get("train", "inputs", "running_var")
    mean, var = golden(recs)
    # rank 1 updated its running variance with its own count (8·9 values) instead of the global one (16·9)
    out["running_var_out"] = (0.9 * rv_in + 0.1 * var * 72 / 71).astype(np.float32).astype(np.float64)
    rep = check_ranks(recs)
    assert not rep and "hold different running statistics after the step" in rep.failures[0]
    assert rep.running["after"]["beyond_tolerance"]
    # one ulp apart: not bit-identical, but within a rounding: a note, not a failure
    good = sync("syncbn:ranks=3+8+5", dtype)
    rv = good[2].tensors["train"]["outputs"]["running_var_out"]
    good[2].tensors["train"]["outputs"]["running_var_out"] = np.nextafter(rv.astype(np.float32),
                                                                          np.float32(np.inf)).astype(np.float64)
    rep = check_ranks(good)
    assert rep and any("not bit-identical" in n for n in rep.notes)
    # different running statistics before the step: DDP did not broadcast the buffers
    good = sync("syncbn:ranks=3+8+5", dtype)
    good[0].tensors["train"]["inputs"]["running_mean"] = good[0].get("train", "inputs", "running_mean") + 0.5
    rep = check_ranks(good)
    assert any("different running statistics before the step" in n for n in rep.notes)


def test_recordings_read_back_from_rank_dumps(tmp_path):
    for r, rec in sync("syncbn:ranks=2+14,merge=unweighted", "fp16").items():
        write_dump(rec, tmp_path / "step0" / f"rank{r}")
    recs = {r: load_dump(tmp_path / "step0" / f"rank{r}") for r in (0, 1)}
    rep = check_ranks(recs)
    assert not rep and rep.call == "SyncBatchNorm.0" and rep.rows[0].merge.startswith("unweighted/")
    assert rep.summary.startswith("SyncBatchNorm.0: some rank used a merge of rank statistics: FAIL: rank 0 used")


def test_bad_input_is_a_one_line_error():
    recs = sync("syncbn:ranks=3+8+5", "fp32")
    with pytest.raises(BNProbeError, match="at least one rank"):
        check_ranks({})
    with pytest.raises(BNProbeError, match="expect must be one of sync, local or None"):
        check_ranks(recs, expect="ddp")
    other = sync("syncbn:ranks=3+8+5", "fp32", shape=(16, 3, 3, 3))
    with pytest.raises(BNProbeError, match=r"rank 1's recording has x shape \(apart from N\) \(3, 3, 3\) but rank 0's "
                                           r"has \(4, 3, 3\)"):
        check_ranks({0: recs[0], 1: other[1]})
    with pytest.raises(BNProbeError, match="rank 2's recording has dtype fp16"):
        check_ranks({0: recs[0], 2: sync("syncbn:ranks=3+8+5", "fp16")[2]})
    del recs[2].tensors["train"]
    with pytest.raises(BNProbeError, match="rank 2's recording has no training forward"):
        check_ranks(recs)


def test_nan_in_x_is_left_out_but_a_nan_statistic_fails():
    x, g, b, rm, rv, dy = batch(seed=7)
    x[1, 2, 0, 0] = np.nan  # input-borne: channel 2's golden is NaN too, nothing to judge there
    rep = check_ranks(rank_recordings("syncbn:ranks=3+8+5", BNCall(x, g, b, rm, rv, dy, dtype="fp16")))
    assert rep and any("channel(s) 2 hold NaN/inf in x" in n for n in rep.notes)
    recs = sync("syncbn:ranks=3+8+5", "fp16")
    recs[1].tensors["train"]["outputs"]["saved_mean"][0] = np.nan  # a kernel's own NaN
    rep = check_ranks(recs)
    assert not rep and rep.rows[1].used == "neither" and rep.rows[1].global_ratio == np.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_ranks_whose_own_statistics_are_the_global_ones_are_either_and_never_disagree(dtype):
    """Rank 0 holds the samples of ranks 1 and 2 together, so its own statistics are the global ones: under plain
    BatchNorm it is 'either', not 'global' beside 'local' ranks (which would read as ranks that disagree)."""
    x, g, b, rm, rv, dy = batch(shape=(8, C, 3, 3), seed=8, shift=(2, 1.0))
    pytest.importorskip("torch")
    x, dy = np.concatenate([x, x]), np.concatenate([dy, dy])  # rank 0: all 8 samples; ranks 1 and 2: 2 and 6 of them
    edges = np.cumsum((0, 8, 2, 6))
    recs = {r: record(get_adapter("torch"),
                      BNCall(x=x[lo:hi], gamma=g, beta=b, running_mean=rm, running_var=rv, dy=dy[lo:hi], dtype=dtype),
                      modes=("train",))
            for r, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))}
    rep = check_ranks(recs)
    assert [r.used for r in rep.rows] == ["either", "local", "local"]
    assert rep and rep.kind == "local" and any("cannot be told apart" in n for n in rep.notes)
    # the ranks saved different statistics: their running statistics differ, as they should (a note, no failure)
    assert any("different running statistics after the step" in n for n in rep.notes)
    one = check_ranks({0: recs[0]})
    assert one and one.kind == "either" and any("one rank given" in n for n in one.notes)


def _local_backward_dx(recs):
    """Each rank's dx as a SyncBatchNorm backward that forgets to all-reduce Σdy and Σdy·x̂ (its own slice's means
    with the global statistics), computed here in float64 and cast to dx's format."""
    from bnprobe.numerics.rounding import round_to

    x = np.concatenate([recs[r].get("train", "inputs", "x") for r in sorted(recs)])
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    inv = (1 / np.sqrt(var + EPS)).reshape(1, -1, 1, 1)
    for rec in recs.values():
        xr, dy = rec.get("train", "inputs", "x"), np.asarray(rec.tensors["backward"]["inputs"]["dy"], np.float64)
        g = np.asarray(rec.get("train", "inputs", "gamma"), np.float64).reshape(1, -1, 1, 1)
        xh = (xr - mean.reshape(1, -1, 1, 1)) * inv
        dx = g * inv * (dy - dy.mean(axis=(0, 2, 3), keepdims=True)
                        - xh * (dy * xh).mean(axis=(0, 2, 3), keepdims=True))
        rec.tensors["backward"]["outputs"]["dx"] = round_to(dx, rec.formats["backward.outputs.dx"])
    return recs


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_ranks_y_and_dx_are_judged_against_the_concatenated_batch(dtype):
    """SyncBatchNorm (issue 29 item 8): every rank's y and dx against the golden of the whole batch, elementwise. The
    syncbn adapter passes; a backward without the all-reduce of Σdy, Σdy·x̂ (dx from the rank's own slice) fails, as
    does one rank's y off by 1% on one element, though every rank's statistics are the global ones."""
    rep = check_ranks(sync("syncbn:ranks=2+14", dtype))
    assert rep.passed and rep.kind == "syncbn"
    assert any("y and dx judged elementwise" in n for n in rep.notes), rep.notes
    local = check_ranks(_local_backward_dx(sync("syncbn:ranks=2+14", dtype)))
    assert not local.passed and any("rank 0's dx is off the concatenated batch's golden" in f for f in local.failures)
    recs = sync("syncbn:ranks=2+14", dtype)
    y = np.array(recs[1].tensors["train"]["outputs"]["y"], dtype=np.float64)
    y[3, 2, 1, 1] *= 1.01
    recs[1].tensors["train"]["outputs"]["y"] = y
    off = check_ranks(recs)
    assert not off.passed and any(f.startswith("rank 1's y is off") and "channel 2" in f for f in off.failures)


@pytest.mark.parametrize("spec", ["syncbn:world=8", "syncbn:ranks=2+14,merge=unweighted"])
def test_ranks_given_as_loaders_are_held_one_at_a_time_with_the_same_report(spec):
    """Two levels: each rank is read, reduced to its moments and let go; y and dx are judged one rank at a time.
    The report is the in-memory one's, and no two recordings are alive at once."""
    import copy
    import gc
    import weakref

    recs = sync(spec, "fp16")
    alive, peak = set(), [0]

    def loader(r):
        def load():
            gc.collect()
            rec = copy.deepcopy(recs[r])
            alive.add(id(rec))
            weakref.finalize(rec, alive.discard, id(rec))
            peak[0] = max(peak[0], len(alive))
            return rec
        return load

    lazy = check_ranks({r: loader(r) for r in recs})
    eager = check_ranks(recs)
    assert lazy.to_dict() == eager.to_dict()
    assert peak[0] == 1
    if spec.endswith("world=8"):
        assert lazy.passed and any("judged elementwise" in n for n in lazy.notes)  # the second level ran
    else:
        assert not lazy.passed


def test_the_merged_golden_statistics_are_the_concatenated_batchs():
    """The golden mean and variance merged from the ranks' moments (Chan) against numpy on the concatenation, also
    far off zero where E[x²]−E[x]² would cancel."""
    for mean in (0.5, 1e6):
        recs = sync("syncbn:ranks=3+8+5", "fp32", mean=mean)
        rep = check_ranks(recs)
        m, v = golden(recs)
        np.testing.assert_allclose(rep.golden["mean"], m, rtol=1e-15)
        np.testing.assert_allclose(rep.golden["var"], v, rtol=1e-12)

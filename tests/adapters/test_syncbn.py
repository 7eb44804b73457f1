"""The syncbn adapter against oracles that share no code with it: torch's F.batch_norm and autograd in float64 on
the concatenated batch (SyncBatchNorm with a correct merge is plain BatchNorm on the whole batch up to rounding),
numpy float64, and exact Fraction arithmetic (tests/oracle.py) for tiny cases of the merge formulas."""

from fractions import Fraction

import numpy as np
import pytest

from bnprobe.adapters import Saved, get_adapter
from bnprobe.adapters.syncbn import SyncBNAdapter, rank_recordings, split_ranks
from bnprobe.core.call import BNCall
from bnprobe.engine.cases import Case
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import load_dump, write_dump
from oracle import round_fraction, round_sqrt

torch = pytest.importorskip("torch")
F = torch.nn.functional

EPS, MOMENTUM = 1e-5, 0.1
PRECISION = {"fp32": 24, "fp16": 11, "bf16": 8, "fp64": 53}  # bits, the implicit one included
EMIN = {"fp32": -126, "fp16": -14, "bf16": -126, "fp64": -1022}
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
U32 = 2.0**-24  # fp32 unit roundoff: SyncBatchNorm computes statistics and the elementwise steps in fp32
DTYPES = ["fp32", "fp16", "bf16"]


def ulp(v, fmt):
    """Spacing of ``fmt`` at |v| (numpy frexp; subnormal spacing below the smallest normal)."""
    _, e = np.frexp(np.abs(np.asarray(v, dtype=np.float64)))
    return np.ldexp(1.0, np.maximum(e - 1, EMIN[fmt]) - PRECISION[fmt] + 1)


def inputs(shape, dtype, mean=0.5, std=1.5, seed=0):
    """x generated and rounded by torch in ``dtype`` (exactly a value of it), fp32 parameters, dy in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).to(TORCH_DTYPE[dtype]).double()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(TORCH_DTYPE[dtype]).double()
    c = shape[1]
    rng = np.random.default_rng(seed)
    vec = [rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.normal(0, 0.2, c), rng.uniform(0.5, 2, c)]
    return x.numpy(), dy.numpy(), *[v.astype(np.float32).astype(np.float64) for v in vec]


def torch_bn(x, dy, g, b, rm, rv):
    """torch's BatchNorm in float64 on the whole batch: y, running mean/var, dx, dγ, dβ."""
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(g, requires_grad=True), torch.tensor(b, requires_grad=True)
    rmt, rvt = torch.tensor(rm), torch.tensor(rv)
    y = F.batch_norm(xt, rmt, rvt, gt, bt, training=True, momentum=MOMENTUM, eps=EPS)
    y.backward(torch.tensor(dy))
    return {"y": y.detach().numpy(), "running_mean": rmt.numpy(), "running_var": rvt.numpy(),
            "dx": xt.grad.numpy(), "dgamma": gt.grad.numpy(), "dbeta": bt.grad.numpy()}


def channel(v, ndim):
    return np.reshape(v, (1, -1) + (1,) * (ndim - 2))


def y_bound(y_ref, x, g, b, dtype):
    """The output's rounding at the golden plus fp32 arithmetic on the statistics and the elementwise steps."""
    axes = (0, *range(2, x.ndim))
    mean, inv = x.mean(axis=axes), 1 / np.sqrt(x.var(axis=axes) + EPS)
    scale = np.abs(channel(g, x.ndim)) * (np.abs(y_ref - channel(b, x.ndim)) / np.abs(channel(g, x.ndim))
                                          + channel(np.abs(mean) * inv, x.ndim)) + np.abs(channel(b, x.ndim))
    return 0.5 * ulp(np.abs(y_ref) * (1 + 2.0**-6), dtype) + 32 * U32 * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [(3, 8, 5), (8, 8), (1, 15)], ids=lambda r: "+".join(map(str, r)))
def test_chan_is_plain_batchnorm_on_the_whole_batch(dtype, ranks):
    x, dy, g, b, rm, rv = inputs((16, 4, 3, 3), dtype)
    ref = torch_bn(x, dy, g, b, rm, rv)
    a = SyncBNAdapter(ranks)
    out = a.forward_train(x, g, b, rm, rv, dtype=dtype)
    assert out.y.dtype == np.dtype({"fp32": np.float32, "fp16": np.float16}.get(dtype, out.y.dtype))
    bound = y_bound(ref["y"], x, g, b, dtype)
    assert np.all(np.abs(out.y.astype(np.float64) - ref["y"]) <= bound)
    # the test sees the difference: each rank normalised with its own statistics is far outside the bound
    edges = np.cumsum((0, *ranks))
    local = np.concatenate([F.batch_norm(torch.tensor(x[lo:hi]), None, None, torch.tensor(g), torch.tensor(b),
                                         training=True, eps=EPS).numpy() for lo, hi in zip(edges[:-1], edges[1:])])
    if len(ranks) > 1:
        assert np.any(np.abs(local - ref["y"]) > 100 * bound)
    axes = (0, 2, 3)
    np.testing.assert_allclose(out.saved.mean.astype(np.float64), x.mean(axis=axes), rtol=0,
                               atol=8 * U32 * np.abs(x).max())
    np.testing.assert_allclose(out.saved.invstd(EPS), 1 / np.sqrt(x.var(axis=axes) + EPS), rtol=16 * U32)
    for k in ("running_mean", "running_var"):  # the unbiased variance over the global count of 144 values
        np.testing.assert_allclose(getattr(out, k).astype(np.float64), ref[k], rtol=16 * U32, atol=16 * U32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_autograd_of_batchnorm_on_the_whole_batch(dtype):
    x, dy, g, b, rm, rv = inputs((16, 4, 3, 3), dtype, seed=1)
    ref = torch_bn(x, dy, g, b, rm, rv)
    a = SyncBNAdapter((3, 8, 5))
    bw = a.backward(dy, x, g, a.forward_train(x, g, b, rm, rv, dtype=dtype).saved, dtype=dtype)
    axes = (0, 2, 3)
    inv = 1 / np.sqrt(x.var(axis=axes) + EPS)
    xhat = (x - channel(x.mean(axis=axes), 4)) * channel(inv, 4)
    scale = channel(np.abs(g) * inv * (np.abs(dy).max(axis=axes) * (1 + np.abs(xhat).max(axis=axes))), 4)
    assert np.all(np.abs(bw.dx.astype(np.float64) - ref["dx"]) <= 0.5 * ulp(np.abs(ref["dx"]) * 1.02, dtype)
                  + 64 * U32 * scale)
    sums = np.abs(dy * (1 + np.abs(xhat))).sum(axis=axes)
    np.testing.assert_allclose(bw.dgamma, ref["dgamma"], rtol=0, atol=64 * U32 * sums.max())
    np.testing.assert_allclose(bw.dbeta, ref["dbeta"], rtol=0, atol=64 * U32 * sums.max())
    # each rank's own partial sums add up to the all-reduced gradients
    np.testing.assert_allclose(np.sum(bw.meta["rank_dgamma"], axis=0), ref["dgamma"], atol=64 * U32 * sums.max())
    assert len(bw.meta["rank_dbeta"]) == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_and_channels_last(dtype):
    x, dy, g, b, rm, rv = inputs((6, 3, 4, 5), dtype, seed=2)
    a = get_adapter("syncbn:ranks=1+5")
    y = a.forward_infer(x, g, b, rm, rv, dtype=dtype).y.astype(np.float64)
    ref = F.batch_norm(torch.tensor(x), torch.tensor(rm), torch.tensor(rv), torch.tensor(g), torch.tensor(b),
                       training=False, eps=EPS).numpy()
    assert np.all(np.abs(y - ref) <= 0.5 * ulp(np.abs(ref) * 1.02, dtype) + 32 * U32 * (np.abs(ref) + 10))
    last = a.forward_train(np.moveaxis(x, 1, -1), g, b, rm, rv, dtype=dtype, layout="channels_last")
    first = a.forward_train(x, g, b, rm, rv, dtype=dtype)
    np.testing.assert_array_equal(np.moveaxis(last.y, -1, 1), first.y)  # the same ranks, the same arithmetic
    ib = a.backward(dy, x, g, Saved(rm, "var", rv), dtype=dtype, training=False)
    want = dy * channel(g / np.sqrt(rv + EPS), 4)
    assert np.all(np.abs(ib.dx.astype(np.float64) - want) <= 0.5 * ulp(np.abs(want) * 1.02, dtype)
                  + 8 * U32 * np.abs(want))


def test_fp64_matches_the_reference_adapter():
    x, dy, g, b, rm, rv = inputs((9, 3, 2, 2), "fp64")
    for spec in ("syncbn:ranks=2+3+4", "syncbn:ranks=2+3+4,merge=sums"):
        out = get_adapter(spec).forward_train(x, g, b, rm, rv, dtype="fp64")
        ref = get_adapter("reference").forward_train(x, g, b, rm, rv, dtype="fp64")
        assert np.abs(out.y - ref.y).max() < 1e-13
        np.testing.assert_allclose(out.running_var, ref.running_var, rtol=1e-14)


# ---- the merge formulas, exactly ---------------------------------------------------------------------------

def test_merge_formulas_against_fractions():
    # ranks [1] and [2, 4]: global mean 7/3 and variance 14/9; the unweighted average: mean (1 + 3)/2, var (0 + 1)/2
    x = np.array([[1.0], [2.0], [4.0]])
    want = {"chan": (Fraction(7, 3), Fraction(14, 9)), "sums": (Fraction(7, 3), Fraction(14, 9)),
            "unweighted": (Fraction(2), Fraction(1, 2))}
    for merge, (mean, var) in want.items():
        out = SyncBNAdapter((1, 2), merge=merge).forward_train(x, None, None, np.zeros(1), np.ones(1), dtype="fp64",
                                                               momentum=1.0)
        assert out.saved.mean[0] == pytest.approx(float(mean), rel=1e-15)
        assert out.saved.invstd(EPS)[0] == pytest.approx(1 / float(var + Fraction(EPS)) ** 0.5, rel=1e-15)
        # momentum 1: the running variance is the unbiased variance over the global count of 3
        assert out.running_var[0] == pytest.approx(float(var * Fraction(3, 2)), rel=1e-15)
    assert want["unweighted"] != want["chan"]  # unequal ranks: the case tells the merges apart


def sums_oracle(ranks, reduce):
    """``sums`` by hand in exact rationals: each rank's Σx and Σx² (exact in fp32 here), rounded to ``reduce`` and
    added in it, then mean = fl32(S/n), var = fl32(fl32(Q/n) − fl32(mean²)), invstd = fl32(1/fl32(√fl32(var+ε)))."""
    r32 = lambda v: Fraction(round_fraction(v, "fp32"))  # noqa: E731
    rr = lambda v: Fraction(round_fraction(v, reduce))  # noqa: E731
    s = q = Fraction(0)
    for i, part in enumerate(ranks):
        ps, pq = sum(map(Fraction, part)), sum(Fraction(v) ** 2 for v in part)
        assert r32(ps) == ps and r32(pq) == pq  # each rank's fp32 sums are exact
        s, q = (rr(ps), rr(pq)) if i == 0 else (rr(s + rr(ps)), rr(q + rr(pq)))
    n = sum(len(p) for p in ranks)
    mean = r32(s / n)
    var = r32(r32(q / n) - r32(mean * mean))
    inv = r32(1 / Fraction(round_sqrt(float(r32(var + r32(Fraction(EPS)))), "fp32")))
    return mean, var, inv


def test_sums_in_fp16_cancels_exactly_as_worked_by_hand():
    # mean 100, spread 1/16: Σx² ≈ 40000 where fp16's spacing is 32, so E[x²] − E[x]² is lost
    ranks = [[100 + 3 / 16, 100 - 1 / 16], [100 + 1 / 16, 100 - 2 / 16]]
    x = np.array([v for r in ranks for v in r])[:, None]
    mean, var, inv = sums_oracle(ranks, "fp16")
    true_var = np.var(x)
    assert abs(float(var) - true_var) >= true_var / 2  # the oracle shows the cancellation: not one digit left
    out = SyncBNAdapter((2, 2), merge="sums", reduce="fp16").forward_train(x, dtype="fp32")
    assert out.saved.mean[0] == float(mean) and out.saved.invstd(EPS)[0] == float(inv)
    exact = sums_oracle(ranks, "fp32")
    out32 = SyncBNAdapter((2, 2), merge="sums").forward_train(x, dtype="fp32")
    assert out32.saved.invstd(EPS)[0] == float(exact[2])


def test_unweighted_with_equal_ranks_and_equal_rank_means_is_exact():
    # the edge where averaging rank statistics is right: equal counts and rank means
    x, dy, g, b, rm, rv = inputs((8, 3, 2, 2), "fp32", seed=3)
    x[4:] = x[:4][::-1] + 0.0  # rank 1 holds rank 0's samples in another order: the same mean and variance
    ref = torch_bn(x, dy, g, b, rm, rv)
    out = SyncBNAdapter((4, 4), merge="unweighted").forward_train(x, g, b, rm, rv, dtype="fp32")
    assert np.all(np.abs(out.y.astype(np.float64) - ref["y"]) <= y_bound(ref["y"], x, g, b, "fp32"))
    x[4:] += 0.25  # different rank means: the average of the rank variances misses their spread
    out = SyncBNAdapter((4, 4), merge="unweighted").forward_train(x, g, b, rm, rv, dtype="fp32")
    np.testing.assert_allclose(out.saved.mean, x.mean(axis=(0, 2, 3)), rtol=1e-6)  # the mean is still right
    assert np.all(out.saved.invstd(EPS) > 1 / np.sqrt(x.var(axis=(0, 2, 3)) + EPS) * (1 + 1e-3))


# ---- the spec and the ranks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ("syncbn:merge=mean", "unknown merge 'mean'; valid: chan, sums, unweighted"),
    ("syncbn:ranks=3+0+5", "every rank needs at least one sample; got ranks=3+0+5"),
    ("syncbn:reduce=fp64", "the all-reduce format must be one of fp32, fp16, bf16, got 'fp64'"),
    ("syncbn:reduce=fp8_e4m3fn", "must be one of fp32, fp16, bf16"),
    ("syncbn:ranks=3+x", "syncbn takes ranks=N+N+..."),
    ("syncbn:cores=2", "unknown syncbn option(s) cores; valid: ranks, world, merge, reduce"),
    ("syncbn:merge", "syncbn option 'merge' is not key=value"),
    ("syncbn:ranks=2+2,world=2", "not both"),
    ("syncbn:world=0", "world must be >= 1, got 0"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(BNProbeError) as err:
        get_adapter(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ranks_that_do_not_add_up_name_both_numbers():
    a = get_adapter("syncbn:ranks=3+8+5,merge=unweighted,reduce=fp16")
    assert a.name == "syncbn:ranks=3+8+5,merge=unweighted,reduce=fp16"
    with pytest.raises(BNProbeError, match=r"ranks 3\+8\+5 add up to 16 samples but x has a batch of 12"):
        a.forward_train(np.ones((12, 2)), dtype="fp32")
    with pytest.raises(BNProbeError, match="a batch of 3 does not split into 4 ranks"):
        get_adapter("syncbn:world=4").forward_train(np.ones((3, 2)), dtype="fp32")
    assert split_ranks(16) == (8, 8) and split_ranks(7, world=3) == (2, 3, 2) and split_ranks(5, (2, 3)) == (2, 3)
    assert get_adapter("syncbn").name == "syncbn"


# ---- per-rank recordings ---------------------------------------------------------------------------------------

def test_rank_recordings_hold_each_ranks_slice_and_round_trip_as_dumps(tmp_path):
    x, dy, g, b, rm, rv = inputs((7, 3, 2, 2), "fp16", seed=4)
    a = SyncBNAdapter((2, 5))
    recs = rank_recordings(a, BNCall(x, g, b, rm, rv, dy, dtype="fp16"))
    whole = a.forward_train(x, g, b, rm, rv, dtype="fp16")
    bw = a.backward(dy, x, g, whole.saved, dtype="fp16")
    assert sorted(recs) == [0, 1]
    np.testing.assert_array_equal(np.concatenate([recs[r].get("train", "inputs", "x") for r in recs]), x)
    np.testing.assert_array_equal(np.concatenate([recs[r].get("train", "outputs", "y") for r in recs]), whole.y)
    np.testing.assert_array_equal(np.concatenate([recs[r].get("backward", "outputs", "dx") for r in recs]), bw.dx)
    for r, rec in recs.items():  # the saved statistics and running statistics are the global ones, on every rank
        np.testing.assert_array_equal(rec.get("train", "outputs", "saved_mean"), whole.saved.mean)
        np.testing.assert_array_equal(rec.get("train", "outputs", "running_var_out"), whole.running_var)
        assert rec.meta["rank"] == r and rec.meta["ranks"] == [2, 5] and rec.formats["train.inputs.x"] == "fp16"
    local = sum(recs[r].get("backward", "outputs", "dgamma") for r in recs)
    np.testing.assert_allclose(local, bw.dgamma, rtol=1e-5)
    reduced = rank_recordings(a, BNCall(x, g, b, rm, rv, dy, dtype="fp16"), grads="reduced")
    np.testing.assert_array_equal(reduced[1].get("backward", "outputs", "dbeta"), bw.dbeta)
    for r, rec in recs.items():
        write_dump(rec, tmp_path / "step0" / f"rank{r}")
        back = load_dump(tmp_path / "step0" / f"rank{r}")
        for key in ("x", "gamma", "running_mean"):
            np.testing.assert_array_equal(back.get("train", "inputs", key), rec.get("train", "inputs", key))
        np.testing.assert_array_equal(back.get("backward", "outputs", "dgamma"),
                                      rec.get("backward", "outputs", "dgamma"))
    with pytest.raises(BNProbeError, match="grads must be one of local, reduced"):
        rank_recordings(a, BNCall(x, dtype="fp16"), grads="all")


# ---- compare-precision ------------------------------------------------------------------------------------------

def test_compare_precision_passes_chan_and_fails_unweighted_with_unequal_ranks():
    cases = [Case("ranks/2+14", (16, 8, 4, 4), mean=0.5, std=1.0, seed=1)]
    good = compare_precision(["syncbn:ranks=2+14"], ("fp16",), cases, budget=False)
    assert good.passed, good.rows[good.rows["verdict"] == "FAIL"][["tensor", "why"]].to_string()
    bad = compare_precision(["syncbn:ranks=2+14,merge=unweighted"], ("fp16",), cases, budget=False)
    failed = set(bad.rows.loc[bad.rows["verdict"] == "FAIL", "tensor"])
    assert not bad.passed and {"y", "saved_mean", "saved_invstd", "dx"} <= failed
    assert "y_infer" not in failed  # inference reads the running statistics it is given: nothing crosses ranks

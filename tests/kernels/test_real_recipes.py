"""The policy fields that describe the CPU kernels users run — PyTorch eager's fp32 statistics (float terms summed
in double, ``sum_format``; the running variance's double update, ``running_var_sum``), inductor's vectorised
reductions (``rowlanes``) and its saved statistics in the input's format (``saved_format``) — each against an
independent oracle: a scalar float64/float32 replay of the source's loops, written here without bnprobe, and the
real kernels themselves (torch's eager kernel in the default suite; torch.compile's in the slow tests)."""

import numpy as np
import pytest

from bnprobe.kernels.batchnorm import forward_train
from bnprobe.kernels.policy import get_policy
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import reduce_sum

f32 = np.float32
TORCH_FP32 = ("fp32:sum_format=fp64,order=sequential,rsqrt=exact,rstd_format=fp64,y_formula=affine,fma=true,"
              "unbiased_by=divide,running_var_sum=fp64")
INDUCTOR = "{fmt}:order=rowlanes,lanes=16,rsqrt=sqrt_div"


def _replay_torch_fp32_stats(x: np.ndarray, eps: float, momentum: float, rv: float):
    """aten's batch_norm_cpu_collect_stats_contiguous_impl and update_stats for one fp32 channel, as scalar loops:
    mean = fl32(Σ_double x / n); var_sum = fl32(Σ_double fl32(fl32(x − mean)²)); var = fl32(var_sum / n);
    invstd = fl32(1 / sqrt_double(var + eps)); running var in double from float terms."""
    n = x.size
    s = 0.0
    for v in x:
        s += float(v)
    mean = f32(s / n)
    q = 0.0
    for v in x:
        d = f32(f32(v) - mean)
        q += float(f32(d * d))
    var_sum = f32(q)
    var = f32(var_sum / f32(n))
    invstd = f32(1.0 / np.sqrt(float(var) + eps))
    m = f32(momentum)
    unbiased = f32(var_sum / f32(n - 1))
    new_rv = f32(float(m) * float(unbiased) + float(f32(f32(f32(1.0) - m) * f32(rv))))
    return mean, invstd, new_rv


@pytest.mark.parametrize("seed", range(6))
def test_sum_format_and_running_var_sum_replay_torch_fp32(seed):
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(2, 5)), 2, int(rng.integers(2, 9)), int(rng.integers(2, 9)))
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3]) + rng.choice([0.0, 10.0, 1e4])).astype(f32)
    r = forward_train(x.astype(np.float64), None, None, np.zeros(2), np.full(2, 0.75), policy=TORCH_FP32)
    for c in range(2):
        mean, invstd, rv = _replay_torch_fp32_stats(x[:, c].ravel(), 1e-5, 0.1, 0.75)
        assert (r.mean[c], r.invstd[c], r.running_var[c]) == (mean, invstd, rv)


def test_sum_format_makes_a_difference_the_plain_fp32_sum_does_not_hide():
    """The double sum is not the float one: on values spread over binades the two means differ."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 1, 8, 8)) * 10.0 ** rng.integers(-3, 4, (64, 1, 8, 8)) + 1e3).astype(f32)
    wide = forward_train(x.astype(np.float64), policy=TORCH_FP32)
    narrow = forward_train(x.astype(np.float64), policy=TORCH_FP32.replace("sum_format=fp64,", ""))
    assert not np.array_equal(wide.mean, narrow.mean) or not np.array_equal(wide.invstd, narrow.invstd)


def _replay_rowlanes(x: np.ndarray, row: int, lanes: int) -> f32:
    """inductor's vectorised sum of one channel as scalar loops: lane = position in the row mod lanes, each lane a
    float accumulator across rows, then lanes folded halves first (8, 4, 2, 1 for 16)."""
    acc = [f32(0)] * lanes
    for r in x.reshape(-1, row):
        for p, v in enumerate(r):
            acc[p % lanes] = f32(acc[p % lanes] + f32(v))
    while len(acc) > 1:
        h = len(acc) // 2
        acc = [f32(acc[i] + acc[i + h]) for i in range(h)]
    return acc[0]


@pytest.mark.parametrize("row,lanes", [(36, 16), (16, 16), (7, 16), (50, 8), (100, 16)])
def test_rowlanes_replays_inductor_s_loops(row, lanes):
    rng = np.random.default_rng(row)
    x = (rng.standard_normal((3, 4 * row)) * 10.0 ** rng.integers(-2, 3, (3, 4 * row))).astype(f32)
    got = reduce_sum(x.astype(np.float64), Arith("fp32"), order="rowlanes", lanes=lanes, row=row)
    assert [f32(g) for g in got] == [_replay_rowlanes(x[c], row, lanes) for c in range(3)]


def test_saved_format_rounds_what_is_saved_not_what_normalises():
    """saved_format=fp16 returns the statistics rounded to fp16 while y is normalised with the fp32 ones."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 5, 5)) * 3 + 7
    plain = forward_train(x, policy="fp16")
    saved = forward_train(x, policy="fp16:saved_format=fp16")
    assert np.array_equal(plain.y, saved.y)
    assert saved.mean.dtype == np.float16 and saved.invstd.dtype == np.float16
    assert np.array_equal(saved.mean, plain.mean.astype(np.float16))
    assert get_policy("fp16:saved_format=fp16").golden().saved_format is None


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("momentum", [0.1, 0.37])
def test_torch_fp32_is_reproduced_bit_for_bit(seed, momentum):
    """PyTorch's own fp32 CPU kernel (NCHW): mean, invstd, y and both running statistics bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(2, 6)), 3, int(rng.integers(2, 9)), int(rng.integers(2, 9)))
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3]) + rng.choice([0.0, 10.0, 1e4])).astype(f32)
    g, b = (rng.uniform(0.5, 1.5, 3).astype(f32), rng.uniform(-1, 1, 3).astype(f32))
    rm, rv = rng.uniform(-1, 1, 3).astype(f32), rng.uniform(0.5, 2, 3).astype(f32)
    t = torch.from_numpy
    trm, trv = t(rm.copy()), t(rv.copy())
    y, sm, si = torch.ops.aten.native_batch_norm(t(x), t(g), t(b), trm, trv, True, momentum, 1e-5)
    r = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=momentum, policy=TORCH_FP32)
    for mine, theirs in ((r.mean, sm), (r.invstd, si), (r.y, y), (r.running_mean, trm), (r.running_var, trv)):
        assert np.array_equal(mine, theirs.numpy())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_inductor_forward_at_small_counts_is_reproduced_bit_for_bit(fmt):
    """torch.compile's CPU BatchNorm at per-channel counts up to 1024 (two-pass): mean, invstd and y bit for bit
    by rowlanes (16 lanes: an AVX-512 machine's; skipped elsewhere) and, for 16-bit input, statistics saved in the
    input's format."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        pytest.skip(f"inductor's vector width here is not 16 lanes ({torch.backends.cpu.get_cpu_capability()})")
    from bnprobe.adapters.registry import get_adapter
    from bnprobe.core.call import BNCall
    from bnprobe.numerics.rounding import round_to

    a = get_adapter("torch-compile")
    rng = np.random.default_rng(4)
    # (16-bit input: y = fma(x, γ·rstd, β − mean·γ·rstd), as measured; fp32: ((x − mean)·rstd)·γ + β)
    pol = INDUCTOR.format(fmt=fmt) + ("" if fmt == "fp32" else f",saved_format={fmt},y_formula=affine,fma=true")
    for _ in range(3):
        shape = (int(rng.integers(2, 5)), 3, int(rng.integers(3, 9)), int(rng.integers(3, 9)))
        x = round_to(rng.standard_normal(shape) * 5 + 100, fmt)
        g, b = round_to(rng.uniform(0.5, 1.5, 3), "fp32"), round_to(rng.uniform(-1, 1, 3), "fp32")
        out = a.train(BNCall(x, g, b, dtype=fmt, params="fp32"))
        r = forward_train(x, g, b, policy=pol)
        assert np.array_equal(r.mean, out.saved.mean) and np.array_equal(r.invstd, out.saved.value)
        assert np.array_equal(r.y, out.y)

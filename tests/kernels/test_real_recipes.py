"""The policy fields that describe the CPU kernels users run — PyTorch eager's fp32 statistics (float terms summed
in double, ``sum_format``; the running variance's double update, ``running_var_sum``), its fp32 backward's sums
plane by plane (``backward_sums=plane_reduce``), inductor's vectorised reductions (``rowlanes``; ``order=inductor``,
``variance=inductor``, ``backward_formula=inductor``, ``threads``) and its saved statistics in the input's format
(``saved_format``) — each against an independent oracle: a scalar float64/float32 replay of the source's loops,
written here without bnprobe (tests/kernels/inductor_replay.py for torch.compile's generated C++), and the real
kernels themselves (torch's eager kernel in the default suite; torch.compile's in the slow tests)."""

from fractions import Fraction

import numpy as np
import pytest
from oracle import round_fraction

from bnprobe.kernels.batchnorm import Execution, backward, forward_train
from bnprobe.kernels.policy import get_policy
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import plane_reduce, reduce_sum

f32 = np.float32
TORCH_FP32 = ("fp32:sum_format=fp64,order=sequential,rsqrt=exact,rstd_format=fp64,y_formula=affine,fma=true,"
              "unbiased_by=divide,running_var_sum=fp64")
# the backward (aten's batch_norm_cpu_backward_contiguous_impl): Σdy and Σ(x - mean)·dy by at::vec::reduce_all per
# H·W plane in 8 float lanes — the kernel is registered with REGISTER_DISPATCH, not ALSO_REGISTER_AVX512_DISPATCH, so
# an AVX-512 machine runs its AVX2 build — each plane's masked last vector by fused multiply-adds (GCC contracts it,
# not the full vectors': measured), the planes added in double
TORCH_FP32_BACKWARD = TORCH_FP32 + ",backward_formula=torch,backward_sums=plane_reduce,lanes=8,backward_fma=tail"
# torch.compile on an AVX-512 machine (the slow tests ask torch for its threads)
INDUCTOR = ("{fmt}:order=inductor,lanes=16,unroll={unroll},variance=inductor,rsqrt=sqrt_div,backward_formula=inductor,"
            "threads={threads}")


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


def _fma32(a, b, c) -> f32:
    """fl32(a·b + c), one rounding (exact rationals)."""
    return f32(round_fraction(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)), "fp32"))


def _fold(acc: list) -> f32:
    """at::vec's vec_reduce_all on AVX2/AVX-512: lane i += lane i + half, halves first, until one lane is left."""
    while len(acc) > 1:
        h = len(acc) // 2
        acc = [f32(acc[i] + acc[i + h]) for i in range(h)]
    return acc[0]


def _replay_plane(v, lanes: int, times=None, fused=()) -> f32:
    """at::vec::reduce_all (times None) or map2_reduce_all (Σ v·times) of one plane in float, as scalar loops: a
    plane shorter than the lanes folded lane 0 first; else the first vector as the accumulator, the full vectors
    added lane by lane, the last partial vector into the first lanes, then the fold.  ``fused``: which of "body"
    (full vectors after the first) and "tail" (the partial one) add their product by a fused multiply-add."""
    v = [f32(t) for t in v]
    w = [f32(1)] * len(v) if times is None else [f32(t) for t in times]

    def term(i):
        return v[i] if times is None else f32(v[i] * w[i])

    def step(a, i, part):
        return _fma32(v[i], w[i], a) if times is not None and part in fused else f32(a + term(i))

    n = len(v)
    if n < lanes:
        s = term(0)
        for i in range(1, n):
            s = f32(s + term(i))
        return s
    acc = [term(i) for i in range(lanes)]
    d = lanes
    while d + lanes <= n:
        acc = [step(acc[i], d + i, "body") for i in range(lanes)]
        d += lanes
    for i in range(n - d):
        acc[i] = step(acc[i], d + i, "tail")
    return _fold(acc)


def _replay_torch_fp32_backward(x: np.ndarray, dy: np.ndarray, w: np.ndarray, mean: np.ndarray,
                                invstd: np.ndarray, lanes: int):
    """aten's fp32 batch_norm_cpu_backward_contiguous_impl (training) as scalar loops: per channel, per sample
    plane, sum += reduce_all(dy) and dotp += map2_reduce_all((x - mean)·dy) into doubles (the masked tail fused);
    k = (float) dotp·invstd·invstd / N and grad_mean = sum / N in float; dx = fma(-(x - mean), k, dy - grad_mean)
    ·invstd·w; dgamma = dotp·invstd and dbeta = sum rounded to float."""
    n, c = x.shape[:2]
    count = x[:, 0].size
    dx, dg, db = np.empty(x.shape, f32), np.empty(c, f32), np.empty(c, f32)
    for ch in range(c):
        m, inv = f32(mean[ch]), f32(invstd[ch])
        s = dotp = 0.0
        for i in range(n):
            xv, dv = x[i, ch].ravel(), dy[i, ch].ravel()
            s += float(_replay_plane(dv, lanes))
            dotp += float(_replay_plane([f32(t - m) for t in xv], lanes, dv, fused=("tail",)))
        k = f32(f32(f32(f32(dotp) * inv) * inv) / f32(count))
        grad_mean = f32(s / count)
        for i in range(n):
            flat = [f32(f32(_fma32(-f32(a - m), k, f32(b - grad_mean)) * inv) * f32(w[ch]))
                    for a, b in zip(x[i, ch].ravel(), dy[i, ch].ravel())]
            dx[i, ch] = np.array(flat, f32).reshape(x.shape[2:])
        dg[ch], db[ch] = f32(dotp * float(inv)), f32(s)
    return dx, dg, db


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("row", [1, 5, 8, 16, 19, 35, 64])
def test_plane_reduce_replays_at_vec_reduce_all_into_a_double(row, lanes):
    """Σ of each channel plane by plane (planes below, at and above the vector width, with a tail), the planes
    added in double, and in float."""
    rng = np.random.default_rng([row, lanes])
    planes = 3
    x = (rng.standard_normal((2, planes * row)) * 10.0 ** rng.integers(-3, 4, (2, planes * row))).astype(f32)
    for into in (Arith("fp64"), None):
        got = plane_reduce(x.astype(np.float64), Arith("fp32"), lanes=lanes, row=row, into=into)
        for c in range(2):
            parts = [_replay_plane(p, lanes) for p in x[c].reshape(planes, row)]
            want = 0.0 if into is not None else f32(0)
            for p in parts:
                want = want + float(p) if into is not None else f32(want + p)
            assert got[c] == want


@pytest.mark.parametrize("row", [5, 8, 19, 35, 50])
def test_plane_reduce_of_products_replays_map2_reduce_all(row):
    """Σ a·b plane by plane, the products rounded or (body, tail, all) fused into the lanes' adds; a plane of one
    vector or less has no add to fuse, a longer one tells the four apart."""
    rng = np.random.default_rng(row)
    a = (rng.standard_normal((24, 2 * row)) * 30).astype(f32)
    b = (rng.standard_normal((24, 2 * row)) * 10.0 ** rng.integers(-2, 3, (24, 2 * row))).astype(f32)
    results = set()
    for fused, parts in (("none", ()), ("tail", ("tail",)), ("body", ("body",)), ("all", ("body", "tail"))):
        got = plane_reduce(a.astype(np.float64), Arith("fp32"), lanes=8, row=row, times=b.astype(np.float64),
                           fused=fused, into=Arith("fp64"))
        for c in range(24):
            want = 0.0
            for pa, pb in zip(a[c].reshape(2, row), b[c].reshape(2, row)):
                want += float(_replay_plane(pa, 8, pb, fused=parts))
            assert got[c] == want
        results.add(tuple(got))
    assert len(results) == (1 if row <= 8 else 4)


@pytest.mark.parametrize("shape", [(2, 2, 2, 3), (3, 2, 5, 7), (1, 2, 9, 9), (2, 1, 4, 4), (2, 2, 1, 19)])
def test_plane_reduce_backward_replays_torch_s_fp32_loops(shape):
    """backward_sums=plane_reduce with the torch formula, on both carriers, against the scalar replay."""
    rng = np.random.default_rng(list(shape))
    x = (rng.standard_normal(shape) * 3 + 40).astype(f32)
    dy = (rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 3, shape) + rng.normal(0, 1, (1, shape[1], 1, 1))
          ).astype(f32)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(f32)
    mean = x.astype(np.float64).mean(axis=(0, 2, 3)).astype(f32)
    invstd = (1 / np.sqrt(x.astype(np.float64).var(axis=(0, 2, 3)) + 1e-5)).astype(f32)
    want = _replay_torch_fp32_backward(x, dy, w, mean, invstd, 8)
    for keep in (True, False):
        r = backward(dy.astype(np.float64), x.astype(np.float64), w, mean, invstd, policy=TORCH_FP32_BACKWARD,
                     execution=Execution(keep_arrays=keep))
        for mine, theirs in zip((r.dx, r.dgamma, r.dbeta), want):
            assert np.array_equal(np.asarray(mine, dtype=np.float64), theirs.astype(np.float64))


# ---- torch.compile (inductor): the emulation against scalar replays of its generated C++ ----------------------

def _channels(r: int, seed: int, c: int = 3) -> np.ndarray:
    """(C, R) fp32 values over several binades, with an offset: sums and variances that depend on their order."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((c, r)) * 2.0 ** rng.integers(-6, 7, (c, r)) + rng.normal(0, 50, (c, 1))
    return x.astype(f32).astype(np.float64)


# (count, row or None for a vector of channels, lanes x unroll as the policy gives them, threads)
SUM_CASES = [(6, 3, 16, 1, 1), (5 * 37, 37, 16, 1, 1), (4 * 45, 45, 16, 2, 1), (4 * 28, 28, 16, 2, 1),
             (600, None, 16, 1, 1), (1000, None, 16, 1, 2), (9000, None, 16, 1, 1), (2 * 4700, 4700, 16, 1, 1),
             (16 * 8400, 16 * 8400, 16, 1, 1)]


@pytest.mark.parametrize("r,row,lanes,unroll,threads", SUM_CASES)
def test_inductor_sums_replay_the_generated_loops(r, row, lanes, unroll, threads):
    """order=inductor: unrolled below 8 values, rows in vectors with masked tails (two vectors for 16-bit input, one
    in rows shorter than both), a vector of channels in order (split across threads), and cascades above 4096."""
    from bnprobe.numerics.reduce import Cores
    from tests.kernels import inductor_replay as rp

    x = _channels(r, r + threads)
    cores = Cores(threads, "ordered", "openmp")
    got = reduce_sum(x, Arith("fp32"), order="inductor", lanes=lanes, unroll=unroll, row=row, cores=cores)
    width = lanes * unroll if row is None or row >= lanes * unroll else lanes
    assert [f32(g) for g in got] == [rp.channel_sum(x[c], row, width, threads) for c in range(3)]


# (count, row or None, lanes, unroll, threads): tails, two vectors, short rows, one chunk pushed (depth 1), a chunk
# stack that carries (depth 2), a vector of channels split across threads
WELFORD_CASES = [(3 * 37, 37, 16, 1, 1), (2 * 45, 45, 16, 2, 1), (2 * 28, 28, 16, 2, 1),
                 (16 * 4200 + 3, None, 16, 1, 1), (16 * 4200 + 5, 16 * 4200 + 5, 16, 1, 1), (1500, None, 16, 1, 2)]


@pytest.mark.parametrize("r,row,lanes,unroll,threads", WELFORD_CASES)
def test_inductor_welford_replays_cpp_prefix(r, row, lanes, unroll, threads):
    """variance=inductor's Welford (bnprobe.numerics.inductor) against a scalar replay of cpp_prefix.h: the
    reciprocal table, the masked tail accumulator, the chunk stack, the lane merges by AVX-512 shuffles."""
    from bnprobe.numerics.inductor import welford
    from tests.kernels import inductor_replay as rp

    x = _channels(r, r)
    mean, m2 = welford(x, Arith("fp32"), lanes=lanes, unroll=unroll, row=row, threads=threads)
    width = lanes * unroll if row is None or row >= lanes * unroll else lanes
    want = [rp.channel_welford(x[c], row, width, threads) for c in range(3)]
    assert [(f32(a), f32(b)) for a, b in zip(mean, m2)] == want


def test_inductor_welford_chunk_stack_carries():
    """More than 2 x 4096 updates per lane (a stack of depth 2 that carries): the emulation against the replay, and
    the replay's stack really carried (a plain running update differs)."""
    from bnprobe.numerics.inductor import welford
    from tests.kernels import inductor_replay as rp

    x = _channels(8300, 1, c=2)
    mean, m2 = welford(x, Arith("fp32"), lanes=16, row=None)
    want = [rp.channel_welford(x[c], None, 16) for c in range(2)]
    assert [(f32(a), f32(b)) for a, b in zip(mean, m2)] == want
    assert rp.Helper(8300, 1).depth == 2


def test_inductor_replays_tell_their_branches_apart():
    """The replays' branches are not one sum in disguise: a cascade with separate tails, a thread split, Welford's
    mean and the two-pass mean each differ from the plain form on these values (else the tests above could not
    fail)."""
    from tests.kernels import inductor_replay as rp

    x = _channels(2 * 4700, 3)[0]
    x[4688: 4700] *= 2.0 ** 14  # (large tails: where they join their lanes shows)
    acc = [f32(0)] * 16  # the two rows' tails masked into the same lanes, no cascade
    for i in range(2):
        for p in range(4700):
            acc[p % 16] = f32(acc[p % 16] + f32(x[i * 4700 + p]))
    assert rp.channel_sum(x, 4700, 16) != rp.fold(acc)
    y = _channels(1000, 4)[1]
    assert rp.channel_sum(y, None, 16, threads=2) != rp.channel_sum(y, None, 16, threads=1)
    z = _channels(3 * 37, 5)[2]
    two_pass = f32(rp.channel_sum(z, 37, 16) / f32(z.size))
    assert rp.channel_welford(z, 37, 16)[0] != two_pass


@pytest.mark.parametrize("r,channels,variance", [(1024, 3, "two_pass"), (1025, 3, "welford"), (600, 1, "welford"),
                                                 (6, 3, "two_pass")])
def test_inductor_takes_two_pass_up_to_1024_values_and_welford_above_or_for_one_channel(r, channels, variance):
    """variance=inductor: the two-pass mean fl(Σ / R) at most 1024 values a channel over several channels, Welford's
    above or for a single channel (inductor's use_two_step_variance)."""
    from tests.kernels import inductor_replay as rp

    x = _channels(r, r, c=channels)
    out = forward_train(x.T.reshape(r, channels), policy="fp32:order=inductor,lanes=16,variance=inductor")
    for c in range(channels):
        want = rp.channel_welford(x[c], None, 16)[0] if variance == "welford" else \
            f32(rp.channel_sum(x[c], None, 16) / f32(r))
        assert out.mean[c] == want


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_inductor_backward_replays_the_decomposition(fmt):
    """backward_formula=inductor against native_batch_norm_backward's decomposition replayed per element in
    float32: p = Σ(x − mean)dy, n = fl(1/R); dγ = p·invstd; dx = ((dy − (x − mean)·((p·n)·invstd²)) − Σdy·n)·
    (invstd·γ), rounded to the input's format."""
    from bnprobe.kernels.batchnorm import backward
    from bnprobe.numerics.rounding import round_to
    from tests.kernels import inductor_replay as rp

    rng = np.random.default_rng(7)
    shape = (3, 2, 5, 9)
    x = round_to(rng.standard_normal(shape) * 3 + 20, fmt)
    dy = round_to(rng.standard_normal(shape) + 0.5, fmt)
    g = round_to(rng.uniform(0.5, 1.5, 2), "fp32")
    mean, inv = round_to(x.mean(axis=(0, 2, 3)), fmt), round_to(1 / x.std(axis=(0, 2, 3)), fmt)
    spec = f"{fmt}:order=inductor,lanes=16,unroll={1 if fmt == 'fp32' else 2},backward_formula=inductor"
    out = backward(dy, x, g, mean, inv, policy=spec)
    r, width = 3 * 45, 16 if fmt == "fp32" else 32
    norm = f32(1.0 / r)
    for c in range(2):
        xc, dc = x[:, c].ravel(), dy[:, c].ravel()
        m, i, gc = f32(mean[c]), f32(inv[c]), f32(g[c])
        cen = [f32(f32(v) - m) for v in xc]
        p = rp.channel_sum(np.array([f32(f32(d) * e) for d, e in zip(dc, cen)]), 45, width)
        s = rp.channel_sum(dc, 45, width)
        proj, mdy, scale = f32(f32(p * norm) * f32(i * i)), f32(s * norm), f32(i * gc)
        dx = [f32(f32(f32(f32(d) - f32(e * proj)) - mdy) * scale) for d, e in zip(dc, cen)]
        assert out.dgamma[c] == f32(p * i) and out.dbeta[c] == s
        assert np.array_equal(np.asarray(out.dx[:, c], dtype=np.float64).ravel(),
                              round_to(np.array(dx, dtype=np.float64), fmt))


# measured on torch 2.13 with 2 threads (whether the generated kernel holds per-thread accumulators, "_arr[tid]"):
# (R, C, format) -> (forward split, backward split), for (N, C) and channels-last input alike
MEASURED_SPLITS = {
    (1000, 3, "fp32"): (True, True), (2178, 3, "fp32"): (True, True), (1000, 4, "fp32"): (False, False),
    (2178, 4, "fp32"): (True, True), (1000, 5, "fp32"): (False, False), (2178, 5, "fp32"): (True, True),
    (1000, 8, "fp32"): (False, False), (2178, 8, "fp32"): (False, False), (2178, 9, "fp32"): (False, False),
    (400, 3, "fp32"): (False, True), (1100, 4, "fp32"): (False, False), (1000, 3, "fp16"): (True, True),
    (1000, 4, "fp16"): (False, True), (2178, 4, "fp16"): (True, True), (1000, 5, "fp16"): (False, True),
    (2178, 5, "fp16"): (True, True), (1000, 8, "fp16"): (False, False), (2178, 9, "fp16"): (False, False),
    (702, 5, "fp16"): (False, True), (300, 20, "fp16"): (False, False)}


@pytest.mark.parametrize("case", sorted(MEASURED_SPLITS))
def test_inductor_thread_split_rule_matches_what_torch_compile_generated(case):
    """splits_channels (with the scalar thresholds batchnorm.py gives it: none for the forward statistics, 4 floats
    or 8 16-bit values for the backward) against the kernels torch.compile generated for these shapes."""
    from bnprobe.numerics.inductor import splits_channels

    r, c, fmt = case
    got = (splits_channels(c, r, 2, 0), splits_channels(c, r, 2, 8 if fmt != "fp32" else 4))
    assert got == MEASURED_SPLITS[case]


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


# shapes (channels-first NCHW, or channels-last NHWC) that take each branch of inductor's code: rows with tails and
# the two-pass variance; a count below 8 (unrolled); rows shorter than a 16-bit pair of vectors; Welford above 1024
# values; backward sums above 4096 (cascade); (N, C) input and channels-last whose few channels are split across
# threads (forward sums at R > 300·C, the backward's whenever its per-channel loop is scalar)
COMPILED_CASES = [((3, 5, 7, 23), "channels_first"), ((2, 3, 1, 3), "channels_first"), ((5, 4, 4, 7), "channels_first"),
                  ((2, 3, 25, 23), "channels_first"), ((1, 2, 70, 70), "channels_first"), ((1000, 3), "channels_first"),
                  ((6, 9, 13, 5), "channels_last"), ((2, 33, 33, 3), "channels_last")]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape,layout", COMPILED_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else v)
def test_inductor_is_reproduced_bit_for_bit(fmt, shape, layout):
    """torch.compile's CPU BatchNorm (AVX-512; skipped elsewhere): saved statistics, y, running statistics, inference
    y and the backward's dx, dγ, dβ bit for bit, with the threads torch runs."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        pytest.skip(f"inductor's vector width here is not 16 lanes ({torch.backends.cpu.get_cpu_capability()})")
    from bnprobe.adapters.emulated import EmulatedAdapter
    from bnprobe.adapters.registry import get_adapter
    from bnprobe.core.call import BNCall
    from bnprobe.numerics.rounding import round_to

    rng = np.random.default_rng(sum(shape))
    c = shape[1] if layout == "channels_first" else shape[-1]
    x = round_to(rng.standard_normal(shape) * 2.0 + 30.0, fmt)
    vec = [round_to(v, "fp32") for v in (rng.uniform(0.5, 1.5, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c),
                                         rng.uniform(0.5, 2, c))]
    call = BNCall(x, *vec[:2], running_mean=vec[2], running_var=vec[3], dy=round_to(rng.standard_normal(shape), fmt),
                  dtype=fmt, params="fp32", layout=layout)
    spec = INDUCTOR.format(fmt=fmt, unroll=1 if fmt == "fp32" else 2, threads=torch.get_num_threads())
    spec += "" if fmt == "fp32" else f",saved_format={fmt}"
    mine, theirs = EmulatedAdapter(spec), get_adapter("torch-compile")
    got, want = mine.train(call), theirs.train(call)
    pairs = [(got.y, want.y), (got.saved.mean, want.saved.mean), (got.saved.value, want.saved.value),
             (got.running_mean, want.running_mean), (got.running_var, want.running_var),
             (mine.infer(call).y, theirs.infer(call).y)]
    b, bt = mine.backward_of(call, want.saved), theirs.backward_of(call, want.saved)
    pairs += [(b.dx, bt.dx), (b.dgamma, bt.dgamma), (b.dbeta, bt.dbeta)]
    names = ("y", "saved mean", "saved invstd", "running mean", "running var", "inference y", "dx", "dγ", "dβ")
    for name, (a, w) in zip(names, pairs):
        assert np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(w, dtype=np.float64)), name


def _torch_fp32_backward_case(shape, seed):
    """torch's fp32 forward and backward (NCHW) on one drawn case: (x, dy, w, saved mean, saved invstd, dx, dw,
    db) as float32 arrays; x with a large mean, dy with a mean per channel and spread over binades."""
    rng = np.random.default_rng([seed, *shape])
    x = (rng.standard_normal(shape) * rng.choice([1e-2, 1.0, 30.0]) + rng.choice([0.0, 10.0, 1e3])).astype(f32)
    dy = (rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 3, shape) + rng.normal(0, 2, (1, shape[1], 1, 1))
          ).astype(f32)
    w, b = rng.uniform(0.5, 1.5, shape[1]).astype(f32), rng.uniform(-1, 1, shape[1]).astype(f32)
    t = torch.from_numpy
    rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
    _, sm, si = torch.ops.aten.native_batch_norm(t(x), t(w), t(b), rm, rv, True, 0.1, 1e-5)
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(t(dy), t(x), t(w), rm, rv, sm, si, True, 1e-5, [True] * 3)
    return x, dy, w, sm.numpy(), si.numpy(), dx.numpy(), dw.numpy(), db.numpy()


def _misses(spec: str, case) -> int:
    """How many of dx, dgamma, dbeta values the recipe gets wrong against torch on one case."""
    x, dy, w, sm, si, *theirs = case
    r = backward(dy.astype(np.float64), x.astype(np.float64), w, sm, si, policy=spec,
                 execution=Execution(keep_arrays=False))
    return sum(int(np.sum(np.asarray(m, dtype=np.float64) != t.astype(np.float64)))
               for m, t in zip((r.dx, r.dgamma, r.dbeta), theirs))


def _skip_unless_avx2_build():
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512", "AMX"):  # (AVX-512 and AMX machines run the AVX2 build of this kernel)
        pytest.skip(f"torch's BatchNorm kernels here are its {cap} build, not the AVX2 one (8 lanes, halves first)")


# planes below the 8 lanes (6, 7), at them (8), not a multiple (35, 81, 114), large (3136, 4160); N = 1 and N = 16
BACKWARD_SHAPES = [(4, 3, 2, 3), (1, 2, 1, 7), (2, 3, 2, 4), (3, 2, 5, 7), (1, 3, 9, 9), (16, 2, 6, 19),
                   (1, 2, 56, 56), (2, 2, 64, 65)]


@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_fp32_backward_is_reproduced_bit_for_bit(shape):
    """PyTorch's own fp32 CPU backward (NCHW, training): dx, dgamma and dbeta bit for bit, on both carriers."""
    _skip_unless_avx2_build()
    for seed in range(3):
        x, dy, w, sm, si, dx, dw, db = _torch_fp32_backward_case(shape, seed)
        for keep in (True, False):
            r = backward(dy.astype(np.float64), x.astype(np.float64), w, sm, si, policy=TORCH_FP32_BACKWARD,
                         execution=Execution(keep_arrays=keep))
            for mine, theirs in ((r.dx, dx), (r.dgamma, dw), (r.dbeta, db)):
                assert np.array_equal(np.asarray(mine, dtype=np.float64), theirs.astype(np.float64))


@pytest.mark.parametrize("other", ["backward_sums=forward,backward_fma=none", "lanes=16", "backward_fma=none",
                                   "backward_fma=all", "sum_format=none"])
def test_each_choice_of_the_torch_fp32_backward_is_seen_in_torch_s_output(other):
    """Each field of the recipe is pinned by torch's outputs: the recipe with it changed (the forward's sums,
    16 lanes, no fused tail, fused vector bodies too, the planes added in float) misses on some of the cases."""
    _skip_unless_avx2_build()
    spec = TORCH_FP32_BACKWARD + "," + other
    cases = [_torch_fp32_backward_case(s, seed) for s in BACKWARD_SHAPES[:6] for seed in range(3)]
    assert sum(_misses(spec, c) for c in cases) > 0

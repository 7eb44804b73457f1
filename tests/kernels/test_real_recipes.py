"""The policy fields that describe the CPU kernels users run — PyTorch eager's fp32 statistics (float terms summed
in double, ``sum_format``; the running variance's double update, ``running_var_sum``), its fp32 backward's sums
plane by plane (``backward_sums=plane_reduce``), inductor's vectorised reductions (``rowlanes``) and its saved
statistics in the input's format (``saved_format``) — each against an independent oracle: a scalar float64/float32
replay of the source's loops, written here without bnprobe, and the real kernels themselves (torch's eager kernel in
the default suite; torch.compile's in the slow tests)."""

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

"""The policy fields that describe TensorFlow's CPU BatchNorm kernels — oneDNN's C++ loop and JIT kernel behind
``tf.nn.fused_batch_norm`` (threads split by sample, ``thread_split``; Σ(x − mean)² by fused multiply-adds,
``variance_fma``; the JIT kernel for channel counts its vector width divides, ``path_channels``; the running update's
``(m·fl(R/(R−1)))·var``, ``unbiased_by=momentum_factor``; both backwards), TensorFlow's Eigen gradient
(``backward_formula=tf_eigen``) and Keras's Eigen reductions (``order=interleave4``, ``packet_lanes``, the x86 rsqrt
estimate) — each against a replay of the source's loops written here in numpy float32 arithmetic, without bnprobe.
The real kernels are compared in tests/adapters/test_frameworks.py, where TensorFlow is installed."""

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.batchnorm import backward, forward_infer, forward_train
from bnprobe.kernels.policy import get_policy
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import balance211, eigen_parallel_blocks, outer_dims_sum, reduce_sum, thread_blocks, \
    thread_sum

f32 = np.float32
ONEDNN = ("{fmt}:order=sequential,y_formula=scale,rsqrt=sqrt_div,backward_formula=onednn,threads={t},"
          "thread_split=samples,path_channels={path},unbiased_by=momentum_factor")
KERAS = ("{fmt}:order=interleave4,packet_lanes=8,rsqrt=rsqrtps,rsqrt_newton=1,newton_form=eigen,y_formula=affine,"
         "running_momentum=old,running_var=biased")


# ---- replays of the sources' loops (numpy float32: each operation rounded once) ------------------------------

def _bal(n: int, team: int, tid: int) -> tuple[int, int]:
    """dnnl's balance211, written out: the first n mod team members take ceil(n / team)."""
    if team <= 1 or n == 0:
        return 0, n
    big = -(-n // team)
    small = big - 1
    n_big = n - small * team
    start = tid * big if tid <= n_big else n_big * big + (tid - n_big) * small
    return start, start + (big if tid < n_big else small)


def _fma(a, b, c):
    """fma in float32 through float64 (a·b exact in float64; the sum's one rounding to binary32 is right for these
    magnitudes, which the tests keep far from the double-rounding corner)."""
    a, b, c = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    return (a * b + c).astype(f32)


def _chunks(n: int, s: int, t: int, jit: bool) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (sample range, position range) each thread takes: the C++ loop deals samples; the JIT kernel deals
    samples over min(N, T) and positions over T // that."""
    if not jit:
        return [(_bal(n, t, i), (0, s)) for i in range(t)]
    tn = max(1, min(n, t))
    ts = max(1, min(s, t // tn))
    return [(_bal(n, tn, i // ts % tn), _bal(s, ts, i % ts)) for i in range(tn * ts)]


def _replay_onednn_forward(x, g, b, rm, rv, eps, f, t, jit):
    """oneDNN's nspc batch normalisation forward (nspc_batch_normalization.cpp / jit_uni_tbb_batch_normalization.cpp)
    and TensorFlow's running update (mkl_fused_batch_norm_op.cc), x in NHWC as float32."""
    n, c = x.shape[0], x.shape[-1]
    rows = x.reshape(n, -1, c)
    s = rows.shape[1]
    r = n * s

    def stat(step):
        tot = np.zeros(c, f32)
        for (n0, n1), (s0, s1) in _chunks(n, s, t, jit):
            acc = np.zeros(c, f32)
            for i in range(n0, n1):
                for p in range(s0, s1):
                    acc = step(acc, rows[i, p])
            tot = tot + acc
        return tot / f32(r)

    mean = stat(lambda a, v: a + v)

    def sq(a, v):
        d = v - mean
        return _fma(d, d, a) if jit else a + d * d

    var = stat(sq)
    std = np.sqrt(var + f32(eps))
    if jit:
        y = _fma((x - mean) * (f32(1) / std), g, b)
    else:
        y = (g / std) * (x - mean) + b
    adj = f32(r) / f32(r - 1)
    ff = f32(f)
    keep = f32(1) - ff
    return mean, var, y, keep * rm + ff * mean, keep * rv + (ff * adj) * var


def _replay_onednn_backward(x, dy, mean, var, g, eps, t, jit):
    """oneDNN's nspc batch normalisation backward, both loops (x, dy in NHWC, float32)."""
    n, c = x.shape[0], x.shape[-1]
    xr, dr = x.reshape(n, -1, c), dy.reshape(n, -1, c)
    s = xr.shape[1]
    r = f32(n * s)
    isv = f32(1) / np.sqrt(var + f32(eps))
    dg, db = np.zeros(c, f32), np.zeros(c, f32)
    for (n0, n1), (s0, s1) in _chunks(n, s, t, jit):
        pg, pb = np.zeros(c, f32), np.zeros(c, f32)
        for i in range(n0, n1):
            sg, sb = np.zeros(c, f32), np.zeros(c, f32)
            for p in range(s0, s1):
                if jit:
                    sb = sb + dr[i, p]
                    sg = _fma(xr[i, p] - mean, dr[i, p], sg)
                else:
                    pg = pg + (xr[i, p] - mean) * dr[i, p]
                    pb = pb + dr[i, p]
            if jit:  # (the JIT kernel stores each sample's sums, the dot times rstd)
                pb = pb + sb
                pg = pg + sg * isv
        dg, db = dg + pg, db + pb
    if jit:
        k = (dg * isv) / r
        dx = ((((dy - db / r) - (x - mean) * k) * g) * isv)
    else:
        dg = dg * isv
        dx = (dy - (db / r + (((x - mean) * dg) * isv) / r)) * (g * isv)
    return dx, dg, db


def _x86_rsqrt(a):
    """RSQRTPS as Intel documents its accuracy and as measured: exponent parity and 10 fraction bits pick an
    interval; 1/sqrt of its midpoint rounded to 12 fraction bits."""
    bits = np.asarray(a, f32).view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127
    base = 1.0 + ((bits >> 13) & 0x3FF) * 2.0 ** -10 + 2.0 ** -11
    odd = (e % 2) == 1
    mid = np.where(odd, 2 * base, base)
    k = np.where(odd, (e - 1) // 2, e // 2)
    m, ex = np.frexp(1 / np.sqrt(mid))
    return (np.ldexp(np.rint(np.ldexp(m, 13)), ex - 13) * 2.0 ** -k).astype(f32)


def _eigen_rsqrt(v, lanes):
    """TensorFlow's rsqrt over channels: whole packets by RSQRTPS and Eigen's Newton step, the rest 1/sqrt."""
    y = _x86_rsqrt(v)
    h = (v * y) * y - f32(1)
    est = (y * f32(-0.5)) * h + y
    out = f32(1) / np.sqrt(v)
    whole = lanes * (v.size // lanes)
    out[:whole] = est[:whole]
    return out


def _replay_tf_eigen_backward(x, dy, mean, var, g, eps, lanes):
    """TensorFlow's FusedBatchNormGrad<CPUDevice> (fused_batch_norm_op.cc), sums in order over rows."""
    c = x.shape[-1]
    xf, dyf = x.reshape(-1, c), dy.reshape(-1, c)
    r = xf.shape[0]
    c0 = _eigen_rsqrt(var + f32(eps), lanes)
    xc = xf - mean
    dscale, doff, dot = np.zeros(c, f32), np.zeros(c, f32), np.zeros(c, f32)
    for i in range(r):
        dscale = dscale + dyf[i] * (xc[i] * c0)
        doff = doff + dyf[i]
        dot = dot + dyf[i] * xc[i]
    ybar = doff * (f32(1) / f32(r))
    coef2 = (c0 * c0) * (dot / f32(r))
    dx = (g * c0) * ((dyf - ybar) - xc * coef2)
    return dx.reshape(x.shape), dscale, doff


def _eigen_row_sum(a, lanes):
    """TensorFlow's reduce_sum over the rows of [R, C]: channels in whole packets by four interleaved accumulators
    (16 rows or more), the rest in order."""
    r, c = a.shape
    seq = np.zeros(c, f32)
    for i in range(r):
        seq = seq + a[i]
    whole = lanes * (c // lanes)
    if r < 16 or not whole:
        return seq
    accs = [np.zeros(whole, f32) for _ in range(4)]
    body = (r // 4) * 4
    for i in range(0, body, 4):
        for k in range(4):
            accs[k] = accs[k] + a[i + k, :whole]
    tot = ((accs[0] + accs[1]) + accs[2]) + accs[3]
    for i in range(body, r):
        tot = tot + a[i, :whole]
    seq[:whole] = tot
    return seq


def _replay_keras_forward(x, g, b, rm, rv, eps, k):
    """Keras 3's BatchNormalization.call on TensorFlow: tf.nn.moments (reduce_mean twice), tf.nn.batch_normalization,
    the moving statistics' m·k + stat·(1 − k)."""
    c = x.shape[-1]
    xf = x.reshape(-1, c)
    r = f32(xf.shape[0])
    mean = _eigen_row_sum(xf, 8) / r
    d = xf - mean
    var = _eigen_row_sum(d * d, 8) / r
    inv = _eigen_rsqrt(var + f32(eps), 8) * g
    y = x * inv + (b - mean * inv)
    keep, f = f32(k), f32(1.0 - k)
    return y, rm * keep + mean * f, rv * keep + var * f


def _replay_keras_backward(x, dy, g, eps):
    """TensorFlow's registered gradients through Keras's graph, op by op: AddV2 and Sub (Σdy), Mul (dy·inv,
    Σx·dy, −Σdy·inv, mean·(−Σdy)), AddN of inv's two gradients, Mul by γ, RsqrtGrad (Eigen's packet form on whole
    packets, its scalar form on the rest), Mean's gradient (÷R), SquaredDifference's (2·g·(x − mean)), AddN of dx's
    three terms."""
    c = x.shape[-1]
    xf, d = x.reshape(-1, c), dy.reshape(-1, c)
    r = f32(xf.shape[0])
    mean = _eigen_row_sum(xf, 8) / r
    var = _eigen_row_sum((xf - mean) * (xf - mean), 8) / r
    rs = _eigen_rsqrt(var + f32(eps), 8)
    inv = rs * g
    gb = _eigen_row_sum(d, 8)
    ginv = _eigen_row_sum(xf * d, 8) + mean * (-gb)
    grs = ginv * g
    whole = 8 * (c // 8)
    gvar = (f32(-0.5) * (grs * rs)) * (rs * rs)
    gvar[:whole] = ((f32(-0.5) * (rs * rs)) * (rs * grs))[:whole]
    dx = (d * inv + ((-gb) * inv) / r) + (f32(2) * (gvar / r)) * (xf - mean)
    return dx.reshape(x.shape), rs * ginv, gb


def _nhwc(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _inputs(seed: int, shape: tuple[int, ...]):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape)
         + rng.normal(0, 30, c)[None, :, None, None]).astype(f32)
    dy = (rng.standard_normal(shape) + rng.normal(0, 2, c)[None, :, None, None]).astype(f32)
    vec = [rng.uniform(0.3, 3, c), rng.normal(0, 1, c), rng.normal(0, 1, c), rng.uniform(0.5, 2, c)]
    return x, dy, [v.astype(f32) for v in vec]


SHAPES = [(4, 19, 5, 7), (3, 6, 9, 11), (1, 12, 6, 6), (5, 7, 3, 3), (2, 16, 3, 5), (1, 32, 3, 5), (3, 8, 4, 5)]


# ---- the tests -------------------------------------------------------------------------------------------------

def test_balance211_and_the_thread_blocks():
    assert [_bal(7, 3, i) for i in range(3)] == [balance211(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert balance211(1, 2, 1) == (1, 1)  # (an idle thread)
    # the C++ loop: whole samples; the JIT kernel: one sample, then its positions split over the two threads
    assert thread_blocks(12, 2, "samples", 1) == [slice(0, 12), slice(12, 12)]
    assert thread_blocks(12, 2, "samples_spatial", 1) == [slice(0, 6), slice(6, 12)]
    assert thread_blocks(30, 4, "samples_spatial", 3) == [slice(0, 10), slice(10, 20), slice(20, 30), slice(30, 30)]
    assert thread_blocks(20, 5, "samples_spatial", 2) == [slice(0, 5), slice(5, 10), slice(10, 15), slice(15, 20),
                                                          slice(20, 20)]
    with pytest.raises(BNProbeError, match="sample count"):
        thread_blocks(10, 2, "samples", 3)


@pytest.mark.parametrize("fused", [False, True])
def test_thread_sum_by_sample_replays_a_loop_per_thread(fused):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((4, 37)) * 10.0 ** rng.integers(-2, 3, (4, 37))).astype(f32)
    b = (rng.standard_normal((4, 37)) * 3).astype(f32)
    got = thread_sum(a.astype(np.float64), Arith("fp32"), threads=3, times=b.astype(np.float64), fused=fused,
                     split="samples", samples=37)
    want = np.zeros(4, f32)
    for t in range(3):
        n0, n1 = _bal(37, 3, t)
        acc = np.zeros(4, f32)
        for j in range(n0, n1):
            acc = _fma(a[:, j], b[:, j], acc) if fused else acc + a[:, j] * b[:, j]
        want = want + acc
    assert np.array_equal(got, want)


def test_interleave4_replays_eigen_s_preserver():
    rng = np.random.default_rng(4)
    for r in (5, 15, 16, 17, 63):
        a = (rng.standard_normal((r, 3)) * 10.0 ** rng.integers(-3, 4, (r, 3))).astype(f32)
        got = reduce_sum(np.ascontiguousarray(a.T).astype(np.float64), Arith("fp32"), order="interleave4")
        assert np.array_equal(got, _eigen_row_sum(a, 1)), r


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_onednn_forward_replays_both_loops(shape, threads):
    """The C++ loop for channel counts 4 does not divide, the JIT kernel for the rest (path_channels=4): saved mean
    and biased variance, y, running statistics, inference."""
    x, _, (g, b, rm, rv) = _inputs(sum(shape) + threads, shape)
    pol = ONEDNN.format(fmt="fp32", t=threads, path=4)
    res = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.1, eps=1e-3, policy=pol)
    mean, var, y, nrm, nrv = _replay_onednn_forward(_nhwc(x), g, b, rm, rv, 1e-3, 0.1, threads, shape[1] % 4 == 0)
    for mine, theirs in ((res.mean, mean), (res.var, var), (_nhwc(res.y), y), (res.running_mean, nrm),
                         (res.running_var, nrv)):
        assert np.array_equal(mine, theirs)
    inf = forward_infer(x.astype(np.float64), g, b, rm, rv, eps=1e-3, policy=pol)
    std = np.sqrt(rv + f32(1e-3))  # (inference: the same normalisation, with the running statistics)
    want = _fma((_nhwc(x) - rm) * (f32(1) / std), g, b) if shape[1] % 4 == 0 else (g / std) * (_nhwc(x) - rm) + b
    assert np.array_equal(_nhwc(inf.y), want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [2, 3])
def test_onednn_backward_replays_both_loops(shape, threads):
    x, dy, (g, _, _, _) = _inputs(7 * sum(shape) + threads, shape)
    mean, var, *_ = _replay_onednn_forward(_nhwc(x), g, g, g, g, 1e-3, 0.1, threads, shape[1] % 4 == 0)
    invstd = f32(1) / np.sqrt(var + f32(1e-3))
    pol = ONEDNN.format(fmt="fp32", t=threads, path=4)
    res = backward(dy.astype(np.float64), x.astype(np.float64), g, mean, invstd, saved_var=var, eps=1e-3,
                   policy=pol)
    dx, dg, db = _replay_onednn_backward(_nhwc(x), _nhwc(dy), mean, var, g, 1e-3, threads, shape[1] % 4 == 0)
    assert np.array_equal(_nhwc(res.dx), dx) and np.array_equal(res.dgamma, dg) and np.array_equal(res.dbeta, db)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_onednn_16_bit_input_rounds_y_only(fmt):
    """16-bit x: converted to float, everything in float, y rounded to the input's format."""
    import ml_dtypes

    dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    x, _, (g, b, rm, rv) = _inputs(11, (3, 19, 4, 6))
    x16 = x.astype(dt)
    res = forward_train(x16, g, b, rm, rv, momentum=0.1, eps=1e-3, policy=ONEDNN.format(fmt=fmt, t=2, path=16))
    mean, var, y, _, _ = _replay_onednn_forward(_nhwc(x16.astype(f32)), g, b, rm, rv, 1e-3, 0.1, 2, False)
    assert np.array_equal(res.mean, mean) and np.array_equal(res.var, var)
    assert np.array_equal(_nhwc(res.y), y.astype(dt))


def test_the_paths_differ_where_they_claim_to():
    """Guards: the replays' two loops give different bits on these inputs, so each test above can fail."""
    x, dy, (g, b, rm, rv) = _inputs(5, (3, 16, 5, 7))
    a = _replay_onednn_forward(_nhwc(x), g, b, rm, rv, 1e-3, 0.1, 2, False)
    j = _replay_onednn_forward(_nhwc(x), g, b, rm, rv, 1e-3, 0.1, 2, True)
    assert not np.array_equal(a[1], j[1]) and not np.array_equal(a[2], j[2])
    one = _replay_onednn_forward(_nhwc(x), g, b, rm, rv, 1e-3, 0.1, 1, False)
    assert not np.array_equal(a[0], one[0])  # (two threads' partial sums are not one thread's)
    fixed = forward_train(x.astype(np.float64), g, b, policy=ONEDNN.format(fmt="fp32", t=2, path=0))
    assert not np.array_equal(_nhwc(fixed.y), j[2])  # (path_channels=0: never the JIT kernel)


def test_momentum_factor_is_not_the_unbiased_variance_times_momentum():
    """TensorFlow's batch term (m·fl(R/(R−1)))·var against PyTorch's m·fl(var·fl(R/(R−1))): they round apart."""
    x, _, (g, b, rm, rv) = _inputs(2, (7, 6, 3, 1))
    tf_rv = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.37, policy="fp32:unbiased_by=momentum_factor")
    pt_rv = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.37, policy="fp32")
    assert not np.array_equal(tf_rv.running_var, pt_rv.running_var)
    r = 21
    want = f32(1 - f32(0.37)) * rv + (f32(0.37) * (f32(r) / f32(r - 1))) * tf_rv.var.astype(f32)
    assert np.array_equal(tf_rv.running_var, want)


@pytest.mark.parametrize("shape", SHAPES)
def test_tf_eigen_backward_replays_tensorflow_s_gradient(shape):
    x, dy, (g, _, _, _) = _inputs(3 * sum(shape), shape)
    x16, dy16 = x.astype(np.float16), dy.astype(np.float16)
    mean, var, *_ = _replay_onednn_forward(_nhwc(x16.astype(f32)), g, g, g, g, 1e-3, 0.1, 2, False)
    res = backward(dy16, x16, g, mean, np.ones_like(mean), saved_var=var, eps=1e-3,
                   policy="fp16:backward_formula=tf_eigen,packet_lanes=8")
    dx, dg, db = _replay_tf_eigen_backward(_nhwc(x16.astype(f32)), _nhwc(dy16.astype(f32)), mean, var, g, 1e-3, 8)
    assert np.array_equal(_nhwc(res.dx), dx.astype(np.float16))
    assert np.array_equal(res.dgamma, dg) and np.array_equal(res.dbeta, db)


@pytest.mark.parametrize("shape", SHAPES + [(2, 19, 2, 3), (1, 17, 3, 4)])
def test_keras_forward_replays_its_ops(shape):
    x, _, (g, b, rm, rv) = _inputs(5 * sum(shape), shape)
    res = forward_train(x.astype(np.float64), g, b, rm, rv, momentum=0.1, eps=1e-3, policy=KERAS.format(fmt="fp32"))
    y, nrm, nrv = _replay_keras_forward(_nhwc(x), g, b, rm, rv, 1e-3, 0.1)
    assert np.array_equal(_nhwc(res.y), y)
    assert np.array_equal(res.running_mean, nrm) and np.array_equal(res.running_var, nrv)


@pytest.mark.parametrize("shape", SHAPES + [(2, 19, 2, 3), (1, 17, 3, 4)])
def test_keras_backward_replays_tensorflow_s_gradient_graph(shape):
    x, dy, (g, b, _, _) = _inputs(13 * sum(shape), shape)
    fwd = forward_train(x.astype(np.float64), g, b, eps=1e-3, policy=KERAS.format(fmt="fp32"))
    res = backward(dy.astype(np.float64), x.astype(np.float64), g, fwd.mean, fwd.invstd, eps=1e-3,
                   policy=KERAS.format(fmt="fp32") + ",backward_formula=keras_tf")
    dx, dg, db = _replay_keras_backward(_nhwc(x), _nhwc(dy), g, 1e-3)
    assert np.array_equal(_nhwc(res.dx), dx) and np.array_equal(res.dgamma, dg) and np.array_equal(res.dbeta, db)


def test_eigen_parallel_for_by_hand():
    """Eigen's cost model worked by hand: 2 blocks of 1330 values (a probe's) cost 2·1330·(4·11/64 + 1) = 4489
    cycles, under the 100000 a thread costs: one range.  2 blocks of 786432 (R = 65536, C = 24) cost 1.08e6 each:
    2 threads, tasks of 40000 cycles make blocks of 1: two ranges.  3 blocks on 2 threads at 100000 each: 2 threads,
    blocks of max(⌈3/8⌉, 0) = 1 leave a thread idle a third of the time (3 / 4 busy), so they grow to 2 (2 / 2).
    4 blocks at 50000: (200000 − 100000)/100000 + 0.9 < 2 threads: one range."""
    small = 1330 * (4 * 11 / 64 + 1)
    big = 786432 * (4 * 11 / 64 + 1)
    assert eigen_parallel_blocks(2, small, 2) == [(0, 2)]
    assert eigen_parallel_blocks(2, big, 2) == [(0, 1), (1, 2)]
    assert eigen_parallel_blocks(2, big, 1) == [(0, 2)]
    assert eigen_parallel_blocks(3, 100000.0, 2) == [(0, 2), (2, 3)]
    assert eigen_parallel_blocks(4, 50000.0, 2) == [(0, 4)]


def test_outer_dims_sum_splits_rows_only_where_eigen_would():
    rng = np.random.default_rng(6)
    a = (rng.standard_normal((24, 65536)) * 10.0 ** rng.integers(-3, 4, (24, 65536))).astype(f32)
    split = outer_dims_sum(a.astype(np.float64), Arith("fp32"), channels=24, threads=2, item_bytes=4)
    half = 32768
    want = np.cumsum(a[:, :half], axis=1, dtype=f32)[:, -1] + np.cumsum(a[:, half:], axis=1, dtype=f32)[:, -1]
    assert np.array_equal(split, want)
    seq = np.cumsum(a, axis=1, dtype=f32)[:, -1]
    assert not np.array_equal(split, seq)
    # 40 channels on 2 threads: the threads split the channels, each channel's rows in order
    wide = outer_dims_sum(a[:, :3000].astype(np.float64), Arith("fp32"), channels=40, threads=2, item_bytes=4)
    assert np.array_equal(wide, np.cumsum(a[:, :3000], axis=1, dtype=f32)[:, -1])


def test_packet_lanes_changes_only_the_channels_past_the_last_packet():
    x, _, (g, b, _, _) = _inputs(9, (4, 19, 5, 7))
    eight = forward_train(x.astype(np.float64), g, b, eps=1e-3, policy=KERAS.format(fmt="fp32"))
    all_lanes = forward_train(x.astype(np.float64), g, b, eps=1e-3,
                              policy=KERAS.format(fmt="fp32").replace("packet_lanes=8", "packet_lanes=0"))
    same = np.array_equal(eight.invstd[:16], all_lanes.invstd[:16])
    assert same and not np.array_equal(eight.invstd[16:], all_lanes.invstd[16:])


def test_policy_refuses_what_the_loops_cannot_do():
    with pytest.raises(BNProbeError, match="thread_split"):
        get_policy("fp32:thread_split=samples")  # (no threads)
    with pytest.raises(BNProbeError, match="path_channels"):
        get_policy("fp32:path_channels=5000")
    pol = get_policy(ONEDNN.format(fmt="fp32", t=2, path=4))
    assert pol.for_channels(6) is pol
    jit = pol.for_channels(12)
    assert (jit.variance_fma, jit.y_formula, jit.fma, jit.backward_formula, jit.thread_split) == \
        (True, "xhat", True, "onednn_jit", "samples_spatial")
    eigen = get_policy("fp16:order=sequential,threads=2,path_channels=16,backward_formula=tf_eigen").for_channels(32)
    assert eigen.backward_formula == "tf_eigen" and eigen.variance_fma

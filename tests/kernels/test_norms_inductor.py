"""torch.compile's LayerNorm, RMSNorm and GroupNorm (TorchInductor's CPU C++) under bnprobe's family policies, against a
plain numpy float32 replay written from the generated code (TORCH_LOGS=output_code, torch 2.13): AVX-512 vectors of
16 floats (two for a 16-bit input widened), a row's last partial vector masked into the first lanes, the lanes
folded halves first, every operation rounded once (no contraction), the statistics saved in the input's format;
a reduction of fewer than 8 values into more than one output unrolled into one expression from its first value.
The replay imports nothing from bnprobe's numerics."""

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.norms import backward, forward
from bnprobe.numerics.rounding import round_to

F32 = np.float32
EPS = 1e-5
RECIPES = {"fp32": "fp32:variance=inductor,order=inductor,lanes=16,rsqrt=sqrt_div,backward_formula=inductor",
           "fp16": "fp16:variance=inductor,order=inductor,lanes=16,unroll=2,rsqrt=sqrt_div,backward_formula=inductor,"
                   "saved_format=fp16"}
WIDTH = {"fp32": 16, "fp16": 32}


def _vsum(v: np.ndarray, width: int) -> F32:
    """tmp_acc0_vec += each whole vector; sum_masked_reduce adds the last partial one into the first lanes;
    vec_reduce_all folds the halves; tmp_acc0 = 0 + that."""
    acc = np.zeros(width, dtype=F32)
    for k in range(0, v.size, width):
        part = v[k:k + width]
        acc[: part.size] = acc[: part.size] + part
    while acc.size > 1:
        acc = acc[: acc.size // 2] + acc[acc.size // 2:]
    return F32(0) + acc[0]


def _replay_layer(x, w, b, dy, fmt):
    """y, mean, rstd (saved), dx, dγ, dβ of the generated LayerNorm kernels (rows of 8 values or more)."""
    rows, r = x.shape
    width = WIDTH[fmt]
    xs, dys = x.astype(F32), dy.astype(F32)
    mean = np.array([_vsum(row, width) / F32(r) for row in xs], dtype=F32)
    sq = np.array([_vsum((row - m) * (row - m), width) for row, m in zip(xs, mean)], dtype=F32)
    rstd = F32(1) / np.sqrt(sq / F32(r) + F32(EPS))
    y = ((xs - mean[:, None]) * rstd[:, None]) * w + b
    saved_mean, saved_rstd = round_to(mean, fmt).astype(F32), round_to(rstd, fmt).astype(F32)
    # the backward reads the statistics as saved
    gxh = dys * w
    xhat = (xs - saved_mean[:, None]) * saved_rstd[:, None]
    sg = np.array([_vsum(row, width) for row in gxh], dtype=F32)
    sgx = np.array([_vsum(row, width) for row in gxh * xhat], dtype=F32)
    inner = (gxh * F32(r) - sg[:, None]) - xhat * sgx[:, None]
    dx = (saved_rstd / F32(r))[:, None] * inner
    dg, db = np.zeros(r, dtype=F32), np.zeros(r, dtype=F32)
    for i in range(rows):  # (the columns' vectors from zero, the rows in order)
        dg, db = dg + dys[i] * xhat[i], db + dys[i]
    return y, saved_mean, saved_rstd, dx, dg, db


def _usum(v: np.ndarray) -> F32:
    """A reduction of fewer than 8 values into more than one output: one unrolled expression, from the first value."""
    s = F32(v[0])
    for t in v[1:]:
        s = s + t
    return s


def _width(fmt: str, r: int) -> int:
    """A row's vector: two float vectors for a 16-bit load, one in rows shorter than that."""
    return 16 if fmt == "fp32" or r < 32 else 32


def _rsum(v: np.ndarray, fmt: str) -> F32:
    return _usum(v) if v.size < 8 else _vsum(v, _width(fmt, v.size))


def _replay_group(x, w, b, dy, fmt, groups, in_order=None):
    """y, mean, rstd (saved), dx, dγ, dβ of the generated GroupNorm kernels (x of shape (N, C, H·W), more than one
    (sample, group); H·W of 8 or more, or of 4 or fewer, whose planes' sums the kernel summing over the channels
    recomputes: each group's channels then in order from +0; ``in_order`` says otherwise)."""
    n, c, hw = x.shape
    d = c // groups
    r = d * hw
    xs, dys = x.astype(F32), dy.astype(F32)
    rows = xs.reshape(n * groups, r)
    mean = np.array([_rsum(row, fmt) / F32(r) for row in rows], dtype=F32)
    sq = np.array([_rsum((row - m) * (row - m), fmt) for row, m in zip(rows, mean)], dtype=F32)
    rstd = F32(1) / np.sqrt(sq / F32(r) + F32(EPS))
    scale = np.repeat(rstd.reshape(n, groups), d, axis=1) * w  # (N, C)
    shift = -np.repeat(mean.reshape(n, groups), d, axis=1) * scale + b
    y = xs * scale[:, :, None] + shift[:, :, None]
    sm, sr = round_to(mean, fmt).astype(F32), round_to(rstd, fmt).astype(F32)
    mc, rc = np.repeat(sm.reshape(n, groups), d, axis=1), np.repeat(sr.reshape(n, groups), d, axis=1)
    ds = np.array([[_rsum(dys[i, j] * xs[i, j], fmt) for j in range(c)] for i in range(n)], dtype=F32)
    db = np.array([[_rsum(dys[i, j], fmt) for j in range(c)] for i in range(n)], dtype=F32)

    def over_channels(v):
        if d < 8:
            return _usum(v)
        if (hw <= 4 if in_order is None else in_order):  # (each group's channels in order from +0)
            s = F32(0)
            for t in v:
                s = s + t
            return s
        return _vsum(v, 16)

    ds_g = np.array([over_channels(ds[i, k * d:(k + 1) * d] * w[k * d:(k + 1) * d])
                     for i in range(n) for k in range(groups)], dtype=F32)
    db_g = np.array([over_channels(db[i, k * d:(k + 1) * d] * w[k * d:(k + 1) * d])
                     for i in range(n) for k in range(groups)], dtype=F32)
    s = F32(1.0 / r)
    c2 = ((((db_g * sm - ds_g) * sr) * sr) * sr) * s
    c3 = (-c2 * sm) - ((db_g * sr) * s)
    c2c, c3c = np.repeat(c2.reshape(n, groups), d, axis=1), np.repeat(c3.reshape(n, groups), d, axis=1)
    dx = (dys * (rc * w)[:, :, None] + xs * c2c[:, :, None]) + c3c[:, :, None]
    terms = (ds - db * mc) * rc

    def over_samples(v):  # (each channel's column in sample order; from +0 for 8 samples or more)
        return _usum(v) if n < 8 else _usum(np.concatenate([np.zeros((1, c), dtype=F32), v]))

    return y, sm, sr, dx, over_samples(terms), over_samples(db)


def _replay_rms(x, w, dy, fmt):
    """y, rstd, dx, dγ of the generated RMSNorm kernels (the composite's ops, autograd's backward graph)."""
    rows, r = x.shape
    width = WIDTH[fmt]
    xs, dys = x.astype(F32), dy.astype(F32)
    ms = np.array([_vsum(row * row, width) for row in xs], dtype=F32)
    rstd = F32(1) / np.sqrt(ms / F32(r) + F32(EPS))
    y = (xs * rstd[:, None]) * w
    gu = dys * w
    s = np.array([_vsum(row, width) for row in gu * xs], dtype=F32)
    per = ((s * F32(-0.5)) * ((rstd * rstd) * rstd)) / F32(r)
    dx = gu * rstd[:, None] + per[:, None] * (xs * F32(2))
    dg = np.zeros(r, dtype=F32)
    for i in range(rows):
        dg = dg + dys[i] * (xs[i] * rstd[i])
    return y, rstd, dx, dg


def _inputs(fmt, shape, seed=3, mean=50.0):
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal(shape) * 0.5 + mean, fmt)
    dy = round_to(rng.standard_normal(shape) + 0.5, fmt)
    w = rng.uniform(0.3, 3.0, shape[-1]).astype(F32)
    b = rng.normal(0, 1, shape[-1]).astype(F32)
    return x, w, b, dy


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(9, 40), (10, 77)], ids=["9x40", "10x77"])
def test_layer_norm_recipe_is_the_replay_of_the_generated_code(fmt, shape):
    x, w, b, dy = _inputs(fmt, shape)
    sh = NormShape.of("layer", shape)
    f = forward(x, w, b, shape=sh, eps=EPS, policy=RECIPES[fmt] + ",params=fp32")
    g = backward(dy, x, w, f.mean, f.rstd, shape=sh, policy=RECIPES[fmt] + ",params=fp32")
    y, mean, rstd, dx, dg, db = _replay_layer(x, w, b, dy, fmt)
    assert np.array_equal(f.y, round_to(y, fmt)) and np.array_equal(f.mean, mean) and np.array_equal(f.rstd, rstd)
    assert np.array_equal(g.dx, round_to(dx, fmt))
    assert np.array_equal(g.dgamma, dg) and np.array_equal(g.dbeta, db)


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_rms_norm_recipe_is_the_replay_of_the_generated_code(fmt):
    x, w, _, dy = _inputs(fmt, (9, 40), mean=0.5)
    sh = NormShape.of("rms", x.shape)
    pol = RECIPES[fmt].replace("variance=inductor,", "").replace(",saved_format=fp16", "") + ",params=fp32"
    f = forward(x, w, shape=sh, eps=EPS, policy=pol)
    g = backward(dy, x, w, None, f.rstd, shape=sh, policy=pol)
    y, rstd, dx, dg = _replay_rms(x, w, dy, fmt)
    assert np.array_equal(f.y, round_to(y, fmt)) and np.array_equal(f.rstd, rstd)
    assert np.array_equal(g.dx, round_to(dx, fmt)) and np.array_equal(g.dgamma, dg)


def test_the_replay_tells_the_recipe_from_a_neighbour():
    """The case distinguishes: eight lanes (AVX2) or eager torch's backward do not reproduce the replay."""
    x, w, b, dy = _inputs("fp32", (10, 77))
    sh = NormShape.of("layer", x.shape)
    _, _, _, dx, dg, _ = _replay_layer(x, w, b, dy, "fp32")
    f = forward(x, w, b, shape=sh, eps=EPS, policy=RECIPES["fp32"] + ",params=fp32")
    for other in (RECIPES["fp32"].replace("lanes=16", "lanes=8"),
                  RECIPES["fp32"].replace("backward_formula=inductor", "backward_formula=torch")):
        g = backward(dy, x, w, f.mean, f.rstd, shape=sh, policy=other + ",params=fp32")
        assert not (np.array_equal(g.dx, dx) and np.array_equal(g.dgamma, dg))


def _split_welford(v: np.ndarray, width: int, threads: int) -> tuple[F32, F32]:
    """(mean, M2) of one row whose Welford loop inductor parallelises: the vector iterations dealt by OpenMP's static
    schedule, each thread's whole vectors into an accumulator of its own, the masked vector into one of the holding
    thread's; the threads' accumulators merged in thread order, then the lanes, the masked result first."""
    from tests.kernels import inductor_replay as rp

    v = [F32(t) for t in v]
    r = len(v)
    whole = r // width
    main, masked = rp.Welford(width), rp.Welford(width)
    for part in rp.omp_static(whole + (1 if r % width else 0), 2 if threads is None else threads):
        own, helper = rp.Welford(width), rp.Helper(0, width)
        for k in part:
            if k < whole:
                own = rp.update(own, v[k * width:(k + 1) * width], helper)
        main = rp.combine(main, own)
        if whole in part and r % width:
            tail = r - whole * width
            masked = rp.combine(masked, rp.update(rp.Welford(width), v[whole * width:] + [F32(0)] * (width - tail),
                                                  helper, tail))
    out = rp.combine(rp.reduce_all(masked), rp.reduce_all(main))
    return out.mean[0], out.m2[0]


@pytest.mark.parametrize("fmt,threads,r", [("fp32", 2, 1100), ("fp16", 2, 1100), ("fp32", 3, 1600)])
def test_a_single_row_s_welford_split_across_threads_is_the_replay(fmt, threads, r):
    """One row of 1100 or 1600 values: inductor parallelises its Welford loop itself (each thread 512 values or more);
    y is computed from the float statistics (γ = 1, β = 0)."""
    x = _inputs(fmt, (1, r), seed=4)[0]
    sh = NormShape.of("layer", x.shape)
    f = forward(x, shape=sh, eps=EPS, policy=RECIPES[fmt] + f",threads={threads},params=fp32")
    mean, m2 = _split_welford(x[0], _width(fmt, r), threads)
    rstd = F32(1) / np.sqrt(m2 / F32(r) + F32(EPS))
    assert np.array_equal(f.mean, round_to(np.array([mean]), fmt))
    assert np.array_equal(f.rstd, round_to(np.array([rstd]), fmt))
    assert np.array_equal(f.y, round_to((x.astype(F32) - mean) * rstd, fmt))
    one = forward(x, shape=sh, eps=EPS, policy=RECIPES[fmt] + ",params=fp32")
    assert not np.array_equal(one.y, f.y)  # (the split shows)


def test_a_split_welford_row_past_its_chunk_is_refused_not_guessed():
    """More than 4096 vectors a thread: the generated code's threads share one chunk stack (a race)."""
    sh = NormShape.of("layer", (1, 140000))
    with pytest.raises(BNProbeError, match="does not emulate"):
        forward(np.ones((1, 140000)), shape=sh, policy=RECIPES["fp32"] + ",threads=2")


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("shape,groups", [((3, 6, 13), 2), ((9, 32, 50), 4), ((2, 40, 3), 2)],
                         ids=["3x6x13-g2", "9x32x50-g4", "2x40x3-g2"])
def test_group_norm_recipe_is_the_replay_of_the_generated_code(fmt, shape, groups):
    """Short and long planes, groups of 3, 8 and 20 channels, fewer and more than 8 samples."""
    rng = np.random.default_rng(5)
    x = round_to(rng.standard_normal(shape) * 0.5 + 50.0, fmt)
    dy = round_to(rng.standard_normal(shape) + 0.5, fmt)
    w = rng.uniform(0.3, 3.0, shape[1]).astype(F32)
    b = rng.normal(0, 1, shape[1]).astype(F32)
    sh = NormShape.of("group", shape, groups=groups)
    pol = RECIPES[fmt] + ",y_formula=affine,params=fp32"
    f = forward(x, w, b, shape=sh, eps=EPS, policy=pol)
    g = backward(dy, x, w, f.mean, f.rstd, shape=sh, policy=pol)
    y, mean, rstd, dx, dg, db = _replay_group(x, w, b, dy, fmt, groups)
    assert np.array_equal(f.y, round_to(y, fmt)) and np.array_equal(f.mean, mean) and np.array_equal(f.rstd, rstd)
    assert np.array_equal(g.dx, round_to(dx, fmt))
    assert np.array_equal(g.dgamma, dg) and np.array_equal(g.dbeta, db)


def test_the_group_replay_tells_the_recipe_from_a_neighbour():
    """Eager torch's GroupNorm backward, or the channels' sums vectorised where the kernel sums them in order, do
    not reproduce the replay."""
    shape = (2, 40, 3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(F32) * F32(0.5) + F32(50)
    dy = rng.standard_normal(shape).astype(F32)
    w = rng.uniform(0.3, 3.0, 40).astype(F32)
    sh = NormShape.of("group", shape, groups=2)
    pol = RECIPES["fp32"] + ",y_formula=affine,params=fp32"
    f = forward(x, w, None, shape=sh, eps=EPS, policy=pol)
    dx = _replay_group(x, w, np.zeros(40, dtype=F32), dy, "fp32", 2)[3]
    assert np.array_equal(backward(dy, x, w, f.mean, f.rstd, shape=sh, policy=pol).dx, dx)
    other = backward(dy, x, w, f.mean, f.rstd, shape=sh, policy=pol.replace("backward_formula=inductor",
                                                                              "backward_formula=torch"))
    assert not np.array_equal(other.dx, dx)
    assert not np.array_equal(_replay_group(x, w, np.zeros(40, dtype=F32), dy, "fp32", 2, in_order=False)[3], dx)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_reduction_into_one_value_is_never_unrolled(rows):
    """RMSNorm on rows of 5 values: one row's sums are a masked vector from +0 (inductor unrolls a short reduction
    only into more than one output), several rows' sums one expression each."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, 5)).astype(F32) * F32(3)
    w = rng.uniform(0.3, 3.0, 5).astype(F32)
    sh = NormShape.of("rms", x.shape)
    pol = RECIPES["fp32"].replace("variance=inductor,", "") + ",params=fp32"
    f = forward(x, w, shape=sh, eps=EPS, policy=pol)
    rstd = {}
    for name, total in (("vector", lambda v: _vsum(v, 16)), ("unrolled", _usum)):
        ms = np.array([total(row * row) for row in x], dtype=F32)
        rstd[name] = F32(1) / np.sqrt(ms / F32(5) + F32(EPS))
    assert not np.array_equal(rstd["vector"], rstd["unrolled"])  # (the input tells the two apart)
    assert np.array_equal(f.rstd, rstd["vector" if rows == 1 else "unrolled"])



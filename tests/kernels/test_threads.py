"""PyTorch CPU's channels-last BatchNorm: its sums split across threads (``threads``), the fused multiply-adds of the
threads' sums of squares (``variance_fma``) and of dx (``dx_fma``) — against an independent oracle, scalar Python loops
of aten's batch_norm_kernel.cpp (per-thread float buffers over contiguous blocks of ⌈R/T⌉ rows, added in thread order
in double for fp32 and in float for 16-bit; the fp32 kernel's own loops when R ≤ T) with every fused multiply-add
computed exactly in rationals and rounded once, written here without bnprobe; and against torch's own kernel, at one
thread and at two, on NHWC tensors, on (N, C) input (BatchNorm1d: the same kernel) and with R ≤ T."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels import Execution, backward, forward_train, get_policy

f32 = np.float32
EPS = 1e-5
# the channels-last recipes of torch 2.13's CPU kernels on an x86 wheel, as identify finds them (checked against
# torch below): vectors of 8 floats (lanes x unroll channels: where dx's vector body ends and its scalar tail begins)
COMMON = "y_formula=affine,fma=true,rstd_format=fp64,backward_formula=torch,unbiased_by=divide,variance_fma=true," \
         "backward_fma=all"
RECIPES = {
    "fp32": f"fp32:order=sequential,sum_format=fp64,running_var_sum=fp64,rsqrt=sqrt_div,{COMMON},lanes=8,dx_fma=body",
    "fp16": f"fp16:order=sequential,rsqrt=sqrt_div,{COMMON}",
    "bf16": f"bf16:order=sequential,{COMMON},lanes=8,unroll=2,dx_fma=tail",
}
WIDTH = {"fp32": 8, "fp16": 16, "bf16": 16}  # channels per vector (fp32: 8 floats; 16-bit: 16 values, 2 x 8 floats)


def recipe(fmt: str, threads: int):
    return get_policy(f"{RECIPES[fmt]},threads={threads}")


# ---- the oracle: aten's loops, one value at a time ----------------------------------------------------------------

def round32(q: Fraction) -> f32:
    """The float32 nearest to the rational q (ties to even)."""
    c = f32(float(q))
    cands = (np.nextafter(c, f32(-np.inf)), c, np.nextafter(c, f32(np.inf)))
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - q), int(np.array(v).view(np.uint32)) & 1))


def fma32(a: f32, b: f32, c: f32) -> f32:
    return round32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def narrow(v: f32, fmt: str) -> f32:
    """A float rounded to the tensor's format (the kernels' convert_from_float)."""
    if fmt == "fp32":
        return f32(v)
    return f32({"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt](f32(v)))


def blocks(r: int, t: int) -> list[range]:
    """at::parallel_for(0, R, 1) on OpenMP: min(T, R) threads of ceil(R / T') rows; threads past the end idle."""
    used = min(t, r)
    k = -(-r // used)
    return [range(min(i * k, r), min((i + 1) * k, r)) for i in range(t)]


def stats(rows: np.ndarray, t: int, fmt: str) -> tuple[list[f32], list[f32]]:
    """mean and var_sum per channel of (R, C) float32 rows, as batch_norm_cpu_collect_stats_channels_last_impl
    (fp32) and ..._channels_last_internal (16-bit, float parameters) compute them at T threads."""
    r, c = rows.shape
    wide = fmt == "fp32"
    if wide and r <= t:  # the fp32 kernel's own loops: per channel in double (16 < C <= 2048), else one thread
        if t > 1 and 16 < c <= 2048:
            means = [f32(sum((float(v) for v in rows[:, j]), 0.0) / r) for j in range(c)]
            var = []
            for j in range(c):
                q = 0.0
                for v in rows[:, j]:
                    d = f32(v - means[j])
                    q += float(f32(d * d))
                var.append(f32(q))
            return means, var
        t = 1
    means, var = [], []
    for j in range(c):
        parts = []
        for b in blocks(r, t):
            s = f32(0)
            for i in b:
                s = f32(s + rows[i, j])
            parts.append(s)
        total = sum((float(p) for p in parts), 0.0) if wide else _fsum(parts)
        means.append(f32(total / r) if wide else f32(f32(total) / f32(r)))
    for j in range(c):
        parts = []
        for b in blocks(r, t):
            s = f32(0)
            for i in b:
                d = f32(rows[i, j] - means[j])
                s = fma32(d, d, s)
            parts.append(s)
        var.append(f32(sum((float(p) for p in parts), 0.0)) if wide else _fsum(parts))
    return means, var


def _fsum(parts: list[f32]) -> f32:
    s = f32(0)
    for p in parts:
        s = f32(s + p)
    return s


def invstd_of(var_sum: f32, r: int) -> f32:
    """batch_norm_cpu_update_stats_template: InvStd(var_sum / n) with a double eps."""
    return f32(1.0 / np.sqrt(float(f32(var_sum / f32(r))) + EPS))


def grads(rows: np.ndarray, dys: np.ndarray, mean, invstd, w, t: int, fmt: str) -> tuple[np.ndarray, list, list]:
    """dx, dγ, dβ as batch_norm_cpu_backward_channels_last_impl / ..._internal compute them: per-thread Σdy and
    Σ(x − mean)·dy (fused), added in double (fp32) or float, stored as float; k = ((Σ·invstd)·invstd)/R;
    dx = ((dy − Σdy/R) − (x − mean)·k)·invstd·w with the subtraction fused in fp32's vector body, in the 16-bit
    kernels' scalar tail (bf16) or everywhere (fp16) — as measured."""
    r, c = rows.shape
    wide = fmt == "fp32"
    body_end = c - c % WIDTH[fmt]
    dx = np.zeros((r, c), dtype=f32)
    dg, db = [], []
    for j in range(c):
        m, inv, wj = f32(mean[j]), f32(invstd[j]), f32(w[j])
        sums, dots = [], []
        for b in blocks(r, t):
            s, p = f32(0), f32(0)
            for i in b:
                s = f32(s + dys[i, j])
                p = fma32(f32(rows[i, j] - m), f32(dys[i, j]), p)
            sums.append(s)
            dots.append(p)
        s = f32(sum((float(v) for v in sums), 0.0)) if wide else _fsum(sums)
        p = f32(sum((float(v) for v in dots), 0.0)) if wide else _fsum(dots)
        k = f32(f32(f32(p * inv) * inv) / f32(r))
        gm = f32(s / f32(r))
        fused = {"fp32": j < body_end, "bf16": j >= body_end, "fp16": True}[fmt]
        for i in range(r):
            d = f32(rows[i, j] - m)
            e = f32(dys[i, j] - gm)
            e = fma32(-d, k, e) if fused else f32(e - f32(d * k))
            dx[i, j] = narrow(f32(f32(e * inv) * wj), fmt)
        dg.append(f32(p * inv))
        db.append(s)
    return dx, dg, db


# ---- bnprobe against the oracle -----------------------------------------------------------------------------------

def _inputs(shape: tuple[int, ...], fmt: str, seed: int) -> tuple[np.ndarray, ...]:
    """x and dy in channels-last layout (N, ..., C), values of ``fmt``; γ."""
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape) + rng.normal(0, 30, c)
    dy = rng.standard_normal(shape) + rng.normal(0, 1, c)
    dt = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    return x.astype(dt).astype(np.float64), dy.astype(dt).astype(np.float64), rng.uniform(0.5, 2, c).astype(f32)


SHAPES = [(3, 5, 3, 21), (4, 2, 3, 7), (9, 20), (2, 20), (2, 4), (3, 1, 1, 33)]  # R = 45, 24, 9, 2, 2, 3


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_threads_replays_aten_s_loops(fmt, threads, shape):
    x, dy, g = _inputs(shape, fmt, seed=threads * 100 + len(shape))
    pol = recipe(fmt, threads)
    ex = Execution(layout="channels_last", keep_arrays=False)
    out = forward_train(x, g, None, policy=pol, execution=ex)
    c = shape[-1]
    rows, dys = x.reshape(-1, c).astype(f32), dy.reshape(-1, c).astype(f32)
    mean, var_sum = stats(rows, threads, fmt)
    r = rows.shape[0]
    assert [f32(v) for v in out.mean] == mean
    assert [f32(v) for v in out.invstd] == [invstd_of(v, r) for v in var_sum]
    b = backward(dy, x, g, out.mean, out.invstd, policy=pol, execution=ex)
    dx, dg, db = grads(rows, dys, out.mean, out.invstd, g, threads, fmt)
    assert np.array_equal(np.asarray(b.dx, dtype=f32).reshape(-1, c), dx)
    assert [f32(v) for v in b.dgamma] == dg and [f32(v) for v in b.dbeta] == db


def test_the_thread_count_the_fused_sums_and_dx_s_fusion_each_change_bits():
    """Guards: on these inputs the oracle's own answer moves with each choice, so the replays above can fail."""
    x, dy, g = _inputs((6, 4, 5, 20), "fp32", seed=3)
    rows = x.reshape(-1, 20).astype(f32)
    assert stats(rows, 1, "fp32")[0] != stats(rows, 2, "fp32")[0]
    ex = Execution(layout="channels_last", keep_arrays=False)
    pol = recipe("fp32", 2)
    plain = pol.with_options(variance_fma=False)
    assert not np.array_equal(forward_train(x, policy=pol, execution=ex).invstd,
                              forward_train(x, policy=plain, execution=ex).invstd)
    x2, dy2, g2 = _inputs((2, 20), "fp32", seed=4)
    f = forward_train(x2, g2, None, policy=pol, execution=ex)
    dxs = {how: backward(dy2, x2, g2, f.mean, f.invstd, policy=pol.with_options(dx_fma=how), execution=ex).dx
           for how in ("all", "body", "tail", "none")}
    assert len({a.tobytes() for a in dxs.values()}) == 4


def test_threads_and_its_companions_are_refused_where_they_do_not_apply():
    for spec, field in (("fp32:threads=2", "threads"), ("fp32:order=sequential,threads=0", "threads"),
                        ("fp32:order=sequential,threads=2,variance=welford", "threads"),
                        ("fp32:order=sequential,variance_fma=true", "variance_fma"),
                        ("fp32:order=sequential,dx_fma=tail", "dx_fma"),
                        ("fp32:order=sequential,threads=2,backward_fma=body", "backward_fma")):
        with pytest.raises(BNProbeError, match=field):
            get_policy(spec)
    assert get_policy("fp16:order=sequential,threads=2,variance_fma=true").golden().variance_fma is False


# ---- bnprobe against torch ----------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


@pytest.fixture
def torch_threads():
    """torch.set_num_threads for the test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


TORCH_SHAPES = [(3, 40, 3, 5), (4, 7, 5, 3), (5, 20), (2, 20), (2, 4), (2, 17, 1, 1), (6, 33, 2, 2), (3, 23)]


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_torch_eager_channels_last_is_reproduced_bit_for_bit(fmt, threads, torch_threads):
    """torch's CPU kernel on NHWC tensors, on (N, C) and (N, C, 1, 1) input (its channels-last kernel too) and with
    R ≤ T: saved mean and invstd, y, both running statistics, dx, dγ and dβ, at 1 and 2 threads."""
    torch_threads(threads)
    from bnprobe.core.formats import get_format

    td = get_format(fmt).torch_dtype
    pol = recipe(fmt, threads)
    for k, shape in enumerate(TORCH_SHAPES):
        rng = np.random.default_rng([threads, k])
        c = shape[1]
        x = rng.standard_normal(shape) * rng.choice([1e-2, 1.0, 30.0]) + rng.normal(0, 50, c).reshape(
            (1, c) + (1,) * (len(shape) - 2))
        dy = rng.standard_normal(shape) + 0.5
        g, b = rng.uniform(0.5, 2, c).astype(f32), rng.normal(0, 1, c).astype(f32)
        rm, rv = rng.normal(0, 1, c).astype(f32), rng.uniform(0.5, 2, c).astype(f32)
        t = torch.from_numpy
        xt, dyt = t(x).to(td), t(dy).to(td)
        if len(shape) == 4:
            xt, dyt = (a.contiguous(memory_format=torch.channels_last) for a in (xt, dyt))
        trm, trv = t(rm.copy()), t(rv.copy())
        y, sm, si = torch.ops.aten.native_batch_norm(xt, t(g), t(b), trm, trv, True, 0.1, EPS)
        dx, dg, db = torch.ops.aten.native_batch_norm_backward(dyt, xt, t(g), None, None, sm, si, True, EPS,
                                                               [True] * 3)

        def last(a):  # (N, C, ...) -> (N, ..., C), as bnprobe's channels-last layout takes it
            return np.moveaxis(a.double().numpy(), 1, -1)

        ex = Execution(layout="channels_last", keep_arrays=False)
        mine = forward_train(last(xt), g, b, rm, rv, momentum=0.1, policy=pol, execution=ex)
        back = backward(last(dyt), last(xt), g, sm.numpy(), si.numpy(), policy=pol, execution=ex)
        for name, a, want in (("mean", mine.mean, sm.numpy()), ("invstd", mine.invstd, si.numpy()),
                              ("y", mine.y, last(y)), ("running_mean", mine.running_mean, trm.numpy()),
                              ("running_var", mine.running_var, trv.numpy()), ("dx", back.dx, last(dx)),
                              ("dgamma", back.dgamma, dg.numpy()), ("dbeta", back.dbeta, db.numpy())):
            got = np.asarray(a, dtype=np.float64)
            assert np.array_equal(got, np.asarray(want, dtype=np.float64)), (shape, name)

"""The row-by-row orders of the frameworks' CPU kernels — Eigen's dense sum (``eigen``: Paddle) and GCC's omp-simd
reduction (``omp_simd``: oneDNN's ncsp BatchNorm in MindSpore) — against scalar loops written here from the sources'
loops (every addition rounded by numpy's float32 scalar arithmetic), and against FPRev pair sums measured on
MindSpore 2.10's kernel."""

import numpy as np
import pytest

from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import Rows, reduce_sum

f32 = np.float32


def loop_eigen_row(v: np.ndarray, lanes: int, start: int) -> f32:
    """Eigen's redux_impl<…, LinearVectorizedTraversal, NoUnrolling>::run on one row, packets from ``start``."""
    n = len(v)
    start = min(start, n)
    size2 = (n - start) // (2 * lanes) * (2 * lanes)
    size1 = (n - start) // lanes * lanes
    if size1 == 0:
        res = f32(v[0])
        for i in range(1, n):
            res = f32(res + f32(v[i]))
        return res
    p0 = [f32(v[start + k]) for k in range(lanes)]
    if size1 > lanes:
        p1 = [f32(v[start + lanes + k]) for k in range(lanes)]
        for i in range(start + 2 * lanes, start + size2, 2 * lanes):
            p0 = [f32(p0[k] + f32(v[i + k])) for k in range(lanes)]
            p1 = [f32(p1[k] + f32(v[i + lanes + k])) for k in range(lanes)]
        p0 = [f32(a + b) for a, b in zip(p0, p1)]
        if size1 > size2:
            p0 = [f32(p0[k] + f32(v[start + size2 + k])) for k in range(lanes)]
    while len(p0) > 1:  # predux: the upper half onto the lower
        h = len(p0) // 2
        p0 = [f32(p0[k] + p0[k + h]) for k in range(h)]
    res = p0[0]
    for i in range(start):
        res = f32(res + f32(v[i]))
    for i in range(start + size1, n):
        res = f32(res + f32(v[i]))
    return res


def loop_eigen(x: np.ndarray, lanes: int, aligned: bool) -> list[float]:
    """Paddle's NCHW mean loop on an (N, C, HW) buffer aligned to a packet: saved_mean(c) += x.col(n·C + c).sum()."""
    n_, c_, hw = x.shape
    out = []
    for c in range(c_):
        s = f32(0)
        for n in range(n_):
            start = (-((n * c_ + c) * hw)) % lanes if aligned else 0
            s = f32(s + loop_eigen_row(x[n, c], lanes, start))
        out.append(float(s))
    return out


def loop_omp_simd(x: np.ndarray, lanes: int) -> list[float]:
    """oneDNN's `for n: #pragma omp simd reduction(+: sum) for sp: sum += src[sp]` as GCC lowers it: per row,
    ``lanes`` private sums, the remainder into lane 0, then sum += lane 0, lane 1, ..."""
    n_, c_, hw = x.shape
    out = []
    for c in range(c_):
        s = f32(0)
        for n in range(n_):
            lane = [f32(0)] * lanes
            whole = hw // lanes * lanes
            for p in range(whole):
                lane[p % lanes] = f32(lane[p % lanes] + f32(x[n, c, p]))
            for p in range(whole, hw):
                lane[0] = f32(lane[0] + f32(x[n, c, p]))
            for v in lane:
                s = f32(s + v)
        out.append(float(s))
    return out


def _spread(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * 2.0 ** rng.uniform(-12, 12, shape)).astype(f32)


def _cr(x: np.ndarray) -> np.ndarray:
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


SHAPES = [(3, 5, 77), (4, 6, 64), (2, 19, 37), (2, 3, 5), (3, 4, 3), (5, 3, 42)]


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_eigen_order_matches_the_redux_loop(shape: tuple[int, int, int], lanes: int) -> None:
    x = _spread(shape, 1)
    acc = Arith("fp32")
    got = reduce_sum(_cr(x), acc, order="eigen", lanes=lanes, row=Rows(shape[2], shape[1]))
    assert got.tolist() == loop_eigen(x, lanes, aligned=True)
    # an expression's sum (no place): packets from each row's first value
    got = reduce_sum(_cr(x), acc, order="eigen", lanes=lanes, row=shape[2])
    assert got.tolist() == loop_eigen(x, lanes, aligned=False)


def test_eigen_order_of_a_block_of_channels_keeps_their_addresses() -> None:
    x = _spread((3, 7, 13), 2)
    want = loop_eigen(x, 8, aligned=True)
    got = reduce_sum(_cr(x)[3:], Arith("fp32"), order="eigen", lanes=8, row=Rows(13, 7, first=3))
    assert got.tolist() == want[3:]


def test_eigen_alignment_shows_where_rows_are_not_whole_packets() -> None:
    """(the guard: on these values the aligned head and the row-start packets give different sums)"""
    x = _spread((3, 5, 77), 1)
    assert loop_eigen(x, 8, aligned=True) != loop_eigen(x, 8, aligned=False)


@pytest.mark.parametrize("lanes", [1, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_omp_simd_order_matches_the_lowered_loop(shape: tuple[int, int, int], lanes: int) -> None:
    x = _spread(shape, 3)
    got = reduce_sum(_cr(x), Arith("fp32"), order="omp_simd", lanes=lanes, row=shape[2])
    assert got.tolist() == loop_omp_simd(x, lanes)


def test_the_row_orders_differ_from_each_other_and_from_a_plain_sequence() -> None:
    x = _spread((3, 5, 77), 4)
    acc = Arith("fp32")
    sums = {o: tuple(reduce_sum(_cr(x), acc, order=o, lanes=8, row=77).tolist()) for o in ("eigen", "omp_simd")}
    sums["sequential"] = tuple(reduce_sum(_cr(x), acc, order="sequential").tolist())
    assert len(set(sums.values())) == 3


# FPRev (Xie et al., ATC 2025) on MindSpore 2.10's CPU BatchNorm (oneDNN v3.10 ncsp_bnorm, 2 threads): one channel
# of N = 1, H·W values of 1 with +2^30 at position 0 and -2^30 at position j; the saved mean times H·W is the count of
# ones the pair did not absorb, for j = 1, 2, ...
FPREV_MINDSPORE = {
    64: [32, 16, 0, 62, 32, 16, 0, 61, 32, 16, 0, 60, 32, 16, 0, 59, 32, 16, 0, 58, 32, 16, 0, 57, 32, 16, 0, 56, 32,
         16, 0, 55, 32, 16, 0, 54, 32, 16, 0, 53, 32, 16, 0, 52, 32, 16, 0, 51, 32, 16, 0, 50, 32, 16, 0, 49, 32, 16,
         0, 48, 32, 16, 0],
    37: [18, 9, 0, 35, 18, 9, 0, 34, 18, 9, 0, 33, 18, 9, 0, 32, 18, 9, 0, 31, 18, 9, 0, 30, 18, 9, 0, 29, 18, 9, 0,
         28, 18, 9, 0, 27],
}


@pytest.mark.parametrize("hw", sorted(FPREV_MINDSPORE))
def test_omp_simd_order_gives_the_pair_sums_measured_on_mindspore(hw: int) -> None:
    rows = np.ones((hw - 1, hw))
    for j in range(1, hw):
        rows[j - 1, 0], rows[j - 1, j] = 2.0**30, -(2.0**30)
    got = reduce_sum(rows, Arith("fp32"), order="omp_simd", lanes=4, row=hw)
    assert got.astype(int).tolist() == FPREV_MINDSPORE[hw]
    # (the guard: 8 lanes would place the pairs otherwise)
    assert reduce_sum(rows, Arith("fp32"), order="omp_simd", lanes=8, row=hw).astype(int).tolist() != \
        FPREV_MINDSPORE[hw]

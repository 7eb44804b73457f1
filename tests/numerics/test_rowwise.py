"""PyTorch CPU's row kernels (bnprobe.numerics.rowwise) against a plain-Python replay of each source loop — one
float32 scalar at a time, in the loops' own order (chunks, the cascade's stack, lanes, the scalar tail), with fused
multiply-adds rounded once by exact rational arithmetic (tests/oracle.py) — bit for bit, on rows whose lengths
take every branch: shorter than a vector, whole vectors and not, one chunk and many, the cascade several levels
deep.  The replays share nothing with the code under test; torch itself is checked in
tests/kernels/test_norms_torch.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from oracle import round_fraction

from bnprobe.numerics.arith import Arith
from bnprobe.numerics.rowwise import aten_column_sum, aten_sum, half_reduce, lane_sums, rowwise_moments, vec_reduce

f32 = np.float32
ACC = Arith("fp32", counting=False)


def fma(a: float, b: float, c: float) -> np.float32:
    """a·b + c rounded once to fp32."""
    return f32(round_fraction(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)), "fp32"))


def ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


# ---- RowwiseMoments (moments_utils.h, torch 2.13) --------------------------------------------------------------

def replay_rowwise(row: np.ndarray, lanes: int, pack: int, fused_tail: bool) -> tuple[np.float32, np.float32]:
    """RowwiseMomentsImpl as written: Vec lanes as Python lists, every operation on one float32 scalar."""
    n_vals = len(row)
    k_vec = lanes * pack
    n = n_vals // k_vec
    m = -(-n // 16)
    depth = ceil_log2(m)
    c_vecs = [f32(1) / f32(i + 1) for i in range(16)]
    stk = [[0, [f32(0)] * lanes, [f32(0)] * lanes] for _ in range(depth)]

    def add_vec(m0_add: int, m1_add: list, m2_add: list, st: list) -> None:  # AddMomentsVec
        total = st[0] + m0_add
        c = f32(0) if total == 0 else f32(f32(m0_add) / f32(total))
        for lane in range(lanes):
            delta = f32(m1_add[lane] - st[1][lane])
            m2_tmp = f32(st[2][lane] + m2_add[lane])
            c_delta = f32(c * delta)
            m0_delta = f32(delta * f32(st[0]))
            st[1][lane] = f32(st[1][lane] + c_delta)
            st[2][lane] = fma(m0_delta, c_delta, m2_tmp)
        st[0] = total

    for i in range(m):
        m0 = min(16, n - i * 16)
        halves = []
        for h in range(pack):  # a 16-bit vector's two float halves, each its own Welford stream
            m1, m2 = [f32(0)] * lanes, [f32(0)] * lanes
            for j in range(m0):
                base = (i * 16 + j) * k_vec + h * lanes
                for lane in range(lanes):
                    x = f32(row[base + lane])
                    delta = f32(x - m1[lane])
                    m1[lane] = fma(delta, c_vecs[j], m1[lane])
                    m2[lane] = fma(delta, f32(x - m1[lane]), m2[lane])
            halves.append((m1, m2))
        for m1, m2 in halves:
            add_vec(m0, m1, m2, stk[0])
        mask, j = i + 1, 1
        while j < depth and mask & 1 == 0:
            add_vec(stk[j - 1][0], stk[j - 1][1], stk[j - 1][2], stk[j])
            stk[j - 1] = [0, [f32(0)] * lanes, [f32(0)] * lanes]
            mask >>= 1
            j += 1
    for i in range(1, depth):
        add_vec(stk[i][0], stk[i][1], stk[i][2], stk[0])
    m0, m1, m2 = 0, f32(0), f32(0)
    for i in range(n * k_vec, n_vals):
        x = f32(row[i])
        delta = f32(x - m1)
        m0 += 1
        m1 = f32(m1 + f32(delta / f32(m0)))
        m2 = fma(delta, f32(x - m1), m2) if fused_tail else f32(m2 + f32(delta * f32(x - m1)))
    m0_add = n * k_vec // lanes
    for lane in range(lanes):  # AddMoments: GCC fuses m1 += c·δ and the m2 term's last product
        total = m0 + m0_add
        c = f32(0) if total == 0 else f32(f32(m0_add) / f32(total))
        delta = f32(stk[0][1][lane] - m1)
        m1 = fma(c, delta, m1)
        m2 = f32(m2 + fma(f32(f32(delta * delta) * c), f32(m0), stk[0][2][lane]))
        m0 = total
    return m1, m2


LENGTHS = [1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 128, 129, 255, 256, 257, 300, 520, 1031, 2048, 2067]


@pytest.mark.parametrize("pack,fused_tail", [(1, False), (2, False), (2, True)], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("r", LENGTHS)
def test_rowwise_moments_is_the_replay(r: int, pack: int, fused_tail: bool) -> None:
    rng = np.random.default_rng(r * 3 + pack)
    rows = 3 if r < 600 else 1
    x = (rng.standard_normal((rows, r)) * rng.uniform(0.1, 10) + rng.normal(0, 50)).astype(f32)
    if pack == 2:  # a 16-bit input's values
        x = x.astype(np.float16).astype(f32)
    mean, m2 = rowwise_moments(x, ACC, lanes=8, pack=pack, fused_tail=fused_tail)
    for i in range(rows):
        want = replay_rowwise(x[i], 8, pack, fused_tail)
        assert (f32(mean[i]), f32(m2[i])) == want, (r, i)


def test_rowwise_moments_deep_cascade_and_other_lanes() -> None:
    """Enough chunks for a four-level stack (17·16·8 values), and 4 and 16 lanes."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((1, 17 * 16 * 8 + 5)) + 3).astype(f32)
    assert tuple(f32(v[0]) for v in rowwise_moments(x, ACC, lanes=8)) == replay_rowwise(x[0], 8, 1, False)
    for lanes in (4, 16):
        y = x[:, :700]
        got = tuple(f32(v[0]) for v in rowwise_moments(y, ACC, lanes=lanes))
        assert got == replay_rowwise(y[0], lanes, 1, False)


def test_each_rowwise_choice_changes_the_result() -> None:
    """The replay tells lanes, the 16-bit pack and the fused tail apart on these rows (the checks above can fail)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((40, 45)) * 3 + 100).astype(np.float16).astype(f32)
    base = rowwise_moments(x, ACC, lanes=8, pack=2, fused_tail=True)
    for other in ({"lanes": 8, "pack": 2, "fused_tail": False}, {"lanes": 8, "pack": 1, "fused_tail": True},
                  {"lanes": 16, "pack": 1, "fused_tail": True}):
        alt = rowwise_moments(x, ACC, **other)
        assert not (np.array_equal(alt[0], base[0]) and np.array_equal(alt[1], base[1])), other


# ---- at::vec reductions ---------------------------------------------------------------------------------------

def replay_vec_reduce(a: np.ndarray, b: np.ndarray | None, lanes: int, fused_body: bool,
                      fused_tail: bool) -> np.float32:
    """map_reduce_all (functional_base.h): first vector as the accumulator, whole vectors, a masked last one, then
    vec_reduce_all's shuffles (lane i += lane i + half, halves shrinking); a short row lane by lane."""
    n = len(a)

    def term(i: int) -> np.float32:
        return f32(a[i]) if b is None else f32(f32(a[i]) * f32(b[i]))

    def add(total: np.float32, i: int, fused: bool) -> np.float32:
        return fma(a[i], b[i], total) if b is not None and fused else f32(total + term(i))

    if n < lanes:
        total = term(0)
        for i in range(1, n):
            total = f32(total + term(i))
        return total
    acc = [term(i) for i in range(lanes)]
    d = lanes
    while d + lanes <= n:
        acc = [add(acc[k], d + k, fused_body) for k in range(lanes)]
        d += lanes
    for k in range(n - d):
        acc[k] = add(acc[k], d + k, fused_tail)
    width = lanes
    while width > 1:
        width //= 2
        acc = [f32(acc[k] + acc[k + width]) for k in range(width)]
    return acc[0]


@pytest.mark.parametrize("r", [1, 5, 8, 13, 16, 37, 64, 301])
@pytest.mark.parametrize("times,fused_body,fused_tail", [(False, False, False), (True, False, True),
                                                         (True, True, False), (True, False, False)])
def test_vec_reduce_is_the_replay(r: int, times: bool, fused_body: bool, fused_tail: bool) -> None:
    rng = np.random.default_rng(r)
    a, b = rng.standard_normal((2, 2, r)).astype(f32) * 7
    got = vec_reduce(a, ACC, lanes=8, times=b if times else None, fused_body=fused_body, fused_tail=fused_tail)
    for i in range(2):
        assert f32(got[i]) == replay_vec_reduce(a[i], b[i] if times else None, 8, fused_body, fused_tail), (r, i)


def replay_half_reduce(a: np.ndarray, b: np.ndarray | None, lanes: int, fused: bool, short_fold: bool) -> np.float32:
    """The two-accumulator loops of a 16-bit row (layer_norm_kernel.cpp's mixed-type backward, functional_bfloat16.h's
    reduce_all): per 2·lanes values two float vectors, a masked tail, acc0 + acc1 and the shuffle fold."""
    n, w = len(a), 2 * lanes

    def term(i: int) -> np.float32:
        return f32(a[i]) if b is None else f32(f32(a[i]) * f32(b[i]))

    def add(total: np.float32, i: int) -> np.float32:
        return fma(a[i], b[i], total) if b is not None and fused else f32(total + term(i))

    def fold(v: list) -> np.float32:
        width = len(v)
        while width > 1:
            width //= 2
            v = [f32(v[k] + v[k + width]) for k in range(width)]
        return v[0]

    if n <= lanes:
        total = term(0)
        for i in range(1, n):
            total = f32(total + term(i))
        return total
    if n < w:
        first = [term(i) for i in range(lanes)]
        for k in range(n - lanes):
            first[k] = add(first[k], lanes + k)
        if short_fold:
            return fold(first)
        total = first[0]
        for k in range(1, lanes):
            total = f32(total + first[k])
        return total
    acc0, acc1 = [term(i) for i in range(lanes)], [term(lanes + i) for i in range(lanes)]
    d = w
    while d + w <= n:
        acc0 = [add(acc0[k], d + k) for k in range(lanes)]
        acc1 = [add(acc1[k], d + lanes + k) for k in range(lanes)]
        d += w
    for k in range(n - d):
        if k < lanes:
            acc0[k] = add(acc0[k], d + k)
        else:
            acc1[k - lanes] = add(acc1[k - lanes], d + k)
    return fold([f32(acc0[k] + acc1[k]) for k in range(lanes)])


@pytest.mark.parametrize("r", [1, 6, 8, 9, 13, 16, 17, 24, 32, 37, 300])
@pytest.mark.parametrize("times,fused,short_fold", [(False, True, True), (True, True, True), (True, False, False),
                                                    (True, True, False)])
def test_half_reduce_is_the_replay(r: int, times: bool, fused: bool, short_fold: bool) -> None:
    rng = np.random.default_rng(r + 1)
    a, b = (rng.standard_normal((2, 2, r)) * 5).astype(np.float16).astype(f32)
    got = half_reduce(a, ACC, lanes=8, times=b if times else None, fused=fused, short_fold=short_fold)
    for i in range(2):
        assert f32(got[i]) == replay_half_reduce(a[i], b[i] if times else None, 8, fused, short_fold), (r, i)


def replay_lane_sums(a: np.ndarray, b: np.ndarray | None, lanes: int, per_vector: int, fused: bool) -> np.float32:
    """group_norm_kernel.cpp's ComputeInternalGradients / CalcDsDb: a vector from zero, std::accumulate, the tail."""
    n, w = len(a), lanes * per_vector

    def add(total: np.float32, i: int) -> np.float32:
        if b is None:
            return f32(total + f32(a[i]))
        return fma(a[i], b[i], total) if fused else f32(total + f32(f32(a[i]) * f32(b[i])))

    vec = [f32(0)] * lanes
    full = n // w
    for blk in range(full):
        for part in range(per_vector):
            vec = [add(vec[k], blk * w + part * lanes + k) for k in range(lanes)]
    total = f32(0)
    for k in range(lanes):
        total = f32(total + vec[k])
    for i in range(full * w, n):
        total = add(total, i)
    return total


@pytest.mark.parametrize("r", [1, 7, 8, 15, 16, 19, 40, 77])
@pytest.mark.parametrize("per_vector,times,fused", [(1, True, True), (2, True, True), (2, False, True),
                                                    (1, True, False)])
def test_lane_sums_is_the_replay(r: int, per_vector: int, times: bool, fused: bool) -> None:
    rng = np.random.default_rng(r + 2)
    a, b = (rng.standard_normal((2, 2, r)) * 3).astype(f32)
    got = lane_sums(a, ACC, lanes=8, per_vector=per_vector, times=b if times else None, fused=fused)
    for i in range(2):
        assert f32(got[i]) == replay_lane_sums(a[i], b[i] if times else None, 8, per_vector, fused), (r, i)


# ---- ATen's sums (SumKernel.cpp) ------------------------------------------------------------------------------

def replay_multi_row_sum(items: list[list[np.float32]]) -> list[np.float32]:
    """multi_row_sum over ``items`` (each a list of nrows values), its level loop as written."""
    size, nrows = len(items), len(items[0]) if items else 0
    level_power = max(4, ceil_log2(size) // 4)
    level_step = 1 << level_power
    level_mask = level_step - 1
    acc = [[f32(0)] * nrows for _ in range(4)]
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            acc[0] = [f32(acc[0][k] + items[i][k]) for k in range(nrows)]
            i += 1
        for j in range(1, 4):
            acc[j] = [f32(acc[j][k] + acc[j - 1][k]) for k in range(nrows)]
            acc[j - 1] = [f32(0)] * nrows
            if i & (level_mask << (j * level_power)):
                break
    while i < size:
        acc[0] = [f32(acc[0][k] + items[i][k]) for k in range(nrows)]
        i += 1
    for j in range(1, 4):
        acc[0] = [f32(acc[0][k] + acc[j][k]) for k in range(nrows)]
    return acc[0]


def replay_row_sum(items: list[list[np.float32]]) -> list[np.float32]:
    """row_sum: the items as a (-1, 4) array of rows, multi_row_sum, the rest into the first, then the four added."""
    width = len(items[0])
    groups = len(items) // 4
    if groups:
        parts = replay_multi_row_sum([sum((items[4 * g + k] for k in range(4)), []) for g in range(groups)])
        partial = [parts[k * width:(k + 1) * width] for k in range(4)]
    else:
        partial = [[f32(0)] * width for _ in range(4)]
    for i in range(groups * 4, len(items)):
        partial[0] = [f32(partial[0][c] + items[i][c]) for c in range(width)]
    for k in range(1, 4):
        partial[0] = [f32(partial[0][c] + partial[k][c]) for c in range(width)]
    return partial[0]


def replay_inner_sum(row: np.ndarray, lanes: int = 8) -> np.float32:
    """vectorized_inner_sum (R ≥ lanes) or scalar_inner_sum, then the store into a zeroed output."""
    n = len(row)
    if n >= lanes:
        nvec = n // lanes
        vacc = replay_row_sum([[f32(v) for v in row[i * lanes:(i + 1) * lanes]] for i in range(nvec)])
        total = f32(0)
        for k in range(nvec * lanes, n):
            total = f32(total + f32(row[k]))
        for k in range(lanes):
            total = f32(total + vacc[k])
    else:
        total = replay_row_sum([[f32(v)] for v in row])[0]
    return f32(f32(0) + total)


@pytest.mark.parametrize("r", [1, 3, 4, 7, 8, 12, 31, 32, 33, 100, 127, 129, 600, 2048, 4100, 20000])
def test_aten_sum_is_the_replay(r: int) -> None:
    rng = np.random.default_rng(r + 5)
    x = (rng.standard_normal((2, r)) * 3 + 1).astype(f32)
    got = aten_sum(x, ACC, lanes=8)
    for i in range(2):
        assert f32(got[i]) == replay_inner_sum(x[i]), (r, i)


def test_aten_sum_splits_one_long_row_across_threads() -> None:
    """A single row of at least 32768 values: min(T, ⌈R/32768⌉) contiguous parts, each summed, the T partial sums
    (zeros for idle threads) summed again — and the split changes the result on this row."""
    rng = np.random.default_rng(0)
    r = 70001
    x = (rng.standard_normal((1, r)) * np.exp(rng.uniform(-8, 8, (1, r)))).astype(f32)  # magnitudes e^±8
    for threads in (2, 3, 5):
        used = min(threads, -(-r // 32768))
        chunk = -(-r // used)
        parts = [replay_inner_sum(x[0, t * chunk:min(r, (t + 1) * chunk)]) for t in range(used)]
        want = replay_inner_sum(np.array(parts + [f32(0)] * (threads - used), dtype=f32))
        assert f32(aten_sum(x, ACC, lanes=8, threads=threads)[0]) == want, threads
    assert aten_sum(x, ACC, lanes=8, threads=1)[0] != aten_sum(x, ACC, lanes=8, threads=2)[0]


def replay_column_sum(x: np.ndarray, lanes: int = 8) -> list[np.float32]:
    """vectorized_outer_sum (R ≥ lanes) or scalar_outer_sum over the rows of x, each column into a zeroed output."""
    rows, r = x.shape
    if r == 1:  # one column: TensorIterator sums it as one contiguous row
        return [replay_inner_sum(x[:, 0], lanes)]
    block = 4 * lanes if r >= lanes else 4
    out = []
    cascaded = r // block * block
    for c0 in range(0, cascaded, block):  # multi_row_sum over the rows, ``block`` columns at once
        out += replay_multi_row_sum([[f32(v) for v in x[i, c0:c0 + block]] for i in range(rows)])
    for c in range(cascaded, r):  # row_sum: the rows read as groups of four
        out += replay_row_sum([[f32(x[i, c])] for i in range(rows)])
    return [f32(f32(0) + v) for v in out]


@pytest.mark.parametrize("rows,r", [(37, 1), (1, 5), (3, 3), (7, 6), (9, 8), (5, 37), (40, 70), (300, 9), (70, 100)])
def test_aten_column_sum_is_the_replay(rows: int, r: int) -> None:
    rng = np.random.default_rng(rows * r)
    x = (rng.standard_normal((rows, r)) * 2 - 0.5).astype(f32)
    got = aten_column_sum(x, ACC, lanes=8)
    assert [f32(v) for v in got] == replay_column_sum(x)

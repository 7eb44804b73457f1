"""Scalar replays of the C++ torch.compile (TorchInductor 2.13, AVX-512) generates for BatchNorm on the CPU, one channel
at a time in float32 — written from the generated code and torch/csrc/inductor/cpp_prefix.h (Welford, WelfordHelper,
welford_combine, welford_vec_reduce_all, vec_shuffle_down, CascadeSumHelper) and ATen's vec_reduce_all, line by line.
Imports nothing from bnprobe: the oracle cannot share a bug with the code it checks."""

from __future__ import annotations

import numpy as np

F = np.float32
CHUNK = 4096  # kChunkSize of WelfordHelper and CascadeSumHelper


def ceil_log2(n: int) -> int:
    """cpp_prefix.h ceil_log2_u64."""
    if n <= 1:
        return 0
    n -= 1
    out = 0
    while n > 0:
        n >>= 1
        out += 1
    return out


def omp_static(n: int, threads: int) -> list[range]:
    """libgomp's static schedule of n iterations: q = n / T each, the first n % T threads one more."""
    q, extra = divmod(n, threads)
    out, start = [], 0
    for t in range(threads):
        size = q + (1 if t < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def fold(lanes: list) -> F:
    """vec_reduce_all of x + y on AVX-512 (VectorizedN<float, 2>: the two vectors added first): partners 8, 4, 2, 1
    lanes away (_mm512_shuffle_f32x4 0x4E, 0xB1; _mm512_shuffle_ps 0x4E, 0xB1)."""
    v = list(lanes)
    if len(v) == 32:
        v = [F(v[i] + v[i + 16]) for i in range(16)]
    for d in (8, 4, 2, 1):
        v = [F(v[i] + v[i ^ d]) for i in range(16)]
    return v[0]


class Cascade:
    """CascadeSumHelper<T, 4096>(n) with cascade_sum_combine and cascade_sum_final, one lane."""

    def __init__(self, n: int) -> None:
        self.depth = ceil_log2(-(-n // CHUNK))
        self.stk = [F(0)] * max(self.depth, 1)
        self.chunks = 0
        self.index = 0

    def add(self, v: F) -> None:
        self.stk[0] = F(self.stk[0] + v)
        if self.depth > 0:
            self.index += 1
            if self.index == CHUNK:
                self.chunks += 1
                self.index = 0
                mask, j = self.chunks, 1
                while j < self.depth and (mask & 1) == 0:
                    self.stk[j] = F(self.stk[j] + self.stk[j - 1])
                    self.stk[j - 1] = F(0)
                    mask >>= 1
                    j += 1

    def final(self) -> F:
        out = self.stk[0]
        for i in range(1, self.depth):
            out = F(out + self.stk[i])
        return out


def channel_sum(v: np.ndarray, row: int | None, width: int, threads: int = 1) -> F:
    """One channel's sum (its values in memory order) as inductor's kernel forms it: unrolled below 8 values; a
    vector of channels (row None: channels-last or (N, C)) summing each channel in order, by thread parts merged in
    thread order when ``threads`` > 1, by a cascade above 4096 values; else rows of ``row`` values in vectors of
    ``width`` lanes, the rows' tails masked into the same lanes (one cascade per lane, tails in lanes of their own,
    above 4096 values), then folded."""
    v = [F(t) for t in v]
    r = len(v)
    if r < 8:
        s = v[0]
        for t in v[1:]:
            s = F(s + t)
        return s
    if row is None:
        total = F(0)
        for part in omp_static(r, threads):
            if r > CHUNK:
                c = Cascade(-(-r // threads))
                for j in part:
                    c.add(v[j])
                s = c.final()
            else:
                s = F(0)
                for j in part:
                    s = F(s + v[j])
            total = F(total + s)
        return total
    rows, full = r // row, (row // width) * width
    if r <= CHUNK:
        acc = [F(0)] * width
        for i in range(rows):
            for p in range(row):
                acc[p % width] = F(acc[p % width] + v[i * row + p])
        return fold(acc)
    main = [Cascade(rows * (full // width)) for _ in range(width)]
    masked = [Cascade(rows if full < row else 0) for _ in range(width)]
    for i in range(rows):
        for k in range(0, full, width):
            for lane in range(width):
                main[lane].add(v[i * row + k + lane])
        if full < row:
            for lane in range(width):
                masked[lane].add(v[i * row + full + lane] if full + lane < row else F(0))
    return fold([F(main[lane].final() + masked[lane].final()) for lane in range(width)])


class Welford:
    """Welford<T> of a vector of ``n`` lanes (lists of floats), the update count shared."""

    def __init__(self, n: int) -> None:
        self.mean, self.m2, self.weight = [F(0)] * n, [F(0)] * n, [F(0)] * n
        self.index = 0

    def copy(self) -> Welford:
        w = Welford(len(self.mean))
        w.mean, w.m2, w.weight, w.index = list(self.mean), list(self.m2), list(self.weight), self.index
        return w


def combine(a: Welford, b: Welford, use_index: bool = False) -> Welford:
    """welford_combine(a, b, use_index), lane by lane (vector form: equal means give δ = 0, a zero weight 0)."""
    if a.index == 0:
        return b
    if b.index == 0:
        return a
    out = Welford(len(a.mean))
    for i in range(len(a.mean)):
        delta = F(0) if a.mean[i] == b.mean[i] else F(b.mean[i] - a.mean[i])
        aw = F(a.index) if use_index else a.weight[i]
        bw = F(b.index) if use_index else b.weight[i]
        w = F(aw + bw)
        wb = F(0) if w == 0 else F(bw / w)
        out.mean[i] = F(a.mean[i] + F(delta * wb))
        out.m2[i] = F(F(a.m2[i] + b.m2[i]) + F(F(F(delta * delta) * aw) * wb))
        out.weight[i] = w
    out.index = a.index + b.index
    return out


class Helper:
    """WelfordHelper<T, 4096>(n): its chunk stack."""

    def __init__(self, n: int, lanes: int) -> None:
        self.depth = ceil_log2(-(-n // CHUNK))
        self.stk = [Welford(lanes) for _ in range(self.depth)]
        self.chunks = 0


def update(acc: Welford, data: list, w: Helper, tail: int | None = None) -> Welford:
    """welford_combine(acc, data, [tail_size,] w): the chunk push, then one value per lane (the first ``tail``
    lanes when masked)."""
    if w.depth > 0 and acc.index == CHUNK:
        w.stk[0] = combine(w.stk[0], acc)
        w.chunks += 1
        acc = Welford(len(acc.mean))
        mask, j = w.chunks, 1
        while j < w.depth and (mask & 1) == 0:
            w.stk[j] = combine(w.stk[j], w.stk[j - 1])
            w.stk[j - 1] = Welford(len(acc.mean))
            mask >>= 1
            j += 1
    out = acc.copy()
    recp = F(1.0 / (acc.index + 1))  # weight_recps[index]: a double 1/(i+1) cast to float
    for i in range(len(data)):
        if tail is not None and i >= tail:
            continue
        weight = F(acc.weight[i] + F(1))
        delta = F(F(data[i]) - acc.mean[i])
        mean = F(acc.mean[i] + F(delta * recp))
        out.mean[i], out.m2[i], out.weight[i] = mean, F(acc.m2[i] + F(delta * F(F(data[i]) - mean))), weight
    out.index = acc.index + 1
    return out


def finish(acc: Welford, w: Helper) -> Welford:
    for j in range(w.depth):
        acc = combine(acc, w.stk[j])
    return acc


def _permute_ps(imm: int, i: int) -> int:
    """The source lane of lane i of _mm512_permute_ps(x, imm): within its 128 bits, imm's 2-bit field i mod 4."""
    return i - i % 4 + ((imm >> (2 * (i % 4))) & 3)


def _shuffle_down(v: list, n: int) -> list:
    """vec_shuffle_down on AVX-512 (cpp_prefix.h): n = 1, 2 by _mm512_permute_ps with SHUFFLE_MASK(1, 1, 3, 3) and
    SHUFFLE_MASK(2, 2, 2, 2); n = 4 by _mm512_permutexvar_ps with _mm512_set_epi32(12 x 8, 4 x 8) (set_epi32 lists
    lane 15 first); n = 8 by the index 8 everywhere."""
    mask = {1: (1 << 6) | (1 << 4) | (3 << 2) | 3, 2: (2 << 6) | (2 << 4) | (2 << 2) | 2}
    if n in mask:
        return [v[_permute_ps(mask[n], i)] for i in range(16)]
    if n == 4:
        return [v[4 if i < 8 else 12] for i in range(16)]
    return [v[8]] * 16


def reduce_all(acc: Welford) -> Welford:
    """welford_vec_reduce_all (a VectorizedN<float, 2> merges its two vectors by their weights first): lane 0's
    state, its index its weight."""
    if acc.index == 0:
        return Welford(1)
    if len(acc.mean) == 32:
        lo, hi = Welford(16), Welford(16)
        lo.mean, lo.m2, lo.weight, lo.index = acc.mean[:16], acc.m2[:16], acc.weight[:16], acc.index
        hi.mean, hi.m2, hi.weight, hi.index = acc.mean[16:], acc.m2[16:], acc.weight[16:], acc.index
        acc = combine(lo, hi)
    use_index = all(w == F(acc.index) for w in acc.weight)
    n = 1
    while n < 16:
        sh = Welford(16)
        sh.mean, sh.m2 = _shuffle_down(acc.mean, n), _shuffle_down(acc.m2, n)
        sh.weight = [F(0)] * 16 if use_index else _shuffle_down(acc.weight, n)
        sh.index = acc.index
        acc = combine(acc, sh, use_index)
        n *= 2
    out = Welford(1)
    out.mean, out.m2, out.weight = [acc.mean[0]], [acc.m2[0]], [acc.weight[0]]
    out.index = int(acc.weight[0])
    return out


def channel_welford(v: np.ndarray, row: int | None, width: int, threads: int = 1) -> tuple[F, F]:
    """One channel's (mean, M2) by inductor's Welford kernel: rows of ``row`` values in vectors of ``width`` lanes
    (the rows' tails in a masked accumulator), or (row None) the channel's values in order, split across threads as
    :func:`channel_sum` says."""
    v = [F(t) for t in v]
    r = len(v)
    if row is None:
        total = Welford(1)
        for part in omp_static(r, threads):
            w = Helper(-(-r // threads), 1)
            acc = Welford(1)
            for j in part:
                acc = update(acc, [v[j]], w)
            total = combine(total, finish(acc, w))
        return total.mean[0], total.m2[0]
    rows, full = r // row, (row // width) * width
    w_main, w_masked = Helper(rows * (full // width), width), Helper(rows if full < row else 0, width)
    main, masked = Welford(width), Welford(width)
    for i in range(rows):
        for k in range(0, full, width):
            main = update(main, v[i * row + k: i * row + k + width], w_main)
        if full < row:
            tail = row - full
            data = v[i * row + full: i * row + row] + [F(0)] * (width - tail)
            masked = update(masked, data, w_masked, tail)
    out = combine(reduce_all(finish(masked, w_masked)), reduce_all(finish(main, w_main)))
    return out.mean[0], out.m2[0]

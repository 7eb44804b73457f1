"""PyTorch CPU's row kernels as compiled: the building blocks of its eager LayerNorm, RMSNorm and GroupNorm, every
operation rounded in the accumulator format and fused where the compiled kernel fuses it.

Arrays are ``(rows, R)``: each row is reduced on its own and all rows advance together.  ``lanes`` is the width of
the accumulator's vectors (``Vectorized<float>::size()``: 8 on the AVX2 build PyTorch dispatches these kernels to on
an AVX-512 machine); a 16-bit input's vector holds ``2 * lanes`` values, converted into two accumulator vectors.
What each function emulates, and which of its multiply-adds are fused, was read in torch 2.13's shipped headers
(``ATen/native/cpu/moments_utils.h``, ``ATen/cpu/vec/functional_base.h``, ``functional_bfloat16.h``) and kernels
(``layer_norm_kernel.cpp``, ``group_norm_kernel.cpp``, ``SumKernel.cpp``) and confirmed on torch's own outputs: a
contraction the source does not spell (GCC fusing ``a + b*c``) is named where it is taken.
"""

from __future__ import annotations

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.arith import Arith, Tally, fma_wide

__all__ = ["CHUNK", "rowwise_moments", "vec_reduce", "half_reduce", "lane_sums", "aten_sum", "aten_column_sum"]

#: RowwiseMoments' Welford chunk: this many vectors per chunk before the chunks' cascade
CHUNK = 16
#: ATen's sums (SumKernel.cpp): the cascade's levels and the partial sums a row is interleaved into
_LEVELS = 4
_ILP = 4
#: ATen's parallel reductions split a sum across threads only past this many elements (at::internal::GRAIN_SIZE)
GRAIN = 32768


def _fold(v: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """at::vec's vec_reduce_all over a whole vector: the upper half added onto the lower until one lane is left (a
    lane count that is not a power of two first adds the lanes above the largest power onto the first ones)."""
    n = v.shape[-1]
    p = 1 << (n.bit_length() - 1)
    if p != n:
        v = np.concatenate([acc.add(v[..., :n - p], v[..., p:], tally), v[..., n - p:p]], axis=-1)
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = acc.add(v[..., :h], v[..., h:], tally)
    return v[..., 0]


def _ceil_log2(x: int) -> int:
    """ATen's utils::CeilLog2: 1 for x <= 2, else ⌈log2 x⌉."""
    return 1 if x <= 2 else (x - 1).bit_length()


def _fma(acc: Arith, a: np.ndarray, b: np.ndarray, c: np.ndarray, tally: Tally | None) -> np.ndarray:
    """a·b + c rounded once in ``acc`` (float32 carriers where the operands were)."""
    r = acc.round(fma_wide(a, b, c, native=acc.native), tally)
    return r.astype(np.float32) if acc.binary32 and isinstance(a, np.ndarray) and a.dtype == np.float32 else r


def _welford_chunks(x: np.ndarray, acc: Arith, lanes: int, pack: int, n: int,
                    tally: Tally | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk's per-lane Welford over its vectors, all chunks at once: (counts per chunk, M1, M2) with M1 and M2
    shaped ``(rows, chunks, pack, lanes)`` (``pack`` streams per chunk: a 16-bit vector's two halves)."""
    rows = x.shape[0]
    chunks = -(-n // CHUNK)
    vec = np.zeros((rows, chunks * CHUNK, pack, lanes), dtype=x.dtype)
    vec[:, :n] = x[:, :n * lanes * pack].reshape(rows, n, pack, lanes)
    vec = vec.reshape(rows, chunks, CHUNK, pack, lanes)
    counts = np.minimum(CHUNK, n - CHUNK * np.arange(chunks))
    m1 = np.zeros((rows, chunks, pack, lanes), dtype=x.dtype)
    m2 = np.zeros_like(m1)
    for j in range(CHUNK):
        live = (counts > j)[None, :, None, None]
        if not live.any():
            break
        xv = vec[:, :, j]
        c = acc.round(1.0 / (j + 1))  # c_vecs[j]: a precomputed reciprocal, fl(1/(j+1))
        delta = acc.sub(xv, m1, tally)
        nm1 = _fma(acc, delta, np.asarray(c, dtype=xv.dtype), m1, tally)  # fmadd(δ, c_j, m1)
        nm2 = _fma(acc, delta, acc.sub(xv, nm1, tally), m2, tally)  # fmadd(δ, x − m1, m2)
        m1, m2 = np.where(live, nm1, m1), np.where(live, nm2, m2)
    return counts, m1, m2


class _Stack:
    """RowwiseMoments' cascade: per level a count and per-lane (M1, M2), merged by AddMomentsVec."""

    def __init__(self, acc: Arith, depth: int, shape: tuple[int, int], dtype: type, tally: Tally | None) -> None:
        self.acc, self.tally = acc, tally
        self.n = [0] * depth
        self.m1 = [np.zeros(shape, dtype=dtype) for _ in range(depth)]
        self.m2 = [np.zeros(shape, dtype=dtype) for _ in range(depth)]

    def add(self, level: int, n_add: int, m1_add: np.ndarray, m2_add: np.ndarray) -> None:
        """AddMomentsVec(n_add, m1_add, m2_add) into ``level``: c = fl(n_add)/fl(n), δ = m1_add − m1,
        m1 += fl(c·δ), m2 = fmadd(fl(δ·fl(n_old)), fl(c·δ), fl(m2 + m2_add))."""
        acc, t = self.acc, self.tally
        n_old = self.n[level]
        total = n_old + n_add
        c = 0.0 if total == 0 else float(acc.div(acc.round(float(n_add)), acc.round(float(total))))
        m1, m2 = self.m1[level], self.m2[level]
        dtype = m1.dtype
        delta = acc.sub(m1_add, m1, t)
        m2_sum = acc.add(m2, m2_add, t)
        c_delta = acc.mul(np.asarray(c, dtype=dtype), delta, t)
        n_delta = acc.mul(delta, np.asarray(acc.round(float(n_old)), dtype=dtype), t)
        self.m1[level] = acc.add(m1, c_delta, t)
        self.m2[level] = _fma(acc, n_delta, c_delta, m2_sum, t)
        self.n[level] = total

    def carry(self, level: int) -> None:
        """Merge ``level - 1`` into ``level`` and empty it."""
        self.add(level, self.n[level - 1], self.m1[level - 1], self.m2[level - 1])
        self.n[level - 1] = 0
        self.m1[level - 1] = np.zeros_like(self.m1[level - 1])
        self.m2[level - 1] = np.zeros_like(self.m2[level - 1])


def rowwise_moments(x: np.ndarray, acc: Arith, *, lanes: int = 8, pack: int = 1, fused_tail: bool = False,
                    tally: Tally | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The mean and the sum of squared deviations M2 of each row of ``x`` (accumulator-format values) as PyTorch
    CPU's RowwiseMoments computes them (the variance is M2 / R): the row's whole vectors of ``lanes · pack`` values
    (``pack`` 2 for a 16-bit input, its vector converted into two accumulator vectors) in chunks of
    :data:`CHUNK`, each chunk a Welford update per lane, δ = x − m1, m1 = fma(δ, fl(1/(j+1)), m1),
    m2 = fma(δ, x − m1, m2) (the two halves of a 16-bit vector two streams of the same lanes, merged in turn); the
    chunks merged by Chan's AddMomentsVec into a binary-counter cascade of ⌈log2 chunks⌉ levels (at least one),
    the levels then merged into the first in order; the values after the last whole vector a scalar Welford with
    exact division, m2 += δ·(x − m1) (fused when ``fused_tail``: GCC contracts it in the fp16 kernel, not in the fp32
    and bf16 ones); then each lane merged into that scalar state in lane order
    (AddMoments: m1 = fma(c, δ, m1), m2 += fma(fl(fl(δ·δ)·c), fl(n), m2_lane)).  Returns ``(mean, M2)``, ``(rows,)``
    each, in ``x``'s carrier."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] == 0:
        raise BNProbeError(f"rowwise_moments expects a (rows, R) array with R >= 1, got shape {x.shape}")
    if lanes < 1 or pack < 1:
        raise BNProbeError(f"rowwise_moments needs lanes and pack >= 1, got {lanes} and {pack}")
    rows, r = x.shape
    vec = lanes * pack
    n = r // vec  # whole vectors
    chunks = -(-n // CHUNK)
    stack = _Stack(acc, _ceil_log2(chunks), (rows, lanes), x.dtype, tally)
    if n:
        counts, m1, m2 = _welford_chunks(x, acc, lanes, pack, n, tally)
        for i in range(chunks):
            for h in range(pack):
                stack.add(0, int(counts[i]), m1[:, i, h], m2[:, i, h])
            mask, level = i + 1, 1
            while level < len(stack.n) and mask & 1 == 0:
                stack.carry(level)
                mask >>= 1
                level += 1
        for level in range(1, len(stack.n)):
            stack.add(0, stack.n[level], stack.m1[level], stack.m2[level])
    # the scalar tail: Welford with an exact division per value
    count = 0
    s1 = np.zeros(rows, dtype=x.dtype)
    s2 = np.zeros(rows, dtype=x.dtype)
    for i in range(n * vec, r):
        xi = x[:, i]
        delta = acc.sub(xi, s1, tally)
        count += 1
        s1 = acc.add(s1, acc.div(delta, np.asarray(float(count), dtype=x.dtype), tally), tally)
        dev = acc.sub(xi, s1, tally)
        s2 = _fma(acc, delta, dev, s2, tally) if fused_tail else acc.add(s2, acc.mul(delta, dev, tally), tally)
    # each lane merged into the scalar state, in lane order (AddMoments; its m1 and the m2 term's last product fused)
    lane_count = n * pack
    m1_lanes, m2_lanes = stack.m1[0], stack.m2[0]
    for k in range(lanes):
        total = count + lane_count
        c = 0.0 if total == 0 else float(acc.div(acc.round(float(lane_count)), acc.round(float(total))))
        cv = np.asarray(c, dtype=x.dtype)
        delta = acc.sub(m1_lanes[:, k], s1, tally)
        s1 = _fma(acc, np.broadcast_to(cv, delta.shape), delta, s1, tally)
        term = acc.mul(acc.mul(delta, delta, tally), cv, tally)
        s2 = acc.add(s2, _fma(acc, term, np.broadcast_to(np.asarray(acc.round(float(count)), dtype=x.dtype),
                                                         term.shape), m2_lanes[:, k], tally), tally)
        count = total
    return s1, s2


def _terms(a: np.ndarray, b: np.ndarray | None, acc: Arith, tally: Tally | None) -> np.ndarray:
    return a if b is None else acc.mul(a, b, tally)


def _add(acc: Arith, total: np.ndarray, a: np.ndarray, b: np.ndarray | None, fused: bool,
         tally: Tally | None) -> np.ndarray:
    """total + a (or + a·b: rounded, or fused into the add)."""
    if b is not None and fused:
        return _fma(acc, a, b, total, tally)
    return acc.add(total, _terms(a, b, acc, tally), tally)


def _sequential_lanes(v: np.ndarray, count: int, acc: Arith, tally: Tally | None) -> np.ndarray:
    """at::vec's vec_reduce_all over the first ``count`` lanes, lane 0 first, one by one."""
    total = v[:, 0]
    for k in range(1, count):
        total = acc.add(total, v[:, k], tally)
    return total


def vec_reduce(a: np.ndarray, acc: Arith, *, lanes: int, times: np.ndarray | None = None, fused_body: bool = False,
               fused_tail: bool = True, tally: Tally | None = None) -> np.ndarray:
    """Σ a (or Σ a·times) of each row as at::vec's reduce_all / map_reduce_all take it for a float row: a row of at
    least ``lanes`` values starts its accumulator with its first vector, adds each further whole vector lane by lane
    (products rounded, or fused into the adds when ``fused_body``), adds a last partial vector into its first lanes
    (masked; its products fused into the add when ``fused_tail``: GCC compiles PyTorch's LayerNorm backward so,
    fusing the masked vector's products only), then folds the lanes halves first; a
    shorter row is summed lane by lane in order.  Returns ``(rows,)``."""
    rows, r = a.shape
    if r < lanes:
        return _sequential_lanes(_terms(a, times, acc, tally), r, acc, tally)
    full = r // lanes
    b = None if times is None else times
    vec = _terms(a[:, :lanes], None if b is None else b[:, :lanes], acc, tally)
    for k in range(1, full):
        sl = slice(k * lanes, (k + 1) * lanes)
        vec = _add(acc, vec, a[:, sl], None if b is None else b[:, sl], fused_body, tally)
    tail = r - full * lanes
    if tail:
        sl = slice(full * lanes, r)
        vec = vec.copy()
        vec[:, :tail] = _add(acc, vec[:, :tail], a[:, sl], None if b is None else b[:, sl], fused_tail, tally)
    return _fold(vec, acc, tally)


def half_reduce(a: np.ndarray, acc: Arith, *, lanes: int, times: np.ndarray | None = None, fused: bool = True,
                short_fold: bool = True, tally: Tally | None = None) -> np.ndarray:
    """Σ a (or Σ a·times) of each row of a 16-bit input as PyTorch's CPU kernels take it: two accumulator vectors
    for the two halves of each vector of ``2 · lanes`` values, started with the row's first vector, each further
    whole vector added half by half, a last partial vector added into the lanes it fills (masked), then the two
    accumulators added and their lanes folded halves first.  A row of fewer than ``2 · lanes`` values and more than
    ``lanes``: its second half added into the first's leading lanes, then all ``lanes`` folded halves first
    (``short_fold``: LayerNorm's own loop) or one by one (at::vec's reduced-float functions); a row of at most
    ``lanes`` values is summed lane by lane.  Products ``a·times`` after the first vector are fused into their adds
    when ``fused``.  Returns ``(rows,)``."""
    rows, r = a.shape
    b = times
    width = 2 * lanes

    def part(sl: slice) -> tuple[np.ndarray, np.ndarray | None]:
        return a[:, sl], None if b is None else b[:, sl]

    if r <= lanes:
        return _sequential_lanes(_terms(a, b, acc, tally), r, acc, tally)
    if r < width:
        first = _terms(*part(slice(0, lanes)), acc, tally).copy()
        first[:, :r - lanes] = _add(acc, first[:, :r - lanes], *part(slice(lanes, r)), fused, tally)
        return _fold(first, acc, tally) if short_fold else _sequential_lanes(first, lanes, acc, tally)
    acc0 = _terms(*part(slice(0, lanes)), acc, tally)
    acc1 = _terms(*part(slice(lanes, width)), acc, tally)
    full = r // width
    for k in range(1, full):
        base = k * width
        acc0 = _add(acc, acc0, *part(slice(base, base + lanes)), fused, tally)
        acc1 = _add(acc, acc1, *part(slice(base + lanes, base + width)), fused, tally)
    d = full * width
    left = r - d
    if left > lanes:
        acc0 = _add(acc, acc0, *part(slice(d, d + lanes)), fused, tally)
        acc1 = acc1.copy()
        acc1[:, :left - lanes] = _add(acc, acc1[:, :left - lanes], *part(slice(d + lanes, r)), fused, tally)
    elif left:
        acc0 = acc0.copy()
        acc0[:, :left] = _add(acc, acc0[:, :left], *part(slice(d, r)), fused, tally)
    return _fold(acc.add(acc0, acc1, tally), acc, tally)


def lane_sums(a: np.ndarray, acc: Arith, *, lanes: int, per_vector: int = 1, times: np.ndarray | None = None,
              fused: bool = True, fused_tail: bool | None = None, rounded_tail: int = 0,
              tally: Tally | None = None) -> np.ndarray:
    """Σ a (or Σ a·times) of each row as PyTorch's GroupNorm backward loops take it: an accumulator vector of
    ``lanes`` starting at zero takes the row's whole blocks of ``lanes · per_vector`` values, one ``lanes`` part after
    the other (a 16-bit vector's two halves: ``per_vector`` 2), products fused into the adds when ``fused``; its lanes
    are then added one by one into a scalar starting at zero (std::accumulate), which takes the values after the
    last whole block one by one (products fused as well, or as ``fused_tail`` says — except the first
    ``rounded_tail`` of them, rounded before their adds: GCC's serial copy of GroupNorm's backward computes the tail's
    products four at a time).  Returns ``(rows,)``."""
    rows, r = a.shape
    width = lanes * per_vector
    full = r // width
    vec = np.zeros((rows, lanes), dtype=a.dtype)
    for k in range(full * per_vector):
        sl = slice(k * lanes, (k + 1) * lanes)
        vec = _add(acc, vec, a[:, sl], None if times is None else times[:, sl], fused, tally)
    total = np.zeros(rows, dtype=a.dtype)
    for k in range(lanes):
        total = acc.add(total, vec[:, k], tally)
    tail_fused = fused if fused_tail is None else fused_tail
    for j in range(full * width, r):
        total = _add(acc, total, a[:, j], None if times is None else times[:, j],
                     tail_fused and j - full * width >= rounded_tail, tally)
    return total


def _cascade(items: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """ATen's multi_row_sum over axis 1 of ``items`` (``(rows, size, ...)``): blocks of 2^p items (p = max(4,
    ⌈log2 size⌉ // 4)) summed from zero, each block carried up a stack of four levels as a counter of base 2^p
    carries, the remaining items summed from zero, then the levels added into the first in order."""
    rows, size = items.shape[:2]
    rest = items.shape[2:]
    power = max(4, _ceil_log2(size) // _LEVELS)
    step = 1 << power
    mask = step - 1
    level = [np.zeros((rows, *rest), dtype=items.dtype) for _ in range(_LEVELS)]
    blocks = size // step

    def from_zero(block: np.ndarray) -> np.ndarray:
        total = np.zeros(block.shape[:1] + block.shape[2:], dtype=block.dtype)
        for j in range(block.shape[1]):
            total = acc.add(total, block[:, j], tally)
        return total

    i = 0
    for _ in range(blocks):
        level[0] = from_zero(items[:, i:i + step])
        i += step
        for j in range(1, _LEVELS):
            level[j] = acc.add(level[j], level[j - 1], tally)
            level[j - 1] = np.zeros_like(level[j - 1])
            if i & (mask << (j * power)):
                break
    if i < size:
        level[0] = from_zero(items[:, i:])
    for j in range(1, _LEVELS):
        level[0] = acc.add(level[0], level[j], tally)
    return level[0]


def _interleaved(items: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """ATen's row_sum over axis 1 of ``items``: the items read as groups of four, each position of the group its own
    cascade (:func:`_cascade`), the items after the last whole group added into the first, then the four added in
    order."""
    rows, size = items.shape[:2]
    groups = size // _ILP
    if groups:
        grouped = items[:, :groups * _ILP].reshape(rows, groups, _ILP, *items.shape[2:])
        part = _cascade(grouped, acc, tally)  # (rows, 4, ...)
        partial = [part[:, k] for k in range(_ILP)]
    else:
        partial = [np.zeros((rows, *items.shape[2:]), dtype=items.dtype) for _ in range(_ILP)]
    for i in range(groups * _ILP, size):
        partial[0] = acc.add(partial[0], items[:, i], tally)
    for k in range(1, _ILP):
        partial[0] = acc.add(partial[0], partial[k], tally)
    return partial[0]


def _inner(x: np.ndarray, acc: Arith, lanes: int, tally: Tally | None) -> np.ndarray:
    """One call of ATen's inner sum on each row of ``x``, into an output of zeros."""
    rows, r = x.shape
    if r >= lanes:  # vectorized_inner_sum
        nvec = r // lanes
        vacc = _interleaved(x[:, :nvec * lanes].reshape(rows, nvec, lanes), acc, tally)
        total = np.zeros(rows, dtype=x.dtype)
        for k in range(nvec * lanes, r):
            total = acc.add(total, x[:, k], tally)
        for k in range(lanes):
            total = acc.add(total, vacc[:, k], tally)
    else:  # scalar_inner_sum
        total = _interleaved(x, acc, tally)
    return acc.add(np.zeros(rows, dtype=x.dtype), total, tally)


def aten_sum(x: np.ndarray, acc: Arith, *, lanes: int = 8, threads: int = 1,
             tally: Tally | None = None) -> np.ndarray:
    """Σ of each row of ``x`` (contiguous rows, ``(rows, R)``) as ATen's CPU sum over its last dims (cascade_sum,
    the contiguous inner reduction) takes it: the row's whole vectors of ``lanes`` read as groups of four, each
    position of the group a cascade of blocks (:func:`_cascade`), the four added in order; then a scalar from zero
    adds the values after the last whole vector and the ``lanes`` lanes in order; rows shorter than a vector take the
    same grouped cascade on their values.  A single row of at least :data:`GRAIN` values on ``threads`` > 1 threads
    is cut into min(threads, ⌈R/GRAIN⌉) contiguous parts, each summed so, the parts' sums (with zeros for threads
    left idle) summed again (ATen's two-pass reduction).  Returns ``(rows,)``."""
    x = np.asarray(x)
    rows, r = x.shape
    if rows == 1 and threads > 1 and r >= GRAIN:
        used = min(threads, -(-r // GRAIN))
        chunk = -(-r // used)
        parts = np.zeros((1, threads), dtype=x.dtype)
        for t in range(used):
            sl = slice(t * chunk, min(r, (t + 1) * chunk))
            if sl.stop > sl.start:
                parts[:, t] = _inner(x[:, sl], acc, lanes, tally)
        return _inner(parts, acc, lanes, tally)
    return _inner(x, acc, lanes, tally)


def aten_column_sum(x: np.ndarray, acc: Arith, *, lanes: int = 8, tally: Tally | None = None) -> np.ndarray:
    """Σ over the rows of each column of ``x`` (``(rows, R)``, rows contiguous) as ATen's CPU sum over leading dims
    takes it (cascade_sum, the contiguous outer reduction): from R ≥ ``lanes`` on, the columns in whole blocks of
    four vectors each a cascade over the rows (:func:`_cascade`), the columns in the next whole vectors and the rest
    each the rows read as groups of four (:func:`_interleaved`); fewer columns than a vector: blocks of four columns a
    cascade each, the rest grouped.  Each result added into an output of zeros.  Returns ``(R,)``."""
    x = np.asarray(x)
    rows, r = x.shape
    if r == 1:  # (TensorIterator drops the column's axis of one: the rows are then one contiguous row)
        return aten_sum(x.reshape(1, rows), acc, lanes=lanes, tally=tally)
    out = np.empty(r, dtype=x.dtype)
    block = 4 * lanes if r >= lanes else 4
    cascaded = r // block * block
    if cascaded:
        out[:cascaded] = _cascade(np.ascontiguousarray(x[:, :cascaded])[None], acc, tally)[0]
    if cascaded < r:
        out[cascaded:] = _interleaved(np.ascontiguousarray(x[:, cascaded:])[None], acc, tally)[0]
    return acc.add(np.zeros(r, dtype=x.dtype), out, tally)

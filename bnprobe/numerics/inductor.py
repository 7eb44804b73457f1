"""TorchInductor's CPU Welford reduction, every operation rounded: the mean and M2 torch.compile's BatchNorm takes
above its two-pass threshold (``torch/csrc/inductor/cpp_prefix.h``: ``Welford``, ``WelfordHelper``,
``welford_combine``, ``welford_vec_reduce_all``, ``vec_shuffle_down``; the loops around them are those inductor's
C++ code generator writes for a per-channel ``var_mean``).

Per channel, in the channels-first layout, each row of H·W values is cut into vectors of ``lanes × unroll`` values
(``unroll`` = 2: ``at::vec::VectorizedN<float, 2>``, 16-bit input widened to two float vectors, in rows of at
least that many values; one vector in shorter rows): a full vector
updates one accumulator lane by lane, the row's last partial vector updates a second, masked accumulator in its
first lanes only; both persist across rows.  An update is ``δ = x − mean; mean += δ · r[k]; M2 += δ · (x − mean)``
with ``r[k] = fl(1/(k+1))`` from a table of :data:`CHUNK` reciprocals; after every :data:`CHUNK` updates an
accumulator is pushed onto a stack of chunks merged as a binary counter (a cascade), and the stack is merged into
it at the end.  The lanes are then merged (``welford_vec_reduce_all``: the two vectors first, then the x86 shuffles
at distances 1, 2, 4, 8 — lane 0 meets lane 3 and lane 2 lane 1 at distance 1), the masked accumulator's result
first, the full vectors' merged into it.  A layout without rows (channels-last, or rows of one value: a vector
holds channels) updates one accumulator per channel in memory order, with the same chunks.  Merges are Chan's:
``mean = a.mean + δ·(w_b/w)``, ``M2 = (a.M2 + b.M2) + ((δ·δ)·w_a)·(w_b/w)``, no fused multiply-adds (inductor compiles
with ``-ffp-contract=off``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.reduce import split_parts

__all__ = ["CHUNK", "welford", "welford_split_rows", "splits_channels", "splits_rows"]

#: WelfordHelper<T, 4096>: updates per chunk, and the length of the reciprocal table
CHUNK = 4096
#: config.cpp.min_chunk_size: a kernel is parallelised only where each thread gets this much work
MIN_CHUNK = 512
#: the ratio of a loop's range to its outer loops' beyond which inductor keeps the loops apart (no outer-loop fusion)
#: and parallelises the inner one instead (codegen/cpp.py check_outer_fusion_loop_level_attr, max_parallel_depth)
OUTER_RATIO = 300
#: the floats of one vector (AVX-512) by which a channels-last kernel tiles its channels
CHANNEL_TILE = 16


def splits_channels(channels: int, count: int, threads: int, scalar_below: int) -> bool:
    """Whether inductor splits each channel's reduction of ``count`` values across ``threads`` threads in a layout
    without rows (channels-last, or (N, C)): where the reduction's loop is not fused with the per-channel work around
    it — its range is more than 300 times the channels', or that work runs as a scalar loop, which inductor does for
    fewer channels than ``scalar_below`` (a quarter of the vector's elements: 4 floats, 8 for 16-bit loads) — and
    the loop over the channels' vectors leaves the reduction 300 times longer and every thread 512 values at least.
    (Read from torch/_inductor/codegen/cpp.py and measured on torch 2.13: a rule of its scheduler's heuristics.)"""
    if threads <= 1:
        return False
    fused = channels * OUTER_RATIO >= count and channels >= scalar_below
    return not fused and (channels // CHANNEL_TILE) * OUTER_RATIO < count and \
        channels * count // threads >= MIN_CHUNK


@dataclass
class _State:
    """A Welford<T>: per channel and lane the mean, M2 and weight (a float count), and the update count (index)
    shared by every lane, as the C++ struct has it (the loops are the same for every channel)."""

    mean: np.ndarray
    m2: np.ndarray
    weight: np.ndarray
    index: int


def _empty(c: int, lanes: int, dtype: type) -> _State:
    z = np.zeros((c, lanes), dtype=dtype)
    return _State(z, z, z, 0)


def _combine(a: _State, b: _State, acc: Arith, t: Tally | None,
             use_index: np.ndarray | None = None) -> _State:
    """welford_combine(a, b, use_index): Chan's merge, the weights from the counts where ``use_index`` (per
    channel) is set; a merge into or with an empty state is the other state."""
    if a.index == 0:
        return b
    if b.index == 0:
        return a
    with np.errstate(all="ignore"):
        # (equal means give δ = 0, also when both are infinite: the C++ guards inf − inf)
        delta = np.where(a.mean == b.mean, 0, acc.sub(b.mean, a.mean, t)).astype(a.mean.dtype)
        aw, bw = a.weight, b.weight
        if use_index is not None:
            aw = np.where(use_index[:, None], np.asarray(a.index, dtype=aw.dtype), aw).astype(aw.dtype)
            bw = np.where(use_index[:, None], np.asarray(b.index, dtype=bw.dtype), bw).astype(bw.dtype)
        w = acc.add(aw, bw, t)
        wb = np.where(w == 0, 0, acc.div(bw, w, t)).astype(w.dtype)  # (a zero total weight: no division)
        mean = acc.add(a.mean, acc.mul(delta, wb, t), t)
        m2 = acc.add(acc.add(a.m2, b.m2, t), acc.mul(acc.mul(acc.mul(delta, delta, t), aw, t), wb, t), t)
    return _State(mean, m2, w, a.index + b.index)


class _Helper:
    """WelfordHelper<T, CHUNK>(n): the chunk stack of an accumulator that takes ``n`` updates (depth
    ⌈log2 ⌈n / CHUNK⌉⌉; no stack when it fits one chunk)."""

    def __init__(self, n: int, acc: Arith, t: Tally | None) -> None:
        m = -(-n // CHUNK)
        self.depth = int(m - 1).bit_length() if m > 1 else 0
        self.stack: list[_State | None] = [None] * self.depth
        self.chunks = 0
        self.acc, self.t = acc, t

    def _at(self, j: int, like: _State) -> _State:
        s = self.stack[j]
        return s if s is not None else _State(like.mean, like.m2, like.weight, 0)

    def push(self, s: _State) -> None:
        """A full chunk onto the stack; equal levels merge as a binary counter carries."""
        self.stack[0] = _combine(self._at(0, s), s, self.acc, self.t)
        self.chunks += 1
        mask, j = self.chunks, 1
        while j < self.depth and mask & 1 == 0:
            self.stack[j] = _combine(self._at(j, s), self._at(j - 1, s), self.acc, self.t)
            self.stack[j - 1] = None
            mask >>= 1
            j += 1

    def finish(self, s: _State) -> _State:
        """welford_combine(acc, helper): the stack merged into the accumulator, lowest level first."""
        for j in range(self.depth):
            s = _combine(s, self._at(j, s), self.acc, self.t)
        return s


def _update(s: _State, data: np.ndarray, acc: Arith, t: Tally | None, helper: _Helper,
            tail: int | None = None) -> _State:
    """welford_combine(acc, data, [tail_size,] helper): one value per lane (the first ``tail`` lanes only, when
    masked; the update count advances for all)."""
    if helper.depth > 0 and s.index == CHUNK:
        helper.push(s)
        s = _State(np.zeros_like(s.mean), np.zeros_like(s.mean), np.zeros_like(s.mean), 0)
    with np.errstate(all="ignore"):
        weight = acc.add(s.weight, np.ones_like(s.weight), t)
        delta = acc.sub(data, s.mean, t)
        if s.index < CHUNK:  # the table's fl(1/(k+1)), not a division
            step = acc.mul(delta, np.asarray(acc.round(1.0 / (s.index + 1)), dtype=delta.dtype), t)
        else:
            step = acc.div(delta, weight, t)
        mean = acc.add(s.mean, step, t)
        m2 = acc.add(s.m2, acc.mul(delta, acc.sub(data, mean, t), t), t)
    if tail is not None:
        keep = np.arange(s.mean.shape[1]) >= tail
        mean, m2, weight = (np.where(keep, old, new).astype(new.dtype)
                            for old, new in ((s.mean, mean), (s.m2, m2), (s.weight, weight)))
    return _State(mean, m2, weight, s.index + 1)


def _shuffle_down(lanes: int, n: int) -> np.ndarray:
    """vec_shuffle_down(x, n) as the source lane of each lane: the AVX2 (8 lanes) and AVX-512 (16 lanes)
    specialisations (within 128 bits, distance 1 takes lanes (3, 3, 1, 1) and distance 2 lane 2), else the
    generic one (lane i takes lane i + n for i a multiple of 2n)."""
    i = np.arange(lanes)
    if lanes in (8, 16):
        if n == 1:
            return i - i % 4 + np.array([3, 3, 1, 1])[i % 4]
        if n == 2:
            return i - i % 4 + 2
        if n == 4:
            return 4 + i % 4 if lanes == 8 else np.where(i < 8, 4, 12)
        return np.full(lanes, 8)
    src = i.copy()
    src[0: max(lanes - n, 0): 2 * n] += n
    return src


def _reduce_lanes(s: _State, acc: Arith, t: Tally | None, lanes: int, unroll: int) -> _State:
    """welford_vec_reduce_all: the ``unroll`` vectors merged into the first, then its lanes by the shuffles;
    lane 0's state, its update count its weight."""
    if s.index == 0:
        return s
    c = s.mean.shape[0]
    if unroll > 1:  # (VectorizedN<float, 2>: the two vectors merged by their weights first)
        halves = [_State(s.mean[:, k * lanes:(k + 1) * lanes], s.m2[:, k * lanes:(k + 1) * lanes],
                         s.weight[:, k * lanes:(k + 1) * lanes], s.index) for k in range(unroll)]
        s = halves[0]
        for h in halves[1:]:
            s = _combine(s, h, acc, t)
    # the weights taken from the count when every lane's weight is the count (no masked lane)
    use_index = np.all(s.weight == s.index, axis=1)
    n = 1
    while n < lanes:
        src = _shuffle_down(lanes, n)
        w = np.where(use_index[:, None], 0, s.weight[:, src]).astype(s.weight.dtype)
        s = _combine(s, _State(s.mean[:, src], s.m2[:, src], w, s.index), acc, t, use_index)
        n *= 2
    weight = s.weight[:, :1]
    return _State(s.mean[:, :1], s.m2[:, :1], weight, int(weight[0, 0]) if c else 0)


def splits_rows(channels: int, count: int, row: int, width: int, threads: int) -> bool:
    """Whether inductor splits each channel's reduction across ``threads`` threads in the channels-first layout (rows
    of ``row`` values, vectors of ``width``): where its first reduction loop — over the batch, or over a single row's
    vectors — has more than 300 times as many steps as there are channels, and every thread 512 values at least (a
    batch of one with few channels and large images; a batch 300 times the channels).  Not emulated: the caller
    refuses it."""
    rows = count // row
    steps = rows if rows > 1 else row // width
    return threads > 1 and channels * OUTER_RATIO < steps and channels * count // threads >= MIN_CHUNK


def _per_channel(x: np.ndarray, acc: Arith, tally: Tally | None, threads: int) -> _State:
    """A layout without rows: each channel's values in memory order into one accumulator, or (``threads`` > 1) each
    thread's contiguous part (OpenMP's static schedule) into its own, the threads' states merged in thread order.
    (Each thread's chunk stack is its own here; the generated code declares one static WelfordHelper for all of
    them, which only a thread's part of more than 4096 values uses — a race this does not reproduce.)"""
    c, r = x.shape
    total = _empty(c, 1, x.dtype)
    for part in split_parts(r, threads, "openmp"):
        helper = _Helper(-(-r // threads), acc, tally)
        s = _empty(c, 1, x.dtype)
        for j in range(part.start, part.stop):
            s = _update(s, x[:, j: j + 1], acc, tally, helper)
        total = _combine(total, helper.finish(s), acc, tally)
    return total


def welford(x: np.ndarray, acc: Arith, *, lanes: int, unroll: int = 1, row: int | None = None, threads: int = 1,
            tally: Tally | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The mean and M2 of each row of a ``(C, R)`` array of ``acc`` values by inductor's CPU Welford reduction
    (see the module notes): vectors of ``lanes`` × ``unroll`` values in each of the layout's rows of ``row`` values
    (None or 1: a layout without rows, one accumulator per channel — per thread of ``threads`` when inductor splits
    the channel, :func:`splits_channels`)."""
    c, r = x.shape
    dtype = x.dtype if x.dtype == np.float32 else np.float64
    x = np.asarray(x, dtype=dtype)
    if row is None or row <= 1 or r % row:
        s = _per_channel(x, acc, tally, threads)
        return s.mean[:, 0].astype(np.float64), s.m2[:, 0].astype(np.float64)
    if row < lanes * unroll:  # (short rows of 16-bit input: one vector, inductor's tiling_factor // 2)
        unroll = 1
    width = lanes * unroll
    rows = r // row
    full = (row // width) * width
    xr = x.reshape(c, rows, row)
    body = xr[:, :, :full].reshape(c, rows * (full // width), width)
    helper = _Helper(body.shape[1], acc, tally)
    main = _empty(c, width, dtype)
    for k in range(body.shape[1]):
        main = _update(main, body[:, k], acc, tally, helper)
    main = helper.finish(main)
    masked = _empty(c, width, dtype)
    if full < row:
        tail = row - full
        pad = np.zeros((c, rows, width), dtype=dtype)
        pad[:, :, :tail] = xr[:, :, full:]
        helper = _Helper(rows, acc, tally)
        for k in range(rows):
            masked = _update(masked, pad[:, k], acc, tally, helper, tail)
        masked = helper.finish(masked)
    res = _combine(_reduce_lanes(masked, acc, tally, lanes, unroll), _reduce_lanes(main, acc, tally, lanes, unroll),
                   acc, tally)
    return res.mean[:, 0].astype(np.float64), res.m2[:, 0].astype(np.float64)


def welford_split_rows(x: np.ndarray, acc: Arith, *, lanes: int, unroll: int = 1, threads: int,
                       tally: Tally | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The mean and M2 of each row of a ``(C, R)`` array of ``acc`` values, each row one contiguous row of the layout,
    where inductor splits a row's Welford reduction across ``threads`` threads (a single row, or a few long ones: the
    row's vector loop is the parallel one).  The row's vector iterations — its whole vectors of ``lanes`` ×
    ``unroll`` values, then one masked vector — are dealt by OpenMP's static schedule; each thread updates an
    accumulator of its own from an empty one with its whole vectors, and the thread holding the masked vector a masked
    accumulator of its own; the threads' accumulators are merged in thread order (welford_combine by their weights),
    the masked ones likewise, and reduced across lanes as :func:`welford` does, the masked result first.  Every
    thread takes at most :data:`CHUNK` updates: beyond that the generated code's chunk stack is one static
    WelfordHelper its threads share (a race), which the caller refuses."""
    c, r = x.shape
    dtype = x.dtype if x.dtype == np.float32 else np.float64
    x = np.asarray(x, dtype=dtype)
    if r < lanes * unroll:
        unroll = 1
    width = lanes * unroll
    whole = r // width
    iterations = whole + (1 if r % width else 0)
    if -(-iterations // max(threads, 1)) > CHUNK:
        raise ValueError(f"more than {CHUNK} updates a thread: the generated code's threads share one chunk stack")
    main = _empty(c, width, dtype)
    masked = _empty(c, width, dtype)
    no_stack = _Helper(0, acc, tally)
    for part in split_parts(iterations, threads, "openmp"):
        own = _empty(c, width, dtype)
        for k in range(part.start, min(part.stop, whole)):
            own = _update(own, x[:, k * width:(k + 1) * width], acc, tally, no_stack)
        main = _combine(main, own, acc, tally)
        if part.stop > whole >= part.start and r % width:
            pad = np.zeros((c, width), dtype=dtype)
            pad[:, : r - whole * width] = x[:, whole * width:]
            masked = _combine(masked, _update(_empty(c, width, dtype), pad, acc, tally, no_stack, r - whole * width),
                              acc, tally)
    res = _combine(_reduce_lanes(masked, acc, tally, lanes, unroll), _reduce_lanes(main, acc, tally, lanes, unroll),
                   acc, tally)
    return res.mean[:, 0].astype(np.float64), res.m2[:, 0].astype(np.float64)

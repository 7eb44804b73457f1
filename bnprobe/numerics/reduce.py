"""Per-channel sums in an explicit accumulator format and order.

Arrays are channel-first ``(C, R)``: each row is reduced independently and all
rows advance together, so loops run over the reduction length (or over vector
repeats), never over individual elements.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.arith import Arith, Tally, as_carrier, fma_wide
from bnprobe.numerics.rowwise import aten_sum

__all__ = ["ORDERS", "COMBINES", "SCHEDULES", "THREAD_SPLITS", "Cores", "Rows", "reduce_sum", "tree_sum",
           "split_parts", "vec_dot", "plane_reduce", "thread_blocks", "thread_sum", "buffered_sum",
           "small_batch_threads", "INDUCTOR_UNROLL_BELOW", "INDUCTOR_CASCADE_ABOVE", "balance211", "outer_dims_sum",
           "eigen_parallel_blocks", "packet_split_sum", "CallShape", "XLA_YNN_MIN_ELEMENTS",
           "XLA_YNN_TILE_ELEMENTS", "XLA_WINDOW", "inductor_split_rows"]

# vec: at::vec-style (PyTorch CPU): per row of H*W values (channels_first; channels_last and the parts of a core split
# or of Chan's tiles take their whole axis as one row), full blocks of lanes x unroll values
# go to ``lanes`` accumulators (value p to lane p mod lanes), the rest of the row to one scalar tail; both persist
# across rows; then tail + (((l0 + l1) + l2) + ...), the lanes summed in order
# rowlanes: inductor-style (torch.compile's vectorised reductions on the CPU): in each row of H*W values
# (channels_first; the whole axis otherwise), value p goes to lane p mod lanes — a row's last partial vector masked
# into the first lanes — the lanes persist across rows; then the lanes summed pairwise, halves first
# (at::vec::vec_reduce_all on AVX-512: 8, 4, 2, 1)
# eigen: Eigen's dense sum (``Redux.h``, LinearVectorizedTraversal; Paddle's and onnxruntime's CPU kernels, which sum
# each (n, c) row of H*W values with it): in each row, from its first value at an address aligned to a whole packet of
# ``lanes`` (only for a sum read straight from memory, :class:`Rows`; an expression's sum starts at the row's first
# value), two packet accumulators take alternate packets, are added, take one more packet if one is left, and are
# folded halves first (Eigen's predux on SSE and AVX packets); then the values before the aligned start and after
# the last whole packet are added one by one; a row shorter than the head plus one packet is summed in order.  The
# rows' sums are added in order into a sum that starts at zero.
# omp_simd: GCC's lowering of ``#pragma omp simd reduction(+: s)`` over each row of H*W values (oneDNN's ncsp
# BatchNorm): ``lanes`` private sums start at zero, value p of the row's whole vectors goes to lane p mod lanes and the
# row's remaining values to lane 0; then s (zero before the first row, carried across rows) adds lane 0, 1, ... in
# order.  lanes=1 (a loop GCC did not vectorise) sums each row from zero in order and adds it to s.  (MindSpore's oneDNN
# runs on a threadpool, which splits BatchNorm over channels only, so the thread count changes no sum: FPRev on C = 1.)
# inductor: torch.compile's CPU sums as TorchInductor generates them (torch/_inductor/codegen/cpp.py): a count below
# INDUCTOR_UNROLL_BELOW is unrolled into one scalar sum in memory order (ir.py, unroll_reductions_threshold); a layout
# without rows (channels_last, or rows of one value: a vector holds channels) sums each channel in memory order;
# otherwise rowlanes with lanes x unroll positions (16-bit input: at::vec::VectorizedN<float, 2>, two vectors of
# lanes, folded v0 + v1 first; rows shorter than that take one vector).  Above INDUCTOR_CASCADE_ABOVE values
# (cpp_prefix.h cascade_sum_combine) each accumulator is a cascade: chunks of that many updates, a stack of partial
# sums merged as a binary counter carries (depth ⌈log2 ⌈updates / chunk⌉⌉, the stack's levels added in order at the
# end), and the rows' last partial vectors go to an accumulator of their own, added lane by lane to the full vectors'
# before the lanes are folded
# interleave4: Eigen's reduction over rows that keeps the channel axis (TensorReduction's InnerMostDimPreserver:
# TensorFlow's reduce_sum and reduce_mean over the N·H·W rows of an NHWC tensor, one packet of channels at a time):
# from 16 values on, four accumulators take value j mod 4 of the first 4⌊R/4⌋, combined ((a0 + a1) + a2) + a3, then
# the remaining values added in order; fewer than 16: in order
# xla: XLA's CPU backend (jaxlib 0.10.2) reducing a channels-last call over every axis but the channels, one reduce
# per sum (JAX's eager dispatch); it needs the call's shape (:class:`CallShape`) and is detailed in :func:`_xla`
# aten: ATen's CPU sum over a row's contiguous values (at::sum, cascade_sum's inner reduction: PyTorch's RMSNorm),
# the row's vectors of ``lanes`` read as groups of four, each position of the group a cascade of blocks, then a scalar
# takes the values after the last vector and the lanes in order (bnprobe.numerics.rowwise.aten_sum)
# lanes_tail: hand-unrolled lanes per row (Paddle's CPU GroupNorm, phi/kernels/cpu/group_norm_kernel.cc: eight
# accumulators per channel, std::accumulate into the group's sum, then the channel's tail): in each row of H*W values
# ``lanes`` sums from zero take value p of its whole vectors (lane p mod lanes); s (zero before the first row, carried
# across rows) adds lane 0, 1, ... in order, then the row's remaining values one by one
ORDERS: tuple[str, ...] = ("sequential", "pairwise", "lanes", "vec", "rowlanes", "eigen", "omp_simd", "inductor",
                           "interleave4", "xla", "aten", "lanes_tail")
#: inductor's config.unroll_reductions_threshold: reductions of fewer values become one unrolled scalar expression
INDUCTOR_UNROLL_BELOW = 8
#: inductor's float sums of more values than this use a CascadeSumHelper of chunks of this many updates
INDUCTOR_CASCADE_ABOVE = 4096
# How per-core partial sums are combined: in core order, or by FP32 atomic adds whose
# arrival order is random (seeded), as on Ascend A2/A3/910 when N or H is split across cores.
COMBINES: tuple[str, ...] = ("ordered", "atomic")
# How the rows R = N·S (N samples of S positions, sample-major) are dealt to threads (thread_blocks):
#   rows            : T' = min(T, R) threads take ⌈R/T'⌉ contiguous rows each (PyTorch CPU: at::parallel_for on OpenMP)
#   samples         : whole samples, N dealt over the T threads by balance211 (the first N mod T take one more; a
#                     thread beyond N stays idle): oneDNN's C++ batch normalisation
#   samples_spatial : the samples dealt over min(N, T) threads by balance211 and, when T // N >= 2, each sample's S
#                     positions dealt again over T // N threads: oneDNN's JIT batch normalisation (thread order:
#                     sample part, then position part)
THREAD_SPLITS: tuple[str, ...] = ("rows", "samples", "samples_spatial")


# How the reduced axis is cut into the cores' parts: nearly equal parts with rounded bounds, or OpenMP's static
# schedule (libgomp: ⌊R/T⌋ values each, the first R mod T parts one more), as a compiled kernel's threads take it
SCHEDULES: tuple[str, ...] = ("even", "openmp")


@dataclass(frozen=True)
class Cores:
    """The simulated cores a sum is split across: ``parts`` contiguous parts of the reduced axis (1: no split) cut
    as ``schedule`` says (:data:`SCHEDULES`), their partial sums combined as ``combine`` says (:data:`COMBINES`;
    atomic draws its order from the caller's generator)."""

    parts: int = 1
    combine: str = "ordered"
    schedule: str = "even"


@dataclass(frozen=True)
class Rows:
    """The reduced axis as rows of ``length`` contiguous values (H·W, channel-first) and, for a sum read straight
    from memory (``channels`` given), where they sit: a channel-first ``(N, channels, length)`` buffer whose first
    value is aligned to a whole packet, the sum's first row belonging to channel ``first`` — for the ``eigen`` order,
    whose vectorised part starts at an aligned address.  ``channels=None``: an expression's sum (no address)."""

    length: int
    channels: int | None = None
    first: int = 0


@dataclass(frozen=True)
class CallShape:
    """The shape of the call a ``(C, R)`` block of channels comes from, for an order that depends on the whole
    call (``xla``): ``reduced``, the extents of the reduced axes outermost first (N, then the spatial axes: the
    order of a row's R values), and ``channels``, the call's channel count (a block may hold fewer)."""

    reduced: tuple[int, ...]
    channels: int

    @property
    def elements(self) -> int:
        return math.prod(self.reduced) * self.channels


# XLA's CPU backend hands a reduce to YNNPACK when its operand has at least this many elements
# (xla/backends/cpu/ynn_support.cc, IsInstructionPreferredByYnn: kMinElements = 4096)
XLA_YNN_MIN_ELEMENTS = 4096
# YNNPACK reduces up to this many elements in one kernel call; a larger reduce is tiled along N and its tiles'
# partial sums reduced again (measured: 32768 elements reduce as one call, 36864 do not; see _xla_ynn)
XLA_YNN_TILE_ELEMENTS = 32768
# XLA's TreeReductionRewriter window (xla/hlo/transforms/simplifiers/tree_reduction_rewriter.h, reduce_window_size)
XLA_WINDOW = 32

# numpy dtypes whose add.accumulate rounds every partial sum correctly to
# nearest-even (fp16/bf16 ufuncs compute in float32 and round back, which is
# exact by the double-rounding argument in arith.py).
_ACCUMULATE_DTYPES = ("fp64", "fp32", "fp16", "bf16")


def _accumulate_exact(x: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray | None:
    """Sequential sum along axis 1 by numpy's accumulate in the accumulator dtype, when that is exact.

    Returns None when a rounding or subnormal mode (or a saturation that
    actually happened) needs the general loop.
    """
    spec = acc.spec
    if acc.fmt.name not in _ACCUMULATE_DTYPES or spec.rounding != "nearest_even":
        return None
    with np.errstate(all="ignore"):
        partial = np.add.accumulate(x.astype(acc.fmt.dtype), axis=1)
        finite_in = np.isfinite(x)
        bad = ~np.isfinite(partial) & np.logical_and.accumulate(finite_in, axis=1)
        # flushing subnormal results changes nothing when no partial sum is one (the addends are the format's
        # values, flushed already where the caller flushes)
        if spec.subnormals != "keep" and ((partial != 0) & (np.abs(partial) < acc.fmt.tiny)).any():
            return None
    if spec.overflow == "saturate" and bad.any():
        return None
    if tally is not None and bad.any():
        # a partial sum that turned non-finite while every addend so far was finite overflowed
        first = bad & ~np.concatenate([np.zeros_like(bad[:, :1]), bad[:, :-1]], axis=1)
        tally.add("overflow", first)
    return partial[:, -1].astype(np.float64)


def _sequential(x: np.ndarray, acc: Arith, tally: Tally | None, kahan: bool) -> np.ndarray:
    """Sum along axis 1 in order, one rounding per addition (Kahan-compensated if asked)."""
    if not kahan:
        fast = _accumulate_exact(x, acc, tally)
        if fast is not None:
            return fast
    s = acc.round(x[:, 0], tally)
    comp = np.zeros_like(s)
    for j in range(1, x.shape[1]):
        xj = x[:, j]
        if kahan:
            y = acc.sub(xj, comp, tally)
            t = acc.add(s, y, tally)
            comp = acc.sub(acc.sub(t, s), y)
            s = t
        else:
            s = acc.add(s, xj, tally)
    return s


def tree_sum(x: np.ndarray, acc: Arith, tally: Tally | None = None) -> np.ndarray:
    """Pairwise sum along the last axis, the way vector units halve a buffer.

    When the length n is not a power of two, the elements above the largest
    power of two P <= n are first added onto the first n - P elements; then the
    upper half is added onto the lower half until one element is left.
    """
    n = x.shape[-1]
    if n == 0:
        raise BNProbeError("cannot reduce an empty axis")
    if acc.binary32 and x.dtype == np.float32:
        fast = _tree_sum_f32(x)
        if fast is not None:
            return fast
    a = x
    p = 1 << (n.bit_length() - 1)
    if p != n:
        head = acc.add(a[..., : n - p], a[..., p:], tally)
        a = np.concatenate([head, a[..., n - p: p]], axis=-1)
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = acc.add(a[..., :h], a[..., h:], tally)
    return a[..., 0]


def _tree_sum_f32(x: np.ndarray) -> np.ndarray | None:
    """tree_sum of float32 carriers in fp32 (binary32 adds, the same order) in one buffer, or None when
    an event may have happened: the caller then takes the general route, which counts it.

    No addition of finite binary32 values underflows, and an overflow cannot be undone (inf plus
    anything finite stays inf; inf plus -inf is NaN), so finite addends with finite sums had none.
    """
    n = x.shape[-1]
    with np.errstate(all="ignore"):
        if not np.isfinite(np.sum(x)):  # a NaN or inf addend (or a float32 overflow of this check)
            return None
        p = 1 << (n.bit_length() - 1)
        buf = np.empty(x.shape[:-1] + (p,), dtype=np.float32)
        if p != n:
            np.add(x[..., : n - p], x[..., p:], out=buf[..., : n - p])
            buf[..., n - p:] = x[..., n - p: p]
        else:
            buf[...] = x
        h = p
        while h > 1:
            h //= 2
            np.add(buf[..., :h], buf[..., h: 2 * h], out=buf[..., :h])
        total = buf[..., 0].copy()
    return total if np.isfinite(total).all() else None


def _per_lane(reduce: Callable[[Tally | None], np.ndarray], c: int, lanes: int, tally: Tally | None) -> np.ndarray:
    """``reduce`` run over the ``c * lanes`` rows of per-lane sequences, its events counted per lane and summed back
    into the channel's ``tally``; the lane sums as ``(c, lanes)``."""
    lane_tally = Tally(c * lanes) if tally is not None else None
    per_lane = reduce(lane_tally).reshape(c, lanes)
    if tally is not None and lane_tally is not None:
        for k, v in lane_tally.counts.items():
            tally.counts[k] += v.reshape(c, lanes).sum(axis=1)
    return per_lane


def _lanes(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, kahan: bool) -> np.ndarray:
    """L lanes accumulate vector repeats sequentially, then a pairwise tree across lanes.

    Element j of the row goes to lane j mod L; the tail repeat is padded with
    zeros, which changes no sum.
    """
    c, r = x.shape
    reps = -(-r // lanes)
    pad = reps * lanes - r
    xp = np.concatenate([x, np.zeros((c, pad), dtype=x.dtype)], axis=1) if pad else x
    rows = xp.reshape(c, reps, lanes).transpose(0, 2, 1).reshape(c * lanes, reps)
    per_lane = _per_lane(lambda t: _sequential(rows, acc, t, kahan), c, lanes, tally)
    return tree_sum(per_lane, acc, tally)


def _vec(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, unroll: int, row: int | None,
         kahan: bool) -> np.ndarray:
    """The ``vec`` order (see :data:`ORDERS`): rows of ``row`` values (the whole axis when None or when it does not
    divide it)."""
    c, r = x.shape
    row = r if not row or r % row else row
    rows, block = r // row, lanes * unroll
    full = (row // block) * block
    xr = x.reshape(c, rows, row)
    if full:
        body = xr[:, :, :full].reshape(c, rows * full // lanes, lanes).transpose(0, 2, 1).reshape(c * lanes, -1)
        per_lane = _per_lane(lambda t: _sequential(np.ascontiguousarray(body), acc, t, kahan), c, lanes, tally)
        total = per_lane[:, 0]
        for j in range(1, lanes):
            total = acc.add(total, per_lane[:, j], tally)
    else:
        total = np.zeros(c)
    if full < row:
        tail = _sequential(np.ascontiguousarray(xr[:, :, full:].reshape(c, -1)), acc, tally, kahan)
        total = acc.add(tail, total, tally)
    return total


def _rowlanes(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, row: int | None,
              kahan: bool) -> np.ndarray:
    """The ``rowlanes`` order (see :data:`ORDERS`): each row padded with zeros to whole vectors (a masked lane
    adds nothing, as a zero changes no sum), the padded rows laid end to end in lanes, then a tree across lanes."""
    c, r = x.shape
    row = r if not row or r % row else row
    width = -(-row // lanes) * lanes
    if width != row:
        xr = x.reshape(c, r // row, row)
        x = np.concatenate([xr, np.zeros((c, r // row, width - row), dtype=x.dtype)], axis=2).reshape(c, -1)
    return _lanes(x, acc, tally, lanes, kahan)


def _rows(x: np.ndarray, row: int | None) -> tuple[np.ndarray, int]:
    """x as ``(C, rows, row)`` (the whole axis one row when ``row`` is None or does not divide it), and the row."""
    c, r = x.shape
    row = r if not row or r % row else row
    return x.reshape(c, r // row, row), row


def _in_order(total: np.ndarray, values: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """total + v0 + v1 + ... for the columns of ``values``, one rounding per addition."""
    for j in range(values.shape[1]):
        total = acc.add(total, values[:, j], tally)
    return total


def _eigen_row(v: np.ndarray, start: int, lanes: int, acc: Arith, tally: Tally | None) -> np.ndarray:
    """Eigen's LinearVectorizedTraversal sum of each row of ``v`` (k, n), its packets from ``start``."""
    n = v.shape[1]
    start = min(start, n)
    whole = (n - start) // lanes * lanes
    pairs = (n - start) // (2 * lanes) * (2 * lanes)
    if not whole:
        return _in_order(v[:, 0], v[:, 1:], acc, tally)
    p0 = v[:, start:start + lanes]
    if whole > lanes:
        p1 = v[:, start + lanes:start + 2 * lanes]
        for i in range(start + 2 * lanes, start + pairs, 2 * lanes):
            p0 = acc.add(p0, v[:, i:i + lanes], tally)
            p1 = acc.add(p1, v[:, i + lanes:i + 2 * lanes], tally)
        p0 = acc.add(p0, p1, tally)
        if whole > pairs:
            p0 = acc.add(p0, v[:, start + pairs:start + pairs + lanes], tally)
    res = tree_sum(np.ascontiguousarray(p0), acc, tally)
    res = _in_order(res, v[:, :start], acc, tally)
    return _in_order(res, v[:, start + whole:], acc, tally)


def _eigen(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, row: int | None,
           place: Rows | None) -> np.ndarray:
    """The ``eigen`` order (see :data:`ORDERS`)."""
    if lanes & (lanes - 1):
        raise BNProbeError(f"the eigen order folds a packet halves first: lanes must be a power of two, got {lanes}")
    xr, row = _rows(x, row)
    c, rows, _ = xr.shape
    total = np.zeros(c)
    for n in range(rows):
        v = xr[:, n, :]
        if place is None or place.channels is None:
            starts = np.zeros(c, dtype=np.int64)
        else:  # the first aligned value of each row: its offset in the buffer rounded up to a whole packet
            offsets = (n * place.channels + place.first + np.arange(c, dtype=np.int64)) * row
            starts = (-offsets) % lanes
        sums = np.empty(c)
        for s in np.unique(starts):
            sel = starts == s
            sub = Tally(int(sel.sum())) if tally is not None else None
            sums[sel] = _eigen_row(v[sel], int(s), lanes, acc, sub)
            if tally is not None and sub is not None:
                for k, counted in sub.counts.items():
                    tally.counts[k][sel] += counted
        total = acc.add(total, sums, tally)
    return total


def _omp_simd(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, row: int | None) -> np.ndarray:
    """The ``omp_simd`` order (see :data:`ORDERS`): the row's remainder added into lane 0, then the lanes."""
    return _lane_rows(x, acc, tally, lanes, row, tail_in_lane=True)


def _lanes_tail(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, row: int | None) -> np.ndarray:
    """The ``lanes_tail`` order (see :data:`ORDERS`): omp_simd's lanes, the row's remainder added after them."""
    return _lane_rows(x, acc, tally, lanes, row, tail_in_lane=False)


def _lane_rows(x: np.ndarray, acc: Arith, tally: Tally | None, lanes: int, row: int | None, *,
               tail_in_lane: bool) -> np.ndarray:
    """Row by row, value p of the row's whole vectors into lane p mod ``lanes`` (each lane from zero: 0 + v is v,
    but -0 becomes +0), the lanes added in order into the total; the row's remainder added in order into lane 0
    before that (``tail_in_lane``: omp_simd) or into the total after it (lanes_tail)."""
    xr, row = _rows(x, row)
    c, rows, _ = xr.shape
    whole = row // lanes * lanes
    total = np.zeros(c)
    for n in range(rows):
        v = xr[:, n, :]
        body = v[:, :whole].reshape(c, whole // lanes, lanes).transpose(0, 2, 1).reshape(c * lanes, -1)
        body = np.concatenate([np.zeros((c * lanes, 1), dtype=v.dtype), body], axis=1)
        lane = _per_lane(lambda t, rows=np.ascontiguousarray(body): _sequential(rows, acc, t, False), c, lanes, tally)
        if tail_in_lane:
            lane[:, 0] = _in_order(lane[:, 0], v[:, whole:], acc, tally)
            total = _in_order(total, lane, acc, tally)
        else:
            total = _in_order(_in_order(total, lane, acc, tally), v[:, whole:], acc, tally)
    return total


def _cascade(x: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """Sums along axis 1 by inductor's CascadeSumHelper (see :data:`ORDERS`): stack level 0 takes every update;
    after every chunk the levels carry as a binary counter; the levels are added in order at the end."""
    k = x.shape[1]
    m = -(-k // INDUCTOR_CASCADE_ABOVE)
    depth = int(m - 1).bit_length() if m > 1 else 0
    stack = [np.zeros(x.shape[0], dtype=x.dtype) for _ in range(max(depth, 1))]
    for n, start in enumerate(range(0, k, INDUCTOR_CASCADE_ABOVE), start=1):
        chunk = x[:, start: start + INDUCTOR_CASCADE_ABOVE]
        stack[0] = _sequential(np.concatenate([stack[0][:, None], chunk], axis=1), acc, tally, False).astype(x.dtype)
        if start + chunk.shape[1] == k and chunk.shape[1] < INDUCTOR_CASCADE_ABOVE:
            break  # (a partial last chunk carries nothing)
        j, mask = 1, n
        while j < depth and mask & 1 == 0:
            stack[j] = acc.add(stack[j], stack[j - 1], tally).astype(x.dtype)
            stack[j - 1] = np.zeros_like(stack[j - 1])
            mask >>= 1
            j += 1
    total = stack[0]
    for level in stack[1:depth]:
        total = acc.add(total, level, tally)
    return np.asarray(total)


def _inductor(x: np.ndarray, acc: Arith, tally: Tally | None, width: int, row: int | None) -> np.ndarray:
    """The ``inductor`` order (see :data:`ORDERS`) with vectors of ``width`` values."""
    c, r = x.shape
    if r < INDUCTOR_UNROLL_BELOW:
        return _sequential(x, acc, tally, False)
    if row is None or row <= 1 or r % row:
        return _cascade(x, acc, tally) if r > INDUCTOR_CASCADE_ABOVE else _sequential(x, acc, tally, False)
    if r <= INDUCTOR_CASCADE_ABOVE:
        return _rowlanes(x, acc, tally, width, row, False)
    rows, full = r // row, (row // width) * width
    xr = x.reshape(c, rows, row)
    # per lane: the full vectors' values in order (one cascade each), and the rows' tails (another)
    body = xr[:, :, :full].reshape(c, rows * full // width, width).transpose(0, 2, 1).reshape(c * width, -1)
    lanes = _per_lane(lambda t: _cascade(np.ascontiguousarray(body), acc, t), c, width, tally) if full else \
        np.zeros((c, width), dtype=x.dtype)
    if full < row:
        tails = np.zeros((c, rows, width), dtype=x.dtype)
        tails[:, :, : row - full] = xr[:, :, full:]
        rest = _per_lane(lambda t: _cascade(np.ascontiguousarray(tails.transpose(0, 2, 1).reshape(c * width, -1)),
                                            acc, t), c, width, tally)
        lanes = acc.add(lanes, rest, tally)
    return tree_sum(lanes, acc, tally)




def inductor_split_rows(x: np.ndarray, acc: Arith, *, width: int, threads: int,
                        tally: Tally | None = None) -> np.ndarray:
    """Σ of each row of a ``(C, R)`` array, each row one contiguous row of the layout, as inductor's CPU kernel sums
    it where it splits a row across ``threads`` threads (few rows, long ones: :func:`~bnprobe.numerics.inductor.
    splits_rows`): the row's vector iterations (its whole vectors of ``width`` values, then one masked vector for the
    rest) dealt by OpenMP's static schedule; each thread sums its whole vectors per lane from zero (a cascade above
    :data:`INDUCTOR_CASCADE_ABOVE` updates).  In a row of more than that many values the thread holding the masked
    vector adds it into a masked accumulator of its own, the threads' vectors are added in thread order into zeros,
    the masked ones likewise, and the two vectors added; in a shorter row (no cascade) it adds the masked vector into
    its own accumulator after its whole vectors, and the threads' accumulators are added in thread order into zeros.
    The lanes are then folded halves first (``vec_reduce_all``).  Returns ``(C,)``."""
    x = as_carrier(x) if acc.fits32 else np.asarray(x, dtype=np.float64)
    c, r = x.shape
    whole = r // width
    iterations = whole + (1 if r % width else 0)
    total = np.zeros((c, width), dtype=x.dtype)
    masked = np.zeros((c, width), dtype=x.dtype)
    cascade = r > INDUCTOR_CASCADE_ABOVE
    for part in split_parts(iterations, threads, "openmp"):
        stop = min(part.stop, whole)
        own = np.zeros((c, width), dtype=x.dtype)
        if stop > part.start:
            body = x[:, part.start * width: stop * width].reshape(c, stop - part.start, width)
            rows = np.ascontiguousarray(body.transpose(0, 2, 1).reshape(c * width, -1))
            own = _per_lane(lambda t, rows=rows: _cascade(rows, acc, t), c, width, tally)
        if part.stop > whole >= part.start and r % width:
            tail = np.zeros((c, width), dtype=x.dtype)
            tail[:, : r - whole * width] = x[:, whole * width:]
            if cascade:
                masked = acc.add(masked, tail, tally)
            else:
                own = acc.add(own, tail, tally)
        total = acc.add(total, own, tally)
    return tree_sum(acc.add(total, masked, tally) if cascade else total, acc, tally)


def _interleave4(x: np.ndarray, acc: Arith, tally: Tally | None, kahan: bool) -> np.ndarray:
    """The ``interleave4`` order (see :data:`ORDERS`)."""
    c, r = x.shape
    if r < 16:
        return _sequential(x, acc, tally, kahan)
    body = (r // 4) * 4
    rows = np.ascontiguousarray(x[:, :body].reshape(c, body // 4, 4).transpose(0, 2, 1).reshape(c * 4, body // 4))
    per_lane = _per_lane(lambda t: _sequential(rows, acc, t, kahan), c, 4, tally)
    total = per_lane[:, 0]
    for j in range(1, 4):
        total = acc.add(total, per_lane[:, j], tally)
    for j in range(body, r):
        total = acc.add(total, x[:, j], tally)
    return total


def _fused_sequential(a: np.ndarray, b: np.ndarray, acc: Arith, fused: bool, tally: Tally | None) -> np.ndarray:
    """Σ a·b along axis 1 in order: s = fma(a, b, s) (one rounding per step), or s + fl(a·b) (two)."""
    s = np.zeros(a.shape[0])
    for j in range(a.shape[1]):
        if fused:
            s = acc.round(fma_wide(a[:, j], b[:, j], s), tally)
        else:
            s = acc.add(s, acc.mul(a[:, j], b[:, j], tally), tally)
    return s


def vec_dot(a: np.ndarray, b: np.ndarray, acc: Arith, *, lanes: int, unroll: int = 1, row: int | None = None,
            fused_body: bool = True, fused_tail: bool = True, tally: Tally | None = None) -> np.ndarray:
    """Σ a·b of each row of two ``(C, R)`` arrays in the ``vec`` order (:data:`ORDERS`), each lane and the tail
    accumulating by fused multiply-adds (``fused_body``, ``fused_tail``) or by rounded products: a vectorised dot
    product such as PyTorch CPU's backward's Σ(x − mean)·dy."""
    c, r = a.shape
    row = r if not row or r % row else row
    rows, block = r // row, lanes * unroll
    full = (row // block) * block
    ar, br = a.reshape(c, rows, row), b.reshape(c, rows, row)
    total = np.zeros(c)
    if full:
        def body(v: np.ndarray) -> np.ndarray:
            return v[:, :, :full].reshape(c, rows * full // lanes, lanes).transpose(0, 2, 1).reshape(c * lanes, -1)

        per_lane = _per_lane(lambda t: _fused_sequential(body(ar), body(br), acc, fused_body, t), c, lanes, tally)
        total = per_lane[:, 0]
        for j in range(1, lanes):
            total = acc.add(total, per_lane[:, j], tally)
    if full < row:
        tail = _fused_sequential(ar[:, :, full:].reshape(c, -1), br[:, :, full:].reshape(c, -1), acc, fused_tail,
                                 tally)
        total = acc.add(tail, total, tally)
    return total


def plane_reduce(x: np.ndarray, acc: Arith, *, lanes: int, row: int | None = None, times: np.ndarray | None = None,
                 fused: str = "none", into: Arith | None = None, tally: Tally | None = None) -> np.ndarray:
    """Σ x (or Σ x·times) of each row of a ``(C, R)`` array as PyTorch's fp32 and fp64 CPU backward takes it
    (at::vec::reduce_all and map2_reduce_all, one call per H·W plane of ``row`` values; the whole axis when ``row``
    is None or does not divide it).  A plane of at least ``lanes`` values: its first vector is the accumulator, each
    further full vector is added lane by lane, a last partial vector is added into the first lanes only (masked),
    then the lanes are folded halves first (:func:`tree_sum`: 8, 4, 2, 1 for 16 lanes).  A shorter plane is folded
    in sequence, lane 0 first.  Every step is rounded in ``acc``; the planes' results are added in order in ``into``
    (PyTorch's fp32 kernel: a double accumulator; ``acc`` when None).  With ``times`` each term is the product
    x·times, rounded, or (``fused``: ``body`` for the full vectors after the first, ``tail`` for the masked one,
    ``all`` for both, ``none``) fused into the lane's add; a plane's first vector and a short plane are plain
    products.  Returns ``(C,)`` float64."""
    into = acc if into is None else into
    x = np.asarray(x)
    c, r = x.shape
    row = r if not row or r % row else row
    planes = r // row
    xr = x.reshape(c, planes, row)
    tr = None if times is None else np.asarray(times).reshape(c, planes, row)

    def term(sl: slice) -> np.ndarray:
        return xr[..., sl] if tr is None else acc.mul(xr[..., sl], tr[..., sl], tally)

    def add(total: np.ndarray, sl: slice, fuse: bool) -> np.ndarray:
        if tr is not None and fuse:
            return acc.round(fma_wide(xr[..., sl], tr[..., sl], total), tally)
        return acc.add(total, term(sl), tally)

    if row < lanes:
        total = term(slice(0, 1))[..., 0]
        for j in range(1, row):
            total = acc.add(total, term(slice(j, j + 1))[..., 0], tally)
    else:
        full = row // lanes
        vec = term(slice(0, lanes))
        for k in range(1, full):
            vec = add(vec, slice(k * lanes, (k + 1) * lanes), fused in ("body", "all"))
        if full * lanes < row:
            tail = row - full * lanes
            head = add(vec[..., :tail], slice(full * lanes, row), fused in ("tail", "all"))
            vec = np.concatenate([head, vec[..., tail:]], axis=-1)
        total = tree_sum(vec, acc, tally)
    return np.asarray(_sequential(np.asarray(total), into, tally, kahan=False), dtype=np.float64)


def thread_blocks(r: int, threads: int, split: str = "rows", samples: int | None = None) -> list[slice]:
    """The rows of a length-r axis each of ``threads`` threads takes, dealt as ``split`` says (:data:`THREAD_SPLITS`;
    ``samples``: the N the rows hold samples of, for the splits by sample).  rows: as at::parallel_for(0, R, 1, ·)
    hands them out on OpenMP (ATen/ParallelOpenMP.h), T' = min(T, R) threads get ⌈R/T'⌉ contiguous rows each in
    thread order, the last what is left; samples and samples_spatial: as oneDNN's batch normalisation deals them
    (:func:`balance211`).  A thread past the end gets none (its buffer stays 0).  One slice per thread, in the
    order the partials are combined, T in all."""
    if split == "rows":
        used = max(1, min(threads, r))
        k = -(-r // used)
        return [slice(min(t * k, r), min((t + 1) * k, r)) for t in range(threads)]
    if split not in THREAD_SPLITS:
        raise BNProbeError(f"unknown thread split {split!r}; valid: {', '.join(THREAD_SPLITS)}")
    n = samples
    if not n or r % n:
        raise BNProbeError(f"a split by sample needs the sample count N dividing R = {r}, got N = {n}")
    s, t = r // n, max(1, threads)
    groups, spatial = (t, 1) if split == "samples" else (min(n, t), max(1, min(s, t // min(n, t))))
    out = []
    for i in range(groups * spatial):
        n0, n1 = balance211(n, groups, i // spatial % groups)
        s0, s1 = balance211(s, spatial, i % spatial)
        # (a spatial split leaves one sample per thread: the rows stay contiguous)
        out.append(slice(n0 * s + s0, (n1 - 1) * s + s1) if n1 > n0 and s1 > s0 else slice(r, r))
    return out + [slice(r, r)] * (t - len(out))


def small_batch_threads(threads: int, r: int, channels: int) -> int:
    """How many threads PyTorch CPU's fp32 channels-last statistics (partials combined in double) split R rows across
    when R ≤ T, where the kernel leaves its per-thread buffers ("Method 1/2" in batch_norm_kernel.cpp): one row per
    thread, combined in double (its per-channel double loop), when 16 < C ≤ 2048 and T > 1; one thread (its
    vectorised float loop over tiles of 16 channels) otherwise.  T itself when R > T."""
    if r > threads:
        return threads
    return r if threads > 1 and 16 < channels <= 2048 else 1


def thread_sum(x: np.ndarray, acc: Arith, *, threads: int, wide: Arith | None = None, times: np.ndarray | None = None,
               fused: bool = False, tally: Tally | None = None, split: str = "rows",
               samples: int | None = None) -> np.ndarray:
    """Σ of each row of a ``(C, R)`` array, or Σ x·times, as PyTorch CPU's channels-last kernels take it across
    ``threads`` threads: thread t adds the rows of its block (:func:`thread_blocks`) one by one into a buffer of
    ``acc``'s format that starts at 0 (with ``times``: s = fma(x, times, s) when ``fused``, else s + fl(x·times)),
    then the T buffers are added in thread order into a sum that starts at 0, in ``wide``'s format (None: ``acc``'s);
    the rows dealt as ``split`` says (``samples``: N; see :func:`thread_blocks`: oneDNN's kernels deal samples).
    The addends must be values of ``acc``'s format; returns (C,) float64 values of the combine's format."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] == 0:
        raise BNProbeError(f"thread_sum expects a non-empty (C, R) array, got shape {x.shape}")
    if threads < 1:
        raise BNProbeError(f"threads must be >= 1, got {threads}")
    c, r = x.shape
    b = None if times is None else np.asarray(times, dtype=np.float64)
    if b is not None and not fused:
        x, b = acc.mul(x, b, tally), None  # (each product rounded, then summed as plain addends)
    into = acc if wide is None else wide
    total = np.zeros(c)
    for sl in thread_blocks(r, threads, split, samples):
        if sl.stop == sl.start:
            part = np.zeros(c)
        elif b is not None:
            part = _fused_sequential(x[:, sl], b[:, sl], acc, True, tally)
        else:
            part = _sequential(np.ascontiguousarray(x[:, sl]), acc, tally, False)
        total = into.add(total, part, tally)
    return total


def buffered_sum(x: np.ndarray, acc: Arith, buffer: Arith, *, threads: int, tally: Tally | None = None) -> np.ndarray:
    """Σ of each row of a ``(C, R)`` array as PyTorch CPU LayerNorm's backward takes dγ and dβ: thread t adds the
    rows of its block (:func:`thread_blocks`, contiguous) one by one into a buffer of ``buffer``'s format that starts
    at 0, each addition formed in ``acc``'s format and rounded to ``buffer``'s (a 16-bit buffer holds fl16(fl32(s + t)):
    at::vec::map3 converts to float, adds, converts back); then the T buffers are added in thread order in ``acc``.
    The addends must be values of ``acc``'s format; returns (C,) float64 values of ``acc``'s format."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] == 0:
        raise BNProbeError(f"buffered_sum expects a non-empty (C, R) array, got shape {x.shape}")
    if threads < 1:
        raise BNProbeError(f"threads must be >= 1, got {threads}")
    c, r = x.shape
    total = np.zeros(c)
    for sl in thread_blocks(r, threads):
        part = np.zeros(c)
        for j in range(sl.start, sl.stop):
            part = buffer.round(acc.add(part, x[:, j], tally), tally)
        total = acc.add(total, part, tally)
    return total


def _from_zero(total: np.ndarray) -> np.ndarray:
    """A sum that starts from +0 (XLA's and YNNPACK's init value): the same as one that starts from its first
    value, except that it is never -0 (+0 + -0 is +0, and no later sum of two values is -0 unless both are)."""
    return np.where(total == 0, 0.0, total).astype(total.dtype)


def _xla(x: np.ndarray, acc: Arith, tally: Tally | None, shape: CallShape | None) -> np.ndarray:
    """The ``xla`` order: how XLA's CPU backend (jaxlib 0.10.2, its YNNPACK of May–August 2026) sums a
    channels-last array over every axis but the channels, each row of ``x`` holding one channel's values in the
    row-major order of ``shape.reduced``.

    A reduce whose operand holds at least :data:`XLA_YNN_MIN_ELEMENTS` values goes to YNNPACK (:func:`_xla_ynn`).
    A smaller one is XLA's own loop: the values in row-major order, from +0, one rounding per addition — after
    XLA's TreeReductionRewriter has replaced a reduce with a reduced axis longer than :data:`XLA_WINDOW` by a
    reduce-window of ``min(extent, 32)`` on every reduced axis (kSame padding: the padding split ⌊p/2⌋ low, the
    rest high), each window summed in row-major order, repeated until no axis is longer.  XLA marks these loops'
    additions ``reassoc``, and LLVM does reassociate some of them (measured: a reduced channel count of 1; an
    innermost reduced extent of 2 with 3 or more channels; a 2×2 grid of windows): there this order is not the
    kernel's, and identify says so."""
    if not isinstance(shape, CallShape):
        raise BNProbeError("order=xla needs the call's shape (a CallShape as the row argument)")
    if math.prod(shape.reduced) != x.shape[1]:
        raise BNProbeError(f"order=xla: a row of {x.shape[1]} values does not fit reduced axes {shape.reduced}")
    if shape.elements >= XLA_YNN_MIN_ELEMENTS:
        return _xla_ynn(x, acc, tally, shape)
    dims = shape.reduced
    while max(dims) > XLA_WINDOW:
        x, dims = _xla_windows(x, acc, tally, dims)
    return _from_zero(_sequential(x, acc, tally, False))


def _xla_windows(x: np.ndarray, acc: Arith, tally: Tally | None,
                 dims: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """One round of XLA's TreeReductionRewriter: every window's sum (row-major within the window; a padded
    position adds +0, which changes no sum that started from +0) as ``(C, windows)``, and the windows' extents."""
    c = x.shape[0]
    win = [min(d, XLA_WINDOW) for d in dims]
    outs = [-(-d // w) for d, w in zip(dims, win)]
    pads = [(0, 0)] + [((o * w - d) // 2, o * w - d - (o * w - d) // 2) for d, w, o in zip(dims, win, outs)]
    grid = np.pad(x.reshape(c, *dims), pads)
    split = grid.reshape(c, *itertools.chain.from_iterable(zip(outs, win)))
    order = [0] + [1 + 2 * i for i in range(len(dims))] + [2 + 2 * i for i in range(len(dims))]
    rows = np.ascontiguousarray(split.transpose(order)).reshape(c * math.prod(outs), math.prod(win))
    sums = _per_lane(lambda t: _from_zero(_sequential(rows, acc, t, False)), c, math.prod(outs), tally)
    return sums, tuple(outs)


def _xla_ynn(x: np.ndarray, acc: Arith, tally: Tally | None, shape: CallShape) -> np.ndarray:
    """YNNPACK's sum (ynnpack/kernels/reduce/sum.h, ``sum_float_kn``; its subgraph tiles the reduce along N).

    Up to :data:`XLA_YNN_TILE_ELEMENTS` values are one kernel call (:func:`_ynn_call`).  A larger reduce is cut
    into tiles of whole n: ⌊32768 / (values per n)⌋ of them per tile, or one per tile and the tiles' sums added in
    pairs when one n alone holds more; each tile is a kernel call, and the tiles' (or pairs') sums are reduced by
    one more kernel call.  Measured on 2 cores against jax: tiles of 8, 2 and 1 n (4096, 15376 and 31552 values
    per n, up to 64 n) and pairs of single n (40000 values per n, 4 to 20 n); with more than 32768 values per n and
    fewer than 4 n YNNPACK tiles another way, which this order does not emulate."""
    n = shape.reduced[0]
    if shape.elements <= XLA_YNN_TILE_ELEMENTS:
        return _from_zero(_ynn_call(x, acc, tally))
    per_n = shape.elements // n
    rows = x.shape[1] // n
    tile, pair = (XLA_YNN_TILE_ELEMENTS // per_n, 1) if per_n <= XLA_YNN_TILE_ELEMENTS else (1, 2)
    tiles = [_ynn_call(x[:, i * rows: (i + tile) * rows], acc, tally) for i in range(0, n, tile)]
    partials = []
    for i in range(0, len(tiles), pair):
        total = np.zeros_like(tiles[0])
        for t in tiles[i: i + pair]:
            total = acc.add(total, t, tally)
        partials.append(total)
    return _from_zero(_ynn_call(np.stack(partials, axis=1), acc, tally))


def _chains(a: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """Σ along the last axis from +0, left to right (YNNPACK's partial_sum_kn over up to 4 rows), for every
    leading index at once."""
    s = acc.add(np.zeros(a.shape[:-1], dtype=a.dtype), a[..., 0], tally)
    for j in range(1, a.shape[-1]):
        s = acc.add(s, a[..., j], tally)
    return s


def _kahan(a: np.ndarray, total: np.ndarray, err: np.ndarray, acc: Arith,
           tally: Tally | None) -> tuple[np.ndarray, np.ndarray]:
    """YNNPACK's kahan_sum(a, total, err): y = a − err; t = total + y; err = (t − total) − y, a non-finite err
    taken as 0."""
    y = acc.sub(a, err, tally)
    t = acc.add(total, y, tally)
    e = acc.sub(acc.sub(t, total, tally), y, tally)
    return t, np.where(np.isfinite(e), e, 0.0).astype(e.dtype)


def _ynn_call(x: np.ndarray, acc: Arith, tally: Tally | None) -> np.ndarray:
    """One YNNPACK ``sum_float_kn`` call over the k values of each row (its result before it is added to the
    output): k <= 4 values are one chain from +0; otherwise chains of 4 consecutive values (the last one shorter)
    are added into a level-0 sum, flushed into a level-1 sum every 16 values, which is added into the level-2
    total by Kahan summation every 256 values; at the end the level-0 sum goes into level 1 and level 1, by one
    last Kahan step, into the total (the step that also applies the pending compensation)."""
    c, k = x.shape
    if k <= 4:
        return _chains(x, acc, tally)
    full = k // 4 * 4
    chains = _chains(x[:, :full].reshape(c, -1, 4), acc, tally)  # (c, chunks)
    groups, blocks = chains.shape[1] // 4, chains.shape[1] // 64
    level1 = _chains(chains[:, : groups * 4].reshape(c, groups, 4), acc, tally) if groups else chains[:, :0]
    total = np.zeros(c, dtype=chains.dtype)
    err = np.zeros_like(total)
    for b in range(blocks):
        total, err = _kahan(_chains(level1[:, b * 16: b * 16 + 16], acc, tally), total, err, acc, tally)
    level0 = np.zeros_like(total)
    for j in range(groups * 4, chains.shape[1]):
        level0 = acc.add(level0, chains[:, j], tally)
    if full < k:
        level0 = acc.add(level0, _chains(x[:, full:], acc, tally), tally)
    rest = np.zeros_like(total)
    for g in range(blocks * 16, groups):
        rest = acc.add(rest, level1[:, g], tally)
    total, _ = _kahan(acc.add(rest, level0, tally), total, err, acc, tally)
    return total


def split_parts(r: int, parts: int, schedule: str = "even") -> list[slice]:
    """Contiguous, nearly equal parts of a length-r axis (at most r of them), as cores take N*H*W, cut as
    ``schedule`` says (:data:`SCHEDULES`)."""
    parts = max(1, min(parts, r))
    if schedule == "openmp":
        q, extra = divmod(r, parts)
        bounds = np.array([i * q + min(i, extra) for i in range(parts + 1)])
    elif schedule == "even":
        bounds = np.linspace(0, r, parts + 1).round().astype(int)
    else:
        raise BNProbeError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def balance211(n: int, team: int, tid: int) -> tuple[int, int]:
    """The range [start, end) of ``n`` items that member ``tid`` of a team of ``team`` takes when the items are dealt
    as evenly as possible, the first ``n mod team`` members taking one more (oneDNN's ``balance211``)."""
    if team <= 1 or n == 0:
        return 0, n
    n1 = -(-n // team)
    n2 = n1 - 1
    t1 = n - n2 * team
    start = tid * n1 if tid <= t1 else t1 * n1 + (tid - t1) * n2
    return start, start + (n1 if tid < t1 else n2)


def reduce_sum(
    x: np.ndarray,
    acc: Arith,
    *,
    order: str = "pairwise",
    lanes: int = 64,
    kahan: bool = False,
    tally: Tally | None = None,
    cores: Cores = Cores(),
    rng: np.random.Generator | None = None,
    unroll: int = 1,
    row: int | Rows | CallShape | None = None,
) -> np.ndarray:
    """Sum each row of a ``(C, R)`` array in ``acc``'s format; returns ``(C,)`` float64.

    ``x`` may be float32 carriers (see arith.py); the sums are the same.

    order: ``sequential`` (left to right, one rounding per addition),
    ``pairwise`` (halving tree, see :func:`tree_sum`), or ``lanes`` (``lanes``
    sequential accumulators over vector repeats, then a tree across lanes).
    ``kahan`` adds compensated summation to ``sequential`` and to each lane; ``vec`` (see :data:`ORDERS`) takes
    ``lanes``, ``unroll`` and ``row``, the length of the layout's contiguous rows; ``eigen`` and ``omp_simd`` take
    ``lanes`` and ``row``, and ``eigen`` where the rows sit in memory when ``row`` is a :class:`Rows` that says so
    (else an expression's sum, its packets from each row's first value); ``xla`` takes the call's
    shape as ``row`` (:class:`CallShape`).  ``cores`` splits the sum across simulated
    cores (:class:`Cores`; ``rng`` orders an atomic combine).
    The addends must already be values of the accumulator format.
    """
    # float32 carriers stay float32 (see arith.py) where the accumulator's values fit in them
    x = as_carrier(x) if acc.fits32 else np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise BNProbeError(f"reduce_sum expects a (C, R) array, got shape {x.shape}")
    if x.shape[1] == 0:
        raise BNProbeError("cannot reduce an empty axis (R = 0)")
    if cores.parts > 1:
        total = _combine_parts(x, acc, order=order, lanes=lanes, kahan=kahan, tally=tally, cores=cores, rng=rng,
                               unroll=unroll)
    else:
        total = _reduce_one(x, acc, order=order, lanes=lanes, kahan=kahan, tally=tally, unroll=unroll, row=row)
    return np.asarray(total, dtype=np.float64)


def packet_split_sum(x: np.ndarray, acc: Arith, vector_rows: int | None, vector_sum: Callable[..., np.ndarray],
                     tally: Tally | None = None) -> np.ndarray:
    """Σ of each row of a ``(C, R)`` array as a kernel vectorised across channels takes it: the first
    ``vector_rows`` rows (channels in whole packets) by ``vector_sum(rows, tally)``, the rest (the channels left over)
    in order, as its scalar path sums them (None: every row by ``vector_sum``).  Returns ``(C,)`` float64."""
    c = x.shape[0]
    if vector_rows is None or not 0 <= vector_rows < c:
        return vector_sum(x, tally)
    total = np.empty(c)
    for sl, run in ((slice(0, vector_rows), vector_sum),
                    (slice(vector_rows, c), lambda v, t: reduce_sum(v, acc, order="sequential", tally=t))):
        if sl.stop > sl.start:
            t = Tally(sl.stop - sl.start) if tally is not None else None
            total[sl] = run(x[sl], t)
            if tally is not None and t is not None:
                for k, v in t.counts.items():
                    tally.counts[k][sl] += v
    return total


def _combine_parts(x: np.ndarray, acc: Arith, *, order: str, lanes: int, kahan: bool, tally: Tally | None,
                   cores: Cores, rng: np.random.Generator | None, unroll: int = 1) -> np.ndarray:
    """Each simulated core reduces its contiguous part; the partials are then added one by one into
    an accumulator that starts at zero, in core order or (atomic) in a random order per channel."""
    combine = cores.combine
    if combine not in COMBINES:
        raise BNProbeError(f"unknown combine {combine!r}; valid: {', '.join(COMBINES)}")
    partial = np.stack([_reduce_one(x[:, sl], acc, order=order, lanes=lanes, kahan=kahan, tally=tally,
                                    unroll=unroll)
                        for sl in split_parts(x.shape[1], cores.parts, cores.schedule)], axis=1)
    if combine == "atomic":
        if rng is None:
            raise BNProbeError("atomic combine needs a seeded generator")
        perm = np.argsort(rng.random(partial.shape), axis=1)
        partial = np.take_along_axis(partial, perm, axis=1)
    total = np.zeros(x.shape[0])
    for j in range(partial.shape[1]):
        total = acc.add(total, partial[:, j], tally)
    return total


def eigen_parallel_blocks(n: int, cost: float, threads: int) -> list[tuple[int, int]]:
    """How Eigen's ThreadPoolDevice::parallelFor(n, cost, f) cuts [0, n) into the ranges it calls f on: one range
    when its cost model (TensorCostModel: 100000 cycles to start, 100000 per thread, tasks of 40000) finds one thread
    enough, else blocks sized by CalculateParallelForBlock (at most 4 per thread, grown while the threads stay as
    busy).  ``cost``: the cycles of one unit of work (TensorOpCost::total_cost with loads at 11/64 a byte)."""
    if n <= 1 or threads <= 1 or min(threads, max(1, int((n * cost - 1e5) / 1e5 + 0.9))) == 1:
        return [(0, max(n, 0))]
    size = min(n, max(-(-n // (4 * threads)), int(40000.0 / cost)))
    largest = min(n, 2 * size)
    count = -(-n // size)

    def efficiency(k: int) -> float:
        return k / (-(-k // threads) * threads)

    best, prev = efficiency(count), count
    while best < 1.0 and prev > 1:
        coarser = -(-n // (prev - 1))
        if coarser > largest:
            break
        prev = -(-n // coarser)
        if efficiency(prev) + 0.01 >= best:
            size, count, best = coarser, prev, max(best, efficiency(prev))
    return [(k * size, min(n, (k + 1) * size)) for k in range(count)]


def outer_dims_sum(x: np.ndarray, acc: Arith, *, channels: int, threads: int, item_bytes: int,
                   tally: Tally | None = None) -> np.ndarray:
    """TensorFlow's ReduceOuterDimensions (redux_functor.h) of a ``(C, R)`` array: each channel's R rows summed in
    order, on ``threads`` threads.  With more than 16 channels a thread (``channels``: the call's C), threads split
    the channels: plain sums in order.  Otherwise the rows are cut into B = min(T, ⌈R·C / ⌈2000/C⌉⌉, R) blocks of
    ⌈R/B⌉, which Eigen's parallelFor (:func:`eigen_parallel_blocks`, costing a block's ⌈R/B⌉·C values at
    ``item_bytes`` each) runs as one or more ranges; each range sums its rows in order from zero, and the ranges'
    sums are added in order.  Returns ``(C,)`` float64."""
    c, r = x.shape
    if channels > 16 * threads:
        return reduce_sum(x, acc, order="sequential", tally=tally)
    blocks = min(threads, -(-(r * channels) // -(-2000 // channels)), r)
    rows = -(-r // blocks)
    cost = rows * channels * (item_bytes * 11.0 / 64.0 + 1.0)
    total = np.zeros(c)
    for start, stop in eigen_parallel_blocks(blocks, cost, threads):
        sl = slice(start * rows, min(r, stop * rows))
        if sl.stop > sl.start:
            total = acc.add(total, reduce_sum(x[:, sl], acc, order="sequential", tally=tally), tally)
    return total


def _reduce_one(x: np.ndarray, acc: Arith, *, order: str, lanes: int, kahan: bool,
                tally: Tally | None, unroll: int = 1, row: int | Rows | CallShape | None = None) -> np.ndarray:
    place = row if isinstance(row, Rows) else None
    shape = row if isinstance(row, CallShape) else None
    row = row.length if isinstance(row, Rows) else None if isinstance(row, CallShape) else row
    if order == "sequential":
        return _sequential(x, acc, tally, kahan)
    if order == "pairwise":
        if kahan:
            raise BNProbeError("kahan compensation applies to the sequential and lanes orders, not pairwise")
        return tree_sum(x, acc, tally)
    if order == "lanes":
        if lanes < 1:
            raise BNProbeError(f"lanes must be >= 1, got {lanes}")
        return _lanes(x, acc, tally, lanes, kahan)
    if order == "vec":
        return _vec(x, acc, tally, lanes, unroll, row, kahan)
    if order == "rowlanes":
        return _rowlanes(x, acc, tally, lanes, row, kahan)
    if order == "lanes_tail":
        if kahan:
            raise BNProbeError("kahan compensation applies to the sequential and lanes orders, not lanes_tail")
        return _lanes_tail(x, acc, tally, lanes, row)
    if order in ("eigen", "omp_simd"):
        if kahan:
            raise BNProbeError(f"kahan compensation applies to the sequential and lanes orders, not {order}")
        return _eigen(x, acc, tally, lanes, row, place) if order == "eigen" else _omp_simd(x, acc, tally, lanes, row)
    if order == "inductor":
        # (rows shorter than lanes x unroll: one vector, inductor's tiling_factor // 2 for short 16-bit rows)
        return _inductor(x, acc, tally, lanes * (unroll if row is None or row >= lanes * unroll else 1), row)
    if order == "interleave4":
        return _interleave4(x, acc, tally, kahan)
    if order == "xla":
        if kahan:
            raise BNProbeError("kahan compensation is not an option of order=xla (YNNPACK's own Kahan step is)")
        return _xla(x, acc, tally, shape)
    if order == "aten":
        if kahan:
            raise BNProbeError("kahan compensation is not an option of order=aten")
        return aten_sum(x, acc, lanes=lanes, tally=tally)
    raise BNProbeError(f"unknown reduction order {order!r}; valid: {', '.join(ORDERS)}")

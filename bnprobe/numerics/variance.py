"""Per-channel mean and biased variance by the classic algorithms, every step rounded.

Error bounds (Chan, Golub & LeVeque 1983; kappa = ||x||_2 / sqrt(S), u = unit roundoff):
``naive`` N·kappa²·u (pairwise kappa²·u·log2 N), ``two_pass`` N·u + N²·kappa²·u²,
``welford`` N·kappa·u (pairwise kappa·u·log2 N).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.numerics import inductor
from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.reduce import CallShape, Cores, Rows, packet_split_sum, reduce_sum, thread_sum
from bnprobe.numerics.rowwise import rowwise_moments

__all__ = ["VARIANCES", "MEAN_BY", "StageValue", "Moments", "MomentsMethod", "Sums", "ThreadSums", "moments",
           "prescale_exponent", "INDUCTOR_TWO_PASS_MAX"]

# inductor: torch.compile's CPU var_mean (torch/_inductor/lowering.py, use_two_step_variance): two_pass when the count
# is at most INDUCTOR_TWO_PASS_MAX and there is more than one channel, else inductor's chunked Welford
# (bnprobe.numerics.inductor)
# rowwise: PyTorch CPU's RowwiseMoments (its LayerNorm and GroupNorm; bnprobe.numerics.rowwise.rowwise_moments)
VARIANCES: tuple[str, ...] = ("naive", "two_pass", "welford", "welford_ascend", "chan", "inductor", "rowwise")
#: inductor's config.cpp.use_two_step_variance_threshold
INDUCTOR_TWO_PASS_MAX = 1024
# divide: s / R, one rounding.  reciprocal: s * fl(1/R) (Ascend TBE).  prescaled: the addends are
# scaled by 2^-k (2^k the next power of two >= R, exact) before summing, then the sum is
# multiplied by fl(2^k / R) (Ascend BatchNormV3), which keeps large sums from overflowing.
MEAN_BY: tuple[str, ...] = ("divide", "reciprocal", "prescaled")


@dataclass
class StageValue:
    """One computed intermediate: its stored value, the float64 value it was rounded from, and events."""

    name: str
    value: np.ndarray
    wide: np.ndarray | None
    arith: Arith
    tally: Tally | None = None
    check_negative: bool = False


@dataclass
class Moments:
    mean: np.ndarray
    var: np.ndarray  # biased, after the optional clamp at 0
    stages: list[StageValue] = field(default_factory=list)


@dataclass(frozen=True)
class MomentsMethod:
    """How :func:`moments` computes: the variance ``algorithm`` (:data:`VARIANCES`) with its knobs (``tiles`` for
    chan, ``mean_by`` of :data:`MEAN_BY`, ``clamp`` a negative variance at 0) and how its sums are taken
    (:func:`~bnprobe.numerics.reduce.reduce_sum`'s ``order``, ``lanes``, ``kahan``, ``unroll`` and ``cores``; welford
    runs ``lanes`` updates side by side).  ``sum_format``: the format the naive and two-pass sums are carried in when
    wider than the accumulator (PyTorch's fp32 CPU kernel: double), each term rounded in the accumulator first; the
    mean is divided from the wide sum and rounded once, the sum of squared deviations is stored in the accumulator
    before its division (PyTorch's ``var_sum``, a float).  ``rowwise`` reads ``lanes``, ``pack`` (the accumulator
    vectors one load of the input fills: 2 for a 16-bit input) and ``fused`` (its scalar tail's M2 update by a fused
    multiply-add)."""

    algorithm: str = "two_pass"
    order: str = "pairwise"
    lanes: int = 64
    tiles: int = 8
    kahan: bool = False
    mean_by: str = "divide"
    clamp: bool = False
    unroll: int = 1
    cores: Cores = Cores()
    sum_format: str | None = None
    pack: int = 1
    fused: bool = False
    #: inductor: the threads its Welford splits each contiguous row across (1: none; a single row or a few long ones)
    row_threads: int = 1


def prescale_exponent(count: int) -> int:
    """k with 2^k the smallest power of two >= count."""
    return int(count - 1).bit_length()


def _scale_by_count(s: np.ndarray, count: np.ndarray | int, acc: Arith, mean_by: str,
                    tally: Tally | None) -> tuple[np.ndarray, np.ndarray]:
    """s / count: a correctly rounded division, s · fl(1/count), or (prescaled: s already holds
    the sum of x·2^-k) s · fl(2^k/count)."""
    with np.errstate(all="ignore"):
        if mean_by == "divide":
            wide = s / count
        elif mean_by == "reciprocal":
            wide = s * acc.round(1.0 / np.asarray(count, dtype=np.float64))
        elif mean_by == "prescaled":
            k = prescale_exponent(int(count))
            wide = s * acc.round(2.0**k / float(count))
        else:
            raise BNProbeError(f"unknown mean_by {mean_by!r}; valid: {', '.join(MEAN_BY)}")
    return acc.round(wide, tally), wide


def _tree(states: tuple[np.ndarray, ...], merge: Callable[..., tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Combine partial states along the last axis with the same halving tree as ``tree_sum``."""
    n = states[0].shape[-1]
    p = 1 << (n.bit_length() - 1)
    if p != n:
        head = merge(tuple(s[..., : n - p] for s in states), tuple(s[..., p:] for s in states))
        states = tuple(np.concatenate([h, s[..., n - p: p]], axis=-1) for h, s in zip(head, states))
    while states[0].shape[-1] > 1:
        h = states[0].shape[-1] // 2
        states = merge(tuple(s[..., :h] for s in states), tuple(s[..., h:] for s in states))
    return tuple(s[..., 0] for s in states)


def _chan_merge(acc: Arith, tally: Tally | None):
    """Chan et al.'s pairwise update of (count, mean, M2), every operation rounded in ``acc``."""

    def merge(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        na, ma, m2a = a
        nb, mb, m2b = b
        n = na + nb  # counts are exact integers
        with np.errstate(all="ignore"):
            empty = n == 0
            safe = np.where(empty, 1, n)
            delta = acc.sub(mb, ma, tally)
            mean = acc.add(ma, acc.mul(delta, acc.round(nb / safe), tally), tally)
            cross = acc.mul(acc.mul(delta, delta, tally), acc.round(na * nb / safe), tally)
            m2 = acc.add(acc.add(m2a, m2b, tally), cross, tally)
        return n, np.where(empty, 0.0, mean), np.where(empty, 0.0, m2)

    return merge


@dataclass
class _Stages:
    """The stages one moments computation records, in order, with the caller's overrides applied; ``pre`` is the
    prescaling of the sums (identity unless mean_by=prescaled)."""

    acc: Arith
    pre: Callable[[np.ndarray], np.ndarray]
    wide_sums: bool
    overrides: dict[str, np.ndarray]
    stages: list[StageValue] = field(default_factory=list)

    def wsum(self, v: np.ndarray, square: bool = False, prescaled: bool = True) -> np.ndarray | None:
        """The float64 sum of each row of v (or of v², formed exactly), prescaled when the sums are; None when
        not wanted."""
        if not self.wide_sums:
            return None
        v = np.asarray(v, dtype=np.float64)
        v = v * v if square else v
        return (self.pre(v) if prescaled else v).sum(axis=1)

    def __call__(self, name: str, value: np.ndarray, wide: np.ndarray | None, tally: Tally | None,
                 negative: bool = False) -> np.ndarray:
        if name in self.overrides:
            value = np.asarray(self.overrides[name], dtype=np.float64)
        self.stages.append(StageValue(name, value, wide, self.acc, tally, negative))
        return value


class Sums:
    """The per-channel sums the naive and two-pass algorithms need, each addend rounded in ``acc`` and
    prescaled by ``pre``, summed by reduce_sum with the options ``red`` — in ``wide`` when given (a wider running
    sum of terms rounded in ``acc``), else in ``acc``.  The sum of x reads x from memory (``red``'s ``row`` may say
    where its rows sit, :class:`~bnprobe.numerics.reduce.Rows`); the sums of squares and of squared deviations are of
    expressions (their rows' length alone)."""

    def __init__(self, acc: Arith, pre: Callable[[np.ndarray], np.ndarray], red: dict,
                 wide: Arith | None = None) -> None:
        self.acc, self.pre = acc, pre
        self.red = {k: v for k, v in red.items() if k != "vector_rows"}
        self.vector_rows = red.get("vector_rows")  # (the rows past it summed in order: a kernel's scalar path)
        self.wide = wide
        self.into = acc if wide is None else wide

    def expression(self) -> dict:
        """``red`` for the sum of an expression: the rows' length, not where x sits."""
        row = self.red.get("row")
        return {**self.red, "row": row.length if isinstance(row, Rows) else row}

    def _reduce(self, v: np.ndarray, t: Tally, red: dict) -> np.ndarray:
        """reduce_sum with ``red``, the rows past ``vector_rows`` in order (a kernel's scalar path)."""
        return packet_split_sum(v, self.into, self.vector_rows,
                                lambda rows, tt: reduce_sum(rows, self.into, tally=tt, **red), t)

    def total(self, x: np.ndarray, t: Tally) -> np.ndarray:
        """The sum of x."""
        return self._reduce(self.pre(x), t, self.red)

    def squares(self, x: np.ndarray, t: Tally) -> np.ndarray:
        """The sum of x*x."""
        return self._reduce(self.pre(self.acc.mul(x, x, t)), t, self.expression())

    def deviations(self, x: np.ndarray, mean: np.ndarray, t: Tally) -> tuple[np.ndarray, np.ndarray | None]:
        """The sum of (x - mean)² (stored in ``acc``: a wide sum is rounded to it) and the deviations x - mean
        (None where they were not kept)."""
        dev = self.acc.sub(x, mean[:, None], t)
        q = self._reduce(self.pre(self.acc.mul(dev, dev, t)), t, self.expression())
        return (q if self.wide is None else self.acc.round(q, t)), dev


class ThreadSums(Sums):
    """The naive and two-pass sums split across threads as PyTorch CPU's channels-last kernels split them
    (:func:`~bnprobe.numerics.reduce.thread_sum`): each of ``threads`` threads sums its contiguous rows in ``acc``,
    the threads' partials are added in thread order in ``wide`` (None: ``acc``); the squares and squared deviations
    are accumulated by fused multiply-adds when ``fused`` (GCC contracts ``y + (x − mean)·(x − mean)``).  ``split``
    and ``samples`` deal the rows another way (oneDNN's kernels deal samples: ``thread_blocks``)."""

    def __init__(self, acc: Arith, threads: int, wide: Arith | None = None, fused: bool = False, split: str = "rows",
                 samples: int | None = None) -> None:
        super().__init__(acc, lambda v: v, {}, wide)
        self.threads, self.fused, self.split, self.samples = threads, fused, split, samples

    def _sum(self, x: np.ndarray, t: Tally, times: np.ndarray | None = None) -> np.ndarray:
        return thread_sum(x, self.acc, threads=self.threads, wide=self.wide, times=times, fused=self.fused, tally=t,
                          split=self.split, samples=self.samples)

    def total(self, x: np.ndarray, t: Tally) -> np.ndarray:
        return self._sum(x, t)

    def squares(self, x: np.ndarray, t: Tally) -> np.ndarray:
        return self._sum(x, t, times=x)

    def deviations(self, x: np.ndarray, mean: np.ndarray, t: Tally) -> tuple[np.ndarray, np.ndarray | None]:
        dev = self.acc.sub(x, mean[:, None], t)
        q = self._sum(dev, t, times=dev)
        return (q if self.wide is None else self.acc.round(q, t)), dev


_Result = tuple[np.ndarray, np.ndarray, "np.ndarray | None", Tally]  # mean, variance, its float64 value, tally


def _naive(x: np.ndarray, acc: Arith, stage: _Stages, sums: Sums, mean_by: str) -> _Result:
    """E[x²] − E[x]² from a sum and a sum of squares."""
    c, r = x.shape
    t = Tally(c)
    s = stage("sum", sums.total(x, t), stage.wsum(x), t)
    t = Tally(c)
    q = stage("sum_sq", sums.squares(x, t), stage.wsum(x, square=True), t)
    t = Tally(c)
    mean, wide = _scale_by_count(s, r, acc, mean_by, t)
    mean = stage("mean", mean, wide, t)
    t = Tally(c)
    ex2, wide = _scale_by_count(q, r, acc, mean_by, t)
    ex2 = stage("ex2", ex2, wide, t)
    t = Tally(c)
    msq = stage("mean_sq", acc.mul(mean, mean, t), mean * mean, t)
    t = Tally(c)
    wide = ex2 - msq
    return mean, acc.round(wide, t), wide, t


def _two_pass(x: np.ndarray, acc: Arith, stage: _Stages, sums: Sums, mean_by: str) -> _Result:
    """The mean, then the sum of squared deviations from it."""
    c, r = x.shape
    t = Tally(c)
    s = stage("sum", sums.total(x, t), stage.wsum(x), t)
    t = Tally(c)
    mean, wide = _scale_by_count(s, r, acc, mean_by, t)
    mean = stage("mean", mean, wide, t)
    t = Tally(c)
    q, dev = sums.deviations(x, mean, t)
    q = stage("sum_sq_dev", q, stage.wsum(dev, square=True), t)
    t = Tally(c)
    var, wide = _scale_by_count(q, r, acc, mean_by, t)
    return mean, var, wide, t


def _welford(x: np.ndarray, acc: Arith, stage: _Stages, algorithm: str, lanes: int, mean_by: str) -> _Result:
    """One running update per lane of ``lanes`` (welford; or welford_ascend, BatchNormV3's update), the lanes
    merged by Chan's formula."""
    c, r = x.shape
    t = Tally(c)
    reps = -(-r // lanes)
    pad = reps * lanes - r
    xp = np.concatenate([x, np.zeros((c, pad), dtype=x.dtype)], axis=1) if pad else x
    blocks = xp.reshape(c, reps, lanes)
    mean = np.zeros((c, lanes))
    m2 = np.zeros((c, lanes))
    lane_idx = np.arange(lanes)
    for k in range(reps):
        xk = blocks[:, k, :]
        valid = (k * lanes + lane_idx) < r
        n = float(k + 1)
        delta = acc.sub(xk, mean, t)
        if algorithm == "welford":
            new_mean = acc.add(mean, acc.div(delta, n, t), t)
            new_m2 = acc.add(m2, acc.mul(delta, acc.sub(xk, new_mean, t), t), t)
        else:  # Ascend BatchNormV3: mean += δ·fl(1/n); M2 += fl(δ²)·fl((n-1)/n)
            new_mean = acc.add(mean, acc.mul(delta, acc.round(1.0 / n), t), t)
            new_m2 = acc.add(m2, acc.mul(acc.mul(delta, delta, t), acc.round((n - 1) / n), t), t)
        mean = np.where(valid, new_mean, mean)
        m2 = np.where(valid, new_m2, m2)
    counts = np.broadcast_to(((r - lane_idx + lanes - 1) // lanes).astype(np.float64), (c, lanes))
    return _merged(x, acc, stage, _tree((counts, mean, m2), _chan_merge(acc, t)), t, mean_by)


def _welford_inductor(x: np.ndarray, acc: Arith, stage: _Stages, method: MomentsMethod,
                      row: int | Rows | None) -> _Result:
    """inductor's chunked Welford (:func:`bnprobe.numerics.inductor.welford`; its threads the method's cores, when
    they take OpenMP's schedule), the variance M2 / count."""
    c, r = x.shape
    t = Tally(c)
    row = row.length if isinstance(row, Rows) else row
    threads = method.cores.parts if method.cores.schedule == "openmp" else 1
    if method.row_threads > 1:
        mean, m2 = inductor.welford_split_rows(x, acc, lanes=method.lanes, unroll=method.unroll,
                                               threads=method.row_threads, tally=t)
    else:
        mean, m2 = inductor.welford(x, acc, lanes=method.lanes, unroll=method.unroll, row=row, threads=threads,
                                    tally=t)
    mean_by = method.mean_by
    return _merged(x, acc, stage, (np.full(c, float(r)), mean, m2), t, mean_by)


def _rowwise(x: np.ndarray, acc: Arith, stage: _Stages, method: MomentsMethod) -> _Result:
    """PyTorch CPU's RowwiseMoments (:func:`~bnprobe.numerics.rowwise.rowwise_moments`), the variance M2 / count."""
    c, r = x.shape
    t = Tally(c)
    mean, m2 = rowwise_moments(x, acc, lanes=method.lanes, pack=method.pack, fused_tail=method.fused,
                               tally=t if acc.counting else None)
    return _merged(x, acc, stage, (np.full(c, float(r)), mean, m2), t, method.mean_by)


def _chan(x: np.ndarray, acc: Arith, stage: _Stages, tiles: int, red: dict, mean_by: str) -> _Result:
    """``tiles`` contiguous tiles, as on simulated cores, each two-pass, merged by Chan's formula."""
    c, r = x.shape
    t = Tally(c)
    ntiles = max(1, min(tiles, r))
    pieces = np.array_split(np.arange(r), ntiles)
    counts, means, m2s = np.empty((c, ntiles)), np.empty((c, ntiles)), np.empty((c, ntiles))
    tile_red = {k: red[k] for k in ("order", "lanes", "kahan", "unroll")}
    for i, idx in enumerate(pieces):
        xt = x[:, idx[0]: idx[-1] + 1]
        st = reduce_sum(xt, acc, tally=t, **tile_red)
        mt, _ = _scale_by_count(st, len(idx), acc, mean_by, t)
        dev = acc.sub(xt, mt[:, None], t)
        counts[:, i] = len(idx)
        means[:, i] = mt
        m2s[:, i] = reduce_sum(acc.mul(dev, dev, t), acc, tally=t, **tile_red)
    return _merged(x, acc, stage, _tree((counts, means, m2s), _chan_merge(acc, t)), t, mean_by)


def _merged(x: np.ndarray, acc: Arith, stage: _Stages, merged: tuple[np.ndarray, ...], t: Tally,
            mean_by: str) -> _Result:
    """The stages of a merged (count, mean, M2) state, and the variance M2 / count."""
    c, r = x.shape
    _, mean, m2 = merged
    mean = stage("mean", mean, stage.wsum(x, prescaled=False) / r if stage.wide_sums else None, t)
    m2 = stage("m2", m2, None, t)
    t = Tally(c)
    var, wide = _scale_by_count(m2, r, acc, mean_by, t)
    return mean, var, wide, t


def moments(
    x: np.ndarray,
    acc: Arith,
    method: MomentsMethod = MomentsMethod(),
    *,
    rng: np.random.Generator | None = None,
    row: int | Rows | CallShape | None = None,
    vector_rows: int | None = None,
    overrides: dict[str, np.ndarray] | None = None,
    wide_sums: bool = True,
    sums: Sums | None = None,
    channels: int | None = None,
) -> Moments:
    """Mean and biased variance of each row of a ``(C, R)`` array of ``acc``-format values, by ``method``.

    algorithm: ``naive`` (E[x²] − E[x]² from a sum and a sum of squares),
    ``two_pass`` (mean, then the sum of squared deviations), ``welford`` (one
    running update per lane of ``lanes``, lanes merged by Chan's formula),
    ``chan`` (``tiles`` contiguous tiles, as on simulated cores, each two-pass,
    merged by Chan's formula).  ``clamp`` sets a negative variance to 0.  ``unroll`` and ``row`` (the length of the
    layout's contiguous rows) shape the ``vec`` order (:func:`~bnprobe.numerics.reduce.reduce_sum`); ``rng`` orders
    an atomic combine of the cores' sums; ``vector_rows``: the naive and two-pass sums of the rows past it are
    sequential (a kernel's scalar path, :func:`~bnprobe.numerics.reduce.reduce_sum`).
    ``wide_sums=False`` skips the float64 reference sums recorded as the stages'
    ``wide`` values (a trace that keeps no arrays does not need them).  ``sums`` forms the naive and
    two-pass sums instead of :class:`Sums` (the compiled route's, bnprobe.kernels.fused; the same values).
    ``row`` may be a :class:`~bnprobe.numerics.reduce.Rows` saying where x's rows sit in memory (the ``eigen``
    order's aligned packets).
    ``inductor`` is torch.compile's choice between two_pass and its own Welford (:data:`VARIANCES`), which reads the
    call's ``channels`` (default: the rows of x).  ``rowwise`` is PyTorch CPU's RowwiseMoments, each row of x
    one contiguous row of its input.
    """
    algorithm, mean_by = method.algorithm, method.mean_by
    r = x.shape[1]
    if algorithm not in VARIANCES:
        raise BNProbeError(f"unknown variance algorithm {algorithm!r}; valid: {', '.join(VARIANCES)}")
    if mean_by == "prescaled" and algorithm not in ("naive", "two_pass"):
        raise BNProbeError(f"mean_by=prescaled scales the sums of naive and two_pass, not {algorithm}")
    wide = None if method.sum_format in (None, acc.fmt.name) else Arith(method.sum_format, counting=acc.counting)
    red = dict(order=method.order, lanes=method.lanes, kahan=method.kahan, cores=method.cores, rng=rng,
               unroll=method.unroll, row=row, vector_rows=vector_rows)
    # prescaled: every addend is multiplied by 2^-k first (exact unless it underflows)
    pre = (lambda v: acc.round(v * 2.0 ** -prescale_exponent(r))) if mean_by == "prescaled" else (lambda v: v)
    stage = _Stages(acc, pre, wide_sums, overrides or {})
    with np.errstate(all="ignore"):
        if algorithm == "naive":
            mean, var, wide, t = _naive(x, acc, stage, sums or Sums(acc, pre, red, wide), mean_by)
        elif algorithm == "two_pass":
            mean, var, wide, t = _two_pass(x, acc, stage, sums or Sums(acc, pre, red, wide), mean_by)
        elif algorithm == "inductor" and (r > INDUCTOR_TWO_PASS_MAX or (channels or x.shape[0]) == 1):
            mean, var, wide, t = _welford_inductor(x, acc, stage, method, row)
        elif algorithm == "inductor":
            mean, var, wide, t = _two_pass(x, acc, stage, sums or Sums(acc, pre, red, wide), mean_by)
        elif algorithm == "rowwise":
            mean, var, wide, t = _rowwise(x, acc, stage, method)
        elif algorithm in ("welford", "welford_ascend"):
            mean, var, wide, t = _welford(x, acc, stage, algorithm, method.lanes, mean_by)
        else:  # chan
            mean, var, wide, t = _chan(x, acc, stage, method.tiles, red, mean_by)
        if method.clamp:
            var = np.where(var < 0, 0.0, var)
        var = stage("var", var, wide, t, negative=True)
    return Moments(mean=mean, var=var, stages=stage.stages)

"""Each rank's y and dx against the golden of the concatenated batch, elementwise (SyncBatchNorm).

A SyncBatchNorm rank normalises its slice with the global statistics, and its backward all-reduces Σdy and Σdy·x̂:
the golden of rank r is, in float64 on the rank's own rounded inputs,

    y_r  = γ·(x_r − μ)·invstd + β
    dx_r = γ·invstd·(dy_r − Σdy/N − x̂_r·Σ(dy·x̂)/N)        (μ, invstd, the sums and N over every rank)

Each element may err by what a correct rank makes: half an ulp of its output format, the elementwise roundings
(``RANK_TOLERANCES["elementwise_ulps"]`` units of the accumulation format of the magnitudes the element is formed
from), and the error its statistics may carry and still be taken for the global ones
(:func:`~bnprobe.checks.ranks.check.statistics_tolerance`, in x̂ units: γ·that·(1 + |x̂|) in y).  The worst element over
its bound is the rank's ratio (<= 1 passes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.formats import get_format
from bnprobe.kernels.layout import layout_of
from bnprobe.core.tolerances import ACCUMULATION_FORMAT, RANK_TOLERANCES

__all__ = ["RankOutput", "rank_outputs"]


@dataclass(frozen=True)
class RankOutput:
    """One output of one rank against the concatenated batch's golden: the worst element's error over its bound
    (<= 1 passes), that error, its bound and where."""

    rank: int
    tensor: str
    ratio: float
    error: float
    bound: float
    where: str

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0

    def describe(self) -> str:
        return (f"rank {self.rank}'s {self.tensor} is off the concatenated batch's golden by {self.error:.3g} at "
                f"{self.where} ({self.ratio:.3g}x the {self.bound:.3g} a correct SyncBatchNorm rank may err by)")


def _col(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float64)[:, None]


def _judge(rank: int, tensor: str, got: np.ndarray, gold: np.ndarray, bound: np.ndarray,
           finite: np.ndarray) -> RankOutput | None:
    """The worst element of ``got`` (C, R) against ``gold`` over ``bound``, on the channels ``finite``."""
    if not finite.any():
        return None
    with np.errstate(all="ignore"):
        err = np.abs(got - gold)
        same = (got == gold) | (np.isnan(got) & np.isnan(gold))
        ratio = np.where(same, 0.0, err / bound)
        ratio = np.where(np.isfinite(ratio), ratio, np.inf)[finite]
    if not ratio.size:
        return None
    c, i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    ch = int(np.flatnonzero(finite)[c])
    return RankOutput(rank, tensor, float(ratio[c, i]), float(err[ch, i]), float(bound[ch, i]),
                      f"channel {ch}, element {int(i)}")


def _views(rec: Any, mu: np.ndarray, inv: np.ndarray) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray,
                                                                 np.ndarray]:
    """(layout, the training inputs and outputs, γ, β, x channel-first, x̂ under the global statistics)."""
    ins, outs = rec.tensors["train"]["inputs"], rec.tensors["train"].get("outputs", {})
    lay = layout_of(ins["x"], rec.layout)
    x = lay.to_cr(ins["x"])
    c = x.shape[0]
    g = np.ones(c) if ins.get("gamma") is None else np.asarray(ins["gamma"], dtype=np.float64)
    b = np.zeros(c) if ins.get("beta") is None else np.asarray(ins["beta"], dtype=np.float64)
    with np.errstate(all="ignore"):
        xhat = (x - mu) * inv
    return lay, outs, g, b, x, xhat


def rank_outputs(ranks: list[tuple[int, Callable[[], Any]]], mean: np.ndarray, invstd: np.ndarray,
                 finite: np.ndarray, tol: np.ndarray) -> list[RankOutput]:
    """Every rank's recorded y (and dx, when every rank recorded its backward) against the concatenated batch's
    golden; ``ranks``: (rank, a function loading its recording) in rank order, each loaded when needed and let go
    (y and the backward's sums in one pass, dx in a second), ``mean``/``invstd`` the global golden statistics,
    ``finite`` the channels to judge, ``tol`` the statistics' tolerance in x̂ units per channel."""
    out: list[RankOutput] = []
    mu, inv = _col(mean), _col(invstd)
    sums: list[np.ndarray] | None = [np.zeros(mean.shape), np.zeros(mean.shape), np.zeros(mean.shape),
                                     np.zeros(mean.shape)]
    n = 0
    for rank, load in ranks:
        rec = load()
        dtype = rec.dtype
        u = get_format(ACCUMULATION_FORMAT.get(get_format(dtype).name, "fp32")).unit_roundoff
        k_el = RANK_TOLERANCES["elementwise_ulps"]
        lay, outs, g, b, x, xhat = _views(rec, mu, inv)
        if "y" in outs:
            y = lay.to_cr(np.asarray(outs["y"], dtype=np.float64))
            fmt = rec.formats.get("train.outputs.y", dtype)
            with np.errstate(all="ignore"):
                gold = _col(g) * xhat + _col(b)
                bound = 0.5 * get_format(fmt).ulp(gold) + k_el * u * (np.abs(gold) + np.abs(_col(b))
                                                                      + np.abs(x * _col(g) * inv)) \
                    + np.abs(_col(g)) * _col(tol) * (1.0 + np.abs(xhat))
            judged = _judge(rank, "y", y, gold, bound, finite)
            if judged is not None:
                out.append(judged)
        bw = rec.tensors.get("backward", {})
        dy, dx = bw.get("inputs", {}).get("dy"), bw.get("outputs", {}).get("dx")
        if sums is not None and dy is not None and dx is not None:
            dy = lay.to_cr(np.asarray(dy, dtype=np.float64))
            with np.errstate(all="ignore"):
                for acc, v in zip(sums, (dy, dy * xhat, np.abs(dy), np.abs(dy * xhat))):
                    acc += v.sum(axis=1)
            n += xhat.shape[1]
        else:
            sums = None  # some rank has no backward: dx is not judged
        del rec, x, xhat
    if sums is not None and ranks:
        out += _dx(ranks, mu, inv, finite, tol, sums, n)
    return out


def _dx(ranks: list[tuple[int, Callable[[], Any]]], mu: np.ndarray, inv: np.ndarray, finite: np.ndarray,
        tol: np.ndarray, sums: list[np.ndarray], n: int) -> list[RankOutput]:
    """dx of every rank against SyncBatchNorm's backward of the concatenated batch (``sums``: Σdy, Σdy·x̂, Σ|dy| and
    Σ|dy·x̂| over every rank, ``n`` values per channel), each rank loaded again."""
    s_dy, s_dyx = sums[0][:, None], sums[1][:, None]
    a_dy, a_dyx = sums[2][:, None] / n, sums[3][:, None] / n
    out = []
    for rank, load in ranks:
        rec = load()
        u = get_format(ACCUMULATION_FORMAT.get(get_format(rec.dtype).name, "fp32")).unit_roundoff
        elem = u * RANK_TOLERANCES["elementwise_ulps"]
        lay, _, g, _, _, xhat = _views(rec, mu, inv)
        bw = rec.tensors["backward"]
        dy = lay.to_cr(np.asarray(bw["inputs"]["dy"], dtype=np.float64))
        dx = lay.to_cr(np.asarray(bw["outputs"]["dx"], dtype=np.float64))
        fmt = rec.formats.get("backward.outputs.dx", rec.dtype)
        with np.errstate(all="ignore"):
            f = _col(g) * inv
            gold = f * (dy - s_dy / n - xhat * s_dyx / n)
            natural = np.abs(f) * (np.abs(dy) + a_dy + np.abs(xhat) * a_dyx)
            bound = 0.5 * get_format(fmt).ulp(gold) + (elem + 2.0 * _col(tol)) * natural * (1.0 + np.abs(xhat))
        judged = _judge(rank, "dx", dx, gold, bound, finite)
        if judged is not None:
            out.append(judged)
        del rec, xhat, dy, dx, gold, natural, bound
    return out

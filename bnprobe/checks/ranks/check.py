"""check_ranks: which statistics each rank of a multi-rank step normalised with, from per-rank dumps.

Given each rank's recording of the same layer at the same step, the golden global statistics are the
float64 mean and biased variance of the concatenated batch (count: the sum of the ranks' counts).  Each
rank's statistics (its saved mean and invstd or variance; without them, recovered from y = γ·(x − mean)·invstd
+ β by a least-squares fit, with the bound of the fit's error from y's rounding) are compared with

- its own slice's golden statistics: ``local`` -- plain BatchNorm under DDP, every rank its own;
- the global golden statistics: ``global`` -- SyncBatchNorm;
- both within tolerance: ``either`` -- on this data the two cannot be told apart;

at the tolerance of ``bnprobe.core.tolerances.RANK_TOLERANCES`` (the error the statistics put into x̂, scaled by
the accumulation's condition 1 + |mean|·invstd).  A rank that matches neither is ``neither``, and the merge
variants real implementations use are tried, each computed from the ranks' slices in float64 and rounded as
the variant rounds: ``unweighted`` (the average of the rank means and of the rank variances, counts ignored),
``sums`` (all-reduced Σx and Σx², var = E[x²] − E[x]²) and ``chan`` (Chan's merge of the gathered counts,
means and invstd), with the all-reduce in fp32, fp16 or bf16 -- so the report names the merge.

Ranks that used the global statistics pass; ranks that used their own pass with a note (plain BatchNorm is not
a failure unless ``expect="sync"``); a rank that used neither, and ranks that disagree with each other, fail.
The running statistics: did the ranks hold the same ones before the step (DDP broadcasts rank 0's buffers),
and after it (bit-identical when they saved the same statistics; a difference beyond a few ulps then fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from bnprobe.adapters.base import Saved
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Judged, Verdict
from bnprobe.kernels.layout import layout_of
from bnprobe.numerics.rounding import round_to
from bnprobe.checks.ranks.outputs import rank_outputs
from bnprobe.recordings import Recording
from bnprobe.core.tolerances import ACCUMULATION_FORMAT, RANK_TOLERANCES

__all__ = ["USED", "MERGE_VARIANTS", "RankRow", "RankReport", "check_ranks", "variant_statistics",
           "statistics_tolerance"]

# either: its own and the global statistics agree within tolerance on this data, so either may be what it used
USED = ("global", "local", "either", "neither", "unknown")
EXPECT = ("sync", "local")
# the merge variants tried on a rank that used neither its own nor the global statistics, as (merge, all-reduce
# format); chan in the accumulation format itself is the global statistics
MERGE_VARIANTS: tuple[tuple[str, str], ...] = (
    ("unweighted", "fp32"), ("unweighted", "fp16"), ("unweighted", "bf16"), ("sums", "fp32"), ("sums", "fp16"),
    ("sums", "bf16"), ("chan", "fp16"), ("chan", "bf16"))
_MERGE_TEXT = {"unweighted": "the unweighted average of the rank means and variances",
               "sums": "all-reduced Σx and Σx² with var = E[x²]−E[x]²",
               "chan": "Chan's merge of the rank counts, means and variances"}


@dataclass(frozen=True)
class RankRow:
    """One rank: the statistics it used and what they match.  Ratios are the worst channel's error over its
    tolerance (<= 1: within; the smallest tolerance that would have passed, as a multiple of the one used)."""

    rank: int
    samples: int  # N of its slice
    count: int  # values per channel (N·spatial)
    source: str  # where its statistics come from: saved, y (fitted) or none
    used: str  # global, local, either (its own and the global agree on this data), neither or unknown
    passed: bool
    merge: str = ""  # for neither: the merge variant that reproduces them, e.g. "unweighted/fp32"
    global_ratio: float = math.nan
    local_ratio: float = math.nan
    merge_ratio: float = math.nan
    mean_error: float = math.nan  # worst |mean - global mean|·global invstd (in units of the global σ)
    invstd_error: float = math.nan  # worst |invstd / global invstd - 1|
    channel: int = -1  # the channel of the worst error against the global statistics
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": Verdict.of(self.passed)}


@dataclass(frozen=True)
class RankReport(Judged):
    """check_ranks' result: one row per rank, the golden global statistics, the running statistics'
    agreement across ranks, what failed and notes.  Truthy when it passed."""

    call: str
    dtype: str
    kind: str  # syncbn (global), local (their own), either (cannot tell), mixed, merge (some used neither), unchecked
    rows: list[RankRow]
    golden: dict[str, Any]  # count, mean, var (the concatenated batch, float64)
    running: dict[str, Any]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def frame(self):  # -> pandas.DataFrame
        """One row per rank (:meth:`to_frame`; ``rows`` holds them as :class:`RankRow`)."""
        return self.to_frame()

    @property
    def summary(self) -> str:
        """One line: the verdict and what the ranks used."""
        head = {"syncbn": "every rank used the global statistics (SyncBatchNorm)",
                "local": "every rank used its own batch's statistics (plain BatchNorm per rank)",
                "either": "the ranks' own statistics agree with the global ones on this data: SyncBatchNorm and plain "
                          "BatchNorm cannot be told apart",
                "mixed": "ranks used different statistics", "merge": "some rank used a merge of rank statistics",
                "unchecked": "no rank's statistics could be checked"}[self.kind]
        return f"{self.call}: {head}: {'pass' if self.passed else 'FAIL: ' + self.failures[0]}"

    def to_frame(self):  # -> pandas.DataFrame
        import pandas as pd

        return pd.DataFrame([{"call": self.call, "dtype": self.dtype, **r.to_dict()} for r in self.rows])

    def to_dict(self) -> dict[str, Any]:
        return {"call": self.call, "dtype": self.dtype, "kind": self.kind, "passed": self.passed,
                "summary": self.summary, "failures": self.failures, "notes": self.notes, "golden": self.golden,
                "running": self.running, "rows": [r.to_dict() for r in self.rows]}


# ---- the ranks' data ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rank:
    """One rank's call reduced to what the check needs (the first level: computed where the call is read, so
    that a layer of many ranks never holds more than one call's tensors)."""

    rank: int
    samples: int
    count: int  # values per channel (N·spatial)
    mean: np.ndarray | None  # the statistics it used, float64 (NaN on channels a fit cannot recover)
    invstd: np.ndarray | None
    source: str
    uncertainty: np.ndarray | float  # of recovered statistics, in x̂ units (0 for saved ones)
    saved_format: str
    moments: _Moments  # of its slice, float64
    key: dict[str, Any]  # what must be alike across ranks of one layer
    info: dict[str, Any]  # dtype, eps, params, formats, call and source of the recording
    running: dict[str, dict[str, np.ndarray]]  # "inputs" / "outputs": the running statistics recorded
    saved: tuple[Any, Any] | None  # (saved_mean, saved_value) as recorded


@dataclass(frozen=True)
class _Moments:
    """Per channel, in float64, what every merge of one rank's slice is made of: its count, mean and biased
    variance (as ``x.mean`` / ``((x - mean)²).mean`` give them), Σx and Σx²."""

    count: int
    mean: np.ndarray
    var: np.ndarray
    total: np.ndarray
    squares: np.ndarray
    low: np.ndarray  # the mean's rounding error, mean(x − mean): the exact mean is about mean + low


def _moments_of(x: np.ndarray) -> _Moments:
    with np.errstate(all="ignore"):
        mean = x.mean(axis=1)
        d = x - mean[:, None]
        low = d.mean(axis=1)
        var = ((d - low[:, None]) ** 2).mean(axis=1)
        return _Moments(int(x.shape[1]), mean, var, x.sum(axis=1), (x * x).sum(axis=1), low)


def _merged(parts: list[_Moments]) -> tuple[int, np.ndarray, np.ndarray]:
    """(count, mean, biased variance) of the concatenated batch from its ranks' moments, in float64, by Chan's merge
    of their M2 with each mean carried as mean + low (a two-term sum): the ranks' deviations from the global mean are
    then exact to float64 even far off zero, where the float64 means alone lose mean·2⁻⁵³ and the merged variance
    ulp(mean)·|deviation|/var of its digits."""
    n = sum(p.count for p in parts)
    with np.errstate(all="ignore"):
        head = sum(p.total for p in parts) / n
        dev = [(p.mean - head) + p.low for p in parts]  # p.mean − head is exact where the two are within 2x
        tail = sum(p.count * d for p, d in zip(parts, dev)) / n
        m2 = sum(p.count * (p.var + (d - tail) ** 2) for p, d in zip(parts, dev))
        return n, head + tail, m2 / n


def _accumulation(dtype: str) -> str:
    return ACCUMULATION_FORMAT.get(get_format(dtype).name, "fp32")


def _u(fmt: str) -> float:
    return get_format(fmt).unit_roundoff


def _from_y(x: np.ndarray, y: np.ndarray, gamma: np.ndarray, beta: np.ndarray, y_fmt: str,
            acc: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, invstd, bound of their error in x̂ units) recovered from y = a·x + b per channel by least squares,
    with each y element's error bounded by half an ulp of y's format plus the elementwise roundings; NaN on
    channels where x is constant or γ is 0."""
    with np.errstate(all="ignore"):
        xm = x.mean(axis=1)
        xc = x - xm[:, None]
        sxx = (xc * xc).sum(axis=1)
        a = (xc * y).sum(axis=1) / sxx
        c = y.mean(axis=1)
        h = 0.5 * get_format(y_fmt).ulp(np.abs(y)) + RANK_TOLERANCES["elementwise_ulps"] * _u(acc) * (
            np.abs(y) + np.abs(beta)[:, None] + np.abs(a[:, None] * x))
        da = (np.abs(xc) * h).sum(axis=1) / sxx
        dc = h.mean(axis=1)
        inv = a / gamma
        mean = xm - (c - beta) / a
        unc = da / np.abs(a) + (dc + np.abs(c - beta) * da / np.abs(a)) / np.abs(gamma)
        bad = (sxx <= 0) | (gamma == 0) | (a == 0) | ~np.isfinite(unc) | ~np.isfinite(mean) | ~np.isfinite(inv)
    return np.where(bad, np.nan, mean), np.where(bad, np.nan, inv), np.where(bad, np.nan, unc)


def _rank(r: int, rec: Recording) -> _Rank:
    """One rank's statistics (saved, else recovered from y, else none) and its slice's moments."""
    if "train" not in rec.tensors:
        raise BNProbeError(f"rank {r}'s recording has no training forward: check_ranks compares the statistics of "
                           "a training step")
    ins, outs = rec.tensors["train"]["inputs"], rec.tensors["train"].get("outputs", {})
    lay = layout_of(ins["x"], rec.layout)
    x = lay.to_cr(ins["x"])
    c = lay.channels
    shape = tuple(np.shape(ins["x"]))
    common = dict(rank=r, samples=lay.shape[0], count=int(x.shape[1]), moments=_moments_of(x),
                  key={"dtype": rec.dtype, "layout": rec.layout, "eps": rec.eps, "x shape (apart from N)": shape[1:]},
                  info={"dtype": rec.dtype, "eps": rec.eps, "params": rec.params, "formats": dict(rec.formats),
                        "call": rec.meta.get("call"), "source": rec.source},
                  running={io: {n: np.asarray(v, dtype=np.float64) for n, v in rec.tensors["train"].get(io, {}).items()
                                if n.startswith("running_")} for io in ("inputs", "outputs")},
                  saved=(outs.get("saved_mean"), outs.get("saved_value")) if "saved_mean" in outs else None)
    if "saved_mean" in outs and "saved_value" in outs and rec.saved_kind:
        sv = Saved(outs["saved_mean"], rec.saved_kind, outs["saved_value"])
        fmt = rec.formats.get("train.outputs.saved_value", "fp64")
        return _Rank(mean=np.asarray(sv.mean, dtype=np.float64), invstd=sv.invstd(rec.eps), source="saved",
                     uncertainty=0.0, saved_format=fmt, **common)
    g = ins.get("gamma")
    b = ins.get("beta")
    g = np.ones(c) if g is None else np.asarray(g, dtype=np.float64)
    b = np.zeros(c) if b is None else np.asarray(b, dtype=np.float64)
    if "y" in outs:
        fmt = rec.formats.get("train.outputs.y", rec.dtype)
        mean, inv, unc = _from_y(x, lay.to_cr(outs["y"]), g, b, fmt, _accumulation(rec.dtype))
        if np.isfinite(mean).any():
            return _Rank(mean=mean, invstd=inv, source="y", uncertainty=unc, saved_format=fmt, **common)
    return _Rank(mean=None, invstd=None, source="none", uncertainty=0.0, saved_format=rec.dtype, **common)


def _recording(v: Recording | Callable[[], Recording]) -> Recording:
    return v() if callable(v) else v


def _load(recordings: Mapping[int, Recording]) -> list[_Rank]:
    """The ranks in rank order, their recordings checked to be of one layer (dtype, layout, eps, channels and the
    spatial size alike)."""
    if not recordings:
        raise BNProbeError("check_ranks needs the recordings of at least one rank")
    ranks = [_rank(int(r), _recording(recordings[r])) for r in sorted(recordings, key=int)]  # one call at a time
    first = ranks[0]
    for k in ranks[1:]:
        for what, mine in k.key.items():
            theirs = first.key[what]
            if mine != theirs:
                raise BNProbeError(f"rank {k.rank}'s recording has {what} {mine} but rank {first.rank}'s has {theirs}: "
                                   "check_ranks compares one layer's call across ranks")
    return ranks


# ---- statistics and tolerances --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Context:
    """What every rank is judged against: the golden global statistics, the ranks' slices and sizes."""

    dtype: str
    eps: float
    count: int
    mean: np.ndarray
    invstd: np.ndarray
    parts: list[_Moments]
    samples: list[int]
    finite: np.ndarray  # channels whose x is finite on every rank (the others are left out)
    variants: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def variant(self, merge: str, reduce: str) -> tuple[np.ndarray, np.ndarray]:
        """A merge variant's statistics, computed once."""
        key = (merge, reduce)
        if key not in self.variants:
            self.variants[key] = _variant(self.parts, merge, reduce, eps=self.eps, compute=_accumulation(self.dtype))
        return self.variants[key]


def _invstd(var: np.ndarray, eps: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        return 1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps)


def _var(invstd: np.ndarray, eps: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        return 1.0 / np.asarray(invstd, dtype=np.float64) ** 2 - eps


def statistics_tolerance(mean: np.ndarray, invstd: np.ndarray, count: int, dtype: str,
                         saved_format: str) -> np.ndarray:
    """Per channel, how far statistics may lie from the reference ``mean`` / ``invstd`` and still be taken for
    them, in x̂ units (|Δmean|·invstd, and |Δinvstd|/invstd): the accumulation's error over ``count`` values and
    the saved format's rounding, scaled by 1 + |mean|·invstd (``bnprobe.core.tolerances.RANK_TOLERANCES``)."""
    t = RANK_TOLERANCES
    units = (t["sum_ulps"] + math.sqrt(count)) * _u(_accumulation(dtype)) + t["stored_ulps"] * _u(saved_format)
    with np.errstate(all="ignore"):
        cond = 1.0 + np.abs(np.asarray(mean, dtype=np.float64)) * np.abs(np.asarray(invstd, dtype=np.float64))
    return units * np.where(np.isfinite(cond), cond, 1.0)


def _cancellation(ctx: _Context, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What E[x²] − E[x]² may carry from its partial sums' accumulation error alone (each sum off by
    (sum_ulps + sqrt(count))·u of itself, so the variance by up to 3·that·E[x²]): (the relative invstd error that
    allows, where the variance is the variant's ``var``; whether that noise reaches below -eps, where any invstd,
    NaN included, is rounding noise)."""
    a = (RANK_TOLERANCES["sum_ulps"] + math.sqrt(ctx.count)) * _u(_accumulation(ctx.dtype))
    with np.errstate(all="ignore"):
        noise = 3.0 * a * (1.0 / ctx.invstd**2 - ctx.eps + ctx.mean**2)
        rel = noise / (2.0 * np.abs(var + ctx.eps))
        return np.where(np.isfinite(rel), rel, np.inf), ~(noise < var + ctx.eps)


def _ratio(mean: np.ndarray, inv: np.ndarray, ref_mean: np.ndarray, ref_inv: np.ndarray, tol: np.ndarray,
           tol_inv: np.ndarray | None = None, noise: np.ndarray | None = None,
           unit: np.ndarray | None = None) -> np.ndarray:
    """Per channel: the worse of the mean's error in units of σ (1/``unit``, default 1/``ref_inv``) over ``tol``
    and the invstd's relative error over ``tol_inv`` (``tol`` when None), the invstd left out where ``noise``
    says it is rounding noise; equal values (NaN and inf included) agree, a non-finite value on one side only is
    infinitely far."""
    with np.errstate(all="ignore"):
        same_inv = (inv == ref_inv) | (np.isnan(inv) & np.isnan(ref_inv))
        em = np.where(mean == ref_mean, 0.0, np.abs(mean - ref_mean) * np.abs(ref_inv if unit is None else unit))
        ei = np.where(same_inv, 0.0, np.abs(inv / ref_inv - 1.0))
        if noise is not None:
            ei = np.where(noise, 0.0, ei)
        r = np.maximum(em / tol, ei / (tol if tol_inv is None else tol_inv))
        return np.where(np.isfinite(r), r, np.inf)


def _worst(ratio: np.ndarray, known: np.ndarray) -> float:
    r = ratio[known]
    return float(r.max()) if r.size else math.nan


def _moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=1)
    d = x - mean[:, None]
    return mean, (d * d).mean(axis=1)


def variant_statistics(parts: list[np.ndarray], merge: str, reduce: str, *, eps: float,
                       compute: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """(mean, invstd) per channel that the merge variant ``merge`` (unweighted, sums, chan) with its all-reduce in
    ``reduce`` makes of the ranks' slices ``parts`` (each ``(C, R_r)``): every rank's partials in float64 rounded
    to ``compute`` (the accumulation format) then to ``reduce``, summed in ``reduce`` in rank order, and the final
    steps rounded in ``compute`` as the variant does them."""
    return _variant([_moments_of(np.asarray(p, dtype=np.float64)) for p in parts], merge, reduce, eps=eps,
                    compute=compute)


def _variant(parts: list[_Moments], merge: str, reduce: str, *, eps: float,
             compute: str) -> tuple[np.ndarray, np.ndarray]:
    """variant_statistics from the ranks' moments."""
    rc = lambda v: round_to(v, compute)  # noqa: E731 - one rounding to the compute format
    rr = lambda v: round_to(v, reduce)  # noqa: E731 - one rounding to the all-reduce format

    def all_reduce(values: list[np.ndarray]) -> np.ndarray:
        total = rr(rc(values[0]))
        for v in values[1:]:
            total = rr(total + rr(rc(v)))
        return total

    c = parts[0].mean.shape[0]
    with np.errstate(all="ignore"):
        if merge == "sums":
            s = all_reduce([p.total for p in parts])
            q = all_reduce([p.squares for p in parts])
            n = all_reduce([np.full(c, float(p.count)) for p in parts])
            mean = rc(s / n)
            var = rc(rc(q / n) - rc(mean * mean))
        elif merge == "unweighted":
            stats = [(p.mean, p.var) for p in parts]
            mean = rc(all_reduce([m for m, _ in stats]) / len(parts))
            var = rc(all_reduce([v for _, v in stats]) / len(parts))
        elif merge == "chan":
            n = np.zeros(c)
            mean, m2 = np.zeros(c), np.zeros(c)
            for p in parts:
                m_r, v_r = p.mean, p.var
                cnt, m = rr(np.full(c, float(p.count))), rr(rc(m_r))
                inv_r = rr(rc(1.0 / rc(np.sqrt(rc(v_r + eps)))))
                tot = n + cnt
                d = m - mean
                m2 = m2 + (1.0 / inv_r**2 - eps) * cnt + d * d * n * cnt / tot
                mean = mean + d * cnt / tot
                n = tot
            mean, var = rc(mean), rc(m2 / n)
        else:
            raise BNProbeError(f"unknown merge {merge!r}; valid: unweighted, sums, chan")
        return mean, rc(1.0 / rc(np.sqrt(rc(var + eps))))


# ---- per rank -----------------------------------------------------------------------------------------------

def _sizes_text(samples: list[int]) -> str:
    if len(samples) == 1:
        return f"one rank of {samples[0]} samples"
    if len(set(samples)) == 1:
        return f"{len(samples)} equal ranks of {samples[0]} samples"
    return "ranks have " + ", ".join(map(str, samples[:-1])) + f" and {samples[-1]} samples"


def _describe(merge: str, reduce: str, ctx: _Context) -> str:
    """What the named variant is, with what makes it wrong on this data."""
    text = f"{_MERGE_TEXT[merge]} (all-reduce in {reduce})"
    if merge == "unweighted":
        why = "" if len(set(ctx.samples)) > 1 else "; the average of the rank variances misses the spread of the " \
                                                    "rank means"
        return f"{text}, counts ignored ({_sizes_text(ctx.samples)}{why})"
    if merge == "sums":
        with np.errstate(all="ignore"):
            m2v = ctx.mean**2 * ctx.invstd**2
        worst = float(np.nanmax(m2v)) if np.isfinite(m2v).any() else math.inf
        if not worst > 2.0:
            return text
        bits = get_format(reduce).precision
        return (f"{text}, which cancels here: mean²/(var+eps) up to {worst:.3g}, so E[x²]−E[x]² loses about "
                f"{min(math.log2(worst), bits):.0f} of the {bits} bits of {reduce}")
    return f"{text}: the gathered values lose the global statistics' precision"


def _variants(k: _Rank, ctx: _Context, known: np.ndarray, unc: np.ndarray | float) -> list[tuple[float, str, str]]:
    """The merge variants within tolerance of a rank's statistics, as (ratio, merge, reduce), best first: the one
    whose emulation reproduces them most closely counting the invstd even where it is rounding noise, then the
    ratio, then MERGE_VARIANTS' order."""
    found = []
    for i, (merge, reduce) in enumerate(MERGE_VARIANTS):
        vm, vi = ctx.variant(merge, reduce)
        # the mean in units of the golden σ: a variant's own variance may be rounding noise
        tol = statistics_tolerance(vm, ctx.invstd, ctx.count, ctx.dtype, k.saved_format) + unc
        extra, noise = _cancellation(ctx, _var(vi, ctx.eps)) if merge == "sums" else (0.0, None)
        ratio = _worst(_ratio(k.mean, k.invstd, vm, vi, tol, tol + extra, noise, ctx.invstd), known)
        if ratio <= 1:
            raw = _worst(_ratio(k.mean, k.invstd, vm, vi, tol, tol + extra, unit=ctx.invstd), known)
            found.append((raw, ratio, i, merge, reduce))
    return [(ratio, merge, reduce) for _, ratio, _, merge, reduce in sorted(found)]


def _rank_row(k: _Rank, ctx: _Context) -> RankRow:
    """One rank's row: the statistics it used against the global and its own golden, and for neither, the merge
    variants."""
    base = dict(rank=k.rank, samples=k.samples, count=k.count, source=k.source)
    if k.mean is None or k.invstd is None:
        return RankRow(**base, used="unknown", passed=True,
                       detail="no saved statistics, and y does not determine them (constant x or γ = 0 on every "
                              "channel, or no y): not checked")
    known = (np.isfinite(k.mean) | (k.source == "saved")) & ctx.finite
    if not known.any():
        return RankRow(**base, used="unknown", passed=True,
                       detail="x holds NaN/inf on every channel whose statistics are known: not checked")
    unc = k.uncertainty
    tol_g = statistics_tolerance(ctx.mean, ctx.invstd, ctx.count, ctx.dtype, k.saved_format) + unc
    g = _ratio(k.mean, k.invstd, ctx.mean, ctx.invstd, tol_g)
    lm, lv = k.moments.mean, k.moments.var
    li = _invstd(lv, ctx.eps)
    loc = _ratio(k.mean, k.invstd, lm, li, statistics_tolerance(lm, li, ctx.count, ctx.dtype, k.saved_format) + unc)
    gw, lw = _worst(g, known), _worst(loc, known)
    ch = int(np.argmax(np.where(known, np.nan_to_num(g, nan=np.inf), -np.inf)))
    with np.errstate(all="ignore"):
        dm = float(np.abs(k.mean[ch] - ctx.mean[ch]) * ctx.invstd[ch])
        di = float(abs(k.invstd[ch] / ctx.invstd[ch] - 1.0))
    row = dict(**base, global_ratio=gw, local_ratio=lw, mean_error=dm, invstd_error=di, channel=ch)
    off = (f"mean off the global by {dm:.3g}σ" if np.isfinite(dm) else f"mean {k.mean[ch]:g}") + " and " + (
        f"invstd by {100 * di:.3g}%" if np.isfinite(di) else f"invstd {k.invstd[ch]:g} (a variance below -eps)") + \
        f" on channel {ch}"
    if gw <= 1 and lw <= 1:
        return RankRow(**row, used="either", passed=True,
                       detail="its own and the global statistics agree within tolerance on this data: either may be "
                              "what it used")
    if gw <= 1:
        return RankRow(**row, used="global", passed=True, detail="used the global statistics")
    if lw <= 1:
        return RankRow(**row, used="local", passed=True, detail=f"used its own slice's statistics: {off}")
    hits = _variants(k, ctx, known, unc)
    if not hits:
        return RankRow(**row, used="neither", passed=False,
                       detail=f"used statistics that are neither its own nor the global ones, and no known merge "
                              f"reproduces them: {off}")
    ratio, merge, reduce = hits[0]
    also = [f"{m}/{r}" for _, m, r in hits[1:]]
    return RankRow(**row, used="neither", passed=False, merge=f"{merge}/{reduce}", merge_ratio=ratio,
                   detail=f"used {_describe(merge, reduce, ctx)}: {off}"
                          + (f" (also reproduced by {', '.join(also)})" if also else ""))


# ---- running statistics ---------------------------------------------------------------------------------

def _spread(values: list[np.ndarray]) -> tuple[float, int]:
    """The largest difference from the first rank's values, and its channel."""
    with np.errstate(invalid="ignore"):
        d = np.max([np.where((v == values[0]) | (np.isnan(v) & np.isnan(values[0])), 0.0, np.abs(v - values[0]))
                    for v in values], axis=0)
        d = np.where(np.isnan(d), np.inf, d)
    return float(d.max()), int(np.argmax(d))


def _running(ranks: list[_Rank]) -> dict[str, Any]:
    """Whether the ranks held the same running statistics before the step and after it (max differences), and
    whether the after-step difference exceeds RANK_TOLERANCES["running_ulps"] ulps of the parameter format."""
    out: dict[str, Any] = {}
    for when, io, suffix in (("before", "inputs", ""), ("after", "outputs", "_out")):
        have = [k.running[io] for k in ranks]
        names = [n for n in ("running_mean", "running_var") if all(f"{n}{suffix}" in h for h in have)]
        entry: dict[str, Any] = {"recorded": bool(names), "identical": True, "beyond_tolerance": False}
        for n in names:
            vals = [np.asarray(h[f"{n}{suffix}"], dtype=np.float64) for h in have]
            diff, ch = _spread(vals)
            same = all(np.array_equal(v, vals[0], equal_nan=True) for v in vals)
            pf = ranks[0].info["formats"].get(f"train.{io}.{n}{suffix}", ranks[0].info["params"])
            allowed = RANK_TOLERANCES["running_ulps"] * float(get_format(pf).ulp(np.max(np.abs(vals), axis=0))[ch])
            entry[n] = {"max_difference": diff, "channel": ch, "allowed": allowed}
            entry["identical"] = entry["identical"] and same
            entry["beyond_tolerance"] = entry["beyond_tolerance"] or not diff <= allowed
        out[when] = entry
    return out


# ---- the verdict ------------------------------------------------------------------------------------------

def _names(rows: list[RankRow]) -> str:
    return ("rank " if len(rows) == 1 else "ranks ") + ", ".join(str(r.rank) for r in rows)


def _kind(rows: list[RankRow]) -> str:
    used = {r.used for r in rows if r.used not in ("unknown", "either")}
    if not used:
        return "either" if any(r.used == "either" for r in rows) else "unchecked"
    if "neither" in used:
        return "merge"
    return "mixed" if len(used) > 1 else ("syncbn" if used == {"global"} else "local")


def _verdict(rows: list[RankRow], running: dict[str, Any], expect: str | None,
             same_saved: bool) -> tuple[list[str], list[str]]:
    """(failures, notes) of the whole step; ``same_saved``: every rank saved bit-identical statistics."""
    fails = [f"rank {r.rank} {r.detail}" for r in rows if r.used == "neither"]
    notes: list[str] = []
    glob = [r for r in rows if r.used == "global"]
    loc = [r for r in rows if r.used == "local"]
    either = [r for r in rows if r.used == "either"]
    its = lambda rs: "its" if len(rs) == 1 else "their"  # noqa: E731
    if glob and loc:
        fails.append(f"ranks disagree: {_names(glob)} used the global statistics, {_names(loc)} {its(loc)} own")
    elif loc and expect != "sync":
        notes.append(f"{_names(loc)} normalised with {its(loc)} own slice's statistics: plain BatchNorm per rank (DDP "
                     "without SyncBatchNorm), not a failure; SyncBatchNorm would use the global statistics of the "
                     "concatenated batch")
    if expect == "sync" and loc:
        fails.append(f"{_names(loc)} used {its(loc)} own statistics where SyncBatchNorm uses the global ones")
    if expect == "local" and glob:
        fails.append(f"{_names(glob)} used the global statistics where plain BatchNorm uses each rank's own")
    if either and len(rows) > 1:
        notes.append(f"{_names(either)}: {its(either)} own statistics agree with the global ones within tolerance on "
                     "this data, so SyncBatchNorm and plain BatchNorm cannot be told apart there")
    unknown = [r for r in rows if r.used == "unknown"]
    if unknown:
        notes.append(f"{_names(unknown)}: {unknown[0].detail}")
    fails_r, notes_r = _running_verdict(running, same_stats=same_saved)
    return fails + fails_r, notes + notes_r


def _running_verdict(running: dict[str, Any], *, same_stats: bool) -> tuple[list[str], list[str]]:
    before, after = running["before"], running["after"]
    fails: list[str] = []
    notes: list[str] = []
    diffs = lambda e: ", ".join(f"{n} by {e[n]['max_difference']:.3g} (channel {e[n]['channel']})"  # noqa: E731
                                for n in ("running_mean", "running_var") if n in e)
    if before["recorded"] and not before["identical"]:
        notes.append(f"the ranks held different running statistics before the step ({diffs(before)}): DDP broadcasts "
                     "rank 0's buffers before each forward unless broadcast_buffers=False")
    if not after["recorded"]:
        notes.append("the updated running statistics are not in the recordings: their agreement is not checked")
    elif not after["identical"]:
        if same_stats and before["identical"] and after["beyond_tolerance"]:
            fails.append(f"the ranks saved the same statistics but hold different running statistics after the step "
                         f"({diffs(after)}): each rank updated them differently")
        elif same_stats and before["identical"]:
            notes.append(f"the ranks' running statistics after the step are not bit-identical ({diffs(after)}), though "
                         "within a rounding: one deterministic update gives identical values")
        else:
            notes.append(f"the ranks hold different running statistics after the step ({diffs(after)})")
    return fails, notes


def _same_saved(ranks: list[_Rank]) -> bool:
    """Whether every rank saved statistics, bit-identical across ranks (then one update gives the same running
    statistics on every rank)."""
    saved = [k.saved for k in ranks if k.source == "saved" and k.saved is not None]
    return len(saved) == len(ranks) and all(np.array_equal(m, saved[0][0], equal_nan=True) and
                                            np.array_equal(v, saved[0][1], equal_nan=True) for m, v in saved)


def check_ranks(recordings: Mapping[int, Recording | Callable[[], Recording]], *, expect: str | None = None,
                call: str | None = None) -> RankReport:
    """Which statistics each rank of one training step normalised with (``recordings``: rank -> that rank's
    recording of one layer at one step, or a function loading it: each is then loaded when needed and let go, so
    that memory holds one call whatever the number of ranks).  ``expect``: None (judge what is found), ``"sync"``
    (a rank using its own statistics fails) or ``"local"`` (a rank using the global ones fails).  Two levels: each
    rank's call is reduced to its statistics and its slice's moments where it is read, and those are merged into
    the concatenated batch's golden statistics; when every rank used the global statistics, each rank's y and dx
    are judged against them, one rank loaded at a time.  Returns a :class:`RankReport`."""
    if expect is not None and expect not in EXPECT:
        raise BNProbeError(f"expect must be one of {', '.join(EXPECT)} or None, got {expect!r}")
    ranks = _load(recordings)
    parts = [k.moments for k in ranks]
    count, mean, var = _merged(parts)
    dtype, eps = ranks[0].info["dtype"], ranks[0].info["eps"]
    finite = np.isfinite(mean) & np.isfinite(var)
    ctx = _Context(dtype, eps, count, mean, _invstd(var, eps), parts, [k.samples for k in ranks], finite)
    rows = [_rank_row(k, ctx) for k in ranks]
    if expect is not None:  # a rank that did what the expected BatchNorm does not is a failing row
        wrong = "local" if expect == "sync" else "global"
        rows = [replace(r, passed=False) if r.used == wrong else r for r in rows]
    running = _running(ranks)
    fails, notes = _verdict(rows, running, expect, _same_saved(ranks))
    if rows and all(r.used in ("global", "either") for r in rows):  # SyncBatchNorm: each rank's outputs, elementwise
        tol = statistics_tolerance(mean, ctx.invstd, ctx.count, dtype, ranks[0].saved_format)
        key = {int(r): r for r in recordings}  # the given keys may be ints or their strings
        loaders = [(k.rank, lambda r=k.rank: _recording(recordings[key[r]])) for k in ranks]
        judged = rank_outputs(loaders, mean, ctx.invstd, finite, tol)
        fails += [o.describe() for o in judged if not o.passed]
        if judged:
            worst = max(judged, key=lambda o: o.ratio)
            notes.append(f"every rank's {' and '.join(dict.fromkeys(o.tensor for o in judged))} judged elementwise "
                         f"against the concatenated batch's golden: worst {worst.ratio:.3g}x its bound (rank "
                         f"{worst.rank}'s {worst.tensor})")
    if not finite.all():
        notes.append(f"channel(s) {', '.join(map(str, np.flatnonzero(~finite)))} hold NaN/inf in x: left out (their "
                     "golden statistics are not finite)")
    if len(ranks) == 1:
        notes.append("one rank given: its own statistics are the global ones (a rank whose statistics came from ranks "
                     "not given used neither)")
    name = call or str(ranks[0].info["call"] or ranks[0].info["source"] or "call")
    golden = {"count": ctx.count, "mean": mean.tolist(), "var": var.tolist()}
    return RankReport(name, dtype, _kind(rows), rows, golden, running, fails, notes)

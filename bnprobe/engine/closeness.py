"""The judge's general rules of closeness: an actual tensor against an expected one with a tolerance or a bound,
for any check to call (gradcheck's rows and identities, fold's channels).  :mod:`bnprobe.engine.rules` holds the
judge's rules of BatchNorm's outputs against the FP64 golden; these are the same judge's plain comparisons, each
deciding PASS/FAIL and saying why in :func:`~bnprobe.engine.rules.mismatch`'s words:

- :func:`allclose_rule`: |actual − expected| <= atol·scale + rtol·|expected| elementwise (torch.testing's rule,
  ``scale`` 1 by default), with the smallest atol and rtol that would pass;
- :func:`scaled_rule`: |actual − expected| relative to each value's own scale (and a condition number) at most
  ``tol``, a non-finite residual failing;
- :func:`bounded_rule`: |actual − expected| at most ``bound`` elementwise (:func:`bound_shares`: equal values,
  infinities included, err by nothing), and :func:`error_within`, errors already formed against their allowance;
- :func:`bench_ratio_rule`: msprobe's benchmark ratios (RMSE and largest error against a bench's, floored at the
  format's error floor times the golden's RMS) within its loosest level's limits.

The tolerances come from :mod:`bnprobe.core.tolerances`; the callers pass them in.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.formats import get_format
from bnprobe.core.tolerances import MSPROBE_BENCHMARK_LIMITS, MSPROBE_STANDARDS
from bnprobe.engine.metrics import min_atol, min_rtol
from bnprobe.engine.result import Judged
from bnprobe.engine.rules import Verdict, mismatch

__all__ = ["Closeness", "allclose_rule", "scaled_rule", "Bounded", "bound_shares", "bounded_rule", "error_within",
           "off_by", "bench_ratio_rule", "BENCH_RMSE_RATIO", "BENCH_MAX_RATIO"]

#: msprobe's benchmark limits at its loosest level (L0, where BatchNorm falls): RMSE and largest error against the
#: bench's
BENCH_RMSE_RATIO = MSPROBE_BENCHMARK_LIMITS["L0"]["rmse"]
BENCH_MAX_RATIO = MSPROBE_BENCHMARK_LIMITS["L0"]["max_rel"]


@dataclass(frozen=True)
class Closeness(Judged):
    """One tolerance rule's judgement of one tensor: whether it passed, the largest absolute and relative errors,
    the smallest atol and rtol that would have passed (``need_atol``, ``need_rtol``), the share of the tolerance
    used (> 1 fails), the worst element (its flat index and where it is) and, when it failed, why.  Truthy when it
    passed."""

    passed: bool
    max_abs: float
    max_rel: float
    need_atol: float
    need_rtol: float
    used: float
    worst: int
    where: str
    why: str


def _at(where: Callable[[int], str] | None, i: int) -> str:
    return where(i) if where else str(i)


def allclose_rule(actual: Any, expected: Any, rtol: float, atol: float, *, scale: Any = None,
                  equal_nan: bool = False, where: Callable[[int], str] | None = None) -> Closeness:
    """|actual − expected| <= atol·scale + rtol·|expected| elementwise (``scale`` 1 when None, else broadcast to
    ``expected``: atol in units of each value's natural scale); ``equal_nan``: an infinity, or a NaN, where the
    expected value has the same one errs by nothing, so an infinity there passes when rtol > 0 (its allowance is
    inf; with rtol 0 it is NaN and fails) but a NaN still fails (its allowance atol + rtol·|NaN| is NaN).  Any
    other non-finite difference fails.  ``where(i)`` names flat element i; the worst element is the one using most
    of its allowance, the first non-finite difference where there is one."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    s = np.ones_like(e) if scale is None else np.broadcast_to(np.asarray(scale, dtype=np.float64),
                                                               np.shape(expected)).reshape(-1)
    with np.errstate(invalid="ignore"):
        d = np.abs(a - e)
        if equal_nan:
            d = np.where((a == e) | (np.isnan(a) & np.isnan(e)), 0.0, d)
        finite = np.isfinite(d)
        allowed = atol * s + rtol * np.abs(e)
        ok = bool(finite.all() and np.all(d <= allowed))
        rel = d / np.where(e == 0, np.nan, np.abs(e))
        used = np.where(d == 0, 0.0, d / allowed)
    worst = int(np.nanargmax(np.where(finite, used, np.inf))) if d.size else 0
    if not finite.all():
        need_atol = need_rtol = math.inf
    elif scale is None:
        need_atol, need_rtol = min_atol(a, e, rtol), min_rtol(a, e, atol)
    else:  # atol as a multiple of the scale
        with np.errstate(all="ignore"):
            excess = d - rtol * np.abs(e)
            per = np.where(excess <= 0, 0.0, np.where(s > 0, excess / np.where(s > 0, s, 1.0), np.inf))
            over = d - atol * s
            ge = np.abs(e)
            per_r = np.where(over <= 0, 0.0, np.where(ge > 0, over / np.where(ge > 0, ge, 1.0), np.inf))
        need_atol = float(per.max()) if per.size else 0.0
        need_rtol = float(per_r.max()) if per_r.size else 0.0
    why = ""
    if not ok:
        with np.errstate(invalid="ignore"):
            off = ~(finite & (d <= allowed))
        w = worst if off[worst] else int(np.argmax(off))  # (a NaN allowance fails where nothing is used)
        why = mismatch(int(off.sum()), d.size, where=_at(where, w), actual=a[w], expected=e[w],
                       allowed=allowed[w], greatest=f"error {d[w]:.3g}",
                       breakdown=f"; atol {atol:g}{' of the scale' if scale is not None else ''}, rtol {rtol:g}")
    return Closeness(ok, float(np.nanmax(d)) if (~np.isnan(d)).any() else math.nan if d.size else 0.0,
                     float(np.nanmax(rel)) if np.isfinite(rel).any() else 0.0, need_atol, need_rtol,
                     float(np.nanmax(np.where(finite, used, np.inf))) if d.size else 0.0, worst, _at(where, worst),
                     why)


def scaled_rule(actual: Any, expected: Any, scale: Any, tol: float, *, condition: Any = None,
                where: Callable[[int], str] | None = None) -> Closeness:
    """|actual − expected| / scale (1 where the scale is not positive) / ``condition`` (when given) at most ``tol``
    elementwise: an error relative to each value's own scale, made that much less exact by the condition of the
    problem.  A NaN/inf residual fails, and is the worst (``where`` then says "(NaN/inf)").  The measures are the
    largest residual (``max_rel``, and the tol that would pass, ``need_atol`` and ``need_rtol`` alike) and the
    largest absolute error (inf when one is not finite)."""
    got = np.asarray(actual, dtype=np.float64)
    want = np.asarray(expected, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        diff = np.abs(got - want)
        resid = diff / np.where(s > 0, s, 1.0)
        if condition is not None:
            resid = resid / condition
    # a NaN/inf residual (a NaN value, an overflowing sum) fails: the worst, infinitely far off
    bad = ~np.isfinite(resid)
    worst = int(np.argmax(bad)) if bad.any() else int(np.argmax(resid)) if resid.size else 0
    top = math.inf if bad.any() else float(resid.max()) if resid.size else 0.0
    big = math.inf if not np.isfinite(diff).all() else float(diff.max()) if diff.size else 0.0
    ok = top <= tol
    at = _at(where, worst) + (" (NaN/inf)" if bad.any() else "")
    why = ""
    if not ok:
        with np.errstate(invalid="ignore", over="ignore"):
            k = int(np.sum(bad | (resid > tol)))
            allowed = tol * float(np.broadcast_to(np.where(s > 0, s, 1.0), resid.shape).flat[worst]) * (
                1.0 if condition is None else float(np.broadcast_to(condition, resid.shape).flat[worst]))
        why = mismatch(k, resid.size, where=at, actual=float(got.flat[worst]), expected=float(want.flat[worst]),
                       allowed=allowed, greatest=f"error {float(diff.flat[worst]):.3g}",
                       breakdown=f"; tol {tol:g} of the scale")
    return Closeness(ok, big, top, top, top, top / tol if tol else math.inf, worst, at, why)


def bound_shares(actual: Any, expected: Any, bound: Any) -> np.ndarray:
    """|actual − expected| / bound per value: 0 where the two are equal (the same infinity included), inf where
    either is NaN or inf and they differ, or the bound is not finite and they differ."""
    with np.errstate(all="ignore"):
        r = np.where(actual == expected, 0.0, np.abs(actual - expected) / bound)
    return np.where(np.isfinite(r) & np.isfinite(bound), r, np.where(actual == expected, 0.0, np.inf))


@dataclass(frozen=True)
class Bounded(Judged):
    """:func:`bounded_rule`'s judgement: per value the share of its bound used (:func:`bound_shares`), whether every
    share is at most 1, the largest and where (flat index), and why it failed.  Truthy when it passed."""

    shares: np.ndarray
    passed: bool
    used: float
    worst: int
    why: str


def bounded_rule(actual: Any, expected: Any, bound: Any, *, where: Callable[[int], str] | None = None) -> Bounded:
    """|actual − expected| <= ``bound`` (broadcast to them) for every value, by :func:`bound_shares`: equal values
    pass whatever the bound, any other non-finite difference fails."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    b = np.asarray(bound, dtype=np.float64)
    shares = bound_shares(a, e, b)
    if not shares.size:
        return Bounded(shares, True, 0.0, 0, "")
    worst = int(np.argmax(shares))
    used = float(shares.flat[worst])
    ok = bool((shares <= 1).all())
    why = ""
    if not ok:
        av, ev = (float(np.broadcast_to(v, shares.shape).flat[worst]) for v in (a, e))
        why = mismatch(int(np.sum(shares > 1)), shares.size, where=_at(where, worst), actual=av, expected=ev,
                       allowed=float(np.broadcast_to(b, shares.shape).flat[worst]),
                       greatest=f"share of the bound {used:.3g}")
    return Bounded(shares, ok, used, worst, why)


def error_within(error: Any, allowed: Any, *, slack: float = 0.0, axis: int | None = None) -> Any:
    """Whether every error (already formed: |Δ| of each value) is at most its allowance times 1 + ``slack`` (the
    rounding of the sums that formed them both): a bool, or along ``axis`` one per row.  A NaN error, or a NaN
    allowance, fails."""
    return (np.asarray(error) <= np.asarray(allowed) * (1 + slack)).all(axis=axis)


def off_by(what: str, actual: float, expected: float, allowed: float) -> str:
    """One value's failure in a few words: "<what> off by <|actual − expected|> (allowed <allowed>)"."""
    return f"{what} off by {abs(actual - expected):.3g} (allowed {allowed:.3g})"


def bench_ratio_rule(actual: np.ndarray, bench: np.ndarray, golden: np.ndarray, fmt: str, *, what: str = "kernel",
                     bench_name: str = "bench") -> Verdict:
    """msprobe's benchmark method on one slice (e.g. a channel): the RMSE and the largest error of ``actual``
    against the golden, over the bench's (a computation in the same format that must not be materially better),
    each denominator floored at the format's error floor (fp16 2^-11, bf16 2^-8, fp32 2^-14) times the golden's
    RMS, within :data:`BENCH_RMSE_RATIO` and :data:`BENCH_MAX_RATIO` (msprobe's loosest level).  NaN values are left
    out of the errors; a non-finite ``actual`` fails.  A format msprobe has no standard for (fp64) passes when
    finite.  Score: the larger of the two ratios as a share of its limit (inf when not finite); bound 1."""
    std = MSPROBE_STANDARDS.get(get_format(fmt).name)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # an actual output that overflowed is all NaN/inf: reported as non-finite
        warnings.filterwarnings("ignore", message="(All-NaN slice|Mean of empty slice)", category=RuntimeWarning)
        err, bench_err = (np.nanmax(np.abs(v - golden)) for v in (actual, bench))
        rms = float(np.sqrt(np.nanmean(golden ** 2)))
        floor = (std.error_floor if std else 0.0) * rms
        rmse, rmse_b = (float(np.sqrt(np.nanmean((v - golden) ** 2))) for v in (actual, bench))
        r_rmse = rmse / max(rmse_b, floor) if rmse > 0 else 0.0
        r_max = float(err) / max(float(bench_err), floor) if err > 0 else 0.0
        finite = bool(np.isfinite(actual).all())
    ok = finite and (std is None or (r_rmse <= BENCH_RMSE_RATIO and r_max <= BENCH_MAX_RATIO))
    why = (f"non-finite {what} output" if not finite else
           f"{what}/{bench_name} error: RMSE x{r_rmse:.3g} (limit {BENCH_RMSE_RATIO:g}), max x{r_max:.3g} "
           f"(limit {BENCH_MAX_RATIO:g})")
    score = max(r_rmse / BENCH_RMSE_RATIO, r_max / BENCH_MAX_RATIO) if finite else math.inf
    return Verdict(ok, why, score, 1.0)

"""The judge: every rule that decides whether an output of BatchNorm is right, in one place.

Each rule measures the error *beyond the output format's own rounding* (half an ulp of the format at the
golden, subnormal spacing included: :func:`beyond_rounding`), so the correctly rounded golden always passes,
and treats non-finite values alike (:func:`nonfinite_mismatch`: NaN/±inf must be where the golden rounded to
the format has them).  The rules:

- :func:`absolute`: msprobe's absolute standards (``scaled``, ``accumulated``, ``threshold``) for one tensor;
- :func:`benchmark_rule`: msprobe's benchmark method against a bench's output, with the two exemptions for
  errors a correct kernel makes too (:func:`within_accumulation` for per-channel sums,
  :func:`small_values_rounded` for outputs that cancel to near zero);
- :func:`channel_rule`: the doctor's per-channel rule (rtol of the channel's scale).

Every failure is described by one builder, :func:`mismatch`, in torch.testing's words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels.layout import element_at
from bnprobe.engine.metrics import benchmark, benchmark_verdict, checker_metrics
from bnprobe.numerics.rounding import round_to
from bnprobe.core.tolerances import (
    MSPROBE_STANDARDS,
    SMALL_VALUE_ULPS,
    Standard,
    accumulation_bound,
    accumulated_terms,
    accumulation_format,
    accumulation_words,
    doctor_tolerance,
)

__all__ = ["Verdict", "STANDARD_RULES", "RULES", "SUMS", "beyond_rounding", "excess", "nonfinite_mismatch",
           "mismatch", "greatest_error", "absolute", "within_accumulation", "within_rounding", "BenchOutput",
           "benchmark_of", "channel_rule", "beyond_format", "bound_used", "within_bound", "VersusBench", "versus_bench",
           "output_shares", "all_finite", "WORSE_THAN_BENCH", "WORSE_ULPS"]

STANDARD_RULES = ("scaled", "accumulated", "threshold")
RULES = ("benchmark", *STANDARD_RULES)
# per-channel sums (or means) of R terms, scaled by Σ|terms| (mean |x|); the running mean is one of them updated by
# the momentum, scaled by max(|running mean|, m·mean |x|) (its update's own rounding is a few ulps of that, under γ_R)
SUMS = ("saved_mean", "running_mean", "dgamma", "dbeta")


@dataclass(frozen=True)
class Verdict:
    """One rule's judgement of one tensor: whether it passed, why, the worst error measure (``score``) and its
    limit (``bound``).  Truthy when it passed; unpacks as (passed, why, score, bound)."""

    passed: bool
    why: str
    score: float
    bound: float

    def __bool__(self) -> bool:
        return self.passed

    def __iter__(self):  # noqa: ANN204 - (passed, why, score, bound)
        return iter((self.passed, self.why, self.score, self.bound))


# ---- rounding and non-finite values ---------------------------------------------------------------------

def beyond_rounding(actual: np.ndarray, golden: np.ndarray, fmt: str) -> np.ndarray:
    """|actual − golden| less half an ulp of ``fmt`` at the golden (subnormal spacing included), floored at
    0: the error beyond the output format's own rounding, so a correctly rounded result has none."""
    a = np.asarray(actual, dtype=np.float64)
    g = np.asarray(golden, dtype=np.float64)
    with np.errstate(all="ignore"):
        return np.maximum(np.abs(a - g) - 0.5 * get_format(fmt).ulp(g), 0.0)


def excess(actual: np.ndarray, expected: np.ndarray, fmt: str) -> np.ndarray:
    """:func:`beyond_rounding` with non-finite values judged per element: 0 for NaN with NaN and for ±inf where
    ``expected`` rounds to that inf in the format (beyond its range: the format cannot hold it, not the kernel's
    error); inf for other NaN/inf."""
    f = get_format(fmt)
    a, w = actual, expected
    with np.errstate(all="ignore"):
        d = np.abs(a - w)
        d -= 0.5 * f.ulp(w)
        np.maximum(d, 0.0, out=d)
        if np.isfinite(d).all():
            return d
        wr = round_to(w, f.name) if f.name != "fp64" else w
        same = (a == w) | (np.isnan(a) & np.isnan(w)) | (np.isinf(a) & (a == wr))
        return np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))


def nonfinite_mismatch(actual: np.ndarray, golden: np.ndarray, fmt: str) -> str:
    """Where NaN/±inf in ``actual`` differ from the golden rounded to ``fmt`` (a golden beyond the format's
    range rounds to ±inf), a sentence saying how many and where; "" when they agree."""
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    f = get_format(fmt)
    if np.size(actual) and all_finite(actual) and g.size and np.isfinite(f.max) and \
            g.max() <= f.max and g.min() >= -f.max:
        return ""  # all finite, and no golden value can round to ±inf (a NaN fails both comparisons)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    with np.errstate(all="ignore"):
        gr = round_to(g, f.name)
    fa, fg = np.isfinite(a), np.isfinite(gr)
    wrong = (fa != fg) | (~fa & ~((a == gr) | (np.isnan(a) & np.isnan(gr))))
    if not wrong.any():
        return ""
    k = int(wrong.sum())
    i = int(np.argmax(wrong))
    return (f"NaN/inf where the golden rounded to the format has none (or the reverse): {k} / {a.size} elements, "
            f"first at index {i} ({a[i]:.6g} vs {gr[i]:.6g})")


_EXPONENTS = {np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(np.float32): (np.uint32, 0x7F800000),
              np.dtype(np.float64): (np.uint64, 0x7FF0000000000000)}


def all_finite(a: Any) -> bool:
    """Whether every value of ``a`` is finite: for a contiguous IEEE float16/32/64 array by its exponent bits (a
    value is inf or NaN exactly when they are all ones), without widening it to float64 first."""
    if isinstance(a, np.ndarray) and a.dtype in _EXPONENTS and a.flags.c_contiguous:
        uint, mask = _EXPONENTS[a.dtype]
        return not ((a.view(uint) & uint(mask)) == uint(mask)).any()
    return bool(np.isfinite(np.asarray(a, dtype=np.float64)).all())


# ---- the words of a failure -------------------------------------------------------------------------------

def mismatch(k: int, n: int, *, where: str, actual: float, expected: float, allowed: float, beyond: str = "",
             breakdown: str = "", greatest: str = "") -> str:
    """A failure in torch.testing's words: "Mismatched elements: k / n (p%...); greatest ... at <where>: actual vs
    expected expected (<allowed> allowed beyond <beyond>)", or "(<allowed> allowed)" without ``beyond`` (a
    tolerance that is the whole allowance).  ``breakdown`` follows the percentage inside its parentheses,
    ``greatest`` names the measure (e.g. "error 0.01")."""
    g = f" {greatest}" if greatest else ""
    b = f" beyond {beyond}" if beyond else ""
    return (f"Mismatched elements: {k} / {n} ({100.0 * k / n:.3g}%{breakdown}); greatest{g} at {where}: "
            f"{actual:.6g} vs {expected:.6g} expected ({allowed:.3g} allowed{b})")


def greatest_error(actual: Any, bench: Any, golden: Any, bench_name: str) -> str:
    """Where a kernel that fails the benchmark errs most: the element, its value, the expected value and the bench's
    value there (what a careful kernel in the same formats gets); "" when it does not err."""
    a = np.asarray(actual, dtype=np.float64)
    g = np.asarray(golden, dtype=np.float64)
    with np.errstate(all="ignore"):
        d = np.where(np.isfinite(a) & np.isfinite(g), np.abs(a - g), -1.0).reshape(-1)
    if not d.size or d.max() <= 0:
        return ""
    i = int(np.argmax(d))
    bv = np.asarray(bench, dtype=np.float64).reshape(-1)[i] if bench is not None else math.nan
    return (f"; greatest error {d[i]:.3g} at {element_at(i, a.shape)}: {a.reshape(-1)[i]:.6g} vs "
            f"{g.reshape(-1)[i]:.6g} expected ({bench_name}: {bv:.6g})")


# ---- msprobe's absolute standards ---------------------------------------------------------------------------

def absolute(actual: np.ndarray, golden: np.ndarray, fmt: str, rule: str = "scaled",
             standards: dict[str, Standard] | None = None, scale: np.ndarray | None = None) -> Verdict:
    """msprobe's verdict for one tensor by ``rule`` (scaled, accumulated or threshold), with score the worst
    error measure and bound its limit.

    Every rule measures the error beyond the output format's own rounding (:func:`beyond_rounding`), so the
    correctly rounded golden always passes; non-finite values must be where the golden rounded to ``fmt`` has
    them.  ``scaled`` floors the relative error's denominator at ``error_floor`` times each element's natural
    magnitude ``scale`` (same shape as golden; default the tensor's largest golden magnitude), ``accumulated``
    at msprobe's absolute floor; ``threshold`` is msprobe's rule for single elementwise operators (relative
    error <= rtol, or for small golden values absolute error <= small_atol)."""
    if rule not in STANDARD_RULES:
        raise BNProbeError(f"unknown standard rule {rule!r}; valid: {', '.join(STANDARD_RULES)}")
    f = get_format(fmt)
    std = (standards or MSPROBE_STANDARDS).get(f.name)
    if std is None:
        return Verdict(True, f"not judged: msprobe has no standard for {f.name} outputs", math.nan, math.inf)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    bad = nonfinite_mismatch(a, g, f.name)
    if bad:
        return Verdict(False, bad, math.inf, 0.0)
    fa = np.isfinite(a)
    sc = None if scale is None else \
        np.broadcast_to(np.asarray(scale, dtype=np.float64), np.shape(golden)).reshape(-1)
    if not fa.all():  # (every element finite, the usual case: no copies)
        a, g, sc = a[fa], g[fa], None if sc is None else sc[fa]
    with np.errstate(all="ignore"):
        if rule == "threshold":
            return _threshold(a, g, beyond_rounding(a, g, f.name), std,
                              lambda w: element_at(int(np.flatnonzero(fa)[w]), np.shape(golden)))
        per = rule == "scaled" and sc is not None  # a floor per element: error_floor times its natural scale
        if rule == "scaled" and sc is None:  # the tensor's largest golden magnitude for every element
            gmax = float(np.abs(g).max()) if g.size else 1.0
            floor = std.error_floor * (gmax if gmax > 0 else 1.0)
        else:
            floor = std.error_floor
        if g.size and jit_for(g.size):  # the same figures in one compiled pass
            from bnprobe.compiled.rules import worst_ratio

            worst, w, over = worst_ratio(a, g, sc if per else None, floor, f.emin, f.mantissa_bits, std.accumulated)
        else:
            ratio = beyond_rounding(a, g, f.name) / np.maximum(np.abs(g), floor * np.where(sc > 0, sc, 1.0)
                                                               if per else floor)
            worst = float(ratio.max()) if ratio.size else 0.0
            w, over = (int(np.argmax(ratio)), int(np.sum(ratio > std.accumulated))) if ratio.size else (0, 0)
        if worst > std.accumulated:
            at = floor * (float(sc[w]) if per and sc[w] > 0 else 1.0)
            allowed = std.accumulated * max(abs(g[w]), at)
            why = mismatch(over, g.size,
                           where=element_at(int(np.flatnonzero(fa)[w]), np.shape(golden)), actual=a[w],
                           expected=g[w], allowed=allowed, greatest=f"accumulated error {worst:.3g}",
                           beyond=f"rounding: {std.accumulated:.3g} of the reference")
            return Verdict(False, why, worst, std.accumulated)
        return Verdict(True, f"accumulated error {worst:.3g} within {std.accumulated:.3g}", worst, std.accumulated)


def _threshold(a: np.ndarray, g: np.ndarray, d: np.ndarray, std: Standard, where: Callable[[int], str]) -> Verdict:
    """msprobe's threshold rule on finite values ``a`` against ``g`` with errors ``d`` beyond rounding."""
    small = np.abs(g) <= std.small_threshold
    used = np.where(small, d / std.small_atol, d / np.where(small, 1.0, np.abs(g)) / std.rtol)
    bad_small = int(np.sum(small & (used > 1)))
    bad = int(np.sum(~small & (used > 1)))
    score = (float(used.max()) if used.size else 0.0) * std.rtol
    if bad or bad_small:
        w = int(np.argmax(used))
        allowed = std.small_atol if small[w] else std.rtol * abs(g[w])
        why = mismatch(bad + bad_small, used.size, where=where(w), actual=a[w], expected=g[w], allowed=allowed,
                       beyond="rounding", breakdown=f": {bad} over rtol {std.rtol:.3g}, {bad_small} small value(s) "
                                                    f"over atol {std.small_atol:.3g}")
        return Verdict(False, why, score, std.rtol)
    return Verdict(True, f"within rtol {std.rtol:.3g} / small-value atol {std.small_atol:.3g}", score, std.rtol)


# ---- msprobe's benchmark method and its exemptions ------------------------------------------------------------

@dataclass
class BenchOutput:
    """A bench's output of one tensor, with its metrics and its absolute verdict computed once and kept."""

    value: Any
    metrics: dict[str, Any] | None = None
    format_check: Verdict | None = None  # the absolute standard on the bench's output


def benchmark_of(actual: Any, bench: Any, golden: Any, fmt: str, *, dev: Any = None) -> Any:
    """msprobe's benchmark verdict; ``bench`` is the bench's output or a :class:`BenchOutput` that keeps its
    metrics (computed once per output, and reused whole when ``actual`` is the bench's own array).  ``dev``: the
    kernel's checker metrics when already computed (:attr:`bnprobe.engine.metrics.Comparison.checker_metrics`)."""
    if not isinstance(bench, BenchOutput):
        return benchmark(actual, bench, golden, fmt)
    if bench.metrics is None:  # the kernel's, when it returned the bench's very values (its metrics are the same)
        same = dev is not None and np.shape(actual) == np.shape(bench.value) and \
            np.array_equal(np.ravel(actual)[:4096], np.ravel(bench.value)[:4096], equal_nan=True) and \
            np.array_equal(actual, bench.value, equal_nan=True)  # (a prefix first: most kernels differ early)
        bench.metrics = dev if same else checker_metrics(bench.value, golden, fmt)
    if dev is None:
        dev = bench.metrics if actual is bench.value else checker_metrics(actual, golden, fmt)
    if dev is None or bench.metrics is None:
        return benchmark(actual, bench.value, golden, fmt)
    return benchmark_verdict(dev, bench.metrics, fmt)


#: an output whose error (RMSE or largest, against the golden) is more than this many times the bench's, and beyond
#: the format's rounding, is named "worse than the bench" whatever the verdict: msprobe's benchmark method floors the
#: bench's metrics (fp32's RMSE at 2^-14 of the output), and the exemptions forgive what a correct kernel's
#: accumulation may reach in the worst case, so neither can see a kernel many times worse than a careful one.  An
#: order of magnitude (msprobe's own limit on the largest error): correct kernels with other summation orders stay
#: below it (torch's CPU kernel against the careful bench, fp32 parameters, default and stress sets: every output
#: within 9.2x of the bench's RMSE but 9 of 702 when this limit was set, each far worse than careful: the docs'
#: compare-precision page, "When bnprobe says FAIL")
WORSE_THAN_BENCH = 10.0
#: ... and only when the kernel's error exceeds this many units in the last place of the output (at the golden,
#: RMS): below it both kernels are at the format's own rounding, and their ratio is noise
WORSE_ULPS = 2.0


@dataclass(frozen=True)
class VersusBench:
    """A kernel's error against a bench's on one output, both against the golden, unfloored: RMSE and largest
    error of each (finite elements of both), their ratios (inf when the bench is exact and the kernel is not, 1 when
    both are), and the output's RMS ulp at the golden."""

    rmse: float
    bench_rmse: float
    max_err: float
    bench_max_err: float
    ulp: float

    @staticmethod
    def _ratio(a: float, b: float) -> float:
        if b > 0:
            return a / b
        return 1.0 if a == 0 else (math.inf if a > 0 else math.nan)

    @property
    def rmse_ratio(self) -> float:
        return self._ratio(self.rmse, self.bench_rmse)

    @property
    def max_ratio(self) -> float:
        return self._ratio(self.max_err, self.bench_max_err)

    def worse(self, bench_name: str, verdict: str) -> str:
        """"" when the kernel is not materially worse than the bench, else a sentence: how much worse, the
        threshold and why it was chosen, and what the verdict let it pass by (``verdict``)."""
        r, m = self.rmse_ratio, self.max_ratio
        if not (max(r, m) > WORSE_THAN_BENCH and self.rmse > WORSE_ULPS * self.ulp):
            return ""
        return (f"worse than {bench_name}: RMSE {_times(r)} ({self.rmse:.3g} vs {self.bench_rmse:.3g}), largest "
                f"error {_times(m)} ({self.max_err:.3g} vs {self.bench_max_err:.3g}); named above "
                f"{WORSE_THAN_BENCH:g}x the bench's error (an order of magnitude, msprobe's limit on the largest "
                f"error, without its floor on the bench's) and {WORSE_ULPS:g} ulps RMS of the output; {verdict}")


def _times(r: float) -> str:
    return "inf x" if math.isinf(r) else f"{r:.3g}x"


def versus_bench(actual: Any, bench: Any, golden: Any, fmt: str) -> VersusBench | None:
    """The kernel's and the bench's errors on one output (:class:`VersusBench`); None when they cannot be set side
    by side (shapes, no finite element)."""
    a, b, g = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (actual, bench, golden))
    if not (a.shape == b.shape == g.shape) or not g.size:
        return None
    if jit_for(g.size) and all(v.flags.c_contiguous for v in (a, b, g)):  # the same figures in one compiled pass
        fast = _versus_compiled(a, b, g, fmt)
        if fast is not None:
            return fast
    with np.errstate(all="ignore"):
        keep = np.isfinite(a) & np.isfinite(b) & np.isfinite(g)
        if not keep.any():
            return None
        if not keep.all():  # (every element finite, the usual case: no copies)
            a, b, g = a[keep], b[keep], g[keep]
        ea, eb = np.abs(a - g), np.abs(b - g)
        ulp = get_format(fmt).ulp(g)
        return VersusBench(float(np.sqrt(np.mean(ea * ea))), float(np.sqrt(np.mean(eb * eb))), float(ea.max()),
                           float(eb.max()), float(np.sqrt(np.mean(ulp * ulp))))


def _versus_compiled(a: np.ndarray, b: np.ndarray, g: np.ndarray, fmt: str) -> VersusBench | None:
    """:func:`versus_bench` where every value is finite, in one compiled pass: numpy's pairwise sums of the same
    squares, its mean (the sum over the count) and root; None where a value is not finite."""
    from bnprobe.compiled.rules import versus_sums

    f = get_format(fmt)
    got = versus_sums(a, b, g, f.emin, f.mantissa_bits)
    if got is None:
        return None
    (sa, sb, su), (ma, mb) = got
    n = np.intp(g.size)  # numpy's mean of a float64 sum: the sum over the count, in float64
    return VersusBench(float(np.sqrt(sa / n)), float(np.sqrt(sb / n)), float(ma), float(mb), float(np.sqrt(su / n)))


def output_shares(ulps: np.ndarray, golden: Any, fmt: str, std: Standard | None) -> tuple[float, float, float, float]:
    """What a compare row reports beside its verdict, each a share: of the finite ULP errors (``ulps``, 1-D
    float64) over the standard's ULP limit; of the golden at most its small-value threshold, in ``fmt``'s
    subnormal range, beyond ``fmt``'s largest value.  0.0 for the first two without a standard, for fp64's
    subnormal share, and for any without elements.  Numpy's means of the comparisons; over a large output, the
    same counts in one compiled pass (a mean of booleans is its count over the size, in float64)."""
    f = get_format(fmt)
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    nan = float("nan")
    limits = (nan if std is None else float(std.ulp), nan if std is None else float(std.small_threshold),
              2.0 ** f.emin if f.name != "fp64" else nan, float(f.max) if np.isfinite(f.max) else nan)
    if jit_for(max(ulps.size, g.size)):
        from bnprobe.compiled.rules import share_counts

        fin, over, small, sub, big = share_counts(ulps.reshape(-1).astype(np.float64, copy=False), g, *limits)
        n = np.float64(g.size)
        return (float(over / np.float64(fin)) if fin else 0.0,
                *(float(k / n) if g.size else 0.0 for k in (small, sub, big)))
    u = ulps[np.isfinite(ulps)]
    gg = np.abs(g)
    with np.errstate(all="ignore"):
        return (float(np.mean(u > limits[0])) if u.size else 0.0,
                *(float(np.mean(m)) if gg.size else 0.0 for m in (gg <= limits[1], (gg > 0) & (gg < limits[2]),
                                                                  gg > limits[3])))


def within_accumulation(tensor: str, actual: Any, golden: Any, fmt: str, scale: np.ndarray | None,
                        terms: int) -> tuple[float, str] | None:
    """For a per-channel sum or mean of ``terms`` terms whose every error is within what a correct kernel's
    accumulation can produce (:func:`~bnprobe.core.tolerances.accumulation_bound` times the terms' magnitude
    ``scale``, plus half an ulp of the output): (the largest share of that bound used, why); else None."""
    if tensor not in SUMS or scale is None:
        return None
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    if a.shape != g.shape:
        return None
    used = bound_used(a, g, accumulation_bound(fmt, terms) * np.asarray(scale, dtype=np.float64).reshape(-1), fmt)
    if not np.all(np.isfinite(used)) or not np.all(used <= 1.0):
        return None
    worst = int(np.argmax(used))
    g_r, rhs = accumulation_words(terms)
    blocked = "" if accumulated_terms(terms)[1] == terms else f", {g_r} = {rhs}"  # (past 4096 terms: how m is made)
    return float(used[worst]), (
        f"within the rounding of a {accumulation_format(fmt)} accumulation of its "
        f"{terms} terms: every error at most {100 * used[worst]:.3g}% of {g_r}·Σ|terms| + ½ ulp{blocked} (channel "
        f"{worst}: {a[worst]:.6g} vs {g[worst]:.6g} expected, terms' magnitude {np.reshape(scale, -1)[worst]:.4g}: "
        "the sum cancels, so its relative error is rounding noise)")


def bound_used(actual: Any, golden: Any, bound: Any, fmt: str) -> np.ndarray:
    """|actual − golden| as a share of ``bound`` (what a correct kernel's arithmetic can err by, broadcast to the
    golden) plus half an ulp of ``fmt`` at the golden: <= 1 where a correct kernel's value can be, 0 where it is
    exact; NaN/inf where either value is not finite."""
    a = np.asarray(actual, dtype=np.float64)
    g = np.asarray(golden, dtype=np.float64)
    with np.errstate(all="ignore"):
        d = np.abs(a - g)
        return np.where(d == 0, 0.0, d / (np.asarray(bound, dtype=np.float64) + 0.5 * get_format(fmt).ulp(g)))


def _same_nonfinite_exempt(a: np.ndarray, g: np.ndarray, used: np.ndarray) -> np.ndarray:
    """``used`` with 0 where the kernel's value is the golden's own NaN or infinity (an input's NaN carried through,
    as the golden carries it: no error of the kernel's), so that a NaN row does not take the bound's exemption
    away from every finite element beside it."""
    with np.errstate(all="ignore"):
        same = ~np.isfinite(g) & ((np.isnan(a) & np.isnan(g)) | (a == g))
    return np.where(same, 0.0, used)


def within_bound(actual: Any, golden: Any, fmt: str, bound: tuple[np.ndarray, str] | None
                 ) -> tuple[float, str] | None:
    """When every element errs by at most ``bound`` (an array broadcastable to the output: the largest error a
    correct kernel's accumulation can put there, :func:`~bnprobe.engine.run.cancellation_bounds`, with its formula)
    plus half an ulp of the output — an element that is the golden's own NaN or infinity errs by nothing —: (the
    largest share of it used, why); else None."""
    if bound is None:
        return None
    g = np.asarray(golden, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if a.shape != g.shape or not g.size:
        return None
    used = _same_nonfinite_exempt(a, g, bound_used(a, g, np.broadcast_to(np.asarray(bound[0], dtype=np.float64),
                                                                       g.shape), fmt))
    if not np.all(np.isfinite(used)) or not np.all(used <= 1.0):
        return None
    w = int(np.argmax(used))
    return float(used.flat[w]), (f"within a correct kernel's accumulation where the sums cancel: every element errs "
                                 f"at most {100 * used.flat[w]:.3g}% of {bound[1]}, + ½ ulp (at "
                                 f"{element_at(w, g.shape)}: {a.flat[w]:.6g} vs {g.flat[w]:.6g} expected)")


def within_rounding(b: Any, actual: Any, golden: Any, fmt: str,
                   natural: Callable[[], np.ndarray] | None) -> tuple[float, str] | None:
    """When msprobe's benchmark ``b`` fails an elementwise output that is formed from larger terms (y = x̂·γ + β, dx
    = γ·rstd·(dy − mean dy − x̂·mean(dy·x̂))) and every element of it errs by at most what a correct kernel's
    rounding gives — SMALL_VALUE_ULPS units of its accumulation format times the element's natural magnitude
    (``natural()``, same shape as the output), plus half an ulp of the output — (the largest share of that bound
    used, why); else None.  Near zero such outputs cancel to rounding noise, which msprobe's relative metrics
    (the small-value ratio, the error balance) magnify whenever the bench happens to round better."""
    failing = [k for k, v in b.status.items() if v == "error"]
    if natural is None or not failing or get_format(fmt).name not in MSPROBE_STANDARDS:
        return None
    g = np.asarray(golden, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if a.shape != g.shape or not g.size:
        return None
    u = get_format(accumulation_format(fmt)).unit_roundoff
    used = _same_nonfinite_exempt(a, g, bound_used(a, g, SMALL_VALUE_ULPS * u * np.broadcast_to(natural(), g.shape),
                                                   fmt))
    if not np.all(np.isfinite(used)) or not np.all(used <= 1.0):
        return None
    w = int(np.argmax(used))
    return float(used.flat[w]), (
        f"within a correct kernel's rounding: every element errs at most {100 * used.flat[w]:.3g}% of "
        f"{SMALL_VALUE_ULPS:g} ulps of {accumulation_format(fmt)} times the magnitude it is formed from, + ½ ulp "
        f"(at {element_at(w, g.shape)}: {a.flat[w]:.6g} vs {g.flat[w]:.6g} expected); msprobe's "
        f"{', '.join(failing)} magnif{'ies' if len(failing) == 1 else 'y'} rounding noise where it cancels")


# ---- the doctor's per-channel rule ------------------------------------------------------------------------------

def channel_rule(key: str, got: np.ndarray, want: np.ndarray, natural: np.ndarray | None, fmt: str,
                 describe: bool = False, bound: tuple[np.ndarray, str] | None = None) -> tuple[float, str]:
    """Per channel, the error beyond the format's rounding (:func:`excess`) over rtol · max(max |want|, natural),
    or over ``bound`` (per channel, and the formula in words) where that is larger: the error a correct kernel's
    accumulation can make in a sum that cancels (:func:`~bnprobe.engine.run.cancellation_bounds`); the worst over
    the channels (<= 1 passes); with ``describe``, the failure in torch.testing's words."""
    a, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    rtol = doctor_tolerance(fmt)
    ch = 1 if a.ndim > 1 else 0
    # a large (N, C, ...) pair: the same figures in two compiled passes (rules_compiled), where every excess is finite
    fast = a.ndim > 1 and a.size > 0 and a.shape == w.shape and jit_for(a.size) and a.flags.c_contiguous \
        and w.flags.c_contiguous
    with np.errstate(all="ignore"):
        if fast:
            from bnprobe.compiled.rules import channel_peaks

            peak = channel_peaks(w, a.shape[1])
        else:
            wf = np.abs(w)
            if not np.isfinite(wf).all():
                wf = np.where(np.isfinite(wf), wf, 0.0)
            peak = wf.max(axis=tuple(i for i in range(a.ndim) if i != ch)) if a.ndim > 1 else wf
        scale = peak if natural is None else np.maximum(peak, natural)
        np.maximum(scale, 1e-300, out=scale)
        per_channel = rtol * scale
        by_bound = np.zeros(per_channel.shape, dtype=bool)
        if bound is not None:
            b = np.nan_to_num(np.asarray(bound[0], dtype=np.float64).reshape(-1))
            by_bound = b > per_channel
            per_channel = np.where(by_bound, b, per_channel)
    shape = [1] * a.ndim
    shape[ch] = -1
    allowed = per_channel.reshape(shape)
    # (a NaN allowance, from a NaN natural scale or bound, makes numpy's worst NaN: its route says so)
    worst = _channel_worst(a, w, fmt, per_channel) if fast and not np.isnan(per_channel).any() else None
    if worst is None:
        with np.errstate(all="ignore"):
            used = excess(a, w, fmt) / allowed
        ratio = float(used.max()) if used.size else 0.0
        if describe and not ratio <= 1:  # where the failure is, only for its message (a NaN ratio fails too)
            i, n_over, n = int(np.argmax(used)), int((used > 1).sum()), used.size
    else:
        (ratio, i, n_over), n = worst, a.size
    if not describe or ratio <= 1:
        return ratio, ""
    av, wv = float(a.flat[i]), float(w.flat[i])
    c = int(np.unravel_index(i, a.shape)[ch]) if a.ndim > 1 else i
    if bound is not None and by_bound[c]:
        beyond = (f"half an ulp: the bound of a correct kernel's accumulation, {bound[1]}; it passes from "
                  f"{ratio:.3g} times that bound")
    else:
        beyond = f"half an ulp: rtol {rtol:g} of the channel's scale; it passes from rtol {ratio * rtol:.3g}"
    return ratio, f"{key} ({fmt}): " + mismatch(
        n_over, n, where=element_at(i, a.shape, ch), actual=av, expected=wv,
        allowed=float(np.broadcast_to(allowed, a.shape).flat[i]), greatest=f"error {abs(av - wv):.3g}", beyond=beyond)


def _channel_worst(a: np.ndarray, w: np.ndarray, fmt: str, per_channel: np.ndarray) -> tuple[float, int, int] | None:
    """:func:`channel_rule`'s (worst, first index, count over 1) in one compiled pass; None where an excess is not
    finite (the non-finite values are judged by :func:`excess`)."""
    from bnprobe.compiled.rules import channel_worst

    f = get_format(fmt)
    return channel_worst(a, w, per_channel, f.emin, f.mantissa_bits)


def beyond_format(key: str, want: np.ndarray, fmt: str) -> str:
    """Where the exact value of an output is finite but its format holds only ±inf, or (the statistics that are
    positive by nature) nonzero but its format holds only 0; "" when the format holds it."""
    w = np.asarray(want, dtype=np.float64)
    with np.errstate(all="ignore"):
        r = round_to(w, fmt) if fmt != "fp64" else w
        over = np.isfinite(w) & np.isinf(r)
        under = np.isfinite(w) & (w != 0) & (r == 0) & (key in ("saved_invstd", "running_var"))
    f = get_format(fmt)
    what = [f"{int(m.sum())} / {m.size} beyond {f.name}'s maximum {f.max:.6g} (inf)" for m in (over,) if m.any()] + \
        [f"{int(m.sum())} / {m.size} below half {f.name}'s smallest subnormal (0)" for m in (under,) if m.any()]
    return f"{key} ({fmt}): " + ", ".join(what) if what else ""

"""compare-precision: every output of BatchNorm in each format against the FP64 golden on the same
rounded inputs, per tensor, per channel, and per stage (an error budget).

Verdicts use msprobe's standards (bnprobe.tolerances.MSPROBE_STANDARDS) by the output's format.
The default, ``scaled``, is msprobe's rule for reduction-based operators, which BatchNorm is —
|d - b| / max(|b|, floor) <= bound for every element, NaN/inf in the same places — with the
denominator floor taken relative to the tensor's largest golden magnitude (floor · max|b|):
msprobe's absolute floor assumes unit-scale outputs, but BatchNorm's gradients and sums cancel to
values near zero whose absolute error is tiny against the tensor's own scale.  For the sums whose
terms are known the floor is condition-aware: dbeta against Σ|dy|, dgamma against Σ|dy·x̂|, means
against mean|x| (a sum's rounding error scales with its terms, not its result), and dx against the
channel's γ·rstd·(max|dy| + |mean(dy)| + max|x̂|·|mean(dy·x̂)|), a bound on the magnitudes it is formed
from (the statistics' errors reach every element of the channel).
Variances keep their own scale, so the cancellation of a single-pass variance still counts.
``accumulated`` is msprobe's rule as written (absolute floor).  ``threshold`` is
msprobe's stricter rule for single elementwise operators (relative error <= rtol, or for small golden
values absolute error <= small_atol); every output of BatchNorm passes through several roundings
(x - mean, x̂, the affine, the cast), so a correct FP32 kernel fails it (rtol 2^-20) and so does any
BF16 kernel near zero (small-value atol 1e-16): use it to see single-rounding-level differences.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.adapters import KernelAdapter, Saved, get_adapter
from bnprobe.adapters.base import MODES, counters_only, params_format
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.inputs import make_input, make_params
from bnprobe.kernels import forward_train
from bnprobe.kernels.layout import element_at, layout_of
from bnprobe.metrics import benchmark, benchmark_verdict, checker_metrics, compare, ulp_error
from bnprobe.numerics.rounding import round_to
from bnprobe.recordings import CallRef, RecordedCalls, Recording
from bnprobe.tolerances import (
    MSPROBE_STANDARDS,
    SMALL_VALUE_ULPS,
    Standard,
    accumulation_bound,
    accumulation_format,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Case", "resnet50_cases", "stress_cases", "recorded_cases", "CompareResult", "compare_precision",
           "error_budget", "select_cases", "verdict", "summarize", "per_call", "first_failing_call", "budget_cause",
           "BUDGET_CHANNELS", "STANDARD_RULES"]

BUDGET_CHANNELS = 8  # the error budget reruns the kernel on the first channels of a layer (channels are independent)
ELEMENTWISE = ("y", "y_infer", "dx")

# ResNet-50 (ImageNet, 224x224) BatchNorm layers: (name, C, H, W), one entry per distinct shape
RESNET50_BN = [
    ("bn1", 64, 112, 112), ("layer1.*.bn1", 64, 56, 56), ("layer1.*.bn3", 256, 56, 56),
    ("layer2.0.bn1", 128, 56, 56), ("layer2.*.bn2", 128, 28, 28), ("layer2.*.bn3", 512, 28, 28),
    ("layer3.0.bn1", 256, 28, 28), ("layer3.*.bn2", 256, 14, 14), ("layer3.*.bn3", 1024, 14, 14),
    ("layer4.0.bn1", 512, 14, 14), ("layer4.*.bn2", 512, 7, 7), ("layer4.*.bn3", 2048, 7, 7),
]


@dataclass(frozen=True)
class Case:
    """One input: a name, a shape and how to make x (or x itself, for real activations)."""

    name: str
    shape: tuple[int, ...]
    dist: str = "normal"
    mean: float = 0.0
    std: float = 1.0
    seed: int = 0
    x: np.ndarray | None = field(default=None, compare=False, repr=False)
    call: CallRef | None = field(default=None, compare=False, repr=False)  # a recorded call: all inputs from it

    def make(self) -> np.ndarray:
        if self.x is not None:
            return self.x
        if self.call is not None:
            return self.call.load().call_inputs()["x"]
        return make_input(self.shape, dist=self.dist, mean=self.mean, std=self.std, seed=self.seed)


def recorded_cases(calls: RecordedCalls) -> list[Case]:
    """One case per recorded BatchNorm call, in forward order (tensors are loaded one call at a time)."""
    calls.require_tensors("comparing a call's outputs with the golden")
    return [Case(c.label, c.shape, "recorded", seed=0, call=c) for c in calls.calls]


def resnet50_cases(batch: int = 2, seed: int = 0, dist: str = "normal") -> list[Case]:
    """ResNet-50's BatchNorm shapes with the batch reduced to ``batch``."""
    return [Case(f"resnet50/{name}", (batch, c, h, w), dist, seed=seed + i) for i, (name, c, h, w)
            in enumerate(RESNET50_BN)]


def stress_cases(seed: int = 0) -> list[Case]:
    """Inputs that stress BatchNorm rather than uniform noise."""
    s = (8, 16, 8, 8)
    return [
        Case("stress/normal", s, seed=seed),
        *[Case(f"stress/mean/std={m:g}", s, mean=m, std=1.0, seed=seed) for m in (1e1, 1e2, 1e3, 1e4)],
        Case("stress/heavy-tails", s, "student_t", seed=seed),
        Case("stress/near-fp16-max", s, mean=0.0, std=8000.0, seed=seed),
        Case("stress/var-near-eps", s, mean=0.5, std=math.sqrt(1e-5), seed=seed),
        Case("stress/constant", s, "constant", mean=1.5, std=0.0, seed=seed),
        Case("stress/R=2", (2, 16), seed=seed),
        Case("stress/R=3", (3, 16), seed=seed),
    ]


# ---- verdicts ----------------------------------------------------------------------------------------

STANDARD_RULES = ("scaled", "accumulated", "threshold")
RULES = ("benchmark", *STANDARD_RULES)


def beyond_rounding(actual: np.ndarray, golden: np.ndarray, fmt: str) -> np.ndarray:
    """|actual − golden| less half an ulp of ``fmt`` at the golden (subnormal spacing included), floored at
    0: the error beyond the output format's own rounding, so a correctly rounded result has none."""
    a = np.asarray(actual, dtype=np.float64)
    g = np.asarray(golden, dtype=np.float64)
    with np.errstate(all="ignore"):
        return np.maximum(np.abs(a - g) - 0.5 * get_format(fmt).ulp(g), 0.0)


def nonfinite_mismatch(actual: np.ndarray, golden: np.ndarray, fmt: str) -> str:
    """Where NaN/±inf in ``actual`` differ from the golden rounded to ``fmt`` (a golden beyond the format's
    range rounds to ±inf), a sentence saying how many and where; "" when they agree."""
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    f = get_format(fmt)
    if a.size and np.isfinite(a).all() and np.isfinite(g).all() and float(np.abs(g).max()) <= f.max:
        return ""  # all finite, and no golden value can round to ±inf
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


def _greatest(actual: Any, bench: Any, golden: Any, bench_name: str) -> str:
    """Where a kernel that fails the benchmark errs most: the element, its value, the expected value and the bench's
    value there (what a careful kernel in the same formats gets)."""
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


def verdict(actual: np.ndarray, golden: np.ndarray, fmt: str, rule: str = "scaled",
            standards: dict[str, Standard] | None = None, scale: np.ndarray | None = None
            ) -> tuple[bool, str, float, float]:
    """msprobe's verdict for one tensor by ``rule`` (scaled, accumulated or threshold):
    (passed, reason, score, bound) with score the worst error measure and bound its limit.

    Every rule measures the error beyond the output format's own rounding (:func:`beyond_rounding`),
    so the correctly rounded golden always passes; non-finite values must be where the golden
    rounded to ``fmt`` has them (a golden beyond the format's range rounds to ±inf).
    ``scale`` (same shape as golden) gives the scaled rule each element's natural magnitude."""
    if rule not in STANDARD_RULES:
        raise BNProbeError(f"unknown standard rule {rule!r}; valid: {', '.join(STANDARD_RULES)}")
    f = get_format(fmt)
    std = (standards or MSPROBE_STANDARDS).get(f.name)
    if std is None:
        return True, "no standard for this format", 0.0, math.inf
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    bad = nonfinite_mismatch(a, g, f.name)
    if bad:
        return False, bad, math.inf, 0.0
    fa = np.isfinite(a)
    sc = None if scale is None else \
        np.broadcast_to(np.asarray(scale, dtype=np.float64), np.shape(golden)).reshape(-1)[fa]
    a, g = a[fa], g[fa]
    with np.errstate(all="ignore"):
        d = beyond_rounding(a, g, f.name)
        if rule == "threshold":
            small = np.abs(g) <= std.small_threshold
            used = np.where(small, d / std.small_atol, d / np.where(small, 1.0, np.abs(g)) / std.rtol)
            bad_small = int(np.sum(small & (used > 1)))
            bad = int(np.sum(~small & (used > 1)))
            score = (float(used.max()) if used.size else 0.0) * std.rtol
            if bad or bad_small:
                w = int(np.argmax(used))
                allowed = std.small_atol if small[w] else std.rtol * abs(g[w])
                return False, (f"Mismatched elements: {bad + bad_small} / {used.size} "
                               f"({100.0 * (bad + bad_small) / used.size:.3g}%: {bad} over rtol {std.rtol:.3g}, "
                               f"{bad_small} small value(s) over atol {std.small_atol:.3g}); greatest at "
                               f"{element_at(int(np.flatnonzero(fa)[w]), np.shape(golden))}: {a[w]:.6g} vs {g[w]:.6g} "
                               f"expected ({allowed:.3g} allowed beyond rounding)"), score, std.rtol
            return True, f"within rtol {std.rtol:.3g} / small-value atol {std.small_atol:.3g}", score, std.rtol
        if rule == "scaled":
            mag = sc if sc is not None else np.full(g.shape, float(np.abs(g).max()) if g.size else 1.0)
            floor = std.error_floor * np.where(mag > 0, mag, 1.0)
        else:
            floor = std.error_floor
        ratio = d / np.maximum(np.abs(g), floor)
        worst = float(ratio.max()) if ratio.size else 0.0
        if worst > std.accumulated:
            k = int(np.sum(ratio > std.accumulated))
            w = int(np.argmax(ratio))
            where = int(np.flatnonzero(fa)[w])
            allowed = std.accumulated * max(abs(g[w]), float(np.asarray(floor).reshape(-1)[w])
                                            if np.ndim(floor) else float(floor))
            return False, (f"Mismatched elements: {k} / {ratio.size} ({100.0 * k / ratio.size:.3g}%); greatest "
                           f"accumulated error {worst:.3g} at {element_at(where, np.shape(golden))}: {a[w]:.6g} vs "
                           f"{g[w]:.6g} expected ({allowed:.3g} allowed beyond rounding: "
                           f"{std.accumulated:.3g} of the reference)"), worst, std.accumulated
        return True, f"accumulated error {worst:.3g} within {std.accumulated:.3g}", worst, std.accumulated


SUMS = ("saved_mean", "dgamma", "dbeta")  # per-channel sums (or means) of R terms, scaled by Σ|terms| (mean |x|)


def _within_accumulation(tensor: str, actual: Any, golden: Any, fmt: str, scale: np.ndarray | None,
                         case: Case) -> tuple[float, str] | None:
    """For a per-channel sum or mean whose every error is within what a correct kernel's accumulation of its R
    terms can produce (:func:`~bnprobe.tolerances.accumulation_bound` times the terms' magnitude, plus half an
    ulp of the output): (the largest share of that bound used, why); else None."""
    if tensor not in SUMS or scale is None:
        return None
    g = np.asarray(golden, dtype=np.float64).reshape(-1)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    terms = math.prod(case.shape) // max(g.size, 1)
    with np.errstate(all="ignore"):
        bound = accumulation_bound(fmt, terms) * np.asarray(scale, dtype=np.float64).reshape(-1) \
            + 0.5 * get_format(fmt).ulp(g)
        used = np.abs(a - g) / bound
    if a.shape != g.shape or not np.all(np.isfinite(used)) or not np.all(used <= 1.0):
        return None
    worst = int(np.argmax(used))
    return float(used[worst]), (
        f"within the rounding of a {accumulation_format(fmt)} accumulation of its "
        f"{terms} terms: every error at most {100 * used[worst]:.3g}% of γ_{terms}·Σ|terms| + ½ ulp (channel "
        f"{worst}: {a[worst]:.6g} vs {g[worst]:.6g} expected, terms' magnitude {np.reshape(scale, -1)[worst]:.4g}: "
        "the sum cancels, so its relative error is rounding noise)")


def _small_values_rounded(b: Any, actual: Any, golden: Any, fmt: str,
                          natural: Callable[[], np.ndarray] | None) -> tuple[float, str] | None:
    """When msprobe's benchmark fails an elementwise output only on its small-value ratio (a few outputs near
    zero, where y = x̂·γ + β cancels) and each of those outputs is within what a correct kernel's rounding gives
    (SMALL_VALUE_ULPS units of its accumulation format times the output's natural magnitude |x·rstd·γ| +
    |μ·rstd·γ| + |β|, plus half an ulp): (the largest share of that bound used, why); else None."""
    failing = [k for k, v in b.status.items() if v == "error"]
    std = MSPROBE_STANDARDS.get(get_format(fmt).name)
    if natural is None or failing != ["small_value"] or std is None:
        return None
    g = np.asarray(golden, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    small = np.abs(g) <= std.small_threshold
    if a.shape != g.shape or not small.any():
        return None
    u = get_format(accumulation_format(fmt)).unit_roundoff
    with np.errstate(all="ignore"):
        bound = SMALL_VALUE_ULPS * u * natural()[small] + 0.5 * get_format(fmt).ulp(g[small])
        used = np.abs(a[small] - g[small]) / bound
    if not np.all(np.isfinite(used)) or not np.all(used <= 1.0):
        return None
    return float(used.max()), (
        f"within a correct kernel's rounding: the {int(small.sum())} output(s) near zero (|golden| <= "
        f"{std.small_threshold:g}) that msprobe's small-value ratio counts each err at most {100 * used.max():.3g}% "
        f"of {SMALL_VALUE_ULPS:g} ulps of {accumulation_format(fmt)} times "
        "|x·rstd·γ| + |μ·rstd·γ| + |β| (y cancels there), and every other metric is within the benchmark")


def _y_natural(inp: _Inputs, gold_t: Any) -> np.ndarray:
    """Per element of y, the magnitude it is formed from: |x·rstd·γ| + |μ·rstd·γ| + |β| (golden statistics)."""
    lay = layout_of(inp.x)
    shape = [-1 if ax == lay.channel_axis else 1 for ax in range(len(lay.shape))]
    r = gold_t.saved.invstd(inp.eps).astype(np.float64)
    g = np.ones(lay.channels) if inp.gamma is None else np.asarray(inp.gamma, dtype=np.float64)
    b = np.zeros(lay.channels) if inp.beta is None else np.asarray(inp.beta, dtype=np.float64)
    rg = np.abs(r * g)
    mu = np.abs(gold_t.saved.mean.astype(np.float64)) * rg + np.abs(b)
    return np.abs(np.asarray(inp.x, dtype=np.float64)) * rg.reshape(shape) + mu.reshape(shape)


def _benchmark(actual: Any, bench: Any, golden: Any, fmt: str) -> Any:
    """msprobe's benchmark verdict; ``bench`` is the bench's output or a :class:`_BenchOutput` that keeps its
    metrics (computed once per output, and reused whole when ``actual`` is the bench's own array)."""
    if not isinstance(bench, _BenchOutput):
        return benchmark(actual, bench, golden, fmt)
    if bench.metrics is None:
        bench.metrics = checker_metrics(bench.value, golden, fmt)
    dev = bench.metrics if actual is bench.value else checker_metrics(actual, golden, fmt)
    if dev is None or bench.metrics is None:
        return benchmark(actual, bench.value, golden, fmt)
    return benchmark_verdict(dev, bench.metrics, fmt)


@dataclass
class _BenchOutput:
    value: Any
    metrics: dict[str, Any] | None = None
    format_check: tuple[bool, str, float, float] | None = None  # the absolute standard on the bench's output


def _row(adapter: str, dtype: str, case: Case, tensor: str, actual: Any, golden: Any, fmt: str,
         standards: dict[str, Standard] | None, rule: str, scale: np.ndarray | None = None,
         bench: Any = None, bench_name: str = "", explain: str = "",
         natural: Callable[[], np.ndarray] | None = None) -> dict[str, Any]:
    """One output's row: msprobe's metrics; the kernel verdict (by default msprobe's benchmark method against
    the bench's output, else the absolute ``rule`` on the kernel's output); the format check — is the format
    adequate for this data: the bench's output (a careful kernel in the same formats) by the absolute scaled
    rule, or the kernel's own output when there is no bench — with what explains a format that falls short."""
    kind = "elementwise" if tensor in ELEMENTWISE else "reduction"
    m = compare(actual, golden, fmt)
    if rule != "benchmark":
        ok_abs, why_abs, score_abs, bound_abs = verdict(actual, golden, fmt, rule, standards, scale)
    if isinstance(bench, _BenchOutput):
        if bench.format_check is None:
            bench.format_check = verdict(bench.value, golden, fmt, "scaled", standards, scale)
        f_ok, f_why, f_score, f_bound = bench.format_check
    elif rule == "scaled":  # no bench: the kernel's own output, already judged by this rule
        f_ok, f_why, f_score, f_bound = ok_abs, why_abs, score_abs, bound_abs
    else:
        f_ok, f_why, f_score, f_bound = verdict(actual, golden, fmt, "scaled", standards, scale)
    extra: dict[str, Any] = {}
    if rule == "benchmark":
        b = _benchmark(actual, bench, golden, fmt)
        # msprobe's metrics leave non-finite elements out: NaN/inf the golden has not is judged here
        broken = nonfinite_mismatch(actual, golden, fmt)
        ok = b.result != "error" and not broken
        ratios = ", ".join(f"{k} {v:.3g}/{b.limits[k]:g}" for k, v in b.ratios.items() if k in b.limits)
        why = broken or (f"{'within' if ok else 'over'} msprobe's benchmark vs {bench_name} (ratio/limit: {ratios})"
                         + (f"; {b.problem}" if b.problem else "")
                         + ("" if ok else _greatest(actual, bench.value if isinstance(bench, _BenchOutput) else bench,
                                                    golden, bench_name)))
        score, bound = (math.inf if broken else float(b.needed)), 1.0
        if not ok and not broken and ((within := _within_accumulation(tensor, actual, golden, fmt, scale, case))
                                      or (within := _small_values_rounded(b, actual, golden, fmt, natural))):
            ok, score, why = True, within[0], f"{within[1]} (msprobe's benchmark alone would fail it: {ratios})"
        extra = {f"bench_{k}": v for k, v in b.ratios.items()}
    else:
        ok, why, score, bound = ok_abs, why_abs, score_abs, bound_abs
    std = (standards or MSPROBE_STANDARDS).get(get_format(fmt).name)
    ulp = ulp_error(np.asarray(actual, dtype=np.float64), np.asarray(golden, dtype=np.float64), fmt)
    ulp = ulp[np.isfinite(ulp)]
    over = float(np.mean(ulp > std.ulp)) if std is not None and ulp.size else 0.0
    gg = np.abs(np.asarray(golden, dtype=np.float64).reshape(-1))
    small = float(np.mean(gg <= std.small_threshold)) if std is not None and gg.size else 0.0
    f = get_format(fmt)
    with np.errstate(all="ignore"):
        sub = float(np.mean((gg > 0) & (gg < 2.0 ** f.emin))) if gg.size and f.name != "fp64" else 0.0
        ovf = float(np.mean(gg > f.max)) if gg.size and np.isfinite(f.max) else 0.0
    why_fmt = ""
    if not f_ok:
        notes = [n for n in (f"{100 * sub:.3g}% of the golden in {f.name}'s subnormal range" if sub else "",
                             f"{100 * ovf:.3g}% beyond {f.name}'s largest value" if ovf else "", explain) if n]
        who = f"{bench_name} (the bench)" if isinstance(bench, _BenchOutput) else "this kernel"
        why_fmt = f"{who}: {f_why}" + (f" — {'; '.join(notes)}" if notes else "")
    return {"adapter": adapter, "dtype": dtype, "case": case.name, "shape": "x".join(map(str, case.shape)),
            "tensor": tensor, "format": fmt, "kind": kind, "verdict": "PASS" if ok else "FAIL", "why": why,
            "score": score, "bound": bound, "format_check": "ok" if f_ok else "WARN", "format_why": why_fmt,
            "format_score": f_score, "format_bound": f_bound, **extra,
            **{k: v for k, v in m.to_dict().items() if k not in ("worst_index",)},
            "ulp_over_threshold": over, "small_value_share": small, "subnormal_share": sub}


def _channels(adapter: str, dtype: str, case: Case, y: np.ndarray, gy: np.ndarray, var: np.ndarray,
              gvar: np.ndarray, gmean: np.ndarray, eps: float, top: int) -> list[dict[str, Any]]:
    """The worst channels of y, with what explains them."""
    a, g = layout_of(y).to_cr(y), layout_of(gy).to_cr(gy)
    with np.errstate(all="ignore"):
        d = np.abs(a - g)
        err = np.where(np.isnan(d), -np.inf, d).max(axis=1)  # NaN for a channel whose error is all NaN
        err = np.where(np.isneginf(err), np.nan, err)
        var_rel = np.abs(np.asarray(var, dtype=np.float64) - gvar) / np.where(gvar > 0, gvar, np.nan)
        m2v = gmean**2 / np.where(gvar > 0, gvar, np.nan)
    r = a.shape[1]
    order = np.argsort(-np.nan_to_num(err, nan=np.inf))[:top]
    return [{"adapter": adapter, "dtype": dtype, "case": case.name, "channel": int(c), "y_max_abs_err": float(err[c]),
             "var_rel_err": float(var_rel[c]), "mean2_over_var": float(m2v[c]), "var_over_eps": float(gvar[c] / eps),
             "R": r} for c in order]


def error_budget(adapter: PolicyAdapter, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, *, dtype: str,
                 eps: float = 1e-5, params: str = "fp32", channels: int = BUDGET_CHANNELS) -> list[dict[str, Any]]:
    """Rerun the training forward with one stage at a time replaced by its FP64 value (the same stage of
    the golden run on the same inputs); report how much of the output's error (RMSE of y against the
    golden) disappears.  The output cast's share is y left unrounded.  Every stage downstream of an
    error's source removes it too, so the *cause* is the earliest stage, in computation order, that
    removes most of it (see :func:`budget_cause`).  Shares need not add up to 100%."""
    k = min(channels, x.shape[1])
    xs = np.ascontiguousarray(x[:, :k])
    pf = params_format(dtype, params)
    xs = round_to(xs, dtype)
    g, b = round_to(gamma[:k], pf), round_to(beta[:k], pf)
    pol = adapter.policy_for(xs, dtype=dtype, params=params)
    pol = replace(pol, core_combine="ordered") if pol.core_combine == "atomic" else pol  # same order every rerun
    gold = forward_train(xs, g, b, eps=eps, policy=pol.golden())
    base = forward_train(xs, g, b, eps=eps, policy=pol)
    gy = gold.trace["y"].value

    def rmse(res: Any) -> float:
        """Error of the y stage as the kernel formed it (the trace's value: an override of y survives there)."""
        with np.errstate(all="ignore"):
            return float(np.sqrt(np.nanmean((res.trace["y"].value - gy) ** 2)))

    e0 = rmse(base)
    rows = []
    skip = {"x", "x_acc", "x_compute", "var_unbiased", "running_mean", "running_var"}
    for st in base.trace:
        if st.name in skip:
            continue
        if st.name == "y":  # the output cast: y at its unrounded (compute-format) value
            ov, label = {"y": st.wide}, "y (output cast)"
        elif st.name in gold.trace:
            ov, label = {st.name: gold.trace[st.name].value}, st.name
        else:
            continue
        e = rmse(forward_train(xs, g, b, eps=eps, policy=pol, overrides=ov))
        removed = (1.0 - e / e0) if e0 > 0 else 0.0
        rows.append({"adapter": adapter.name, "dtype": dtype, "order": len(rows), "stage": label,
                     "format": st.format, "rmse_with_stage_exact": e, "rmse": e0, "error_removed": removed})
    return rows


def budget_cause(shares: list[tuple[str, float]], share: float = 0.9) -> tuple[str, float]:
    """The earliest stage (``shares`` in computation order) removing at least ``share`` of the largest
    removal: the intermediate where the error arises."""
    if not shares:
        return "", float("nan")
    top = max(v for _, v in shares)
    if not top > 0:
        return "", top
    for stage, v in shares:
        if v >= share * top:
            return stage, v
    return shares[-1]


# ---- the whole run ------------------------------------------------------------------------------------

@dataclass
class CompareResult:
    rows: pd.DataFrame
    channels: pd.DataFrame
    budget: pd.DataFrame
    meta: dict[str, Any]

    @property
    def passed(self) -> bool:
        return bool((self.rows["verdict"] == "PASS").all()) if len(self.rows) else True

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "passed": self.passed, "rows": self.rows.to_dict(orient="records"),
                "channels": self.channels.to_dict(orient="records"), "budget": self.budget.to_dict(orient="records")}


COMPARE_MODES = (*MODES, "all")  # compare-precision also takes every mode at once


@dataclass
class _Inputs:
    """One case's inputs in one format, rounded as every adapter receives them."""

    fmt: str
    params: str  # same or fp32
    pf: str  # the parameters' format
    x: np.ndarray
    gamma: np.ndarray | None
    beta: np.ndarray | None
    running_mean: np.ndarray | None
    running_var: np.ndarray | None
    dy: np.ndarray | None
    eps: float
    momentum: float | None
    modes: tuple[str, ...]  # of train, infer, backward
    training: bool = True
    rec: Recording | None = None
    goldens: dict[str, Any] = field(default_factory=dict)  # inference y and backward of the golden, once per case

    @property
    def common(self) -> dict[str, Any]:
        return {"dtype": self.fmt, "eps": self.eps, "params": self.params}


def _generated(case: Case, x: np.ndarray, fmt: str, params: str, eps: float, momentum: float | None,
               modes: tuple[str, ...]) -> _Inputs:
    lay = layout_of(x)
    c = lay.channels
    prm = make_params(c, case.seed)
    pf = params_format(fmt, params)
    dy = np.random.default_rng([case.seed, 3]).standard_normal(x.shape)
    rm, rv = np.full(c, case.mean), np.full(c, max(case.std, 1e-3) ** 2)
    train_ok = lay.reduce_size > 1
    return _Inputs(fmt, params, pf, round_to(x, fmt), round_to(prm["gamma"], pf), round_to(prm["beta"], pf),
                   round_to(rm, pf), round_to(rv, pf), round_to(dy, fmt), eps, momentum,
                   tuple(m for m in modes if m == "infer" or train_ok))


def _recorded(rec: Recording, modes: tuple[str, ...]) -> _Inputs:
    """A recorded call's own inputs and scalars: the modes it recorded, in its formats."""
    ci = rec.call_inputs()
    name = rec.meta.get("call") or rec.source
    if ci["layout"] != "channels_first":
        raise BNProbeError(f"{name} is recorded {ci['layout']}: compare-precision takes channels_first recordings")
    if rec.training and layout_of(ci["x"]).reduce_size < 2:
        raise BNProbeError(f"{name}: a training call with one value per channel (N*H*W = 1) has no batch statistics "
                           "to compare")
    kept = tuple(m for m in modes if m in rec.tensors and (m != "train" or rec.training))
    return _Inputs(rec.dtype, ci["params"], rec.params, ci["x"], ci["gamma"], ci["beta"], ci["running_mean"],
                   ci["running_var"], ci["dy"], rec.eps, rec.momentum, kept, rec.training, rec)


def _scales(inp: _Inputs, gold_t: Any) -> dict[str, np.ndarray | None]:
    """Natural scales of the sums, per channel (see the module docstring); temporaries freed at once."""
    lay = layout_of(inp.x)
    xcr = lay.to_cr(inp.x)
    out: dict[str, np.ndarray | None] = {"mean": np.abs(xcr).mean(axis=1), "dx": None, "dgamma": None,
                                         "dbeta": None}
    if gold_t is None or inp.dy is None:
        return out
    eps = inp.eps
    gm, gv = gold_t.saved.mean.astype(np.float64), gold_t.saved.var(eps)
    xhat = (xcr - gm[:, None]) / np.sqrt(gv[:, None] + eps)
    del xcr
    dycr = lay.to_cr(inp.dy)
    g = np.ones(lay.channels) if inp.gamma is None else inp.gamma
    out["dbeta"], out["dgamma"] = np.abs(dycr).sum(axis=1), np.abs(dycr * xhat).sum(axis=1)
    gr = np.abs(g) / np.sqrt(gv + eps)
    m1, m2 = np.abs(dycr.mean(axis=1)), np.abs((dycr * xhat).mean(axis=1))
    dx_max = gr * (np.abs(dycr).max(axis=1) + m1 + np.abs(xhat).max(axis=1) * m2)
    out["dx"] = dx_max.reshape([-1 if ax == lay.channel_axis else 1 for ax in range(len(lay.shape))])
    return out


def _for_case(a: KernelAdapter, case: Case, rec: Recording | None) -> KernelAdapter:
    """A dump adapter bound to the case's recorded call (another dump's call of the same name otherwise)."""
    if not isinstance(a, DumpAdapter) or rec is None or case.call is None:
        return a
    if any(c is case.call for c in a.calls.calls):
        return a.bind(rec)
    match = [c for c in a.calls.calls if c.label == case.call.label]
    if not match:
        raise BNProbeError(f"{a.name} has no call {case.call.label!r} to replay on this case")
    return a.bind(match[0].load())


def _outputs(a: KernelAdapter, ref: KernelAdapter, inp: _Inputs, gold_t: Any, sc: dict[str, np.ndarray | None],
             ) -> tuple[list[tuple[str, Any, Any, str, np.ndarray | None]], dict[str, Any]]:
    """Run ``a`` on one case in every mode the case asks for: (tensor, actual, golden, format, scale) per
    output, and what the rows need besides (the forward's y and saved statistics, stored-statistics shares)."""
    fmt, pf, eps, common = inp.fmt, inp.pf, inp.eps, inp.common
    out_fmt = a.capabilities().output or fmt
    xs, g, b, rms, rvs = inp.x, inp.gamma, inp.beta, inp.running_mean, inp.running_var
    outs: list[tuple[str, Any, Any, str, np.ndarray | None]] = []
    info: dict[str, Any] = {}

    def put(t: str, act: Any, gol: Any, f: str, scale: np.ndarray | None = None) -> None:
        # judge an output by the format the adapter returned it in (fp16 parameters, say), falling
        # back to ``f`` for float64 arrays (the reference, or formats carried in float64)
        dt = np.asarray(act).dtype
        outs.append((t, act, gol, get_format(dt).name if dt != np.float64 else f, scale))

    saved: Saved | None = None
    if "train" in inp.modes:
        out = a.forward_train(xs, g, b, rms, rvs, momentum=inp.momentum, **common)
        saved = out.saved
        put("y", out.y, gold_t.y, out_fmt)
        info["y"] = out.y
        if out.saved is not None:
            kind = out.saved.kind
            sf = get_format(np.asarray(out.saved.value).dtype).name
            gval = gold_t.saved.var(eps) if kind == "var" else gold_t.saved.invstd(eps)
            put("saved_mean", out.saved.mean, gold_t.saved.mean, sf, sc["mean"])
            put(f"saved_{kind}", out.saved.value, gval, sf)
            info["saved"] = out.saved
        if out.running_mean is not None and gold_t.running_mean is not None:
            mom = 0.0 if inp.momentum is None else inp.momentum
            put("running_mean", out.running_mean, gold_t.running_mean, pf, np.maximum(np.abs(rms), mom * sc["mean"]))
            put("running_var", out.running_var, gold_t.running_var, pf)
    if "infer" in inp.modes:
        out_i = a.forward_infer(xs, g, b, rms, rvs, **common)
        if "y_infer" not in inp.goldens:
            inp.goldens["y_infer"] = ref.forward_infer(xs, g, b, rms, rvs, **common).y
        put("y_infer", out_i.y, inp.goldens["y_infer"], out_fmt)
    if "backward" in inp.modes and inp.dy is not None:
        if inp.training:
            if saved is None and "train" not in inp.modes:
                saved = a.forward_train(xs, g, b, rms, rvs, momentum=inp.momentum, **common).saved
            # a kernel that saves nothing (a recorded functional call) recomputes its statistics itself
            mine, gold_saved = saved if saved is not None else gold_t.saved, gold_t.saved
        else:
            mine = gold_saved = Saved(rms, "var", rvs)
        got = a.backward(inp.dy, xs, g, mine, training=inp.training, **common)
        if "backward" not in inp.goldens:  # the same for every adapter: the golden's own statistics
            inp.goldens["backward"] = ref.backward(inp.dy, xs, g, gold_saved, training=inp.training, **common)
        gold_b = inp.goldens["backward"]
        missing = got.meta.get("missing", ())  # gradients a recorded kernel did not compute
        for t, act, gol, f, scale in (("dx", got.dx, gold_b.dx, out_fmt, sc["dx"]),
                                      ("dgamma", got.dgamma, gold_b.dgamma, pf, sc["dgamma"]),
                                      ("dbeta", got.dbeta, gold_b.dbeta, pf, sc["dbeta"])):
            if t not in missing:
                put(t, act, gol, f, scale)
        if inp.training and saved is not None and "dx" not in missing and a is not ref:
            info["stored_share"] = _stored_share(ref, inp, saved, got.dx, gold_b.dx)
    return outs, info


def _stored_share(ref: KernelAdapter, inp: _Inputs, saved: Saved, dx: np.ndarray, gold_dx: np.ndarray) -> float:
    """The share of dx's error (RMSE against the golden) that the kernel's stored statistics explain: the
    golden backward recomputed from the statistics exactly as stored removes that share."""
    stored = Saved(np.asarray(saved.mean, dtype=np.float64), saved.kind, np.asarray(saved.value, dtype=np.float64))
    gold2 = ref.backward(inp.dy, inp.x, inp.gamma, stored, training=True, **inp.common).dx
    with np.errstate(all="ignore"):
        d = np.asarray(dx, dtype=np.float64)
        e0 = float(np.sqrt(np.nanmean((d - gold_dx) ** 2)))
        e1 = float(np.sqrt(np.nanmean((d - gold2) ** 2)))
    return max(0.0, 1.0 - e1 / e0) if e0 > 0 else 0.0


def _explain(inp: _Inputs, gold_t: Any) -> str:
    """What makes the data hard for a format: mean²/var (cancellation), var/eps (eps dominance), R."""
    lay = layout_of(inp.x)
    parts = [f"R = {lay.reduce_size}"]
    if gold_t is not None and gold_t.saved is not None:
        m = np.asarray(gold_t.saved.mean, dtype=np.float64)
        v = gold_t.saved.var(inp.eps)
        with np.errstate(all="ignore"):
            r = m * m / np.where(v > 0, v, np.nan)
            m2v = float(np.max(r[np.isfinite(r)])) if np.isfinite(r).any() else float("inf")
            ve = float(np.min(v / inp.eps)) if v.size else float("nan")
        parts = [f"max mean²/var {m2v:.3g}", f"min var/eps {ve:.3g}", *parts]
    if inp.pf not in ("fp32", "fp64"):
        parts.append(f"statistics and parameters in {inp.pf}")
    return ", ".join(parts)


def _compare_adapter(a: KernelAdapter, ref: KernelAdapter, case: Case, inp: _Inputs, gold_t: Any,
                     sc: dict[str, np.ndarray | None], standards: dict[str, Standard] | None, rule: str,
                     budget: bool, top_channels: int, rows: list[dict[str, Any]], chans: list[dict[str, Any]],
                     budgets: list[dict[str, Any]], bench: tuple[str, dict[str, Any], Any, Any] | None = None) -> None:
    """Every output of one adapter on one case against the golden (and the bench's outputs)."""
    fmt, eps = inp.fmt, inp.eps
    bench_name, bench_out, bench_run, bench_pol = bench if bench is not None else ("", {}, None, None)
    if bench_run is not None and bench_pol is not None and _policy(a, inp) == bench_pol:
        outs, info = bench_run  # the same kernel as the bench: its outputs, not a second run
    else:
        outs, info = _outputs(a, ref, inp, gold_t, sc)
    explain = _explain(inp, gold_t)
    for t, act, gol, f, scale in outs:
        natural = (lambda: _y_natural(inp, gold_t)) if t == "y" and gold_t is not None else None
        r = _row(a.name, fmt, case, t, act, gol, f, standards, rule, scale, bench_out.get(t), bench_name, explain,
                 natural)
        if t == "dx" and "stored_share" in info:
            r["stored_stats_share"] = info["stored_share"]
        rows.append(r)
    if "saved" in info:
        chans.extend(_channels(a.name, fmt, case, info["y"], gold_t.y, info["saved"].var(eps),
                               gold_t.saved.var(eps), gold_t.saved.mean.astype(np.float64), eps, top_channels))
    if budget and isinstance(a, PolicyAdapter) and a.name != "reference" and gold_t is not None and \
            inp.gamma is not None and inp.beta is not None:
        for r in error_budget(a, inp.x, inp.gamma, inp.beta, dtype=fmt, eps=eps, params=inp.params):
            budgets.append({"case": case.name, **r})


def _policy(a: KernelAdapter, inp: _Inputs) -> Any:
    """The policy an emulated adapter runs this case with (its name aside), or None for other kernels."""
    if not isinstance(a, PolicyAdapter) or a.name == "reference":
        return None
    return replace(a.policy_for(inp.x, dtype=inp.fmt, params=inp.params), name="")


def _bench(bench: KernelAdapter, ref: KernelAdapter, inp: _Inputs, gold_t: Any,
           sc: dict[str, np.ndarray | None]) -> tuple[str, dict[str, Any], Any, Any]:
    """The bench on one case: its name, its outputs by tensor name (saved statistics under both names), the
    run itself and its policy (an adapter running the same policy reuses the run)."""
    run = _outputs(bench, ref, inp, gold_t, sc)
    outs, info = run
    got = {t: _BenchOutput(act) for t, act, *_ in outs}
    if "saved" in info:
        s = info["saved"]
        for kind, value in (("invstd", s.invstd(inp.eps)), ("var", s.var(inp.eps))):
            got.setdefault(f"saved_{kind}", _BenchOutput(value))
    return bench.name, got, run, _policy(bench, inp)


def _check_formats(resolved: list[KernelAdapter], bench_a: KernelAdapter | None, cases: list[Case],
                   fmts: list[str], recorded_fmts: list[str], dtypes: tuple[str, ...] | None) -> None:
    """Refuse, before any work, formats that contradict a recording or that an adapter or the bench cannot run."""
    if dtypes is not None:
        off = [f for f in recorded_fmts if f not in fmts]
        if off:
            raise BNProbeError(f"the recording holds {', '.join(off)} calls; dtypes {', '.join(fmts)} contradict it")
    need = list(dict.fromkeys((fmts if any(c.call is None for c in cases) else []) + recorded_fmts))
    for a in resolved:
        missing = [f for f in need if f not in a.capabilities().formats]
        if missing:
            raise BNProbeError(f"adapter {a.name} does not run {', '.join(missing)} "
                               f"(it runs {', '.join(a.capabilities().formats)})")
    if bench_a is not None:
        if isinstance(bench_a, DumpAdapter):
            raise BNProbeError("the bench must be a kernel bnprobe can run on every input (a dump replays only its "
                               "own)")
        missing = [f for f in need if f not in bench_a.capabilities().formats]
        if missing:
            raise BNProbeError(f"bench {bench_a.name} does not run {', '.join(missing)}")


def _case_inputs(case: Case, fmts: list[str], modes: tuple[str, ...], eps: float | None, momentum: float | None,
                 params: str | None, notes: list[str]) -> list[_Inputs]:
    """A case's inputs, one per format (a recorded call: its own, in its format), with what they hold that the
    verdicts cannot see (NaN/inf: the golden is non-finite there too) said in ``notes``."""
    if case.call is not None:
        rec = case.call.load()
        _agree(case.name, rec, eps, momentum, params)
        notes.extend(f"{case.name}: {n}" for n in rec.meta.get("notes", []))
        per_fmt = [_recorded(rec, modes)]
    else:
        x = case.make()
        e = 1e-5 if eps is None else eps
        m = 0.1 if momentum is None else momentum
        per_fmt = [_generated(case, x, f, params or "fp32", e, m, modes) for f in fmts]
    for inp in per_fmt:
        for what, t in (("x", inp.x), ("dy", inp.dy)):
            bad = 0 if t is None else int(np.size(t) - np.count_nonzero(np.isfinite(t)))
            if bad:
                notes.append(f"{case.name} ({inp.fmt}): {what} holds {bad} NaN/inf value(s) of {np.size(t)}; "
                             "outputs that depend on them are non-finite in the golden too")
    return per_fmt


def _golden_train(ref: KernelAdapter, inp: _Inputs) -> Any:
    """The golden's training forward of a case, when it has one (its statistics are what backward uses)."""
    if inp.training and layout_of(inp.x).reduce_size > 1 and ("train" in inp.modes or "backward" in inp.modes):
        return ref.forward_train(inp.x, inp.gamma, inp.beta, inp.running_mean, inp.running_var,
                                 momentum=inp.momentum, **inp.common)
    return None


def compare_precision(
    adapters: list[str | KernelAdapter] | None = None,
    dtypes: tuple[str, ...] | None = None,
    cases: list[Case] | None = None,
    *,
    mode: str = "all",
    eps: float | None = None,
    momentum: float | None = None,
    params: str | None = None,
    seed: int = 0,
    standards: dict[str, Standard] | None = None,
    rule: str = "benchmark",
    bench: str | KernelAdapter | None = "careful",
    budget: bool = True,
    top_channels: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> CompareResult:
    """Compare each adapter in each format with the FP64 golden on the same rounded inputs.

    Default: the ``emulated`` adapter (each format's preset), fp16/bf16/fp32, ResNet-50's BatchNorm
    shapes (batch 2) plus the stress suite, training forward, inference and backward.  When an adapter
    is a dump (and no cases are given) the cases are its recorded calls, each run on its own recorded
    inputs, scalars and formats, one call at a time; ``dtypes``, ``eps``, ``momentum`` and ``params``
    then must agree with the recording (None: as recorded).
    """
    import pandas as pd

    if mode not in COMPARE_MODES:
        raise BNProbeError(f"unknown mode {mode!r}; valid: {', '.join(COMPARE_MODES)}")
    if rule not in RULES:
        raise BNProbeError(f"unknown rule {rule!r}; valid: {', '.join(RULES)}")
    resolved = [get_adapter(a) if isinstance(a, str) else a for a in (adapters or ["emulated"])]
    dumps = [a for a in resolved if isinstance(a, DumpAdapter)]
    if cases is None:
        cases = recorded_cases(dumps[0].calls) if dumps else resnet50_cases(seed=seed) + stress_cases(seed)
    fmts = [get_format(d).name for d in (dtypes or ("fp16", "bf16", "fp32"))]
    recorded_fmts = list(dict.fromkeys(c.call.dtype for c in cases if c.call is not None))
    bench_a = (get_adapter(bench) if isinstance(bench, str) else bench) if bench is not None else None
    if bench_a is None and rule == "benchmark":
        raise BNProbeError("the benchmark rule needs a bench (e.g. careful or torch)")
    _check_formats(resolved, bench_a, cases, fmts, recorded_fmts, dtypes)
    ref = get_adapter("reference")
    modes = ("train", "infer", "backward") if mode == "all" else (mode,)
    rows, chans, budgets, notes = [], [], [], []  # the three tables' rows, and what the verdicts cannot show
    total = sum(1 if c.call is not None else len(fmts) for c in cases) * len(resolved)
    done = 0
    t0 = time.monotonic()
    # traces are not needed here: counters only, not every intermediate (on copies: the caller's are unchanged)
    ref, bench_a = counters_only(ref), counters_only(bench_a)
    runs = [counters_only(a) for a in resolved]
    for case in cases:
        for inp in _case_inputs(case, fmts, modes, eps, momentum, params, notes):
            gold_t = _golden_train(ref, inp)
            sc = _scales(inp, gold_t)
            bench_out = _bench(bench_a, ref, inp, gold_t, sc) if bench_a else None
            for a in runs:
                _compare_adapter(_for_case(a, case, inp.rec), ref, case, inp, gold_t, sc, standards, rule, budget,
                                 top_channels, rows, chans, budgets, bench_out)
                done += 1
                if progress:
                    progress(done, total)
    meta = {"adapters": [a.name for a in resolved],
            "dtypes": list(dict.fromkeys(([] if all(c.call is not None for c in cases) else fmts) + recorded_fmts)),
            "mode": mode, "eps": eps, "momentum": momentum, "params": params, "seed": seed,
            "cases": [{"name": c.name, "shape": list(c.shape), "dist": c.dist, "mean": c.mean, "std": c.std}
                      for c in cases],
            "recorded": any(c.call is not None for c in cases),
            "seconds": round(time.monotonic() - t0, 3), "standards": "msprobe" if standards is None else "custom",
            "rule": rule, "bench": bench_a.name if bench_a is not None else None, "notes": notes}
    if dumps:
        meta["dump"] = {"source": dumps[0].calls.source, "kind": dumps[0].calls.kind,
                        "notes": list(dumps[0].calls.notes)}
    return CompareResult(pd.DataFrame(rows), pd.DataFrame(chans), pd.DataFrame(budgets), meta)


def _agree(name: str, rec: Recording, eps: float | None, momentum: float | None, params: str | None) -> None:
    """Options given for a recorded call must be the recorded ones."""
    if eps is not None and eps != rec.eps:
        raise BNProbeError(f"{name} was recorded with eps {rec.eps:g}; eps {eps:g} contradicts it")
    if momentum is not None and rec.momentum is not None and momentum != rec.momentum:
        raise BNProbeError(f"{name} was recorded with momentum {rec.momentum:g}; momentum {momentum:g} contradicts it")
    if params is not None and params != rec.params_mode:
        raise BNProbeError(f"{name} was recorded with {rec.params} parameters ({rec.params_mode}); params {params} "
                           "contradicts it")


def per_call(result: CompareResult) -> list[dict[str, Any]]:
    """Per case (a recorded call, in forward order) and adapter: outputs checked, failed, the worst."""
    rows = result.rows
    out: list[dict[str, Any]] = []
    if not len(rows):
        return out
    order = {c["name"]: i for i, c in enumerate(result.meta["cases"])}
    for (adapter, case), sub in rows.groupby(["adapter", "case"], sort=False):
        ratio = sub["score"] / sub["bound"]
        worst = sub.loc[ratio.idxmax()]
        bad = sub[sub["verdict"] == "FAIL"]
        out.append({"order": order.get(case, -1), "call": case, "adapter": adapter, "dtype": sub["dtype"].iloc[0],
                    "outputs": int(len(sub)), "failed": int(len(bad)),
                    "failing": ", ".join(bad["tensor"]), "worst": worst["tensor"], "worst_ratio": float(ratio.max())})
    out.sort(key=lambda r: (r["order"], r["adapter"]))
    return out


def first_failing_call(result: CompareResult) -> dict[str, Any] | None:
    """The first call (in forward order) with a failing output, or None."""
    return next((r for r in per_call(result) if r["failed"]), None)


def summarize(result: CompareResult) -> list[dict[str, Any]]:
    """Per adapter and format: how many tensors were checked, how many failed, the worst one, and
    the stage whose exact value removes most of the output's error."""
    out = []
    rows, budget = result.rows, result.budget
    if not len(rows):
        return out
    for (adapter, dtype), sub in rows.groupby(["adapter", "dtype"], sort=False):
        ratio = sub["score"] / sub["bound"]
        worst = sub.loc[ratio.idxmax()]
        warn = sub[sub["format_check"] == "WARN"]
        fworst = (warn["format_score"] / warn["format_bound"]).idxmax() if len(warn) else None
        item = {"adapter": adapter, "dtype": dtype, "checked": int(len(sub)),
                "failed": int((sub["verdict"] == "FAIL").sum()),
                "format_warnings": int(len(warn)),
                "format_worst": "" if fworst is None else f"{sub.loc[fworst, 'tensor']} on {sub.loc[fworst, 'case']}",
                "worst": f"{worst['tensor']} on {worst['case']}", "worst_ratio": float(ratio.max()),
                "worst_why": worst["why"], "budget_top": "", "budget_share": float("nan")}
        if len(budget):
            b = budget[(budget["adapter"] == adapter) & (budget["dtype"] == dtype)]
            if len(b):
                mean = b.groupby("stage").agg(order=("order", "min"), removed=("error_removed", "mean"))
                mean = mean.sort_values("order")
                item["budget_top"], item["budget_share"] = budget_cause(list(zip(mean.index, mean["removed"])))
        out.append(item)
    return out


def select_cases(adapters: list[KernelAdapter], *, input: str | Path | None = None, calls: str | None = None,
                 shape: str | None = None, shapes: str = "resnet50", batch: int | None = None, dist: str | None = None,
                 mean: float | None = None, std: float | None = None, seed: int = 0, mode: str = "all",
                 stress: bool = True) -> tuple[list[KernelAdapter], list[Case], RecordedCalls | None]:
    """What compare-precision runs on, checked before any run: a dump's calls (``input`` a dump folder, or a
    dump adapter among ``adapters``, selected by ``calls``), the tensor at ``input``, one generated ``shape``,
    or ResNet-50's shapes at ``batch`` (2) plus the stress inputs (``stress``).  Options that contradict a
    recording, and a run the memory limit cannot hold (its largest case), are refused.  Returns the adapters
    (a dump adapter replaced by one of the selected calls: the caller's is not changed), the cases and the
    recorded calls (or None)."""
    from bnprobe.recordings import open_dump
    from bnprobe.guard import require_run
    from bnprobe.inputs import input_tensor, parse_shape

    dumps = [a for a in adapters if isinstance(a, DumpAdapter)]
    recorded = None
    if input is not None and Path(input).is_dir():
        if dumps:
            raise BNProbeError("--input DIR and a dump adapter both give the recorded inputs; give one of them")
        recorded = open_dump(input, calls)
    elif dumps:
        recorded = dumps[0].calls.select(calls)
        adapters = [DumpAdapter(recorded) if a is dumps[0] else a for a in adapters]
    elif calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapters dump:DIR or --input DIR)")
    if recorded is not None:
        given = [f"--{n}" for n, v in (("shape", shape), ("batch", batch), ("dist", dist), ("mean", mean),
                                        ("std", std)) if v is not None]
        if given:
            raise BNProbeError(f"{', '.join(given)} contradict{'s' if len(given) == 1 else ''} the recording: its "
                               "calls bring their own inputs")
        cases = recorded_cases(recorded)
        has = {m: any(m in c.modes for c in recorded.calls) for m in MODES}
        if mode in has and not has[mode]:
            raise BNProbeError(f"--mode {mode}: no call of {recorded.source} recorded it (it recorded "
                               f"{', '.join(m for m, v in has.items() if v)})")
    elif input is not None:
        x = input_tensor("compare-precision", input, seed=seed)
        cases = [Case(f"input/{Path(input).name}", tuple(x.shape), x=x, seed=seed)]
    elif shape is not None:
        d, m, s = dist or "normal", 0.0 if mean is None else mean, 1.0 if std is None else std
        cases = [Case(f"{d}(mean={m:g}, std={s:g})", parse_shape(shape), d, m, s, seed)]
    else:
        if shapes != "resnet50":
            raise BNProbeError(f"unknown shape set {shapes!r}; valid: resnet50 (or give --shape)")
        if batch is not None and batch < 1:
            raise BNProbeError(f"--batch must be >= 1, got {batch}")
        cases = resnet50_cases(2 if batch is None else batch, seed, dist or "normal")
        cases += stress_cases(seed) if stress else []
    biggest = max(cases, key=lambda c: math.prod(c.shape))
    require_run("compare-precision", biggest.shape, f"compare-precision on {biggest.name} (shape {biggest.shape})")
    return adapters, cases, recorded

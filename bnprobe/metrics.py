"""Comparison metrics with MindStudio Probe's (msprobe) definitions, so figures line up with what
Ascend users know (shared/reference/msprobe-metrics.md), plus the smallest tolerance that passes.

``actual`` is compared with ``golden``; both are widened to float64 first (BF16 included).
Comparing never raises.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bnprobe.formats import Format, get_format

__all__ = ["Comparison", "compare", "cosine", "ulp_error", "min_atol", "min_rtol", "MSPROBE_ULP_BITS"]

# msprobe's ULP: (actual - golden) * 2^(mantissa - e), e = floor(log2|golden|) clamped at the format's
# minimum normal exponent
MSPROBE_ULP_BITS = {"fp16": (10, -14), "bf16": (7, -126), "fp32": (23, -126), "fp64": (52, -1022)}


def _f64(a: Any) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.asarray(a, dtype=np.float64).reshape(-1)


def cosine(actual: np.ndarray, golden: np.ndarray) -> float:
    """Cosine similarity; 1.0 when both norms are (nearly) zero, as msprobe defines it."""
    a, g = _f64(actual), _f64(golden)
    na, ng = float(np.linalg.norm(a)), float(np.linalg.norm(g))
    tiny = np.finfo(np.float64).eps
    if na <= tiny and ng <= tiny:
        return 1.0
    if na <= tiny or ng <= tiny:
        return 0.0
    return float(np.dot(a, g) / (na * ng))


def ulp_error(actual: np.ndarray, golden: np.ndarray, fmt: str | Format) -> np.ndarray:
    """Per-element error in ULPs of ``fmt`` at the golden value (msprobe's definition)."""
    name = get_format(fmt).name
    mant, emin = MSPROBE_ULP_BITS.get(name, (get_format(name).mantissa_bits, get_format(name).emin))
    a, g = _f64(actual), _f64(golden)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.abs(g)))
    e = np.where(np.isfinite(e), np.maximum(e, emin), emin).astype(np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(a - g) / np.ldexp(1.0, e - mant)  # 2^(e - mant) >= 2^-1074: never zero


def min_atol(actual: np.ndarray, golden: np.ndarray, rtol: float) -> float:
    """The smallest atol with |a - g| <= atol + rtol·|g| everywhere (finite elements)."""
    a, g = _f64(actual), _f64(golden)
    ok = np.isfinite(a) & np.isfinite(g)
    if not ok.any():
        return 0.0
    return float(max(0.0, np.max(np.abs(a[ok] - g[ok]) - rtol * np.abs(g[ok]))))


def min_rtol(actual: np.ndarray, golden: np.ndarray, atol: float) -> float:
    """The smallest rtol with |a - g| <= atol + rtol·|g| everywhere (inf if some |a-g| > atol where g = 0)."""
    a, g = _f64(actual), _f64(golden)
    ok = np.isfinite(a) & np.isfinite(g)
    if not ok.any():
        return 0.0
    excess = np.abs(a[ok] - g[ok]) - atol
    gg = np.abs(g[ok])
    need = np.where(excess <= 0, 0.0, np.where(gg > 0, excess / np.where(gg > 0, gg, 1.0), np.inf))
    return float(need.max())


@dataclass(frozen=True)
class Comparison:
    """msprobe's element-wise metrics for one tensor, plus tolerance figures.

    ``nan_mismatch``: NaN/inf positions differ (msprobe then reports "Nan"); where they match those
    elements are zeroed before the metrics, as msprobe does.
    """

    size: int
    cosine: float
    euclidean: float
    max_abs: float
    max_rel: float
    mean_rel: float
    rmse: float
    ratio_1e3: float  # share of elements with relative error < 0.001
    ratio_5e3: float
    error_balance: float  # |#(a > g) - #(a < g)| / n
    ulp_max: float
    ulp_mean: float
    worst_index: int
    nan_mismatch: bool
    accuracy_reached: str  # msprobe's verdict: "Yes", "No" or "Nan"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(actual: np.ndarray, golden: np.ndarray, fmt: str | Format = "fp32") -> Comparison:
    """msprobe's metrics of ``actual`` against ``golden`` (ULPs in ``fmt``)."""
    a, g = _f64(actual), _f64(golden)
    if a.shape != g.shape:
        raise ValueError(f"compare: actual has {a.size} elements, golden {g.size}")
    fin_a, fin_g = np.isfinite(a), np.isfinite(g)
    same_nonfinite = (~fin_a == ~fin_g) & ((a == g) | (np.isnan(a) & np.isnan(g)) | (fin_a & fin_g))
    nan_mismatch = bool(np.any(fin_a != fin_g) or not np.all(same_nonfinite))
    a = np.where(fin_a & fin_g, a, 0.0)
    g = np.where(fin_a & fin_g, g, 0.0)
    n = max(a.size, 1)
    d = np.abs(a - g)
    tiny = np.finfo(np.float64).eps
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = d / np.where(g == 0, tiny, np.abs(g))  # eps only where golden is 0
    ulp = ulp_error(a, g, fmt)
    cos = cosine(a, g)
    max_abs = float(d.max()) if d.size else 0.0
    if nan_mismatch:
        verdict = "Nan"
    elif (cos < 0.99 and max_abs > 0.001) or cos < 0.9 or max_abs > 1:
        verdict = "No"
    else:
        verdict = "Yes"
    return Comparison(
        size=int(a.size), cosine=cos, euclidean=float(np.linalg.norm(a - g)), max_abs=max_abs,
        max_rel=float(rel.max()) if rel.size else 0.0, mean_rel=float(rel.mean()) if rel.size else 0.0,
        rmse=float(math.sqrt(float(np.mean((a - g) ** 2)))) if a.size else 0.0,
        ratio_1e3=float(np.mean(rel < 1e-3)) if rel.size else 1.0,
        ratio_5e3=float(np.mean(rel < 5e-3)) if rel.size else 1.0,
        error_balance=float(abs(int(np.sum(a > g)) - int(np.sum(a < g))) / n),
        ulp_max=float(ulp.max()) if ulp.size else 0.0, ulp_mean=float(ulp.mean()) if ulp.size else 0.0,
        worst_index=int(np.argmax(d)) if d.size else -1, nan_mismatch=nan_mismatch, accuracy_reached=verdict)

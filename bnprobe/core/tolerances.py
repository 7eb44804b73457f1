"""bnprobe's default tolerances and standards, all in this one module: its tables (keyed by format where they
depend on it) and constants.

- ``GRAD_TOLERANCES`` and ``FINITE_DIFFERENCE``: gradcheck (below);
- ``DOCTOR_TOLERANCES``: the doctor's outputs; ``KERNEL_AGREEMENT``: how far two correct kernels may differ;
- ``RANK_TOLERANCES``: check_ranks' statistics;
- ``ACCUMULATION_FORMAT`` (the format a correct kernel accumulates in) and ``SMALL_VALUE_ULPS``: compare-precision's
  benchmark rule;
- ``FOLD_COMPUTE_ULPS``, ``FOLD_SUM_SLACK`` and ``folded_tolerance``: a user's folded layer (``fold --folded``);
- msprobe 26.2.0's own: ``MSPROBE_STANDARDS``, ``MSPROBE_CHECKER``, ``MSPROBE_BENCHMARK_LIMITS``,
  ``MSPROBE_BENCHMARK_APIS``, ``MSPROBE_COMPARE_LIMITS`` and ``MSPROBE_CSV_DECIMALS``.

Gradients (gradcheck): |actual - golden| <= atol + rtol·|golden|, elementwise, for inputs of unit
scale (the checks generate x, dy ~ N(0, 1) and gamma ~ U(0.5, 1.5)).  The 16-bit rows allow about
two ULPs of the format (fp16 2^-10 = 9.8e-4, bf16 2^-7 = 7.8e-3): the output's own rounding plus the
FP32 accumulation error of the sums; fp32 allows the log2(R)·u growth of R-term sums; fp64 is
torch.testing's.
Finite differences use torch.autograd.gradcheck's defaults.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["GRAD_TOLERANCES", "FINITE_DIFFERENCE", "MSPROBE_STANDARDS", "Standard", "grad_tolerance",
           "check_rtol_atol", "CheckerStandard", "MSPROBE_CHECKER", "MSPROBE_BENCHMARK_LIMITS",
           "MSPROBE_BENCHMARK_APIS", "MSPROBE_CSV_DECIMALS", "MSPROBE_COMPARE_LIMITS", "DOCTOR_TOLERANCES",
           "doctor_tolerance", "KERNEL_AGREEMENT", "RANK_TOLERANCES", "ACCUMULATION_FORMAT", "accumulation_format",
           "accumulation_bound", "variance_bound", "family_statistics_bounds", "SMALL_VALUE_ULPS", "FOLD_COMPUTE_ULPS",
           "FOLD_SUM_SLACK", "folded_tolerance"]

GRAD_TOLERANCES: dict[str, tuple[float, float]] = {  # (rtol, atol)
    "fp64": (1e-7, 1e-7),
    "fp32": (1e-5, 1e-5),
    "fp16": (2e-3, 2e-3),  # about two ULPs (2 * 2^-10)
    "bf16": (1.6e-2, 1.6e-2),  # about two ULPs (2 * 2^-7); torch.testing's bf16 rtol
}
# doctor: an output passes when, per channel, max |actual - expected| <= rtol · max(max |expected|, the
# channel's natural scale: what the output is formed from); four times the gradient rtol of the format the
# output is returned in (a few ULPs of the largest value: the output's rounding plus the accumulated error)
DOCTOR_GRAD_FACTOR = 4.0  # the doctor's rtol, in units of the gradient rtol of the same format
DOCTOR_TOLERANCES: dict[str, float] = {f: DOCTOR_GRAD_FACTOR * rtol for f, (rtol, _) in GRAD_TOLERANCES.items()}
# torch.autograd.gradcheck: central differences with eps = 1e-6, atol = 1e-5, rtol = 1e-3
#: How far two correct kernels' outputs may lie apart on unit-scale inputs (the largest absolute difference of y; dx
#: twice that): different reduction orders, rsqrt methods and output rounding, a few ULPs at |y| of a few units.
#: The adapter contract and the torch adapter's tests both hold kernels to it.
KERNEL_AGREEMENT: dict[str, float] = {"fp64": 1e-12, "fp32": 4e-6, "fp16": 8e-3, "bf16": 6e-2}

FINITE_DIFFERENCE = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3}

#: check_ranks: which statistics a rank of a multi-rank step normalised with.  Statistics match a reference on a
#: channel when the errors they put into x̂ -- |mean - reference mean|·invstd and |invstd / reference invstd - 1| --
#: are each within (sum_ulps + sqrt(count))·u·(1 + |mean|·invstd), u the unit roundoff of the accumulation format
#: (fp32; fp64 for fp64 data): a reduction of ``count`` values near |mean| errs by log2(count) (a tree) to
#: sqrt(count) (a typical sequential sum) units of u·|mean|, and a Chan merge carries the rank means' error into
#: the variance; plus stored_ulps·u of the format the statistics were saved in (their own rounding), and for
#: statistics recovered from y (none saved) the bound of that fit's error from y's elements, each off by half an
#: ulp of y's format plus elementwise_ulps·u of the accumulation format of |y| + |β| + |x·γ·invstd|.
#: running_ulps: ranks that used the same statistics hold the same running statistics after the step (one
#: deterministic update: bit-identical); a difference beyond this many ulps of the parameter format is another update.
RANK_TOLERANCES: dict[str, float] = {"sum_ulps": 16.0, "stored_ulps": 2.0, "elementwise_ulps": 4.0,
                                     "running_ulps": 4.0}


@dataclass(frozen=True)
class Standard:
    """msprobe's precision standard for one output format (its API accuracy checker's table)."""

    small_threshold: float  # |golden| <= this is a "small value"
    small_atol: float  # small values pass when their absolute error is at most this
    rtol: float  # other values pass when their relative error is at most this
    error_floor: float  # denominator floor of the accumulated-error ratio
    accumulated: float  # bound on |d - b| / max(|b|, floor) for reductions
    ulp: float  # ULP threshold per element


MSPROBE_STANDARDS: dict[str, Standard] = {
    "fp16": Standard(2.0**-10, 2.0**-16, 2.0**-10, 2.0**-11, 2.0**-8, 1),
    "bf16": Standard(2.0**-10, 1e-16, 2.0**-8, 2.0**-8, 2.0**-7, 1),
    "fp32": Standard(2.0**-20, 2.0**-30, 2.0**-20, 2.0**-14, 2.0**-11, 32),
}


def check_rtol_atol(rtol: float | None, atol: float | None) -> None:
    if (rtol is None) != (atol is None):
        raise BNProbeError("give rtol and atol both, or neither (then the per-format defaults apply)")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not v >= 0:
            raise BNProbeError(f"{name} must be >= 0, got {v}")


def grad_tolerance(fmt: str, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for gradients in ``fmt``: the given pair, or the table's default."""
    check_rtol_atol(rtol, atol)
    if rtol is not None and atol is not None:
        return rtol, atol
    return GRAD_TOLERANCES[get_format(fmt).name]


# ==== msprobe 26.2.0's accuracy checker and compare (bnprobe.engine.metrics follows them exactly) ====
# Each entry names where msprobe keeps it.

@dataclass(frozen=True)
class CheckerStandard:
    """The accuracy checker's values for one output format (its benchmark method and ULP error)."""

    device: type  # how it holds the device output (torch has no numpy bf16: bf16 is read as float32)
    bench: type  # how it holds the golden, computed one precision level up (fp16/bf16 -> fp32, fp32 -> fp64)
    rel_eps: float  # added to |golden| in relative errors (get_abs_bench_with_eps: the golden's eps, bf16 2^-8)
    small_value: float  # |golden| <= this is a small value (StandardConfig._small_value)
    small_value_atol: float  # a small value errs above this (StandardConfig._benchmark_small_value_atol)
    error_floor: float  # floor of the bench metric in the ratios (StandardConfig._minmum_err)
    ulp_mantissa: int  # ULP_PARAMETERS exponent_num
    ulp_min_exp: int  # ULP_PARAMETERS min_eb
    ulp_dtype: type  # get_ulp_err works in float64 for fp32 outputs, float32 otherwise
    msprobe: bool = True  # False: msprobe has no such entry; bnprobe's extension with its "default" values


_F32_EPS = float.fromhex("0x1p-23")  # 1.1920928955078125e-07, np.finfo(float32).eps
_F64_EPS = float.fromhex("0x1p-52")  # 2.220446049250313e-16
MSPROBE_CHECKER: dict[str, CheckerStandard] = {
    "fp16": CheckerStandard(np.float16, np.float32, _F32_EPS, 2.0**-10, 1e-16, 2.0**-11, 10, -14, np.float32),
    "bf16": CheckerStandard(np.float32, np.float32, 2.0**-8, 2.0**-10, 1e-16, 2.0**-8, 7, -126, np.float32),
    "fp32": CheckerStandard(np.float32, np.float64, _F64_EPS, 2.0**-20, 2.0**-30, 2.0**-14, 23, -126, np.float64),
    # msprobe skips float64 outputs and judges fp8 ones by ULP alone: its "default" entries, the formats' own ULP
    "fp64": CheckerStandard(np.float64, np.float64, _F64_EPS, 2.0**-20, 2.0**-30, 2.0**-14, 52, -1022, np.float64,
                            msprobe=False),
    "fp8_e4m3fn": CheckerStandard(np.float32, np.float32, _F32_EPS, 2.0**-20, 2.0**-30, 2.0**-14, 3, -6, np.float64,
                                  msprobe=False),
    "fp8_e5m2": CheckerStandard(np.float32, np.float32, _F32_EPS, 2.0**-20, 2.0**-30, 2.0**-14, 2, -14, np.float64,
                                msprobe=False),
}
# benchmark verdict: error when device metric / max(bench metric, error_floor) exceeds the limit
# (StandardConfig.get_benchmark_ratio_threshold by API level; small_value and eb: get_benchmark_threshold).
# Error balance is judged but left out of the result (BenchmarkPrecisionCompare._get_status).
MSPROBE_BENCHMARK_LIMITS: dict[str, dict[str, float]] = {
    "L0": {"small_value": 2.0, "rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0, "eb": 2.0},
    "L1": {"small_value": 2.0, "rmse": 1.5, "max_rel": 5.0, "mean_rel": 1.5, "eb": 2.0},
    "L2": {"small_value": 2.0, "rmse": 1.2, "max_rel": 2.0, "mean_rel": 1.2, "eb": 2.0},
}
MSPROBE_BENCHMARK_APIS: dict[str, frozenset[str]] = {  # StandardConfig.L1_API_LIST / L2_API_LIST; others L0
    "L1": frozenset({"embedding", "npu_fusion_attention_grad", "npu_fusion_attention", "scatter_", "scatter_add_"}),
    "L2": frozenset({"addmm", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward", "GELU", "layer_norm",
                     "matmul", "mm", "index", "one_hot", "sum", "npu_rms_norm", "npu_rms_norm_backward",
                     "nonzero"}),
}
MSPROBE_CSV_DECIMALS = 14  # the checker's detail CSV writes float64 metrics with this many decimals (precision)
MSPROBE_COMPARE_LIMITS: dict[str, float] = {  # CompareConst
    "thousandth": 0.001,  # THOUSAND_RATIO_THRESHOLD
    "five_thousandths": 0.005,  # FIVE_THOUSAND_RATIO_THRESHOLD
    "cosine_rounded_above": 0.9999,  # COSINE_THRESHOLD: a cosine above it is printed with 6 decimals
    "decimals": 12,  # format_value
    # check_accuracy: "No" when (cos < 0.99 and MaxAbsErr > 0.001) or cos < 0.9 or MaxAbsErr > 1
    "cos": 0.99, "max_abs": 0.001, "cos_min": 0.9, "max_abs_max": 1.0,
}
# ==== end of msprobe's constants ======================================================================


def doctor_tolerance(fmt: str) -> float:
    """The doctor's rtol for an output returned in ``fmt`` (relative to the channel's scale)."""
    return DOCTOR_TOLERANCES[get_format(fmt).name]


#: the format a correct kernel accumulates sums in, by the format of its data: fp32 for 16-bit and 32-bit data (what
#: PyTorch, cuDNN and Ascend's kernels do), fp64 for fp64.  compare-precision's benchmark rule does not fail a
#: per-channel sum or mean whose every error is within what such an accumulation of its terms can produce,
#: γ_R·Σ|terms| (γ_R = R·u/(1 - R·u), R terms, u this format's unit roundoff) plus half an ulp of the output: on a
#: sum that cancels, any two correct kernels differ by rounding noise that msprobe's relative metrics magnify.
ACCUMULATION_FORMAT: dict[str, str] = {"fp64": "fp64", "fp32": "fp32", "fp16": "fp32", "bf16": "fp32"}


#: compare-precision's benchmark rule does not fail an elementwise output only on msprobe's small-value ratio when each
#: output near zero errs by at most this many units of the accumulation format's unit roundoff times its natural
#: magnitude |x·rstd·γ| + |μ·rstd·γ| + |β|, plus half an ulp: y = (x - μ)·rstd·γ + β rounds about four times on
#: values of that size and inherits the statistics' rounding (a few units more), so near zero it cancels to noise.
SMALL_VALUE_ULPS = 8.0


def accumulation_format(fmt: str) -> str:
    """The format a correct kernel accumulates ``fmt`` data in (:data:`ACCUMULATION_FORMAT`; fp32 for others)."""
    return ACCUMULATION_FORMAT.get(get_format(fmt).name, "fp32")


#: the most terms a correct kernel adds one after another into one accumulator.  Any order of R terms errs by at most
#: γ_R = R·u/(1 − R·u) of their magnitudes, a bound that is 6% in fp32 at R = 2^20 and infinite from R = 2^24, where
#: it passed torch's fp16 saved_invstd at 16.7 M values per channel 5.4·10^4 times the careful kernel's error.
#: Beyond this many terms a kernel is held to a blocked sum's bound (:func:`accumulated_terms`): what a careful
#: kernel (pairwise, cascade, blocks per thread, Welford's merges) stays within at every size; a kernel that sums
#: millions of terms into one fp32 accumulator does not, and its statistics fail as its y does.
SEQUENTIAL_TERMS = 4096


def accumulated_terms(terms: int) -> tuple[int, int]:
    """(m, b): the bound of a correct kernel's sum of ``terms`` terms is γ_m — all of them one after another (m = R,
    b = R) up to :data:`SEQUENTIAL_TERMS`, beyond that blocks of b = max(SEQUENTIAL_TERMS, ⌈√R⌉) terms added in any
    order and their ⌈R/b⌉ partial sums added in any order, m = b + ⌈R/b⌉ (a blocked sum errs by at most
    γ_(b + R/b − 1) of the terms' magnitudes: Higham, Accuracy and Stability of Numerical Algorithms, §4.2).  m·u < 1
    in fp32 for every R below 2^46: the bound stays finite at every size a kernel can be given."""
    r = max(int(terms), 1)
    if r <= SEQUENTIAL_TERMS:
        return r, r
    b = max(SEQUENTIAL_TERMS, math.isqrt(r - 1) + 1)
    return b + -(-r // b), b


def accumulation_bound(fmt: str, terms: int) -> float:
    """γ_m of the accumulation format of ``fmt`` for ``terms`` terms (:func:`accumulated_terms`): the relative bound
    of a correct kernel's sum's rounding error against the sum of the terms' magnitudes."""
    u = get_format(accumulation_format(fmt)).unit_roundoff
    m = accumulated_terms(terms)[0]
    return m * u / (1 - m * u) if m * u < 1 else float("inf")


def accumulation_words(terms: int) -> tuple[str, str]:
    """(the bound's symbol, what it equals) for ``terms`` terms, as the verdicts print them: "γ_R", "R·u/(1 − R·u)"
    up to :data:`SEQUENTIAL_TERMS`; beyond, the blocked sum's "γ_m", "m·u/(1 − m·u) (how m is made of R)"."""
    m, b = accumulated_terms(terms)
    rhs = f"{m}·u/(1 − {m}·u)"
    if (m, b) != (terms, terms):
        rhs += f" (its {terms} terms summed in blocks of {b}: {b} + {-(-terms // b)} additions in a row)"
    return f"γ_{m}", rhs


#: fold --folded: a user's folded W' = W·A or b' = b·A + B is right when it lies within half an ulp of its storage
#: format of the FP64 golden (the one rounding into the file) plus this many units of roundoff of the format the fold
#: is computed in (the accumulation format: fp32 for 16-bit and fp32 files, fp64 for fp64 ones) times the size of what
#: it is formed from -- |W'| for a weight; |b·A| + |β| + |μ·A| for a bias, since B = β − μ·A can cancel.  A correct
#: fold in fp32 rounds about six times on the way (σ²+ε, √, ÷, ·γ or ·W; μ·A, β − μ·A, b·A, +), fewer than eight.
FOLD_COMPUTE_ULPS = 8.0
#: fold --folded: the layer's output error and what the tolerance allows there are each an FP64 sum (the layer run on
#: W' − W'gold and on |x| with the tolerances); two FP64 sums of up to 1e6 terms each round by less than
#: 1e6 · 2^-53 ~ 1e-10 relative, so the allowance is widened by this share
FOLD_SUM_SLACK = 1e-9


def variance_bound(gamma_r: float, u: float, var: np.ndarray, dmean: np.ndarray) -> np.ndarray:
    """How far a two-pass variance σ'² can be from σ² when it sums R squares in a format of unit roundoff ``u``
    (γ_R = ``gamma_r``) about a mean off by ``dmean``: (γ_R + 3u)·(σ² + δμ²) + δμ²."""
    return (gamma_r + 3 * u) * (var + dmean**2) + dmean**2


def family_statistics_bounds(fmt: str, r: int, mean: Any, var: Any, eps: float, mean_abs: Any,
                             mean_abs_dev: Any, *, rms: bool, rstd: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(δμ, δrstd) per row of a family call on ``fmt`` data with ``r`` values per row: the error a correct kernel's
    accumulation (:func:`accumulation_format`, any order) can put into its mean and its rstd, given the row's exact
    ``mean``, ``var`` (RMSNorm: the mean square), ``mean_abs`` = mean|x| and ``mean_abs_dev`` = mean|x − μ|.

    With γ_R = R·u/(1 − R·u): δμ = γ_R·mean|x| (RMSNorm: none); the variance errs by :func:`variance_bound`
    + 2·SMALL_VALUE_ULPS·u·|μ|·mean|x − μ| (the first-order error of deviations taken from a mean carried to within a
    few ulps as it goes, Welford's running mean, Chan's merges, which two-pass's exact cancellation does not have; a
    one-pass E[x²] − E[x]², off by u·μ², stays beyond it wherever |μ| is much larger than mean|x − μ|; not for RMSNorm,
    nor where ``mean`` is None); rstd by rstd·(½·that/(σ² + ε) + SMALL_VALUE_ULPS·u), with ``rstd`` the one given
    (the statistics a backward used), else 1/√(var + ε)."""
    u = get_format(accumulation_format(fmt)).unit_roundoff
    gr = accumulation_bound(fmt, r)
    var = np.asarray(var, dtype=np.float64)
    with np.errstate(all="ignore"):
        dmean = np.zeros_like(var) if rms else gr * np.asarray(mean_abs, dtype=np.float64)
        b_var = variance_bound(gr, u, var, dmean)
        if not rms and mean is not None:
            b_var = b_var + 2 * SMALL_VALUE_ULPS * u * np.abs(np.asarray(mean, dtype=np.float64)) * \
                np.asarray(mean_abs_dev, dtype=np.float64)
        inv = 1.0 / np.sqrt(var + eps) if rstd is None else np.asarray(rstd, dtype=np.float64)
        return dmean, inv * (0.5 * b_var / (var + eps) + SMALL_VALUE_ULPS * u)


def folded_tolerance(expected: np.ndarray, storage: str, magnitude: np.ndarray | None = None) -> np.ndarray:
    """Elementwise, the largest |actual - expected| of a correct fold stored in ``storage`` (:data:`FOLD_COMPUTE_ULPS`);
    ``magnitude``: the size of the terms each value is formed from (default |expected|)."""
    fmt = get_format(storage)
    u = get_format(accumulation_format(fmt.name)).unit_roundoff
    e = np.abs(np.asarray(expected, dtype=np.float64))
    m = e if magnitude is None else np.abs(np.asarray(magnitude, dtype=np.float64))
    with np.errstate(all="ignore"):
        return 0.5 * fmt.ulp(np.where(np.isfinite(e), e, fmt.max)) + FOLD_COMPUTE_ULPS * u * m

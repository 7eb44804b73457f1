"""The one table of default tolerances, keyed by format.

Gradients (gradcheck): |actual - golden| <= atol + rtol·|golden|, elementwise, for inputs of unit
scale (the checks generate x, dy ~ N(0, 1) and gamma ~ U(0.5, 1.5)).  The 16-bit rows allow about
two ULPs of the format (fp16 2^-10 = 9.8e-4, bf16 2^-7 = 7.8e-3): the output's own rounding plus the
FP32 accumulation error of the sums; fp32 allows the log2(R)·u growth of R-term sums; fp64 is
torch.testing's.
Finite differences use torch.autograd.gradcheck's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format

__all__ = ["GRAD_TOLERANCES", "FINITE_DIFFERENCE", "MSPROBE_STANDARDS", "Standard", "grad_tolerance",
           "check_rtol_atol"]

GRAD_TOLERANCES: dict[str, tuple[float, float]] = {  # (rtol, atol)
    "fp64": (1e-7, 1e-7),
    "fp32": (1e-5, 1e-5),
    "fp16": (2e-3, 2e-3),  # about two ULPs (2 * 2^-10)
    "bf16": (1.6e-2, 1.6e-2),  # about two ULPs (2 * 2^-7); torch.testing's bf16 rtol
}
# torch.autograd.gradcheck: central differences with eps = 1e-6, atol = 1e-5, rtol = 1e-3
FINITE_DIFFERENCE = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3}


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

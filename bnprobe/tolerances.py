"""The one table of default tolerances, keyed by format.

Gradients (gradcheck): |actual - golden| <= atol + rtol·|golden|, elementwise, for inputs of unit
scale (the checks generate x, dy ~ N(0, 1) and gamma ~ U(0.5, 1.5)).  The 16-bit rows allow about
two ULPs of the format (fp16 2^-10 = 9.8e-4, bf16 2^-7 = 7.8e-3): the output's own rounding plus the
FP32 accumulation error of the sums; fp32 allows the log2(R)·u growth of R-term sums; fp64 is
torch.testing's.
Finite differences use torch.autograd.gradcheck's defaults.
"""

from __future__ import annotations

from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format

__all__ = ["GRAD_TOLERANCES", "FINITE_DIFFERENCE", "grad_tolerance", "check_rtol_atol"]

GRAD_TOLERANCES: dict[str, tuple[float, float]] = {  # (rtol, atol)
    "fp64": (1e-7, 1e-7),
    "fp32": (1e-5, 1e-5),
    "fp16": (2e-3, 2e-3),  # about two ULPs (2 * 2^-10)
    "bf16": (1.6e-2, 1.6e-2),  # about two ULPs (2 * 2^-7); torch.testing's bf16 rtol
}
# torch.autograd.gradcheck: central differences with eps = 1e-6, atol = 1e-5, rtol = 1e-3
FINITE_DIFFERENCE = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3}


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

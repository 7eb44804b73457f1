"""What a kernel saves and can do, shared by the adapters and the recordings: the modes of a call, the saved
statistics and their kinds, the parameters' precision and an adapter's declared capabilities."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["MODES", "SAVED_KINDS", "PARAM_PRECISIONS", "Capabilities", "Saved", "params_format", "params_mode"]

MODES = ("train", "infer", "backward")
# what a training forward saves for the backward: mean + 1/sqrt(var + eps) (PyTorch, cuDNN, Ascend 950)
# or mean + the biased variance (Ascend TBE and A2 BatchNormV3); a recording may have neither ("none")
SAVED_KINDS = ("invstd", "var")
# Capabilities.saved: one of SAVED_KINDS, or "none" for a kernel whose backward recomputes its statistics (autodiff
# through its forward: flax, Keras); its backward is handed the golden's statistics, which it may ignore
# parameter (gamma, beta, running statistics) precision: as the input, or fp32 as under mixed precision
PARAM_PRECISIONS = ("same", "fp32")


def params_format(dtype: str, params: str) -> str:
    """The format of γ, β and the running statistics: the input's (``same``) or fp32 (fp64 for fp64)."""
    if params not in PARAM_PRECISIONS:
        raise BNProbeError(f"params must be one of {', '.join(PARAM_PRECISIONS)}, got {params!r}")
    fmt = get_format(dtype).name
    return fmt if params == "same" else ("fp64" if fmt == "fp64" else "fp32")


def params_mode(dtype: str, fmt: str) -> str:
    """The ``params`` choice that gives parameters in format ``fmt`` for input format ``dtype``."""
    d, f = get_format(dtype).name, get_format(fmt).name
    if f == d:
        return "same"
    if f == params_format(d, "fp32"):
        return "fp32"
    raise BNProbeError(f"parameters in {f} with input in {d}: bnprobe runs parameters in the input's format or "
                       "in fp32")


@dataclass(frozen=True)
class Capabilities:
    formats: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    layouts: tuple[str, ...] = ("channels_first", "channels_last")
    saved: str = "invstd"
    deterministic: bool = True
    traced: bool = False  # returns a Trace of its intermediates
    training_r1: bool = False  # accepts N*H*W = 1 in training
    output: str | None = None  # format of y and dx when not the run's dtype (the reference returns fp64)
    recorded: bool = False  # replays a recording: answers only its own calls, bound to one with bind(recording)
    # the framework convention it follows (bnprobe.core.conventions: running variance's bias, momentum's spelling, what
    # is saved): the golden, the bench and the bug models follow it; the momentum it is given is always bnprobe's m
    convention: str = "torch"
    # the format it reads γ, β and the running statistics in whatever it is given (a fixed policy's, e.g.
    # emulated:bf16-acc16's bf16), None when it takes the run's parameter format; a recording stores them so
    params: str | None = None
    # bnprobe runs it stage by stage: it runs a Policy (``policy_for`` names the one of a call) and nothing else, so a
    # check can rerun it with one stage changed (the error budget, overflow's traced scan, the statistics' format) or
    # stand another run of the same policy in for it (a subclass changing how a call runs is not staged)
    staged: bool = False
    # it is the FP64 golden itself (bnprobe's reference): every kernel is judged against its outputs, so nothing
    # of it is budgeted or explained
    golden: bool = False


@dataclass(frozen=True)
class Saved:
    """The statistics a training forward saved: mean plus invstd or the biased variance."""

    mean: np.ndarray
    kind: str  # "invstd" or "var"
    value: np.ndarray

    def invstd(self, eps: float) -> np.ndarray:
        """1/sqrt(var + eps) in float64 (exact conversion when the kernel saved invstd)."""
        v = np.asarray(self.value, dtype=np.float64)
        with np.errstate(all="ignore"):
            return v if self.kind == "invstd" else 1.0 / np.sqrt(v + eps)

    def var(self, eps: float) -> np.ndarray:
        v = np.asarray(self.value, dtype=np.float64)
        with np.errstate(all="ignore"):
            return v if self.kind == "var" else 1.0 / (v * v) - eps

"""bnprobe: numerical precision and debugging toolkit for the BatchNorm operator.

An FP64 golden, exact FP32/FP16/BF16 emulation of every operation, and
instrumented BatchNorm kernels whose Trace records every intermediate.

The public names are imported on first use, so ``import bnprobe`` (and ``bnprobe --help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bnprobe.core.errors import BNProbeError

__version__ = "0.1.0"

# public name -> the module that defines it, or (module, its name there)
_LAZY = {
    "FORMATS": "bnprobe.core.formats", "Format": "bnprobe.core.formats", "get_format": "bnprobe.core.formats",
    "round_to": "bnprobe.numerics.rounding",
    **{n: "bnprobe.kernels" for n in ("PRESETS", "BackwardResult", "Execution", "InferResult", "Policy", "Stage",
                                      "Trace", "TrainResult", "backward", "forward_infer", "forward_train",
                                      "get_policy")},
    "capture": "bnprobe.recordings.capture", "Capture": "bnprobe.recordings.capture",
    "monitor": "bnprobe.recordings.monitor", "Monitor": "bnprobe.recordings.monitor",
    "compare_precision": "bnprobe.checks.compare.precision",
    "gradcheck": "bnprobe.checks.gradcheck.gradients", "check_formula": "bnprobe.checks.gradcheck.gradients",
    "gradcheck_norm": "bnprobe.checks.gradcheck.family",
    "doctor": "bnprobe.checks.doctor.diagnosis", "shrink": "bnprobe.checks.shrink.shrinking",
    "scan_overflow": ("bnprobe.checks.overflow.scan", "scan"),
    "find_stats_problems": ("bnprobe.checks.plot_stats.stats", "find"),
    "check_fold": "bnprobe.checks.fold.layer", "trace_run": "bnprobe.checks.trace.stages",
    "identify": "bnprobe.checks.identify.search",
}

__all__ = ["__version__", "BNProbeError", "FORMATS", "Format", "get_format", "round_to", "PRESETS", "BackwardResult",
           "Execution", "InferResult", "Policy", "Stage", "Trace", "TrainResult", "backward", "forward_infer",
           "forward_train", "get_policy", "capture", "Capture", "monitor", "Monitor", "compare_precision", "gradcheck",
           "check_formula", "gradcheck_norm", "doctor", "shrink", "scan_overflow", "find_stats_problems", "check_fold",
           "trace_run", "identify"]

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.recordings.capture import Capture, capture
    from bnprobe.recordings.monitor import Monitor, monitor
    from bnprobe.checks.compare.precision import compare_precision
    from bnprobe.checks.doctor.diagnosis import doctor
    from bnprobe.checks.fold.layer import check_fold
    from bnprobe.checks.gradcheck.family import gradcheck_norm
    from bnprobe.checks.gradcheck.gradients import check_formula, gradcheck
    from bnprobe.checks.identify.search import identify
    from bnprobe.checks.overflow.scan import scan as scan_overflow
    from bnprobe.checks.plot_stats.stats import find as find_stats_problems
    from bnprobe.checks.shrink.shrinking import shrink
    from bnprobe.checks.trace.stages import trace_run
    from bnprobe.core.formats import FORMATS, Format, get_format
    from bnprobe.kernels import (
        PRESETS,
        BackwardResult,
        Execution,
        InferResult,
        Policy,
        Stage,
        Trace,
        TrainResult,
        backward,
        forward_infer,
        forward_train,
        get_policy,
    )
    from bnprobe.numerics.rounding import round_to


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name] if isinstance(_LAZY[name], tuple) else (_LAZY[name], name)
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bnprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

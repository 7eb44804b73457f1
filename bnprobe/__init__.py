"""bnprobe: numerical precision and debugging toolkit for the BatchNorm operator.

An FP64 golden, exact FP32/FP16/BF16 emulation of every operation, and
instrumented BatchNorm kernels whose Trace records every intermediate.

The public names are imported on first use, so ``import bnprobe`` (and ``bnprobe --help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bnprobe.errors import BNProbeError

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "FORMATS": "bnprobe.formats", "Format": "bnprobe.formats", "get_format": "bnprobe.formats",
    "round_to": "bnprobe.numerics.rounding",
    **{n: "bnprobe.kernels" for n in ("PRESETS", "BackwardResult", "InferResult", "Policy", "Stage", "Trace",
                                      "TrainResult", "backward", "forward_infer", "forward_train", "get_policy")},
    "capture": "bnprobe.recordings.capture", "Capture": "bnprobe.recordings.capture",
    "monitor": "bnprobe.recordings.monitor", "Monitor": "bnprobe.recordings.monitor",
    **{n: "bnprobe.checks" for n in ("compare_precision", "gradcheck", "check_formula", "doctor", "shrink",
                                     "scan_overflow", "find_stats_problems", "check_fold", "trace_run", "identify")},
}

__all__ = ["__version__", "BNProbeError", "FORMATS", "Format", "get_format", "round_to", "PRESETS", "BackwardResult",
           "InferResult", "Policy", "Stage", "Trace", "TrainResult", "backward", "forward_infer", "forward_train",
           "get_policy", "capture", "Capture", "monitor", "Monitor", "compare_precision", "gradcheck", "check_formula",
           "doctor", "shrink",
           "scan_overflow", "find_stats_problems", "check_fold", "trace_run", "identify"]

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.recordings.capture import Capture, capture
    from bnprobe.recordings.monitor import Monitor, monitor
    from bnprobe.checks import (
        check_fold,
        check_formula,
        compare_precision,
        doctor,
        find_stats_problems,
        gradcheck,
        identify,
        scan_overflow,
        shrink,
        trace_run,
    )
    from bnprobe.formats import FORMATS, Format, get_format
    from bnprobe.kernels import (
        PRESETS,
        BackwardResult,
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
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bnprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""bnprobe: numerical precision and debugging toolkit for the BatchNorm operator.

An FP64 golden, exact FP32/FP16/BF16 emulation of every operation, and
instrumented BatchNorm kernels whose Trace records every intermediate.
"""

from bnprobe.errors import BNProbeError
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

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "BNProbeError",
    "Format",
    "FORMATS",
    "get_format",
    "round_to",
    "Policy",
    "PRESETS",
    "get_policy",
    "forward_train",
    "forward_infer",
    "backward",
    "TrainResult",
    "InferResult",
    "BackwardResult",
    "Trace",
    "Stage",
    "capture",
    "Capture",
]


def __getattr__(name: str) -> object:
    """``capture`` and ``Capture`` are imported on first use (they pull in the dump readers)."""
    if name in ("capture", "Capture"):
        from bnprobe import _capture

        return getattr(_capture, name)
    raise AttributeError(f"module 'bnprobe' has no attribute {name!r}")

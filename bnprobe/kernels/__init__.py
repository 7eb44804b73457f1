"""The instrumented BatchNorm kernels, their Policy and their Trace."""

from bnprobe.kernels.batchnorm import (
    BackwardResult,
    Execution,
    InferResult,
    TrainResult,
    backward,
    forward_infer,
    forward_train,
)
from bnprobe.kernels.layout import LAYOUTS
from bnprobe.kernels.policy import PRESETS, Policy, get_policy
from bnprobe.kernels.trace import COUNTERS, Stage, Trace

__all__ = [
    "forward_train", "forward_infer", "backward", "Execution", "TrainResult", "InferResult", "BackwardResult",
    "Policy", "PRESETS", "get_policy", "Trace", "Stage", "COUNTERS", "LAYOUTS",
]

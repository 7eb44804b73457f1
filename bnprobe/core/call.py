"""One normalisation call: its inputs, scalars and formats, as one typed value (importing it loads nothing: the
CLI reads its defaults at start-up).

Every check runs a kernel and the FP64 golden on a :class:`BNCall` — a recorded call's (a dump's), a generated
one's, a probe's — and the defaults of BatchNorm's scalars are defined here once.  The call names its layer
(``norm``): BatchNorm, the default, or one of its siblings — LayerNorm, RMSNorm, GroupNorm, InstanceNorm — with
what places their statistics (the normalised trailing shape, the groups) and the offset some models apply γ with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["BNCall", "NormCall", "EPS", "MOMENTUM", "TENSORS", "NORMS", "NORM_NAMES"]

EPS = 1e-5  # BatchNorm's epsilon where none is given (PyTorch's, and every framework's BatchNorm2d default)
MOMENTUM = 0.1  # the running statistics' momentum where none is given (PyTorch's convention: new = (1-m)·old + m·batch)
TENSORS = ("x", "gamma", "beta", "running_mean", "running_var", "dy")  # a call's tensors, by their fields' names
# the layers a call can name, as users name them (--norm): BatchNorm, LayerNorm, RMSNorm, GroupNorm, InstanceNorm
NORMS = ("batch", "layer", "rms", "group", "instance")
NORM_NAMES = {"batch": "BatchNorm", "layer": "LayerNorm", "rms": "RMSNorm", "group": "GroupNorm",
              "instance": "InstanceNorm"}


@dataclass(frozen=True, eq=False)
class BNCall:
    """What a BatchNorm kernel is called with: x (and dy for the backward) in ``dtype``; γ, β and the running
    statistics (None where the call has none) in the parameter format (``params``: ``same`` as x, or ``fp32``);
    ε, momentum (None: a cumulative average), the training flag and the layout of x.  An adapter is handed the
    call whole (``train(call)``, ``infer(call)``, ``backward_of(call, saved)``).

    ``norm`` names the layer (:data:`NORMS`; BatchNorm by default).  LayerNorm and RMSNorm normalise the trailing
    dims ``normalized_shape`` (default: the last) of each leading index, γ and β shaped as those dims; GroupNorm the
    ``groups`` groups of channels of each sample, InstanceNorm each channel of each sample, γ and β per channel;
    ``weight_offset`` is added to γ where a model stores γ − offset (Gemma's RMSNorm: 1, y = x̂·(1 + w))."""

    x: np.ndarray
    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None
    running_mean: np.ndarray | None = None
    running_var: np.ndarray | None = None
    dy: np.ndarray | None = None
    eps: float = EPS
    momentum: float | None = MOMENTUM
    training: bool = True
    dtype: str = "fp32"
    params: str = "fp32"
    layout: str = "channels_first"
    norm: str = "batch"
    normalized_shape: tuple[int, ...] | None = None
    groups: int | None = None
    weight_offset: float = 0.0

    @property
    def has_running(self) -> bool:
        """Whether the call has both running statistics."""
        return self.running_mean is not None and self.running_var is not None

    def with_(self, **changes: Any) -> BNCall:
        """A copy with ``changes`` (field=value)."""
        return replace(self, **changes)

    def with_inputs(self, inputs: Mapping[str, Any]) -> BNCall:
        """A copy holding the tensors of ``inputs`` (a recorded mode's inputs by name) in place of its own: x, and
        γ, β, the running statistics and dy where ``inputs`` has them, None where it lacks them (other names, such
        as a backward's saved statistics, are not the call's)."""
        return replace(self, **{k: inputs.get(k) for k in TENSORS})


NormCall = BNCall  # (the same value: a call of any layer of the family)

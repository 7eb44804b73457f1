"""BatchNorm's conventions as data: what each framework's BatchNorm does where BatchNorm's definition leaves it free.

A :class:`Convention` says how a framework's running variance is biased, what its ``momentum`` argument means,
its default ε and momentum, what its training forward saves for the backward and its native layout.  Every kernel
adapter declares one (:attr:`~bnprobe.adapters.base.Capabilities.convention`, ``torch`` unless it says otherwise);
plugins and dumps take ``--convention``.  The golden, the bench and the doctor's bug models follow the kernel's
convention, so a framework's documented behaviour is reported as that convention, never as a bug, and a behaviour
no convention explains is a bug.

bnprobe speaks one momentum throughout — ``m``, the weight of the batch (``new = (1 − m)·old + m·batch``, torch's)
— on the command line, in the adapter interface and in reports; a framework whose argument is the weight of the old
value (``k = 1 − m``) has it translated by its adapter (:meth:`Convention.framework_momentum`).  Every framework
here adds ε to the variance inside the square root, so ε's placement is not a choice of convention (one that adds
it to σ is the ``eps-on-sigma`` bug).

The facts (../shared/reference/framework-conventions.md) were established by running each framework's own
BatchNorm on the CPU against a float64 one: jax 0.10 / flax 0.12, TensorFlow 2.21 / Keras 3.15, PaddlePaddle 3.3,
MindSpore 2.10.  Importing this module loads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from bnprobe.core.errors import BNProbeError

__all__ = ["Convention", "CONVENTIONS", "get_convention", "convention_of"]


@dataclass(frozen=True)
class Convention:
    """One framework's BatchNorm conventions."""

    name: str
    framework: str  # the API, in words
    running_var: str  # "unbiased" (× R/(R−1)) or "biased": the variance the running variance is updated with
    momentum: str  # "new": the framework's momentum weighs the batch (m); "old": it weighs the old value (k = 1 − m)
    momentum_arg: str  # the framework's name for it
    default_momentum: float  # the framework's default, in its own spelling
    default_eps: float
    saved: str  # what the training forward saves for the backward: "invstd", "var" (biased) or "none" (autodiff)
    layout: str  # the framework's native layout of x
    cumulative: bool = False  # momentum=None is a cumulative average (torch only)

    def framework_momentum(self, m: float) -> float:
        """bnprobe's momentum ``m`` (the batch's weight) as this framework's ``momentum`` argument."""
        return m if self.momentum == "new" else 1.0 - m


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention("torch", "torch.nn.BatchNorm*d", "unbiased", "new", "momentum", 0.1, 1e-5, "invstd", "channels_first",
               cumulative=True),
    Convention("tensorflow", "tf.nn.fused_batch_norm (FusedBatchNormV3)", "unbiased", "new",
               "exponential_avg_factor", 1.0, 1e-3, "var", "channels_last"),
    Convention("keras", "keras.layers.BatchNormalization", "biased", "old", "momentum", 0.99, 1e-3, "none",
               "channels_last"),
    Convention("flax", "flax.linen.BatchNorm", "biased", "old", "momentum", 0.99, 1e-5, "none", "channels_last"),
    Convention("paddle", "paddle.nn.functional.batch_norm", "biased", "old", "momentum", 0.9, 1e-5, "invstd",
               "channels_first"),
    Convention("mindspore", "mindspore.nn.BatchNorm2d / ops.BatchNorm", "unbiased", "old", "momentum", 0.9, 1e-5,
               "var", "channels_first"),
)}


def get_convention(name: str | Convention | None) -> Convention:
    """A convention by name (None: torch's)."""
    if isinstance(name, Convention):
        return name
    key = (name or "torch").strip().lower()
    if key not in CONVENTIONS:
        raise BNProbeError(f"unknown convention {name!r}; known: {', '.join(CONVENTIONS)}")
    return CONVENTIONS[key]


def convention_of(adapter: object) -> Convention:
    """The convention ``adapter`` declares (its capabilities' ``convention``; torch's when it declares none)."""
    caps = adapter.capabilities()  # type: ignore[attr-defined]
    return get_convention(getattr(caps, "convention", None))

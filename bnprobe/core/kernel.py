"""What a kernel saves and can do, shared by the adapters and the recordings: the modes of a call, the saved
statistics and their kinds, the parameters' precision and an adapter's declared capabilities."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format

__all__ = ["MODES", "SAVED_KINDS", "PARAM_PRECISIONS", "Capabilities", "Saved", "params_format", "params_mode",
           "MODE_OUTPUTS", "runs_only", "modes_left_out", "needs_modes", "one_mode", "one_value_per_channel",
           "TRAINING_R1", "inference_alone", "one_value_per_row"]

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
    # the threads its reductions split across where that changes its results (PyTorch CPU's channels-last kernels:
    # torch.get_num_threads() when asked), None when not known or when it does not: identify tries it first
    threads: int | None = None
    # the layers it runs (bnprobe.core.call.NORMS): BatchNorm, and where it says so LayerNorm, RMSNorm, GroupNorm and
    # InstanceNorm calls (a call's ``norm``); a call of another layer is refused in one line
    norms: tuple[str, ...] = ("batch",)
    # the family layers among ``norms`` whose forward returns no statistics although its BatchNorm does (Paddle's and
    # MindSpore's LayerNorm save the variance, not the rstd the family's interface takes, and converting would not be
    # exact): their backward takes saved=None (the framework's autodiff recomputes them); with saved "none", all of them
    unsaved_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class Saved:
    """The statistics a training forward saved: mean plus invstd or the biased variance (a LayerNorm's, RMSNorm's,
    GroupNorm's or InstanceNorm's per row of its statistics, RMSNorm's without a mean: None)."""

    mean: np.ndarray | None
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


# ---- what a kernel that runs some modes only leaves out, in one set of words every command uses -------------------

#: what a kernel runs in each mode, as "<kernel> runs ... only" says it
_RUNS = {"train": "the training forward", "infer": "inference", "backward": "the backward"}
#: each mode as what a check needs of a kernel ("gradcheck needs the kernel's backward")
_NEEDS = {"train": "training forward", "infer": "inference", "backward": "backward"}
#: each mode's outputs in words: what is not judged of a kernel that does not run it
MODE_OUTPUTS = {"train": "training forward (y, saved and running statistics)", "infer": "inference (y)",
                "backward": "backward (dx, dgamma, dbeta)"}


def _listed(words: Iterable[str]) -> str:
    ws = list(words)
    return "nothing" if not ws else ws[0] if len(ws) == 1 else ", ".join(ws[:-1]) + " and " + ws[-1]


def runs_only(name: str, runs: Iterable[str]) -> str:
    """``"onnxruntime runs inference only"``: the kernel ``name`` and the modes it runs (``runs``), in words."""
    runs = tuple(runs)
    return f"{name} runs {_listed(_RUNS[m] for m in MODES if m in runs)} only"


def modes_left_out(name: str, runs: Iterable[str], asked: Iterable[str] = MODES, verb: str = "judged") -> str | None:
    """The note a check gives when the kernel ``name`` does not run some of the modes ``asked`` (an inference-only
    kernel, a deployment runtime's; a forward-only one, a plugin without a backward): ``"onnxruntime runs inference
    only: its training forward (y, saved and running statistics) and backward (dx, dgamma, dbeta) are not
    judged"`` (``verb``: what the check does to outputs: judged, recorded, identified).  None when it runs them
    all."""
    runs = tuple(runs)
    left = [m for m in MODES if m in tuple(asked) and m not in runs]
    if not left:
        return None
    return (f"{runs_only(name, runs)}: its {_listed(MODE_OUTPUTS[m] for m in left)} "
            f"{'is' if len(left) == 1 else 'are'} not {verb}")


def needs_modes(what: str, need: Iterable[str], name: str, runs: Iterable[str]) -> str:
    """The one line refusing a kernel a check cannot judge: ``"gradcheck needs the kernel's backward; onnxruntime
    runs inference only"`` (``what``: the check, or the option that asks for the mode; ``need``: the modes it
    needs, those the kernel ``name`` does not run named)."""
    runs = tuple(runs)
    missing = [m for m in MODES if m in tuple(need) and m not in runs]
    return f"{what} needs the kernel's {_listed(_NEEDS[m] for m in missing)}; {runs_only(name, runs)}"


def one_mode(name: str, runs: Iterable[str], mode: str | None, default: str = "train") -> tuple[str, str | None]:
    """The mode a check of one mode runs the kernel ``name`` in, and the note of what it leaves out: ``mode`` when
    asked (refused in one line when the kernel does not run it, or for the backward, the training forward its
    statistics come from); else ``default``, or where the kernel does not run that, the first mode it runs, every
    mode it does not run named as not judged (:func:`modes_left_out`)."""
    runs = tuple(runs)
    if mode is not None:
        need = ("train", "backward") if mode == "backward" else (mode,)
        if any(m not in runs for m in need):
            raise BNProbeError(needs_modes(f"{named('mode')} {mode}", need, name, runs), field="mode")
        return mode, None
    if default in runs:
        return default, None
    first = next((m for m in MODES if m in runs), None)
    if first is None:
        raise BNProbeError(f"{name} declares no mode it runs (its capabilities' modes are empty)")
    return first, modes_left_out(name, runs)


#: why training (and its backward) is undefined on one value per channel, in the words every command uses
TRAINING_R1 = "its unbiased running variance divides by R − 1 = 0"


def one_value_per_channel(shape: Iterable[int], what: str = "training", hint: str = "") -> str:
    """The one line refusing ``what`` (training, a training forward's backward) on an input of ``shape`` that holds
    one value per channel: ``"training needs more than one value per channel: x of shape (1, 3) has R = N·H·W = 1
    value per channel"``, then ``hint`` (what can be run instead, e.g. its inference) after a semicolon."""
    return (f"{what} needs more than one value per channel: x of shape {tuple(int(n) for n in shape)} has "
            f"R = N·H·W = 1 value per channel" + (f"; {hint}" if hint else ""))


def inference_alone(names: Iterable[str], left: Iterable[str] = ("train", "backward")) -> str:
    """The note of a check that judges inputs ``names``, each holding one value per channel, in inference alone:
    the modes ``left`` out of them named with their outputs, and why."""
    words = " and ".join(MODE_OUTPUTS[m] for m in MODES if m in tuple(left))
    return (f"{', '.join(names)}: R = N·H·W = 1 value per channel, so its inference alone is judged: its {words} "
            f"are not ({TRAINING_R1})")


def one_value_per_row(layer: str, shape: Iterable[int], what: str = "") -> str:
    """The one line refusing a family layer (``layer``: LayerNorm, RMSNorm, GroupNorm, InstanceNorm; ``what``: its
    part, e.g. "'s backward") an input of ``shape`` whose rows of statistics hold one value each."""
    return (f"{layer}{what} needs more than one value per row of its statistics: x of shape "
            f"{tuple(int(n) for n in shape)} has R = 1 value per row")

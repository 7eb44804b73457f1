"""The named inputs checks run on (:class:`Case`: compare-precision's cases, doctor's inputs, identify's probes), and
compare-precision's: the built-in case catalogue (ResNet-50's BatchNorm shapes, the stress suite), a recording's
calls as cases, and the selection of what a run covers from the command's options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import MODES
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.core.call import BNCall
from bnprobe.recordings import CallRef, RecordedCalls
from bnprobe.core.errors import BNProbeError, named
from bnprobe.inputs import Draw, make_input

__all__ = ["Case", "DY_KINDS", "RESNET50_BN", "SHAPE_SETS", "dy_of_kind", "make_dy",
           "recorded_cases", "resnet50_cases", "stress_cases", "select_cases", "family_cases"]

# ResNet-50 (ImageNet, 224x224) BatchNorm layers: (name, C, H, W), one entry per distinct shape
RESNET50_BN = [
    ("bn1", 64, 112, 112), ("layer1.*.bn1", 64, 56, 56), ("layer1.*.bn3", 256, 56, 56),
    ("layer2.0.bn1", 128, 56, 56), ("layer2.*.bn2", 128, 28, 28), ("layer2.*.bn3", 512, 28, 28),
    ("layer3.0.bn1", 256, 28, 28), ("layer3.*.bn2", 256, 14, 14), ("layer3.*.bn3", 1024, 14, 14),
    ("layer4.0.bn1", 512, 14, 14), ("layer4.*.bn2", 512, 7, 7), ("layer4.*.bn3", 2048, 7, 7),
]


@dataclass(frozen=True)
class Case:
    """One named input a check runs on — compare-precision's cases, doctor's inputs and identify's probes alike: a
    name, the call or what makes it, and what it is made to show.

    The call is given whole (``call``: x and every other input and scalar, float64 before rounding to the run's
    formats, as doctor and identify design theirs), recorded (``recorded``: a dump's call, loaded when run), or
    made by the check from x (compare-precision's cases: x given, a user's tensor, or generated from ``shape``,
    ``dist``, ``mean``, ``std`` and ``seed``, with an upstream gradient of the kind ``dy``).  ``shape`` is x's (taken
    from the call, x or the recorded call when not given).  ``purpose``: what the input is made to show; ``steps``:
    training batches run before it (doctor's inference after several steps); ``modes_only``: read only by
    identify's modes stage (its subnormal and huge inputs)."""

    name: str
    shape: tuple[int, ...] = ()
    dist: str = "normal"
    mean: float = 0.0
    std: float = 1.0
    seed: int = 0
    x: np.ndarray | None = field(default=None, compare=False, repr=False)
    recorded: CallRef | None = field(default=None, compare=False, repr=False)  # a recorded call: all inputs from it
    dy: str = "normal"  # the upstream gradient: normal N(0, 1), shifted (a mean per channel), heavy (Student t)
    call: BNCall | None = field(default=None, compare=False, repr=False)
    purpose: str = ""
    steps: tuple[np.ndarray, ...] = field(default=(), compare=False, repr=False)
    modes_only: bool = False

    def __post_init__(self) -> None:
        if not self.shape:
            given = self.call.x if self.call is not None else self.x
            shape = np.shape(given) if given is not None else self.recorded.shape if self.recorded is not None else ()
            object.__setattr__(self, "shape", tuple(shape))

    def make(self) -> np.ndarray:
        """x: as given (in the call, or alone), the recorded call's, or generated."""
        if self.call is not None:
            return self.call.x
        if self.x is not None:
            return self.x
        if self.recorded is not None:
            return self.recorded.load().call().x
        return make_input(self.shape, dist=self.dist, mean=self.mean, std=self.std, seed=self.seed)


DY_KINDS = ("normal", "shifted", "heavy")


def make_dy(case: Case, shape: tuple[int, ...]) -> np.ndarray:
    """The case's upstream gradient (:func:`dy_of_kind` of its ``dy`` kind and seed)."""
    return dy_of_kind(case.dy, shape, case.seed)


def dy_of_kind(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """An upstream gradient: ``normal``: N(0, 1); ``shifted``: N(0, 1) plus a mean per channel between 0.5 and 2 (real
    losses give dy a non-zero mean per channel, so Σdy grows with R); ``heavy``: Student t with 2 degrees of freedom
    plus the same means (rare large gradients)."""
    if kind not in DY_KINDS:
        raise BNProbeError(f"unknown dy kind {kind!r}; valid: {', '.join(DY_KINDS)}")
    rng = np.random.default_rng([seed, 3])
    if kind == "normal":
        return rng.standard_normal(shape)
    base = rng.standard_normal(shape) if kind == "shifted" else rng.standard_t(2.0, shape)
    means = np.linspace(0.5, 2.0, shape[1]) if len(shape) > 1 else np.array([1.0])
    return base + means.reshape((1, -1) + (1,) * (len(shape) - 2))


def recorded_cases(calls: RecordedCalls) -> list[Case]:
    """One case per recorded BatchNorm call, in forward order (tensors are loaded one call at a time)."""
    calls.require_tensors("comparing a call's outputs with the golden")
    return [Case(c.label, c.shape, "recorded", seed=0, recorded=c) for c in calls.calls]


# the shape sets of --shapes: every distinct ResNet-50 shape, or two of them (the default run's, for its time)
SHAPE_SETS = {"resnet50": tuple(name for name, *_ in RESNET50_BN), "sample": ("layer3.*.bn2", "layer4.*.bn3")}


def resnet50_cases(batch: int = 2, seed: int = 0, dist: str = "normal", which: str = "resnet50") -> list[Case]:
    """ResNet-50's BatchNorm shapes with the batch reduced to ``batch`` (``which``: a :data:`SHAPE_SETS` name)."""
    keep = SHAPE_SETS[which]
    return [Case(f"resnet50/{name}", (batch, c, h, w), dist, seed=seed + i) for i, (name, c, h, w)
            in enumerate(RESNET50_BN) if name in keep]


def stress_cases(seed: int = 0) -> list[Case]:
    """Inputs that stress BatchNorm rather than uniform noise."""
    s = (8, 16, 8, 8)
    return [
        Case("stress/normal", s, seed=seed),
        *[Case(f"stress/mean/std={m:g}", s, mean=m, std=1.0, seed=seed) for m in (1e1, 1e2, 1e3, 1e4)],
        Case("stress/heavy-tails", s, "student_t", seed=seed),
        Case("stress/near-fp16-max", s, mean=0.0, std=8000.0, seed=seed),
        Case("stress/var-near-eps", s, mean=0.5, std=math.sqrt(1e-5), seed=seed),
        Case("stress/constant", s, "constant", mean=1.5, std=0.0, seed=seed),
        Case("stress/R=2", (2, 16), seed=seed),
        Case("stress/R=3", (3, 16), seed=seed),
        Case("stress/dy-shifted", s, seed=seed, dy="shifted"),
        Case("stress/dy-heavy-tails", s, seed=seed, dy="heavy"),
        # R = 65536: past fp16's 65504, so Σdy of a shifted dy and a Bessel factor n/(n-1) built in fp16 leave it
        Case("stress/R=65536", (1024, 2, 8, 8), seed=seed, dy="shifted"),
    ]


def family_cases(norm: str, seed: int = 0) -> list[Case]:
    """compare-precision's default inputs for a family layer, shaped as the models that run it: transformer hidden
    states (batch, tokens, hidden) for LayerNorm and RMSNorm — hidden sizes 768 and 4096, rows with a large mean,
    rows near fp16's range (their squares past 65504), rows whose mean square is near ε, and "massive activations"
    (a few features 10³–10⁴× the rest, as LLM hidden states hold: Sun et al., arXiv 2402.17762) — and convolution
    activations (N, C, H, W) for GroupNorm and InstanceNorm, with large means and a spread near ε."""
    rng = np.random.default_rng([seed, 55])
    if norm in ("layer", "rms"):
        massive = rng.standard_normal((2, 64, 1024))
        massive[:, :, [7, 700]] *= np.array([2e3, -8e3])  # two features, every token, as in LLaMA's hidden states
        first = rng.standard_normal((2, 64, 1024))
        first[:, 0, :16] *= 1e4  # the first token's few huge features
        return [
            Case("hidden/768", (4, 128, 768), seed=seed),
            Case("hidden/4096", (1, 32, 4096), seed=seed),
            Case("stress/mean=100", (2, 64, 1024), mean=100.0, std=1.0, seed=seed),
            Case("stress/near-fp16-range", (2, 16, 4096), mean=0.0, std=200.0, seed=seed),
            Case("stress/mean-square-near-eps", (2, 64, 1024), mean=0.0, std=3e-3, seed=seed),
            Case("stress/massive-activations", massive.shape, x=massive, seed=seed),
            Case("stress/first-token-outliers", first.shape, x=first, seed=seed),
            Case("stress/dy-shifted", (2, 64, 1024), seed=seed, dy="shifted"),
        ]
    return [
        Case("activations", (4, 64, 16, 16), seed=seed),
        Case("stress/mean=100", (2, 64, 8, 8), mean=100.0, std=1.0, seed=seed),
        Case("stress/var-near-eps", (2, 64, 8, 8), mean=0.5, std=math.sqrt(1e-5), seed=seed),
        Case("stress/heavy-tails", (2, 64, 8, 8), "student_t", seed=seed),
        Case("stress/dy-shifted", (2, 64, 8, 8), seed=seed, dy="shifted"),
    ]


def select_cases(adapters: list[KernelAdapter], *, input: str | Path | None = None, calls: str | None = None,
                 shape: str | None = None, shapes: str = "sample", batch: int | None = None,
                 values: Draw = Draw(), mode: str = "all",
                 stress: bool = True,
                 norm: str = "batch") -> tuple[list[KernelAdapter], list[Case], RecordedCalls | None]:
    """What compare-precision runs on, checked before any run: a dump's calls (``input`` a dump folder, or a
    dump adapter among ``adapters``, selected by ``calls``), the tensor at ``input``, one generated ``shape``,
    or ResNet-50's shapes (``shapes``: a :data:`SHAPE_SETS` name) at ``batch`` (2) plus the stress inputs
    (``stress``) — a family layer's (``norm``) own shapes and stress inputs instead (:func:`family_cases`) —, the
    generated ones drawn as ``values`` says (:class:`~bnprobe.inputs.Draw`; its seed is every
    case's).  Options that contradict a recording, and a run the memory limit cannot hold (its largest case), are
    refused.  Returns the adapters (a dump adapter replaced by one of the selected calls: the caller's is not
    changed), the cases and the recorded calls (or None)."""
    from bnprobe.recordings import open_dump
    from bnprobe.guard import require_run
    from bnprobe.inputs import input_tensor, parse_shape

    dist, mean, std = values.dist, values.mean, values.std
    d = values.resolved()
    dumps = [a for a in adapters if a.capabilities().recorded]
    recorded = None
    if input is not None and Path(input).is_dir():
        if dumps:
            raise BNProbeError(f"{named('input')} DIR and a dump adapter both give the recorded inputs; give one of "
                               "them")
        recorded = open_dump(input, calls)
    elif dumps:
        recorded = dumps[0].calls.select(calls)
        adapters = [DumpAdapter(recorded) if a is dumps[0] else a for a in adapters]
    elif calls is not None:
        raise BNProbeError(f"{named('calls')} selects recorded calls: give a dump ({named('adapters')} dump:DIR or "
                           f"{named('input')} DIR)")
    if recorded is not None:
        given = [named(n) for n, v in (("shape", shape), ("batch", batch), ("dist", dist), ("mean", mean),
                                        ("std", std)) if v is not None]
        if given:
            raise BNProbeError(f"{', '.join(given)} contradict{'s' if len(given) == 1 else ''} the recording: its "
                               "calls bring their own inputs")
        cases = recorded_cases(recorded)
        has = {m: any(m in c.modes for c in recorded.calls) for m in MODES}
        if mode in has and not has[mode]:
            raise BNProbeError(f"{named('mode')} {mode}: no call of {recorded.source} recorded it (it recorded "
                               f"{', '.join(m for m, v in has.items() if v)})")
    elif input is not None:
        x = input_tensor("compare-precision", input, seed=d.seed)
        cases = [Case(f"input/{Path(input).name}", tuple(x.shape), x=x, seed=d.seed)]
    elif shape is not None:
        cases = [Case(f"{d.dist}(mean={d.mean:g}, std={d.std:g})", parse_shape(shape), d.dist, d.mean, d.std,
                      d.seed)]
    else:
        if shapes not in SHAPE_SETS:
            raise BNProbeError(f"unknown shape set {shapes!r}; valid: {', '.join(SHAPE_SETS)} (or give "
                               f"{named('shape')})")
        if batch is not None and batch < 1:
            raise BNProbeError(f"{named('batch')} must be >= 1, got {batch}")
        if norm != "batch":  # a family layer's: transformer- or convolution-shaped (batch and shapes are ResNet's)
            if batch is not None:
                raise BNProbeError(f"{named('batch')} sizes ResNet-50's BatchNorm shapes: give {named('shape')} for "
                                   f"the {norm} norm")
            cases = family_cases(norm, d.seed)
            cases = cases if stress else [c for c in cases if not c.name.startswith("stress/")]
        else:
            cases = resnet50_cases(2 if batch is None else batch, d.seed, d.dist, shapes)
            cases += stress_cases(d.seed) if stress else []
    biggest = max(cases, key=lambda c: math.prod(c.shape))
    require_run("compare-precision", biggest.shape, f"compare-precision on {biggest.name} (shape {biggest.shape})",
                torch=any(a.name.startswith("torch") for a in adapters),
                recorded=recorded is not None and all(a.capabilities().recorded for a in adapters))
    return adapters, cases, recorded

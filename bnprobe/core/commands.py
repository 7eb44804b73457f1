"""The commands, in one registry: each command's name as typed, its one-line purpose, the library function it calls
and the function that renders its result (as ``module:name``, imported only when asked for), its memory per input
value, and whether a sweep runs it.  The command line registers exactly these, the memory guard reads their
figures, the sweep their sweep fields, and the documentation has a page for each."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bnprobe.core.errors import BNProbeError

__all__ = ["Command", "COMMANDS", "command", "SWEEP_COMMANDS"]


@dataclass(frozen=True)
class Command:
    """One command: ``name`` as typed (``bnprobe NAME``), ``purpose`` in one line, ``entry`` the library function
    it calls and ``renderer`` the function that renders its result (``module:name``; None for a listing);
    ``per_element`` the peak bytes per value of the largest input it holds at once (None: it holds no input),
    ``per_recorded_element`` where it replays a dump's call (None: as ``per_element``), ``compiled`` whether its
    kernels may take the compiled route (numba's memory counts then); ``sweep_score`` what a sweep of it scores
    (None: no sweep runs it), ``writes_by_default`` whether it writes a report folder without ``--out``; ``shape``
    the shape of its generated input where none is given (N,C[,...]; None: it has none)."""

    name: str
    purpose: str
    entry: str
    renderer: str | None = None
    per_element: int | None = None
    per_recorded_element: int | None = None
    compiled: bool = True
    sweep_score: str | None = None
    writes_by_default: bool = False
    shape: str | None = None

    @property
    def sweepable(self) -> bool:
        return self.sweep_score is not None

    def resolve(self, which: str = "entry") -> Callable[..., Any]:
        """The entry point (``which="entry"``) or the renderer (``"renderer"``), imported now."""
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), name)


# Peak bytes per element (measured slope × 1.3).  trace keeps every stage's array (≈ 30 float64 copies);
# compare-precision holds the golden, each format's outputs, their metrics and the bench's; gradcheck the
# finite-difference probes besides; shrink's first checks need ~110 B, but the dump it writes at the end costs what
# ``dump`` does (on a 76 M-value input whose first check outlasted the time budget it recorded the whole input and
# needed over 13 GiB).  A recorded call replayed (the dump's own outputs judged, loaded one call at a time; one
# format, the call's own; where a kernel runs on a dump's inputs, ``per_element`` applies): measured slope × 1.3 on
# emulated fp16 dumps of train, infer and backward calls of 2.1 M and 8.4 M values (2026-12-05: compare-precision
# 214 B, overflow 191 B, gradcheck 218 B, doctor 188 B besides its bug models).  A model's capture (6 calls of a
# model.half() network, the largest 9.4 M values) measured less: 1.26 GB for compare-precision, where this
# estimates 3.0 GiB.
COMMANDS: tuple[Command, ...] = (
    Command("compare-precision",
            "FP16/BF16/FP32 kernels against the FP64 golden, every output, with a verdict and a report",
            "bnprobe.checks.compare.precision:compare_precision", "bnprobe.reports.compare:write_report",
            per_element=380, per_recorded_element=280, sweep_score="error / bound of the worst output",
            writes_by_default=True),
    Command("gradcheck", "the backward against FP64 finite differences, the identities per channel, a formula's ∂L/∂X",
            "bnprobe.checks.gradcheck.gradients:gradcheck", "bnprobe.reports.checks:gradcheck_report",
            per_element=460, per_recorded_element=285, shape="4,3,5,5"),
    Command("plot-stats", "μ, σ² and the running statistics over training: simulated, a log, dumps or a monitored run",
            "bnprobe.checks.plot_stats.stats:find", "bnprobe.reports.stats:write_stats"),
    Command("overflow", "where a BatchNorm goes non-finite or silently wrong, in which stage and channel, and why",
            "bnprobe.checks.overflow.scan:scan", "bnprobe.reports.checks:overflow_report",
            # its observable checks hold the golden's outputs besides (backward: 447 B measured)
            per_element=580, per_recorded_element=250, sweep_score="anomalies found", shape="8,16,14,14"),
    Command("rsqrt", "the ULP error of hardware rsqrt / reciprocal / sqrt estimates and their Newton steps",
            "bnprobe.checks.rsqrt.mathfn:analyze", "bnprobe.reports.rsqrt:write_math"),
    Command("fold", "BatchNorm folded into a Conv/Linear, your exported weights, an ONNX model and its fused graph",
            "bnprobe.checks.fold.layer:check_fold", "bnprobe.reports.checks:fold_report", per_element=200),
    Command("doctor", "the expert's checklist for a kernel, with the known bug or recipe that explains a failure",
            "bnprobe.checks.doctor.diagnosis:doctor", "bnprobe.reports.checks:doctor_report",
            # 250 B measured running a kernel on a dump's inputs (--input DIR, 4.2 M -> 8.4 M values), 170 B on a
            # generated input, besides its bug models (bnprobe.guard)
            per_element=325, per_recorded_element=245, sweep_score="failed checklist items", shape="8,4,4,4"),
    Command("shrink", "a failing case reduced to the smallest input that still fails, with the command replaying it",
            "bnprobe.checks.shrink.shrinking:shrink", "bnprobe.reports.shrink:write_shrink",
            # as dump: it records a dump of what it found, the whole input when time runs out
            per_element=440, shape="16,64,28,28"),
    Command("identify", "how a black-box kernel computes: the policy that reproduces it bit for bit",
            "bnprobe.checks.identify.search:identify", "bnprobe.reports.identify:identify_report",
            per_element=400),  # the confirmation on your input: the kernel's, the candidate's and the golden's
    Command("trace", "one normalisation layer, every stage: range, error against the FP64 golden, anomalies",
            "bnprobe.checks.trace.stages:trace_run", "bnprobe.reports.checks:trace_lines",
            per_element=380, compiled=False, shape="8,16,14,14"),  # it keeps every stage's array: the float64 route
    Command("dump", "record an adapter's inputs and outputs as a dump, to replay and check anywhere",
            "bnprobe.recordings:record", "bnprobe.recordings:write_dump", per_element=440, shape="8,16,14,14"),
    Command("adapters", "every kernel adapter, and whether it runs on this machine",
            "bnprobe.adapters.registry:list_adapters"),
)

_BY_NAME = {c.name: c for c in COMMANDS}
SWEEP_COMMANDS = tuple(sorted(c.name for c in COMMANDS if c.sweepable))


def command(name: str) -> Command:
    """The command named ``name`` (as typed)."""
    if name not in _BY_NAME:
        raise BNProbeError(f"unknown command {name!r}; the commands: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]

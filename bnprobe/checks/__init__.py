"""Checks on BatchNorm runs; each returns values (dataclasses / DataFrames), never prints.

The entry points, imported on first use (so ``import bnprobe.checks`` stays fast)::

    compare_precision   every output against the FP64 golden, per format        (checks.compare)
    gradcheck           a backward against finite differences and the golden    (checks.gradients)
    check_formula       a candidate backward formula                            (checks.gradients)
    doctor              the expert's checklist for a kernel                     (checks.diagnosis)
    shrink              a failing input reduced to a minimal one                (checks.shrinking)
    scan_overflow       where and why a run goes non-finite                     (checks.overflow)
    find_stats_problems divergence / collapse / wrong momentum in statistics    (checks.stats)
    check_fold          BatchNorm folded into a conv / linear layer             (checks.fold)
    trace_run           one run's every stage against the golden                (checks.stages)
    identify            the policy that reproduces a black-box kernel bit for bit (checks.identify)

and ``*_recorded`` forms of compare, gradcheck, doctor and overflow for a dump's calls.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> (module, name in that module)
_LAZY = {
    "compare_precision": ("bnprobe.checks.compare", "compare_precision"),
    "gradcheck": ("bnprobe.checks.gradients", "gradcheck"),
    "gradcheck_recorded": ("bnprobe.checks.gradients", "gradcheck_recorded"),
    "check_formula": ("bnprobe.checks.gradients", "check_formula"),
    "doctor": ("bnprobe.checks.diagnosis", "doctor"),
    "doctor_recorded": ("bnprobe.checks.diagnosis", "doctor_recorded"),
    "shrink": ("bnprobe.checks.shrinking", "shrink"),
    "scan_overflow": ("bnprobe.checks.overflow", "scan"),
    "scan_overflow_recorded": ("bnprobe.checks.overflow", "scan_recorded"),
    "find_stats_problems": ("bnprobe.checks.stats", "find"),
    "check_fold": ("bnprobe.checks.fold", "check_fold"),
    "identify": ("bnprobe.checks.identify", "identify"),
    "identify_recorded": ("bnprobe.checks.identify", "identify_recorded"),
    **{n: ("bnprobe.checks.stages", n) for n in ("MODES", "StageError", "TraceComparison", "stage_errors",
                                                 "trace_run")},
}

__all__ = ["MODES", "StageError", "TraceComparison", "check_fold", "check_formula", "compare_precision", "doctor",
           "doctor_recorded", "find_stats_problems", "gradcheck", "gradcheck_recorded", "identify", "identify_recorded",
           "scan_overflow",
           "scan_overflow_recorded", "shrink", "stage_errors", "trace_run"]

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.checks.compare import compare_precision
    from bnprobe.checks.diagnosis import doctor, doctor_recorded
    from bnprobe.checks.fold import check_fold
    from bnprobe.checks.gradients import check_formula, gradcheck, gradcheck_recorded
    from bnprobe.checks.identify import identify, identify_recorded
    from bnprobe.checks.overflow import scan as scan_overflow
    from bnprobe.checks.overflow import scan_recorded as scan_overflow_recorded
    from bnprobe.checks.shrinking import shrink
    from bnprobe.checks.stages import MODES, StageError, TraceComparison, stage_errors, trace_run
    from bnprobe.checks.stats import find as find_stats_problems


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bnprobe.checks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

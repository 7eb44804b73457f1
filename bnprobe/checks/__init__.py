"""Checks on BatchNorm runs; each returns values (dataclasses / DataFrames), never prints."""

from bnprobe.checks.stages import MODES, StageError, TraceComparison, stage_errors, trace_run

__all__ = ["MODES", "StageError", "TraceComparison", "stage_errors", "trace_run"]

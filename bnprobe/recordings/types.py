"""What every reader of recorded BatchNorm calls shares: the types, the file names, and the checks of metadata.

:class:`Recording` is one call's tensors; :class:`CallRef` one call of a dump, nothing loaded; and
:class:`RecordedCalls` the calls of a dump in forward order.  The helpers read a metadata file's JSON
(:func:`read_json`) and check a recording's eps and momentum (:func:`check_eps_momentum`) for the bnprobe
and the msprobe reader alike.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.kernel import MODES, params_mode
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["Recording", "CallRef", "RecordedCalls", "META_NAME", "TENSORS_NAME", "CALLS_NAME", "CALLS_TAG",
           "DUMP_MARKERS", "read_json", "check_eps_momentum", "message_line"]

# a bnprobe dump: its metadata and its tensors
META_NAME = "bnprobe-dump.json"
TENSORS_NAME = "tensors.npz"
# a model dump (bnprobe.capture): its index of calls, one bnprobe dump each
CALLS_NAME = "bnprobe-calls.json"
CALLS_TAG = "bnprobe-calls"
# a folder holding one of these holds a dump: msprobe's, a bnprobe dump, a model dump
DUMP_MARKERS = ("dump.json", META_NAME, CALLS_NAME)


@dataclass
class Recording:
    """What one kernel did: per mode, its input and output tensors (float64, each a value of its format)."""

    adapter: str
    dtype: str
    params: str
    layout: str
    eps: float
    momentum: float | None
    saved_kind: str | None
    tensors: dict[str, dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)  # mode -> io -> name
    formats: dict[str, str] = field(default_factory=dict)  # "mode.io.name" -> format
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in MODES if m in self.tensors)

    def get(self, mode: str, io: str, name: str) -> np.ndarray | None:
        return self.tensors.get(mode, {}).get(io, {}).get(name)

    @property
    def training(self) -> bool:
        """Whether the call ran in training mode (batch statistics)."""
        return "train" in self.tensors or bool(self.meta.get("training", False))

    @property
    def params_mode(self) -> str:
        """``same`` or ``fp32``: how the recorded parameter format relates to the input's."""
        return params_mode(self.dtype, self.params)

    def call(self) -> BNCall:
        """Everything the kernel was called with: x, γ, β, the running statistics (None where not recorded; an
        eval-mode call's backward may record them as its statistics), dy (None without a backward), ε, momentum,
        the training flag, the format, the parameter format (``same``/``fp32``), the layout, and for a family layer
        (its ``norm`` in the meta) what places its statistics."""
        mode = "train" if "train" in self.tensors else ("infer" if "infer" in self.tensors else "backward")
        ins = self.tensors[mode]["inputs"]
        bw = self.tensors.get("backward", {}).get("inputs", {})
        m = self.meta
        ns = m.get("normalized_shape")
        return BNCall(ins["x"], ins.get("gamma"), ins.get("beta"),
                      ins.get("running_mean", bw.get("saved_mean") if not self.training else None),
                      ins.get("running_var", bw.get("saved_value") if not self.training else None),
                      bw.get("dy"), self.eps, self.momentum, self.training, self.dtype, self.params_mode, self.layout,
                      norm=m.get("norm", "batch"), normalized_shape=None if ns is None else tuple(ns),
                      groups=m.get("groups"), weight_offset=float(m.get("weight_offset", 0.0)))


@dataclass(frozen=True)
class CallRef:
    """One recorded BatchNorm call of a dump, nothing loaded: ``load()`` reads its tensors (a
    :class:`Recording`), or for an msprobe statistics dump its summaries."""

    name: str
    module: str | None
    shape: tuple[int, ...]
    dtype: str
    training: bool
    has_backward: bool
    task: str  # "tensor" or "statistics"
    load: Callable[[], Any] = field(compare=False, repr=False)
    recorded: tuple[str, ...] = ()  # the modes recorded (train, infer, backward) where known without loading

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this call recorded: as stored, or its training flag and whether a backward was dumped."""
        return self.recorded or ("train" if self.training else "infer", *(("backward",) if self.has_backward else ()))

    @property
    def label(self) -> str:
        shown = self.module and not self.name.startswith(f"{self.module}#")  # capture names calls module#index
        return f"{self.name} ({self.module})" if shown else self.name

    def matches(self, pattern: str) -> bool:
        return any(fnmatch.fnmatchcase(s, pattern) for s in (self.name, self.label, self.module or ""))


@dataclass(frozen=True)
class RecordedCalls:
    """The BatchNorm calls of a dump, in forward order."""

    source: str
    kind: str  # bnprobe, capture or msprobe
    calls: tuple[CallRef, ...]
    notes: tuple[str, ...] = ()
    convention: str = "torch"  # the framework convention the recorded kernel follows (bnprobe.core.conventions)

    @property
    def task(self) -> str:
        return "statistics" if self.calls and all(c.task == "statistics" for c in self.calls) else "tensor"

    def select(self, pattern: str | None) -> RecordedCalls:
        """The calls whose name, module or label matches the glob ``pattern`` (all when None)."""
        if not pattern:
            return self
        picked = tuple(c for c in self.calls if c.matches(pattern))
        if not picked:
            shown = ", ".join(c.label for c in self.calls[:8]) + (", ..." if len(self.calls) > 8 else "")
            raise BNProbeError(f"{self.source}: no BatchNorm call matches {pattern!r}; it holds {shown}")
        return replace(self, calls=picked)

    def require_tensors(self, what: str) -> None:
        if self.task == "statistics":
            raise BNProbeError(f"{self.source} is a statistics-only msprobe dump (max/min/mean/norm, no tensors): "
                               f"{what} needs a tensor dump (task \"tensor\"); bnprobe overflow reads the summaries")


def message_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" when it has none)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def read_json(path: Path) -> Any:
    """The JSON document of a dump's metadata file; a file that cannot be read or parsed (bad bytes, bad JSON,
    arrays or objects nested deeper than the parser's recursion limit, too large to hold) is a one-line error
    naming it."""
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise BNProbeError(f"{path}: not readable JSON (nested too deeply to parse)") from None
    except MemoryError:
        raise BNProbeError(f"{path}: not readable JSON (too large to parse in the memory available)") from None
    except (OSError, ValueError) as exc:
        raise BNProbeError(f"{path}: not readable JSON ({type(exc).__name__}: {message_line(exc)})") from None


def check_eps_momentum(eps: Any, momentum: Any, params: str, where: str) -> tuple[float, float | None]:
    """A recording's eps (a number > 0 within the range of its parameter format ``params``) and momentum (null
    or a number in [0, 1]), as floats."""
    fmt = get_format(params)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= fmt.max:
        raise BNProbeError(f"{where} records eps = {eps!r}, not a number > 0 within the range of {fmt.name} "
                           f"(the parameter format, max {fmt.max:.4g})")
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                                 or not 0 <= momentum <= 1):
        raise BNProbeError(f"{where} records momentum = {momentum!r}, not a number in [0, 1] or null")
    return float(eps), None if momentum is None else float(momentum)

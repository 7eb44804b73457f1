"""What a check over a recording runs on, and the options a recording refuses.

A recording (the ``dump:DIR`` adapter, or ``--input DIR`` with a runnable adapter) holds calls made
with their own x, γ, β, running statistics, eps, momentum, training flag, parameter format and dy.
Each call is loaded, run by :mod:`bnprobe.engine.run` through the kernel under test (the recording
replayed, or a runnable adapter on the recorded inputs) and the FP64 golden on exactly those inputs,
checked and dropped: memory stays bounded by one call.  Every check takes a :class:`Recorded` where it takes
its kernel (:func:`given_to`; trace, where it takes x) and then runs over the recording's calls; its result over
them is a :class:`PerCall`.  Options that describe generated input contradict a recording; :func:`check_options`
rejects them before any work.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.registry import as_adapter
from bnprobe.adapters.base import PARAM_PRECISIONS
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Verdict
from bnprobe.recordings import CALLS_NAME, META_NAME, CallRef, RecordedCalls, Recording, open_dump, split_dump_spec

__all__ = ["Recorded", "PerCall", "recording_of", "is_dump_path", "check_options", "check_params", "given", "refuse",
           "one_call", "require_one", "given_to", "only_call"]


@dataclass(frozen=True)
class Recorded:
    """What a check runs over: the kernel under test and the recorded calls that give its inputs."""

    kernel: KernelAdapter
    calls: RecordedCalls

    @property
    def replay(self) -> bool:
        """True when the kernel is the recording itself (its outputs are the recorded ones)."""
        return self.kernel.capabilities().recorded


def is_dump_path(path: str | Path) -> bool:
    """Whether ``--input`` names a dump (a folder, ``DIR#NAME``, or a dump's JSON) rather than a tensor file."""
    try:
        text = split_dump_spec(str(path))[0]
    except BNProbeError:  # a file whose name holds ",key=value" (not a dump's options): the name as it is
        text = str(path)
    head = Path(text.partition("#")[0])
    return head.is_dir() or head.name in (META_NAME, CALLS_NAME, "dump.json")


def require_calls(command: str, calls: list[CallRef], replayed: bool = True) -> None:
    """Refuse ``command`` over recorded ``calls`` when its largest call (they are loaded one at a time) would not
    fit in memory (:mod:`bnprobe.guard`); nothing is loaded.  ``replayed``: the dump's own outputs are judged (the
    guard's figures for a recorded call); else a kernel runs on its inputs (the figures of a generated input)."""
    from bnprobe.guard import require_run

    biggest = max(calls, key=lambda c: math.prod(c.shape), default=None)
    if biggest is not None:
        require_run(command, tuple(biggest.shape), f"{command} on {biggest.label} (shape {tuple(biggest.shape)})",
                    recorded=replayed)


def recording_of(adapter: str | KernelAdapter, input: str | Path | None = None,
                 calls: str | None = None, guard: str | None = None) -> Recorded | None:
    """The recording a command runs over: ``adapter`` when it is a dump, or the dump ``input`` names (with
    a runnable adapter); ``calls`` selects calls by glob.  None when neither is a recording.  With ``guard`` (a
    command of :data:`bnprobe.guard.PER_ELEMENT`) refused when that command would not fit (:func:`require_calls`)."""
    a = as_adapter(adapter)
    dump_input = input is not None and is_dump_path(input)
    if a.capabilities().recorded:
        if input is not None:
            raise BNProbeError(f"{named('input')} and the dump adapter {a.name} both give the inputs: a dump runs on "
                               f"its own recorded inputs; drop {named('input')}")
        found = Recorded(a, a.calls.select(calls))
    elif dump_input:
        found = Recorded(a, open_dump(input, calls))  # type: ignore[arg-type]
    elif calls is not None:
        raise BNProbeError(f"{named('calls')} selects recorded calls: give a dump ({named('adapter')} dump:DIR or "
                           f"{named('input')} DIR)")
    else:
        return None
    if guard is not None:
        require_calls(guard, found.calls.calls, replayed=a.capabilities().recorded)
    return found


def given(**options: Any) -> tuple[str, ...]:
    """The names of the options that were given (not None), :func:`~bnprobe.core.errors.named` for an error
    message (the command line words them as its flags)."""
    return tuple(named(k) for k, v in options.items() if v is not None)


def require_one(calls: RecordedCalls, what: str = "this command") -> CallRef:
    """The one call of a dump's selection ``calls``: ``what`` takes one, so several are an error naming them."""
    if len(calls.calls) != 1:
        shown = ", ".join(c.label for c in calls.calls[:4]) + (", ..." if len(calls.calls) > 4 else "")
        raise BNProbeError(f"{calls.source} holds {len(calls.calls)} BatchNorm calls ({shown}); {what} takes one: "
                           f"select it with DIR#NAME or {named('calls')}")
    return calls.calls[0]


def one_call(spec: str | Path, calls: str | None = None, what: str = "this command",
             guard: str | None = None) -> Recorded:
    """The recording of the one recorded call a dump (``DIR``, ``DIR#NAME``; ``calls`` a glob) selects, replayed
    by the dump, its tensors read now: its call's ``load()`` answers with what was read here, so nothing is read
    twice.  With ``guard`` (a command of :data:`bnprobe.guard.PER_ELEMENT`) refused before reading when that
    command would not fit."""
    from bnprobe.adapters.dump import DumpAdapter

    found = open_dump(spec, calls)
    found.require_tensors(what)
    c = require_one(found, what)
    if guard is not None:
        require_calls(guard, [c], replayed=False)
    rec = c.load()
    one = replace(found, calls=(replace(c, load=lambda: rec),))
    return Recorded(DumpAdapter(one), one)


def given_to(adapter: str | KernelAdapter | Recorded) -> tuple[KernelAdapter, Recorded | None]:
    """What a check was given to run: a :class:`Recorded` (its kernel, and itself: the check runs over every
    selected call), a dump adapter (itself, and its calls, replayed: the check runs on its one call,
    :func:`only_call`) or a kernel (itself, and None: the check runs it on generated inputs)."""
    if isinstance(adapter, Recorded):
        return adapter.kernel, adapter
    a = as_adapter(adapter)
    return a, (Recorded(a, a.calls) if a.capabilities().recorded else None)  # type: ignore[attr-defined]


def only_call(recorded: Recorded, check: str) -> None:
    """A dump adapter given to a check as its kernel stands for its one call: a dump of several is an error (the
    check runs over them all given their :class:`Recorded`, :func:`recording_of`)."""
    n = len(recorded.calls.calls)
    if n != 1:
        raise BNProbeError(f"{recorded.kernel.name} holds {n} BatchNorm calls: {check} runs on each given the "
                           "recording (bnprobe.engine.recorded.recording_of), or select one with dump:DIR#NAME")


def refuse(names: tuple[str, ...], source: str) -> None:
    """Options of generated input (``names``, as :func:`given` names them) contradict a recording: a one-line error
    naming them."""
    if names:
        raise BNProbeError(f"{', '.join(names)} contradict{'s' if len(names) == 1 else ''} the recording {source}: "
                           "its calls bring their own inputs and scalars")


def check_params(params: str | None) -> None:
    """``params`` must be None (a recording's own, or fp32) or one of ``fp32`` and ``same``."""
    if params is not None and params not in PARAM_PRECISIONS:
        raise BNProbeError(f"{named('params')} takes {' or '.join(PARAM_PRECISIONS)}, got {params!r}")


def check_options(recorded: Recorded, *, given: tuple[str, ...] = (), dtype: str | None = None,
                  mode: str | None = None, params: str | None = None) -> None:
    """Refuse, before any work, options that contradict the recording: ``given`` names options of generated
    input that were set; ``dtype`` must be every selected call's format; ``mode`` one every call recorded;
    ``params`` (same or fp32) every call's parameter format."""
    refuse(given, recorded.calls.source)
    check_params(params)
    calls = recorded.calls.calls
    if params is not None:
        for c in calls:
            rec = c.load()
            if isinstance(rec, Recording) and rec.params_mode != params:
                raise BNProbeError(f"{named('params')} {params} contradicts the recording: {c.label} was recorded "
                                   f"with {rec.params} parameters in {rec.dtype} ({rec.params_mode})")
    if dtype is not None:
        fmt = get_format(dtype).name
        off = [c for c in calls if c.dtype != fmt]
        if off:
            more = f" (and {len(off) - 1} more)" if len(off) > 1 else ""
            raise BNProbeError(f"{named('dtype')} {fmt} contradicts the recording: {off[0].label} was recorded in "
                               f"{off[0].dtype}{more}; select calls with {named('calls')}")
    if not recorded.replay:
        runs_ = recorded.kernel.capabilities().formats
        off = [c for c in calls if c.dtype not in runs_]
        if off:
            raise BNProbeError(f"adapter {recorded.kernel.name} does not run {off[0].dtype} (it runs "
                               f"{', '.join(runs_)}), the format of recorded call {off[0].label}")
    if mode is not None:
        for c in calls:
            why = ("was recorded in eval mode" if mode == "train" and not c.training else
                   "has no recorded backward" if mode == "backward" and not c.has_backward else "")
            if mode == "infer" and c.training:  # a bnprobe dump may hold a training call's inference too
                has_infer = recorded.calls.kind != "msprobe" and "infer" in getattr(c.load(), "tensors", {})
                why = "" if has_infer else "was recorded in training mode (no inference call)"
            if why:
                raise BNProbeError(f"{named('mode')} {mode} contradicts the recording: {c.label} {why}; leave "
                                   f"{named('mode')} out to check what each call recorded, or select calls with "
                                   f"{named('calls')}")


@dataclass
class PerCall:
    """A check's results over the calls of a recording, in forward order: one result per call, each
    truthy when its call passed; truthy when every call passed."""

    check: str
    kernel: str
    source: str
    kind: str
    results: list[Any]
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, check: str, recorded: Recorded, results: list[Any], notes: list[str] | tuple[str, ...] = ()
           ) -> PerCall:
        """``check``'s ``results`` over the calls of ``recorded``: ``notes`` (the run's own), then the recording's."""
        calls = recorded.calls
        return cls(check, recorded.kernel.name, calls.source, calls.kind, results, [*notes, *calls.notes])

    def __bool__(self) -> bool:
        return all(bool(r) for r in self.results)

    @property
    def passed(self) -> bool:
        return bool(self)

    @property
    def verdict(self) -> Verdict:
        return Verdict.of(self.passed)

    @property
    def frame(self):  # -> pandas.DataFrame
        """The calls' rows (:meth:`to_frame`)."""
        return self.to_frame()

    def to_frame(self):  # -> pandas.DataFrame
        """The results' frames (each with its call column) one after the other."""
        import pandas as pd

        frames = [r.to_frame() for r in self.results if hasattr(r, "to_frame")]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "adapter": self.kernel, "source": self.source, "kind": self.kind,
                "passed": bool(self), "notes": self.notes, "calls": [r.to_dict() for r in self.results]}

"""A command's sweep, from its options to its result: whether the run is a sweep at all (:func:`find_root`), the plan
checked and its memory guarded before any work (:func:`prepare`), then the tasks run with a journal that lets an
interrupted sweep resume (:func:`execute`).  The command line words what this raises and renders what it returns."""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bnprobe.core.commands import COMMANDS
from bnprobe.core.errors import BNProbeError, named
from bnprobe.guard import format_size, require, run_bytes
from bnprobe.sweep.tasks import (
    Journal,
    RankGroup,
    SweepResult,
    SweepSpec,
    Task,
    check_plan,
    dump_leaves,
    header,
    plan,
    rank_groups,
    run_sweep,
    scheduler_address,
)

__all__ = ["SWEEP_FILES", "WRITES_BY_DEFAULT", "SweepInterrupted", "SweepPlan", "SweepRequest", "execute",
           "find_root", "prepare"]

# the files of a sweep's report folder (the first, the table of every row, is written when the sweep has finished)
SWEEP_FILES = ("sweep.csv", "sweep.parquet", "sweep.json", "summary.md", "heatmap-layer-step.png",
               "heatmap-layer-rank.png")
# the commands that write a report folder under reports/ without --out (the others write only where --out says, on
# one call, a dump or a sweep alike)
WRITES_BY_DEFAULT = tuple(c.name for c in COMMANDS if c.writes_by_default)


def find_root(adapter: str, input: Path | None, asked: bool) -> tuple[Path, str | None] | None:
    """(dump root, the runnable adapter or None for the recorded outputs) when this run is a sweep: ``asked`` for
    (a sweep's option given), or a dump root holding several step/rank dumps; None when it is not."""
    from bnprobe.adapters.registry import refuse_empty_options

    refuse_empty_options(adapter)  # ("dump:" is not the current folder: a ':' promises a DIR)
    if adapter.startswith("dump:") and "#" not in adapter:
        root, runnable = Path(adapter[len("dump:"):]), None
    elif input is not None and input.is_dir():
        root, runnable = input, adapter
    elif asked:
        raise BNProbeError(f"{named('sweep')}, {named('workers')}, {named('scheduler')} and {named('resume')} run over "
                           f"a dump root: give {named('input')} ROOT or an adapter dump:ROOT")
    else:
        return None
    return (root, runnable) if asked or (root.is_dir() and len(dump_leaves(root)) > 1) else None


@dataclass(frozen=True)
class SweepRequest:
    """A command's sweep as asked: the command, its dump root and runnable adapter (None: the recorded outputs), the
    calls to take (a glob, None for all), where its report goes (None: nowhere, unless the command writes by
    default), the workers or scheduler, whether to resume, and the command's own options (``options``)."""

    command: str
    root: Path
    runnable: str | None
    calls: str | None = None
    out: Path | None = None
    force: bool = False
    workers: int | None = None
    scheduler: str | None = None
    resume: bool = False
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepPlan:
    """A sweep checked and ready: its tasks (each call, then each group of ranks), the workers it runs on (or the
    scheduler's address), and the folder its report goes to (``keep``: the user's, not a scratch folder removed
    after the run)."""

    request: SweepRequest
    spec: SweepSpec
    items: list[Task | RankGroup]
    workers: int
    address: str | None
    out: Path | None
    keep: bool
    scratch: tempfile.TemporaryDirectory | None = None

    def cleanup(self) -> None:
        """Remove the scratch folder a sweep without an output folder wrote its journal to."""
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None


class SweepInterrupted(Exception):
    """The user interrupted a sweep: ``kept`` of ``total`` tasks finished and are in ``journal``; the report folder
    ``out`` lets the same command with resume continue."""

    def __init__(self, kept: int, total: int, journal: Path, out: Path) -> None:
        super().__init__(f"interrupted: {kept} of {total} task(s) finished and kept in {journal}")
        self.kept, self.total, self.journal, self.out = kept, total, journal, out


def prepare(request: SweepRequest) -> SweepPlan:
    """The sweep's plan, checked before any work: the scheduler's address, the tasks (no tensor loaded), each
    task's options, the memory of one task per worker at once, and whether a resumed sweep has anything left."""
    r = request
    address = scheduler_address(r.scheduler)
    if r.resume and r.out is None:
        raise BNProbeError(f"{named('resume')} continues the sweep in {named('out')} DIR: give that folder")
    spec = SweepSpec(r.command, r.runnable, **r.options)
    tasks = plan(r.root, r.calls)
    check_plan(tasks, spec)
    items = [*tasks, *rank_groups(tasks)]  # each call, then each layer and step several ranks recorded
    n = 1 if address else min(r.workers or os.cpu_count() or 1, len(items))
    biggest = max(items, key=lambda t: math.prod(t.shape))
    need = run_bytes(r.command, math.prod(biggest.shape), recorded=r.runnable is None) * n  # one task per worker
    require(need, f"{r.command} sweep on {n} worker(s), the largest task {biggest.key} (shape {biggest.shape}, "
                  f"{format_size(need // n)} each)")
    if r.resume and r.out is not None and (r.out / SWEEP_FILES[0]).exists() and not r.force:
        raise BNProbeError(f"the sweep in {r.out} has finished (every row is in {r.out / SWEEP_FILES[0]}): nothing "
                           f"to resume; {named('force')} runs it again")
    if r.out is None and r.command not in WRITES_BY_DEFAULT:  # as the command on one dump: no --out, nothing kept
        scratch = tempfile.TemporaryDirectory(prefix="bnprobe-sweep-")
        return SweepPlan(r, spec, items, n, address, Path(scratch.name), False, scratch)
    return SweepPlan(r, spec, items, n, address, r.out, True)


def execute(p: SweepPlan, folder: Path, progress: Callable[[int, int, int], None] | None = None,
            words: Callable[[str], str] = str) -> SweepResult:
    """Run the plan's tasks, each finished row appended to the journal in ``folder`` as it arrives; ``progress(done,
    total, failed)`` after each; a task's error worded by ``words`` in its row (see :func:`run_sweep`).  Raises
    :class:`SweepInterrupted` when the user interrupts it."""
    r = p.request
    journal = Journal(folder, header(r.root, p.spec, r.calls))
    t0 = time.monotonic()
    try:
        rows = run_sweep(p.items, p.spec, workers=p.workers, scheduler=p.address, journal=journal, resume=r.resume,
                         force=r.force, progress=progress, words=words)
    except KeyboardInterrupt:
        kept = max(0, len(journal.path.read_text(encoding="utf-8").splitlines()) - 1) if journal.path.exists() else 0
        raise SweepInterrupted(kept, len(p.items), journal.path, folder) from None
    return SweepResult.of(r.command, str(r.root), rows, seconds=round(time.monotonic() - t0, 1),
                          engine=f"dask scheduler {p.address}" if p.address else f"{p.workers} local worker(s)")

"""Sweeps: a check over every BatchNorm call of every step and rank of a dump root, one task per call.

A dump root holds one dump per step and rank (msprobe's ``step*/rank*/`` and ``step*/proc*/``, bnprobe's capture
folders ``step*/rank*/``) or a single dump.  :func:`plan` lists the tasks without loading a tensor; each task
(:func:`run_task`) opens its own dump, loads only its own call's tensors and returns one row of plain values, so
nothing large travels between processes.  :func:`run_sweep` runs the tasks

- in this process (``workers=1``), or on local worker processes (``workers>1``; no set-up, no dask needed), or
- on a ``dask.distributed`` cluster (``scheduler="tcp://HOST:8786"``; the ``bnprobe[dist]`` extra): the workers
  read the dump paths themselves (a shared filesystem), so tensors never pass through the scheduler.

A task that fails (an unreadable file, a lost worker) is retried once, then reported as an error row; it never
stops the others.  Every finished row is appended to a journal as it arrives, so an interrupted sweep resumes
without redoing finished tasks.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bnprobe._files import append_text, atomic_write_text
from bnprobe._loading import first_line
from bnprobe.core.commands import COMMANDS, SWEEP_COMMANDS
from bnprobe.core.errors import BNProbeError, named
from bnprobe.engine.result import Verdict
from bnprobe.guard import tune_process

__all__ = ["SWEEP_COMMANDS", "Task", "SweepSpec", "plan", "dump_leaves", "run_task", "run_sweep", "Journal",
           "scheduler_address", "SweepResult", "SCORES", "header", "error_row", "check_plan", "RankGroup",
           "rank_groups"]

JOURNAL = "sweep-journal.jsonl"
_LEVELS = ("", "step*", "rank*", "proc*", "step*/rank*", "step*/proc*")


@dataclass(frozen=True)
class Task:
    """One BatchNorm call of one dump of the root: what a worker needs to find it, nothing loaded."""

    key: str  # step/rank/call: unique in the sweep
    leaf: str  # the folder of its dump
    call: str  # the call's name in that dump
    step: int  # -1 when the dump's path names no step
    rank: str  # "0", "1", "proc4242"; "" when the path names none
    order: int  # forward order within its dump
    layer: str  # the same for the same layer across steps and ranks (module path, else the call name)
    shape: tuple[int, ...]
    dtype: str
    task: str = "tensor"  # msprobe's task: tensor, or statistics (summaries only)


@dataclass(frozen=True)
class RankGroup:
    """One layer at one step across its ranks: the statistics each rank used, checked against the golden of the
    concatenated batch (:func:`bnprobe.checks.ranks.check.check_ranks`)."""

    key: str  # ranks:step/layer
    step: int
    layer: str
    members: tuple[Task, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The concatenated batch's shape (for the memory estimate)."""
        first = self.members[0].shape
        return (sum(t.shape[0] for t in self.members), *first[1:])


@dataclass(frozen=True)
class SweepSpec:
    """What every task runs: the check (``command``) and its options, as plain values."""

    command: str
    adapter: str | None = None  # None: the recorded outputs; else a runnable adapter (re-run on the inputs)
    mode: str | None = None
    rule: str = "benchmark"
    bench: str = "careful"
    budget: bool = False
    convention: str | None = None  # the framework convention the kernel is judged in (None: its own)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.command not in SWEEP_COMMANDS:
            raise BNProbeError(f"a sweep runs {', '.join(SWEEP_COMMANDS)}, not {self.command!r}")
        if self.convention is not None:
            from bnprobe.core.conventions import get_convention

            get_convention(self.convention)  # an unknown name: one line, before any task


def _step_rank(rel: Path) -> tuple[int, str]:
    step, rank = -1, ""
    for part in rel.parts:
        if m := re.fullmatch(r"step(\d+)", part):
            step = int(m.group(1))
        elif m := re.fullmatch(r"(?:rank|proc)(\d+)", part):
            rank = m.group(1) if part.startswith("rank") else part
    return step, rank


def _holds_dump(p: Path) -> bool:
    from bnprobe.recordings.ms_graph import graph_folders

    from bnprobe.recordings import DUMP_MARKERS

    return p.is_dir() and (any((p / m).is_file() for m in DUMP_MARKERS) or bool(graph_folders(p)))


def _where(root: Path, p: Path) -> tuple[int, tuple[int, int | str], str]:
    """Sort key of a dump folder: step, then rank (numerically), then path."""
    step, rank = _step_rank(p.relative_to(root))
    return step, _rank_key(rank), str(p)


def dump_leaves(root: str | Path) -> list[Path]:
    """The folders of the dumps under ``root``: itself when it holds one, else its ``step*``, ``rank*``, ``proc*``,
    ``step*/rank*`` and ``step*/proc*`` folders holding an msprobe ``dump.json`` or a bnprobe dump, in step and rank
    order."""
    root = Path(root)
    if not root.is_dir():
        raise BNProbeError(f"sweep root {root}: not a folder")
    if _holds_dump(root):
        return [root]
    found = {p for level in _LEVELS if level for p in root.glob(level) if _holds_dump(p)}
    if not found:
        raise BNProbeError(f"sweep root {root}: no dump in it or in its step*/, rank*/, proc*/ folders")
    return sorted(found, key=lambda p: _where(root, p))


def plan(root: str | Path, calls: str | None = None) -> list[Task]:
    """Every BatchNorm call of every dump under ``root`` (``calls``: a glob on the call or module name), in step,
    rank and forward order; nothing but the dumps' JSON is read."""
    from bnprobe.recordings import open_dump

    root = Path(root)
    tasks: list[Task] = []
    for leaf in dump_leaves(root):
        rel = leaf.relative_to(root)
        step, rank = _step_rank(rel)
        found = open_dump(leaf)
        order = {c.name: i for i, c in enumerate(found.calls)}
        for c in (c for c in found.calls if not calls or c.matches(calls)):
            where = rel.as_posix() if rel.parts else "."
            layer = c.module or ("(the dump's call)" if c.name == leaf.name else c.name)  # bnprobe dump: one call
            tasks.append(Task(f"{where}/{c.name}", str(leaf), c.name, step, rank, order[c.name], layer,
                              tuple(c.shape), c.dtype, c.task))
    if not tasks:
        raise BNProbeError(f"sweep root {root}: no BatchNorm call matches {calls!r}" if calls else
                           f"sweep root {root}: no BatchNorm call in its dumps")
    return tasks


def check_plan(tasks: list[Task], spec: SweepSpec) -> None:
    """Refuse, before any task runs, a check that needs tensors over statistics-only dumps."""
    stats = [t for t in tasks if t.task == "statistics"]
    if stats and spec.command != "overflow":
        raise BNProbeError(f"{stats[0].leaf} is a statistics-only msprobe dump (max/min/mean/norm, no tensors): "
                           f"{spec.command} needs a tensor dump (task \"tensor\"); bnprobe overflow reads the "
                           "summaries")


def rank_groups(tasks: list[Task]) -> list[RankGroup]:
    """The (step, layer) pairs that several ranks of a tensor dump recorded: one rank check each."""
    groups: dict[tuple[int, str], list[Task]] = {}
    for t in tasks:
        if t.task == "tensor" and t.rank:
            groups.setdefault((t.step, t.layer), []).append(t)
    return [RankGroup(f"ranks:{step}/{layer}", step, layer, tuple(ts)) for (step, layer), ts in groups.items()
            if len({t.rank for t in ts}) > 1]


# ---- one task (runs in a worker) ---------------------------------------------------------------------

def _one_call(task: Task) -> Any:
    """The task's call alone, as a RecordedCalls (its dump's JSON read again, its tensors not yet)."""
    from dataclasses import replace

    from bnprobe.recordings import open_dump

    found = open_dump(task.leaf)
    picked = tuple(c for c in found.calls if c.name == task.call)
    if not picked:
        raise BNProbeError(f"{task.leaf}: call {task.call} is no longer in the dump")
    return replace(found, source=task.key, calls=picked)


def _kernel(one: Any, spec: SweepSpec) -> Any:
    """What a task checks: the call's recorded outputs, or the runnable adapter; in ``spec.convention`` if given."""
    from bnprobe.adapters import get_adapter
    from bnprobe.adapters.convention import in_convention
    from bnprobe.adapters.dump import DumpAdapter
    from bnprobe.core.conventions import get_convention

    kernel = DumpAdapter(one) if spec.adapter is None else get_adapter(spec.adapter)
    return kernel if spec.convention is None else in_convention(kernel, get_convention(spec.convention))


def _compare_row(one: Any, spec: SweepSpec) -> dict[str, Any]:
    from bnprobe.engine.cases import recorded_cases
    from bnprobe.checks.compare.precision import Judging, compare_precision

    adapter = _kernel(one, spec)
    r = compare_precision([adapter], None, recorded_cases(one), mode=spec.mode or "all", budget=spec.budget,
                          judging=Judging(rule=spec.rule, bench=spec.bench))
    rows = r.rows
    if not len(rows):
        return {"verdict": r.verdict, "score": 0.0, "outputs": 0, "failing": "", "worst": "", "notes": r.notes}
    ratio = rows["score"] / rows["bound"]
    worst = rows.loc[ratio.idxmax()]
    bad = rows[rows["verdict"] == Verdict.FAIL]
    return {"verdict": r.verdict, "score": float(ratio.max()), "outputs": int(len(rows)),
            "failing": ", ".join(bad["tensor"]), "worst": str(worst["tensor"]),
            "format_warnings": int((rows["format_check"] == Verdict.WARN).sum()), "notes": r.notes,
            "statistics": _statistics(rows)}


def _statistics(rows: Any) -> dict[str, float]:
    """The errors of the saved and running statistics (for ranks that disagree): tensor -> max |error|."""
    keep = rows[rows["tensor"].isin(["saved_mean", "saved_invstd", "running_mean", "running_var"])]
    return {str(t): float(v) for t, v in zip(keep["tensor"], keep["max_abs"])}


def _doctor_row(one: Any, spec: SweepSpec) -> dict[str, Any]:
    from bnprobe.checks.doctor.diagnosis import doctor
    from bnprobe.engine.recorded import Recorded

    kernel = _kernel(one, spec)
    rep = doctor(Recorded(kernel, one), stability=False).results[0]
    failed = [i.name for i in rep.items if i.status == Verdict.FAIL]
    return {"verdict": rep.verdict, "score": float(len(failed)), "outputs": len(rep.items),
            "failing": "; ".join(failed), "worst": "; ".join(rep.diagnosis), "notes": list(rep.notes)}


def _overflow_row(one: Any, spec: SweepSpec) -> dict[str, Any]:
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.engine.recorded import Recorded

    kernel = _kernel(one, spec)
    run = scan(Recorded(kernel, one), mode=spec.mode)
    findings = [f for rep in run.results for f in rep.findings]
    return {"verdict": run.verdict, "score": float(len(findings)), "outputs": len(run.results),
            "failing": ", ".join(dict.fromkeys(f"{f.anomaly}@{f.stage}" for f in findings)), "worst": "",
            "notes": [n for rep in run.results for n in rep.notes]}


_ROWS: dict[str, Callable[[Any, SweepSpec], dict[str, Any]]] = {
    "compare-precision": _compare_row, "doctor": _doctor_row, "overflow": _overflow_row}


def _ranks_row(group: RankGroup) -> dict[str, Any]:
    """The rank check of one layer at one step: each rank's recording loaded when the check reads it and let go (one
    call in memory, however many ranks)."""
    from bnprobe.checks.ranks.check import check_ranks

    recs = {i: _one_call(t).calls[0].load for i, t in enumerate(group.members)}  # its index read, no tensors
    rep = check_ranks(recs, call=group.layer)
    # per rank: its statistics' worst error against the concatenated batch's, over the tolerance (<= 1 passes)
    scores = {str(group.members[r.rank].rank): r.global_ratio for r in rep.rows}
    return {"kind": rep.kind, "verdict": rep.verdict, "summary": rep.summary,
            "failures": list(rep.failures), "notes": list(rep.notes), "scores": scores}


def run_task(task: Task | RankGroup, spec: SweepSpec) -> dict[str, Any]:
    """Run the sweep's check on one call (loading only its tensors), or the rank check of one layer and step;
    one row of plain values.  Raises on failure: the engine retries once and then records the error."""
    import socket
    import warnings

    tune_process()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = _ranks_row(task) if isinstance(task, RankGroup) else _ROWS[spec.command](_one_call(task), spec)
    row["notes"] = list(dict.fromkeys([*row.get("notes", []), *(f"a library warned: {w.message}" for w in caught)]))
    return {**_base(task), **row, "status": "ok", "seconds": round(time.monotonic() - t0, 4),
            "worker": f"{socket.gethostname()}:{os.getpid()}", "worker_peak_mb": _peak_mb()}


def _peak_mb() -> float:
    """This process's peak resident memory so far, in MiB (what a worker has needed for its largest call)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def _base(task: Task | RankGroup) -> dict[str, Any]:
    """What identifies a task's row."""
    if isinstance(task, RankGroup):
        return {"key": task.key, "step": task.step, "layer": task.layer,
                "ranks": ", ".join(t.rank for t in task.members)}
    return {"key": task.key, "step": task.step, "rank": task.rank, "order": task.order, "layer": task.layer,
            "call": task.call, "shape": "x".join(map(str, task.shape)), "dtype": task.dtype}


def error_row(task: Task | RankGroup, message: str, attempts: int) -> dict[str, Any]:
    """The row of a task that failed ``attempts`` times."""
    if isinstance(task, RankGroup):
        return {**_base(task), "kind": "", "verdict": Verdict.ERROR, "summary": "", "failures": [], "notes": [],
                "status": "error", "error": message, "attempts": attempts, "seconds": 0.0, "worker": "",
                "worker_peak_mb": float("nan")}
    return {**_base(task), "status": "error", "verdict": Verdict.ERROR, "score": float("nan"), "outputs": 0,
            "failing": "", "worst": "", "notes": [], "error": message, "attempts": attempts, "seconds": 0.0,
            "worker": "", "worker_peak_mb": float("nan")}


def _reason(exc: BaseException, words: Callable[[str], str] = str) -> str:
    """A failed task's reason, one line: a BNProbeError's own message (the parameters it names worded by
    ``words``), else ``TypeName: first line``."""
    text = (exc.worded(words) if isinstance(exc, BNProbeError) else str(exc)).strip()
    return (text.splitlines()[0] if isinstance(exc, BNProbeError) and text else first_line(exc))[:300]


# ---- the journal: finished rows, appended as they arrive -----------------------------------------------

class Journal:
    """``sweep-journal.jsonl`` in the output folder: a header naming the sweep, then one finished row per line
    (flushed at once), so an interrupted sweep resumes where it stopped."""

    def __init__(self, folder: Path, header: dict[str, Any]) -> None:
        self.path = Path(folder) / JOURNAL
        self.header = header

    def finished(self, resume: bool, force: bool) -> dict[str, dict[str, Any]]:
        """The rows already finished (with ``resume``; errors are redone), after checking the journal is this
        sweep's; without ``resume`` an existing journal is refused unless ``force``."""
        if not self.path.exists():
            if resume:
                raise BNProbeError(f"{named('resume')}: no sweep journal in {self.path.parent}")
            return {}
        if not resume:
            if not force:
                raise BNProbeError(f"{self.path} exists: a sweep ran there; {named('resume')} to continue it, "
                                   f"{named('force')} to start it again")
            self.path.unlink()
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            head = json.loads(lines[0]) if lines else None
        except ValueError:
            head = None
        if head != self.header:
            raise BNProbeError(f"{named('resume')}: {self.path} is the journal of another sweep (a different root, "
                               "command or options)")
        done: dict[str, dict[str, Any]] = {}
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except ValueError:  # the line being written when the sweep was interrupted
                continue
            if isinstance(row, dict) and row.get("status") == "ok" and isinstance(row.get("key"), str):
                done[row["key"]] = row
        return done

    def open(self, rows: Iterable[dict[str, Any]]) -> None:
        """Start the journal afresh with the header and the rows kept from a resumed run."""
        atomic_write_text(self.path, "".join(json.dumps(r, default=str) + "\n" for r in (self.header, *rows)))

    def add(self, row: dict[str, Any]) -> None:
        append_text(self.path, json.dumps(row, default=str) + "\n")


# ---- engines -----------------------------------------------------------------------------------------

def scheduler_address(given: str | None) -> str | None:
    """``--scheduler``, else ``$BNPROBE_SCHEDULER``; checked to be ``tcp://HOST:PORT`` (or tls://...), with
    dask.distributed installed to reach it."""
    address = given if given is not None else os.environ.get("BNPROBE_SCHEDULER") or None
    if address is None:
        return None
    if not re.fullmatch(r"(tcp|tls|inproc|ucx)://[^\s/]+(:\d+)?/?", address):
        raise BNProbeError(f"{named('scheduler')} takes a dask scheduler address such as tcp://HOST:8786, got "
                           f"{address!r}")
    try:
        import distributed  # noqa: F401
    except ImportError:
        raise BNProbeError(f"{named('scheduler')} needs dask.distributed: pip install 'bnprobe[dist]'") from None
    return address


def _start_method() -> str:
    """fork is quick and needs no importable __main__; a process that loaded torch or numba (their OpenMP threads
    do not survive a fork: a child that runs a parallel loop again aborts) starts its workers fresh.  numba is
    loaded only for a compiled route: the BatchNorm kernels, and the compiled casts, metrics and rules alike."""
    threaded = "torch" in sys.modules or "numba" in sys.modules
    return "spawn" if threaded or not hasattr(os, "fork") else "fork"


def _local(todo: list[Task], spec: SweepSpec, workers: int, finish: Callable[[Task, Any, int], bool]) -> None:
    """Run ``todo`` here (one worker) or on ``workers`` local processes; ``finish(task, result or exception,
    attempt)`` returns True when the task should run again."""
    if workers <= 1:
        for task in todo:
            attempt = 1
            while True:
                try:
                    result: Any = run_task(task, spec)
                except Exception as exc:  # noqa: BLE001 - reported in the task's row, never stops the sweep
                    result = exc
                if not finish(task, result, attempt):
                    break
                attempt += 1
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    pending = [(t, 1) for t in todo]
    ctx = multiprocessing.get_context(_start_method())
    while pending:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            running = {pool.submit(run_task, t, spec): (t, a) for t, a in pending}
            pending = []
            broken = False
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    task, attempt = running.pop(fut)
                    try:
                        result = fut.result()
                    except BrokenProcessPool as exc:  # a worker died: this task and the others still running
                        broken, result = True, BNProbeError(f"worker lost ({_reason(exc)})")
                    except Exception as exc:  # noqa: BLE001
                        result = exc
                    if finish(task, result, attempt):
                        (pending.append((task, attempt + 1)) if broken else
                         running.setdefault(pool.submit(run_task, task, spec), (task, attempt + 1)))
                if broken:  # the tasks still queued or running on the broken pool run again on a new one
                    pending.extend(running.values())
                    break


def _dask(todo: list[Task], spec: SweepSpec, address: str, finish: Callable[[Task, Any, int], bool]) -> None:
    """Run ``todo`` on the dask.distributed cluster at ``address``; a task whose worker is lost is rescheduled by
    dask itself, and one that fails is retried once here."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise BNProbeError(f"{named('scheduler')} needs dask.distributed: pip install 'bnprobe[dist]'") from None
    try:
        client = Client(address, timeout=10, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise BNProbeError(f"cannot reach the dask scheduler at {address}: {_reason(exc)}") from None
    try:
        futures = {client.submit(run_task, t, spec, key=f"bnprobe-{t.key}-1", pure=False): (t, 1) for t in todo}
        with client.as_current():
            queue = as_completed(list(futures))
        for fut in queue:
            task, attempt = futures.pop(fut)
            try:
                result: Any = fut.result()
            except Exception as exc:  # noqa: BLE001 - KilledWorker, the task's own error...
                result = exc
            if finish(task, result, attempt):
                again = client.submit(run_task, task, spec, key=f"bnprobe-{task.key}-{attempt + 1}", pure=False)
                futures[again] = (task, attempt + 1)
                queue.add(again)
    finally:
        client.close()


def run_sweep(tasks: list[Task], spec: SweepSpec, *, workers: int = 1, scheduler: str | None = None,
              journal: Journal | None = None, resume: bool = False, force: bool = False,
              progress: Callable[[int, int, int], None] | None = None,
              words: Callable[[str], str] = str) -> list[dict[str, Any]]:
    """Every task's row (finished ones of a resumed sweep reused), in step, rank and forward order.  Each
    failure is retried once, then its row holds the error, the parameters it names worded by ``words`` (the
    command line passes its flags); ``progress(done, total, failed)`` after each row."""
    done = journal.finished(resume, force) if journal is not None else {}
    rows = {k: v for k, v in done.items() if any(t.key == k for t in tasks)}
    if journal is not None:
        journal.open(rows.values())
    todo = [t for t in tasks if t.key not in rows]
    failed = [0]

    def finish(task: Task, result: Any, attempt: int) -> bool:
        if isinstance(result, BaseException):
            if attempt < 2:
                return True
            row = error_row(task, _reason(result, words), attempt)
            failed[0] += 1
        else:
            row = {**result, "attempts": attempt}
        rows[task.key] = row
        if journal is not None:
            journal.add(row)
        if progress is not None:
            progress(len(rows), len(tasks), failed[0])
        return False

    if progress is not None:
        progress(len(rows), len(tasks), 0)
    if scheduler is not None:
        _dask(todo, spec, scheduler, finish)
    else:
        _local(todo, spec, workers, finish)
    return [rows[t.key] for t in tasks]


def header(root: str | Path, spec: SweepSpec, calls: str | None) -> dict[str, Any]:
    """What identifies a sweep in its journal: root, check, options."""
    return {"bnprobe-sweep": 1, "root": str(Path(root).resolve()), "calls": calls, **asdict(spec)}


# ---- the sweep's result --------------------------------------------------------------------------------

SCORES = {c.name: c.sweep_score for c in COMMANDS if c.sweepable}  # what a sweep of each command scores


@dataclass
class SweepResult:
    """Every task's row and what they say together: the first call over the standard per step and rank (forward
    order), and the ranks that disagree on the same layer and step."""

    command: str
    root: str
    rows: list[dict[str, Any]]  # one per call
    seconds: float = 0.0
    engine: str = ""
    notes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # one per (step, layer) several ranks recorded

    @classmethod
    def of(cls, command: str, root: str, rows: list[dict[str, Any]], **kw: Any) -> SweepResult:
        """From :func:`run_sweep`'s rows: the calls' and the rank checks' apart.  Where every rank of a layer and
        step normalised with the global statistics (SyncBatchNorm), a call's own check against its slice of the
        batch does not apply: its verdict is the rank check's, against the concatenated batch."""
        ranks = [r for r in rows if r["key"].startswith("ranks:")]
        calls = [dict(r) for r in rows if not r["key"].startswith("ranks:")]
        sync = {(r["step"], r["layer"]): r for r in ranks if r.get("kind") == "syncbn"}
        for row in calls:
            if (g := sync.get((row["step"], row["layer"]))) is not None and row["status"] == "ok":
                # its score too: the own-slice one (kept as own_slice_score) measures the wrong golden
                row.update(verdict=g["verdict"],
                           failing="" if g["verdict"] == Verdict.PASS else "; ".join(g["failures"]),
                           judged_by="ranks", own_slice_score=row.get("score"),
                           score=(g.get("scores") or {}).get(str(row["rank"]), math.nan),
                           notes=[*row.get("notes", []), "SyncBatchNorm: this rank normalised "
                                  "with the global statistics; judged by the rank check against "
                                  "the concatenated batch, not its own slice"])
        return cls(command, root, calls, ranks=ranks, **kw)

    @property
    def passed(self) -> bool:
        return all(r["verdict"] == Verdict.PASS for r in (*self.rows, *self.ranks))

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> Verdict:
        """PASS; else FAIL when a call or a rank check failed; else ERROR (some could not run)."""
        if self.passed:
            return Verdict.PASS
        return Verdict.FAIL if any(r["verdict"] == Verdict.FAIL for r in (*self.rows, *self.ranks)) else Verdict.ERROR

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per (step, rank, call) (:meth:`to_frame`)."""
        return self.to_frame()

    def to_frame(self) -> Any:
        """One row per (step, rank, call): lists and mappings as text, so CSV and Parquet hold them."""
        import pandas as pd

        flat = [{k: ("; ".join(map(str, v)) if isinstance(v, list) else json.dumps(v) if isinstance(v, dict) else v)
                 for k, v in r.items()} for r in self.rows]
        return pd.DataFrame(flat)

    def first_failing(self) -> list[dict[str, Any]]:
        """Per step and rank, the first call (forward order) that fails or errs."""
        first: dict[tuple[int, str], dict[str, Any]] = {}
        for r in sorted(self.rows, key=lambda r: r["order"]):
            if r["verdict"] != Verdict.PASS:
                first.setdefault((r["step"], r["rank"]), r)
        return [{"step": s, "rank": k, "order": r["order"], "call": r["call"], "layer": r["layer"],
                 "verdict": r["verdict"], "failing": r["failing"] or r.get("error", "")}
                for (s, k), r in sorted(first.items(), key=lambda kv: (kv[0][0], _rank_key(kv[0][1])))]

    def disagreements(self) -> list[dict[str, Any]]:
        """Layers and steps on which ranks reach different verdicts on their own data, or used statistics that
        the concatenated batch does not explain (the rank checks that failed or could not run)."""
        groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for r in self.rows:
            groups.setdefault((r["step"], r["layer"]), []).append(r)
        out = []
        for (step, layer), rs in groups.items():
            verdicts = {r["verdict"] for r in rs}
            if len(rs) > 1 and len(verdicts) > 1:
                out.append({"step": step, "layer": layer, "what": "verdicts differ",
                            "ranks": ", ".join(f"{r['rank'] or '-'}: {r['verdict']}"
                                               + (f" ({r['failing']})" if r["failing"] else "") for r in rs)})
        out += [{"step": r["step"], "layer": r["layer"], "what": "statistics" if r["verdict"] == Verdict.FAIL else
                 "rank check could not run", "ranks": r["summary"] or r.get("error", "")}
                for r in self.ranks if r["verdict"] != Verdict.PASS]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "root": self.root, "passed": self.passed, "tasks": len(self.rows),
                "failed": sum(r["verdict"] == Verdict.FAIL for r in self.rows),
                "errors": sum(r["verdict"] == Verdict.ERROR for r in self.rows), "seconds": self.seconds,
                "engine": self.engine, "score": SCORES[self.command], "first_failing": self.first_failing(),
                "disagreements": self.disagreements(), "notes": self.notes, "rows": self.rows,
                "ranks": self.ranks}


def _rank_key(rank: str) -> tuple[int, int | str]:
    return (0, int(rank)) if rank.isdigit() else (1, rank)

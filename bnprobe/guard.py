"""The resource guard: a run's peak memory is estimated from its shapes **before** anything is allocated, and a run
that would not fit is refused with one line naming the size and the limit.

The limit is the memory available to this process (``MemAvailable``, and the cgroup's own limit when it is lower),
or what ``--max-memory`` / ``BNPROBE_MAX_MEMORY`` set.  The estimates are per command: a fixed base (the
interpreter, numpy, pandas, matplotlib; numba's compiler where the kernels may take the compiled route) plus
bytes per element of the largest input the run holds at once (the kernels work one call and one channel block
at a time, the recorded calls are loaded one at a time).  The
per-element figures are the measured growth of each command's peak resident memory between a 0.5 M and a 4.2 M
element input (``/usr/bin/time -f %M``), times 1.3; a dump's call replayed (its own outputs judged, in its one
format) has its own, measured between 2.1 M and 8.4 M values; ``tests/test_guard.py`` re-measures them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

from bnprobe.compiled.jit import may_compile
from bnprobe.core.commands import COMMANDS
from bnprobe.core.errors import BNProbeError

__all__ = ["ENV", "BASE_BYTES", "COMPILED_BYTES", "PER_ELEMENT", "PER_RECORDED_ELEMENT", "MODEL_CACHE_BYTES",
           "parse_size", "format_size", "available_memory",
           "memory_limit", "set_memory_limit", "require", "require_run", "run_bytes", "tune_process",
           "release_free_memory"]

ENV = "BNPROBE_MAX_MEMORY"

#: Resident memory of a command before its data: Python, numpy, pandas, matplotlib's first figure.
BASE_BYTES = 256 * 2**20

#: Peak bytes per element of the largest input a command holds at once, and of a recorded call replayed: each
#: command's figures in the registry (bnprobe.core.commands, where their measurements are told); ``load``: reading
#: an input file (its values in float64 besides their stored bytes).
PER_ELEMENT: dict[str, int] = {**{c.name: c.per_element for c in COMMANDS if c.per_element is not None}, "load": 16}
#: Commands not named here take PER_ELEMENT's figure.
PER_RECORDED_ELEMENT: dict[str, int] = {c.name: c.per_recorded_element for c in COMMANDS
                                        if c.per_recorded_element is not None}

#: doctor keeps the bug models' outputs on one call within this, and the newest model besides
#: (bnprobe.checks.doctor.diagnosis).  On a dump they measured 322 B per element up to 1 M values, then 240-320 MiB; the
#: estimate adds 420 B per element, up to 1.5 × this.
MODEL_CACHE_BYTES = 256 * 2**20
_MODEL_CACHE_PER_ELEMENT = 420

#: numba and its compiler, for commands whose kernels may take the compiled route (bnprobe.kernels.fused):
#: measured +131 MB to run cached kernels and +257 MB peak for a first run that compiles them (2 cores, x86_64).
COMPILED_BYTES = 288 * 2**20
_NO_COMPILED_ROUTE = frozenset((*(c.name for c in COMMANDS if not c.compiled), "load"))

#: torch, for runs with a torch adapter (compare-precision's default set has one where torch is installed):
#: importing it and running its CPU kernel measured +199 MB resident (torch 2.13.0 CPU, x86_64), ×1.15.
TORCH_BYTES = 224 * 2**20

_override: int | None = None


def parse_size(text: str) -> int:
    """``'512M'``, ``'4G'``, ``'1.5GiB'``, ``'2000000'`` (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise BNProbeError(f"memory size {text!r} is not a number with an optional unit (K, M, G, T), e.g. 4G")
    value = float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    if not math.isfinite(value) or value < 1 or value > 2**62:
        raise BNProbeError(f"memory size {text!r} must be between 1 byte and 4 EiB")
    return int(value)


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> tuple[int, str]:
    """Bytes this process can still allocate, and where the figure comes from."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "available memory"))
                break
    except (OSError, ValueError, IndexError):
        pass
    cg_max, cg_now = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if cg_max is None:  # cgroup v1
        cg_max = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        cg_now = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if cg_max is not None and cg_max < 2**60:
        found.append((max(cg_max - (cg_now or 0), 0), "memory left in this cgroup"))
    try:  # an address-space limit (ulimit -v): what is left of it
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            vm = 0
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    vm = int(line.split()[1]) * 1024
            found.append((max(soft - vm, 0), "address space left under ulimit -v"))
    except (ImportError, OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        pass
    if not found:
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available memory"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
            found.append((8 * 2**30, "assumed memory (8 GiB; set --max-memory)"))
    return min(found)


def set_memory_limit(nbytes: int | None) -> None:
    """Set the limit for this process (``--max-memory``); ``None`` restores the default."""
    global _override
    _override = nbytes


def memory_limit() -> tuple[int, str]:
    """The limit in bytes and its source: ``--max-memory``, else ``BNPROBE_MAX_MEMORY``, else what is available."""
    if _override is not None:
        return _override, "--max-memory limit"
    env = os.environ.get(ENV)
    if env:
        try:
            return parse_size(env), f"{ENV} limit"
        except BNProbeError as exc:
            raise BNProbeError(f"{ENV}: {exc}") from None
    return available_memory()


def require(nbytes: float, what: str) -> None:
    """Refuse, before allocating, a run estimated to need ``nbytes``."""
    limit, source = memory_limit()
    if nbytes > limit:
        raise BNProbeError(f"{what} needs about {format_size(nbytes)} of memory, more than the {format_size(limit)} "
                           f"{source} (--max-memory SIZE sets the limit; a smaller shape or fewer calls need less)")


def run_bytes(command: str, elements: int, *, torch: bool = False, recorded: bool = False) -> int:
    """The estimated peak memory of ``command`` on an input of ``elements`` values (``recorded``: a dump's call),
    with the compiled route's numba where the command's kernels may take it, and torch's when ``torch`` (a torch
    adapter runs)."""
    n = int(elements)
    jit = COMPILED_BYTES if command not in _NO_COMPILED_ROUTE and may_compile(n) else 0
    per = PER_RECORDED_ELEMENT.get(command, PER_ELEMENT[command]) if recorded else PER_ELEMENT[command]
    models = min(_MODEL_CACHE_PER_ELEMENT * n, MODEL_CACHE_BYTES * 3 // 2) if command == "doctor" else 0
    return BASE_BYTES + jit + (TORCH_BYTES if torch else 0) + per * n + models


def require_run(command: str, shape: tuple[int, ...] | int, what: str | None = None, *, torch: bool = False,
                recorded: bool = False) -> None:
    """Refuse ``command`` on an input of ``shape`` (or that many elements; ``recorded``: a dump's call) when it
    would exceed the limit."""
    elements = shape if isinstance(shape, int) else math.prod(shape)
    label = what or (f"{command} on shape {tuple(shape)}" if not isinstance(shape, int)
                     else f"{command} on {elements:,} values")
    require(run_bytes(command, elements, torch=torch, recorded=recorded), label)


_PROCESS_TUNED = False


def tune_process() -> None:
    """Large temporaries reuse memory instead of faulting in fresh pages each time, and idle compiled threads sleep.

    glibc's malloc maps and unmaps large temporaries anew each time: above its mmap threshold (128 KiB fixed when
    MALLOC_TRIM_THRESHOLD_ is set, as dask's nanny does for its workers: tasks 2.6x slower; rising to at most
    32 MiB otherwise), every array of a check's pass over an output is fresh pages, faulted in and zeroed.  In a
    command's process and a sweep's worker, temporaries up to 512 MiB (a 64 M-value float64 array) come from the
    heap (msprobe's metrics on a 1.6 M-value output 2.8x faster; the main job 1.13x; a sweep's task 1.35x
    in-process, 3.6x on a dask worker; with 512 MiB instead of 64, compare-precision on a dump whose largest call
    is 9.4 M values 1.11x, its peak 3% higher); free heap above 128 MiB is still returned to the system.

    numpy asks for transparent huge pages for every array of 4 MiB or more (``NUMPY_MADVISE_HUGEPAGE``); on a
    virtual machine whose host backs them lazily the first touch of each stalls (measured: a fresh 75 MB array
    13 ms for the first two, then 220-470 ms each, against 24 ms each without), so commands do not ask for them:
    the same dump's compare-precision 1.28x faster; where huge pages are cheap the cost is the fresh pages'
    faults, which the heap's reuse above makes rare.  A ``NUMPY_MADVISE_HUGEPAGE`` the user set is kept.

    The compiled kernels' threads (numba's OpenMP layer) wait for work asleep, not spinning (``OMP_WAIT_POLICY``
    passive, read when the layer loads, unless the user set it): spinning threads of two processes on the same cores
    (a sweep's workers, two commands at once, the test suite's two workers) hold each other off at every parallel
    loop's barrier.  Measured on 2 cores: two compare-precision runs at once on a dump 19.9 s passive, 22.0 s with
    libgomp's default (it spins a while), 34-35 s spinning (``ACTIVE``); the compiled-route test matrix (many small
    parallel loops) in two processes 25 s passive, 164 s by default; one command alone as fast either way (the main
    job 11.2-12.2 s against 11.7-12.7 s, compare-precision on a dump 16.7-18.0 s against 17.1-17.9 s, torch's
    kernel on 4 M values, whose threads read it too, 6.2-6.9 s against 6.2-7.2 s).

    numpy's BLAS (OpenBLAS) threads likewise sleep as soon as a call is done (``OPENBLAS_THREAD_TIMEOUT`` 4, 2^4
    cycles of spinning, read when numpy loads, unless the user set it; its default spins for 2^28 cycles, about
    0.1 s): msprobe's cosine and EucDist are numpy dot products, which OpenBLAS splits over its threads above about
    10,000 values, and the thread left spinning after each one took a core from the command's own thread.  The number of
    threads, so how a dot product is split and summed, is unchanged: the same bits.  Measured (2026-12-06, 2 cores,
    load 4.4): msprobe's metrics on a 100,352-value fp32 output 10.5-11.7 ms against 22.7-23.3 ms, their CPU 3.4x
    less.  (In a sweep's worker numpy may be loaded before this runs: its threads keep OpenBLAS's default.)

    Called by the CLI and the sweep's tasks, never on import (a user's own process keeps its settings); nothing is
    done to malloc on another libc."""
    global _PROCESS_TUNED
    if _PROCESS_TUNED:
        return
    _PROCESS_TUNED = True
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # (the least OpenBLAS takes)
    if not sys.platform.startswith("linux"):
        return
    _no_huge_pages()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        # a threshold glibc refuses, 32 MiB then (its documented limit); where it refuses both, its own dynamic
        # threshold is kept, and the trim threshold (which would fix it) is left alone too
        if libc.mallopt(-3, 512 << 20) or libc.mallopt(-3, 32 << 20):  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def release_free_memory() -> None:
    """Return the heap's free memory to the system now (glibc's ``malloc_trim``), in a process :func:`tune_process`
    tuned (a command's: its heap keeps what it frees below the 128 MiB trim threshold, for speed): between a run's
    cases and before its report, so that the memory a finished case freed is not counted again in the next phase's
    peak (a few milliseconds; the next case's arrays fault their pages in again).  Nothing elsewhere."""
    if not _PROCESS_TUNED or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _no_huge_pages() -> None:
    """numpy's arrays without MADV_HUGEPAGE (see :func:`tune_process`), unless ``NUMPY_MADVISE_HUGEPAGE`` is set."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    np = sys.modules.get("numpy")
    if np is None:  # read when numpy is imported
        os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
        return
    for where in ("_core", "core"):  # numpy 2, numpy 1.x
        setter = getattr(getattr(getattr(np, where, None), "multiarray", None), "_set_madvise_hugepage", None)
        if setter is not None:
            setter(False)
            return

"""Whether the kernels' compiled route (numba) is on, and for which calls.  ``BNPROBE_JIT``: 0/false/no/off never,
1/true/yes/on/always for every call, unset or ``auto`` for calls of at least :data:`COMPILED_MIN_ELEMENTS` values
once the kernels are compiled for this machine; never when numba is not installed.  A bottom-layer module: the
kernels choose their route by it, the resource guard counts its memory.

Under ``auto`` no run waits for numba to compile: until the warm-up (:mod:`.warm_up`) has filled numba's cache for
these sources, numba version and machine, large calls take the numpy route (the same values bit for bit) and the
first one starts the warm-up in a background process (``BNPROBE_WARM_UP``: ``background``, the default; or
``foreground``: compile in the run on first use, as numba does by itself)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import threading
import time
from pathlib import Path

__all__ = ["JIT_ENV", "WARM_UP_ENV", "COMPILED_MIN_ELEMENTS", "KERNEL_LOCK", "jit_mode", "jit_enabled", "jit_for",
           "may_compile", "compiled_ready", "warm_up_paths", "start_warm_up", "write_state", "python_of_this_package"]

JIT_ENV = "BNPROBE_JIT"
WARM_UP_ENV = "BNPROBE_WARM_UP"
#: under ``auto``, a call of fewer values takes the numpy route: both routes give the same values bit for bit, and
#: below this the compiled one does not pay for itself — the main job's default run (ResNet-50's shapes at batch 2,
#: at most 1.6 million values a call) took 20.6 s compiled and 21.2 s on numpy (2 cores), while importing numba's
#: kernels costs 1.7 s and about 250 MB, and compiling them on a fresh install 65 s
COMPILED_MIN_ELEMENTS = 1 << 21

# numba's default threading layer (workqueue) aborts when two threads run parallel kernels at once (a dask
# worker's threads can): every compiled kernel is called under this lock
KERNEL_LOCK = threading.Lock()

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "always")


def jit_mode() -> str:
    """``off``, ``on`` (every call) or ``auto`` (large calls), from ``BNPROBE_JIT`` and whether numba is here."""
    value = os.environ.get(JIT_ENV, "auto").strip().lower()
    if value in _OFF or not _numba_installed():
        return "off"
    return "on" if value in _ON else "auto"


def jit_enabled() -> bool:
    """Whether any call may take the compiled route (``BNPROBE_JIT`` not off, numba installed)."""
    return jit_mode() != "off"


def jit_for(elements: int | None, *, cheap: bool = False) -> bool:
    """Whether a call of ``elements`` values takes the compiled route (None: of unknown size, as a large one).
    Under ``auto`` a large call waits for no compiler: before the kernels are compiled here (:func:`compiled_ready`)
    it takes the numpy route and starts the background warm-up (see the module notes).  ``cheap``: a kernel that
    compiles in about a second and repays it on one large array (bnprobe.compiled.bits' casts and ulps: numpy's
    route takes 0.1-0.2 s more per 8 M values, and a dump's compare makes dozens of them), compiled in the run when
    the warm-up has not done it yet."""
    mode = jit_mode()
    if mode != "auto":
        return mode == "on"
    if elements is not None and elements < COMPILED_MIN_ELEMENTS:
        # once a large call has loaded the kernels the warm-up compiled, the small ones of the same run take them
        # too: what kept them on numpy (importing numba and loading its cache, 1.7 s) is paid (a six-layer model's
        # dump compared in 6.3 s of CPU against 7.4 s with its four smaller calls on numpy)
        return _IN_USE.is_set()
    foreground = _warm_up_mode() == "foreground"
    if cheap or foreground or compiled_ready():
        if cheap and not compiled_ready():
            start_warm_up()
        elif not foreground:
            _IN_USE.set()
        return True
    start_warm_up()
    return False


#: set when a large call took the kernels the warm-up compiled (never in foreground mode, where they may not be
#: compiled yet: a small call would compile its own)
_IN_USE = threading.Event()


def may_compile(elements: int | None) -> bool:
    """Whether a call of ``elements`` values may take the compiled route in this process — now, or once a warm-up
    ends during the run — without starting anything (what the resource guard counts numba's memory for)."""
    mode = jit_mode()
    return mode == "on" or (mode == "auto" and (elements is None or elements >= COMPILED_MIN_ELEMENTS))


def _warm_up_mode() -> str:
    return "foreground" if os.environ.get(WARM_UP_ENV, "").strip().lower() == "foreground" else "background"


# the ready mark is looked for again at most this often (a stat per large call otherwise): a warm-up that ends
# during a run moves its later large calls to the compiled route
_RECHECK_SECONDS = 2.0
_ready_seen: list[float] = []  # when the mark was last looked for and not found


def compiled_ready() -> bool:
    """Whether the warm-up has compiled the kernels into numba's cache for these sources, this numba and this
    machine (its mark, :func:`warm_up_paths`, exists).  Once True, stays True in this process."""
    if _READY.is_set():
        return True
    now = time.monotonic()
    if _ready_seen and now - _ready_seen[0] < _RECHECK_SECONDS:
        return False
    _ready_seen[:] = [now]
    if warm_up_paths()[0].exists():
        _READY.set()
        return True
    return False


_READY = threading.Event()


@functools.cache
def warm_up_paths() -> tuple[Path, Path, Path]:
    """(ready mark, lock, log) of the warm-up, beside numba's cache of these kernels: ``$NUMBA_CACHE_DIR``, else
    this package's ``__pycache__`` where writable (where numba caches them), else the user's cache folder.  Their
    names carry a digest of the compiled route's sources, numba's version, Python's and the machine's, so that an
    edit or an upgrade makes the kernels cold again."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    numba_version = importlib.metadata.version("numba") if _numba_installed() else "none"
    digest.update(f"{numba_version} {sys.version_info[:2]} {platform.machine()} {platform.node()}".encode())
    key = digest.hexdigest()[:16]
    if os.environ.get("NUMBA_CACHE_DIR"):
        folder = Path(os.environ["NUMBA_CACHE_DIR"]) / "bnprobe"
    elif os.access(here / "__pycache__" if (here / "__pycache__").is_dir() else here, os.W_OK):
        folder = here / "__pycache__"
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bnprobe"
    return folder / f"warm-up-{key}.ready", folder / f"warm-up-{key}.lock", folder / f"warm-up-{key}.log"


# a lock older than this is taken for a warm-up that died without removing it
_STALE_LOCK_SECONDS = 3600.0


def start_warm_up() -> bool:
    """Start the warm-up (``python -m bnprobe.compiled.warm_up``) in a background process of the lowest priority,
    unless this process started one or another process's is running.  Returns whether it started one."""
    if _STARTED.is_set():
        return False
    _STARTED.set()
    _, lock, log = warm_up_paths()
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and _stale(lock):
            lock.unlink(missing_ok=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # one warm-up at a time: who creates it
    except OSError:  # another process's warm-up holds the lock, or the folder cannot be written: nothing to start
        return False
    env = {**os.environ, JIT_ENV: "1"}
    try:
        out = os.open(log, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
        try:
            # its own session: the warm-up outlives this run (and a Ctrl-C of it) and is never waited for
            pid = os.posix_spawn(sys.executable, [*python_of_this_package(), "bnprobe.compiled.warm_up", str(lock)],
                                 env,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)],
                                 setsid=True)
        finally:
            os.close(out)
    except (OSError, AttributeError):  # no posix_spawn here (Windows): numba compiles on first use, as before
        lock.unlink(missing_ok=True)
        os.environ[WARM_UP_ENV] = "foreground"
        return False
    write_state(lock, str(pid))
    return True


_STARTED = threading.Event()


def write_state(path: Path, text: str) -> None:
    """Write the warm-up's lock or ready mark: small state files in numba's cache folder, not a run's output
    (bnprobe._files stages those, a layer above this one)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _stale(lock: Path) -> bool:
    """Whether ``lock`` was left by a warm-up that is gone (its process ended, or it is older than an hour)."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            return True
        pid = int(lock.read_text() or 0)
    except (OSError, ValueError):
        return False
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def python_of_this_package() -> list[str]:
    """The command that runs a module (its name appended) of this very bnprobe, wherever it was imported from
    (an installed package or a checkout on ``PYTHONPATH``): the warm-up's processes must compile these sources."""
    root = str(Path(__file__).resolve().parents[2])
    return [sys.executable, "-c", "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
            "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)", root]


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None

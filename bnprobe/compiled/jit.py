"""Whether the kernels' compiled route (numba) is on, and for which calls.  ``BNPROBE_JIT``: 0/false/no/off never,
1/true/yes/on/always for every call, unset or ``auto`` for calls of at least :data:`COMPILED_MIN_ELEMENTS` values;
never when numba is not installed.  A bottom-layer module: the kernels choose their route by it, the resource
guard counts its memory."""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

__all__ = ["JIT_ENV", "COMPILED_MIN_ELEMENTS", "KERNEL_LOCK", "jit_mode", "jit_enabled", "jit_for"]

JIT_ENV = "BNPROBE_JIT"
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


def jit_for(elements: int | None) -> bool:
    """Whether a call of ``elements`` values takes the compiled route (None: of unknown size, as a large one)."""
    mode = jit_mode()
    return mode == "on" or (mode == "auto" and (elements is None or elements >= COMPILED_MIN_ELEMENTS))


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None

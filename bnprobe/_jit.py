"""Whether the kernels' compiled route (numba) is on: ``BNPROBE_JIT`` is not 0/false/no/off and numba is
installed.  A bottom-layer module: the kernels choose their route by it, the resource guard counts its memory."""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["JIT_ENV", "jit_enabled"]

JIT_ENV = "BNPROBE_JIT"


def jit_enabled() -> bool:
    """False when ``BNPROBE_JIT`` is 0/false/no/off, or numba is not installed."""
    if os.environ.get(JIT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _numba_installed()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None

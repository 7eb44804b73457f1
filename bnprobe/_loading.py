"""Loading user code named as ``package.module:attribute``."""

from __future__ import annotations

import importlib
from typing import Any

from bnprobe.errors import BNProbeError

__all__ = ["load_callable"]


def load_callable(spec: str, what: str) -> Any:
    """The callable ``attribute`` of ``module`` named by ``spec`` (``module:attribute``); ``what`` names it in
    errors."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise BNProbeError(f"{what} {spec!r} is not module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise BNProbeError(f"cannot load {what} {spec!r}: {exc}") from None
    if not callable(fn):
        raise BNProbeError(f"{what} {spec!r} is not callable")
    return fn

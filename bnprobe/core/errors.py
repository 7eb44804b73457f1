"""The one exception type bnprobe raises for bad input."""

from __future__ import annotations

__all__ = ["BNProbeError"]


class BNProbeError(ValueError):
    """Bad input or configuration: the message is one line naming the problem.

    The CLI prints it as ``bnprobe: error: <message>`` and exits with status 2.
    """

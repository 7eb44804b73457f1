"""The one exception type bnprobe raises for bad input, and the parameters its messages name.

A message names a parameter through :func:`named`: ``str(exc)`` reads it as the library's parameter (``eps``), and
the command line words it as its flag (``--eps``) through :meth:`BNProbeError.worded`, so a library user is not told
about flags and a command-line user is not told about parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["BNProbeError", "named", "worded"]

_MARK = "\x1f"  # ASCII's unit separator: no message's own text holds it
_NAMED = re.compile(f"{_MARK}([^{_MARK}]*){_MARK}")


def named(field: str) -> str:
    """``field``, a parameter's name, as an error message names it: read as ``field`` itself by ``str(exc)``, and
    as whatever :meth:`BNProbeError.worded` is given (the command line's flag)."""
    return f"{_MARK}{field}{_MARK}"


def worded(text: str, name: Callable[[str], str] = str) -> str:
    """``text`` with each parameter it :func:`named` written as ``name(field)`` (by default the field itself)."""
    return _NAMED.sub(lambda m: name(m.group(1)), text)


class BNProbeError(ValueError):
    """Bad input or configuration: the message is one line naming the problem.

    ``field`` is the parameter at fault (``"eps"``, ``"calls"``; by default the first the message names, None when
    it names none).  The CLI prints the message as ``bnprobe: error: <message>``, the parameters it names worded
    as flags, and exits with status 2.
    """

    def __init__(self, message: str = "", field: str | None = None) -> None:
        self.template = message  # the message with the parameters it names marked (see named())
        first = _NAMED.search(message)
        self.field = field if field is not None or first is None else first.group(1)
        super().__init__(worded(message))

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each parameter it names written as ``name(field)`` (the command line: its flag)."""
        return worded(self.template, name)

"""What every check's result answers, whatever its own shape: the :class:`Verdict` values the reports print, and
the :class:`CheckResult` protocol — ``passed`` (and ``bool(result)``, the same), ``verdict``, ``notes`` and
``frame``, the per-output rows as a DataFrame — and :class:`OfCalls`, what a result over a recording's calls answers
besides.

Each check keeps its own result type (its fields are what its report reads); each satisfies the protocol, so a
renderer or a sweep reads the verdict and the notes the same way for every check.  Importing this module loads
neither numpy nor pandas.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Verdict", "CheckResult", "OfCalls", "Judged", "Analysis"]


class Verdict(str, enum.Enum):
    """A verdict as the reports print it: each member *is* its text (``Verdict.PASS == "PASS"``, and
    ``str()``, f-strings, JSON and pandas' CSV write ``PASS``), so a row holding one is written exactly as the
    plain string was."""

    PASS = "PASS"
    FAIL = "FAIL"
    WARN = "WARN"  # doctor's checklist item that is not wrong but worth knowing; compare's format check
    OK = "ok"  # compare's format check with nothing to warn of
    ERROR = "ERROR"  # a sweep's task that could not run (twice)
    NOT_FUSED = "not fused"  # fold --onnx: the fused model has no such layer
    NOT_CHECKED = "not checked"  # fold --onnx: the fused layer could not be compared
    NONE = "none"  # a result with no verdict of its own (rsqrt's analysis, shrink's smaller input)

    # the text, on Python 3.10 as on 3.11+ (where a str mix-in Enum formats as "Verdict.PASS")
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    # equal to its text, so hashed as its text (Enum hashes the member's name: OK's is not its value)
    def __hash__(self) -> int:
        return hash(self.value)

    @classmethod
    def of(cls, passed: bool) -> Verdict:
        """PASS when ``passed``, else FAIL."""
        return cls.PASS if passed else cls.FAIL


@runtime_checkable
class CheckResult(Protocol):
    """What every check's result answers (``isinstance(result, CheckResult)`` holds for each).

    ``passed``: nothing the check judged failed (what its command's exit status 0 says; a result with no verdict of
    its own passes); ``bool(result)`` is ``passed``; ``verdict``: a :class:`Verdict`; ``notes``: what the verdict
    alone does not say, in words; ``frame``: the result's rows (per output, channel, item or call, as the check
    has them) as a pandas DataFrame, made when asked for."""

    @property
    def passed(self) -> bool: ...

    @property
    def verdict(self) -> Verdict: ...

    @property
    def notes(self) -> list[str]: ...

    @property
    def frame(self) -> pd.DataFrame: ...

    def __bool__(self) -> bool: ...


@runtime_checkable
class OfCalls(Protocol):
    """What a check's result over the calls of a recording answers besides the protocol: ``results``, each call's
    own result in forward order (``isinstance(result, OfCalls)``: what a command's one renderer tells such a result
    from the result of one run by)."""

    @property
    def results(self) -> list[Any]: ...


class Judged:
    """What a result derives from its ``passed``: truthy when it passed, and its verdict PASS or FAIL (a result
    with other verdicts defines its own).  A base of the checks' result types, so the protocol's derived half is
    written once."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return bool(self.passed)  # type: ignore[attr-defined]

    @property
    def verdict(self) -> Verdict:
        return Verdict.of(self.passed)  # type: ignore[attr-defined]


class Analysis(Judged):
    """The result of an analysis, not a check (rsqrt's, shrink's): it has no verdict of its own (``Verdict.NONE``)
    and passes, as its command exits 0."""

    __slots__ = ()

    @property
    def passed(self) -> bool:
        return True

    @property
    def verdict(self) -> Verdict:
        return Verdict.NONE

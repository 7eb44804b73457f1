"""A minimal progress bar: drawn on stderr when it is a terminal, silent when piped."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.monotonic()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int, suffix: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        self.stream.write(f"\r{self.label} [{bar}] {frac:6.1%}  {elapsed:6.1f}s  eta {eta:6.1f}s"
                          + (f"  {suffix}" if suffix else ""))
        self.stream.flush()
        self.drawn = True

    def steps(self, total: int) -> Callable[[Any], None]:
        """A callback drawing one step per call, up to ``total`` (for work whose length is not known ahead)."""
        done = [0]

        def tick(_: Any = None) -> None:
            done[0] += 1
            self(min(done[0], total), total)

        return tick

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()

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
        self.first: tuple[float, int] | None = None  # (time, steps done) when the first step completed

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
        self.stream.write(f"\r{self.label} [{bar}] {frac:6.1%}  {elapsed:6.1f}s  {self._eta(now, done, total)}"
                          + (f"  {suffix}" if suffix else ""))
        self.stream.flush()
        self.drawn = True

    def _eta(self, now: float, done: int, total: int) -> str:
        """The time left, from the rate since the first step completed: the first carries start-up and any kernel
        compiling (numba's first run of a kernel takes a minute), which would make an estimate from it far off."""
        if done >= total:
            return "eta    0.0s"
        if self.first is None and done > 0:
            self.first = (now, done)
        if self.first is None or done <= self.first[1]:
            return "eta: after the first step (it may compile kernels)"
        t0, d0 = self.first
        return f"eta {(now - t0) / (done - d0) * (total - done):6.1f}s"

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

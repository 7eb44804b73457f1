"""The trace: every intermediate of a BatchNorm run, in order, with exception counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import Format, get_format
from bnprobe.numerics.arith import TALLY_FIELDS, Tally, as_carrier

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Stage", "Trace", "COUNTERS"]

# Per-channel counters of every stage.  overflow: the wide value rounds beyond the
# format's max (also when saturation hid it); saturated: clamped to ±max or NaN
# set to 0; underflow: a nonzero wide value stored as zero; flushed: a subnormal
# flushed to zero; subnormal: stored nonzero values below the smallest normal;
# negative: a variance-like value below zero before any clamp.
COUNTERS: tuple[str, ...] = ("nan", "posinf", "neginf", *TALLY_FIELDS, "subnormal", "negative")


@dataclass
class Stage:
    """One named intermediate.

    ``value`` holds the stored values (float64 carriers of ``format``) and
    ``wide`` the float64 values they were rounded from (None where not kept); for
    a reduction stage (a sum), ``wide`` is the sum of the same addends formed in
    float64, i.e. the stage without its own rounding.
    Elementwise stages are channel-first ``(C, R)``; per-channel ones ``(C,)``.
    """

    name: str
    format: str
    value: np.ndarray | None
    wide: np.ndarray | None
    counters: dict[str, np.ndarray]
    elementwise: bool
    size: int
    vmin: float
    vmax: float
    absmax: float

    def count(self, counter: str) -> int:
        return int(self.counters[counter].sum())

    @property
    def anomalies(self) -> dict[str, int]:
        """Counters that are nonzero, summed over channels."""
        return {k: int(v.sum()) for k, v in self.counters.items() if v.any()}


def _range(v: np.ndarray) -> tuple[float, float, float, bool]:
    """(min, max, max |v|) over the finite values, and whether every value is finite.  A zero bound is +0:
    which of -0 and +0 a minimum returns depends on the order it looks at them, which routes do not share."""
    if v.size == 0:
        return float("nan"), float("nan"), float("nan"), True
    with np.errstate(invalid="ignore"):
        mn, mx = float(v.min()), float(v.max())  # NaN/inf propagate: finite results mean all values are
    if np.isfinite(mn) and np.isfinite(mx):
        return mn + 0.0, mx + 0.0, max(abs(mn), abs(mx)), True
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        return float("nan"), float("nan"), float("nan"), False
    mn, mx = float(finite.min()), float(finite.max())
    return mn + 0.0, mx + 0.0, max(abs(mn), abs(mx)), False


def _subnormals(flat: np.ndarray, tiny: float) -> np.ndarray:
    """Per row, the nonzero values below ``tiny`` in magnitude (NaN is not one)."""
    small = np.abs(flat) < tiny  # zeros included
    if not small.any():
        return np.zeros(flat.shape[0], dtype=np.int64)
    idx = np.flatnonzero(small)  # usually few: look only at those
    nonzero = flat.reshape(-1)[idx] != 0
    return np.bincount(idx[nonzero] // flat.shape[1], minlength=flat.shape[0]).astype(np.int64)


@dataclass
class Trace:
    """Stages in the order the kernel computed them, plus the run's metadata.

    ``keep_arrays=False`` keeps only counters and ranges (for large tensors); ``counted=False`` records no
    stage at all (a run whose outputs alone are read: the metadata stays).
    """

    channels: int
    keep_arrays: bool = True
    meta: dict[str, Any] = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    counted: bool = True

    def record(self, name: str, value: np.ndarray, fmt: str | Format, *, wide: np.ndarray | None = None,
               tally: Tally | None = None, check_negative: bool = False) -> None:
        """Add a stage; counters are computed here from the stored and wide values."""
        if not self.counted:
            return
        fmt = get_format(fmt)
        value = as_carrier(value)  # float32 carriers are read as they are (see numerics/arith.py)
        c = self.channels
        flat = value.reshape(c, -1)
        counts: dict[str, np.ndarray] = {}
        zeros = np.zeros(c, dtype=np.int64)
        vmin, vmax, absmax, all_finite = _range(flat)
        with np.errstate(invalid="ignore"):
            if all_finite:
                counts["nan"], counts["posinf"], counts["neginf"] = zeros, zeros.copy(), zeros.copy()
            else:
                counts["nan"] = np.isnan(flat).sum(axis=1)
                counts["posinf"] = np.isposinf(flat).sum(axis=1)
                counts["neginf"] = np.isneginf(flat).sum(axis=1)
            for k in TALLY_FIELDS:
                counts[k] = tally.counts[k].copy() if tally is not None else zeros.copy()
            counts["subnormal"] = _subnormals(flat, fmt.tiny)
            if check_negative:
                src = flat if wide is None else np.asarray(wide, dtype=np.float64).reshape(c, -1)
                counts["negative"] = (src < 0).sum(axis=1)
            else:
                counts["negative"] = np.zeros(c, dtype=np.int64)
        keep = self.keep_arrays
        self.stages.append(Stage(
            name=name, format=fmt.name, value=value if keep else None,
            wide=(np.asarray(wide, dtype=np.float64) if wide is not None and keep else None),
            counters=counts, elementwise=value.ndim > 1, size=value.size,
            vmin=vmin, vmax=vmax, absmax=absmax))

    def record_counts(self, name: str, fmt: str | Format, counts: np.ndarray, ranges: np.ndarray, size: int,
                      at: int | None = None) -> None:
        """Add an elementwise stage whose counters were counted where it was computed (the compiled route):
        ``counts`` is ``(C, 8)`` in COUNTERS' order without ``negative``, ``ranges`` ``(C, 2)`` the least and
        greatest finite value of each channel (+inf / -inf where it has none).  ``at`` inserts it before
        the stage at that index instead of appending it."""
        if not self.counted:
            return
        if self.keep_arrays:
            raise AssertionError("a stage counted elsewhere has no arrays to keep")
        c = self.channels
        counters = {k: np.ascontiguousarray(counts[:, i]) for i, k in enumerate(COUNTERS[:-1])}
        counters["negative"] = np.zeros(c, dtype=np.int64)
        lo, hi = float(ranges[:, 0].min()) + 0.0, float(ranges[:, 1].max()) + 0.0  # a zero bound is +0 (_range)
        if not np.isfinite(lo):  # no finite value anywhere
            lo = hi = float("nan")
        stage = Stage(name=name, format=get_format(fmt).name, value=None, wide=None, counters=counters,
                      elementwise=True, size=size, vmin=lo, vmax=hi, absmax=max(abs(lo), abs(hi)))
        self.stages.insert(len(self.stages) if at is None else at, stage)

    @classmethod
    def concat(cls, parts: list[Trace], meta: dict[str, Any] | None = None) -> Trace:
        """Join traces of consecutive channel blocks of one run into one trace over all channels."""
        if len(parts) == 1:
            if meta:
                parts[0].meta.update(meta)
            return parts[0]
        first = parts[0]
        out = cls(sum(p.channels for p in parts), first.keep_arrays, {**first.meta, **(meta or {})},
                  counted=first.counted)
        for i, s in enumerate(first.stages):
            group = [p.stages[i] for p in parts]
            if any(g.name != s.name for g in group):
                raise AssertionError("channel blocks recorded different stages")

            def cat(arrays: list[np.ndarray | None]) -> np.ndarray | None:
                return None if any(a is None for a in arrays) else np.concatenate(arrays, axis=0)

            finite = [g for g in group if not np.isnan(g.vmin)]
            out.stages.append(Stage(
                name=s.name, format=s.format, value=cat([g.value for g in group]),
                wide=cat([g.wide for g in group]),
                counters={k: np.concatenate([g.counters[k] for g in group]) for k in s.counters},
                elementwise=s.elementwise, size=sum(g.size for g in group),
                vmin=min((g.vmin for g in finite), default=float("nan")),
                vmax=max((g.vmax for g in finite), default=float("nan")),
                absmax=max((g.absmax for g in finite), default=float("nan"))))
        return out

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def __getitem__(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise BNProbeError(f"no stage {name!r} in this trace; stages: {', '.join(self.names())}")

    def __iter__(self):
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def first(self, counter: str) -> Stage | None:
        """The first stage whose ``counter`` is nonzero."""
        for s in self.stages:
            if s.counters[counter].any():
                return s
        return None

    def to_frame(self) -> pd.DataFrame:
        """One row per stage: format, size, range and every counter summed over channels."""
        import pandas as pd

        rows = []
        for i, s in enumerate(self.stages):
            row: dict[str, Any] = {"order": i, "stage": s.name, "format": s.format,
                                   "kind": "element" if s.elementwise else "channel", "size": s.size,
                                   "min": s.vmin, "max": s.vmax, "absmax": s.absmax}
            row.update({k: int(v.sum()) for k, v in s.counters.items()})
            rows.append(row)
        return pd.DataFrame(rows)

    def channel_frame(self) -> pd.DataFrame:
        """One row per (stage, channel) with every counter."""
        import pandas as pd

        rows = []
        for s in self.stages:
            for ch in range(self.channels):
                row: dict[str, Any] = {"stage": s.name, "channel": ch}
                row.update({k: int(v[ch]) for k, v in s.counters.items()})
                rows.append(row)
        return pd.DataFrame(rows)

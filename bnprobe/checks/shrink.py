"""bnprobe shrink: reduce a failing BatchNorm case to a minimal one that still fails.

Channels first (they are independent in BatchNorm, so bisection keeps a failing half), then the
batch, then each spatial axis, then the values: the coarsest rounding (fewest significant bits)
that still fails, then element by element toward the channel's mean.  Deterministic, bounded in
time.  The result is written as ``x.npy``, a bnprobe dump of the adapter on it, and the exact
command that replays the failure.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe._loading import load_callable
from bnprobe.adapters import get_adapter
from bnprobe.errors import BNProbeError

__all__ = ["ShrinkResult", "shrink", "compare_predicate", "overflow_predicate", "load_predicate", "write_shrink"]

Predicate = Callable[[np.ndarray], bool]


def compare_predicate(adapter: str, against: str = "reference", dtype: str = "fp16", mode: str = "train") -> Predicate:
    """Fails when compare-precision finds an output of ``adapter`` over the standard on x."""
    from bnprobe.checks.compare import Case, compare_precision

    if against != "reference":
        raise BNProbeError("shrink compares against the FP64 reference (--against reference)")
    a = get_adapter(adapter)

    def fails(x: np.ndarray) -> bool:
        if mode != "infer" and x.size // x.shape[1] < 2:
            return False
        r = compare_precision([a], (dtype,), [Case("shrink", tuple(x.shape), x=x)], mode=mode, budget=False)
        return bool((r.rows["verdict"] == "FAIL").any())

    return fails


def overflow_predicate(adapter: str, dtype: str = "fp16", mode: str = "train") -> Predicate:
    """Fails when the overflow scan finds an anomaly (input-borne ones excluded)."""
    from bnprobe.checks.overflow import scan

    def fails(x: np.ndarray) -> bool:
        if mode != "infer" and x.size // x.shape[1] < 2:
            return False
        rep = scan(adapter, x, dtype=dtype, mode=mode, remedies=False)
        return any(not f.input_borne for f in rep.findings)

    return fails


def load_predicate(spec: str) -> Predicate:
    if ":" not in spec:
        raise BNProbeError(f"--predicate takes compare, overflow or module:function, got {spec!r}")
    return load_callable(spec, "predicate")


@dataclass
class ShrinkResult:
    x: np.ndarray
    original_shape: tuple[int, ...]
    steps: list[str] = field(default_factory=list)
    evaluations: int = 0
    seconds: float = 0.0
    timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.x.shape), "elements": int(self.x.size), "original_shape": list(self.original_shape),
                "steps": self.steps, "evaluations": self.evaluations, "seconds": round(self.seconds, 3),
                "timed_out": self.timed_out, "x": self.x.tolist()}


def shrink(x: np.ndarray, fails: Predicate, *, seconds: float = 120.0,
           progress: Callable[[str], None] | None = None) -> ShrinkResult:
    """The smallest input found that still fails ``fails`` (which must fail on ``x``)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim < 2:
        raise BNProbeError(f"x must have 2 to 5 dimensions, got shape {x.shape}")
    res = ShrinkResult(x, tuple(x.shape))
    t0 = time.monotonic()

    def test(candidate: np.ndarray) -> bool:
        res.evaluations += 1
        return bool(fails(np.ascontiguousarray(candidate)))

    if not test(x):
        raise BNProbeError("the check passes on this input: nothing to shrink")

    def out_of_time() -> bool:
        res.timed_out = time.monotonic() - t0 > seconds
        return res.timed_out

    def bisect(axis: int, label: str) -> None:
        nonlocal x
        while x.shape[axis] > 1 and not out_of_time():
            h = x.shape[axis] // 2
            lo, hi = np.take(x, range(h), axis=axis), np.take(x, range(h, x.shape[axis]), axis=axis)
            if test(lo):
                x = lo
            elif test(hi):
                x = hi
            else:
                break
            res.steps.append(f"{label} -> {x.shape[axis]}: shape {x.shape}")
            if progress:
                progress(res.steps[-1])

    bisect(1, "channels")
    bisect(0, "batch")
    for ax in range(2, x.ndim):
        bisect(ax, f"axis {ax}")
    # values: the coarsest rounding that still fails, then element by element toward the channel mean
    for bits in range(1, 24):
        if out_of_time():
            break
        cand = _round_bits(x, bits)
        if not np.array_equal(cand, x) and test(cand):
            x = cand
            res.steps.append(f"values rounded to {bits} significant bit(s)")
            break
    flat_idx = list(np.ndindex(*x.shape))
    if len(flat_idx) <= 256:
        for idx in flat_idx:
            if out_of_time():
                break
            channel = np.moveaxis(x, 1, 0)[idx[1]]
            target = float(_round_bits(np.array([channel.mean()]), 4)[0])
            for value in (0.0, target):
                if x[idx] == value:
                    continue
                cand = x.copy()
                cand[idx] = value
                if test(cand):
                    x = cand
                    res.steps.append(f"x{idx} -> {value:g}")
                    break
    res.x = x
    res.seconds = time.monotonic() - t0
    return res


def _round_bits(x: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e)


def write_shrink(result: ShrinkResult, out: str | Path, *, adapter: str, dtype: str, mode: str,
                 predicate: str = "compare") -> tuple[list[Path], str]:
    """x.npy, a bnprobe dump of the adapter on it, shrink.json, and the command that replays the failure."""
    from bnprobe.adapters.dump import record, write_dump
    from bnprobe.reports import atomic_write_bytes, atomic_write_text, check_targets, dumps_json

    out = Path(out)
    xpath, jpath = out / "x.npy", out / "shrink.json"
    check_targets([xpath, jpath], force=False)
    import io

    buf = io.BytesIO()
    np.save(buf, result.x)
    atomic_write_bytes(xpath, buf.getvalue())
    c = result.x.shape[1]
    files = [xpath]
    try:
        rec = record(get_adapter(adapter), x=result.x, gamma=None, beta=None, running_mean=np.zeros(c),
                     running_var=np.ones(c), dy=np.ones_like(result.x), dtype=dtype,
                     modes=("train", "infer") if result.x.size // c < 2 else ("train", "infer", "backward"),
                     meta={"shrunk_from": list(result.original_shape)})
        files += write_dump(rec, out / "dump")
    except BNProbeError as exc:  # the dump is a convenience; the replay command is what matters
        result.steps.append(f"no dump written: {exc}")
    if predicate == "overflow":
        cmd = f"bnprobe overflow --adapter {shlex.quote(adapter)} --dtype {dtype} --mode {mode} --input {xpath}"
    else:
        cmd = (f"bnprobe compare-precision --adapters {shlex.quote(adapter)} --dtypes {dtype} --mode {mode} "
               f"--input {xpath} --no-budget --out {out / 'replay-report'}")
    atomic_write_text(jpath, dumps_json({**result.to_dict(), "adapter": adapter, "dtype": dtype, "mode": mode,
                                         "predicate": predicate, "replay": cmd}))
    files.append(jpath)
    return files, cmd

"""ULP analysis of rsqrt / reciprocal / sqrt / divide methods against correctly rounded references.

Domains
-------
``exhaustive``: every positive finite input of the format (fp16/bf16: ~32k values;
fp32: 2**31 - 2**23 values, processed in chunks).
``reduced`` (fp32): every input of one period [1, 4), every subnormal input, the two
lowest and two highest normal binades, plus random inputs over the whole range as
a confirmation.  Why this covers everything: for x' = 4**k * x, the bit-trick
seed gives exactly y0' = 2**-k * y0 (the shift moves 2k exponent steps into k),
the table estimates index only the significand and the exponent's parity, and
every Newton operation scales by an exact power of two, so each rounding sees
the same significands.  Hence the error in ULPs (and relatively) is identical
for all inputs whose estimate, iterates and intermediates stay normal and
finite; the excluded binades are the ones where that can fail, and they are
checked exhaustively.  The sampled confirmation must not exceed the reduced
maximum; the result says so.  (The reciprocal's period is one binade; [1, 4)
covers it twice.)
``samples``: N seeded random bit patterns over the positive finite range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import Format, get_format
from bnprobe.engine.result import Analysis
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.rsqrt import (
    MAGIC_RECIP,
    MAGIC_RSQRT,
    NEWTON_FORMS,
    RECIP_ESTIMATES,
    RSQRT_ESTIMATES,
    Working,
    divide,
    reciprocal,
    rsqrt,
    rsqrt_exact,
    sqrt,
)

__all__ = ["OPS", "MathSpec", "StepResult", "MathAnalysis", "analyze", "HIST_EDGES", "METHODS", "MAX_SAMPLES",
           "MAX_NEWTON"]

OPS: tuple[str, ...] = ("rsqrt", "reciprocal", "sqrt", "divide")
# ULP-error histogram bins: [0, 0.5], (0.5, 1], (1, 2], (2, 4] ... (2**20, inf)
HIST_EDGES: tuple[float, ...] = (0.0, 0.5, 1.0) + tuple(2.0**k for k in range(1, 21)) + (np.inf,)
CHUNK = 1 << 22
# the methods of each operation (divide: the reciprocal estimate of a * recip(b))
METHODS: dict[str, tuple[str, ...]] = {"rsqrt": RSQRT_ESTIMATES, "reciprocal": RECIP_ESTIMATES,
                                       "divide": RECIP_ESTIMATES, "sqrt": ("exact", "exp_log", *RSQRT_ESTIMATES[1:])}
MAX_SAMPLES = 1 << 26  # random inputs (or pairs): 2**26 float64 values are 0.5 GiB per array
MAX_NEWTON = 8  # Newton / Heron steps: each doubles the correct bits; 8 is past any format's precision


@dataclass(frozen=True)
class MathSpec:
    """One method of one operation in one format."""

    op: str = "rsqrt"
    format: str = "fp32"
    method: str = "magic"
    constant: int | None = None
    bits: int = 12
    form: str = "standard"
    subnormals: str = "keep"
    working: str | None = None  # Newton steps' format; None = the format itself
    heron: int = 3  # sqrt exp_log

    # for op="divide", method names the reciprocal estimate of a * recip(b); "exact" divides

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise BNProbeError(f"unknown op {self.op!r}; valid: {', '.join(OPS)}")
        try:
            fmt = get_format(self.format)
        except BNProbeError:  # the general message lists formats this analysis refuses
            fmt = None
        if fmt is None or fmt.name not in ("fp32", "fp16", "bf16"):
            raise BNProbeError(f"rsqrt analysis supports fp32, fp16 and bf16 (or float32, float16, bfloat16), not "
                               f"{self.format!r}")
        object.__setattr__(self, "format", fmt.name)
        if self.working is not None:
            object.__setattr__(self, "working", get_format(self.working).name)
        if self.method not in METHODS[self.op]:
            raise BNProbeError(f"unknown {self.op} method {self.method!r}; valid: {', '.join(METHODS[self.op])}")
        if self.form not in NEWTON_FORMS:
            raise BNProbeError(f"unknown Newton form {self.form!r}; valid: {', '.join(NEWTON_FORMS)}")
        if self.subnormals not in ("keep", "zero"):
            raise BNProbeError(f"subnormals must be 'keep' or 'zero', got {self.subnormals!r}")
        if self.constant is not None and self.method != "magic":
            raise BNProbeError(f"a constant is the magic method's; the {self.method} method takes none")
        if self.method == "magic" and self.constant is None:
            table = MAGIC_RECIP if self.op in ("reciprocal", "divide") else MAGIC_RSQRT
            object.__setattr__(self, "constant", table[fmt.name])
        if self.method == "magic":
            # the seed is a value of the format: a positive finite bit pattern (0 and the inf/NaN patterns are not)
            top = _bit_of(fmt.max, fmt)
            c = self.constant
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 1 <= c <= top:
                shown = f"{c:#x}" if isinstance(c, (int, np.integer)) and not isinstance(c, bool) else repr(c)
                raise BNProbeError(f"magic constant {shown} is not a positive finite {fmt.name} bit pattern: it must "
                                   f"be in 0x1..{top:#x}")
        if self.method == "table" and not (isinstance(self.bits, (int, np.integer))
                                           and 1 <= self.bits <= fmt.mantissa_bits):
            raise BNProbeError(f"table bits must be an integer in 1..{fmt.mantissa_bits} for {fmt.name}, got "
                               f"{self.bits!r}")

    @property
    def rounds_result(self) -> bool:
        return self.working is None or self.working == self.format

    def label(self) -> str:
        extra = {"magic": f" C={hex(self.constant)}" if self.constant is not None else "",
                 "table": f" k={self.bits}"}.get(self.method, "")
        return f"{self.op} {self.format} {self.method}{extra}"

    def compute(self, x: np.ndarray, newton: int) -> np.ndarray:
        fmt = self.format
        if self.op == "rsqrt":
            return rsqrt(x, fmt, method=self.method, newton=newton, form=self.form, constant=self.constant,
                         bits=self.bits, subnormals=self.subnormals, working=Working(self.working, self.rounds_result))
        if self.op == "reciprocal":
            return reciprocal(x, fmt, method=self.method, newton=newton, form=self.form, constant=self.constant,
                              bits=self.bits, subnormals=self.subnormals,
                              working=Working(self.working, self.rounds_result))
        if self.op == "sqrt":
            if self.method in ("exact", "exp_log"):
                return sqrt(x, fmt, method=self.method, heron=newton if self.method == "exp_log" else 0)
            return sqrt(x, fmt, method="rsqrt", rsqrt_method=self.method, newton=newton, form=self.form,
                        constant=self.constant, bits=self.bits)
        # divide: 1/x as a / b with a = 1 exercises the reciprocal path; a is drawn separately below
        raise AssertionError("divide is computed by _divide_pairs")

    def reference(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(correctly rounded result, float64 value of the exact result) for each x."""
        with np.errstate(all="ignore"):
            if self.op == "rsqrt":
                return rsqrt_exact(x, self.format), 1.0 / np.sqrt(x)
            if self.op == "reciprocal":
                return Arith(self.format).div(np.ones_like(x), x), 1.0 / x
            return Arith(self.format).sqrt(x), np.sqrt(x)


@dataclass
class _Acc:
    """Streaming statistics of one Newton step over chunks."""

    n: int = 0
    max_ulp: float = 0.0
    sum_ulp: float = 0.0
    max_rel: float = 0.0
    max_ulp_normal: float = 0.0  # over normal inputs only
    max_rel_normal: float = 0.0
    n_normal: int = 0
    sum_ulp_normal: float = 0.0
    correct: int = 0
    nonfinite: int = 0  # non-finite results
    nonfinite_mismatch: int = 0  # of which the correctly rounded result differs
    hist: np.ndarray = field(default_factory=lambda: np.zeros(len(HIST_EDGES) - 1, dtype=np.int64))
    worst: list[tuple[float, float, float, float]] = field(default_factory=list)  # (ulp, x, got, exact), normal x
    worst_subnormal: list[tuple[float, float, float, float]] = field(default_factory=list)

    def update(self, x: np.ndarray, got: np.ndarray, correct: np.ndarray, exact: np.ndarray, fmt: Format,
               keep_worst: int) -> None:
        with np.errstate(all="ignore"):
            same = (got == correct) | (np.isnan(got) & np.isnan(correct))
            # a non-finite result the correctly rounded one does not share (it is finite, or another non-finite
            # value) is the method's defect, an infinite error; one it shares is the format's overflow
            wrong = ~np.isfinite(got) & ~same
            self.nonfinite += int(np.sum(~np.isfinite(got)))
            self.nonfinite_mismatch += int(np.sum(wrong))
            finite = np.isfinite(got) & np.isfinite(exact)
            pick = finite | wrong
            g, e, xx = got[pick], exact[pick], x[pick]
            ulp = np.where(wrong[pick], np.inf, np.abs(g - e) / fmt.ulp(e))
            rel = np.where(wrong[pick], np.inf, np.abs(g - e) / np.abs(e))
            normal = np.abs(xx) >= fmt.tiny
        self.n += int(x.size)
        self.correct += int(np.sum((got == correct) | (np.isnan(got) & np.isnan(correct))))
        if ulp.size:
            self.max_ulp = max(self.max_ulp, float(ulp.max()))
            self.sum_ulp += float(ulp.sum())
            self.max_rel = max(self.max_rel, float(rel.max()))
            if normal.any():
                self.max_ulp_normal = max(self.max_ulp_normal, float(ulp[normal].max()))
                self.max_rel_normal = max(self.max_rel_normal, float(rel[normal].max()))
                self.n_normal += int(normal.sum())
                self.sum_ulp_normal += float(ulp[normal].sum())
            self.hist += np.histogram(ulp, bins=np.array(HIST_EDGES))[0]
            self.worst = _top(self.worst, ulp[normal], xx[normal], g[normal], e[normal], keep_worst)
            self.worst_subnormal = _top(self.worst_subnormal, ulp[~normal], xx[~normal], g[~normal], e[~normal],
                                        keep_worst)


def _top(current: list[tuple[float, float, float, float]], ulp: np.ndarray, x: np.ndarray, got: np.ndarray,
         exact: np.ndarray, keep: int) -> list[tuple[float, float, float, float]]:
    if ulp.size == 0 or keep <= 0:
        return current
    k = min(keep, ulp.size)
    idx = np.argpartition(-ulp, k - 1)[:k]
    return sorted(current + [(float(ulp[i]), float(x[i]), float(got[i]), float(exact[i])) for i in idx],
                  reverse=True)[:keep]


@dataclass(frozen=True)
class StepResult:
    newton: int
    inputs: int
    max_ulp: float
    mean_ulp: float
    max_rel: float
    max_ulp_normal: float
    max_rel_normal: float
    mean_ulp_normal: float
    correctly_rounded: float  # fraction of inputs whose result equals the correctly rounded one (NaN if unrounded)
    nonfinite: int  # results that are ±inf or NaN
    nonfinite_mismatch: int  # of which the correctly rounded result is finite or another value: infinite errors
    histogram: dict[str, int]
    worst: list[dict[str, float]]  # normal inputs
    worst_subnormal: list[dict[str, float]]
    confirmation_max_ulp: float | None = None  # reduced domain: the sampled full-range maximum

    def row(self) -> dict[str, Any]:
        return {"newton": self.newton, "inputs": self.inputs, "max_ulp": self.max_ulp, "mean_ulp": self.mean_ulp,
                "max_rel": self.max_rel, "max_ulp_normal": self.max_ulp_normal,
                "max_rel_normal": self.max_rel_normal, "mean_ulp_normal": self.mean_ulp_normal,
                "correctly_rounded": self.correctly_rounded, "nonfinite": self.nonfinite,
                "nonfinite_mismatch": self.nonfinite_mismatch, "confirmation_max_ulp": self.confirmation_max_ulp}


@dataclass(frozen=True)
class MathAnalysis(Analysis):
    """The rsqrt command's result: one :class:`StepResult` per Newton step count, the error curve and the notes.
    An analysis, not a check: it has no verdict of its own (``Verdict.NONE``) and passes (rsqrt exits 0)."""

    spec: MathSpec
    domain: str
    steps: list[StepResult]
    curve: dict[str, np.ndarray]  # x over two binades and the signed relative error per step (envelope)
    notes: list[str]

    @property
    def frame(self):  # -> pandas.DataFrame
        """One row per Newton step count (:meth:`to_frame`)."""
        return self.to_frame()

    def rows(self) -> list[dict[str, Any]]:
        return [{"op": self.spec.op, "format": self.spec.format, "method": self.spec.method,
                 "label": self.spec.label(), "domain": self.domain, **s.row()} for s in self.steps]

    def to_frame(self):  # -> pandas.DataFrame
        import pandas as pd

        return pd.DataFrame(self.rows())

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.__dict__, "domain": self.domain, "notes": self.notes,
                "steps": [{**s.row(), "histogram": s.histogram, "worst": s.worst,
                           "worst_subnormal": s.worst_subnormal} for s in self.steps]}


def _rows(worst: list[tuple[float, float, float, float]]) -> list[dict[str, float]]:
    return [{"x": w[1], "result": w[2], "exact": w[3], "ulp": w[0]} for w in worst]


def _step(n: int, a: _Acc, rounded: bool, labels: list[str], confirmation: float | None) -> StepResult:
    return StepResult(
        newton=n, inputs=a.n, max_ulp=a.max_ulp, mean_ulp=a.sum_ulp / max(a.n, 1), max_rel=a.max_rel,
        max_ulp_normal=a.max_ulp_normal, max_rel_normal=a.max_rel_normal,
        mean_ulp_normal=a.sum_ulp_normal / max(a.n_normal, 1),
        correctly_rounded=a.correct / max(a.n, 1) if rounded else float("nan"),
        nonfinite=a.nonfinite, nonfinite_mismatch=a.nonfinite_mismatch,
        histogram={lab: int(c) for lab, c in zip(labels, a.hist) if c},
        worst=_rows(a.worst), worst_subnormal=_rows(a.worst_subnormal), confirmation_max_ulp=confirmation)


def _positive_bits(fmt: Format) -> tuple[int, int]:
    """First and one-past-last bit pattern of the positive finite values (subnormals included)."""
    return 1, int(np.array([np.inf], dtype=fmt.dtype).view(np.uint16 if fmt.itemsize == 2 else np.uint32)[0])


def _values(bits: np.ndarray, fmt: Format) -> np.ndarray:
    ut = np.uint16 if fmt.itemsize == 2 else np.uint32
    with np.errstate(invalid="ignore"):
        return bits.astype(ut).view(fmt.dtype).astype(np.float64)


def _bit_of(v: float, fmt: Format) -> int:
    return int(np.array([v], dtype=fmt.dtype).view(np.uint16 if fmt.itemsize == 2 else np.uint32)[0])


def _ranges(fmt: Format, domain: str) -> list[tuple[int, int]]:
    lo, hi = _positive_bits(fmt)
    if domain == "exhaustive":
        return [(lo, hi)]
    # reduced: [1, 4), subnormals, two lowest and two highest normal binades
    return [(_bit_of(1.0, fmt), _bit_of(4.0, fmt)), (lo, _bit_of(fmt.tiny, fmt)),
            (_bit_of(fmt.tiny, fmt), _bit_of(fmt.tiny * 4, fmt)), (_bit_of(2.0 ** (fmt.emax - 1), fmt), hi)]


def _check_args(fmt: Format, domain: str, newton: tuple[int, ...], samples: int,
                seed: int) -> tuple[str, tuple[int, ...]]:
    """The domain (``auto`` resolved for ``fmt``) and the Newton step counts, after refusing invalid arguments."""
    if domain == "auto":
        domain = "exhaustive" if fmt.itemsize == 2 else "reduced"
    if domain not in ("exhaustive", "reduced", "samples"):
        raise BNProbeError(f"unknown domain {domain!r}; valid: auto, exhaustive, reduced, samples")
    newton = tuple(newton)
    if not newton or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_NEWTON
                         for n in newton) or len(set(newton)) != len(newton):
        raise BNProbeError(f"newton steps must be distinct integers from 0 to {MAX_NEWTON}, got {list(newton)}")
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or not 1 <= samples <= MAX_SAMPLES:
        raise BNProbeError(f"samples must be an integer from 1 to {MAX_SAMPLES} (2**26), got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise BNProbeError(f"seed must be an integer >= 0, got {seed!r}")
    return domain, newton


@dataclass(frozen=True)
class _Feed:
    """Runs ``spec`` after each number of Newton steps on bit patterns of its format, into per-step accumulators
    (and, asked to, into the error curve)."""

    spec: MathSpec
    fmt: Format
    newton: tuple[int, ...]
    worst: int  # worst inputs each accumulator keeps
    curve: _Curve

    def __call__(self, bits: np.ndarray, target: dict[int, _Acc], fold_curve: bool = False) -> None:
        """Every step count's results on the inputs ``bits`` into ``target``, folded into the curve if asked."""
        x = _values(bits, self.fmt)
        correct, exact = self.spec.reference(x)
        for n in self.newton:
            got = self.spec.compute(x, n)
            target[n].update(x, got, correct, exact, self.fmt, self.worst)
            if fold_curve:
                self.curve.fold(bits, got, exact, n)

    def accumulators(self) -> dict[int, _Acc]:
        """A fresh accumulator per Newton step count."""
        return {n: _Acc() for n in self.newton}


def _sweep_samples(feed: _Feed, accs: dict[int, _Acc], samples: int, rng: np.random.Generator,
                   progress: Callable[[int, int], None] | None) -> None:
    """``samples`` random positive finite inputs in chunks; the curve from every 2**s-th input of [1, 4)."""
    lo, hi = _positive_bits(feed.fmt)
    done = 0
    for i in range(0, samples, CHUNK):
        c = rng.integers(lo, hi, size=min(CHUNK, samples - i))
        feed(c, accs)
        done += c.size
        if progress:
            progress(done, samples)
    # s chosen for about 2**18 points of the curve
    curve = feed.curve
    stride = max(1, (curve.stop - curve.start) >> 18)
    feed(np.arange(curve.start, curve.stop, stride, dtype=np.int64), feed.accumulators(), True)


def _sweep_ranges(feed: _Feed, accs: dict[int, _Acc], domain: str,
                  progress: Callable[[int, int], None] | None) -> None:
    """Every input of the domain's bit-pattern ranges in chunks, those of [1, 4) into the curve too."""
    ranges = _ranges(feed.fmt, domain)
    total = sum(b - a for a, b in ranges)
    done = 0
    curve = feed.curve
    for a, b in ranges:
        for start in range(a, b, CHUNK):
            stop = min(b, start + CHUNK)
            chunk = np.arange(start, stop, dtype=np.int64)
            in_curve = (chunk >= curve.start) & (chunk < curve.stop)
            if in_curve.all():
                feed(chunk, accs, True)
            elif in_curve.any():
                feed(chunk[in_curve], accs, True)
                feed(chunk[~in_curve], accs)
            else:
                feed(chunk, accs)
            done += stop - start
            if progress:
                progress(done, total)


def _confirm_reduced(feed: _Feed, accs: dict[int, _Acc], samples: int,
                     rng: np.random.Generator) -> tuple[dict[int, _Acc], list[str]]:
    """The reduced domain's confirmation: ``samples`` random inputs over the full range, and notes saying whether
    they stay within the reduced domain's maximum."""
    lo, hi = _positive_bits(feed.fmt)
    confirm = feed.accumulators()
    feed(rng.integers(lo, hi, size=samples), confirm)
    notes = []
    for n in feed.newton:
        if confirm[n].max_ulp > accs[n].max_ulp or confirm[n].max_ulp_normal > accs[n].max_ulp_normal:
            notes.append(f"newton={n}: the full-range sample found {confirm[n].max_ulp:.4g} ulp, more than "
                         f"the reduced domain's {accs[n].max_ulp:.4g}: the reduction does not hold here")
    if not notes:
        notes.append(f"reduced domain confirmed: {samples} random inputs over the full range stay within "
                     "the reduced domain's maximum")
    return confirm, notes


def _hist_labels() -> list[str]:
    """The ULP-error histogram's bin labels, one per bin of :data:`HIST_EDGES`."""
    return ["[0, 0.5]", "(0.5, 1]"] + [f"({HIST_EDGES[i]:g}, {HIST_EDGES[i + 1]:g}]"
                                       for i in range(2, len(HIST_EDGES) - 1)]


def analyze(
    spec: MathSpec,
    newton: tuple[int, ...] = (0, 1, 2),
    *,
    domain: str = "auto",
    samples: int = 1 << 20,
    seed: int = 0,
    worst: int = 10,
    progress: Callable[[int, int], None] | None = None,
) -> MathAnalysis:
    """Errors of ``spec`` after each number of Newton steps, in ULPs of the format and relatively.

    domain: ``exhaustive`` | ``reduced`` | ``samples`` | ``auto`` (exhaustive for fp16/bf16,
    reduced for fp32).  ``progress(done, total)`` is called after each chunk.
    """
    fmt = get_format(spec.format)
    if spec.op == "divide" and (spec.subnormals != "keep" or spec.working is not None or domain == "exhaustive"):
        raise BNProbeError(f"divide is analysed on random pairs in its own format: {named('subnormals')} zero, "
                           f"{named('working')} and {named('exhaustive')} do not apply; drop them")
    domain, newton = _check_args(fmt, domain, newton, samples, seed)
    if spec.method == "exact":
        newton = (0,)
    rng = np.random.default_rng(seed)
    if spec.op == "divide":
        return _analyze_divide(spec, newton, samples, rng, worst)
    feed = _Feed(spec, fmt, newton, worst, _Curve(fmt, newton))
    accs = feed.accumulators()
    if domain == "samples":
        _sweep_samples(feed, accs, samples, rng, progress)
    else:
        _sweep_ranges(feed, accs, domain, progress)
    confirm, notes = _confirm_reduced(feed, accs, samples, rng) if domain == "reduced" else (None, [])
    if not spec.rounds_result:
        notes.append(f"Newton steps in {spec.working}, result not rounded to {spec.format}; ULPs are "
                     f"{spec.format} ULPs")
    labels = _hist_labels()
    steps = [_step(n, accs[n], spec.rounds_result, labels, None if confirm is None else confirm[n].max_ulp_normal)
             for n in newton]
    return MathAnalysis(spec, domain, steps, feed.curve.result(), notes + _nonfinite_notes(spec, steps))


def _nonfinite_notes(spec: MathSpec, steps: list[StepResult]) -> list[str]:
    """What the non-finite results are: the format's own overflow, or the method's defects."""
    notes = []
    for s in steps:
        if s.nonfinite > s.nonfinite_mismatch:
            notes.append(f"newton={s.newton}: {s.nonfinite - s.nonfinite_mismatch} of {s.inputs} results are inf as "
                         f"the correctly rounded ones are (the exact value is beyond {spec.format}'s range): the "
                         "format's overflow, not the method's")
        if s.nonfinite_mismatch:
            notes.append(f"newton={s.newton}: {s.nonfinite_mismatch} of {s.inputs} results are inf or NaN where the "
                         "correctly rounded result is finite or another value: the method's defect, counted as an "
                         "infinite error")
    return notes


class _Curve:
    """Envelope (min and max per bin) of the signed relative error over two binades [1, 4)."""

    def __init__(self, fmt: Format, newton: tuple[int, ...], bins: int = 2048) -> None:
        self.start, self.stop = _bit_of(1.0, fmt), _bit_of(4.0, fmt)
        self.width = max(1, (self.stop - self.start) // bins)
        nb = -(-(self.stop - self.start) // self.width)
        self.x = _values(np.arange(self.start, self.stop, self.width, dtype=np.int64), fmt)
        self.lo = {n: np.full(nb, np.inf) for n in newton}
        self.hi = {n: np.full(nb, -np.inf) for n in newton}

    def fold(self, bits: np.ndarray, got: np.ndarray, exact: np.ndarray, n: int) -> None:
        with np.errstate(all="ignore"):
            rel = got / exact - 1.0
        b = (bits - self.start) // self.width
        starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
        idx = b[starts]
        np.minimum.at(self.lo[n], idx, np.minimum.reduceat(rel, starts))
        np.maximum.at(self.hi[n], idx, np.maximum.reduceat(rel, starts))

    def result(self) -> dict[str, np.ndarray]:
        seen = np.isfinite(next(iter(self.lo.values()))) if self.lo else np.zeros(0, dtype=bool)
        out = {"x": self.x[seen]}
        for n in self.lo:
            out[f"min_{n}"], out[f"max_{n}"] = self.lo[n][seen], self.hi[n][seen]
        return out


def _analyze_divide(spec: MathSpec, newton: tuple[int, ...], samples: int, rng: np.random.Generator,
                    worst: int) -> MathAnalysis:
    """a / b: exact division, or a * recip(b) with recip by ``spec.method`` and n Newton steps; sampled."""
    fmt = get_format(spec.format)
    lo, hi = _positive_bits(fmt)
    n_pairs = min(samples, 1 << 22)
    a = _values(rng.integers(_bit_of(1.0, fmt), _bit_of(2.0, fmt), size=n_pairs), fmt)
    b = _values(rng.integers(lo, hi, size=n_pairs), fmt)
    ar = Arith(fmt)
    correct = ar.div(a, b)
    with np.errstate(all="ignore"):
        exact = a / b
    accs = {n: _Acc() for n in newton}
    for n in newton:
        if spec.method == "exact":
            got = correct
        else:
            got = divide(a, b, fmt, method="reciprocal", recip_method=spec.method, newton=n,
                         form=spec.form, constant=spec.constant, bits=spec.bits)
        accs[n].update(b, got, correct, exact, fmt, worst)
    steps = [_step(n, accs[n], True, _hist_labels(), None) for n in newton]
    capped = [f"{samples} pairs asked: capped at {n_pairs}"] if n_pairs < samples else []
    return MathAnalysis(spec, "samples", steps, {}, [f"{n_pairs} random pairs a in [1, 2), b over the full range; "
                                                     "worst inputs list b", *capped, *_nonfinite_notes(spec, steps)])

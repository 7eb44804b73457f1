"""The compiled route of LayerNorm's and RMSNorm's forward and standard backward (:mod:`bnprobe.compiled.family`):
which calls take it, and the Python around its kernels.

A call takes it when ``BNPROBE_JIT`` allows it for the call's size (:func:`bnprobe.compiled.jit.jit_for`, as
BatchNorm's), its trace keeps no arrays, and its policy is one the kernels compute bit for bit: x, y, dy and dx in
fp32, fp16 or bf16, parameters in one of those, compute and accumulator fp32 with the default rounding, the
two-pass variance (LayerNorm), pairwise sums, mean_by=divide, x̂·γ + β (y_formula=xhat, no fma) rounded once
(cast_point=after_gamma), the exact rstd and the standard backward — the fp32, fp16 and bf16 presets and the
careful kernel's policy.  Every other choice runs on numpy (bnprobe.kernels.norms).

The kernels flag the rows where something rare happened (a non-finite value, an overflow, a binary32 subnormal or
underflow in an fp32 stage); those rows are computed again by the numpy route on their own (each row's statistics
and outputs are its own) and their outputs and trace counters put in place, so every output, saved statistic,
counter and range equals the numpy route's (tests/kernels/test_norms_compiled.py).  The per-row statistics between
the kernels' passes (mean, variance, rstd, the backward's coefficients) are numpy's own functions on ``(rows,)``
vectors.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.compiled.jit import KERNEL_LOCK, jit_for
from bnprobe.core.formats import get_format
from bnprobe.kernels.trace import COUNTERS, Stage, Trace
from bnprobe.numerics.arith import Tally
from bnprobe.numerics.reduce import reduce_sum
from bnprobe.numerics.rounding import RoundingSpec
from bnprobe.numerics.rsqrt import rsqrt

__all__ = ["takes_compiled", "numpy_route", "CompiledForward", "CompiledBackward", "forward_rows", "backward_rows"]

_FORMATS = ("fp32", "fp16", "bf16")
# the policy fields the route computes with their one value each (the presets' and the careful kernel's)
_FIXED = dict(compute="fp32", accumulate="fp32", order="pairwise", mean_by="divide", y_formula="xhat", fma=False,
              rsqrt="exact", backward_formula="standard", kahan=False, clamp_var=False, core_parts=1,
              cast_point="after_gamma", rstd_format=None, eps_format=None, rstd_cast=None, sum_format=None,
              threads=None, grad_sum_format=None, offset_format=None)
# the bits a 16-bit tensor is held in (compiled.fast's tags)
_BITS = {"float16": np.uint16, "bfloat16": np.int16, "float32": np.float32}
# the runs of rows the backward's dγ and dβ sums take in parallel (compiled.family.backward): a power of two,
# several per thread so that the threads finish together
_PARTS = 16
_SUBNORMAL, _UNDERFLOW = COUNTERS.index("subnormal"), COUNTERS.index("underflow")


# set within numpy_route(): the family's calls stay on numpy
_NUMPY_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("bnprobe_family_numpy_only", default=False)


@contextmanager
def numpy_route() -> Iterator[None]:
    """Within it, LayerNorm's and RMSNorm's calls take the numpy route whatever their size (the compiled route's own
    flagged rows; tests comparing the two routes)."""
    token = _NUMPY_ONLY.set(True)
    try:
        yield
    finally:
        _NUMPY_ONLY.reset(token)


def takes_compiled(pol: Any, norm: str, elements: int, r: int, keep_arrays: bool) -> bool:
    """Whether a family call of ``elements`` values in rows of ``r`` takes the compiled route (see the module notes;
    R below 2^24, which binary32 holds exactly; never within :func:`numpy_route`)."""
    if _NUMPY_ONLY.get() or keep_arrays or norm not in ("layer", "rms") or not jit_for(elements) or r >= 1 << 24:
        return False
    if any(getattr(pol, name) != value for name, value in _FIXED.items()):
        return False
    if norm == "layer" and pol.variance != "two_pass":
        return False
    if pol.storage not in _FORMATS or pol.params_format not in _FORMATS or \
            (pol.saved_format is not None and pol.saved_format not in _FORMATS + ("fp64",)):
        return False
    return pol.spec == RoundingSpec() and pol.output_spec == RoundingSpec()


@functools.cache
def _kernels() -> Any:
    from bnprobe.compiled import family

    return family


@functools.cache
def _fp16_table() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _call(name: str, *args: Any) -> Any:
    with KERNEL_LOCK:
        return getattr(_kernels(), name)(*args)


def _stored(a: Any, fmt: str, rows: int, r: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A caller's tensor as ``(rows, R)`` values of format ``fmt`` in its dtype and as the bits the kernels read;
    None where it holds a value the format does not (the numpy route rounds it, counting what happens)."""
    dt = get_format(fmt).dtype
    a = np.asarray(a)
    if a.dtype != dt:
        with np.errstate(all="ignore"):
            held = a.astype(dt)
            if not np.array_equal(held.astype(np.float64), a, equal_nan=True):
                return None
        a = held
    a = np.ascontiguousarray(a).reshape(rows, r)
    return a, a.view(_BITS[np.dtype(dt).name])


def _least(g: np.ndarray) -> np.float32:
    """γ's least nonzero finite magnitude (1 where it has none), for the kernels' bound on small values."""
    a = np.abs(g[np.isfinite(g) & (g != 0)])
    return np.float32(a.min() if a.size else 1.0)


def _counts(cnt: np.ndarray) -> np.ndarray:
    """A kernel's per-row (subnormal, underflow) counts as the rows of Trace.record_counts' counters."""
    out = np.zeros((cnt.shape[0], len(COUNTERS) - 1), dtype=np.int64)
    out[:, _SUBNORMAL], out[:, _UNDERFLOW] = cnt[:, 0], cnt[:, 1]
    return out


class _Recorder:
    """The stages of the rows no kernel flagged (``ok``), recorded in the numpy route's order."""

    def __init__(self, ok: np.ndarray, r: int, counted: bool) -> None:
        self.ok, self.r = ok, r
        self.trace = Trace(int(ok.size), keep_arrays=False, counted=counted)

    def row(self, name: str, values: np.ndarray, negative: bool = False) -> None:
        self.trace.record(name, np.asarray(values, dtype=np.float64)[self.ok], "fp32", check_negative=negative)

    def element(self, name: str, fmt: str, cnt: np.ndarray, rg: np.ndarray) -> None:
        self.trace.record_counts(name, fmt, _counts(cnt[self.ok]), rg[self.ok].astype(np.float64),
                                 int(self.ok.size) * self.r)


def _merge(rows: int, ok: np.ndarray, fast: Trace, bad: np.ndarray, slow: Trace) -> Trace:
    """One trace over all rows from the unflagged rows' (``fast``) and the flagged rows' (``slow``, numpy's)."""
    if not fast.counted:
        return fast if not bad.size else slow
    out = Trace(rows, keep_arrays=False, counted=True)
    if [s.name for s in fast.stages] != [s.name for s in slow.stages]:
        raise AssertionError(f"the compiled and numpy routes recorded different stages: {fast.names()} and "
                             f"{slow.names()}")
    for a, b in zip(fast.stages, slow.stages):
        counters = {}
        for key in a.counters:
            v = np.zeros(rows, dtype=np.int64)
            v[ok], v[bad] = a.counters[key], b.counters[key]
            counters[key] = v
        finite = [s for s in (a, b) if not np.isnan(s.vmin)]
        out.stages.append(Stage(name=a.name, format=a.format, value=None, wide=None, counters=counters,
                                elementwise=a.elementwise, size=a.size + b.size,
                                vmin=min((s.vmin for s in finite), default=float("nan")),
                                vmax=max((s.vmax for s in finite), default=float("nan")),
                                absmax=max((s.absmax for s in finite), default=float("nan"))))
    return out


def _fp32_clean(*values: np.ndarray) -> np.ndarray:
    """Rows where a per-row fp32 value is not finite, or is a nonzero below binary32's smallest normal (a stage the
    numpy route may count an event or a subnormal in): True there."""
    bad = np.zeros(values[0].shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        for v in values:
            a = np.abs(v)
            bad |= ~np.isfinite(v) | ((a < get_format("fp32").tiny) & (v != 0))
    return bad


@dataclass(frozen=True)
class CompiledForward:
    """A forward by the compiled route: y (x's shape), the per-row mean (None for RMSNorm), rstd and variance as
    saved, ε as added, and the trace over all rows."""

    y: np.ndarray
    saved: tuple[np.ndarray | None, np.ndarray, np.ndarray]
    eps_added: float
    trace: Trace


@dataclass(frozen=True)
class CompiledBackward:
    """A standard backward by the compiled route: dx (x's shape), dγ's and dβ's sums (float64, before their
    rounding to the parameters' format) with their tallies, and the trace over all rows."""

    dx: np.ndarray
    dgamma: tuple[np.ndarray, Tally]
    dbeta: tuple[np.ndarray, Tally] | None
    trace: Trace


def forward_rows(k: Any, x: Any, gamma: np.ndarray, beta: np.ndarray | None, eps: float,
                 numpy_rows: Callable[[np.ndarray], Any]) -> CompiledForward | None:
    """The forward of family kernel ``k`` (bnprobe.kernels.norms: its policy, shape and run) on x with γ as applied
    (flat, rounded) and β (flat, rounded, or None), or None where x holds values of another format or every row is
    flagged (the numpy route takes the call).  ``numpy_rows(idx)``: the numpy route's forward (a NormResult) of rows
    ``idx`` alone."""
    pol, shape, run = k.pol, k.shape, k.run
    rows, r = shape.rows, shape.r
    xs = _stored(x, pol.storage, rows, r)
    if xs is None:
        return None
    xa, xv = xs
    acc, lut, p = run.acc, _fp16_table(), 1 << (r.bit_length() - 1)
    layer = shape.norm == "layer"
    with np.errstate(all="ignore"):
        if layer:
            s32, m32, q32, cnt_x, rg_x, flag = _call("layer_sums", xv, lut, p)
            s, mean, q = s32.astype(np.float64), m32.astype(np.float64), q32.astype(np.float64)
            var = acc.round(q / r)
            per_row = [s, mean, q, var]
        else:
            s32, cnt_xq, rg_xq, flag = _call("rms_sums", xv, lut, p)
            s = s32.astype(np.float64)
            var = acc.div(s, float(r))
            mean = None
            per_row = [s, var]
        eps_added = float(acc.round(eps))
        var_eps = acc.round(var + eps_added)
        rstd = rsqrt(var_eps, acc, method="exact")
        y = np.empty(shape.shape, dtype=get_format(pol.storage).dtype)
        yv = y.reshape(rows, r).view(_BITS[y.dtype.name])
        add = layer or beta is not None
        bvec = np.zeros(r, dtype=np.float32) if beta is None else np.asarray(beta, dtype=np.float32)
        m32 = np.zeros(rows, dtype=np.float32) if mean is None else mean.astype(np.float32)
        xr = (rg_x if layer else rg_xq)[:, 0]
        g32 = np.asarray(gamma, dtype=np.float32)
        cnt_n, rg_n, flag3 = _call("normalise_rows", xv, lut, xr, m32, layer, rstd.astype(np.float32), g32,
                                   _least(g32), bvec, add, yv)
    bad_rows = (flag | flag3).astype(bool) | _fp32_clean(*per_row, var_eps, rstd)
    par = run.params if pol.saved_format is None else type(run.params)(pol.saved_format, pol.spec)
    dt = par.fmt.dtype
    saved = (None if mean is None else par.round(mean).astype(dt), par.round(rstd).astype(dt),
             par.round(var).astype(dt))
    ok, bad = np.flatnonzero(~bad_rows), np.flatnonzero(bad_rows)
    if not ok.size:  # every row flagged: the numpy route takes the call
        return None
    rec = _Recorder(ok, r, run.counting)
    if layer:
        rec.element("x", pol.storage, cnt_x[:, 0], rg_x[:, 0])
        for name, v, neg in zip(("sum", "mean", "sum_sq_dev", "var"), per_row, (False, False, False, True)):
            rec.row(name, v, neg)
    else:
        rec.element("x", pol.storage, cnt_xq[:, 0], rg_xq[:, 0])
        rec.element("squares", "fp32", cnt_xq[:, 1], rg_xq[:, 1])
        rec.row("sum_squares", s)
        rec.row("mean_square", var)
    rec.row("var_eps", var_eps, True)
    rec.row("rstd", rstd)
    for j, name in enumerate(("centered", "xhat", "affine")):
        if name != "centered" or layer:
            rec.element(name, "fp32", cnt_n[:, j], rg_n[:, j])
    rec.element("y", pol.storage, cnt_n[:, 3], rg_n[:, 3])
    trace = rec.trace
    if bad.size:
        sub = numpy_rows(bad)
        y.reshape(rows, r)[bad] = np.asarray(sub.y).reshape(bad.size, r)
        for whole, part in zip(saved, (sub.mean, sub.rstd, sub.var)):
            if whole is not None:
                whole[bad] = part
        trace = _merge(rows, ok, rec.trace, bad, sub.trace)
    return CompiledForward(y, saved, eps_added, trace)


def backward_rows(k: Any, dy: Any, x: Any, gamma: np.ndarray, mu: np.ndarray | None, inv: np.ndarray,
                  numpy_rows: Callable[[np.ndarray], Any]) -> CompiledBackward | None:
    """The standard backward of family kernel ``k`` from dy, x, γ as applied (flat, rounded) and the statistics as
    the kernel reads them (accumulator values per row), or None where dy or x holds values of another format (or
    every row is flagged).
    ``numpy_rows(idx)``: the numpy route's backward (a NormGradients) of rows ``idx`` alone."""
    pol, shape, run = k.pol, k.shape, k.run
    rows, r = shape.rows, shape.r
    xs, dys = _stored(x, pol.storage, rows, r), _stored(dy, pol.storage, rows, r)
    if xs is None or dys is None:
        return None
    xv, dyv = xs[1], dys[1]
    lut = _fp16_table()
    layer = shape.norm == "layer"
    m32 = np.zeros(rows, dtype=np.float32) if mu is None else np.asarray(mu, dtype=np.float32)
    i32, g32 = np.asarray(inv, dtype=np.float32), np.asarray(gamma, dtype=np.float32)
    with np.errstate(all="ignore"):
        dx = np.empty(shape.shape, dtype=get_format(pol.storage).dtype)
        dxv = dx.reshape(rows, r).view(_BITS[dx.dtype.name])
        parts = min(_PARTS, 1 << (rows.bit_length() - 1))
        per_row, cnt, rg, flag, dg, db = _call("backward", dyv, xv, lut, m32, layer, i32, g32, dxv, parts)
        sum_gx, sum_g, m2, m1 = per_row.astype(np.float64).T
    bad_rows = flag.astype(bool) | _fp32_clean(sum_gx, m2, *((sum_g, m1) if layer else ()))
    ok, bad = np.flatnonzero(~bad_rows), np.flatnonzero(bad_rows)
    if not ok.size:  # every row flagged: the numpy route takes the call
        return None
    rec = _Recorder(ok, r, run.counting)
    names = ("dy", "x", "centered", "xhat", "dy_gamma")
    fmts = (pol.storage, pol.storage, "fp32", "fp32", "fp32")
    for j, (name, fmt) in enumerate(zip(names, fmts)):
        if name != "centered" or layer:
            rec.element(name, fmt, cnt[:, j], rg[:, j])
    rec.row("sum_g_xhat", sum_gx)
    if layer:
        rec.row("sum_g", sum_g)
    rec.element("dx_compute", "fp32", cnt[:, 5], rg[:, 5])
    rec.element("dx", pol.storage, cnt[:, 6], rg[:, 6])
    trace = rec.trace
    if bad.size:
        sub = numpy_rows(bad)
        dx.reshape(rows, r)[bad] = np.asarray(sub.dx).reshape(bad.size, r)
        trace = _merge(rows, ok, rec.trace, bad, sub.trace)

    dgamma, dbeta = _sums(dg), _sums(db)
    odd = np.flatnonzero(~np.isfinite(dg) | (~np.isfinite(db) if layer else False))
    if odd.size:
        _odd_columns(k, xs[0], dys[0], mu, inv, odd, dgamma, dbeta if layer else None)
    return CompiledBackward(dx, dgamma, dbeta if layer else None, trace)


def _sums(values: np.ndarray) -> tuple[np.ndarray, Tally]:
    """A kernel's finite column sums as float64, with their tally (no event: see compiled.family.param_sums)."""
    return values.astype(np.float64), Tally(values.size)


def _odd_columns(k: Any, xa: np.ndarray, dya: np.ndarray, mu: np.ndarray | None, inv: np.ndarray, cols: np.ndarray,
                 dgamma: tuple[np.ndarray, Tally], dbeta: tuple[np.ndarray, Tally] | None) -> None:
    """dγ's and dβ's sums of columns ``cols`` (where one is not finite) again by the numpy route's operations, in
    place, counting their overflows; which of two NaNs an addition keeps is the compiler's choice, so a NaN's bits
    are numpy's only when numpy forms it."""
    run, pol = k.run, k.pol
    acc, comp = run.acc, run.comp
    with np.errstate(all="ignore"):
        xc = xa[:, cols].astype(np.float64)
        dy = dya[:, cols].astype(np.float64)
        centered = xc if mu is None else comp.round(xc - comp.round(mu)[:, None])
        xhat = comp.round(centered * comp.round(inv)[:, None])
        parts = [(acc.mul(dy, acc.round(xhat)), dgamma)] + ([] if dbeta is None else [(dy, dbeta)])
        for terms, (values, tally) in parts:
            t = Tally(cols.size)
            values[cols] = reduce_sum(np.ascontiguousarray(terms.T), acc, order=pol.order, lanes=pol.lanes, tally=t)
            tally.counts["overflow"][cols] = t.counts["overflow"]

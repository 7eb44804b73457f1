"""The compiled route's Python side: which runs take it, and the passes a kernel block makes with it.

A run takes the compiled route (``bnprobe.compiled.kernels``, numba) when its trace keeps no arrays,
no stage is overridden, every format is fp64, fp32, fp16 or bf16, no rounding is stochastic (its random
stream is drawn by numpy), and ``BNPROBE_JIT`` allows it for the call's size (:func:`bnprobe.compiled.jit.jit_for`).
The elementwise passes (loading a tensor, casts, the normalisation and affine, dx) and the per-channel sums run
compiled; the per-channel
statistics between them (mean, variance, rstd, the coefficients) are the numpy code every route shares,
and so are the variance algorithms without a compiled sum (welford, chan) and a reduction split
across cores.  Results, saved and running statistics and every trace counter and range equal the
numpy routes' (tests/kernels/test_carriers.py).
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TextIO

import numpy as np

from bnprobe.compiled.jit import KERNEL_LOCK, jit_for
from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.rounding import RoundingSpec
from bnprobe.numerics.variance import prescale_exponent

__all__ = ["compiled_route", "Source", "Fused", "COMPILED_CHUNK_ELEMENTS"]

_FORMATS = frozenset(("fp64", "fp32", "fp16", "bf16"))
# the compiled route's channel blocks: larger than numpy's (its passes keep no temporaries per operation: a
# block holds three float32 carriers, 96 MiB at most unless one channel alone is longer), so that each parallel
# pass has channels for every thread and a call few blocks' Python: fwd+bwd of 32x64x56x56 (fp16) took 0.34 s
# in blocks of 2^18 values and 0.24 s in blocks of 2^21 (2 cores); after the fast kernels were vectorised,
# 62 ms in blocks of 2^21 and 55 ms in blocks of 2^22; then 50-61 ms in blocks of 2^22 and 43-55 ms in one
# block of 2^23 (three rounds alternating in one process)
COMPILED_CHUNK_ELEMENTS = 1 << 23
# the fast kernels count a row of a tensor (N, C, S) in int32 (compiled_fast._count): longer rows take the general
# kernels
ROW_MAX = 2**31 - 1


def compiled_route(policy: Any, keep_arrays: bool, overrides: dict[str, np.ndarray] | None,
                   elements: int | None = None) -> bool:
    """Whether a kernel call with this policy (on ``elements`` values) takes the compiled route (see the module
    notes and :func:`bnprobe.compiled.jit.jit_for`)."""
    if keep_arrays or overrides or not jit_for(elements):
        return False
    if policy.order in ("vec", "rowlanes", "eigen", "omp_simd", "inductor", "interleave4", "xla", "lanes_tail") or \
            policy.variance == "inductor" or policy.y_formula == "affine_mr" or \
            policy.backward_formula in ("torch", "paddle", "onednn", "inductor", "onednn_jit", "tf_eigen",
                                        "keras_tf", "jax") or \
            policy.sqrt == "eigen_fast" or policy.rsqrt in ("sqrt_recip", "rsqrtps") or \
            policy.backward_sums != "forward" or policy.variance_fma or policy.path_channels or policy.packet_lanes or \
            any(f is not None for f in (policy.rstd_format, policy.sum_format, policy.saved_format,
                                           policy.running_var_sum, policy.threads, policy.infer_rsqrt,
                                           policy.backward_lanes)):
        # (orders, formats and formulas the kernels do not have)
        return False
    formats = {policy.storage, policy.params_format, policy.compute, policy.accumulate}
    if not formats <= _FORMATS or "stochastic" in (policy.rounding, policy.output_spec.rounding):
        return False
    if formats == {"fp64"}:  # numpy's float64 arithmetic is already native and vectorised: nothing to gain
        return False
    # fp64 arithmetic is taken as native (no rounding, no events): right for the default spec only
    return "fp64" not in formats or (policy.spec == RoundingSpec() and policy.output_spec == RoundingSpec())


@functools.cache
def kernels() -> ModuleType:
    """The numba kernels, imported (and compiled, or loaded from numba's cache) on first use.

    Compiled kernels are cached (``cache=True``) beside their modules, or where the package directory is not
    writable in numba's user-wide cache directory (``$NUMBA_CACHE_DIR``, else the platform's user cache)."""
    from bnprobe.compiled import kernels as compiled

    return _Locked(compiled)


class _Locked:
    """The kernels module with every kernel call taken under one lock (see KERNEL_LOCK)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not callable(attr) or not hasattr(attr, "py_func"):
            return attr

        def call(*args: Any) -> Any:
            return call_compiled(attr, *args)
        return call


def call_compiled(kernel: Any, *args: Any) -> Any:
    """``kernel(*args)`` for a numba kernel, under the kernels' lock, said once on a terminal when it compiles."""
    with KERNEL_LOCK:
        announce_compiling(kernel)
        return kernel(*args)


# a first run compiles the kernels for a minute or more (65 s for the presets' on 2 cores): said once per process,
# on a terminal
_ANNOUNCED = threading.Event()


def _compiles(kernel: Any) -> bool:
    """Whether calling numba dispatcher ``kernel`` compiles it: nothing of it compiled in this process yet, and
    nothing in numba's cache for it (its index is missing, or was written for another version of the source).
    False where the cache cannot be read this way (numba's cache index is not public API)."""
    if kernel.overloads:
        return False
    try:
        return not kernel._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - a numba without these internals: say nothing, compile as ever
        return False


def announce_compiling(kernel: Any, stream: TextIO | None = None) -> None:
    """One line on ``stream`` (stderr) when it is a terminal and calling ``kernel`` is about to compile the kernels;
    once per process."""
    if _ANNOUNCED.is_set() or kernel.overloads:
        return
    stream = stream if stream is not None else sys.stderr
    if not stream.isatty() or not _compiles(kernel):
        return
    _ANNOUNCED.set()
    where = getattr(getattr(kernel, "_cache", None), "_cache_path", "numba's cache")
    stream.write(f"bnprobe: compiling its numba kernels for this machine, once: about a minute or two "
                 f"(later runs load them from {where})\n")
    stream.flush()


# the fast kernels' formats, as the dtypes that name them (16-bit formats held as their bit patterns)
_TAGS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.uint16), "bf16": np.dtype(np.int16)}
_BITS = {"float16": _TAGS["fp16"], "bfloat16": _TAGS["bf16"]}


@functools.cache
def _tag(name: str) -> np.ndarray:
    """An empty array whose dtype names format ``name`` to a fast kernel."""
    return np.empty(0, dtype=_TAGS[name])


@functools.cache
def _fp16_table() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def spec_vector(ar: Arith) -> tuple[float, ...]:
    """The format and rounding of ``ar`` as the vector the kernels take (compiled.SPEC_FIELDS)."""
    k = kernels()
    fmt, spec = ar.fmt, ar.spec
    if fmt.name == "fp64":
        kind = k.KIND_FP64
    elif fmt.name == "fp32" and spec.rounding == "nearest_even":
        kind = k.KIND_FP32
    else:
        kind = k.KIND_BITS
    # a tuple, not an array: numba keeps a tuple's fields in registers (an array's reloads cost 8x per value)
    return tuple(float(v) for v in (kind, fmt.mantissa_bits, fmt.emin, k.ROUNDING_CODES[spec.rounding],
                                    spec.overflow == "saturate", spec.subnormals == "flush", fmt.max, fmt.tiny))


@dataclass(frozen=True)
class Source:
    """A caller's tensor as ``(N, C, S)`` (the whole of it: see compiled.load_fast), as the kernels read it
    (16-bit formats as their bit patterns, see _TAGS) and as it is (``values``), with the
    block of channels a kernel call reads or writes."""

    view: np.ndarray
    values: np.ndarray
    channels: slice = field(default_factory=lambda: slice(0, 0))

    @classmethod
    def of(cls, view3: np.ndarray) -> Source:
        bits = _BITS.get(view3.dtype.name)
        return cls(view3 if bits is None else view3.view(bits), view3)

    def block(self, channels: slice) -> Source:
        return Source(self.view, self.values, channels)

    @property
    def counted(self) -> bool:
        """Whether the fast kernels can count this tensor's rows (ROW_MAX)."""
        return self.view.shape[2] <= ROW_MAX

    @property
    def fast(self) -> bool:
        """Whether the fast kernels read this tensor: float32, fp16 or bf16 (an integer tensor of 16 bits has
        the dtype of the bit patterns, but its values are integers: numpy converts it), in rows they count."""
        return self.values.dtype.name in ("float32", "float16", "bfloat16") and self.counted

    def rows(self) -> np.ndarray:
        """This block's values as a channel-first (k, R) float64 copy (what the general kernels take)."""
        part = self.values[:, self.channels, :]
        with np.errstate(invalid="ignore"):
            return np.ascontiguousarray(part.transpose(1, 0, 2), dtype=np.float64).reshape(part.shape[1], -1)

    def put(self, rows: np.ndarray) -> None:
        """Write a channel-first (k, R) block of values of this tensor's format into this block."""
        part = self.values[:, self.channels, :]
        with np.errstate(all="ignore"):
            part[...] = rows.reshape(part.shape[1], part.shape[0], part.shape[2]).transpose(1, 0, 2)

    @property
    def offset(self) -> int:
        return self.channels.start


class Fused:
    """The compiled passes of one block of a kernel call; stages go to ``trace`` in the numpy order."""

    def __init__(self, run: Any, dest: Source | None = None) -> None:
        self.run = run
        self.k = kernels()
        self.dest = dest  # where y or dx is written
        self._specs: dict[int, tuple[float, ...]] = {}
        # binary32 kernels apply: every operation fp32 with the default rounding (float32 carriers), the
        # stored tensors rounded to nearest-even (see compiled_fast.py)
        self.fast = run.carrier is np.float32 and run.out.spec == RoundingSpec()

    def _stores(self, ar: Arith) -> bool:
        """Whether the fast kernels store ``ar``'s format (into ``dest``, when one is written)."""
        return ar.fmt.name in _TAGS and (self.dest is None or (self.dest.view.dtype == _TAGS[ar.fmt.name]
                                                             and self.dest.counted))

    @staticmethod
    def _fast(fast_result: tuple, general: Any) -> tuple:
        """A fast kernel's results (arrays indexed by channel first), with the channels it flagged computed
        again by the general kernel: ``general(sel)`` computes (and writes) the block's channels ``sel``, a
        slice, and returns their results.  A rare event costs its channels, not the block."""
        *result, flag = fast_result
        bad = np.flatnonzero(flag)
        for run in np.split(bad, np.flatnonzero(np.diff(bad) != 1) + 1) if bad.size else ():
            sel = slice(int(run[0]), int(run[-1]) + 1)
            for whole, part in zip(result, general(sel)):
                whole[sel] = part
        return tuple(result)

    def _columns(self, cols: tuple[np.ndarray, ...], width: int) -> np.ndarray:
        """Per-channel values rounded to the compute format, as the (k, width) table a kernel reads (unused
        columns zero)."""
        table = np.zeros((len(cols[0]), width))
        for i, v in enumerate(cols):
            table[:, i] = self.run.comp.round(v)
        return table

    def spec(self, ar: Arith) -> tuple[float, ...]:
        v = self._specs.get(id(ar))
        if v is None:
            v = self._specs[id(ar)] = spec_vector(ar)
        return v

    def _record(self, names: tuple[str | None, ...], fmts: tuple[Arith, ...], cnt: np.ndarray, rg: np.ndarray,
                size: int, at: int | None = None) -> None:
        for j, (name, ar) in enumerate(zip(names, fmts)):
            if name is not None:
                self.run.trace.record_counts(name, ar.fmt, cnt[:, j], rg[:, j], size, at)
                at = None if at is None else at + 1

    def load(self, name: str, src: Source, ar: Arith) -> np.ndarray:
        """A caller's tensor block rounded to ``ar``'s format, as a (k, R) block of carriers; stage ``name``."""
        nn, ss = src.view.shape[0], src.view.shape[2]
        dst = np.empty((src.channels.stop - src.channels.start, nn * ss), dtype=self.run.carrier)
        lut = _fp16_table()

        def general(sel: slice) -> tuple:
            out = np.empty(dst[sel].shape)
            result = self.k.cast(src.block(_within(src.channels, sel)).rows(), out, self.spec(ar))
            dst[sel] = out  # exact: the carrier holds the format
            return result
        if self.fast and src.fast and ar.fmt.name in _TAGS:
            cnt, rg = self._fast(self.k.load_fast(src.view, src.offset, lut, dst, _tag(ar.fmt.name)), general)
        else:
            cnt, rg = general(slice(None))
        self._record((name,), (ar,), cnt, rg, dst.size)
        return dst

    def cast(self, name: str, block: np.ndarray, ar: Arith) -> np.ndarray:
        """A (k, R) block rounded to ``ar``'s format; stage ``name``."""
        out = np.empty(block.shape)
        cnt, rg = self.k.cast(np.asarray(block, dtype=np.float64), out, self.spec(ar))
        self._record((name,), (ar,), cnt, rg, out.size)
        return out.astype(block.dtype, copy=False)  # exact: the carrier holds the format

    def reduce(self, a: np.ndarray, t: Tally, b: np.ndarray | None = None, *, op: int | None = None,
               mean: np.ndarray | None = None, prescale: float = 0.0) -> np.ndarray:
        """The per-channel sum of a's addends (op, see compiled.reduce; x·round(b) when b is given) in the
        accumulator format by the policy's order; the events go to ``t``."""
        run, k = self.run, self.k
        pol = run.policy
        if op is None:
            op = k.ADD_X if b is None else k.ADD_PRODUCT
        bb, mm, order = a if b is None else b, np.zeros(a.shape[0]) if mean is None else mean, k.ORDER_CODES[pol.order]

        def general(sel: slice) -> tuple:
            f64 = np.float64
            return k.reduce(np.asarray(a[sel], f64), np.asarray(bb[sel], f64), mm[sel], op, self.spec(run.acc),
                            order, pol.lanes, pol.kahan, prescale)
        if self.fast and not pol.kahan:
            sums, tallies = self._fast(k.reduce_fast(a, bb, mm, op, order, pol.lanes, prescale, k.THREAD_SLOTS),
                                       general)
        else:
            sums, tallies = general(slice(None))
        self.tally(t, tallies)
        return sums

    def backward_first(self, dy: Source, x: Source, mu: np.ndarray,
                       inv: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The backward's first pass (compiled.backward_fast): dy and x loaded, centered, xhat and the sums of dy
        and dy·xhat, stages recorded from dy to xhat, nothing stored (dx_source computes the values again);
        (mean, invstd, sums (k, 2), tallies (k, 2, 4)), or None where the run takes the separate passes
        (compute or accumulator not fp32, a reduction split across cores, Kahan, a channels_last tensor)."""
        run, k = self.run, self.k
        pol, st = run.policy, run.storage
        if not (self.fast and pol.core_parts == 1 and not pol.kahan and st.fmt.name in _TAGS
                and dy.fast and x.fast
                and run.comp.fmt.name == run.acc.fmt.name == "fp32"
                # channels_last views read a value per row (no vectorising to gain), and each layout compiles
                # its own kernels: they take the separate passes
                and dy.view.flags.c_contiguous and x.view.flags.c_contiguous):
            return None
        mean, invstd = run.acc.round(run.param(mu)), run.acc.round(run.param(inv))
        nk = x.channels.stop - x.channels.start
        order = k.ORDER_CODES[pol.order]

        def general(sel: slice) -> tuple:
            dys, xs, xhat, (cnt, rg) = self._carriers(dy, x, mean, invstd, sel)
            acc, z = self.spec(run.acc), np.zeros(len(dys))
            s1, t1 = k.reduce(dys, dys, z, k.ADD_X, acc, order, pol.lanes, False, 0.0)
            s2, t2 = k.reduce(dys, xhat, z, k.ADD_PRODUCT, acc, order, pol.lanes, False, 0.0)
            return cnt, rg, np.stack([s1, s2], axis=1), np.stack([t1, t2], axis=1)
        cnt, rg, sums, flag = k.backward_fast(dy.view, x.view, x.offset, nk, _fp16_table(), _tag(st.fmt.name), mean,
                                              invstd, order, pol.lanes, k.THREAD_SLOTS)
        cnt, rg, sums, tallies = self._fast((cnt, rg, sums, np.zeros((nk, 2, 4), dtype=np.int64), flag), general)
        self._record(("dy", "x", "centered", "xhat"), (st, st, run.comp, run.comp), cnt, rg,
                     nk * x.view.shape[0] * x.view.shape[2])
        return mean, invstd, sums, tallies

    def _carriers(self, dy: Source, x: Source, mean: np.ndarray, invstd: np.ndarray,
                  sel: slice) -> tuple[np.ndarray, ...]:
        """The general kernels' dy, x and xhat of the block's channels ``sel`` (float64 (k, R)), and the (cnt,
        rg) of the stages dy, x, centered, xhat."""
        run, k = self.run, self.k
        parts, rows = [], []
        for src in (dy, x):
            a = src.block(_within(src.channels, sel)).rows()
            out = np.empty(a.shape)
            parts.append(k.cast(a, out, self.spec(run.storage)))
            rows.append(out)
        xhat = np.empty(rows[1].shape)
        parts.append(k.center_scale(rows[1], mean[sel], invstd[sel], self.spec(run.comp), xhat))
        cnt, rg = (np.concatenate([p[i] for p in parts], axis=1) for i in (0, 1))
        return rows[0], rows[1], xhat, (cnt, rg)

    def dx_source(self, dy: Source, x: Source, mean: np.ndarray, invstd: np.ndarray, formula: str,
                  cols: tuple[np.ndarray, ...]) -> None:
        """dx() after backward_first: dy, x and xhat formed again from the tensors (compiled.dx_source_fast)."""
        run, k = self.run, self.k
        table = self._columns(cols, 3)
        code = {"standard": k.DX_STANDARD, "ascend": k.DX_ASCEND, "constant": k.DX_CONSTANT}[formula]

        def general(sel: slice) -> tuple:
            dys, xs, xhat, _ = self._carriers(dy, x, mean, invstd, sel)
            out = np.empty(dys.shape)
            result = k.dx(dys, xhat, xs, table[sel], code, self.spec(run.comp), self.spec(run.out), out)
            self.dest.block(_within(self.dest.channels, sel)).put(out)
            return result
        nk = x.channels.stop - x.channels.start
        if self._stores(run.out):
            cnt, rg = self._fast(k.dx_source_fast(dy.view, x.view, x.offset, _fp16_table(), _tag(run.storage.fmt.name),
                                                  mean, invstd, table, code, self.dest.view), general)
        else:
            cnt, rg = general(slice(None))
        self._record(("dx_compute", "dx"), (run.comp, run.out), cnt, rg, nk * x.view.shape[0] * x.view.shape[2])

    def tally(self, t: Tally, tallies: np.ndarray) -> Tally:
        """``t`` with a kernel's events (k, [overflow, saturated, underflow, flushed]) added."""
        for i, key in enumerate(("overflow", "saturated", "underflow", "flushed")):
            t.counts[key] += tallies[:, i]
        return t

    def sums(self, r: int) -> _Sums | None:
        """The two-pass and naive algorithms' sums, compiled (None where the policy splits them across cores:
        numpy's reduce_sum does that)."""
        pol = self.run.policy
        if pol.core_parts > 1:
            return None
        return _Sums(self, 2.0 ** -prescale_exponent(r) if pol.mean_by == "prescaled" else 0.0)

    def normalise(self, xs: np.ndarray, formula: str, cols: tuple[np.ndarray, ...], at: int) -> None:
        """y from a block of storage values and the formula's per-channel values (see compiled.normalise),
        written to ``dest``; x_compute is recorded at index ``at`` (before the per-channel stages the
        formula's coefficients recorded), the rest appended."""
        run, k = self.run, self.k
        pol, comp = run.policy, run.comp
        code = {"xhat": k.Y_XHAT, "scale": k.Y_SCALE, "affine": k.Y_AFFINE}[formula]
        table = self._columns(cols, 4)
        xcast = not comp.fmt.holds(run.storage.fmt)

        def general(sel: slice) -> tuple:
            y = np.empty(xs[sel].shape)
            result = k.normalise(np.asarray(xs[sel], dtype=np.float64), table[sel], code, pol.fma, xcast,
                                 self.spec(comp), self.spec(run.out), y)
            self.dest.block(_within(self.dest.channels, sel)).put(y)
            return result
        if self.fast and not pol.fma and not xcast and self._stores(run.out):
            cnt, rg = self._fast(k.normalise_fast(xs, table, code, self.dest.view, self.dest.offset,
                                                  _fp16_table()), general)
        else:
            cnt, rg = general(slice(None))
        self._record(("x_compute" if xcast else None,), (comp,), cnt, rg, xs.size, at)
        names = {"xhat": ("centered", "xhat"), "scale": ("centered", None), "affine": (None, None)}[formula]
        self._record((None, *names, "affine", "y"), (comp, comp, comp, comp, run.out), cnt, rg, xs.size)

    def center_scale(self, xc: np.ndarray, mean: np.ndarray, invstd: np.ndarray) -> np.ndarray:
        """The backward's centered and xhat stages; returns xhat."""
        comp = self.run.comp
        xhat = np.empty_like(xc)
        mean, invstd = comp.round(mean), comp.round(invstd)

        def general(sel: slice) -> tuple:
            out = np.empty(xc[sel].shape)
            result = self.k.center_scale(np.asarray(xc[sel], dtype=np.float64), mean[sel], invstd[sel],
                                         self.spec(comp), out)
            xhat[sel] = out  # exact: the carrier holds the compute format
            return result
        if self.fast:
            cnt, rg = self._fast(self.k.center_scale_fast(xc, mean, invstd, xhat), general)
        else:
            cnt, rg = general(slice(None))
        self._record(("centered", "xhat"), (comp, comp), cnt, rg, xc.size)
        return xhat

    def dx(self, formula: str, dyc: np.ndarray, xhat: np.ndarray, xc: np.ndarray,
           cols: tuple[np.ndarray, ...]) -> None:
        """dx_compute and dx by the dx formula (compiled.dx), dx written to ``dest``."""
        run, k = self.run, self.k
        comp = run.comp
        table = self._columns(cols, 3)
        code = {"standard": k.DX_STANDARD, "ascend": k.DX_ASCEND, "constant": k.DX_CONSTANT}[formula]

        def general(sel: slice) -> tuple:
            f64, out = np.float64, np.empty(dyc[sel].shape)
            result = k.dx(np.asarray(dyc[sel], f64), np.asarray(xhat[sel], f64), np.asarray(xc[sel], f64),
                          table[sel], code, self.spec(comp), self.spec(run.out), out)
            self.dest.block(_within(self.dest.channels, sel)).put(out)
            return result
        if self.fast and self._stores(run.out):
            cnt, rg = self._fast(k.dx_fast(dyc, xhat, xc, table, code, self.dest.view, self.dest.offset,
                                           _fp16_table()), general)
        else:
            cnt, rg = general(slice(None))
        self._record(("dx_compute", "dx"), (comp, run.out), cnt, rg, dyc.size)


def _within(channels: slice, sel: slice) -> slice:
    """The tensor's channels of the block's channels ``sel`` (a slice of a block of ``channels``)."""
    start, stop, _ = sel.indices(channels.stop - channels.start)
    return slice(channels.start + start, channels.start + stop)


class _Sums:
    """numerics.variance.Sums, compiled: the same sums, each addend prescaled by ``prescale`` (0: not)."""

    def __init__(self, fused: Fused, prescale: float) -> None:
        self.fused, self.prescale = fused, prescale

    def total(self, x: np.ndarray, t: Tally) -> np.ndarray:
        return self.fused.reduce(x, t, op=self.fused.k.ADD_X, prescale=self.prescale)

    def squares(self, x: np.ndarray, t: Tally) -> np.ndarray:
        return self.fused.reduce(x, t, op=self.fused.k.ADD_SQUARE, prescale=self.prescale)

    def deviations(self, x: np.ndarray, mean: np.ndarray, t: Tally) -> tuple[np.ndarray, None]:
        return self.fused.reduce(x, t, op=self.fused.k.ADD_DEV_SQUARE, mean=mean, prescale=self.prescale), None

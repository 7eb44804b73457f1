"""Instrumented BatchNorm: training forward, inference forward and backward.

Pure functions: arrays and a Policy in, frozen results out.  Every operation is
rounded to the format the policy gives it, and every intermediate is recorded in
the result's Trace.  Internally tensors are channel-first ``(C, R)`` float64
arrays holding values of their format; outputs are returned in the layout and
numpy dtype of their format.

When the trace keeps no arrays and every operation is an fp32 one with the
default rounding (the fp32, fp16 and bf16 presets: 16-bit tensors, fp32
arithmetic, parameters in fp32, fp16 or bf16), the tensors are float32 carriers instead: the same values, half the
memory traffic, and fp32 arithmetic done by the CPU's own binary32 operations
(see numerics/arith.py for why that is exact).  Outputs, statistics and trace
counters are identical either way; tests/kernels/test_carriers.py checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import one_value_per_channel
from bnprobe.kernels.fused import COMPILED_CHUNK_ELEMENTS, Fused, Source, compiled_route
from bnprobe.kernels.layout import Layout, as_channel_vector, check_eps, check_momentum, layout_of
from bnprobe.kernels.policy import FAMILY_ONLY, Policy, get_policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.arith import Arith, Tally, as_carrier, fits_float32, fma_wide
from bnprobe.numerics.inductor import splits_channels, splits_rows
from bnprobe.numerics.reduce import (CallShape, Cores, Rows, outer_dims_sum, packet_split_sum, plane_reduce, reduce_sum,
                                     small_batch_threads, thread_blocks, thread_sum, vec_dot)
from bnprobe.numerics.rounding import RoundingSpec, round_to
from bnprobe.numerics.rsqrt import divide, rsqrt_ascend950, sqrt_eigen_fast
from bnprobe.numerics.rsqrt import rsqrt as nrsqrt
from bnprobe.numerics.rsqrt import sqrt as nsqrt
from bnprobe.numerics.variance import MomentsMethod, ThreadSums, moments, prescale_exponent

__all__ = ["Execution", "TrainResult", "InferResult", "BackwardResult", "forward_train", "forward_infer", "backward",
           "KernelRun", "RunSetting", "per_count", "batch_policy"]


@dataclass(frozen=True)
class TrainResult:
    """Outputs of a training forward.

    ``mean``, ``invstd`` and ``var`` (the biased batch variance) are the saved
    statistics in the params format; ``running_mean`` / ``running_var`` are the
    updated running statistics (None when none were given).
    """

    y: np.ndarray
    mean: np.ndarray
    invstd: np.ndarray
    var: np.ndarray
    running_mean: np.ndarray | None
    running_var: np.ndarray | None
    num_batches_tracked: int
    trace: Trace


@dataclass(frozen=True)
class InferResult:
    y: np.ndarray
    trace: Trace


@dataclass(frozen=True)
class BackwardResult:
    dx: np.ndarray
    dgamma: np.ndarray
    dbeta: np.ndarray
    trace: Trace


# Channels are processed in blocks of at most this many values (2 MiB per float64 array, 1 MiB per float32
# one; at least one channel per block), small enough that a block's arrays stay in a core's L2 cache:
# fwd+bwd of 32x64x56x56 took 0.37 s with 1 << 18 and 0.51 s with 1 << 20 (fp16 preset, 2-core Xeon).
DEFAULT_CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True, eq=False)
class Execution:
    """How a kernel call reads its arrays and runs, apart from its arithmetic (the policy's): ``layout``, how x (and
    dy) are laid out; ``keep_arrays``, whether the trace keeps every stage's array (False: its counters and ranges
    only); ``counters=False`` records no trace (its metadata only) and counts no events, for callers that read the
    outputs alone (the same outputs bit for bit); ``chunk_elements``, the most values a block of channels holds
    (None: one block; the blocks give the results of one pass); ``overrides``, stage name to the values that replace
    the stage's (channel-first, ``(C,)`` or ``(C, R)``), for what-if runs."""

    layout: str = "channels_first"
    keep_arrays: bool = True
    chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS
    overrides: Mapping[str, np.ndarray] | None = None
    counters: bool = True


def carrier_for(policy: Policy, keep_arrays: bool, overrides: dict[str, np.ndarray] | None) -> type:
    """float32 when a run can use float32 carriers (see the module notes), else float64.  The parameters may be
    fp16 or bf16 (a model.half() layer's): they are per-channel values, rounded by their own Arith, and float32
    holds them."""
    fp32 = all(get_format(f).name == "fp32" for f in (policy.compute, policy.accumulate)) and \
        get_format(policy.params_format).name in ("fp32", "fp16", "bf16")
    if (keep_arrays or overrides or not fp32 or not fits_float32(get_format(policy.storage))
            or policy.spec != RoundingSpec()):
        return np.float64
    return np.float32


@dataclass(frozen=True)
class RunSetting:
    """What every block of a kernel call runs with: whether its trace keeps arrays and counts (False: no events
    counted, no stage recorded, outputs only), its carrier, the dtypes of the caller's tensors by stage name, whether
    it takes the compiled route, the length of the layout's contiguous rows in a channel (H*W channels-first;
    for order=vec), the call's channel count (PyTorch's small-batch split across threads and packet_lanes depend on
    it), its number of samples N (for threads dealt by sample) and its shape (order=xla reads it)."""

    keep_arrays: bool = False
    counting: bool = True
    carrier: type = np.float64
    sources: Mapping[str, np.dtype] | None = None
    compiled: bool = False
    row: int | None = None
    channels: int = 1
    samples: int | None = None
    shape: CallShape | None = None


def _call_shape(lay: Layout) -> CallShape:
    """The call's reduced axes (N and the spatial ones, outermost first) and channel count, for order=xla."""
    return CallShape(tuple(d for i, d in enumerate(lay.shape) if i != lay.channel_axis), lay.channels)


class KernelRun:
    """The arithmetic contexts of one block of channels of a kernel call, and its trace."""

    def __init__(self, policy: Policy, channels: int, rng: np.random.Generator, setting: RunSetting, *,
                 overrides: dict[str, np.ndarray] | None = None, dest: Source | None = None, first: int = 0) -> None:
        self.policy = policy
        self.first = first  # the call's index of this block's first channel
        self.row = setting.row  # the length of the layout's contiguous rows in a channel, for order=vec
        self.shape = setting.shape if policy.order == "xla" else None  # the call's shape, which order=xla reads
        self.channels = setting.channels  # the call's, not this block's
        self.c = channels
        self.samples = setting.samples  # the call's N
        # how many of this block's channels (from the call's channel ``first`` on) are in whole packets (None: all)
        lanes = policy.packet_lanes
        self.vector_rows = None if not lanes else \
            min(channels, max(0, self.channels // lanes * lanes - first))
        self.carrier = setting.carrier
        self.sources = setting.sources or {}  # dtypes of the caller's tensors, by stage name
        self.overrides = overrides or {}
        spec = policy.spec
        counting = self.counting = setting.counting  # False: no events counted, no stage recorded (outputs only)
        self.storage = Arith(policy.storage, spec, rng, counting=counting)
        self.out = Arith(policy.storage, policy.output_spec, rng, counting=counting)
        self.params = Arith(policy.params_format, spec, rng, counting=counting)
        self.comp = Arith(policy.compute, spec, rng, counting=counting)
        self.acc = Arith(policy.accumulate, spec, rng, counting=counting)
        self.rng = rng
        self.cores = Cores(policy.core_parts, policy.core_combine)  # how the policy splits a sum across cores
        self.trace = Trace(channels, setting.keep_arrays, counted=counting)
        # the compiled route's passes (tensors arrive as Sources, y / dx is written to dest), or None
        self.fused = Fused(self, dest) if setting.compiled else None

    def reduce(self, x: np.ndarray, tally: Tally, times: np.ndarray | None = None, fused: bool = False,
               cores: Cores | None = None) -> np.ndarray:
        """A per-channel sum in the accumulator format, by the policy's order and core split (or ``cores``), or split
        across its threads: of x (a tensor read from memory), or of x * round(times) (an expression) with both
        roundings' events counted (``fused``: x·times accumulated by fused multiply-adds, across threads)."""
        pol = self.policy
        if pol.threads is not None and pol.order != "inductor":  # (inductor's split: cores, inductor_cores)
            t = None if times is None else self.acc.round(times, tally)
            return self.acc.round(thread_sum(x, self.acc, threads=pol.threads, wide=self.wide_sums(), times=t,
                                             fused=fused, tally=tally, split=pol.thread_split, samples=self.samples),
                                  tally)
        if self.fused is not None and pol.core_parts == 1:
            return self.fused.reduce(x, tally, times)
        if times is not None:
            x = self.acc.mul(x, self.acc.round(times, tally), tally)
        return packet_split_sum(x, self.acc, self.vector_rows, lambda rows, t: reduce_sum(
            rows, self.acc, order=pol.order, lanes=pol.lanes, kahan=pol.kahan, tally=t, cores=cores or self.cores,
            rng=self.rng, unroll=pol.unroll, row=self.order_rows() if times is None else self.shape or self.row), tally)

    def order_rows(self) -> Rows | CallShape | None:
        """What the policy's order reads of the layout: the call's shape (order=xla), or this block's rows."""
        return self.shape if self.policy.order == "xla" else self.rows()

    def rows(self) -> Rows | None:
        """This block's channel-first rows and where they sit in the call's buffer (None: not channel-first)."""
        return Rows(self.row, self.channels, self.first) if self.row is not None else None

    def packets(self) -> np.ndarray:
        """Which of this block's channels fill whole packets of ``lanes`` channels of the call (a vectorised
        per-channel loop takes them; the rest go through its scalar tail)."""
        lanes, channels = self.policy.lanes, max(self.channels, self.first + self.c)
        return self.first + np.arange(self.c) < channels // lanes * lanes

    def inductor_cores(self, r: int, scalar_below: int) -> Cores:
        """The core split of the policy, or for order=inductor the threads its kernel splits a channel's reduction
        across (:func:`~bnprobe.numerics.inductor.splits_channels`; none in a layout with rows)."""
        pol = self.policy
        if pol.order != "inductor" or pol.threads is None:
            return self.cores
        channels = self.channels or self.c
        if (self.row is None or self.row == 1) and splits_channels(channels, r, pol.threads, scalar_below):
            return Cores(pol.threads, "ordered", "openmp")
        width = pol.lanes * (pol.unroll if self.row is not None and self.row >= pol.lanes * pol.unroll else 1)
        if self.row is not None and self.row > 1 and splits_rows(channels, r, self.row, width, pol.threads):
            raise BNProbeError(f"order=inductor with threads={pol.threads}: torch.compile splits each channel's rows "
                               f"across its threads at {channels} channel(s) of {r} values in rows of {self.row}, "
                               "which bnprobe does not emulate (without threads: the one-thread kernel)")
        return self.cores

    def tally(self) -> Tally:
        return Tally(self.c)

    def wide_sums(self) -> Arith | None:
        """The format the policy carries its sums in when wider than the accumulator (or None)."""
        fmt = self.policy.sum_format
        return None if fmt is None or fmt == self.acc.fmt.name else Arith(fmt, counting=self.counting)

    def rec(self, name: str, ar: Arith, wide: np.ndarray, tally: Tally | None = None,
            negative: bool = False) -> np.ndarray:
        """Round ``wide`` in ``ar``'s format and record it as stage ``name``.

        ``wide`` holds values already formed (a float32 carrier is taken as it is); an expression of
        several values goes through :meth:`op`, which rounds it as one operation in either carrier.
        """
        tally = tally if tally is not None else self.tally()
        with np.errstate(all="ignore"):
            wide = as_carrier(wide)
        value = self.carried(ar.round(wide, tally), ar)
        return self.record(name, ar, value, wide, tally, negative)

    def output(self, name: str, ar: Arith, wide: np.ndarray) -> np.ndarray:
        """rec() of a final output (y, dx); returns it in the format's own dtype where the rounding made
        that array anyway (float32 carriers), else as rec() does."""
        if self.carrier is not np.float32 or wide.dtype != np.float32:  # (no overrides with float32 carriers)
            return self.rec(name, ar, wide)
        t = self.tally()
        value, narrow = ar.round_narrow(wide, t)
        self.record(name, ar, value, wide, t)
        return value if narrow is None else narrow

    def op(self, name: str, ar: Arith, f: Any, *args: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        """``f(*args)`` (np.add, np.subtract, np.multiply) formed exactly, rounded once in ``ar``'s
        format, recorded as stage ``name``."""
        tally = tally if tally is not None else self.tally()
        if self.carrier is np.float32:
            value = self.carried(ar.apply(f, *args, tally=tally), ar)
            return self.record(name, ar, value, None, tally)
        with np.errstate(all="ignore"):
            wide = f(*(np.asarray(a, dtype=np.float64) for a in args))
        return self.rec(name, ar, wide, tally)

    def carried(self, value: np.ndarray, ar: Arith) -> np.ndarray:
        """An elementwise value in this run's carrier (exact: float32 only holds formats that fit)."""
        if self.carrier is np.float32 and value.ndim == 2 and ar.fits32 and value.dtype != np.float32:
            return value.astype(np.float32)
        return value

    def col(self, ar: Arith, v: np.ndarray) -> np.ndarray:
        """A per-channel value rounded to ``ar``'s format, as a column in this run's carrier."""
        return self.carried(ar.round(v)[:, None], ar)

    def cast(self, name: str, value: np.ndarray, src: str, dst: Arith) -> np.ndarray:
        """Convert between formats; recorded as a stage only when it can round."""
        if dst.fmt.holds(get_format(src)):
            return value
        if self.fused is not None:
            return self.fused.cast(name, value, dst)
        return self.rec(name, dst, value)

    def load(self, name: str, a: np.ndarray, ar: Arith) -> np.ndarray:
        """Round a block of a caller's tensor to its format and record it (input-borne NaN/inf show here).

        A tensor already in the format's dtype is taken as it is when rounding cannot change it (IEEE
        overflow and kept subnormals: every rounding mode leaves a value of the format unchanged) and
        draws no random numbers (stochastic rounding does, and the run's stream must not shift).
        """
        if self.fused is not None:
            return self.fused.load(name, a, ar)
        spec = ar.spec
        if (self.sources.get(name) == ar.fmt.dtype and spec.overflow == "ieee" and spec.subnormals == "keep"
                and spec.rounding != "stochastic" and name not in self.overrides):
            value = self.carried(np.asarray(a), ar)
            return self.record(name, ar, value, value, self.tally())
        return self.rec(name, ar, a)  # rec returns it in this run's carrier

    def param(self, v: np.ndarray) -> np.ndarray:
        return self.params.round(v)

    def record(self, name: str, ar: Arith, value: np.ndarray, wide: np.ndarray, tally: Tally,
               negative: bool = False) -> np.ndarray:
        """Record a stage (a value computed in one or many steps, with ``wide`` its float64 value before the
        last rounding) and return what flows downstream: the value, or the override given for ``name``."""
        if name in self.overrides:  # (overrides run in float64 carriers: see carrier_for)
            value = np.broadcast_to(np.asarray(self.overrides[name], dtype=np.float64), np.shape(value)).copy()
        self.trace.record(name, value, ar.fmt, wide=wide, tally=tally, check_negative=negative)
        return value

    def div(self, a: np.ndarray, b: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        """a / b in the accumulator format by the policy's division method."""
        pol = self.policy
        return divide(a, b, self.acc, method=pol.division, recip_method=pol.recip, newton=pol.recip_newton,
                      form=pol.newton_form, bits=pol.recip_bits, tally=tally)

    def _rsqrt_options(self) -> dict[str, Any]:
        pol = self.policy
        estimate = pol.rsqrt not in ("exact", "sqrt_div", "ascend950")
        return dict(method=pol.rsqrt if estimate else "exact", newton=pol.rsqrt_newton, form=pol.newton_form,
                    constant=pol.rsqrt_constant, bits=pol.rsqrt_bits)

    def sqrt(self, name: str, v: np.ndarray) -> np.ndarray:
        """sqrt(v) in the accumulator format by the policy's sqrt method, recorded as ``name``."""
        opts = self._rsqrt_options()
        t = self.tally()
        if self.policy.sqrt == "eigen_fast":  # the packet path on whole packets of channels, the scalar on the rest
            value = np.where(self.packets(), sqrt_eigen_fast(v, self.acc, tally=t), self.acc.sqrt(v, t))
        else:
            value = nsqrt(v, self.acc, method=self.policy.sqrt, rsqrt_method=opts.pop("method"), tally=t, **opts)
        with np.errstate(all="ignore"):
            return self.record(name, self.acc, value, np.sqrt(v), t)

    def rstd(self, var_eps: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """rstd (and std when the method forms it) from var + eps, in the accumulator format."""
        acc, pol = self.acc, self.policy
        if pol.rstd_format is not None:  # formed in a wider format, then rounded (PyTorch CPU: in double); the
            # formulas then take γ·rstd, not γ/σ
            wide_run = KernelRun(pol.with_options(accumulate=pol.rstd_format, rstd_format=None), self.c, self.rng,
                            RunSetting(counting=self.counting))
            return self.rec("rstd", acc, wide_run.rstd(var_eps)[0]), None
        with np.errstate(all="ignore"):
            ideal = 1.0 / np.sqrt(var_eps)
            if pol.rsqrt == "sqrt_div":
                std = self.sqrt("std", var_eps)
                t = self.tally()
                return self.record("rstd", acc, self.div(np.ones_like(std), std, t), ideal, t), std
            t = self.tally()
            if pol.rsqrt == "sqrt_recip":  # sqrt(1/(var + eps))
                t = self.tally()
                recip = self.record("recip_var", acc, acc.div(np.ones_like(var_eps), var_eps, t), 1.0 / var_eps, t)
                return self.sqrt("rstd", recip), None
            if pol.rsqrt == "ascend950":
                return self.record("rstd", acc, rsqrt_ascend950(var_eps, acc, tally=t), ideal, t), None
            value = nrsqrt(var_eps, acc, tally=t, **self._rsqrt_options())
            if self.vector_rows is not None and self.vector_rows < self.c:  # the scalar path: sqrt, then divide
                v = self.vector_rows
                scalar = acc.div(np.ones(self.c), acc.sqrt(var_eps))  # (its events are not the kernel's: uncounted)
                value = np.concatenate([value[:v], scalar[v:]])
            return self.record("rstd", acc, value, ideal, t), None

    def normalise(self, xs: np.ndarray, mean: np.ndarray, rstd: np.ndarray, std: np.ndarray | None,
                  gamma: np.ndarray, beta: np.ndarray) -> np.ndarray | None:
        """y in the storage format from x, per-channel mean/rstd and the affine parameters (None when the
        compiled route wrote it to its destination)."""
        pol, comp = self.policy, self.comp
        at = len(self.trace.stages)  # x_compute comes first
        xc = xs if self.fused is not None else self.cast("x_compute", xs, pol.storage, comp)
        with np.errstate(all="ignore"):
            cols = self._coefficients(mean, rstd, std, gamma, beta)
            if self.fused is not None:
                self.fused.normalise(xs, pol.y_formula, cols, at)
                return None
            c = [self.col(comp, v) for v in cols]

            def mac(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:
                """Record a*b + d as the 'affine' stage, fused or as two roundings."""
                if pol.fma:
                    return self.rec("affine", comp, fma_wide(a, b, d, native=comp.native))
                t = self.tally()
                prod = comp.mul(a, b, t)
                return self.op("affine", comp, np.add, prod, d, tally=t)

            if pol.y_formula == "xhat":
                centered = self.op("centered", comp, np.subtract, xc, c[0])
                xhat = self.op("xhat", comp, np.multiply, centered, c[1])
                affine = mac(xhat, c[2], c[3])
            elif pol.y_formula == "scale":
                centered = self.op("centered", comp, np.subtract, xc, c[0])
                affine = mac(centered, c[1], c[2])
            else:  # affine
                affine = mac(xc, c[0], c[1])
            return self.output("y", self.out, affine)

    def _coefficients(self, mean: np.ndarray, rstd: np.ndarray, std: np.ndarray | None, gamma: np.ndarray,
                      beta: np.ndarray) -> tuple[np.ndarray, ...]:
        """The per-channel values the y formula applies to x (recording those it computes):
        xhat (mean, rstd, gamma, beta), scale (mean, w, beta), affine (mult, addend)."""
        pol, acc = self.policy, self.acc
        ga, ba = acc.round(gamma), acc.round(beta)
        if pol.y_formula == "xhat":
            return mean, rstd, gamma, beta
        if pol.y_formula == "affine_mr":  # (from rstd whatever formed it: Paddle's kernels have no σ)
            t = self.tally()
            w = self.rec("mult", acc, acc.mul(rstd, ga, t), t)
            t = self.tally()
            addend = self.rec("addend", acc, ba - acc.mul(acc.mul(mean, rstd, t), ga, t), t)
            return w, addend
        if std is not None:
            t = self.tally()
            w = self.record("w" if pol.y_formula == "scale" else "mult", acc, self.div(ga, std, t), ga / std, t)
        else:
            w = self.rec("w" if pol.y_formula == "scale" else "mult", acc, ga * rstd)
        if pol.y_formula == "scale":
            return mean, w, beta
        if pol.fma:
            addend = self.rec("addend", acc, fma_wide(-w, mean, ba, native=acc.native))
        else:
            t = self.tally()
            addend = self.rec("addend", acc, ba - acc.mul(w, mean, t), t)
        return w, addend


class _Blocks:
    """Runs a kernel core over channel blocks so memory stays bounded, and assembles the results.

    Channels are independent in BatchNorm, so the blocks give bit-identical
    results to one pass (stochastic rounding draws from one seeded stream).
    """

    def __init__(self, policy: Policy, lay: Layout, execution: Execution, meta: dict[str, Any],
                 sources: dict[str, np.ndarray] | None = None) -> None:
        keep_arrays = execution.keep_arrays and execution.counters  # (no trace: no arrays to keep either)
        overrides = execution.overrides
        self.policy, self.lay = policy, lay
        self.overrides = overrides or {}
        self.compiled = compiled_route(policy, keep_arrays, overrides, int(np.prod(lay.shape, dtype=np.int64)))
        chunk_elements = execution.chunk_elements
        if self.compiled and chunk_elements == DEFAULT_CHUNK_ELEMENTS:
            chunk_elements = COMPILED_CHUNK_ELEMENTS
        self.slices = lay.chunks(chunk_elements)
        self.rng = np.random.default_rng(policy.seed)
        self.meta = {"policy": policy.name, "policy_detail": policy.to_dict(), "shape": lay.shape,
                     "layout": lay.layout, "channels": lay.channels, "reduce_size": lay.reduce_size,
                     "channel_blocks": len(self.slices), **meta}
        self.traces: list[Trace] = []
        carrier = carrier_for(policy, keep_arrays, overrides)
        self.setting = RunSetting(keep_arrays, execution.counters, carrier,
                                {k: np.asarray(v).dtype for k, v in (sources or {}).items()}, self.compiled,
                                int(np.prod(lay.shape[2:], dtype=np.int64)) if lay.layout == "channels_first" else None,
                                lay.channels, int(lay.shape[0]), _call_shape(lay))
        self.meta["route"] = "compiled" if self.compiled else f"{np.dtype(carrier).name} carriers"
        self._views: dict[int, Source] = {}
        self._dest: Source | None = None

    def __iter__(self):
        for sl in self.slices:
            # overrides are channel-first, (C,) or (C, R): take this block's channels
            sub = {k: np.asarray(v)[sl] for k, v in self.overrides.items()}
            dest = self._dest.block(sl) if self._dest is not None else None
            run = KernelRun(self.policy, sl.stop - sl.start, self.rng, self.setting, overrides=sub, dest=dest,
                       first=sl.start)
            yield sl, run
            self.traces.append(run.trace)

    def trace(self) -> Trace:
        return Trace.concat(self.traces, self.meta)

    def source(self, a: np.ndarray, sl: slice, carrier: type) -> np.ndarray | Source:
        """A block of channels of a caller's tensor as the route takes it: a channel-first (k, R) copy, or
        (compiled) an (N, k, S) view of it."""
        if not self.compiled:
            return self.lay.to_cr(a, sl, carrier)
        src = self._views.get(id(a))
        if src is None:
            src = self._views[id(a)] = Source.of(self.lay.view3(a))
        return src.block(sl)

    def place(self, out: np.ndarray, block: np.ndarray | None, sl: slice) -> None:
        """Write a channel-first block into ``out`` (the compiled route wrote it already: None)."""
        if block is not None:
            self.lay.place(out, block, sl)

    def tensor(self, fmt: str) -> np.ndarray:
        """The call's output tensor (the compiled route writes y or dx straight into it)."""
        out = np.empty(self.lay.shape, dtype=get_format(fmt).dtype)
        if self.compiled:
            self._dest = Source.of(self.lay.view3(out))
        return out

    def vector(self, fmt: str) -> np.ndarray:
        return np.empty(self.lay.channels, dtype=get_format(fmt).dtype)


def batch_policy(pol: Policy) -> Policy:
    """``pol`` when a BatchNorm kernel runs it; a one-line refusal naming a choice only the family layers read."""
    defaults = {f.name: f.default for f in fields(Policy)}
    for name in FAMILY_ONLY:
        value = getattr(pol, name)
        if value != defaults[name]:
            raise BNProbeError(f"policy {name}={value} is a LayerNorm/RMSNorm/GroupNorm/InstanceNorm choice: a "
                               "BatchNorm kernel is not run with it")
    if pol.y_formula == "xhat_div" or pol.order == "lanes_tail":
        which = "y_formula=xhat_div" if pol.y_formula == "xhat_div" else "order=lanes_tail"
        raise BNProbeError(f"policy {which} is a LayerNorm/RMSNorm/GroupNorm/InstanceNorm choice: a BatchNorm "
                           "kernel is not run with it")
    return pol


def _check_train_size(lay: Layout, policy: Policy | None = None) -> None:
    if lay.reduce_size < 2 and (policy is None or policy.unbiased_r1 == "error"):
        raise BNProbeError(one_value_per_channel(lay.shape))


def forward_train(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    *,
    momentum: float | None = MOMENTUM,
    eps: float = EPS,
    policy: str | Policy = "fp32",
    num_batches_tracked: int = 0,
    execution: Execution = Execution(),
) -> TrainResult:
    """Training-mode BatchNorm: batch statistics, normalisation, running-stat update.

    Running statistics follow PyTorch: ``running = (1 - m)·running + m·batch`` with
    the unbiased variance (× R/(R−1)); ``momentum=None`` is the cumulative average
    with factor ``1/(num_batches_tracked + 1)``.  gamma/beta default to 1/0.  ``execution``: the layout of x, what
    the trace keeps, the block size and stage overrides (:class:`Execution`).
    """
    lay = layout_of(x, execution.layout)
    pol = batch_policy(get_policy(policy)).for_channels(lay.channels)
    _check_train_size(lay, pol)
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    if (running_mean is None) != (running_var is None):
        raise BNProbeError("give both running_mean and running_var, or neither")
    if int(num_batches_tracked) < 0:
        raise BNProbeError(f"num_batches_tracked must be >= 0, got {num_batches_tracked}")
    g = as_channel_vector("gamma", gamma, lay, 1.0)
    b = as_channel_vector("beta", beta, lay, 0.0)
    rm = as_channel_vector("running_mean", running_mean, lay, 0.0) if running_mean is not None else None
    rv = as_channel_vector("running_var", running_var, lay, 1.0) if running_var is not None else None

    blocks = _Blocks(pol, lay, execution, {"mode": "train", "eps": eps, "momentum": momentum}, {"x": x})
    y = blocks.tensor(pol.storage)
    pf = pol.params_format
    saved = {k: blocks.vector(pol.saved_format or pf if k in ("mean", "invstd", "var") else pf)
             for k in ("mean", "invstd", "var", "running_mean", "running_var")}
    nbt = int(num_batches_tracked) + 1
    for sl, run in blocks:
        out = _train_block(run, blocks.source(x, sl, run.carrier), g[sl], b[sl], None if rm is None else rm[sl],
                           None if rv is None else rv[sl], eps=eps, momentum=momentum, nbt=nbt,
                           r=lay.reduce_size)
        blocks.place(y, out.pop("y"), sl)
        for k, v in out.items():
            saved[k][sl] = v
    trace = blocks.trace()
    trace.meta["eps_effective"] = float(round_to(eps, pol.accumulate))
    return TrainResult(
        y=y, mean=saved["mean"], invstd=saved["invstd"], var=saved["var"],
        running_mean=saved["running_mean"] if rm is not None else None,
        running_var=saved["running_var"] if rv is not None else None,
        num_batches_tracked=nbt, trace=trace)


def _train_block(run: KernelRun, x: np.ndarray, g: np.ndarray, b: np.ndarray, rm: np.ndarray | None,
                 rv: np.ndarray | None, *, eps: float, momentum: float | None, nbt: int,
                 r: int) -> dict[str, np.ndarray]:
    """Training forward of one channel block (channel-first arrays); returns y and the statistics."""
    pol, acc = run.policy, run.acc
    out: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        xs = run.load("x", x, run.storage)
        gp, bp = run.param(g), run.param(b)
        xa = run.cast("x_acc", xs, pol.storage, acc)
        # (inductor's forward statistics: their per-channel work has ops enough to be vectorised for any count of
        # channels, so only the ratio of the loops' ranges keeps them apart: no scalar threshold)
        method = MomentsMethod(pol.variance, pol.order, pol.lanes, pol.tiles, pol.kahan, pol.mean_by, pol.clamp_var,
                               pol.unroll, run.inductor_cores(r, 0), pol.sum_format)
        sums = None if run.fused is None else run.fused.sums(r)
        if pol.threads is not None and pol.order != "inductor":
            # (split across threads; PyTorch's fp32 kernel has a branch of its own for R ≤ T)
            wide = run.wide_sums()
            sums = ThreadSums(acc, pol.threads if wide is None else small_batch_threads(pol.threads, r, run.channels),
                              wide, pol.variance_fma, pol.thread_split, run.samples)
        m = moments(xa, acc, method, rng=run.rng, row=run.order_rows(), vector_rows=run.vector_rows,
                    overrides=run.overrides, wide_sums=run.trace.keep_arrays, sums=sums, channels=run.channels)
        for sv in m.stages:
            run.trace.record(sv.name, sv.value, sv.arith.fmt, wide=sv.wide, tally=sv.tally,
                             check_negative=sv.check_negative)
        mean, var = m.mean, m.var
        ea = acc if pol.rstd_format is None else Arith(pol.rstd_format, pol.spec, run.rng, counting=run.counting)
        var_eps = run.rec("var_eps", ea, var + float(ea.round(eps)), negative=True)
        rstd, std = run.rstd(var_eps)
        if pol.stored_stats:  # y from the statistics as stored (params format), not as computed
            out["y"] = run.normalise(xs, run.params.round(mean), run.params.round(rstd), None, gp, bp)
        else:
            out["y"] = run.normalise(xs, mean, rstd, std, gp, bp)
        if rm is not None and rv is not None:
            # the update's arithmetic: in the accumulator format, or where the policy says (a narrow port)
            ru = acc if pol.running_format is None else Arith(pol.running_format, pol.spec, run.rng,
                                                              counting=run.counting)
            if momentum is not None and pol.running_momentum == "old":  # m weighs the old value (flax, Keras)
                f_a, keep_a = ru.round(1.0 - momentum), ru.round(momentum)
            elif momentum is not None and pol.running_momentum == "keep":  # k = 1 - m a float32 attribute (Paddle)
                keep_a = ru.round(round_to(1.0 - momentum, "fp32"))
                f_a = ru.round(1.0 - keep_a)
            else:
                f = momentum if momentum is not None else 1.0 / nbt
                f_a, keep_a = ru.round(f), ru.round(1.0 - f)
            if pol.running_var == "biased":
                var_unbiased = var
            elif r > 1 and pol.unbiased_by == "momentum_factor":
                var_unbiased = None  # (not formed: the batch term is (m·fl(R/(R-1)))·var, below)
            elif r > 1 and pol.unbiased_by == "divide" and (q := _sum_sq_dev(m)) is not None:
                if pol.mean_by == "prescaled":  # (the recorded sum is of the prescaled squares: Σ·2^-k)
                    q = q * 2.0 ** prescale_exponent(r)
                var_unbiased = run.rec("var_unbiased", ru, ru.round(q) / (r - 1))  # Σ(x - mean)² / (R - 1)
            elif r > 1:
                var_unbiased = run.rec("var_unbiased", ru, ru.round(var) * ru.round(r / (r - 1)))
            else:  # R = 1: the policy says (TBE takes the factor as 0, BatchNormV3 gives NaN)
                var_unbiased = run.rec("var_unbiased", ru, var * (0.0 if pol.unbiased_r1 == "zero" else float("nan")))
            for name, old, batch in (("running_mean", rm, mean), ("running_var", rv, var_unbiased)):
                t = run.tally()
                old_a = ru.round(run.param(old))
                if batch is None:  # momentum_factor: (m · fl(R/(R-1))) · var, R and R - 1 converted exactly
                    term_b = ru.mul(ru.mul(f_a, ru.div(float(r), float(r - 1), t), t), ru.round(var), t)
                    upd = ru.round(ru.mul(keep_a, old_a, t) + term_b, t)
                elif name == "running_var" and pol.running_var_sum is not None:
                    wide = Arith(pol.running_var_sum, pol.spec, run.rng, counting=run.counting)
                    term = wide.add(ru.mul(keep_a, old_a, t), wide.mul(f_a, ru.round(batch), t), t)
                    upd = ru.round(term, t)
                else:
                    upd = ru.round(ru.mul(keep_a, old_a, t) + ru.mul(f_a, ru.round(batch), t), t)
                out[name] = run.rec(name, run.params, upd, t)
        par = run.params if pol.saved_format is None else Arith(pol.saved_format, pol.spec, run.rng,
                                                                  counting=run.counting)
        out["mean"], out["invstd"], out["var"] = par.round(mean), par.round(rstd), par.round(var)
    return out


def _sum_sq_dev(m: Any) -> np.ndarray | None:
    """Σ(x - mean)² as the moments computed it (two-pass: its sum; Welford, Chan: M2), or None (one-pass)."""
    return next((sv.value for sv in m.stages if sv.name in ("sum_sq_dev", "m2")), None)


def forward_infer(
    x: np.ndarray,
    gamma: np.ndarray | None,
    beta: np.ndarray | None,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    *,
    eps: float = EPS,
    policy: str | Policy = "fp32",
    execution: Execution = Execution(),
) -> InferResult:
    """Inference-mode BatchNorm: normalise with the running statistics (``execution``: see :class:`Execution`)."""
    lay = layout_of(x, execution.layout)
    pol = batch_policy(get_policy(policy)).for_channels(lay.channels)
    eps = check_eps(eps)
    g = as_channel_vector("gamma", gamma, lay, 1.0)
    b = as_channel_vector("beta", beta, lay, 0.0)
    rm = as_channel_vector("running_mean", running_mean, lay)
    rv = as_channel_vector("running_var", running_var, lay)
    # a kernel whose inference has its own formula (a folded y = A·x + B, whatever its training does); one that forms
    # the batch statistics' rstd in a wider format (rstd_format) forms the running ones' in its accumulator, and
    # takes γ·rstd, not γ/σ (PyTorch's CPU kernel)
    times_rstd = pol.rstd_format is not None
    if pol.infer_y_formula is not None or times_rstd or pol.infer_rsqrt is not None:
        pol = pol.with_options(y_formula=pol.infer_y_formula or pol.y_formula, infer_y_formula=None, rstd_format=None,
                               rsqrt=pol.infer_rsqrt or pol.rsqrt, infer_rsqrt=None)
    blocks = _Blocks(pol, lay, execution, {"mode": "infer", "eps": eps}, {"x": x})
    y = blocks.tensor(pol.storage)
    for sl, run in blocks:
        acc = run.acc
        with np.errstate(all="ignore"):
            xs = run.load("x", blocks.source(x, sl, run.carrier), run.storage)
            mean = acc.round(run.param(rm[sl]))
            var = acc.round(run.param(rv[sl]))
            var_eps = run.rec("var_eps", acc, var + float(acc.round(eps)), negative=True)
            rstd, std = run.rstd(var_eps)
            blocks.place(y, run.normalise(xs, mean, rstd, None if times_rstd else std, run.param(g[sl]),
                                          run.param(b[sl])), sl)
    trace = blocks.trace()
    trace.meta["eps_effective"] = float(round_to(eps, pol.accumulate))
    return InferResult(y=y, trace=trace)


def backward(
    dy: np.ndarray,
    x: np.ndarray,
    gamma: np.ndarray | None,
    saved_mean: np.ndarray,
    saved_invstd: np.ndarray,
    *,
    policy: str | Policy = "fp32",
    training: bool = True,
    saved_var: np.ndarray | None = None,
    eps: float = EPS,
    execution: Execution = Execution(),
) -> BackwardResult:
    """Gradients dx, dgamma, dbeta of BatchNorm.

    training=True differentiates through the batch statistics (``saved_mean`` /
    ``saved_invstd`` from the forward); training=False treats them as constants
    (pass the running mean and 1/sqrt(running_var + eps)).  The policy's
    ``backward_formula`` picks the standard form or Ascend's BNTrainingReduceGrad
    form; the latter recomputes sigma = sqrt(saved_var + eps) when ``saved_var``
    is given (as the TBE kernels do), else uses sigma = 1/invstd.  ``execution``: see :class:`Execution`.
    """
    lay = layout_of(x, execution.layout)
    pol = batch_policy(get_policy(policy)).for_channels(lay.channels)
    if pol.backward_lanes is not None:  # the backward's sums in lanes of their own
        pol = pol.with_options(lanes=pol.backward_lanes, backward_lanes=None)
    if np.shape(dy) != lay.shape:
        raise BNProbeError(f"dy has shape {np.shape(dy)} but x has shape {lay.shape}")
    if training:
        _check_train_size(lay, pol)
    g = as_channel_vector("gamma", gamma, lay, 1.0)
    mu = as_channel_vector("saved_mean", saved_mean, lay)
    inv = as_channel_vector("saved_invstd", saved_invstd, lay)
    sv = as_channel_vector("saved_var", saved_var, lay) if saved_var is not None else None
    eps = check_eps(eps)
    blocks = _Blocks(pol, lay, execution, {"mode": "backward", "training": training, "eps": eps},
                     {"x": x, "dy": dy})
    dx = blocks.tensor(pol.storage)
    dgamma, dbeta = blocks.vector(pol.params_format), blocks.vector(pol.params_format)
    for sl, run in blocks:
        out = _backward_block(run, blocks.source(dy, sl, run.carrier), blocks.source(x, sl, run.carrier), g[sl],
                              mu[sl], inv[sl], None if sv is None else sv[sl], eps=eps, training=training,
                              r=lay.reduce_size)
        blocks.place(dx, out["dx"], sl)
        dgamma[sl], dbeta[sl] = out["dgamma"], out["dbeta"]
    return BackwardResult(dx=dx, dgamma=dgamma, dbeta=dbeta, trace=blocks.trace())


def _backward_block(run: KernelRun, dy: np.ndarray | Source, x: np.ndarray | Source, g: np.ndarray, mu: np.ndarray,
                    inv: np.ndarray, sv: np.ndarray | None, *, eps: float, training: bool,
                    r: int) -> dict[str, np.ndarray | None]:
    """Backward of one channel block (channel-first arrays; dx is None when the compiled route wrote it)."""
    pol, acc, comp = run.policy, run.acc, run.comp
    if pol.backward_formula == "torch" and training:
        return _backward_torch(run, dy, x, g, mu, inv, r)
    if pol.backward_formula in ("paddle", "onednn") and training:
        return _backward_framework(run, dy, x, g, mu, inv, r)
    if pol.backward_formula == "inductor":
        return _backward_inductor(run, dy, x, g, mu, inv, r, training)
    if pol.backward_formula == "onednn_jit":
        return _backward_onednn_jit(run, dy, x, g, mu, inv, r, training)
    if pol.backward_formula == "tf_eigen":
        return _backward_tf_eigen(run, dy, x, g, mu, sv, r, training, eps)
    if pol.backward_formula == "keras_tf":
        return _backward_keras_tf(run, dy, x, g, mu, inv, r, training)
    if pol.backward_formula == "jax":
        return _backward_jax(run, dy, x, g, (mu, inv, sv), eps=eps, training=training, r=r)
    with np.errstate(all="ignore"):
        first = None if run.fused is None else run.fused.backward_first(dy, x, mu, inv)
        if first is not None:  # loads, centered, xhat and both sums in one compiled pass, nothing stored
            mean, invstd, sums, tallies = first
            ga = acc.round(run.param(g))
            sum_dy = run.rec("sum_dy", acc, sums[:, 0], run.fused.tally(run.tally(), tallies[:, 0]))
            sum_dy_xhat = run.rec("sum_dy_xhat", acc, sums[:, 1], run.fused.tally(run.tally(), tallies[:, 1]))
        else:
            dys, ga, mean, invstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
            if run.fused is not None:
                xhat = run.fused.center_scale(xc, mean, invstd)
            else:
                centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
                xhat = run.op("xhat", comp, np.multiply, centered, run.col(comp, invstd))
            dya = run.cast("dy_acc", dys, pol.storage, acc)
            t = run.tally()
            sum_dy = run.rec("sum_dy", acc, run.reduce(dya, t), t)
            t = run.tally()
            sum_dy_xhat = run.rec("sum_dy_xhat", acc, run.reduce(dya, t, times=xhat), t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, sum_dy_xhat)
        formula, cols = _dx_coefficients(run, ga, mean, invstd, sum_dy, sum_dy_xhat, sv, eps=eps,
                                         training=training, r=r)
        if first is not None:
            run.fused.dx_source(dy, x, mean, invstd, formula, cols)
            return {"dx": None, "dgamma": dgamma, "dbeta": dbeta}
        if run.fused is not None:
            run.fused.dx(formula, dyc, xhat, xc, cols)
            return {"dx": None, "dgamma": dgamma, "dbeta": dbeta}
        c = [run.col(comp, v) for v in cols]
        t = run.tally()
        if formula == "constant":
            d = dyc
        elif formula == "standard":
            d = comp.sub(dyc, c[0], t)
            d = comp.sub(d, comp.mul(xhat, c[1], t), t)
        else:  # ascend: BNTrainingReduceGrad
            d = comp.add(dyc, comp.mul(xc, c[0], t), t)
            d = comp.add(d, c[1], t)
        dx_c = run.op("dx_compute", comp, np.multiply, d, c[-1], tally=t)
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _backward_loads(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray,
                    inv: np.ndarray) -> tuple[np.ndarray, ...]:
    """The backward's inputs as its numpy route takes them: dy in storage; γ, the mean and invstd in the accumulator
    (from the parameter format); x and dy in the compute format.  (dys, γ, mean, invstd, x_compute, dy_compute)"""
    pol, acc, comp = run.policy, run.acc, run.comp
    dys = run.load("dy", dy, run.storage)
    xs = run.load("x", x, run.storage)
    ga = acc.round(run.param(g))
    mean = acc.round(run.param(mu))
    invstd = acc.round(run.param(inv))
    xc = run.cast("x_compute", xs, pol.storage, comp)
    dyc = run.cast("dy_compute", dys, pol.storage, comp)
    return dys, ga, mean, invstd, xc, dyc


def _backward_torch(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                    r: int) -> dict[str, np.ndarray | None]:
    """PyTorch CPU's training backward (``backward_formula=torch``): Σdy and Σ(x − mean)·dy in the policy's order
    (fused as ``backward_fma`` says), plane by plane (``backward_sums=plane_reduce``, the planes added in
    ``sum_format``) or split across threads (``threads``); dγ = Σ(x − mean)dy·invstd (in the sums' format),
    k = fl(Σ(x − mean)dy)·invstd·invstd / R, and dx = (((dy − Σdy/R) − (x − mean)·k)·invstd)·γ with the subtraction
    of the product fused as ``dx_fma`` says, every step rounded in the compute format."""
    pol, acc, comp = run.policy, run.acc, run.comp
    with np.errstate(all="ignore"):
        dys, ga, mean, invstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
        centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        planes = pol.backward_sums == "plane_reduce"
        # the sums' format: the planes' results are added in sum_format (PyTorch's fp32 kernel: double)
        into = acc if not planes or pol.sum_format in (None, acc.fmt.name) else \
            Arith(pol.sum_format, pol.spec, run.rng, counting=run.counting)
        t = run.tally()
        if planes:
            sum_dy = plane_reduce(dya, acc, lanes=pol.lanes, row=run.row, into=into, tally=t)
        else:
            sum_dy = run.reduce(dya, t)
        sum_dy = run.rec("sum_dy", into, sum_dy, t)
        t = run.tally()
        if planes:
            dot = plane_reduce(acc.round(centered), acc, lanes=pol.lanes, row=run.row, times=dya,
                               fused=pol.backward_fma, into=into, tally=t)
        elif pol.backward_fma == "none":
            dot = run.reduce(dya, t, times=centered)
        elif pol.threads is not None:
            dot = run.reduce(centered, t, times=dya, fused=True)
        else:
            dot = vec_dot(np.asarray(centered, dtype=np.float64), np.asarray(dya, dtype=np.float64), acc,
                          lanes=pol.lanes, unroll=pol.unroll, row=run.row,
                          fused_body=pol.backward_fma in ("body", "all"),
                          fused_tail=pol.backward_fma in ("tail", "all"), tally=t)
        dot = run.rec("sum_dy_centered", into, dot, t)
        t = run.tally()
        dg = run.record("dgamma_acc", into, into.mul(dot, invstd, t), dot * invstd, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        t = run.tally()
        # k from the sum rounded to the accumulator (PyTorch: (float) dotp * invstd * invstd / N)
        dg_acc = dg if into is acc else acc.mul(acc.round(dot, t), invstd, t)
        k = run.record("k", acc, acc.div(acc.mul(dg_acc, invstd, t), float(r), t), dg_acc * invstd / r, t)
        t = run.tally()
        mean_dy = acc.div(sum_dy, float(r), t) if into is acc else acc.round(into.div(sum_dy, float(r), t), t)
        mean_dy = run.record("mean_dy", acc, mean_dy, sum_dy / r, t)
        t = run.tally()
        d = comp.sub(dyc, run.col(comp, mean_dy), t)
        d = _dx_projection(run, d, centered, run.col(comp, k), t)
        d = comp.mul(d, run.col(comp, invstd), t)
        dx_c = run.op("dx_compute", comp, np.multiply, d, run.col(comp, ga), tally=t)
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _dx_projection(run: KernelRun, d: np.ndarray, centered: np.ndarray, k: np.ndarray, tally: Tally) -> np.ndarray:
    """d − (x − mean)·k in the compute format: one fused multiply-add, or a rounded product then a subtraction, per
    channel as the policy's ``dx_fma`` says (body: the channels in full vectors of lanes x unroll across a
    channels-last row; tail: the others)."""
    comp, how = run.comp, run.policy.dx_fma
    fused = plain = None
    tf, tp = Tally(run.c), Tally(run.c)
    if how != "none":
        fused = comp.round(fma_wide(-np.asarray(centered, dtype=np.float64), k, d), tf)
    if how != "all":
        plain = comp.sub(d, comp.mul(centered, k, tp), tp)
    if fused is None or plain is None:
        tally.merge(tf if plain is None else tp)
        return fused if plain is None else plain
    block = run.policy.lanes * run.policy.unroll
    body = np.arange(run.first, run.first + run.c) < run.channels - run.channels % block
    use = body if how == "body" else ~body
    for name in tally.counts:
        tally.counts[name] += np.where(use, tf.counts[name], tp.counts[name])
    return np.where(use[:, None], fused, plain)
def _backward_inductor(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                       r: int, training: bool) -> dict[str, np.ndarray | None]:
    """torch.compile's backward (``backward_formula=inductor``, see :data:`~bnprobe.kernels.policy.BACKWARD_FORMULAS`):
    Σdy and Σ(x − mean)·dy (the products rounded) in the policy's order, every other step rounded in the
    accumulator format, 1/R the double rounded once."""
    pol, acc = run.policy, run.acc
    with np.errstate(all="ignore"):
        dys, ga, mean, invstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
        xa = run.cast("x_acc", xc, pol.compute, acc)
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        centered = run.op("centered", acc, np.subtract, xa, run.col(acc, mean))
        # (its per-channel work loads the saved statistics: a vector of 32 16-bit values, a quarter of it 8)
        cores = run.inductor_cores(r, 8 if (pol.saved_format or pol.params_format) in ("fp16", "bf16") else 4)
        t = run.tally()
        sum_dy = run.rec("sum_dy", acc, run.reduce(dya, t, cores=cores), t)
        t = run.tally()
        dot = run.rec("sum_dy_centered", acc, run.reduce(dya, t, times=centered, cores=cores), t)
        t = run.tally()
        dg = run.record("dgamma_acc", acc, acc.mul(dot, invstd, t), dot * invstd, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        t = run.tally()
        scale = run.record("scale", acc, acc.mul(invstd, ga, t), invstd * ga, t)
        if training:
            norm = acc.round(1.0 / r)
            t = run.tally()
            proj = run.record("proj_scale", acc, acc.mul(acc.mul(dot, norm, t), acc.mul(invstd, invstd, t), t),
                              dot * invstd * invstd / r, t)
            t = run.tally()
            mean_dy = run.record("mean_dy", acc, acc.mul(sum_dy, norm, t), sum_dy / r, t)
            t = run.tally()
            d = acc.sub(dya, acc.mul(centered, run.col(acc, proj), t), t)
            d = acc.sub(d, run.col(acc, mean_dy), t)
        else:
            d = dya
        dx_c = run.op("dx_compute", acc, np.multiply, d, run.col(acc, scale))
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _backward_framework(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                        r: int) -> dict[str, np.ndarray | None]:
    """The training backward of Paddle's and oneDNN's CPU kernels (``backward_formula`` paddle, onednn; see
    :data:`~bnprobe.kernels.policy.BACKWARD_FORMULAS`), every step rounded in the compute format (the per-channel
    ones in the accumulator's); Σdy is read from memory, the dot product is an expression's sum."""
    pol, acc, comp = run.policy, run.acc, run.comp
    with np.errstate(all="ignore"):
        dys, ga, mean, invstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
        centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        t = run.tally()
        sum_dy = run.rec("sum_dy", acc, run.reduce(dya, t), t)
        t = run.tally()
        paddle = pol.backward_formula == "paddle"
        # Paddle sums ((x - mean)·invstd)·dy and takes it as dγ; oneDNN sums (x - mean)·dy, then dγ = Σ·invstd
        xhat = run.op("xhat", comp, np.multiply, centered, run.col(comp, invstd)) if paddle else centered
        dot = run.rec("sum_dy_xhat" if paddle else "sum_dy_centered", acc, run.reduce(dya, t, times=xhat), t)
        t = run.tally()
        dg = dot if paddle else run.record("dgamma_acc", acc, acc.mul(dot, invstd, t), dot * invstd, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        t = run.tally()
        rows = r // run.row if run.row else 1  # N (and H·W = R / N)
        if paddle:  # s·((dy·N·HW − Σdy) − ((x − mean)·dγ)·invstd), s = (γ·invstd)/R
            s = run.record("scale", acc, acc.div(acc.mul(ga, invstd, t), float(r), t), ga * invstd / r, t)
            a = comp.mul(comp.mul(dyc, float(rows), t), float(r // rows), t)
            a = comp.sub(a, run.col(comp, sum_dy), t)
            b = comp.mul(comp.mul(centered, run.col(comp, dg), t), run.col(comp, invstd), t)
            dx_c = run.op("dx_compute", comp, np.multiply, run.col(comp, s), comp.sub(a, b, t), tally=t)
        else:  # (dy − (Σdy/R + (((x − mean)·dγ)·invstd)/R))·(γ·invstd)
            mean_dy = run.record("mean_dy", acc, acc.div(sum_dy, float(r), t), sum_dy / r, t)
            b = comp.div(comp.mul(comp.mul(centered, run.col(comp, dg), t), run.col(comp, invstd), t), float(r), t)
            d = comp.sub(dyc, comp.add(run.col(comp, mean_dy), b, t), t)
            scale = run.record("scale", acc, acc.mul(ga, invstd, t), ga * invstd, t)
            dx_c = run.op("dx_compute", comp, np.multiply, d, run.col(comp, scale), tally=t)
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _backward_onednn_jit(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                         r: int, training: bool) -> dict[str, np.ndarray | None]:
    """oneDNN's JIT batch normalisation backward (``backward_formula=onednn_jit``, see
    :data:`~bnprobe.kernels.policy.BACKWARD_FORMULAS`): each of the policy's threads (``threads``, dealt as
    ``thread_split`` says) sums dy and, by fused multiply-adds, (x − mean)·dy over each of its samples from zero, adds
    the sample's sum and its dot times rstd to its own; the threads' partials are added in order.  Every step rounded
    in the accumulator format; with the statistics taken as constants (``training=False``) dx = (dy·γ)·rstd."""
    pol, acc = run.policy, run.acc
    with np.errstate(all="ignore"):
        dys, ga, mean, invstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
        centered = run.op("centered", acc, np.subtract, xc, run.col(acc, mean))
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        cen, dyw = np.asarray(centered, dtype=np.float64), np.asarray(dya, dtype=np.float64)
        t = run.tally()
        s_len = r // (run.samples or 1)
        dot, sum_dy = np.zeros(run.c), np.zeros(run.c)
        for part in thread_blocks(r, pol.threads or 1, pol.thread_split, run.samples):
            p_dot, p_sum = np.zeros(run.c), np.zeros(run.c)
            start = part.start
            while start < part.stop:
                stop = min(part.stop, (start // s_len + 1) * s_len)  # (the rest of this sample)
                sl = slice(start, stop)
                p_sum = acc.add(p_sum, reduce_sum(dyw[:, sl], acc, order="sequential", tally=t), t)
                one = thread_sum(cen[:, sl], acc, threads=1, times=dyw[:, sl], fused=True, tally=t)
                p_dot = acc.add(p_dot, acc.mul(one, invstd, t), t)
                start = stop
            dot, sum_dy = acc.add(dot, p_dot, t), acc.add(sum_dy, p_sum, t)
        dg = run.record("dgamma_acc", acc, dot, dot, t)
        sum_dy = run.record("sum_dy", acc, sum_dy, sum_dy, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        t = run.tally()
        d = dyc
        if training:
            rf = float(r)
            k = acc.div(acc.mul(dg, invstd, t), rf, t)
            d = acc.sub(acc.sub(d, run.col(acc, acc.div(sum_dy, rf, t)), t), acc.mul(centered, run.col(acc, k), t), t)
        d = acc.mul(d, run.col(acc, ga), t)
        dx_c = run.op("dx_compute", acc, np.multiply, d, run.col(acc, invstd), tally=t)
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _backward_tf_eigen(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray,
                       sv: np.ndarray | None, r: int, training: bool, eps: float) -> dict[str, np.ndarray | None]:
    """TensorFlow's Eigen FusedBatchNormGrad (``backward_formula=tf_eigen``, see
    :data:`~bnprobe.kernels.policy.BACKWARD_FORMULAS`) and, with the statistics taken as constants, its
    FusedBatchNormFreezeGrad; every step rounded in the accumulator format, the sums TensorFlow's ReduceOuterDimensions
    on the policy's ``threads`` (:func:`~bnprobe.numerics.reduce.outer_dims_sum`)."""
    pol, acc = run.policy, run.acc
    if sv is None:
        raise BNProbeError("backward_formula=tf_eigen recomputes rsqrt from the saved variance: give saved_var")
    with np.errstate(all="ignore"):
        dys, ga, mean, _, xc, dyc = _backward_loads(run, dy, x, g, mu, np.ones_like(mu))
        var_eps = acc.add(acc.round(run.param(sv)), acc.round(eps))
        c0 = nrsqrt(var_eps, acc, method="rsqrtps", newton=1, form="eigen")
        if run.vector_rows is not None and run.vector_rows < run.c:  # the scalar path: sqrt, then divide
            v = run.vector_rows
            c0 = np.concatenate([c0[:v], acc.div(np.ones(run.c - v), acc.sqrt(var_eps[v:]))])
        c0 = run.record("rstd", acc, c0, 1.0 / np.sqrt(var_eps), run.tally())
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        centered = run.op("centered", acc, np.subtract, xc, run.col(acc, mean))
        t = run.tally()

        def total(v: np.ndarray, item_bytes: int = 4) -> np.ndarray:
            return outer_dims_sum(np.asarray(v, dtype=np.float64), acc, channels=run.channels,
                                  threads=pol.threads or 1, item_bytes=item_bytes, tally=t)

        sum_dy = run.record("sum_dy", acc, total(dya, get_format(pol.storage).itemsize), None, t)
        dot = total(acc.mul(dya, centered, t))
        if training:
            dg = total(acc.mul(dya, acc.mul(centered, run.col(acc, c0), t), t))
        else:
            dg = acc.mul(dot, c0, t)
        dg = run.record("dgamma_acc", acc, dg, None, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        t = run.tally()
        if training:
            ybar = acc.mul(sum_dy, acc.div(1.0, float(r), t), t)
            coef2 = acc.mul(acc.mul(c0, c0, t), acc.div(dot, float(r), t), t)
            d = acc.sub(acc.sub(dyc, run.col(acc, ybar), t), acc.mul(centered, run.col(acc, coef2), t), t)
            dx_c = run.op("dx_compute", acc, np.multiply, run.col(acc, acc.mul(ga, c0, t)), d, tally=t)
        else:
            dx_c = run.op("dx_compute", acc, np.multiply, dyc, run.col(acc, acc.mul(c0, ga, t)), tally=t)
        dx = run.output("dx", run.out, dx_c)
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _backward_keras_tf(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                       r: int, training: bool) -> dict[str, np.ndarray | None]:
    """TensorFlow's autodiff through Keras 3's BatchNormalization (``backward_formula=keras_tf``, see
    :data:`~bnprobe.kernels.policy.BACKWARD_FORMULAS`): every op of the gradient graph rounded in the accumulator
    format, its sums by the policy's order (the Sum ops' Eigen reductions); with the statistics taken as constants
    (the moving ones) only dy·inv reaches dx."""
    pol, acc = run.policy, run.acc
    with np.errstate(all="ignore"):
        dys, ga, mean, rstd, xc, dyc = _backward_loads(run, dy, x, g, mu, inv)
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        t = run.tally()
        sum_dy = run.rec("sum_dy", acc, run.reduce(dya, t), t)
        t = run.tally()
        dot = run.rec("sum_dy_x", acc, run.reduce(acc.mul(xc, dyc, t), t), t)
        t = run.tally()
        scale = acc.mul(rstd, ga, t)  # inv·γ, the forward's
        neg = -sum_dy
        grad_inv = acc.add(dot, acc.mul(mean, neg, t), t)
        dg = acc.mul(rstd, grad_inv, t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, dg)
        dx_c = acc.mul(dyc, run.col(acc, scale), t)
        if training:
            rf = float(r)
            g_r = acc.mul(grad_inv, ga, t)
            packet = acc.mul(acc.mul(-0.5, acc.mul(rstd, rstd, t), t), acc.mul(rstd, g_r, t), t)
            scalar = acc.mul(acc.mul(-0.5, acc.mul(g_r, rstd, t), t), acc.mul(rstd, rstd, t), t)
            v = run.c if run.vector_rows is None else run.vector_rows
            grad_var = np.concatenate([packet[:v], scalar[v:]])
            grad_var = np.where(g_r == 0, 0.0, grad_var)  # (RsqrtGrad: a zero gradient gives zero)
            centered = run.op("centered", acc, np.subtract, xc, run.col(acc, mean))
            d_var = acc.mul(run.col(acc, acc.mul(2.0, acc.div(grad_var, rf, t), t)), centered, t)
            d_mean = run.col(acc, acc.div(acc.mul(neg, scale, t), rf, t))
            dx_c = acc.add(acc.add(dx_c, d_mean, t), d_var, t)
        dx = run.output("dx", run.out, run.carried(acc.round(dx_c, t), acc))
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def _jax_statistics(run: KernelRun, xs: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """The batch statistics JAX's autodiff recomputes from x (flax saves none): the mean, var + ε, rstd by the
    policy's forward, and the derivative of the variance's clamp max(0, v) — 1 above 0, ½ at 0 (JAX's derivative
    of a tie), 0 below (1 everywhere without clamp_var)."""
    pol, acc = run.policy, run.acc
    xa = run.cast("x_acc", xs, pol.storage, acc)
    method = MomentsMethod(pol.variance, pol.order, pol.lanes, pol.tiles, pol.kahan, pol.mean_by, False,
                           pol.unroll, run.cores, pol.sum_format)
    m = moments(xa, acc, method, rng=run.rng, row=run.order_rows(), wide_sums=False)
    raw = m.var
    var, slope = raw, np.ones_like(raw)
    if pol.clamp_var:
        var = np.where(raw < 0, 0.0, raw)
        slope = np.where(raw > 0, 1.0, np.where(raw == 0, 0.5, 0.0))
    var_eps = run.rec("var_eps", acc, var + float(acc.round(eps)), negative=True)
    return m.mean, var_eps, run.rstd(var_eps)[0], slope


def _backward_jax(run: KernelRun, dy: np.ndarray, x: np.ndarray, g: np.ndarray,
                  saved: tuple[np.ndarray, np.ndarray, np.ndarray | None], *, eps: float, training: bool,
                  r: int) -> dict[str, np.ndarray | None]:
    """``backward_formula=jax``: the vjp JAX runs through flax's BatchNorm (eager: one rounding per primitive,
    per-channel values in the accumulator, elementwise ones in the compute format).  dβ = Σdy, dγ = rstd·Σ(x −
    mean)dy; in evaluation dx = dy·w with w = rstd·γ (from the given mean and invstd, or var + ε when a variance
    is given); in training, with the statistics recomputed (:func:`_jax_statistics`), u = dy·w,
    k₂ = ((Σ(x − mean)dy·γ)·(−½·rstd/(var + ε))·clamp')/R, k₁ = (−Σu − k₂·2mean)/R (each /R as mean_by says)
    and dx = (u + k₁) + k₂·2x — or, x stored narrower than computed, dx = fl(u) + fl(k₁ + k₂·2x), the sum in the
    storage format (flax casts each cotangent to x's dtype before adding them)."""
    pol, acc, comp = run.policy, run.acc, run.comp
    mu, inv, sv = saved
    with np.errstate(all="ignore"):
        dys = run.load("dy", dy, run.storage)
        xs = run.load("x", x, run.storage)
        ga = acc.round(run.param(g))
        slope = None
        if training:
            mean, var_eps, rstd, slope = _jax_statistics(run, xs, eps)
        else:
            mean = acc.round(run.param(mu))
            var_eps = None if sv is None else run.rec("var_eps", acc, acc.round(run.param(sv)) + float(acc.round(eps)))
            rstd = acc.round(run.param(inv)) if var_eps is None else run.rstd(var_eps)[0]
        xc = run.cast("x_compute", xs, pol.storage, comp)
        dyc = run.cast("dy_compute", dys, pol.storage, comp)
        dya = run.cast("dy_acc", dys, pol.storage, acc)
        w = run.rec("w", acc, ga * rstd)
        centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
        t = run.tally()
        sum_dy = run.rec("sum_dy", acc, run.reduce(dya, t), t)
        t = run.tally()
        dot = run.rec("sum_dy_centered", acc, run.reduce(dya, t, times=centered), t)
        dbeta = run.rec("dbeta", run.params, sum_dy)
        dgamma = run.rec("dgamma", run.params, acc.mul(rstd, dot))
        u = run.op("dy_w", comp, np.multiply, dyc, run.col(comp, w))
        if not training:
            return {"dx": run.output("dx", run.out, u), "dgamma": dgamma, "dbeta": dbeta}
        t = run.tally()
        neg_sum_u = -run.reduce(run.cast("dy_w_acc", u, pol.compute, acc), t)
        half = acc.mul(-0.5, acc.div(rstd, var_eps))
        lead = acc.mul(acc.mul(acc.mul(dot, ga), half), slope)  # dL/dE[x²]·R
        k2 = run.rec("k2", acc, per_count(lead, r, pol.mean_by, acc))
        k1 = run.rec("k1", acc, per_count(acc.add(neg_sum_u, acc.mul(-lead, acc.mul(2.0, mean))), r, pol.mean_by,
                                           acc))
        t = run.tally()
        two_x = comp.mul(2.0, xc, t)
        spread = comp.mul(run.col(comp, k2), two_x, t)
        if get_format(pol.storage).name == get_format(pol.compute).name:
            dx_c = run.op("dx_compute", comp, np.add, comp.add(u, run.col(comp, k1), t), spread, tally=t)
            dx = run.output("dx", run.out, dx_c)
        else:
            parts = run.out.round(u, t), run.out.round(comp.add(run.col(comp, k1), spread, t), t)
            dx = run.output("dx", run.out, run.out.add(*parts, t))
    return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}


def per_count(v: np.ndarray, count: int, mean_by: str, acc: Arith) -> np.ndarray:
    """v / count as the policy divides by R: one rounding (divide) or v·fl(1/R) (reciprocal)."""
    if mean_by == "divide":
        return acc.div(v, float(count))
    if mean_by == "reciprocal":
        return acc.mul(v, acc.round(1.0 / count))
    raise BNProbeError(f"backward_formula=jax divides by R as mean_by=divide or reciprocal do, not {mean_by}")


def _dx_coefficients(run: KernelRun, ga: np.ndarray, mean: np.ndarray, invstd: np.ndarray, sum_dy: np.ndarray,
                     sum_dy_xhat: np.ndarray, sv: np.ndarray | None, *, eps: float, training: bool,
                     r: int) -> tuple[str, tuple[np.ndarray, ...]]:
    """The dx formula and its per-channel values, recording those it computes: constant (statistics taken as
    constants: dy·scale), standard (mean_dy, mean_dy_xhat, scale) or ascend (mult, addend, scale)."""
    pol, acc = run.policy, run.acc
    if not training:
        return "constant", (run.rec("scale", acc, ga * invstd),)
    if pol.backward_formula == "standard":
        mean_dy = run.rec("mean_dy", acc, sum_dy / r)
        mean_dy_xhat = run.rec("mean_dy_xhat", acc, sum_dy_xhat / r)
        return "standard", (mean_dy, mean_dy_xhat, run.rec("scale", acc, ga * invstd))
    if sv is not None:
        var_eps = acc.add(acc.round(run.param(sv)), acc.round(eps))
        sigma = run.sqrt("std", var_eps)
    else:
        t = run.tally()
        sigma = run.record("std", acc, run.div(np.ones_like(invstd), invstd, t), 1.0 / invstd, t)
    dg_r = acc.div(sum_dy_xhat, float(r))
    db_r = acc.div(sum_dy, float(r))
    t = run.tally()
    mult = run.record("mult", acc, run.div(-dg_r, sigma, t), -dg_r / sigma, t)
    t = run.tally()
    addend = run.rec("addend", acc, acc.mul(run.div(mean, sigma, t), dg_r, t) - db_r, t)
    t = run.tally()
    scale = run.record("scale", acc, run.div(ga, sigma, t), ga / sigma, t)
    return "ascend", (mult, addend, scale)

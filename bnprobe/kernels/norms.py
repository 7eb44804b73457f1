"""Instrumented LayerNorm, RMSNorm, GroupNorm and InstanceNorm: the forward and the backward under a Policy, every
operation rounded as it says and every intermediate traced.

Each of these layers normalises groups of values by their own statistics: the rows of a ``(rows, R)`` view of x
(:class:`NormShape`).  LayerNorm and RMSNorm take a row per leading index over the normalised trailing dims,
GroupNorm a row per (sample, group) over the group's channels and positions, InstanceNorm a row per (sample,
channel) over its positions.  Their statistics are BatchNorm's statistics of that view, taken by the same numerics
(the sums' order and lanes, the variance algorithm, 1/R, ε, the inverse root: bnprobe.numerics) in the same
arithmetic contexts (:class:`~bnprobe.kernels.batchnorm.KernelRun`); what differs is where γ and β sit — per
element of the normalised shape, or per channel — and the formulas that apply them (``y_formula``):

==========  ==============================================  ==========================================
y_formula   LayerNorm, RMSNorm (γ per element)              GroupNorm, InstanceNorm (γ per channel)
==========  ==============================================  ==========================================
xhat        x̂ = (x − μ)·rstd; y = x̂·γ + β                    the same
scale       w = γ·rstd; y = (x − μ)·w + β                     the same
affine      a = x·rstd + (−μ·rstd); y = a·γ + β               m = γ·rstd; y = x·m + (β − m·μ)
            (PyTorch CPU's 16-bit LayerNorm)                  (PyTorch CPU's GroupNorm)
==========  ==============================================  ==========================================

RMSNorm has no mean (μ = 0; a β only where one is given): rstd = 1/√(mean(x²) + ε).  ``cast_point=before_gamma``
rounds x̂ to the storage format before γ multiplies it (HF Llama's RMSNorm: a second rounding).  A call's
``weight_offset`` applies γ as offset + w (Gemma's RMSNorm: 1 + w), formed in ``offset_format`` (default: the
compute format).

The defects bnprobe doctor names by (:mod:`bnprobe.checks.doctor.family_bugs`) are policies too: ``eps_format``
rounds ε before it is added, ``rstd_cast`` rounds rstd wherever it multiplies, ``grad_sum_format`` carries dγ's and
dβ's sums in a narrow format and ``threads`` splits those sums across per-thread buffers (PyTorch CPU LayerNorm's
backward); each row's statistics stay one thread's.

The backward is the standard one of each: g = dy·γ; dx = rstd·(g − Σg/R − x̂·Σ(g·x̂)/R) per row (RMSNorm without
Σg); dγ = Σ dy·x̂ and dβ = Σ dy over the values each parameter touches (the rows, for LayerNorm and RMSNorm; the
samples and positions of its channel, for GroupNorm and InstanceNorm), in the accumulator format.  Or
(``backward_formula=torch``) each layer's PyTorch CPU kernel as compiled: LayerNorm's dx = a·dy·γ + b·x + c with its
per-thread dγ/dβ buffers (``threads``, ``grad_sum_format``), GroupNorm's per-channel then per-group sums,
RMSNorm's autograd through its composite ops with ATen's sums (:mod:`bnprobe.numerics.rowwise`).  Their forwards
are policies of the same fields: RowwiseMoments is ``variance=rowwise`` (``lanes``; ``variance_fma`` its fp16 tail),
ATen's sum ``order=aten``.

Arrays are float64 carriers of their formats inside; outputs are returned in their formats' numpy dtypes, the
statistics per row (``(rows,)``), the parameters' gradients in γ's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from bnprobe.core.call import EPS
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels.batchnorm import KernelRun, RunSetting, per_count
from bnprobe.kernels.layout import FAMILY, NormShape, check_eps
from bnprobe.kernels.norms_compiled import backward_rows, forward_rows, numpy_route, takes_compiled
from bnprobe.kernels.policy import BACKWARD_FORMULAS, Policy, get_policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.arith import Arith, Tally, fma_wide
from bnprobe.numerics.inductor import CHANNEL_TILE, CHUNK, MIN_CHUNK, OUTER_RATIO, splits_rows
from bnprobe.numerics.reduce import (INDUCTOR_UNROLL_BELOW, Cores, buffered_sum, inductor_split_rows, reduce_sum,
                                     split_parts)
from bnprobe.numerics.rowwise import aten_column_sum, aten_sum, half_reduce, lane_sums, vec_reduce
from bnprobe.numerics.variance import INDUCTOR_TWO_PASS_MAX, MomentsMethod, moments

__all__ = ["FAMILY", "NormShape", "NormResult", "NormGradients", "forward", "backward", "check_family_policy"]

# Policy fields whose choices are BatchNorm kernels' own (their backward formulas, thread splits, code paths,
# inference forms): a family kernel is not run under a policy that sets one, rather than ignoring it
_BATCHNORM_ONLY = ("backward_fma", "backward_sums", "thread_split", "packet_lanes",
                   "path_channels", "stored_stats", "core_parts", "dx_fma", "infer_y_formula",
                   "infer_rsqrt", "backward_lanes")
#: the backward formulas a family kernel runs: the standard one, each layer's PyTorch CPU kernel (torch), or
#: torch.compile's (inductor: each layer's decomposition as TorchInductor generates it on the CPU)
FAMILY_BACKWARDS = ("standard", "torch", "inductor")
_DEFAULTS = {f.name: f.default for f in fields(Policy)}
#: inductor's config.realize_reads_threshold: a pointwise value reading more inputs than this is stored, not
#: recomputed inside the kernels that read it
_REALIZE_READS = 4


def check_family_policy(pol: Policy) -> Policy:
    """``pol`` when a family kernel runs it; a one-line refusal naming the first BatchNorm-only choice it sets."""
    for name in _BATCHNORM_ONLY:
        if getattr(pol, name) != _DEFAULTS[name]:
            raise BNProbeError(f"policy {name}={getattr(pol, name)!r} is a BatchNorm kernel's choice: LayerNorm, "
                               "RMSNorm, GroupNorm and InstanceNorm are not run with it")
    if pol.y_formula == "xhat_div" and (pol.rsqrt != "sqrt_div" or pol.rstd_format is not None):
        raise BNProbeError("policy y_formula=xhat_div divides by σ: give rsqrt=sqrt_div (and no rstd_format), which "
                           "forms it")
    bad = {"y_formula": ("affine_mr",), "sqrt": ("eigen_fast",), "order": ("xla",),
           "mean_by": ("prescaled",),
           "backward_formula": tuple(f for f in BACKWARD_FORMULAS if f not in FAMILY_BACKWARDS)}
    for name, values in bad.items():
        if getattr(pol, name) in values:
            raise BNProbeError(f"policy {name}={getattr(pol, name)} is a BatchNorm kernel's choice: LayerNorm, "
                               "RMSNorm, GroupNorm and InstanceNorm are not run with it")
    return pol


@dataclass(frozen=True)
class NormResult:
    """A family layer's forward: y, and per row the mean (None for RMSNorm), rstd and the variance (RMSNorm: the
    mean square) as saved (``saved_format``, default the parameters'); ``trace`` holds the per-row stages and
    ``param_trace`` those shaped as γ."""

    y: np.ndarray
    mean: np.ndarray | None
    rstd: np.ndarray
    var: np.ndarray
    trace: Trace
    param_trace: Trace


@dataclass(frozen=True)
class NormGradients:
    """A family layer's backward: dx, and dγ and dβ in γ's shape (dβ None where the layer has no β)."""

    dx: np.ndarray
    dgamma: np.ndarray
    dbeta: np.ndarray | None
    trace: Trace
    param_trace: Trace


def _parameter(name: str, value: Any, shape: NormShape, default: float | None) -> np.ndarray | None:
    """γ or β as a flat float64 vector of ``shape.param_shape``'s size (``default`` everywhere when None)."""
    if value is None:
        return None if default is None else np.full(math.prod(shape.param_shape), default, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    if v.shape != shape.param_shape and not (v.ndim == 1 and v.size == math.prod(shape.param_shape)):
        raise BNProbeError(f"{name} must have shape {list(shape.param_shape)}, got {list(v.shape)}")
    return v.reshape(-1)


class _Kernel:
    """One family call's arithmetic: the per-row run (its statistics and elementwise stages) and the trace of the
    stages shaped as γ."""

    def __init__(self, pol: Policy, shape: NormShape, keep_arrays: bool, counters: bool) -> None:
        self.pol, self.shape = pol, shape
        # (the policy's threads split dγ's and dβ's sums alone: each row's statistics are one thread's)
        # the contiguous rows the statistics' sums read: the row, or for order=lanes_tail each channel's positions
        # (Paddle's GroupNorm restarts its lanes per channel of the group)
        row = shape.r // (shape.shape[1] // shape.groups) if shape.norm == "group" and pol.order == "lanes_tail" \
            else shape.r
        self.run = KernelRun(replace(pol, threads=None), shape.rows, np.random.default_rng(pol.seed),
                             RunSetting(keep_arrays=keep_arrays, counting=counters, row=row, channels=shape.rows))
        self.params_n = math.prod(shape.param_shape)
        self.param_trace = Trace(self.params_n, keep_arrays, counted=counters)

    @property
    def pack(self) -> int:
        """The accumulator vectors one vector load of x fills: 2 for a 16-bit x summed in a 32-bit accumulator (PyTorch
        CPU's Vectorized<T> of a 16-bit T holds twice Vectorized<float>'s lanes), else 1."""
        return 2 if get_format(self.pol.storage).itemsize == 2 and self.run.acc.fmt.itemsize == 4 else 1

    def row_sum(self, a: np.ndarray, tally: Tally) -> np.ndarray:
        """Σ of each row of ``a`` (``(rows, R)``, accumulator values) in the policy's order; ATen's (order=aten) split
        across the policy's threads where it splits one long row."""
        pol = self.pol
        if pol.order == "aten":
            return aten_sum(a, self.run.acc, lanes=pol.lanes, threads=pol.threads or 1,
                            tally=tally if self.run.counting else None)
        if pol.order == "inductor":  # (split across the policy's threads where inductor splits a long row)
            return _inductor_sum(self, a, tally if self.run.counting else None)
        return self.run.reduce(a, tally)

    def record_param(self, name: str, ar: Arith, wide: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        """Round a γ-shaped value in ``ar``'s format and record it in the parameters' trace."""
        t = tally if tally is not None else Tally(self.params_n)
        value = ar.round(wide, t if self.run.counting else None)
        self.param_trace.record(name, value, ar.fmt, wide=wide, tally=t)
        return value

    def gamma(self, g: np.ndarray, offset: float) -> np.ndarray:
        """γ as the kernel applies it: w, or offset + w in ``offset_format`` (the compute format by default)."""
        gp = self.run.param(g)
        if not offset:
            return gp
        fmt = self.pol.offset_format or self.pol.compute
        ar = Arith(fmt, self.pol.spec, self.run.rng, counting=self.run.counting)
        return self.record_param("gamma_offset", ar, ar.round(offset) + gp)

    def param_sum(self, name: str, a: np.ndarray, out: Arith) -> np.ndarray:
        """The sum over the values each parameter touches of ``a`` (``(rows, R)``, accumulator values) in the
        policy's order — in ``grad_sum_format`` where the policy names one, across its ``threads`` where it has
        them (per-thread buffers, :func:`~bnprobe.numerics.reduce.buffered_sum`) — rounded to ``out`` (the
        parameters' format) and recorded."""
        pol, acc = self.pol, self.run.acc
        t = Tally(self.params_n)
        tally = t if self.run.counting else None
        into = acc if pol.grad_sum_format is None else Arith(pol.grad_sum_format, pol.spec, self.run.rng,
                                                             counting=self.run.counting)
        terms = self.shape.gather(a)
        if pol.threads is not None:
            s = buffered_sum(terms, acc, into, threads=pol.threads, tally=tally)
        else:
            if into is not acc:  # the terms formed in the sums' format (Liger-Kernel#950: a bf16 product)
                terms = into.round(terms, tally)
            s = reduce_sum(terms, into, order=pol.order, lanes=pol.lanes, kahan=pol.kahan, tally=tally,
                           unroll=pol.unroll)
        return self.record_param(name, out, s, t)


def forward(x: Any, gamma: Any = None, beta: Any = None, *, shape: NormShape, eps: float = EPS,
            policy: str | Policy = "fp32", weight_offset: float = 0.0, keep_arrays: bool = True,
            counters: bool = True) -> NormResult:
    """The forward of the family layer ``shape`` names on x (γ defaults to 1; β to 0, none for RMSNorm), by
    ``policy``; the statistics per row as saved.  ``keep_arrays=False`` keeps the trace's counters and ranges only,
    ``counters=False`` records no trace (the same outputs).  A large call under the presets' policies takes the
    compiled route (bnprobe.kernels.norms_compiled: the same outputs and trace; ``numpy_route()`` keeps calls off
    it)."""
    pol = check_family_policy(get_policy(policy))
    eps = check_eps(eps)
    g = _parameter("gamma", gamma, shape, 1.0)
    b = _parameter("beta", beta, shape, None if shape.norm == "rms" else 0.0)
    k = _Kernel(pol, shape, keep_arrays, counters)
    if takes_compiled(pol, shape.norm, math.prod(shape.shape), shape.r, keep_arrays):
        res = _forward_compiled(k, x, g, b, eps, weight_offset)
        if res is not None:
            return res
        k = _Kernel(pol, shape, keep_arrays, counters)  # (afresh: the attempt may have recorded γ's offset)
    run, acc, r = k.run, k.run.acc, shape.r
    with np.errstate(all="ignore"):
        xs = run.load("x", shape.to_rows(x), run.storage)
        xa = run.cast("x_acc", xs, pol.storage, acc)
        if shape.norm == "rms":
            t = run.tally()
            sq = run.op("squares", acc, np.multiply, xa, xa, tally=t)
            t = run.tally()
            s = run.rec("sum_squares", acc, k.row_sum(sq, t), t)
            var = run.rec("mean_square", acc, per_count(s, r, pol.mean_by, acc))
            mean = None
        else:
            # (inductor's Welford — past its two-pass threshold, or for a single row — split across the threads
            # where inductor splits the row)
            split = pol.variance == "inductor" and (r > INDUCTOR_TWO_PASS_MAX or shape.rows == 1) and \
                _inductor_splits_row(pol, shape.rows, r)
            if split and -(-r // (_inductor_width(pol, r) * pol.threads)) > CHUNK:
                raise BNProbeError(f"variance=inductor with threads={pol.threads}: torch.compile splits each row's "
                                   f"Welford reduction across its threads at {shape.rows} row(s) of {r} values, "
                                   f"more than {CHUNK} vectors a thread, where its threads share one chunk stack "
                                   "(a race), which bnprobe does not emulate")
            method = MomentsMethod(pol.variance, pol.order, pol.lanes, pol.tiles, pol.kahan, pol.mean_by,
                                   pol.clamp_var, pol.unroll, run.cores, pol.sum_format, pack=k.pack,
                                   fused=pol.variance_fma, row_threads=pol.threads if split else 1)
            m = moments(xa, acc, method, rng=run.rng, row=run.order_rows(), wide_sums=run.trace.keep_arrays,
                        channels=shape.rows)
            for sv in m.stages:
                run.trace.record(sv.name, sv.value, sv.arith.fmt, wide=sv.wide, tally=sv.tally,
                                 check_negative=sv.check_negative)
            mean, var = m.mean, m.var
        ea = acc if pol.rstd_format is None else Arith(pol.rstd_format, pol.spec, run.rng, counting=run.counting)
        # ε as the kernel adds it: rounded to eps_format first where the policy names one (x's 16-bit dtype before
        # pytorch/pytorch#142848), then to the format of the addition
        eps_added = float(ea.round(eps if pol.eps_format is None else
                                   float(Arith(pol.eps_format, pol.spec, run.rng).round(eps))))
        var_eps = run.rec("var_eps", ea, var + eps_added, negative=True)
        rstd, std = run.rstd(var_eps)
        y = _normalise(k, xs, mean, _applied_rstd(k, rstd), k.gamma(g, weight_offset),
                       None if b is None else run.param(b), std)
        par = run.params if pol.saved_format is None else Arith(pol.saved_format, pol.spec, run.rng,
                                                                  counting=run.counting)
        dt = par.fmt.dtype
        saved = (None if mean is None else par.round(mean).astype(dt), par.round(rstd).astype(dt),
                 par.round(var).astype(dt))
    run.trace.meta.update(norm=shape.norm, mode="train", eps=eps, eps_effective=eps_added)
    out = shape.from_rows(np.asarray(y).astype(get_format(pol.storage).dtype))
    return NormResult(out, *saved, run.trace, k.param_trace)


def _sub_shape(shape: NormShape, rows: np.ndarray) -> NormShape:
    """The shape of a LayerNorm or RMSNorm call on ``rows`` rows of ``shape``'s alone."""
    return NormShape(shape.norm, (int(rows.size),) + shape.normalized, shape.normalized)


def _rows_of(a: Any, shape: NormShape, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of x-shaped ``a`` (as given), shaped for :func:`_sub_shape`."""
    return np.asarray(a).reshape(shape.rows, shape.r)[rows].reshape((int(rows.size),) + shape.normalized)


def _forward_compiled(k: _Kernel, x: Any, g: np.ndarray, b: np.ndarray | None, eps: float,
                      weight_offset: float) -> NormResult | None:
    """The forward by the compiled route (bnprobe.kernels.norms_compiled), or None where it does not take x."""
    pol, shape, run = k.pol, k.shape, k.run

    def numpy_rows(rows: np.ndarray) -> NormResult:
        with numpy_route():
            return forward(_rows_of(x, shape, rows), g, b, shape=_sub_shape(shape, rows), eps=eps, policy=pol,
                           weight_offset=weight_offset, keep_arrays=False, counters=run.counting)
    with np.errstate(all="ignore"):
        ga = k.gamma(g, weight_offset)
        res = forward_rows(k, x, ga, None if b is None else run.param(b), eps, numpy_rows)
    if res is None:
        return None
    res.trace.meta.update(norm=shape.norm, mode="train", eps=eps, eps_effective=res.eps_added, route="compiled")
    return NormResult(res.y, *res.saved, res.trace, k.param_trace)


def _backward_compiled(k: _Kernel, dy: Any, x: Any, g: np.ndarray, mean: Any, rstd: Any,
                       weight_offset: float) -> NormGradients | None:
    """The standard backward by the compiled route (bnprobe.kernels.norms_compiled), or None where it does not take
    dy and x."""
    pol, shape, run = k.pol, k.shape, k.run
    acc, params = run.acc, run.params
    stats = params if pol.saved_format is None else Arith(pol.saved_format, pol.spec, run.rng)
    with np.errstate(all="ignore"):
        mu = None if mean is None else acc.round(stats.round(np.asarray(mean, dtype=np.float64).reshape(-1)))
        inv = acc.round(stats.round(np.asarray(rstd, dtype=np.float64).reshape(-1)))

    def numpy_rows(rows: np.ndarray) -> NormGradients:
        with numpy_route():
            return backward(_rows_of(dy, shape, rows), _rows_of(x, shape, rows), g,
                            None if mean is None else np.asarray(mean).reshape(-1)[rows],
                            np.asarray(rstd).reshape(-1)[rows], shape=_sub_shape(shape, rows), policy=pol,
                            weight_offset=weight_offset, keep_arrays=False, counters=run.counting)
    with np.errstate(all="ignore"):
        ga = k.gamma(g, weight_offset)
        res = backward_rows(k, dy, x, ga, mu, inv, numpy_rows)
        if res is None:
            return None
        dgamma = k.record_param("dgamma", params, res.dgamma[0], res.dgamma[1])
        dbeta = None if res.dbeta is None else k.record_param("dbeta", params, res.dbeta[0], res.dbeta[1])
    res.trace.meta.update(norm=shape.norm, mode="backward", route="compiled")
    pshape, dt = shape.param_shape, params.fmt.dtype
    return NormGradients(res.dx, dgamma.astype(dt).reshape(pshape),
                         None if dbeta is None else dbeta.astype(dt).reshape(pshape), res.trace, k.param_trace)


def _applied_rstd(k: _Kernel, rstd: np.ndarray) -> np.ndarray:
    """rstd as the kernel multiplies by it: rounded to the policy's ``rstd_cast`` (recorded) where it names one."""
    pol, run = k.pol, k.run
    if pol.rstd_cast is None:
        return rstd
    return run.rec("rstd_cast", Arith(pol.rstd_cast, pol.spec, run.rng, counting=run.counting), rstd)


def _normalise(k: _Kernel, xs: np.ndarray, mean: np.ndarray | None, rstd: np.ndarray, g: np.ndarray,
               b: np.ndarray | None, std: np.ndarray | None = None) -> np.ndarray:
    """y (rows view, storage values) from x, the rows' statistics (``std`` where the policy formed σ) and γ, β
    (flat, as the kernel applies them)."""
    run, pol, shape = k.run, k.pol, k.shape
    comp, acc = run.comp, run.acc
    xc = run.cast("x_compute", xs, pol.storage, comp)
    ge = shape.expand(g)
    be = None if b is None else shape.expand(b)
    per_element = shape.norm in ("layer", "rms")

    def mac(name: str, a: np.ndarray, m: np.ndarray, d: np.ndarray | None) -> np.ndarray:
        """a·m + d recorded as stage ``name``: fused or two roundings (no d: the product)."""
        if d is None:
            return run.op(name, comp, np.multiply, a, m)
        if pol.fma:
            return run.rec(name, comp, fma_wide(a, m, d, native=comp.native))
        t = run.tally()
        return run.op(name, comp, np.add, comp.mul(a, m, t), d, tally=t)

    rcol = run.col(comp, rstd)
    centered = xc if mean is None else None
    if pol.y_formula in ("xhat", "scale", "xhat_div") and centered is None:
        centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
    if pol.y_formula in ("xhat", "xhat_div"):
        if pol.y_formula == "xhat_div":  # (x − μ)/σ, σ rounded to the compute format (MindSpore's CPU LayerNorm)
            xhat = run.op("xhat", comp, np.divide, centered, run.col(comp, std))
        else:
            xhat = run.op("xhat", comp, np.multiply, centered, rcol)
        if pol.cast_point == "before_gamma":  # x̂ stored in x's format before γ multiplies it
            xhat = run.rec("xhat_stored", run.storage, xhat)
        y = mac("affine", xhat, ge, be)
    elif pol.y_formula == "scale":
        w = run.rec("w", acc, ge * rstd[:, None])
        y = mac("affine", centered, w, be)
    elif per_element:  # affine: a = x·rstd + (−μ·rstd), then ·γ + β (γ varies along the row: not folded)
        shift = None if mean is None else run.col(comp, acc.round(-(mean * rstd)))
        a = mac("normalized", xc, rcol, shift)
        if pol.cast_point == "before_gamma":
            a = run.rec("xhat_stored", run.storage, a)
        y = mac("affine", a, ge, be)
    else:  # affine, γ per channel: m = γ·rstd, y = x·m + (β − m·μ)
        mult = run.rec("mult", acc, ge * rstd[:, None])
        be0 = np.zeros_like(mult) if be is None else be
        if pol.fma:
            addend = run.rec("addend", acc, fma_wide(-mult, mean[:, None], be0, native=acc.native))
        else:
            t = run.tally()
            addend = run.rec("addend", acc, be0 - acc.mul(mult, mean[:, None], t), t)
        y = mac("affine", xc, mult, addend)
    return run.output("y", run.out, y)


def backward(dy: Any, x: Any, gamma: Any, mean: Any, rstd: Any, *, shape: NormShape, policy: str | Policy = "fp32",
             weight_offset: float = 0.0, keep_arrays: bool = True, counters: bool = True) -> NormGradients:
    """dx, dγ and dβ of the family layer ``shape`` names, from the statistics its forward saved (``mean`` per row,
    None for RMSNorm; ``rstd`` per row), by ``policy``; its route as :func:`forward`'s."""
    pol = check_family_policy(get_policy(policy))
    if np.shape(dy) != shape.shape:
        raise BNProbeError(f"dy has shape {list(np.shape(dy))} but x has shape {list(shape.shape)}")
    rows = shape.rows
    for name, v in (("mean", mean), ("rstd", rstd)):
        if (v is None) != (name == "mean" and shape.norm == "rms") or (v is not None and np.size(v) != rows):
            want = "none (RMSNorm has no mean)" if name == "mean" and shape.norm == "rms" else f"{rows} values"
            raise BNProbeError(f"saved {name} must be {want}, got {'none' if v is None else np.size(v)}")
    g = _parameter("gamma", gamma, shape, 1.0)
    k = _Kernel(pol, shape, keep_arrays, counters)
    if takes_compiled(pol, shape.norm, math.prod(shape.shape), shape.r, keep_arrays):
        res = _backward_compiled(k, dy, x, g, mean, rstd, weight_offset)
        if res is not None:
            return res
        k = _Kernel(pol, shape, keep_arrays, counters)  # (afresh: the attempt may have recorded γ's offset)
    run, acc, comp, r = k.run, k.run.acc, k.run.comp, shape.r
    with np.errstate(all="ignore"):
        dys = run.load("dy", shape.to_rows(dy), run.storage)
        xs = run.load("x", shape.to_rows(x), run.storage)
        # the statistics as the kernel reads them: in the format they were saved in
        stats = run.params if pol.saved_format is None else Arith(pol.saved_format, pol.spec, run.rng,
                                                                    counting=run.counting)
        mu = None if mean is None else acc.round(stats.round(np.asarray(mean, dtype=np.float64).reshape(-1)))
        inv = acc.round(stats.round(np.asarray(rstd, dtype=np.float64).reshape(-1)))
        params = run.params
        if pol.backward_formula in ("torch", "inductor"):
            # (γ as the caller's module holds it: offset + w formed in the parameters' format)
            gw = run.param(g) if not weight_offset else params.round(params.round(weight_offset) + run.param(g))
            back = _torch_backward if pol.backward_formula == "torch" else _inductor_backward
            dx, dgamma, dbeta = back(k, dys, xs, gw, mu, inv)
        else:
            inv = _applied_rstd(k, inv)
            xc = run.cast("x_compute", xs, pol.storage, comp)
            dyc = run.cast("dy_compute", dys, pol.storage, comp)
            centered = xc if mu is None else run.op("centered", comp, np.subtract, xc, run.col(comp, mu))
            xhat = run.op("xhat", comp, np.multiply, centered, run.col(comp, inv))
            gdy = run.op("dy_gamma", comp, np.multiply, dyc, shape.expand(k.gamma(g, weight_offset)))
            ga = run.cast("dy_gamma_acc", gdy, pol.compute, acc)
            t = run.tally()
            sum_gx = run.rec("sum_g_xhat", acc, run.reduce(ga, t, times=xhat), t)
            t = run.tally()
            d = comp.sub(gdy, comp.mul(xhat, run.col(comp, per_count(sum_gx, r, pol.mean_by, acc)), t), t)
            if mu is not None:
                t2 = run.tally()
                sum_g = run.rec("sum_g", acc, run.reduce(ga, t2), t2)
                d = comp.sub(d, run.col(comp, per_count(sum_g, r, pol.mean_by, acc)), t)
            dx_c = run.op("dx_compute", comp, np.multiply, d, run.col(comp, inv), tally=t)
            dx = run.output("dx", run.out, dx_c)
            dya = run.cast("dy_acc", dys, pol.storage, acc)
            dgamma = k.param_sum("dgamma", acc.mul(dya, acc.round(xhat)), params)
            dbeta = None if shape.norm == "rms" else k.param_sum("dbeta", dya, params)
    run.trace.meta.update(norm=shape.norm, mode="backward")
    pshape, dt = shape.param_shape, params.fmt.dtype
    return NormGradients(shape.from_rows(np.asarray(dx).astype(get_format(pol.storage).dtype)),
                         dgamma.astype(dt).reshape(pshape), None if dbeta is None else dbeta.astype(dt).reshape(pshape),
                         run.trace, k.param_trace)


def _inductor_sum(k: _Kernel, a: np.ndarray, tally: Tally | None, *, columns: bool = False,
                  unroll: int | None = None, step: int = 1) -> np.ndarray:
    """Σ of each row of ``a`` (``(rows, R)``, accumulator values) as inductor's CPU reduction takes it
    (order=inductor: each row one contiguous row of the layout; a long row split across the policy's threads where
    inductor splits it, :func:`~bnprobe.numerics.reduce.inductor_split_rows`), or (``columns``) Σ over the rows of
    each column, a reduction of values R apart: each column in memory order (vectors across the columns), a cascade
    above 4096 rows, split across the policy's threads (OpenMP's static schedule, the parts added in thread order)
    where inductor parallelises the reduction instead of the columns: fewer whole column vectors than a 300th of the
    rows (codegen/cpp.py max_parallel_depth) and 512 values a thread at least (min_chunk_size).  A reduction of 8
    values or more starts its accumulators at +0 (fewer: one unrolled expression from the first value), so its sum
    is never −0.  ``unroll`` replaces the policy's vectors per load (1: sums of float buffers, whatever x's format);
    ``step`` is the rows of one iteration of a column sum's loop (a tiled kernel's: threads are dealt whole tiles)."""
    pol, acc = k.pol, k.run.acc
    if unroll is not None:
        pol = replace(pol, unroll=unroll)
    a = np.asarray(a)
    rows, r = a.shape
    if columns:
        width = _inductor_width(pol, r)
        threads = pol.threads or 1
        split = threads > 1 and (r // width) * OUTER_RATIO < rows and r * rows // threads >= MIN_CHUNK
        if split and step > 1:  # the threads deal tiles of ``step`` rows: each thread's rows in order, from +0
            s = np.zeros(r)
            for part in split_parts(-(-rows // step), threads, "openmp"):
                block = a[part.start * step: part.stop * step]
                s = acc.add(s, reduce_sum(np.ascontiguousarray(block.T), acc, order="inductor", lanes=pol.lanes,
                                          row=None, tally=tally), tally)
        else:
            s = reduce_sum(np.ascontiguousarray(a.T), acc, order="inductor", lanes=pol.lanes, unroll=pol.unroll,
                           row=None, tally=tally, cores=Cores(threads, "ordered", "openmp") if split else Cores())
        count, outputs = rows, r
    else:
        if rows == 1 and r < INDUCTOR_UNROLL_BELOW:
            # a reduction to one value is never unrolled (ir.py): one masked vector from +0, which the zeros
            # padding the row to the unroll threshold leave as it is
            a = np.concatenate([a, np.zeros((1, INDUCTOR_UNROLL_BELOW - r), dtype=a.dtype)], axis=1)
            r = INDUCTOR_UNROLL_BELOW
        width = _inductor_width(pol, r)
        if _inductor_splits_row(pol, rows, r):
            s = inductor_split_rows(a, acc, width=width, threads=pol.threads, tally=tally)
        else:
            s = reduce_sum(a, acc, order="inductor", lanes=pol.lanes, unroll=pol.unroll, row=r, tally=tally)
        count, outputs = r, rows
    # (+0 + −0 is +0, and a sum from +0 is −0 nowhere in round-to-nearest)
    return np.where(s == 0, 0.0, s) if count >= INDUCTOR_UNROLL_BELOW or outputs == 1 else s


def _inductor_splits_row(pol: Policy, rows: int, r: int) -> bool:
    """Whether torch.compile's CPU kernel splits each of ``rows`` rows of ``r`` values across the policy's threads:
    one row has no loop around its reduction, so the reduction's own loop is parallelised wherever each thread gets
    512 values (config.cpp.min_chunk_size; codegen/cpp.py decide_parallel_depth); more rows by
    :func:`~bnprobe.numerics.inductor.splits_rows`."""
    threads = pol.threads or 1
    if threads <= 1:
        return False
    if rows == 1:
        return r // threads >= MIN_CHUNK
    return splits_rows(rows, r, r, _inductor_width(pol, r), threads)


def _inductor_width(pol: Policy, r: int) -> int:
    """The values of one vector of inductor's loop over a row of ``r`` (two vectors for a 16-bit load, one in rows
    shorter than that)."""
    return pol.lanes * (pol.unroll if r >= pol.lanes * pol.unroll else 1)


def _inductor_backward(k: _Kernel, dys: np.ndarray, xs: np.ndarray, g: np.ndarray, mu: np.ndarray | None,
                       inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """dx (storage), dγ and dβ (the parameters' format) as torch.compile's CPU kernel computes them
    (backward_formula=inductor), every operation one rounding in the accumulator (x, dy and γ upcast; inductor
    compiles without contraction) and its sums inductor's (:func:`_inductor_sum`).  LayerNorm
    (native_layer_norm_backward's decomposition): g = dy·γ, x̂ = (x − μ)·rstd, dx = fl(rstd/R)·((g·R − Σg) −
    x̂·Σ(g·x̂)), dγ = Σ_rows dy·x̂, dβ = Σ_rows dy.  RMSNorm (autograd through rms_norm's composite ops): PyTorch's
    formula (:func:`_torch_rms_backward`) with inductor's sums.  GroupNorm (native_group_norm_backward's
    decomposition): :func:`_inductor_group_backward`."""
    run, shape = k.run, k.shape
    acc = run.acc
    xa, dya, ga = _upcast_for_backward(k, xs, dys, g, "InstanceNorm under torch.compile is BatchNorm's decomposition "
                                       "on the (1, N·C, ...) view: run BatchNorm's recipe on that view "
                                       "(backward_formula=inductor is LayerNorm's, RMSNorm's and GroupNorm's here)")
    if shape.norm == "rms":
        return _torch_rms_backward(k, dya, xa, ga, inv, sums=_inductor_sum)
    if shape.norm == "group":
        return _inductor_group_backward(k, dya, xa, ga, mu, inv)
    rows, r = xa.shape
    gr = np.broadcast_to(ga.reshape(1, -1), xa.shape)
    t = run.tally()
    tt = t if run.counting else None
    gxh = acc.mul(dya, gr, tt)
    xhat = run.rec("xhat", acc, acc.mul(acc.sub(xa, _col(mu, xa), tt), _col(inv, xa), tt), t)
    t = run.tally()
    tt = t if run.counting else None
    sum_g = run.rec("sum_g", acc, _inductor_sum(k, gxh, tt), t)
    t = run.tally()
    tt = t if run.counting else None
    sum_gx = run.rec("sum_g_xhat", acc, _inductor_sum(k, acc.mul(gxh, xhat, tt), tt), t)
    t = run.tally()
    tt = t if run.counting else None
    count = np.asarray(acc.round(float(r)), dtype=xa.dtype)
    inner = acc.sub(acc.sub(acc.mul(gxh, count, tt), _col(sum_g, xa), tt), acc.mul(xhat, _col(sum_gx, xa), tt), tt)
    scale = acc.div(np.asarray(inv, dtype=xa.dtype), count, tt)
    dx = run.output("dx", run.out, run.rec("dx_compute", acc, acc.mul(_col(scale, xa), inner, tt), t))
    params = run.params
    dgamma = _inductor_sum(k, acc.mul(dya, xhat), None, columns=True)
    dbeta = _inductor_sum(k, dya, None, columns=True)
    return dx, k.record_param("dgamma", params, dgamma), k.record_param("dbeta", params, dbeta)


def _inductor_group_backward(k: _Kernel, dya: np.ndarray, xa: np.ndarray, ga: np.ndarray, mu: np.ndarray,
                             inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GroupNorm's backward as torch.compile's CPU kernel computes it (native_group_norm_backward's decomposition,
    every operation one rounding in the accumulator, no product fused): per channel of each sample ds = Σ dy·x and
    db = Σ dy over its positions (inductor's row sums, each (sample, channel) a row of H·W); per group ds_g = Σ ds·γ
    and db_g = Σ db·γ over its channels (a row of D channels, the products rounded, one float vector); c1 =
    rstd·γ, c2 = fl(fl(fl(fl(db_g·μ − ds_g)·rstd)·rstd)·rstd)·fl(1/R)), c3 = fl(−c2·μ) − fl(fl(db_g·rstd)·fl(1/R));
    dx = fl(fl(dy·c1) + fl(x·c2)) + c3 (in the accumulator: a 16-bit x's dx is computed as a float and rounded once
    to its format).  dγ = Σ_n fl(fl(ds − fl(db·μ))·rstd) and dβ = Σ_n db over the samples, each channel's column
    summed in sample order (:func:`_inductor_sum`'s columns)."""
    run, shape = k.run, k.shape
    acc = run.acc
    n, ch = shape.shape[0], shape.shape[1]
    groups = shape.groups or ch
    d = ch // groups
    hw = shape.r // d
    t = run.tally()
    tt = t if run.counting else None
    planes_dy, planes_x = dya.reshape(n * ch, hw), xa.reshape(n * ch, hw)
    # (the planes' sums are counted nowhere: the trace's tallies are the (sample, group) rows')
    ds = _inductor_sum(k, acc.mul(planes_dy, planes_x), None)
    db = _inductor_sum(k, planes_dy, None)
    ds = np.asarray(ds, dtype=xa.dtype).reshape(n * groups, d)
    db = np.asarray(db, dtype=xa.dtype).reshape(n * groups, d)
    gg = np.broadcast_to(np.asarray(ga, dtype=xa.dtype).reshape(1, groups, d), (n, groups, d)).reshape(n * groups, d)
    inlined = hw <= _REALIZE_READS or (n * groups == 1 and hw < INDUCTOR_UNROLL_BELOW)

    def group_sum(v: np.ndarray, tally: Tally | None) -> np.ndarray:
        """Σ over a group's channels of v·γ: ds and db are float buffers, summed by one float vector whatever x's
        format.  Where the positions are too few to loop over, the planes' sums are unrolled, and where inductor
        then computes them inside this reduction's loop over the channels — a single (sample, group): the same
        loop; or 4 positions at most: a sum of that few reads is inlined (config.realize_reads_threshold) — it reads x
        and dy across channels, not vectorised along them: each group's channels in order from +0 (unless this sum
        is unrolled too: fewer than 8 channels in more than one group)."""
        terms = acc.mul(v, gg, tally)
        if inlined and (d >= INDUCTOR_UNROLL_BELOW or n * groups == 1):
            s = reduce_sum(terms, acc, order="inductor", lanes=k.pol.lanes, row=None, tally=tally)
            return np.where(s == 0, 0.0, s)
        return _inductor_sum(k, terms, tally, unroll=1)

    ds_g = run.rec("sum_ds_gamma", acc, group_sum(ds, tt), t)
    t = run.tally()
    tt = t if run.counting else None
    db_g = run.rec("sum_db_gamma", acc, group_sum(db, tt), t)
    t = run.tally()
    tt = t if run.counting else None
    scale = acc.round(1.0 / float(acc.round(float(shape.r))))
    c2 = acc.sub(acc.mul(db_g, mu, tt), ds_g, tt)
    c2 = run.rec("dx_b", acc, acc.mul(acc.mul(acc.mul(acc.mul(c2, inv, tt), inv, tt), inv, tt), scale, tt), t)
    t = run.tally()
    tt = t if run.counting else None
    c3 = run.rec("dx_c", acc, acc.sub(acc.mul(-c2, mu, tt), acc.mul(acc.mul(db_g, inv, tt), scale, tt), tt), t)
    t = run.tally()
    tt = t if run.counting else None
    c1 = acc.mul(_col(inv, xa), gg, tt)  # (n·G, D): rstd·γ per channel
    c1 = np.repeat(c1.reshape(-1, 1), hw, axis=1).reshape(xa.shape)
    dx_c = acc.add(acc.add(acc.mul(dya, c1, tt), acc.mul(xa, _col(c2, xa), tt), tt), _col(c3, xa), tt)
    dx = run.output("dx", run.out, run.rec("dx_compute", acc, dx_c, t))
    dsn, dbn = ds.reshape(n, ch), db.reshape(n, ch)
    mun = np.repeat(np.asarray(mu, dtype=xa.dtype).reshape(n, groups), d, axis=1)
    invn = np.repeat(np.asarray(inv, dtype=xa.dtype).reshape(n, groups), d, axis=1)
    terms = acc.mul(acc.sub(dsn, acc.mul(dbn, mun)), invn)
    params = run.params
    # (the planes' sums inlined: recomputed inside a kernel tiled 16 samples deep)
    step = CHANNEL_TILE if hw <= _REALIZE_READS else 1
    dgamma = _inductor_sum(k, terms, None, columns=True, step=step)
    dbeta = _inductor_sum(k, dbn, None, columns=True, step=step)
    return dx, k.record_param("dgamma", params, dgamma), k.record_param("dbeta", params, dbeta)


def _upcast_for_backward(k: _Kernel, xs: np.ndarray, dys: np.ndarray, g: np.ndarray,
                         instance: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x and dy as stored, and γ, in the accumulator (traced as x_acc, dy_acc), for a real kernel's backward recipe;
    InstanceNorm refused with ``instance`` (those kernels run BatchNorm's on a view)."""
    if k.shape.norm == "instance":
        raise BNProbeError(instance)
    run, acc = k.run, k.run.acc
    xa = run.cast("x_acc", xs, k.pol.storage, acc)
    dya = run.cast("dy_acc", dys, k.pol.storage, acc)
    return xa, dya, np.asarray(acc.round(g), dtype=xa.dtype)


def _torch_backward(k: _Kernel, dys: np.ndarray, xs: np.ndarray, g: np.ndarray, mu: np.ndarray | None,
                    inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """dx (in the storage format), dγ and dβ (in the parameters' format) as the layer's PyTorch CPU kernel computes
    them (backward_formula=torch), from x and dy as stored, γ in the parameters' format and the saved statistics."""
    xa, dya, ga = _upcast_for_backward(k, xs, dys, g, "InstanceNorm's PyTorch kernel is BatchNorm's, run on the "
                                       "(1, N·C, ...) view: run BatchNorm's torch recipe on that view "
                                       "(backward_formula=torch is LayerNorm's, RMSNorm's and GroupNorm's here)")
    if k.shape.norm == "layer":
        return _torch_layer_backward(k, dya, xa, ga, mu, inv)
    if k.shape.norm == "group":
        return _torch_group_backward(k, dya, xa, ga, mu, inv)
    return _torch_rms_backward(k, dya, xa, ga, inv)


def _col(v: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A per-row value as a column in ``like``'s carrier."""
    return np.asarray(v, dtype=like.dtype)[:, None]


def _fused(acc: Arith, a: np.ndarray, b: np.ndarray, c: np.ndarray, tally: Tally | None,
           like: np.ndarray) -> np.ndarray:
    """fma(a, b, c) rounded once in ``acc``, in ``like``'s carrier."""
    return np.asarray(acc.round(fma_wide(*np.broadcast_arrays(a, b, c), native=acc.native), tally), dtype=like.dtype)


def _dx_coefficients(k: _Kernel, ds: np.ndarray, db: np.ndarray, mu: np.ndarray, inv: np.ndarray,
                     count: int, c_fuses: str) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's b = (db·μ − ds)·rstd³/R and c = −b·μ − db·rstd/R as compiled: fl(1/R) a float, db·μ − ds one fused
    multiply-subtract, the products left to right; c fuses its first product (``c_fuses`` "first": fma(−b, μ,
    −fl(fl(db·rstd)·fl(1/R))), GCC's choice in LayerNorm's kernel) or its second ("second": fma(−fl(db·rstd),
    fl(1/R), fl(−b·μ)), in GroupNorm's)."""
    run = k.run
    acc = run.acc
    t = run.tally()
    scale = acc.round(1.0 / float(acc.round(float(count))))
    first = acc.round(fma_wide(db, mu, -ds), t)
    b = acc.mul(acc.mul(acc.mul(acc.mul(first, inv, t), inv, t), inv, t), scale, t)
    b = run.rec("dx_b", acc, b, t)
    t = run.tally()
    if c_fuses == "first":
        c = acc.round(fma_wide(-b, mu, -acc.mul(acc.mul(db, inv, t), scale, t)), t)
    else:
        c = acc.round(fma_wide(-acc.mul(db, inv, t), scale, -acc.mul(b, mu, t)), t)
    return b, run.rec("dx_c", acc, c, t)


def _torch_layer_backward(k: _Kernel, dya: np.ndarray, xa: np.ndarray, ga: np.ndarray, mu: np.ndarray,
                          inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch CPU's LayerNorm backward (layer_norm_kernel.cpp).  Per row ds = Σ dy·x·γ and db = Σ dy·γ: for a float
    x by at::vec's map3/map2_reduce_all (the masked last vector's products fused), for a 16-bit x with float γ by
    LayerNorm's own loops (every product after the first vector fused; a short row's halves folded), for a 16-bit x
    with 16-bit γ by at::vec's reduced-float functions (a short row's lanes added one by one).  dx =
    fl(fma(b, x, fl(fl(rstd·dy)·γ)) + c) (dx_fuses=dy: fl(fma(fl(rstd·dy), γ, fl(b·x)) + c)) with
    :func:`_dx_coefficients`.  dγ and dβ are accumulated row by row into one buffer per thread (threads, each
    thread a contiguous block of rows) held in the grad_sum_format format — buf = fma(dy, fma(rstd, x, fl(−rstd·μ)),
    buf) and buf + dy, computed in the accumulator and stored — and the buffers added in thread order from zero."""
    run, pol = k.run, k.pol
    acc, lanes = run.acc, pol.lanes
    rows, r = xa.shape
    gr = np.broadcast_to(np.asarray(ga, dtype=xa.dtype).reshape(1, -1), xa.shape)
    t = run.tally()
    tt = t if run.counting else None
    if k.pack == 1:
        ds = vec_reduce(acc.mul(dya, xa, tt), acc, lanes=lanes, times=gr, tally=tt)
        db = vec_reduce(dya, acc, lanes=lanes, times=gr, tally=tt)
    elif run.params.fmt.itemsize > get_format(pol.storage).itemsize:  # float γ: LayerNorm's own 16-bit loops
        dg = acc.mul(dya, gr, tt)
        ds = half_reduce(xa, acc, lanes=lanes, times=dg, tally=tt)
        db = half_reduce(dg, acc, lanes=lanes, tally=tt)
    else:  # 16-bit γ: at::vec's reduced-float map3_reduce_all / map2_reduce_all
        ds = half_reduce(acc.mul(dya, xa, tt), acc, lanes=lanes, times=gr, short_fold=False, tally=tt)
        db = half_reduce(dya, acc, lanes=lanes, times=gr, short_fold=False, tally=tt)
    ds = run.rec("sum_dy_x_gamma", acc, ds, t)
    db = run.rec("sum_dy_gamma", acc, db, run.tally())
    b, c = _dx_coefficients(k, ds, db, mu, inv, r, "first")
    t = run.tally()
    tt = t if run.counting else None
    direct = acc.mul(acc.mul(_col(inv, xa), dya, tt), gr, tt)
    if pol.dx_fuses == "dy":
        first = _fused(acc, acc.mul(_col(inv, xa), dya, tt), gr, acc.mul(_col(b, xa), xa, tt), tt, xa)
    else:
        first = _fused(acc, _col(b, xa), xa, direct, tt, xa)
    dx_c = acc.add(first, _col(c, xa), tt)
    dx = run.output("dx", run.out, run.rec("dx_compute", acc, dx_c, t))
    # dγ and dβ: one buffer per thread, each a contiguous block of rows (at::parallel_for), advancing together
    threads = pol.threads or 1
    buf = acc if pol.grad_sum_format is None else Arith(pol.grad_sum_format, pol.spec, run.rng, counting=run.counting)
    used = min(threads, rows)
    chunk = -(-rows // used)
    shift = acc.mul(-inv, mu)
    bg = np.zeros((threads, r), dtype=xa.dtype)
    bb = np.zeros((threads, r), dtype=xa.dtype)
    starts = np.arange(threads) * chunk
    for j in range(chunk):
        idx = starts + j
        live = (idx < rows) & (np.arange(threads) < used)
        if not live.any():
            break
        i = np.minimum(idx, rows - 1)
        inner = _fused(acc, _col(inv[i], xa), xa[i], _col(shift[i], xa), None, xa)
        ng = np.asarray(buf.round(_fused(acc, dya[i], inner, bg, None, xa)), dtype=xa.dtype)
        nb = np.asarray(buf.round(acc.add(bb, dya[i])), dtype=xa.dtype)
        bg = np.where(live[:, None], ng, bg)
        bb = np.where(live[:, None], nb, bb)
    dgamma = np.zeros(r, dtype=xa.dtype)
    dbeta = np.zeros(r, dtype=xa.dtype)
    for th in range(threads):
        dgamma, dbeta = acc.add(dgamma, bg[th]), acc.add(dbeta, bb[th])
    params = run.params
    return dx, k.record_param("dgamma", params, dgamma), k.record_param("dbeta", params, dbeta)


def _torch_group_backward(k: _Kernel, dya: np.ndarray, xa: np.ndarray, ga: np.ndarray, mu: np.ndarray,
                          inv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch CPU's GroupNorm backward (group_norm_kernel.cpp, contiguous x).  Per channel of each sample ds = Σ dy·x
    and db = Σ dy over its positions: for a float x by at::vec's map2_reduce_all and reduce_all (no product fused),
    for a 16-bit x by an accumulator vector from zero taking each vector's two halves (products fused), its lanes
    then added in order from zero, then the positions left over.  Per group ds_g = Σ ds·γ and db_g = Σ db·γ over its
    channels the same way (vectors of γ's width, products fused; with a float γ on one thread, or for a single group,
    the channels after the last whole vector first four at a time with rounded products).
    dx = fl(fma(c2, x, fl(fl(rstd·γ)·dy)) + c3) — dx_fuses=dy: fl(fma(fl(rstd·γ), dy, fl(c2·x)) + c3) — with c2, c3
    as LayerNorm's b, c (:func:`_dx_coefficients`, R the group's channels times positions, c3's second product
    fused).  dγ = Σ_n fma(fma(−db, μ, ds), rstd, ·) and dβ = Σ_n db, in sample order from zero."""
    run, pol, shape = k.run, k.pol, k.shape
    acc, lanes = run.acc, pol.lanes
    n, ch = shape.shape[0], shape.shape[1]
    groups = shape.groups or ch
    d = ch // groups
    hw = shape.r // d
    planes_dy, planes_x = dya.reshape(n * ch, hw), xa.reshape(n * ch, hw)
    t = run.tally()
    tt = t if run.counting else None
    if k.pack == 1:
        ds = vec_reduce(planes_dy, acc, lanes=lanes, times=planes_x, fused_tail=False, tally=tt)
        db = vec_reduce(planes_dy, acc, lanes=lanes, tally=tt)
    else:
        ds = lane_sums(planes_dy, acc, lanes=lanes, per_vector=2, times=planes_x, tally=tt)
        db = lane_sums(planes_dy, acc, lanes=lanes, per_vector=2, tally=tt)
    ds = np.asarray(ds, dtype=xa.dtype).reshape(n * groups, d)
    db = np.asarray(db, dtype=xa.dtype).reshape(n * groups, d)
    gg = np.broadcast_to(np.asarray(ga, dtype=xa.dtype).reshape(1, groups, d), (n, groups, d)).reshape(n * groups, d)
    per_vector = 2 if run.params.fmt.itemsize == 2 and acc.fmt.itemsize == 4 else 1
    # at::parallel_for runs its lambda inline when it has one group or one thread: GCC's copy of it there computes
    # the channels left after the last whole vector four products at a time, rounded (a float γ only)
    serial = (pol.threads or 1) == 1 or n * groups == 1
    left = d % (lanes * per_vector)
    rounded = left // 4 * 4 if serial and per_vector == 1 else 0
    ds_g = run.rec("sum_ds_gamma", acc, lane_sums(ds, acc, lanes=lanes, per_vector=per_vector, times=gg,
                                                  rounded_tail=rounded, tally=tt), t)
    db_g = run.rec("sum_db_gamma", acc, lane_sums(db, acc, lanes=lanes, per_vector=per_vector, times=gg,
                                                  rounded_tail=rounded, tally=tt), run.tally())
    c2, c3 = _dx_coefficients(k, ds_g, db_g, mu, inv, shape.r, "second")
    t = run.tally()
    tt = t if run.counting else None
    c1 = acc.mul(_col(inv, xa), gg, tt)  # (n·G, D): rstd·γ per channel
    c1 = np.repeat(c1.reshape(-1, 1), hw, axis=1).reshape(xa.shape)
    if pol.dx_fuses == "dy":
        first = _fused(acc, c1, dya, acc.mul(_col(c2, xa), xa, tt), tt, xa)
    else:
        first = _fused(acc, _col(c2, xa), xa, acc.mul(c1, dya, tt), tt, xa)
    dx_c = acc.add(first, _col(c3, xa), tt)
    dx = run.output("dx", run.out, run.rec("dx_compute", acc, dx_c, t))
    dsn, dbn = ds.reshape(n, ch), db.reshape(n, ch)
    mun = np.repeat(np.asarray(mu, dtype=xa.dtype).reshape(n, groups), d, axis=1)
    invn = np.repeat(np.asarray(inv, dtype=xa.dtype).reshape(n, groups), d, axis=1)
    dgamma = np.zeros(ch, dtype=xa.dtype)
    dbeta = np.zeros(ch, dtype=xa.dtype)
    for i in range(n):
        dev = _fused(acc, -dbn[i], mun[i], dsn[i], None, xa)
        dgamma = _fused(acc, dev, invn[i], dgamma, None, xa)
        dbeta = acc.add(dbeta, dbn[i])
    params = run.params
    return dx, k.record_param("dgamma", params, dgamma), k.record_param("dbeta", params, dbeta)


def _torch_rms_backward(k: _Kernel, dya: np.ndarray, xa: np.ndarray, ga: np.ndarray, inv: np.ndarray,
                        sums: Any = None) -> tuple[np.ndarray, np.ndarray, None]:
    """PyTorch's RMSNorm backward on the CPU: autograd through rms_norm_composite's ops, each an ATen kernel rounding
    once in the accumulator (x upcast): gu = fl(dy·γ); dx = fl(fl(gu·rstd) + fl(fl(fl(fl(−½·Σ gu·x)·fl(fl(rstd·rstd)·
    rstd)) / R)·2x)), the row's Σ by ATen's sum (order=aten, :func:`~bnprobe.numerics.rowwise.aten_sum`); dγ = Σ over
    the rows of fl(dy·fl(x·rstd)) by ATen's sum over leading dims
    (:func:`~bnprobe.numerics.rowwise.aten_column_sum`), rounded to γ's format.  ``sums`` (k, a, tally, columns=)
    takes both sums another way (torch.compile's: :func:`_inductor_sum`)."""
    run, pol = k.run, k.pol
    acc, lanes = run.acc, pol.lanes
    rows, r = xa.shape
    gr = np.broadcast_to(np.asarray(ga, dtype=xa.dtype).reshape(1, -1), xa.shape)
    rc = _col(inv, xa)
    t = run.tally()
    tt = t if run.counting else None
    gu = acc.mul(dya, gr, tt)
    direct = acc.mul(gu, rc, tt)
    terms = acc.mul(gu, xa, tt)
    grad_r = run.rec("sum_gu_x", acc, aten_sum(terms, acc, lanes=lanes, threads=pol.threads or 1, tally=tt)
                     if sums is None else sums(k, terms, tt), t)
    cube = acc.mul(acc.mul(inv, inv), inv)
    grad_ms = acc.mul(acc.mul(np.asarray(-0.5, dtype=xa.dtype), grad_r), cube)
    per_value = acc.div(grad_ms, acc.round(float(r)))
    t = run.tally()
    tt = t if run.counting else None
    through_mean = acc.mul(_col(per_value, xa), acc.mul(np.asarray(2.0, dtype=xa.dtype), xa, tt), tt)
    dx = run.output("dx", run.out, run.rec("dx_compute", acc, acc.add(direct, through_mean, tt), t))
    xhat = acc.mul(xa, rc)
    dgamma = aten_column_sum(acc.mul(dya, xhat), acc, lanes=lanes) if sums is None else \
        sums(k, acc.mul(dya, xhat), None, columns=True)
    return dx, k.record_param("dgamma", run.params, dgamma), None

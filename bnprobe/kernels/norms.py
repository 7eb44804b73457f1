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
samples and positions of its channel, for GroupNorm and InstanceNorm), in the accumulator format.

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
from bnprobe.kernels.policy import Policy, get_policy
from bnprobe.kernels.trace import Trace
from bnprobe.numerics.arith import Arith, Tally, fma_wide
from bnprobe.numerics.reduce import buffered_sum, reduce_sum
from bnprobe.numerics.variance import MomentsMethod, moments

__all__ = ["FAMILY", "NormShape", "NormResult", "NormGradients", "forward", "backward", "check_family_policy"]

# Policy fields whose choices are BatchNorm kernels' own (their backward formulas, thread splits, code paths,
# inference forms): a family kernel is not run under a policy that sets one, rather than ignoring it
_BATCHNORM_ONLY = ("backward_formula", "backward_fma", "backward_sums", "thread_split", "packet_lanes",
                   "path_channels", "stored_stats", "core_parts", "dx_fma", "variance_fma", "infer_y_formula",
                   "infer_rsqrt", "backward_lanes")
_DEFAULTS = {f.name: f.default for f in fields(Policy)}


def check_family_policy(pol: Policy) -> Policy:
    """``pol`` when a family kernel runs it; a one-line refusal naming the first BatchNorm-only choice it sets."""
    for name in _BATCHNORM_ONLY:
        if getattr(pol, name) != _DEFAULTS[name]:
            raise BNProbeError(f"policy {name}={getattr(pol, name)!r} is a BatchNorm kernel's choice: LayerNorm, "
                               "RMSNorm, GroupNorm and InstanceNorm are not run with it")
    bad = {"y_formula": ("affine_mr",), "sqrt": ("eigen_fast",), "order": ("xla", "inductor"),
           "variance": ("inductor",), "mean_by": ("prescaled",)}
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
        self.run = KernelRun(replace(pol, threads=None), shape.rows, np.random.default_rng(pol.seed),
                             RunSetting(keep_arrays=keep_arrays, counting=counters, row=shape.r, channels=shape.rows))
        self.params_n = math.prod(shape.param_shape)
        self.param_trace = Trace(self.params_n, keep_arrays, counted=counters)

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
    ``counters=False`` records no trace (the same outputs)."""
    pol = check_family_policy(get_policy(policy))
    eps = check_eps(eps)
    g = _parameter("gamma", gamma, shape, 1.0)
    b = _parameter("beta", beta, shape, None if shape.norm == "rms" else 0.0)
    k = _Kernel(pol, shape, keep_arrays, counters)
    run, acc, r = k.run, k.run.acc, shape.r
    with np.errstate(all="ignore"):
        xs = run.load("x", shape.to_rows(x), run.storage)
        xa = run.cast("x_acc", xs, pol.storage, acc)
        if shape.norm == "rms":
            t = run.tally()
            sq = run.op("squares", acc, np.multiply, xa, xa, tally=t)
            t = run.tally()
            s = run.rec("sum_squares", acc, run.reduce(sq, t), t)
            var = run.rec("mean_square", acc, per_count(s, r, pol.mean_by, acc))
            mean = None
        else:
            method = MomentsMethod(pol.variance, pol.order, pol.lanes, pol.tiles, pol.kahan, pol.mean_by,
                                   pol.clamp_var, pol.unroll, run.cores, pol.sum_format)
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
                       None if b is None else run.param(b))
        par = run.params if pol.saved_format is None else Arith(pol.saved_format, pol.spec, run.rng,
                                                                  counting=run.counting)
        dt = par.fmt.dtype
        saved = (None if mean is None else par.round(mean).astype(dt), par.round(rstd).astype(dt),
                 par.round(var).astype(dt))
    run.trace.meta.update(norm=shape.norm, mode="train", eps=eps, eps_effective=eps_added)
    out = shape.from_rows(np.asarray(y).astype(get_format(pol.storage).dtype))
    return NormResult(out, *saved, run.trace, k.param_trace)


def _applied_rstd(k: _Kernel, rstd: np.ndarray) -> np.ndarray:
    """rstd as the kernel multiplies by it: rounded to the policy's ``rstd_cast`` (recorded) where it names one."""
    pol, run = k.pol, k.run
    if pol.rstd_cast is None:
        return rstd
    return run.rec("rstd_cast", Arith(pol.rstd_cast, pol.spec, run.rng, counting=run.counting), rstd)


def _normalise(k: _Kernel, xs: np.ndarray, mean: np.ndarray | None, rstd: np.ndarray, g: np.ndarray,
               b: np.ndarray | None) -> np.ndarray:
    """y (rows view, storage values) from x, the rows' statistics and γ, β (flat, as the kernel applies them)."""
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
    if pol.y_formula in ("xhat", "scale") and centered is None:
        centered = run.op("centered", comp, np.subtract, xc, run.col(comp, mean))
    if pol.y_formula == "xhat":
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
    None for RMSNorm; ``rstd`` per row), by ``policy``."""
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
    run, acc, comp, r = k.run, k.run.acc, k.run.comp, shape.r
    with np.errstate(all="ignore"):
        dys = run.load("dy", shape.to_rows(dy), run.storage)
        xs = run.load("x", shape.to_rows(x), run.storage)
        mu = None if mean is None else acc.round(run.param(np.asarray(mean, dtype=np.float64).reshape(-1)))
        inv = _applied_rstd(k, acc.round(run.param(np.asarray(rstd, dtype=np.float64).reshape(-1))))
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
        params = run.params
        dgamma = k.param_sum("dgamma", acc.mul(dya, acc.round(xhat)), params)
        dbeta = None if shape.norm == "rms" else k.param_sum("dbeta", dya, params)
    run.trace.meta.update(norm=shape.norm, mode="backward")
    pshape, dt = shape.param_shape, params.fmt.dtype
    return NormGradients(shape.from_rows(np.asarray(dx).astype(get_format(pol.storage).dtype)),
                         dgamma.astype(dt).reshape(pshape), None if dbeta is None else dbeta.astype(dt).reshape(pshape),
                         run.trace, k.param_trace)

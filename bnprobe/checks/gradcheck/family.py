"""gradcheck of BatchNorm's siblings — LayerNorm, RMSNorm, GroupNorm, InstanceNorm: the layer's FP64 forward
differentiated by central differences against its backward, the backward in a format against the FP64 golden by
compare-precision's judge, and the identities the layer's gradients obey, each within the bound of a correct
kernel's accumulation.  One :class:`~bnprobe.checks.gradcheck.gradients.GradcheckResult` per call.

Per row of statistics (R values, :class:`~bnprobe.kernels.layout.NormShape`'s rows), with μ and rstd as the forward
saved them (RMSNorm: μ = 0), x̂ = (x − μ)·rstd, g = dy·γ (γ as applied: offset + w), S0 = Σx̂, S1 = Σg·x̂,
S2 = Σx̂² and G = Σg, the backward dx = rstd·(g − G/R − x̂·S1/R) (RMSNorm: without G/R) gives, exactly in real
arithmetic for whatever statistics it is handed:

- LayerNorm, GroupNorm, InstanceNorm: Σdx = −rstd·S0·S1/R, which is 0 at the row's own mean (S0 = 0: y does not
  move when x shifts); Σdx·x̂ = rstd·(S1·(1 − S2/R) − G·S0/R), which at the row's own statistics is
  rstd·S1·(1 − mean(x̂²)) = ε·rstd³·S1 (mean(x̂²) = σ²/(σ² + ε)): zero only when ε = 0.
- RMSNorm: Σdx·x = S1·(1 − S2/R), at its own rstd ε·rstd²·S1 (mean(x̂²) = ms/(ms + ε)): zero only when ε = 0 (y
  does not move when x scales only without ε).
- Every layer: dβ = Σdy and dγ = Σdy·x̂ over the values each parameter touches (the rows for LayerNorm and RMSNorm,
  the samples and positions of its channel for GroupNorm and InstanceNorm); RMSNorm has no β.

The identities are evaluated in float64 from the kernel's gradients, its inputs as rounded and the statistics its
backward was handed, and each is judged against the sum over its terms of what a correct kernel's rounding can put in
them (:func:`~bnprobe.engine.family.family_bounds`' per-row and per-parameter bounds, the format's unit roundoff):
no fixed tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter, get_adapter
from bnprobe.adapters.base import outputs_only
from bnprobe.adapters.convention import reference_for
from bnprobe.adapters.registry import as_adapter
from bnprobe.checks.gradcheck.gradients import (
    central_difference,
    FD_SAMPLED_COLS,
    FULL_JACOBIAN_MAX,
    GradcheckResult,
    GradRow,
    by_compare,
    grad_row,
    gradient_rows,
    jacobian_rows,
    needs_backward,
)
from bnprobe.core.call import EPS, NORM_NAMES, BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import one_value_per_row
from bnprobe.core.tolerances import (
    FINITE_DIFFERENCE,
    SMALL_VALUE_ULPS,
    accumulation_format,
    check_rtol_atol,
    grad_tolerance,
)
from bnprobe.engine.closeness import bounded_rule
from bnprobe.engine.recorded import Recorded, check_params
from bnprobe.engine.run import CallRun, Golden, generated_call, run_call
from bnprobe.inputs import SEED
from bnprobe.kernels.layout import FAMILY, NormShape, check_eps

__all__ = ["Layer", "gradcheck_norm", "family_inputs", "FAMILY_SHAPES"]

#: each layer's generated input where no shape is given: (batch, tokens, hidden) for LayerNorm and RMSNorm, (N, C, H, W)
#: for GroupNorm and InstanceNorm — small enough that the full Jacobian is formed (about 160 000 and 70 000 entries)
FAMILY_SHAPES: dict[str, tuple[int, ...]] = {"layer": (4, 6, 16), "rms": (4, 6, 16), "group": (2, 8, 4, 4),
                                             "instance": (2, 8, 4, 4)}
FD_ROWS = 8  # a large call's finite differences look at its first rows (a sample's, for GroupNorm and InstanceNorm)
_U64 = get_format("fp64").unit_roundoff  # float64's, in which the identities are evaluated
_EVAL_ULPS = 8.0  # units of float64 roundoff per term of the identities' own float64 evaluation (sums, x̂, products)


@dataclass(frozen=True)
class Layer:
    """A sibling of BatchNorm gradcheck runs: ``norm`` (layer, rms, group, instance), the trailing dims LayerNorm and
    RMSNorm normalise (None: the last), GroupNorm's ``groups``, and ``weight_offset``, added to γ where the model
    stores γ − offset (Gemma's RMSNorm: 1)."""

    norm: str
    normalized_shape: tuple[int, ...] | None = None
    groups: int | None = None
    weight_offset: float = 0.0

    def shape_of(self, shape: tuple[int, ...]) -> NormShape:
        """Where this layer's statistics and parameters sit in x of ``shape`` (each misfit refused in one line)."""
        if self.norm not in FAMILY:
            raise BNProbeError(f"norm must be one of {', '.join(FAMILY)} here (gradcheck runs BatchNorm by its own "
                               f"function), got {self.norm!r}")
        if not math.isfinite(self.weight_offset):
            raise BNProbeError(f"weight_offset must be finite, got {self.weight_offset}")
        return NormShape.of(self.norm, shape, self.normalized_shape, self.groups)

    def describe(self, sh: NormShape) -> str:
        """The layer in a few words: "LayerNorm over (16,)", "GroupNorm of 2 groups", with γ's offset if any."""
        where = {"layer": f" over {sh.normalized}", "rms": f" over {sh.normalized}", "instance": "",
                 "group": f" of {sh.groups} group{'s' if sh.groups > 1 else ''}"}[sh.norm]
        offset = f", γ applied as {self.weight_offset:g} + w" if self.weight_offset else ""
        return f"{NORM_NAMES[sh.norm]}{where}{offset}"


def family_inputs(layer: Layer, shape: tuple[int, ...], seed: int = 0, x: np.ndarray | None = None,
                  eps: float = EPS) -> BNCall:
    """The generated call (float64, seeded): x a unit-scale normal with its own mean (N(0, 1)) and spread (0.5 to 2)
    per row of statistics, γ uniform in 0.5 to 1.5 and β normal (σ 0.1; none for RMSNorm) of the layer's parameter
    shape, dy normal with a mean between 0.5 and 2 per parameter, as real losses give (Σdy then grows with the values
    a parameter touches, and G = Σg is far from 0: a backward that drops it is seen).  ``x`` (of ``shape``): that x
    instead; the parameters and dy are the same either way."""
    sh = layer.shape_of(shape)
    if x is None:
        rng = np.random.default_rng([seed, 0x6AD, 55, 0])
        x = (rng.standard_normal((sh.rows, sh.r)) * rng.uniform(0.5, 2.0, (sh.rows, 1))
             + rng.normal(0.0, 1.0, (sh.rows, 1))).reshape(sh.shape)
    elif np.shape(x) != sh.shape:
        raise BNProbeError(f"x has shape {np.shape(x)}, not the shape {sh.shape} given")
    rng = np.random.default_rng([seed, 0x6AD, 55, 1])
    n = math.prod(sh.param_shape)
    gamma = rng.uniform(0.5, 1.5, n).reshape(sh.param_shape)
    beta = rng.normal(0.0, 0.1, n).reshape(sh.param_shape)
    dy = rng.standard_normal(sh.shape) + sh.from_rows(sh.expand(rng.uniform(0.5, 2.0, n)))
    return BNCall(np.asarray(x, dtype=np.float64), gamma, None if sh.norm == "rms" else beta, dy=dy, eps=eps,
                  dtype="fp64", norm=sh.norm, normalized_shape=sh.normalized or None, groups=layer.groups,
                  weight_offset=layer.weight_offset)


# ---- finite differences -------------------------------------------------------------------------------------------

class _LayerJacobian:
    """y's Jacobian in theta = (x, γ, β) of one adapter's fp64 forward of a family call (RMSNorm: no β): columns by
    central differences, rows (vector-Jacobian products) by its backward from the statistics its forward saved
    (:class:`~bnprobe.checks.gradcheck.gradients.Jacobian`)."""

    def __init__(self, adapter: KernelAdapter, call: BNCall) -> None:
        self.adapter = outputs_only(adapter)  # y, the saved statistics and the gradients are all it reads
        self.call, self.h = call, FINITE_DIFFERENCE["eps"]
        self.shape = tuple(np.shape(call.x))
        self.param_shape = np.shape(call.gamma)
        parts = [np.ravel(call.x), np.ravel(call.gamma)] + ([] if call.beta is None else [np.ravel(call.beta)])
        self.theta = np.concatenate(parts).astype(np.float64)
        self.work = self.theta.copy()
        self.m, self.k = parts[0].size, parts[1].size
        self.p = self.theta.size
        m, k = self.m, self.k
        self.blocks = {"dx": slice(0, m), "dgamma": slice(m, m + k)}
        if call.beta is not None:
            self.blocks["dbeta"] = slice(m + k, m + 2 * k)
        self.saved = self.adapter.train(call).saved

    def _at(self, t: np.ndarray) -> BNCall:
        m, k, ps = self.m, self.k, self.param_shape
        return self.call.with_(x=t[:m].reshape(self.shape), gamma=t[m:m + k].reshape(ps),
                               beta=None if self.call.beta is None else t[m + k:].reshape(ps))

    def y_at(self, t: np.ndarray) -> np.ndarray:
        """y (flat) at theta ``t``."""
        return np.asarray(self.adapter.train(self._at(t)).y, dtype=np.float64).reshape(-1)

    def column(self, i: int) -> np.ndarray:
        """Column i by central differences (theta_i moved by ±h in place)."""
        return central_difference(self.y_at, self.work, self.theta, self.h, i)

    def vjp(self, v: np.ndarray) -> np.ndarray:
        out = self.adapter.backward_of(self.call.with_(dy=np.reshape(v, self.shape)), self.saved)
        grads = [out.dx, out.dgamma] + ([] if self.call.beta is None else [out.dbeta])
        return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in grads])

    def row(self, j: int) -> np.ndarray:
        return self.vjp(np.eye(1, self.m, j).reshape(self.shape))


# ---- the check ----------------------------------------------------------------------------------------------------

def gradcheck_norm(
    adapter: str | KernelAdapter = "emulated",
    layer: str | Layer = "layer",
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
    *,
    seed: int | None = None, eps: float | None = None, params: str | None = None,
    rtol: float | None = None, atol: float | None = None, x: np.ndarray | None = None,
) -> GradcheckResult:
    """gradcheck of a sibling of BatchNorm (``layer``: its norm, or a :class:`Layer` with its normalised shape,
    groups and γ's offset): FP64 central differences of the adapter's own forward against its backward (on the
    reference where the adapter does not run fp64), the adapter's backward in ``dtype`` (default fp16) against the
    FP64 golden — judged by compare-precision's rule in fp16, bf16 and fp32 unless ``rtol`` and ``atol`` are given —
    and the identities of its gradients (this module's docstring), on generated inputs of ``shape`` (default
    :data:`FAMILY_SHAPES`'), ``seed`` (default 0), ``eps`` (default 1e-5) and parameters in fp32 (default) or x's
    format (``params`` same); ``x`` (of ``shape``): the input instead of the generated one.  Truthy when every check
    passed."""
    check_rtol_atol(rtol, atol)
    lay = Layer(layer) if isinstance(layer, str) else layer
    if isinstance(adapter, Recorded) or (a := as_adapter(adapter)).capabilities().recorded:
        name = NORM_NAMES.get(lay.norm, lay.norm)
        raise BNProbeError(f"{name} from a dump is not read yet: gradcheck a dump's BatchNorm calls, or {name} on "
                           "generated inputs", field="adapter")
    shp = FAMILY_SHAPES.get(lay.norm, ()) if shape is None else tuple(int(d) for d in shape)
    sh = lay.shape_of(shp)
    caps = a.capabilities()
    if sh.norm not in caps.norms:
        runs = ", ".join(NORM_NAMES[n] for n in caps.norms)
        raise BNProbeError(f"adapter {a.name} runs {runs} only, not {NORM_NAMES[sh.norm]}: gradcheck it with an "
                           "adapter that does (reference, careful, emulated[:<policy>], torch)", field="adapter")
    needs_backward(a.name, caps.modes, "train")
    fmt = get_format(dtype or "fp16").name
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    check_params(params)
    if sh.r < 2:
        raise BNProbeError(one_value_per_row(NORM_NAMES[sh.norm], sh.shape))
    seed = SEED if seed is None else seed
    call = family_inputs(lay, sh.shape, seed, x, check_eps(EPS if eps is None else eps))
    # 1. finite differences in FP64 on the adapter's own forward where it runs fp64, else on the reference
    fd_target = a if "fp64" in caps.formats else get_adapter("reference")
    part, which = _fd_part(call, sh)
    rows, how = jacobian_rows(_LayerJacobian(fd_target, part), np.random.default_rng([seed, 7]),
                              param_columns=FD_SAMPLED_COLS)
    notes = [f"finite differences on {fd_target.name} in fp64{which}: {how}"]
    # 2. the adapter's backward in its format vs the FP64 golden, through the engine, judged by compare-precision
    rec = generated_call(call.with_(dtype=fmt, params=params or "fp32"), modes=("backward",), label="gradcheck")
    golden = Golden(outputs_only(reference_for(a)), rec)
    run = run_call(outputs_only(a), rec, modes=("backward",), golden=golden, quiet=True)
    rows += _vs_fp64(a, rec, run, golden, grad_tolerance(fmt, rtol, atol), judge=rtol is None)
    # 3. the identities of the adapter's own gradients, from the statistics its backward was handed
    rows += _identities(run, fmt)
    if run.saved is None:
        notes.append(f"{a.name} saves no statistics: the identities use the golden's")
    return GradcheckResult(a.name, fmt, "train", sh.shape, seed, rows, notes, params=params, layer=lay.describe(sh))


def _fd_part(call: BNCall, sh: NormShape) -> tuple[BNCall, str]:
    """The call the finite differences run on, and what of it in words: the whole call where its full Jacobian is
    formed, else its first :data:`FD_ROWS` rows (LayerNorm, RMSNorm) or its first sample (GroupNorm, InstanceNorm) —
    a call of the same layer and parameters, its rows' statistics their own."""
    n = math.prod(sh.param_shape)
    if sh.rows * sh.r * (sh.rows * sh.r + 2 * n) <= FULL_JACOBIAN_MAX:
        return call, ""
    if sh.norm in ("layer", "rms"):
        keep = min(FD_ROWS, sh.rows)
        cut = lambda a: np.reshape(a, (sh.rows, *sh.normalized))[:keep]  # noqa: E731
        return call.with_(x=cut(call.x), dy=cut(call.dy)), f" on rows 0-{keep - 1} of {sh.rows}"
    return call.with_(x=call.x[:1], dy=call.dy[:1]), f" on sample 0 of {sh.shape[0]}"


def _vs_fp64(a: KernelAdapter, rec: Any, run: CallRun, golden: Golden, tol: tuple[float, float], *,
             judge: bool) -> list[GradRow]:
    """The adapter's dx, dγ and dβ against the golden's on the same rounded inputs: by compare-precision's verdict
    (``judge``: its rows for this call, the one judge; msprobe's rules leave fp64 to rtol/atol), else by rtol/atol;
    the measures either way."""
    from bnprobe.checks.compare.precision import judge_call

    judged = gradient_rows(judge_call(a, rec, ("backward",), label="gradcheck", run=run, golden=golden)) \
        if judge else {}
    sh = NormShape.of(run.inputs.norm, np.shape(run.inputs.x), run.inputs.normalized_shape, run.inputs.groups)
    out = []
    for t in ("dx", "dgamma", "dbeta"):
        if t not in run.got:
            continue
        where = (lambda i: _element(sh, i)) if t == "dx" else (lambda i: _parameter(sh, i))
        r = grad_row("vs-fp64", t, run.got[t], run.gold[t], tol, fmt=run.formats[t], where_of=where,
                     detail=f"{a.name} in {run.fmt} vs FP64 on the same rounded inputs")
        out.append(by_compare(r, judged.get(t)))
    return out


def _element(sh: NormShape, i: int) -> str:
    """Where element ``i`` of x (flat) is: its index and its row of statistics."""
    return f"index {tuple(int(v) for v in np.unravel_index(i, sh.shape))} ({_row_of(sh, i // sh.r)})"


def _row_of(sh: NormShape, k: int) -> str:
    """Row ``k`` of statistics in words: its leading index, or its sample and group or channel."""
    if sh.norm in ("layer", "rms"):
        lead = sh.shape[:len(sh.shape) - len(sh.normalized)]
        return f"row {tuple(int(v) for v in np.unravel_index(k, lead))}"
    n, j = divmod(k, sh.groups)
    return f"sample {n}, {'group' if sh.norm == 'group' else 'channel'} {j}"


def _parameter(sh: NormShape, i: int) -> str:
    """Where parameter ``i`` (flat) is: its index in the normalised shape, or its channel."""
    if sh.norm in ("layer", "rms"):
        return f"element {tuple(int(v) for v in np.unravel_index(i, sh.param_shape))}"
    return f"channel {i}"


# ---- identities ---------------------------------------------------------------------------------------------------

def _identities(run: CallRun, fmt: str) -> list[GradRow]:
    """The identities of the kernel's gradients (this module's docstring) per row and per parameter, each judged
    against its bound: per row Σ over its terms of |weight|·(half an ulp of dx in its format + SMALL_VALUE_ULPS·u·dx's
    natural scale + the bound of dx's sums), per parameter half an ulp of the output plus the bound of its sum
    (:func:`~bnprobe.engine.family.family_bounds`), with u the accumulation format's unit roundoff; plus the float64
    evaluation's own rounding."""
    c = run.inputs
    sh = NormShape.of(c.norm, np.shape(c.x), c.normalized_shape, c.groups)
    stats = run.saved if run.saved is not None else run.gold_saved
    rms, r = sh.norm == "rms", sh.r
    u = get_format(accumulation_format(fmt)).unit_roundoff
    with np.errstate(all="ignore"):
        xr, dyr = sh.to_rows(c.x), sh.to_rows(c.dy)
        gamma = np.ones(math.prod(sh.param_shape)) if c.gamma is None else np.asarray(c.gamma, np.float64).ravel()
        g = dyr * sh.expand(gamma + c.weight_offset)
        mu = np.zeros(sh.rows) if rms else np.asarray(stats.mean, dtype=np.float64).ravel()
        rstd = np.asarray(stats.value, dtype=np.float64).ravel()
        xhat = (xr - mu[:, None]) * rstd[:, None]
        dx = sh.to_rows(run.got["dx"])
        s0, s1, s2, gs = xhat.sum(1), (g * xhat).sum(1), (xhat**2).sum(1), g.sum(1)
        # per element of dx, what a correct kernel's rounding can put there: its output's rounding, its elementwise
        # arithmetic on the values it is formed from, and its sums' accumulation (family_bounds' per-row figures)
        dx_fmt = get_format(run.formats["dx"])
        per = 0.5 * dx_fmt.ulp(np.abs(dx)) + (SMALL_VALUE_ULPS * u * run.scales["dx"]
                                               + np.nan_to_num(run.bounds["dx"][0]))[:, None]
        ab1, abx = np.abs(g * xhat).sum(1), np.abs(xhat).sum(1)
        if rms:
            checks = [("sum(dx*x) = sum(g*xhat)*(1-mean(xhat^2))", dx * xr, s1 * (1 - s2 / r),
                       np.abs(xr), ab1 * (1 + s2 / r))]
        else:
            checks = [("sum(dx) = 0", dx, -rstd * s0 * s1 / r, np.ones_like(dx), rstd * abx * ab1 / r),
                      ("sum(dx*xhat) = rstd*sum(g*xhat)*(1-mean(xhat^2))", dx * xhat,
                       rstd * (s1 * (1 - s2 / r) - gs * s0 / r), np.abs(xhat),
                       rstd * (ab1 * (1 + s2 / r) + np.abs(g).sum(1) * abx / r))]
    rows = []
    for name, terms, want, weight, magnitude in checks:
        with np.errstate(all="ignore"):
            got, scale = terms.sum(1), np.abs(terms).sum(1)
            bound = (np.abs(weight) * per).sum(1) + _EVAL_ULPS * (r + 4) * _U64 * (scale + magnitude)
        rows.append(_judged(name, got, want, scale, bound, lambda k: _row_of(sh, k),
                            f"per row of statistics, x̂ from the statistics the backward was handed (1 − mean(x̂²) = "
                            f"ε·rstd² at the row's own: 0 only when ε = 0); bound: Σ|weight|·(½ ulp of dx + "
                            f"{SMALL_VALUE_ULPS:g}u·dx's natural scale + its sums' bound), u = 2^{int(np.log2(u))}"))
    rows += _parameter_identities(run, sh, dyr, xhat, u)
    return rows


def _parameter_identities(run: CallRun, sh: NormShape, dyr: np.ndarray, xhat: np.ndarray, u: float) -> list[GradRow]:
    """dβ = Σdy and dγ = Σdy·x̂ per parameter, each within half an ulp of its output's format plus the bound of a
    correct kernel's sum of those terms (:func:`~bnprobe.engine.family.family_bounds`)."""
    k = sh.rows * sh.r // math.prod(sh.param_shape)
    rows = []
    for name, t, terms in (("dbeta = sum(dy)", "dbeta", dyr), ("dgamma = sum(dy*xhat)", "dgamma", dyr * xhat)):
        if t not in run.got:
            continue
        with np.errstate(all="ignore"):
            got = np.asarray(run.got[t], dtype=np.float64).ravel()
            gathered = sh.gather(terms)
            want, scale = gathered.sum(1), np.abs(gathered).sum(1)
            bound = 0.5 * get_format(run.formats[t]).ulp(np.abs(got)) + np.nan_to_num(run.bounds[t][0]) + \
                _EVAL_ULPS * (k + 4) * _U64 * scale
        rows.append(_judged(name, got, want, scale, bound, lambda i: _parameter(sh, i),
                            f"per parameter over its {k} values, x̂ from the statistics the backward was handed; bound: "
                            f"½ ulp of the output + {run.bounds[t][1]}"))
    return rows


def _judged(name: str, got: np.ndarray, want: np.ndarray, scale: np.ndarray, bound: np.ndarray, where: Any,
            detail: str) -> GradRow:
    """An identity's row: |got − want| <= ``bound`` for every row or parameter (:func:`~bnprobe.engine.closeness
    .bounded_rule`); the residual relative to the identity's own ``scale`` (the sum of its terms' magnitudes) as its
    relative error and as the rtol it needs, and the allowance there as its rtol."""
    v = bounded_rule(got, want, bound, where=where)
    with np.errstate(all="ignore"):
        resid = np.abs(got - want)
        rel = resid / np.where(scale > 0, scale, 1.0)
        allowed = float(bound.flat[v.worst] / (scale.flat[v.worst] if scale.flat[v.worst] > 0 else 1.0))
    max_abs = float(np.nanmax(resid)) if np.isfinite(resid).all() else math.inf
    max_rel = float(np.nanmax(rel)) if np.isfinite(rel).all() else math.inf
    return GradRow("identity", name, v.passed, max_abs, max_rel, allowed, 0.0, max_abs, max_rel, v.used,
                   where(v.worst), detail)

"""What the overflow check judges of a kernel's observable results, traced or not: the saved statistics, y's
per-channel moments and dx's identities, each against the FP64 golden on the same inputs, with a bound that a
careful kernel meets.

Every bound is derived from the accumulation bound of the format a correct kernel accumulates in
(γ_R = R·u/(1 − R·u) for R terms, :func:`~bnprobe.core.tolerances.accumulation_bound`), its unit roundoff u, the
rounding allowance of a correct kernel's elementwise arithmetic (SMALL_VALUE_ULPS units of u) and half an ulp of
the format each value is returned in (:func:`~bnprobe.engine.rules.bound_used`).  With δμ = γ_R·mean|x| the
largest error of a correct mean:

- the variance, σ'² against σ²: (γ_R + 3u)·(σ² + δμ²) + δμ² (a two-pass sum of squares about a mean off by δμ);
  judged as the scale 1/sqrt(σ'² + ε) a kernel normalises with, relative bound ½·that/(σ² + ε) + 8u + u_params
  (the statistics held in the parameter format; δμ then also takes u_params·|mean|);
- y per channel: its std against the golden's within |γ|·std(x̂)·(that relative bound) plus the elementwise
  rounding, its mean within |γ|·invstd·δμ plus the same;
- dx per channel: Σdx and Σdx·x̂ (both 0 for the exact gradient) within the elementwise rounding summed over
  the channel plus what statistics within those bounds move them by (through mean(dy·x̂) and mean(dy)).

A one-pass variance E[x²] − E[x]² errs by about u·E[x²]: far beyond these once mean²/σ² exceeds ~R.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from bnprobe.checks.overflow.report import OverflowFinding, RowLayout, index_str, input_at
from bnprobe.engine.rules import bound_used
from bnprobe.engine.run import CallRun
from bnprobe.core.formats import get_format
from bnprobe.engine.family import family_shape
from bnprobe.kernels.layout import layout_of
from bnprobe.core.tolerances import SMALL_VALUE_ULPS, accumulation_bound, accumulation_format, variance_bound

__all__ = ["observed_findings", "CarefulBounds"]


class CarefulBounds:
    """Per channel, what a careful kernel's statistics can err by on a call (x channel-first ``x_cr``, the golden's
    mean and variance, ``fmt`` the call's format, ``params`` the format its statistics are held in: a kernel may
    normalise with them rounded there, as PyTorch's CPU kernel does with same-format parameters)."""

    def __init__(self, x_cr: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float, fmt: str,
                 params: str) -> None:
        self.terms = x_cr.shape[1]
        self.acc = accumulation_format(fmt)
        self.u = get_format(self.acc).unit_roundoff
        gam = accumulation_bound(fmt, self.terms)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.mean_abs = np.nanmean(np.abs(x_cr), axis=1)
        self.gamma_r = gam
        up = get_format(params).unit_roundoff
        self.dmean = gam * self.mean_abs + up * np.abs(mean)
        self.mean, self.var = mean, var
        self.invstd = 1.0 / np.sqrt(var + eps)
        self.var_bound = variance_bound(gam, self.u, var, self.dmean)
        self.scale_rel = 0.5 * self.var_bound / (var + eps) + SMALL_VALUE_ULPS * self.u + up
        self.shift = self.dmean * self.invstd  # the largest shift of a correct x̂, in units of σ

    def rule(self) -> str:
        """The bound in words, for a finding's message."""
        return (f"a careful kernel accumulating its {self.terms} terms in {self.acc} errs by at most "
                f"γ_R = {self.gamma_r:.3g} of Σ|terms| (u = {self.u:.3g}), + ½ ulp of the output")


def _finding(anomaly: str, stage: str, fmt: str, used: np.ndarray, x_cr: np.ndarray, detail: Any) -> OverflowFinding:
    """A finding of the channels where ``used`` (share of the bound, per channel) exceeds 1; ``detail(c)`` the message
    at the worst channel c."""
    bad = ~(used <= 1.0)
    chans = np.flatnonzero(bad)
    c = int(chans[np.argmax(np.nan_to_num(used[chans], nan=np.inf))])
    return OverflowFinding(anomaly, stage, fmt, tuple(chans.tolist()), int(chans.size), f"channel {c}",
                           input_at(c, x_cr, False), f"{detail(c)}; {chans.size} / {used.size} channels")


def _variance_finding(run: CallRun, b: CarefulBounds, x_cr: np.ndarray, name: str) -> OverflowFinding | None:
    """The saved statistics' scale 1/sqrt(σ'² + ε) against the golden's, within ``b``'s relative bound."""
    got, gold, formats = run.invstd_view()
    if "saved_invstd" not in got:
        return None
    inv, fmt = np.asarray(got["saved_invstd"], dtype=np.float64), formats["saved_invstd"]
    # a zero or NaN/inf invstd is the output findings' (underflow, nan, inf): judged here are the plausible ones
    used = np.where(np.isfinite(inv) & (inv > 0), bound_used(inv, b.invstd, b.scale_rel * b.invstd, fmt), 0.0)
    if np.all(used <= 1.0):
        return None
    eps = run.eps
    with np.errstate(all="ignore"):
        var_k = 1.0 / (inv * inv) - eps
        ex2 = np.nanmean(x_cr * x_cr, axis=1)
    saved = "invstd" if "saved_invstd" in run.got else "var"

    def detail(c: int) -> str:
        return (f"{name}: the kernel's variance {var_k[c]:.6g} (saved {saved}; invstd {inv[c]:.6g}) vs "
                f"{b.var[c]:.6g} FP64 golden (invstd {b.invstd[c]:.6g}), while E[x²] = {ex2[c]:.6g}: invstd off "
                f"by {abs(inv[c] / b.invstd[c] - 1):.3g} relative, {used[c]:.3g}× the {b.scale_rel[c]:.3g} allowed "
                f"(½·((γ_R + 3u)(σ² + δμ²) + δμ²)/(σ² + ε) + {SMALL_VALUE_ULPS:g}u + u_params, δμ = γ_R·mean|x| + "
                f"u_params·|mean|; {b.rule()})")
    return _finding("variance_error", "variance (saved)", fmt, used, x_cr, detail)


def _mean_finding(run: CallRun, b: CarefulBounds, x_cr: np.ndarray) -> OverflowFinding | None:
    """The saved mean against the golden's within γ_R·mean|x|."""
    if "saved_mean" not in run.got:
        return None
    m, fmt = np.asarray(run.got["saved_mean"], dtype=np.float64), run.formats["saved_mean"]
    used = bound_used(m, b.mean, b.dmean, fmt)
    if np.all(used <= 1.0):
        return None

    def detail(c: int) -> str:
        return (f"the kernel's mean {m[c]:.8g} vs {b.mean[c]:.8g} FP64 golden: off by {abs(m[c] - b.mean[c]):.3g}, "
                f"{used[c]:.3g}× the γ_R·mean|x| = {b.dmean[c]:.3g} allowed ({b.rule()})")
    return _finding("mean_error", "mean (saved)", fmt, used, x_cr, detail)


def _per_channel(v: Any, vec: Any, default: float) -> np.ndarray:
    return np.full(v, default) if vec is None else np.asarray(vec, dtype=np.float64).reshape(-1)


def _y_findings(run: CallRun, b: CarefulBounds, x_cr: np.ndarray, xhat: np.ndarray, lay: Any) -> list[OverflowFinding]:
    """y's per-channel std and mean against the golden y's."""
    if "y" not in run.got:
        return []
    y, yg = lay.to_cr(np.asarray(run.got["y"], dtype=np.float64)), lay.to_cr(run.gold["y"])
    fmt = run.formats["y"]
    c = x_cr.shape[0]
    g, beta = np.abs(_per_channel(c, run.inputs.gamma, 1.0)), np.abs(_per_channel(c, run.inputs.beta, 0.0))
    # a NaN/inf, zero or constant channel is the output findings' (nan, inf, zero_output, constant_output)
    ok = np.all(np.isfinite(y), axis=1) & np.all(np.isfinite(yg), axis=1) & ~np.all(y == y[:, :1], axis=1)
    with np.errstate(all="ignore"):
        elem = get_format(fmt).unit_roundoff * np.abs(yg).max(axis=1) + \
            SMALL_VALUE_ULPS * b.u * (g * np.abs(xhat).max(axis=1) + beta)
        moments = (("std", y.std(axis=1), yg.std(axis=1), g * xhat.std(axis=1) * b.scale_rel + elem),
                   ("mean", y.mean(axis=1), yg.mean(axis=1), g * b.invstd * b.dmean * (1 + b.scale_rel) + elem))
    def detail(what: str, got: np.ndarray, gold: np.ndarray, bound: np.ndarray, used: np.ndarray, k: int) -> str:
        return (f"y's per-channel {what} {got[k]:.6g} vs {gold[k]:.6g} of the FP64 golden y (max |y| "
                f"{np.abs(y[k]).max():.4g} vs {np.abs(yg[k]).max():.4g}): off by {abs(got[k] - gold[k]):.3g}, "
                f"{used[k]:.3g}× the {bound[k]:.3g} allowed (the statistics' bounds carried into y, + u of "
                f"{fmt}·max|y| + {SMALL_VALUE_ULPS:g}u·(|γ|·max|x̂| + |β|); {b.rule()})")

    return _flagged("y_moments", "y: per-channel {}", moments, ok, fmt, x_cr, detail)


def _flagged(anomaly: str, stage: str, checks: Any, ok: np.ndarray, fmt: str, x_cr: np.ndarray,
             detail: Callable[..., str]) -> list[OverflowFinding]:
    """A finding per check (what, observed, golden, bound per channel) whose observed value leaves its bound on
    some channel ``ok`` to judge; ``detail(what, got, gold, bound, used, channel)`` says it."""
    out = []
    for what, got, gold, bound in checks:
        used = np.where(ok, bound_used(got, gold, bound, "fp64"), 0.0)
        if not np.all(used <= 1.0):
            out.append(_finding(anomaly, stage.format(what), fmt, used, x_cr,
                                functools.partial(detail, what, got, gold, bound, used)))
    return out


def _dx_findings(run: CallRun, b: CarefulBounds, x_cr: np.ndarray, xhat: np.ndarray, lay: Any) -> list[OverflowFinding]:
    """Σdx and Σdx·x̂ per channel (0 for the exact training gradient) against the golden dx's."""
    dy = run.recording.tensors.get("backward", {}).get("inputs", {}).get("dy")
    if "dx" not in run.got or dy is None or not run.inputs.training or "dx" not in run.scales:
        return []
    dx, dxg = lay.to_cr(np.asarray(run.got["dx"], dtype=np.float64)), lay.to_cr(run.gold["dx"])
    fmt = run.formats["dx"]
    c, r = x_cr.shape
    g = np.abs(_per_channel(c, run.inputs.gamma, 1.0))
    with np.errstate(all="ignore"):
        dy_cr = lay.to_cr(np.asarray(dy, dtype=np.float64))
        m1, m2 = np.abs(dy_cr.mean(axis=1)), np.abs(np.mean(dy_cr * xhat, axis=1))
        elem = 0.5 * get_format(fmt).ulp(dxg) + SMALL_VALUE_ULPS * b.u * run.scales["dx"][:, None]
        ok = np.all(np.isfinite(dx), axis=1) & np.all(np.isfinite(dxg), axis=1)
        # statistics off by δμ (shift t = δμ·invstd) and a scale s = invstd'/invstd within 1 ± rel make
        # Σdx = |γ|·invstd'·R·t·mean(dy·x̂') and Σdx·x̂ = |γ|·invstd'·R·(mean(dy·x̂)·(1 − s²) + s·t·mean(dy))
        rel, t = b.scale_rel, b.shift
        moved = g * b.invstd * (1 + rel) * r
        checks = (("Σdx", np.ones_like(xhat), moved * t * ((1 + rel) * m2 + t * m1)),
                  ("Σdx·x̂", xhat, moved * (m2 * ((1 + rel) ** 2 - 1) + (1 + rel) * t * m1)))
    with np.errstate(all="ignore"):
        sums = [(what, (dx * w).sum(axis=1), (dxg * w).sum(axis=1), (elem * np.abs(w)).sum(axis=1) + stats)
                for what, w, stats in checks]

    def detail(what: str, got: np.ndarray, gold: np.ndarray, bound: np.ndarray, used: np.ndarray, k: int) -> str:
        return (f"{what} over the channel is {got[k]:.4g} (FP64 golden dx: {gold[k]:.3g}; exactly 0 for the "
                f"exact gradient), {used[k]:.3g}× the {bound[k]:.3g} allowed (½ ulp of {fmt} + "
                f"{SMALL_VALUE_ULPS:g}u of dx's natural magnitude per element, summed, + what the statistics' "
                f"bounds move it by); max |dx − golden| = {np.abs(dx[k] - dxg[k]).max():.3g}")

    return _flagged("dx_identity", "dx: {} identity", sums, ok, fmt, x_cr, detail)


def observed_findings(run: CallRun, variance_name: str = "variance off") -> list[OverflowFinding]:
    """A training call's observable results (saved statistics, y, dx) against the FP64 golden, each within what
    a careful kernel meets (the module's bounds); ``variance_name`` names a variance finding (e.g. "cancellation
    in the variance" where the kernel is known to form E[x²] − E[x]²).  Nothing for a call without a training
    golden or with NaN/inf in x (its other findings say so)."""
    if run.gold_saved is None:
        return []
    ci = run.inputs
    if ci.norm != "batch":
        return family_findings(run, variance_name)
    lay = layout_of(ci.x, run.recording.layout)
    x_cr = lay.to_cr(np.asarray(ci.x, dtype=np.float64))
    if not np.isfinite(x_cr).all() or x_cr.shape[1] < 2:
        return []
    mean = np.asarray(run.gold_saved.mean, dtype=np.float64)
    b = CarefulBounds(x_cr, mean, run.gold_saved.var(run.eps), run.eps, run.fmt, run.recording.params)
    xhat = (x_cr - mean[:, None]) * b.invstd[:, None]
    found = [_mean_finding(run, b, x_cr), _variance_finding(run, b, x_cr, variance_name)]
    return [f for f in found if f is not None] + _y_findings(run, b, x_cr, xhat, lay) + \
        _dx_findings(run, b, x_cr, xhat, lay)


def _held(run: CallRun, lay: RowLayout, xr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a correct kernel's statistics held in the parameter format can add to y's error per element and to dx's
    per row (``xr``: x's rows)."""
    ci = run.inputs
    up = get_format(run.recording.params).unit_roundoff
    # a correct kernel may normalise with its statistics rounded to the parameter format (PyTorch's CPU kernels with
    # 16-bit parameters): rstd off by 2·u_params relative (the variance and rstd held there) and μ by
    # u_params·|μ|, carried into y and dx
    sh = lay.norm_shape
    gm0 = np.zeros(sh.rows) if sh.norm == "rms" else np.asarray(run.gold_saved.mean, dtype=np.float64).reshape(-1)
    rstd0 = np.asarray(run.gold_saved.invstd(run.eps), dtype=np.float64).reshape(-1)
    gamma = np.ones(int(np.prod(sh.param_shape))) if ci.gamma is None else \
        np.asarray(ci.gamma, dtype=np.float64).reshape(-1)
    ge = np.abs(sh.expand(gamma + ci.weight_offset))
    with np.errstate(all="ignore"):
        dev = np.abs(xr - gm0[:, None])
        held_y = ge * rstd0[:, None] * up * (np.abs(gm0)[:, None] + 2 * dev)
        dy_in = run.recording.tensors.get("backward", {}).get("inputs", {}).get("dy")
        held_dx = np.zeros((sh.rows, 1))
        if dy_in is not None and "dx" in run.scales:
            gmax = np.nanmax(np.abs(lay.to_cr(np.asarray(dy_in, dtype=np.float64))) * ge, axis=1)
            xmax = np.nanmax(dev, axis=1) * rstd0
            held_dx = (up * (3 * np.asarray(run.scales["dx"], dtype=np.float64).reshape(-1) +
                             2 * rstd0 * np.abs(gm0) * rstd0 * gmax * xmax))[:, None]
    return held_y, held_dx


def _elementwise_bound(run: CallRun, lay: RowLayout, key: str, held: np.ndarray) -> tuple[np.ndarray, str]:
    """y's bound per element, dx's per row (+ a correct kernel's elementwise rounding of dx's natural magnitude, as
    compare-precision allows it), each + ``held`` (the statistics held in the parameter format), in the rows view."""
    bnd, how = run.bounds[key]
    if key == "y":
        return lay.to_cr(np.broadcast_to(bnd, lay.shape)) + held, how
    u = get_format(accumulation_format(run.fmt)).unit_roundoff
    b = np.asarray(bnd, dtype=np.float64).reshape(-1, 1)
    return b + SMALL_VALUE_ULPS * u * np.asarray(run.scales["dx"], dtype=np.float64).reshape(-1, 1) + held, how


def family_findings(run: CallRun, variance_name: str = "variance off") -> list[OverflowFinding]:
    """A LayerNorm, RMSNorm, GroupNorm or InstanceNorm training call's observable results against the FP64 golden,
    row by row, each within what a correct kernel's accumulation can err by (the run's bounds,
    :func:`~bnprobe.engine.family.family_bounds`, + ½ ulp of the format returned): the saved mean (γ_R·mean|x| +
    u_params·|μ|), the saved rstd (``variance_name`` names its finding), y and dx, element by element.  Nothing
    without a training golden, or with NaN/inf in x (the input findings say so)."""
    ci = run.inputs
    lay = RowLayout(family_shape(ci))
    xr = lay.to_cr(np.asarray(ci.x, dtype=np.float64))
    if run.gold_saved is None or not np.isfinite(xr).all() or xr.shape[1] < 2:
        return []
    r = xr.shape[1]
    gam = accumulation_bound(run.fmt, r)
    mean_abs = np.abs(xr).mean(axis=1)
    pf = run.recording.params
    up = get_format(pf).unit_roundoff
    out: list[OverflowFinding] = []

    def held(fmt: str) -> str:
        """The coarser of ``fmt`` (a statistic's returned dtype) and the parameter format it is held in."""
        return pf if get_format(pf).precision < get_format(fmt).precision else fmt

    held_y, held_dx = _held(run, lay, xr)

    def flag(anomaly: str, stage: str, fmt: str, used: np.ndarray, detail: Callable[[int], str]) -> None:
        used = np.where(np.isnan(used), np.inf, used)
        if np.all(used <= 1.0):
            return
        rows = np.flatnonzero(used > 1.0)
        k = int(rows[np.argmax(used[rows])])
        out.append(OverflowFinding(anomaly, stage, fmt, tuple(rows.tolist()), int(rows.size), index_str(k, lay, False),
                                   input_at(k, xr, False, lay), f"{detail(k)}; {rows.size} / {used.size} rows"))

    def finite(*arrays: np.ndarray) -> np.ndarray:
        # a NaN/inf in the output is the output findings' (nan, inf, zero_output): judged here are the finite ones
        return np.all([np.isfinite(a).reshape(a.shape[0], -1).all(axis=1) for a in arrays], axis=0)

    if "saved_mean" in run.got:
        m, gm, fmt = (np.asarray(run.got["saved_mean"], dtype=np.float64).reshape(-1), run.gold["saved_mean"],
                      held(run.formats["saved_mean"]))
        dm = gam * mean_abs + get_format(run.recording.params).unit_roundoff * np.abs(gm)
        used = np.where(finite(m[:, None]), bound_used(m, gm, dm, fmt), 0.0)
        flag("mean_error", "mean (saved)", fmt, used, lambda k: (
            f"the kernel's mean {m[k]:.8g} vs {gm[k]:.8g} FP64 golden: off by {abs(m[k] - gm[k]):.3g}, {used[k]:.3g}× "
            f"the {dm[k]:.3g} allowed (γ_R·mean|x| + u_params·|μ|, γ_R = {gam:.3g}, R = {r})"))
    if "saved_rstd" in run.got and "saved_rstd" in run.bounds:
        v, gv, fmt = (np.asarray(run.got["saved_rstd"], dtype=np.float64).reshape(-1), run.gold["saved_rstd"],
                      held(run.formats["saved_rstd"]))
        bnd, how = run.bounds["saved_rstd"]
        # + u_params·rstd: the variance may be held in the parameter format before its root (two roundings there)
        bnd = bnd + up * np.abs(gv)
        how += f"; + u_params·rstd, the variance held in {pf}"
        used = np.where(finite(v[:, None]) & (v > 0), bound_used(v, gv, bnd, fmt), 0.0)
        with np.errstate(all="ignore"):
            ex2 = (xr * xr).mean(axis=1)
            ratio = np.where(xr.var(axis=1) > 0, xr.mean(axis=1) ** 2 / xr.var(axis=1), np.inf)
        flag("variance_error", "rstd (saved)", fmt, used, lambda k: (
            f"{variance_name}: the kernel's rstd {v[k]:.6g} vs {gv[k]:.6g} FP64 golden (E[x²] = {ex2[k]:.6g}, "
            f"mean²/var = {ratio[k]:.3g}): off by {abs(v[k] / gv[k] - 1):.3g} relative, {used[k]:.3g}× the "
            f"{bnd[k]:.3g} allowed ({how})"))
    for key in ("y", "dx"):
        if key not in run.got or key not in run.bounds:
            continue
        a, g, fmt = lay.to_cr(np.asarray(run.got[key], dtype=np.float64)), lay.to_cr(run.gold[key]), run.formats[key]
        b, how = _elementwise_bound(run, lay, key, held_y if key == "y" else held_dx)
        with np.errstate(all="ignore"):
            per = np.where(finite(a, g)[:, None], bound_used(a, g, b, fmt), 0.0)
        used = per.max(axis=1)
        at = per.argmax(axis=1)
        flag(f"{key}_error", key, fmt, used, lambda k, a=a, g=g, b=b, at=at, key=key, how=how, used=used, fmt=fmt: (
            f"{key} = {a[k, at[k]]:.6g} vs {g[k, at[k]]:.6g} FP64 golden at {lay.element(k * r + int(at[k]))}: "
            f"{used[k]:.3g}× the {np.broadcast_to(b, a.shape)[k, at[k]]:.3g} allowed ({how}; + the statistics held in "
            f"{pf}, + ½ ulp of {fmt})"))
    return out

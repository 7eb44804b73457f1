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

from bnprobe.checks.overflow.report import OverflowFinding, input_at
from bnprobe.engine.rules import bound_used
from bnprobe.engine.run import CallRun
from bnprobe.core.formats import get_format
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

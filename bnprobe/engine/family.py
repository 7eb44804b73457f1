"""The family layers in the run engine — LayerNorm, RMSNorm, GroupNorm, InstanceNorm: per row of their statistics
and per parameter, the magnitudes their outputs are formed from, and the error a correct kernel's accumulation can
put into them whatever its summation order.  These are BatchNorm's bounds (:mod:`bnprobe.engine.run`) with a row
of statistics in place of a channel, g = dy·γ in place of dy in dx, and the values each parameter touches (K of
them: the rows for LayerNorm and RMSNorm, N·H·W for GroupNorm and InstanceNorm) in place of a channel's in dγ and
dβ; RMSNorm has no mean, so no mean's error enters.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from bnprobe.core.formats import get_format
from bnprobe.core.kernel import Saved
from bnprobe.core.tolerances import (SMALL_VALUE_ULPS, accumulation_bound, accumulation_format, accumulation_words,
                                     family_statistics_bounds)
from bnprobe.kernels.layout import NormShape

__all__ = ["family_shape", "family_y_natural", "family_bounds", "per_row_element"]


def family_shape(call: Any) -> NormShape:
    """Where a family call's statistics and parameters sit."""
    return NormShape.of(call.norm, np.shape(call.x), call.normalized_shape, call.groups)


def _params(call: Any, sh: NormShape) -> tuple[np.ndarray, np.ndarray]:
    """γ as applied (offset + w; 1 where none) and β (0 where none), each as the ``(rows, R)`` array x meets."""
    p = np.prod(sh.param_shape, dtype=int)
    g = np.ones(p) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64).reshape(-1)
    b = np.zeros(p) if call.beta is None else np.asarray(call.beta, dtype=np.float64).reshape(-1)
    return sh.expand(g + call.weight_offset), sh.expand(b)


def per_row_element(call: Any, v: np.ndarray) -> np.ndarray:
    """A per-row value as an x-shaped array (each element its row's)."""
    sh = family_shape(call)
    return sh.from_rows(np.broadcast_to(np.asarray(v, dtype=np.float64).reshape(-1, 1), (sh.rows, sh.r)))


def family_y_natural(call: Any, stats: Saved) -> np.ndarray:
    """Per element of y, the magnitude it is formed from: |x·rstd·γ| + |μ·rstd·γ| + |β| (golden statistics)."""
    sh = family_shape(call)
    ge, be = _params(call, sh)
    r = np.abs(np.asarray(stats.invstd(call.eps), dtype=np.float64))[:, None]
    mu = 0.0 if stats.mean is None else np.abs(np.asarray(stats.mean, dtype=np.float64))[:, None]
    with np.errstate(all="ignore"):
        return sh.from_rows(np.abs(sh.to_rows(call.x)) * r * np.abs(ge) + mu * r * np.abs(ge) + np.abs(be))


def _deviation(xr: np.ndarray, stats: Saved, rms: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The row's mean and mean|x − μ| (None for RMSNorm, or statistics without a mean): what the variance's bound
    charges a running mean's deviations with (:func:`~bnprobe.core.tolerances.family_statistics_bounds`)."""
    if rms or stats.mean is None:
        return None, None
    mu = np.asarray(stats.mean, dtype=np.float64)
    return mu, np.nanmean(np.abs(xr - mu[:, None]), axis=1)


def family_bounds(call: Any, gold: Saved | None, stats: Saved | None, dy: np.ndarray | None,
                  ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, str]]]:
    """The natural scales (per row: saved_mean, dx; per parameter: dγ, dβ) and the bounds of a correct kernel's
    accumulation (saved_rstd from ``gold``, the golden's statistics; dβ, dγ and dx where the sums cancel, with
    ``stats`` the statistics the backward used and ``dy``), each with its formula in words.

    With R values per row, K per parameter and γ_n = n·u/(1 − n·u) (n of R or K terms; past
    :data:`~bnprobe.core.tolerances.SEQUENTIAL_TERMS` a blocked sum's count,
    :func:`~bnprobe.core.tolerances.accumulated_terms`), u the unit roundoff of the accumulation format: the mean
    errs by δμ = γ_R·mean|x| (none for RMSNorm); the variance (RMSNorm: the mean square) by
    (γ_R + 3u)·(σ² + δμ²) + δμ² + 2·SMALL_VALUE_ULPS·u·|μ|·mean|x − μ| (the last for a running mean's deviations,
    Welford's), so rstd by rstd·(½·that/(σ² + ε) + SMALL_VALUE_ULPS·u); dβ = Σdy by γ_K·Σ|dy|;
    dγ = Σdy·x̂ by γ_K·2·Σ|dy·x̂| + Σ|dy|·(rstd·δμ + |x − μ|·δrstd); dx = rstd·(g − Σg/R − x̂·Σ(g·x̂)/R) by
    rstd·(γ_R·Σ|g| + max|x̂|·γ_R·(2·Σ|g·x̂| + rstd·mean|x|·Σ|g|))/R (RMSNorm: the Σg terms left out)."""
    sh = family_shape(call)
    r = sh.r
    acc = accumulation_format(call.dtype)
    u = get_format(acc).unit_roundoff
    u_exp = int(np.log2(u))
    how = f"u = 2^{u_exp} ({acc} accumulation, any order)"
    g_r, rhs_r = accumulation_words(r)
    rms = sh.norm == "rms"
    scales: dict[str, np.ndarray] = {}
    bounds: dict[str, tuple[np.ndarray, str]] = {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        xr = sh.to_rows(call.x)
        mean_abs = np.nanmean(np.abs(xr), axis=1)
        scales["saved_mean"] = mean_abs
        if gold is not None:
            var = np.asarray(gold.var(call.eps), dtype=np.float64)
            mu_g, dev = _deviation(xr, gold, rms)
            dmean, b_rstd = family_statistics_bounds(call.dtype, r, mu_g, var, call.eps, mean_abs, dev, rms=rms)
            inv = 1.0 / np.sqrt(var + call.eps)
            what = "the mean square" if rms else "the variance"
            bounds["saved_rstd"] = (b_rstd,
                                    f"rstd·(½·{what}'s bound/(σ² + ε) + {SMALL_VALUE_ULPS:g}u), {what}'s bound "
                                    f"({g_r} + 3u)·(σ² + δμ²) + δμ²"
                                    f"{'' if rms else f' + 2·{SMALL_VALUE_ULPS:g}u·|μ|·mean|x − μ|'}"
                                    f"{'' if rms else f', δμ = {g_r}·mean|x|'}, "
                                    f"{g_r} = {rhs_r}, {how}")
            # y = (x − μ)·rstd·γ + β with the statistics off by their bounds, plus a correct kernel's rounding of it
            ge, _ = _params(call, sh)
            mu0 = np.zeros(sh.rows) if rms else np.asarray(gold.mean, dtype=np.float64)
            b_inv = bounds["saved_rstd"][0]
            nat = sh.to_rows(family_y_natural(call, gold))
            b_y = np.abs(ge) * ((inv * dmean)[:, None] + np.abs(xr - mu0[:, None]) * b_inv[:, None]) + \
                SMALL_VALUE_ULPS * u * nat
            bounds["y"] = (sh.from_rows(b_y), f"|γ|·(rstd·δμ + |x − μ|·δrstd) + {SMALL_VALUE_ULPS:g}u·(the magnitude y "
                                              f"is formed from), δrstd saved_rstd's bound"
                                              f"{'' if rms else ', δμ = γ_R·mean|x|'}, γ_R = {rhs_r}, {how}")
    if stats is not None and dy is not None:
        _gradient_bounds(call, sh, stats, dy, scales, bounds)
    return scales, bounds


def _gradient_bounds(call: Any, sh: NormShape, stats: Saved, dy: np.ndarray, scales: dict[str, np.ndarray],
                     bounds: dict[str, tuple[np.ndarray, str]]) -> None:
    """dβ's, dγ's and dx's natural scales and bounds (:func:`family_bounds`), added to ``scales`` and ``bounds``."""
    r, k = sh.r, sh.rows * sh.r // int(np.prod(sh.param_shape))
    acc = accumulation_format(call.dtype)
    u = get_format(acc).unit_roundoff
    gr, gk = accumulation_bound(call.dtype, r), accumulation_bound(call.dtype, k)
    how = f"u = 2^{int(np.log2(u))} ({acc} accumulation, any order)"
    g_k, rhs_k = accumulation_words(k)
    rhs_r = accumulation_words(r)[1]
    rms = sh.norm == "rms"
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        xr = sh.to_rows(call.x)
        mean_abs = scales["saved_mean"]
        rstd = np.asarray(stats.invstd(call.eps), dtype=np.float64)
        mu = np.zeros(sh.rows) if stats.mean is None or rms else np.asarray(stats.mean, dtype=np.float64)
        ge, _ = _params(call, sh)
        dev = xr - mu[:, None]
        xhat = dev * rstd[:, None]
        dyr = sh.to_rows(dy)
        g = dyr * ge
        gx = g * xhat
        scales["dbeta"] = np.nansum(sh.gather(np.abs(dyr)), axis=1)
        scales["dgamma"] = np.nansum(sh.gather(np.abs(dyr * xhat)), axis=1)
        xmax = np.nanmax(np.abs(xhat), axis=1)
        gsum, gxsum = np.nansum(np.abs(g), axis=1), np.nansum(np.abs(gx), axis=1)
        gmean = 0.0 if rms else np.abs(np.nanmean(g, axis=1))
        scales["dx"] = rstd * (np.nanmax(np.abs(g), axis=1) + gmean + xmax * np.abs(np.nanmean(gx, axis=1)))
        # the statistics' errors, per row, as they enter every x̂ of the row
        mu_s, dev_s = _deviation(xr, stats, rms)
        dmean, drstd = family_statistics_bounds(call.dtype, r, mu_s, stats.var(call.eps), call.eps, mean_abs, dev_s,
                                                rms=rms, rstd=rstd)
        stat_err = np.abs(dyr) * ((rstd * dmean)[:, None] + np.abs(dev) * drstd[:, None])
        bounds["dbeta"] = (gk * scales["dbeta"], f"{g_k}·Σ|dy|, {g_k} = {rhs_k}, {how}")
        bounds["dgamma"] = (2 * gk * scales["dgamma"] + np.nansum(sh.gather(stat_err), axis=1),
                            f"2·{g_k}·Σ|dy·x̂| + Σ|dy|·(rstd·δμ + |x − μ|·δrstd) with the statistics' bounds, "
                            f"{g_k} = {rhs_k}, {how}")
        # (dγ and dβ are shaped as γ: a multi-dimensional normalised shape's scales and bounds too)
        ps = sh.param_shape
        scales["dbeta"], scales["dgamma"] = scales["dbeta"].reshape(ps), scales["dgamma"].reshape(ps)
        bounds["dbeta"] = (bounds["dbeta"][0].reshape(ps), bounds["dbeta"][1])
        bounds["dgamma"] = (bounds["dgamma"][0].reshape(ps), bounds["dgamma"][1])
        inner = 2 * gxsum if rms else 2 * gxsum + rstd * mean_abs * gsum
        b_dx = rstd * ((0.0 if rms else gr * gsum) + xmax * gr * inner) / r
        bounds["dx"] = (b_dx, f"rstd·({'' if rms else 'γ_R·Σ|g| + '}max|x̂|·γ_R·(2·Σ|g·x̂|"
                              f"{'' if rms else ' + rstd·mean|x|·Σ|g|'}))/{r}, g = dy·γ, γ_R = {rhs_r}, "
                              f"{how}")

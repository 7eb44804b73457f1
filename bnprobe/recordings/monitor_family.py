"""What :func:`bnprobe.monitor` checks of a normalisation-family call (LayerNorm, RMSNorm, GroupNorm, InstanceNorm),
per row of its ``(rows, R)`` view (:class:`~bnprobe.kernels.layout.NormShape`: a token's features for LayerNorm and
RMSNorm, a sample's group or channel for GroupNorm and InstanceNorm): the row's exact statistics, and how far the
kernel's output and saved statistics are from the FP64 golden on the same x, γ, β, as a fraction of what a correct
kernel's accumulation and roundings can put there.

The golden is computed on the tensor's device in float64 (two-pass mean and variance, y = (x − μ)·rstd·γ + β;
RMSNorm: y = x·rstd·γ with the mean square), so it costs a few float64 passes over x per call: the price of a check
against the golden, paid by the family's calls only.  The bound per element of y is the run engine's
(:func:`~bnprobe.core.tolerances.family_statistics_bounds` for the statistics' errors, then
|γ|·(rstd·δμ + |x − μ|·δrstd) + SMALL_VALUE_ULPS·u·(|x·rstd·γ| + |μ·rstd·γ| + |β|)), plus two spacings of x's
format and one of y's at that magnitude: a composite that casts x̂ to x's format before ·γ (Hugging Face's RMSNorm)
errs there by ½·|γ|·spacing(x̂), which reaches spacing(|γ·x̂|) where γ is just below a power of two (seen: 0.97 of
it on fp16), and y rounds once more.  A saved statistic may err by its bound plus two spacings of the format it was
saved in (an all-bf16 LayerNorm saves bf16 statistics; torch's all-bf16 InstanceNorm rounds in bf16 on the way to its
saved rstd, which was seen 0.86 of one spacing from the exact one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.core.tolerances import SMALL_VALUE_ULPS, accumulation_format, family_statistics_bounds
from bnprobe.core.formats import get_format
from bnprobe.kernels.layout import NormShape

__all__ = ["golden_rows", "GOLDEN_COLUMNS"]

#: the per-row columns :func:`golden_rows` gives
GOLDEN_COLUMNS = ("mean", "var", "rstd", "stats_err", "y_err")


def _spacing(v: Any, dtype: Any) -> Any:
    """The spacing of ``dtype``'s values at |v| (a float64 tensor; the smallest subnormal's below the normal range)."""
    import torch

    fi = torch.finfo(dtype)
    _, e = torch.frexp(v.abs())
    return torch.clamp(torch.ldexp(torch.full_like(v, fi.eps / 2), e), min=fi.tiny * fi.eps)


def _per_element(p: Any, sh: NormShape, like: Any) -> Any:
    """A parameter (flat) as the ``(rows, R)`` tensor of the value each x meets (float64, on x's device)."""
    import torch

    p = p.reshape(-1).to(device=like.device, dtype=torch.float64)
    if sh.norm in ("layer", "rms"):
        return p.reshape(1, sh.r).expand(sh.rows, sh.r)
    c = sh.shape[1]
    return p.reshape(1, c, *([1] * (len(sh.shape) - 2))).expand(sh.shape).reshape(sh.rows, sh.r)


def golden_rows(x: Any, y: Any, sh: NormShape, *, eps: float, gamma: Any = None, beta: Any = None,
                offset: float = 0.0, saved: tuple[Any, Any] | None = None) -> dict[str, np.ndarray]:
    """Per row of ``sh``: the exact ``mean`` (NaN for RMSNorm) and ``var`` (RMSNorm: the mean square, what ε is added
    to) of x, the kernel's saved ``rstd`` (NaN where ``saved``, its (mean, rstd), is None), and the largest
    |kernel − golden| / bound over the row: ``stats_err`` of the saved mean and rstd, ``y_err`` of y.  Above 1 the
    kernel is beyond what a correct one can be; NaN where x's row is not finite (the golden is then undefined)."""
    import torch

    rms = sh.norm == "rms"
    fmt = get_format(str(x.dtype)).name
    u = get_format(accumulation_format(fmt)).unit_roundoff
    with torch.no_grad():
        xr = x.detach().to(torch.float64).reshape(sh.rows, sh.r)
        ok = torch.isfinite(xr).all(dim=1)
        mu = torch.zeros(sh.rows, dtype=torch.float64, device=x.device) if rms else xr.mean(dim=1)
        dev = xr - mu[:, None]
        var = (dev * dev).mean(dim=1)
        host = torch.stack([mu, var, xr.abs().mean(dim=1), dev.abs().mean(dim=1)]).cpu().numpy()
        dmean, drstd = family_statistics_bounds(fmt, sh.r, None if rms else host[0], host[1], eps, host[2],
                                                None if rms else host[3], rms=rms)
        rstd = torch.rsqrt(var + eps)
        g = _per_element(gamma, sh, xr) + offset if gamma is not None else torch.full_like(xr, 1.0 + offset)
        b = _per_element(beta, sh, xr) if beta is not None else torch.zeros_like(xr)
        ge = g.abs()
        yg = dev * rstd[:, None] * g + b
        nat = (xr.abs() * rstd[:, None] + mu.abs()[:, None] * rstd[:, None]) * ge + b.abs()
        dm = torch.as_tensor(dmean, device=x.device)[:, None]
        dr = torch.as_tensor(drstd, device=x.device)[:, None]
        tol = ge * (rstd[:, None] * dm + dev.abs() * dr) + SMALL_VALUE_ULPS * u * nat + 2 * _spacing(nat, x.dtype) \
            + _spacing(nat, y.dtype)
        yk = y.detach().to(torch.float64).reshape(sh.rows, sh.r)
        y_err = torch.amax((yk - yg).abs() / tol, dim=1)
        nan = torch.full_like(var, float("nan"))
        if saved is not None:
            sm, sr = (s.detach().reshape(-1).to(torch.float64) for s in saved)
            err = (sr - rstd).abs() / (dr[:, 0] + 2 * _spacing(rstd, saved[1].dtype))
            if not rms:
                err = torch.maximum(err, (sm - mu).abs() / (dm[:, 0] + 2 * _spacing(mu, saved[0].dtype)))
            stats_err, rstd_k = err, sr
        else:
            stats_err, rstd_k = nan, nan
        rows = torch.stack([torch.where(ok, mu, nan) if not rms else nan, var, rstd_k,
                            torch.where(ok, stats_err, nan), torch.where(ok, y_err, nan)]).cpu().numpy()
    return dict(zip(GOLDEN_COLUMNS, rows))

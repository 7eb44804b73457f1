"""What :func:`bnprobe.monitor` checks of a normalisation-family call (LayerNorm, RMSNorm, GroupNorm, InstanceNorm),
per row of its ``(rows, R)`` view (:class:`~bnprobe.kernels.layout.NormShape`: a token's features for LayerNorm and
RMSNorm, a sample's group or channel for GroupNorm and InstanceNorm): the row's exact statistics, and how far the
kernel's output and saved statistics are from the FP64 golden on the same x, γ, β, as a fraction of what a correct
kernel's accumulation and roundings can put there.

The golden is computed on the tensor's device in float64 (two-pass mean and variance, y = (x − μ)·rstd·γ + β;
RMSNorm: y = x·rstd·γ with the mean square), so it costs about fifteen float64 passes over x per call (0.3 s for a
(8, 512, 1024) fp32 LayerNorm on one CPU thread): the price of a check against the golden, paid by the family's calls
only.  The bound per element of y is the run engine's (:func:`~bnprobe.core.tolerances.family_statistics_bounds` for
the statistics' errors, then |γ|·(rstd·δμ + |x − μ|·δrstd) + SMALL_VALUE_ULPS·u·(the magnitude y is formed from)),
with two units of x's format and one of y's added to that relative term: a composite that casts x̂ to x's format
before ·γ (Hugging Face's RMSNorm) errs there by ½·|γ|·spacing(x̂), which reaches spacing(|γ·x̂|) where γ is just
below a power of two (seen: 0.97 of it on fp16), and y rounds once more.  The magnitude is taken as
(|x − μ| + 2·|μ|)·rstd·|γ| + |β|, at least the engine's |x·rstd·γ| + |μ·rstd·γ| + |β| (a pass fewer).  A saved
statistic may err by its bound plus two spacings of the format it was saved in (an all-bf16 LayerNorm saves bf16
statistics; torch's all-bf16 InstanceNorm rounds in bf16 on the way to its saved rstd, which was seen 0.86 of one
spacing from the exact one).
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


def _blocks(sh: NormShape) -> tuple[int, int, int]:
    """x as ``(rows, K, S)``: each row's R values as K parameter blocks of S (LayerNorm, RMSNorm: one block of R
    values, each with its own γ; GroupNorm, InstanceNorm: the group's C/G channels of H·W values)."""
    if sh.norm in ("layer", "rms"):
        return sh.rows, 1, sh.r
    k = sh.shape[1] // sh.groups
    return sh.rows, k, sh.r // k


def _param(p: Any, sh: NormShape, like: Any, offset: float) -> Any:
    """A parameter (flat; None: ``offset``'s γ of 1, or no β) as what broadcasts against :func:`_blocks`' view."""
    import torch

    rows, k, s = _blocks(sh)
    if p is None:
        return torch.tensor(offset + 1.0 if offset is not None else 0.0, dtype=torch.float64, device=like.device)
    p = p.detach().reshape(-1).to(device=like.device, dtype=torch.float64) + (offset or 0.0)
    if sh.norm in ("layer", "rms"):
        return p.reshape(1, 1, s)
    return p.reshape(1, sh.groups, k, 1).expand(rows // sh.groups, sh.groups, k, 1).reshape(rows, k, 1)


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
    fx, fy = torch.finfo(x.dtype), torch.finfo(y.dtype)
    rows, k, s = _blocks(sh)
    with torch.no_grad():
        xv = x.detach().to(torch.float64).reshape(rows, k, s)
        mu = torch.zeros(rows, 1, 1, dtype=torch.float64, device=x.device) if rms else \
            xv.mean(dim=(1, 2), keepdim=True)
        dev = xv - mu
        norms = torch.stack([torch.linalg.vector_norm(dev, ord=o, dim=(1, 2)) for o in (2, 1)]
                            + [torch.linalg.vector_norm(xv, ord=1, dim=(1, 2))])
        var, mad, mab = norms[0] ** 2 / sh.r, norms[1] / sh.r, norms[2] / sh.r
        ok = torch.isfinite(var)  # (a NaN or ±inf in the row makes its mean of squares NaN or inf)
        mu = mu.reshape(rows)
        host = torch.stack([mu, var, mab, mad]).cpu().numpy()
        dmean, drstd = family_statistics_bounds(fmt, sh.r, None if rms else host[0], host[1], eps, host[2],
                                                None if rms else host[3], rms=rms)
        dm = torch.as_tensor(dmean, device=x.device)
        dr = torch.as_tensor(drstd, device=x.device)
        rstd = torch.rsqrt(var + eps)
        g, b = _param(gamma, sh, xv, offset), _param(beta, sh, xv, None)
        t = dev.mul_(rstd[:, None, None])  # x̂ (dev's storage)
        diff = y.detach().to(torch.float64).reshape(rows, k, s).sub_(torch.addcmul(b, t, g)).abs_()
        # the bound: |γ|·(rstd·δμ + |x − μ|·δrstd) + c·(the magnitude y is formed from), c the accumulation's
        # SMALL_VALUE_ULPS·u, two units of x's format (the cast of x̂ before ·γ) and one of y's; that magnitude
        # |x·rstd·γ| + |μ·rstd·γ| + |β| taken as (|x̂| + 2·|μ|·rstd)·|γ| + |β| (|x| ≤ |x − μ| + |μ|), and a unit
        # of the formats' subnormals below their normal range
        c = SMALL_VALUE_ULPS * u + 2 * fx.eps + fy.eps
        k1 = (dr / rstd + c)[:, None, None]
        k2 = (rstd * (dm + 2 * c * mu.abs()))[:, None, None]
        tol = torch.addcmul(k2, t.abs_(), k1).mul_(g.abs()).add_(c * b.abs() + 2 * fx.tiny * fx.eps +
                                                                  fy.tiny * fy.eps)
        y_err = torch.amax(diff.div_(tol), dim=(1, 2))
        nan = torch.full_like(var, float("nan"))
        if saved is not None:
            sm, sr = (v.detach().reshape(-1).to(torch.float64) for v in saved)
            err = (sr - rstd).abs() / (dr + 2 * _spacing(rstd, saved[1].dtype))
            if not rms:
                err = torch.maximum(err, (sm - mu).abs() / (dm + 2 * _spacing(mu, saved[0].dtype)))
            stats_err, rstd_k = err, sr
        else:
            stats_err, rstd_k = nan, nan
        rows_out = torch.stack([torch.where(ok, mu, nan) if not rms else nan, var, rstd_k,
                                torch.where(ok, stats_err, nan), torch.where(ok, y_err, nan)]).cpu().numpy()
    return dict(zip(GOLDEN_COLUMNS, rows_out))

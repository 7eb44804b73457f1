"""Low-precision kernels: outputs are values of their format, and errors stay within a derived bound.

The bound is a first-order rounding-error analysis of the policy's formulas
(x̂ form, two-pass variance, pairwise sums).  With u_a, u_c, u_s, u_p the unit
roundoffs of the accumulate, compute, storage and params formats,
d = ceil(log2 R) the depth of a pairwise tree and g_k = k·u/(1 - k·u):

  mean     |dμ|   <= g_{d+1}(u_a) · mean|x|
  variance |dvar| <= (d+4)·u_a·var + dμ²          (Σ(x-μ) = 0 kills the cross term)
  rstd     |dρ|/ρ <= (|dvar| + u_a(var+ε)) / (2(var+ε)) + u_a
  x̂_i     |dx̂_i| <= ρ(dμ_c + u_c|x_i-μ|) + |x_i-μ|·ρ·(dρ/ρ + u_c) + u_c|x̂_i|
  y_i      |dy_i| <= |γ|·|dx̂_i| + u_c(|γx̂_i| + |y_i|) + u_s(|y_i| + ...) + half the smallest subnormal

where dμ_c adds u_c·|μ| when μ is cast to a narrower compute format.  The
backward bound follows the same steps through sum(dy), sum(dy·x̂), the two
means and dx = γρ·(dy − mean(dy) − x̂·mean(dy·x̂)).  A safety factor of 1.5
covers the second-order terms.  The test runs many seeds per preset.
"""

from math import ceil, log2

import numpy as np
import pytest

from bnprobe.core.formats import get_format
from bnprobe.kernels import backward, forward_train, get_policy
from bnprobe.numerics.rounding import is_representable, round_to

PRESETS = ["fp32", "fp16", "bf16", "fp16-acc16", "bf16-acc16"]
SAFETY = 1.5


def units(pol):
    return tuple(get_format(f).unit_roundoff for f in (pol.accumulate, pol.compute, pol.storage, pol.params_format))


def g(k, u):
    return k * u / (1 - k * u)


def forward_bound(x, gamma, beta, eps, pol):
    """Per-element bound on |y_emulated - y_exact| (x, gamma, beta already rounded; channel-first (C, R))."""
    ua, uc, us, _ = units(pol)
    r = x.shape[1]
    d = ceil(log2(r)) if r > 1 else 1
    mu = x.mean(axis=1)
    var = ((x - mu[:, None]) ** 2).mean(axis=1)
    rho = 1 / np.sqrt(var + eps)
    dmu = g(d + 1, ua) * np.abs(x).mean(axis=1)
    dvar = (d + 4) * ua * var + dmu**2 + ua * eps
    drho = (dvar + ua * (var + eps)) / (2 * (var + eps)) + ua
    narrow = get_format(pol.compute).precision < get_format(pol.accumulate).precision
    dmu_c = dmu + (uc * np.abs(mu) if narrow else 0)
    dev = np.abs(x - mu[:, None])
    xhat = (x - mu[:, None]) * rho[:, None]
    y = gamma[:, None] * xhat + beta[:, None]
    dxhat = rho[:, None] * (dmu_c[:, None] + uc * dev) + dev * rho[:, None] * (drho[:, None] + uc) + uc * np.abs(xhat)
    dy = np.abs(gamma)[:, None] * dxhat + uc * (np.abs(gamma[:, None] * xhat) + np.abs(y) + np.abs(beta)[:, None])
    fs = get_format(pol.storage)
    return SAFETY * (dy + us * (np.abs(y) + dy)) + fs.smallest_subnormal / 2, y


def backward_bound(dy, x, gamma, mean, invstd, pol):
    """Per-element bound on |dx| error and per-channel bounds on dgamma / dbeta (standard form)."""
    ua, uc, us, up = units(pol)
    r = x.shape[1]
    d = ceil(log2(r)) if r > 1 else 1
    dev = x - mean[:, None]
    xhat = dev * invstd[:, None]
    dxhat = invstd[:, None] * uc * np.abs(dev) + 2 * uc * np.abs(xhat)
    sdy = dy.sum(axis=1)
    sdyx = (dy * xhat).sum(axis=1)
    e_sdy = g(d, ua) * np.abs(dy).sum(axis=1)
    e_sdyx = (np.abs(dy) * dxhat).sum(axis=1) + g(d + 1, ua) * np.abs(dy * xhat).sum(axis=1) + ua * np.abs(
        dy * xhat).sum(axis=1)
    m1, m2 = sdy / r, sdyx / r
    e_m1 = e_sdy / r + ua * np.abs(m1)
    e_m2 = e_sdyx / r + ua * np.abs(m2)
    t1 = dy - m1[:, None]
    t2 = xhat * m2[:, None]
    t3 = t1 - t2
    scale = gamma * invstd
    e_t3 = (e_m1[:, None] + uc * np.abs(t1)) + (np.abs(m2)[:, None] * dxhat + np.abs(xhat) * e_m2[:, None]
                                                + uc * np.abs(t2)) + uc * np.abs(t3)
    dx = scale[:, None] * t3
    e_dx = np.abs(scale)[:, None] * e_t3 + np.abs(t3) * ua * np.abs(scale)[:, None] + uc * np.abs(dx)
    fs = get_format(pol.storage)
    e_dx = SAFETY * (e_dx + us * (np.abs(dx) + e_dx)) + fs.smallest_subnormal / 2
    e_dg = SAFETY * (e_sdyx + up * np.abs(sdyx))
    e_db = SAFETY * (e_sdy + up * np.abs(sdy))
    return e_dx, dx, e_dg, sdyx, e_db, sdy


def cr(a):
    return np.moveaxis(np.asarray(a, dtype=np.float64), 1, 0).reshape(a.shape[1], -1)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("seed", range(12))
def test_forward_and_backward_within_derived_bound(preset, seed):
    pol = get_policy(preset)
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(2, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 9)))
    c = shape[1]
    loc = rng.uniform(-4, 4, c).reshape(1, c, 1, 1)
    scale = np.exp(rng.uniform(-2, 2, c)).reshape(1, c, 1, 1)
    x = round_to(rng.standard_normal(shape) * scale + loc, pol.storage)
    gamma = round_to(rng.uniform(0.2, 2, c), pol.params_format)
    beta = round_to(rng.standard_normal(c), pol.params_format)
    eps = 1e-5
    if shape[0] * shape[2] * shape[3] < 2:
        return
    res = forward_train(x, gamma, beta, np.zeros(c), np.ones(c), eps=eps, policy=pol)
    # outputs are exactly values of their formats
    assert is_representable(res.y.astype(np.float64), pol.storage).all()
    for v in (res.mean, res.invstd, res.var, res.running_mean, res.running_var):
        assert is_representable(v.astype(np.float64), pol.params_format).all()
    eps_eff = float(round_to(eps, pol.accumulate))
    bound, y_exact = forward_bound(cr(x), gamma, beta, eps_eff, pol)
    err = np.abs(cr(res.y) - y_exact)
    assert (err <= bound).all(), f"worst ratio {np.max(err / bound):.3g}"
    # backward with the emulated kernel's own saved statistics, golden on the same values
    dy = round_to(rng.standard_normal(shape), pol.storage)
    mean, invstd = res.mean.astype(np.float64), res.invstd.astype(np.float64)
    bw = backward(dy, x, gamma, mean, invstd, policy=pol)
    assert is_representable(bw.dx.astype(np.float64), pol.storage).all()
    e_dx, dx, e_dg, dg, e_db, db = backward_bound(cr(dy), cr(x), gamma, mean, invstd, pol)
    assert (np.abs(cr(bw.dx) - dx) <= e_dx).all(), f"dx worst ratio {np.max(np.abs(cr(bw.dx) - dx) / e_dx):.3g}"
    assert (np.abs(bw.dgamma.astype(np.float64) - dg) <= e_dg).all()
    assert (np.abs(bw.dbeta.astype(np.float64) - db) <= e_db).all()


@pytest.mark.parametrize("preset", ["fp16", "bf16"])
def test_bound_is_not_vacuous(preset):
    """The bound is within a small factor of the error actually seen, so it would catch a real regression."""
    pol = get_policy(preset)
    rng = np.random.default_rng(0)
    x = round_to(rng.standard_normal((16, 4, 8, 8)), pol.storage)
    gamma, beta = np.ones(4), np.zeros(4)
    res = forward_train(x, gamma, beta, policy=pol)
    bound, y = forward_bound(cr(x), gamma, beta, float(round_to(1e-5, pol.accumulate)), pol)
    err = np.abs(cr(res.y) - y)
    # the worst element uses a sizeable share of its bound (output rounding dominates: ~1/3 of it)
    assert np.max(err / bound) > 0.2

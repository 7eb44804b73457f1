"""Gradient checks: numerical vs analytic gradients, an adapter's backward vs the FP64 golden,
the identities BatchNorm's gradients obey, and candidate backward formulas.

Numerical gradients are central differences in FP64 (torch.autograd.gradcheck's eps, atol, rtol):
the full Jacobian of y with respect to (x, gamma, beta) for small tensors, random projections
v^T J u plus sampled Jacobian entries for large ones.  Comparisons use |a - n| <= atol + rtol·|n|.

On a recording (a :class:`~bnprobe.engine.recorded.Recorded`, given to :func:`gradcheck` in place of the kernel)
every call is checked on its own recorded inputs: the finite differences run on the golden at those inputs (its
first channels: channels are independent), the kernel's backward (the recorded one, for a dump) is compared with
the golden's on the same inputs, with atol relative to each gradient's natural scale (recorded data is not of unit
scale), and the identities are checked on the kernel's gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM, BNCall
from bnprobe._loading import first_line, kind_of, load_callable, raised
from bnprobe.adapters import KernelAdapter, Saved, get_adapter
from bnprobe.adapters.base import outputs_only, params_format, stored_inputs
from bnprobe.engine.recorded import PerCall, Recorded, check_options, given, given_to, only_call
from bnprobe.engine.result import Judged, Verdict
from bnprobe.engine.run import CallRun, each_run
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import needs_modes, one_value_per_channel
from bnprobe.kernels.layout import channel_column, element_at, layout_of, reduce_axes, to_channels_first
from bnprobe.engine.closeness import allclose_rule, scaled_rule
from bnprobe.engine.metrics import compare
from bnprobe.core.tolerances import FINITE_DIFFERENCE, check_rtol_atol, grad_tolerance
from bnprobe.inputs import SEED, input_shape

__all__ = ["GradRow", "GradcheckResult", "gradcheck", "check_formula", "FORMULAS", "central_difference",
           "FULL_JACOBIAN_MAX", "FD_CHANNELS"]

FULL_JACOBIAN_MAX = 250_000  # entries M*P up to which the full Jacobian is formed
FD_CHANNELS = 8  # finite differences at a recorded call's inputs look at its first channels (they are independent)
FD_RECORDED_FULL_MAX = 20_000  # a recording may hold many calls: projections beyond this many Jacobian entries
FD_PROJECTIONS = 12
FD_SAMPLED_ROWS = 8
FD_SAMPLED_COLS = 24


@dataclass(frozen=True)
class GradRow:
    check: str  # finite-differences, vs-fp64, identity, formula
    tensor: str
    passed: bool
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    min_atol: float  # the smallest atol that passes at this rtol (the smallest tolerance that would have passed)
    min_rtol: float = 0.0  # the smallest rtol that passes at this atol
    used: float = 0.0  # max |a - n| / (atol + rtol·|n|): the share of the tolerance used (> 1 fails)
    where: str = ""
    detail: str = ""
    cosine: float | None = None
    ratio_1e3: float | None = None
    ratio_5e3: float | None = None
    ulp_max: float | None = None

    @property
    def status(self) -> Verdict:
        return Verdict.of(self.passed)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


@dataclass(frozen=True)
class GradcheckResult(Judged):
    adapter: str
    dtype: str
    mode: str
    shape: tuple[int, ...]
    seed: int
    rows: list[GradRow]
    notes: list[str] = field(default_factory=list)
    call: str | None = None  # the recorded call checked (its label), None for generated inputs
    params: str | None = None  # the parameters' format asked for (fp32, same), None when not asked (fp32)
    layer: str | None = None  # a sibling of BatchNorm checked (e.g. "LayerNorm over (16,)"), None for BatchNorm

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def frame(self):  # -> pandas.DataFrame
        """One row per check and tensor (:meth:`to_frame`; ``rows`` holds them as :class:`GradRow`)."""
        return self.to_frame()

    def failed(self) -> list[GradRow]:
        return [r for r in self.rows if not r.passed]

    def to_frame(self):  # -> pandas.DataFrame
        import pandas as pd

        call = {} if self.call is None else {"call": self.call}
        layer = {} if self.layer is None else {"layer": self.layer}
        return pd.DataFrame([{**call, "adapter": self.adapter, **layer, "dtype": self.dtype, "mode": self.mode,
                              **r.to_dict()} for r in self.rows])

    def to_dict(self) -> dict[str, Any]:
        return {**({} if self.call is None else {"call": self.call}), "adapter": self.adapter,
                **({} if self.layer is None else {"layer": self.layer}), "dtype": self.dtype,
                "mode": self.mode, "shape": list(self.shape), "seed": self.seed, "passed": bool(self),
                "notes": self.notes, "rows": [r.to_dict() for r in self.rows]}


def grad_row(check: str, tensor: str, actual: np.ndarray, expected: np.ndarray, tol: tuple[float, float], *,
         fmt: str = "fp64", where_of: Callable[[int], str] | None = None, detail: str = "",
         scale: np.ndarray | None = None, equal_nan: bool = False) -> GradRow:
    """The judge's :func:`~bnprobe.engine.closeness.allclose_rule` at ``tol`` (rtol, atol: |a - e| <= atol·scale +
    rtol·|e| elementwise, scale 1 when None; ``equal_nan``: as that rule says, an infinity where the expected value
    has the same one passes when rtol > 0, and a NaN where it has NaN still fails, though the intent was that an
    input-borne NaN is not the kernel's error) as a row, with msprobe's measures in ``fmt``."""
    rtol, atol = tol
    v = allclose_rule(actual, expected, rtol, atol, scale=scale, equal_nan=equal_nan, where=where_of)
    m = compare(np.asarray(actual, dtype=np.float64).reshape(-1), np.asarray(expected, dtype=np.float64).reshape(-1),
                fmt)
    return GradRow(check, tensor, v.passed, v.max_abs, v.max_rel, rtol, atol, v.need_atol, v.need_rtol, v.used,
                   v.where, detail, m.cosine, m.ratio_1e3, m.ratio_5e3, m.ulp_max)


# ---- inputs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    x: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    dy: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray


def make_inputs(shape: tuple[int, ...], seed: int = 0, x: np.ndarray | None = None,
                eps: float | None = None) -> Inputs:
    """Unit-scale inputs with distinct per-channel statistics (seeded), dy with a mean per channel between 0.5 and
    2 as real losses give (Σdy then grows with R: a backward that keeps it in a 16-bit format is seen);
    ``x`` (of ``shape``): that x instead.  ``eps`` (given, and two channels or more): the last channel centred at 0
    with a standard deviation of √ε, so that where ε enters the root shows in every gradient of that channel
    (√(max(σ², ε)) or √σ² + ε against √(σ² + ε): a factor up to √2), as it does in real layers whose channel went
    constant; at unit scale it is a few parts in 10⁶, within a correct fp32 kernel's error."""
    if x is not None:
        if np.shape(x) != tuple(shape):
            raise BNProbeError(f"x has shape {np.shape(x)}, not the shape {tuple(shape)} given")
        return replace(make_inputs(shape, seed), x=np.asarray(x, dtype=np.float64))
    rng = np.random.default_rng([seed, 0x6AD])
    c = shape[1]
    col = (1, c) + (1,) * (len(shape) - 2)
    z = rng.standard_normal(shape)
    std, shift = rng.uniform(0.5, 2.0, c), rng.normal(0, 1, c)
    if eps is not None and c >= 2:
        std[-1], shift[-1] = math.sqrt(eps), 0.0
    x = z * std.reshape(col) + shift.reshape(col)
    g, b, dy = rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.standard_normal(shape)
    dy += np.random.default_rng([seed, 0x6AD, 1]).uniform(0.5, 2.0, c).reshape(col)
    return Inputs(x, g, b, dy, rng.normal(0, 0.5, c), rng.uniform(0.5, 2.0, c))


def _where(shape: tuple[int, ...]) -> Callable[[int], str]:
    """Where element i of a tensor of ``shape`` is (:func:`~bnprobe.kernels.layout.element_at`)."""
    return functools.partial(element_at, shape=tuple(shape))


# ---- finite differences -------------------------------------------------------------------------

def central_difference(y_at: Callable[[np.ndarray], np.ndarray], work: np.ndarray, theta: np.ndarray, h: float,
                       i: int) -> np.ndarray:
    """Column i of y's Jacobian by central differences: ``work`` (a copy of ``theta``) moved by ±h at i in place and
    restored — a whole copy of theta per evaluation cost as much as the fp64 forward itself on a large call."""
    work[i] = theta[i] + h
    up = y_at(work)
    work[i] = theta[i] - h
    down = y_at(work)
    work[i] = theta[i]
    with np.errstate(invalid="ignore"):  # (inf - inf where y is not finite: NaN, no warning)
        return (up - down) / (2 * h)


class _Jacobian:
    """y's Jacobian in theta = (x, gamma, beta) of one adapter's fp64 forward: columns by central differences,
    rows (vector-Jacobian products) by its backward."""

    def __init__(self, adapter: KernelAdapter, inp: Inputs, mode: str, eps: float) -> None:
        self.adapter = outputs_only(adapter)  # y, the saved statistics and the gradients are all it reads
        self.inp, self.eps, self.train = inp, eps, mode == "train"
        x, g, b = inp.x, inp.gamma, inp.beta
        self.c, self.shape, self.h = g.size, x.shape, FINITE_DIFFERENCE["eps"]
        self.saved = self.adapter.train(BNCall(x, g, b, dtype="fp64", eps=eps)).saved if self.train else \
            Saved(inp.running_mean, "var", inp.running_var)
        self.theta = np.concatenate([x.reshape(-1), g, b])
        self.m, self.p = x.size, self.theta.size
        self.work = self.theta.copy()
        m, c, p = self.m, self.c, self.p
        self.blocks = {"dx": slice(0, m), "dgamma": slice(m, m + c), "dbeta": slice(m + c, p)}
        # bnprobe's FP64 reference computes each channel alone (its channel blocks give the same bits as one pass):
        # a column moves one channel's input, so only that channel is run again, the others' differences being
        # those of the unmoved forward, y0 - y0 (0, or NaN where y0 is not finite)
        caps = self.adapter.capabilities()
        self.by_channel = caps.golden and caps.staged  # (a subclass changing how a call runs is not staged)
        self._still: np.ndarray | None = None

    def y_at(self, t: np.ndarray, k: int | None = None) -> np.ndarray:
        """y (flat) at theta ``t``; ``k``: of channel k alone, from theta's channel k (t is then that channel's)."""
        a, inp, m, c = self.adapter, self.inp, self.m, self.c
        if k is None:
            xx, gg, bb, rm, rv = t[:m].reshape(self.shape), t[m:m + c], t[m + c:], inp.running_mean, inp.running_var
        else:
            one = (self.shape[0], 1, *self.shape[2:])
            xx, gg, bb = t[:-2].reshape(one), t[-2:-1], t[-1:]
            rm, rv = inp.running_mean[k:k + 1], inp.running_var[k:k + 1]
        if self.train:
            y = a.train(BNCall(xx, gg, bb, dtype="fp64", eps=self.eps)).y
        else:
            y = a.infer(BNCall(xx, gg, bb, rm, rv, dtype="fp64", eps=self.eps, training=False)).y
        return np.asarray(y, dtype=np.float64).reshape(-1)

    def column(self, i: int) -> np.ndarray:
        """Column i by central differences: theta_i moved by +-h in place (a whole copy of theta per evaluation
        cost as much as the fp64 forward itself on a large call)."""
        if self.by_channel:
            return self._channel_column(i)
        return central_difference(self.y_at, self.work, self.theta, self.h, i)

    def _channel_column(self, i: int) -> np.ndarray:
        """:meth:`column` running only the channel theta_i belongs to (the same values: see ``by_channel``)."""
        m, c, h, theta = self.m, self.c, self.h, self.theta
        if self._still is None:
            y0 = self.y_at(theta)
            with np.errstate(invalid="ignore"):
                self._still = (y0 - y0) / (2 * h)
        one = (self.shape[0], 1, *self.shape[2:])
        if i < m:
            idx = np.unravel_index(i, self.shape)
            k, at = int(idx[1]), int(np.ravel_multi_index((idx[0], 0, *idx[2:]), one))
        else:
            k, at = (i - m) % c, -2 if i < m + c else -1
        xk = theta[:m].reshape(self.shape)[:, k:k + 1]
        work = np.concatenate([xk.reshape(-1), theta[m + k:m + k + 1], theta[m + c + k:m + c + k + 1]])
        work[at] = theta[i] + h
        up = self.y_at(work, k)
        work[at] = theta[i] - h
        down = self.y_at(work, k)
        col = self._still.copy()
        with np.errstate(invalid="ignore"):
            col.reshape(self.shape)[:, k] = ((up - down) / (2 * h)).reshape(self.shape[0], *self.shape[2:])
        return col

    def vjp(self, v: np.ndarray) -> np.ndarray:
        out = self.adapter.backward_of(BNCall(self.inp.x, self.inp.gamma, dy=v, dtype="fp64", eps=self.eps,
                                              training=self.train), self.saved)
        return np.concatenate([np.asarray(out.dx, dtype=np.float64).reshape(-1),
                               np.asarray(out.dgamma, dtype=np.float64), np.asarray(out.dbeta, dtype=np.float64)])

    def row(self, j: int) -> np.ndarray:
        return self.vjp(np.eye(1, self.m, j).reshape(self.shape))


def _fd_check(adapter: KernelAdapter, inp: Inputs, mode: str, eps: float, rng: np.random.Generator,
              full_max: int = FULL_JACOBIAN_MAX) -> tuple[list[GradRow], str]:
    return jacobian_rows(_Jacobian(adapter, inp, mode, eps), rng, full_max)


class Jacobian(Protocol):
    """What the finite-difference check reads of a forward's Jacobian in theta (the inputs it differentiates, flat):
    its m outputs and p inputs, the output's ``shape``, theta and the step ``h``, the gradients' ``blocks`` of
    theta (name -> slice), a column by central differences, a row (the backward of a unit dy), a vector-Jacobian
    product and the output at any theta."""

    m: int
    p: int
    shape: tuple[int, ...]
    theta: np.ndarray
    h: float
    blocks: dict[str, slice]

    def column(self, i: int) -> np.ndarray: ...

    def row(self, j: int) -> np.ndarray: ...

    def vjp(self, v: np.ndarray) -> np.ndarray: ...

    def y_at(self, t: np.ndarray) -> np.ndarray: ...


def jacobian_rows(jac: Jacobian, rng: np.random.Generator, full_max: int = FULL_JACOBIAN_MAX,
                  param_columns: int | None = None) -> tuple[list[GradRow], str]:
    """The backward of ``jac`` against its central differences, a row per gradient: the full Jacobian when it has at
    most ``full_max`` entries, else random projections and sampled entries (``rng``; of the parameters' columns,
    beyond x's, all or ``param_columns`` of them drawn); and how, in words."""
    m, p = jac.m, jac.p
    if m * p <= full_max:
        return _fd_full(jac), f"full Jacobian ({m} outputs x {p} inputs)"
    return _fd_sampled(jac, rng, param_columns), f"random projections and sampled entries ({m} outputs x {p} inputs)"


def _fd_full(jac: Jacobian) -> list[GradRow]:
    rtol, atol = FINITE_DIFFERENCE["rtol"], FINITE_DIFFERENCE["atol"]
    m, p, shape = jac.m, jac.p, jac.shape
    num = np.empty((m, p))
    for i in range(p):
        num[:, i] = jac.column(i)
    ana = np.stack([jac.row(j) for j in range(m)])
    rows = []
    for name, sl in jac.blocks.items():
        cols = sl.stop - sl.start

        def where(k: int, cols: int = cols, name: str = name) -> str:
            j, i = divmod(k, cols)
            return f"d y{tuple(int(v) for v in np.unravel_index(j, shape))} / d {name[1:]}[{i}]"

        rows.append(grad_row("finite-differences", name, ana[:, sl], num[:, sl], (rtol, atol), where_of=where,
                         detail=f"full Jacobian {m}x{cols}"))
    return rows


def _fd_sampled(jac: Jacobian, rng: np.random.Generator, param_columns: int | None = None) -> list[GradRow]:
    """A large call: projections v^T J u on each block, and sampled entries J[j, i] (every parameter's column, or
    ``param_columns`` of them drawn: a LayerNorm's parameters are as many as its normalised values)."""
    rtol, atol, h = FINITE_DIFFERENCE["rtol"], FINITE_DIFFERENCE["atol"], jac.h
    m, p, theta = jac.m, jac.p, jac.theta
    rows = []
    for name, sl in jac.blocks.items():
        ana_p, num_p = [], []
        for _ in range(FD_PROJECTIONS):
            u = np.zeros(p)
            u[sl] = rng.standard_normal(sl.stop - sl.start)
            v = rng.standard_normal(m)
            num_p.append(float(v @ (jac.y_at(theta + h * u) - jac.y_at(theta - h * u))) / (2 * h))
            ana_p.append(float(jac.vjp(v.reshape(jac.shape)) @ u))
        rows.append(grad_row("finite-differences", f"{name} (v^T J u)", np.array(ana_p), np.array(num_p), (rtol, atol),
                         detail=f"{FD_PROJECTIONS} random projections"))
    js = rng.choice(m, size=min(FD_SAMPLED_ROWS, m), replace=False)
    ana_rows = {int(j): jac.row(int(j)) for j in js}
    params = np.arange(m, p) if param_columns is None or p - m <= param_columns else \
        m + rng.choice(p - m, size=param_columns, replace=False)
    cols = np.concatenate([rng.choice(m, size=min(FD_SAMPLED_COLS, m), replace=False), params])
    a_e, n_e = [], []
    for i in cols:
        col = jac.column(int(i))
        for j in js:
            n_e.append(col[j])
            a_e.append(ana_rows[int(j)][i])
    rows.append(grad_row("finite-differences", "sampled entries", np.array(a_e), np.array(n_e), (rtol, atol),
                     detail=f"{len(js)} rows x {len(cols)} columns of J"))
    return rows


# ---- identities -----------------------------------------------------------------------------------

def _identities(dx: np.ndarray, dg: np.ndarray | None, db: np.ndarray | None, call: BNCall, saved: Saved, *,
                tol: float, dx_scale: np.ndarray | None = None) -> list[GradRow]:
    """The gradient identities of the gradients ``dx``, ``dg`` and ``db`` (None: not returned) of ``call`` (its x, dy,
    γ and ε, as the kernel was given them) from the golden's statistics ``saved``.  Per channel, relative to each
    identity's own scale:
    Σ dx = 0;  Σ dx·x̂ = γ·rstd·Σ(dy·x̂)·(1 - mean(x̂²)) (= 0 only when eps = 0);  dβ = Σ dy;  dγ = Σ dy·x̂.
    ``dx_scale`` (per channel, the magnitude dx is formed from) keeps the dx identities' scales from
    vanishing where dx itself cancels (dy constant over a channel: dx is rounding noise around 0).
    x̂ here is the golden's; the kernel's own differs by its mean's rounding, u·|mean|·rstd of x̂'s scale, so
    the tolerance of a channel is ``tol``·(1 + |mean|·rstd), the condition of x − mean (a large mean against
    the spread: every correct kernel's identities are that much less exact), and the identities weighted by x̂ count
    that shift of every x̂ in their scale: Σ|dy|·|mean|·rstd (Σ|dx|·|mean|·rstd), which is most of it where a
    channel's spread is far below √ε (x̂ small, its shift not)."""
    g, eps = call.gamma, call.eps
    mean, var = np.asarray(saved.mean, dtype=np.float64), saved.var(eps)
    lay = layout_of(call.x, call.layout)
    cr = lambda a: lay.to_cr(np.asarray(a, dtype=np.float64))  # noqa: E731
    dxc, dyc, xc = cr(dx), cr(call.dy), cr(call.x)
    rstd = 1 / np.sqrt(var + eps)
    xhat = (xc - mean[:, None]) * rstd[:, None]
    shift = np.abs(mean) * rstd  # (x̂'s shift per unit roundoff of the mean)
    s_dx, s_dxx = np.abs(dxc).sum(axis=1), np.abs(dxc * xhat).sum(axis=1)
    if dx_scale is not None:
        s_dx = np.maximum(s_dx, dx_scale * xc.shape[1])
        s_dxx = np.maximum(s_dxx, dx_scale * np.abs(xhat).sum(axis=1))
    s_dxx = s_dxx + shift * s_dx
    checks = [
        ("sum(dx) = 0", dxc.sum(axis=1), np.zeros(len(g)), s_dx),
        ("sum(dx*xhat) = g*rstd*sum(dy*xhat)*(1-mean(xhat^2))", (dxc * xhat).sum(axis=1),
         g * rstd * (dyc * xhat).sum(axis=1) * (1 - (xhat**2).mean(axis=1)), s_dxx),
    ]
    if db is not None:
        checks.append(("dbeta = sum(dy)", np.asarray(db, dtype=np.float64), dyc.sum(axis=1), np.abs(dyc).sum(axis=1)))
    if dg is not None:
        checks.append(("dgamma = sum(dy*xhat)", np.asarray(dg, dtype=np.float64), (dyc * xhat).sum(axis=1),
                       np.abs(dyc * xhat).sum(axis=1) + shift * np.abs(dyc).sum(axis=1)))
    rows = []
    with np.errstate(all="ignore"):
        cond = 1.0 + np.abs(mean) * rstd
        cond = np.where(np.isfinite(cond), cond, 1.0)
    for name, got, want, scale in checks:
        v = scaled_rule(got, want, scale, tol, condition=cond, where=lambda i: f"channel {i}")
        rows.append(GradRow("identity", name, v.passed, v.max_abs, v.max_rel, tol, 0.0, v.need_atol, v.need_rtol,
                            v.used, v.where, "residual relative to the identity's own scale and the condition "
                            "1 + |mean|·rstd, per channel"))
    return rows


# ---- candidate formulas ----------------------------------------------------------------------------

Formula = Callable[..., Any]


def formula_standard(dy, x, gamma, mean, var, eps):  # noqa: ANN001, ANN201 - the documented formula signature
    """dx = γ/√(σ²+ε) · (dy − mean(dy) − x̂·mean(dy·x̂))."""
    ax, n = reduce_axes(x), x.ndim
    xhat = (x - channel_column(mean, n)) / np.sqrt(channel_column(var, n) + eps)
    return channel_column(gamma / np.sqrt(var + eps), n) * (dy - dy.mean(axis=ax, keepdims=True)
                                                   - xhat * (dy * xhat).mean(axis=ax, keepdims=True))


def formula_ascend(dy, x, gamma, mean, var, eps):  # noqa: ANN001, ANN201
    """BNTrainingReduceGrad: σ = √(var+ε); mult = −(dγ/R)/σ; addend = (μ/σ)(dγ/R) − dβ/R;
    dx = (dy + mult·x + addend)·γ/σ."""
    ax, n = reduce_axes(x), x.ndim
    r = x.size // x.shape[1]
    sigma = np.sqrt(var + eps)
    xhat = (x - channel_column(mean, n)) / channel_column(sigma, n)
    dg, db = (dy * xhat).sum(axis=ax), dy.sum(axis=ax)
    mult = -(dg / r) / sigma
    addend = (mean / sigma) * (dg / r) - db / r
    return (dy + channel_column(mult, n) * x + channel_column(addend, n)) * channel_column(gamma / sigma, n)


def seed_formula(use_sqrt: bool = False, use_xhat: bool = False) -> Formula:
    """The seed document's ∂L/∂X = γ/(σ²+ε)·(dY − mean(dY) − X·mean(dY·X)), optionally corrected."""

    def f(dy, x, gamma, mean, var, eps):  # noqa: ANN001, ANN202
        ax, n = reduce_axes(x), x.ndim
        factor = gamma / (np.sqrt(var + eps) if use_sqrt else (var + eps))
        z = (x - channel_column(mean, n)) / np.sqrt(channel_column(var, n) + eps) if use_xhat else x
        return channel_column(factor, n) * (dy - dy.mean(axis=ax, keepdims=True)
                                            - z * (dy * z).mean(axis=ax, keepdims=True))

    return f


FORMULAS: dict[str, Formula] = {"standard": formula_standard, "ascend": formula_ascend, "seed": seed_formula()}
SEED_CORRECTIONS = [("as printed", False, False), ("with √ on the factor", True, False),
                    ("with x̂ in place of X", False, True), ("with both corrections", True, True)]


def _load_formula(spec: str) -> Formula:
    if spec in FORMULAS:
        return FORMULAS[spec]
    if ":" not in spec:
        raise BNProbeError(f"unknown formula {spec!r}; valid: {', '.join(FORMULAS)} or module:function")
    return load_callable(spec, "formula", ("dy", "x", "gamma", "mean", "var", "eps"))


def _failed_formula(tensor: str, rtol: float, atol: float, why: str) -> GradRow:
    """The row of a formula output that could not be compared (``why``: one line)."""
    return GradRow("formula", tensor, False, math.inf, math.inf, rtol, atol, math.inf, math.inf, math.inf, "", why)


def _real_array(value: Any) -> tuple[np.ndarray, str | None]:
    """A formula's output as a float64 array, or why it is none (one line): a complex, object, string or ragged
    result is refused, not cast (a cast would drop an imaginary part with only a warning)."""
    try:
        with np.errstate(all="ignore"):
            a = np.asarray(value)
            if a.dtype.kind not in "biuf":
                what = "an array" if isinstance(value, np.ndarray) else kind_of(value)
                return np.empty(0), f"returned {what} of dtype {a.dtype}, not a real array"
            return a.astype(np.float64), None
    except Exception as exc:  # noqa: BLE001 - whatever the user's object raises on conversion
        return np.empty(0), f"returned {kind_of(value)}, not an array ({first_line(exc)})"


@functools.lru_cache(maxsize=8)
def _golden_fd_rows(shape: tuple[int, ...], seed: int, eps: float) -> tuple[GradRow, ...]:
    """The FP64 golden's own gradients checked by finite differences on the formula check's inputs (the same for
    every formula on the same shape, seed and eps: computed once)."""
    inp = make_inputs(shape, seed)
    fd_rows, _ = _fd_check(get_adapter("reference"), inp, "train", eps, np.random.default_rng(seed))
    return tuple(replace(r, tensor=f"reference {r.tensor}", detail="the golden's own gradients, by finite "
                         "differences") for r in fd_rows)


def check_formula(spec: str, shape: tuple[int, ...] | None = None, *, seed: int | None = None,
                  eps: float | None = None, rtol: float | None = None, atol: float | None = None) -> GradcheckResult:
    """Check a backward formula ``f(dy, x, gamma, mean, var, eps) -> dx`` (or (dx, dgamma, dbeta)) in FP64
    against the analytic gradient (itself checked by finite differences), on generated inputs of ``shape``
    (default (4, 3, 5, 5)), ``seed`` (default 0) and ``eps`` (default 1e-5).  For ``seed``, also try the
    candidate corrections alone and together and say which combination passes."""
    shape = input_shape("gradcheck") if shape is None else tuple(shape)
    seed, eps = SEED if seed is None else seed, EPS if eps is None else eps
    rt, at = grad_tolerance("fp64", rtol, atol)
    # the formula is loaded and checked before anything is computed
    candidates = [(f"seed {label}", seed_formula(s, xh)) for label, s, xh in SEED_CORRECTIONS] if spec == "seed" \
        else [(spec, _load_formula(spec))]
    inp = make_inputs(shape, seed)
    ref = get_adapter("reference")
    call = BNCall(inp.x, inp.gamma, inp.beta, dy=inp.dy, dtype="fp64", eps=eps)
    f = ref.train(call)
    gold = ref.backward_of(call, f.saved)
    mean, var = f.saved.mean.astype(np.float64), f.saved.var(eps)
    rows = list(_golden_fd_rows(tuple(shape), seed, eps))
    notes: list[str] = []
    where = _where(inp.x.shape)
    passing = []
    for label, fn in candidates:
        try:
            with np.errstate(all="ignore"):
                out = fn(inp.dy.copy(), inp.x.copy(), inp.gamma.copy(), mean.copy(), var.copy(), eps)
        except Exception as exc:  # noqa: BLE001 - a user's formula may fail in any way; report it
            rows.append(_failed_formula(f"{label}: dx", rt, at, raised("the formula", exc)))
            continue
        outs = out if isinstance(out, tuple) else (out,)
        names = ("dx", "dgamma", "dbeta")
        golds = (gold.dx, gold.dgamma, gold.dbeta)
        if not outs or len(outs) > len(names):
            rows.append(_failed_formula(f"{label}: dx", rt, at, f"returned a tuple of {len(outs)}, not dx or "
                                                                 "(dx, dgamma, dbeta)"))
            continue
        ok = True
        for name, got, want in zip(names, outs, golds):
            got, why = _real_array(got)
            if why is None and got.shape != np.shape(want):
                why = f"returned shape {got.shape}, expected {np.shape(want)}"
            if why is not None:
                rows.append(_failed_formula(f"{label}: {name}", rt, at, why))
                ok = False
                continue
            r = grad_row("formula", f"{label}: {name}", got, want, (rt, at),
                     where_of=where if name == "dx" else _where((len(inp.gamma),)))
            rows.append(r)
            ok &= r.passed
        if ok:
            passing.append(label)
    if spec == "seed":
        fixes = [label for label in passing if label != "seed as printed"]
        if "seed as printed" in passing:
            notes.append("the seed formula as printed passes (unexpected)")
        elif fixes:
            what = fixes[0].removeprefix("seed with ")
            notes.append(f"the seed's dL/dX is wrong; it passes only {what}: the factor must be "
                         "γ/√(σ²+ε), and both X must be the normalised x̂ = (X−μ)/√(σ²+ε)"
                         if fixes == ["seed with both corrections"] else f"the seed's dL/dX passes {what}")
        else:
            notes.append("no combination of the candidate corrections makes the seed formula pass")
    return GradcheckResult(f"formula:{spec}", "fp64", "train", tuple(shape), seed, rows, notes)


# ---- the whole check ---------------------------------------------------------------------------------

def gradcheck(
    adapter: str | KernelAdapter | Recorded = "emulated",
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
    *,
    mode: str | None = None, seed: int | None = None, eps: float | None = None,
    rtol: float | None = None, atol: float | None = None,
    params: str | None = None, x: np.ndarray | None = None,
) -> GradcheckResult | PerCall:
    """Finite differences in FP64, the adapter's backward in ``dtype`` (default fp16) vs the FP64 golden,
    and (training, the default ``mode``) the gradient identities, on generated inputs of ``shape``
    (default (4, 3, 5, 5)), ``seed`` (default 0), ``eps`` (default 1e-5) and parameters (γ, β, running and saved
    statistics) in fp32 (default) or the input's format (``params`` same); ``x`` (of ``shape``): the input instead of
    the default's per-channel shifted normal (e.g. drawn from the command line's --dist, --mean, --std).  Truthy
    when every check passed.

    Given a recording (a :class:`~bnprobe.engine.recorded.Recorded`) in place of the kernel, every selected call of
    it runs on its own recorded inputs, scalars and formats: a :class:`~bnprobe.engine.recorded.PerCall` of one
    :class:`GradcheckResult` per call.  A dump adapter of one call runs on that call's recorded inputs (its one
    result).  On a recording ``shape``, ``eps`` and ``x`` contradict it, and ``dtype``, ``mode`` and ``params``
    must agree."""
    if mode not in (None, "train", "infer"):
        raise BNProbeError(f"gradcheck mode must be train or infer, got {mode!r}")
    check_rtol_atol(rtol, atol)
    seed = SEED if seed is None else seed
    a, recorded = given_to(adapter)
    if recorded is not None:
        check_options(recorded, given=given(shape=shape, eps=eps, x=x), dtype=dtype, params=params)
        if recorded is not adapter:
            only_call(recorded, "gradcheck")
        run = _gradcheck_calls(recorded, mode=mode, rtol=rtol, atol=atol, seed=seed)
        return run if recorded is adapter else run.results[0]
    asked = params
    fmt = get_format(dtype or "fp16").name
    params = params or "fp32"
    shape = input_shape("gradcheck") if shape is None else tuple(shape)
    mode = mode or "train"
    eps = EPS if eps is None else eps
    caps = a.capabilities()
    needs_backward(a.name, caps.modes, mode)
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    layout_of(np.empty(shape))
    if mode == "train" and math.prod(shape) // shape[1] < 2:
        raise BNProbeError(one_value_per_channel(shape, hint=f"{named('mode')} infer checks its inference"),
                           field="mode")
    inp = make_inputs(shape, seed, x, eps)
    rng = np.random.default_rng([seed, 7])
    rows: list[GradRow] = []
    notes: list[str] = []
    ref = get_adapter("reference")
    # 1. finite differences in FP64 on the adapter's own forward if it runs fp64, else on the reference
    fd_target = a if "fp64" in caps.formats and "backward" in caps.modes else ref
    fd_rows, how = _fd_check(fd_target, inp, mode, eps, rng)
    rows += fd_rows
    notes.append(f"finite differences on {fd_target.name} in fp64: {how}")
    # 2. the adapter's backward in its format vs the FP64 golden on the same rounded inputs
    pf = params_format(fmt, params)
    xs, dys, g, b, rm, rv = stored_inputs(fmt, params, inp.x, inp.dy, inp.gamma, inp.beta, inp.running_mean,
                                          inp.running_var)
    train = mode == "train"
    call = BNCall(xs, g, b, dy=dys, eps=eps, training=train, dtype=fmt, params=params)
    if train:
        saved = a.train(call).saved
        gsaved = ref.train(call).saved
        if saved is None:  # autodiff through the forward (flax, Keras): it recomputes them; handed the golden's
            saved = gsaved
            notes.append(f"{a.name} saves no statistics (its backward recomputes them): judged against the golden "
                         "of the batch's own statistics")
    else:
        saved = gsaved = Saved(rm, "var", rv)
    got = a.backward_of(call, saved)
    gold = ref.backward_of(call, gsaved)
    rt, at = grad_tolerance(fmt, rtol, atol)
    judged = _judged(a, inp, fmt, params, eps) if train and rtol is None and atol is None else {}
    rows += _vs_fp64(a.name, got, gold, judged, fmt=fmt, pf=pf, out_fmt=caps.output or fmt, rt=rt, at=at)
    # 3. identities of the adapter's own gradients (training)
    if train:
        rows += _identities(got.dx, got.dgamma, got.dbeta, call, gsaved, tol=rt)
    return GradcheckResult(a.name, fmt, mode, tuple(shape), seed, rows, notes, params=asked)


def needs_backward(name: str, runs: tuple[str, ...], mode: str) -> None:
    """Refuse in one line a kernel gradcheck cannot check: one without a backward (an inference-only kernel, a
    forward-only one), or in training one without the training forward its backward's statistics come from."""
    if "backward" not in runs:
        raise BNProbeError(needs_modes("gradcheck", ("backward",), name, runs), field="adapter")
    if mode == "train" and "train" not in runs:
        raise BNProbeError(needs_modes(f"gradcheck in {named('mode')} train", ("train",), name, runs), field="mode")


def _vs_fp64(name: str, got: Any, gold: Any, judged: dict[str, dict[str, Any]], *, fmt: str, pf: str, out_fmt: str,
             rt: float, at: float) -> list[GradRow]:
    """The adapter's dx, dγ, dβ against the golden's: by compare-precision's verdict where ``judged`` holds it
    (:func:`_judged`), else by rtol/atol; the measures (max errors, the tolerance each would need) either way."""
    where_x, where_c = _where(np.shape(gold.dx)), _where((np.size(gold.dgamma),))
    rows = []
    for t, actual, golden, where in (("dx", got.dx, gold.dx, where_x), ("dgamma", got.dgamma, gold.dgamma, where_c),
                                     ("dbeta", got.dbeta, gold.dbeta, where_c)):
        r = grad_row("vs-fp64", t, actual, golden, (rt, at), fmt=out_fmt if t == "dx" else pf,
                 where_of=where, detail=f"{name} in {fmt} vs FP64 on the same rounded inputs")
        rows.append(by_compare(r, judged.get(t)))
    return rows


def by_compare(r: GradRow, v: dict[str, Any] | None) -> GradRow:
    """``r`` with the verdict compare-precision gives the same output of the same call (``v``, its row), if any."""
    if v is None or not np.isfinite(float(v["score"])):  # not judged there (msprobe's rules skip float64)
        return r
    return replace(r, passed=v["verdict"] == "PASS", used=float(v["score"]) / float(v["bound"]),
                   detail=f"{r.detail}; by compare-precision's rule: {v['why']}")


def _judged_recorded(recorded: Recorded, run: CallRun) -> dict[str, dict[str, Any]]:
    """compare-precision's rows for dx, dγ, dβ of a recorded training call (the kernel on its inputs, or the dump's
    recorded backward), by tensor; none where compare-precision does not take the call (channels_last)."""
    from bnprobe.checks.compare.precision import judge_call

    if run.recording.layout != "channels_first":
        return {}
    return gradient_rows(judge_call(recorded.kernel, run.recording, ("backward",), label=run.label, run=run))


def gradient_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """compare-precision's rows of dx, dγ and dβ, by tensor."""
    return {r["tensor"]: r for r in rows if r["tensor"] in ("dx", "dgamma", "dbeta")}


def _judged(a: KernelAdapter, inp: Any, fmt: str, params: str, eps: float) -> dict[str, dict[str, Any]]:
    """compare-precision's rows for dx, dγ and dβ of this training call (the one judge: msprobe's benchmark method
    against the careful bench, with its exemptions), by tensor."""
    from bnprobe.core.call import BNCall
    from bnprobe.checks.compare.precision import judge_call
    from bnprobe.engine.run import generated_call

    # (the running statistics' update does not enter the backward: BatchNorm's default momentum, which every
    # framework has, where torch's cumulative average would be refused by the others)
    call = BNCall(inp.x, inp.gamma, inp.beta, inp.running_mean, inp.running_var, inp.dy, eps, MOMENTUM, dtype=fmt,
                  params=params)
    return gradient_rows(judge_call(a, generated_call(call, modes=("backward",), label="gradcheck"), ("backward",)))


# ---- recorded calls ---------------------------------------------------------------------------------

def _per_element(scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A per-channel scale broadcastable against a channel-first tensor of ``shape``."""
    return np.asarray(scale).reshape((1, -1) + (1,) * (len(shape) - 2)) if len(shape) > 1 else np.asarray(scale)


def _gradcheck_calls(recorded: Recorded, *, mode: str | None = None, rtol: float | None = None,
                     atol: float | None = None, seed: int = 0) -> PerCall:
    """Every selected call of a recording, in forward order, one at a time, on its own recorded inputs,
    scalars and formats: finite differences in FP64 at those inputs (on the golden, or on a runnable
    adapter that runs fp64), the kernel's backward (a dump's: the recorded dx, dγ, dβ) vs the golden's,
    and (training calls) the gradient identities of the kernel's gradients.  ``mode`` (train or infer),
    when given, must be the mode of every call.  One :class:`GradcheckResult` per call."""
    if not recorded.replay:  # a kernel run on the recorded inputs: its backward is what is checked
        needs_backward(recorded.kernel.name, recorded.kernel.capabilities().modes, None)
    recorded.calls.require_tensors("gradcheck")
    if mode is not None:
        off = [c for c in recorded.calls.calls if c.training != (mode == "train")]
        if off:
            raise BNProbeError(f"{named('mode')} {mode} contradicts the recording: {off[0].label} was recorded in "
                               f"{'training' if off[0].training else 'eval'} mode")
    results = each_run(recorded, lambda i, run: _gradcheck_call(recorded, run, rtol, atol,
                                                                 np.random.default_rng([seed, 7, i])),
                       modes=("backward",), skip_missing=True)
    return PerCall.of("gradcheck", recorded, results)


def _gradcheck_call(recorded: Recorded, run: CallRun, rtol: float | None, atol: float | None,
                    rng: np.random.Generator) -> GradcheckResult:
    rec, ci = run.recording, run.inputs
    fmt, eps, training, layout = run.fmt, run.eps, rec.training, rec.layout
    mode = "train" if training else "infer"
    x = to_channels_first(ci.x, layout)
    c = x.shape[1]
    rows: list[GradRow] = []
    notes = list(run.notes)
    ref = outputs_only(get_adapter("reference"))  # finite differences need y only
    kernel = recorded.kernel
    caps = kernel.capabilities()
    # 1. finite differences in FP64 at the recorded inputs, on the first channels
    fd_target = kernel if not recorded.replay and "fp64" in caps.formats and "backward" in caps.modes else ref
    k = min(FD_CHANNELS, c)
    vec = lambda v, default: (np.full(c, default) if v is None else np.asarray(v, dtype=np.float64))[:k]  # noqa: E731
    rm, rv = ci.running_mean, ci.running_var
    if not np.all(np.isfinite(x)):
        notes.append("x holds NaN/inf (input-borne): no finite differences")
    elif not training and (rm is None or rv is None):
        notes.append("an eval-mode call without running statistics: no finite differences")
    elif training and x.size // c < 2:
        notes.append("N*H*W = 1: no training-mode finite differences")
    else:
        inp = Inputs(np.ascontiguousarray(x[:, :k]), vec(ci.gamma, 1.0), vec(ci.beta, 0.0),
                     np.zeros_like(x[:, :k]), vec(rm, 0.0), vec(rv, 1.0))
        fd_rows, how = _fd_check(fd_target, inp, mode, eps, rng, FD_RECORDED_FULL_MAX)
        rows += fd_rows
        notes.append(f"finite differences on {fd_target.name} in fp64 at the recorded inputs"
                     + (f" (channels 0-{k - 1} of {c}; channels are independent)" if k < c else "") + f": {how}")
    # 2. the kernel's backward vs the golden's on the recorded inputs
    if "dx" not in run.got:
        notes.append("no backward recorded: only the finite differences on the golden at the call's inputs")
        return GradcheckResult(run.kernel, fmt, mode, tuple(np.shape(ci.x)), 0, rows, notes, run.label)
    rt, at = grad_tolerance(fmt, rtol, atol)
    where_x, where_c = _where(x.shape), _where((c,))
    what = "the recorded backward" if recorded.replay else f"{run.kernel}'s backward"
    # a replay answers only the gradients the call recorded (its kernel computed): affine=False records no dγ, dβ
    recorded_out = rec.tensors.get("backward", {}).get("outputs", {}) if recorded.replay else run.got
    got = {k: v for k, v in run.got.items() if k in recorded_out}
    judged = _judged_recorded(recorded, run) if training and rtol is None and atol is None else {}
    for name in ("dx", "dgamma", "dbeta"):
        if name not in got:
            continue
        actual, golden = run.got[name], run.gold[name]
        scale = run.scales.get(name)
        if name == "dx":
            actual, golden = to_channels_first(actual, layout), to_channels_first(golden, layout)
            scale = None if scale is None else _per_element(scale, x.shape)
        r = grad_row("vs-fp64", name, actual, golden, (rt, at), fmt=run.formats[name],
                 where_of=where_x if name == "dx" else where_c, scale=scale, equal_nan=True,
                 detail=f"{what} in {fmt} vs FP64 on the recorded inputs; atol relative to the gradient's natural "
                        "scale")
        rows.append(by_compare(r, judged.get(name)))
    if "dgamma" not in got:
        notes.append("affine=False: no dgamma, dbeta recorded")
    # 3. identities of the kernel's gradients (training)
    if training and run.gold_saved is not None and "dx" in got:
        g = np.ones(c) if ci.gamma is None else np.asarray(ci.gamma, dtype=np.float64)
        dy = to_channels_first(rec.tensors["backward"]["inputs"]["dy"], layout)
        rows += _identities(to_channels_first(got["dx"], layout), got.get("dgamma"), got.get("dbeta"),
                            BNCall(x, g, dy=dy, eps=eps), run.gold_saved, tol=rt, dx_scale=run.scales.get("dx"))
    return GradcheckResult(run.kernel, fmt, mode, tuple(np.shape(ci.x)), 0, rows, notes, run.label)

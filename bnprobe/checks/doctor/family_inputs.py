"""doctor's designed inputs for LayerNorm, RMSNorm, GroupNorm and InstanceNorm (:func:`family_probes`), each a
:class:`~bnprobe.engine.cases.Case` holding its whole call (float64 before rounding to the run's formats).

LayerNorm and RMSNorm get transformer-shaped hidden states (batch, tokens, hidden) — a hidden size of 4096, tokens
with large means (100 to 4·10⁴, and onnxruntime#28463's row 40000, 40001, 40002, 40003), massive activations (two
features 2·10³ and 8·10³ times the rest on every token, as LLaMA's: Sun et al., arXiv 2402.17762), rows near fp16's
range (their squares past 65504) and rows whose mean square is near ε or far below it — and GroupNorm and
InstanceNorm convolution activations (N, C, H, W) with the same large means, spreads near ε and values near fp16's
range.  Each input's upstream gradient is N(0, 1) (the dy-shifted input's with a mean of 1, so that Σdy over its
rows grows into the hundreds, where a 16-bit sum's spacing is a unit or more).  With ``normalized_shape`` the
transformer inputs take it as their trailing dims; GroupNorm's channels are a multiple of its groups."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from bnprobe.core.call import BNCall
from bnprobe.engine.cases import Case
from bnprobe.kernels.layout import NormShape

__all__ = ["family_probes", "family_user_probe", "ORT_ROW"]

#: the row microsoft/onnxruntime#28463 normalises to NaN with a one-pass variance (repeated along a row)
ORT_ROW = (40000.0, 40001.0, 40002.0, 40003.0)
_MEANS = (100.0, -1000.0, 1e4, 4e4)  # per-token means, cycled over the rows
_SMALL = (math.sqrt(1e-5), 1e-3, 1e-4)  # per-row spreads: mean square near ε, and 10 and 1000 times below it

Rows = Callable[[np.random.Generator, int, int], np.ndarray]


def _normal(rng: np.random.Generator, rows: int, r: int) -> np.ndarray:
    return rng.standard_normal((rows, r))


def _large_mean(rng: np.random.Generator, rows: int, r: int) -> np.ndarray:
    """Rows of N(0, 1) about the means 100, −1000, 10⁴, 4·10⁴ in turn; the last row onnxruntime#28463's."""
    x = rng.standard_normal((rows, r)) + np.resize(np.array(_MEANS), rows)[:, None]
    x[-1] = np.resize(np.array(ORT_ROW), r)
    return x


def _massive(rng: np.random.Generator, rows: int, r: int) -> np.ndarray:
    """N(0, 1) with two features 2·10³ and −8·10³ times larger on every row."""
    x = rng.standard_normal((rows, r))
    x[:, 7 % r] *= 2e3
    x[:, 700 % r] *= -8e3
    return x


def _near_range(rng: np.random.Generator, rows: int, r: int) -> np.ndarray:
    """N(0, 300²) with one value per row near ±6·10⁴ (fp16's largest is 65504)."""
    x = 300.0 * rng.standard_normal((rows, r))
    x[np.arange(rows), np.arange(rows) % r] = np.where(np.arange(rows) % 2, -1.0, 1.0) * rng.uniform(5e4, 6e4, rows)
    return x


def _small(centre: float) -> Rows:
    def make(rng: np.random.Generator, rows: int, r: int) -> np.ndarray:
        """Rows about ``centre`` whose spread cycles through √ε, 10⁻³ and 10⁻⁴ (ε = 10⁻⁵)."""
        return centre + rng.standard_normal((rows, r)) * np.resize(np.array(_SMALL), rows)[:, None]
    return make


# (name, leading dims, hidden size, rows, dy's mean): LayerNorm's and RMSNorm's inputs
_TRANSFORMER: tuple[tuple[str, tuple[int, ...], int, Rows, float], ...] = (
    ("hidden/4096", (1, 16), 4096, _normal, 0.0),
    ("stress/large-mean", (2, 8), 1024, _large_mean, 0.0),
    ("stress/massive-activations", (2, 32), 1024, _massive, 0.0),
    ("stress/near-fp16-range", (2, 8), 4096, _near_range, 0.0),
    ("stress/mean-square-near-eps", (2, 12), 1024, _small(0.0), 0.0),
    ("stress/dy-shifted", (4, 128), 768, _normal, 1.0),
)
# (name, (N, H, W), rows, dy's mean): GroupNorm's and InstanceNorm's inputs
_CONVOLUTION: tuple[tuple[str, tuple[int, int, int], Rows, float], ...] = (
    ("activations", (4, 16, 16), _normal, 0.0),
    ("stress/large-mean", (2, 8, 8), _large_mean, 0.0),
    ("stress/var-near-eps", (2, 8, 8), _small(0.5), 0.0),
    ("stress/near-fp16-range", (2, 8, 8), _near_range, 0.0),
    ("stress/dy-shifted", (8, 8, 8), _normal, 1.0),
)


def _channels(groups: int | None) -> int:
    """GroupNorm's and InstanceNorm's channel count: 64, or the least multiple of the groups from 64 up."""
    g = groups or 1
    return g * max(1, -(-64 // g))


def _probe(name: str, norm: str, shape: tuple[int, ...], rows: Rows, shift: float, seed: int, *,
           normalized_shape: tuple[int, ...] | None, groups: int | None) -> Case:
    """One designed input: x from ``rows`` in the layer's (rows, R) view, γ ~ U(0.5, 1.5) and β ~ N(0, 0.3²) per
    parameter (no β for RMSNorm), dy ~ N(shift, 1); drawn from ``seed`` and the input's name."""
    rng = np.random.default_rng([seed, 0xFA, *name.encode()])
    sh = NormShape.of(norm, shape, normalized_shape, groups)
    x = sh.from_rows(rows(rng, sh.rows, sh.r))
    p = math.prod(sh.param_shape)
    gamma = rng.uniform(0.5, 1.5, p).reshape(sh.param_shape)
    beta = None if norm == "rms" else rng.normal(0.0, 0.3, p).reshape(sh.param_shape)
    dy = rng.standard_normal(shape) + shift
    return Case(name, call=BNCall(x, gamma, beta, dy=dy, norm=norm, normalized_shape=normalized_shape,
                                  groups=groups))


def family_probes(norm: str, seed: int = 0, *, normalized_shape: tuple[int, ...] | None = None,
                  groups: int | None = None, stress: bool = True) -> list[Case]:
    """doctor's inputs for ``norm`` (layer, rms, group, instance): the plain input, then (``stress``) the stress
    inputs (see the module's docstring)."""
    out = []
    if norm in ("layer", "rms"):
        for name, lead, hidden, rows, shift in _TRANSFORMER:
            trailing = normalized_shape if normalized_shape is not None else (hidden,)
            out.append(_probe(name, norm, (*lead, *trailing), rows, shift, seed, normalized_shape=normalized_shape,
                              groups=groups))
    else:
        c = _channels(groups if norm == "group" else None)
        for name, (n, h, w), rows, shift in _CONVOLUTION:
            out.append(_probe(name, norm, (n, c, h, w), rows, shift, seed, normalized_shape=None, groups=groups))
    return out if stress else out[:1]


def family_user_probe(x: np.ndarray, norm: str, name: str, seed: int = 0, *,
                      normalized_shape: tuple[int, ...] | None = None, groups: int | None = None) -> Case:
    """The user's tensor (or a generated one) as an input of the layer's checklist: γ, β and dy seeded."""
    x = np.asarray(x, dtype=np.float64)
    return _probe(name, norm, tuple(x.shape), lambda rng, rows, r: NormShape.of(
        norm, x.shape, normalized_shape, groups).to_rows(x), 0.0, seed, normalized_shape=normalized_shape,
        groups=groups)

"""doctor's inputs: the diagnostic input, the stress inputs and the user's own (:func:`probes`, :func:`user_probe`),
each a :class:`~bnprobe.engine.cases.Case` whose call is made whole (NC... layout, float64 before rounding to the
run's formats; its dtype and params are set per run), and for the eval-after-steps input the training batches
before it (its ``steps``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.cases import Case
from bnprobe.kernels.layout import reduce_axes

__all__ = ["probes", "USER", "GENERATED", "user_probe"]


# ---- the inputs ---------------------------------------------------------------------------------------

def _probe(name: str, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, running_mean: np.ndarray,
           running_var: np.ndarray, dy: np.ndarray | None, steps: tuple[np.ndarray, ...] = ()) -> Case:
    """An input of the checklist with BatchNorm's default ε and momentum."""
    return Case(name, call=BNCall(x, gamma, beta, running_mean, running_var, dy), steps=steps)


def _running(rng: np.random.Generator, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running statistics far from the batch's (1.5 std away, 0.3 x or 3 x the variance), so that momentum and
    the train/eval switch show."""
    ax = reduce_axes(x)
    mean, std = x.mean(axis=ax), x.std(axis=ax)
    c = mean.size
    sign = np.where(np.arange(c) % 2, -1.0, 1.0)
    return mean + 1.5 * sign * np.maximum(std, 0.1), np.where(np.arange(c) % 2, 3.0, 0.3) * np.maximum(std, 0.1) ** 2


def _diagnostic(seed: int) -> Case:
    """Channels of variance 4, 1 and 0.25 (shifted), 1e-4, 4e-6 (< eps) and 1e-10 (std ≈ eps), R = 32; γ and
    β away from 1 and 0 and from each other; dy = a·x̂ + b + noise per channel, so that -mean(dy) dominates
    dx in one channel, -x̂·mean(dy·x̂) in another and the factor γ·rstd shows in the noise-led channels."""
    rng = np.random.default_rng([seed, 0xD0C])
    std = np.array([2.0, 1.0, 0.5, 1e-2, 2e-3, 1e-5])
    shift = np.array([1.0, -0.7, 0.3, 0.0, 0.0, 0.0])
    c = std.size
    col = (1, c, 1, 1)
    x = rng.standard_normal((8, c, 2, 2)) * std.reshape(col) + shift.reshape(col)
    xhat = (x - x.mean(axis=(0, 2, 3), keepdims=True)) / x.std(axis=(0, 2, 3), keepdims=True)
    a = np.array([1.5, -0.3, 0.1, 0.5, 0.8, -0.5])
    b = np.array([0.2, -1.5, 0.1, 0.5, -0.6, 0.4])
    noise = np.array([0.3, 0.3, 1.0, 1.0, 0.5, 1.0])
    dy = a.reshape(col) * xhat + b.reshape(col) + noise.reshape(col) * rng.standard_normal(x.shape)
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    rm = mean + np.array([2.0, -2.0, 2.0, -2.0, 2.0, -2.0]) * std
    rv = var * np.array([3.0, 0.3, 2.5, 0.4, 3.0, 0.25])
    return _probe("diagnostic", x, np.array([0.6, 1.4, 0.75, 1.3, 0.8, 1.25]),
                 np.array([0.3, -0.4, 0.2, -0.25, 0.5, -0.1]), rm, rv, dy)


def _stress(name: str, x: np.ndarray, seed: int) -> Case:
    rng = np.random.default_rng([seed, len(name)])
    c = x.shape[1]
    rm, rv = _running(rng, x)
    return _probe(name, x, rng.uniform(0.5, 1.5, c), rng.normal(0.0, 0.3, c), rm, rv, rng.standard_normal(x.shape))


def probes(seed: int = 0, *, stress: bool = True) -> list[Case]:
    """The checklist's inputs: the diagnostic input, then (``stress``) the stress inputs."""
    out = [_diagnostic(seed)]
    if not stress:
        return out
    rng = np.random.default_rng([seed, 0x57E5])
    n = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    means = np.array([1e2, -1e2, 1e3, -1e3]).reshape(1, 4, 1, 1)
    const = n(8, 4, 2, 2)
    const[:, 1], const[:, 2], const[:, 3] = 1.5, -2.0, 0.0
    steps = tuple(n(8, 3, 2, 2) * s + m for s, m in ((1.0, 0.5), (2.0, -1.0), (0.5, 2.0), (1.5, 0.0)))
    out += [
        _stress("stress/large-mean", n(8, 4, 4, 4) + means, seed),
        _stress("stress/var-near-eps", 0.5 + math.sqrt(1e-5) * n(8, 4, 4, 4), seed),
        _stress("stress/large-variance", 100.0 * n(8, 4, 4, 4), seed),
        _stress("stress/constant-channels", const, seed),
        _stress("stress/R=2", n(2, 4) * np.array([1.0, 3.0, 0.2, 10.0]), seed),
        _stress("stress/16-bit-sums", 4.0 + n(16, 2, 8, 8), seed),
    ]
    # dy with a mean per channel, as real losses give: Σdy over R = 2048 reaches 4096 (fp16's ulp there is 4), so a
    # backward that keeps it in a 16-bit format shows
    shifted = _stress("stress/dy-shifted", n(32, 2, 8, 8), seed)
    out.append(replace(shifted, call=shifted.call.with_(dy=shifted.call.dy + np.array([1.0, 2.0]).reshape(1, 2, 1, 1))))
    ev = _stress("stress/eval-after-steps", n(8, 3, 2, 2) + 0.5, seed)
    out.append(replace(ev, call=ev.call.with_(running_mean=np.zeros(3), running_var=np.ones(3), dy=None), steps=steps))
    return out


USER = "input"
GENERATED = "generated"  # the input made from the command line's --shape, --mean, --std, --dist


def user_probe(x: np.ndarray, seed: int = 0, name: str = USER) -> Case:
    """The user's tensor as an input of the checklist (γ, β and dy seeded, running statistics 0 and 1)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim < 2:
        raise BNProbeError(f"x must have 2 to 5 dimensions, got shape {x.shape}")
    p = _stress(name, x, seed)
    return replace(p, call=p.call.with_(running_mean=np.zeros(x.shape[1]), running_var=np.ones(x.shape[1])))

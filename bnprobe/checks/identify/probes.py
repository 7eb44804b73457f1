"""identify's probes: the designed inputs that tell a kernel's choices apart (:func:`probes`, each a
:class:`~bnprobe.engine.cases.Case`: its call, what it is for, and whether only the modes stage reads it), what a
kernel returns on each (:func:`observe`), what a candidate policy returns on the same (:func:`emulate`) and how far
the two are apart, in ULPs, per output (:func:`score_outputs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter, Saved
from bnprobe.adapters.base import Capabilities, params_format
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.core.call import EPS, MOMENTUM, BNCall
from bnprobe.engine.cases import Case, dy_of_kind
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels.policy import PRESETS, Policy


__all__ = ["Observed", "Score", "probes", "observe", "emulate", "score_outputs", "probe_vectors",
           "searched_format"]


def searched_format(kernel: KernelAdapter, dtype: str | None, params: str | None) -> tuple[str, str]:
    """The format identify searches ``kernel`` in (``dtype``, fp16 if None) and the parameters' (``params``, fp32 if
    None): one the kernel runs and a policy preset exists for, the pair valid — else one line naming the problem."""
    caps = kernel.capabilities()
    fmt = get_format(dtype or "fp16").name
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {kernel.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    if fmt not in PRESETS:
        raise BNProbeError(f"identify searches fp64, fp32, fp16 and bf16 kernels, not {fmt}")
    params = params or "fp32"
    params_format(fmt, params)  # (validated)
    return fmt, params


# ---- probes -------------------------------------------------------------------------------------------------

def probe_vectors(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    """γ not a power of two, β, and running statistics that are not the batch's."""
    return {"gamma": rng.uniform(0.3, 3.0, c), "beta": rng.normal(0.0, 1.0, c),
            "running_mean": rng.normal(0.0, 1.0, c), "running_var": rng.uniform(0.5, 2.0, c)}


def _call(x: np.ndarray, rng: np.random.Generator, fmt: str, params: str, eps: float, momentum: float | None,
          seed: int, layout: str = "channels_first", running: tuple[np.ndarray, np.ndarray] | None = None, *,
          dy: np.ndarray | None = None) -> BNCall:
    c = x.shape[1] if layout == "channels_first" else x.shape[-1]
    shape_cf = x.shape if layout == "channels_first" else (x.shape[0], x.shape[-1], *x.shape[1:-1])
    dy = dy_of_kind("shifted", shape_cf, seed) if dy is None else dy
    if layout == "channels_last":
        dy = np.moveaxis(dy, 1, -1)
        x = np.ascontiguousarray(x)
    vec = probe_vectors(rng, c)
    if running is not None:
        vec["running_mean"], vec["running_var"] = running
    return BNCall(x, dy=dy, eps=eps, momentum=momentum, dtype=fmt, params=params, layout=layout, **vec)


def probes(dtype: str, params: str = "fp32", *, seed: int = 0, eps: float = EPS, momentum: float | None = MOMENTUM,
           layouts: tuple[str, ...] = ("channels_first", "channels_last"), fresh: bool = False,
           layout: str = "channels_first") -> list[Case]:
    """The designed inputs identify drives a kernel with (``fresh``: the confirmation set, another seed, shape and
    scale, never seen by the search, with inputs in every layout of ``layouts``).  ``layout``: the layout of the
    designed ones — channels_last gives the same values moved to (N, H, W, C), for the search of a kernel whose
    channels-last branch computes another way, and leaves out the subnormal and huge inputs (the modes are the
    channels-first search's)."""
    fmt = get_format(dtype)
    rng = np.random.default_rng([seed, 31, 1 if fresh else 0])
    wide = {"fp16": 6, "bf16": 10}.get(fmt.name, 12)  # binades of spread: more than the accumulator resolves
    out: list[Case] = []

    def add(name: str, x: np.ndarray, purpose: str, layout: str = layout, modes_only: bool = False,
            running: tuple[np.ndarray, np.ndarray] | None = None, *, dy: np.ndarray | None = None) -> None:
        if layout == "channels_last":
            if modes_only:
                return
            x = np.moveaxis(x, 1, -1)  # (dy stays channels-first: _call moves it)
        out.append(Case(name, call=_call(x, rng, fmt.name, params, eps, momentum, seed + len(out), layout, running,
                                         dy=dy),
                        purpose=purpose, modes_only=modes_only))

    def near(means: np.ndarray, stds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Running statistics near the batch's (inference on a large running mean: its formula shows)."""
        return means * (1 + 0.01 * rng.standard_normal(means.shape)), stds ** 2 * rng.uniform(0.8, 1.25, stds.shape)

    if fresh:
        _fresh(add, near, rng, fmt.name, wide, layouts)
        return out
    # FPRev's probe (Xie et al., ATC 2025), one question per channel: small values and one pair +L, -L at a distance
    # that differs per channel; where the pair meets in the summation tree decides which small values are lost
    dist = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 100, 127, 128, 200, 255, 256, 300)
    x = 2.0 ** -9 * (1.0 + rng.random((3, len(dist), 7, 23)))
    flat = x.reshape(3, len(dist), -1).transpose(1, 0, 2).reshape(len(dist), -1)  # channel-first (C, R)
    for c, d in enumerate(dist):
        at = int(rng.integers(0, flat.shape[1] - d))
        flat[c, at], flat[c, at + d] = 2.0 ** 14, -(2.0 ** 14)
    x = flat.reshape(len(dist), 3, -1).transpose(1, 0, 2).reshape(x.shape)
    add("pairs", x, "FPRev pairs +L, -L among small values at distances 1 to 300: the summation tree and lanes "
        "(R = 483)")
    # values spread over many binades with random signs: every sum depends on its order and width
    # (8 channels: with 12 in binades and 16 in plain, a vector path for channel counts that 4, 8 or 16 divides shows
    # which of them it is)
    sign = np.where(rng.random((3, 8, 7, 11)) < 0.5, -1.0, 1.0)
    x = sign * 2.0 ** rng.uniform(-wide, wide, (3, 8, 7, 11)) * (1.0 + rng.random((3, 8, 7, 11)))
    x[:, 1] += 2.0 ** (wide - 1)  # one channel with a large offset: a big value plus many small ones
    add("spread", x, "sums that depend on order and width (R = 231, no lane width divides it); 8 channels")
    means, stds = np.array([10.0, 100.0, 1000.0, -300.0, 50.0, 7.0]), np.array([1, 1, 1, 2, 0.25, 3])
    x = means[None, :, None, None] + rng.standard_normal((4, 6, 5, 9)) * stds[None, :, None, None]
    add("large-mean", x, "large means over small spreads (one-pass variance cancels; inference on a large running "
        "mean); R = 180", running=near(means, stds))
    means, stds = np.array([300.0, -1e3, 3e3, 1e4, -5e3, 2e3]), np.array([1.0, 0.5, 4.0, 30.0, 2.0, 0.05])
    x = means[None, :, None, None] + stds[None, :, None, None] * rng.standard_normal((4, 6, 9, 11))
    add("mean-over-sigma", x, "means to 1e4 over spreads to 0.05 (y's formula and FMA: x·A + B cancels); R = 396",
        running=near(means, stds))
    stds = np.sqrt(eps) * np.array([0.3, 1.0, 3.0, 0.1, 10.0, 0.5])
    x = 0.5 + rng.standard_normal((2, 6, 8, 5)) * stds[None, :, None, None]
    add("var-near-eps", x, "variances near ε (where ε is added); R = 80")
    scales = 2.0 ** np.arange(-6, 6) * (1.0 + rng.random(12))
    x = rng.standard_normal((2, 12, 6, 6)) * scales[None, :, None, None]
    add("binades", x, "standard deviations across 12 binades (the rsqrt's signature); R = 72")
    # (16 channels: a kernel's vector path for channel counts that 4, 8 or 16 divide — oneDNN's JIT kernel — shows)
    x = rng.standard_normal((5, 16, 4, 7)) + rng.normal(0.0, 3.0, 16)[None, :, None, None]
    add("plain", x, "ordinary activations with γ, β and running statistics, 16 channels; R = 140")
    x = rng.standard_normal((2, 3, 4, 6)) + 1.0
    add("tiny-r", x[:, :, :1, :3], "R = 6: Bessel's factor and the divisions by R show")
    sub = fmt.smallest_subnormal * rng.integers(1, 64, (2, 4, 4, 4)).astype(np.float64)
    sub[:, 0] = rng.standard_normal((2, 4, 4)) * fmt.tiny * 4
    add("subnormal", sub, "subnormal values: kept or flushed", modes_only=True)
    huge = fmt.max * 0.25 * np.where(rng.random((2, 3, 4, 4)) < 0.5, -1.0, 1.0)
    add("huge", huge, "values near the format's maximum: the sum of squares overflows (IEEE inf or saturation)",
        modes_only=True)
    _later(add, rng)  # (after the others: they keep their random streams)
    if layout == "channels_last":  # (channels-first, a kernel may run (N, C, 1, 1) as channels-last: PyTorch does)
        x = rng.standard_normal((2, 63, 1, 1)) * 3.0 + rng.normal(0.0, 20.0, 63)[None, :, None, None]
        add("batch-of-two", x, "R = 2: dx cancels to its last bits, which show how each channel's is formed (C = 63: "
            "vectors of 4, 8, 16 or 32 channels leave tails of 3, 7, 15 or 31)")
    return out


def _later(add: Callable[..., None], rng: np.random.Generator) -> None:
    """The designed inputs added after the first ten, each given to ``add``: a count above 1024 and a flat dy."""
    means, stds = np.array([100.0, -30.0, 0.5]), np.array([1.0, 3.0, 0.01])
    x = means[None, :, None, None] + stds[None, :, None, None] * rng.standard_normal((2, 3, 25, 23))
    add("over-1024", x, "R = 1150, above 1024 (torch.compile's switch from a two-pass variance to Welford's), rows "
        "of 575 values with a tail in every vector width")
    x = rng.standard_normal((2, 4, 6, 7)) * 3.0 + 1.0
    flat = np.broadcast_to(np.array([0.75, -1.5, 2.0, 0.375])[None, :, None, None], x.shape).copy()
    add("flat-dy", x, "dy constant in each channel (values of every format): dy − mean(dy) cancels, so the backward's "
        "grouping shows even in 16-bit dx; R = 84", dy=flat)


def _fresh(add: Callable[..., None], near: Callable[..., Any], rng: np.random.Generator, fmt: str, wide: int,
           layouts: tuple[str, ...]) -> None:
    """The confirmation inputs (:func:`probes`' ``fresh``), each given to ``add`` with its layout."""
    n, c, h, w = 6, 5, 9, 13  # R = 702
    means = np.array([3e2, -1e3, 50.0, 7e2, -20.0])[:c] * (4.0 if fmt != "fp16" else 1.0)
    stds = np.array([1.0, 4.0, 0.3, 2.0, 0.05])
    x = means[None, :, None, None] + stds[None, :, None, None] * rng.standard_normal((n, c, h, w))
    add("fresh/large-means", x, "per-channel means to 1e3 and scales from 0.05 to 4", "channels_first",
        running=near(means, stds))
    large = x
    x = rng.standard_normal((n, c, h, w)) * 2.0 ** rng.uniform(-wide, wide, (n, c, h, w))
    add("fresh/spread", x, "values over many binades", "channels_first")
    if "channels_last" in layouts:  # (a kernel may compute NHWC another way: its own search confirms on these)
        add("fresh/channels-last", x * 0.5 + 3.0, "the NHWC layout", "channels_last")
        add("fresh/channels-last-means", large[:, :, ::-1] * 1.5, "the NHWC layout, large means", "channels_last",
            running=near(means * 1.5, stds * 1.5))


# ---- observing and emulating ----------------------------------------------------------------------------------

def _as64(a: Any) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=np.float64)


@dataclass
class Observed:
    """The kernel's outputs on one probe, and the recording they came from."""

    probe: Case
    rec: Any  # Recording
    got: dict[str, np.ndarray]
    formats: dict[str, str]
    saved: Saved | None


def observe(kernel: KernelAdapter, probe: Case, rec: Any) -> Observed:
    from bnprobe.engine.run import run_call

    run = run_call(kernel, rec, label=probe.name, quiet=True, skip_missing=True)
    return Observed(probe, rec, {k: _as64(v) for k, v in run.got.items()}, dict(run.formats), run.saved)


def _fixed(policy: Policy, saved: str) -> PolicyAdapter:
    return PolicyAdapter(policy.name, lambda p, mode: policy,
                         Capabilities(formats=(policy.storage,), saved=saved, training_r1=True))


def emulate(policy: Policy, obs: Observed, modes: tuple[str, ...], saved_kind: str) -> dict[str, np.ndarray]:
    """The candidate's outputs on the probe's inputs: its training step, its inference, and its backward from the
    kernel's own saved statistics (the candidate's where the kernel saved none)."""
    a = _fixed(policy, saved_kind)
    a.keep_arrays = False
    a.counters = False  # (the outputs alone are compared: no trace, the same bits)
    rec, call = obs.rec, obs.rec.call()
    out: dict[str, np.ndarray] = {}
    own: Saved | None = None
    if "train" in modes and "train" in rec.tensors:
        ins = rec.tensors["train"]["inputs"]
        f = a.train(call.with_inputs(ins))
        out["y"], own = _as64(f.y), f.saved
        if f.saved is not None:
            out["saved_mean"] = _as64(f.saved.mean)
            out[f"saved_{f.saved.kind}"] = _as64(f.saved.value)
        if f.running_mean is not None:
            out["running_mean"], out["running_var"] = _as64(f.running_mean), _as64(f.running_var)
    if "infer" in modes and "infer" in rec.tensors:
        ins = rec.tensors["infer"]["inputs"]
        out["y_infer"] = _as64(a.infer(call.with_inputs(ins)).y)
    bw = rec.tensors.get("backward", {}).get("inputs", {})
    if "backward" in modes and bw.get("dy") is not None:
        saved = obs.saved
        if saved is None or saved.kind not in ("invstd", "var"):
            if own is None:
                ins = rec.tensors.get("train", {}).get("inputs", bw)
                own = a.train(call.with_inputs(ins)).saved
            saved = own
        b = a.backward_of(call.with_(dy=bw["dy"], x=bw["x"], gamma=bw.get("gamma")), saved)
        out["dx"], out["dgamma"], out["dbeta"] = _as64(b.dx), _as64(b.dgamma), _as64(b.dbeta)
    return out


@dataclass
class Score:
    mismatches: int = 0
    elements: int = 0
    max_ulps: float = 0.0

    def add(self, got: np.ndarray, cand: np.ndarray | None, fmt: str) -> None:
        self.elements += got.size
        if cand is None or cand.shape != got.shape:
            self.mismatches += got.size
            self.max_ulps = float("inf")
            return
        with np.errstate(all="ignore"):
            same = ((got == cand) & (np.signbit(got) == np.signbit(cand))) | (np.isnan(got) & np.isnan(cand))
            n = int((~same).sum())
            if n:
                u = get_format(fmt).ulps_apart(got[~same], cand[~same])
                self.max_ulps = max(self.max_ulps, float(np.max(u)))
        self.mismatches += n

    @property
    def exact(self) -> bool:
        return self.mismatches == 0


def score_outputs(observed: list[Observed], cand: list[dict[str, np.ndarray]],
                  outputs: tuple[str, ...]) -> dict[str, Score]:
    scores = {k: Score() for k in outputs}
    for obs, c in zip(observed, cand):
        for k in outputs:
            if k in obs.got:
                scores[k].add(obs.got[k], c.get(k), obs.formats.get(k, obs.rec.dtype))
    return scores

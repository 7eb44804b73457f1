"""identify: how a black-box BatchNorm kernel computes, found by searching bnprobe's exact policy space.

A kernel reaches bnprobe only as outputs.  :class:`~bnprobe.kernels.policy.Policy` describes every numerical
choice a BatchNorm makes and its emulation is exact, so the question "what is the device doing?" becomes a search:
the policy whose emulation reproduces the kernel's outputs **bit for bit**.  The search runs stage by stage, each
stage with the ones before it fixed (``../shared/reference/identify-methods.md``):

======== ========================================= ===================================================
stage    fields searched                            pinned by
======== ========================================= ===================================================
mean     accumulator format, summation order and    the saved mean (else y)
         lanes, Kahan, mean by division or
         reciprocal, running (Welford) or tiled
         (Chan) updates
variance one-pass or two-pass, clamped at 0          the saved variance or invstd (else y)
rsqrt    exact, sqrt then divide (reciprocal         the saved invstd (else y)
         estimates), estimates + Newton steps
y        formula, FMA, compute format, statistics   y
         rounded before use, output rounding
modes    overflow (IEEE or saturation), subnormals  every training output, on subnormal and huge input
running  momentum's meaning, Bessel's factor, the   the running statistics
         update's format
infer    inference's formula                        inference y
backward the dx formula, its sums' order            dx, dγ, dβ (from the kernel's own saved statistics)
======== ========================================= ===================================================

It drives the kernel on designed probes (values spread over many binades, so sums depend on their order; large
means over small spreads; variances near ε; standard deviations across binades; both layouts; subnormal and huge
input for the modes) — or, on a recording, only the recorded inputs — keeping at every stage the candidates that
reproduce what the stage pins, ties kept as fields the probes could not distinguish.  Where no candidate
reproduces a stage, the closest is kept and the stage named as the one where the kernel departs from the space,
with its residual in ULPs: never a nearest guess called a match.  The identified policy is then confirmed on
fresh inputs the search never saw (another seed, shape and scale).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter, Saved, get_adapter
from bnprobe.adapters.base import Capabilities, outputs_only, params_format
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.call import EPS, MOMENTUM, BNCall
from bnprobe.checks.cases import dy_of_kind
from bnprobe.checks.run import recording_notes
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.kernels.policy import PRESETS, Policy

__all__ = ["identify", "identify_recorded", "Identified", "IdentifiedCalls", "OutputMatch", "Undistinguished",
           "STAGES", "policy_spec", "probes", "lossy_choices", "LOSSY"]

# the outputs each stage pins, in the order it prefers them (the first the kernel returned is used); a forward
# stage whose statistics the kernel does not return is searched through y
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "mean": ("saved_mean",),
    "variance": ("saved_var", "saved_invstd"),
    "rsqrt": ("saved_invstd",),
    "y": ("y",),
    "modes": ("y", "saved_mean", "saved_invstd", "saved_var"),
    "running": ("running_mean", "running_var"),
    "infer": ("y_infer",),
    "backward": ("dx", "dgamma", "dbeta"),
}
STAGES = tuple(STAGE_OUTPUTS)
_FORWARD = ("mean", "variance", "rsqrt", "y", "modes", "running")
# the stage that reports an output as reproduced or not (the last stage pinning it)
OUTPUT_STAGE = {"saved_mean": "mean", "saved_var": "variance", "saved_invstd": "rsqrt", "y": "y",
                "running_mean": "running", "running_var": "running", "y_infer": "infer", "dx": "backward",
                "dgamma": "backward", "dbeta": "backward"}

# what would tell the candidates of a field apart, for the fields a run could not distinguish
FIELD_PROBES = {
    "accumulate": "sums whose exact value needs more bits than the narrower accumulator keeps (a large value plus "
                  "many small ones)",
    "order": "sums that depend on their order: values spread over many binades, R above the accumulator's precision",
    "lanes": "an FPRev pair (+M, -M among ones) at lane distances 1 to 128",
    "kahan": "a sum whose rounding errors accumulate: many small values after a large one",
    "unroll": "rows of H·W values that are not a multiple of 2 x lanes", "rstd_format": "var + ε swept across binades",
    "unbiased_by": "R where var·fl(R/(R-1)) and Σ/(R-1) round apart",
    "mean_by": "counts R = 3, 7, 49 with sums where s/R and s·fl(1/R) round apart; sums that overflow unless "
               "prescaled",
    "variance": "a large mean over a small spread (mean 1e4, σ 1): one-pass cancels",
    "clamp_var": "a constant channel whose one-pass variance rounds negative",
    "tiles": "a variance merged from tiles of different means",
    "rsqrt": "var + ε swept across binades (the error pattern of an estimate is its signature)",
    "rsqrt_newton": "var + ε swept across binades", "rsqrt_bits": "var + ε swept across binades",
    "sqrt": "var + ε swept across binades", "division": "γ/σ for many γ", "recip": "γ/σ for many γ",
    "recip_newton": "γ/σ for many γ",
    "y_formula": "a large mean with γ not a power of two", "fma": "a large mean with γ not a power of two",
    "compute": "x·invstd products that need more than the storage format's bits",
    "stored_stats": "statistics that need more bits than the parameter format keeps",
    "output_rounding": "y values that fall exactly halfway between two values of the format (ties)",
    "overflow": "values near the format's maximum", "subnormals": "a channel of subnormal values",
    "running_momentum": "a momentum other than 0.5", "running_var": "R small enough that R/(R-1) shows",
    "running_format": "running statistics that need more bits than the parameter format keeps",
    "infer_y_formula": "inference with a large running mean and γ not a power of two",
    "backward_formula": "dy with a mean per channel, a large mean in x",
    "backward_fma": "rows of H·W values with a tail (not a multiple of 2 x lanes)",
}


# ---- probes -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """A designed input: the call, what it is for, and the stages it serves (``modes``: only the modes stage)."""

    name: str
    call: BNCall
    purpose: str
    modes_only: bool = False


def _vectors(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    """γ not a power of two, β, and running statistics that are not the batch's."""
    return {"gamma": rng.uniform(0.3, 3.0, c), "beta": rng.normal(0.0, 1.0, c),
            "running_mean": rng.normal(0.0, 1.0, c), "running_var": rng.uniform(0.5, 2.0, c)}


def _call(x: np.ndarray, rng: np.random.Generator, fmt: str, params: str, eps: float, momentum: float | None,
          seed: int, layout: str = "channels_first", running: tuple[np.ndarray, np.ndarray] | None = None) -> BNCall:
    c = x.shape[1] if layout == "channels_first" else x.shape[-1]
    shape_cf = x.shape if layout == "channels_first" else (x.shape[0], x.shape[-1], *x.shape[1:-1])
    dy = dy_of_kind("shifted", shape_cf, seed)
    if layout == "channels_last":
        dy = np.moveaxis(dy, 1, -1)
        x = np.ascontiguousarray(x)
    vec = _vectors(rng, c)
    if running is not None:
        vec["running_mean"], vec["running_var"] = running
    return BNCall(x, dy=dy, eps=eps, momentum=momentum, dtype=fmt, params=params, layout=layout, **vec)


def probes(dtype: str, params: str = "fp32", *, seed: int = 0, eps: float = EPS, momentum: float | None = MOMENTUM,
           layouts: tuple[str, ...] = ("channels_first", "channels_last"), fresh: bool = False) -> list[Probe]:
    """The designed inputs identify drives a kernel with (``fresh``: the confirmation set, another seed, shape and
    scale, never seen by the search)."""
    fmt = get_format(dtype)
    rng = np.random.default_rng([seed, 31, 1 if fresh else 0])
    wide = {"fp16": 6, "bf16": 10}.get(fmt.name, 12)  # binades of spread: more than the accumulator resolves
    out: list[Probe] = []

    def add(name: str, x: np.ndarray, purpose: str, layout: str = "channels_first", modes_only: bool = False,
            running: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        out.append(Probe(name, _call(x, rng, fmt.name, params, eps, momentum, seed + len(out), layout, running),
                         purpose, modes_only))

    def near(means: np.ndarray, stds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Running statistics near the batch's (inference on a large running mean: its formula shows)."""
        return means * (1 + 0.01 * rng.standard_normal(means.shape)), stds ** 2 * rng.uniform(0.8, 1.25, stds.shape)

    if fresh:
        n, c, h, w = 6, 5, 9, 13  # R = 702
        means = np.array([3e2, -1e3, 50.0, 7e2, -20.0])[:c] * (4.0 if fmt.name != "fp16" else 1.0)
        stds = np.array([1.0, 4.0, 0.3, 2.0, 0.05])
        x = means[None, :, None, None] + stds[None, :, None, None] * rng.standard_normal((n, c, h, w))
        add("fresh/large-means", x, "per-channel means to 1e3 and scales from 0.05 to 4", running=near(means, stds))
        x = rng.standard_normal((n, c, h, w)) * 2.0 ** rng.uniform(-wide, wide, (n, c, h, w))
        add("fresh/spread", x, "values over many binades")
        if "channels_last" in layouts:  # (searched in channels_first: a kernel may compute NHWC another way)
            add("fresh/channels-last", np.moveaxis(x, 1, -1) * 0.5 + 3.0, "the NHWC layout", "channels_last")
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
    sign = np.where(rng.random((3, 6, 7, 11)) < 0.5, -1.0, 1.0)
    x = sign * 2.0 ** rng.uniform(-wide, wide, (3, 6, 7, 11)) * (1.0 + rng.random((3, 6, 7, 11)))
    x[:, 1] += 2.0 ** (wide - 1)  # one channel with a large offset: a big value plus many small ones
    add("spread", x, "sums that depend on order and width (R = 231, no lane width divides it)")
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
    x = rng.standard_normal((5, 6, 4, 7)) + rng.normal(0.0, 3.0, 6)[None, :, None, None]
    add("plain", x, "ordinary activations with γ, β and running statistics; R = 140")
    x = rng.standard_normal((2, 3, 4, 6)) + 1.0
    add("tiny-r", x[:, :, :1, :3], "R = 6: Bessel's factor and the divisions by R show")
    sub = fmt.smallest_subnormal * rng.integers(1, 64, (2, 4, 4, 4)).astype(np.float64)
    sub[:, 0] = rng.standard_normal((2, 4, 4)) * fmt.tiny * 4
    add("subnormal", sub, "subnormal values: kept or flushed", modes_only=True)
    huge = fmt.max * 0.25 * np.where(rng.random((2, 3, 4, 4)) < 0.5, -1.0, 1.0)
    add("huge", huge, "values near the format's maximum: the sum of squares overflows (IEEE inf or saturation)",
        modes_only=True)
    return out


# ---- observing and emulating ----------------------------------------------------------------------------------

def _as64(a: Any) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=np.float64)


@dataclass
class _Observed:
    """The kernel's outputs on one probe, and the recording they came from."""

    probe: Probe
    rec: Any  # Recording
    got: dict[str, np.ndarray]
    formats: dict[str, str]
    saved: Saved | None


def _observe(kernel: KernelAdapter, probe: Probe, rec: Any) -> _Observed:
    from bnprobe.checks.run import run_call

    run = run_call(kernel, rec, label=probe.name, quiet=True, skip_missing=True)
    return _Observed(probe, rec, {k: _as64(v) for k, v in run.got.items()}, dict(run.formats), run.saved)


def _fixed(policy: Policy, saved: str) -> PolicyAdapter:
    return PolicyAdapter(policy.name, lambda p, mode: policy,
                         Capabilities(formats=(policy.storage,), saved=saved, training_r1=True))


def _emulate(policy: Policy, obs: _Observed, modes: tuple[str, ...], saved_kind: str) -> dict[str, np.ndarray]:
    """The candidate's outputs on the probe's inputs: its training step, its inference, and its backward from the
    kernel's own saved statistics (the candidate's where the kernel saved none)."""
    a = _fixed(policy, saved_kind)
    a.keep_arrays = False
    rec, call = obs.rec, obs.rec.call()
    opts = call.kernel_options
    out: dict[str, np.ndarray] = {}
    own: Saved | None = None
    if "train" in modes and "train" in rec.tensors:
        ins = rec.tensors["train"]["inputs"]
        f = a.forward_train(ins["x"], ins.get("gamma"), ins.get("beta"), ins.get("running_mean"),
                            ins.get("running_var"), momentum=call.momentum, **opts)
        out["y"], own = _as64(f.y), f.saved
        if f.saved is not None:
            out["saved_mean"] = _as64(f.saved.mean)
            out[f"saved_{f.saved.kind}"] = _as64(f.saved.value)
        if f.running_mean is not None:
            out["running_mean"], out["running_var"] = _as64(f.running_mean), _as64(f.running_var)
    if "infer" in modes and "infer" in rec.tensors:
        ins = rec.tensors["infer"]["inputs"]
        out["y_infer"] = _as64(a.forward_infer(ins["x"], ins.get("gamma"), ins.get("beta"), ins.get("running_mean"),
                                               ins.get("running_var"), **opts).y)
    bw = rec.tensors.get("backward", {}).get("inputs", {})
    if "backward" in modes and bw.get("dy") is not None:
        saved = obs.saved
        if saved is None or saved.kind not in ("invstd", "var"):
            if own is None:
                ins = rec.tensors.get("train", {}).get("inputs", bw)
                own = a.forward_train(ins["x"], ins.get("gamma"), ins.get("beta"), ins.get("running_mean"),
                                      ins.get("running_var"), momentum=call.momentum, **opts).saved
            saved = own
        b = a.backward(bw["dy"], bw["x"], bw.get("gamma"), saved, training=call.training, **opts)
        out["dx"], out["dgamma"], out["dbeta"] = _as64(b.dx), _as64(b.dgamma), _as64(b.dbeta)
    return out


@dataclass
class _Score:
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
                diff = np.abs(got - cand)[~same]
                ulp = get_format(fmt).ulp(np.abs(got[~same]))
                u = np.where(np.isfinite(diff), diff / ulp, np.inf)
                self.max_ulps = max(self.max_ulps, float(np.nanmax(np.where(np.isnan(u), np.inf, u))))
        self.mismatches += n

    @property
    def exact(self) -> bool:
        return self.mismatches == 0


def _score(observed: list[_Observed], cand: list[dict[str, np.ndarray]], outputs: tuple[str, ...]) -> dict[str, _Score]:
    scores = {k: _Score() for k in outputs}
    for obs, c in zip(observed, cand):
        for k in outputs:
            if k in obs.got:
                scores[k].add(obs.got[k], c.get(k), obs.formats.get(k, obs.rec.dtype))
    return scores


# ---- the search space, stage by stage -------------------------------------------------------------------------

_ORDERS: tuple[dict[str, Any], ...] = (
    {"order": "pairwise"}, {"order": "sequential"}, {"order": "sequential", "kahan": True},
    *({"order": "lanes", "lanes": n} for n in (2, 4, 8, 16, 32, 64, 128)),
    *({"order": "lanes", "lanes": n, "kahan": True} for n in (8, 16)),
    *({"order": "vec", "lanes": n, "unroll": u} for n in (4, 8, 16) for u in (1, 2)),
)
_RSQRTS: tuple[dict[str, Any], ...] = (
    {"rsqrt": "exact"},
    {"rsqrt": "sqrt_div", "sqrt": "exact", "division": "exact"},
    *({"rsqrt": "sqrt_div", "division": "reciprocal", "recip": r, "recip_newton": k}
      for r in ("table", "frecpe", "magic") for k in (1, 2)),
    *({"rsqrt": "magic", "rsqrt_newton": k} for k in (0, 1, 2, 3)),
    *({"rsqrt": "table", "rsqrt_bits": b, "rsqrt_newton": k} for b in (7, 8, 10, 12) for k in (0, 1, 2)),
    *({"rsqrt": "frsqrte", "rsqrt_newton": k} for k in (0, 1, 2)),
    {"rsqrt": "ascend950"},
    {"rsqrt": "sqrt_div", "rstd_format": "fp64"}, {"rsqrt": "exact", "rstd_format": "fp64"},
)


def _accumulators(fmt: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(("fp32", fmt if fmt in ("fp16", "bf16") else "fp32", "fp64")))


def _mean_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    sum_based = cur.variance if cur.variance in ("naive", "two_pass") else "two_pass"
    for acc in _accumulators(fmt):
        orders = _ORDERS if acc != "fp64" else ({"order": "pairwise"},)
        for o, by in itertools.product(orders, ("divide", "reciprocal", "prescaled")):
            # (an order other than vec takes the backward's fused lanes away: backward_fma needs vec)
            fused = cur.backward_fma if o.get("order") == "vec" else "none"
            yield {"accumulate": acc, "variance": sum_based, "kahan": False, "unroll": 1, **o, "mean_by": by,
                   "backward_fma": fused}
    for acc in _accumulators(fmt):
        for v, lanes, by in itertools.product(("welford", "welford_ascend"), (1, 8, 16, 64), ("divide", "reciprocal")):
            yield {"accumulate": acc, "variance": v, "lanes": lanes, "mean_by": by, "order": "pairwise",
                   "kahan": False, "backward_fma": "none"}
        for tiles, o in itertools.product((2, 4, 8, 16, 24, 32, 64), ({"order": "pairwise"}, {"order": "sequential"})):
            yield {"accumulate": acc, "variance": "chan", "tiles": tiles, "mean_by": "divide", "kahan": False,
                   "backward_fma": "none", **o}


def _variance_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    variances = ("two_pass", "naive") if cur.variance in ("naive", "two_pass") else (cur.variance,)
    # (the variance's division by R too: a Welford or Chan mean does not show it)
    for v, clamp, by in itertools.product(variances, (False, True), ("divide", "reciprocal")):
        yield {"variance": v, "clamp_var": clamp, "mean_by": by if cur.mean_by != "prescaled" else "prescaled"}


def _rsqrt_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    defaults = {"sqrt": "exact", "division": "exact", "recip": "table", "recip_newton": 2, "rsqrt_newton": 0,
                "rsqrt_bits": 12, "rstd_format": None}
    for r in _RSQRTS:
        yield {**defaults, **r}


def _y_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    computes = tuple(dict.fromkeys(("fp32" if fmt != "fp64" else "fp64", fmt)))
    narrow = cur.params_format in ("fp16", "bf16")
    for f, fma, comp, stored, rnd in itertools.product(("xhat", "scale", "affine"), (False, True), computes,
                                                       (False, True) if narrow else (False,),
                                                       (None, "nearest_away", "toward_zero")):
        yield {"y_formula": f, "fma": fma, "compute": comp, "stored_stats": stored, "output_rounding": rnd}


def _modes_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    for ov, sub in itertools.product(("ieee", "saturate"), ("keep", "flush")):
        yield {"overflow": ov, "subnormals": sub}


def _running_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    formats = tuple(dict.fromkeys(f for f in (None, cur.params_format, "fp64") if f != cur.accumulate))
    for m, v, f, by in itertools.product(("new", "old"), ("unbiased", "biased"), formats, ("factor", "divide")):
        if v == "unbiased" or by == "factor":
            yield {"running_momentum": m, "running_var": v, "running_format": f, "unbiased_by": by}


def _infer_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    for f in (None, "xhat", "scale", "affine"):
        if f != cur.y_formula:
            yield {"infer_y_formula": f}


def _backward_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    # (the sums' order and format are the forward's: the forward's outputs pinned them)
    for f in ("standard", "ascend", "torch"):
        for fused in (("none", "body", "all") if cur.order == "vec" else ("none",)):
            yield {"backward_formula": f, "backward_fma": fused}


_SPACES: dict[str, Callable[[Policy, str], Iterator[dict[str, Any]]]] = {
    "mean": _mean_space, "variance": _variance_space, "rsqrt": _rsqrt_space, "y": _y_space, "modes": _modes_space,
    "running": _running_space, "infer": _infer_space, "backward": _backward_space,
}
_MODES_OF = {**{s: ("train",) for s in _FORWARD}, "infer": ("infer",), "backward": ("backward",)}


# ---- results --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutputMatch:
    """One output of the kernel against the identified policy: on the search's probes and on fresh inputs."""

    output: str
    stage: str
    probes_exact: bool
    fresh_exact: bool | None  # None: not observed on the fresh inputs
    mismatches: int
    elements: int
    max_ulps: float

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "stage": self.stage, "bit_for_bit": self.probes_exact and
                self.fresh_exact is not False, "probes_exact": self.probes_exact, "fresh_exact": self.fresh_exact,
                "mismatches": self.mismatches, "elements": self.elements, "max_ulps": self.max_ulps}


@dataclass(frozen=True)
class Undistinguished:
    """Candidates of one stage that the probes could not tell apart: each alternative (the fields it changes, as
    ``key=value``) reproduced what the stage pins as well as the chosen policy."""

    stage: str
    fields: tuple[str, ...]
    chosen: str  # the chosen policy's values of those fields
    alternatives: tuple[str, ...]
    probe: str  # what would tell them apart

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "fields": list(self.fields), "chosen": self.chosen,
                "alternatives": list(self.alternatives), "would_tell": self.probe}


@dataclass
class Identified:
    """What identify found for one kernel (or one recorded call)."""

    adapter: str
    dtype: str
    params: str
    policy: Policy
    spec: str
    outputs: list[OutputMatch]
    undistinguished: list[Undistinguished]
    departs: str | None  # the first stage no candidate reproduced, None when every observed output is bit for bit
    stages: dict[str, dict[str, Any]]
    probes: list[str]
    unobserved: list[str]
    evaluations: int
    seconds: float
    nondeterministic: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    label: str = ""
    layouts: dict[str, list[str]] = field(default_factory=dict)  # another layout: the outputs it does not reproduce

    @property
    def reproduced(self) -> bool:
        """Every observed output bit for bit, on the probes and on the fresh inputs."""
        return all(o.probes_exact and o.fresh_exact is not False for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {"adapter": self.adapter, "label": self.label, "dtype": self.dtype, "params": self.params,
                "policy": self.spec, "policy_fields": {k: v for k, v in self.policy.to_dict().items() if k != "name"},
                "reproduced": self.reproduced, "departs": self.departs,
                "outputs": [o.to_dict() for o in self.outputs],
                "undistinguished": [u.to_dict() for u in self.undistinguished], "stages": self.stages,
                "probes": self.probes, "unobserved": self.unobserved, "nondeterministic": self.nondeterministic,
                "layouts": {k: {"not_reproduced": v} for k, v in self.layouts.items()},
                "evaluations": self.evaluations, "seconds": self.seconds, "notes": self.notes}

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([o.to_dict() for o in self.outputs])


@dataclass
class IdentifiedCalls:
    """identify over the calls of a recording, in forward order."""

    source: str
    results: list[Identified]

    @property
    def reproduced(self) -> bool:
        return all(r.reproduced for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "reproduced": self.reproduced, "calls": [r.to_dict() for r in self.results]}


_NARROW = ("fp16", "bf16")
_ESTIMATES = ("magic", "table", "frsqrte")
# the choices known to lose accuracy against a careful kernel, in words (doctor names a kernel's recipe by them)
LOSSY: tuple[tuple[Callable[[Policy], bool], Callable[[Policy], str]], ...] = (
    (lambda p: p.variance == "naive",
     lambda p: "a single-pass variance E[x²] − E[x]², which cancels at large means (variance=naive)"),
    (lambda p: p.accumulate in _NARROW,
     lambda p: f"sums and statistics accumulated in {p.accumulate} (accumulate={p.accumulate})"),
    (lambda p: p.compute in _NARROW,
     lambda p: f"the normalisation computed in {p.compute} (compute={p.compute})"),
    (lambda p: p.stored_stats,
     lambda p: f"the batch statistics rounded to {p.params_format} before use (stored_stats=true)"),
    (lambda p: p.running_format in _NARROW,
     lambda p: f"the running statistics updated in {p.running_format} (running_format={p.running_format})"),
    (lambda p: p.rsqrt in _ESTIMATES and p.rsqrt_newton == 0,
     lambda p: f"an rsqrt estimate without a Newton step (rsqrt={p.rsqrt}, rsqrt_newton=0)"),
    (lambda p: p.rsqrt == "sqrt_div" and p.division == "reciprocal" and p.recip_newton == 0,
     lambda p: f"division by a reciprocal estimate without a Newton step (recip={p.recip}, recip_newton=0)"),
    (lambda p: p.y_formula == "affine",
     lambda p: "y = x·A + B with B = β − μ·A, which cancels at large mean/σ (y_formula=affine)"),
    (lambda p: p.subnormals == "flush", lambda p: "subnormals flushed to zero (subnormals=flush)"),
    (lambda p: "toward_zero" in (p.rounding, p.output_rounding),
     lambda p: "rounding toward zero (rounding/output_rounding=toward_zero)"),
)


def lossy_choices(policy: Policy) -> list[str]:
    """The choices of ``policy`` known to lose accuracy against a careful kernel, in words with field and value."""
    return [words(policy) for test, words in LOSSY if test(policy)]


def policy_spec(policy: Policy) -> str:
    """The shortest ``preset:key=value,...`` spec that :func:`~bnprobe.kernels.policy.get_policy` turns back into
    ``policy`` (every field but the name)."""
    best = None
    for name, preset in PRESETS.items():
        if preset.storage != policy.storage:
            continue
        diff = [f.name for f in fields(Policy) if f.name not in ("name",) and getattr(policy, f.name) !=
                getattr(preset, f.name)]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    if best is None:
        raise BNProbeError(f"no preset stores {policy.storage}")
    name, diff = best

    return name + (":" + ",".join(f"{k}={_text(getattr(policy, k))}" for k in diff) if diff else "")


# ---- the search -----------------------------------------------------------------------------------------------

def _base(fmt: str, params: str) -> Policy:
    pf = params_format(fmt, params)
    return PRESETS[fmt].with_options(name="identified", params=pf)


#: how many of an earlier stage's ties a later stage tries as alternatives
TIES_TRIED = 12


class _Search:
    """The coordinate search over the stages, on the observed probes."""

    def __init__(self, observed: list[_Observed], fmt: str, saved_kind: str, tick: Callable[[], None]) -> None:
        self.observed, self.fmt, self.saved_kind, self.tick = observed, fmt, saved_kind, tick
        self.evaluations = 0
        self.runs = 0
        self.kept: list[str] = []  # outputs the forward stages so far reproduced, which later stages must keep
        self.ties: dict[str, list[dict[str, Any]]] = {}  # per stage, the changes tied with its choice
        narrow = {"fp16", "bf16"}
        self.narrow_stats = any(o.formats.get("saved_mean") in narrow and fmt in narrow and
                                o.formats.get("saved_mean") != "fp32" for o in observed) and \
            any(o.formats.get("saved_mean") in narrow for o in observed)
        self.cache: dict[tuple, dict[str, np.ndarray]] = {}

    def outputs_of(self, stage: str) -> tuple[str, ...]:
        seen = set().union(*(o.got for o in self.observed))
        pinned = tuple(k for k in STAGE_OUTPUTS[stage] if k in seen)
        if stage == "variance":
            pinned = pinned[:1]
        if pinned and stage in ("mean", "variance", "rsqrt") and "y" in seen and self.narrow_stats:
            return pinned + ("y",)  # statistics stored narrower than computed: y, formed from them, shows more
        if not pinned and stage in ("mean", "variance", "rsqrt") and "y" in seen:
            return ("y",)  # statistics the kernel does not return: searched through y
        return pinned

    def probes_of(self, stage: str) -> list[_Observed]:
        if stage == "modes":
            return self.observed
        return [o for o in self.observed if not o.probe.modes_only]

    def emulated(self, policy: Policy, stage: str, i: int, obs: _Observed) -> dict[str, np.ndarray]:
        """The candidate's outputs on one probe (cached per policy, modes and probe)."""
        modes = _MODES_OF[stage]
        key = (repr(sorted(policy.to_dict().items())), modes, obs.probe.name, i)
        if key not in self.cache:
            self.runs += 1
            try:
                self.cache[key] = _emulate(policy, obs, modes, self.saved_kind)
            except BNProbeError:
                self.cache[key] = {}
        return self.cache[key]

    def evaluate(self, policy: Policy, stage: str, outputs: tuple[str, ...],
                 limit: int | None = None, limit_on: tuple[str, ...] | None = None) -> dict[str, _Score]:
        """The candidate's scores on ``outputs`` over the stage's probes; with ``limit``, stop as soon as it has
        more mismatching elements (in ``limit_on``, default all) than that (a search that has a candidate with
        ``limit`` mismatches needs no more of a worse one; its score is then a lower bound, marked by infinite
        ULPs)."""
        limit_on = outputs if limit_on is None else limit_on
        self.evaluations += 1
        self.tick()
        scores = {k: _Score() for k in outputs}
        for i, o in enumerate(self.probes_of(stage)):
            s = _score([o], [self.emulated(policy, stage, i, o)], outputs)
            for k in outputs:
                scores[k].mismatches += s[k].mismatches
                scores[k].elements += s[k].elements
                scores[k].max_ulps = max(scores[k].max_ulps, s[k].max_ulps)
            if limit is not None and sum(scores[k].mismatches for k in limit_on) > limit:
                for k in outputs:
                    scores[k].max_ulps = float("inf")
                return scores
        return scores

    def break_ties(self, stage: str, outputs: tuple[str, ...], ties: list[tuple]) -> list[tuple]:
        """Tied candidates of a stage told apart, where they can be, on the subnormal and huge probes (which only
        the modes stage searches): a prescaled sum that does not overflow, a flush that shows."""
        extra = [o for o in self.observed if o.probe.modes_only]
        if len(ties) < 2 or stage == "modes" or not extra:
            return ties
        keyed = []
        for t in ties:
            n = sum(_score([o], [self.emulated(t[1], "modes", i, o)], outputs)[k].mismatches
                    for i, o in enumerate(self.observed) if o.probe.modes_only for k in outputs)
            keyed.append((n, t))
        low = min(n for n, _ in keyed)
        return [t for n, t in keyed if n == low]

    def stage(self, cur: Policy, stage: str) -> tuple[Policy, dict[str, Any], list[dict[str, Any]]]:
        """The best candidate of ``stage`` from ``cur``; its summary; the changes of the candidates tied with it.
        A forward stage is scored on what the forward stages before it reproduced too, so a later choice never
        undoes an earlier match (the variance's division by R must keep the mean that pinned it)."""
        own = self.outputs_of(stage)
        if not own:
            return cur, {"pinned_by": [], "exact": None, "candidates": 0}, []
        kept = tuple(k for k in self.kept if k not in own) if stage in _FORWARD and stage != "modes" else ()
        outputs = own + kept

        # y appended to a narrow statistic's stage breaks its ties (secondary); the rest must be reproduced first
        secondary = ("y",) if stage not in ("y", "modes") and len(own) > 1 and own[-1] == "y" else ()
        primary = tuple(k for k in outputs if k not in secondary)

        def total(s: dict[str, _Score]) -> _Score:
            return _Score(sum(v.mismatches for v in s.values()), sum(v.elements for v in s.values()),
                          max(v.max_ulps for v in s.values()))

        def key(s: dict[str, _Score]) -> tuple[int, int, float]:
            return (sum(s[k].mismatches for k in primary), sum(s[k].mismatches for k in secondary),
                    max(v.max_ulps for v in s.values()))

        # the current policy competes too: a stage never makes the match worse
        here_s = self.evaluate(cur, stage, outputs)
        here, best_key = total(here_s), key(here_s)
        best = here
        scored = []
        space = list(_SPACES[stage](cur, self.fmt))
        if stage == "y" and self.outputs_of("rsqrt") == ("y",):  # rsqrt seen only through y: searched with it
            # (the rsqrt stage's own choice and its ties, and the exact forms: the joint space stays small)
            joint = [{}] + self.ties.get("rsqrt", [])[:TIES_TRIED] + [r for r in _rsqrt_space(cur, self.fmt)
                                                                      if r["rsqrt"] in ("exact", "sqrt_div")
                                                                      and r["division"] == "exact"]
            space = [{**r, **c} for r in joint for c in space]
        if stage == "variance" or stage == "rsqrt" and own[0] != "y":  # the earlier statistics' ties (an order
            # the mean could not tell apart shows in the sum of squares), kept exact by the scoring; (an rsqrt seen
            # only through y is searched with y's formula instead)
            earlier = ("mean",) if stage == "variance" else ("mean", "variance")
            alts = [{}] + [t for st in earlier for t in self.ties.get(st, [])[:TIES_TRIED]]
            space = [{**alt, **c} for alt in alts for c in space]
        if stage in ("infer", "backward"):
            # the earlier stages' ties reproduced the training forward (y in fp16 hides the compute format, an FMA, a
            # division...); inference and the backward, which compute with them, may tell them apart
            alts = [{}] + [t for st in ("rsqrt", "y") for t in self.ties.get(st, [])[:TIES_TRIED]]
            if stage == "infer":  # (inference forms its own rstd: every rsqrt the training forward allows)
                alts += [{**r, "rstd_format": cur.rstd_format} for r in _rsqrt_space(cur, self.fmt)]
            space = [{**alt, **c} for alt in alts for c in space]
        forward = tuple(dict.fromkeys(self.kept + ["y"])) if stage in ("infer", "backward") and \
            "y" in self.outputs_of("y") else ()
        own_fields = {k for c in _SPACES[stage](cur, self.fmt) for k in c}
        for changes in space:
            try:
                cand = cur.with_options(**changes)
            except BNProbeError:  # (a combination the space does not allow, e.g. Kahan on a pairwise tree)
                continue
            sc = self.evaluate(cand, stage, outputs, limit=best_key[0], limit_on=primary)
            k, t = key(sc), total(sc)
            if forward and k <= best_key and set(changes) - own_fields and \
                    total(self.evaluate(cand, "y", forward, limit=0)).mismatches:
                continue  # (an earlier stage's tie that the stages since have made wrong for the forward)
            if k < best_key:
                best, best_key = t, k
            scored.append((k, changes, cand, t))
        ties = [(c, p, t) for k, c, p, t in scored if k == best_key]
        if key(here_s) == best_key:
            ties.insert(0, ({}, cur, here))
        ties = self.break_ties(stage, outputs, ties)
        # the current policy when it is among the best (a later pass keeps what a later stage chose among the ties),
        # else the simplest of them (fewest fields away from the format's preset)
        ties.sort(key=lambda t: (t[1] is not cur, _complexity(t[1])))
        chosen, best = ties[0][1], ties[0][2]
        ties = [t for t in ties if t[1] is not cur]
        if stage in _FORWARD and stage != "modes" and best.exact:
            self.kept.extend(k for k in own if k not in self.kept)
        summary = {"pinned_by": list(own), "exact": best.exact, "mismatches": best.mismatches,
                   "elements": best.elements, "max_ulps": best.max_ulps, "candidates": len(scored),
                   "tied": len(ties)}
        self.ties[stage] = [c for c, _, _ in ties]
        return chosen, summary, self.ties[stage]

def _text(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _complexity(policy: Policy) -> int:
    """How many fields a policy sets away from its format's preset (the simplest explanation is preferred)."""
    base = PRESETS.get(policy.storage)
    return 0 if base is None else sum(getattr(policy, f.name) != getattr(base, f.name) for f in fields(Policy)
                                      if f.name not in ("name", "params"))


def _undistinguished(stage: str, chosen: Policy, ties: list[dict[str, Any]]) -> Undistinguished | None:
    """The stage's tied candidates as alternatives to the chosen policy (None when there are none)."""
    alts, names = [], []
    for t in ties:
        diff = {k: v for k, v in t.items() if v != getattr(chosen, k)}
        if stage == "backward" and not {"backward_formula", "backward_fma"} & set(diff):
            continue  # (a tie of the y stage's, listed there)
        if diff:
            alts.append(",".join(f"{k}={_text(v)}" for k, v in diff.items()))
            names.extend(k for k in diff if k not in names)
    if not alts:
        return None
    hint = "; ".join(dict.fromkeys(FIELD_PROBES.get(n, "another probe") for n in names))
    return Undistinguished(stage, tuple(names), ",".join(f"{n}={_text(getattr(chosen, n))}" for n in names),
                           tuple(dict.fromkeys(alts)), hint)


def _nondeterministic(kernel: KernelAdapter, first: _Observed) -> list[str]:
    """The outputs that differ when the first probe is run again (a nondeterministic kernel: a finding)."""
    again = _observe(kernel, first.probe, first.rec)
    return [k for k, v in first.got.items() if k in again.got and not
            np.array_equal(v, again.got[k], equal_nan=True)]


def _identify_observed(kernel: KernelAdapter, observed: list[_Observed], fresh: list[_Observed], fmt: str,
                       params: str, *, passes: int, progress: Callable[[int, int], None] | None,
                       label: str = "") -> Identified:
    t0 = time.perf_counter()
    saved_kind = next((o.saved.kind for o in observed if o.saved is not None), "invstd")
    total_guess = 400
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(min(done[0], total_guess - 1), total_guess)

    search = _Search(observed, fmt, saved_kind, tick)
    cur = _base(fmt, params)
    stages: dict[str, dict[str, Any]] = {}
    ties_of: dict[str, tuple[Policy, list[dict[str, Any]]]] = {}
    for _ in range(passes):
        before = cur
        for st in STAGES:
            cur, stages[st], ties = search.stage(cur, st)
            ties_of[st] = (cur, ties)
        if cur == before or all(s.get("exact") in (True, None) for s in stages.values()):
            break
    policy = cur
    spec = policy_spec(policy)
    seen = [k for k in OUTPUT_STAGE if any(k in o.got for o in observed)]
    by_stage = {st: tuple(k for k in seen if OUTPUT_STAGE[k] == st) for st in STAGES}
    mine = {st: search.evaluate(policy, st, outs) for st, outs in by_stage.items() if outs}

    def equivalent(changes: dict[str, Any]) -> bool:
        """Whether the policy with ``changes`` reproduces every output as well as the one chosen (a tie of one
        stage that a later stage told apart is not an alternative)."""
        try:
            cand = policy.with_options(**changes)
        except BNProbeError:
            return False
        return all(search.evaluate(cand, st, outs)[k].mismatches == mine[st][k].mismatches
                   for st, outs in by_stage.items() if outs for k in outs)

    undist = [u for st in STAGES
              if (u := _undistinguished(st, policy, [t for t in ties_of.get(st, (policy, []))[1] if equivalent(t)]))]
    nondet = _nondeterministic(kernel, observed[0])
    fresh_scores, layouts = _confirm(policy, fresh, saved_kind, tuple(seen), observed[0].rec.layout)
    outputs = _matches(seen, {st: mine.get(st, {}) for st in STAGES}, fresh_scores)
    if stages.get("modes", {}).get("exact") is False:  # (the subnormal and huge probes: no output of their own)
        m = stages["modes"]
        outputs.append(OutputMatch("modes (subnormal, huge input)", "modes", False, None, m.get("mismatches", 0),
                                   m.get("elements", 0), m.get("max_ulps", 0.0)))
    departs = next((st for st in STAGES if any(o.stage == st and not (o.probes_exact and o.fresh_exact is not False)
                                               for o in outputs)), None)
    unobserved = [k for k in ("saved_mean", "saved_invstd", "running_mean", "running_var", "y_infer", "dx", "dgamma",
                              "dbeta") if k not in seen and not (k == "saved_invstd" and "saved_var" in seen)]
    notes = _notes(nondet, layouts, stages, seen)
    if progress is not None:
        progress(total_guess, total_guess)
    return Identified(kernel.name, fmt, params, policy, spec, outputs, undist, departs, stages,
                      [o.probe.name for o in observed], unobserved, search.evaluations, time.perf_counter() - t0,
                      nondet, notes, label, layouts)


def _confirm(policy: Policy, fresh: list[_Observed], saved_kind: str, seen: tuple[str, ...],
             layout: str = "channels_first") -> tuple[dict[str, _Score], dict[str, list[str]]]:
    """The identified policy on the fresh inputs: the scores per output of those in the search's ``layout``, and per
    other layout the outputs it does not reproduce."""
    fresh_scores: dict[str, _Score] = {}
    layouts: dict[str, list[str]] = {}
    first = [o for o in fresh if o.rec.layout == layout]
    if first:
        cand = [_emulate(policy, o, ("train", "infer", "backward"), saved_kind) for o in first]
        fresh_scores = _score(first, cand, seen)
    for o in fresh:
        if o.rec.layout != layout:
            s = _score([o], [_emulate(policy, o, ("train", "infer", "backward"), saved_kind)], seen)
            layouts[o.rec.layout] = [k for k, v in s.items() if v.elements and not v.exact]
    return fresh_scores, layouts


def _matches(seen: list[str], found: dict[str, dict[str, _Score]],
             fresh_scores: dict[str, _Score]) -> list[OutputMatch]:
    """Every observed output of the identified policy, on the search's probes and on the fresh inputs."""
    outputs = []
    for k in seen:
        st = OUTPUT_STAGE[k]
        s = found[st][k]
        f = fresh_scores.get(k)
        f_exact = None if f is None or f.elements == 0 else f.exact
        outputs.append(OutputMatch(k, st, s.exact, f_exact, s.mismatches + (f.mismatches if f else 0),
                                   s.elements + (f.elements if f else 0), max(s.max_ulps, f.max_ulps if f else 0.0)))
    return outputs


def _notes(nondet: list[str], layouts: dict[str, list[str]], stages: dict[str, dict[str, Any]],
           seen: list[str]) -> list[str]:
    """What the result's reader must know: nondeterminism, other layouts, stages seen only through y."""
    notes = []
    if nondet:
        notes.append(f"nondeterministic: the same probe run twice gave different {', '.join(nondet)} (a reduction "
                     "whose order changes from call to call, such as atomic adds): no policy reproduces it bit for "
                     "bit, the closest is shown")
    for lay, off in layouts.items():
        notes.append(f"{lay}: " + (f"{', '.join(off)} not reproduced — the kernel computes this layout another way "
                                   "(the search ran on the other)" if off else "reproduced bit for bit too"))
    for st in ("mean", "variance", "rsqrt"):
        if stages.get(st, {}).get("pinned_by") == ["y"]:
            what = "saves the variance, not invstd" if "saved_var" in seen else "returns no saved statistics"
            notes.append(f"the kernel {what}: the {st} stage was searched through y alone")
    return notes


def identify(adapter: str | KernelAdapter, dtype: str = "fp16", *, params: str = "fp32", x: np.ndarray | None = None,
             seed: int = 0, eps: float = EPS, momentum: float | None = MOMENTUM, passes: int = 2,
             fresh: bool = True, progress: Callable[[int, int], None] | None = None) -> Identified:
    """The policy that reproduces ``adapter`` bit for bit in ``dtype`` with ``params`` parameters (fp32 or same),
    searched stage by stage on designed probes, then confirmed on fresh inputs (``fresh``) and on ``x`` (the user's
    input, channels-first, when given).  Its ``spec`` runs as ``emulated:<spec>``."""
    from bnprobe.checks.run import generated_call

    kernel = outputs_only(get_adapter(adapter) if isinstance(adapter, str) else adapter)
    caps = kernel.capabilities()
    if caps.recorded:
        raise BNProbeError(f"{kernel.name} replays a recording: identify it with identify_recorded (the CLI does)")
    fmt = get_format(dtype).name
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {kernel.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    if fmt not in PRESETS:
        raise BNProbeError(f"identify searches fp64, fp32, fp16 and bf16 kernels, not {fmt}")
    params_format(fmt, params)  # (validated)
    layouts = tuple(caps.layouts)
    designed = probes(fmt, params, seed=seed, eps=eps, momentum=momentum, layouts=layouts)
    if caps.saved == "none":
        designed = [p for p in designed if p.name != "tiny-r"]
    confirm = probes(fmt, params, seed=seed + 7919, eps=eps, momentum=momentum, layouts=layouts, fresh=True) \
        if fresh else []
    if x is not None:  # the user's input confirms the recipe (the search runs on the designed probes)
        xa = np.asarray(x, dtype=np.float64)
        if xa.ndim < 2:
            raise BNProbeError(f"identify: x must be (N, C, ...), got shape {xa.shape}")
        rng = np.random.default_rng([seed, 5])
        confirm.insert(0, Probe("input", BNCall(xa, dy=dy_of_kind("shifted", xa.shape, seed), eps=eps,
                                                momentum=momentum, dtype=fmt, params=params,
                                                **_vectors(rng, xa.shape[1])), "your input"))

    def observe_all(ps: list[Probe]) -> list[_Observed]:
        out = []
        for p in ps:
            try:
                out.append(_observe(kernel, p, generated_call(p.call, label=p.name)))
            except BNProbeError as exc:
                if p.modes_only:  # (a kernel may refuse subnormal or huge input: the modes stay unidentified)
                    continue
                raise BNProbeError(f"identify: {kernel.name} refused the probe {p.name}: {exc}") from None
        return out

    observed, confirmed = observe_all(designed), observe_all(confirm)
    res = _identify_observed(kernel, observed, confirmed, fmt, params, passes=passes, progress=progress)
    seen_only = [o for o in res.outputs if o.probes_exact and o.fresh_exact is False]
    if fresh and seen_only and not res.nondeterministic:
        # the search's probes could not tell apart what the fresh inputs did: they join the search, and another
        # fresh set, never seen, confirms
        again = observe_all(probes(fmt, params, seed=seed + 2 * 7919, eps=eps, momentum=momentum, layouts=layouts,
                                   fresh=True))
        first = res
        res = _identify_observed(kernel, observed + [o for o in confirmed if o.rec.layout == "channels_first"],
                                 again + [o for o in confirmed if o.rec.layout != "channels_first"], fmt, params,
                                 passes=passes, progress=progress)
        res.evaluations += first.evaluations
        res.seconds += first.seconds
        res.notes.append(f"the first search's probes did not tell apart what fresh inputs showed in "
                         f"{', '.join(o.output for o in seen_only)}: those inputs joined the search and a second "
                         "fresh set confirmed it")
    return res


def _slice_channels(rec: Any, idx: np.ndarray) -> Any:
    """The recorded call restricted to the channels ``idx`` (BatchNorm's channels are independent: every tensor
    taken along the channel axis, every per-channel vector at those channels)."""
    import dataclasses

    call = rec.call()
    axis = 1 if rec.layout == "channels_first" else np.ndim(call.x) - 1
    c = np.shape(call.x)[axis]

    def take(v: Any) -> Any:
        if not isinstance(v, np.ndarray) or v.ndim == 0:
            return v
        if v.ndim == np.ndim(call.x) and v.shape[axis] == c:
            return np.take(v, idx, axis=axis)
        if v.ndim == 1 and v.shape[0] == c:
            return v[idx]
        return v

    tensors = {m: {io: {k: take(v) for k, v in named.items()} for io, named in ios.items()}
               for m, ios in rec.tensors.items()}
    return dataclasses.replace(rec, tensors=tensors, meta={**rec.meta, "channels_of": [int(i) for i in idx]})


#: the search on a recorded call runs on as many of its channels (spread over them, at least 6) as keep it within
#: this many values; the whole call then confirms what it found
SEARCH_VALUES = 1 << 16


def identify_recorded(recorded: Any, *, passes: int = 3,
                      progress: Callable[[int, int], None] | None = None) -> IdentifiedCalls:
    """identify on every selected call of a recording (a :class:`~bnprobe.checks.recorded.Recorded`), each on its
    own recorded inputs only, one call in memory at a time: the search runs on channels spread over the call
    (:data:`SEARCH_VALUES`; channels are independent), and the identified policy is then confirmed on all of them."""
    recorded.calls.require_tensors("identify")
    kernel = outputs_only(recorded.kernel)
    replay = kernel.capabilities().recorded
    results = []
    for c in recorded.calls.calls:
        rec = c.load()
        call = rec.call()
        channels = np.shape(call.x)[1 if rec.layout == "channels_first" else -1]
        per_channel = max(1, np.size(call.x) // max(channels, 1))
        want = min(channels, max(6, SEARCH_VALUES // per_channel))
        idx = np.unique(np.linspace(0, channels - 1, want).round().astype(int))
        sub = _slice_channels(rec, idx)
        k = kernel.bind(sub) if replay else kernel
        obs = [_observe(k, Probe(c.label, sub.call(), f"the recorded call, channels {list(map(int, idx))}"), sub)]
        whole = []
        if len(idx) < channels:
            kw = kernel.bind(rec) if replay else kernel
            whole = [_observe(kw, Probe(c.label, call, "the recorded call, every channel"), rec)]
        res = _identify_observed(k, obs, whole, rec.dtype, rec.params_mode, passes=passes, progress=progress,
                                 label=c.label)
        which = "every channel" if len(idx) == channels else \
            f"channels {', '.join(map(str, idx))} of {channels}, confirmed on every channel"
        res.notes.append(f"searched on the recorded inputs alone ({which}): a recording cannot be probed, so the "
                         "fields its data cannot tell apart are listed")
        res.notes[:0] = [f"{c.label}: {n}" for n in recording_notes(rec)]
        results.append(res)
    return IdentifiedCalls(recorded.calls.source, results)

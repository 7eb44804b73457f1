"""identify for LayerNorm, RMSNorm and GroupNorm: the policy of bnprobe.kernels.norms that reproduces a black-box
kernel of the family bit for bit, searched stage by stage over the family's fields on designed probes and confirmed
on fresh inputs the search never saw.

The space is smaller than BatchNorm's: the choices the family's kernels are known to make (the statistics'
algorithm and its lanes — PyTorch CPU's RowwiseMoments, a two-pass or one-pass variance, Welford, torch.compile's
var_mean; ATen's or inductor's sums for RMSNorm; the inverse root and the format ε is added in; the saved statistics'
format; y's formula, fused or not,
rounded before γ or after; the backward's formula, the threads and the buffers of its dγ/dβ, which product dx fuses):

======== ================================================ ===============================
stage    fields searched                                   pinned by
======== ================================================ ===============================
mean     variance (rowwise, two_pass, naive, welford,      the saved mean (LayerNorm,
         inductor), order, lanes, unroll, variance_fma     GroupNorm)
rsqrt    rsqrt, rstd_format, clamp_var, saved_format       the saved rstd
         (RMSNorm: and its sum's order, lanes)
y        y_formula, fma, cast_point                        y
backward backward_formula, threads, grad_sum_format,       dx, dγ, dβ (from the kernel's own
         dx_fuses                                          saved statistics)
======== ================================================ ===============================

A stage keeps the candidate that reproduces what it pins on every probe, ties kept as fields the probes could not
tell apart; where none does, the stage is where the kernel departs (its best candidate's residual in ULPs and the
probes that show it), and the search goes on from that candidate.  "Reproduced" is said only when every output is
bit for bit on the probes and on the fresh inputs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import outputs_only, params_format
from bnprobe.checks.identify.probes import Score, searched_format
from bnprobe.checks.identify.results import Identified, OutputMatch, Undistinguished, policy_spec, value_text
from bnprobe.core.call import EPS, NORM_NAMES, BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.norms import backward as family_backward
from bnprobe.kernels.norms import forward as family_forward
from bnprobe.kernels.policy import PRESETS, Policy
from bnprobe.numerics.rounding import round_to

__all__ = ["FAMILY_STAGES", "FamilyProbe", "family_probes", "identify_family"]

#: the outputs each stage pins (a stage whose outputs the kernel does not return is searched through y)
FAMILY_STAGES: dict[str, tuple[str, ...]] = {
    "mean": ("saved_mean",),
    "rsqrt": ("saved_rstd",),
    "y": ("y",),
    "backward": ("dx", "dgamma", "dbeta"),
}
#: the thread counts the backward stage tries (LayerNorm's dγ/dβ buffers: one per thread)
THREADS_TRIED = (1, 2, 3, 4, 6, 8)
#: how many of a stage's tied candidates the next stage starts from
TIES_CARRIED = 12
#: what would tell a field's candidates apart, for the fields a run could not distinguish
FAMILY_FIELD_PROBES = {
    "variance": "a large mean over a small spread", "order": "rows whose sums depend on their order",
    "lanes": "rows of lengths that leave tails in every vector width", "variance_fma": "rows with a scalar tail",
    "rsqrt": "var + ε across binades", "rstd_format": "var + ε across binades",
    "clamp_var": "a constant row", "saved_format": "statistics that need more bits than the input's format",
    "y_formula": "a large mean with γ not a power of two", "fma": "a large mean with γ not a power of two",
    "cast_point": "y whose rounding before γ shows",
    "backward_formula": "dy with a mean per row, a large mean in x",
    "threads": "more rows than threads (LayerNorm's dγ/dβ buffers), a single group (GroupNorm), a row of "
                      "32768 values or more (RMSNorm's sums), a single row of 1024 or more (torch.compile's)",
    "grad_sum_format": "a 16-bit input over many rows (dγ/dβ buffers rounded per row)",
    "dx_fuses": "dx that cancels (a large mean over a tiny spread)",
}


@dataclass(frozen=True)
class FamilyProbe:
    """One designed input: its call (x, γ, β, dy and the layer's shape) and what it is made to show."""

    name: str
    call: BNCall
    purpose: str


def family_probes(norm: str, fmt: str, params: str, *, seed: int = 0, eps: float = EPS, groups: int | None = None,
                  fresh: bool = False) -> list[FamilyProbe]:
    """The probes identify drives a ``norm`` kernel with (``fresh``: the confirmation set, another seed and other
    shapes).  Rows of lengths that take every branch of a vectorised row kernel (shorter than a vector, tails in
    every width, several RowwiseMoments chunks), large means over small spreads (the variance, y's formula and dx's
    fusion show), values across binades (the sums' order), more rows than threads (dγ/dβ per thread).  GroupNorm's
    take ``groups`` groups (default 2) of channel counts with and without vector tails, one single-group call, and
    groups of 64 channels (a 16-bit y shows the statistics' last fp32 bit only where it crosses a rounding boundary:
    many channels of their own γ make that likely)."""
    rng = np.random.default_rng([seed, 59, 1 if fresh else 0])
    g = groups or 2
    if norm in ("layer", "rms"):
        shapes = [(9, 777), (12, 45), (5, 3)] if fresh else \
            [(24, 5), (16, 13), (12, 37), (9, 300), (2, 2067), (64, 11)]
        if norm == "rms" and not fresh:  # (ATen splits the sum of one row of 32768 values or more across threads)
            shapes.append((1, 40000))
    else:
        shapes = [(3, 7 * g, 50), (1, 11 * g, 9)] if fresh else \
            [(4, 3 * g, 37), (3, 10 * g, 13), (6, 6 * g, 20), (2, 20 * g, 3), (1, 4 * g, 60), (2, 64 * g, 40)]
    wide = {"fp16": 5, "bf16": 8}.get(fmt, 10)
    out = []
    for i, shape in enumerate(shapes):
        kind = 0 if norm == "group" and i % 2 == 0 else (i % 3 if i < 5 else 0)
        if kind == 0:  # large means over small spreads: cancellation in x − μ, y's formula, dx
            mean = rng.choice([100.0, -300.0, 1000.0])
            z = rng.standard_normal(shape)
            spread = rng.choice([0.01, 0.3, 2.0] if norm != "group" else [0.01, 0.05])
            if norm == "group" and i > 0:  # (a spread under the mean's ulp rounds a 16-bit group to one value:
                # the first probe keeps that — x − μ cancels in dx —, the others show the sums' order)
                spread = max(spread, 6 * float(get_format(fmt).ulp(np.float64(mean))))
            x = mean + z * spread
            purpose = "a large mean over a small spread (the variance, y's formula and dx's fusion show)"
        elif kind == 1:  # values across binades: every sum depends on its order and width
            x = np.where(rng.random(shape) < 0.5, -1.0, 1.0) * 2.0 ** rng.uniform(-wide, wide, shape) + 0.25
            purpose = "values across binades (the sums' order and lanes)"
        else:
            x = rng.standard_normal(shape) * 3.0 + rng.normal(0, 5)
            purpose = "ordinary activations"
        lead = shape if norm in ("layer", "rms") else shape[:2]
        pshape = shape[-1:] if norm in ("layer", "rms") else shape[1:2]
        dy = rng.standard_normal(shape) + rng.normal(0, 1, lead[:1] + (1,) * (len(shape) - 1))
        call = BNCall(x, gamma=rng.uniform(0.3, 3.0, pshape), beta=None if norm == "rms" else rng.normal(0, 1, pshape),
                      dy=dy, eps=eps, dtype=fmt, params=params, norm=norm,
                      groups=g if norm == "group" else None)
        where = "x".join(map(str, shape))
        out.append(FamilyProbe(f"{'fresh/' if fresh else ''}{where}", call, f"{purpose}; shape {where}"))
    return out


@dataclass
class _Observed:
    """The kernel's outputs on one probe, in their formats, and its saved statistics."""

    probe: FamilyProbe
    got: dict[str, np.ndarray]
    formats: dict[str, str]
    saved: Any


def _format_of(a: np.ndarray) -> str:
    return get_format(np.asarray(a).dtype).name


def _observe(kernel: KernelAdapter, probe: FamilyProbe) -> _Observed:
    f = kernel.train(probe.call)
    got = {"y": np.asarray(f.y)}
    if f.saved is not None:
        if f.saved.mean is not None:
            got["saved_mean"] = np.asarray(f.saved.mean)
        got["saved_rstd"] = np.asarray(f.saved.value)
    b = kernel.backward_of(probe.call, f.saved)
    got.update(dx=np.asarray(b.dx), dgamma=np.asarray(b.dgamma))
    if b.dbeta is not None:
        got["dbeta"] = np.asarray(b.dbeta)
    formats = {k: _format_of(v) for k, v in got.items()}
    return _Observed(probe, {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}, formats, f.saved)


class _Emulator:
    """Candidates' outputs on the observed probes, cached per policy and probe."""

    def __init__(self, observed: list[_Observed], fmt: str, pf: str) -> None:
        self.observed, self.fmt, self.pf = observed, fmt, pf
        self.cache: dict[tuple, dict[str, np.ndarray]] = {}
        self.runs = 0

    def outputs(self, policy: Policy, i: int, backward: bool) -> dict[str, np.ndarray]:
        key = (policy, i, backward)
        if key in self.cache:
            return self.cache[key]
        obs = self.observed[i]
        c = obs.probe.call
        sh = NormShape.of(c.norm, np.shape(c.x), c.normalized_shape, c.groups)
        x = round_to(np.asarray(c.x, dtype=np.float64), self.fmt)
        g = round_to(np.asarray(c.gamma, dtype=np.float64).reshape(-1), self.pf)
        b = None if c.beta is None else round_to(np.asarray(c.beta, dtype=np.float64).reshape(-1), self.pf)
        out: dict[str, np.ndarray] = {}
        self.runs += 1
        try:
            f = family_forward(x, g, b, shape=sh, eps=c.eps, policy=policy, keep_arrays=False, counters=False)
            out["y"] = np.asarray(f.y, dtype=np.float64)
            if f.mean is not None:
                out["saved_mean"] = np.asarray(f.mean, dtype=np.float64)
            out["saved_rstd"] = np.asarray(f.rstd, dtype=np.float64)
            if backward:  # from the kernel's own saved statistics
                s = obs.saved
                dy = round_to(np.asarray(c.dy, dtype=np.float64), self.fmt)
                gr = family_backward(dy, x, g, f.mean if s is None else s.mean, f.rstd if s is None else s.value,
                                     shape=sh, policy=policy, keep_arrays=False, counters=False)
                out["dx"] = np.asarray(gr.dx, dtype=np.float64)
                out["dgamma"] = np.asarray(gr.dgamma, dtype=np.float64).reshape(-1)
                if gr.dbeta is not None:
                    out["dbeta"] = np.asarray(gr.dbeta, dtype=np.float64).reshape(-1)
        except BNProbeError:
            out = {}
        self.cache[key] = out
        return out

    def score(self, policy: Policy, outputs: tuple[str, ...], backward: bool) -> dict[str, Score]:
        scores = {k: Score() for k in outputs}
        for i, obs in enumerate(self.observed):
            cand = self.outputs(policy, i, backward)
            for k in outputs:
                if k in obs.got:
                    scores[k].add(obs.got[k].reshape(-1), None if k not in cand else cand[k].reshape(-1),
                                  obs.formats[k])
        return scores


def _spaces(norm: str, fmt: str, pf: str) -> dict[str, Callable[[Policy], Iterator[dict[str, Any]]]]:
    """Each stage's candidates (changes to the current policy; ``pf`` the parameters' format, which the saved
    statistics take unless saved_format says otherwise)."""

    def mean(cur: Policy) -> Iterator[dict[str, Any]]:
        for lanes, fused in itertools.product((8, 16, 4), (False, True)):
            yield {"variance": "rowwise", "lanes": lanes, "variance_fma": fused, "order": "pairwise"}
        for order in ("pairwise", "sequential"):
            yield {"variance": "two_pass", "order": order, "variance_fma": False}
        yield {"variance": "two_pass", "order": "lanes", "lanes": 8, "variance_fma": False}
        yield {"variance": "welford", "lanes": 8, "variance_fma": False, "order": "pairwise"}
        yield {"variance": "naive", "order": "pairwise", "variance_fma": False}
        # Paddle's CPU GroupNorm: one pass, clamped, eight hand-unrolled lanes per channel
        yield {"variance": "naive", "clamp_var": True, "order": "lanes_tail", "lanes": 8, "variance_fma": False}
        # torch.compile's var_mean: two-pass up to 1024 values, its chunked Welford above; AVX-512 vectors, two of
        # them for a 16-bit input widened
        for unroll in (1, 2):
            yield {"variance": "inductor", "order": "inductor", "lanes": 16, "unroll": unroll, "variance_fma": False}

    def rsqrt(cur: Policy) -> Iterator[dict[str, Any]]:
        orders: tuple[dict[str, Any], ...] = ({},)
        if norm == "rms":
            orders = (*({"order": "aten", "lanes": lanes, "threads": t} for lanes in (8, 16)
                        for t in THREADS_TRIED),
                      {"order": "pairwise"}, {"order": "sequential"}, {"order": "vec", "lanes": 8},
                      # (torch.compile's sums: a long row split across its threads)
                      *({"order": "inductor", "lanes": 16, "unroll": u, "threads": t} for u in (1, 2)
                        for t in THREADS_TRIED))
        clamps = (False,) if norm == "rms" else (False, True)
        saved = (None, *(f for f in dict.fromkeys((fmt, "fp32")) if f != pf))
        for o, (r, wide), clamp, s in itertools.product(
                orders, (("sqrt_div", None), ("exact", None), ("sqrt_div", "fp64"), ("exact", "fp64")), clamps,
                saved):
            yield {**o, "rsqrt": r, "rstd_format": wide, "clamp_var": clamp, "saved_format": s}

    def y(cur: Policy) -> Iterator[dict[str, Any]]:
        for formula, fma, cast in itertools.product(("xhat", "affine", "scale"), (False, True),
                                                    ("after_gamma", "before_gamma")):
            yield {"y_formula": formula, "fma": fma, "cast_point": cast}
        if fmt in ("fp16", "bf16"):  # every step in x's format, dividing by σ (MindSpore's CPU LayerNorm)
            yield {"y_formula": "xhat_div", "fma": False, "cast_point": "after_gamma", "compute": fmt,
                   "rsqrt": "sqrt_div", "rstd_format": None}

    def back(cur: Policy) -> Iterator[dict[str, Any]]:
        # (what each layer's torch backward reads: LayerNorm its dγ/dβ buffers' threads and format and dx's fusion;
        # GroupNorm whether it runs on one thread and dx's fusion; RMSNorm its autograd, whose threads, which split
        # only a row of 32768 values or more, its forward's sum showed)
        yield {"backward_formula": "standard", "threads": None, "grad_sum_format": None, "dx_fuses": "x"}
        # torch.compile's decomposition, with its forward's sums (which saved statistics of the input's 16-bit format
        # may not have told apart): its own sums split across the threads it runs on
        for unroll in (1, 2) if cur.order != "inductor" else (cur.unroll,):
            stats = {"order": "inductor", "lanes": 16, "unroll": unroll, **({} if norm == "rms" else
                                                                              {"variance": "inductor"})}
            for t in THREADS_TRIED if norm != "rms" or cur.order != "inductor" else (cur.threads,):
                yield {**stats, "backward_formula": "inductor", "threads": t, "grad_sum_format": None,
                       "dx_fuses": "x"}
        threads = {"layer": THREADS_TRIED, "group": (1, 2), "rms": (cur.threads,)}[norm]
        buffers = dict.fromkeys((fmt, None)) if norm == "layer" else (None,)
        for t, buffer, fuses in itertools.product(threads, buffers, ("x", "dy") if norm != "rms" else ("x",)):
            yield {"backward_formula": "torch", "threads": t, "grad_sum_format": buffer, "dx_fuses": fuses}

    spaces = {"mean": mean, "rsqrt": rsqrt, "y": y, "backward": back}
    if norm == "rms":
        del spaces["mean"]
    return spaces


def _base(fmt: str, params: str) -> Policy:
    return PRESETS[fmt].with_options(name="identified", params=params_format(fmt, params))


def _changed(a: Policy, b: Policy) -> dict[str, Any]:
    return {f.name: getattr(b, f.name) for f in fields(Policy)
            if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)}


def identify_family(adapter: str | KernelAdapter, norm: str, dtype: str | None = None, *, params: str | None = None,
                    seed: int = 0, eps: float | None = None, groups: int | None = None, passes: int = 2,
                    extra: list[BNCall] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Identified:
    """The policy that reproduces the ``norm`` (layer, rms, group) kernel ``adapter`` bit for bit in ``dtype``
    (default fp16) with ``params`` parameters (fp32, or same), searched stage by stage (:data:`FAMILY_STAGES`) on the
    designed probes (``seed``; GroupNorm's with ``groups`` groups) in ``passes`` passes, then confirmed on fresh
    inputs and on the calls ``extra`` (a user's own inputs)."""
    from bnprobe.adapters import get_adapter

    if norm not in ("layer", "rms", "group"):
        raise BNProbeError(f"identify searches LayerNorm, RMSNorm and GroupNorm kernels (--norm layer, rms, group), "
                           f"not {NORM_NAMES.get(norm, norm)}" + (" (InstanceNorm runs BatchNorm's kernel on a "
                                                                  "view: identify it as BatchNorm)"
                                                                  if norm == "instance" else ""))
    kernel = outputs_only(get_adapter(adapter) if isinstance(adapter, str) else adapter)
    caps = kernel.capabilities()
    if norm not in caps.norms:
        raise BNProbeError(f"adapter {kernel.name} does not run {NORM_NAMES[norm]}")
    if "backward" not in caps.modes or "train" not in caps.modes:
        raise BNProbeError(f"identify --norm {norm} runs the kernel's forward and backward: {kernel.name} runs "
                           f"{', '.join(caps.modes)}")
    fmt, params = searched_format(kernel, dtype, params)
    pf = params_format(fmt, params)
    eps = EPS if eps is None else eps
    start = time.perf_counter()
    designed = family_probes(norm, fmt, params, seed=seed, eps=eps, groups=groups)
    confirm = family_probes(norm, fmt, params, seed=seed + 7919, eps=eps, groups=groups, fresh=True)
    confirm += [FamilyProbe(f"input/{i}", c, "your input") for i, c in enumerate(extra or [])]
    observed = [_observe(kernel, p) for p in designed]
    fresh = [_observe(kernel, p) for p in confirm]
    seen = set().union(*(o.got for o in observed))
    narrow = any(o.formats.get("saved_rstd") in ("fp16", "bf16") for o in observed)
    search = _FamilySearch(_Emulator(observed, fmt, pf), _spaces(norm, fmt, pf), seen, narrow, progress)
    policy = search.run(_base(fmt, params), passes)
    checker = _Emulator(fresh, fmt, pf)
    outputs = []
    for stage, outs in FAMILY_STAGES.items():
        for k in outs:
            if k not in seen:
                continue
            s = search.final[k]
            fs = checker.score(policy, (k,), backward=True)[k] if fresh else None
            outputs.append(OutputMatch(k, stage, s.exact, None if fs is None else fs.exact,
                                       s.mismatches + (fs.mismatches if fs else 0), s.elements + (fs.elements if fs
                                                                                                   else 0),
                                       max(s.max_ulps, fs.max_ulps if fs else 0.0)))
    departs = next((st for st in search.stages if not search.stages[st]["exact"]), None)
    if departs is None and any(o.fresh_exact is False for o in outputs):
        departs = next(o.stage for o in outputs if o.fresh_exact is False)
    if departs is not None and all(o.stage != departs for o in outputs):
        # a kernel that returns no statistics (Paddle's, MindSpore's LayerNorm): the mean and rsqrt stages were
        # searched through y, so the departure is told by the first output it shows in
        departs = next((o.stage for o in outputs if not (o.probes_exact and o.fresh_exact is not False)), departs)
    spec = policy_spec(policy)
    res = Identified(adapter=kernel.name, dtype=fmt, params=params, policy=policy.with_options(name=spec), spec=spec,
                     outputs=outputs, undistinguished=search.undistinguished, departs=departs, stages=search.stages,
                     probes=[p.name for p in designed] + [p.name for p in confirm],
                     unobserved=[k for outs in FAMILY_STAGES.values() for k in outs if k not in seen and
                                 not (k == "saved_mean" and norm == "rms") and not (k == "dbeta" and norm == "rms")],
                     evaluations=search.evaluations, seconds=time.perf_counter() - start, norm=norm)
    if departs is not None:
        res.departing_probes = search.departing.get(departs, [])
    res.notes.append(f"{NORM_NAMES[norm]}: searched on {len(designed)} designed probes, confirmed on "
                     f"{len(confirm)} fresh input(s); γ applied as the kernel's adapter hands it (ones where a call "
                     "gives none)")
    return res


class _FamilySearch:
    """The coordinate search over the family's stages: each stage tries its space from each of the candidates the
    stage before left tied (up to :data:`TIES_CARRIED`), so a tie that only a later output can break is broken
    there."""

    def __init__(self, emu: _Emulator, spaces: dict[str, Callable[[Policy], Iterator[dict[str, Any]]]],
                 seen: set[str], narrow_stats: bool, progress: Callable[[int, int], None] | None) -> None:
        self.emu, self.spaces, self.seen, self.progress = emu, spaces, seen, progress
        self.narrow_stats = narrow_stats
        self.evaluations = 0
        self.stages: dict[str, dict[str, Any]] = {}
        self.undistinguished: list[Undistinguished] = []
        self.departing: dict[str, list[str]] = {}
        self.final: dict[str, Score] = {}
        self.alternatives: dict[str, list[dict[str, Any]]] = {}  # per stage, its own fields' tied changes

    def pinned(self, stage: str) -> tuple[str, ...]:
        """The outputs a stage is judged on: its own (the mean stage's also the saved rstd, which the variance's
        choices show in), else y."""
        own = FAMILY_STAGES[stage] + (("saved_rstd",) if stage == "mean" else ())
        return tuple(k for k in own if k in self.seen) or ("y",)

    def tiebreak(self, stage: str) -> tuple[str, ...]:
        """The outputs that order a stage's tied candidates: y where the statistics are saved narrower than
        computed (y, formed from them, shows more), so that the ties carried on are y's likeliest first; dx and dγ
        where the kernel saves none (their backward, from the statistics unrounded, shows what y's rounding hid)."""
        if stage not in ("mean", "rsqrt"):
            return ()
        if "saved_rstd" not in self.seen:
            return tuple(k for k in ("dx", "dgamma") if k in self.seen)
        return ("y",) if self.narrow_stats and "y" in self.seen else ()

    def run(self, start: Policy, passes: int) -> Policy:
        total = passes * sum(len(list(space(start))) for space in self.spaces.values())
        tied = [start]
        for _ in range(passes):
            for stage, space in self.spaces.items():
                tied = self.stage(stage, space, tied, total)
        cur = tied[0]
        everything = tuple(sorted(self.seen))
        self.final = self.emu.score(cur, everything, backward=True)
        exact = all(v.exact for v in self.final.values())
        for stage, alts in self.alternatives.items():  # the ties that reproduce every output with the rest as found
            kept = []
            for a in dict.fromkeys(tuple(sorted(a.items())) for a in alts):
                try:
                    alt = cur.with_options(**dict(a))
                except BNProbeError:
                    continue
                if alt != cur and (not exact or all(v.exact for v in self.emu.score(alt, everything,
                                                                                    backward=True).values())):
                    kept.append(_changed(cur, alt))
            if kept:
                names = tuple(sorted({k for a in kept for k in a}))
                self.undistinguished.append(Undistinguished(
                    stage, names, ", ".join(f"{k}={value_text(getattr(cur, k))}" for k in names),
                    tuple(dict.fromkeys(", ".join(f"{k}={value_text(v)}" for k, v in a.items()) for a in kept)),
                    "; ".join(dict.fromkeys(FAMILY_FIELD_PROBES.get(k, k) for k in names))))
        return cur

    def stage(self, stage: str, space: Callable[[Policy], Iterator[dict[str, Any]]], starts: list[Policy],
              total: int) -> list[Policy]:
        """The stage's candidates that reproduce what it pins (the first the chosen one), or its best alone."""
        outs = self.pinned(stage)
        back = stage == "backward"
        keep = tuple(k for k in ("saved_mean", "saved_rstd", "y") if k in self.seen and k not in outs) \
            if stage in ("y", "backward") else ()
        scored: list[tuple[int, float, Policy, int]] = []
        tried: set[Policy] = set()
        for cur in starts[:TIES_CARRIED]:
            for change in space(cur):
                try:
                    cand = cur.with_options(**change)
                except BNProbeError:
                    continue
                if cand in tried:
                    continue
                tried.add(cand)
                self.evaluations += 1
                if self.progress is not None:
                    self.progress(self.evaluations, total)
                sc = self.emu.score(cand, outs + keep, backward=back)
                tie = self.tiebreak(stage)
                tb = self.emu.score(cand, tie, backward=back or any(k in FAMILY_STAGES["backward"] for k in tie))
                scored.append((sum(v.mismatches for v in sc.values()), max(v.max_ulps for v in sc.values()), cand,
                               sum(v.mismatches for v in tb.values())))
        best = min(scored, key=lambda t: (t[0], t[1]))
        exact = [t[2] for t in sorted((t for t in scored if t[0] == 0), key=lambda t: t[3])]
        chosen = exact[0] if exact else best[2]
        self.stages[stage] = {"pinned_by": list(outs), "candidates": len(scored), "exact": bool(exact),
                              "tied": max(0, len(exact) - 1)}
        if not exact:
            self.departing[stage] = [obs.probe.name for i, obs in enumerate(self.emu.observed)
                                     if self._misses(chosen, i, outs, back)]
        fields_here = {k for cur in starts[:1] for change in space(cur) for k in change}
        self.alternatives[stage] = [d for d in ({k: v for k, v in _changed(chosen, p).items() if k in fields_here}
                                                for p in exact[1:]) if d]
        return exact or [chosen]

    def _misses(self, policy: Policy, i: int, outs: tuple[str, ...], back: bool) -> bool:
        obs, cand = self.emu.observed[i], self.emu.outputs(policy, i, back)
        return any(k in obs.got and (k not in cand or not np.array_equal(obs.got[k].reshape(-1), cand[k].reshape(-1)))
                   for k in outs)

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
input for the modes) — or, given a recording (a :class:`~bnprobe.engine.recorded.Recorded`) in place of the
kernel, only each recorded call's inputs — keeping at every stage the candidates that reproduce what the stage
pins, ties kept as fields the probes could not distinguish.  Where no candidate reproduces a stage, the stage is
named as the one where the kernel departs from the space, with the best candidate's residual in ULPs and the
probes that show it; that candidate is called the closest only when it is close (all but
:data:`~bnprobe.checks.identify.results.CLOSE_SHARE` of the values within
:data:`~bnprobe.checks.identify.results.CLOSE_ULPS`): never a nearest guess called a match.  The identified
policy is then confirmed on fresh inputs the search never saw (another seed, shape and scale).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import outputs_only, params_format
from bnprobe.core.call import EPS, MOMENTUM, BNCall
from bnprobe.engine.cases import Case, dy_of_kind
from bnprobe.engine.recorded import Recorded, check_options, given_to, only_call
from bnprobe.engine.run import each_call, recording_notes
from bnprobe.core.errors import BNProbeError, named
from bnprobe.inputs import SEED
from bnprobe.core.kernel import modes_left_out
from bnprobe.kernels.policy import PRESETS, Policy
from bnprobe.checks.identify.probes import (
    Observed,
    Score,
    emulate,
    observe,
    probe_vectors,
    probes,
    score_outputs,
    searched_format,
)
from bnprobe.checks.identify.results import (
    Identified,
    IdentifiedCalls,
    LayoutResult,
    OutputMatch,
    Undistinguished,
    policy_spec,
    value_text,
)
from bnprobe.checks.identify.space import (
    FIELD_PROBES,
    FORWARD_STAGES,
    MODES_OF,
    OUTPUT_STAGE,
    SPACES,
    STAGE_OUTPUTS,
    STAGES,
    infer_only_space,
    layout_spaces,
    rsqrt_space,
)

__all__ = ["identify"]


# ---- the search -----------------------------------------------------------------------------------------------

def _base(fmt: str, params: str) -> Policy:
    pf = params_format(fmt, params)
    return PRESETS[fmt].with_options(name="identified", params=pf)


#: how many of an earlier stage's ties a later stage tries as alternatives
TIES_TRIED = 12


class _Search:
    """The coordinate search over the stages, on the observed probes."""

    def __init__(self, observed: list[Observed], fmt: str, saved_kind: str, tick: Callable[[], None],
                 first: dict[str, Callable[[Policy, str], Any]] | None = None) -> None:
        """``first``: a search in another layout from the recipe the first layout found — a stage the recipe already
        reproduces is kept as it is, and one it does not tries these candidates (:func:`~.space.layout_spaces`)
        before the stage's whole space."""
        self.observed, self.fmt, self.saved_kind, self.tick = observed, fmt, saved_kind, tick
        self.first = first
        self.evaluations = 0
        self.runs = 0
        self.kept: list[str] = []  # outputs the forward stages so far reproduced, which later stages must keep
        self.infer_kept = False  # whether the infer stage reproduced inference's y, which the backward must keep
        self.ties: dict[str, list[dict[str, Any]]] = {}  # per stage, the changes tied with its choice
        narrow = {"fp16", "bf16"}
        self.narrow_stats = any(o.formats.get("saved_mean") in narrow and fmt in narrow and
                                o.formats.get("saved_mean") != "fp32" for o in observed) and \
            any(o.formats.get("saved_mean") in narrow for o in observed)
        self.cache: dict[tuple, dict[str, np.ndarray]] = {}
        self.trains = any("y" in o.got for o in observed)  # the kernel ran training forwards (not inference-only)

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

    def probes_of(self, stage: str) -> list[Observed]:
        if stage == "modes":
            return self.observed
        return [o for o in self.observed if not o.probe.modes_only]

    def emulated(self, policy: Policy, stage: str, i: int, obs: Observed) -> dict[str, np.ndarray]:
        """The candidate's outputs on one probe (cached per policy, modes and probe)."""
        modes = MODES_OF[stage]
        key = (policy, modes, obs.probe.name, i)  # (a frozen Policy hashes by its fields)
        if key not in self.cache:
            self.runs += 1
            try:
                self.cache[key] = emulate(policy, obs, modes, self.saved_kind)
            except BNProbeError:
                self.cache[key] = {}
        return self.cache[key]

    def evaluate(self, policy: Policy, stage: str, outputs: tuple[str, ...],
                 limit: int | None = None, limit_on: tuple[str, ...] | None = None) -> dict[str, Score]:
        """The candidate's scores on ``outputs`` over the stage's probes; with ``limit``, stop as soon as it has
        more mismatching elements (in ``limit_on``, default all) than that (a search that has a candidate with
        ``limit`` mismatches needs no more of a worse one; its score is then a lower bound, marked by infinite
        ULPs)."""
        limit_on = outputs if limit_on is None else limit_on
        self.evaluations += 1
        self.tick()
        scores = {k: Score() for k in outputs}
        for i, o in enumerate(self.probes_of(stage)):
            s = score_outputs([o], [self.emulated(policy, stage, i, o)], outputs)
            for k in outputs:
                scores[k].mismatches += s[k].mismatches
                scores[k].elements += s[k].elements
                scores[k].max_ulps = max(scores[k].max_ulps, s[k].max_ulps)
            if limit is not None and sum(scores[k].mismatches for k in limit_on) > limit:
                for k in outputs:
                    scores[k].max_ulps = float("inf")
                return scores
        return scores

    def misses(self, policy: Policy, stage: str, outputs: tuple[str, ...]) -> bool:
        """Whether a candidate already evaluated misses any of ``outputs`` on the stage's probes (a re-check of
        it in another stage's modes, not counted as a candidate evaluation)."""
        return any(v.mismatches for i, o in enumerate(self.probes_of(stage))
                   for v in score_outputs([o], [self.emulated(policy, stage, i, o)], outputs).values())

    def break_ties(self, stage: str, outputs: tuple[str, ...], ties: list[tuple]) -> list[tuple]:
        """Tied candidates of a stage told apart, where they can be, on the subnormal and huge probes (which only
        the modes stage searches): a prescaled sum that does not overflow, a flush that shows."""
        extra = [o for o in self.observed if o.probe.modes_only]
        if len(ties) < 2 or stage == "modes" or not extra:
            return ties
        keyed = []
        for t in ties:
            n = sum(score_outputs([o], [self.emulated(t[1], "modes", i, o)], outputs)[k].mismatches
                    for i, o in enumerate(self.observed) if o.probe.modes_only for k in outputs)
            keyed.append((n, t))
        low = min(n for n, _ in keyed)
        return [t for n, t in keyed if n == low]

    def rounds(self, stage: str) -> list[Callable[[Policy, str], Any]]:
        """The spaces a stage tries in turn until one reproduces it: its own, or in another layout's search the
        layout's candidates first."""
        if self.first is not None and stage in self.first:
            return [self.first[stage], SPACES[stage]]
        return [SPACES[stage]]

    def space(self, cur: Policy, stage: str, own: tuple[str, ...],
              stage_space: Callable[[Policy, str], Any] | None = None) -> list[dict[str, Any]]:
        """The candidates of ``stage`` from ``cur`` (each a dict of changes; ``stage_space``: the stage's own, default
        :data:`~.space.SPACES`'), with the earlier stages' ties where the stage can tell them apart."""
        if stage == "infer" and not self.trains:  # (nothing earlier pinned the arithmetic it shares)
            return list(infer_only_space(cur, self.fmt))
        space = list((stage_space or SPACES[stage])(cur, self.fmt))
        if stage == "y" and self.outputs_of("rsqrt") == ("y",):  # rsqrt seen only through y: searched with it
            # (the rsqrt stage's own choice and its ties, and the exact forms: the joint space stays small)
            joint = [{}] + self.ties.get("rsqrt", [])[:TIES_TRIED] + [r for r in rsqrt_space(cur, self.fmt)
                                                                      if r["rsqrt"] in ("exact", "sqrt_div")
                                                                      and r["division"] == "exact"]
            space = [{**r, **c} for r in joint for c in space]
        if stage == "variance" or stage == "rsqrt" and own[0] != "y":  # the earlier statistics' ties (an order
            # the mean could not tell apart shows in the sum of squares), kept exact by the scoring; (an rsqrt seen
            # only through y is searched with y's formula instead)
            earlier = ("mean",) if stage == "variance" else ("mean", "variance")
            alts = [{}] + [t for st in earlier for t in self.ties.get(st, [])[:TIES_TRIED]]
            space = [{**alt, **c} for alt in alts for c in space]
        if stage == "running" and (self.narrow_stats or self.outputs_of("mean") == ("y",)):
            # (the running statistics read the batch statistics unrounded: the mean stage's ties, which statistics
            # saved in a 16-bit format could not tell apart, are told apart here — inductor's Welford above 1024
            # values from a two-pass variance, in bf16; and for a kernel that returns no statistics, the variance
            # stage's too, which y, formed from them and rounded, may hide — Keras in bf16)
            earlier = ("mean",) if self.narrow_stats else ("mean", "variance")
            alts = [{}] + [t for st in earlier for t in self.ties.get(st, [])[:TIES_TRIED]]
            space = [{**alt, **c} for alt in alts for c in space]
        if stage in ("infer", "backward"):
            # the earlier stages' ties reproduced the training forward (y in fp16 hides the compute format, an FMA, a
            # division...); inference and the backward, which compute with them, may tell them apart
            alts = [{}] + [t for st in ("rsqrt", "y") for t in self.ties.get(st, [])[:TIES_TRIED]]
            # (and one tie of each y formula past those: a 16-bit y may hide the formula inference then shows; and of
            # each rsqrt method: a 16-bit y may hide an estimate the backward then shows — Keras's rsqrtps, in bf16)
            alts += _one_of_each(self.ties.get("y", [])[TIES_TRIED:], alts, ("y_formula",))
            alts += _one_of_each(self.ties.get("rsqrt", [])[TIES_TRIED:], alts, ("rsqrt", "newton_form"))
            if stage == "infer":  # (inference forms its own rstd: every rsqrt the training forward allows)
                alts += [{**r, "rstd_format": cur.rstd_format} for r in rsqrt_space(cur, self.fmt)]
            space = [{**alt, **c} for alt in alts for c in space]
        return space

    def stage(self, cur: Policy, stage: str) -> tuple[Policy, dict[str, Any], list[dict[str, Any]]]:
        """The best candidate of ``stage`` from ``cur``; its summary; the changes of the candidates tied with it.
        A forward stage is scored on what the forward stages before it reproduced too, so a later choice never
        undoes an earlier match (the variance's division by R must keep the mean that pinned it)."""
        own = self.outputs_of(stage)
        if not own:
            return cur, {"pinned_by": [], "exact": None, "candidates": 0}, []
        kept = tuple(k for k in self.kept if k not in own) if stage in FORWARD_STAGES and stage != "modes" else ()
        outputs = own + kept

        # y appended to a narrow statistic's stage breaks its ties (secondary); the rest must be reproduced first
        secondary = ("y",) if stage not in ("y", "modes") and len(own) > 1 and own[-1] == "y" else ()
        primary = tuple(k for k in outputs if k not in secondary)

        def total(s: dict[str, Score]) -> Score:
            return Score(sum(v.mismatches for v in s.values()), sum(v.elements for v in s.values()),
                          max(v.max_ulps for v in s.values()))

        def key(s: dict[str, Score]) -> tuple[int, int, float]:
            return (sum(s[k].mismatches for k in primary), sum(s[k].mismatches for k in secondary),
                    max(v.max_ulps for v in s.values()))

        # the current policy competes too: a stage never makes the match worse
        here_s = self.evaluate(cur, stage, outputs)
        here, best_key = total(here_s), key(here_s)
        best = here
        scored = []
        if self.first is not None and here.exact and stage not in self.first:
            # (another layout: what the first's recipe reproduces stays, but for the layout's own fields: a sum that
            # happens to be exact in the first's order may still be split across threads, as its variance shows)
            self.kept.extend(k for k in own if k not in self.kept and stage in FORWARD_STAGES and stage != "modes")
            self.ties[stage] = []
            return cur, {"pinned_by": list(own), "exact": True, "mismatches": 0, "elements": here.elements,
                         "max_ulps": 0.0, "candidates": 0, "tied": 0}, []
        forward = tuple(dict.fromkeys(self.kept + ["y"])) if stage in ("infer", "backward") and \
            "y" in self.outputs_of("y") else ()
        tried: set[Policy] = set()  # (another layout: the candidates its first round tried)
        for n, stage_space in enumerate(self.rounds(stage)):
            if n and best.exact:  # (the layout's candidates reproduced it: no need for the rest)
                break
            own_fields = {k for c in stage_space(cur, self.fmt) for k in c}
            for changes in self.space(cur, stage, own, stage_space):
                try:
                    cand = cur.with_options(**changes)
                except BNProbeError:  # (a combination the space does not allow, e.g. Kahan on a pairwise tree)
                    continue
                if self.first is not None:
                    if cand in tried and n:
                        continue
                    tried.add(cand)
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
        # else the simplest of them (fewest fields away from the format's preset); the backward's ties that keep the
        # inference the infer stage reproduced first (an earlier stage's tie can change how inference forms its rstd)
        keeps_infer = stage == "backward" and self.infer_kept and len(ties) > 1
        ties.sort(key=lambda t: (t[1] is not cur, keeps_infer and self.misses(t[1], "infer", ("y_infer",)),
                                 _complexity(t[1]), _mode_specific(t[1])))
        chosen, best = ties[0][1], ties[0][2]
        ties = [t for t in ties if t[1] is not cur]
        if stage in FORWARD_STAGES and stage != "modes" and best.exact:
            self.kept.extend(k for k in own if k not in self.kept)
        if stage == "infer":
            self.infer_kept = bool(best.exact)
        summary = {"pinned_by": list(own), "exact": best.exact, "mismatches": best.mismatches,
                   "elements": best.elements, "max_ulps": best.max_ulps, "candidates": len(scored),
                   "tied": len(ties)}
        self.ties[stage] = [c for c, _, _ in ties]
        return chosen, summary, self.ties[stage]


def _one_of_each(ties: list[dict[str, Any]], have: list[dict[str, Any]],
                 fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Of ``ties``, the first of each value of ``fields`` that ``have`` (and the ones taken before it) do not hold."""
    seen = {tuple(t.get(f) for f in fields) for t in have}
    out = []
    for t in ties:
        if (v := tuple(t.get(f) for f in fields)) not in seen:
            seen.add(v)
            out.append(t)
    return out


def _rescore(search: _Search, policy: Policy, stages: dict[str, dict[str, Any]]) -> None:
    """A stage pinned by an output a later stage of the last pass settled (y, for a kernel that returns no
    statistics: the mean and variance are searched before the rsqrt that y needs) scored again with the policy
    found: its summary says exact when that policy reproduces what pins it."""
    for st in FORWARD_STAGES:
        summary = stages.get(st, {})
        pinned = tuple(summary.get("pinned_by") or ())
        if summary.get("exact") is False and pinned:
            again = search.evaluate(policy, st, pinned)
            if all(v.exact for v in again.values()):
                summary.update(exact=True, mismatches=0, max_ulps=0.0)


def _complexity(policy: Policy) -> int:
    """How many fields a policy sets away from its format's preset (the simplest explanation is preferred)."""
    base = PRESETS.get(policy.storage)
    return 0 if base is None else sum(getattr(policy, f.name) != getattr(base, f.name) for f in fields(Policy)
                                      if f.name not in ("name", "params"))


def _mode_specific(policy: Policy) -> int:
    """How many of inference's own choices a policy sets (among equally simple ties, a kernel that computes both
    modes alike is preferred: a 16-bit y may hide the training formula that inference then shows)."""
    return sum(getattr(policy, f) is not None for f in ("infer_y_formula", "infer_rsqrt"))


def _undistinguished(stage: str, chosen: Policy, ties: list[dict[str, Any]]) -> Undistinguished | None:
    """The stage's tied candidates as alternatives to the chosen policy (None when there are none)."""
    alts, names = [], []
    for t in ties:
        diff = {k: v for k, v in t.items() if v != getattr(chosen, k)}
        if stage == "backward" and not {"backward_formula", "backward_fma", "backward_sums", "dx_fma", "lanes",
                                        "unroll"} & set(diff):
            continue  # (a tie of the y stage's, listed there)
        if diff:
            alts.append(",".join(f"{k}={value_text(v)}" for k, v in diff.items()))
            names.extend(k for k in diff if k not in names)
    if not alts:
        return None
    # (lanes and unroll beside dx_fma are where a channels-last row's vector body ends, not a summation order)
    told = [n for n in names if not ("dx_fma" in names and n in ("lanes", "unroll"))]
    hint = "; ".join(dict.fromkeys(FIELD_PROBES.get(n, "another probe") for n in told))
    return Undistinguished(stage, tuple(names), ",".join(f"{n}={value_text(getattr(chosen, n))}" for n in names),
                           tuple(dict.fromkeys(alts)), hint)


def _nondeterministic(kernel: KernelAdapter, first: Observed) -> list[str]:
    """The outputs that differ when the first probe is run again (a nondeterministic kernel: a finding)."""
    again = observe(kernel, first.probe, first.rec)
    return [k for k, v in first.got.items() if k in again.got and not
            np.array_equal(v, again.got[k], equal_nan=True)]


def _identify_observed(kernel: KernelAdapter, observed: list[Observed], fresh: list[Observed], fmt: str,
                       params: str, *, passes: int, progress: Callable[[int, int], None] | None,
                       label: str = "", start: Policy | None = None) -> Identified:
    """The search on ``observed``, confirmed on ``fresh`` (``start``: the recipe another layout's search found, from
    which a search in the observed layout starts: :func:`~.space.layout_spaces`)."""
    t0 = time.perf_counter()
    saved_kind = next((o.saved.kind for o in observed if o.saved is not None), "invstd")
    total_guess = 400
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(min(done[0], total_guess - 1), total_guess)

    first = None if start is None else layout_spaces(kernel.capabilities().threads)
    search = _Search(observed, fmt, saved_kind, tick, first)
    cur = _base(fmt, params) if start is None else start
    # the format the kernel returns its saved statistics in is read off its outputs, not searched (inductor on the
    # CPU: the input's, whatever the parameters')
    saved_fmt = next((o.formats["saved_mean"] for o in observed if o.formats.get("saved_mean")), None)
    if saved_fmt is not None and saved_fmt != cur.params_format and saved_fmt in ("fp64", "fp32", "fp16", "bf16"):
        cur = cur.with_options(saved_format=saved_fmt)
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
    _rescore(search, policy, stages)

    def equivalent(changes: dict[str, Any]) -> bool:
        """Whether the policy with ``changes`` reproduces every output as well as the one chosen (a tie of one
        stage that a later stage told apart is not an alternative)."""
        try:
            cand = policy.with_options(**changes)
        except BNProbeError:
            return False
        for st, outs in by_stage.items():
            if outs:  # (a candidate with more mismatches than the chosen one is not equivalent: stop there)
                got = search.evaluate(cand, st, outs, limit=sum(mine[st][k].mismatches for k in outs))
                if any(got[k].mismatches != mine[st][k].mismatches for k in outs):
                    return False
        return True

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
    notes = _notes(nondet, stages, seen)
    compiling = getattr(kernel, "compile_seconds", None)  # a compiling adapter's own account (torch-compile)
    if compiling:
        notes.append(f"besides identify's {time.perf_counter() - t0:.1f} s, the kernel's compiler took "
                     f"{compiling:.1f} s ({getattr(kernel, 'compiles', '?')} compiles: one per probe shape and format)")
    if progress is not None:
        progress(total_guess, total_guess)
    return Identified(kernel.name, fmt, params, policy, spec, outputs, undist, departs, stages,
                      [o.probe.name for o in observed], unobserved, search.evaluations, time.perf_counter() - t0,
                      nondet, notes, label, {k: LayoutResult(k, v) for k, v in layouts.items()},
                      _showing(search, policy, departs, by_stage))


def _showing(search: _Search, policy: Policy, departs: str | None, by_stage: dict[str, tuple[str, ...]]) -> list[str]:
    """The search's probes on which the policy found misses the departing stage's outputs."""
    outs = by_stage.get(departs or "", ())
    if not outs:
        return []
    return list(dict.fromkeys(o.probe.name for i, o in enumerate(search.probes_of(departs))
                              if any(v.mismatches for v in score_outputs(
                                  [o], [search.emulated(policy, departs, i, o)], outs).values())))


def _confirm(policy: Policy, fresh: list[Observed], saved_kind: str, seen: tuple[str, ...],
             layout: str = "channels_first") -> tuple[dict[str, Score], dict[str, list[str]]]:
    """The identified policy on the fresh inputs: the scores per output of those in the search's ``layout``, and per
    other layout the outputs it does not reproduce."""
    fresh_scores: dict[str, Score] = {}
    layouts: dict[str, list[str]] = {}
    first = [o for o in fresh if o.rec.layout == layout]
    if first:
        cand = [emulate(policy, o, ("train", "infer", "backward"), saved_kind) for o in first]
        fresh_scores = score_outputs(first, cand, seen)
    for o in fresh:
        if o.rec.layout != layout:
            s = score_outputs([o], [emulate(policy, o, ("train", "infer", "backward"), saved_kind)], seen)
            off = layouts.setdefault(o.rec.layout, [])
            off.extend(k for k, v in s.items() if v.elements and not v.exact and k not in off)
    return fresh_scores, layouts


def _matches(seen: list[str], found: dict[str, dict[str, Score]],
             fresh_scores: dict[str, Score]) -> list[OutputMatch]:
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


def _notes(nondet: list[str], stages: dict[str, dict[str, Any]], seen: list[str]) -> list[str]:
    """What the result's reader must know: nondeterminism, stages seen only through y."""
    notes = []
    if nondet:
        notes.append(f"nondeterministic: the same probe run twice gave different {', '.join(nondet)} (a reduction "
                     "whose order changes from call to call, such as atomic adds): no policy reproduces it bit for "
                     "bit")
    for st in ("mean", "variance", "rsqrt"):
        if stages.get(st, {}).get("pinned_by") == ["y"]:
            what = "saves the variance, not invstd" if "saved_var" in seen else "returns no saved statistics"
            notes.append(f"the kernel {what}: the {st} stage was searched through y alone")
    return notes


def identify(adapter: str | KernelAdapter | Recorded, dtype: str | None = None, *, params: str | None = None,
             x: np.ndarray | None = None, seed: int | None = None, eps: float | None = None,
             momentum: float | None = MOMENTUM, passes: int | None = None, fresh: bool = True,
             progress: Callable[[int, int], None] | None = None) -> Identified | IdentifiedCalls:
    """The policy that reproduces ``adapter`` bit for bit in ``dtype`` (default fp16) with ``params`` parameters
    (fp32, the default, or same), searched stage by stage on designed probes (``seed``, default 0; ``eps``, default
    1e-5; ``passes`` over the stages, default 2), then confirmed on fresh inputs (``fresh``) and on ``x`` (the user's
    input, channels-first, when given).  Its ``spec`` runs as ``emulated:<spec>``.

    Given a recording (a :class:`~bnprobe.engine.recorded.Recorded`) in place of the kernel, every selected call of
    it is identified on its own recorded inputs alone (``passes`` default 3): an
    :class:`~bnprobe.checks.identify.results.IdentifiedCalls` of one result per call.  A dump adapter of one call
    is identified on its recorded inputs (its one result).  On a recording ``x``, ``seed``, ``eps`` and
    ``momentum`` contradict it, and ``dtype`` and ``params`` must agree."""

    a, recorded = given_to(adapter)
    if recorded is not None:
        off = (("x", x is not None), ("seed", seed not in (None, SEED)), ("eps", eps not in (None, EPS)),
               ("momentum", momentum != MOMENTUM))
        check_options(recorded, given=tuple(named(n) for n, v in off if v), dtype=dtype, params=params)
        if recorded is not adapter:
            only_call(recorded, "identify")
        run = _identify_calls(recorded, passes=3 if passes is None else passes, progress=progress)
        return run if recorded is adapter else run.results[0]
    seed, eps = SEED if seed is None else seed, EPS if eps is None else eps
    kernel = outputs_only(a)
    caps = kernel.capabilities()
    fmt, params = searched_format(kernel, dtype, params)
    passes = 2 if passes is None else passes
    layouts = tuple(caps.layouts)
    observe_all = _observer(kernel, caps)
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
        confirm.insert(0, Case("input", call=BNCall(xa, dy=dy_of_kind("shifted", xa.shape, seed), eps=eps,
                                                    momentum=momentum, dtype=fmt, params=params,
                                                    **probe_vectors(rng, xa.shape[1])), purpose="your input"))

    observed, confirmed = observe_all(designed), observe_all(confirm)
    res = _identify_observed(kernel, observed, confirmed, fmt, params, passes=passes, progress=progress)
    untold, shown = _untold(res, confirmed, observe_all) if fresh and not res.nondeterministic else ([], [])
    if untold:
        # the search's probes could not tell apart what the fresh inputs did: they join the search, and another
        # fresh set, never seen, confirms
        again = observe_all(probes(fmt, params, seed=seed + 2 * 7919, eps=eps, momentum=momentum, layouts=layouts,
                                   fresh=True))
        first = res
        res = _identify_observed(kernel, observed + untold,
                                 again + [o for o in confirmed if o.rec.layout != "channels_first"], fmt, params,
                                 passes=passes, progress=progress)
        res.evaluations += first.evaluations
        res.seconds += first.seconds
        res.notes.append(f"the first search's probes did not tell apart what fresh inputs showed in "
                         f"{', '.join(shown)}: those inputs joined the search, and a second fresh set checked the "
                         "recipe it found")
        confirmed = confirmed + again

    def designed_in(layout: str) -> list[Case]:
        return [p for p in probes(fmt, params, seed=seed, eps=eps, momentum=momentum, layout=layout)
                if caps.saved != "none" or p.name != "tiny-r"]

    _other_layouts(kernel, res, confirmed, observe_all, designed_in, passes=passes, progress=progress)
    if (left_out := modes_left_out(kernel.name, caps.modes, verb="identified")) is not None:
        res.notes.insert(0, left_out)  # (an inference-only kernel: its training and backward, by name)
    return res


def _untold(res: Identified, confirmed: list[Observed],
            observe_all: Callable[[list[Case]], list[Observed]]) -> tuple[list[Observed], list[str]]:
    """The fresh inputs ``confirmed`` that ``res``'s recipe misses where the search's probes did not tell its
    candidates apart, in channels_first, and the outputs they showed: those in the searched layout, and those of
    another layout that the kernel computes as the searched one (moved there, so they join the search as such)."""
    shown = [o.output for o in res.outputs if o.probes_exact and o.fresh_exact is False]
    untold = [o for o in confirmed if o.rec.layout == "channels_first"] if shown else []
    for lay, other in res.layouts.items():
        moved = _layout_blind(observe_all, [o for o in confirmed if o.rec.layout == lay], "channels_first") \
            if other.off else None
        missed = _missed(res, moved) if moved is not None else []
        if missed:
            untold += moved
            shown += [k for k in missed if k not in shown]
    return untold, shown


def _other_layouts(kernel: KernelAdapter, res: Identified, confirmed: list[Observed],
                   observe_all: Callable[[list[Case]], list[Observed]], designed_in: Callable[[str], list[Case]], *,
                   passes: int, progress: Callable[[int, int], None] | None) -> None:
    """Each other layout the fresh inputs ``confirmed`` hold, where ``res``'s recipe misses them: the same misses in
    the searched layout (the kernel's outputs are the same, moved), or a search of its own on the probes
    ``designed_in`` it, from that recipe — said in ``res``'s layouts and notes."""
    for lay, other in res.layouts.items():
        fresh_here = [o for o in confirmed if o.rec.layout == lay]
        moved = _layout_blind(observe_all, fresh_here, "channels_first") if other.off else None
        if moved is not None:
            other.same = True  # (the kernel computes the layout as the searched one: no search of the layout)
            other.as_searched = not _missed(res, moved)
        elif other.off and not res.nondeterministic:  # (computed another way: searched there on its own)
            other.own = _identify_observed(kernel, observe_all(designed_in(lay)), fresh_here, res.dtype, res.params,
                                           passes=passes, progress=progress, start=res.policy)
            res.evaluations += other.own.evaluations
            res.seconds += other.own.seconds
        res.notes.append(_layout_note(res, other))


def _layout_blind(observe_all: Callable[[list[Case]], list[Observed]], there: list[Observed],
                  layout: str) -> list[Observed] | None:
    """The kernel on the inputs ``there`` moved to ``layout`` when it returns the same outputs there, bit for bit (a
    kernel whose layouts compute alike), else None."""
    if not there:
        return None
    moved = observe_all([Case(o.probe.name, call=_moved(o.probe.call, layout), purpose=o.probe.purpose)
                         for o in there])
    for o, m in zip(there, moved):
        for k, v in o.got.items():
            w = m.got.get(k)
            if w is None or not np.array_equal(v, _moved_array(w, layout, o.rec.layout), equal_nan=True):
                return None
    return moved


def _missed(res: Identified, observed: list[Observed]) -> list[str]:
    """The outputs of ``observed`` (inputs in the searched layout) that ``res``'s recipe does not reproduce bit for
    bit."""
    kind = next((o.saved.kind for o in observed if o.saved is not None), "invstd")
    cand = [emulate(res.policy, o, ("train", "infer", "backward"), kind) for o in observed]
    seen = tuple(dict.fromkeys(k for o in observed for k in o.got))
    return [k for k, s in score_outputs(observed, cand, seen).items() if s.elements and not s.exact]


def _moved(call: BNCall, layout: str) -> BNCall:
    """The call with x and dy in ``layout`` (channels first: (N, C, ...), channels last: (N, ..., C))."""
    return call.with_(x=_moved_array(call.x, call.layout, layout), dy=None if call.dy is None else
                      _moved_array(call.dy, call.layout, layout), layout=layout)


def _moved_array(a: np.ndarray, src: str, dst: str) -> np.ndarray:
    a = np.asarray(a)
    if src == dst or a.ndim <= 2:
        return a
    return np.ascontiguousarray(np.moveaxis(a, 1, -1) if dst == "channels_last" else np.moveaxis(a, -1, 1))


def _layout_note(res: Identified, other: LayoutResult) -> str:
    """What identify found in another layout than the one it searched, in words."""
    if not other.off:
        return f"{other.layout}: reproduced bit for bit too"
    if other.same and other.as_searched:
        return (f"{other.layout}: the kernel returns the same outputs in both layouts (it computes this one as "
                "channels_first), and the recipe above reproduces them bit for bit on the inputs in channels_first; "
                f"bnprobe's own {other.layout} run of the recipe sums in that layout's order, which this kernel does "
                "not use")
    if other.same:
        return (f"{other.layout}: the kernel returns the same outputs in both layouts on its fresh inputs, and the "
                f"recipe above does not reproduce {', '.join(other.off)} there — inputs the search's probes did not "
                "tell apart, not a layout of its own")
    head = (f"{other.layout}: the kernel computes this layout another way ({', '.join(other.off)} not reproduced by "
            "the recipe above)")
    own = other.own
    if own is None:
        return head
    changed = ", ".join(f"{f.name}={value_text(getattr(own.policy, f.name))}" for f in fields(Policy)
                        if f.name != "name" and getattr(own.policy, f.name) != getattr(res.policy, f.name))
    found = (f"its own search from that recipe, on the same probes in this layout and a batch of two "
             f"({own.evaluations} evaluations, {own.seconds:.1f} s), ")
    if own.reproduced:
        return f"{head}; {found}found emulated:{own.spec} bit for bit, fresh inputs too (changed: {changed})"
    return f"{head}; {found}{own.found()}"


def _observer(kernel: KernelAdapter, caps: Any) -> Callable[[list[Case]], list[Observed]]:
    """What runs the probes on ``kernel``: each probe's call in the modes the kernel has (an inference-only kernel,
    a deployment runtime, is searched on its inference alone)."""
    from bnprobe.engine.run import generated_call

    modes = tuple(m for m in ("train", "infer", "backward") if m in caps.modes and (m != "backward" or
                                                                                   "train" in caps.modes))
    if "infer" not in modes and "train" not in modes:
        raise BNProbeError(f"identify: {kernel.name} runs neither a training nor an inference forward")

    def observe_all(ps: list[Case]) -> list[Observed]:
        out = []
        for p in ps:
            if p.modes_only and "train" not in modes:
                continue  # (the modes stage reads training outputs)
            try:
                out.append(observe(kernel, p, generated_call(p.call, modes=modes, label=p.name)))
            except BNProbeError as exc:
                if p.modes_only:  # (a kernel may refuse subnormal or huge input: the modes stay unidentified)
                    continue
                raise BNProbeError(f"identify: {kernel.name} refused the probe {p.name}: {exc.template}") from None
        return out

    return observe_all


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


def _identify_calls(recorded: Recorded, *, passes: int, progress: Callable[[int, int], None] | None
                    ) -> IdentifiedCalls:
    """identify on every selected call of a recording, each on its own recorded inputs only, one call in memory at
    a time (:func:`_identify_call`)."""
    recorded.calls.require_tensors("identify")
    kernel = outputs_only(recorded.kernel)
    results = each_call(recorded, lambda _, c, rec: _identify_call(kernel, c, rec, passes, progress))
    return IdentifiedCalls(recorded.calls.source, results)


def _identify_call(kernel: KernelAdapter, c: Any, rec: Any, passes: int,
                   progress: Callable[[int, int], None] | None) -> Identified:
    """identify on one recorded call (``c``, read as ``rec``), on its own inputs only: the search runs on channels
    spread over the call (:data:`SEARCH_VALUES`; channels are independent), and the identified policy is then
    confirmed on all of them."""
    replay = kernel.capabilities().recorded
    call = rec.call()
    channels = np.shape(call.x)[1 if rec.layout == "channels_first" else -1]
    per_channel = max(1, np.size(call.x) // max(channels, 1))
    want = min(channels, max(6, SEARCH_VALUES // per_channel))
    idx = np.unique(np.linspace(0, channels - 1, want).round().astype(int))
    sub = _slice_channels(rec, idx)
    k = kernel.bind(sub) if replay else kernel
    obs = [observe(k, Case(c.label, call=sub.call(), purpose=f"the recorded call, channels {list(map(int, idx))}"),
                   sub)]
    whole = []
    if len(idx) < channels:
        kw = kernel.bind(rec) if replay else kernel
        whole = [observe(kw, Case(c.label, call=call, purpose="the recorded call, every channel"), rec)]
    res = _identify_observed(k, obs, whole, rec.dtype, rec.params_mode, passes=passes, progress=progress,
                             label=c.label)
    which = "every channel" if len(idx) == channels else \
        f"channels {', '.join(map(str, idx))} of {channels}, confirmed on every channel"
    res.notes.append(f"searched on the recorded inputs alone ({which}): a recording cannot be probed, so the "
                     "fields its data cannot tell apart are listed")
    res.notes[:0] = recording_notes(rec)  # (the report names the call)
    if not replay and (left_out := modes_left_out(kernel.name, kernel.capabilities().modes, rec.modes,
                                                  verb="identified")) is not None:
        res.notes.insert(0, left_out)
    return res

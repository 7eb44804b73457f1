"""doctor's judgement of one group of outputs on one input against the FP64 golden and the bug models
(:class:`Check`, :func:`judge_group`), and of every input together: the checklist's items and the diagnosis
(:func:`checklist_items`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bnprobe.checks.doctor.bugs import (
    BUGS, CHECKS, CONVENTION_HINTS, GROUPS, RECIPES, Outputs, describe,
    running_item,
)
from bnprobe.engine.run import CallRun
from bnprobe.engine.rules import beyond_format, channel_rule
from bnprobe.core.formats import get_format
from bnprobe.guard import MODEL_CACHE_BYTES  # the bug models' outputs kept on one input (_Outputs.model)
from bnprobe.kernels.layout import reduce_axes
from bnprobe.checks.doctor.report import Item

__all__ = ["BugModels", "Check", "judge_group", "checklist_items", "returned_format", "output_scales"]


# ---- comparing one group of outputs -------------------------------------------------------------------

@dataclass
class _Outputs:
    """One input's outputs (channels-first): the kernel's, the golden's, and the bug models' on the same inputs,
    each model computed when first asked for."""

    name: str
    got: dict[str, np.ndarray]
    gold: dict[str, np.ndarray]
    formats: dict[str, str]
    natural: dict[str, np.ndarray]
    models: Callable[[str | None, str | None], dict[str, np.ndarray]] | None  # (bug, recipe): the model's outputs
    stored: Callable[[str | None], dict[str, np.ndarray]] | None = None  # backward from the kernel's statistics
    skip: tuple[str, ...] = ()
    bounds: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # a correct accumulation's, per channel
    checks: dict[str, Check] = field(default_factory=dict)  # the groups judged on this input
    convention: str = "torch"  # the kernel's (bnprobe.core.conventions): the bug models' words are relative to it
    _cache: dict[tuple[str | None, bool, str | None], dict[str, np.ndarray]] = field(default_factory=dict)

    def model(self, bug: str | None, stored: bool = False, recipe: str | None = None) -> dict[str, np.ndarray]:
        """The outputs of the model of ``bug`` (on ``recipe``; ``stored``: the backward from the kernel's stored
        statistics), kept for the next question while the models kept hold at most MODEL_CACHE_BYTES (on a
        9.4 M-value call each model is 0.3 GB: keeping all of them took doctor to 7.5 GB)."""
        key = (bug, stored, recipe)
        if key in self._cache:
            self._cache[key] = self._cache.pop(key)  # most recently used last
            return self._cache[key]
        with np.errstate(all="ignore"):
            out = self.stored(bug) if stored else self.models(bug, recipe)  # type: ignore[misc, arg-type]
        self._cache[key] = out
        while len(self._cache) > 1 and sum(map(_held_bytes, self._cache.values())) > MODEL_CACHE_BYTES:
            del self._cache[next(iter(self._cache))]
        return out

    def distance(self, keys: tuple[str, ...], want: dict[str, np.ndarray], describe: bool = False,
                 got: dict[str, np.ndarray] | None = None) -> tuple[float, list[str]]:
        """The worst of the outputs ``keys`` against ``want`` (see :func:`~bnprobe.engine.rules.channel_rule`), and
        what is wrong."""
        worst, wrong = 0.0, []
        for k in keys:
            r, why = channel_rule(k, (got or self.got)[k], want[k], self.natural.get(k), self.formats[k], describe,
                                  self.bounds.get(k))
            worst = max(worst, r)
            if why:
                wrong.append(why)
        return worst, wrong


def _held_bytes(m: Mapping[str, np.ndarray]) -> int:
    """The bytes a model's outputs hold: those formed so far (:class:`~bnprobe.checks.doctor.bugs.Outputs`), or all."""
    return m.held_bytes() if isinstance(m, Outputs) else sum(np.asarray(a).nbytes for a in m.values())


@dataclass
class Check:
    """One group of outputs on one input: how far from the golden, and (asked) how far from each bug model."""

    group: str
    input: str
    ratio: float  # worst error / allowed over the group's outputs (<= 1 passes)
    formats: str
    wrong: list[str] = field(default_factory=list)  # per failing output, what is wrong, torch.testing style
    keys: tuple[str, ...] = ()
    beyond: list[str] = field(default_factory=list)  # outputs whose exact value the format cannot hold
    outputs: _Outputs | None = field(default=None, repr=False)
    from_stored: bool = False  # judged against the backward of the statistics as stored (closer than the FP64 one)
    causes: list[str] = field(default_factory=list)  # recipes compare-precision's verdict names for its failures
    unnamed: list[str] = field(default_factory=list)  # what compare-precision knows of the failures nothing names
    own_ratio: float = math.nan  # the doctor's own rule, where compare-precision's verdict replaced it

    @property
    def passed(self) -> bool:
        return self.ratio <= 1

    def fit(self, bug: str | None, recipe: str | None = None) -> float:
        """The kernel's distance to the model of ``bug`` (<= 1: the model fits), inf when not modelled here;
        ``recipe``: of the bug on top of that numerical recipe (``bug`` None: the recipe alone)."""
        o = self.outputs
        if o is None or o.models is None or bug in o.skip or (bug is not None and self.group not in BUGS[bug]):
            return math.inf
        fit = o.distance(self.keys, o.model(bug, recipe=recipe))[0]
        if recipe is not None or bug is None:
            return fit
        saved = o.checks.get("saved")
        if fit > 1 and self.group == "backward" and o.stored is not None and saved is not None and \
                (saved.fit(bug) <= 1 if "saved" in BUGS[bug] else saved.passed):
            # the bug's backward from the statistics the kernel stored, when they are the bug's statistics
            fit = min(fit, o.distance(self.keys, o.model(bug, stored=True))[0])
        return fit

    def hidden(self, bug: str) -> bool | None:
        """Whether the model of ``bug`` is within tolerance of the golden (this input cannot show the bug)."""
        o = self.outputs
        if o is None or o.models is None or bug in o.skip or self.group not in BUGS[bug]:
            return None
        return o.distance(self.keys, o.gold, got=o.model(bug))[0] <= 1

    def composed(self, others: list[Check]) -> list[str]:
        """Where no bug's model fits this group (on this input and ``others``, the same group on the other
        inputs), in words: each numerical recipe (:data:`RECIPES`) whose model fits alone, else the pairs of a
        recipe and a bug whose model on top of it fits (e.g. "one-pass variance + running_var updated with the
        biased variance"); only the bugs that change this group are tried."""
        cs = [self, *others]
        out = []
        for recipe, words in RECIPES.items():
            if all(c.fit(None, recipe) <= 1 for c in cs):
                out.append(words)  # the recipe alone explains the group: nothing composed
                continue
            conv = self.outputs.convention if self.outputs is not None else "torch"
            out += [f"{words} + {describe(bug, conv)}" for bug in BUGS
                    if self.group in BUGS[bug] and all(c.fit(bug, recipe) <= 1 for c in cs)]
        return out


@dataclass(frozen=True)
class BugModels:
    """The bug models of one input: ``of(bug, recipe)``, the outputs of a bug's model (all channels-first; bug None:
    the correct one; recipe None: the FP64 statistics); ``skip``, the bugs this input cannot model; ``stored(bug)``,
    the backward (correct for None) from the statistics the kernel saved; ``convention``, the kernel's
    (:mod:`bnprobe.core.conventions`): the models' words are relative to it."""

    of: Callable[..., dict[str, np.ndarray]]
    skip: tuple[str, ...] = ()
    stored: Callable[[str | None], dict[str, np.ndarray]] | None = None
    convention: str = "torch"


def judge_group(name: str, got: dict[str, np.ndarray], gold: dict[str, np.ndarray], formats: dict[str, str],
                natural: dict[str, np.ndarray], *, models: BugModels | None, ranges: bool = True,
                bounds: dict[str, tuple[np.ndarray, str]] | None = None) -> dict[str, Check]:
    """Every group of outputs present in ``got`` on one input against the golden; each group's bug models
    (``models.of(bug)``) are compared with the kernel when asked (:meth:`Check.fit`), but for ``models.skip``.
    ``models.stored(bug)``: the backward from the statistics the kernel saved; when they pass their own check, the
    gradients are judged against that golden as well and pass by the closer one (a correct backward cannot undo
    the rounding of what its forward stored).  ``ranges``: note the outputs whose exact values their formats cannot
    hold (the user's data; the designed inputs stay inside the formats where it matters).  ``bounds``: per output,
    the error a correct kernel's accumulation can make per channel where its sums cancel
    (:func:`~bnprobe.engine.run.cancellation_bounds`), allowed where larger than the rtol."""
    m = models if models is not None else BugModels(None)  # type: ignore[arg-type]
    stored = m.stored
    o = _Outputs(name, got, gold, formats,
                 {k: np.nan_to_num(np.asarray(v, dtype=np.float64).reshape(-1)) for k, v in natural.items()},
                 m.of, stored, m.skip, bounds or {}, convention=m.convention)
    out: dict[str, Check] = {}
    for gr, keys in GROUPS.items():
        keys = tuple(k for k in keys if k in got)
        if not keys:
            continue
        worst, wrong = o.distance(keys, gold, describe=True)
        from_stored = False
        if gr == "backward" and stored is not None and "saved" in out and out["saved"].passed \
                and len(out["saved"].keys) == 2:
            alt = o.distance(keys, o.model(None, stored=True))[0]
            if alt < worst:  # closer to the backward of the statistics as stored
                from_stored = True
                worst, wrong = (alt, []) if alt <= 1 else (alt, wrong)
        out[gr] = Check(gr, name, worst, ", ".join(dict.fromkeys(formats[k] for k in keys)), wrong, keys,
                        [b for k in keys if ranges and (b := beyond_format(k, gold[k], formats[k]))], o, from_stored)
    o.checks = out
    return out


def _group_fits(checks: list[dict[str, Check]]) -> dict[str, tuple[str, ...]]:
    """Per failing group, the bugs whose model fits the kernel on every input the group was checked on."""
    out: dict[str, tuple[str, ...]] = {}
    for gr in CHECKS:
        cs = [c[gr] for c in checks if gr in c]
        failing = [c for c in cs if not c.passed]
        if failing:
            order = failing + [c for c in cs if c.passed]  # the failing inputs reject most models first
            out[gr] = tuple(bug for bug in BUGS if gr in BUGS[bug] and all(c.fit(bug) <= 1 for c in order))
    return out


def checklist_items(checks: list[dict[str, Check]], on: str,
                    unseen: bool = False) -> tuple[list[Item], list[str], list[str]]:
    """One item per group over every input it was checked on; the bugs whose model fits the kernel on all of
    them are its diagnosis.  (items, diagnosis, notes; with ``unseen`` a note naming the bugs no input shows)"""
    items: list[Item] = []
    diagnosis: list[str] = []
    fits = _group_fits(checks)
    conv = next((c.outputs.convention for ch in checks for c in ch.values() if c.outputs is not None), "torch")
    say = lambda bug: describe(bug, conv)  # noqa: E731
    # a bug is named only where no other failing group it changes refutes it (its model does not fit there)
    refuted = {bug for gr, ms in fits.items() for bug in BUGS if gr in BUGS[bug] and bug not in ms}
    for gr, (name, what) in CHECKS.items():
        cs = [c[gr] for c in checks if gr in c]
        if not cs:
            continue
        name = running_item(conv) if gr == "running" else name
        fmts = ", ".join(dict.fromkeys(f for c in cs for f in c.formats.split(", ")))
        failing = [c for c in cs if not c.passed]
        worst = max(cs, key=lambda c: c.ratio)
        if not failing:
            where = f" on {len(cs)} inputs" if len(cs) > 1 else f" {on or 'on ' + cs[0].input}"
            stored = [c.input for c in cs if c.from_stored]
            items.append(Item(name, "PASS", f"{what} match the FP64 golden{where} (largest error "
                                            f"{100 * worst.ratio:.3g}% of the {fmts} tolerance"
                                            + (f", on {worst.input})" if len(cs) > 1 else ")")
                                            + (f"; judged from the statistics as the kernel stored them (closer than "
                                               f"from the FP64 ones) on {', '.join(stored)}" if stored else "")))
            continue
        names = [c.input for c in failing]
        if all(c.own_ratio <= 1 for c in failing):  # within the doctor's rule, less accurate than a careful kernel:
            # a precision failure no logic bug explains; compare-precision's recipe, where it names one
            matches = tuple(dict.fromkeys(f"it {w}" for c in failing for w in c.causes))
            head = (f"{what} less accurate than a careful kernel on {len(failing)} of {len(cs)} input(s) "
                    f"({', '.join(names)}), by compare-precision's rule"
                    + (f"; {'; '.join(matches)}" if matches else _unnamed(failing, "; no known recipe matches")))
        elif all(c.causes for c in failing):  # a recipe reproduces every failing output: it, not a bug's model
            matches = tuple(dict.fromkeys(f"it {w}" for c in failing for w in c.causes))
            head = (f"{what} wrong on {len(failing)} of {len(cs)} input(s) ({', '.join(names)}), as compare-precision "
                    f"finds; {'; '.join(matches)}")
        else:
            matches = tuple(say(bug) for bug in fits[gr] if bug not in refuted)
            if not matches:  # a numerical recipe, or a bug on top of one, where no bug's model fits alone
                matches = tuple(failing[0].composed(failing[1:] + [c for c in cs if c.passed]))
            head = (f"{what} wrong on {len(failing)} of {len(cs)} input(s) ({', '.join(names)})"
                    + (f"; they match the model of: {'; '.join(matches)}" if matches else
                       _unnamed(failing, "; no known bug model matches")))
        diagnosis.extend(b for b in matches if b not in diagnosis)
        items.append(Item(name, "FAIL", head, matches, tuple(f"on {c.input}: {w}" for c in failing for w in c.wrong)))
    named = {bug for gr, ms in fits.items() for bug in ms if bug not in refuted}
    hints = [f"{say(bug)}: {CONVENTION_HINTS[bug]}" for bug in CONVENTION_HINTS if bug in named and conv == "torch"]
    beyond = [f"on {c.input}: {b}" for ch in checks for c in ch.values() for b in c.beyond]
    if beyond:
        items.append(Item("the outputs' formats hold their values", "WARN", "some exact values are beyond the range "
                          "of the format the kernel returns them in: no kernel can return them (the format is the "
                          "cause; bnprobe overflow locates them)", (), tuple(beyond)))
    notes = hints
    if unseen:
        bugs = [bug for bug in BUGS if _unseen(bug, checks)]
        if bugs:
            notes.append("on this call's data these bugs look like correct BatchNorm (within tolerance) and cannot "
                         "be seen: " + "; ".join(map(say, bugs)))
    return items, diagnosis, notes


def _unnamed(failing: list[Check], none: str) -> str:
    """What is known of failing checks nothing names (compare-precision's words for their outputs, each said once),
    or ``none``."""
    said = [u.split("; ") for c in failing for u in c.unnamed]
    heads = dict.fromkeys(p[0] for p in said)  # (each output's own first: how much worse than the bench it is)
    known = [*heads, *dict.fromkeys(q for p in said for q in p[1:] if q not in heads)]
    return f"{none}; not named: {'; '.join(known)}" if known else none


def _unseen(bug: str, checks: list[dict[str, Check]]) -> bool:
    """Whether some group can model ``bug`` and on every such group its model is within tolerance of the golden
    (:meth:`Check.hidden`): the groups asked in turn, stopping at the first that shows the bug (each question
    forms the bug's model of that group)."""
    judged = False
    for c in checks:
        for gr in c:
            h = c[gr].hidden(bug)
            if h is False:
                return False
            judged = judged or h is not None
    return judged


def returned_format(a: Any, fallback: str) -> str:
    """The format an output was returned in: its dtype's, or ``fallback`` for float64 arrays."""
    dt = np.asarray(a).dtype
    return fallback if dt == np.float64 else get_format(dt).name


def output_scales(run: CallRun, x: np.ndarray) -> dict[str, np.ndarray]:
    """Per channel, the magnitude each output is formed from (see the module docstring): y from x·rstd·γ and
    μ·rstd·γ plus β; the inference y from x and the running mean; the sums from their terms."""
    ci = run.inputs
    c = x.shape[1]
    g = np.ones(c) if ci.gamma is None else np.abs(np.asarray(ci.gamma, dtype=np.float64))
    b = np.zeros(c) if ci.beta is None else np.abs(np.asarray(ci.beta, dtype=np.float64))
    ax = reduce_axes(x)
    with np.errstate(all="ignore"):
        mean_abs = np.nanmean(np.abs(x), axis=ax)
        out = {k: np.asarray(v, dtype=np.float64) for k, v in run.scales.items()}
        if "dx" in out:
            out["dx"] = out["dx"].reshape(-1)
        if run.gold_saved is not None:
            rs = 1 / np.sqrt(run.gold_saved.var(run.eps) + run.eps)
            out["y"] = g * rs * mean_abs + b
        if ci.running_mean is not None and ci.running_var is not None:
            rm = np.abs(np.asarray(ci.running_mean, dtype=np.float64))
            rs = 1 / np.sqrt(np.asarray(ci.running_var, dtype=np.float64) + run.eps)
            out["y_infer"] = g * rs * (mean_abs + rm) + b
    return out

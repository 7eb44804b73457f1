"""bnprobe doctor: the expert's checklist for a BatchNorm kernel, with the known bug each failure matches.

The kernel runs on a set of inputs, each made to show some bugs: a diagnostic input that tells the
classic bugs apart (channels whose variance is above, near and far below eps, R = 32 so that R/(R-1)
is visible, running statistics far from the batch's, dy built so that each term of dx carries weight
in some channel), and stress inputs on which real kernels go wrong (a large mean, var ≈ eps, a large
variance, constant channels, R = 2, inference after several training steps, sums large enough to lose
bits in a 16-bit accumulator), plus the user's own input when given.  On each input every group of
outputs — the training y, the saved statistics, the running statistics, the inference y, the gradients,
the inference after the steps — is compared with the FP64 golden on the same rounded inputs (the
reference adapter, parameters in the run's format), output by output at the tolerance of the format the
kernel returned it in, per channel, relative to the channel's largest expected value or its natural
scale (what the output is formed from), whichever is larger.  A group that fails on any input fails the
kernel.  A bug is diagnosed when the model of BatchNorm with that bug matches the kernel on every input
(and the correct model does not on some); where no model matches, the item says which outputs are wrong
on which input, and how (torch.testing style).

On a recording (:func:`doctor_recorded`) each call's recorded outputs are judged the same way on its own
inputs; a runnable kernel given a recording as input also gets the checklist on the diagnostic and stress
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM
from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.registry import as_adapter
from bnprobe.adapters.base import outputs_only, params_format, stored_inputs
from bnprobe.adapters.convention import reference_for
from bnprobe.core.call import BNCall
from bnprobe.checks.doctor.bugs import (
    BIASED_RUNNING, BUGS, CHECKS, CONVENTION_HINTS, ELEMENTWISE, GROUPS, RECIPES, TRAIN_RUNNING, Outputs, describe,
    model, running_item,
)
from bnprobe.engine.recorded import PerCall, Recorded, check_options, check_params
from bnprobe.engine.result import Verdict
from bnprobe.engine.run import CallRun, Golden, each_run, generated_call, run_call
from bnprobe.engine.rules import beyond_format, channel_rule
from bnprobe.core.conventions import convention_of
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.guard import MODEL_CACHE_BYTES  # the bug models' outputs kept on one input (_Outputs.model)
from bnprobe.kernels.layout import reduce_axes, to_channels_first
from bnprobe.numerics.rounding import round_to
from bnprobe.core.tolerances import MSPROBE_STANDARDS

__all__ = ["Item", "DoctorReport", "Probe", "doctor", "doctor_recorded", "probes", "SKIPPED_ON_RECORDINGS"]

# ---- reports ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    name: str
    status: Verdict  # PASS, WARN or FAIL (given as the text or the member: kept as the member)
    evidence: str
    matches: tuple[str, ...] = ()
    details: tuple[str, ...] = ()  # what is wrong, per input and output (torch.testing style)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Verdict(self.status))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matches"] = list(self.matches)
        d["details"] = list(self.details)
        return d


@dataclass
class DoctorReport:
    adapter: str
    dtype: str
    items: list[Item]
    diagnosis: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    call: str | None = None  # the recorded call diagnosed (its label), None for the diagnostic inputs
    params: str | None = None  # the parameters' format (fp32, same...), None when not known
    inputs: tuple[str, ...] = ()  # the inputs the checklist ran on

    @property
    def passed(self) -> bool:
        """No checklist item failed (every result type answers with ``.passed`` and ``bool``)."""
        return all(i.status != Verdict.FAIL for i in self.items)

    @property
    def healthy(self) -> bool:
        """The same as :attr:`passed` (the name its JSON report keeps)."""
        return self.passed

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> Verdict:
        return Verdict.of(self.passed)

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per checklist item (its CSV)."""
        import pandas as pd

        return pd.DataFrame([i.to_dict() for i in self.items])

    def to_dict(self) -> dict[str, Any]:
        return {**({} if self.call is None else {"call": self.call}), "adapter": self.adapter, "dtype": self.dtype,
                "params": self.params, "inputs": list(self.inputs), "healthy": self.healthy,
                "diagnosis": self.diagnosis, "items": [i.to_dict() for i in self.items], "notes": self.notes}




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


def _judge(name: str, got: dict[str, np.ndarray], gold: dict[str, np.ndarray], formats: dict[str, str],
           natural: dict[str, np.ndarray], *, models: Callable[[str], dict[str, np.ndarray]] | None,
           skip: tuple[str, ...] = (),
           stored: Callable[[str | None], dict[str, np.ndarray]] | None = None, ranges: bool = True,
           bounds: dict[str, tuple[np.ndarray, str]] | None = None, convention: str = "torch") -> dict[str, Check]:
    """Every group of outputs present in ``got`` on one input against the golden; each group's bug models
    (``models(bug)``, all outputs channels-first) are compared with the kernel when asked (:meth:`Check.fit`);
    ``skip``: bugs this input cannot model.  ``stored(bug)``: the backward (correct for None) from the
    statistics the kernel saved; when they pass their own check, the gradients are judged against that golden
    as well and pass by the closer one (a correct backward cannot undo the rounding of what its forward
    stored).  ``ranges``: note the outputs whose exact values their formats cannot hold (the user's data; the
    designed inputs stay inside the formats where it matters).  ``bounds``: per output, the error a correct
    kernel's accumulation can make per channel where its sums cancel (:func:`~bnprobe.engine.run
    .cancellation_bounds`), allowed where larger than the rtol."""
    o = _Outputs(name, got, gold, formats,
                 {k: np.nan_to_num(np.asarray(v, dtype=np.float64).reshape(-1)) for k, v in natural.items()},
                 models, stored, skip, bounds or {}, convention=convention)
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


def _items(checks: list[dict[str, Check]], on: str, unseen: bool = False) -> tuple[list[Item], list[str], list[str]]:
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
                    + (f"; {'; '.join(matches)}" if matches else "; no known recipe matches"))
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
                       "; no known bug model matches"))
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


def _returned(a: Any, fallback: str) -> str:
    """The format an output was returned in: its dtype's, or ``fallback`` for float64 arrays."""
    dt = np.asarray(a).dtype
    return fallback if dt == np.float64 else get_format(dt).name


def _natural(run: CallRun, x: np.ndarray) -> dict[str, np.ndarray]:
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


# ---- the inputs ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """One input of the checklist: a named call (NC... layout, float64 before rounding to the run's formats; its
    dtype and params are set per run), and for the eval-after-steps input the training batches before it."""

    name: str
    call: BNCall
    steps: tuple[np.ndarray, ...] = ()  # training batches before the inference on x (eval after several steps)


def _probe(name: str, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, running_mean: np.ndarray,
           running_var: np.ndarray, dy: np.ndarray | None, steps: tuple[np.ndarray, ...] = ()) -> Probe:
    """A probe with BatchNorm's default ε and momentum."""
    return Probe(name, BNCall(x, gamma, beta, running_mean, running_var, dy), steps)


def _running(rng: np.random.Generator, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running statistics far from the batch's (1.5 std away, 0.3 x or 3 x the variance), so that momentum and
    the train/eval switch show."""
    ax = reduce_axes(x)
    mean, std = x.mean(axis=ax), x.std(axis=ax)
    c = mean.size
    sign = np.where(np.arange(c) % 2, -1.0, 1.0)
    return mean + 1.5 * sign * np.maximum(std, 0.1), np.where(np.arange(c) % 2, 3.0, 0.3) * np.maximum(std, 0.1) ** 2


def _diagnostic(seed: int) -> Probe:
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


def _stress(name: str, x: np.ndarray, seed: int) -> Probe:
    rng = np.random.default_rng([seed, len(name)])
    c = x.shape[1]
    rm, rv = _running(rng, x)
    return _probe(name, x, rng.uniform(0.5, 1.5, c), rng.normal(0.0, 0.3, c), rm, rv, rng.standard_normal(x.shape))


def probes(seed: int = 0, *, stress: bool = True) -> list[Probe]:
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
    out.append(Probe(shifted.name, shifted.call.with_(dy=shifted.call.dy + np.array([1.0, 2.0]).reshape(1, 2, 1, 1)),
                     ()))
    ev = _stress("stress/eval-after-steps", n(8, 3, 2, 2) + 0.5, seed)
    out.append(Probe(ev.name, ev.call.with_(running_mean=np.zeros(3), running_var=np.ones(3), dy=None), steps))
    return out


USER = "input"
GENERATED = "generated"  # the input made from the command line's --shape, --mean, --std, --dist


def user_probe(x: np.ndarray, seed: int = 0, name: str = USER) -> Probe:
    """The user's tensor as an input of the checklist (γ, β and dy seeded, running statistics 0 and 1)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim < 2:
        raise BNProbeError(f"x must have 2 to 5 dimensions, got shape {x.shape}")
    p = _stress(name, x, seed)
    return Probe(name, p.call.with_(running_mean=np.zeros(x.shape[1]), running_var=np.ones(x.shape[1])))


# ---- running the kernel on one input ------------------------------------------------------------------

def _probe_checks(a: KernelAdapter, ref: KernelAdapter, p: Probe, fmt: str, params: str) -> dict[str, Check]:
    if p.steps:
        return _steps_checks(a, ref, p, fmt, params)
    caps = a.capabilities()
    r = p.call.x.size // p.call.x.shape[1]
    modes = ("train", "infer", "backward") if r > 1 else ("infer",)
    modes = tuple(m for m in modes if m in caps.modes)  # (a kernel saving no statistics: from the golden's)
    conv = caps.convention
    rec = generated_call(p.call.with_(dtype=fmt, params=params), modes=modes, label=p.name)
    golden = Golden(ref, rec)
    run = run_call(a, rec, ref=ref, label=p.name, golden=golden)
    ci = run.inputs
    x = ci.x
    vec = {k: np.asarray(getattr(ci, k), dtype=np.float64) for k in ("gamma", "beta", "running_mean", "running_var")}
    dy = ci.dy if ci.dy is not None else np.zeros_like(x)
    args = (x, vec["gamma"], vec["beta"], vec["running_mean"], vec["running_var"], dy, p.call.momentum, p.call.eps)
    got, gold, formats = run.invstd_view()
    got = {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}
    shared: dict[Any, np.ndarray] = {}  # what no bug model changes, computed once for this input
    checks = _judge(p.name, got, gold, formats, _natural(run, x),
                    models=lambda bug, recipe=None: model(*args, bug=bug, recipe=recipe, convention=conv,
                                                          shared=shared),
                    stored=_stored(args, got, convention=conv), ranges=p.name in (USER, GENERATED), bounds=run.bounds,
                    convention=conv)
    return _as_compare(checks, a, rec, modes, p.name, run=run, golden=golden)


def _compared_training(rec: Any) -> bool:
    """Whether compare-precision takes this recorded call (channels_first, more than one value per channel)."""
    x = rec.tensors.get("train", {}).get("inputs", {}).get("x")
    return rec.layout == "channels_first" and x is not None and np.size(x) // max(np.shape(x)[1], 1) > 1


#: the outputs compare-precision judges, by the doctor's names (its saved statistic under either of its names)
_COMPARED = {"y": ("y",), "saved_mean": ("saved_mean",), "saved_invstd": ("saved_invstd", "saved_var"),
             "running_mean": ("running_mean",), "running_var": ("running_var",), "y_infer": ("y_infer",),
             "dx": ("dx",), "dgamma": ("dgamma",), "dbeta": ("dbeta",)}


def _as_compare(checks: dict[str, Check], a: KernelAdapter, rec: Any, modes: tuple[str, ...],
                label: str, run: CallRun | None = None, golden: Any = None) -> dict[str, Check]:
    """Each group's verdict joined with compare-precision's on the same call: a group fails where compare-precision
    fails one of its outputs (with its reason, and the recipe it names), so every output compare-precision fails,
    doctor fails; it fails too where the doctor's own rule does (its designed inputs show logic bugs that msprobe's
    metrics can let through, e.g. running_var + eps in fp16 on the diagnostic input).  Groups compare-precision does
    not judge (fp64 outputs: msprobe's rules skip them) keep the doctor's own rule; the bug models are fitted by it
    either way."""
    from bnprobe.checks.compare.precision import judge_call
    from bnprobe.engine.recipes import RECIPE

    if get_format(rec.dtype).name not in MSPROBE_STANDARDS or rec.layout != "channels_first":
        return checks
    rows = {r["tensor"]: r for r in judge_call(a, rec, modes, label=label, run=run, golden=golden)}
    call = rec.call()
    for c in checks.values():
        judged = [next((rows[t] for t in _COMPARED.get(k, ()) if t in rows), None) for k in c.keys]
        if not c.keys or any(v is None or not math.isfinite(float(v["score"])) for v in judged):
            continue
        failing = [v for v in judged if v["verdict"] == Verdict.FAIL]
        c.own_ratio = c.ratio
        if not failing:  # the doctor's designed inputs may still show a logic bug msprobe's metrics let through
            continue
        c.ratio = max(c.ratio, max(float(v["score"]) / float(v["bound"]) for v in failing), 1.0 + 1e-9)
        if c.own_ratio <= 1:  # the doctor's rule passed it: compare-precision's reasons are the evidence
            c.wrong = [f"{v['tensor']} ({v['format']}), by compare-precision's rule: {v['why']}" for v in failing]
        c.causes = [RECIPE[v["cause"]].words(call) for v in failing if v.get("cause") in RECIPE]
    saved, bw = checks.get("saved"), checks.get("backward")
    if saved is None or not saved.causes or bw is None or not (bw.own_ratio > 1 and bw.ratio > 1):
        return checks
    judged = [rows[t] for k in bw.keys for t in _COMPARED.get(k, ()) if t in rows]
    if judged and all(v["verdict"] == Verdict.PASS for v in judged):
        # the backward is judged from the statistics the kernel stored, whose error a recipe names: compare-precision
        # passes it from them, and the doctor's rule (from the FP64 statistics) sees only the stored ones' error
        bw.ratio = max(float(v["score"]) / float(v["bound"]) for v in judged)
        bw.wrong, bw.from_stored = [], True
    return checks


def _stored(args: tuple[Any, ...], got: dict[str, np.ndarray], training: bool = True, convention: str = "torch",
            ) -> Callable[[str | None], dict[str, np.ndarray]] | None:
    """The backward models from the statistics the kernel saved (see :func:`_judge`)."""
    if not training or "saved_mean" not in got or "saved_invstd" not in got:
        return None
    saved, shared = (got["saved_mean"], got["saved_invstd"]), {}
    return lambda bug: model(*args, bug=bug, saved=saved, convention=convention, shared=shared)


def _steps_checks(a: KernelAdapter, ref: KernelAdapter, p: Probe, fmt: str, params: str) -> dict[str, Check]:
    """Training steps on ``p.steps`` then inference on ``p.call.x``, with the running statistics the steps left: the
    kernel's chain against the golden's (the reference, its update kept in the parameters' format after each
    step as a kernel keeps it) and the bug models' chains."""
    caps = a.capabilities()
    if "train" not in caps.modes or "infer" not in caps.modes:
        return {}
    pf = params_format(fmt, params)
    batches = [round_to(s, fmt) for s in p.steps]
    c = p.call
    x, _, g, b, rm0, rv0 = stored_inputs(fmt, params, c.x, None, c.gamma, c.beta, c.running_mean, c.running_var)
    k_rm, k_rv, g_rm, g_rv = rm0, rv0, rm0, rv0
    step = BNCall(x, g, b, eps=c.eps, momentum=c.momentum, dtype=fmt, params=params)
    with np.errstate(all="ignore"):
        for xb in batches:
            out = a.train(step.with_(x=xb, running_mean=k_rm, running_var=k_rv))
            if out.running_mean is None or out.running_var is None:
                return {}
            k_rm, k_rv = out.running_mean, out.running_var
            gt = ref.train(step.with_(x=xb, running_mean=g_rm, running_var=g_rv))
            g_rm, g_rv = round_to(gt.running_mean, pf), round_to(gt.running_var, pf)
        y = a.infer(step.with_(running_mean=k_rm, running_var=k_rv, training=False)).y
        gy = ref.infer(step.with_(running_mean=g_rm, running_var=g_rv, training=False)).y

        def models(bug: str | None, recipe: str | None = None) -> dict[str, np.ndarray]:
            rm, rv = rm0, rv0
            for xb in batches:
                m = model(xb, g, b, rm, rv, np.zeros_like(xb), p.call.momentum, p.call.eps, bug=bug, recipe=recipe,
                          convention=caps.convention)
                rm, rv = round_to(m["running_mean"], pf), round_to(m["running_var"], pf)
            m = model(x, g, b, rm, rv, np.zeros_like(x), p.call.momentum, p.call.eps, bug=bug, recipe=recipe,
                      convention=caps.convention)
            return {"running_mean": rm, "running_var": rv, "y_eval": m["y_infer"]}

        out_fmt, vec_fmt = caps.output or fmt, "fp64" if caps.output == "fp64" else pf
        got = {"running_mean": k_rm, "running_var": k_rv, "y_eval": y}
        gold = {"running_mean": g_rm, "running_var": g_rv, "y_eval": gy}
        formats = {k: _returned(v, out_fmt if k == "y_eval" else vec_fmt) for k, v in got.items()}
        ax = reduce_axes(x)
        mean_abs = np.max([np.abs(bt).mean(axis=ax) for bt in batches], axis=0)
        natural = {"running_mean": np.maximum(np.abs(g_rm), p.call.momentum * mean_abs),
                   "y_eval": np.abs(g) / np.sqrt(g_rv + p.call.eps) * (np.abs(x).mean(axis=ax) + np.abs(g_rm))
                   + np.abs(b)}
    got = {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}
    return _judge(p.name, got, {k: np.asarray(v, dtype=np.float64) for k, v in gold.items()}, formats, natural,
                  models=models, convention=caps.convention)


def doctor(adapter: str | KernelAdapter = "reference", dtype: str | None = None, *, seed: int = 0,
           stability: bool = True, params: str | None = None, x: np.ndarray | None = None, eps: float = EPS,
           momentum: float = MOMENTUM, generated: np.ndarray | None = None, recipe: bool = False) -> DoctorReport:
    """Run the checklist on ``adapter`` in ``dtype`` (default: fp64 when it runs it, else its first format)
    with parameters (γ, β, running and saved statistics) in fp32 or the input's format (``params`` same), on
    the diagnostic input, the stress inputs (``stability``), ``x`` (the user's tensor) and ``generated`` (an input
    made from the command line's shape and distribution) when given, every one with BatchNorm's ``eps`` and
    ``momentum``.  A dump adapter of one call is diagnosed on its recorded inputs (:func:`doctor_recorded` does
    every call).  ``recipe``: when something fails, also identify the kernel's numerical recipe
    (:func:`~bnprobe.checks.identify.search.identify`) and, where it is reproduced bit for bit, name its choices
    known to lose accuracy in the diagnosis."""
    a = as_adapter(adapter)
    check_params(params)
    if a.capabilities().recorded:
        if len(a.calls.calls) != 1:
            raise BNProbeError(f"{a.name} holds {len(a.calls.calls)} BatchNorm calls: doctor_recorded diagnoses each "
                               "(or select one with dump:DIR#NAME)")
        if x is not None or generated is not None:
            raise BNProbeError(f"--input and the dump adapter {a.name} both give the inputs: drop --input")
        if eps != EPS or momentum != MOMENTUM:
            raise BNProbeError(f"the dump adapter {a.name} holds its calls' eps and momentum: drop --eps/--momentum")
        return doctor_recorded(Recorded(a, a.calls), dtype=dtype, params=params).results[0]
    caps = a.capabilities()
    fmt = get_format(dtype).name if dtype else ("fp64" if "fp64" in caps.formats else caps.formats[0])
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    prm = params or "fp32"
    todo = probes(seed, stress=stability) + ([user_probe(x, seed)] if x is not None else []) \
        + ([user_probe(generated, seed, GENERATED)] if generated is not None else [])
    todo = [Probe(p.name, p.call.with_(eps=eps, momentum=momentum), p.steps) for p in todo]
    ref = outputs_only(reference_for(a))  # the golden in the kernel's convention
    a = outputs_only(a)  # only outputs are compared: no intermediates kept (on a copy: the caller's is unchanged)
    checks: list[dict[str, Check]] = []
    notes: list[str] = []
    for p in todo:
        try:
            checks.append(_probe_checks(a, ref, p, fmt, prm))
        except BNProbeError as exc:
            notes.append(f"{p.name} not run: {exc}")
    items, diagnosis, more = _items(checks, "")
    notes += more
    diag = todo[0]
    if convention_of(a).cumulative:
        items.append(_momentum_none(a, ref, diag, fmt, prm))
    else:
        notes.append(f"momentum=None (torch's cumulative average) is not in the {convention_of(a).name} convention: "
                     "not checked")
    items.append(_epsilon(a, diag.call.x, fmt, diag.call.eps, prm))
    items.append(_determinism(_forward_twice(a, diag, fmt, prm), caps.deterministic))
    notes.append("that inference leaves the running statistics unchanged cannot be observed through the adapter "
                 "interface (forward_infer returns none); bnprobe's own kernels guarantee it")
    if x is not None and not np.isfinite(x).all():
        bad = int(np.size(x) - np.isfinite(x).sum())
        notes.insert(0, f"your input holds {bad} NaN/inf value(s) of {np.size(x)}: outputs that depend on them are "
                        f"non-finite in the golden too, so the checks on '{USER}' cannot see a kernel fault there")
    if recipe and any(it.status == Verdict.FAIL for it in items) and fmt != "fp64":
        diagnosis += _recipe_words(a, fmt, prm, seed, eps, momentum, notes)
    return DoctorReport(a.name, fmt, items, diagnosis, notes, params=prm, inputs=tuple(p.name for p in todo))


def _recipe_words(a: KernelAdapter, fmt: str, params: str, seed: int, eps: float, momentum: float,
                  notes: list[str]) -> list[str]:
    """The diagnosis by recipe: identify's policy when it reproduces the kernel bit for bit, its lossy choices in
    words; otherwise a note that no recipe of the space reproduces it (never the closest called a match)."""
    from bnprobe.checks.identify.results import lossy_choices
    from bnprobe.checks.identify.search import identify

    res = identify(a, fmt, params=params, seed=seed, eps=eps, momentum=momentum, passes=2)
    if not res.reproduced:
        notes.append(f"identify: no recipe of the policy space reproduces the kernel (it departs at the {res.departs} "
                     "stage), so none is named")
        return []
    lossy = lossy_choices(res.policy)
    if not lossy:
        notes.append(f"identify: the kernel computes as emulated:{res.spec}, bit for bit, with no choice known to "
                     "lose accuracy")
        return []
    return [f"its recipe (identify, bit for bit: emulated:{res.spec}): " + "; ".join(lossy)]


def _momentum_none(a: KernelAdapter, ref: KernelAdapter, p: Probe, fmt: str, params: str) -> Item:
    """momentum=None: PyTorch's cumulative average; for a first batch the running stats become the batch's."""
    name = "momentum=None is a cumulative average"
    try:
        rec = generated_call(p.call.with_(dy=None, dtype=fmt, params=params, momentum=None), modes=("train",),
                             label=p.name)
        run = run_call(a, rec, ref=ref, label=p.name)
    except BNProbeError as exc:
        return Item(name, "WARN", f"not supported: {exc}")
    keys = [k for k in GROUPS["running"] if k in run.got]
    if not keys:
        return Item(name, "WARN", "the kernel returns no running statistics")
    nat = _natural(run, run.inputs.x)
    res = [channel_rule(k, run.got[k], run.gold[k], nat.get(k), run.formats[k], describe=True) for k in keys]
    worst = max(r for r, _ in res)
    fmts = ", ".join(dict.fromkeys(run.formats[k] for k in keys))
    if worst <= 1:
        return Item(name, "PASS", f"first batch with momentum=None: the running statistics are the batch's "
                                  f"(largest error {100 * worst:.3g}% of the {fmts} tolerance)")
    if "running_var" in keys and channel_rule("running_var", run.got["running_var"], _first_batch_biased(run),
                                              nat.get("running_var"), run.formats["running_var"])[0] <= 1:
        # the running variance is the batch's biased one: the running statistics' item names it, once
        return Item(name, "WARN", "first batch with momentum=None: the running variance is the batch's biased "
                                  f"variance — the finding '{describe(BIASED_RUNNING)}' of the running statistics, "
                                  "not a second one")
    return Item(name, "FAIL", "first batch with momentum=None: the running statistics are not the batch's", (),
                tuple(f"on {p.name} with momentum=None: {why}" for _, why in res if why))


def _first_batch_biased(run: CallRun) -> np.ndarray:
    """The running variance a first batch with momentum=None leaves when updated with the biased variance."""
    v = run.gold_saved.var(run.eps) if run.gold_saved is not None else np.full(1, np.nan)
    return np.asarray(v, dtype=np.float64)


def _epsilon(a: KernelAdapter, x: np.ndarray, fmt: str, eps: float, params: str) -> Item:
    """eps sane for the format the statistics are computed in."""
    stat_fmt = get_format(a.policy_for(round_to(x, fmt), dtype=fmt, params=params).accumulate) \
        if a.capabilities().staged else get_format("fp64" if fmt == "fp64" else "fp32")
    name = "epsilon is resolvable in the statistics' format"
    if eps < stat_fmt.eps / 2:
        return Item(name, "WARN", f"eps {eps:g} is below half the {stat_fmt.name} spacing at 1 "
                                  f"({stat_fmt.eps / 2:.3g}): var + eps == var for var >= 1, so eps only acts on "
                                  "small variances")
    return Item(name, "PASS", f"eps {eps:g} vs {stat_fmt.name} spacing at 1 {stat_fmt.eps:.3g}")


def _determinism(run: Callable[[], Any], declared: bool, inputs: str = "the same inputs") -> Item:
    """``run`` twice (a kernel's forward on ``inputs``): the same bits, or by how much two runs differ — a failure
    for a kernel that declares itself deterministic (``declared``, its capabilities), a warning otherwise."""
    ys = [np.asarray(run()) for _ in range(2)]
    if np.array_equal(ys[0], ys[1], equal_nan=True):
        return Item("determinism", "PASS", f"{inputs} twice give the same bits")
    with np.errstate(all="ignore"):
        diff = float(np.nanmax(np.abs(ys[0].astype(np.float64) - ys[1].astype(np.float64))))
    if declared:
        return Item("determinism", "FAIL", f"two runs on {inputs} differ by up to {diff:.3g}, but the kernel "
                                           "declares itself deterministic (Capabilities.deterministic)")
    return Item("determinism", "WARN", f"two runs on {inputs} differ by up to {diff:.3g} "
                                       "(non-deterministic reduction order)")


def _forward_twice(a: KernelAdapter, p: Probe, fmt: str, params: str) -> Callable[[], Any]:
    """The training forward of ``a`` on the probe's inputs, as stored in ``fmt`` and ``params``."""
    c = p.call
    x, _, g, b, rm, rv = stored_inputs(fmt, params, c.x, None, c.gamma, c.beta, c.running_mean, c.running_var)
    step = BNCall(x, g, b, rm, rv, eps=c.eps, momentum=c.momentum, dtype=fmt, params=params)
    return lambda: a.train(step).y


# ---- recorded calls ---------------------------------------------------------------------------------

SKIPPED_ON_RECORDINGS = (
    "momentum=None is a cumulative average (needs a rerun with momentum=None)",
    "determinism (needs a second run on the same inputs)",
    "the checklist on the diagnostic and stress inputs (needs runs on other data)",
)


def doctor_recorded(recorded: Recorded, *, dtype: str | None = None, params: str | None = None,
                    stability: bool = True) -> PerCall:
    """The checklist on every selected call of a recording, in forward order, one at a time, on its own
    recorded inputs and scalars: each output the call returned (for a dump: the recorded one) against the
    FP64 golden, at the tolerance of the format it was returned in, and against the bug models on the same
    inputs.  One :class:`DoctorReport` per call; a runnable kernel also gets the checklist on the diagnostic
    and stress inputs (``stability``) in each format and parameter format the calls were recorded in, as a
    report of its own; the items a replay cannot run are in the notes."""
    recorded.calls.require_tensors("doctor")
    check_options(recorded, dtype=dtype, params=params)
    kinds: dict[tuple[str, str], None] = {}

    def judge(_: int, run: CallRun) -> DoctorReport:
        kinds[(run.fmt, run.inputs.params)] = None
        return _doctor_call(recorded, run)

    reports = each_run(recorded, judge)
    notes = [f"skipped on a recording: {s}" for s in SKIPPED_ON_RECORDINGS] if recorded.replay else []
    if not recorded.replay:
        for fmt, prm in kinds:
            rep = doctor(recorded.kernel, fmt, params=prm, stability=stability)
            rep.call = f"(diagnostic and stress inputs, {fmt}, params {prm})"
            reports.append(rep)
    return PerCall("doctor", recorded.kernel.name, recorded.calls.source, recorded.calls.kind, reports,
                   notes + list(recorded.calls.notes))


def _doctor_call(recorded: Recorded, run: CallRun) -> DoctorReport:
    rec, ci, fmt, eps = run.recording, run.inputs, run.fmt, run.eps
    conv = convention_of(recorded.kernel).name
    layout = rec.layout
    cf = lambda a: None if a is None else np.asarray(to_channels_first(np.asarray(a, dtype=np.float64), layout))  # noqa: E731
    x = cf(ci.x)
    c = x.shape[1]
    g = np.ones(c) if ci.gamma is None else np.asarray(ci.gamma, dtype=np.float64)
    b = np.zeros(c) if ci.beta is None else np.asarray(ci.beta, dtype=np.float64)
    have_running = ci.running_mean is not None and ci.running_var is not None
    rm = np.asarray(ci.running_mean, dtype=np.float64) if have_running else np.zeros(c)
    rv = np.asarray(ci.running_var, dtype=np.float64) if have_running else np.ones(c)
    dy = cf(rec.tensors.get("backward", {}).get("inputs", {}).get("dy"))
    mom = rec.momentum
    got, gold, formats = run.invstd_view()
    got = {k: cf(v) if k in ELEMENTWISE else np.asarray(v, dtype=np.float64) for k, v in got.items()}
    gold = {k: cf(v) if k in ELEMENTWISE else v for k, v in gold.items()}
    notes = list(run.notes)
    if "running_mean" in got and mom is None:
        notes.append("momentum None (cumulative average): the running statistics' update is not checked")
        got.pop("running_mean"), got.pop("running_var")
    args = (x, g, b, rm, rv, np.zeros_like(x) if dy is None else dy, MOMENTUM if mom is None else mom, eps)
    shared: dict[Any, np.ndarray] = {}  # what no bug model changes, computed once for this call
    checks = _judge(run.label, got, gold, formats, _natural(run, x),
                    models=lambda bug, recipe=None: model(*args, bug=bug, training=rec.training, recipe=recipe,
                                                          convention=conv, shared=shared),
                    skip=() if have_running else (TRAIN_RUNNING,), stored=_stored(args, got, rec.training, conv),
                    bounds=run.bounds, convention=conv)
    if rec.training and _compared_training(rec):
        checks = _as_compare(checks, recorded.kernel, rec, tuple(m for m in ("train", "infer", "backward")
                                                                 if m in rec.tensors), run.label, run=run)
    items, diagnosis, unseen = _items([checks], "on the recorded inputs", unseen=True)
    if rec.training and "train" in rec.tensors and "running_mean" not in run.got:
        notes.append("the updated running statistics are not in the recording: their momentum and unbiased "
                     "variance are not checked")
    if "backward" not in rec.tensors:
        notes.append("no backward recorded: the gradients are not checked")
    items.append(_epsilon(recorded.kernel, x, fmt, eps, ci.params))
    if not recorded.replay and "train" in rec.tensors:
        ins = rec.tensors["train"]["inputs"]
        first = BNCall(ins["x"], ins.get("gamma"), ins.get("beta"), eps=eps, dtype=fmt, params=ci.params,
                       layout=layout)
        items.append(_determinism(lambda: recorded.kernel.train(first).y,
                                  recorded.kernel.capabilities().deterministic, "the recorded inputs"))
    notes += unseen
    return DoctorReport(run.kernel, fmt, items, diagnosis, notes, run.label, params=ci.params,
                        inputs=(run.label,))

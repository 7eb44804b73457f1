"""bnprobe doctor --norm layer|rms|group|instance: the checklist of a LayerNorm, RMSNorm, GroupNorm or InstanceNorm
kernel, with the known defect each failure reproduces.

The kernel runs on the layer's designed inputs (:mod:`.family_inputs`) and the user's, each in training forward
and backward; every output (y, the saved mean and rstd, dx, dγ, dβ) is judged by compare-precision's judge on the
same call (:func:`~bnprobe.checks.compare.precision.judge_call`: the FP64 golden, msprobe's benchmark against the
careful kernel, the bounds of a correct kernel's accumulation per row and per parameter), grouped into the
checklist's items: the forward y, the saved statistics, the backward.  A failing output is named by the defect
models of :mod:`.family_bugs` whose emulation reproduces it on every input it fails on, bit for bit or within the
judge's bound of it (each naming says which); where none does, nothing is named and the judge's words say what is
wrong."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import Saved, outputs_only, params_format
from bnprobe.adapters.convention import reference_for
from bnprobe.adapters.emulated import careful_family_policy
from bnprobe.checks.compare.precision import CallOptions, judge_call
from bnprobe.checks.doctor.diagnosis import determinism_item, epsilon_item
from bnprobe.checks.doctor.family_bugs import FamilyBug, model_outputs, models_of, reproduced_by
from bnprobe.checks.doctor.family_inputs import family_probes, family_user_probe
from bnprobe.checks.doctor.inputs import GENERATED, USER
from bnprobe.checks.doctor.report import DoctorReport, Item
from bnprobe.core.call import EPS, NORM_NAMES, NORMS
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.engine.cases import Case
from bnprobe.engine.recorded import check_params, given_to
from bnprobe.engine.result import Verdict
from bnprobe.engine.family import per_row_element
from bnprobe.engine.run import Golden, generated_call, run_call
from bnprobe.inputs import SEED
from bnprobe.kernels.layout import NormShape

__all__ = ["doctor_family", "FAMILY_GROUPS", "JUDGED_FORMATS"]

#: the formats compare-precision's judge (msprobe's benchmark method) judges
JUDGED_FORMATS = ("fp16", "bf16", "fp32")
#: the checklist's groups of outputs: (item, what its outputs are, the outputs)
FAMILY_GROUPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "forward": ("forward: y = (x − μ)·rstd·γ + β, rstd = 1/√(var + ε) per row", "outputs y", ("y",)),
    "saved": ("saved statistics: per row the mean and 1/√(var + ε)", "saved mean and rstd",
              ("saved_mean", "saved_rstd")),
    "backward": ("backward: dx, dγ, dβ", "gradients", ("dx", "dgamma", "dbeta")),
}
_RMS_NAMES = {"forward": ("forward: y = x·rstd·γ, rstd = 1/√(mean(x²) + ε) per row", "outputs y"),
              "saved": ("saved statistics: per row 1/√(mean(x²) + ε)", "saved rstd"),
              "backward": ("backward: dx, dγ", "gradients")}


@dataclass
class _Input:
    """One designed input's run: its call, the kernel's and the golden's outputs, compare-precision's row of each
    and the judge's bounds, the statistics the kernel saved, and the bug models' outputs on it, each model run when
    first asked for."""

    case: Case
    rec: Any
    golden: Golden
    modes: tuple[str, ...]
    got: dict[str, Any]
    gold: dict[str, Any]
    rows: dict[str, dict[str, Any]]
    bounds: dict[str, tuple[np.ndarray, str]]  # per output, the judge's bound of a correct kernel, one per element
    saved: Saved | None  # the statistics the kernel's forward saved (its backward's)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def failing(self, tensor: str) -> bool:
        return tensor in self.rows and self.rows[tensor]["verdict"] == Verdict.FAIL

    def model(self, key: str, policy: Any, part: str) -> dict[str, Any]:
        """A bug model's outputs of its forward or backward (``part``) on this input
        (:func:`~.family_bugs.model_outputs`, run once, kept under ``key``)."""
        if key not in self.runs:
            self.runs[key] = model_outputs(policy, self.rec, self.modes, self.saved, part)
        return self.runs[key]


@dataclass(frozen=True)
class _Naming:
    """What the bug models are tried with: the careful kernel's policy in the run's formats, the kernel's declared
    thread count, the layer and the run's format."""

    careful: Any
    threads: int | None
    norm: str
    fmt: str

    def bugs(self, tensor: str) -> list[FamilyBug]:
        """The models that change ``tensor`` and are defects of this layer in this format."""
        return models_of(tensor, self.norm, self.fmt)


def _reproduced(bug: FamilyBug, run: _Input, tensor: str, n: _Naming) -> tuple[str, int | None] | None:
    """How ``bug``'s model reproduces ``tensor`` on this input (:func:`~.family_bugs.reproduced_by`) and the thread
    count it took, or None."""
    return reproduced_by(bug, tensor, run.got[tensor], run.gold[tensor], run.rows[tensor]["format"],
                         run.bounds.get(tensor), careful=n.careful, threads=n.threads, outputs=run.model)


@dataclass(frozen=True)
class _Match:
    """A model that reproduces an output on every input where it fails: how, input by input, and the thread counts
    it took there."""

    bug: FamilyBug
    hows: tuple[str, ...]
    threads: tuple[int, ...]


def _how(matches: list[_Match]) -> str:
    """How a model reproduces the outputs (``matches``: its own, one per output), in words: bit for bit, within the
    judge's bound, or each on so many of the failing outputs; and the thread counts it took."""
    hows = [h for m in matches for h in m.hows]
    said = dict.fromkeys(hows)
    text = next(iter(said)) if len(said) == 1 else \
        ", ".join(f"{h} on {hows.count(h)} of {len(hows)} failing outputs" for h in said)
    threads = dict.fromkeys(t for m in matches for t in m.threads)
    return text + (f"; {'/'.join(map(str, threads))} thread(s)" if threads else "")


def _named(tensor: str, failing: list[_Input], n: _Naming) -> list[_Match]:
    """The models that reproduce ``tensor`` on every input where it fails (input by input, a model dropped at the
    first input it does not reproduce)."""
    out = []
    for bug in n.bugs(tensor):
        found = []
        for run in failing:
            r = _reproduced(bug, run, tensor, n)
            if r is None:
                break
            found.append(r)
        else:
            out.append(_Match(bug, tuple(h for h, _ in found),
                              tuple(dict.fromkeys(t for _, t in found if t is not None))))
    return out


def _why(row: dict[str, Any]) -> str:
    """The judge's words on a failing output, without compare-precision's naming of it (doctor names it with every
    model that reproduces it on every input, or says that nothing does)."""
    return str(row["why"]).split("; not named: ")[0].split("; it matches the model of: ")[0]


def _naming_phrases(tensors: tuple[str, ...], runs: list[_Input], n: _Naming) -> tuple[list[str], list[str]]:
    """Per failing output, the models that reproduce it, in words (outputs named alike said together) — or that
    none does; and the models' words."""
    failing = [r for r in runs if any(r.failing(t) for t in tensors)]
    by_models: dict[tuple[str, ...], list[tuple[str, list[_Match]]]] = {}
    for t in tensors:
        bad = [r for r in runs if r.failing(t)]
        if bad:
            ms = _named(t, bad, n)
            where = f" (on {len(bad)} of them)" if len(bad) < len(failing) else ""
            by_models.setdefault(tuple(m.bug.id for m in ms), []).append((t + where, ms))
    phrases, words = [], []
    for ids, outs in by_models.items():
        who = " and ".join(t for t, _ in outs)
        if not ids:
            phrases.append(f"{who}: no bug model reproduces {'it' if len(outs) == 1 else 'them'}")
            continue
        ms = outs[0][1]
        said = [f"{m.bug.words(n.fmt)}, {_how([f for _, found in outs for f in found if f.bug is m.bug])}"
                for m in ms]
        phrases.append(f"{who} match{'es' if len(outs) == 1 else ''} the model of: {' | '.join(said)}")
        words += [m.bug.words(n.fmt) for m in ms]
    return phrases, words


def _group_item(group: str, runs: list[_Input], n: _Naming) -> tuple[Item, list[str]] | None:
    """One checklist item over every input, and the models it names (None when the kernel returns none of the
    group's outputs)."""
    name, what, tensors = FAMILY_GROUPS[group]
    name, what = _RMS_NAMES[group] if n.norm == "rms" else (name, what)
    tensors = tuple(t for t in tensors if any(t in r.rows for r in runs))
    if not tensors:
        return None
    judged = [(r, t) for r in runs for t in tensors if t in r.rows]
    failing = [r for r in runs if any(r.failing(t) for t in tensors)]
    fmts = ", ".join(dict.fromkeys(r.rows[t]["format"] for r, t in judged))
    if not failing:
        worst, wt = max(judged, key=lambda rt: _share(rt[0].rows[rt[1]]))
        where = (f"on {len(runs)} inputs", f", on {worst.case.name}") if len(runs) > 1 else \
            (f"on {runs[0].case.name}", "")
        return Item(name, "PASS", f"{what} pass compare-precision's judge {where[0]} (the closest to failing: {wt} "
                                  f"at {100 * _share(worst.rows[wt]):.3g}% of its bound{where[1]}; {fmts})"), []
    phrases, words = _naming_phrases(tensors, runs, n)
    head = (f"{what} fail compare-precision's judge on {len(failing)} of {len(runs)} input(s) "
            f"({', '.join(r.case.name for r in failing)}); " + "; ".join(phrases))
    details = tuple(f"on {r.case.name}: {t} ({r.rows[t]['format']}): {_why(r.rows[t])}" for r in failing
                    for t in tensors if r.failing(t))
    words = list(dict.fromkeys(words))
    return Item(name, "FAIL", head, tuple(words), details), words


def _share(row: dict[str, Any]) -> float:
    """An output's score against its bound (0 where the judge measures nothing)."""
    with np.errstate(all="ignore"):
        v = float(row["score"]) / float(row["bound"])
    return v if math.isfinite(v) else 0.0


def _kernel_for(adapter: str | KernelAdapter, options: CallOptions, dtype: str | None) -> tuple[KernelAdapter, str]:
    """The kernel and the format to diagnose ``options.norm`` in (default: the first of fp16, bf16, fp32 it runs),
    or a one-line refusal: a recording, a kernel that does not run the layer, a format or outputs the judge does
    not judge, running statistics' options."""
    layer = NORM_NAMES[options.norm]
    a, recorded = given_to(adapter)
    if recorded is not None:
        raise BNProbeError(f"{layer} from a dump is not read yet: doctor a dump's BatchNorm calls, or "
                           f"{named('norm')} {options.norm} on its designed inputs")
    caps = a.capabilities()
    if options.norm not in caps.norms:
        runs = ", ".join(NORM_NAMES[m] for m in NORMS if m in caps.norms)
        raise BNProbeError(f"adapter {a.name} runs {runs} only, not {layer}: name one that does (careful, "
                           "emulated[:<policy>], torch)")
    if options.momentum is not None:
        raise BNProbeError(f"{named('momentum')} is BatchNorm's running statistics' weight: {layer} keeps none")
    if "train" not in caps.modes:
        raise BNProbeError(f"adapter {a.name} runs inference only: doctor judges {layer}'s training forward (its "
                           "inference is the same forward) and backward")
    fmt = get_format(dtype).name if dtype else next((f for f in JUDGED_FORMATS if f in caps.formats), "fp64")
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    if fmt not in JUDGED_FORMATS or caps.output == "fp64":
        why = f"{a.name} returns fp64 outputs" if caps.output == "fp64" else f"{fmt} outputs are not judged"
        raise BNProbeError(f"{why}: compare-precision's judge (msprobe's benchmark method) judges fp16, bf16 and "
                           f"fp32 outputs, so doctor {named('norm')} {options.norm} runs a kernel in one of them "
                           "(e.g. --adapter torch --dtype fp16)")
    return a, fmt


def _run_input(a: KernelAdapter, ref: KernelAdapter, case: Case, fmt: str, params: str,
               modes: tuple[str, ...]) -> _Input:
    """The kernel on one input against the golden, each output judged by compare-precision's judge."""
    call = case.call
    rec = generated_call(call.with_(dtype=fmt, params=params), modes=modes, label=case.name)
    golden = Golden(ref, rec)
    run = run_call(a, rec, label=case.name, golden=golden, quiet=True)
    models: dict[str, dict[str, Any]] = {}  # (the bug models' outputs: compare-precision's naming runs them first)
    rows = {r["tensor"]: r for r in judge_call(a, rec, modes, label=case.name, run=run, golden=golden,
                                               models=models)}
    bounds = {k: (per_row_element(rec.call(), b) if k == "dx" else b, words) for k, (b, words) in run.bounds.items()}
    return _Input(case, rec, golden, modes, dict(run.got), dict(run.gold), rows, bounds, run.saved, models)


def doctor_family(adapter: str | KernelAdapter, dtype: str | None = None, *, options: CallOptions,
                  seed: int | None = None, stability: bool = True, x: np.ndarray | None = None,
                  generated: np.ndarray | None = None) -> DoctorReport:
    """The checklist of ``adapter`` for the layer ``options.norm`` (with its ``normalized_shape`` or ``groups``, ε
    and parameter format) in ``dtype`` (default: the first of fp16, bf16, fp32 it runs) on the layer's designed
    inputs — the plain one, then the stress inputs (``stability``) — and ``x`` (the user's tensor) and ``generated``
    when given; ``seed`` (default 0) draws them."""
    a, fmt = _kernel_for(adapter, options, dtype)
    check_params(options.params)
    norm, layer = options.norm, NORM_NAMES[options.norm]
    seed = SEED if seed is None else seed
    eps = EPS if options.eps is None else options.eps
    prm = options.params or "fp32"
    shape = dict(normalized_shape=options.normalized_shape, groups=options.groups)
    todo = family_probes(norm, seed, stress=stability, **shape)
    todo += [family_user_probe(v, norm, name, seed, **shape) for v, name in ((x, USER), (generated, GENERATED))
             if v is not None]
    todo = [replace(c, call=c.call.with_(eps=eps)) for c in todo]
    caps = a.capabilities()
    modes = tuple(m for m in ("train", "backward") if m in caps.modes)
    ref, a = outputs_only(reference_for(a)), outputs_only(a)
    runs = [_run_input(a, ref, c, fmt, prm, modes) for c in todo]
    n = _Naming(careful_family_policy(fmt, params_format(fmt, prm)), caps.threads, norm, fmt)
    items, diagnosis = [], []
    for group in FAMILY_GROUPS:
        made = _group_item(group, runs, n)
        if made is not None:
            items.append(made[0])
            diagnosis += [w for w in made[1] if w not in diagnosis]
    first = todo[0].call.with_(dtype=fmt, params=prm)
    items.append(epsilon_item(a, first.x, fmt, eps, prm))
    items.append(determinism_item(lambda: a.train(first).y, caps.deterministic))
    rs = sorted({NormShape.of(norm, r.case.shape, **shape).r for r in runs})
    notes = [f"{layer}: statistics per row of {', '.join(map(str, rs))} values; its inference is its training "
             "forward (no running statistics), judged as y"]
    if "backward" not in modes:
        notes.append(f"{a.name} runs the forward only: its backward (dx, dgamma, dbeta) is not judged")
    if x is not None and not np.isfinite(x).all():
        notes.insert(0, f"your input holds {int(np.size(x) - np.isfinite(x).sum())} NaN/inf value(s) of "
                        f"{np.size(x)}: outputs that depend on them are non-finite in the golden too")
    return DoctorReport(a.name, fmt, items, diagnosis, notes, params=prm, inputs=tuple(c.name for c in todo),
                        layer=layer)

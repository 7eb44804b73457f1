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

Given a recording (a :class:`~bnprobe.engine.recorded.Recorded`) in place of the kernel, each call's recorded
outputs are judged the same way on its own inputs; a runnable kernel given a recording as input also gets the
checklist on the diagnostic and stress inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM
from bnprobe.adapters import KernelAdapter
from bnprobe.adapters.base import outputs_only, params_format, stored_inputs
from bnprobe.adapters.convention import reference_for
from bnprobe.core.call import BNCall
from bnprobe.checks.doctor.bugs import (
    BIASED_RUNNING, ELEMENTWISE, GROUPS, TRAIN_RUNNING, describe,
    model, names_a_bug,
)
from bnprobe.engine.cases import Case
from bnprobe.engine.recorded import PerCall, Recorded, check_options, check_params, given_to, only_call
from bnprobe.engine.result import Verdict
from bnprobe.engine.run import CallRun, Golden, each_run, generated_call, run_call
from bnprobe.engine.rules import channel_rule
from bnprobe.core.conventions import convention_of
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import modes_left_out
from bnprobe.inputs import SEED
from bnprobe.kernels.layout import reduce_axes, to_channels_first
from bnprobe.numerics.rounding import round_to
from bnprobe.core.tolerances import MSPROBE_STANDARDS
from bnprobe.checks.doctor.inputs import GENERATED, USER, probes, user_probe
from bnprobe.checks.doctor.items import (
    BugModels,
    Check,
    checklist_items,
    judge_group,
    output_scales,
    returned_format,
)
from bnprobe.checks.doctor.report import DoctorReport, Item


__all__ = ["Item", "DoctorReport", "doctor", "probes", "SKIPPED_ON_RECORDINGS", "epsilon_item", "determinism_item"]

# ---- running the kernel on one input ------------------------------------------------------------------

def _probe_checks(a: KernelAdapter, ref: KernelAdapter, p: Case, fmt: str, params: str) -> dict[str, Check]:
    if p.steps:
        return _steps_checks(a, ref, p, fmt, params)
    caps = a.capabilities()
    r = p.call.x.size // p.call.x.shape[1]
    modes = ("train", "infer", "backward") if r > 1 else ("infer",)
    modes = tuple(m for m in modes if m in caps.modes)  # those it runs (the others are named in the report's notes)
    if not modes:
        return {}
    conv = caps.convention
    rec = generated_call(p.call.with_(dtype=fmt, params=params), modes=modes, label=p.name)
    golden = Golden(ref, rec)
    run = run_call(a, rec, label=p.name, golden=golden)
    ci = run.inputs
    x = ci.x
    vec = {k: np.asarray(getattr(ci, k), dtype=np.float64) for k in ("gamma", "beta", "running_mean", "running_var")}
    dy = ci.dy if ci.dy is not None else np.zeros_like(x)
    bn = BNCall(x, vec["gamma"], vec["beta"], vec["running_mean"], vec["running_var"], dy, eps=p.call.eps,
                momentum=p.call.momentum)
    got, gold, formats = run.invstd_view()
    got = {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}
    shared: dict[Any, np.ndarray] = {}  # what no bug model changes, computed once for this input
    models = BugModels(lambda bug, recipe=None: model(bn, bug=bug, recipe=recipe, convention=conv, shared=shared),
                       stored=_stored(bn, got, convention=conv), convention=conv)
    checks = judge_group(p.name, got, gold, formats, output_scales(run, x), models=models,
                         ranges=p.name in (USER, GENERATED), bounds=run.bounds)
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

    if get_format(rec.dtype).name not in MSPROBE_STANDARDS or rec.layout != "channels_first":
        return checks
    rows = {r["tensor"]: r for r in judge_call(a, rec, modes, label=label, run=run, golden=golden)}
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
        # what names each failing output: a recipe model, or identify's recipe for the kernel (reproduced on the call);
        # not a bug's model, which the doctor fits itself on every input
        c.causes = [v["named"] for v in failing if v.get("named") and not names_a_bug(v.get("cause"))]
        c.unnamed = [v["unnamed"] for v in failing if v.get("unnamed")]
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


def _stored(bn: BNCall, got: dict[str, np.ndarray], convention: str = "torch",
            ) -> Callable[[str | None], dict[str, np.ndarray]] | None:
    """The backward models from the statistics the kernel saved (see :func:`judge_group`), of a training call."""
    if not bn.training or "saved_mean" not in got or "saved_invstd" not in got:
        return None
    saved, shared = (got["saved_mean"], got["saved_invstd"]), {}
    return lambda bug: model(bn, bug=bug, saved=saved, convention=convention, shared=shared)


def _steps_checks(a: KernelAdapter, ref: KernelAdapter, p: Case, fmt: str, params: str) -> dict[str, Check]:
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
                m = model(BNCall(xb, g, b, rm, rv, np.zeros_like(xb), eps=p.call.eps, momentum=p.call.momentum),
                          bug=bug, recipe=recipe, convention=caps.convention)
                rm, rv = round_to(m["running_mean"], pf), round_to(m["running_var"], pf)
            m = model(BNCall(x, g, b, rm, rv, np.zeros_like(x), eps=p.call.eps, momentum=p.call.momentum), bug=bug,
                      recipe=recipe, convention=caps.convention)
            return {"running_mean": rm, "running_var": rv, "y_eval": m["y_infer"]}

        out_fmt, vec_fmt = caps.output or fmt, "fp64" if caps.output == "fp64" else pf
        got = {"running_mean": k_rm, "running_var": k_rv, "y_eval": y}
        gold = {"running_mean": g_rm, "running_var": g_rv, "y_eval": gy}
        formats = {k: returned_format(v, out_fmt if k == "y_eval" else vec_fmt) for k, v in got.items()}
        ax = reduce_axes(x)
        mean_abs = np.max([np.abs(bt).mean(axis=ax) for bt in batches], axis=0)
        natural = {"running_mean": np.maximum(np.abs(g_rm), p.call.momentum * mean_abs),
                   "y_eval": np.abs(g) / np.sqrt(g_rv + p.call.eps) * (np.abs(x).mean(axis=ax) + np.abs(g_rm))
                   + np.abs(b)}
    got = {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}
    return judge_group(p.name, got, {k: np.asarray(v, dtype=np.float64) for k, v in gold.items()}, formats, natural,
                       models=BugModels(models, convention=caps.convention))


def doctor(adapter: str | KernelAdapter | Recorded = "reference", dtype: str | None = None, *,
           seed: int | None = None, stability: bool = True, params: str | None = None, x: np.ndarray | None = None,
           eps: float | None = None, momentum: float = MOMENTUM, generated: np.ndarray | None = None,
           recipe: bool = False) -> DoctorReport | PerCall:
    """Run the checklist on ``adapter`` in ``dtype`` (default: fp64 when it runs it, else its first format)
    with parameters (γ, β, running and saved statistics) in fp32 or the input's format (``params`` same), on
    the diagnostic input, the stress inputs (``stability``), ``x`` (the user's tensor) and ``generated`` (an input
    made from the command line's shape and distribution) when given, every one with BatchNorm's ``eps`` (default
    1e-5) and ``momentum``; ``seed`` (default 0) draws the designed inputs.  ``recipe``: when something fails, also
    identify the kernel's numerical recipe (:func:`~bnprobe.checks.identify.search.identify`) and, where it is
    reproduced bit for bit, name its choices known to lose accuracy in the diagnosis.

    Given a recording (a :class:`~bnprobe.engine.recorded.Recorded`, e.g. from
    :func:`~bnprobe.engine.recorded.recording_of`) in place of the kernel, the checklist runs on every selected call
    of it, on the call's own recorded inputs and scalars: a :class:`~bnprobe.engine.recorded.PerCall` of one
    :class:`DoctorReport` per call.  A dump adapter of one call is diagnosed on its recorded inputs (its one
    report).  The options of generated input contradict a recording."""
    a, recorded = given_to(adapter)
    check_params(params)
    if recorded is not None:
        if recorded is not adapter:
            only_call(recorded, "doctor")
        _takes_its_own(recorded, x is not None or generated is not None,
                       eps is not None and eps != EPS or momentum != MOMENTUM, recipe)
        run = _doctor_calls(recorded, dtype=dtype, params=params, stability=stability)
        return run if recorded is adapter else run.results[0]
    seed, eps = SEED if seed is None else seed, EPS if eps is None else eps
    caps = a.capabilities()
    fmt = get_format(dtype).name if dtype else ("fp64" if "fp64" in caps.formats else caps.formats[0])
    if fmt not in caps.formats:
        raise BNProbeError(f"adapter {a.name} does not run {fmt} (it runs {', '.join(caps.formats)})")
    prm = params or "fp32"
    todo = probes(seed, stress=stability) + ([user_probe(x, seed)] if x is not None else []) \
        + ([user_probe(generated, seed, GENERATED)] if generated is not None else [])
    todo = [replace(p, call=p.call.with_(eps=eps, momentum=momentum)) for p in todo
            if not p.steps or {"train", "infer"} <= set(caps.modes)]  # (steps need both: else not an input here)
    ref = outputs_only(reference_for(a))  # the golden in the kernel's convention
    a = outputs_only(a)  # only outputs are compared: no intermediates kept (on a copy: the caller's is unchanged)
    checks: list[dict[str, Check]] = []
    left_out = modes_left_out(a.name, caps.modes)  # an inference-only kernel's training and backward, by name
    notes: list[str] = [] if left_out is None else [left_out]
    for p in todo:
        try:
            checks.append(_probe_checks(a, ref, p, fmt, prm))
        except BNProbeError as exc:
            notes.append(f"{p.name} not run: {exc}")
    items, diagnosis, more = checklist_items(checks, "")
    notes += more
    diag = todo[0]
    if "train" not in caps.modes:
        pass  # (no training forward: no running statistics to update; the notes say it is not judged)
    elif convention_of(a).cumulative:
        items.append(_momentum_none(a, ref, diag, fmt, prm))
    else:
        notes.append(f"momentum=None (torch's cumulative average) is not in the {convention_of(a).name} convention: "
                     "not checked")
    items.append(epsilon_item(a, diag.call.x, fmt, diag.call.eps, prm))
    items.append(determinism_item(_forward_twice(a, diag, fmt, prm), caps.deterministic))
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


def _momentum_none(a: KernelAdapter, ref: KernelAdapter, p: Case, fmt: str, params: str) -> Item:
    """momentum=None: PyTorch's cumulative average; for a first batch the running stats become the batch's."""
    name = "momentum=None is a cumulative average"
    try:
        rec = generated_call(p.call.with_(dy=None, dtype=fmt, params=params, momentum=None), modes=("train",),
                             label=p.name)
        run = run_call(a, rec, label=p.name, golden=Golden(ref, rec))
    except BNProbeError as exc:
        return Item(name, "WARN", f"not supported: {exc}")
    keys = [k for k in GROUPS["running"] if k in run.got]
    if not keys:
        return Item(name, "WARN", "the kernel returns no running statistics")
    nat = output_scales(run, run.inputs.x)
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


def epsilon_item(a: KernelAdapter, x: np.ndarray, fmt: str, eps: float, params: str) -> Item:
    """eps sane for the format the statistics are computed in."""
    stat_fmt = get_format(a.policy_for(round_to(x, fmt), dtype=fmt, params=params).accumulate) \
        if a.capabilities().staged else get_format("fp64" if fmt == "fp64" else "fp32")
    name = "epsilon is resolvable in the statistics' format"
    if eps < stat_fmt.eps / 2:
        return Item(name, "WARN", f"eps {eps:g} is below half the {stat_fmt.name} spacing at 1 "
                                  f"({stat_fmt.eps / 2:.3g}): var + eps == var for var >= 1, so eps only acts on "
                                  "small variances")
    return Item(name, "PASS", f"eps {eps:g} vs {stat_fmt.name} spacing at 1 {stat_fmt.eps:.3g}")


def determinism_item(run: Callable[[], Any], declared: bool, inputs: str = "the same inputs") -> Item:
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


def _forward_twice(a: KernelAdapter, p: Case, fmt: str, params: str) -> Callable[[], Any]:
    """The training forward of ``a`` on the probe's inputs, as stored in ``fmt`` and ``params`` (the inference
    forward of a kernel that runs inference only)."""
    c = p.call
    x, _, g, b, rm, rv = stored_inputs(fmt, params, c.x, None, c.gamma, c.beta, c.running_mean, c.running_var)
    step = BNCall(x, g, b, rm, rv, eps=c.eps, momentum=c.momentum, dtype=fmt, params=params)
    if "train" not in a.capabilities().modes:
        return lambda: a.infer(step.with_(training=False)).y
    return lambda: a.train(step).y


# ---- recorded calls ---------------------------------------------------------------------------------

SKIPPED_ON_RECORDINGS = (
    "momentum=None is a cumulative average (needs a rerun with momentum=None)",
    "determinism (needs a second run on the same inputs)",
    "the checklist on the diagnostic and stress inputs (needs runs on other data)",
)


def _takes_its_own(recorded: Recorded, inputs: bool, scalars: bool, recipe: bool) -> None:
    """A recording brings its calls' inputs (``inputs``: others were given too), eps and momentum (``scalars``:
    others given), and is not probed (``recipe``: identify's search on designed probes was asked for)."""
    source = recorded.calls.source
    if inputs:
        raise BNProbeError(f"{named('x')} and the recording {source} both give the inputs: drop {named('x')}")
    if scalars:
        raise BNProbeError(f"the recording {source} holds its calls' eps and momentum: drop "
                           f"{named('eps')}/{named('momentum')}")
    if recipe:
        raise BNProbeError(f"{named('recipe')} identifies a kernel on designed probes: for a recording run identify "
                           "on it (each call on its own inputs)")


def _doctor_calls(recorded: Recorded, *, dtype: str | None = None, params: str | None = None,
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
    return PerCall.of("doctor", recorded, reports, notes)


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
    bn = BNCall(x, g, b, rm, rv, np.zeros_like(x) if dy is None else dy, eps=eps,
                momentum=MOMENTUM if mom is None else mom, training=rec.training)
    shared: dict[Any, np.ndarray] = {}  # what no bug model changes, computed once for this call
    models = BugModels(lambda bug, recipe=None: model(bn, bug=bug, recipe=recipe, convention=conv, shared=shared),
                       skip=() if have_running else (TRAIN_RUNNING,), stored=_stored(bn, got, conv), convention=conv)
    checks = judge_group(run.label, got, gold, formats, output_scales(run, x), models=models, bounds=run.bounds)
    if rec.training and _compared_training(rec):
        checks = _as_compare(checks, recorded.kernel, rec, run.modes, run.label, run=run)
    items, diagnosis, unseen = checklist_items([checks], "on the recorded inputs", unseen=True)
    if rec.training and "train" in run.modes and "running_mean" not in run.got:
        notes.append("the updated running statistics are not in the recording: their momentum and unbiased "
                     "variance are not checked")
    if "backward" not in rec.tensors:
        notes.append("no backward recorded: the gradients are not checked")
    items.append(epsilon_item(recorded.kernel, x, fmt, eps, ci.params))
    if not recorded.replay and "train" in run.modes:
        ins = rec.tensors["train"]["inputs"]
        first = BNCall(ins["x"], ins.get("gamma"), ins.get("beta"), eps=eps, dtype=fmt, params=ci.params,
                       layout=layout)
        items.append(determinism_item(lambda: recorded.kernel.train(first).y,
                                  recorded.kernel.capabilities().deterministic, "the recorded inputs"))
    notes += unseen
    return DoctorReport(run.kernel, fmt, items, diagnosis, notes, run.label, params=ci.params,
                        inputs=(run.label,))

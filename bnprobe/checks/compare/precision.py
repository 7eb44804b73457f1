"""compare-precision: every output of BatchNorm in each format against the FP64 golden on the same
rounded inputs, per tensor, per channel, and per stage (an error budget).

Each output answers two questions (the rules are :mod:`bnprobe.engine.rules`'): is this kernel as accurate
as a careful kernel in the same formats — the verdict, by default msprobe's *benchmark* method against a
bench (``careful``) run on the same inputs — and is the format adequate for this data — a *format
warning*: the bench's own output by msprobe's absolute ``scaled`` rule, with what explains it.  ``rule``
(``scaled``, ``accumulated``, ``threshold``) makes the verdict one of msprobe's absolute rules instead.
The kernels run on the engine (:mod:`bnprobe.engine.run`); the inputs are :mod:`bnprobe.engine.cases`'.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.adapters import KernelAdapter, Saved, get_adapter
from bnprobe.adapters.registry import as_adapter
from bnprobe.adapters.base import MODES, outputs_only, params_format
from bnprobe.adapters.convention import bench_for, reference_for
from bnprobe.core.call import EPS, MOMENTUM, NORM_NAMES, BNCall
from bnprobe.core.conventions import convention_of, get_convention
from bnprobe.engine.budget import BUDGET_CHANNELS, budget_cause, error_budget
from bnprobe.engine.cases import Case, family_cases, make_dy, recorded_cases, resnet50_cases, stress_cases
from bnprobe.engine.family import per_row_element
from bnprobe.engine.recipes import RECIPES, recipe_fits
from bnprobe.adapters.emulated import EmulatedAdapter, PolicyAdapter, careful_family_policy
from bnprobe.checks.compare.identified import (
    CAUSE,
    Choice,
    attribute,
    choices_differing,
    resettable,
    with_choices,
)
from bnprobe.checks.doctor.bugs import BUGS, bugs_changing, describe
from bnprobe.checks.doctor.bugs import model as bug_model
from bnprobe.checks.doctor.family_bugs import model_outputs, models_of, reproduced_by
from bnprobe.checks.identify.kernels import Known, known
from bnprobe.kernels.policy import Policy, get_policy
from bnprobe.engine.result import Judged, Verdict
from bnprobe.engine.rules import (
    RULES,
    BenchOutput,
    absolute,
    benchmark_of,
    greatest_error,
    nonfinite_mismatch,
    output_shares,
    versus_bench,
    within_accumulation,
    within_bound,
    within_rounding,
)
from bnprobe.engine.run import (
    CallCollector,
    OUTPUT_MODE,
    CallRun,
    Golden,
    generated_call,
    run_call,
    running_stats,
    y_natural,
)
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.core.kernel import inference_alone, modes_left_out, needs_modes, one_value_per_channel, one_value_per_row
from bnprobe.guard import release_free_memory
from bnprobe.inputs import make_params
from bnprobe.kernels.layout import NormShape, layout_of
from bnprobe.engine.metrics import compare, ulp_error
from bnprobe.recordings import Recording
from bnprobe.core.tolerances import MSPROBE_STANDARDS, Standard

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["CallOptions", "Judging", "CompareResult", "compare_precision", "judge_call", "summarize", "per_call",
           "first_failing_call", "worse_rows", "COMPARE_MODES"]

ELEMENTWISE = ("y", "y_infer", "dx")


@dataclass(frozen=True)
class CallOptions:
    """The scalars and parameter format compare-precision runs the generated calls with: ``eps``, ``momentum`` and
    ``params`` (``same`` as x, or ``fp32``); None: each case's own.  A recorded call runs as recorded, and these,
    where given, must agree with it."""

    eps: float | None = None
    momentum: float | None = None
    params: str | None = None
    # the layer the generated calls are (BatchNorm, or LayerNorm, RMSNorm, GroupNorm, InstanceNorm with what places
    # their statistics: normalized_shape, default the last dim; groups)
    norm: str = "batch"
    normalized_shape: tuple[int, ...] | None = None
    groups: int | None = None


@dataclass(frozen=True)
class Judging:
    """How compare-precision judges each output: by ``rule`` (:data:`~bnprobe.engine.rules.RULES`; ``benchmark``:
    msprobe's benchmark method against the outputs of ``bench``, a kernel bnprobe runs, e.g. careful or torch), with
    ``standards`` per format (None: msprobe's)."""

    rule: str = "benchmark"
    bench: str | KernelAdapter | None = "careful"
    standards: dict[str, Standard] | None = None


@dataclass(frozen=True)
class _Judging:
    """How every row of a run is judged: the standards, the rule, and the bench's name."""

    standards: dict[str, Standard] | None
    rule: str
    bench_name: str = ""


@dataclass(frozen=True)
class _Place:
    """Where a row's output comes from: the adapter, the format, the case and the output's name."""

    adapter: str
    dtype: str
    case: Case
    tensor: str


def _row(j: _Judging, at: _Place, actual: Any, golden: Any, fmt: str, *, scale: np.ndarray | None = None,
         bench: Any = None, explain: str = "", natural: Callable[[], np.ndarray] | None = None,
         cancel: tuple[np.ndarray, str] | None = None) -> dict[str, Any]:
    """One output's row: msprobe's metrics; the kernel verdict (by default msprobe's benchmark method against
    the bench's output, else the absolute ``rule`` on the kernel's output); the format check — is the format
    adequate for this data: the bench's output (a careful kernel in the same formats) by the absolute scaled
    rule, or the kernel's own output when there is no bench — with what explains a format that falls short."""
    standards, rule, bench_name = j.standards, j.rule, j.bench_name
    adapter, dtype, case, tensor = at.adapter, at.dtype, at.case, at.tensor
    kind = "elementwise" if tensor in ELEMENTWISE else "reduction"
    m = compare(actual, golden, fmt)
    if rule != "benchmark":
        ok_abs, why_abs, score_abs, bound_abs = absolute(actual, golden, fmt, rule, standards, scale)
    if isinstance(bench, BenchOutput):
        if bench.format_check is None:
            bench.format_check = absolute(bench.value, golden, fmt, "scaled", standards, scale)
        f_ok, f_why, f_score, f_bound = bench.format_check
    elif rule == "scaled":  # no bench: the kernel's own output, already judged by this rule
        f_ok, f_why, f_score, f_bound = ok_abs, why_abs, score_abs, bound_abs
    else:
        f_ok, f_why, f_score, f_bound = absolute(actual, golden, fmt, "scaled", standards, scale)
    extra: dict[str, Any] = {}
    if rule == "benchmark":
        b = benchmark_of(actual, bench, golden, fmt, dev=m.checker_metrics)
        # msprobe's metrics leave non-finite elements out: NaN/inf the golden has not is judged here
        broken = nonfinite_mismatch(actual, golden, fmt)
        ok = b.result != "error" and not broken
        ratios = ", ".join(f"{k} {v:.3g}/{b.limits[k]:g}" for k, v in b.ratios.items() if k in b.limits)
        why = broken or (f"{'within' if ok else 'over'} msprobe's benchmark vs {bench_name} (ratio/limit: {ratios})"
                         + (f"; {b.problem}" if b.problem else "")
                         + ("" if ok else greatest_error(actual, bench.value if isinstance(bench, BenchOutput)
                                                        else bench, golden, bench_name)))
        score, bound = (math.inf if broken else float(b.needed)), 1.0
        terms = math.prod(case.shape) // max(np.size(golden), 1)
        if not ok and not broken and ((within := within_accumulation(tensor, actual, golden, fmt, scale, terms))
                                      or (within := within_rounding(b, actual, golden, fmt, natural))
                                      or (within := within_bound(actual, golden, fmt, cancel))):
            ok, score, why = True, within[0], f"{within[1]} (msprobe's benchmark alone would fail it: {ratios})"
        extra = {f"bench_{k}": v for k, v in b.ratios.items()}
    else:
        ok, why, score, bound = ok_abs, why_abs, score_abs, bound_abs
    if isinstance(bench, BenchOutput) and actual is not bench.value and \
            (vs := versus_bench(actual, bench.value, golden, fmt)) is not None:
        extra.update(rmse_vs_bench=vs.rmse_ratio, max_vs_bench=vs.max_ratio,
                     worse=vs.worse(bench_name, f"it passes: {why}" if ok else "it fails"))
    std = (standards or MSPROBE_STANDARDS).get(get_format(fmt).name)
    ulp = m.ulps if m.ulps is not None else \
        ulp_error(np.asarray(actual, dtype=np.float64), np.asarray(golden, dtype=np.float64), fmt)
    over, small, sub, ovf = output_shares(ulp, golden, fmt, std)
    f = get_format(fmt)
    why_fmt = ""
    if f_ok and ovf:  # ±inf where the golden rounds to it passes every rule: said, never silent
        f_ok, f_why, f_score = False, (f"the golden exceeds {f.name}'s largest value ({f.max:g}) in {100 * ovf:.3g}% "
                                       f"of elements: the format cannot hold this output (±inf there)"), math.inf
    if not f_ok:
        notes = [n for n in (f"{100 * sub:.3g}% of the golden in {f.name}'s subnormal range" if sub else "",
                             f"{100 * ovf:.3g}% beyond {f.name}'s largest value" if ovf else "", explain) if n]
        who = f"{bench_name} (the bench)" if isinstance(bench, BenchOutput) else "this kernel"
        why_fmt = f"{who}: {f_why}" + (f" — {'; '.join(notes)}" if notes else "")
    return {"adapter": adapter, "dtype": dtype, "case": case.name, "shape": "x".join(map(str, case.shape)),
            "tensor": tensor, "format": fmt, "kind": kind, "verdict": Verdict.of(ok), "why": why,
            "score": score, "bound": bound, "format_check": Verdict.OK if f_ok else Verdict.WARN, "format_why": why_fmt,
            "format_score": f_score, "format_bound": f_bound, **extra,
            **{k: v for k, v in m.to_dict().items() if k not in ("worst_index",)},
            "ulp_over_threshold": over, "small_value_share": small, "subnormal_share": sub}


def _channels(adapter: str, dtype: str, case: Case, y: np.ndarray, gy: np.ndarray, *, var: np.ndarray,
              gvar: np.ndarray, gmean: np.ndarray, eps: float, top: int) -> list[dict[str, Any]]:
    """The worst channels of y, with what explains them."""
    a, g = layout_of(y).to_cr(y), layout_of(gy).to_cr(gy)
    with np.errstate(all="ignore"):
        d = np.abs(a - g)
        err = np.where(np.isnan(d), -np.inf, d).max(axis=1)  # NaN for a channel whose error is all NaN
        err = np.where(np.isneginf(err), np.nan, err)
        var_rel = np.abs(np.asarray(var, dtype=np.float64) - gvar) / np.where(gvar > 0, gvar, np.nan)
        m2v = gmean**2 / np.where(gvar > 0, gvar, np.nan)
    r = a.shape[1]
    order = np.argsort(-np.nan_to_num(err, nan=np.inf))[:top]
    return [{"adapter": adapter, "dtype": dtype, "case": case.name, "channel": int(c), "y_max_abs_err": float(err[c]),
             "var_rel_err": float(var_rel[c]), "mean2_over_var": float(m2v[c]), "var_over_eps": float(gvar[c] / eps),
             "R": r} for c in order]


@dataclass
class CompareResult(Judged):
    """compare-precision's result (a :class:`~bnprobe.engine.result.CheckResult`): one row per output judged
    (``rows``, also its ``frame``), the worst channels, the error budget and what the run was (``meta``, whose
    ``notes`` are its ``notes``)."""

    rows: pd.DataFrame
    channels: pd.DataFrame
    budget: pd.DataFrame
    meta: dict[str, Any]

    @property
    def passed(self) -> bool:
        return bool((self.rows["verdict"] == Verdict.PASS).all()) if len(self.rows) else True

    @property
    def notes(self) -> list[str]:
        """What the verdicts cannot show: ``meta``'s notes (the same list)."""
        return self.meta.get("notes", [])

    @property
    def frame(self) -> pd.DataFrame:
        """The outputs' rows (``rows``)."""
        return self.rows

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "passed": self.passed, "rows": self.rows.to_dict(orient="records"),
                "channels": self.channels.to_dict(orient="records"), "budget": self.budget.to_dict(orient="records")}


COMPARE_MODES = (*MODES, "all")  # compare-precision also takes every mode at once


@dataclass
class _CaseCall:
    """One case in one format: the call every adapter runs on, the modes asked of it, and its golden."""

    case: Case
    rec: Recording
    modes: tuple[str, ...]
    golden: Golden
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)  # each recipe's outputs, run when first asked
    # identify's recipes and their variants on this call (:func:`_variant_outputs`): outputs and their formats, or
    # why it could not run
    variants: dict[str, tuple[dict[str, Any], dict[str, str]] | str] = field(default_factory=dict)
    replay: Recording | None = None  # what a dump adapter replays on this call, when it is not a case's

    @property
    def gold_train(self) -> Any:
        """The golden's training forward, for a training call run in train or backward mode (else None)."""
        return self.golden.train_for(self.modes)


def _generated(case: Case, x: np.ndarray, fmt: str, params: str, eps: float, momentum: float | None,
               modes: tuple[str, ...], norm: CallOptions = CallOptions()) -> tuple[Recording, tuple[str, ...]]:
    """A generated case in one format: γ, β from the case's seed, running statistics at the case's mean and
    variance, dy of the case's kind (:func:`~bnprobe.engine.cases.make_dy`); training modes only where N*H*W > 1.
    A family layer's (``norm``'s) call has γ and β of its parameter shape, no running statistics, and no inference
    of its own (its inference is its training forward)."""
    dy = make_dy(case, x.shape)
    if norm.norm != "batch":  # a family layer: γ, β of its parameter shape, no running statistics
        sh = NormShape.of(norm.norm, x.shape, norm.normalized_shape, norm.groups)
        prm = make_params(math.prod(sh.param_shape), case.seed)
        call = BNCall(x, prm["gamma"].reshape(sh.param_shape),
                      None if norm.norm == "rms" else prm["beta"].reshape(sh.param_shape), dy=dy, eps=eps,
                      momentum=momentum, dtype=fmt, params=params, norm=norm.norm,
                      normalized_shape=norm.normalized_shape, groups=norm.groups)
        kept = tuple(m for m in modes if sh.r > 1 and m != "infer")
        return generated_call(call, modes=kept, label=case.name), kept
    lay = layout_of(x)
    c = lay.channels
    prm = make_params(c, case.seed)
    kept = tuple(m for m in modes if m == "infer" or lay.reduce_size > 1)
    call = BNCall(x, prm["gamma"], prm["beta"], np.full(c, case.mean), np.full(c, max(case.std, 1e-3) ** 2), dy,
                  eps, momentum, dtype=fmt, params=params)
    rec = generated_call(call, modes=kept, label=case.name)
    return rec, kept


def _recorded(rec: Recording, modes: tuple[str, ...]) -> tuple[Recording, tuple[str, ...]]:
    """A recorded call's own inputs and scalars: the modes it recorded, in its formats."""
    name = rec.meta.get("call") or rec.source
    if rec.layout != "channels_first":
        raise BNProbeError(f"{name} is recorded {rec.layout}: compare-precision takes channels_first recordings")
    if rec.training and layout_of(rec.call().x).reduce_size < 2:
        raise BNProbeError(f"{name}: a training call with one value per channel (N*H*W = 1) has no batch statistics "
                           "to compare")
    return rec, tuple(m for m in modes if m in rec.tensors and (m != "train" or rec.training))


@dataclass
class _CallNote:
    """A recording's note, said once for every call that carries it (a capture of a compiled model notes every call
    alike): ``calls``, the calls' names in the order they came."""

    text: str
    calls: list[str]

    def __str__(self) -> str:
        who = self.calls
        head = who[0] if len(who) == 1 else f"{len(who)} calls ({', '.join(who[:3])}{', ...' if len(who) > 3 else ''})"
        return f"{head}: {self.text}"


def _note_of_call(notes: list[str | _CallNote], name: str, text: str) -> None:
    """``text``, a note of the recorded call ``name``, in ``notes``: the call added to the note when another call
    carried it already."""
    same = next((n for n in notes if isinstance(n, _CallNote) and n.text == text), None)
    if same is None:
        notes.append(_CallNote(text, [name]))
    else:
        same.calls.append(name)


def _case_calls(case: Case, fmts: list[str], modes: tuple[str, ...], opts: dict[str, Any], ref: KernelAdapter,
                notes: list[str | _CallNote]) -> list[_CaseCall]:
    """A case's calls, one per format (a recorded call: its own, in its format), with what they hold that the
    verdicts cannot see (NaN/inf: the golden is non-finite there too) said in ``notes``."""
    eps, momentum, params = opts["eps"], opts["momentum"], opts["params"]
    if case.recorded is not None:
        rec = case.recorded.load()
        _agree(case.name, rec, eps, momentum, params)
        for n in rec.meta.get("notes", []):
            _note_of_call(notes, case.name, n)
        per_fmt = [_recorded(rec, modes)]
    else:
        x = case.make()
        per_fmt = [_generated(case, x, f, params or "fp32", EPS if eps is None else eps,
                              MOMENTUM if momentum is None else momentum, modes, opts["norm"]) for f in fmts]
    out = []
    for rec, kept in per_fmt:
        cc = _CaseCall(case, rec, kept, Golden(ref, rec))
        call = cc.golden.call
        for what, t in (("x", call.x), ("dy", call.dy)):
            bad = 0 if t is None else int(np.size(t) - np.count_nonzero(np.isfinite(t)))
            if bad:
                notes.append(f"{case.name} ({rec.dtype}): {what} holds {bad} NaN/inf value(s) of {np.size(t)}; "
                             "outputs that depend on them are non-finite in the golden too")
        out.append(cc)
    return out


def _replaying(a: KernelAdapter, cc: _CaseCall) -> Recording | None:
    """For a dump adapter, the recording it replays on this case: the case's own call when it is one of the
    dump's, else the dump's call of the same name (None for a runnable kernel)."""
    case = cc.case
    if not a.capabilities().recorded:
        return None
    if cc.replay is not None or case.recorded is None:
        return cc.replay
    calls = a.calls.calls  # type: ignore[attr-defined]
    if any(c is case.recorded for c in calls):
        return cc.rec
    match = [c for c in calls if c.label == case.recorded.label]
    if not match:
        raise BNProbeError(f"{a.name} has no call {case.recorded.label!r} to replay on this case")
    return match[0].load()


def _run(a: KernelAdapter, cc: _CaseCall, only: str | None = None) -> CallRun:
    """``a`` on one case call, in the asked modes it runs (an inference-only kernel: inference; said in the run's
    notes), or in mode ``only`` of them, through the engine (its golden shared with every other kernel on the
    call)."""
    runs = a.capabilities().modes
    return run_call(a, cc.rec, modes=tuple(m for m in cc.modes if m in runs and only in (None, m)),
                    label=cc.case.name, golden=cc.golden, quiet=True, replay=_replaying(a, cc))


def _natural(key: str, run: CallRun, call: Any, gold_t: Any) -> Callable[[], np.ndarray] | None:
    """For y, y_infer and dx, the magnitude each element is formed from (when first asked for; inference's from the
    running statistics it normalises with); None for other outputs."""
    if key == "y" and gold_t is not None:
        return lambda: y_natural(call, gold_t.saved)
    if key == "y_infer" and (st := running_stats(call)) is not None:
        return lambda: y_natural(call, st)
    scale = _scale(run, key) if key == "dx" else None
    return None if scale is None else (lambda: scale)


def _cancel_bound(run: CallRun, key: str) -> tuple[np.ndarray, str] | None:
    """The bound of a correct kernel's accumulation on a gradient's sums (:func:`~bnprobe.engine.run
    .cancellation_bounds`), shaped to broadcast against the output; None for other outputs."""
    b = run.bounds.get(key)
    return b if b is None or key != "dx" else (_per_element(run, b[0]), b[1])


def _per_element(run: CallRun, v: np.ndarray) -> np.ndarray:
    """A per-channel vector (a family layer's: per row) shaped to broadcast against the call's x (its layout's
    channel axis)."""
    if run.inputs.norm != "batch":
        return per_row_element(run.inputs, v)
    return layout_of(run.inputs.x).column(v)


def _scale(run: CallRun, key: str) -> np.ndarray | None:
    """The natural scale of output ``key`` (broadcastable to it), or None."""
    sc = run.scales.get(key)
    if sc is None or key not in ("saved_mean", "running_mean", "dx", "dgamma", "dbeta"):
        return None
    return _per_element(run, sc) if key == "dx" else sc


def _stored_share(ref: KernelAdapter, run: CallRun, gold_dx: np.ndarray) -> float:
    """The share of dx's error (RMSE against the golden) that the kernel's stored statistics explain: the
    golden backward recomputed from the statistics exactly as stored removes that share."""
    saved, call = run.saved, run.inputs
    stored = Saved(None if saved.mean is None else np.asarray(saved.mean, dtype=np.float64),  # type: ignore[union-attr]
                   saved.kind,  # type: ignore[union-attr]
                   np.asarray(saved.value, dtype=np.float64))  # type: ignore[union-attr]
    gold2 = ref.backward_of(call.with_(training=True), stored).dx
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN dx: no share (NaN), not a warning
        d = np.asarray(run.got["dx"], dtype=np.float64)
        e0 = float(np.sqrt(np.nanmean((d - gold_dx) ** 2)))
        e1 = float(np.sqrt(np.nanmean((d - gold2) ** 2)))
    return max(0.0, 1.0 - e1 / e0) if e0 > 0 else 0.0


def _explain(call: Any, gold_t: Any, pf: str) -> str:
    """What makes the data hard for a format: mean²/var (cancellation), var/eps (eps dominance), R."""
    r = NormShape.of(call.norm, call.x.shape, call.normalized_shape, call.groups).r if call.norm != "batch" else \
        layout_of(call.x).reduce_size
    parts = [f"R = {r}"]
    if gold_t is not None and gold_t.saved is not None and gold_t.saved.mean is not None:
        m = np.asarray(gold_t.saved.mean, dtype=np.float64)
        v = gold_t.saved.var(call.eps)
        with np.errstate(all="ignore"):
            r = m * m / np.where(v > 0, v, np.nan)
            m2v = float(np.max(r[np.isfinite(r)])) if np.isfinite(r).any() else float("inf")
            ve = float(np.min(v / call.eps)) if v.size else float("nan")
        parts = [f"max mean²/var {m2v:.3g}", f"min var/eps {ve:.3g}", *parts]
    if pf not in ("fp32", "fp64"):
        parts.append(f"statistics and parameters in {pf}")
    return ", ".join(parts)


@dataclass
class _Tables:
    """The rows of the run's three tables, as they are made."""

    rows: list[dict[str, Any]]
    chans: list[dict[str, Any]]
    budgets: list[dict[str, Any]]
    picks: dict[tuple[str, str], tuple[Any, ...]] = field(default_factory=dict)  # the budget's call per adapter/format


def _compare_adapter(a: KernelAdapter, cc: _CaseCall, j: _Judging, tables: _Tables, *, budget: bool,
                     top_channels: int, ref: KernelAdapter, bench: tuple[dict[str, Any], CallRun, Any, Any] | None,
                     done: CallRun | None = None) -> None:
    """Every output of one adapter on one case call against the golden (and the bench's outputs, :func:`_bench`);
    ``done``: the adapter's run on this call already made (by the caller, on the same golden)."""
    bench_out, bench_run, bench_pol, bench_a = bench if bench is not None else ({}, None, None, None)
    fmt, case, call = cc.rec.dtype, cc.case, cc.golden.call
    if done is not None:
        run = done
    elif bench_run is not None and bench_pol is not None and _policy(a, cc.rec) == bench_pol:
        run = bench_run  # the same kernel as the bench: its outputs, not a second run
    else:
        run = _run(a, cc)
    gold_t = cc.gold_train
    explain = _explain(call, gold_t, cc.rec.params)
    stats_cause: tuple[str, str] | None = None  # what named the kernel's saved statistics (its gradients inherit it)
    stats_right: bool | None = None  # whether its saved statistics passed (None: not judged)
    for t, act in run.got.items():
        natural = _natural(t, run, call, gold_t)
        r = _row(j, _Place(a.name, fmt, case, t), act, run.gold[t], run.formats[t], scale=_scale(run, t),
                 bench=bench_out.get(t), explain=explain, natural=natural, cancel=_cancel_bound(run, t))
        if t == "dx" and call.training and run.saved is not None:
            r["stored_stats_share"] = _stored_share(ref, run, run.gold["dx"])
        if r["verdict"] == Verdict.FAIL and call.norm != "batch":
            if not _name_family(r, cc, run, t, a):
                _unnamed_family(r, call.norm, j, act, run.gold[t], run.formats[t], call.dtype)
        elif r["verdict"] == Verdict.FAIL:
            naming = _Naming(a, j, bench_out, bench_a)
            if t in bench_out:  # the recipe models first (each says more than a recipe), then identify's recipe
                _name_recipe(r, cc, run, t, bench_out[t].value)
            if "cause" not in r and not _name_identified(r, cc, run, t, naming) and \
                    not _name_bug(r, cc, run, t, naming, stats_cause, stats_right):
                _unnamed(r, cc, run, t, naming)
            if t in ("saved_mean", "saved_invstd") and r.get("named") and stats_cause is None:
                stats_cause = (r["cause"], r["named"])
        if t in ("saved_mean", "saved_invstd"):
            stats_right = stats_right is not False and r["verdict"] == Verdict.PASS
        tables.rows.append(r)
    if call.norm != "batch":  # (the per-channel table and the error budget are BatchNorm's)
        return
    if "y" in run.got and run.saved is not None:
        eps = call.eps
        tables.chans.extend(_channels(a.name, fmt, case, run.got["y"], gold_t.y, var=run.saved.var(eps),
                                      gvar=gold_t.saved.var(eps), gmean=gold_t.saved.mean.astype(np.float64), eps=eps,
                                      top=top_channels))
    caps = a.capabilities()
    if budget and caps.staged and not caps.golden and gold_t is not None and \
            call.gamma is not None and call.beta is not None and "y" in run.got:
        _pick_for_budget(tables, a, fmt, case.name, call, next(r for r in reversed(tables.rows) if r["tensor"] == "y"))


def _pick_for_budget(tables: _Tables, a: KernelAdapter, fmt: str, case: str, call: Any, y_row: dict[str, Any]) -> None:
    """Keep, per adapter and format, the call whose y is worst against its bound (the error budget explains that
    one: the first channels' inputs are copied, the rest let go; a y with NaN or inf in it comes last)."""
    with np.errstate(all="ignore"):
        ratio = float(y_row["score"] / y_row["bound"]) if y_row["bound"] else 0.0
    ratio = ratio if math.isfinite(ratio) else -1.0  # NaN/inf in y: an RMSE to share out needs a finite one
    key = (a.name, fmt)
    if key in tables.picks and tables.picks[key][0] >= ratio:
        return
    k = min(BUDGET_CHANNELS, np.shape(call.x)[1])
    tables.picks[key] = (ratio, a, case, np.array(np.asarray(call.x)[:, :k]), np.asarray(call.gamma)[:k],
                         np.asarray(call.beta)[:k], call.eps, call.params)


def _budgets(tables: _Tables) -> None:
    """The error budget of each adapter and format on its worst call for y (see :func:`_pick_for_budget`)."""
    for (_, fmt), (_, a, case, x, g, b, eps, params) in tables.picks.items():
        release_free_memory()  # (what the last case or budget freed is not counted again in this one's peak)
        for r in error_budget(a, x, g, b, dtype=fmt, eps=eps, params=params):
            tables.budgets.append({"case": case, **r})


def _name_recipe(r: dict[str, Any], cc: _CaseCall, run: CallRun, t: str, bench: Any) -> None:
    """Name, in the row of a failing output ``t``, the recipe (:data:`~bnprobe.engine.recipes.RECIPES`) whose
    kernel reproduces it on this case call (each recipe run once per case call)."""
    call = cc.golden.call
    # (dγ and dβ are sums over each channel's values, in the kernel's own order)
    terms = layout_of(call.x).reduce_size if t in ("dgamma", "dbeta") else 1

    def fits(out: Any) -> bool:
        return out is not None and recipe_fits(run.got[t], out, bench, run.gold[t], run.formats[t], terms)

    for rp in RECIPES:
        if t not in rp.outputs or not rp.applies(call):
            continue
        derived = rp.derive(call, run.got, run.saved).get(t) if rp.derive else None
        # the outputs derived from the call (cheap) first; the recipe's kernel is run only when they do not fit
        if any(fits(out) for out in (derived if isinstance(derived, list) else [derived])) or \
                rp.kernel is not None and fits(_recipe_outputs(rp, cc, t).get(t)):
            r["cause"], r["named"] = rp.id, rp.words(call)
            r["why"] += f"; it matches a kernel that {rp.words(call)}"
            return


def _recipe_outputs(rp: Any, cc: _CaseCall, t: str) -> dict[str, Any]:
    """The outputs of recipe ``rp``'s kernel on this case call in the mode that returns output ``t`` (a failing y
    needs no backward), each mode run once (its outputs alone: no trace arrays)."""
    key = f"{rp.id}:{OUTPUT_MODE[t]}"
    if key not in cc.recipes:
        cc.recipes[key] = _run(outputs_only(rp.kernel()), cc, OUTPUT_MODE[t]).got
    return cc.recipes[key]


def _policy(a: KernelAdapter, rec: Recording) -> Any:
    """The policy a staged adapter (an emulated kernel) runs this call with (its name aside), or None for other
    kernels and for the golden."""
    caps = a.capabilities()
    if not caps.staged or caps.golden:
        return None
    call = rec.call()
    return replace(a.policy_for(call.x, dtype=rec.dtype, params=call.params), name="")


def _bench(bench: KernelAdapter, cc: _CaseCall) -> tuple[dict[str, Any], CallRun, Any, KernelAdapter]:
    """The bench on one case call: its outputs by tensor name (saved statistics under both names), the run itself,
    its policy (an adapter running the same policy reuses the run) and the bench."""
    run = _run(bench, cc)
    got = {t: BenchOutput(act) for t, act in _with_saved(run).items()}
    return got, run, _policy(bench, cc.rec), bench


def _with_saved(run: CallRun) -> dict[str, Any]:
    """A run's outputs by name, its saved statistics under both names (invstd and variance)."""
    got = dict(run.got)
    if run.saved is not None and "y" in run.got:
        s, eps = run.saved, run.eps
        for kind, value in (("invstd", s.invstd(eps)), ("var", s.var(eps))):
            got.setdefault(f"saved_{kind}", value)
    return got


def _check_formats(resolved: list[KernelAdapter], bench_a: KernelAdapter | None, cases: list[Case],
                   fmts: list[str], recorded_fmts: list[str], dtypes: tuple[str, ...] | None) -> None:
    """Refuse, before any work, formats that contradict a recording or that an adapter or the bench cannot run."""
    if dtypes is not None:
        off = [f for f in recorded_fmts if f not in fmts]
        if off:
            raise BNProbeError(f"the recording holds {', '.join(off)} calls; dtypes {', '.join(fmts)} contradict it")
    generated = fmts if any(c.recorded is None for c in cases) else []
    need = list(dict.fromkeys(generated + recorded_fmts))
    for a in resolved:
        runs = a.capabilities().formats
        missing = [f for f in (need if dtypes is not None else recorded_fmts) if f not in runs]
        if dtypes is None and generated and not any(f in runs for f in generated):
            missing = generated
        if missing:
            raise BNProbeError(f"adapter {a.name} does not run {', '.join(missing)} "
                               f"(it runs {', '.join(a.capabilities().formats)})")
    if bench_a is not None:
        if bench_a.capabilities().recorded:
            raise BNProbeError("the bench must be a kernel bnprobe can run on every input (a dump replays only its "
                               "own)")
        missing = [f for f in need if f not in bench_a.capabilities().formats]
        if missing:
            raise BNProbeError(f"bench {bench_a.name} does not run {', '.join(missing)}")


def compare_precision(
    adapters: list[str | KernelAdapter] | None = None,
    dtypes: tuple[str, ...] | None = None,
    cases: list[Case] | None = None,
    *,
    mode: str = "all",
    options: CallOptions = CallOptions(),
    seed: int = 0,
    judging: Judging = Judging(),
    budget: bool = True,
    top_channels: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> CompareResult:
    """Compare each adapter in each format with the FP64 golden on the same rounded inputs, judged as ``judging``
    says (:class:`Judging`).

    Default: the ``emulated`` adapter (each format's preset), fp16/bf16/fp32, ResNet-50's BatchNorm
    shapes (batch 2) plus the stress suite, training forward, inference and backward.  When an adapter
    is a dump (and no cases are given) the cases are its recorded calls, each run on its own recorded
    inputs, scalars and formats, one call at a time; ``dtypes`` and the ``options`` (:class:`CallOptions`: eps,
    momentum, params) then must agree with the recording (None: as recorded).  ``options.norm`` names a family
    layer (LayerNorm, RMSNorm, GroupNorm, InstanceNorm): its own default inputs, judged in training and backward.
    """
    import pandas as pd

    eps, momentum, params = options.eps, options.momentum, options.params
    standards, rule, bench = judging.standards, judging.rule, judging.bench
    _check_mode_rule(mode, rule)
    resolved = [as_adapter(a) for a in (adapters or ["emulated"])]
    dumps = [a for a in resolved if a.capabilities().recorded]
    cases = _cases_of(options, resolved, dumps, cases, seed)
    fmts = [get_format(d).name for d in (dtypes or ("fp16", "bf16", "fp32"))]
    recorded_fmts = list(dict.fromkeys(c.recorded.dtype for c in cases if c.recorded is not None))
    bench_a = as_adapter(bench) if bench is not None else None
    if bench_a is None and rule == "benchmark":
        raise BNProbeError("the benchmark rule needs a bench (e.g. careful or torch)")
    _check_formats(resolved, bench_a, cases, fmts, recorded_fmts, dtypes)
    ref = get_adapter("reference")
    modes = ("train", "infer", "backward") if mode == "all" else (mode,)
    tables = _Tables([], [], [])  # the three tables' rows
    notes: list[str | _CallNote] = _modes_left_out(resolved, mode, modes)  # what the verdicts cannot show
    modes, budget, left_out = _judged_modes(options, cases, mode, modes, notes, budget)
    skip, total = _default_formats(resolved, cases, fmts, dtypes)
    done = 0
    t0 = time.monotonic()
    # traces are not read here: outputs only, no stage recorded or counted (on copies: the caller's are unchanged)
    ref, bench_a = outputs_only(ref), outputs_only(bench_a)
    runs = [outputs_only(a) for a in resolved]
    j = _Judging(standards, rule, bench_a.name if bench_a is not None else "")
    opts = {"eps": eps, "momentum": momentum, "params": params, "norm": options}
    # the bench in each kernel's convention (a framework's running variance is judged against a careful one's)
    benches = {convention_of(a).name: outputs_only(bench_for(bench_a, a)) for a in runs} if bench_a else {}
    with CallCollector() as collector:
        for case in cases:
            _between_cases(collector, case.shape)
            for cc in _case_calls(case, fmts, modes, opts, ref, notes):
                bench_outs: dict[str, Any] = {}
                for a in runs:
                    if skip(a, cc):
                        continue
                    conv = convention_of(a).name
                    if bench_a is not None and conv not in bench_outs:
                        bench_outs[conv] = _bench(benches[conv], cc)
                    _compare_adapter(a, cc, j, tables, budget=budget, top_channels=top_channels, ref=ref,
                                     bench=bench_outs.get(conv))
                    done += 1
                    if progress:
                        progress(done, total)
            cc = bench_outs = None  # type: ignore[assignment]  # (nothing of this case held at the next collection)
    if budget:
        _budgets(tables)
    meta = {"adapters": [a.name for a in resolved],
            "dtypes": list(dict.fromkeys(([] if all(c.recorded is not None for c in cases) else fmts) + recorded_fmts)),
            "mode": mode, "eps": eps, "momentum": momentum, "params": params, "seed": seed, **_norm_meta(options),
            **_run_meta(cases, dumps), "seconds": round(time.monotonic() - t0, 3),
            "standards": "msprobe" if standards is None else "custom", "rule": rule,
            "bench": bench_a.name if bench_a is not None else None,
            "notes": [str(n) for n in notes], **left_out}
    return CompareResult(pd.DataFrame(tables.rows), pd.DataFrame(tables.chans), pd.DataFrame(tables.budgets), meta)


def _between_cases(collector: CallCollector, shape: tuple[int, ...]) -> None:
    """Before the next case: the heap's free memory returned (what the last case freed is not counted again in
    this one's peak), and a collection when the case is large (the last case's arrays caught in reference cycles
    go first)."""
    release_free_memory()
    collector.before(shape)


def _check_mode_rule(mode: str, rule: str) -> None:
    """The mode and the rule compare-precision knows, each refused in one line."""
    if mode not in COMPARE_MODES:
        raise BNProbeError(f"unknown mode {mode!r}; valid: {', '.join(COMPARE_MODES)}")
    if rule not in RULES:
        raise BNProbeError(f"unknown rule {rule!r}; valid: {', '.join(RULES)}")


def _cases_of(options: CallOptions, resolved: list[KernelAdapter], dumps: list[KernelAdapter],
              cases: list[Case] | None, seed: int) -> list[Case]:
    """The cases to run: those given, or a family layer's defaults, a dump's calls, or ResNet-50's shapes and the
    stress inputs."""
    if options.norm != "batch":
        return _family_cases(options, resolved, dumps, cases, seed)
    if cases is not None:
        return cases
    return recorded_cases(dumps[0].calls) if dumps else resnet50_cases(seed=seed) + stress_cases(seed)


def _norm_meta(options: CallOptions) -> dict[str, Any]:
    """The layer in a run's meta (nothing for BatchNorm)."""
    if options.norm == "batch":
        return {}
    return {"norm": options.norm, "normalized_shape": options.normalized_shape, "groups": options.groups}


def _family_cases(options: CallOptions, resolved: list[KernelAdapter], dumps: list[KernelAdapter],
                  cases: list[Case] | None, seed: int) -> list[Case]:
    """A family layer's cases (its defaults when none are given), each checked to fit the layer, and the adapters
    checked to run it — before any work."""
    layer = NORM_NAMES.get(options.norm, options.norm)
    if dumps:
        raise BNProbeError(f"{named('norm')} {options.norm} contradicts the dump: its calls bring their own layer "
                           f"(compare-precision reads a recorded {layer} call as one)")
    refused = [a.name for a in resolved if options.norm not in a.capabilities().norms]
    if refused:
        raise BNProbeError(f"{', '.join(refused)} run{'s' if len(refused) == 1 else ''} no {layer}: name adapters "
                           "that do (reference, careful, emulated[:<policy>], torch)")
    cases = family_cases(options.norm, seed) if cases is None else cases
    for c in cases:  # (its normalised shape, its groups; statistics of more than one value, or nothing to judge)
        if NormShape.of(options.norm, c.shape, options.normalized_shape, options.groups).r < 2:
            raise BNProbeError(one_value_per_row(layer, c.shape))
    return cases


def _family_modes(options: CallOptions, cases: list[Case], mode: str, modes: tuple[str, ...],
                  notes: list[str | _CallNote]) -> tuple[str, ...]:
    """The modes a family layer is judged in (no inference of its own: it keeps no running statistics), said in
    ``notes`` with R of its cases.  (Its run has no error budget: that reruns BatchNorm's stages.)"""
    layer = NORM_NAMES[options.norm]
    if mode == "infer":
        raise BNProbeError(f"{named('mode')} infer: {layer} keeps no running statistics, so its inference is its "
                           "training forward: give train, backward or all")
    rs = sorted({NormShape.of(options.norm, c.shape, options.normalized_shape, options.groups).r for c in cases})
    notes.append(f"{layer}: statistics per row of {', '.join(map(str, rs))} values; its inference is its training "
                 "forward (no running statistics), judged once as y")
    return tuple(m for m in modes if m != "infer")


def _judged_modes(options: CallOptions, cases: list[Case], mode: str, modes: tuple[str, ...],
                  notes: list[str | _CallNote], budget: bool) -> tuple[tuple[str, ...], bool, dict[str, Any]]:
    """The modes the cases are judged in, whether the error budget is run, and the run meta's ``left_out`` (modes
    left out of inputs of one value per channel): a family layer's (:func:`_family_modes`; no budget) or
    BatchNorm's (:func:`_one_value_cases`), what they leave out said in ``notes``."""
    if options.norm != "batch":
        return _family_modes(options, cases, mode, modes, notes), False, {}
    return modes, budget, _one_value_cases(cases, mode, modes, notes)


def _one_value_cases(cases: list[Case], mode: str, modes: tuple[str, ...],
                     notes: list[str | _CallNote]) -> dict[str, Any]:
    """The generated cases with one value per channel (R = N·H·W = 1), where training and its backward are undefined
    (:func:`~bnprobe.core.kernel.inference_alone` says why): refused in one line when ``mode`` asks for one of them
    by name, else judged in inference only, said in ``notes``; the run meta's ``left_out`` (the cases, the modes left
    out of them and why, said in the headline and the report's introduction too), or {} when none."""
    ones = [c for c in cases if c.recorded is None and len(c.shape) >= 2 and math.prod(c.shape) // c.shape[1] < 2]
    left = [m for m in modes if m != "infer"]
    if not ones or not left:
        return {}
    if mode != "all":
        raise BNProbeError(one_value_per_channel(ones[0].shape, f"{named('mode')} {mode}",
                                                 f"{named('mode')} infer or all judges its inference"), field="mode")
    notes.append(inference_alone([c.name for c in ones], left))
    return {"left_out": {"cases": [c.name for c in ones], "modes": left, "why": "R = N·H·W = 1 value per channel"}}


def _modes_left_out(adapters: list[KernelAdapter], mode: str, modes: tuple[str, ...]) -> list[str | _CallNote]:
    """Notes naming the asked modes (``mode``: ``modes``) a kernel does not run (an inference-only kernel, a
    deployment runtime's, runs inference alone: its training and backward are not judged, and the run says so,
    :func:`~bnprobe.core.kernel.modes_left_out`); a kernel that runs none of the asked modes is refused in one line
    naming what it runs."""
    notes: list[str | _CallNote] = []
    for a in adapters:
        runs = a.capabilities().modes
        if a.capabilities().recorded:
            continue  # (a dump's calls say what they recorded, per call)
        if not any(m in runs for m in modes):
            raise BNProbeError(needs_modes(f"{named('mode')} {mode}", modes, a.name, runs), field="mode")
        if (note := modes_left_out(a.name, runs, modes)) is not None:
            notes.append(note)
    return notes


def _default_formats(resolved: list[KernelAdapter], cases: list[Case], fmts: list[str],
                     dtypes: tuple[str, ...] | None) -> tuple[Callable[[KernelAdapter, Any], bool], int]:
    """(whether an adapter skips a case call, the number of runs): with the default formats each adapter runs those
    it can (a fixed policy, e.g. emulated:fp16-acc16, its own); formats asked for are run by every adapter."""
    def skip(a: KernelAdapter, cc: Any) -> bool:
        return dtypes is None and cc.case.recorded is None and cc.rec.dtype not in a.capabilities().formats

    total = sum(1 if c.recorded is not None else sum(f in a.capabilities().formats or dtypes is not None for f in fmts)
                for c in cases for a in resolved)
    return skip, total


def _run_meta(cases: list[Case], dumps: list[KernelAdapter]) -> dict[str, Any]:
    """The run's inputs, and the dump it replayed, for the result's meta."""
    out: dict[str, Any] = {"cases": [{"name": c.name, "shape": list(c.shape), "dist": c.dist, "mean": c.mean,
                                      "std": c.std} for c in cases],
                           "recorded": any(c.recorded is not None for c in cases)}
    if dumps:
        calls = dumps[0].calls  # type: ignore[attr-defined]
        out["dump"] = {"source": calls.source, "kind": calls.kind, "notes": list(calls.notes)}
    return out


def judge_call(a: KernelAdapter, rec: Recording, modes: tuple[str, ...], *, label: str | None = None,
               bench: str | KernelAdapter = "careful", run: CallRun | None = None,
               golden: Golden | None = None, models: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """compare-precision's rows for one call (the FP64 golden, msprobe's benchmark method against ``bench``, with
    its exemptions and recipes): the verdict every command that judges an output of a call reads, so that they
    agree on it.  A dump adapter replays ``rec`` (one of its recorded calls).  ``run`` (with the ``golden`` it was
    run on): the adapter's run on this call, when the caller has made it (not run again); ``models``: where the bug
    models' outputs on this call are kept (the caller's, so that it runs none of them again)."""
    ref = outputs_only(reference_for(a))
    bench_a = outputs_only(bench_for(as_adapter(bench), a))
    call = rec.call()
    case = Case(label or rec.meta.get("call") or rec.source, tuple(np.shape(call.x)))
    cc = _CaseCall(case, rec, modes, golden if golden is not None else Golden(ref, rec),
                   recipes={} if models is None else models, replay=rec if a.capabilities().recorded else None)
    tables = _Tables([], [], [])
    _compare_adapter(outputs_only(a), cc, _Judging(None, "benchmark", bench_a.name), tables, budget=False,
                     top_channels=0, ref=ref, bench=_bench(bench_a, cc), done=run)
    return tables.rows


def _agree(name: str, rec: Recording, eps: float | None, momentum: float | None, params: str | None) -> None:
    """Options given for a recorded call must be the recorded ones."""
    if eps is not None and eps != rec.eps:
        raise BNProbeError(f"{name} was recorded with eps {rec.eps:g}; eps {eps:g} contradicts it")
    if momentum is not None and rec.momentum is not None and momentum != rec.momentum:
        raise BNProbeError(f"{name} was recorded with momentum {rec.momentum:g}; momentum {momentum:g} contradicts it")
    if params is not None and params != rec.params_mode:
        raise BNProbeError(f"{name} was recorded with {rec.params} parameters ({rec.params_mode}); params {params} "
                           "contradicts it")


def per_call(result: CompareResult) -> list[dict[str, Any]]:
    """Per case (a recorded call, in forward order) and adapter: outputs checked, failed, the worst."""
    rows = result.rows
    out: list[dict[str, Any]] = []
    if not len(rows):
        return out
    order = {c["name"]: i for i, c in enumerate(result.meta["cases"])}
    for (adapter, case), sub in rows.groupby(["adapter", "case"], sort=False):
        ratio, worst = _worst(sub, "score", "bound")
        bad = sub[sub["verdict"] == Verdict.FAIL]
        out.append({"order": order.get(case, -1), "call": case, "adapter": adapter, "dtype": sub["dtype"].iloc[0],
                    "outputs": int(len(sub)), "failed": int(len(bad)), "failing": ", ".join(bad["tensor"]),
                    "worst": "" if worst is None else worst["tensor"], "worst_ratio": ratio})
    out.sort(key=lambda r: (r["order"], r["adapter"]))
    return out


def _worst(rows: Any, score: str, bound: str) -> tuple[float, Any]:
    """(the largest score/bound, its row) over ``rows``; (NaN, None) when no row has a measure (msprobe's
    benchmark skips float64 outputs: nothing is measured, so nothing is the worst)."""
    ratio = rows[score] / rows[bound] if len(rows) else rows[score]
    if not ratio.notna().any():
        return float("nan"), None
    return float(ratio.max()), rows.loc[ratio.idxmax()]


def first_failing_call(result: CompareResult) -> dict[str, Any] | None:
    """The first call (in forward order) with a failing output, or None."""
    return next((r for r in per_call(result) if r["failed"]), None)


def worse_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of outputs materially worse than the bench (:meth:`~bnprobe.engine.rules.VersusBench.worse`)."""
    if "worse" not in rows or not len(rows):
        return rows.iloc[0:0]
    return rows[rows["worse"].fillna("").astype(str) != ""]


def summarize(result: CompareResult) -> list[dict[str, Any]]:
    """Per adapter and format: how many tensors were checked, how many failed, the worst one, and
    the stage whose exact value removes most of the output's error."""
    out = []
    rows, budget = result.rows, result.budget
    if not len(rows):
        return out
    for (adapter, dtype), sub in rows.groupby(["adapter", "dtype"], sort=False):
        ratio, worst = _worst(sub, "score", "bound")
        warn = sub[sub["format_check"] == Verdict.WARN]
        _, fworst = _worst(warn, "format_score", "format_bound")
        worse = worse_rows(sub)
        top = worse.loc[worse["rmse_vs_bench"].fillna(float("inf")).idxmax()] if len(worse) else None
        item = {"adapter": adapter, "dtype": dtype, "checked": int(len(sub)),
                "failed": int((sub["verdict"] == Verdict.FAIL).sum()),
                "worse": int(len(worse)),
                "worse_worst": "" if top is None else f"{top['tensor']} on {top['case']} ({top['rmse_vs_bench']:.3g}x)",
                "format_warnings": int(len(warn)),
                "format_worst": "" if fworst is None else f"{fworst['tensor']} on {fworst['case']}",
                "worst": "" if worst is None else f"{worst['tensor']} on {worst['case']}", "worst_ratio": ratio,
                "worst_why": sub["why"].iloc[0] if worst is None else worst["why"], "budget_top": "",
                "budget_share": float("nan")}
        if len(budget):
            b = budget[(budget["adapter"] == adapter) & (budget["dtype"] == dtype)]
            if len(b):
                mean = b.groupby("stage").agg(order=("order", "min"), removed=("error_removed", "mean"))
                mean = mean.sort_values("order")
                item["budget_top"], item["budget_share"] = budget_cause(list(zip(mean.index, mean["removed"])))
        out.append(item)
    return out


@dataclass(frozen=True)
class _Naming:
    """What naming a failing output needs beyond its row: the kernel, how rows are judged, the bench's outputs and
    the bench itself (None without one)."""

    kernel: KernelAdapter
    judging: _Judging
    bench_out: dict[str, Any]
    bench: KernelAdapter | None


def _known(a: KernelAdapter, cc: _CaseCall) -> Known | None:
    """What identify's table knows of kernel ``a`` in this call's format, parameters and layout; None for an
    emulated kernel (its policy is its own) and for a recording (whose kernel the table cannot tell)."""
    caps = a.capabilities()
    if caps.staged or caps.golden or caps.recorded:
        return None
    call = cc.golden.call
    return known(a.name, cc.rec.dtype, call.params, call.layout)


def _variant_outputs(cc: _CaseCall, key: str, make: Callable[[], KernelAdapter]) -> tuple[dict[str, Any],
                                                                                         dict[str, str]] | str:
    """The outputs (saved statistics under both names) and their formats of the kernel ``make()`` on this case call,
    run once per ``key``; or why it cannot run."""
    if key not in cc.variants:
        try:
            run = _run(outputs_only(make()), cc)
            cc.variants[key] = (_with_saved(run), run.formats)
        except BNProbeError as exc:
            cc.variants[key] = str(exc)
    return cc.variants[key]


def _reproduces(run: CallRun, t: str, out: Any, bench: Any) -> str | None:
    """How a recipe's output ``out`` reproduces the kernel's ``t`` on this call: bit for bit, within
    :func:`~bnprobe.engine.recipes.recipe_fits`, or not (None)."""
    got = run.got[t]
    if out is None or np.shape(out) != np.shape(got):
        return None
    if np.array_equal(np.asarray(got, dtype=np.float64), np.asarray(out, dtype=np.float64), equal_nan=True):
        return "bit for bit"
    terms = layout_of(run.inputs.x).reduce_size if t in ("dgamma", "dbeta") else 1
    if bench is not None and recipe_fits(got, out, bench, run.gold[t], run.formats[t], terms):
        return "within the careful kernel's own error of it"
    return None


def _name_identified(r: dict[str, Any], cc: _CaseCall, run: CallRun, t: str, n: _Naming) -> bool:
    """Name a failing output ``t`` by identify's recipe for its kernel (:mod:`bnprobe.checks.identify.kernels`) where
    the recipe's emulation reproduces it on this call, and by the recipe's choice the failure comes from
    (:mod:`bnprobe.checks.compare.identified`): the row's ``cause``, ``named`` and ``why``.  False where there is no
    such recipe or it does not reproduce the output (the row's ``unnamed_recipe`` then says so)."""
    kn = _known(n.kernel, cc)
    rp = kn.recipe if kn is not None else None
    if rp is None or not rp.covers(t):
        if rp is not None:
            r["unnamed_recipe"] = f"{rp.words} covers {', '.join(rp.outputs)} only, not {t}"
        return False
    conv = get_convention(n.kernel.capabilities().convention)
    if (rv := get_policy(rp.spec).running_var) != conv.running_var:  # (a kernel judged in another convention)
        r["unnamed_recipe"] = (f"{rp.words} was identified in its own convention (running_var={rv}); judged in "
                               f"{conv.name}'s, the convention differs (--convention names the kernel's)")
        return False
    done = _variant_outputs(cc, f"identified:{rp.spec}", lambda: EmulatedAdapter(rp.spec))
    if isinstance(done, str):
        r["unnamed_recipe"] = f"{rp.words} `{rp.spec}` cannot run on this call ({done})"
        return False
    out, bench = done[0].get(t), n.bench_out.get(t)
    how = _reproduces(run, t, out, None if bench is None else bench.value)
    if how is None:
        r["unnamed_recipe"] = f"{rp.words} `{rp.spec}` does not reproduce it on this call" + _miss(run, t, out)
        return False
    cause, words = _attribution(cc, run, t, n, rp.spec)
    r["cause"], r["named"] = cause, f"computes `{rp.spec}` ({rp.words}, reproduced {how} on this call); {words}"
    r["why"] += f"; {t}: the kernel {r['named']}"
    return True


def _miss(run: CallRun, t: str, out: Any) -> str:
    """How far a recipe's output is from the kernel's: ``" (k of n values differ, up to u ulps)"``."""
    if out is None or np.shape(out) != np.shape(run.got[t]):
        return f" (it gives no {t} of this shape)"
    got, want = np.asarray(run.got[t], dtype=np.float64).reshape(-1), np.asarray(out, dtype=np.float64).reshape(-1)
    off = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    ulps = ulp_error(got[off], want[off], run.formats[t]) if off.any() else np.zeros(1)
    return f" ({int(off.sum())} of {got.size} values differ, up to {float(np.nanmax(ulps)):.3g} ulps)"


def _attribution(cc: _CaseCall, run: CallRun, t: str, n: _Naming, spec: str) -> tuple[str, str]:
    """(the row's cause, in words) of a failing output ``t`` that identify's recipe ``spec`` reproduces: the
    recipe's choices that differ from the careful bench's, each reset to the bench's in turn (and, where no reset
    alone makes ``t`` pass, each put alone into the bench's policy), ``t`` judged again by the run's rules."""
    careful = n.bench
    if careful is None or not careful.capabilities().staged or careful.capabilities().golden:
        return CAUSE, (f"the bench ({n.judging.bench_name or 'none'}) is not a policy of bnprobe's, so no choice of "
                       "the recipe is singled out")
    call, fmt = cc.golden.call, cc.rec.dtype
    recipe = get_policy(spec)
    modes = ("train", "backward") if OUTPUT_MODE[t] == "backward" else (OUTPUT_MODE[t],)
    pols = [careful.policy_for(call.x, dtype=fmt, mode=m, layout=call.layout, params=call.params) for m in modes]
    caps = EmulatedAdapter(spec).capabilities()

    def valid(cs: list[Choice]) -> bool:  # each way round: the recipe with the careful choices, and the reverse
        try:
            for mine in pols:
                with_choices(mine, recipe, cs), with_choices(recipe, mine, cs)
        except BNProbeError:
            return False
        return True

    def judged(key: str, into_careful: bool, choice: Choice) -> bool | str:
        def mixed(mine: Policy) -> Policy:
            return with_choices(mine, recipe, [choice], key) if into_careful else \
                with_choices(recipe, mine, [choice], key)

        def policy(p: Any, mode: str) -> Policy:
            return mixed(careful.policy(p, mode))  # type: ignore[attr-defined]
        try:  # (a choice that cannot be set alone, even joined with another, is said, not run)
            for mine in pols:
                mixed(mine)
        except BNProbeError as exc:
            return str(exc)
        done = _variant_outputs(cc, key, lambda: PolicyAdapter(key, policy, caps))
        if isinstance(done, str):
            return done
        out, formats = done
        if t not in out:
            return f"it gives no {t}"
        row = _row(n.judging, _Place(n.kernel.name, fmt, cc.case, t), out[t], run.gold[t],
                   formats.get(t, run.formats[t]), scale=_scale(run, t), bench=n.bench_out.get(t),
                   natural=_natural(t, run, call, cc.gold_train), cancel=_cancel_bound(run, t))
        return row["verdict"] == Verdict.PASS

    def passes_without(c: Choice) -> bool | str:  # the recipe with the careful kernel's choice c
        return judged(f"identified:{spec}:careful {c.id}", False, c)

    def fails_with(c: Choice) -> bool | str:  # the careful kernel with the recipe's choice c
        ok = judged(f"identified:careful:{spec} {c.id}", True, c)
        return ok if isinstance(ok, str) else not ok

    att = attribute(t, resettable(choices_differing(recipe, pols), valid), passes_without, fails_with)
    return att.cause, att.words(recipe, pols[-1])


def _name_family(r: dict[str, Any], cc: _CaseCall, run: CallRun, t: str, a: KernelAdapter) -> bool:
    """Name, in the row of a failing output ``t`` of a family layer, the first bug model (doctor's,
    :data:`~bnprobe.checks.doctor.family_bugs.FAMILY_BUGS`) whose emulation reproduces it on this call — bit for
    bit or within the judge's bound of it —, each model run once per case call; whether one did."""
    call = cc.golden.call
    fmt = call.dtype
    careful = careful_family_policy(fmt, params_format(fmt, call.params))
    bound = run.bounds.get(t)
    if bound is not None and t == "dx":
        bound = (per_row_element(call, bound[0]), bound[1])

    def outputs(key: str, policy: Policy, part: str) -> dict[str, Any]:
        if key not in cc.recipes:
            cc.recipes[key] = model_outputs(policy, cc.rec, cc.modes, run.saved, part)
        return cc.recipes[key]

    for bug in models_of(t, call.norm, fmt):  # (the catalogue's order: doctor's first model)
        found = reproduced_by(bug, t, run.got[t], run.gold[t], run.formats[t], bound, careful=careful,
                              threads=a.capabilities().threads, outputs=outputs)
        if found is not None:
            how, threads = found
            words = bug.words(fmt)
            r["cause"], r["named"] = bug.id, words
            r["why"] += f"; it matches the model of: {words}, {how}" + \
                (f", {threads} thread(s)" if threads is not None else "")
            return True
    return False


def _bug_tried(a: KernelAdapter, call: BNCall) -> bool:
    """Whether doctor's BatchNorm bug models are tried on a failing output of kernel ``a`` on ``call``: a kernel not
    of bnprobe's own (an emulated kernel's policy has no logic bug), on a channels-first call."""
    caps = a.capabilities()
    return not (caps.staged or caps.golden) and call.layout == "channels_first"


def _name_bug(r: dict[str, Any], cc: _CaseCall, run: CallRun, t: str, n: _Naming,
              stats_cause: tuple[str, str] | None = None, stats_right: bool | None = None) -> bool:
    """Name a failing BatchNorm output ``t`` by doctor's bug models (:data:`~bnprobe.checks.doctor.bugs.BUGS`) whose
    FP64 model on this call, rounded to the format ``t`` is returned in, reproduces it as a recipe must
    (:func:`~bnprobe.engine.recipes.recipe_fits`: no farther from the kernel than the bench is from the golden, and
    at most half the kernel's distance to the golden): the row's ``cause`` (the bug's id; the ids joined by ``|``
    where several models reproduce it and this call cannot tell them apart, as ε missing and ε as a floor on the
    variance where no variance is below ε), ``named`` and ``why``; whether one did.  A gradient that no model
    reproduces but the golden backward from the statistics the kernel saved does is named by what named those
    statistics (``stats_cause``: (cause, words) of its saved_mean or saved_invstd row).  A bug that changes the
    saved statistics does not name a gradient of a kernel whose saved statistics passed (``stats_right``): they
    refute it.  Each model's outputs are formed once per case call, when first read."""
    from bnprobe.numerics.rounding import round_to

    call = cc.golden.call
    bench = n.bench_out.get(t)
    if not _bug_tried(n.kernel, call) or bench is None or t not in run.got:
        return False
    if t in ("running_mean", "running_var") and (call.momentum is None or call.running_mean is None):
        return False  # (a cumulative average, or no running statistics: the models update none)
    if t in ("dx", "dgamma", "dbeta") and call.dy is None:
        return False
    conv = convention_of(n.kernel).name
    c = np.shape(call.x)[1]
    f64 = lambda v, fill: np.full(c, fill) if v is None else np.asarray(v, dtype=np.float64)  # noqa: E731
    shared = cc.recipes.setdefault(f"bug-models:{conv}", {})
    c64 = call.with_(x=np.asarray(call.x, dtype=np.float64), gamma=f64(call.gamma, 1.0), beta=f64(call.beta, 0.0),
                     running_mean=f64(call.running_mean, 0.0), running_var=f64(call.running_var, 1.0),
                     # (without a backward, a dy of one zero: the models form their gradients' common sum at once)
                     dy=np.zeros((1,) * np.ndim(call.x)) if call.dy is None else np.asarray(call.dy, dtype=np.float64))
    terms = layout_of(call.x).reduce_size if t in ("dgamma", "dbeta") else 1

    def fits(key: str, make: Callable[[], Any]) -> bool:
        if key not in cc.recipes:
            with np.errstate(all="ignore"):
                cc.recipes[key] = make()
        with np.errstate(all="ignore"):
            out = round_to(np.asarray(cc.recipes[key][t], dtype=np.float64), run.formats[t])
        return recipe_fits(run.got[t], out, bench.value, run.gold[t], run.formats[t], terms, at_recipe_scale=True)

    saved = run.saved
    stored = None if saved is None or saved.mean is None or not call.training else \
        (np.asarray(saved.mean, dtype=np.float64), np.asarray(saved.invstd(call.eps), dtype=np.float64))
    shared_stored: dict[Any, Any] = cc.recipes.setdefault(f"bug-models-from-saved:{conv}", {})

    def made(bug: str) -> tuple[str, Callable[[], Any]]:
        """A model's key and maker: a bug of the backward alone from the statistics the kernel saved (as its
        backward takes them), any other from its own."""
        if BUGS[bug] == ("backward",) and stored is not None:
            return f"bug-model:{bug}:{conv}:from-saved", lambda: bug_model(c64, bug=bug, saved=stored, convention=conv,
                                                                           shared=shared_stored)
        return f"bug-model:{bug}:{conv}", lambda: bug_model(c64, bug=bug, convention=conv, shared=shared)

    from_saved = (f"bug-model:from-saved:{conv}", lambda: bug_model(c64, saved=stored, convention=conv,
                                                                     shared=shared_stored))
    # a backward bug is not seen where the right backward from the same saved statistics gives the kernel's output too
    # (statistics of NaN make every backward NaN): the statistics are then what names it, below
    right_from_saved = stored is not None and t in ("dx", "dgamma", "dbeta") and fits(*from_saved)
    refuted = stats_right and t in ("dx", "dgamma", "dbeta")
    found = [bug for bug in bugs_changing(t)
             if not (right_from_saved and BUGS[bug] == ("backward",)) and not (refuted and "saved" in BUGS[bug])
             and fits(*made(bug))]
    if found:
        words = describe(found[0], conv)
        if len(found) > 1:
            words += " (not told apart on this call from: " + "; ".join(describe(b, conv) for b in found[1:]) + ")"
        r["cause"], r["named"] = "|".join(found), words
        r["why"] += f"; it matches doctor's model of the bug: {words}"
        return True
    if stats_cause is None or not right_from_saved:
        return False
    cause, said = stats_cause
    r["cause"], r["named"] = cause, f"{said}, in the statistics it saved (its backward is right given them)"
    r["why"] += f"; it matches the golden backward from the statistics the kernel saved, whose failure is named: " \
                f"{said}"
    return True


def _unnamed_family(r: dict[str, Any], norm: str, j: _Judging, actual: Any, golden: Any, fmt: str,
                    dtype: str) -> None:
    """Say, in a family layer's failing row, what is known of it: how much worse than the bench it is; where it is
    returned in a wider format than x's but every value of it is one of x's format (and the golden's are not), that
    it was summed or rounded in x's format; and that no bug model of that layer reproduces it (an identified
    recipe names BatchNorm's failures only)."""
    bench = "the careful kernel's" if j.bench_name.startswith("careful") else f"{j.bench_name}'s"
    ratio = r.get("rmse_vs_bench")
    parts = [f"{r['tensor']} {ratio:.3g}x {bench} error"] if ratio is not None and math.isfinite(ratio) else []
    narrow, wide = get_format(dtype), get_format(fmt)
    if wide.holds(narrow) and wide.name != narrow.name:
        a, g = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (actual, golden))
        with np.errstate(all="ignore"):
            fin = np.isfinite(a) & np.isfinite(g) & (g != 0)
            ulps = np.abs(a[fin] - g[fin]) / narrow.ulp(g[fin])
        if ulps.size and float(np.median(ulps)) >= 0.5:
            parts.append(f"returned in {wide.name}, its errors are of the size of {narrow.name}'s rounding (median "
                         f"{float(np.median(ulps)):.3g} ulps of {narrow.name}, x's format): what a sum carried or "
                         f"rounded in {narrow.name} gives")
    parts.append(f"no bug model of {NORM_NAMES[norm]} reproduces it (an identified recipe names BatchNorm's "
                 "failures only)")
    r["unnamed"] = "; ".join(parts)
    r["why"] += f"; not named: {r['unnamed']}"


def _unnamed(r: dict[str, Any], cc: _CaseCall, run: CallRun, t: str, n: _Naming) -> None:
    """Say, in a failing output's row that nothing names (``unnamed``, also in ``why``), what is known of it: how
    much worse than the bench it is, whether the kernel saved its statistics (the recipe models need them), and
    what identify's table knows of the kernel (its recipe and why it does not name this output, or why there is
    none)."""
    bench = "the careful kernel's" if n.judging.bench_name.startswith("careful") else f"{n.judging.bench_name}'s"
    ratio = r.get("rmse_vs_bench")
    parts = []
    if ratio is not None and math.isfinite(ratio):
        parts.append(f"{t} {ratio:.3g}x {bench} error")
    elif ratio is not None and n.bench is not None:
        parts.append(f"{t} in error where {bench} is exact")
    if cc.golden.call.training and "train" in run.modes and run.saved is None:
        parts.append("statistics not saved")
    parts.append("no recipe model fits" if not _bug_tried(n.kernel, cc.golden.call) else
                 "no recipe model and no bug model of doctor's fits")
    caps = n.kernel.capabilities()
    if caps.staged:
        parts.append("an emulated kernel: its policy is its own (its error budget and bnprobe trace locate the "
                     "stage)")
    elif caps.recorded:
        parts.append("a recording, whose kernel identify's table cannot name (bnprobe identify searches each "
                     "recorded call's recipe)")
    elif (said := r.pop("unnamed_recipe", None)) is not None:
        parts.append(said)
    elif (kn := _known(n.kernel, cc)) is not None:
        parts.append(kn.text)
    r["unnamed"] = "; ".join(parts)
    r["why"] += f"; not named: {r['unnamed']}"

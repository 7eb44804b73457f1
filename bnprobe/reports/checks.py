"""The reports of gradcheck, overflow, doctor, fold and trace: terminal text, CSV, JSON and Markdown.

Each function takes a check's result and returns a :class:`~bnprobe.reports.Report`; nothing here prints.  A
command's one renderer reads whichever result its check returned: a result over a recording's calls (one that
answers :class:`~bnprobe.engine.result.OfCalls`) is shown as a table of its calls, any other as one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bnprobe._table import render_table
from bnprobe.engine.result import OfCalls, Verdict
from bnprobe.reports import Report, file_stem

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.checks.doctor.diagnosis import DoctorReport
    from bnprobe.checks.fold.layer import FoldReport
    from bnprobe.checks.fold.onnx_model import OnnxFoldReport
    from bnprobe.checks.gradcheck.gradients import GradcheckResult
    from bnprobe.checks.overflow.report import OverflowReport
    from bnprobe.checks.trace.stages import TraceComparison
    from bnprobe.engine.recorded import PerCall
    from bnprobe.kernels.layout import Layout

__all__ = ["gradcheck_report", "overflow_report", "doctor_report", "fold_report", "folded_report", "fold_onnx_report",
           "fold_onnx_html", "trace_lines"]


def _markdown(title: str, table: str, notes: list[str] | tuple[str, ...], *sections: tuple[str, str]) -> str:
    """``# title``, the table as a code block, each (heading, table) section, then the notes as a list."""
    md = f"# {title}\n\n```\n{table}\n```\n\n" + "".join(f"## {h}\n\n```\n{t}\n```\n\n" for h, t in sections)
    return md + "\n".join(f"- {n}" for n in notes) + "\n"


# ---- gradcheck --------------------------------------------------------------------------------------

def gradcheck_report(result: GradcheckResult | PerCall) -> Report:
    """gradcheck's result: an adapter's backward or a formula on generated inputs, or every call of a recording (one
    row per call, then the failed checks)."""
    if isinstance(result, OfCalls):
        return _gradcheck_calls(result)
    rows = [{**r.to_dict(), "used %": 100.0 * r.used} for r in result.rows]
    table = render_table(rows, ["check", "tensor", "status", "max_abs", "max_rel", "used %", "min_rtol", "where"],
                         headers=["check", "tensor", "status", "max abs err", "max rel err", "tol used %",
                                  "needs rtol", "worst at"])
    params = result.params
    layer = "" if result.layer is None else f" {result.layer}"
    title = (f"gradcheck {result.adapter}{layer} in {result.dtype}" + (f" (params {params})" if params is not None
                                                                       else "")
             + f", {result.mode}, shape {tuple(result.shape)}, seed {result.seed}: {result.verdict}")
    return Report(title, [table], list(result.notes), result.passed, result.to_dict(),
                  file_stem("gradcheck", result.adapter, result.dtype, result.mode), result.to_frame(),
                  _markdown(title, table, result.notes))


def _gradcheck_calls(run: PerCall) -> Report:
    """gradcheck on every recorded call: one row per call, then the failed checks."""
    summary, failed = [], []
    for i, res in enumerate(run.results):
        bad = res.failed()
        fd = [r for r in res.rows if r.check == "finite-differences"]
        summary.append({"#": i, "call": res.call, "format": res.dtype, "mode": res.mode, "checks": len(res.rows),
                        "failed": len(bad), "failing": ", ".join(dict.fromkeys(r.tensor for r in bad)),
                        "fd": ("full" if any(r.detail.startswith("full") for r in fd) else "projections")
                        if fd else "-", "used %": 100.0 * max((r.used for r in res.rows), default=0.0)})
        failed += [{**r.to_dict(), "call": res.call, "used %": 100.0 * r.used} for r in bad]
    table = render_table(summary, ["#", "call", "format", "mode", "checks", "failed", "failing", "fd", "used %"],
                         headers=["#", "call (forward order)", "format", "mode", "checks", "failed", "failing",
                                  "finite diff.", "worst tol used %"])
    title = (f"gradcheck {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
             f"{run.verdict}")
    blocks = [table]
    if failed:
        blocks += ["\nfailed checks:",
                   render_table(failed, ["call", "check", "tensor", "max_abs", "used %", "min_atol", "min_rtol",
                                         "where"],
                                headers=["call", "check", "tensor", "max abs err", "tol used %", "needs atol",
                                         "needs rtol", "worst at"])]
    notes = list(run.notes) + [f"{r.call}: {n}" for r in run.results for n in r.notes
                               if not n.startswith("finite differences on")]
    return Report(title, blocks, notes, run.passed, run.to_dict(), file_stem("gradcheck", run.kernel, "recorded"),
                  run.to_frame(), _markdown(title, table, run.notes))


# ---- overflow ---------------------------------------------------------------------------------------

_HEADROOM_NOTE = "headroom of the sums is predicted"


def overflow_report(rep: OverflowReport | PerCall) -> Report:
    """The overflow scan of one run (findings, the remedies tried, headroom predicted vs actual, saturation), or of
    every call of a recording (one row per call, then every finding)."""
    if isinstance(rep, OfCalls):
        return _overflow_calls(rep)
    params = rep.params
    frame = rep.to_frame()
    # (a family layer's findings are located by row of its statistics, BatchNorm's by channel)
    cols = ["anomaly", "stage", "format", "channels", "count", "first_element", "detail"]
    table = render_table(frame.to_dict(orient="records"), cols,
                         headers=None if rep.layer is None else [("rows" if c == "channels" else c) for c in cols]) \
        if len(frame) else "no anomalies"
    head = [{**h.__dict__} for h in rep.headroom]
    htable = render_table(head, ["stage", "format", "predicted_max", "headroom_binades", "overflows", "actual_max",
                                 "actually_overflowed"],
                          headers=["stage", "format", "predicted |max|", "headroom (binades)", "predicted overflow",
                                   "actual |max|", "overflowed"]) if head else ""
    title = (f"overflow scan of {rep.adapter} in {rep.dtype} ({rep.mode}"
             + (f", params {params}" if params is not None else "") + "): "
             + ("clean" if rep.passed else f"{len(rep.findings)} finding(s)"))
    blocks = [table] if rep.layer is None else [f"layer: {rep.layer}", table]
    for f in rep.findings:
        if f.remedies:
            blocks.append(f"remedies for {f.anomaly} at {f.stage}: " + "; ".join(
                f"{r.name} {'fixes it' if r.fixed else 'does not'} (max err {r.y_error:.3g})" for r in f.remedies))
        blocks.append(f"  {f.anomaly}: input at {f.first_element}: {f.inputs}")
    if htable:
        blocks += ["\nheadroom predicted from the input's statistics, checked against the run:", htable]
    blocks += [f"{s['overflow_mode']:>8} mode: outputs finite {100 * s['finite_share']:.0f}%, max |output| "
               f"{s['max_abs_output']:.4g}, max error {s['max_abs_error']:.4g}" for s in rep.saturation]
    md = (f"# bnprobe overflow: {rep.adapter} in {rep.dtype}, {rep.mode}\n\n```\n{table}\n```\n\n"
          f"## Headroom\n\n```\n{htable}\n```\n")
    return Report(title, blocks, list(rep.notes), rep.passed, rep.to_dict(),
                  file_stem("overflow", rep.adapter, rep.dtype, rep.mode), frame, md)


def _overflow_calls(run: PerCall) -> Report:
    """The overflow scan of every recorded call: one row per call, then every finding."""
    frame = run.to_frame()
    summary = []
    for i, rep in enumerate(run.results):
        tight = min(rep.headroom, key=lambda h: h.headroom_binades, default=None)
        summary.append({"#": i, "call": rep.call, "format": rep.dtype, "mode": rep.mode, "findings": len(rep.findings),
                        "anomalies": ", ".join(dict.fromkeys(f"{f.anomaly}@{f.stage}" for f in rep.findings)),
                        "headroom": f"{tight.headroom_binades:.1f} ({tight.stage})" if tight else ""})
    table = render_table(summary, ["#", "call", "format", "mode", "findings", "anomalies", "headroom"],
                         headers=["#", "call (forward order)", "format", "mode", "findings", "anomaly@output",
                                  "least headroom, binades (stage)"])
    where = "channels" if all(r.layer is None for r in run.results) else \
        "rows" if all(r.layer is not None for r in run.results) else "channels / rows"
    ftable = render_table(frame.to_dict(orient="records"), ["call", "anomaly", "stage", "format", "channels",
                                                           "count", "first_element", "detail"],
                          headers=["call", "anomaly", "output", "format", where, "count", "first element",
                                   "detail"]) if len(frame) else "no anomalies"
    title = (f"overflow scan of {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
             + ("clean" if run.passed else f"{sum(len(r.findings) for r in run.results)} finding(s)"))
    notes = list(run.notes) + [f"{r.call}: {n}" for r in run.results for n in r.notes
                               if not n.startswith((_HEADROOM_NOTE, "policy:"))]
    heads = [n for r in run.results for n in r.notes if n.startswith(_HEADROOM_NOTE)]
    return Report(title, [table, *(["", ftable] if len(frame) else [])], notes + heads[:1], run.passed,
                  run.to_dict(), file_stem("overflow", run.kernel, "recorded"), frame,
                  _markdown(title, table, run.notes, ("Findings", ftable)))


# ---- doctor -----------------------------------------------------------------------------------------

def _details(failed: list[tuple[str, Any]]) -> list[str]:
    """What is wrong, per failing check, one line per input and output."""
    out: list[str] = []
    for name, lines in failed:
        if lines:
            out += [f"\n{name}:", *(f"  {line}" for line in lines)]
    return out


def doctor_report(rep: DoctorReport | PerCall, left_out: str = "") -> Report:
    """The checklist on one kernel: PASS/WARN/FAIL per item with its evidence, the details of what is wrong and
    the known bugs that match; or on every call of a recording (one row per call, then the items that did not
    pass).  ``left_out``: what the checklist did not judge, said in the title after the verdict."""
    import pandas as pd

    if isinstance(rep, OfCalls):
        return _doctor_calls(rep)

    rows = [i.to_dict() for i in rep.items]
    table = render_table(rows, ["status", "name", "evidence"], headers=["status", "check", "evidence"])
    layer = "" if rep.layer is None else f" {rep.layer}"
    title = f"doctor {rep.adapter}{layer} in {rep.dtype}, params {rep.params}: " + \
        ("healthy" if rep.passed else "something failed") + (f"; {left_out}" if left_out else "")
    blocks = [f"inputs: {', '.join(rep.inputs)}", table, *_details([(it.name, it.details) for it in rep.items])]
    if rep.diagnosis:
        blocks.append("diagnosis: " + "; ".join(rep.diagnosis))
    md = (f"# bnprobe {title}\n\n```\n{table}\n```\n\ndiagnosis: {'; '.join(rep.diagnosis) or 'none'}\n\n"
          + "".join(f"- {it.name}: {d}\n" for it in rep.items for d in it.details))
    return Report(title, blocks, list(rep.notes), rep.passed, rep.to_dict(),
                  file_stem("doctor", rep.adapter, rep.dtype), pd.DataFrame(rows), md)


def _doctor_calls(run: PerCall) -> Report:
    """The checklist on every recorded call: one row per call, then the items that did not pass."""
    import pandas as pd

    summary, items = [], []
    for i, rep in enumerate(run.results):
        summary.append({"#": i, "call": rep.call, "format": rep.dtype, "params": rep.params,
                        "status": "healthy" if rep.passed else "FAIL", "items": len(rep.items),
                        "failed": sum(it.status == Verdict.FAIL for it in rep.items),
                        "diagnosis": "; ".join(rep.diagnosis)})
        items += [{"call": rep.call, **it.to_dict()} for it in rep.items if it.status != Verdict.PASS]
    table = render_table(summary, ["#", "call", "format", "params", "status", "items", "failed", "diagnosis"],
                         headers=["#", "call (forward order)", "format", "params", "status", "items", "failed",
                                  "diagnosis"])
    title = (f"doctor {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
             + ("healthy" if run.passed else "something failed"))
    blocks = [table]
    if items:
        blocks += ["", render_table(items, ["call", "status", "name", "evidence"],
                                    headers=["call", "status", "check", "evidence"]),
                   *_details([(f"{it['call']}: {it['name']}", it["details"]) for it in items])]
    notes = list(run.notes) + [f"{rep.call}: {n}" for rep in run.results for n in rep.notes]
    every = pd.DataFrame([{"call": rep.call, **it.to_dict()} for rep in run.results for it in rep.items])
    return Report(title, blocks, notes, run.passed, run.to_dict(), file_stem("doctor", run.kernel, "recorded"),
                  every, _markdown(title, table, run.notes))


# ---- fold -------------------------------------------------------------------------------------------

def fold_report(rep: FoldReport) -> Report:
    """Folding per output channel (largest A and failing channels first), the fused forms, the eps rule, the
    wrong statistics and torch's fusion; with ``rep.folded``, the user's fold (:func:`folded_report`)."""
    if rep.folded is not None:
        return folded_report(rep)
    ch = rep.channels
    shown = ch.sort_values(["verdict", "A"], ascending=[True, False]).head(10)
    table = render_table(shown.to_dict(orient="records"),
                         ["channel", "A", "var_over_eps", "folded_w_absmax", "w_headroom_binades", "err_unfused",
                          "err_folded", "verdict"],
                         headers=["channel", "A", "var/eps", "max|W'|", "W' headroom", "err unfused", "err folded",
                                  "verdict"])
    n_fail = int((ch.verdict == Verdict.FAIL).sum())
    title = (f"fold {rep.layer} + BatchNorm in {rep.dtype} (accumulate {rep.accumulate}), {len(ch)} output channels: "
             + ("all pass" if rep.passed else f"{n_fail} break the standard") + " (largest A / failing channels first)")
    e = rep.eps_rule
    blocks = [table, "\nforms, max |error| against the FP64 golden:",
              render_table(rep.forms.to_dict(orient="records"), ["form", "max_abs_err"]),
              f"\neps rule (Ascend's folding pass: eps < 1e-8 becomes 1e-5): eps {e['eps']:g} -> "
              f"{e['eps_after_rule']:g}; output changes by up to {e['max_abs_change']:.4g}"]
    if len(rep.wrong_stats):
        blocks += ["folding with the wrong statistics changes the output by up to:",
                   render_table(rep.wrong_stats.to_dict(orient="records"), ["folded with", "max_abs_change"])]
    if rep.torch:
        blocks.append(f"torch.nn.utils.fusion ({rep.torch['torch']}, {rep.torch['dtype']}): folded weights differ by "
                      f"at most {rep.torch['max_rel_weight_diff']:.3g} relative, bias "
                      f"{rep.torch['max_rel_bias_diff']:.3g}")
    md = f"# bnprobe fold: {rep.layer} + BN in {rep.dtype}\n\n```\n{table}\n```\n"
    return Report(title, blocks, list(rep.notes), rep.passed, rep.to_dict(), file_stem("fold", rep.layer, rep.dtype),
                  ch, md)


def folded_report(rep: FoldReport) -> Report:
    """A user's folded layer per output channel (failing and worst channels first), then each candidate cause."""
    ch, f = rep.channels, rep.folded
    shown = ch.sort_values(["verdict", "needs_x_tolerance"], ascending=[True, False]).head(10)
    table = render_table(shown.to_dict(orient="records"),
                         ["channel", "A", "w_err", "w_allowed", "b_err", "b_allowed", "needs_x_tolerance", "y_err",
                          "y_allowed", "verdict"],
                         headers=["channel", "A", "|dW'| worst", "allowed", "|db'|", "allowed", "needs x tol",
                                  "|dy| worst", "allowed", "verdict"])
    n_fail = int((ch.verdict == Verdict.FAIL).sum())
    title = (f"fold --folded {f['file']}: {rep.layer} + BatchNorm stored in {rep.dtype}, {len(ch)} output channels "
             f"against the FP64 fold (eps {f['eps']:g}): "
             + ("all pass" if rep.passed else f"{n_fail} fail") + " (failing / worst channels first)")
    causes = render_table(rep.causes.to_dict(orient="records"),
                          ["cause", "channels_reproduced", "channels", "needs_x_tolerance", "fits"],
                          headers=["candidate fold", "channels reproduced", "of", "needs x tol", "fits"])
    from bnprobe.core.tolerances import FOLD_COMPUTE_ULPS

    blocks = [table, f"\ntolerance: half an ulp of the storage format + {FOLD_COMPUTE_ULPS:g} units of fp32 (fp64 for "
                     "an fp64 file) of what each value is formed from; the output's: that carried through the layer "
                     f"on x ({f['x']})", "\neach candidate fold against your numbers:", causes]
    if not rep.passed:
        blocks.append("likely cause: " + ("; ".join(f["likely_causes"]) if f["likely_causes"] else
                                          "no known cause matches (see the notes)"))
    md = _markdown(title, table, rep.notes, ("Candidate folds", causes))
    return Report(title, blocks, list(rep.notes), rep.passed, rep.to_dict(),
                  file_stem("fold", "folded", rep.layer, f["weight_format"]), ch, md)


_ONNX_COLUMNS = ["layer", "op", "check", "channels", "eps", "A_max", "near_dead", "overflow", "min_headroom_binades",
                 "failed", "cause", "verdict"]
_ONNX_HEADERS = ["layer", "op", "check", "ch", "eps", "max |A|", "near-dead ch", "overflow ch", "W' headroom",
                 "failed ch", "likely cause / why", "verdict"]


def _onnx_details(rep: OnnxFoldReport) -> list[str]:
    """Per failing check: its worst channels, and for a fused layer each candidate cause."""
    out: list[str] = []
    for (name, d), r in rep.analysis.items():
        if not r.passed:
            bad = r.channels[r.channels.verdict == Verdict.FAIL].head(5)
            out += [f"\n{name}, fold in {d}:", *(f"  channel {int(c.channel)}: {c.why}" for c in bad.itertuples())]
    for label, reps in (("fused", rep.fused), ("fused in fp16", rep.fp16)):
        for name, r in reps.items():
            if isinstance(r, str) or r.passed:
                continue
            bad = r.channels[r.channels.verdict == Verdict.FAIL].sort_values("needs_x_tolerance", ascending=False)
            out += [f"\n{name}, {label} ({r.folded['file']}): {len(bad)} of {len(r.channels)} channels fail; "
                    "likely cause: " + ("; ".join(r.folded["likely_causes"]) or "no known cause matches"),
                    *(f"  channel {int(c.channel)}: {c.why}" for c in bad.head(5).itertuples())]
    return out


def fold_onnx_report(rep: OnnxFoldReport) -> Report:
    """``fold --onnx``: one row per layer and check (the fold per format, the fused layer, its fp16 view), then the
    failures with their causes; the CSV holds every channel of every check."""
    rows = rep.summary()
    table = render_table(rows, _ONNX_COLUMNS, headers=_ONNX_HEADERS) if rows else "no layer to fold"
    n_fail = sum(r["verdict"] == Verdict.FAIL for r in rows)
    fused = f", fused: {rep.fused_source}" if rep.fused_source else ""
    title = (f"fold --onnx {rep.model}: {len(rep.layers)} layer(s) + BatchNorm in {', '.join(rep.dtypes)}{fused}: "
             + ("all pass" if rep.passed else f"{n_fail} check(s) fail"))
    blocks = [table, *_onnx_details(rep)]
    notes = [f"{ly.name}: {n}" for ly in rep.layers for n in ly.notes] + [f"skipped {s}" for s in rep.skipped]
    notes += [f"{name} ({label}): {n}" for label, reps in (("fused", rep.fused), ("fp16", rep.fp16))
              for name, r in reps.items() if not isinstance(r, str) for n in r.notes
              if not n.startswith(("read ", "the weights file has no x", "no known cause matches"))]
    notes += list(rep.notes)
    details = "\n".join(blocks[1:]).strip()
    md = _markdown(title, table, notes, *([("Failures", details)] if details else []))
    return Report(title, blocks, notes, rep.passed, rep.to_dict(), file_stem("fold", "onnx", Path(rep.model).stem),
                  rep.to_frame(), md)


def fold_onnx_html(rep: OnnxFoldReport, report: Report) -> str:
    """The same report as one HTML page: the summary, then every check's channel table."""
    import pandas as pd

    from bnprobe.reports import html_report

    sections: list[tuple[str, Any]] = [("Layers and checks", pd.DataFrame(rep.summary()))]
    sections += [(f"{n}: fold in {d}", r.channels) for (n, d), r in rep.analysis.items()]
    for label, reps in (("fused", rep.fused), ("fused in fp16", rep.fp16)):
        sections += [(f"{n}: {label}", r if isinstance(r, str) else r.channels) for n, r in reps.items()]
        sections += [(f"{n}: {label}, candidate causes", r.causes) for n, r in reps.items()
                     if not isinstance(r, str) and r.causes is not None and not r.passed]
    sections.append(("Notes", "; ".join(report.notes)))
    return html_report(report.title, f"bnprobe fold --onnx {rep.model}", sections)


# ---- trace ------------------------------------------------------------------------------------------

def trace_lines(cmp: TraceComparison, source: str, lay: Layout | None = None) -> list[str]:
    """A traced run, stage by stage: range, error against the FP64 golden, anomalies.  ``lay``: a BatchNorm call's
    layout (a family layer's call says where its statistics sit itself)."""
    meta, eps, momentum = cmp.meta, cmp.eps, cmp.momentum
    if cmp.layer is not None:
        head = _family_trace_head(cmp, source)
    else:
        assert lay is not None, "a BatchNorm trace is shown with its layout"
        head = [f"input    {source}, shape {tuple(lay.shape)} ({lay.layout}), C = {lay.channels}, R = N*spatial = "
                f"{lay.reduce_size}",
                f"mode     {cmp.mode}; eps {eps:g} (as used: {meta.get('eps_effective', eps):.6g})"
                + ((f", momentum {momentum:g}" if momentum is not None else ", momentum None (cumulative average)")
                   if cmp.mode == "train" else "")]
    lines = [f"policy   {cmp.policy.describe()}", *head,
             "errors   against the FP64 golden (same algorithm, same rounded inputs); ulp = in the stage's own format",
             ""]
    rows = []
    for r in cmp.rows:
        d = r.to_dict()
        d["anomalies"] = " ".join(f"{k}={v}" for k, v in r.anomalies.items()) or ""
        if r.mismatched_nonfinite:
            d["anomalies"] = (d["anomalies"] + f" nonfinite-vs-golden={r.mismatched_nonfinite}").strip()
        rows.append(d)
    lines.append(render_table(rows, ["stage", "format", "kind", "min", "max", "max_abs_err", "max_rel_err",
                                     "max_ulp_err", "anomalies"],
                              headers=["stage", "format", "kind", "min", "max", "max abs err", "max rel err",
                                       "max ulp", "anomalies"]))
    inp = cmp.trace["x"] if cmp.trace is not None and "x" in cmp.trace else None
    if inp is not None and (inp.count("nan") or inp.count("posinf") or inp.count("neginf")):
        lines.append("\nnote: NaN/inf present in the input itself (input-borne, not a kernel fault)")
    return lines


def _family_trace_head(cmp: TraceComparison, source: str) -> list[str]:
    """A family layer's trace: its input, where its statistics and parameters sit, its mode and ε."""
    from bnprobe.core.call import NORM_NAMES

    sh = cmp.layer
    assert sh is not None
    where = {"layer": f" over {sh.normalized}", "rms": f" over {sh.normalized}", "instance": "",
             "group": f" of {sh.groups} group{'s' if sh.groups > 1 else ''}"}[sh.norm]
    params = "γ" if sh.norm == "rms" else "γ, β"
    offset = f", γ applied as {cmp.weight_offset:g} + w" if cmp.weight_offset else ""
    eps = cmp.eps
    return [f"input    {source}, shape {tuple(sh.shape)}",
            f"layer    {NORM_NAMES[sh.norm]}{where}: {sh.rows} rows of R = {sh.r} (kind row), {params} of shape "
            f"{sh.param_shape} (kind param){offset}",
            f"mode     {cmp.mode}; eps {eps:g} (as used: {cmp.meta.get('eps_effective', eps):.6g})"]

"""compare-precision's report: the folder (CSV, JSON, Markdown summary, HTML page) and the terminal text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bnprobe._table import render_table
from bnprobe.engine.budget import BUDGET_CHANNELS
from bnprobe.engine.result import Verdict
from bnprobe.checks.compare.precision import CompareResult, first_failing_call, per_call, summarize, worse_rows
from bnprobe.engine.rules import WORSE_THAN_BENCH, WORSE_ULPS
from bnprobe.core.errors import BNProbeError
from bnprobe.reports import MAX_SORTABLE_ROWS, HtmlTable, OutputDir, dumps_json, html_report, output_dir

__all__ = ["REPORT_FORMATS", "COLUMNS", "report_formats", "report_files", "write_report", "markdown_summary",
           "compare_lines"]

_RATIO = ("the verdict's score over its bound: above 1 fails. By msprobe's benchmark method the largest of its "
          "metrics' ratios (the kernel's over the bench's, the bench's floored) each over its limit; an output an "
          "exemption lets pass (a correct kernel's rounding or accumulation), the share of that bound its error "
          "uses; by an absolute rule, its worst error measure over the rule's limit; inf: NaN/inf where the golden "
          "has none")
#: every column of the HTML page's tables: field -> (heading, what it holds), the heading's tooltip and the
#: glossary under each table (the CSV, JSON and Markdown files keep the field names)
COLUMNS: dict[str, tuple[str, str]] = {
    "adapter": ("adapter", "the kernel judged (bnprobe's adapter name)"),
    "dtype": ("format", "the format the call's x and dy are in (γ, β and the running statistics are in the "
                        "parameter format)"),
    "case": ("input", "the input the call ran on: resnet50/… a ResNet-50 BatchNorm shape with generated data, "
                      "stress/… a stress input, else the input given or a recorded call"),
    "tensor": ("output", "the BatchNorm output: y (training forward), y_infer (inference), saved_mean / saved_invstd "
                         "/ saved_var (the batch statistics kept for the backward), running_mean / running_var "
                         "(the updated running statistics), dx / dgamma / dbeta (backward)"),
    "checked": ("outputs", "outputs compared against the FP64 golden: each output of each input"),
    "failed": ("failed", "outputs whose verdict is FAIL"),
    "worse": ("worse than bench", f"outputs whose error is materially above the bench's (a careful kernel in the same "
                                  f"formats): RMSE or largest error over {WORSE_THAN_BENCH:g}x the bench's and RMSE "
                                  f"over {WORSE_ULPS:g} ulps (RMS) of the output, whatever the verdict"),
    "worse_worst": ("most worse (RMSE ratio)", "of those, the output with the largest RMSE over the bench's RMSE: "
                                               "output on input (that ratio)"),
    "format_warnings": ("format warnings", "outputs where the bench's own output is over msprobe's absolute scaled "
                                           "standard (or the golden is beyond the format's largest value): the "
                                           "format, not the kernel, falls short for this data"),
    "format_worst": ("worst format warning", "of those, the output furthest over the standard's bound: output on "
                                             "input"),
    "worst": ("worst output", "the output with the largest error / bound, passing or not"),
    "worst_ratio": ("worst / bound", "that output's error / bound: " + _RATIO),
    "error_over_bound": ("error / bound", "this output's " + _RATIO),
    "budget_top": ("error-budget cause", f"the stage of the kernel where y's error arises: rerun on the first "
                                         f"{BUDGET_CHANNELS} channels of the input with the worst y with one stage "
                                         "at a time exact (FP64), the earliest stage, in computation order, that "
                                         "removes at least 90% of the largest share removed (blank for a kernel "
                                         "bnprobe does not run stage by stage, e.g. torch)"),
    "budget_share": ("its share", "the share of y's RMSE that disappears when that stage is exact (1: all of it)"),
    "stage": ("stage", "the kernel's stage made exact (FP64) in the rerun; y (output cast): y left unrounded"),
    "error_removed": ("share removed", f"the share of y's RMSE against the golden that disappears when only this "
                                       f"stage is exact (the first {BUDGET_CHANNELS} channels of the input with the "
                                       "worst y); the shares need not add up to 1"),
    "order": ("#", "the call's place in forward order"),
    "call": ("call", "the recorded call"),
    "outputs": ("outputs", "outputs of this call compared against the FP64 golden"),
    "failing": ("failing outputs", "the outputs of this call that fail"),
    "verdict": ("verdict", "PASS or FAIL by the run's rule"),
    "why": ("why", "the verdict in words: the rule's figures against their limits, where the error is greatest "
                   "(and the bench's value there), and the known kernel mistake that reproduces it when one does"),
    "max_abs": ("largest abs. error", "the largest |output − golden| (msprobe compare's MaxAbsErr; NaN where "
                                      "NaN/inf sit in different places)"),
    "max_rel": ("largest rel. error", "the largest |output − golden| / |golden| (msprobe compare's MaxRelativeErr, "
                                      "in float32 for formats up to fp32; float32's eps added where the golden is 0)"),
    "cosine": ("cosine", "cosine similarity of the output and the golden (msprobe compare's Cosine; 1: same "
                         "direction)"),
    "ulp_max": ("largest ULP error", "the largest |output − golden| in units in the last place of the format at the "
                                     "golden (msprobe's accuracy checker)"),
    "rmse_vs_bench": ("RMSE / bench's", "the output's RMSE against the golden over the bench's (finite elements, "
                                        "unfloored; inf where the bench is exact and the kernel is not)"),
    "max_vs_bench": ("largest error / bench's", "the output's largest |error| over the bench's (likewise)"),
    "worse_why": ("how much worse", "both ratios with both kernels' figures, the threshold, and what the verdict "
                                    "let it pass by"),
    "format_why": ("why (format)", "what falls short: the bench's output by msprobe's absolute scaled rule, and what "
                                   "makes the data hard (max mean²/var, min var/eps, R, subnormal or overflowing "
                                   "golden values)"),
    "channel": ("channel", "the channel"),
    "y_max_abs_err": ("largest y error", "the channel's largest |y − golden y|"),
    "var_rel_err": ("variance rel. error", "|the kernel's batch variance − the golden's| / the golden's, for the "
                                           "channel"),
    "mean2_over_var": ("mean² / var", "the golden's mean² over its variance: large, single-pass variance "
                                      "(E[x²] − E[x]²) cancels"),
    "var_over_eps": ("var / eps", "the golden's variance over eps: near 1 or below, eps dominates the variance"),
    "R": ("values per channel", "R = N·H·W, the values each channel's statistics are taken over"),
}


def markdown_summary(result: CompareResult, summary: list[dict[str, Any]] | None = None) -> str:
    """The report's Markdown summary: verdicts per format, failures, worst channels, the error budget.  ``summary``:
    :func:`~bnprobe.checks.compare.precision.summarize` of the result when the caller has it."""
    import pandas as pd

    from bnprobe._table import markdown_table

    s = summarize(result) if summary is None else summary
    lines = [f"# {report_title(result)}", "", report_intro(result) + f" {result.meta['seconds']} s.", "",
             "## Per format", "", markdown_table(pd.DataFrame(s)) if s else "(nothing compared)", ""]
    for n in [] if result.meta.get("recorded") else result.notes:
        lines += [f"Note: {n}", ""]
    if result.meta.get("recorded"):
        first = first_failing_call(result)
        lines += ["## Recorded calls, in forward order", "",
                  "Each call is judged on its own recorded inputs, so the error shown is the kernel's own, not the "
                  "error its input carried from upstream layers.", "",
                  "First call that fails: " + (f"#{first['order']} {first['call']} ({first['failing']}, "
                                                      f"{first['adapter']})" if first else "none") + ".", "",
                  markdown_table(pd.DataFrame(per_call(result))), ""]
        for n in [*result.meta.get("dump", {}).get("notes", []), *result.notes]:
            lines += [f"Note: {n}", ""]
    fails = result.rows[result.rows["verdict"] == Verdict.FAIL] if len(result.rows) else result.rows
    if len(fails):
        lines += ["## Outputs that fail", "",
                  markdown_table(fails[["adapter", "dtype", "case", "tensor", *_cause(fails), "why", "max_abs",
                                        "max_rel", "cosine"]]), ""]
    worse = worse_rows(result.rows)
    if len(worse):
        lines += [f"## {WORSE_TITLE}", "", markdown_table(worse[WORSE_COLUMNS]), ""]
    warns = result.rows[result.rows["format_check"] == Verdict.WARN] if len(result.rows) else result.rows
    if len(warns):
        lines += ["## Format warnings: error over msprobe's absolute standard (the format, not the kernel)", "",
                  markdown_table(warns[["adapter", "dtype", "case", "tensor", "format_why"]]), ""]
    if len(result.channels):
        worst = result.channels.sort_values("y_max_abs_err", ascending=False).head(15)
        lines += ["## Worst channels (y)", "",
                  "mean²/var large: single-pass variance cancels; var/eps near 1: eps dominates the variance.", "",
                  markdown_table(worst), ""]
    if len(result.budget):
        piv = result.budget.groupby(["adapter", "dtype", "stage"])["error_removed"].mean().unstack([0, 1])
        lines += ["## Error budget (share of y's RMSE removed when the stage is exact, on each adapter and format's "
                  "input with the worst y)", "",
                  markdown_table(piv, index=True), ""]
    return "\n".join(lines) + "\n"


REPORT_FORMATS = ("csv", "json", "md", "html")
WORSE_TITLE = ("Worse than the bench: error materially above the careful kernel's (named whatever the verdict; "
               "the ratios are unfloored)")
WORSE_COLUMNS = ["adapter", "dtype", "case", "tensor", "verdict", "rmse_vs_bench", "max_vs_bench", "worse"]


def report_title(result: CompareResult) -> str:
    return "bnprobe compare-precision: " + ("every output passes" if result.passed else "some outputs fail")


def report_intro(result: CompareResult) -> str:
    m = result.meta
    judged = (f"msprobe's benchmark method against the bench '{m['bench']}' (a kernel in the same formats), both "
              "against the FP64 golden" if m["rule"] == "benchmark" else f"msprobe's absolute rule '{m['rule']}'")
    return (f"Adapters {', '.join(m['adapters'])}; formats {', '.join(m['dtypes'])}; {len(m['cases'])} inputs; "
            f"mode {m['mode']}; every output against the FP64 golden on the same rounded inputs, judged by "
            f"{judged}; format warnings by msprobe's absolute standard (rule 'scaled', beyond the format's own "
            "rounding)." + (f" Not judged: the {' and '.join(MODE_LEFT[m] for m in left['modes'])} of "
                            f"{', '.join(left['cases'])} ({left['why']}: training is undefined there, its inference "
                            "alone is judged)." if (left := m.get("left_out")) else ""))


def report_files(formats: tuple[str, ...] = REPORT_FORMATS) -> list[str]:
    """The names of the files :func:`write_report` writes for ``formats``."""
    names = {"csv": ["compare.csv", "channels.csv", "budget.csv"], "json": ["compare.json"], "md": ["summary.md"],
             "html": ["report.html"]}
    return [n for f in formats for n in names.get(f, [])]


def report_formats(text: str) -> tuple[str, ...]:
    """The report formats of a comma-separated list (``--format``), each checked."""
    fmts = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in fmts if f not in REPORT_FORMATS]
    if bad:
        raise BNProbeError(f"unknown report format(s) {', '.join(bad)}; valid: {', '.join(REPORT_FORMATS)}")
    return fmts


def write_report(result: CompareResult, out: Any, formats: tuple[str, ...] = REPORT_FORMATS, *,
                 summary: list[dict[str, Any]] | None = None) -> list[Path]:
    """Write the result's files into ``out`` (a folder path, or an :class:`~bnprobe.reports.OutputDir`): all or
    none, never over an existing file unless the OutputDir allows it; returns the paths.  ``summary``:
    :func:`~bnprobe.checks.compare.precision.summarize` of the result when the caller has it (it is made once)."""
    from bnprobe.plots import compare_svg

    sink = out if isinstance(out, OutputDir) else output_dir(out, "compare-precision")
    report_formats(",".join(formats))
    files: dict[str, Any] = {}
    if "csv" in formats:
        files.update({"compare.csv": result.rows.to_csv(index=False),
                      "channels.csv": result.channels.to_csv(index=False),
                      "budget.csv": result.budget.to_csv(index=False)})
    if "json" in formats:
        files["compare.json"] = dumps_json(result.to_dict())
    summary = summarize(result) if summary is None else summary
    md = markdown_summary(result, summary)
    if "md" in formats:
        files["summary.md"] = md
    if "html" in formats:
        import pandas as pd

        per = pd.DataFrame(summary)  # the worst output's verdict text is in "Outputs that fail" below
        sections: list[tuple[str, Any]] = [("Per adapter and format", per.drop(columns=["worst_why"], errors="ignore"))]
        if result.meta.get("recorded"):
            first = first_failing_call(result)
            sections.append(("Recorded calls in forward order (first that fails: "
                             + (f"#{first['order']} {first['call']}" if first else "none") + ")",
                             pd.DataFrame(per_call(result))))
        fails = result.rows[result.rows["verdict"] == Verdict.FAIL] if len(result.rows) else result.rows
        if len(fails):
            sections.append(("Outputs that fail, worst first", _failing(fails)))
        worse = worse_rows(result.rows)
        if len(worse):
            sections.append((WORSE_TITLE, worse[WORSE_COLUMNS].rename(columns={"worse": "worse_why"})))
        warns = result.rows[result.rows["format_check"] == Verdict.WARN] if len(result.rows) else result.rows
        if len(warns):
            sections.append(("Format warnings: error over msprobe's absolute standard (the format, not the kernel)",
                             warns[["adapter", "dtype", "case", "tensor", "format_why"]]))
        if len(result.channels):
            sections.append(("Worst channels of y (mean²/var: cancellation risk; var/eps: eps dominance)",
                             result.channels.sort_values("y_max_abs_err", ascending=False).head(20)))
        if len(result.budget):
            piv = result.budget.groupby(["adapter", "dtype", "stage"])["error_removed"].mean().reset_index()
            sections.append(("Error budget: share of y's RMSE removed when one stage is exact (each adapter and "
                             "format's input with the worst y)", piv))
        sections.append(("Every output", f"{len(result.rows)} outputs, each with every metric and its verdict: "
                                         "compare.csv beside this page (channels.csv, budget.csv: the channel and "
                                         "stage tables in full)"))
        fig = compare_svg(result.rows) if len(result.rows) else None  # (SVG: matplotlib is not imported)
        files["report.html"] = html_report(report_title(result), report_intro(result), sections, fig,
                                           columns=COLUMNS)
    for name, text in files.items():
        sink.write_text(name, text)
    return sink.commit()


def _failing(fails: Any) -> HtmlTable:
    """The failing outputs, worst first (error / bound, largest first; ties in the run's order), sortable by any
    column and filterable by adapter, format and output."""
    t = fails.assign(error_over_bound=fails["score"] / fails["bound"])
    t = t.sort_values("error_over_bound", ascending=False, kind="stable", na_position="last")
    return HtmlTable(t[["adapter", "dtype", "case", "tensor", "error_over_bound", *_cause(t), "why", "max_abs",
                        "max_rel", "cosine", "ulp_max"]], sortable=True, filters=("adapter", "dtype", "tensor"),
                     max_rows=MAX_SORTABLE_ROWS, sorted_by="error_over_bound")


def _cause(rows: Any) -> list[str]:
    """["cause"] where some row names its failure (what names it: a recipe model, identify's recipe and choice)."""
    return ["cause"] if "cause" in rows and rows["cause"].notna().any() else []


def _left_out(result: CompareResult) -> str:
    """The modes no output was judged in because an input holds one value per channel, said in the headline (the
    notes say why): such a run passes on its inference alone."""
    left = result.meta.get("left_out")
    if not left:
        return ""
    n = len(left["cases"])
    return (f"; {' and '.join(MODE_LEFT[m] for m in left['modes'])} not judged on {n} input{'s' if n > 1 else ''} "
            f"({left['why']})")


#: each mode as the headline names what it did not judge
MODE_LEFT = {"train": "training forward", "backward": "backward"}


def _unjudged(result: CompareResult) -> str:
    """How many outputs no rule measured (msprobe's benchmark skips float64 outputs), said in the headline: such an
    output passes without having been judged."""
    rows = result.rows
    n = int(rows["score"].isna().sum()) if len(rows) else 0
    return f"; {n} output(s) not judged (msprobe's rules skip float64 outputs)" if n else ""


def compare_lines(result: CompareResult, what: str, recorded_notes: tuple[str, ...] | list[str] = (),
                  recorded: bool = False, *, summary: list[dict[str, Any]] | None = None) -> list[str]:
    """The terminal text: one line of verdicts, the table per adapter and format, per recorded call (forward
    order) the first that fails, and the notes.  ``summary``: :func:`~bnprobe.checks.compare.precision.summarize`
    of the result when the caller has it (its rows are copied, not changed)."""
    rows = [dict(r) for r in (summarize(result) if summary is None else summary)]
    for r in rows:
        r["budget"] = f"{r['budget_top']} ({100 * r['budget_share']:.0f}%)" if r["budget_top"] else ""
        r["worst / bound"] = r["worst_ratio"]
    n_fail = int((result.rows["verdict"] == Verdict.FAIL).sum()) if len(result.rows) else 0
    n_warn = int((result.rows["format_check"] == Verdict.WARN).sum()) if len(result.rows) else 0
    n_worse = len(worse_rows(result.rows))
    judged = (f"benchmark vs {result.meta['bench']}" if result.meta["rule"] == "benchmark"
              else f"absolute rule {result.meta['rule']}")
    lines = [f"compare-precision: {what}, {len(result.rows)} outputs vs the FP64 golden ({judged}), "
             f"{result.meta['seconds']} s: " + ("all pass" if result.passed else f"{n_fail} fail")
             + (f"; {n_worse} worse than {result.meta['bench']}" if n_worse else "")
             + f"; {n_warn} format warning(s)" + _unjudged(result) + _left_out(result),
             render_table(rows, ["adapter", "dtype", "checked", "failed", "worst", "worst / bound", "worse",
                                 "worse_worst", "format_warnings", "format_worst", "budget"],
                          headers=["adapter", "format", "outputs", "failed", "worst output", "worst/bound",
                                   "worse than bench", "most worse (RMSE ratio)", "format warnings",
                                   "worst format warning", "error-budget cause (share)"])]
    if recorded:
        first = first_failing_call(result)
        lines += ["", render_table(per_call(result), ["order", "call", "adapter", "dtype", "outputs", "failed",
                                                      "failing"],
                                   headers=["#", "call (forward order)", "adapter", "format", "outputs", "failed",
                                            "failing outputs"]),
                  "first call that fails: " + (f"#{first['order']} {first['call']} ({first['failing']}, "
                                               f"{first['adapter']})" if first else "none")]
    return lines + _named_line(result) + [f"note: {n}" for n in [*recorded_notes, *result.notes]]


def _named_line(result: CompareResult) -> list[str]:
    """The line saying how many failing outputs are named, and by what (each row's ``cause``); [] when none fail."""
    rows = result.rows
    fails = rows[rows["verdict"] == Verdict.FAIL] if len(rows) else rows
    if not len(fails):
        return []
    causes = fails["cause"].dropna() if "cause" in fails else fails["tensor"].iloc[0:0]
    by = ", ".join(f"{c} {n}" for c, n in causes.value_counts(sort=True).items())
    return [f"failing outputs named: {len(causes)} of {len(fails)}" + (f" ({by})" if by else "")
            + ("; each unnamed one says what is known of it (its row's why)" if len(causes) < len(fails) else "")]

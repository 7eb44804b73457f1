"""compare-precision's report: the folder (CSV, JSON, Markdown summary, HTML page) and the terminal text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bnprobe._table import render_table
from bnprobe.checks.compare.precision import CompareResult, first_failing_call, per_call, summarize, worse_rows
from bnprobe.core.errors import BNProbeError
from bnprobe.reports import OutputDir, dumps_json, html_report, output_dir

__all__ = ["REPORT_FORMATS", "report_formats", "report_files", "write_report", "markdown_summary", "compare_lines"]


def markdown_summary(result: CompareResult) -> str:
    """The report's Markdown summary: verdicts per format, failures, worst channels, the error budget."""
    import pandas as pd

    from bnprobe._table import markdown_table

    s = summarize(result)
    lines = [f"# {report_title(result)}", "", report_intro(result) + f" {result.meta['seconds']} s.", "",
             "## Per format", "", markdown_table(pd.DataFrame(s)) if s else "(nothing compared)", ""]
    for n in [] if result.meta.get("recorded") else result.meta.get("notes", []):
        lines += [f"Note: {n}", ""]
    if result.meta.get("recorded"):
        first = first_failing_call(result)
        lines += ["## Recorded calls, in forward order", "",
                  "Each call is judged on its own recorded inputs, so the error shown is the kernel's own, not the "
                  "error its input carried from upstream layers.", "",
                  "First call that fails: " + (f"#{first['order']} {first['call']} ({first['failing']}, "
                                                      f"{first['adapter']})" if first else "none") + ".", "",
                  markdown_table(pd.DataFrame(per_call(result))), ""]
        for n in [*result.meta.get("dump", {}).get("notes", []), *result.meta.get("notes", [])]:
            lines += [f"Note: {n}", ""]
    fails = result.rows[result.rows["verdict"] == "FAIL"] if len(result.rows) else result.rows
    if len(fails):
        lines += ["## Outputs that fail", "",
                  markdown_table(fails[["adapter", "dtype", "case", "tensor", "why", "max_abs", "max_rel",
                                        "cosine"]]), ""]
    worse = worse_rows(result.rows)
    if len(worse):
        lines += [f"## {WORSE_TITLE}", "", markdown_table(worse[WORSE_COLUMNS]), ""]
    warns = result.rows[result.rows["format_check"] == "WARN"] if len(result.rows) else result.rows
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
            "rounding).")


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


def write_report(result: CompareResult, out: Any, formats: tuple[str, ...] = REPORT_FORMATS) -> list[Path]:
    """Write the result's files into ``out`` (a folder path, or an :class:`~bnprobe.reports.OutputDir`): all or
    none, never over an existing file unless the OutputDir allows it; returns the paths."""
    from bnprobe.plots import plot_compare

    sink = out if isinstance(out, OutputDir) else output_dir(out, "compare-precision")
    report_formats(",".join(formats))
    files: dict[str, Any] = {}
    if "csv" in formats:
        files.update({"compare.csv": result.rows.to_csv(index=False),
                      "channels.csv": result.channels.to_csv(index=False),
                      "budget.csv": result.budget.to_csv(index=False)})
    if "json" in formats:
        files["compare.json"] = dumps_json(result.to_dict())
    md = markdown_summary(result)
    if "md" in formats:
        files["summary.md"] = md
    if "html" in formats:
        import pandas as pd

        per = pd.DataFrame(summarize(result))  # the worst output's verdict text is in "Outputs that fail" below
        sections: list[tuple[str, Any]] = [("Per adapter and format", per.drop(columns=["worst_why"], errors="ignore"))]
        if result.meta.get("recorded"):
            first = first_failing_call(result)
            sections.append(("Recorded calls in forward order (first that fails: "
                             + (f"#{first['order']} {first['call']}" if first else "none") + ")",
                             pd.DataFrame(per_call(result))))
        fails = result.rows[result.rows["verdict"] == "FAIL"] if len(result.rows) else result.rows
        if len(fails):
            sections.append(("Outputs that fail", fails[["adapter", "dtype", "case", "tensor", "why",
                                                         "max_abs", "max_rel", "cosine", "ulp_max"]]))
        worse = worse_rows(result.rows)
        if len(worse):
            sections.append((WORSE_TITLE, worse[WORSE_COLUMNS]))
        warns = result.rows[result.rows["format_check"] == "WARN"] if len(result.rows) else result.rows
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
        fig = plot_compare(result.rows) if len(result.rows) else None
        files["report.html"] = html_report(report_title(result), report_intro(result), sections, fig)
    for name, text in files.items():
        sink.write_text(name, text)
    return sink.commit()


def _unjudged(result: CompareResult) -> str:
    """How many outputs no rule measured (msprobe's benchmark skips float64 outputs), said in the headline: such an
    output passes without having been judged."""
    rows = result.rows
    n = int(rows["score"].isna().sum()) if len(rows) else 0
    return f"; {n} output(s) not judged (msprobe's rules skip float64 outputs)" if n else ""


def compare_lines(result: CompareResult, what: str, recorded_notes: tuple[str, ...] | list[str] = (),
                  recorded: bool = False) -> list[str]:
    """The terminal text: one line of verdicts, the table per adapter and format, per recorded call (forward
    order) the first that fails, and the notes."""
    rows = summarize(result)
    for r in rows:
        r["budget"] = f"{r['budget_top']} ({100 * r['budget_share']:.0f}%)" if r["budget_top"] else ""
        r["worst / bound"] = r["worst_ratio"]
    n_fail = int((result.rows["verdict"] == "FAIL").sum()) if len(result.rows) else 0
    n_warn = int((result.rows["format_check"] == "WARN").sum()) if len(result.rows) else 0
    n_worse = len(worse_rows(result.rows))
    judged = (f"benchmark vs {result.meta['bench']}" if result.meta["rule"] == "benchmark"
              else f"absolute rule {result.meta['rule']}")
    lines = [f"compare-precision: {what}, {len(result.rows)} outputs vs the FP64 golden ({judged}), "
             f"{result.meta['seconds']} s: " + ("all pass" if result.passed else f"{n_fail} fail")
             + (f"; {n_worse} worse than {result.meta['bench']}" if n_worse else "")
             + f"; {n_warn} format warning(s)" + _unjudged(result),
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
    return lines + [f"note: {n}" for n in [*recorded_notes, *result.meta["notes"]]]

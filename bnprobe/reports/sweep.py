"""A sweep's report: the table of every (step, rank, call) as CSV and Parquet, JSON, a Markdown summary, and the
layer x step and layer x rank heatmaps of the worst score; and the terminal text."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from bnprobe._table import markdown_table, render_table
from bnprobe.engine.result import Verdict
from bnprobe.reports import OutputDir, dumps_json
from bnprobe.sweep.command import SWEEP_FILES
from bnprobe.sweep.tasks import SCORES, SweepResult

__all__ = ["SWEEP_FILES", "write_sweep", "sweep_lines"]

_COLUMNS = ["step", "rank", "order", "layer", "call", "shape", "dtype", "verdict", "score", "failing", "worst",
            "attempts", "seconds", "error"]


def _parquet(frame: Any) -> bytes | None:
    """The table as Parquet bytes, or None when no Parquet engine is installed (pyarrow: ``bnprobe[dist]``)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return None
    import io

    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


def _title(result: SweepResult) -> str:
    failed = sum(r["verdict"] == Verdict.FAIL for r in result.rows)
    errors = sum(r["verdict"] == Verdict.ERROR for r in result.rows)
    steps = len({r["step"] for r in result.rows})
    ranks = len({r["rank"] for r in result.rows})
    return (f"{result.command} sweep of {result.root}: {len(result.rows)} calls ({steps} step(s) x {ranks} rank(s)), "
            + ("all pass" if result.passed else f"{failed} fail" + (f", {errors} could not run" if errors else ""))
            + (f"; {len(result.ranks)} layer(s) x step checked across ranks ("
               + ", ".join(f"{k} {n}" for k, n in Counter(r["kind"] or "error" for r in result.ranks).items()) + ")"
               + (f", {bad} not explained by the concatenated batch" if (bad := sum(r["verdict"] != Verdict.PASS
                                                                                   for r in result.ranks)) else "")
               if result.ranks else "")
            + f"; {result.seconds:.1f} s on {result.engine}")


def _markdown(result: SweepResult, frame: Any) -> str:
    import pandas as pd

    cols = [c for c in _COLUMNS if c in frame]
    bad = frame[frame["verdict"] != Verdict.PASS]
    parts = [f"# {_title(result)}", "", f"Score: {SCORES[result.command]}.", "",
             "## First call that fails, per step and rank (forward order)", "",
             markdown_table(pd.DataFrame(result.first_failing())) if result.first_failing() else "none", "",
             "## Ranks that disagree on the same layer and step", "",
             markdown_table(pd.DataFrame(result.disagreements())) if result.disagreements() else "none", "",
             "## Statistics across ranks (each layer and step, against the concatenated batch)", "",
             "\n".join(f"- step {r['step']}: {r['summary'] or r.get('error', '')}" for r in result.ranks) or "none",
             "", "## Calls that fail or could not run", "",
             markdown_table(bad[cols]) if len(bad) else "none", "", "## Figures", "",
             "- [layer x step](heatmap-layer-step.png)", "- [layer x rank](heatmap-layer-rank.png)", ""]
    return "\n".join(parts + [f"Note: {n}" for n in result.notes]) + "\n"


def write_sweep(result: SweepResult, sink: OutputDir) -> list[Path]:
    """Every file of the report into ``sink``, all or nothing (the journal stays beside them)."""
    from bnprobe.plots import plot_sweep_heatmap

    frame = result.frame
    sink.write_text("sweep.csv", frame.to_csv(index=False))
    data = _parquet(frame)
    if data is None:
        result.notes.append("no Parquet table: install pyarrow (pip install 'bnprobe[dist]')")
    else:
        sink.write_bytes("sweep.parquet", data)
    if result.ranks:
        import pandas as pd

        sink.write_text("ranks.csv", pd.DataFrame(result.ranks).to_csv(index=False))
    sink.write_text("sweep.json", dumps_json(result.to_dict()))
    ok = frame[frame["verdict"] != Verdict.ERROR]
    if len(ok):
        for across in ("step", "rank"):
            sink.save_figure(f"heatmap-layer-{across}.png", plot_sweep_heatmap(ok, across, SCORES[result.command]),
                             dpi=110)
    sink.write_text("summary.md", _markdown(result, frame))
    return sink.commit()


def sweep_lines(result: SweepResult, folder: Path | None = None) -> list[str]:
    """The terminal text: the verdict line, the first failing call per step and rank, the ranks that disagree,
    the calls that could not run, the notes and where the report is."""
    lines = [_title(result)]
    first = [{**f, "failing": f["failing"] if len(f["failing"]) <= 90 else f["failing"][:89] + "…"}
             for f in result.first_failing()]
    if first:
        lines += ["", "first call that fails, per step and rank (forward order):",
                  render_table(first, ["step", "rank", "order", "call", "verdict", "failing"],
                               headers=["step", "rank", "#", "call", "verdict", "failing / error"])]
    dis = result.disagreements()
    if dis:
        lines += ["", "ranks that disagree on the same layer and step:",
                  render_table(dis, ["step", "layer", "what", "ranks"])]
    lines += [f"note: {n}" for n in result.notes]
    if folder is not None:
        lines.append(f"report: {folder}/ (sweep.csv, sweep.json, summary.md, heatmaps; journal {folder}/"
                     "sweep-journal.jsonl)")
    return lines

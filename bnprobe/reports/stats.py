"""plot-stats' folder: a figure per run and layer, the summaries, stats.csv, findings.json, index.md and
index.html; and the terminal text."""

from __future__ import annotations

import html
import re
from typing import Any

from bnprobe.core.call import EPS
from bnprobe.reports import OutputDir, dumps_json, html_report

__all__ = ["STATS_FILES", "write_stats", "stats_lines"]

STATS_FILES = ("stats.csv", "findings.json", "index.md", "index.html")


def _file_name(stem: str, ext: str, taken: list[tuple[str, str]]) -> str:
    """A file name from user-given layer and policy names: safe characters only, never two alike."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._")[:100] or "figure"
    name, k = f"{base}.{ext}", 1
    while any(name == f for f, _ in taken):
        name, k = f"{base}-{k}.{ext}", k + 1
    return name


def _figures(df: Any, eps: float, channels: int, ext: str, sink: OutputDir,
             findings: list[Any]) -> list[tuple[str, str]]:
    """Every figure saved into ``sink``: (file name, what it shows)."""
    from bnprobe.plots import (plot_channel_stats, plot_distributions, plot_divergence, plot_layer_summary,
                               plot_monitor_layer)

    files: list[tuple[str, str]] = []
    monitored = "invstd" in df.columns and "x_max" in df.columns
    for pol in df["policy"].unique():
        for layer in df[df["policy"] == pol]["layer"].unique():
            name = _file_name(f"stats-{pol}-{layer}", ext, files)
            sink.save_figure(name, plot_channel_stats(df, pol, layer, channels), dpi=110)
            files.append((name, f"μ and σ² over steps: {layer}, {pol}"))
            if monitored:
                marks = [f.step for f in findings if f.kind == "anomaly" and f.policy == pol and f.layer == layer]
                name = _file_name(f"monitor-{pol}-{layer}", ext, files)
                sink.save_figure(name, plot_monitor_layer(df, pol, layer, marks), dpi=110)
                files.append((name, f"invstd and headroom over steps: {layer}, {pol}"))
        name = _file_name(f"summary-{pol}", ext, files)
        sink.save_figure(name, plot_layer_summary(df, pol), dpi=110)
        files.append((name, f"layer x step drift of the running mean: {pol}"))
    if "fp32" in set(df["policy"]) and df["policy"].nunique() > 1:
        sink.save_figure(f"divergence.{ext}", plot_divergence(df), dpi=110)
        files.append((f"divergence.{ext}", "low precision vs fp32 over steps"))
    sink.save_figure(f"distributions.{ext}", plot_distributions(df, eps), dpi=110)
    files.append((f"distributions.{ext}", "mean²/var and var/eps per channel"))
    return files


def write_stats(df: Any, findings: list[Any], source: str, sink: OutputDir, *, eps: float | None, channels: int,
                ext: str) -> None:
    """The figures, the statistics, the findings and an index (Markdown and HTML) into ``sink``, all or nothing
    (``eps``, for var/eps: default 1e-5)."""
    eps = EPS if eps is None else eps
    files = _figures(df, eps, channels, ext, sink, findings)
    sink.write_text("stats.csv", df.to_csv(index=False))
    sink.write_text("findings.json", dumps_json([f.to_dict() for f in findings]))
    lines = [f"# bnprobe plot-stats: {source}", "", f"{len(findings)} finding(s)", ""]
    lines += [f"- **{f.kind}** ({f.policy} {f.layer}, step {f.step}"
              + (f", channels {list(f.channels)[:8]}" if f.channels else "") + f"): {f.detail}" for f in findings]
    lines += ["", "## Figures", ""] + [f"- [{desc}]({name})" for name, desc in files]
    sink.write_text("index.md", "\n".join(lines) + "\n")
    body = "".join(f'<h2>{html.escape(desc)}</h2><a href="{html.escape(name)}"><img src="{html.escape(name)}" '
                   f'alt="{html.escape(desc)}"></a>' for name, desc in files)
    page = html_report(f"bnprobe plot-stats: {source}", f"{len(findings)} finding(s)",
                       [("Findings", "; ".join(f"{f.kind} ({f.policy} {f.layer}, step {f.step}): {f.detail}"
                                               for f in findings) or "none")], body=body)
    sink.write_text("index.html", page)
    sink.commit()


def stats_lines(df: Any, findings: list[Any], source: str, sink: OutputDir) -> list[str]:
    """The terminal text: what was read, the findings, where the index is."""
    return [f"plot-stats ({source}): {df['step'].nunique()} steps, {df['layer'].nunique()} layer(s), "
            f"{df['policy'].nunique()} run(s); {len(findings)} finding(s)",
            *(f"  {f.kind}: {f.policy} {f.layer} step {f.step}: {f.detail}" for f in findings),
            f"figures and index: {sink.path}/index.html"]

"""Every report bnprobe shows or writes, assembled here; the CLI only prints what these return.

Files are written atomically (temporary file, then rename) and never over an existing file silently
(:mod:`bnprobe._files`).  One module per kind of report: :mod:`.checks` (gradcheck, overflow, doctor, fold,
trace), :mod:`.compare` (compare-precision's folder), :mod:`.rsqrt`, :mod:`.shrink`, :mod:`.stats` (plot-stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bnprobe._files import (
    OutputDir,
    atomic_write_bytes,
    atomic_write_text,
    check_targets,
    dumps_json,
    output_dir,
    save_figure,
    to_jsonable,
)

__all__ = ["atomic_write_text", "atomic_write_bytes", "save_figure", "check_targets", "to_jsonable", "dumps_json",
           "new_report_dir", "html_report", "output_dir", "OutputDir", "Report", "file_stem", "write_result"]


def new_report_dir(root: str | Path, stem: str) -> Path:
    """A new, empty ``<root>/<stem>-<timestamp>[-k]`` folder, created now (no other run can get the same one)."""
    return output_dir(None, stem, root=root).path


MAX_HTML_ROWS = 100  # rows of a table the page shows; the CSV beside it holds them all

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1600px; }}
.wide {{ overflow-x: auto; max-width: 100%; }}
table {{ border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: left; vertical-align: top; }}
td {{ max-width: 40em; overflow-wrap: normal; }}
th {{ background: #f2f2f2; }}
.FAIL {{ color: #b00020; font-weight: bold; }} .PASS {{ color: #1b5e20; }}
img {{ max-width: 100%; }} p.more {{ color: #555; font-size: 0.9em; }}
@media print {{ .wide {{ overflow: visible; }} td {{ max-width: none; }} }}
</style></head><body>
<h1>{title}</h1>
<p>{intro}</p>
{body}</body></html>
"""


def html_report(title: str, intro: str, sections: list[tuple[str, Any]], figure: Any | None = None,
                body: str = "") -> str:
    """One self-contained HTML page: an embedded PNG figure, tables (DataFrames or text), then ``body`` (HTML
    the caller has escaped)."""
    import base64
    import html
    import io

    parts = []
    if figure is not None:
        buf = io.BytesIO()
        figure.savefig(buf, format="png", dpi=110)
        parts.append(f'<img alt="error per format and tensor" src="data:image/png;base64,'
                     f'{base64.b64encode(buf.getvalue()).decode()}">')
    for heading, content in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if hasattr(content, "to_html"):
            shown = content.head(MAX_HTML_ROWS)
            text = shown.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0)
            text = text.replace("<td>FAIL</td>", '<td class="FAIL">FAIL</td>').replace(
                "<td>PASS</td>", '<td class="PASS">PASS</td>')
            parts.append(f'<div class="wide">{text}</div>')
            if len(content) > len(shown):
                parts.append(f'<p class="more">the first {len(shown)} of {len(content)} rows; every row is in the '
                             "CSV files beside this page</p>")
        else:
            parts.append(f"<p>{html.escape(str(content))}</p>")
    return _HTML.format(title=html.escape(title), intro=html.escape(intro), body="\n".join(parts) + "\n" + body)


@dataclass
class Report:
    """What a command shows and writes for one result: on the terminal its ``title``, ``blocks`` of text
    (tables) and ``notes``; in files ``<stem>.csv`` (``frame``), ``<stem>.json`` (``doc``, also what ``--json``
    prints), ``<stem>.md`` (``markdown``) and any ``pages`` (file name -> text, e.g. an HTML page)."""

    title: str
    blocks: list[str]
    notes: list[str]
    passed: bool
    doc: Any
    stem: str = ""
    frame: Any = None
    markdown: str = ""
    pages: dict[str, str] = field(default_factory=dict)

    def lines(self, written: list[Path] | None = None) -> list[str]:
        """The terminal text: title, blocks, notes, and the files written (when any were)."""
        return [self.title, *self.blocks, *(f"note: {n}" for n in self.notes),
                *(["wrote " + ", ".join(str(w) for w in written)] if written is not None else [])]


def file_stem(*parts: str) -> str:
    """A report file's stem from its parts (adapter names hold ':' and '/')."""
    return "-".join(p.replace(":", "_").replace("/", "_") for p in parts)


def write_result(sink: OutputDir, report: Report) -> list[Path]:
    """The report's CSV, JSON and Markdown into the output folder, all or nothing, never over existing files
    without ``--force``, its pages first; returns the paths."""
    for name, text in report.pages.items():
        sink.write_text(name, text)
    sink.write_text(f"{report.stem}.csv", report.frame.to_csv(index=False))
    sink.write_text(f"{report.stem}.json", dumps_json(report.doc))
    sink.write_text(f"{report.stem}.md", report.markdown)
    return sink.commit()

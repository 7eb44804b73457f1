"""Every report bnprobe shows or writes, assembled here; the CLI only prints what these return.

Files are written atomically (temporary file, then rename) and never over an existing file silently
(:mod:`bnprobe._files`).  One module per kind of report: :mod:`.checks` (gradcheck, overflow, doctor, fold,
trace), :mod:`.compare` (compare-precision's folder), :mod:`.rsqrt`, :mod:`.shrink`, :mod:`.stats` (plot-stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from bnprobe.engine.result import Verdict
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
           "new_report_dir", "html_report", "HtmlTable", "output_dir",
           "OutputDir", "Report", "file_stem", "write_result"]


def new_report_dir(root: str | Path, stem: str) -> Path:
    """A new, empty ``<root>/<stem>-<timestamp>[-k]`` folder, created now (no other run can get the same one)."""
    return output_dir(None, stem, root=root).path


MAX_HTML_ROWS = 100  # rows of a table the page shows; the CSV beside it holds them all
MAX_SORTABLE_ROWS = 1000  # rows of a sortable, filterable table (all of them, but for a run failing nearly everywhere)

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1600px; }}
.wide {{ overflow-x: auto; max-width: 100%; }}
table {{ border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0 0.3em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: left; vertical-align: top; }}
td {{ max-width: 40em; overflow-wrap: normal; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
th {{ background: #f2f2f2; }} th[title] {{ text-decoration: underline dotted #999; }}
th[aria-sort="descending"]::after {{ content: " ▼"; }} th[aria-sort="ascending"]::after {{ content: " ▲"; }}
table.js th {{ cursor: pointer; }}
.FAIL {{ color: #b00020; font-weight: bold; }} .PASS {{ color: #1b5e20; }}
img {{ max-width: 100%; }} p.more {{ color: #555; font-size: 0.9em; }}
details.glossary {{ font-size: 0.8em; color: #444; margin: 0 0 1.5em; }}
details.glossary dl {{ display: grid; grid-template-columns: max-content 1fr; gap: 0.1em 1em; margin: 0.3em 0; }}
details.glossary dt {{ font-weight: bold; }} details.glossary dd {{ margin: 0; max-width: 70em; }}
.filters {{ font-size: 0.9em; margin: 0.3em 0; }} .filters label {{ margin-right: 1em; }}
@media print {{ .wide {{ overflow: visible; }} td {{ max-width: none; }} .filters {{ display: none; }} }}
</style>{script}</head><body>
<h1>{title}</h1>
<p>{intro}</p>
{body}</body></html>
"""

# Sorts a table.sortable by the heading clicked (numbers by their value, data-v; NaN last; a second click turns the
# order round) and shows only the rows its filters (select boxes, hidden until this script shows them) let through.
# Without JavaScript the page shows every row in the order it was written.
_SCRIPT = """<script>
document.addEventListener('DOMContentLoaded', () => {
  for (const t of document.querySelectorAll('table.sortable')) {
    const body = t.tBodies[0], heads = [...t.tHead.rows[0].cells];
    t.classList.add('js');
    const key = (tr, i) => { const c = tr.cells[i]; return c.dataset.v !== undefined ? +c.dataset.v : c.textContent; };
    const sort = (th, i) => {
      const num = [...body.rows].every(tr => tr.cells[i].dataset.v !== undefined);
      const was = th.getAttribute('aria-sort');
      const down = was ? was === 'ascending' : num;  // numbers largest first, words a to z, then round
      const rows = [...body.rows].sort((a, b) => {
        const x = key(a, i), y = key(b, i);
        if (num && (Number.isNaN(x) || Number.isNaN(y))) return Number.isNaN(x) - Number.isNaN(y);
        const c = num ? (x < y ? -1 : x > y ? 1 : 0) : String(x).localeCompare(String(y), undefined, {numeric: true});
        return down ? -c : c;
      });
      heads.forEach(h => h.removeAttribute('aria-sort'));
      th.setAttribute('aria-sort', down ? 'descending' : 'ascending');
      body.append(...rows);
    };
    heads.forEach((th, i) => {
      th.tabIndex = 0;
      th.addEventListener('click', () => sort(th, i));
      th.addEventListener('keydown', e => {
        if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); sort(th, i); }
      });
    });
    const box = document.querySelector(`.filters[data-table="${t.id}"]`);
    if (!box) continue;
    const picks = [...box.querySelectorAll('select')], shown = box.querySelector('.shown');
    const filter = () => {
      let n = 0;
      for (const tr of body.rows) {
        tr.hidden = !picks.every(s => s.value === '' || tr.cells[+s.dataset.col].textContent === s.value);
        n += !tr.hidden;
      }
      shown.textContent = `${n} of ${body.rows.length} rows shown`;
    };
    picks.forEach(s => s.addEventListener('change', filter));
    box.hidden = false;
    filter();
  }
});
</script>"""


@dataclass
class HtmlTable:
    """A table of the page: ``frame``'s first ``max_rows`` rows; ``sortable``: a click on a heading sorts it (the
    rows as given until then); ``filters``: the columns it can be filtered by (a select box each)."""

    frame: Any
    sortable: bool = False
    filters: tuple[str, ...] = ()
    max_rows: int = MAX_HTML_ROWS
    sorted_by: str = ""  # the column (largest first) the rows are given in, marked as sorted


def _cell(v: Any) -> tuple[str, str]:
    """A cell's text (escaped) and, for a number, its value as data-v (what the page sorts by)."""
    import html
    import math
    import numbers

    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return html.escape(str(v)), ""
    if isinstance(v, numbers.Integral):
        return str(v), f' data-v="{v}"'
    x = float(v)
    return ("NaN" if math.isnan(x) else f"{x:.4g}"), f' data-v="{x!r}"' if not math.isnan(x) else ' data-v="NaN"'


def _table_html(tid: str, table: HtmlTable, columns: Mapping[str, tuple[str, str]]) -> str:
    """The table (headings from ``columns``: field -> (heading, explanation), a field without one by its name), its
    filters (hidden until the page's script shows them), and a glossary of its columns."""
    import html

    df = table.frame.head(table.max_rows)
    fields = [str(c) for c in df.columns]
    out = []
    if table.filters:
        picks = []
        for f in table.filters:
            values = sorted({str(v) for v in df[f]})
            opts = "".join(f'<option value="{html.escape(v)}">{html.escape(v)}</option>' for v in values)
            picks.append(f'<label>{html.escape(columns.get(f, (f, ""))[0])} <select data-col="{fields.index(f)}">'
                         f'<option value="">all</option>{opts}</select></label>')
        out.append(f'<div class="filters" data-table="{tid}" hidden>{"".join(picks)}<span class="shown"></span></div>')
    heads = []
    for f in fields:
        heading, explanation = columns.get(f, (f, ""))
        attrs = (f' title="{html.escape(explanation)}"' if explanation else "") + \
            (' aria-sort="descending"' if f == table.sorted_by else "")
        heads.append(f'<th scope="col"{attrs}>{html.escape(heading)}</th>')
    rows = []
    for rec in df.itertuples(index=False, name=None):
        cells = []
        for v in rec:
            text, data = _cell(v)
            cls = f' class="{text}"' if text in (Verdict.PASS, Verdict.FAIL) else (' class="num"' if data else "")
            cells.append(f"<td{cls}{data}>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    sortable = ' class="sortable"' if table.sortable else ""
    out.append(f'<div class="wide"><table id="{tid}"{sortable}>'
               f'<thead><tr>{"".join(heads)}</tr></thead>\n<tbody>\n' + "\n".join(rows) + "\n</tbody></table></div>")
    known = [f for f in fields if columns.get(f, ("", ""))[1]]
    if known:
        out.append('<details class="glossary"><summary>What the columns mean</summary><dl>'
                   + "".join(f"<dt>{html.escape(columns[f][0])}</dt><dd>{html.escape(columns[f][1])}</dd>"
                             for f in known) + "</dl></details>")
    if len(table.frame) > len(df):
        out.append(f'<p class="more">the first {len(df)} of {len(table.frame)} rows; every row is in the CSV files '
                   "beside this page</p>")
    return "\n".join(out)


def html_report(title: str, intro: str, sections: list[tuple[str, Any]], figure: Any | None = None,
                body: str = "", columns: Mapping[str, tuple[str, str]] | None = None) -> str:
    """One self-contained HTML page: an embedded figure (a matplotlib Figure as PNG, or SVG text), tables
    (DataFrames, :class:`HtmlTable` or text), then ``body`` (HTML the caller has escaped).  ``columns``: field ->
    (heading, explanation) for every table's headings (the explanation as the heading's tooltip and in a glossary
    under the table); a sortable table brings the page's one inline script (no file or network fetched)."""
    import base64
    import html
    import io

    parts = []
    if isinstance(figure, str):  # an SVG document
        parts.append(f'<img alt="error per format and tensor" src="data:image/svg+xml;base64,'
                     f'{base64.b64encode(figure.encode()).decode()}">')
    elif figure is not None:
        buf = io.BytesIO()
        figure.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        parts.append(f'<img alt="error per format and tensor" src="data:image/png;base64,'
                     f'{base64.b64encode(buf.getvalue()).decode()}">')
    script = False
    for k, (heading, content) in enumerate(sections):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if hasattr(content, "to_html"):
            content = HtmlTable(content)
        if isinstance(content, HtmlTable):
            parts.append(_table_html(f"t{k}", content, columns or {}))
            script = script or content.sortable
        else:
            parts.append(f"<p>{html.escape(str(content))}</p>")
    return _HTML.format(title=html.escape(title), intro=html.escape(intro), body="\n".join(parts) + "\n" + body,
                        script=_SCRIPT if script else "")


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

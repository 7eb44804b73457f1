"""Writing results to disk: atomically (temporary file, then rename) and never over an existing file silently."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bnprobe._files import (
    OutputDir,
    atomic_write_bytes,
    atomic_write_text,
    check_targets,
    output_dir,
    save_figure,
)

__all__ = ["atomic_write_text", "atomic_write_bytes", "save_figure", "check_targets", "to_jsonable", "dumps_json",
           "new_report_dir", "html_report", "output_dir", "OutputDir"]


def to_jsonable(o: Any) -> Any:
    """numpy scalars/arrays to Python, NaN/inf to strings, tuples to lists."""
    import numpy as np

    if isinstance(o, dict):
        return {str(k): to_jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return to_jsonable(o.tolist())
    if isinstance(o, np.generic):
        return to_jsonable(o.item())
    if isinstance(o, float) and not math.isfinite(o):
        return "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o


def dumps_json(o: Any) -> str:
    return json.dumps(to_jsonable(o), indent=2, default=str)


def new_report_dir(root: str | Path, stem: str) -> Path:
    """A new, empty ``<root>/<stem>-<timestamp>[-k]`` folder, created now (no other run can get the same one)."""
    return output_dir(None, stem, root=root).path


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; }}
th {{ background: #f2f2f2; }} td:first-child, th:first-child {{ text-align: left; }}
.FAIL {{ color: #b00020; font-weight: bold; }} .PASS {{ color: #1b5e20; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{title}</h1>
<p>{intro}</p>
{body}
</body></html>
"""


def html_report(title: str, intro: str, sections: list[tuple[str, Any]], figure: Any | None = None) -> str:
    """One self-contained HTML page: tables (DataFrames or HTML text) and an embedded PNG figure."""
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
            text = content.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0)
            text = text.replace("<td>FAIL</td>", '<td class="FAIL">FAIL</td>').replace(
                "<td>PASS</td>", '<td class="PASS">PASS</td>')
            parts.append(text)
        else:
            parts.append(f"<p>{html.escape(str(content))}</p>")
    return _HTML.format(title=html.escape(title), intro=html.escape(intro), body="\n".join(parts))

"""Plain-text tables for the terminal (no pandas at start-up)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["render_table", "fmt_num", "markdown_table"]


def fmt_num(v: Any) -> str:
    """Short, aligned-friendly number formatting: 4 significant digits, '-' for NaN."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v == 0:
            return "0"
        if 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return str(v)


def render_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], *,
                 headers: Sequence[str] | None = None) -> str:
    """Left-aligned text columns, numbers right-aligned."""
    headers = list(headers or columns)
    cells = [[fmt_num(r.get(c)) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
               for c in columns]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def markdown_table(frame: Any, *, index: bool = False) -> str:
    """A pandas DataFrame as a Markdown table (numbers formatted like the terminal tables)."""
    df = frame.reset_index() if index else frame
    cols = [str(c) if not isinstance(c, tuple) else " ".join(str(p) for p in c) for c in df.columns]
    out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for rec in df.itertuples(index=False):
        cells = []
        for v in rec:
            if hasattr(v, "item"):
                v = v.item()
            cells.append(fmt_num(v).replace("|", "\\|"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)

"""The rsqrt / reciprocal / sqrt / divide analysis: its files (CSV, JSON, the error plot) and terminal text."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bnprobe._table import render_table
from bnprobe.reports import OutputDir, dumps_json

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.checks.rsqrt.mathfn import MathAnalysis

__all__ = ["math_files", "write_math", "math_lines"]


def math_files(stem: str) -> tuple[str, str, str]:
    """The names :func:`write_math` may write for ``stem`` (the PNG only when there is a curve to plot)."""
    return f"{stem}.csv", f"{stem}.json", f"{stem}.png"


def write_math(result: MathAnalysis, sink: OutputDir, stem: str) -> list[Path]:
    """CSV and JSON of the analysis and the plot of its error curve, all or nothing."""
    from bnprobe.plots import plot_math_error

    csv, js, png = math_files(stem)
    sink.write_text(csv, result.frame.to_csv(index=False))
    sink.write_text(js, dumps_json(result.to_dict()))
    if result.curve:
        sink.save_figure(png, plot_math_error(result), dpi=120)
    return sink.commit()


def math_lines(result: MathAnalysis) -> list[str]:
    """Per Newton step count: ULP and relative error, correctly rounded share, non-finite results; the ULP
    histograms, the worst inputs and the notes."""
    spec = result.spec
    lines = [f"{spec.label()}: {spec.form} Newton form" + (f", steps in {spec.working}" if spec.working else "")
             + f"; domain {result.domain}"]
    rows = [{**s.row(), "correct %": 100.0 * s.correctly_rounded} for s in result.steps]
    lines.append(render_table(rows, ["newton", "inputs", "max_ulp_normal", "mean_ulp_normal", "max_rel_normal",
                                     "correct %", "max_ulp", "nonfinite", "nonfinite_mismatch"],
                              headers=["newton", "inputs", "max ulp", "mean ulp", "max rel err", "correct %",
                                       "max ulp (incl. subnormal)", "non-finite", "of which wrong"]))
    for st in result.steps:
        if st.histogram:
            total = sum(st.histogram.values())
            parts = "  ".join(f"{k}: {100.0 * v / total:.3g}%" for k, v in st.histogram.items())
            lines.append(f"ulp histogram, {st.newton} step(s): {parts}")
    last = result.steps[-1]
    if last.worst:  # every digit of x and of the result: neighbouring inputs would print alike at 4 digits
        rows = [{"x": f"{w['x']:.9g}", "result": f"{w['result']:.9g}", "exact": f"{w['exact']:.9g}", "ulp": w["ulp"]}
                for w in last.worst[:5]]
        lines += [f"\nworst normal inputs after {last.newton} step(s):", render_table(rows, ["x", "result", "exact",
                                                                                           "ulp"])]
    return lines + [f"note: {note}" for note in result.notes]

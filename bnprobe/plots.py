"""Results -> matplotlib Figures.  Figures are built without pyplot, so no global backend is touched;
the CLI saves them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    import pandas as pd

    from bnprobe.checks.mathfn import MathAnalysis

__all__ = ["plot_math_error", "plot_compare"]


def plot_math_error(analysis: MathAnalysis) -> Figure:
    """Signed relative error against the input over two binades [1, 4), one panel per Newton step."""
    from matplotlib.figure import Figure

    spec = analysis.spec
    steps = [s.newton for s in analysis.steps]
    fig = Figure(figsize=(9, 2.4 * len(steps) + 0.8), layout="constrained")
    axes = fig.subplots(len(steps), 1, sharex=True, squeeze=False)[:, 0]
    x = analysis.curve["x"]
    unit = 2.0 ** -(1 + {"fp32": 23, "fp16": 10, "bf16": 7}[spec.format])
    for ax, step in zip(axes, analysis.steps):
        lo, hi = analysis.curve[f"min_{step.newton}"], analysis.curve[f"max_{step.newton}"]
        ax.fill_between(x, lo, hi, step="post", color="tab:blue", alpha=0.6, linewidth=0.5,
                        label="error range within each input bin")
        ax.axhline(unit, color="tab:red", linestyle=":", linewidth=1, label=f"±u = ±2^{int(np.log2(unit))}")
        ax.axhline(-unit, color="tab:red", linestyle=":", linewidth=1)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_ylabel("relative error")
        ax.set_title(f"{step.newton} Newton step{'s' if step.newton != 1 else ''}: max |rel| "
                     f"{step.max_rel_normal:.3g} (normal inputs), max {step.max_ulp_normal:.3g} ulp, "
                     f"{step.correctly_rounded:.1%} correctly rounded", fontsize=9)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("input x (two binades, log2 scale)")
    extra = {"magic": f", constant {hex(spec.constant) if spec.constant is not None else 'default'}",
             "table": f", {spec.bits}-bit table"}.get(spec.method, "")
    working = f", Newton in {spec.working}" if spec.working and spec.working != spec.format else ""
    fig.suptitle(f"{spec.op} in {spec.format}: {spec.method} estimate{extra}, {spec.form} Newton form{working}")
    return fig


def plot_compare(rows: pd.DataFrame) -> Figure:
    """Worst error per tensor and format, as a multiple of the standard's bound (log scale; 1 = the limit)."""
    from matplotlib.figure import Figure

    df = rows.copy()
    df["ratio"] = (df["score"] / df["bound"]).clip(lower=1e-6)
    tensors = [t for t in ("y", "y_infer", "saved_mean", "saved_invstd", "saved_var", "running_mean", "running_var",
                           "dx", "dgamma", "dbeta") if t in set(df["tensor"])]
    groups = sorted({(a, d) for a, d in zip(df["adapter"], df["dtype"])})
    fig = Figure(figsize=(max(8, 1.1 * len(tensors) + 3), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(groups), 1)
    for k, (adapter, dtype) in enumerate(groups):
        sub = df[(df["adapter"] == adapter) & (df["dtype"] == dtype)]
        worst = [float(sub[sub["tensor"] == t]["ratio"].max()) if (sub["tensor"] == t).any() else np.nan
                 for t in tensors]
        ax.bar(np.arange(len(tensors)) + (k - (len(groups) - 1) / 2) * width, worst, width,
               label=f"{adapter} {dtype}")
    ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="standard's bound")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(tensors)), tensors, rotation=20)
    ax.set_ylabel("worst error / bound (over all inputs)")
    ax.set_title("BatchNorm outputs vs the FP64 golden: worst error as a multiple of msprobe's bound")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig

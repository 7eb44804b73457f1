"""bnprobe.plots: the compare figure's bars are each output's worst error over its bound, per adapter and format."""

import math

import pandas as pd

from bnprobe.plots import plot_compare


def test_the_compare_figure_draws_each_groups_worst_ratio():
    """One bar per (adapter, format) and tensor: the largest score/bound over the inputs (NaN rows left out), NaN
    where the group has no such output, an infinite ratio drawn hatched at the cap (10x the largest finite one)."""
    rows = pd.DataFrame([
        ("k", "fp16", "y", 0.5, 1.0), ("k", "fp16", "y", 2.0, 1.0), ("k", "fp16", "y", float("nan"), 1.0),
        ("k", "fp16", "dx", 3.0, 2.0), ("k", "bf16", "y", float("inf"), 1.0), ("t", "fp16", "dx", 40.0, 1.0),
        ("t", "fp16", "dx", float("nan"), 1.0)], columns=["adapter", "dtype", "tensor", "score", "bound"])
    fig = plot_compare(rows)
    bars = fig.axes[0].containers  # groups sorted: (k, bf16), (k, fp16), (t, fp16); tensors y, dx
    heights = [[b.get_height() for b in c] for c in bars]
    cap = max(1e3, 10 * 40.0)
    want = [[cap, math.nan], [2.0, 1.5], [math.nan, 40.0]]
    for got, exp in zip(heights, want):
        assert all((math.isnan(g) and math.isnan(e)) or g == e for g, e in zip(got, exp)), (heights, want)
    assert [b.get_hatch() for b in bars[0]][0] == "xx" and not bars[1][0].get_hatch()
    assert fig.axes[0].get_yscale() == "log"


def test_the_compare_figures_legend_is_beside_the_bars_not_over_them():
    """The legend (one line per adapter and format, 18 on the default run) lies outside the axes: its box and the
    axes' box do not meet once drawn, and it is within the figure (nothing cut off)."""
    rows = pd.DataFrame([(f"adapter-{a}", d, t, 10.0 ** (a - 2), 1.0) for a in range(6)
                         for d in ("fp16", "bf16", "fp32")
                         for t in ("y", "saved_mean", "saved_invstd", "running_var", "dx", "dgamma", "dbeta")],
                        columns=["adapter", "dtype", "tensor", "score", "bound"])
    fig = plot_compare(rows)
    fig.draw_without_rendering()
    ax = fig.axes[0]
    legend, axes, whole = ax.get_legend().get_window_extent(), ax.get_window_extent(), fig.bbox
    assert len(ax.get_legend().get_texts()) == 19  # 18 groups and the bound's line
    assert not legend.overlaps(axes), (legend, axes)
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and whole.y0 <= legend.y0 and legend.y1 <= whole.y1

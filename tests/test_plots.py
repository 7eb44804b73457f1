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

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


def test_the_report_chart_in_svg_draws_the_same_bars_on_a_log_scale():
    """compare_svg (the report's chart, no matplotlib) draws the bars plot_compare draws: one per group and tensor
    with a value (NaN: none), each top at log10(its ratio) on one scale, measured from the bound's dashed line at 1
    (so 2.0, 1.5, 40 and the cap 1e3 stand in those proportions), the infinite ratio hatched at the cap, and the
    legend's names right of the axes' frame."""
    import xml.etree.ElementTree as ET

    from bnprobe.plots import compare_svg

    rows = pd.DataFrame([
        ("k", "fp16", "y", 0.5, 1.0), ("k", "fp16", "y", 2.0, 1.0), ("k", "fp16", "y", float("nan"), 1.0),
        ("k", "fp16", "dx", 3.0, 2.0), ("k", "bf16", "y", float("inf"), 1.0), ("t", "fp16", "dx", 40.0, 1.0),
        ("t", "fp16", "dx", float("nan"), 1.0)], columns=["adapter", "dtype", "tensor", "score", "bound"])
    svg = ET.fromstring(compare_svg(rows))
    ns = "{http://www.w3.org/2000/svg}"
    rects = svg.iter(f"{ns}rect")
    bars = [r for r in rects if r.get("fill", "").startswith("#") and r.get("fill") != "#fff" and r.get("x")
            and float(r.get("width")) < 100 and float(r.get("height")) > 10]  # (legend swatches are 10 px high)
    hatched = [r for r in svg.iter(f"{ns}rect") if r.get("fill") == "url(#hatch)"]
    bound = next(ln for ln in svg.iter(f"{ns}line") if ln.get("stroke") == "#d62728" and ln.get("x1") != ln.get("x2")
                 and float(ln.get("x2")) - float(ln.get("x1")) > 100)
    y1 = float(bound.get("y1"))
    tops = sorted(y1 - float(b.get("y")) for b in bars)  # height above the bound's line, smallest first
    want = sorted(math.log10(v) for v in (1e3, 2.0, 1.5, 40.0))  # the cap: max(1e3, 10 * 40)
    scale = tops[-1] / want[-1]
    assert len(bars) == 4 and all(abs(t - scale * w) < 0.05 for t, w in zip(tops, want)), (tops, want)
    assert len(hatched) == 1 and hatched[0].get("y") == max(bars, key=lambda b: y1 - float(b.get("y"))).get("y")
    frame = next(r for r in svg.iter(f"{ns}rect") if r.get("fill") == "none")
    right = float(frame.get("x")) + float(frame.get("width"))
    names = {t.text: float(t.get("x")) for t in svg.iter(f"{ns}text")}
    assert all(names[n] > right for n in ("k bf16", "k fp16", "t fp16", "standard's bound")), names

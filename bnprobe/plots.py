"""Results -> matplotlib Figures, and compare-precision's report chart as SVG text.

Figures are built without pyplot, so no global backend is touched; the CLI saves them.  The report's chart
(:func:`compare_svg`) is written as text: a report needs no matplotlib import for one bar chart."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from bnprobe.core.call import EPS

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    import pandas as pd

    from bnprobe.checks.rsqrt.mathfn import MathAnalysis

__all__ = ["plot_math_error", "plot_compare", "compare_bars", "compare_svg", "plot_channel_stats",
           "plot_layer_summary", "plot_divergence", "plot_distributions", "plot_sweep_heatmap"]

MAX_LABELLED_ROWS = 60  # heatmap rows that get a name each; beyond, every k-th
MAX_LEGEND = 12  # lines named in a legend; the others are drawn unnamed


def _text(name: object) -> str:
    """A user's name (layer, run) as literal figure text: ``$`` would start matplotlib's math mode."""
    return str(name).replace("$", r"\$")


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


_TENSORS = ("y", "y_infer", "saved_mean", "saved_invstd", "saved_var", "running_mean", "running_var", "dx", "dgamma",
            "dbeta")
_TITLE = "BatchNorm outputs vs the FP64 golden: worst error as a multiple of msprobe's bound"
_YLABEL = "worst error / bound (over all inputs; hatched: inf)"


def compare_bars(rows: pd.DataFrame) -> tuple[list[str], list[tuple[str, str]], list[list[float]], float]:
    """The compare chart's bars: (tensors, (adapter, format) groups sorted, each group's worst error / bound per
    tensor over all inputs (NaN where it has none; ratios clipped at 1e-6), the cap an infinite ratio is drawn at:
    ten times the largest finite one, at least 1e3)."""
    df = rows.copy()
    with np.errstate(all="ignore"):
        ratio = (df["score"] / df["bound"]).clip(lower=1e-6)
    finite = ratio[np.isfinite(ratio)]
    cap = max(1e3, 10.0 * float(finite.max())) if len(finite) else 1e3
    df["ratio"] = ratio.where(np.isfinite(ratio) | ratio.isna(), cap)  # inf (NaN/overflow) drawn at the cap
    tensors = [t for t in _TENSORS if t in set(df["tensor"])]
    groups = sorted({(a, d) for a, d in zip(df["adapter"], df["dtype"])})
    peaks = df.groupby(["adapter", "dtype", "tensor"])["ratio"].max()  # (NaN left out, as Series.max leaves it)
    return tensors, groups, [[float(peaks.get((a, d, t), np.nan)) for t in tensors] for a, d in groups], cap


def plot_compare(rows: pd.DataFrame) -> Figure:
    """Worst error per tensor and format, as a multiple of the standard's bound (log scale; 1 = the limit)."""
    from matplotlib.figure import Figure

    tensors, groups, peaks, cap = compare_bars(rows)
    fig = Figure(figsize=(max(8, 1.1 * len(tensors) + 3), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(groups), 1)
    for k, ((adapter, dtype), worst) in enumerate(zip(groups, peaks)):
        bars = ax.bar(np.arange(len(tensors)) + (k - (len(groups) - 1) / 2) * width, worst, width,
                      label=f"{adapter} {dtype}")
        for bar, w in zip(bars, worst):
            if w == cap:  # an inf ratio: hatched, at the cap
                bar.set_hatch("xx")
    ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="standard's bound")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(tensors)), tensors, rotation=20)
    ax.set_ylabel(_YLABEL)
    ax.set_title(_TITLE)
    ax.grid(True, axis="y", alpha=0.3)
    # beside the axes, right of the bars (constrained layout makes room for it): never over a bar
    ax.legend(fontsize=8, ncol=1 if len(groups) < 24 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    return fig


# matplotlib's default colour cycle (tab10), so the SVG chart's groups look as plot_compare's do
_CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_LEGEND_COLUMN = 210  # px per legend column: the longest built-in name ("emulated:fp16-acc16 fp16") at 11 px


def compare_svg(rows: pd.DataFrame) -> str:
    """:func:`plot_compare`'s chart (the same bars: :func:`compare_bars`) as a standalone SVG document: log scale
    over whole decades from the smallest bar (or 1) to the largest, the bound's dashed line at 1, an infinite ratio
    hatched at the cap, the legend right of the axes."""
    from html import escape

    tensors, groups, peaks, cap = compare_bars(rows)
    values = [v for worst in peaks for v in worst if v == v and v > 0]
    lo = math.floor(math.log10(min([1.0, *values])))
    hi = max(math.ceil(math.log10(max([1.0, *values]))), lo + 1)
    cols = 1 if len(groups) < 24 else 2
    left, top, bottom, plot_w, plot_h = 78, 40, 64, max(121 * len(tensors), 360), 400
    legend_x = left + plot_w + 14
    per_col = math.ceil((len(groups) + 1) / cols)  # the groups and the bound's line
    width, height = legend_x + cols * _LEGEND_COLUMN, max(top + plot_h + bottom, top + 16 * per_col + 16)

    def y_of(v: float) -> float:
        return top + plot_h * (hi - math.log10(v)) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse">'
           '<path d="M0,6 L6,0 M-1,1 L1,-1 M5,7 L7,5 M0,0 L6,6 M-1,5 L1,7 M5,-1 L7,1" stroke="#000" '
           'stroke-width="0.8"/></pattern></defs>',
           f'<rect width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{left + plot_w / 2:.1f}" y="24" text-anchor="middle" font-size="14">{escape(_TITLE)}</text>']
    for e in range(lo, hi + 1):  # a grid line and a label at each decade
        y = y_of(10.0 ** e)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#b0b0b0" '
                   'stroke-opacity="0.5" stroke-width="0.8"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">10<tspan dy="-6" font-size="9">{e}'
                   '</tspan></text>')
    slot = plot_w / max(len(tensors), 1)
    bar_w = slot * 0.8 / max(len(groups), 1)
    floor_y = top + plot_h
    for k, worst in enumerate(peaks):
        colour = _CYCLE[k % len(_CYCLE)]
        for i, v in enumerate(worst):
            if not v == v or v <= 0:  # no output of this tensor in the group
                continue
            x = left + slot * (i + 0.5) + (k - (len(groups) - 1) / 2) * bar_w - bar_w / 2
            y = y_of(v)
            out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{floor_y - y:.2f}" '
                       f'fill="{colour}"/>')
            if v == cap:  # an inf ratio: hatched, at the cap
                out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{floor_y - y:.2f}" '
                           'fill="url(#hatch)"/>')
    bound = y_of(1.0)
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{bound:.1f}" y2="{bound:.1f}" stroke="#d62728" '
               'stroke-width="1.2" stroke-dasharray="5,3"/>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#000"/>')
    for i, t in enumerate(tensors):  # the tensors' names under their bars, turned as plot_compare turns them
        x = left + slot * (i + 0.5)
        out.append(f'<text x="{x:.1f}" y="{floor_y + 16}" text-anchor="middle" '
                   f'transform="rotate(-20 {x:.1f} {floor_y + 16})">{escape(t)}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2:.1f})">{escape(_YLABEL)}</text>')
    names = [(f"{a} {d}", _CYCLE[k % len(_CYCLE)]) for k, (a, d) in enumerate(groups)] + [("standard's bound", "")]
    for n, (name, colour) in enumerate(names):
        x, y = legend_x + (n // per_col) * _LEGEND_COLUMN, top + 8 + 16 * (n % per_col)
        mark = (f'<rect x="{x}" y="{y - 9}" width="18" height="10" fill="{colour}"/>' if colour else
                f'<line x1="{x}" x2="{x + 18}" y1="{y - 4}" y2="{y - 4}" stroke="#d62728" stroke-width="1.2" '
                'stroke-dasharray="5,3"/>')
        out.append(f'{mark}<text x="{x + 24}" y="{y}" font-size="11">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _select_channels(g: pd.DataFrame, k: int) -> list[int]:
    """The k most anomalous channels: largest drift of the running mean from the batch mean (in std)."""
    last = g[g["step"] == g["step"].max()].set_index("channel")
    if "running_mean" in last and last["running_mean"].notna().any():
        score = (last["running_mean"] - last["mean"]).abs() / np.sqrt(last["var"].abs() + 1e-12)
    else:
        score = last["var"].abs()
    return [int(c) for c in score.sort_values(ascending=False, na_position="first").index[:k]]


def plot_channel_stats(df: pd.DataFrame, policy: str, layer: str, channels: int = 6) -> Figure:
    """Batch mean and variance per channel over steps, with the running estimates dashed."""
    from matplotlib.figure import Figure

    g = df[(df["policy"] == policy) & (df["layer"] == layer)]
    chans = _select_channels(g, channels)
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    ax_m, ax_v = fig.subplots(2, 1, sharex=True)
    colors = [f"C{i}" for i in range(10)]
    for i, c in enumerate(chans):
        s = g[g["channel"] == c].sort_values("step")
        col = colors[i % len(colors)]
        ax_m.plot(s["step"], s["mean"], color=col, linewidth=1, label=f"channel {c}" if i < MAX_LEGEND else None)
        ax_v.plot(s["step"], s["var"], color=col, linewidth=1)
        if "running_mean" in s and s["running_mean"].notna().any():
            ax_m.plot(s["step"], s["running_mean"], color=col, linewidth=1.5, linestyle="--")
            ax_v.plot(s["step"], s["running_var"], color=col, linewidth=1.5, linestyle="--")
    ax_m.set_ylabel("mean μ")
    ax_v.set_ylabel("variance σ²")
    ax_v.set_yscale("log")
    ax_v.set_xlabel("training step")
    ax_m.set_title("batch statistics (solid) and running estimates (dashed)", fontsize=9)
    ax_m.legend(fontsize=7, ncol=3, loc="upper right")
    for ax in (ax_m, ax_v):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{_text(layer)} ({_text(policy)}): μ and σ² of the {len(chans)} most drifting channels")
    return fig


def plot_layer_summary(df: pd.DataFrame, policy: str) -> Figure:
    """Layer x step heatmap of the median drift |running_mean - batch mean| / batch std."""
    from matplotlib.figure import Figure

    g = df[df["policy"] == policy].copy()
    fig = Figure(figsize=(10, 1.2 + 0.5 * min(g["layer"].nunique(), MAX_LABELLED_ROWS)), layout="constrained")
    ax = fig.subplots()
    if "running_mean" not in g or g["running_mean"].isna().all():
        g["drift"] = np.nan
    else:
        g["drift"] = (g["running_mean"] - g["mean"]).abs() / np.sqrt(g["var"].abs() + 1e-12)
    piv = g.groupby(["layer", "step"])["drift"].median().unstack("step")
    im = ax.imshow(piv.to_numpy(), aspect="auto", cmap="viridis", interpolation="nearest",
                   extent=(piv.columns.min() - 0.5, piv.columns.max() + 0.5, len(piv) - 0.5, -0.5))
    every = -(-len(piv) // MAX_LABELLED_ROWS)
    ax.set_yticks(range(0, len(piv), every), [_text(n) for n in piv.index[::every]])
    ax.set_xlabel("training step")
    ax.set_ylabel("layer" if every == 1 else f"layer (every {every}th named)")
    fig.colorbar(im, ax=ax, label="median |running mean − batch mean| / batch std")
    ax.set_title(f"{_text(policy)}: how far the running mean trails the batch mean, per layer and step")
    return fig


def plot_divergence(df: pd.DataFrame, base: str = "fp32") -> Figure:
    """Low precision vs ``base``: median relative error of the batch variance over steps, per policy and layer,
    and a channel x step heatmap for the worst policy/layer."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    ax_l, ax_h = fig.subplots(2, 1)
    ref = df[df["policy"] == base].set_index(["step", "layer", "channel"])["var"]
    worst = None
    named = 0
    for pol in [p for p in df["policy"].unique() if p != base]:
        cur = df[df["policy"] == pol].set_index(["step", "layer", "channel"])["var"]
        rel = ((cur - ref).abs() / ref.abs()).dropna().rename("rel").reset_index()
        for layer, g in rel.groupby("layer"):
            med = g.groupby("step")["rel"].median()
            ax_l.plot(med.index, med.to_numpy(), label=f"{_text(pol)} {_text(layer)}" if named < MAX_LEGEND else None)
            named += 1
            if worst is None or med.max() > worst[0]:
                worst = (med.max(), pol, layer, g)
    ax_l.set_yscale("log")
    ax_l.set_xlabel("training step")
    ax_l.set_ylabel(f"median |σ² − σ²({base})| / σ²({base})")
    ax_l.set_title(f"batch variance vs the {base} run (same data, each run trains its own weights)", fontsize=9)
    ax_l.grid(True, alpha=0.3)
    if worst is not None:
        ax_l.legend(fontsize=7, ncol=2, loc="upper right")
        _, pol, layer, g = worst
        piv = g.pivot(index="channel", columns="step", values="rel")
        im = ax_h.imshow(np.log10(piv.to_numpy() + 1e-16), aspect="auto", cmap="magma", interpolation="nearest")
        fig.colorbar(im, ax=ax_h, label="log10 relative error of σ²")
        ax_h.set_xlabel("training step")
        ax_h.set_ylabel("channel")
        ax_h.set_title(f"{_text(pol)} {_text(layer)}: relative error of σ² per channel and step", fontsize=9)
    fig.suptitle("low precision vs " + _text(base))
    return fig


def plot_monitor_layer(df: pd.DataFrame, policy: str, layer: str, anomalies: list[int]) -> Figure:
    """A monitored layer over steps: invstd's range across channels, and the headroom in binades of the run's
    format left by the largest |x|, |y| and |dx| (log2(format max / largest magnitude)); anomalous steps marked."""
    from matplotlib.figure import Figure

    from bnprobe.core.formats import get_format

    g = df[(df["policy"] == policy) & (df["layer"] == layer)]
    fig = Figure(figsize=(10, 6), layout="constrained")
    ax_i, ax_h = fig.subplots(2, 1, sharex=True)
    by = g.groupby("step")
    inv = by["invstd"].agg(["min", "max"])
    ax_i.fill_between(inv.index, inv["min"], inv["max"], alpha=0.3, color="C0", label="min–max over channels")
    ax_i.plot(inv.index, by["invstd"].median(), color="C0", linewidth=1, label="median")
    ax_i.set_yscale("log")
    ax_i.set_ylabel("invstd = 1/√(σ² + ε)")
    fmax = get_format(str(g["dtype"].iloc[0])).max
    with np.errstate(all="ignore"):
        for i, t in enumerate(("x", "y", "dx")):
            if f"{t}_max" not in g or g[f"{t}_max"].isna().all():
                continue
            big = np.maximum(g[f"{t}_max"].abs(), g[f"{t}_min"].abs()).groupby(g["step"]).max()
            room = np.log2(fmax / big)
            ax_h.plot(big.index, room.where(np.isfinite(room), -1.0), color=f"C{i + 1}", linewidth=1, label=f"|{t}|")
            gone = room.index[big.isna() | np.isinf(big)]
            if len(gone):  # NaN or inf: no headroom left, drawn at −1
                ax_h.plot(gone, np.full(len(gone), -1.0), "x", color=f"C{i + 1}", markersize=8)
    ax_h.axhline(0, color="k", linewidth=0.8)
    ax_h.set_ylabel(f"headroom, binades ({_text(g['dtype'].iloc[0])}; ×: NaN/inf)")
    ax_h.set_xlabel("training step")
    for ax in (ax_i, ax_h):
        for k, step in enumerate(sorted(set(anomalies))):
            ax.axvline(step, color="red", linewidth=1, alpha=0.6, label="anomaly" if k == 0 and ax is ax_i else None)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{_text(layer)} ({_text(policy)}): invstd and headroom over steps")
    return fig


def plot_distributions(df: pd.DataFrame, eps: float = EPS) -> Figure:
    """Per-channel mean²/var (cancellation risk of single-pass variance) and var/eps (eps dominance) at the last
    step."""
    from matplotlib.figure import Figure

    last = df[df["step"] == df["step"].max()]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for k, ((pol, layer), g) in enumerate(last.groupby(["policy", "layer"])):
        with np.errstate(all="ignore"):  # NaN, inf and negative variances are left out (find() reports them)
            risk = np.log10(g["mean"].to_numpy() ** 2 / g["var"].to_numpy() + 1e-30)
            dominance = np.log10(g["var"].to_numpy() / eps)
        for ax, v in ((ax1, risk), (ax2, dominance)):
            if np.isfinite(v).any():
                ax.hist(v[np.isfinite(v)], bins=30, alpha=0.5,
                        label=f"{_text(pol)} {_text(layer)}" if k < MAX_LEGEND else None)
    ax1.axvline(np.log10(2.0**12), color="tab:red", linestyle="--", linewidth=1,
                label="fp32 single-pass loses half its digits")
    ax1.set_xlabel("log10(mean² / var) per channel")
    ax2.axvline(1.0, color="tab:red", linestyle="--", linewidth=1, label="var = 10·eps")
    ax2.set_xlabel("log10(var / eps) per channel")
    for ax in (ax1, ax2):
        ax.set_ylabel("channels")
        ax.legend(fontsize=6, loc="upper right")
        ax.grid(True, alpha=0.3)
    fig.suptitle("where the risky channels are (last step)")
    return fig


def plot_sweep_heatmap(table: pd.DataFrame, across: str, what: str) -> Figure:
    """Layer (forward order) x ``across`` (``step`` or ``rank``) heatmap of a sweep's worst score per cell (the
    largest over the other axis): ``what`` says what the score is.  Errors and missing cells are blank."""
    from matplotlib.figure import Figure

    order = table.groupby("layer", sort=False)["order"].min().sort_values()
    piv = table.pivot_table(index="layer", columns=across, values="score", aggfunc="max").reindex(order.index)
    piv = piv[sorted(piv.columns, key=lambda c: (0, int(c)) if str(c).isdigit() else (1, str(c)))]  # rank 2 < 10
    # at most 16 in wide (every k-th column named beyond 40) and at least 3 in tall: the colour bar's label fits
    fig = Figure(figsize=(min(16.0, max(6.0, 1.0 + 0.6 * piv.shape[1])),
                          max(3.0, 1.4 + 0.32 * min(len(piv), MAX_LABELLED_ROWS))), layout="constrained")
    ax = fig.subplots()
    data = piv.to_numpy(dtype=float)
    im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap="magma_r", interpolation="nearest",
                   vmin=0.0, vmax=max(1.0, float(np.nanmax(data))) if np.isfinite(data).any() else 1.0)
    every = -(-len(piv) // MAX_LABELLED_ROWS) if len(piv) else 1
    ax.set_yticks(range(0, len(piv), every), [_text(n) for n in piv.index[::every]])
    step = -(-piv.shape[1] // 40) if piv.shape[1] else 1
    ax.set_xticks(range(0, piv.shape[1], step), [_text(c) for c in piv.columns[::step]])
    ax.set_xlabel(across if step == 1 else f"{across} (every {step}th named)")
    ax.set_ylabel("layer, forward order" if every == 1 else f"layer, forward order (every {every}th named)")
    import textwrap

    fig.colorbar(im, ax=ax, label=textwrap.fill(_text(what), 30))
    ax.set_title(f"{_text(what)}: the worst per layer and {across}")
    return fig

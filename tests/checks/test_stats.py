import numpy as np
import pandas as pd
import pytest

from bnprobe.checks.stats import StatsRecorder, find, load_log, simulate
from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.kernels import forward_train
from bnprobe.plots import plot_channel_stats, plot_distributions, plot_divergence, plot_layer_summary


@pytest.fixture(scope="module")
def run():
    return simulate(("fp32", "fp16", "bf16"), steps=40, seed=3)


def test_simulation_is_deterministic_by_seed(run):
    again = simulate(("fp32", "fp16", "bf16"), steps=40, seed=3)
    pd.testing.assert_frame_equal(run, again)
    other = simulate(("fp32",), steps=40, seed=4)
    assert not np.allclose(other["mean"].to_numpy(), run[run.policy == "fp32"]["mean"].to_numpy())


def test_simulation_records_what_it_should(run):
    assert set(run.policy) == {"fp32", "fp16", "bf16"} and set(run.layer) == {"bn1", "bn2"}
    cols = {"step", "layer", "channel", "mean", "var", "running_mean", "running_var", "rstd", "anomalies",
            "y_min", "y_max", "grad_gamma", "grad_norm_x", "loss"}
    assert cols <= set(run.columns)
    # the running mean follows PyTorch's update with momentum 0.1, step by step
    g = run[(run.policy == "fp32") & (run.layer == "bn1") & (run.channel == 0)].sort_values("step")
    rm, m = g.running_mean.to_numpy(), g["mean"].to_numpy()
    np.testing.assert_allclose(rm[1:], 0.9 * rm[:-1] + 0.1 * m[1:], rtol=1e-5, atol=1e-6)
    assert g.loss.iloc[-1] < g.loss.iloc[0]


def test_figures_have_their_axes_and_labels(run):
    fig = plot_channel_stats(run, "fp16", "bn1", 4)
    ax_m, ax_v = fig.axes
    assert ax_m.get_ylabel() == "mean μ" and ax_v.get_ylabel() == "variance σ²" and ax_v.get_xlabel() == "training step"
    assert len(ax_m.lines) == 8 and "bn1 (fp16)" in fig._suptitle.get_text()  # 4 channels x (batch, running)
    fig = plot_divergence(run)
    assert "fp32" in fig.axes[0].get_ylabel() and fig.axes[1].get_ylabel() == "channel"
    assert len(fig.axes[0].lines) == 4  # fp16 and bf16, two layers
    fig = plot_layer_summary(run, "fp32")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["bn1", "bn2"]
    fig = plot_distributions(run)
    assert "mean² / var" in fig.axes[0].get_xlabel() and "var / eps" in fig.axes[1].get_xlabel()


def log_of(rm_fn, var=1.0, mean=5.0, steps=40, channels=3, nan_at=None):
    rows = []
    rm = np.zeros(channels)
    rv = np.ones(channels)
    rng = np.random.default_rng(0)
    for t in range(steps):
        m = mean + rng.normal(0, 0.1, channels)
        v = np.full(channels, var) * rng.uniform(0.9, 1.1, channels)
        if nan_at is not None and t >= nan_at:
            v[1] = np.nan
        rm, rv = rm_fn(rm, m), rm_fn(rv, v)
        for c in range(channels):
            rows.append({"step": t, "layer": "bn", "channel": c, "mean": m[c], "var": v[c], "running_mean": rm[c],
                         "running_var": rv[c]})
    return pd.DataFrame(rows).assign(policy="log")


PYTORCH = lambda r, b: 0.9 * r + 0.1 * b  # noqa: E731


def test_clean_logs_raise_nothing(run):
    assert find(run) == []
    assert find(log_of(PYTORCH)) == []


@pytest.mark.parametrize("crafted,kind", [
    (log_of(lambda r, b: r), "running statistics diverge from the batch statistics"),  # never updated
    (log_of(PYTORCH, var=1e-6), "variance collapsing toward eps"),
    (log_of(PYTORCH, nan_at=20), "non-finite statistics"),
    (log_of(lambda r, b: 0.1 * r + 0.9 * b), "momentum behaves like the wrong convention"),
])
def test_each_finding_on_a_crafted_log(crafted, kind):
    kinds = {f.kind for f in find(crafted)}
    assert kind in kinds
    if kind == "momentum behaves like the wrong convention":
        assert "Keras" in next(f for f in find(crafted) if f.kind == kind).detail


def test_malformed_logs_are_clear_errors(tmp_path):
    good = log_of(PYTORCH)
    p = tmp_path / "l.csv"
    good.drop(columns=["var"]).to_csv(p, index=False)
    with pytest.raises(BNProbeError, match="missing column"):
        load_log(p)
    bad = good.copy().astype({"mean": object})
    bad.loc[5, "mean"] = "oops"
    bad.to_csv(p, index=False)
    with pytest.raises(BNProbeError, match=r"row 7 has a non-numeric mean \('oops'\)"):
        load_log(p)
    pd.concat([good, good.iloc[[3]]]).to_csv(p, index=False)
    with pytest.raises(BNProbeError, match="repeats step/layer/channel"):
        load_log(p)
    good.drop(columns=["running_var"]).to_csv(p, index=False)
    with pytest.raises(BNProbeError, match="both running_mean and running_var"):
        load_log(p)


def test_recorder_api_in_a_users_loop():
    rec = StatsRecorder("mine")
    rm, rv = np.zeros(4), np.ones(4)
    rng = np.random.default_rng(0)
    for t in range(5):
        r = forward_train(rng.standard_normal((16, 4)) + 2, None, None, rm, rv, policy="fp16")
        rec.record_result(t, "layer0", r)
        rm, rv = r.running_mean.astype(np.float64), r.running_var.astype(np.float64)
    df = rec.frame()
    assert len(df) == 20 and set(df.columns) >= {"mean", "var", "running_mean", "rstd", "anomalies"}


def test_cli(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["plot-stats", "--steps", "20", "--policies", "fp32,fp16", "--out", str(out)]) == 0
    capsys.readouterr()
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) >= 6 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "stats-fp16-bn1.png" in (out / "index.md").read_text() and "<img" in (out / "index.html").read_text()
    log = tmp_path / "bad.csv"
    log_of(lambda r, b: r).to_csv(log, index=False)
    assert main(["plot-stats", "--log", str(log), "--out", str(tmp_path / "o2"), "--format", "svg"]) == 1
    assert "diverge" in capsys.readouterr().out
    assert (tmp_path / "o2" / "distributions.svg").read_text().lstrip().startswith("<?xml")
    assert main(["plot-stats", "--log", str(tmp_path / "nope.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err

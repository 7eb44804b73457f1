import json
import re

import numpy as np
import pandas as pd
import pytest

from bnprobe.checks.plot_stats.stats import StatsRecorder, find, load_dump_series, load_log, simulate
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.kernels import forward_train
from bnprobe.plots import plot_channel_stats, plot_distributions, plot_divergence, plot_layer_summary
from bnprobe.recordings import Recording, write_dump


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


# ---- dump series ------------------------------------------------------------------------------------

def _call(name: str, x: np.ndarray, *, training: bool, saved: tuple | None = None, running: tuple | None = None,
          running_out: tuple | None = None) -> Recording:
    """A hand-made bnprobe dump of one call (fp32 values, exactly representable)."""
    c = x.shape[1]
    mode = "train" if training else "infer"
    rec = Recording(f"capture:{name}", "fp32", "fp32", "channels_first", 0.25, 0.1,
                    "invstd" if saved else None, meta={"call": name, "training": training})
    ins = {"x": x, "gamma": np.ones(c), "beta": np.zeros(c)}
    if running:
        ins["running_mean"], ins["running_var"] = running
    outs = {"y": np.zeros_like(x)}
    if saved:
        outs["saved_mean"], outs["saved_value"] = saved
    if running_out:
        outs["running_mean_out"], outs["running_var_out"] = running_out
    rec.tensors[mode] = {"inputs": ins, "outputs": outs}
    rec.formats = {f"{mode}.{io}.{k}": "fp32" for io, d in (("inputs", ins), ("outputs", outs)) for k in d}
    return rec


def _model_dump(folder, calls: list[tuple[str, str, Recording]]) -> None:
    entries = []
    for order, (module, name, rec) in enumerate(calls):
        d = f"{order:04d}-{module}-{name.split('#')[1]}"
        write_dump(rec, folder / d)
        entries.append({"name": name, "dir": d, "module": module, "type": "BatchNorm1d",
                        "index": int(name.split("#")[1]), "order": order, "training": rec.meta["training"],
                        "backward": False})
    (folder / "bnprobe-calls.json").write_text(json.dumps({"format": "bnprobe-calls", "version": 1,
                                                           "source": "capture", "calls": entries}))


def test_dump_series_of_model_dumps_gives_one_layer_per_module(tmp_path):
    x = np.array([[1.0, 2.0], [3.0, 6.0]])  # batch mean (2, 4), biased var (1, 4)
    one, two = (np.ones(2), np.ones(2)), (np.full(2, 2.0), np.full(2, 3.0))
    for step in range(2):
        _model_dump(tmp_path / "series" / f"step{step}", [
            # a training call whose kernel saved mean (5, 7) and invstd (0.5, 0.25): those are the statistics,
            # not x's: var = 1/invstd^2 - eps = (4 - 0.25, 16 - 0.25)
            ("block.bn", "block.bn#0", _call("block.bn#0", x, training=True,
                                             saved=(np.array([5.0, 7.0]), np.array([0.5, 0.25])),
                                             running=one, running_out=two)),
            # an inference call of the same module later in the step: the training call is the layer's
            ("block.bn", "block.bn#1", _call("block.bn#1", x + step, training=False, running=two)),
            # a module with inference calls only: statistics of x, running statistics as they were used
            ("head.bn", "head.bn#0", _call("head.bn#0", x + step, training=False, running=one)),
            ("head.bn", "head.bn#1", _call("head.bn#1", x + 10 * step, training=False, running=two)),
        ])
    df = load_dump_series(tmp_path / "series")
    assert sorted(df["layer"].unique()) == ["block.bn", "head.bn"] and len(df) == 2 * 2 * 2
    assert not df.duplicated(["step", "layer", "channel"]).any()
    for step in range(2):
        bn = df[(df.step == step) & (df.layer == "block.bn")].sort_values("channel")
        assert bn["mean"].tolist() == [5.0, 7.0] and bn["var"].tolist() == [3.75, 15.75]
        assert bn["running_mean"].tolist() == [2.0, 2.0] and bn["running_var"].tolist() == [3.0, 3.0]
        head = df[(df.step == step) & (df.layer == "head.bn")].sort_values("channel")  # its last call
        assert head["mean"].tolist() == [2.0 + 10 * step, 4.0 + 10 * step] and head["var"].tolist() == [1.0, 4.0]
        assert head["running_mean"].tolist() == [2.0, 2.0]


def test_dump_series_of_single_dumps_reads_as_before(tmp_path):
    x = np.array([[1.0, 2.0], [3.0, 6.0]])
    for step in range(2):
        rec = _call("Functional.batch_norm.0", x + step, training=True,
                    saved=(np.array([5.0, 7.0]), np.array([0.5, 0.25])), running=(np.zeros(2), np.ones(2)),
                    running_out=(np.full(2, 0.5), np.ones(2)))
        write_dump(rec, tmp_path / "series" / f"step{step}")
    df = load_dump_series(tmp_path / "series")
    assert df["layer"].unique().tolist() == ["Functional.batch_norm.0"]
    got = df[df.step == 1].sort_values("channel")
    assert got["mean"].tolist() == [3.0, 5.0] and got["var"].tolist() == [1.0, 4.0]  # from x, as before
    assert got["running_mean"].tolist() == [0.5, 0.5]


# ---- hostile logs: one-line errors, or findings for data that is merely bad -------------------------------------

def _log(steps=12, layers=("bn1",), channels=3, seed=0):
    rng = np.random.default_rng(seed)
    rows = [{"step": s, "layer": layer, "channel": c, "mean": rng.normal(), "var": rng.uniform(0.5, 2),
             "running_mean": 0.0, "running_var": 1.0}
            for s in range(steps) for layer in layers for c in range(channels)]
    return pd.DataFrame(rows)


def _render(df):
    import io

    for pol in df["policy"].unique():
        for layer in df[df["policy"] == pol]["layer"].unique()[:2]:
            plot_channel_stats(df, pol, layer, 6).savefig(io.BytesIO(), format="png", dpi=30)
        plot_layer_summary(df, pol).savefig(io.BytesIO(), format="png", dpi=30)
    if "fp32" in set(df["policy"]) and df["policy"].nunique() > 1:
        plot_divergence(df).savefig(io.BytesIO(), format="png", dpi=30)
    plot_distributions(df).savefig(io.BytesIO(), format="png", dpi=30)


@pytest.mark.parametrize("text,match", [
    ("step,layer,channel,mean,var\n", "the log holds no rows"),
    ("step,layer,channel,mean\n0,bn,0,1\n", "missing column"),
    ("step,layer,channel,mean,var\n0,bn,0,abc,1\n", r"row 2 has a non-numeric mean \('abc'\)"),
    ("step,layer,channel,mean,var\n0,bn,0,1,True\n", "column var holds true/false, not numbers"),
    ("step,layer,channel,mean,var\n0,bn,0,1,1\n0.5,bn,0,1,1\n", "row 3 has step 0.5, not an integer from 0 to 2"),
    ("step,layer,channel,mean,var\n-1,bn,0,1,1\n", "row 2 has step -1, not an integer"),
    ("step,layer,channel,mean,var\n0,bn,-1,1,1\n", "row 2 has channel -1, not an integer"),
    ("step,layer,channel,mean,var\n99999999999999999999,bn,0,1,1\n", "row 2 has step 1e\\+20"),
    ("step,layer,channel,mean,var\n0,,0,1,1\n", "row 2 has no layer name"),
    ("step,layer,channel,mean,var,policy\n0,bn,0,1,1,\n", "row 2 has no policy name"),
])
def test_malformed_logs_are_one_line_errors(tmp_path, text, match):
    p = tmp_path / "log.csv"
    p.write_text(text)
    with pytest.raises(BNProbeError) as info:
        load_log(p)
    assert type(info.value) is BNProbeError and "\n" not in str(info.value)
    assert re.search(match, str(info.value))


def test_the_step_and_layer_bounds_at_their_edges(tmp_path, monkeypatch):
    from bnprobe.checks.plot_stats import stats

    p = tmp_path / "log.csv"
    p.write_text(f"step,layer,channel,mean,var\n{2**53},bn,0,1,1\n")
    assert int(load_log(p)["step"].iloc[0]) == 2**53
    _log(steps=1, layers=("a", "b", "c"), channels=1).to_csv(p, index=False)
    monkeypatch.setattr(stats, "MAX_LAYERS", 3)
    assert load_log(p)["layer"].nunique() == 3
    monkeypatch.setattr(stats, "MAX_LAYERS", 2)
    with pytest.raises(BNProbeError, match=r"3 \(run, layer\) pairs, more than the 2 plot-stats draws"):
        load_log(p)
    monkeypatch.setattr(stats, "MAX_ROWS", 2)
    with pytest.raises(BNProbeError, match="3 rows, more than the 2 plot-stats reads"):
        load_log(p)


@pytest.mark.parametrize("column,value,kind,detail", [
    ("var", -0.5, "negative batch variance", "batch variance below 0 from step 4"),
    ("running_var", -3.0, "negative running variance", "running variance below 0 from step 4"),
    ("var", np.nan, "non-finite statistics", "NaN/inf var from step 4"),
    ("running_mean", np.inf, "non-finite statistics", "NaN/inf running_mean from step 4"),
])
def test_negative_or_nan_statistics_are_findings_not_crashes(tmp_path, column, value, kind, detail):
    """A NaN or negative variance is data (a one-pass variance cancelling gives one): reported, and every figure
    still drawn."""
    df = _log()
    df.loc[(df.step == 4) & (df.channel == 1), column] = value
    p = tmp_path / "log.csv"
    df.to_csv(p, index=False)
    got = load_log(p)
    f = next(f for f in find(got) if f.kind == kind)
    assert f.step == 4 and f.channels == (1,) and f.detail.startswith(detail)
    assert all(x.kind != "variance collapsing toward eps" for x in find(got))
    _render(got)


def test_all_nan_or_negative_variances_and_odd_names_still_plot(tmp_path):
    df = _log(layers=("$\\undefined$", "<script>alert(1)</script>", "a$b"))
    df["var"] = np.nan
    df.loc[df.layer == "a$b", "var"] = -1.0
    p = tmp_path / "log.csv"
    df.to_csv(p, index=False)
    got = load_log(p)
    kinds = {f.kind for f in find(got)}
    assert {"non-finite statistics", "negative batch variance"} <= kinds
    _render(got)
    many = _log(steps=2, layers=tuple(f"l{i}" for i in range(80)), channels=1)
    many["policy"] = "log"
    _render(many)


def test_a_dump_series_whose_call_name_is_not_text_names_the_layer_by_its_text(tmp_path):
    x = np.array([[1.0, 2.0], [3.0, 6.0]])
    for step in range(2):
        rec = _call("bn", x + step, training=True, saved=(np.array([5.0, 7.0]), np.array([0.5, 0.25])),
                    running=(np.zeros(2), np.ones(2)), running_out=(np.full(2, 0.5), np.ones(2)))
        rec.meta["call"] = [1, 2]  # metadata of the wrong JSON type: a label all the same, never a crash
        write_dump(rec, tmp_path / "series" / f"step{step}")
    df = load_dump_series(tmp_path / "series")
    assert df["layer"].unique().tolist() == ["[1, 2]"] and isinstance(find(df), list)


PANDAS_PARQUET_ADVICE = ("Unable to find a usable engine; tried using: 'pyarrow', 'fastparquet'.\n"
                         "A suitable version of pyarrow or fastparquet is required for parquet support.\n"
                         "Trying to import the above resulted in these errors:\n - Missing optional dependency")


@pytest.mark.parametrize("name,reader,exc,match", [
    ("log.parquet", "read_parquet", ImportError(PANDAS_PARQUET_ADVICE),
     r"log.parquet: reading Parquet needs pyarrow or fastparquet \(pip install pyarrow\)$"),
    ("log.parquet", "read_parquet", ValueError("bad magic\nsecond line"),
     r"log.parquet: not a readable CSV/Parquet log \(ValueError: bad magic\)$"),
    ("log.csv", "read_csv", ValueError(""), r"log.csv: not a readable CSV/Parquet log \(ValueError\)$"),
    ("log.csv", "read_csv", RecursionError("deep\n"), r"not a readable CSV/Parquet log \(RecursionError: deep\)$"),
])
def test_an_unreadable_log_is_one_line_whatever_the_reader_says(tmp_path, monkeypatch, name, reader, exc, match):
    """pandas' ImportError without pyarrow is four lines of advice (it was passed on whole), and an exception
    without a message ended in an IndexError."""
    p = tmp_path / name
    p.write_bytes(b"PAR1 junk PAR1")

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(pd, reader, fail)
    with pytest.raises(BNProbeError) as info:
        load_log(p)
    assert type(info.value) is BNProbeError and "\n" not in str(info.value)
    assert re.search(match, str(info.value))


def test_a_sweep_roots_step_and_rank_layout_is_a_series_per_rank(tmp_path, capsys):
    """plot-stats --dumps reads the step<k>/rank<r>/ layout sweeps take: one run per rank, the steps by number
    (step10 after step2), each statistic the recorded call's own (numpy on its x)."""
    from bnprobe.recordings import load_dump
    from tests.test_sweep import RANKS, make_root

    root = make_root(tmp_path / "run", steps=3)
    (root / "step2").rename(root / "step10")
    df = load_dump_series(root)
    assert sorted(df.policy.unique()) == sorted(f"rank {r}" for r in RANKS)
    assert sorted(df.step.unique()) == [0, 1, 10]
    x = load_dump(root / "step10" / f"rank{RANKS[1]}").tensors["train"]["inputs"]["x"]
    got = df[(df.policy == f"rank {RANKS[1]}") & (df.step == 10)].sort_values("channel")
    np.testing.assert_allclose(got["mean"], x.mean(axis=(0, 2, 3)), rtol=2e-3, atol=2e-3)  # the saved mean (fp16)
    assert main(["plot-stats", "--dumps", str(root), "--out", str(tmp_path / "ps")]) in (0, 1)
    assert f"{len(RANKS)} run(s)" in capsys.readouterr().out

"""bnprobe.monitor on the normalisation family: a small transformer-like model (Linear → LayerNorm → Linear → RMSNorm →
Linear → a Hugging Face-style RMSNorm) and a conv net (BatchNorm, GroupNorm, InstanceNorm) trained for a few steps.
The oracle is torch and numpy, run here apart from the monitor: this test's own hooks keep every call's x, y, dx and
dy, and the Parquet's per-row numbers are checked against numpy float64 on them; a NaN put into one LayerNorm input
at a chosen step must be exactly that step's, module's and token's anomaly, its dump must replay, and the replayed
golden must be torch's float64 of the same module.  A one-pass LayerNorm (E[x²] − E[x]², the defect of
pytorch/pytorch#40302) shows that the check against the golden can fail, and torch's own kernels that it passes."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.recordings import read_calls

torch = pytest.importorskip("torch")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
nn, F = torch.nn, torch.nn.functional

from bnprobe import monitor  # noqa: E402 - after the skips
from tests.recordings.test_capture_family import LlamaRMSNorm  # noqa: E402 - the one HF-style RMSNorm of the tests

STEPS = 6
B, T, D = 4, 6, 32  # the transformer's batch, tokens and hidden size


class Transformerish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.ln = nn.Linear(16, D), nn.LayerNorm(D)
        self.l2, self.rms = nn.Linear(D, D), nn.RMSNorm(D, eps=1e-5)
        self.l3, self.hf = nn.Linear(D, D), LlamaRMSNorm(D)
        self.head = nn.Linear(D, 4)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = self.rms(self.l2(torch.relu(self.ln(self.l1(x)))))
        return self.head(self.hf(self.l3(h)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.gn = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.c3, self.inorm = nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = torch.relu(self.bn(self.c1(x)))
        h = torch.relu(self.gn(self.c2(h)))
        return self.head(torch.relu(self.inorm(self.c3(h))).mean((2, 3)))


FAMILY = {Transformerish: ("ln", "rms", "hf"), ConvNet: ("gn", "inorm")}
ROWS = {"ln": B * T, "rms": B * T, "hf": B * T, "gn": 4 * 4, "inorm": 4 * 8}  # rows of each call's (rows, R) view


class Seen:
    """The test's own record of every family call: x, y, dx and dy as float64 numpy arrays, per step."""

    def __init__(self, model, names) -> None:  # noqa: ANN001
        self.calls, self.step = {}, 0
        for name in names:
            m = getattr(model, name)
            m.register_forward_pre_hook(self._pre(name))
            m.register_forward_hook(self._post(name))

    def _pre(self, name):  # noqa: ANN001, ANN202
        def hook(module, args):  # noqa: ANN001, ANN202
            entry = self.calls.setdefault((self.step, name), {})
            x = args[0]
            entry["x"] = x.detach().double().numpy().copy()
            if x.requires_grad:
                x.register_hook(lambda g: entry.__setitem__("dx", g.detach().double().numpy().copy()))
        return hook

    def _post(self, name):  # noqa: ANN001, ANN202
        def hook(module, args, y):  # noqa: ANN001, ANN202
            entry = self.calls[(self.step, name)]
            entry["y"] = y.detach().double().numpy().copy()
            if y.requires_grad:
                y.register_hook(lambda g: entry.__setitem__("dy", g.detach().double().numpy().copy()))
        return hook


def _inject(model, at_step, where):  # noqa: ANN001, ANN202
    """A NaN put into LayerNorm's input at ``where`` at step ``at_step`` (a pre-hook registered before the monitor's,
    so the monitor sees the input the module computes with); returns the step counter the loop sets."""
    state = {"step": -1}

    def hook(module, args):  # noqa: ANN001, ANN202
        if state["step"] != at_step:
            return None
        x = args[0].clone()
        x[where] = float("nan")
        return (x, *args[1:])
    model.ln.register_forward_pre_hook(hook)
    return state


def train(out, cls, *, inject=None, skip=True, **kw):  # noqa: ANN001, ANN201
    """Train ``cls`` for STEPS steps under a monitor; the optimizer skips a step whose loss is not finite (as a
    GradScaler does), so one bad input leaves the later steps clean (with ``skip`` False it steps on: the NaN goes into
    the weights).  ``inject``: (step, index) of a NaN put into the LayerNorm's input."""
    torch.manual_seed(0)
    net = cls()
    state = _inject(net, *inject) if inject else None
    seen = Seen(net, FAMILY[cls])
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with monitor(net, out, **kw) as mon:
        for step in range(STEPS):
            seen.step = step
            if state is not None:
                state["step"] = step
            x = torch.randn(B, T, 16, generator=gen) if cls is Transformerish else \
                torch.randn(4, 3, 6, 6, generator=gen)
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss) or not skip:
                opt.step()
            mon.step()
    return mon, seen


def _rows(a: np.ndarray, name: str) -> np.ndarray:
    """An x-shaped array of ``name``'s call as its (rows, R) view, written from the layer's definition."""
    if name in ("ln", "rms", "hf"):
        return a.reshape(-1, a.shape[-1])  # a token's features
    if name == "gn":
        return a.reshape(a.shape[0] * 4, -1)  # a sample's group of 2 channels
    return a.reshape(a.shape[0] * a.shape[1], -1)  # a sample's channel


@pytest.mark.parametrize("cls", [Transformerish, ConvNet], ids=["transformer", "convnet"])
def test_a_clean_run_is_watched_per_row_and_raises_no_alarm(tmp_path, cls) -> None:  # noqa: ANN001
    out = tmp_path / "mon"
    mon, seen = train(out, cls)
    assert mon.anomalies == [] and mon.dumps == []
    assert not (out / "anomalies").exists() and not (out / "anomalies.csv").exists()
    df = pd.read_parquet(out / "family.parquet")
    names = FAMILY[cls]
    assert len(df) == STEPS * sum(ROWS[n] for n in names)
    assert not df.duplicated(["step", "layer", "call", "row"]).any()
    norms = {"ln": "layer", "rms": "rms", "hf": "rms", "gn": "group", "inorm": "instance"}
    assert dict(df.groupby("layer").norm.first()) == {n: norms[n] for n in names}
    layer = {"ln": ("32", 0, 1e-5), "rms": ("32", 0, 1e-5), "hf": ("32", 0, 1e-6), "gn": ("", 4, 1e-5),
             "inorm": ("", 0, 1e-5)}
    for n in names:
        got = df[df.layer == n][["normalized_shape", "groups", "eps", "weight_offset"]].drop_duplicates()
        assert len(got) == 1 and tuple(got.iloc[0]) == (layer[n][0], layer[n][1], pytest.approx(layer[n][2]), 0.0)
    # every number against numpy float64 on the call's own tensors
    for (step, name), t in seen.calls.items():
        r = df[(df.step == step) & (df.layer == name)].sort_values("row")
        xr, yr, dxr, dyr = (_rows(t[k], name) for k in ("x", "y", "dx", "dy"))
        np.testing.assert_array_equal(r.x_min, xr.min(1))
        np.testing.assert_array_equal(r.x_max, xr.max(1))
        np.testing.assert_array_equal(r.y_min, yr.min(1))
        np.testing.assert_array_equal(r.y_max, yr.max(1))
        np.testing.assert_array_equal(r.dx_max, dxr.max(1))
        if name in ("rms", "hf"):
            assert r["mean"].isna().all()
            np.testing.assert_allclose(r["var"], (xr**2).mean(1), rtol=1e-12)
        else:
            np.testing.assert_allclose(r["mean"], xr.mean(1), rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(r["var"], xr.var(1), rtol=1e-12)
            eps = 1e-5
            np.testing.assert_allclose(r["rstd"], 1 / np.sqrt(xr.var(1) + eps), rtol=1e-5)  # torch's fp32 rstd
        assert (r[["x_nan", "y_nan", "dx_nan", "dy_nan", "dy_inf"]] == 0).all().all()
        assert np.isfinite(dyr).all()
    # the check against the golden: torch's kernels within the bound, and not vacuously (a real share of it used)
    assert df.y_err.max() < 1 and df.y_err.max() > 1e-3
    if cls is ConvNet:  # the BatchNorm in the same net: its rows where they always were
        bn = pd.read_parquet(out / "monitor.parquet")
        assert len(bn) == STEPS * 8 and set(bn.layer) == {"bn"} and "row" not in bn.columns


def test_a_nan_in_one_token_is_found_at_its_step_and_row_dumped_and_replayed(tmp_path, capsys) -> None:  # noqa: ANN001
    out, bad_step, (b, t, f) = tmp_path / "mon", 3, (1, 4, 5)
    mon, seen = train(out, Transformerish, inject=(bad_step, (b, t, f)))
    row = b * T + t
    with open(out / "anomalies.csv", newline="") as fh:
        found = list(csv.DictReader(fh))
    # the NaN goes down its token's row only: LayerNorm's, then both RMSNorms', forward and backward
    assert sorted((a["layer"], a["reason"], a["phase"]) for a in found) == sorted(
        (layer, f"NaN in {t} (row {row})", phase) for layer in ("ln", "rms", "hf")
        for t, phase in (("x", "forward"), ("dy", "backward")))
    for a in found:
        assert (a["first_step"], a["last_step"], a["count"]) == (str(bad_step), str(bad_step), "1")
        assert a["channels"] == str(row) and a["dump"] == str(out / "anomalies" / f"step-{bad_step}")
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == [f"step-{bad_step}"]
    dump = out / "anomalies" / f"step-{bad_step}"
    index = read_calls(dump)
    assert [c["module"] for c in index["calls"]] == ["ln", "rms", "hf"] and index["step"] == bad_step
    from bnprobe.recordings import open_dump

    recs = {c.name: c.load() for c in open_dump(str(dump)).calls}
    ln = recs["ln#0"]
    assert ln.meta["monitor"]["step"] == bad_step and ln.meta["module"] == "ln"
    c = ln.call()
    assert (c.norm, c.normalized_shape, c.groups, c.weight_offset) == ("layer", (D,), None, 0.0)
    assert (recs["hf#0"].call().norm, recs["hf#0"].eps) == ("rms", pytest.approx(1e-6))
    # the dumped x is the one LayerNorm computed with, NaN included, bit for bit; its backward is there
    np.testing.assert_array_equal(c.x, seen.calls[(bad_step, "ln")]["x"])
    assert np.isnan(c.x).sum() == 1 and np.isnan(c.x[b, t, f])
    np.testing.assert_array_equal(c.dy, seen.calls[(bad_step, "ln")]["dy"])
    # it replays: compare-precision reads the family's rows from the dump
    code = main(["compare-precision", "--adapters", f"dump:{dump}", "--no-budget", "--out", str(tmp_path / "cp")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "3 recorded call(s)" in text and "ln#0" in text and "hf#0" in text
    # independently: the replayed golden is torch's float64 of the same module on the dumped inputs
    from bnprobe.adapters import get_adapter

    ref = get_adapter("reference")
    for name in ("ln#0", "rms#0", "hf#0"):
        call = recs[name].call()
        x = torch.tensor(call.x)
        g = torch.tensor(np.asarray(call.gamma, dtype=np.float64))
        if call.norm == "layer":
            want = F.layer_norm(x, [D], g, torch.tensor(np.asarray(call.beta, dtype=np.float64)), call.eps)
        else:
            want = F.rms_norm(x, [D], g, call.eps)
        got = ref.train(call).y
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-13, atol=1e-15, equal_nan=True)
        assert np.isnan(got).any(axis=-1).sum() == 1  # the bad token's row only


def test_a_persistent_nan_in_the_family_is_dumped_once_and_a_later_anomaly_still_is(tmp_path) -> None:  # noqa: ANN001
    """The NaN token at step 2 with the optimizer stepping on: the weights go NaN and every later call of the three
    norms sees NaN.  Each such anomaly is listed once with the steps at which the test's own record of the calls'
    x and dy holds a NaN, and dumped once, at step 2; a predicate's reason on rms at step 4 is a new anomaly and is
    dumped with the budget left (max_dumps=4: three calls at step 2, one at step 4)."""
    out, bad_step, later = tmp_path / "mon", 2, 4

    def planted(row):  # noqa: ANN001, ANN202
        return "planted" if row["layer"] == "rms" and row["step"] == later and row["phase"] == "forward" else None
    mon, seen = train(out, Transformerish, inject=(bad_step, (1, 4, 5)), skip=False, max_dumps=4,
                           predicate=planted)
    assert torch.isnan(mon.model.l1.weight).all()  # the case: the NaN went into the weights
    listed = {(a["layer"], _kind(a["reason"])): a for a in mon.anomalies}
    assert len(listed) == len(mon.anomalies) == 7
    for layer in ("ln", "rms", "hf"):
        for t in ("x", "dy"):
            steps = [k for k in range(STEPS) if np.isnan(seen.calls[(k, layer)][t]).any()]
            assert steps == list(range(bad_step, STEPS))
            a = listed[(layer, f"NaN in {t}")]
            assert (a["first_step"], a["last_step"], a["count"]) == (steps[0], steps[-1], len(steps))
            assert a["dump"] == str(out / "anomalies" / f"step-{bad_step}")
    a = listed[("rms", "predicate: planted")]
    assert (a["first_step"], a["last_step"], a["dump"]) == (later, later, str(out / "anomalies" / f"step-{later}"))
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == [f"step-{bad_step}", f"step-{later}"]
    assert [c["module"] for c in read_calls(out / "anomalies" / f"step-{later}")["calls"]] == ["rms"]


def test_a_nan_in_a_groupnorm_input_names_its_sample_and_group(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    net = ConvNet()

    def bad(module, args):  # noqa: ANN001, ANN202
        x = args[0].clone()
        x[2, 5, 1, 1] = float("nan")  # sample 2, channel 5: group 2 of 4
        return (x,)
    net.gn.register_forward_pre_hook(bad)
    with monitor(net, tmp_path / "mon") as mon:
        net(torch.randn(4, 3, 6, 6)).pow(2).mean().backward()
        mon.step()
    gn = [a for a in mon.anomalies if a["layer"] == "gn"]
    # (dy: conv3's backward spreads inorm's NaN over sample 2's channels, so all four of its groups)
    assert [a["reason"] for a in gn] == [f"NaN in x (row {2 * 4 + 2})", "NaN in dy (rows 8, 9, 10, 11)"]
    inorm = [a for a in mon.anomalies if a["layer"] == "inorm"]  # (conv3 spreads it over sample 2's channels)
    assert inorm[0]["reason"] == "NaN in x (rows 16, 17, 18, 19, 20, 21, 22, 23)"
    # the BatchNorm before it sees the NaN only in its backward (dy, through conv2)
    bn = [a for a in mon.anomalies if a["layer"] == "bn"]
    assert len(bn) == 1 and bn[0]["phase"] == "backward" and bn[0]["reason"].startswith("NaN in dy (")
    assert len(mon.anomalies) == 5


def _kind(reason: str) -> str:
    """An anomaly's reason without the rows it names."""
    return re.sub(r" \(rows? [0-9, .]+\)$", "", reason)


class OnePassLayerNorm(nn.LayerNorm):
    """A LayerNorm computing its variance as E[x²] − E[x]² in float32 (pytorch/pytorch#40302)."""

    def forward(self, x):  # noqa: ANN001, ANN201
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) * torch.rsqrt(v + self.eps) * self.weight + self.bias


class Twins(nn.Module):
    def __init__(self, norm=nn.LayerNorm, d=D) -> None:  # noqa: ANN001
        super().__init__()
        self.good, self.bad = nn.LayerNorm(d), norm(d)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.good(x) + self.bad(x)


def test_the_check_against_the_golden_fails_a_one_pass_variance_and_passes_torchs(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    net = Twins(OnePassLayerNorm)
    x = torch.randn(B, T, D) * 0.05 + 40  # |μ| ≫ σ: E[x²] − E[x]² cancels in float32
    with monitor(net, tmp_path / "mon") as mon:
        net(x.requires_grad_()).sum().backward()
        mon.step()
    assert [(a["layer"], _kind(a["reason"])) for a in mon.anomalies] == \
        [("bad", "y beyond a correct kernel's bound of the FP64 golden")]
    df = pd.read_parquet(tmp_path / "mon" / "family.parquet")
    good, bad = df[df.layer == "good"], df[df.layer == "bad"]
    assert good.y_err.max() < 1 and good.stats_err.max() < 1 and bad.y_err.min() > 1
    assert bad.stats_err.isna().all()  # (a composite: no kernel saved statistics)
    # the guard: on data that does not cancel the one-pass kernel is within the bound, so the case distinguishes
    with monitor(net, tmp_path / "mon2") as mon:
        net(torch.randn(B, T, D)).sum().backward()
        mon.step()
    assert mon.anomalies == []


def test_torchs_channels_last_groupnorm_is_caught_where_its_one_pass_cancels(tmp_path) -> None:  # noqa: ANN001
    """torch's CPU GroupNorm on a channels-last input takes Σx and Σx² in one pass (norm-family reference §2.4): on
    activations with |μ| ≫ σ its saved statistics are beyond a correct kernel's bound; the contiguous kernel on the
    same values is not."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, 16, 16) + 30
    found = {}
    for name, layout in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        gn = nn.GroupNorm(8, 32)
        with monitor(gn, tmp_path / name) as mon:
            gn(x.to(memory_format=layout).requires_grad_()).sum().backward()
            mon.step()
        found[name] = [_kind(a["reason"]) for a in mon.anomalies]
    assert found == {"contiguous": [],
                     "channels_last": ["saved statistics beyond a correct kernel's bound of the FP64 golden"]}


def test_a_clean_bf16_transformer_raises_no_alarm(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    net = Transformerish().to(torch.bfloat16)
    with monitor(net, tmp_path / "mon") as mon:
        for _ in range(2):
            net(torch.randn(B, T, 16).to(torch.bfloat16) * 3 + 1).float().pow(2).mean().backward()
            mon.step()
    assert mon.anomalies == []
    df = pd.read_parquet(tmp_path / "mon" / "family.parquet")
    assert set(df.dtype) == {"bfloat16"} and 1e-2 < df.y_err.max() < 1


def test_every_other_step_and_a_predicate_on_the_familys_rows(tmp_path) -> None:  # noqa: ANN001
    """every=2: the family's rows on the even steps only; a predicate sees a family call's per-row arrays and its
    layer, and the call it returned a reason for is listed and dumped."""
    seen_norms = set()

    def wide(row):  # noqa: ANN001, ANN202
        seen_norms.add(row.get("norm", "batch"))
        if row.get("norm") == "layer" and row["phase"] == "forward" and row["step"] == 4:
            return "checked at step 4"
        return None
    mon, _ = train(tmp_path / "mon", Transformerish, every=2, predicate=wide)
    df = pd.read_parquet(tmp_path / "mon" / "family.parquet")
    assert sorted(df.step.unique()) == [0, 2, 4] and mon.steps == [0, 2, 4]
    assert seen_norms == {"layer", "rms"}
    assert [(a["first_step"], a["layer"], a["reason"]) for a in mon.anomalies] == \
        [(4, "ln", "predicate: checked at step 4")]
    dump = tmp_path / "mon" / "anomalies" / "step-4"
    assert [c["module"] for c in read_calls(dump)["calls"]] == ["ln"]

"""bnprobe.monitor over real training loops: a small conv network trained for tens of steps with one bad batch at
a known step.  The oracle is torch and numpy, run here independently: this test's own hooks keep every call's
x, y and dy, and the Parquet's numbers are checked against numpy float64 on those tensors; the anomalies must be
exactly the bad step's calls, and the commands replaying the dump must find what the bad batch did."""

import csv
import json
import re

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import CALLS_NAME, read_calls

torch = pytest.importorskip("torch")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
nn = torch.nn

from bnprobe import monitor  # noqa: E402 - after the skips

STEPS = 16
CHANNELS = {"bn1": 6, "bn2": 8}


class Net(nn.Module):
    def __init__(self, bn=nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = bn(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.bn2 = bn(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


class Seen:
    """The test's own record of every BatchNorm call: x, y and dy as float64 numpy arrays, per step."""

    def __init__(self, model):
        self.calls, self.step = {}, 0
        for name, m in model.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, args, y):
            entry = {"x": args[0].detach().double().numpy().copy(), "y": y.detach().double().numpy().copy()}
            self.calls[(self.step, name)] = entry
            if y.requires_grad:
                y.register_hook(lambda g: entry.__setitem__("dy", g.detach().double().numpy().copy()))
        return hook


def train(out, *, dtype=torch.float32, bad_step=None, bad="nan", steps=STEPS, seen=False, bn=nn.BatchNorm2d, skip=True,
          **kw):
    """Train Net for ``steps`` steps under a monitor; the optimizer skips a step whose loss is not finite (as a
    GradScaler does), so one bad batch leaves the later steps clean; with ``skip`` False it steps on, and the NaN
    goes into the weights."""
    torch.manual_seed(0)
    net = Net(bn).to(dtype)
    rec = Seen(net) if seen else None
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with monitor(net, out, **kw) as mon:
        for step in range(steps):
            if rec is not None:
                rec.step = step
            x = torch.randn(4, 3, 8, 8, generator=gen).to(dtype)
            if step == bad_step:
                if bad == "nan":
                    x[1, 2, 3, 4] = float("nan")
                else:  # a scaled input: the first convolution overflows the format
                    x = x * 3e4
            loss = net(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss) or not skip:
                opt.step()
            mon.step()
    return mon, rec


def kind(row):
    """An anomalies.csv row's reason without the channels it names (what the monitor knows an anomaly by)."""
    return re.sub(r" \((channels?|rows?) [0-9, .]+\)$", "", row["reason"])


def table(out):
    return pd.read_parquet(out / "monitor.parquet")


def anomalies(out):
    with open(out / "anomalies.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_nan_pixel_is_found_at_its_step_dumped_and_replayed(tmp_path, capsys):
    out = tmp_path / "mon"
    mon, seen = train(out, bad_step=7, seen=True)
    df = table(out)
    # every step x layer x channel, once
    assert len(df) == STEPS * sum(CHANNELS.values())
    assert not df.duplicated(["step", "layer", "call", "channel"]).any()
    assert sorted(df.step.unique()) == list(range(STEPS))
    # exactly the bad step's calls, both layers (conv1 spreads the NaN to every channel), NaN in x and in dy
    rows = anomalies(out)
    assert {(r["layer"], kind(r), r["phase"]) for r in rows} == {
        (layer, what, phase) for layer in ("bn1", "bn2") for what, phase in (("NaN in x", "forward"),
                                                                              ("NaN in dy", "backward"))}
    assert all((r["first_step"], r["last_step"], r["count"]) == ("7", "7", "1") for r in rows)
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == ["step-7"]
    dump = out / "anomalies" / "step-7"
    assert [c["module"] for c in read_calls(dump)["calls"]] == ["bn1", "bn2"]
    # the dumped x is the x of that call, bit for bit, and its backward is there
    from bnprobe.recordings import open_dump

    calls = open_dump(str(dump)).calls
    rec = calls[0].load()
    np.testing.assert_array_equal(rec.tensors["train"]["inputs"]["x"], seen.calls[(7, "bn1")]["x"])
    assert "dx" in rec.tensors["backward"]["outputs"]
    # the commands on the dump say what happened
    code, text, _ = run(capsys, "overflow", "--adapter", f"dump:{dump}")
    assert "input_nonfinite" in text and "x" in text
    code, text, _ = run(capsys, "compare-precision", "--adapters", f"dump:{dump}", "--no-budget", "--out",
                        tmp_path / "cp")
    assert code in (0, 1) and "NaN/inf value(s)" in text
    # plot-stats draws it and lists the anomalies as findings
    code, text, _ = run(capsys, "plot-stats", "--monitor", out, "--out", tmp_path / "ps")
    assert code == 1 and text.count("anomaly:") == 4 and "step 7" in text and "seen at" not in text
    assert any(p.name.startswith("monitor-float32-bn1") for p in (tmp_path / "ps").iterdir())
    findings = json.loads((tmp_path / "ps" / "findings.json").read_text())
    assert {f["step"] for f in findings if f["kind"] == "anomaly"} == {7}


PERSIST_STEPS, NAN_STEP, LATER = 30, 17, 24


def test_a_persistent_nan_is_dumped_once_at_its_first_step_and_listed_with_its_steps(tmp_path, capsys):
    """One NaN pixel at step 17 of 30 and the optimizer steps on: the weights are NaN from then on, and every later
    call sees NaN.  Each such anomaly (a layer's NaN in x, its NaN in dy) is listed once, with the first and last step
    and the number of steps at which the test's own record of the calls' x and dy holds a NaN, and dumped once, at
    step 17; a different anomaly arising later (a predicate planted on bn2 at step 24) is still dumped: max_dumps=3
    is not used up by the persistent ones (the monitor before this dumped steps 17 and 18 with it, then no more)."""
    out = tmp_path / "mon"

    def planted(r):
        return "planted" if r["layer"] == "bn2" and r["step"] == LATER and r["phase"] == "forward" else None
    mon, seen = train(out, bad_step=NAN_STEP, steps=PERSIST_STEPS, seen=True, skip=False, max_dumps=3,
                           predicate=planted)
    assert torch.isnan(mon.model.conv1.weight).all()  # the case: the NaN batch went into the weights
    rows = anomalies(out)
    listed = {(r["layer"], kind(r)): r for r in rows}
    assert len(listed) == len(rows) == 5
    for layer in ("bn1", "bn2"):
        for t in ("x", "dy"):
            steps = [k for k in range(PERSIST_STEPS) if np.isnan(seen.calls[(k, layer)][t]).any()]
            assert steps == list(range(NAN_STEP, PERSIST_STEPS))  # (NaN at every step from 17: one anomaly)
            r = listed[(layer, f"NaN in {t}")]
            assert (int(r["first_step"]), int(r["last_step"]), int(r["count"])) == (steps[0], steps[-1], len(steps))
            assert r["dump"] == str(out / "anomalies" / f"step-{NAN_STEP}")
    r = listed[("bn2", "predicate: planted")]
    assert (r["first_step"], r["last_step"], r["count"], r["phase"]) == (str(LATER), str(LATER), "1", "forward")
    assert r["dump"] == str(out / "anomalies" / f"step-{LATER}")
    # the dumps: the persistent anomalies' calls at their first step, the planted one's call at its step
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == [f"step-{NAN_STEP}", f"step-{LATER}"]
    assert [c["module"] for c in read_calls(out / "anomalies" / f"step-{NAN_STEP}")["calls"]] == ["bn1", "bn2"]
    assert [c["module"] for c in read_calls(out / "anomalies" / f"step-{LATER}")["calls"]] == ["bn2"]
    assert mon.anomalies == [{**a, "first_step": int(a["first_step"]), "last_step": int(a["last_step"]),
                              "count": int(a["count"]), "rank": int(a["rank"]), "call": int(a["call"])} for a in rows]
    # plot-stats lists each anomaly once, with the steps it went on to
    code, text, _ = run(capsys, "plot-stats", "--monitor", out, "--out", tmp_path / "ps")
    assert code == 1 and text.count("anomaly:") == 5
    assert text.count(f"step {NAN_STEP}: ") >= 4 and \
        text.count(f"; to step {PERSIST_STEPS - 1}, seen at {PERSIST_STEPS - NAN_STEP} steps (dump: ") == 4


@pytest.mark.parametrize("every, marked, want", [
    (1, {3, 4, 5, 9}, [(3, 5, 3), (9, 9, 1)]),  # stops after 5, comes back at 9: a new anomaly, dumped again
    (2, {2, 3, 4, 6}, [(2, 6, 3)]),  # every=2: seen at each measured step (step 3 is not asked)
    (2, {2, 6}, [(2, 2, 1), (6, 6, 1)]),  # not seen at step 4, a measured step: it stopped there
], ids=["every-1-back", "every-2-on", "every-2-back"])
def test_an_anomaly_that_stops_and_comes_back_is_a_new_one(tmp_path, every, marked, want):
    out = tmp_path / "mon"
    train(out, steps=12, every=every,
          predicate=lambda r: "marked" if r["layer"] == "bn1" and r["step"] in marked and r["phase"] == "forward"
          else None)
    rows = anomalies(out)
    assert [(int(r["first_step"]), int(r["last_step"]), int(r["count"])) for r in rows] == want
    assert {r["reason"] for r in rows} == {"predicate: marked"}
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == sorted(f"step-{w[0]}" for w in want)


KILLED = '''
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from test_monitor import Net
from bnprobe import monitor

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1)
with monitor(net, sys.argv[1]) as mon:
    for step in range(30):
        x = torch.randn(4, 3, 8, 8, generator=gen)
        if step == 17:
            x[1, 2, 3, 4] = float("nan")
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if step == 22:  # killed in the middle of the run, step 22's anomalies seen and not yet listed
            os.kill(os.getpid(), signal.SIGKILL)
        mon.step()
'''


def test_a_killed_run_leaves_anomalies_csv_whole_as_of_its_last_step(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "mon"), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    rows = anomalies(tmp_path / "mon")
    assert [(r["layer"], kind(r), r["first_step"], r["last_step"], r["count"]) for r in rows] == [
        (layer, what, "17", "21", "5") for layer in ("bn2", "bn1") for what in ("NaN in x", "NaN in dy")]
    assert sorted(p.name for p in (tmp_path / "mon").iterdir()) == ["anomalies", "anomalies.csv", "monitor.parquet"]


@pytest.mark.parametrize("affine", [True, False])
def test_the_numbers_are_numpys_on_the_calls_tensors(tmp_path, affine):
    """Batch mean/var against numpy float64 on x; min/max and counts of x and y; Σdy and Σdy·x̂ from dy and x (the
    kernel's dβ, dγ with affine; reduced by the monitor without)."""
    out = tmp_path / "mon"
    _, seen = train(out, steps=4, seen=True, bn=lambda c: nn.BatchNorm2d(c, affine=affine))
    df = table(out)
    for (step, layer), t in seen.calls.items():
        g = df[(df.step == step) & (df.layer == layer)].sort_values("channel")
        x, y, dy = t["x"], t["y"], t["dy"]
        ax = (0, 2, 3)
        mean, var = x.mean(axis=ax), x.var(axis=ax)
        np.testing.assert_allclose(g.batch_mean, mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.batch_var, var, rtol=1e-4)
        np.testing.assert_allclose(g.invstd, 1 / np.sqrt(var + 1e-5), rtol=1e-4)
        np.testing.assert_array_equal(g.x_min, x.min(axis=ax))
        np.testing.assert_array_equal(g.y_max, y.max(axis=ax))
        np.testing.assert_array_equal(g.y_zero, (y == 0).sum(axis=ax))
        assert (g.x_nan == 0).all() and (g.dx_inf == 0).all()
        np.testing.assert_allclose(g.sum_dy, dy.sum(axis=ax), rtol=1e-4, atol=1e-9)
        xhat = (x - mean[None, :, None, None]) / np.sqrt(var + 1e-5)[None, :, None, None]
        np.testing.assert_allclose(g.sum_dy_xhat, (dy * xhat).sum(axis=ax), rtol=1e-3, atol=1e-7)
    assert not (out / "anomalies.csv").exists()  # a clean run has no anomaly


def test_fp16_overflow_from_a_scaled_input(tmp_path, capsys):
    """model.half(): a batch scaled by 3e4 overflows the first convolution; bn1's x holds inf at that step only."""
    out = tmp_path / "mon"
    train(out, dtype=torch.float16, bad_step=5, bad="scale")
    df = table(out)
    assert set(df.dtype) == {"float16"} and len(df) == STEPS * sum(CHANNELS.values())
    rows = anomalies(out)
    assert {(int(r["first_step"]), int(r["last_step"])) for r in rows} == {(5, 5)}
    assert {"±inf in x", "x at the float16 maximum (saturated)"} & {kind(r) for r in rows if r["layer"] == "bn1"}
    assert df[(df.step == 5) & (df.layer == "bn1")].x_inf.sum() > 0
    assert df[df.step != 5].filter(like="_inf").fillna(0).to_numpy().sum() == 0
    code, text, _ = run(capsys, "overflow", "--adapter", f"dump:{out / 'anomalies' / 'step-5'}")
    assert code == 1 and "input_nonfinite" in text


class MomentumFlipped(nn.BatchNorm2d):
    """A BatchNorm whose running update weights the new batch by 1 - momentum (Keras' convention in torch)."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked += 1
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                        self.training, 1 - self.momentum, self.eps)


def test_running_statistics_that_are_not_the_momentum_update_are_anomalies(tmp_path):
    """Every step's update is wrong: one anomaly per layer, from step 0 to 2, dumped at step 0 only."""
    out = tmp_path / "mon"
    mon, _ = train(out, steps=3, bn=MomentumFlipped)
    rows = anomalies(out)
    assert [(r["layer"], kind(r), r["first_step"], r["last_step"], r["count"]) for r in rows] == [
        (layer, "running statistics are not the momentum-0.1 update of the batch's", "0", "2", "3")
        for layer in ("bn2", "bn1")]  # (in the order the calls close: the backward's)
    assert sorted(p.name for p in (out / "anomalies").iterdir()) == ["step-0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_correct_kernel_raises_no_anomaly(tmp_path, dtype):
    """torch's own BatchNorm, in each format, over a clean run: no false alarm (running update, variance, invstd)."""
    mon, _ = train(tmp_path / "mon", dtype=dtype, steps=12)
    assert mon.anomalies == []


def test_every_max_dumps_never_and_a_predicate(tmp_path):
    # every=3: rows on steps 0, 3, 6, ...; an anomalous call on another step still gets its row
    out = tmp_path / "a"
    train(out, bad_step=7, every=3)
    steps = set(table(out).step)
    assert steps == {0, 3, 6, 7, 9, 12, 15}
    # max_dumps bounds the calls dumped; the rest are listed as not dumped
    out = tmp_path / "b"
    train(out, bad_step=4, max_dumps=1)
    rows = anomalies(out)  # (NaN in x and in dy of each of the two calls; the second call's not dumped)
    assert len(rows) == 4 and sum(r["dump"].startswith("not dumped: max_dumps=1") for r in rows) == 2
    assert len(read_calls(out / "anomalies" / "step-4")["calls"]) == 1
    out = tmp_path / "c"
    train(out, bad_step=4, capture_on="never")
    assert not (out / "anomalies").exists() and all("capture_on='never'" in r["dump"] for r in anomalies(out))
    # a user's predicate: any channel of bn2 whose batch mean is above 0 at step 2
    out = tmp_path / "d"
    train(out, steps=3, predicate=lambda r: "bn2 at step 2" if r["layer"] == "bn2" and r["step"] == 2 and
          r["phase"] == "forward" else None)
    rows = anomalies(out)
    assert [(r["first_step"], r["layer"], r["reason"]) for r in rows] == [("2", "bn2", "predicate: bn2 at step 2")]
    assert (out / "anomalies" / "step-2" / CALLS_NAME).is_file()


def test_a_crash_keeps_every_finished_step(tmp_path):
    out = tmp_path / "mon"
    net = Net()
    with pytest.raises(RuntimeError, match="boom"):
        with monitor(net, out) as mon:
            for step in range(5):
                net(torch.randn(4, 3, 8, 8)).sum().backward()
                if step == 3:
                    raise RuntimeError("boom")
                mon.step()
    # steps 0-2 were written at their mon.step(); step 3's rows at the exit
    assert sorted(table(out).step.unique()) == [0, 1, 2, 3]


def test_bad_arguments_and_an_existing_output_are_refused(tmp_path):
    net = Net()
    for kw, msg in (({"every": 0}, "every"), ({"capture_on": "always"}, "capture_on"), ({"max_dumps": -1}, "max_dumps"),
                    ({"var_floor": float("nan")}, "var_floor"), ({"predicate": 3}, "predicate")):
        with pytest.raises(BNProbeError, match=msg):
            monitor(net, tmp_path / "x", **kw)
    with pytest.raises(BNProbeError, match="no BatchNorm"):
        with monitor(nn.Linear(2, 2), tmp_path / "x"):
            pass
    train(tmp_path / "m", steps=1)
    with pytest.raises(BNProbeError, match="refusing to overwrite"):
        train(tmp_path / "m", steps=1)
    train(tmp_path / "m", steps=2, force=True)
    assert sorted(table(tmp_path / "m").step.unique()) == [0, 1]


def test_plot_stats_reads_the_anomalies_csv_of_a_monitor_before_anomalies_went_on_over_steps(tmp_path, capsys):
    """A folder written before anomalies.csv had a line per anomaly (a ``step`` and a ``reasons`` column, a line per
    anomalous call and step): each line is a finding of one step, as it was."""
    out = tmp_path / "mon"
    train(out, steps=3)
    (out / "anomalies.csv").write_text(
        "step,rank,layer,call,dtype,phase,reasons,channels,dump\n"
        '1,0,bn1,0,float32,forward,"NaN in x (channel 2); NaN in dy (channel 2)",2,runs/x/anomalies/step-1\n'
        '2,0,bn1,0,float32,forward,"NaN in x (channel 2); NaN in dy (channel 2)",2,not dumped: max_dumps=1 reached\n')
    code, text, _ = run(capsys, "plot-stats", "--monitor", out, "--out", tmp_path / "ps")
    assert code == 1
    assert [line for line in text.splitlines() if "anomaly:" in line] == [
        f"  anomaly: float32 bn1 step {k}: forward: NaN in x (channel 2); NaN in dy (channel 2) (dump: {d})"
        for k, d in ((1, "runs/x/anomalies/step-1"), (2, "not dumped: max_dumps=1 reached"))]


def test_plot_stats_monitor_refuses_a_folder_without_a_monitor(tmp_path, capsys):
    code, _, err = run(capsys, "plot-stats", "--monitor", tmp_path)
    assert code == 2 and "no monitor.parquet" in err and len(err.strip().splitlines()) == 1


DDP = '''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_monitor import Net
from bnprobe import monitor

def work(rank, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with monitor(net, out) as mon:
        for step in range(4):
            x = torch.randn(4, 3, 8, 8)
            if step == 2 and rank == 1:
                x[0, 0, 0, 0] = float("inf")
            loss = net(x).pow(2).mean()
            opt.zero_grad(); loss.backward()
            mon.step()
    dist.barrier()  # both ranks done (rank 1 writes its dumps) before the group goes: gloo aborts a rank left behind
    dist.destroy_process_group()

if __name__ == "__main__":
    torch.multiprocessing.spawn(work, args=(sys.argv[1],), nprocs=2)
'''


def test_two_ranks_on_gloo_each_write_their_own_and_plot_stats_reads_both(tmp_path, capsys):
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "mon"), str(port), str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for r in (0, 1):
        df = table(tmp_path / "mon" / f"rank{r}")
        assert set(df["rank"]) == {r} and sorted(df.step.unique()) == [0, 1, 2, 3]
    rows = anomalies(tmp_path / "mon" / "rank1")
    assert {(r["rank"], r["first_step"]) for r in rows} == {("1", "2")}
    assert not (tmp_path / "mon" / "rank0" / "anomalies.csv").exists()
    code, text, _ = run(capsys, "plot-stats", "--monitor", tmp_path / "mon", "--out", tmp_path / "ps")
    assert code == 1 and "2 run(s)" in text and "anomaly: rank 1 float32 module.bn1 step 2" in text


def test_a_failed_write_is_raised_on_the_training_thread(tmp_path, monkeypatch):
    """The writer's thread writes each step's file: a write that fails is raised by a later mon.step() or at the exit,
    as it was raised, and the steps written before it are there."""
    from bnprobe.recordings import monitor_writer

    real = monitor_writer.write_table
    calls = []

    def failing(path, table, dense):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, table, dense)

    monkeypatch.setattr(monitor_writer, "write_table", failing)
    out = tmp_path / "mon"
    net = Net()
    with pytest.raises(OSError, match="No space left"):
        with monitor(net, out) as mon:
            for _ in range(6):
                net(torch.randn(4, 3, 8, 8)).sum().backward()
                mon.step()
    assert len(calls) >= 3
    assert {0, 1} <= set(table(out).step.unique()) and 2 not in set(table(out).step.unique())

"""Sweeps over a dump root: one task per (step, rank, call), in this process, on local workers or on a real
dask.distributed cluster; a failure is retried once and reported, never stops the others; a sweep resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import record, write_dump
from bnprobe.core.call import BNCall
from bnprobe.sweep.tasks import SweepResult, SweepSpec, Journal, dump_leaves, header, plan, run_sweep
from tests.checks.bn_plugins import NumpyBN

RANKS = ("0", "1", "10")  # "10" sorts after "1" and "2" numerically, not as text
TIMING = ("seconds", "worker", "attempts", "worker_peak_mb")


def _call(adapter, seed, mean=0.5, shape=(4, 3, 2, 2)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) + mean
    c = shape[1]
    return record(adapter, BNCall(x=x, gamma=rng.uniform(0.5, 1.5, c), beta=rng.normal(0, 0.3, c),
                                  running_mean=np.zeros(c), running_var=np.ones(c), dy=rng.standard_normal(shape),
                                  dtype="fp16"), modes=("train", "backward"))


def make_root(root: Path, steps=2, ranks=RANKS, bad=None) -> Path:
    """A bnprobe dump per step and rank (step<k>/rank<r>/), each of numpy's correct kernel, except ``bad``:
    {(step, rank): adapter} recorded instead."""
    for s in range(steps):
        for i, r in enumerate(ranks):
            adapter = (bad or {}).get((s, r), NumpyBN())
            write_dump(_call(adapter, 10 * s + i), root / f"step{s}" / f"rank{r}")
    return root


def same(rows_a, rows_b):
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    return strip(rows_a) == strip(rows_b)


def test_plan_lists_every_call_in_step_rank_and_forward_order_without_loading_a_tensor(tmp_path):
    root = make_root(tmp_path / "run")
    tasks = plan(root)
    assert [(t.step, t.rank) for t in tasks] == [(s, r) for s in (0, 1) for r in RANKS]
    assert len({t.key for t in tasks}) == 6 and all(t.shape == (4, 3, 2, 2) and t.dtype == "fp16" for t in tasks)
    assert dump_leaves(root / "step0" / "rank1") == [root / "step0" / "rank1"]  # a single dump is its own root
    with pytest.raises(BNProbeError, match="no dump"):
        dump_leaves(tmp_path)
    with pytest.raises(BNProbeError, match="no BatchNorm call matches"):
        plan(root, calls="nothing*")


def test_in_process_and_local_workers_give_the_same_rows_and_a_wrong_rank_fails(tmp_path):
    root = make_root(tmp_path / "run", bad={(1, "1"): NumpyBN("dx-drops-xhat-term")})
    tasks = plan(root)
    one = run_sweep(tasks, SweepSpec("compare-precision"), workers=1)
    two = run_sweep(tasks, SweepSpec("compare-precision"), workers=2)
    assert same(one, two)
    assert len({r["worker"] for r in two}) == 2 or len(two) < 2  # both workers took tasks
    verdicts = {(r["step"], r["rank"]): r["verdict"] for r in one}
    assert verdicts.pop((1, "1")) == "FAIL" and set(verdicts.values()) == {"PASS"}
    result = SweepResult("compare-precision", str(root), one)
    assert not result and [(f["step"], f["rank"]) for f in result.first_failing()] == [(1, "1")]
    assert [(d["step"], d["what"]) for d in result.disagreements()] == [(1, "verdicts differ")]


def test_a_task_that_keeps_failing_is_retried_once_reported_and_never_stops_the_others(tmp_path):
    root = make_root(tmp_path / "run")
    (root / "step0" / "rank1" / "tensors.npz").write_bytes(b"not a zip")
    for workers in (1, 2):
        rows = run_sweep(plan(root), SweepSpec("doctor"), workers=workers)
        bad = [r for r in rows if r["status"] != "ok"]
        assert [(r["step"], r["rank"], r["attempts"], r["verdict"]) for r in bad] == [(0, "1", 2, "ERROR")]
        assert "tensors.npz" in bad[0]["error"] and "\n" not in bad[0]["error"]
        assert sum(r["status"] == "ok" for r in rows) == 5


def test_a_failed_tasks_error_is_worded_as_the_caller_says(tmp_path, monkeypatch):
    """A task's error in its row: in the library's words (the parameter it names), or, run from the command line,
    with its flags (the rows are that command's report)."""
    import bnprobe.sweep.tasks as sweep
    from bnprobe.cli import flag
    from bnprobe.core.errors import named

    def refuse(task, spec):
        raise BNProbeError(f"{named('mode')} backward contradicts the recording")

    monkeypatch.setattr(sweep, "run_task", refuse)
    root = make_root(tmp_path / "run")
    assert {r["error"] for r in run_sweep(plan(root), SweepSpec("doctor"))} == {"mode backward contradicts the "
                                                                                "recording"}
    assert {r["error"] for r in run_sweep(plan(root), SweepSpec("doctor"), words=flag)} == {
        "--mode backward contradicts the recording"}


def test_a_task_that_fails_once_succeeds_on_its_retry(tmp_path, monkeypatch):
    import bnprobe.sweep.tasks as sweep

    root = make_root(tmp_path / "run", steps=1)
    real, seen = sweep.run_task, []

    def flaky(task, spec):
        seen.append(task.key)
        if seen.count(task.key) == 1 and task.rank == "1":
            raise OSError("NFS hiccup")
        return real(task, spec)

    monkeypatch.setattr(sweep, "run_task", flaky)
    rows = run_sweep(plan(root), SweepSpec("overflow"), workers=1)
    assert [r["attempts"] for r in rows] == [1, 2, 1] and all(r["status"] == "ok" for r in rows)


class DiesOnce(NumpyBN):
    """A kernel whose worker process dies (os._exit) the first time it runs a call with a large mean: the pool
    breaks, the sweep starts a new one and retries."""

    flag = None

    def _forward_train_impl(self, p, *, momentum, eps):
        flag = Path(os.environ["BNPROBE_TEST_DIES_ONCE"])
        if not flag.exists():
            flag.write_text("died")
            os._exit(9)
        return super()._forward_train_impl(p, momentum=momentum, eps=eps)


def test_a_local_worker_that_dies_is_survived(tmp_path, monkeypatch):
    monkeypatch.setenv("BNPROBE_TEST_DIES_ONCE", str(tmp_path / "died"))
    root = make_root(tmp_path / "run", steps=3)  # 9 calls on 2 workers: some still queued when the pool breaks
    rows = run_sweep(plan(root), SweepSpec("compare-precision", adapter="tests.test_sweep:DiesOnce"), workers=2)
    assert len(rows) == 9 and (tmp_path / "died").exists()
    assert all(r["status"] == "ok" and r["verdict"] == "PASS" for r in rows)
    assert max(r["attempts"] for r in rows) == 2


def test_a_sweep_resumes_without_redoing_finished_tasks(tmp_path, monkeypatch):
    import bnprobe.sweep.tasks as sweep

    root, out = make_root(tmp_path / "run"), tmp_path / "out"
    out.mkdir()
    spec = SweepSpec("compare-precision")
    journal = Journal(out, header(root, spec, None))
    full = run_sweep(plan(root), spec, workers=1, journal=journal)
    lines = journal.path.read_text().splitlines()
    assert len(lines) == 7 and json.loads(lines[0]) == journal.header
    journal.path.write_text("\n".join(lines[:3]) + '\n{"key": "step1/ra')  # interrupted while writing a row
    real, ran = sweep.run_task, []
    monkeypatch.setattr(sweep, "run_task", lambda t, s: ran.append(t.key) or real(t, s))
    again = run_sweep(plan(root), spec, workers=1, journal=journal, resume=True)
    assert len(ran) == 4 and same(full, again)
    with pytest.raises(BNProbeError, match="; resume to continue it, force"):
        run_sweep(plan(root), spec, journal=journal)
    with pytest.raises(BNProbeError, match="journal of another sweep"):
        run_sweep(plan(root), SweepSpec("doctor"), journal=Journal(out, header(root, SweepSpec("doctor"), None)),
                  resume=True)
    with pytest.raises(BNProbeError, match="no sweep journal"):
        run_sweep(plan(root), spec, journal=Journal(tmp_path, header(root, spec, None)), resume=True)


def cli(capsys, *args):
    code = main([*args])
    out, err = capsys.readouterr()
    return code, out, err


def test_commands_sweep_a_root_of_steps_and_ranks_and_write_one_report(tmp_path, capsys):
    root = make_root(tmp_path / "run", bad={(0, "10"): NumpyBN("biased-running-var")})
    for command, flag in (("compare-precision", "--adapters"), ("doctor", "--adapter"), ("overflow", "--adapter")):
        out = tmp_path / command
        code, text, err = cli(capsys, command, flag, f"dump:{root}", "--out", str(out), "--workers", "2")
        assert err == "" and f"{command} sweep of {root}: 6 calls (2 step(s) x 3 rank(s))" in text
        files = sorted(p.name for p in out.iterdir())
        assert files == ["heatmap-layer-rank.png", "heatmap-layer-step.png", "ranks.csv", "summary.md",
                         "sweep-journal.jsonl", "sweep.csv", "sweep.json", "sweep.parquet"]
        doc = json.loads((out / "sweep.json").read_text())
        assert doc["tasks"] == 6 and doc["errors"] == 0
        if command != "overflow":  # the running variance is the fault: the outputs' scan has nothing to say
            assert code == 1 and [(f["step"], f["rank"]) for f in doc["first_failing"]] == [(0, "10")]
    import pandas as pd

    table = pd.read_parquet(tmp_path / "doctor" / "sweep.parquet")
    assert list(table["rank"]) == [*RANKS, *RANKS] and table.loc[2, "verdict"] == "FAIL"


def test_a_sweep_judges_in_the_convention_given(tmp_path, capsys):
    """--convention reaches every task: under flax's (biased running variance) the one biased rank passes and the
    unbiased ones fail; an unknown convention is refused before any task."""
    root = make_root(tmp_path / "run", steps=1, bad={(0, "10"): NumpyBN("biased-running-var")})
    code, text, err = cli(capsys, "doctor", "--adapter", f"dump:{root}", "--out", str(tmp_path / "d"),
                          "--workers", "1", "--convention", "flax")
    doc = json.loads((tmp_path / "d" / "sweep.json").read_text())
    assert code == 1 and doc["errors"] == 0, err
    verdicts = {r["rank"]: r["verdict"] for r in doc["rows"] if r.get("rank")}
    assert verdicts["10"] == "PASS" and sum(v == "FAIL" for v in verdicts.values()) == len(verdicts) - 1
    code, _, err = cli(capsys, "doctor", "--adapter", f"dump:{root}", "--out", str(tmp_path / "e"), "--workers", "1",
                       "--convention", "nope")
    assert code == 2 and "unknown convention 'nope'" in err and not (tmp_path / "e").exists()


@pytest.mark.parametrize("args,message", [
    (("--json",), "drop --json"),
    (("--shape", "2,3"), "--shape contradicts"),
    (("--scheduler", "not an address"), "--scheduler takes a dask scheduler address"),
    (("--resume",), "--resume continues the sweep in --out"),
])
def test_sweep_options_are_checked_first(tmp_path, capsys, args, message):
    root = make_root(tmp_path / "run", steps=1)
    before = set(Path("reports").glob("overflow-sweep-*"))
    code, out, err = cli(capsys, "overflow", "--adapter", f"dump:{root}", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert set(Path("reports").glob("overflow-sweep-*")) == before  # nothing written


def test_sweep_flags_need_a_dump_root(capsys):
    code, out, err = cli(capsys, "doctor", "--workers", "2")
    assert code == 2 and "run over a dump root" in err


# ---- a real dask.distributed cluster on loopback -----------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=":0", silence_logs=50) as c:  # (None still took 8787)
        yield c


def test_a_sweep_on_a_local_cluster_equals_the_in_process_one(tmp_path, cluster):
    root = make_root(tmp_path / "run", bad={(1, "0"): NumpyBN("dx-drops-xhat-term")})
    tasks = plan(root)
    here = run_sweep(tasks, SweepSpec("compare-precision"), workers=1)
    there = run_sweep(tasks, SweepSpec("compare-precision"), scheduler=cluster.scheduler_address)
    assert same(here, there) and {r["verdict"] for r in there} == {"PASS", "FAIL"}
    assert len({r["worker"] for r in there}) == 2  # both workers ran tasks, reading the dump paths themselves


def test_a_cluster_worker_killed_mid_sweep_is_survived(tmp_path, cluster):
    import signal

    from distributed import Client

    root = make_root(tmp_path / "run", steps=4)
    with Client(cluster.scheduler_address, set_as_default=False) as client:
        pids = client.run(os.getpid)
    killed = []

    def kill_one(done, total, failed):
        if done == 2 and not killed:
            killed.append(next(iter(pids.values())))
            os.kill(killed[0], signal.SIGKILL)

    rows = run_sweep(plan(root), SweepSpec("doctor"), scheduler=cluster.scheduler_address, progress=kill_one)
    assert killed and len(rows) == 12 and all(r["status"] == "ok" for r in rows)
    assert same(rows, run_sweep(plan(root), SweepSpec("doctor"), workers=1))


def test_a_sweep_of_real_msprobe_ranks_and_steps(msprobe_ranks, tmp_path, capsys):
    """msprobe's own dumps of a 2-rank DDP run (gloo), 2 steps: torch's kernel passes on every call; the
    statistics dump's summaries are scanned; a check that needs tensors refuses the statistics dump up front."""
    root, manifest = msprobe_ranks
    tensor = root / manifest["dumps"]["tensor"]["dump_path"]
    stats = root / manifest["dumps"]["statistics"]["dump_path"]
    tasks = plan(tensor)
    assert [(t.step, t.rank) for t in tasks][::4] == [(0, "0"), (0, "1"), (1, "0"), (1, "1")] and len(tasks) == 16
    code, out, err = cli(capsys, "compare-precision", "--adapters", f"dump:{tensor}", "--out", str(tmp_path / "t"),
                         "--workers", "1")
    assert code == 0 and "16 calls (2 step(s) x 2 rank(s)), all pass" in out, out + err
    code, out, err = cli(capsys, "overflow", "--adapter", f"dump:{stats}", "--out", str(tmp_path / "s"))
    assert code in (0, 1) and "overflow sweep" in out and err == ""
    code, out, err = cli(capsys, "doctor", "--adapter", f"dump:{stats}", "--out", str(tmp_path / "d"))
    assert code == 2 and "statistics-only" in err and not (tmp_path / "d").exists()


def _syncbn_root(root, merge, ranks=(2, 14), steps=1):
    """Per-rank bnprobe dumps of an emulated SyncBatchNorm step (ranks of unequal sizes, channels whose rank means
    differ), as a multi-rank run writes them: step<k>/rank<r>/."""
    from bnprobe.adapters.syncbn import SyncBNAdapter, rank_recordings

    rng = np.random.default_rng(5)
    n = sum(ranks)
    x = rng.standard_normal((n, 3, 2, 2)) + np.repeat([0.0, 3.0], ranks)[:, None, None, None]
    for s in range(steps):
        recs = rank_recordings(SyncBNAdapter(ranks, merge=merge), BNCall(x + s, np.ones(3), np.zeros(3), np.zeros(3),
                                                                         np.ones(3), rng.standard_normal(x.shape),
                                                                         dtype="fp32"))
        for r, rec in recs.items():
            write_dump(rec, root / f"step{s}" / f"rank{r}")
    return root


def test_the_statistics_each_rank_used_are_checked_against_the_concatenated_batch(tmp_path, capsys):
    """A SyncBatchNorm whose merge ignores the ranks' counts (2 and 14 samples) is named by the sweep's rank check
    and fails it; the correct merge (Chan's) reads as SyncBatchNorm and passes; real DDP ranks read as local."""
    good = _syncbn_root(tmp_path / "chan", "chan")
    bad = _syncbn_root(tmp_path / "unweighted", "unweighted")
    code, out, err = cli(capsys, "doctor", "--adapter", f"dump:{good}", "--out", str(tmp_path / "g"))
    assert code == 0 and "1 layer(s) x step checked across ranks (syncbn 1)" in out, out + err
    code, out, err = cli(capsys, "doctor", "--adapter", f"dump:{bad}", "--out", str(tmp_path / "b"))
    doc = json.loads((tmp_path / "b" / "sweep.json").read_text())
    assert code == 1 and doc["ranks"][0]["verdict"] == "FAIL" and "unweighted" in doc["ranks"][0]["summary"]
    assert any(d["what"] == "statistics" for d in doc["disagreements"]) and "statistics" in out
    assert (tmp_path / "b" / "ranks.csv").is_file()
    # each SyncBatchNorm rank's score (the heatmaps') is the rank check's against the concatenated batch: within 1
    # where it passes, over 1 on the rank the unweighted merge put off; its own slice's is kept beside it
    import pandas as pd

    rows = pd.read_csv(tmp_path / "g" / "sweep.csv")
    assert (rows.judged_by == "ranks").all() and (rows.score <= 1).all() and (rows.own_slice_score > 1).any()
    rows = pd.read_csv(tmp_path / "b" / "sweep.csv")
    assert (rows.score > 1).any()


def test_a_scheduler_without_dask_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    import sys

    root = make_root(tmp_path / "run", steps=1)
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if bnprobe[dist] were not installed
    code, out, err = cli(capsys, "overflow", "--adapter", f"dump:{root}", "--scheduler", "tcp://127.0.0.1:1",
                         "--out", str(tmp_path / "o"))
    assert code == 2 and "pip install 'bnprobe[dist]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing left behind


def test_the_scheduler_can_come_from_the_environment(tmp_path, capsys, monkeypatch, cluster):
    root = make_root(tmp_path / "run", steps=1)
    monkeypatch.setenv("BNPROBE_SCHEDULER", cluster.scheduler_address)
    code, out, err = cli(capsys, "compare-precision", "--adapters", f"dump:{root}", "--out", str(tmp_path / "o"))
    assert code == 0 and f"on dask scheduler {cluster.scheduler_address}" in out, out + err
    monkeypatch.setenv("BNPROBE_SCHEDULER", "nonsense")
    code, out, err = cli(capsys, "compare-precision", "--adapters", f"dump:{root}", "--out", str(tmp_path / "p"))
    assert code == 2 and "--scheduler takes a dask scheduler address" in err


def test_local_workers_are_spawned_once_a_compiled_kernel_has_run():
    """numba's OpenMP threads do not survive a fork (the child aborts): after a compiled kernel, workers start
    fresh; before, they are forked (quicker)."""
    code = ("import sys, numpy as np\n"
            "from bnprobe import Execution, forward_train\nfrom bnprobe.sweep import tasks as sweep\n"
            "before = sweep._start_method()\n"
            "r = forward_train(np.ones((2, 3, 4), np.float32) * np.arange(4), policy='fp16',\n"
            "                  execution=Execution(keep_arrays=False))\n"
            "print(before, r.trace.meta['route'], sweep._start_method())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BNPROBE_JIT": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fork", "compiled", "spawn"]


@pytest.mark.parametrize("run", ["from bnprobe.numerics.rounding import fp16_as; fp16_as(np.ones(9), np.float32)",
                                 "from bnprobe.engine.rules import channel_rule; "
                                 "channel_rule('y', np.ones((2, 3, 4)), np.ones((2, 3, 4)), None, 'fp16')"])
def test_local_workers_are_spawned_once_any_compiled_helper_has_run(run):
    """Not only the BatchNorm kernels: the compiled casts and rules (parallel numba loops too) make the process one
    whose fork would abort."""
    code = ("import numpy as np\n"
            "from bnprobe.sweep import tasks as sweep\n"
            "before = sweep._start_method()\n"
            f"{run}\n"
            "print(before, sweep._start_method())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "BNPROBE_JIT": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fork", "spawn"]


def test_an_interrupted_sweep_says_what_finished_and_a_finished_one_is_not_resumed(tmp_path, capsys, monkeypatch):
    """Ctrl-C: exit 130 with how many of the tasks (6 calls, 2 rank checks) finished, where they are kept and how to
    continue; --resume then finishes it; --resume on a finished sweep says so in one line (exit 2)."""
    import bnprobe.sweep.command as command
    import bnprobe.sweep.tasks as sweep

    root, out = make_root(tmp_path / "run"), tmp_path / "out"
    real = command.run_sweep

    def interrupted(tasks, spec, *, journal=None, **kw):
        journal.open([])
        journal.add({**sweep.run_task(tasks[0], spec), "attempts": 1})  # one task finished, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run_sweep", interrupted)
    code, text, err = cli(capsys, "overflow", "--adapter", f"dump:{root}", "--out", str(out))
    assert code == 130 and text == ""
    assert err.strip() == (f"bnprobe: interrupted: 1 of 8 task(s) finished and kept in {out}/sweep-journal.jsonl; "
                           f"the same command with --resume --out {out} continues from there")
    monkeypatch.setattr(command, "run_sweep", real)
    code, text, err = cli(capsys, "overflow", "--adapter", f"dump:{root}", "--out", str(out), "--resume")
    assert code == 0 and "6 calls" in text
    code, text, err = cli(capsys, "overflow", "--adapter", f"dump:{root}", "--out", str(out), "--resume")
    assert code == 2 and "has finished" in err and "nothing to resume" in err and err.count("\n") == 1


def test_a_sweep_writes_where_its_command_writes(tmp_path, capsys, monkeypatch):
    """One rule on one call, a dump or a sweep: overflow and doctor write only where --out says, compare-precision
    its report folder under reports/ as on one call."""
    root = make_root(tmp_path / "run", steps=1)
    monkeypatch.chdir(tmp_path)
    for command in ("overflow", "doctor"):
        code, text, err = cli(capsys, command, "--adapter", f"dump:{root}")
        assert code in (0, 1) and "nothing written: " in text and not (tmp_path / "reports").exists()
    code, text, err = cli(capsys, "compare-precision", "--adapters", f"dump:{root}", "--no-budget")
    assert "report: reports/compare-precision-sweep-" in text and (tmp_path / "reports").is_dir()

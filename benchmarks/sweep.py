"""A sweep at model scale: ResNet-50's 53 BatchNorm calls x 2 steps x 2 ranks (batch 2 per rank), checked by
``bnprobe compare-precision`` one task per call, with 1 and 2 local workers and on a dask.distributed LocalCluster
of 1 and 2 worker processes, side by side in one run.

    python benchmarks/sweep/tasks.py [--root DIR] [--steps 2] [--ranks 2] [--batch 2]

Prints, per engine: wall time and the time running the tasks, the scaling efficiency of 2 workers over 1
(T1 / (2 T2)), the per-task scheduling overhead ((task-running time x workers - sum of the tasks' own times) /
tasks; start-up, planning and the report are not per task) against the median task time, and the largest peak
memory of any worker against the memory estimate of the largest single call; then what a 1,000-rank, 53-layer,
10-step sweep costs on N workers at the measured per-task time.  Writes reports/benchmarks-sweep.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CAPTURE = '''
import sys, torch, bnprobe
out, batch, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)  # the same model on every rank and step, as DDP keeps it
m = resnet50().train()
torch.manual_seed(1000 + seed)  # each rank and step its own batch
x = torch.randn(batch, 3, 224, 224)
with bnprobe.capture(m, out):
    (m(x) ** 2).mean().backward()
'''


def _model_source() -> str:
    spec = importlib.util.spec_from_file_location("resnet50_dump", ROOT / "benchmarks" / "resnet50_dump.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.MODEL


def make_root(root: Path, steps: int, ranks: int, batch: int) -> float:
    """Capture one training step per step and rank into root/step<k>/rank<r>/; the seconds it took."""
    t0 = time.perf_counter()
    script = _model_source() + CAPTURE
    for s in range(steps):
        for r in range(ranks):
            out = root / f"step{s}" / f"rank{r}"
            if not out.exists():
                subprocess.run([sys.executable, "-c", script, str(out), str(batch), str(s * ranks + r)], check=True)
    return time.perf_counter() - t0


def sweep(root: Path, out: Path, *args: str) -> dict:
    """One compare-precision sweep in its own process: wall time and the sweep's own rows."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "bnprobe", "compare-precision", "--adapters", f"dump:{root}", "--out",
                        str(out), "--force", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"sweep failed: {p.stderr.strip()}")
    doc = json.loads((out / "sweep.json").read_text())
    rows = doc["rows"] + doc["ranks"]
    return {"wall": wall, "engine": doc["seconds"], "tasks": len(rows),
            "task_seconds": [r["seconds"] for r in rows if r["status"] == "ok"],
            "peak_mb": max(r["worker_peak_mb"] for r in rows if r["status"] == "ok"), "verdict": doc["passed"],
            "errors": doc["errors"]}


def figures(runs: dict[str, dict], workers: dict[str, int]) -> list[dict]:
    out = []
    for name, r in runs.items():
        w = workers[name]
        med = statistics.median(r["task_seconds"])
        overhead = (r["engine"] * w - sum(r["task_seconds"])) / r["tasks"]  # the engine's time, not start-up/report
        out.append({"engine": name, "workers": w, "tasks": r["tasks"], "wall_s": r["wall"], "engine_s": r["engine"],
                    "median_task_s": med,
                    "overhead_per_task_s": overhead, "overhead_share": overhead / med, "peak_mb": r["peak_mb"],
                    "all_pass": r["verdict"], "errors": r["errors"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="dump root to make (and reuse when it exists)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    root = a.root or Path(tempfile.mkdtemp(prefix="bnprobe-sweep-bench-")) / "run"
    made = make_root(root, a.steps, a.ranks, a.batch)
    from bnprobe.guard import format_size, run_bytes
    from bnprobe.sweep.tasks import plan

    tasks = plan(root)
    largest = max(tasks, key=lambda t: math.prod(t.shape))
    estimate = run_bytes("compare-precision", math.prod(largest.shape))
    dump_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    runs, workers = {}, {}
    for w in (1, 2):
        runs[f"local x{w}"], workers[f"local x{w}"] = sweep(root, root.parent / f"local{w}", "--workers", str(w)), w
    from distributed import LocalCluster

    for w in (1, 2):
        with LocalCluster(n_workers=w, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, silence_logs=50) as cluster:
            name = f"dask LocalCluster x{w}"
            runs[name], workers[name] = sweep(root, root.parent / f"dask{w}", "--scheduler",
                                              cluster.scheduler_address), w
    rows = figures(runs, workers)
    lines = [f"# Sweep benchmark: {len(tasks)} calls ({a.steps} steps x {a.ranks} ranks of ResNet-50's BatchNorm "
             f"calls, batch {a.batch} per rank), compare-precision on the recorded outputs", "",
             f"dump root: {format_size(dump_bytes)} on disk, made in {made:.0f} s; largest call {largest.key} "
             f"{largest.shape}: guard estimate {format_size(estimate)}", "",
             "| engine | workers | tasks | wall s | of which running tasks s | median task s | overhead/task s | "
             "overhead / median task | peak MB of a worker | all pass |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['engine']} | {r['workers']} | {r['tasks']} | {r['wall_s']:.1f} | {r['engine_s']:.1f} | "
              f"{r['median_task_s']:.3f} | "
              f"{r['overhead_per_task_s']:.4f} | {100 * r['overhead_share']:.1f}% | {r['peak_mb']:.0f} | "
              f"{r['all_pass']} |" for r in rows]
    by = {r["engine"]: r for r in rows}
    for kind in ("local", "dask LocalCluster"):
        one, two = by[f"{kind} x1"], by[f"{kind} x2"]
        lines.append(f"\n{kind}: scaling efficiency of 2 workers over 1 = T1 / (2 T2) = "
                     f"{one['wall_s'] / (2 * two['wall_s']):.2f} (wall), {one['engine_s'] / (2 * two['engine_s']):.2f} "
                     "(running the tasks)")
    per_task = statistics.median(runs["dask LocalCluster x2"]["task_seconds"])
    big = 1000 * 53 * 10
    lines += ["", f"On paper, at the measured median task time {per_task:.3f} s (batch {a.batch} per rank; a task "
              "scales with its call's size): a 1,000-rank, 53-layer, 10-step sweep is "
              f"{big:,} call tasks = {big * per_task / 3600:.0f} CPU-hours, plus 530 rank checks (each loads the "
              "layer's 1,000 ranks' calls: memory 1,000 x one call)"]
    lines += [f"- on {n} workers at efficiency 0.9: {big * per_task / (0.9 * n) / 3600:.1f} h" for n in (16, 128,
                                                                                                          1024)]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "benchmarks-sweep.md").write_text(text)


if __name__ == "__main__":
    main()

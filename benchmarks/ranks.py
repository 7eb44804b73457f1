"""The rank check at 1,000 ranks: one SyncBatchNorm layer's training step simulated on N ranks (many small calls,
written as bnprobe dumps under ROOT/step0/rank<r>/), and the sweep's rank task over them, run in a child process
whose peak memory the kernel measures (getrusage; the dumps are made in a process of their own, since a child
inherits its parent's high-water mark across fork and exec).  Side by side in one run: the rank task as the sweep
runs it (each rank's call read, reduced to its moments and let go; y and dx judged one rank at a time) and the same
check handed every rank's call loaded at once (what the sweep did before).

    python benchmarks/ranks.py [--ranks 1000] [--per-rank 2,32,8,8] [--dtype fp16] [--root DIR]

Prints each one's wall time and peak memory, one rank's call size and the eager/bounded ratios; writes
reports/benchmarks-ranks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

CHILD = '''
import json, resource, sys, time
from bnprobe.sweep import tasks as sweep
from bnprobe.checks.ranks.check import check_ranks
root, how = sys.argv[1], sys.argv[2]
tasks = sweep.plan(root)
(group,) = sweep.rank_groups(tasks)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if how == "bounded":
    row = sweep._ranks_row(group)
    verdict, fails = row["verdict"], len(row["failures"])
else:
    recs = {i: sweep._one_call(t).calls[0].load() for i, t in enumerate(group.members)}
    rep = check_ranks(recs, call=group.layer)
    verdict, fails = ("PASS" if rep.passed else "FAIL"), len(rep.failures)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": dt, "peak_mb": peak / 1024, "import_mb": base / 1024, "verdict": verdict,
                  "failures": fails, "ranks": len(group.members)}))
'''


def make_root(root: Path, ranks: int, per_rank: tuple[int, ...], dtype: str) -> tuple[float, float]:
    """Write one SyncBatchNorm step of ``ranks`` ranks; (seconds, one rank's dump in MB)."""
    from bnprobe.adapters.syncbn import rank_recordings
    from bnprobe.core.call import BNCall
    from bnprobe.recordings import write_dump

    t0 = time.perf_counter()
    n, c = per_rank[0], per_rank[1]
    rng = np.random.default_rng(0)
    x = rng.normal(0.5, 1.5, (n * ranks, *per_rank[1:]))
    dy = rng.normal(size=x.shape)
    recs = rank_recordings(f"syncbn:world={ranks}", BNCall(x, rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c),
                                                           np.zeros(c), np.ones(c), dy, dtype=dtype), call="layer1.bn")
    del x, dy
    for r, rec in recs.items():
        write_dump(rec, root / "step0" / f"rank{r}")
    size = sum(p.stat().st_size for p in (root / "step0" / "rank0").rglob("*") if p.is_file())
    return time.perf_counter() - t0, size / 2**20


def run(root: Path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), how], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1000)
    ap.add_argument("--per-rank", default="2,32,8,8", help="one rank's x shape, N,C,H,W")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--root", type=Path, default=None, help="reuse or keep the simulated dumps here")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    per_rank = tuple(int(v) for v in a.per_rank.split(","))
    if a.make_only:
        made, _ = make_root(a.root, a.ranks, per_rank, a.dtype)
        print(f"simulated {a.ranks} ranks of {per_rank} {a.dtype} in {made:.1f} s")
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = a.root or Path(tmp) / "ranks"
        if not (root / "step0").exists():  # in a process of its own: Linux keeps ru_maxrss across fork and exec
            subprocess.run([sys.executable, __file__, "--make-only", "--root", str(root), "--ranks", str(a.ranks),
                            "--per-rank", a.per_rank, "--dtype", a.dtype], check=True)
        one_mb = sum(p.stat().st_size for p in (root / "step0" / "rank0").rglob("*") if p.is_file()) / 2**20
        bounded, eager = run(root, "bounded"), run(root, "eager")
    assert bounded["verdict"] == eager["verdict"], (bounded, eager)
    rows = [("rank task as the sweep runs it (two levels, one call held)", bounded),
            ("every rank's call loaded at once (before)", eager)]
    lines = [f"# The rank check at {a.ranks} ranks ({a.per_rank} {a.dtype} per rank; one rank's dump "
             f"{one_mb:.3f} MB)", "", "| how | wall | peak memory (getrusage) | over the imports | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in rows:
        grow = r["peak_mb"] - r["import_mb"]
        lines.append(f"| {name} | {r['seconds']:.1f} s | {r['peak_mb']:.0f} MB | {grow:.0f} MB "
                     f"| {r['verdict']} ({r['failures']} failures) |")
    grow_b, grow_e = bounded["peak_mb"] - bounded["import_mb"], eager["peak_mb"] - eager["import_mb"]
    lines += ["", f"memory over the imports: {grow_b:.0f} MB bounded vs {grow_e:.0f} MB eager "
              f"({grow_e / max(grow_b, 1e-9):.1f}x); time {bounded['seconds'] / eager['seconds']:.2f}x of eager"]
    text = "\n".join(lines)
    print(text)
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "benchmarks-ranks.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

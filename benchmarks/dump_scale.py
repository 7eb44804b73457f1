"""A model's dump at the batch users train with, against the golden's own cost: capture one fp16 training step of a
6-layer conv network at batch 32 (33 M BatchNorm values: this machine cannot train ResNet-50 at batch 32), then
time each command on the dump against torch's float64 forward + backward of the same calls, measured in one run.

    python benchmarks/dump_scale.py [--batch 32] [--size 96] [--dtype fp16] [--keep DIR] [--commands ...]

Each part runs in its own process; its peak memory is getrusage's of that child.  The golden's cost is the median
of three in-process passes of ``torch.nn.functional.batch_norm`` in float64 over every recorded call (the dump
read once, before the clock).  Each command's own compute time is the one its headline prints; its wall time
includes Python's start and the imports.  Writes reports/benchmarks-dump-scale.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the network: six conv/BatchNorm/ReLU blocks (benchmarks/dump_compare.py dumps the same one with msprobe)
SIX = '''
import torch
from torch import nn

def six():
    layers, cin = [], 3
    for cout, s in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1)):
        layers += [nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
'''

NET = SIX + '''
import contextlib, resource, sys, time

out, dtype, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
m = six()
m = {"fp32": m.float, "fp16": m.half, "bf16": m.bfloat16}[dtype]().train()
x = torch.randn(batch, 3, size, size).to(next(m.parameters()).dtype)
if out != "-":
    import bnprobe
t0 = time.perf_counter()
with (bnprobe.capture(m, out) if out != "-" else contextlib.nullcontext()):
    m(x).float().pow(2).mean().backward()
print(time.perf_counter() - t0)
'''

GOLDEN = '''
import sys, time, numpy as np, torch
from bnprobe.recordings import open_dump
calls = [ref.load().call() for ref in open_dump(sys.argv[1]).calls]
as64 = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))
times = []
for _ in range(4):
    t0 = time.perf_counter()
    for c in calls:
        x = as64(c.x).requires_grad_()
        g, b = as64(c.gamma).requires_grad_(), as64(c.beta).requires_grad_()
        y = torch.nn.functional.batch_norm(x, as64(c.running_mean), as64(c.running_var), g, b, c.training,
                                           c.momentum or 0.0, c.eps)
        y.backward(as64(c.dy))
    times.append(time.perf_counter() - t0)
print(sorted(times[1:])[1], sum(int(np.size(c.x)) for c in calls), len(calls))
'''

COMMANDS = {
    "compare-precision --no-budget": ["compare-precision", "--adapters", "dump:{dump}", "--no-budget"],
    "compare-precision (with the error budget)": ["compare-precision", "--adapters", "dump:{dump}"],
    "doctor": ["doctor", "--adapter", "dump:{dump}"],
    "overflow": ["overflow", "--adapter", "dump:{dump}"],
    "gradcheck": ["gradcheck", "--adapter", "dump:{dump}"],
}


def _runner():
    spec = importlib.util.spec_from_file_location("resnet50_dump", ROOT / "benchmarks" / "resnet50_dump.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod._run  # wall time, peak RSS (MB) of the child, and its output


def _headline_seconds(out: str) -> float | None:
    """The compute time a command's headline prints (``..., 12.345 s: ...``), or None."""
    m = re.search(r", ([0-9.]+) s[:;,]", out.splitlines()[0] if out else "")
    return float(m.group(1)) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--dtype", default="fp16", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--keep", type=Path, default=None, help="keep the dump and reports in this folder")
    ap.add_argument("--dump", type=Path, default=None, help="an existing capture of the network (skips the step)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="which commands, comma-separated")
    a = ap.parse_args()
    run = _runner()
    root = a.keep or Path(tempfile.mkdtemp(prefix="bnprobe-dump-scale-"))
    dump = a.dump or root / f"six-{a.dtype}-b{a.batch}"
    lines = [f"# A model's dump at batch {a.batch} ({a.dtype}) against the golden's cost", "",
             "| part | wall | compute (headline) | peak | ratio to the golden |", "| --- | --- | --- | --- | --- |"]
    try:
        if a.dump is None:
            wall, peak, out = run([sys.executable, "-c", NET, "-", a.dtype, str(a.batch), str(a.size)])
            step, step_peak = float(out.split()[-1]), peak
            print(f"plain training step: {step:.1f} s, peak {peak:.0f} MB")
            lines.append(f"| plain training step | {step:.1f} s | | {peak:.0f} MB | |")
            wall, peak, out = run([sys.executable, "-c", NET, str(dump), a.dtype, str(a.batch), str(a.size)])
            cap = float(out.split()[-1])
            size = sum(f.stat().st_size for f in dump.rglob("*") if f.is_file()) / 2**20
            print(f"capture of the same step: {cap:.1f} s ({cap / step:.2f}x), peak {peak:.0f} MB "
                  f"({peak / step_peak:.2f}x), dump {size:.0f} MB")
            lines.append(f"| capture of the step | {cap:.1f} s ({cap / step:.2f}x) | | {peak:.0f} MB "
                         f"({peak / step_peak:.2f}x) | dump {size:.0f} MB |")
        wall, peak, out = run([sys.executable, "-c", GOLDEN, str(dump)])
        gold, values, ncalls = out.split()
        gold = float(gold)
        print(f"golden: torch float64 forward + backward of the {ncalls} calls ({int(values) / 1e6:.1f} M values): "
              f"{gold:.3f} s")
        lines.append(f"| golden: torch float64 forward + backward, {ncalls} calls, {int(values) / 1e6:.1f} M values "
                     f"| | {gold:.3f} s | | 1 |")
        for name in [c.strip() for c in a.commands.split(",") if c.strip()]:
            args = [s.format(dump=dump) for s in COMMANDS[name]]
            report = root / ("report-" + re.sub(r"[^a-z]+", "-", name).strip("-"))
            wall, peak, out = run([sys.executable, "-m", "bnprobe.cli", *args, "--out", str(report), "--force"])
            own = _headline_seconds(out)
            shown = "" if own is None else f"{own:.1f} s ({own / gold:.0f}x)"
            print(f"{name}: {wall:.1f} s wall ({wall / gold:.0f}x the golden), {shown or 'no headline time'}, "
                  f"peak {peak:.0f} MB")
            lines.append(f"| {name} | {wall:.1f} s | {shown} | {peak:.0f} MB | {wall / gold:.0f}x |")
        (ROOT / "reports").mkdir(exist_ok=True)
        (ROOT / "reports" / "benchmarks-dump-scale.md").write_text("\n".join(lines) + "\n")
        print(json.dumps({"written": "reports/benchmarks-dump-scale.md"}))
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

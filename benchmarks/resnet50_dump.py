"""ResNet-50's 53 BatchNorm calls, end to end: capture one training step of a plain-torch ResNet-50 at
batch 2 with ``bnprobe.capture``, then run ``bnprobe compare-precision`` on the dump (every call on its
own recorded inputs), timing each part and measuring each part's peak memory in its own process.

    python benchmarks/resnet50_dump.py [--out DIR] [--dtype fp32|fp16|bf16] [--adapters dump,torch]

The model is torchvision's ResNet-50 (v1.5: stride in the 3x3 conv) written out in plain torch, so
no torchvision is needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODEL = '''
import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride, down):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \\
            if down else None

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


def resnet50(num_classes=1000):
    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        seq = []
        for i in range(blocks):
            seq.append(Bottleneck(cin, width, stride if i == 0 else 1, i == 0))
            cin = width * 4
        layers.append(nn.Sequential(*seq))
    m = nn.Sequential()
    m.add_module("conv1", nn.Conv2d(3, 64, 7, 2, 3, bias=False))
    m.add_module("bn1", nn.BatchNorm2d(64))
    m.add_module("relu", nn.ReLU())
    m.add_module("maxpool", nn.MaxPool2d(3, 2, 1))
    for i, layer in enumerate(layers, 1):
        m.add_module(f"layer{i}", layer)
    m.add_module("avgpool", nn.AdaptiveAvgPool2d(1))
    m.add_module("flatten", nn.Flatten())
    m.add_module("fc", nn.Linear(2048, num_classes))
    return m
'''

STEP = MODEL + '''
import contextlib, sys, time, resource
import bnprobe
out, dtype, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
m = resnet50()
m = {"fp32": m.float, "fp16": m.half, "bf16": m.bfloat16}[dtype]()
m.train()
x = torch.randn(batch, 3, 224, 224).to(next(m.parameters()).dtype)
t0 = time.perf_counter()
with (bnprobe.capture(m, out) if out != "-" else contextlib.nullcontext()):
    loss = (m(x).float() ** 2).mean()
    loss.backward()
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
'''
CAPTURE = STEP  # (the plain step: out "-")


def run_child(args: list[str]) -> tuple[float, float, float, str]:
    """Wall time, CPU time (user + system, the child's and its own children's), peak RSS (MB) of the child, and
    its output (benchmarks/dump_compare.py times its parts by it too).  On a shared machine the CPU time moves less
    than the wall between runs."""
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", "import resource, subprocess, sys\n"
                               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
                               "print(r.stdout, end=''); print(r.stderr, end='', file=sys.stderr)\n"
                               "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
                               "print('PEAK', u.ru_maxrss / 1024, u.ru_utime + u.ru_stime)\n"
                               "sys.exit(r.returncode)", *args],
        capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = p.stdout.strip().splitlines()
    if p.returncode not in (0, 1) or not lines or not lines[-1].startswith("PEAK"):
        raise SystemExit(f"{' '.join(args[:4])}... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    _, peak, cpu = lines[-1].split()
    return wall, float(cpu), float(peak), "\n".join(lines[:-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="where to keep the dump and report (default: a temp dir)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--adapters", default="dump,torch", help="compare-precision adapters; 'dump' is the capture")
    ap.add_argument("--no-compare", action="store_true", help="the capture and the plain step only")
    args = ap.parse_args()
    tmp = None
    if args.out is None:
        tmp = Path(tempfile.mkdtemp(prefix="bnprobe-resnet50-"))
    root = args.out or tmp
    dump, report = root / f"resnet50-{args.dtype}-b{args.batch}", root / f"report-{args.dtype}-b{args.batch}"
    try:
        p_wall, _, p_peak, _ = run_child([sys.executable, "-c", STEP, "-", args.dtype, str(args.batch)])
        print(f"plain training step of ResNet-50 at batch {args.batch} in {args.dtype}: {p_wall:.1f} s wall (with "
              f"the process's start), peak {p_peak:.0f} MB")
        wall, _, peak, out = run_child([sys.executable, "-c", CAPTURE, str(dump), args.dtype, str(args.batch)])
        index = json.loads((dump / "bnprobe-calls.json").read_text())
        size = sum(f.stat().st_size for f in dump.rglob("*") if f.is_file()) / 2**20
        print(f"capture: {len(index['calls'])} BatchNorm calls (forward + backward) of ResNet-50 at batch "
              f"{args.batch} in {args.dtype}: {wall:.1f} s wall, peak {peak:.0f} MB, dump {size:.0f} MB; "
              f"{wall / p_wall:.2f}x the plain step's wall time, {peak / p_peak:.2f}x its peak")
        if args.no_compare:
            return 0
        adapters = ",".join(f"dump:{dump}" if a.strip() == "dump" else a.strip() for a in args.adapters.split(","))
        wall, _, peak, out = run_child([sys.executable, "-m", "bnprobe.cli", "compare-precision", "--adapters",
                                        adapters, "--no-budget", "--out", str(report)])
        print(f"compare-precision --adapters {args.adapters}: {wall:.1f} s wall, peak {peak:.0f} MB")
        print(out.splitlines()[0])
        first = [ln for ln in out.splitlines() if ln.startswith("first call over")]
        print(first[0] if first else "")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

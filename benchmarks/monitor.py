"""What bnprobe.monitor costs a training step: the plain step and the monitored step of the same model, side by
side in one run, each in its own process (peak memory by getrusage of that child), alternating runs.

    python benchmarks/monitor.py [--model resnet50|small|small3|transformer] [--batch 8] [--size 112] [--steps 6]
                                 [--repeats 3] [--every 1] [--threads N]

resnet50: torchvision's ResNet-50 in plain torch (benchmarks/resnet50_dump.py's model, 53 BatchNorm calls);
small: a 4-layer conv network (4 BatchNorm calls); small3: issue 56's small net, 3 conv/BN blocks (16, 32, 64
channels, stride 2; use --batch 16 --size 32); transformer: examples/monitor_transformer.py's block (a LayerNorm and
a Hugging Face-style RMSNorm, watched per row; --batch 4, 16 tokens).  A step is forward, backward and an SGD step on
the CPU; the first step is not timed.  Prints the median step time of each (with --every k > 1, the monitored run's
mean), the median CPU time of a step (every thread of the process: the monitor's writer thread included), the ratios
monitored/plain and the peaks; writes reports/benchmarks-monitor-<model>.md.  --threads sets torch's threads in both
(default: torch's own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMALL = '''
import torch
from torch import nn

def small():
    layers, cin = [], 3
    for cout in (32, 64, 64, 128):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
'''

SMALL3 = '''
def small3():
    layers, cin = [], 3
    for cout in (16, 32, 64):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))

def transformer():
    import importlib.util
    spec = importlib.util.spec_from_file_location("monitor_transformer", EXAMPLES + "/monitor_transformer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_block()
'''

STEP = '''
import json, resource, sys, time, torch
name, how, batch, size, steps, out, every, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
m = {"resnet50": resnet50, "small": small, "small3": small3, "transformer": transformer}[name]().train()
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(batch, 16, 32) if name == "transformer" else torch.randn(batch, 3, size, size)
times, cpu = [], []

def step():
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()

if how == "plain":
    for k in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
else:
    import bnprobe
    with bnprobe.monitor(m, out, every=every) as mon:
        for k in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            mon.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
rest, crest = times[1:], sorted(cpu[1:])
print(json.dumps({"median": sorted(rest)[len(rest) // 2] if every == 1 else sum(rest) / len(rest),
                  "cpu": crest[len(crest) // 2] if every == 1 else sum(crest) / len(crest), "peak_mb": peak}))
'''


def _resnet_source() -> str:
    spec = importlib.util.spec_from_file_location("resnet50_dump", ROOT / "benchmarks" / "resnet50_dump.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.MODEL.split("\nm = resnet50()")[0]


def run(how: str, a: argparse.Namespace, out: Path) -> dict:
    src = _resnet_source() + SMALL + f"EXAMPLES = {str(ROOT / 'examples')!r}\n" + SMALL3 + STEP
    res = subprocess.run([sys.executable, "-c", src, a.model, how, str(a.batch), str(a.size), str(a.steps), str(out),
                          str(a.every), str(a.threads)], check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("resnet50", "small", "small3", "transformer"), default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, default=1, help="monitor(every=k): rows every k-th step (time per step "
                                                           "averaged over the steps)")
    ap.add_argument("--threads", type=int, default=0, help="torch's threads in both runs (0: torch's default)")
    a = ap.parse_args()
    plain, mon = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.repeats):  # alternating, so that a busy spell of the machine hits both
            plain.append(run("plain", a, Path(tmp) / f"p{k}"))
            mon.append(run("monitor", a, Path(tmp) / f"m{k}"))
    tp, tm = (statistics.median(r["median"] for r in rs) for rs in (plain, mon))
    cp, cm = (statistics.median(r["cpu"] for r in rs) for rs in (plain, mon))
    pp, pm = (max(r["peak_mb"] for r in rs) for rs in (plain, mon))
    text = "\n".join([
        f"# bnprobe.monitor's cost: {a.model}, batch {a.batch}, "
        f"{'16 tokens' if a.model == 'transformer' else f'{a.size}x{a.size}'}, CPU"
        f"{f', {a.threads} torch threads' if a.threads else ''}, {a.steps} steps x {a.repeats} runs each", "",
        "| | step (median) | CPU time of a step (median) | peak memory |", "| --- | --- | --- | --- |",
        f"| plain training step | {tp * 1e3:.2f} ms | {cp * 1e3:.2f} ms | {pp:.0f} MB |",
        f"| monitored step (every={a.every}{'' if a.every == 1 else ', mean over steps'}) | {tm * 1e3:.2f} ms | "
        f"{cm * 1e3:.2f} ms | {pm:.0f} MB |",
        f"| ratio | {tm / tp:.2f}x | {cm / cp:.2f}x | {pm / pp:.2f}x |"])
    print(text)
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / f"benchmarks-monitor-{a.model}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

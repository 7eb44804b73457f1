"""Side-by-side timings of bnprobe against its peers, run in the same session.

    python benchmarks/run.py [--quick] [--only NAME,...]

Every case runs in a fresh subprocess (so its peak memory is its own) and is
repeated; the median wall time is reported, with the ratio to the peer measured
in the same run.  Absolute times vary between machines and runs; the ratios are
what to compare.  Results are printed and written to reports/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# emulated forward + backward (train) on one ResNet-sized layer, timed without its trace arrays
KERNEL_CASE = """
import numpy as np
import bnprobe
WARMUP = True
x = np.random.default_rng(0).standard_normal((32, 64, 56, 56)).astype(np.float32)
dy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
def work():
    f = bnprobe.forward_train(x, None, None, np.zeros(64), np.ones(64), policy="{policy}", keep_arrays=False)
    bnprobe.backward(dy, x, None, f.mean, f.invstd, policy="{policy}", keep_arrays=False)
"""

# Each case: (name, code run in a subprocess; it must set `work()`; setup is not timed).
CASES: dict[str, str] = {
    # ---- rsqrt analysis (issue: exhaustive fp16/bf16 < 1 s; fp32 reduced+sampled < 2 min, < 2 GB)
    "rsqrt fp16 exhaustive (magic, 0-2 steps)": """
from bnprobe.checks.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "fp16", "magic"), (0, 1, 2))
""",
    "rsqrt bf16 exhaustive (magic, 0-2 steps)": """
from bnprobe.checks.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "bf16", "magic"), (0, 1, 2))
""",
    "rsqrt fp32 reduced + 2^20 samples (magic, 0-2 steps)": """
from bnprobe.checks.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "fp32", "magic"), (0, 1, 2))
""",
    # ---- kernels: emulated forward + backward vs torch CPU FP32 forward + backward, 32x64x56x56
    "torch fp32 fwd+bwd 32x64x56x56 (peer)": """
import torch
WARMUP = True
torch.manual_seed(0)
x = torch.randn(32, 64, 56, 56, requires_grad=True)
bn = torch.nn.BatchNorm2d(64)
dy = torch.randn_like(x)
def work():
    y = bn(x)
    y.backward(dy)
""",
    **{f"bnprobe {p} fwd+bwd 32x64x56x56": KERNEL_CASE.format(policy=p) for p in ("fp16", "bf16")},
    # ---- the main job's default run (target: peak <= 6x the largest fp32 input + 300 MB = 338 MB)
    "compare-precision default run (ResNet-50 x2 + stress)": """
import tempfile
from bnprobe.cli import main
def work():
    with tempfile.TemporaryDirectory() as d:
        main(["compare-precision", "--out", d + "/r"])
""",
    # ---- start-up (target: bnprobe --help < 0.3 s more than python -c pass)
    "python -c pass (peer)": "SHELL:" + sys.executable + " -c pass",
    "bnprobe --help": "SHELL:" + sys.executable + " -m bnprobe --help",
}
PEERS = {
    "bnprobe fp16 fwd+bwd 32x64x56x56": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    "bnprobe bf16 fwd+bwd 32x64x56x56": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    "bnprobe --help": "python -c pass (peer)",
}
TARGETS = {
    "rsqrt fp16 exhaustive (magic, 0-2 steps)": "< 1 s",
    "rsqrt bf16 exhaustive (magic, 0-2 steps)": "< 1 s",
    "rsqrt fp32 reduced + 2^20 samples (magic, 0-2 steps)": "< 120 s, < 2 GB",
    "bnprobe fp16 fwd+bwd 32x64x56x56": "<= 3x peer",
    "bnprobe bf16 fwd+bwd 32x64x56x56": "<= 3x peer",
    "bnprobe --help": "< peer + 0.3 s",
    "compare-precision default run (ResNet-50 x2 + stress)": "peak <= 338 MB",
}

RUNNER = """
import json, resource, sys, time
{code}
if globals().get("WARMUP"):
    work()  # one untimed call: first-call set-up (allocator, thread pools) is not what is measured
t = time.perf_counter()
work()
dt = time.perf_counter() - t
print(json.dumps({{"seconds": dt, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def run_case(code: str) -> dict[str, float]:
    if code.startswith("SHELL:"):
        t = time.perf_counter()
        subprocess.run(code[6:].split(), check=True, capture_output=True, cwd=ROOT)
        return {"seconds": time.perf_counter() - t, "peak_mb": float("nan")}
    out = subprocess.run([sys.executable, "-c", RUNNER.format(code=code)], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition per case (default: 3)")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names to run")
    args = ap.parse_args()
    reps = 1 if args.quick else 3
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    results: dict[str, dict[str, float]] = {}
    for name, code in CASES.items():
        if wanted and not any(w in name for w in wanted) and not any(
                w in n for n, p in PEERS.items() if p == name for w in wanted):
            continue
        if "torch" in code and not torch_available():
            print(f"skip {name}: torch not installed", file=sys.stderr)
            continue
        runs = [run_case(code) for _ in range(reps)]
        results[name] = {"seconds": statistics.median(r["seconds"] for r in runs),
                         "peak_mb": max(r["peak_mb"] for r in runs)}
        print(f"  {name}: {results[name]['seconds']:.3f} s", file=sys.stderr)

    lines = [f"bnprobe benchmarks, {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; median of {reps}", "",
             "| case | time (s) | peak RSS (MB) | vs peer | target |", "| --- | ---: | ---: | ---: | --- |"]
    for name, r in results.items():
        peer = PEERS.get(name)
        ratio = ""
        if peer in results:
            if name == "bnprobe --help":
                ratio = f"+{r['seconds'] - results[peer]['seconds']:.3f} s"
            else:
                ratio = f"{r['seconds'] / results[peer]['seconds']:.2f}x"
        mem = "" if r["peak_mb"] != r["peak_mb"] else f"{r['peak_mb']:.0f}"
        lines.append(f"| {name} | {r['seconds']:.3f} | {mem} | {ratio} | {TARGETS.get(name, '')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "reports" / "benchmarks.md"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side timings of bnprobe against its peers, run in the same session.

    python benchmarks/run.py [--quick] [--only NAME,...]

Every case runs in a fresh subprocess (so its peak memory is its own) and is
repeated; the median wall time is reported, with the ratio to the peer measured
in the same run.  Cases of tens of milliseconds (the kernels and their torch
peer) time the median of 15 calls in each subprocess, after three untimed ones.
Absolute times vary between machines and runs; the ratios are what to compare.
Results are printed and written to reports/benchmarks.md.
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

# emulated forward + backward (train) on one ResNet-sized layer, timed without its trace arrays (keep=False)
# by the compiled route (jit=1, the default) or the numpy route (jit=0)
KERNEL_CASE = """
import os
os.environ["BNPROBE_JIT"] = "{jit}"
import numpy as np
import ml_dtypes
import bnprobe
REPEAT = {repeat}
WARMUP = 3 if REPEAT > 1 else 1  # a process's first few calls took up to 2x the later ones (the peer's alike)
x = np.random.default_rng(0).standard_normal((32, 64, 56, 56)).astype({dtype})
dy = np.random.default_rng(1).standard_normal(x.shape).astype({dtype})
def work():
    f = bnprobe.forward_train(x, None, None, np.zeros(64), np.ones(64), policy="{policy}",
                              execution=bnprobe.Execution(keep_arrays={keep}))
    bnprobe.backward(dy, x, None, f.mean, f.invstd, policy="{policy}", execution=bnprobe.Execution(keep_arrays={keep}))
"""

# the first call of the compiled kernels in a fresh process with an empty numba cache: what a first run pays
# (compilation), then a second process with the cache filled (loading them)
COLD_CASE = """
import os, tempfile
CACHE = os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="bnprobe-numba-"))
import numpy as np
import bnprobe
x = np.random.default_rng(0).standard_normal((4, 8, 5, 5)).astype(np.float32)
def work():
    for policy in {policies}:
        ex = bnprobe.Execution(keep_arrays=False)
        f = bnprobe.forward_train(x, None, None, np.zeros(8), np.ones(8), policy=policy, execution=ex)
        bnprobe.backward(x, x, None, f.mean, f.invstd, policy=policy, execution=ex)
        bnprobe.forward_infer(x, None, None, f.running_mean, f.running_var, policy=policy, execution=ex)
"""

ROUND_CASE = """
import numpy as np
import ml_dtypes
WARMUP = "pychop" not in {setup!r}  # a first call pays for fresh pages; pychop's 23 s is not worth doubling
{setup}
x = np.random.default_rng(0).standard_normal(25_000_000).astype(np.float32)
def work():
    {call}
"""

# Each case: (name, code run in a subprocess; it must set `work()`; setup is not timed).
CASES: dict[str, str] = {
    # ---- rsqrt analysis (issue: exhaustive fp16/bf16 < 1 s; fp32 reduced+sampled < 2 min, < 2 GB)
    "rsqrt fp16 exhaustive (magic, 0-2 steps)": """
from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "fp16", "magic"), (0, 1, 2))
""",
    "rsqrt bf16 exhaustive (magic, 0-2 steps)": """
from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "bf16", "magic"), (0, 1, 2))
""",
    "rsqrt fp32 reduced + 2^20 samples (magic, 0-2 steps)": """
from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze
def work(): analyze(MathSpec("rsqrt", "fp32", "magic"), (0, 1, 2))
""",
    # ---- kernels: emulated forward + backward vs torch CPU FP32 forward + backward, 32x64x56x56
    "torch fp32 fwd+bwd 32x64x56x56 (peer)": """
import torch
WARMUP = 3
REPEAT = 15
torch.manual_seed(0)
x = torch.randn(32, 64, 56, 56, requires_grad=True)
bn = torch.nn.BatchNorm2d(64)
dy = torch.randn_like(x)
def work():
    y = bn(x)
    y.backward(dy)
""",
    **{f"bnprobe {p} fwd+bwd 32x64x56x56": KERNEL_CASE.format(policy=p, dtype="np.float32", jit=1, keep=False,
                                                              repeat=15) for p in ("fp16", "bf16")},
    # the same with the tensors already in the 16-bit format, as a model's activations are
    **{f"bnprobe {p} fwd+bwd 32x64x56x56, {p} tensors": KERNEL_CASE.format(policy=p, dtype=d, jit=1, keep=False,
                                                                          repeat=15)
       for p, d in (("fp16", "np.float16"), ("bf16", "ml_dtypes.bfloat16"))},
    # the numpy route (BNPROBE_JIT=0), and the full trace arrays kept (the float64 route, no target)
    **{f"bnprobe {p} fwd+bwd 32x64x56x56, numpy route": KERNEL_CASE.format(policy=p, dtype="np.float32", jit=0,
                                                                           keep=False, repeat=3)
       for p in ("fp16", "bf16")},
    **{f"bnprobe {p} fwd+bwd 32x64x56x56, trace arrays kept": KERNEL_CASE.format(
        policy=p, dtype="np.float32", jit=1, keep=True, repeat=1) for p in ("fp16", "bf16")},
    # compilation: the presets' fast kernels, then the general ones (every pass of a 16-bit-arithmetic port)
    "compiled kernels cold, fp32/fp16/bf16 presets (empty numba cache)": "COLD:" + COLD_CASE.format(
        policies=("fp32", "fp16", "bf16")),
    "compiled kernels cold, general kernels (fp16-acc16, bf16 saturate)": "COLD:" + COLD_CASE.format(
        policies=("fp16-acc16", "bf16:overflow=saturate")),
    # ---- the main job's default run (target: peak <= 6x the largest fp32 input + 300 MB = 338 MB)
    "compare-precision default run (ResNet-50 x2 + stress)": """
import tempfile
from bnprobe.cli import main
def work():
    with tempfile.TemporaryDirectory() as d:
        main(["compare-precision", "--out", d + "/r"])
""",
    "compare-precision default run, numpy route (BNPROBE_JIT=0)": """
import os, tempfile
os.environ["BNPROBE_JIT"] = "0"
from bnprobe.cli import main
def work():
    with tempfile.TemporaryDirectory() as d:
        main(["compare-precision", "--out", d + "/r"])
""",
    # ---- rounding 25M float32 values (target: within 1.5x of astype for nearest-even, faster than pychop)
    **{f"round 25M f32 -> {f}: astype (peer)": ROUND_CASE.format(setup="", call=f"x.astype({dt})")
       for f, dt in (("fp16", "np.float16"), ("bf16", "ml_dtypes.bfloat16"))},
    **{f"round 25M f32 -> {f}: bnprobe round_to(dtype={f})": ROUND_CASE.format(
        setup="from bnprobe.numerics.rounding import round_to", call=f"round_to(x, '{f}', dtype={dt})")
       for f, dt in (("fp16", "np.float16"), ("bf16", "ml_dtypes.bfloat16"))},
    # the same values in wider carriers (what the kernels compute on), for comparison
    **{f"round 25M f32 -> {f}: bnprobe round_to(dtype=float32)": ROUND_CASE.format(
        setup="from bnprobe.numerics.rounding import round_to", call=f"round_to(x, '{f}', dtype=np.float32)")
       for f in ("fp16", "bf16")},
    **{f"round 25M f32 -> {f}: bnprobe round_to (float64, the default)": ROUND_CASE.format(
        setup="from bnprobe.numerics.rounding import round_to", call=f"round_to(x, '{f}')") for f in ("fp16", "bf16")},
    **{f"round 25M f32 -> {f}: pychop (peer)": ROUND_CASE.format(
        setup=f"from pychop import Chop\nchop = Chop({e}, {m}, rmode=1)", call="chop(x)")
       for f, e, m in (("fp16", 5, 10), ("bf16", 8, 7))},
    # ---- an fp16 forward, every operation rounded: bnprobe's kernel vs the same formula with pychop
    "fp16 forward 8x64x28x28: pychop, rounding after each vectorised op (peer)": """
import numpy as np
from pychop import Chop
c = Chop(5, 10, rmode=1)
x = np.random.default_rng(0).standard_normal((8, 64, 28, 28))
ax, r = (0, 2, 3), 8 * 28 * 28
def work():
    xs = c(x)
    mean = c(c(xs.sum(axis=ax, keepdims=True)) / r)
    d = c(xs - mean)
    var = c(c(c(d * d).sum(axis=ax, keepdims=True)) / r)
    rstd = c(1.0 / c(np.sqrt(c(var + 1e-5))))
    y = c(c(d * rstd) * 1.0 + 0.0)
""",
    "fp16 forward 8x64x28x28: bnprobe fp16-acc16": """
import numpy as np
import bnprobe
x = np.random.default_rng(0).standard_normal((8, 64, 28, 28))
def work():
    bnprobe.forward_train(x, policy="fp16-acc16", execution=bnprobe.Execution(keep_arrays=False))
""",
    # ---- start-up (target: bnprobe --help < 0.3 s more than python -c pass)
    "python -c pass (peer)": "SHELL:" + sys.executable + " -c pass",
    "bnprobe --help": "SHELL:" + sys.executable + " -m bnprobe --help",
}
PEERS = {
    "bnprobe fp16 fwd+bwd 32x64x56x56": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    "bnprobe bf16 fwd+bwd 32x64x56x56": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    "bnprobe fp16 fwd+bwd 32x64x56x56, fp16 tensors": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    "bnprobe bf16 fwd+bwd 32x64x56x56, bf16 tensors": "torch fp32 fwd+bwd 32x64x56x56 (peer)",
    **{f"bnprobe {p} fwd+bwd 32x64x56x56, {v}": "torch fp32 fwd+bwd 32x64x56x56 (peer)"
       for p in ("fp16", "bf16") for v in ("numpy route", "trace arrays kept")},
    "compare-precision default run, numpy route (BNPROBE_JIT=0)":
        "compare-precision default run (ResNet-50 x2 + stress)",
    "bnprobe --help": "python -c pass (peer)",
    **{f"round 25M f32 -> {f}: bnprobe round_to{v}": f"round 25M f32 -> {f}: astype (peer)"
       for f in ("fp16", "bf16") for v in (f"(dtype={f})", "(dtype=float32)", " (float64, the default)")},
    "round 25M f32 -> fp16: pychop (peer)": "round 25M f32 -> fp16: bnprobe round_to(dtype=fp16)",
    "round 25M f32 -> bf16: pychop (peer)": "round 25M f32 -> bf16: bnprobe round_to(dtype=bf16)",
    "fp16 forward 8x64x28x28: bnprobe fp16-acc16":
        "fp16 forward 8x64x28x28: pychop, rounding after each vectorised op (peer)",
}
# cases slow enough that one repetition tells the story
SLOW = ("pychop", "rsqrt fp32", "compare-precision", "cold")
TARGETS = {
    "rsqrt fp16 exhaustive (magic, 0-2 steps)": "< 1 s",
    "rsqrt bf16 exhaustive (magic, 0-2 steps)": "< 1 s",
    "rsqrt fp32 reduced + 2^20 samples (magic, 0-2 steps)": "< 120 s, < 2 GB",
    "bnprobe fp16 fwd+bwd 32x64x56x56": "<= 2x peer",
    "bnprobe bf16 fwd+bwd 32x64x56x56": "<= 2x peer",
    "bnprobe fp16 fwd+bwd 32x64x56x56, fp16 tensors": "<= 2x peer",
    "bnprobe bf16 fwd+bwd 32x64x56x56, bf16 tensors": "<= 2x peer",
    "compare-precision default run, numpy route (BNPROBE_JIT=0)": ">= 3x (the compiled route faster)",
    "bnprobe --help": "< peer + 0.3 s",
    "compare-precision default run (ResNet-50 x2 + stress)": "peak <= 338 MB",
    "round 25M f32 -> fp16: bnprobe round_to(dtype=fp16)": "<= 1.5x astype",
    "round 25M f32 -> bf16: bnprobe round_to(dtype=bf16)": "<= 1.5x astype",
    "round 25M f32 -> fp16: pychop (peer)": "> 1x (bnprobe faster)",
    "round 25M f32 -> bf16: pychop (peer)": "> 1x (bnprobe faster)",
    "fp16 forward 8x64x28x28: bnprobe fp16-acc16": "< 1x (bnprobe faster)",
}

RUNNER = """
import json, resource, sys, time
{code}
for _ in range(int(globals().get("WARMUP", 0))):
    work()  # untimed calls: first-call set-up (allocator, thread pools) is not what is measured
times = []
for _ in range(globals().get("REPEAT", 1)):  # cases of tens of milliseconds: the median of several calls
    t = time.perf_counter()
    work()
    times.append(time.perf_counter() - t)
dt = sorted(times)[len(times) // 2]
print(json.dumps({{"seconds": dt, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def run_case(code: str) -> dict[str, float]:
    if code.startswith("COLD:"):  # no warm-up: the first call is the case; the cache directory is removed after
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="bnprobe-numba-")
        try:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, "-c", RUNNER.format(code=code[5:])], check=True,
                                 capture_output=True, text=True, cwd=ROOT, env=env)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    if code.startswith("SHELL:"):
        t = time.perf_counter()
        subprocess.run(code[6:].split(), check=True, capture_output=True, cwd=ROOT)
        return {"seconds": time.perf_counter() - t, "peak_mb": float("nan")}
    out = subprocess.run([sys.executable, "-c", RUNNER.format(code=code)], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def module_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def torch_available() -> bool:
    return module_available("torch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition per case (default: 3)")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings of case names to run (the table is printed, not written)")
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
        if "pychop" in code and not module_available("pychop"):
            print(f"skip {name}: pychop not installed (pip install 'bnprobe[bench]')", file=sys.stderr)
            continue
        runs = [run_case(code) for _ in range(1 if any(k in name for k in SLOW) else reps)]
        results[name] = {"seconds": statistics.median(r["seconds"] for r in runs),
                         "peak_mb": max(r["peak_mb"] for r in runs)}
        print(f"  {name}: {results[name]['seconds']:.3f} s", file=sys.stderr)

    lines = [f"bnprobe benchmarks, {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; median of {reps}", "",
             "| case | time (s) | peak RSS (MB) | time / peer | target |", "| --- | ---: | ---: | ---: | --- |"]
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
    if wanted:  # a partial run does not replace the full report
        return 0
    out = ROOT / "reports" / "benchmarks.md"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

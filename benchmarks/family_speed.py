"""Issue 55's speed target: bnprobe's emulated fp16/bf16 LayerNorm and RMSNorm, forward and backward, against
PyTorch's CPU fp32 kernels on the same shape, in one run.

    python benchmarks/family_speed.py [--scale 8] [--rounds 2] [--fresh-cache]

For x of (8, 2048, 4096) (``--scale k``: the batch divided by k), times PyTorch's F.layer_norm and F.rms_norm on fp32
tensors (forward, then backward through autograd) and bnprobe.kernels.norms' forward and backward under the fp16 and
bf16 presets (x, dy in their format, γ and β in fp32, traces counted but keeping no arrays: keep_arrays=False, as
compare-precision runs them), and prints each time and the ratio emulated / torch against the target of 2.  The
first emulated call of a process loads numba's compiled kernels from its cache, or compiles them (``--fresh-cache``:
into a new cache directory, so that the first call includes the compilation); it is reported apart, then the warm
rounds' best.  The machine's load shows in the figures: ``uptime`` first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

TARGET = 2.0
SHAPE = (8, 2048, 4096)


def _timed(f):
    t0 = time.perf_counter()
    out = f()
    return time.perf_counter() - t0, out


def torch_times(norm: str, shape: tuple[int, ...], rounds: int) -> tuple[float, float]:
    """The best of ``rounds`` (forward, backward) times of PyTorch's fp32 CPU kernel (after one warm-up)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, requires_grad=True)
    dy = torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g, requires_grad=True)
    b = torch.randn(shape[-1], generator=g, requires_grad=True)
    best = [float("inf"), float("inf")]
    for _ in range(rounds + 1):
        x.grad = w.grad = b.grad = None
        if norm == "layer":
            tf, y = _timed(lambda: F.layer_norm(x, (shape[-1],), w, b))
        else:
            tf, y = _timed(lambda: F.rms_norm(x, (shape[-1],), w, eps=1e-5))
        tb, _ = _timed(lambda y=y: y.backward(dy))
        best = [min(best[0], tf), min(best[1], tb)]
    return best[0], best[1]


def emulated_times(norm: str, policy: str, shape: tuple[int, ...], rounds: int) -> tuple[tuple[float, float],
                                                                                           tuple[float, float], str]:
    """((first forward, first backward), (best warm forward, backward)) of bnprobe's emulated kernel, and the route
    the call took."""
    import numpy as np

    from bnprobe.core.formats import get_format
    from bnprobe.kernels.layout import NormShape
    from bnprobe.kernels.norms import backward, forward
    from bnprobe.kernels.norms_compiled import takes_compiled
    from bnprobe.kernels.policy import get_policy

    rng = np.random.default_rng(0)
    dt = get_format(policy).dtype
    x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    dy = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    g = rng.standard_normal(shape[-1])
    b = rng.standard_normal(shape[-1]) if norm == "layer" else None
    sh = NormShape.of(norm, shape)
    route = "compiled" if takes_compiled(get_policy(policy), norm, x.size, shape[-1], False) else "numpy"
    times = []
    for _ in range(rounds + 1):
        tf, f = _timed(lambda: forward(x, g, b, shape=sh, policy=policy, keep_arrays=False))
        tb, _ = _timed(lambda f=f: backward(dy, x, g, f.mean, f.rstd, shape=sh, policy=policy, keep_arrays=False))
        times.append((tf, tb))
    warm = times[1:] or times
    return times[0], (min(t[0] for t in warm), min(t[1] for t in warm)), route


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=1, help="divide the batch (8) by this: 8 runs (1, 2048, 4096)")
    ap.add_argument("--rounds", type=int, default=2, help="warm rounds of each kernel (the best is reported)")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="compile numba's kernels into a new cache directory (the first call includes compiling)")
    args = ap.parse_args(argv)
    if args.scale < 1 or SHAPE[0] % args.scale:
        ap.error("--scale must divide 8")
    if args.fresh_cache:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bnprobe-numba-")
    shape = (SHAPE[0] // args.scale,) + SHAPE[1:]
    print(f"shape {shape}, {args.rounds} warm round(s); load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores (a shared machine: the figures move with it)")
    print(f"{'layer':8} {'kernel':22} {'forward':>9} {'backward':>9} {'total':>9} {'ratio':>7}")
    worst = 0.0
    for norm, name in (("layer", "F.layer_norm"), ("rms", "F.rms_norm")):
        tf, tb = torch_times(norm, shape, args.rounds)
        base = tf + tb
        print(f"{norm:8} {'torch fp32 ' + name:22} {tf:9.3f} {tb:9.3f} {base:9.3f} {'':>7}")
        for policy in ("fp16", "bf16"):
            first, warm, route = emulated_times(norm, policy, shape, args.rounds)
            ratio = sum(warm) / base
            worst = max(worst, ratio)
            print(f"{norm:8} {f'emulated {policy} first':22} {first[0]:9.3f} {first[1]:9.3f} {sum(first):9.3f} "
                  f"{sum(first) / base:7.2f}")
            print(f"{norm:8} {f'emulated {policy} warm':22} {warm[0]:9.3f} {warm[1]:9.3f} {sum(warm):9.3f} "
                  f"{ratio:7.2f}  ({route} route)")
    verdict = "met" if worst <= TARGET else "not met"
    print(f"target: emulated warm within {TARGET:g}x torch fp32 — worst ratio {worst:.2f}: {verdict}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

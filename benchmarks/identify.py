"""identify on a kernel whose calls are (8, 64, 28, 28): the whole identification (designed probes, the search, the
fresh inputs and the confirmation on an input of that shape) as a ratio to one forward + backward of the same
kernel on that input, measured side by side in this process.

    python benchmarks/identify.py [--adapters torch,ascend-bnv3] [--dtype fp16] [--shape 8,64,28,28] [--repeat 3]

Target (issue 30): identify within 2 minutes on this 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fwd_bwd(adapter, x, dtype: str) -> float:
    """Seconds of one training forward and its backward of ``adapter`` on x (γ = 1, β = 0, running statistics)."""
    import numpy as np

    from bnprobe.adapters import BNCall

    c = x.shape[1]
    dy = np.random.default_rng(1).standard_normal(x.shape)
    call = BNCall(x, np.ones(c), np.zeros(c), np.zeros(c), np.ones(c), dy, dtype=dtype)
    t = time.perf_counter()
    out = adapter.train(call)
    adapter.backward_of(call, out.saved)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default="torch,ascend-bnv3")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--shape", default="8,64,28,28")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from bnprobe.adapters import get_adapter
    from bnprobe.adapters.base import counters_only
    from bnprobe.checks.identify.search import identify
    from bnprobe.inputs import make_input, parse_shape

    shape = parse_shape(args.shape)
    x = make_input(shape, mean=2.0, std=3.0, seed=0)
    print(f"identify on {args.dtype} kernels, confirmed on an input of shape {shape}; {args.repeat} runs each")
    print(f"{'adapter':<14} {'fwd+bwd (s)':>12} {'identify (s)':>13} {'ratio':>8} {'evaluations':>12}  result")
    for name in args.adapters.split(","):
        a = counters_only(get_adapter(name))
        fwd_bwd(a, x, args.dtype)  # (warm: imports, caches)
        base = statistics.median(fwd_bwd(a, x, args.dtype) for _ in range(args.repeat))
        times, res = [], None
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = identify(a, args.dtype, x=x)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        verdict = f"bit for bit: {res.spec}" if res.reproduced else f"departs at {res.departs}: {res.spec}"
        print(f"{name:<14} {base:>12.3f} {med:>13.2f} {med / base:>8.0f} {res.evaluations:>12}  {verdict}")


if __name__ == "__main__":
    main()

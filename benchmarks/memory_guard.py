"""The memory guard on this machine: the largest input each command accepts, and the peak memory measured for it.

    python benchmarks/memory_guard.py [--measure trace,overflow,...] [--limit SIZE]

For every guarded command, the largest batch N of an (N, 64, 56, 56) input the guard accepts under the limit (the
memory available, or --limit), the guard's estimate for it, and — for the commands named by --measure — the peak
resident memory of a real run at that shape, measured by the kernel (``getrusage`` of a child process), and its wall
time.  The measured peak must stay under the limit: that is what makes the refusal honest.  Runs of minutes each at
the full shape; --measure '' prints the estimates alone.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time

from bnprobe.guard import PER_ELEMENT, format_size, memory_limit, parse_size, run_bytes, set_memory_limit

ARGS = {  # each command's options for a generated input of the shape (stress and budget off: one case)
    "trace": ["--mode", "backward"],
    "overflow": ["--mode", "backward"],
    "compare-precision": ["--no-stress", "--no-budget", "--format", "csv", "--dtypes", "fp16", "--out", "{tmp}/c"],
    "gradcheck": [],
    "dump": ["--adapter", "emulated:fp16", "--out", "{tmp}/d"],
    "shrink": ["--adapter", "emulated:fp16:variance=naive", "--mean", "100", "--seconds", "60", "--out", "{tmp}/s"],
}
SPATIAL = (64, 56, 56)


def largest_batch(command: str, limit: int) -> int:
    """The largest N with run_bytes(command, N*64*56*56) within the limit."""
    per = math.prod(SPATIAL)
    return max(0, (limit - run_bytes(command, 0)) // (PER_ELEMENT[command] * per))


_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'bnprobe', *sys.argv[1:]], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
            "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
            "print(r.stderr.strip()[-300:])")


def measure(command: str, shape: tuple[int, ...], limit: int) -> tuple[int, float]:
    """Peak resident bytes and seconds of ``bnprobe command --shape shape``, in a wrapper process of its own (the
    kernel's maximum over that wrapper's children is this run's alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [a.replace("{tmp}", tmp) for a in ARGS[command]]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", _WRAPPER, "--max-memory", str(limit), command, "--shape",
                            ",".join(map(str, shape)), *argv],
                           capture_output=True, text=True, check=True)
        seconds = time.monotonic() - t0
    first, _, err = r.stdout.partition("\n")
    code, peak = (int(v) for v in first.split())
    if code not in (0, 1):
        raise SystemExit(f"{command} {shape} exited {code}: {err.strip()}")
    return peak, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", default="trace,overflow", help="Commands to run at their largest accepted shape.")
    ap.add_argument("--limit", default=None, help="Memory limit (default: what is available).")
    args = ap.parse_args()
    if args.limit:
        set_memory_limit(parse_size(args.limit))
    limit, source = memory_limit()
    print(f"limit: {format_size(limit)} ({source}); input (N, {', '.join(map(str, SPATIAL))})")
    print(f"{'command':<18} {'largest shape':<22} {'values':>12} {'estimate':>10} {'measured':>10} {'seconds':>8}")
    wanted = [c for c in args.measure.split(",") if c]
    for command in ARGS:
        n = largest_batch(command, limit)
        shape = (n, *SPATIAL)
        est = run_bytes(command, math.prod(shape))
        peak, secs = "", ""
        if command in wanted and n > 0:
            p, s = measure(command, shape, limit)  # the same limit as here, whatever frees up meanwhile
            peak, secs = format_size(p), f"{s:.0f}"
            if p > limit:
                peak += " (!! over the limit)"
        print(f"{command:<18} {str(shape):<22} {math.prod(shape):>12,} {format_size(est):>10} {peak:>10} {secs:>8}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

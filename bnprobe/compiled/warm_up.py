"""The warm-up: compile the compiled route's kernels into numba's cache in the background, so that no run waits.

``python -m bnprobe.compiled.warm_up`` (started by :func:`bnprobe.compiled.jit.start_warm_up` on a run's first
large call while the kernels are cold) runs bnprobe's own commands on small generated inputs with every call on the
compiled route (``BNPROBE_JIT=1``), each in its own process at the lowest priority: what a command's passes compile
on a large input (the same kernels, on the same dtypes and layouts) is compiled here, a kernel added to a pass
later included, without a list of kernels or signatures to keep.  Then it writes the ready mark
(:func:`bnprobe.compiled.jit.warm_up_paths`) and removes its lock.  A run whose input reaches a signature the
warm-up did not compile compiles that one on first use, as numba does by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bnprobe.compiled.jit import JIT_ENV, python_of_this_package, warm_up_paths, write_state

__all__ = ["WORKLOAD", "warm_up"]

# a small call: every pass runs, in a fraction of a second once compiled
_SHAPE = "4,8,6,6"
_FAMILY_SHAPE = "4,6,32"

# (the dump's name, `bnprobe dump`'s options): a model.half() / model.bfloat16() layer (16-bit parameters, as a
# capture of such a model records), mixed precision (fp32 parameters), and fp32
_DUMPS = (
    ("fp16-same", ["--dtype", "fp16", "--params", "same"]),
    ("bf16-same", ["--dtype", "bf16", "--params", "same"]),
    ("fp16", ["--dtype", "fp16"]),
    ("bf16", ["--dtype", "bf16"]),
    ("fp32", ["--dtype", "fp32"]),
    ("layer-fp16", ["--dtype", "fp16", "--norm", "layer", "--shape", _FAMILY_SHAPE]),
    ("rms-bf16", ["--dtype", "bf16", "--norm", "rms", "--shape", _FAMILY_SHAPE]),
)
# the commands run on each dump ({dump}: its folder), then once on the built-in kernels
_ON_DUMP = (
    ["compare-precision", "--adapters", "dump:{dump}"],
    ["doctor", "--adapter", "dump:{dump}"],
    ["overflow", "--adapter", "dump:{dump}"],
    ["gradcheck", "--adapter", "dump:{dump}"],
)
_BUILT_IN = (["compare-precision", "--shape", _SHAPE, "--dtypes", "fp16,bf16,fp32", "--no-stress"],)


def _workload(root: Path) -> list[list[str]]:
    """The commands of the warm-up, in order (each a `bnprobe` argument list), writing under ``root``."""
    runs: list[list[str]] = []
    for name, opts in _DUMPS:
        dump = root / name
        shape = [] if "--shape" in opts else ["--shape", _SHAPE]
        runs.append(["dump", "--adapter", "emulated", *opts, *shape, "--out", str(dump), "--force"])
        family = "--norm" in opts
        for cmd in _ON_DUMP[:1] if family else _ON_DUMP:
            runs.append([a.format(dump=dump) for a in cmd])
    runs.extend(list(c) for c in _BUILT_IN)
    for i, args in enumerate(runs):
        if args[0] != "dump":
            args += ["--out", str(root / f"report-{i}"), "--force"]
    return runs


#: the warm-up's commands, as run in a folder ROOT
WORKLOAD = _workload(Path("ROOT"))


def warm_up(log: object = sys.stdout, ready: Path | None = None) -> bool:
    """Run the warm-up's commands (see the module notes); True when each ran (a check's failure, exit status 1,
    included: the kernels ran), and then the ready mark (default :func:`bnprobe.compiled.jit.warm_up_paths`'s)
    is written."""
    ready = ready or warm_up_paths()[0]
    env = {**os.environ, JIT_ENV: "1"}
    ok = True
    with tempfile.TemporaryDirectory(prefix="bnprobe-warm-up-") as tmp:
        for args in _workload(Path(tmp)):
            t0 = time.perf_counter()
            done = subprocess.run([*python_of_this_package(), "bnprobe", *args], env=env, cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            print(f"{time.perf_counter() - t0:6.1f} s  exit {done.returncode}  bnprobe {' '.join(args)}", file=log,
                  flush=True)
            if done.returncode > 1:
                ok = False
                print(done.stderr[-2000:], file=log, flush=True)
    if ok:
        ready.parent.mkdir(parents=True, exist_ok=True)
        write_state(ready, time.strftime("%Y-%m-%d %H:%M:%S\n"))
    return ok


def main() -> int:
    """``python -m bnprobe.compiled.warm_up [LOCK]``: the lock its starter took (default: these sources'), removed
    at the end; the ready mark beside it."""
    lock = Path(sys.argv[1]) if len(sys.argv) > 1 else warm_up_paths()[1]
    try:
        os.nice(19)  # the lowest priority: the run that started it comes first
    except (OSError, AttributeError):
        pass
    try:
        return 0 if warm_up(ready=lock.with_suffix(".ready")) else 1
    finally:
        lock.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())

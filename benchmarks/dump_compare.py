"""A model's msprobe dump compared: bnprobe against msprobe's own compare and against the golden, side by side.

    python benchmarks/dump_compare.py [--model six|resnet50] [--batch 32] [--size 48] [--repeats 3] [--keep DIR]
    python benchmarks/dump_compare.py --model resnet50 --batch 8        # the 100-call case (53 forward + 53 backward)

Makes the dumps itself with mindstudio-probe (msprobe's PrecisionDebugger, task "tensor", level L1, through
tests/msprobe_dumps.py's ``dump_all``): one training step of the network in model.half() and the same step (the
same weights and inputs) in float32.  Then runs, alternating, each in its own process (its peak by getrusage of
that child):

- msprobe's compare of the fp16 dump against the fp32 one, as its users run it:
  ``msprobe compare -tp FP16_DUMP/step0 -gp FP32_DUMP/step0 -o OUT``;
- ``bnprobe compare-precision --adapters dump:FP16_DUMP --no-budget`` (warm: the numba cache filled by a first,
  untimed run);
- the golden with loading: each BatchNorm call read from the dump (``bnprobe.recordings.open_dump``) and torch's
  float64 forward + backward of it, timed in the process (the issue's measure) and as the process's wall.

Prints the medians, each part's peak, the ratios (bnprobe's wall against msprobe's, against the golden's), the dump
read in GB/s (the BatchNorm calls' tensors on disk over bnprobe's wall) and calls per second; writes
reports/benchmarks-dump-compare.md.  ``--dumps DIR`` reuses a folder this script made (``--keep DIR``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "tests" / "msprobe_dumps.py"  # msprobe's PrecisionDebugger driven as the tests drive it


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


# the child that makes the dumps: the model's source comes first (it defines six() or resnet50())
MAKE = '''
import copy, importlib.util, sys
from pathlib import Path
root, model, batch, size, shared = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
spec = importlib.util.spec_from_file_location("bnprobe_msprobe_dumps", shared)
ms = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ms
spec.loader.exec_module(ms)
torch.manual_seed(0)
base = six() if model == "six" else resnet50()
x = torch.randn(batch, 3, size, size)


class OneInput(torch.nn.Module):
    """dump_all calls model(x, v): the network takes x alone."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, v):
        return self.m(x)


jobs = []
for dtype in ("fp16", "fp32"):
    m = copy.deepcopy(base)
    m = (m.half() if dtype == "fp16" else m.float()).train()
    jobs.append((ms.Spec(dtype, "L1", "tensor", dtype, "train"), OneInput(m), x.to(next(m.parameters()).dtype),
                 None, None))
ms.dump_all(root, jobs, lambda out, weights: out.float().pow(2).mean())
'''

GOLDEN = '''
import sys, time
t0 = time.perf_counter()
import numpy as np, torch
from bnprobe.recordings import open_dump
t1 = time.perf_counter()
as64 = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))
n = values = 0
for ref in open_dump(sys.argv[1]).calls:
    c = ref.load().call()
    x = as64(c.x).requires_grad_()
    g, b = as64(c.gamma).requires_grad_(), as64(c.beta).requires_grad_()
    y = torch.nn.functional.batch_norm(x, as64(c.running_mean), as64(c.running_var), g, b, c.training,
                                       c.momentum or 0.0, c.eps)
    y.backward(as64(c.dy))
    n, values = n + 1, values + int(np.size(c.x))
print(time.perf_counter() - t1, t1 - t0, n, values)
'''


def _run(args: list[str]) -> tuple[float, float, float, str]:
    """Wall time, CPU time, peak RSS (MB) and output of a child (resnet50_dump.run_child)."""
    return _bench("resnet50_dump").run_child(args)


def _proc_dir(dump: Path) -> Path:
    """msprobe's folder of one process's step 0 (where its dump.json is)."""
    found = sorted(dump.glob("step0/*/dump.json"))
    if not found:
        raise SystemExit(f"{dump}: no msprobe dump (step0/*/dump.json)")
    return found[0].parent


def _bn_bytes(proc: Path) -> tuple[int, int]:
    """The BatchNorm records' count and the bytes of their tensors on disk (what bnprobe reads)."""
    doc = json.loads((proc / "dump.json").read_text())
    names = [k for k in doc["data"] if re.search(r"\.(batch_norm|native_batch_norm)\.\d+\.(forward|backward)$", k)]
    files = set()

    def walk(v):
        if isinstance(v, dict):
            if isinstance(v.get("data_name"), str):
                files.add(v["data_name"])
            for w in v.values():
                walk(w)
        elif isinstance(v, list):
            for w in v:
                walk(w)

    for k in names:
        walk(doc["data"][k])
    data = proc / "dump_tensor_data"
    return len(names), sum((data / f).stat().st_size for f in files if (data / f).exists())


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="six", choices=("six", "resnet50"))
    ap.add_argument("--batch", type=int, default=None, help="default 32 (six), 8 (resnet50)")
    ap.add_argument("--size", type=int, default=None, help="image side; default 48 (six), 112 (resnet50)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each part, alternating")
    ap.add_argument("--keep", type=Path, default=None, help="keep the dumps and reports in this folder")
    ap.add_argument("--dumps", type=Path, default=None, help="a folder this script made (skips the dumping)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another bnprobe checkout (e.g. main's) run beside this one, alternating, on the same dump")
    ap.add_argument("--skip", default="", help="parts not to run, comma-separated: msprobe,bnprobe,golden")
    a = ap.parse_args()
    batch = a.batch or (32 if a.model == "six" else 8)
    size = a.size or (48 if a.model == "six" else 112)
    src = _bench("dump_scale").SIX if a.model == "six" else _bench("resnet50_dump").MODEL
    root = a.dumps or a.keep or Path(tempfile.mkdtemp(prefix="bnprobe-dump-compare-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.environ.update(env)
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    try:
        if a.dumps is None:
            wall, _, peak, out = _run([sys.executable, "-c", src + MAKE, str(root), a.model, str(batch), str(size),
                                   str(SHARED)])
            print(f"dumped one {a.model} training step at batch {batch}, {size}x{size}, fp16 and fp32, with "
                  f"msprobe: {wall:.1f} s, peak {peak:.0f} MB")
        fp16, fp32 = root / "fp16", root / "fp32"
        proc16, proc32 = _proc_dir(fp16), _proc_dir(fp32)
        records, bn_bytes = _bn_bytes(proc16)
        size16, size32 = _du(fp16), _du(fp32)
        print(f"the fp16 dump: {size16 / 2**20:.0f} MB ({bn_bytes / 2**20:.0f} MB of it the {records} BatchNorm "
              f"records' tensors); the fp32 dump {size32 / 2**20:.0f} MB")
        msprobe = str(Path(sys.executable).with_name("msprobe"))
        parts = {
            "msprobe": [msprobe, "compare", "-tp", str(proc16.parent), "-gp", str(proc32.parent), "-o",
                        str(root / "msprobe-out")],
            "bnprobe": [sys.executable, "-m", "bnprobe.cli", "compare-precision", "--adapters", f"dump:{fp16}",
                        "--no-budget", "--out", str(root / "bnprobe-out"), "--force"],
            "golden": [sys.executable, "-c", GOLDEN, str(fp16)],
        }
        if a.baseline is not None:  # the same command from the other checkout (its folder first on the path)
            parts["baseline"] = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                                 "from bnprobe.cli import main; sys.exit(main())", str(a.baseline.resolve()),
                                 *parts["bnprobe"][3:-3], "--out", str(root / "baseline-out"), "--force"]
        parts = {k: v for k, v in parts.items() if k not in skip}
        for name in ("bnprobe", "baseline"):
            if name in parts:
                _run(parts[name])  # fills the numba cache: the runs timed are warm
        got: dict[str, list[tuple[float, float, float, str]]] = {k: [] for k in parts}
        loads = []
        for i in range(a.repeats):
            for name, cmd in parts.items():
                shutil.rmtree(root / "msprobe-out", ignore_errors=True)
                got[name].append(_run(cmd))
                if name == "msprobe" and not list((root / "msprobe-out").glob("compare_result_*.csv")):
                    raise SystemExit(f"msprobe compare wrote no result:\n{got[name][-1][3][-2000:]}")
            loads.append(_loadavg())
            print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f} s (CPU {v[-1][1]:.2f} s)" for k, v in got.items())
                  + f"; load {loads[-1]}", flush=True)
        med = {k: statistics.median(w for w, _, _, _ in v) for k, v in got.items()}
        cpu = {k: statistics.median(c for _, c, _, _ in v) for k, v in got.items()}
        peak = {k: max(p for _, _, p, _ in v) for k, v in got.items()}
        lines = [f"# A model's msprobe dump compared: {a.model}, batch {batch}, {size}x{size}, fp16 (msprobe 26.2, L1)",
                 "", f"fp16 dump {size16 / 2**20:.0f} MB, {records} BatchNorm records ({bn_bytes / 2**20:.0f} MB); "
                 f"median of {a.repeats}, alternating; load averages {', '.join(loads)}", "",
                 "| part | wall (median) | walls | CPU (median) | peak | figure |",
                 "| --- | --- | --- | --- | --- | --- |"]

        def row(name: str, label: str, figure: str) -> None:
            walls = ", ".join(f"{w:.2f}" for w, _, _, _ in got[name])
            lines.append(f"| {label} | {med[name]:.2f} s | {walls} | {cpu[name]:.2f} s | {peak[name]:.0f} MB "
                         f"| {figure} |")
            print(f"{label}: {med[name]:.2f} s wall (runs {walls}), CPU {cpu[name]:.2f} s, peak {peak[name]:.0f} MB; "
                  f"{figure}")

        gold = None
        if "golden" in got:
            fields = [ln.split() for ln in (o for _, _, _, o in got["golden"])]
            gold = statistics.median(float(f[0]) for f in fields)
            imports = statistics.median(float(f[1]) for f in fields)
            ncalls, values = int(fields[0][2]), int(fields[0][3])
            row("golden", f"golden with loading: the {ncalls} calls read, torch float64 forward + backward",
                f"{gold:.2f} s in the process ({values / 1e6:.1f} M input values; its imports {imports:.2f} s more)")
        if "msprobe" in got:
            row("msprobe", "msprobe compare (fp16 dump against fp32 dump)",
                f"{(size16 + size32) / med['msprobe'] / 1e9:.3f} GB/s of the two dumps read, "
                f"{records / 2 / med['msprobe']:.1f} BatchNorm calls/s (of {records // 2}; it compares every API)")
        if "bnprobe" in got:
            b = med["bnprobe"]
            heads = [re.search(r", ([0-9.]+) s[:;,]", o.splitlines()[0] if o else "") for _, _, _, o in got["bnprobe"]]
            own = [float(m.group(1)) for m in heads if m]
            headline = f"its headline {statistics.median(own):.2f} s; " if own else ""
            figure = (f"{headline}{bn_bytes / b / 1e9:.3f} GB/s of BatchNorm tensors read, {records / 2 / b:.1f} "
                      f"calls/s")
            if "msprobe" in got:
                figure += f"; msprobe's / bnprobe's wall: {med['msprobe'] / b:.2f}x (target >= 3x)"
            if "msprobe" in got:
                figure += f" (CPU: {cpu['msprobe'] / cpu['bnprobe']:.2f}x)"
            if gold:
                figure += f"; bnprobe's wall / the golden's: {b / gold:.1f}x (target <= 6x)"
            row("bnprobe", "bnprobe compare-precision --no-budget (warm)", figure)
        if "baseline" in got:
            row("baseline", f"the same from {a.baseline}", f"this checkout's / its wall: "
                f"{med.get('bnprobe', float('nan')) / med['baseline']:.2f}x, CPU: "
                f"{cpu.get('bnprobe', float('nan')) / cpu['baseline']:.2f}x")
        (ROOT / "reports").mkdir(exist_ok=True)
        out = ROOT / "reports" / f"benchmarks-dump-compare-{a.model}.md"
        out.write_text("\n".join(lines) + "\n")
        print(json.dumps({"written": str(out.relative_to(ROOT))}))
    finally:
        if a.keep is None and a.dumps is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A command's first run on a machine whose numba cache is empty, against its warm run: does the first run wait?

    python benchmarks/cold_start.py [--repeats 2] [--foreground] [--numpy] -- COMMAND [ARGS ...]

e.g. ``-- compare-precision --adapters dump:DIR --no-budget`` (a capture made by ``benchmarks/dump_scale.py
--keep``, or an msprobe dump), or ``-- compare-precision`` (the main job).  Each round, in child processes
(``--out`` and ``--force`` appended): *cold*, the command with an empty ``NUMBA_CACHE_DIR`` (it takes numpy's
route and starts the background warm-up, which runs beside it: the contention is in its time); then, once that
warm-up has finished, *warm*, the same command on the filled cache.  ``--foreground`` adds the first run as numba
does it by itself (``BNPROBE_WARM_UP=foreground``: compiling in the run, on another empty cache), ``--numpy`` the
command on numpy's route alone (``BNPROBE_JIT=0``, no warm-up beside it).  Prints each run's wall time, its peak
(getrusage of the child) and the load average, the ratios to the warm run, and whether the cold run's reports
equal the warm run's byte for byte (the seconds a report states left out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _runner():
    spec = importlib.util.spec_from_file_location("resnet50_dump", ROOT / "benchmarks" / "resnet50_dump.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod._run  # wall time, peak RSS (MB) of the child, and its output


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def _warm_up_files(cache: Path) -> list[Path]:
    folder = cache / "bnprobe"
    return sorted(folder.glob("warm-up-*")) if folder.is_dir() else []


def _wait_for_warm_up(cache: Path, since: float, limit: float = 3600.0) -> float:
    """Seconds from ``since`` until the warm-up in ``cache`` has ended (its lock gone)."""
    while time.perf_counter() - since < limit:
        files = _warm_up_files(cache)
        if files and not any(f.suffix == ".lock" for f in files):
            return time.perf_counter() - since
        time.sleep(1.0)
    raise SystemExit(f"the warm-up in {cache} did not end within {limit:.0f} s")


def _reports(folder: Path) -> dict[str, bytes]:
    """The report files, the seconds a run states blanked (they differ between any two runs)."""
    out = {}
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        if f.suffix == ".json":
            data = re.sub(rb'"seconds": [0-9.]+', b'"seconds": -', data)
        data = re.sub(rb"[0-9]+\.[0-9]+ s\b", b"- s", data)
        out[f.name] = data
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="rounds of cold, warm (and the others)")
    ap.add_argument("--foreground", action="store_true", help="add numba's own first run (compiling in the run)")
    ap.add_argument("--numpy", action="store_true", help="add the command on numpy's route alone")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bnprobe command and its arguments")
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the command after --")
    run = _runner()
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "BNPROBE_JIT", "BNPROBE_WARM_UP")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    tmp = Path(tempfile.mkdtemp(prefix="bnprobe-cold-start-"))
    rows: list[dict] = []

    def once(kind: str, env: dict[str, str], cache: Path | None) -> dict:
        out = tmp / f"report-{kind}-{len(rows)}"
        env = {**base, **env, **({"NUMBA_CACHE_DIR": str(cache)} if cache else {})}
        load = _load()
        os.environ.update(env)  # _run's child inherits this process's environment
        try:
            wall, peak, _ = run([sys.executable, "-m", "bnprobe", *command, "--out", str(out), "--force"])
        finally:
            for k in env:
                if k in base:
                    os.environ[k] = base[k]
                else:
                    os.environ.pop(k, None)
        row = {"run": kind, "wall": round(wall, 2), "peak_mb": round(peak), "load": load, "reports": out}
        rows.append(row)
        print(f"{kind:>10}: {wall:7.1f} s, peak {peak:5.0f} MB (load {load})", flush=True)
        return row

    try:
        for r in range(a.repeats):
            cache = tmp / f"cache-{r}"
            t0 = time.perf_counter()
            cold = once("cold", {}, cache)
            if _warm_up_files(cache):
                warm_up = _wait_for_warm_up(cache, t0)
                print(f"{'warm-up':>10}: ended {warm_up:.0f} s after the cold run started", flush=True)
            else:
                print(f"{'warm-up':>10}: none started (no call large enough for the compiled route)", flush=True)
            warm = once("warm", {}, cache)
            same = _reports(cold["reports"]) == _reports(warm["reports"])
            print(f"{'':>10}  cold / warm {cold['wall'] / warm['wall']:.2f}x; reports cold = warm: {same}", flush=True)
            if a.foreground:
                fg = once("foreground", {"BNPROBE_WARM_UP": "foreground"}, tmp / f"cache-fg-{r}")
                print(f"{'':>10}  foreground / warm {fg['wall'] / warm['wall']:.2f}x; reports = warm: "
                      f"{_reports(fg['reports']) == _reports(warm['reports'])}", flush=True)
            if a.numpy:
                alone = once("numpy", {"BNPROBE_JIT": "0"}, tmp / f"cache-np-{r}")
                print(f"{'':>10}  numpy alone / warm {alone['wall'] / warm['wall']:.2f}x, cold / numpy alone "
                      f"{cold['wall'] / alone['wall']:.2f}x (the warm-up's contention)", flush=True)
        print(json.dumps([{k: v for k, v in row.items() if k != "reports"} for row in rows]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

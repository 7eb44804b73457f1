"""Behaviour corpus of bnprobe's CLI: a fixed list of commands whose output is recorded, so that two checkouts (say
before and after a behaviour-preserving redesign) can be compared byte for byte, with timings and the other
run-to-run noise masked.

    python benchmarks/behaviour_corpus.py run OUTDIR [--only GLOB] [--timeout SECONDS] [--keep]
    python benchmarks/behaviour_corpus.py diff A B [--lines N]
    python benchmarks/behaviour_corpus.py list

Run it from the checkout whose behaviour you record, with PYTHONPATH=that checkout:

    cd /work/wt-corpus && PYTHONPATH=/work/wt-corpus python benchmarks/behaviour_corpus.py run /work/corpus-base
    cd /work/wt-new && PYTHONPATH=/work/wt-new python benchmarks/behaviour_corpus.py run /work/corpus-new
    python benchmarks/behaviour_corpus.py diff /work/corpus-base /work/corpus-new

(A checkout without this file can run this one: the script's own checkout only supplies tests/msprobe_dumps.py,
which imports nothing from bnprobe.)

Every command runs as ``sys.executable -m bnprobe ...`` with the runner's environment, PYTHONPATH included, so the
bnprobe that runs is the one PYTHONPATH finds first (an editable install elsewhere would otherwise win); the runner
prints the bnprobe it found and warns when it is not under PYTHONPATH.  Its environment has every ``BNPROBE_*``
variable removed (entries set their own), ``COLUMNS=200``, ``PYTHONHASHSEED=0``, ``TZ=UTC``, UTF-8 I/O and umask 022;
stdin is empty and stdout/stderr are pipes (so no progress bar is drawn).  Inputs are generated with fixed seeds
(bnprobe's default seed 0 unless the entry gives one).

``run`` makes its fixtures first (in a temporary folder): an x.npy, a forged .npy, a plain file, a layer .npz for
``fold --weights``, a statistics log for ``plot-stats --log`` (numpy only), msprobe 26.x dumps made by
tests/msprobe_dumps.py (torch and mindstudio-probe, in its own process) and per-rank SyncBatchNorm dumps made with
bnprobe.adapters.syncbn.rank_recordings; entries themselves make the bnprobe dumps (``provides``) that later entries
replay (``needs``: copied into their work folder).  Each entry then runs in a fresh work folder (the commands' cwd;
relative paths such as ``--out report`` land there) and OUTDIR/NN-name.txt records, per step: the command line, the
exit status, stdout, stderr, and every file the step wrote or changed in the work folder (its path, mode and
content; .npy/.npz as each array's dtype, shape and SHA-256; .parquet as the CSV pandas reads from it; PNG and other
binary files as their size class only; images embedded in HTML likewise), the files it deleted and the empty
folders it left.  Nothing else is
written to OUTDIR except _run-info.txt (which bnprobe ran, per-entry wall times), which ``diff`` ignores.

Masking (everything else is kept byte for byte; each rule is as narrow as the output it masks):
- the work folder, the fixtures folder, the temporary root and the checkout's own path -> <WORK>, <FIXTURES>,
  <TMP>, <REPO>;
- timings: compare-precision's ", 31.027 s: " and summary.md's "... 1.656 s.", shrink's "in 18 checks, 6.6 s",
  a sweep's "; 3.7 s on ..."; progress-bar lines; JSON/JSONL keys "seconds"; CSV and Markdown-table columns
  "seconds";
- a sweep row's "worker" (host:pid) and "worker_peak_mb" (JSON keys, CSV and Markdown columns);
- report folders named by the time (reports/compare-precision-20261130-091206[-k]/ -> ...-<TIME>/);
- bnprobe-dump.json's "created" time; msprobe's proc<pid> folders (and the padding of a terminal table that holds
  one, whose width follows the pid's length);
- the memory guard's figure of free memory ("more than the 21.3 GiB available memory"; its estimate is kept).

No command had to be left out as non-deterministic: two runs of the same checkout give identical corpora.  Sweeps
run with --workers 1 except one with --workers 2, whose journal (rows appended in completion order) is recorded with
its lines sorted.  ascend-tbe's atomic-add order is seeded, so it repeats.  shrink stops at its time budget
(--seconds, 120 s by default; these runs take a few seconds): only a machine slowed some twentyfold would change what
it finds.  The groups: generated inputs (every command, --json, --out, failing kernels), bnprobe dumps (made by
``dump``, replayed by every command), real msprobe dumps, sweeps (step*/rank* roots, syncbn ranks, --resume) and bad
input (exit 2, one line); ``list`` prints them.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import fnmatch
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # tests/msprobe_dumps.py is found here


# ------------------------------------------------------------------------------------------------- the corpus ---

@dataclass(frozen=True)
class Entry:
    name: str
    group: str
    steps: tuple[tuple[str, ...], ...]  # bnprobe argv of each step, run in order in the same work folder
    needs: tuple[str, ...] = ()  # fixtures copied into the work folder first
    provides: tuple[str, ...] = ()  # paths of the work folder kept as fixtures for later entries
    env: tuple[tuple[str, str], ...] = ()
    unordered: tuple[str, ...] = ()  # globs of files whose lines are recorded sorted (completion order)


def _e(group: str, name: str, *steps: str, needs=(), provides=(), env=None, unordered=()) -> Entry:
    return Entry(name, group, tuple(tuple(shlex.split(s)) for s in steps), tuple(needs), tuple(provides),
                 tuple(sorted((env or {}).items())), tuple(unordered))


SMALL = "--shape 2,8,4,4 --no-stress"
BAD_KERNEL = "emulated:fp16:variance=naive,accumulate=fp16"  # README's port: single-pass variance, fp16 sums
SWEEP_ROOT = (  # 2 steps x 2 ranks of bnprobe dumps; step1/rank1 is the bad kernel's
    "dump --adapter emulated --shape 4,4,4,4 --mean 30 --seed 0 --out sw/step0/rank0",
    "dump --adapter emulated --shape 4,4,4,4 --mean 30 --seed 1 --out sw/step0/rank1",
    "dump --adapter emulated --shape 4,4,4,4 --mean 30 --seed 2 --out sw/step1/rank0",
    f"dump --adapter {BAD_KERNEL} --shape 4,4,4,4 --mean 30 --seed 3 --out sw/step1/rank1",
)

CORPUS: tuple[Entry, ...] = (
    # --- generated inputs ---------------------------------------------------------------------------------------
    _e("generated", "compare-default", "compare-precision"),  # README's first command: reports/compare-precision-<t>
    _e("generated", "compare-small", f"compare-precision {SMALL} --no-budget --out report"),
    _e("generated", "compare-small-numpy-route", f"compare-precision {SMALL} --no-budget --out report",
       env={"BNPROBE_JIT": "0"}),
    _e("generated", "compare-failing-kernels",
       "compare-precision --adapters emulated:fp16-acc16,ascend-tbe,ascend-bnv3 --dtypes fp16 --shape 4,8,6,6 "
       "--mean 100 --no-stress --out report"),
    _e("generated", "compare-bf16-acc16-scaled",
       f"compare-precision --adapters emulated:bf16-acc16 --dtypes bf16 {SMALL} --rule scaled --format csv,json "
       "--out report"),
    _e("generated", "compare-bench-torch",
       f"compare-precision --adapters emulated,torch --dtypes fp16,bf16 --bench torch --mode train {SMALL} "
       "--no-budget --format md --out report"),
    _e("generated", "compare-params-same-backward",
       f"compare-precision --dtypes bf16,fp16 --params same --mode backward {SMALL} --dist student_t --seed 3 "
       "--rule threshold --format json --out report"),
    _e("generated", "compare-input-npy",
       "compare-precision --input x.npy --adapters emulated,ascend-950 --dtypes fp16 --mode infer --no-stress "
       "--out report", needs=("x.npy",)),
    _e("generated", "compare-syncbn",
       "compare-precision --adapters syncbn:ranks=2+14 --dtypes fp32 --shape 16,4,2,2 --no-stress --no-budget "
       "--format csv --out report"),
    _e("generated", "gradcheck-seed-formula", "gradcheck --formula seed"),
    _e("generated", "gradcheck-ascend-formula", "gradcheck --formula ascend --shape 2,3,3,3"),
    _e("generated", "gradcheck-default-json", "gradcheck --json"),
    _e("generated", "gradcheck-bf16-acc16-out", "gradcheck --adapter emulated:bf16-acc16 --dtype bf16 --shape 2,8,4,4 "
       "--out g"),
    _e("generated", "gradcheck-ascend-tbe-tol", "gradcheck --adapter ascend-tbe --dtype fp16 --shape 2,4,3,3 "
       "--rtol 1e-3 --atol 1e-4"),
    _e("generated", "overflow-readme", "overflow --accumulate fp16 --mean 100 --shape 8,4,8,8"),
    _e("generated", "overflow-acc16-json", "overflow --adapter emulated:fp16-acc16 --shape 4,4,8,8 --dist student_t "
       "--std 300 --json"),
    _e("generated", "overflow-tbe-backward-out", "overflow --adapter ascend-tbe --mean 300 --shape 4,8,6,6 "
       "--mode backward --out o"),
    _e("generated", "overflow-torch-outputs", "overflow --adapter torch --dtype fp16 --shape 4,4,4,4 --mean 2000"),
    _e("generated", "overflow-bf16-clean", "overflow --dtype bf16 --shape 2,8,4,4 --params same"),
    _e("generated", "rsqrt-fp16-magic", "rsqrt --format fp16 --method magic --newton 0,1,2"),
    _e("generated", "rsqrt-bf16-reciprocal-table-json", "rsqrt --op reciprocal --format bf16 --method table --bits 6 "
       "--newton 0,1 --json"),
    _e("generated", "rsqrt-fp16-frsqrte-out", "rsqrt --format fp16 --method frsqrte --form arm --newton 0,1 --out rs"),
    _e("generated", "rsqrt-fp32-samples", "rsqrt --format fp32 --method magic --working fp64 --samples 20000 "
       "--newton 0,1,2"),
    _e("generated", "rsqrt-sqrt-exp-log", "rsqrt --op sqrt --format bf16 --method exp_log --newton 0,1 "
       "--subnormals zero"),
    _e("generated", "rsqrt-divide-exact", "rsqrt --op divide --format fp16 --method exact"),
    _e("generated", "fold-default", "fold"),
    _e("generated", "fold-linear-bf16-json", "fold --layer linear --dtype bf16 --json"),
    _e("generated", "fold-tiny-eps-groups-out", "fold --eps 1e-12 --dtype fp16 --groups 4 --out f"),
    _e("generated", "fold-weights-acc16", "fold --weights layer.npz --accumulate fp16", needs=("layer.npz",)),
    _e("generated", "doctor-reference", "doctor"),
    _e("generated", "doctor-ascend-tbe", "doctor --adapter ascend-tbe --dtype fp16"),
    _e("generated", "doctor-acc16-json", "doctor --adapter emulated:fp16-acc16 --json"),
    _e("generated", "doctor-plugin-out", "doctor --adapter examples.plugin_adapter:NumpyFP32BatchNorm --dtype fp32 "
       "--out d"),
    _e("generated", "doctor-input-npy", "doctor --adapter emulated --dtype bf16 --input x.npy --no-stability",
       needs=("x.npy",)),
    _e("generated", "doctor-syncbn-unweighted", "doctor --adapter syncbn:world=2,merge=unweighted --dtype fp32"),
    _e("generated", "shrink-tbe", "shrink --adapter ascend-tbe --mean 100 --shape 4,8,8,8 --out shrunk"),
    _e("generated", "shrink-overflow-default-out", "shrink --adapter emulated:fp16-acc16 --predicate overflow "
       "--mean 100 --shape 4,4,8,8"),
    _e("generated", "trace-readme", "trace --policy fp16-acc16:variance=naive --shape 8,4,8,8 --mean 100"),
    _e("generated", "trace-backward-json", "trace --policy bf16 --mode backward --shape 2,4,3,3 --json"),
    _e("generated", "trace-infer-lanes-channels-last", "trace --policy fp16:variance=welford,order=lanes,lanes=8 "
       "--layout channels_last --shape 2,3,3,4 --mode infer --eps 1e-3"),
    _e("generated", "trace-rsqrt-policy", "trace --policy fp16:rsqrt=frsqrte,rsqrt_newton=2,newton_form=arm "
       "--shape 2,4,4,4 --dist uniform"),
    _e("generated", "trace-input-npy", "trace --input x.npy --policy fp32:order=lanes,lanes=16,kahan=true "
       "--momentum 0.3", needs=("x.npy",)),
    _e("generated", "trace-saturate-constant", "trace --policy fp16-acc16:overflow=saturate --dist constant "
       "--mean 300 --shape 2,2,8,8"),
    _e("generated", "plot-stats-simulate", "plot-stats --steps 5 --channels 2 --out ps"),
    _e("generated", "plot-stats-log", "plot-stats --log stats-log.csv --out ps", needs=("stats-log.csv",)),
    _e("generated", "adapters", "adapters"),
    _e("generated", "adapters-json", "adapters --json"),
    # --- bnprobe dumps: made here, then replayed ---------------------------------------------------------------
    _e("bnprobe-dump", "dump-bad-kernel", f"dump --adapter {BAD_KERNEL} --mean 30 --shape 4,8,6,6 --out bad-kernel",
       provides=("bad-kernel",)),
    _e("bnprobe-dump", "dump-bf16-same-channels-last", "dump --adapter emulated --dtype bf16 --params same "
       "--layout channels_last --shape 4,3,3,8 --seed 2 --out good-dump", provides=("good-dump",)),
    _e("bnprobe-dump", "dump-tbe-train-backward", "dump --adapter ascend-tbe --mean 100 --shape 4,8,6,6 "
       "--modes train,backward --out tbe-dump", provides=("tbe-dump",)),
    _e("bnprobe-dump", "dump-plugin", "dump --adapter examples.plugin_adapter:NumpyFP32BatchNorm --dtype fp32 "
       "--shape 2,4,3,3 --out mine"),
    _e("bnprobe-dump", "dump-sweep-root", *SWEEP_ROOT, provides=("sw",)),
    _e("bnprobe-dump", "compare-dump-bad-and-torch", "compare-precision --adapters dump:bad-kernel,torch --out report",
       needs=("bad-kernel",)),
    _e("bnprobe-dump", "doctor-dump-bad", "doctor --adapter dump:bad-kernel", needs=("bad-kernel",)),
    _e("bnprobe-dump", "overflow-dump-bad-json", "overflow --adapter dump:bad-kernel --json", needs=("bad-kernel",)),
    _e("bnprobe-dump", "gradcheck-dump-bad", "gradcheck --adapter dump:bad-kernel", needs=("bad-kernel",)),
    _e("bnprobe-dump", "trace-dump-bad-backward", "trace --input bad-kernel --mode backward", needs=("bad-kernel",)),
    _e("bnprobe-dump", "shrink-dump-input", "shrink --adapter emulated:fp16-acc16 --input bad-kernel --out shrunk",
       needs=("bad-kernel",)),
    _e("bnprobe-dump", "compare-input-dump", "compare-precision --input bad-kernel --adapters emulated,ascend-tbe "
       "--no-budget --out report", needs=("bad-kernel",)),
    _e("bnprobe-dump", "compare-input-dump-channels-last", "compare-precision --input good-dump --adapters emulated "
       "--no-budget --out report", needs=("good-dump",)),
    _e("bnprobe-dump", "doctor-dump-good-out", "doctor --adapter dump:good-dump --out d", needs=("good-dump",)),
    _e("bnprobe-dump", "compare-dump-tbe", "compare-precision --adapters dump:tbe-dump --out report",
       needs=("tbe-dump",)),
    _e("bnprobe-dump", "overflow-dump-tbe-out", "overflow --adapter dump:tbe-dump --out o", needs=("tbe-dump",)),
    # --- real msprobe 26.x dumps (tests/msprobe_dumps.py) ------------------------------------------------------
    _e("msprobe-dump", "compare-msprobe-fp16", "compare-precision --adapters dump:ms/L1-fp16 --out report",
       needs=("ms",)),
    _e("msprobe-dump", "doctor-msprobe-fp16", "doctor --adapter dump:ms/L1-fp16", needs=("ms",)),
    _e("msprobe-dump", "overflow-msprobe-fp16", "overflow --adapter dump:ms/L1-fp16", needs=("ms",)),
    _e("msprobe-dump", "overflow-msprobe-statistics-json", "overflow --adapter dump:ms/stats-bf16 --json",
       needs=("ms",)),
    _e("msprobe-dump", "gradcheck-msprobe-bf16-native", "gradcheck --adapter dump:ms/L1-bf16 --calls *native*",
       needs=("ms",)),
    _e("msprobe-dump", "trace-msprobe-mix-call", "trace --input ms/mix-fp16 --calls *bn2*", needs=("ms",)),
    _e("msprobe-dump", "compare-msprobe-eval-torch", "compare-precision --adapters dump:ms/eval-fp32,torch "
       "--no-budget --out report", needs=("ms",)),
    _e("msprobe-dump", "doctor-adapter-on-msprobe-inputs", "doctor --adapter ascend-950 --input ms/L1-fp16 "
       "--calls Functional.batch_norm.[01]", needs=("ms",)),
    # --- sweeps ------------------------------------------------------------------------------------------------
    _e("sweep", "sweep-compare", "compare-precision --adapters dump:sw --workers 1 --out sweep", needs=("sw",)),
    _e("sweep", "sweep-doctor-syncbn-unweighted", "doctor --adapter dump:syncbn-root --workers 1 --out sweep",
       needs=("syncbn-root",)),
    _e("sweep", "sweep-overflow-syncbn-chan-2-workers", "overflow --adapter dump:syncbn-chan --workers 2 --out sweep",
       needs=("syncbn-chan",), unordered=("sweep/sweep-journal.jsonl",)),
    _e("sweep", "sweep-doctor-resume", "doctor --adapter dump:sw --workers 1 --out sweep",
       "doctor --adapter dump:sw --workers 1 --out sweep --resume",
       "doctor --adapter dump:sw --workers 1 --out sweep --resume --force",
       "compare-precision --adapters dump:sw --workers 1 --out sweep --resume --force", needs=("sw",)),
    _e("sweep", "plot-stats-dumps", "plot-stats --dumps sw/step0 --out ps", needs=("sw",)),
    _e("sweep", "sweep-one-msprobe-dump", "compare-precision --adapters dump:ms/L1-fp16 --sweep --workers 1 "
       "--no-budget --out sweep", needs=("ms",)),
    # --- bad input: exit 2 with one line -----------------------------------------------------------------------
    _e("bad-input", "bad-memory-available", "trace --shape 1,128,1024,1024"),
    _e("bad-input", "bad-max-memory-option", "--max-memory 2G compare-precision --batch 64"),
    _e("bad-input", "bad-max-memory-env", "overflow", env={"BNPROBE_MAX_MEMORY": "1M"}),
    _e("bad-input", "bad-forged-npy", "trace --input forged.npy", needs=("forged.npy",)),
    _e("bad-input", "bad-out-is-a-file", "overflow --out notes.txt", needs=("notes.txt",)),
    _e("bad-input", "bad-refuse-overwrite-then-force",
       "compare-precision --shape 8,16,14,14 --no-stress --no-budget --format csv --out mine",
       "compare-precision --shape 8,16,14,14 --no-stress --no-budget --format csv --out mine",
       "compare-precision --shape 8,16,14,14 --no-stress --no-budget --format csv --out mine --force"),
    _e("bad-input", "bad-policy-field", "trace --policy fp16:variance=bogus"),
    _e("bad-input", "bad-format-for-adapter", "gradcheck --adapter emulated:bf16-acc16"),
    _e("bad-input", "bad-adapter-name", "compare-precision --adapters nosuch --out report"),
    _e("bad-input", "bad-adapter-options-with-comma",
       "compare-precision --adapters syncbn:ranks=2+14,merge=unweighted --dtypes fp32 --shape 16,4,2,2 --no-stress "
       "--out report"),
    _e("bad-input", "bad-doctor-syncbn-ranks-vs-batch", "doctor --adapter syncbn:ranks=2+14,merge=unweighted "
       "--dtype fp32"),
    _e("bad-input", "bad-plugin-not-an-adapter", "dump --adapter os:abort --out x"),
    _e("bad-input", "bad-shrink-a-dump", "shrink --adapter dump:bad-kernel", needs=("bad-kernel",)),
    _e("bad-input", "bad-doctor-statistics-dump", "doctor --adapter dump:ms/stats-bf16 --out d", needs=("ms",)),
    _e("bad-input", "bad-replay-other-eps", "compare-precision --adapters dump:bad-kernel --eps 1e-3 --out report",
       needs=("bad-kernel",)),
    _e("bad-input", "bad-scheduler-env", "compare-precision --adapters dump:sw --out report", needs=("sw",),
       env={"BNPROBE_SCHEDULER": "nonsense"}),
    _e("bad-input", "bad-rtol-without-atol", "gradcheck --rtol 1e-3"),
    _e("bad-input", "bad-missing-weights", "fold --weights missing.npz"),
    _e("bad-input", "bad-zero-shape", "trace --shape 0,4"),
    _e("bad-input", "bad-newton-steps", "rsqrt --newton 0,99"),
    _e("bad-input", "bad-shrink-seconds", "shrink --adapter ascend-tbe --seconds 0"),
    _e("bad-input", "bad-log-missing", "plot-stats --log missing.csv --out ps"),
)

assert len(CORPUS) < 100, "entries are numbered NN-"

# fixtures made before the entries run (the others come from entries' ``provides``)
SETUP_FIXTURES = ("x.npy", "forged.npy", "notes.txt", "layer.npz", "stats-log.csv", "ms", "syncbn-root",
                  "syncbn-chan")
MSPROBE_DUMPS = ("L1-fp16", "L1-bf16", "mix-fp16", "stats-bf16", "eval-fp32")

SYNCBN_ROOT = """
import inspect
import sys
from pathlib import Path

import numpy as np

try:  # the dump writer's module: bnprobe.recordings since the engine redesign, bnprobe.adapters.dump before it
    from bnprobe.recordings import write_dump
except ImportError:
    from bnprobe.adapters.dump import write_dump
from bnprobe.adapters.syncbn import SyncBNAdapter, rank_recordings
from bnprobe.core.call import BNCall


def ranks_of(adapter, *tensors, dtype):
    # rank_recordings of one call: handed whole (a BNCall) since it takes one, its tensors one by one before
    if "whole" in inspect.signature(rank_recordings).parameters:
        return rank_recordings(adapter, BNCall(*tensors, dtype=dtype))
    return rank_recordings(adapter, *tensors, dtype=dtype)


root, merge = Path(sys.argv[1]), sys.argv[2]
ranks = (2, 14)
rng = np.random.default_rng(5)
x = rng.standard_normal((sum(ranks), 3, 2, 2)) + np.repeat([0.0, 3.0], ranks)[:, None, None, None]
for s in range(2):
    recs = ranks_of(SyncBNAdapter(ranks, merge=merge), x + s, np.ones(3), np.zeros(3), np.zeros(3), np.ones(3),
                    rng.standard_normal(x.shape), dtype="fp32")
    for r, rec in recs.items():
        write_dump(rec, root / f"step{s}" / f"rank{r}")
"""


def make_fixtures(fix: Path, names: set[str], env: dict[str, str]) -> dict[str, str]:
    """Make the setup fixtures in ``names`` under ``fix``; {name: error} of those that could not be made."""
    import numpy as np

    errors: dict[str, str] = {}
    if "x.npy" in names:
        np.save(fix / "x.npy", (np.random.default_rng(7).standard_normal((4, 8, 5, 5)) * 2 + 3).astype(np.float32))
    if "forged.npy" in names:  # a header declaring 80 GB of float64, and no data
        with open(fix / "forged.npy", "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False,
                                                     "shape": (100000, 100000)})
    if "notes.txt" in names:
        (fix / "notes.txt").write_text("my notes\n")
    if "layer.npz" in names:  # a conv2d + BatchNorm, one near-dead channel (running_var 1e-7)
        rng = np.random.default_rng(11)
        rv = rng.uniform(0.5, 2.0, 8)
        rv[3] = 1e-7
        np.savez(fix / "layer.npz", weight=rng.normal(0, 0.2, (8, 4, 3, 3)), bias=rng.normal(0, 0.1, 8),
                 gamma=rng.uniform(0.5, 1.5, 8), beta=rng.normal(0, 0.1, 8), running_mean=rng.normal(0, 0.5, 8),
                 running_var=rv)
    if "stats-log.csv" in names:
        _stats_log(fix / "stats-log.csv")
    if "ms" in names:
        root = fix / "ms"
        root.mkdir()
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "msprobe_dumps.py"), str(root), *MSPROBE_DUMPS],
                           cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            errors["ms"] = f"tests/msprobe_dumps.py exited {p.returncode}: {p.stderr.strip()[-2000:]}"
    for name, merge in (("syncbn-root", "unweighted"), ("syncbn-chan", "chan")):
        if name in names:
            p = subprocess.run([sys.executable, "-c", SYNCBN_ROOT, str(fix / name), merge], cwd=fix, env=env,
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                errors[name] = f"rank_recordings exited {p.returncode}: {p.stderr.strip()[-2000:]}"
    return errors


def _stats_log(path: Path) -> None:
    """A log of 2 layers x 3 channels x 30 steps whose running statistics follow momentum 0.9 (the 1-m convention
    for PyTorch's 0.1), and whose bn2 channel 2 variance collapses toward eps."""
    import math

    rows = []
    for layer, k in (("bn1", 0), ("bn2", 1)):
        for c in range(3):
            rm, rv = 0.0, 1.0
            for step in range(30):
                mean = 0.5 * c - k + 0.1 * math.sin(0.3 * step + c)
                var = 1.5 + 0.5 * c + 0.2 * math.cos(0.2 * step) if (layer, c) != ("bn2", 2) else 2.0 ** (-step)
                rm, rv = 0.1 * rm + 0.9 * mean, 0.1 * rv + 0.9 * var
                rows.append((step, layer, c, repr(mean), repr(var), repr(rm), repr(rv)))
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(("step", "layer", "channel", "mean", "var", "running_mean", "running_var"))
        w.writerows(rows)


# ---------------------------------------------------------------------------------------------------- masking ---

#: (pattern, replacement) applied to all recorded text, in order.
TEXT_RULES = tuple((re.compile(p), r) for p, r in (
    # compare-precision's headline ", 31.027 s: all pass" and summary.md's intro "... rounding). 1.656 s."
    (r", \d+(?:\.\d+)? s: ", ", <T> s: "),
    (r"(?m)(?<= )\d+(?:\.\d+)? s\.$", "<T> s."),
    # shrink's headline "... in 18 checks, 6.6 s"
    (r"( checks, )\d+(?:\.\d+)? s\b", r"\1<T> s"),
    # a sweep's headline "...; 3.7 s on 1 local worker(s)"
    (r"; \d+(?:\.\d+)? s on ", "; <T> s on "),
    # the progress bar "label [####......]  40.0%     1.2s  eta    1.8s" (drawn on a terminal only)
    (r"\r?[^\r\n]*\[[#.]{30}\] +[\d.]+%  +[\d.naninf]+s  eta +[\d.naninf]+s[^\r\n]*", "<progress>"),
    # report folders named by the time: reports/compare-precision-20261130-091206[-2]
    (r"\b([a-z]+(?:-[a-z]+)*-)\d{8}-\d{6}(?:-\d+)?\b", r"\1<TIME>"),
    # bnprobe-dump.json's creation time
    (r'("created": )"[^"]*"', r'\1"<DATE>"'),
    # msprobe's dump folders are named by the pid of the process that dumped
    (r"\bproc\d+\b", "proc<PID>"),
    # the memory guard's figure of free memory (its estimate of the need is kept)
    (r"(more than the )\d+(?:\.\d+)? [KMGT]?i?B( (?:available memory|memory left in this cgroup|address space left "
     r"under ulimit -v))", r"\1<FREE>\2"),
    # JSON / JSONL: timings, a sweep row's worker (host:pid) and its peak memory
    (r'("seconds": )-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?', r'\1"<T>"'),
    (r'("worker": )"[^"]*"', r'\1"<WORKER>"'),
    (r'("worker_peak_mb": )(?:-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|null|NaN)', r'\1"<MB>"'),
))
#: columns masked in CSV files and Markdown tables
MASKED_COLUMNS = {"seconds": "<T>", "worker": "<WORKER>", "worker_peak_mb": "<MB>"}
IMAGE_DATA = re.compile(r"data:image/(png|jpeg|gif);base64,([A-Za-z0-9+/=]+)")


def size_class(n: int) -> str:
    if n == 0:
        return "empty"
    lo = 1 << (n.bit_length() - 1)
    units = ((1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
    fmt = next(f"{lo // s}-{2 * lo // s} {u}" for s, u in units if lo >= s)
    return f"size class [{fmt})"


class Masker:
    def __init__(self, paths: list[tuple[str, str]]):
        # longest first, so that the work folder (inside the temporary root) is named as such
        self.paths = sorted({(p, r) for p, r in paths if p}, key=lambda pr: -len(pr[0]))

    def text(self, s: str) -> str:
        for p, r in self.paths:
            s = s.replace(p, r)
        for pat, rep in TEXT_RULES:
            s = pat.sub(rep, s)
        return unpad_pid_tables(s)


def unpad_pid_tables(s: str) -> str:
    """A terminal table with a proc<PID> cell is padded to the pid's length, which varies from run to run: in such a
    table (its lines up to a blank line either side) each run of two or more spaces or dashes becomes two."""
    lines = s.split("\n")
    hit = [i for i, line in enumerate(lines) if "proc<PID>" in line and "  " in line]
    for i in hit:
        lo, hi = i, i
        while lo > 0 and lines[lo - 1].strip():
            lo -= 1
        while hi + 1 < len(lines) and lines[hi + 1].strip():
            hi += 1
        for k in range(lo, hi + 1):
            if not lines[k].lstrip().startswith(("|", "===")):  # Markdown tables and file headers are not padded
                lines[k] = re.sub(r"-{2,}", "--", re.sub(r" {2,}", "  ", lines[k]))
    return "\n".join(lines)


def mask_csv(text: str) -> str:
    """Mask MASKED_COLUMNS of a CSV file (re-written by csv.writer when it has one; otherwise unchanged)."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or not (cols := [i for i, h in enumerate(rows[0]) if h in MASKED_COLUMNS]):
        return text
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(rows[0])
    for row in rows[1:]:
        w.writerow([MASKED_COLUMNS[rows[0][i]] if i in cols and i < len(row) else v for i, v in enumerate(row)])
    return out.getvalue()


def mask_markdown_tables(text: str) -> str:
    """Mask MASKED_COLUMNS in Markdown pipe tables (a header row followed by a | --- | row)."""
    lines = text.split("\n")
    cols: dict[int, str] = {}
    for k, line in enumerate(lines):
        if not line.startswith("|"):
            cols = {}
            continue
        cells = re.split(r"(?<!\\)\|", line)
        if k + 1 < len(lines) and re.fullmatch(r"\|(?:\s*:?-+:?\s*\|)+", lines[k + 1].strip()):
            cols = {i: MASKED_COLUMNS[c.strip()] for i, c in enumerate(cells) if c.strip() in MASKED_COLUMNS}
            continue
        if cols and not re.fullmatch(r"\|(?:\s*:?-+:?\s*\|)+", line.strip()):
            lines[k] = "|".join(f" {cols[i]} " if i in cols else c for i, c in enumerate(cells))
    return "\n".join(lines)


def describe_arrays(path: Path) -> list[str]:
    import numpy as np

    def one(name: str, a: np.ndarray) -> str:
        a = np.ascontiguousarray(a)
        digest = hashlib.sha256(a.tobytes()).hexdigest()[:16]
        values = f" values {a.ravel().tolist()}" if a.size <= 8 else ""
        return f"  array {name}: dtype {a.dtype}, shape {list(a.shape)}, sha256 {digest}{values}"

    if path.suffix == ".npy":
        return [one("(npy)", np.load(path, allow_pickle=False))]
    with np.load(path, allow_pickle=False) as z:
        return [one(k, z[k]) for k in sorted(z.files)]


def render_file(path: Path, rel: str, masker: Masker, unordered: bool) -> list[str]:
    data = path.read_bytes()
    head = f"=== file {masker.text(rel)} (mode {path.stat().st_mode & 0o777:o})"
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        try:
            return [head + f": {suffix[1:]}", *describe_arrays(path)]
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            return [head + f": unreadable {suffix[1:]} ({type(exc).__name__}), {size_class(len(data))}"]
    if suffix == ".parquet":
        try:
            import pandas as pd

            df = pd.read_parquet(path)
            dtypes = ", ".join(f"{c}: {t}" for c, t in df.dtypes.astype(str).items())
            body = masker.text(mask_csv(df.to_csv(index=False, lineterminator="\n")))
            return [head + f": parquet, {len(df)} rows; columns {dtypes}; as CSV:", body.rstrip("\n")]
        except Exception as exc:  # noqa: BLE001 - an unreadable parquet is recorded, not fatal
            return [head + f": unreadable parquet ({type(exc).__name__}), {size_class(len(data))}"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        return [head + f": binary, {size_class(len(data))}"]
    text = IMAGE_DATA.sub(lambda m: f"data:image/{m.group(1)};base64,<{size_class(len(m.group(2)) * 3 // 4)}>",
                          text)
    if suffix == ".csv":
        text = mask_csv(text)
    elif suffix == ".md":
        text = mask_markdown_tables(text)
    text = masker.text(text)
    if unordered:
        text = "\n".join(sorted(text.split("\n")))
        head += " [lines sorted: written in completion order]"
    return [head + f": text, {text.count(chr(10))} newline(s)", text]


# ----------------------------------------------------------------------------------------------------- runner ---

def snapshot(root: Path) -> tuple[dict[str, tuple], set[str]]:
    """{relative path: (sha256, inode, mtime)} of every file under root (a file rewritten with the same content
    counts as written), and the relative paths of its folders."""
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        for n in dirnames:
            dirs.add((d / n).relative_to(root).as_posix())
        for n in filenames:
            p = d / n
            st = p.stat()
            files[p.relative_to(root).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_ino,
                                                     st.st_mtime_ns)
    return files, dirs


def command_env(base: dict[str, str], extra: tuple[tuple[str, str], ...]) -> dict[str, str]:
    drop = ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PY_COLORS", "NO_COLOR")
    env = {k: v for k, v in base.items() if not k.startswith("BNPROBE_") and k not in drop}
    env.update(COLUMNS="200", PYTHONHASHSEED="0", PYTHONIOENCODING="utf-8", TZ="UTC", LC_ALL="C.UTF-8",
               LANG="C.UTF-8")
    env.update(dict(extra))
    return env


def run_entry(index: int, entry: Entry, tmp: Path, fix: Path, base_env: dict[str, str], masker_paths, timeout: float,
              missing: dict[str, str]) -> tuple[str, list[int]]:
    work = tmp / "work" / f"{index:02d}-{entry.name}"
    work.mkdir(parents=True)
    masker = Masker([*masker_paths, (str(work), "<WORK>"), (os.path.realpath(work), "<WORK>")])
    env = command_env(base_env, entry.env)
    out = [f"# bnprobe behaviour corpus: {index:02d}-{entry.name} (group {entry.group})"]
    if entry.env:
        out.append("# env: " + " ".join(f"{k}={v}" for k, v in entry.env))
    if entry.needs:
        out.append("# fixtures: " + ", ".join(entry.needs))
    for need in entry.needs:
        src = fix / need
        if need in missing or not src.exists():
            out.append(f"# FIXTURE MISSING: {need}: {missing.get(need, 'not made')}")
            continue
        if src.is_dir():
            shutil.copytree(src, work / need, symlinks=True)
        else:
            shutil.copy2(src, work / need)
    codes = []
    for k, argv in enumerate(entry.steps, 1):
        before, dirs_before = snapshot(work)
        cmd = [sys.executable, "-m", "bnprobe", *argv]
        out += ["", f"## step {k}/{len(entry.steps)}", "$ bnprobe " + shlex.join(argv)]
        try:
            p = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
            code, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            code, stdout, stderr = "TIMEOUT", exc.stdout or b"", exc.stderr or b""
        codes.append(code if isinstance(code, int) else -1)
        after, dirs_after = snapshot(work)
        out.append(f"exit status: {code}")
        for label, data in (("stdout", stdout), ("stderr", stderr)):
            text = masker.text(data.decode("utf-8", errors="backslashreplace"))
            out.append(f"--- {label} ({text.count(chr(10))} newline(s))")
            if text:
                out.append(text.rstrip("\n") if text.endswith("\n") else text + "\n<no newline at end>")
        changed = sorted((r for r in after if before.get(r) != after[r]), key=masker.text)
        deleted = sorted((r for r in before if r not in after), key=masker.text)
        empty = sorted(d for d in dirs_after - dirs_before if not any(f.startswith(d + "/") for f in after))
        out.append(f"--- files written or changed: {len(changed)}")
        for rel in changed:
            unordered = any(fnmatch.fnmatch(rel, g) for g in entry.unordered)
            out += render_file(work / rel, rel, masker, unordered)
        for rel in deleted:
            out.append(f"=== deleted {masker.text(rel)}")
        for rel in empty:
            out.append(f"=== new empty folder {masker.text(rel)}")
    for p in entry.provides:
        if (work / p).is_dir():
            shutil.copytree(work / p, fix / p, symlinks=True)
        elif (work / p).exists():
            shutil.copy2(work / p, fix / p)
        else:
            missing[p] = f"entry {entry.name} did not write it"
    return "\n".join(out) + "\n", codes


def bnprobe_location(env: dict[str, str]) -> str:
    p = subprocess.run([sys.executable, "-c", "import bnprobe, os; print(os.path.dirname(bnprobe.__file__))"],
                       env=env, capture_output=True, text=True, check=True)
    return p.stdout.strip()


def select(only: str | None) -> list[tuple[int, Entry]]:
    """The entries to run (all, or those matching ``only`` plus the entries providing what they need)."""
    numbered = list(enumerate(CORPUS, 1))
    if not only:
        return numbered
    chosen = {i for i, e in numbered if fnmatch.fnmatch(e.name, only) or fnmatch.fnmatch(f"{i:02d}-{e.name}", only)}
    for i, e in numbered:
        if i in chosen:
            for need in e.needs:
                chosen |= {j for j, f in numbered if need in f.provides}
    return [(i, e) for i, e in numbered if i in chosen]


def cmd_run(args: argparse.Namespace) -> int:
    outdir = Path(args.outdir)
    if outdir.exists() and any(outdir.iterdir()):
        print(f"{outdir} exists and is not empty; choose a new folder", file=sys.stderr)
        return 2
    outdir.mkdir(parents=True, exist_ok=True)
    os.umask(0o022)
    base_env = dict(os.environ)
    probe_env = command_env(base_env, ())
    pkg = bnprobe_location(probe_env)
    checkout = os.path.dirname(pkg)
    pythonpath = [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    print(f"bnprobe under test: {pkg}")
    if not any(os.path.realpath(pkg).startswith(os.path.realpath(p) + os.sep) for p in pythonpath):
        print("warning: that bnprobe is not under PYTHONPATH: run with PYTHONPATH=<the checkout you record>",
              file=sys.stderr)
    entries = select(args.only)
    tmp = Path(tempfile.mkdtemp(prefix="bnprobe-corpus-"))
    fix = tmp / "fixtures"
    fix.mkdir()
    paths = [(str(fix), "<FIXTURES>"), (os.path.realpath(fix), "<FIXTURES>"), (str(tmp), "<TMP>"),
             (os.path.realpath(tmp), "<TMP>"), (checkout, "<REPO>"), (os.path.realpath(checkout), "<REPO>")]
    info = [f"bnprobe: {pkg}", f"python: {sys.executable} {sys.version.split()[0]}",
            f"PYTHONPATH: {base_env.get('PYTHONPATH', '')}", f"temporary folder: {tmp}", ""]
    t_all = time.monotonic()
    needed = {n for _, e in entries for n in e.needs if n in SETUP_FIXTURES}
    try:
        t0 = time.monotonic()
        missing = make_fixtures(fix, needed, probe_env)
        info.append(f"fixtures {', '.join(sorted(needed))}: {time.monotonic() - t0:.1f} s")
        for name, err in missing.items():
            print(f"fixture {name} could not be made: {err}", file=sys.stderr)
            info.append(f"fixture {name} FAILED: {err}")
        for n, (i, e) in enumerate(entries, 1):
            t0 = time.monotonic()
            text, codes = run_entry(i, e, tmp, fix, base_env, paths, args.timeout, missing)
            (outdir / f"{i:02d}-{e.name}.txt").write_text(text, encoding="utf-8")
            dt = time.monotonic() - t0
            info.append(f"{i:02d}-{e.name}: exit {','.join(map(str, codes))}, {dt:.1f} s")
            print(f"[{n:2d}/{len(entries)}] {i:02d}-{e.name}: exit {','.join(map(str, codes))} ({dt:.1f} s)",
                  flush=True)
    finally:
        if args.keep:
            print(f"work folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - t_all
    info.append(f"total: {total:.1f} s for {len(entries)} entries")
    (outdir / "_run-info.txt").write_text("\n".join(info) + "\n")
    print(f"{len(entries)} entries in {total:.1f} s: {outdir}")
    return 0


def where(lines: list[str]) -> str:
    """'  in ## step k/n, === file PATH' of the last step header (and file header after it) in lines."""
    steps = [i for i, x in enumerate(lines) if x.startswith("## step")]
    if not steps:
        return ""
    files = [x for x in lines[steps[-1]:] if x.startswith("=== file")]
    return "  in " + lines[steps[-1]].strip() + (", " + files[-1].split(" (mode")[0] if files else "")


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = Path(args.a), Path(args.b)
    names = sorted({p.name for d in (a, b) for p in d.iterdir() if re.fullmatch(r"\d+-.+\.txt", p.name)},
                   key=lambda n: (int(n.split("-")[0]), n))
    differ = 0
    for name in names:
        pa, pb = a / name, b / name
        if not pa.exists() or not pb.exists():
            differ += 1
            print(f"{name}: only in {a if pa.exists() else b}")
            continue
        # (a corpus recorded before its pid tables were unpadded is compared as if they were)
        la = unpad_pid_tables(pa.read_text(encoding="utf-8")).splitlines(keepends=True)
        lb = unpad_pid_tables(pb.read_text(encoding="utf-8")).splitlines(keepends=True)
        if la == lb:
            continue
        differ += 1
        diff = list(difflib.unified_diff(la, lb, str(pa), str(pb), n=2))
        print(f"{name}: differs ({len(diff)} diff lines)")
        for line in diff[:args.lines]:
            if m := re.match(r"@@ -(\d+)", line):  # name the step and the file the hunk is in
                line = line.rstrip("\n") + where(la[:int(m.group(1))]) + "\n"
            sys.stdout.write(line if line.endswith("\n") else line + "\n")
        if len(diff) > args.lines:
            print(f"... ({len(diff) - args.lines} more diff lines)")
    print(f"{len(names)} entries compared, {differ} differ")
    return 1 if differ else 0


def cmd_list(_: argparse.Namespace) -> int:
    for i, e in enumerate(CORPUS, 1):
        steps = " && ".join("bnprobe " + shlex.join(s) for s in e.steps)
        env = "".join(f"{k}={v} " for k, v in e.env)
        print(f"{i:02d}-{e.name} [{e.group}]: {env}{steps}")
    groups: dict[str, int] = {}
    for e in CORPUS:
        groups[e.group] = groups.get(e.group, 0) + 1
    print(f"{len(CORPUS)} entries, {sum(len(e.steps) for e in CORPUS)} commands: "
          + ", ".join(f"{g} {n}" for g, n in groups.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the corpus into OUTDIR (a new or empty folder)")
    r.add_argument("outdir")
    r.add_argument("--only", help="run only the entries whose name matches this glob (and those they need)")
    r.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    r.add_argument("--keep", action="store_true", help="keep the temporary work folders")
    d = sub.add_parser("diff", help="compare two corpus folders; exit 1 when any entry differs")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--lines", type=int, default=60, help="diff lines shown per entry (default 60)")
    sub.add_parser("list", help="print the corpus")
    args = ap.parse_args(argv)
    return {"run": cmd_run, "diff": cmd_diff, "list": cmd_list}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""Real multi-rank, multi-step MindStudio Probe (msprobe) dumps of BatchNorm calls, for bnprobe's tests.

This module is an independent oracle: it imports nothing from bnprobe.  ``make_rank_dumps(root)`` runs this file as
a script in a subprocess (``python tests/msprobe_ranks.py ROOT``), so msprobe's patching of torch never reaches the
calling (pytest) process.  That script (the *launcher*, which never imports torch) starts ``world`` worker processes
of this same file on localhost (``MASTER_ADDR=127.0.0.1``, a free port chosen at run time, ``torch.distributed``
with the gloo backend).  Each worker

1. builds a small deterministic CNN (``Net`` below: four BatchNorm calls per forward -- three ``nn.BatchNorm2d``
   with different eps/momentum and one ``nn.BatchNorm1d``) wrapped in ``DistributedDataParallel`` (CPU, default
   ``broadcast_buffers=True``), with its OWN data: rank r's batch holds ``BATCH[r % 2]`` samples (unequal counts,
   which DDP allows), and rank 1 shifts one input channel by ``LARGE_OFFSET`` so that bn1's channels have a large
   mean there;
2. *reference pass, before msprobe is imported*: trains ``steps`` SGD steps under DDP (gradient all-reduce and
   buffer broadcast included) with hooks recording, per (step, BatchNorm call in forward order), what the
   BatchNorm module actually received (x, weight, bias and the running statistics after DDP's broadcast from
   rank 0), its y, dy, dx and the rank's local dweight / dbias (before DDP's all-reduce: what the BatchNorm
   backward produced).  A standalone ``F.batch_norm`` / ``torch.native_batch_norm`` on clones of the inputs then
   recomputes y, the running statistics after the call, the saved statistics (save_mean / save_invstd) and dx /
   dweight / dbias, and must agree with the hooked values bit for bit.  Everything is saved as float32 ``.npy``
   under ``ROOT/expected/step<k>/rank<r>/<call index>-<field>.npy``;
3. imports msprobe, creates ONE ``msprobe.pytorch.PrecisionDebugger`` (task "tensor", level "L1", every rank and
   step) and re-runs the same training from scratch with ``start()``, forward, backward, ``stop()``, ``step()``
   per step, msprobe writing ``ROOT/tensor/step<k>/rank<r>/`` (msprobe 26.2.0 names the folder ``rank<n>`` from
   ``torch.distributed.get_rank()`` when the process group is initialised at the first ``start()``, else
   ``proc<pid>``); then, through msprobe's config hot reload (``"dump_enable": true``), re-runs it once more with
   task "statistics" into ``ROOT/statistics/`` (``set_init_step(0)`` restarts the step count at step0);
4. after each dumped run, checks that the model's final parameters and buffers and every step's loss equal the
   reference pass's bit for bit (else the dump would not be of the run the expected values describe: it raises).

The launcher then writes ``ROOT/manifest.json`` from the model's definition (never from the dump): world size,
steps, per rank its batch size and x shapes, per call in forward order the msprobe api name it is expected to get
(msprobe 26.2.0 names the ``nn.BatchNormNd`` calls ``Functional.batch_norm.<n>``, n counting them in forward order
and restarting at every step), module path, shapes, eps, momentum, training flag and dtype.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

MANIFEST = "manifest.json"
CONFIG = "msprobe-config.json"
EXPECTED = "expected"
DUMPS = {"tensor": ("tensor", "L1"), "statistics": ("statistics", "L1")}  # dump folder -> (task, level)

# The model's shapes and BatchNorm hyper-parameters; the manifest is written from these.
C_IN, H, W = 3, 8, 8
BATCH = (4, 3)  # rank r's batch size is BATCH[r % 2]: unequal counts across ranks
LARGE_RANK, LARGE_CHANNEL, LARGE_OFFSET = 1, 0, 300.0  # this rank's input channel is shifted: bn1 sees large means
LR = 0.01
SEED_MODEL, SEED_DATA = 1234, 4321
FIELDS = ("x", "weight", "bias", "running_mean", "running_var", "y", "running_mean_after", "running_var_after",
          "save_mean", "save_invstd", "dy", "dx", "dweight", "dbias")

# The BatchNorm calls of one forward, in order: (module path, class, channels, per-sample shape, eps, momentum)
CALLS = (
    ("bn1", "BatchNorm2d", 4, (4, H, W), 1e-5, 0.1),
    ("bn2", "BatchNorm2d", 6, (6, H, W), 1e-3, 0.3),
    ("bn3", "BatchNorm2d", 4, (4, H // 2, W // 2), 1e-4, 0.05),
    ("bn4", "BatchNorm1d", 5, (5,), 1e-5, 0.1),
)
API = "Functional.batch_norm"
OUT_FEATURES = 5


def batch_of(rank: int) -> int:
    return BATCH[rank % len(BATCH)]


def make_rank_dumps(root: Path, steps: int = 2, world: int = 2, *, statistics: bool = True) -> Path:
    """Generate the dumps under root (in a subprocess) and return the tensor dump's msprobe dump_path;
    ``statistics=False`` skips the second (statistics) dump."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(root), "--steps", str(steps),
                           "--world", str(world), *([] if statistics else ["--no-statistics"])], check=False,
                          cwd=root, capture_output=True, text=True, timeout=600)
    (root / "generator.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"msprobe rank dump generation failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-6000:]}")
    manifest = json.loads((root / MANIFEST).read_text())
    return root / manifest["dumps"]["tensor"]["dump_path"]


# ------------------------------------------------------------------------------------------------------ launcher ---
# Runs in the subprocess make_rank_dumps starts; never imports torch.

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manifest(root: Path, steps: int, world: int, dumps) -> dict:
    import importlib.metadata as md

    calls = []
    for i, (path, cls, c, sample, eps, momentum) in enumerate(CALLS):
        calls.append({
            "index": i,
            "api": API,
            "api_name": f"{API}.{i}",
            "module": path,
            "ddp_module": f"module.{path}",
            "module_class": cls,
            "channels": c,
            "sample_shape": list(sample),
            "eps": eps,
            "momentum": momentum,
            "training": True,
            "affine": True,
            "has_backward": True,
            "dtype": "torch.float32",
            "outputs": ["y"],
        })
    ranks = []
    for r in range(world):
        ranks.append({
            "rank": r,
            "batch": batch_of(r),
            "x_shapes": [[batch_of(r), *sample] for _, _, _, sample, _, _ in CALLS],
            "input_offset": {"channel": LARGE_CHANNEL, "offset": LARGE_OFFSET} if r == LARGE_RANK else None,
        })
    records = []
    for k in range(steps):
        for r in range(world):
            for i, call in enumerate(calls):
                records.append({
                    "step": k, "rank": r, "index": i, "api_name": call["api_name"], "folder": f"step{k}/rank{r}",
                    "x_shape": ranks[r]["x_shapes"][i],
                    "expected": {f: f"{EXPECTED}/step{k}/rank{r}/{i}-{f}.npy" for f in FIELDS},
                })
    return {
        "format": "bnprobe-msprobe-ranks/1",
        "msprobe_version": md.version("mindstudio-probe"),
        "torch_version": md.version("torch"),
        "backend": "gloo",
        "world": world,
        "steps": steps,
        "lr": LR,
        "broadcast_buffers": True,
        "dumps": {name: {"dump_path": name, "task": DUMPS[name][0], "level": DUMPS[name][1]} for name in dumps},
        "expected_dir": EXPECTED,
        "fields": list(FIELDS),
        "ranks": ranks,
        "calls": calls,
        "records": records,
    }


def launch(root: Path, steps: int, world: int, dumps=tuple(DUMPS)) -> dict:
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        log = open(root / f"worker{r}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(root), "--steps",
                                        str(steps), "--world", str(world), "--worker", str(r),
                                        *([] if "statistics" in dumps else ["--no-statistics"])],
                                       env=dict(env, RANK=str(r)), cwd=root, stdout=log, stderr=subprocess.STDOUT),
                      log))
    failed = None
    deadline = time.time() + 300
    while any(p.poll() is None for p, _ in procs):
        bad = [r for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
        if bad or time.time() > deadline:
            failed = f"worker {bad[0]} exited with {procs[bad[0]][0].returncode}" if bad else "timed out"
            break
        time.sleep(0.05)
    for p, log in procs:
        if p.poll() is None:
            p.kill()  # a worker left waiting in a collective for a dead peer
        p.wait()
        log.close()
    logs = "".join(f"--- worker {r} ---\n{(root / f'worker{r}.log').read_text()[-3000:]}\n" for r in range(world))
    print(logs)
    if failed is None and any(p.returncode != 0 for p, _ in procs):
        failed = "a worker failed"
    if failed is not None:
        raise SystemExit(f"msprobe rank dumps: {failed}")
    manifest = _manifest(root, steps, world, dumps)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"done in {time.time() - t0:.1f} s", flush=True)
    return manifest


# -------------------------------------------------------------------------------------------------------- worker ---
# Everything below runs in the worker processes only.

def _torch():
    import torch

    return torch


def _net_class():
    torch = _torch()
    nn = torch.nn

    class Net(nn.Module):
        """conv -> bn1 -> ReLU -> conv -> bn2 (eps 1e-3, momentum 0.3) -> ReLU -> strided conv -> bn3 (eps 1e-4,
        momentum 0.05) -> ReLU -> flatten -> Linear -> bn4 (BatchNorm1d)."""

        def __init__(self):
            super().__init__()
            (p1, _, c1, _, e1, m1), (p2, _, c2, _, e2, m2), (p3, _, c3, _, e3, m3), (p4, _, c4, _, e4, m4) = CALLS
            self.conv1 = nn.Conv2d(C_IN, c1, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(c1, eps=e1, momentum=m1)
            self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(c2, eps=e2, momentum=m2)
            self.conv3 = nn.Conv2d(c2, c3, 3, stride=2, padding=1)
            self.bn3 = nn.BatchNorm2d(c3, eps=e3, momentum=m3)
            self.fc = nn.Linear(c3 * (H // 2) * (W // 2), c4)
            self.bn4 = nn.BatchNorm1d(c4, eps=e4, momentum=m4)
            self.relu = nn.ReLU()

        def forward(self, x):
            a = self.relu(self.bn1(self.conv1(x)))
            a = self.relu(self.bn2(self.conv2(a)))
            a = self.relu(self.bn3(self.conv3(a)))
            return self.bn4(self.fc(torch.flatten(a, 1)))

    return Net


def _check(ok, msg):
    if not ok:
        raise RuntimeError(msg)


def _same(a, b):
    torch = _torch()
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _build(rank: int):
    """A fresh DDP-wrapped model (same initial state on every rank), its optimizer, and this rank's data and loss
    weights for every step: all deterministic."""
    torch = _torch()
    torch.manual_seed(SEED_MODEL)
    model = _net_class()()
    g = torch.Generator().manual_seed(SEED_MODEL + 1)
    with torch.no_grad():
        for path, _, c, _, _, _ in CALLS:
            m = model.get_submodule(path)
            m.weight.copy_(1 + 0.25 * torch.randn(c, generator=g))
            m.bias.copy_(0.2 * torch.randn(c, generator=g))
            m.running_mean.copy_(0.5 * torch.randn(c, generator=g))
            m.running_var.copy_(0.5 + 1.5 * torch.rand(c, generator=g))
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    return ddp, opt


def _data(rank: int, steps: int):
    torch = _torch()
    g = torch.Generator().manual_seed(SEED_DATA + 97 * rank)
    n = batch_of(rank)
    out = []
    for _ in range(steps):
        x = 1.5 * torch.randn(n, C_IN, H, W, generator=g) + 0.5
        if rank == LARGE_RANK:
            x[:, LARGE_CHANNEL] += LARGE_OFFSET
        # the loss weights the output by fixed random numbers: the plain sum of a BN output would give it dy ~ 0
        out.append((x, torch.randn(n, OUT_FEATURES, generator=g)))
    return out


def _train_step(ddp, opt, x, w):
    loss = (ddp(x) * w).sum()
    loss.backward()
    return loss


def _state(ddp):
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def _reference(root: Path, rank: int, steps: int):
    """Train under DDP without msprobe, recording each BatchNorm call; returns the final state and the losses."""
    torch = _torch()
    F = torch.nn.functional
    ddp, opt = _build(rank)
    bns = [ddp.module.get_submodule(path) for path, *_ in CALLS]
    seen: list[dict] = [{} for _ in CALLS]

    def pre_hook(i):
        def f(mod, inp):
            x = inp[0]
            s = seen[i]
            s.update(x=x.detach().clone(), weight=mod.weight.detach().clone(), bias=mod.bias.detach().clone(),
                     running_mean=mod.running_mean.detach().clone(), running_var=mod.running_var.detach().clone())
            x.register_hook(lambda g: s.__setitem__("dx", g.detach().clone()))
        return f

    def post_hook(i):
        def f(mod, inp, out):
            s = seen[i]
            s.update(y=out.detach().clone(), running_mean_after=mod.running_mean.detach().clone(),
                     running_var_after=mod.running_var.detach().clone())
            out.register_hook(lambda g: s.__setitem__("dy", g.detach().clone()))
        return f

    def param_hook(i, field):
        # a tensor hook on a parameter sees the gradient flowing into it: this rank's own, before DDP's all-reduce
        return lambda g: seen[i].__setitem__(field, g.detach().clone())

    for i, m in enumerate(bns):
        m.register_forward_pre_hook(pre_hook(i))
        m.register_forward_hook(post_hook(i))
        m.weight.register_hook(param_hook(i, "dweight"))
        m.bias.register_hook(param_hook(i, "dbias"))

    losses = []
    for k, (x, w) in enumerate(_data(rank, steps)):
        for s in seen:
            s.clear()
        losses.append(_train_step(ddp, opt, x, w).detach().clone())
        outdir = root / EXPECTED / f"step{k}" / f"rank{rank}"
        outdir.mkdir(parents=True, exist_ok=True)
        for i, ((path, _, _, sample, eps, momentum), s) in enumerate(zip(CALLS, seen)):
            where = f"step {k} rank {rank} call {i} ({path})"
            _check(set(s) >= set(FIELDS) - {"save_mean", "save_invstd"}, f"{where}: hooks saw only {sorted(s)}")
            _check(tuple(s["x"].shape) == (batch_of(rank), *sample), f"{where}: x shape {tuple(s['x'].shape)}")
            _check(bool((s["dy"] != 0).any()), f"{where}: dy is all zero")
            # the standalone call on clones of the inputs must reproduce the hooked values bit for bit
            xc = s["x"].clone().requires_grad_()
            wc, bc = s["weight"].clone().requires_grad_(), s["bias"].clone().requires_grad_()
            rm, rv = s["running_mean"].clone(), s["running_var"].clone()
            y = F.batch_norm(xc, rm, rv, wc, bc, True, momentum, eps)
            y.backward(s["dy"])
            yn, save_mean, save_invstd = torch.native_batch_norm(s["x"].clone(), s["weight"].clone(),
                                                                 s["bias"].clone(), s["running_mean"].clone(),
                                                                 s["running_var"].clone(), True, momentum, eps)
            for name, got, want in (("y", y.detach(), s["y"]), ("native y", yn, s["y"]), ("dx", xc.grad, s["dx"]),
                                    ("dweight", wc.grad, s["dweight"]), ("dbias", bc.grad, s["dbias"]),
                                    ("running_mean_after", rm, s["running_mean_after"]),
                                    ("running_var_after", rv, s["running_var_after"])):
                _check(_same(got, want), f"{where}: standalone {name} differs from the model's")
            s.update(save_mean=save_mean, save_invstd=save_invstd)
            for field in FIELDS:
                _save(outdir / f"{i}-{field}.npy", s[field].detach().float().numpy())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _state(ddp), losses


def _save(path: Path, a):
    import numpy as np

    np.save(path, np.ascontiguousarray(a, dtype=np.float32))


def _write_config(path: Path, task: str, level: str, dump_path: Path):
    task_cfg = {"scope": [], "list": [], "data_mode": ["all"]}
    if task == "statistics":
        task_cfg["summary_mode"] = "statistics"
    cfg = {"task": task, "dump_path": str(dump_path), "rank": [], "step": [], "level": level, "dump_enable": True,
           task: task_cfg}
    path.write_text(json.dumps(cfg, indent=1))


def _dumped(root: Path, rank: int, steps: int, reference, dumps):
    """The same training run, dumped by msprobe: once per entry of DUMPS, through one debugger."""
    torch = _torch()
    dist = torch.distributed
    ref_state, ref_losses = reference
    t0 = time.time()
    from msprobe.pytorch import PrecisionDebugger

    print(f"rank {rank}: msprobe imported in {time.time() - t0:.1f} s", flush=True)
    cfg = root / f"{rank}-{CONFIG}"  # one config file per rank: the debugger reloads it when it changes
    dbg = None
    for name in dumps:
        task, level = DUMPS[name]
        dump_path = root / name
        _write_config(cfg, task, level, dump_path)
        if dbg is None:
            dbg = PrecisionDebugger(config_path=str(cfg))
        else:
            # the debugger re-reads a changed config file at start() once its check interval has passed
            time.sleep(getattr(PrecisionDebugger, "_CONFIG_CHECK_INTERVAL_ENABLED_S", 0.5) + 0.1)
        PrecisionDebugger.set_init_step(0)
        dist.barrier()
        ddp, opt = _build(rank)
        losses = []
        for k, (x, w) in enumerate(_data(rank, steps)):
            dbg.start(model=ddp)
            if k == 0:
                got = (dbg.config.task, dbg.config.level, Path(dbg.config.dump_path).resolve())
                _check(got == (task, level, dump_path.resolve()), f"{name}: msprobe did not take the config ({got})")
            losses.append(_train_step(ddp, opt, x, w).detach().clone())
            dbg.stop()
            dbg.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = _state(ddp)
        # msprobe ran the reference's training: same losses, same final parameters and buffers, bit for bit
        for k, (a, b) in enumerate(zip(losses, ref_losses)):
            _check(_same(a, b), f"{name}: rank {rank} step {k} loss {a.item()!r} != reference {b.item()!r}")
        for key, v in ref_state.items():
            _check(_same(state[key], v), f"{name}: rank {rank}: final {key} differs from the reference pass")
        print(f"rank {rank}: {name} dumped and checked ({time.time() - t0:.1f} s)", flush=True)


def worker(root: Path, rank: int, steps: int, world: int, dumps=tuple(DUMPS)):
    import datetime

    t0 = time.time()
    torch = _torch()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist = torch.distributed
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    _check(dist.get_rank() == rank and dist.get_world_size() == world, "process group does not match")
    reference = _reference(root, rank, steps)
    print(f"rank {rank}: reference pass done ({time.time() - t0:.1f} s)", flush=True)
    dist.barrier()
    _dumped(root, rank, steps, reference, dumps)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done in {time.time() - t0:.1f} s", flush=True)


def _args(argv):
    import argparse

    ap = argparse.ArgumentParser(description="real multi-rank msprobe dumps of BatchNorm calls")
    ap.add_argument("root", type=Path)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--no-statistics", action="store_true", help="skip the statistics dump")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


if __name__ == "__main__":
    # run as a script, Python puts tests/ first on sys.path, where folders such as tests/kernels could shadow a
    # package torch or msprobe tries to import; this file needs nothing from there
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    a = _args(sys.argv[1:])
    chosen = tuple(n for n in DUMPS if not (a.no_statistics and n == "statistics"))
    if a.worker is None:
        launch(a.root, a.steps, a.world, chosen)
    else:
        worker(a.root.resolve(), a.worker, a.steps, a.world, chosen)

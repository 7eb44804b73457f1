"""Real MindStudio Probe (msprobe) dumps of BatchNorm calls, for bnprobe's tests.

This module is an independent oracle: it imports nothing from bnprobe.  ``make_dumps(root)`` runs this file as a
script in a subprocess (``python tests/msprobe_dumps.py ROOT``), so msprobe's patching of torch never reaches the
calling (pytest) process.  The script

1. builds, per dump, a fresh deterministic model (``Net`` below) holding every BatchNorm flavour bnprobe reads:
   ``nn.BatchNorm2d`` twice (defaults, then eps=1e-3/momentum=0.3), ``nn.BatchNorm1d`` on an (N, C) tensor,
   ``nn.BatchNorm3d`` on a 5-D tensor and one direct ``torch.native_batch_norm`` call (eps=1e-2, momentum=0.25);
2. computes torch's own reference values for every BatchNorm call *before msprobe is imported*: a plain forward +
   backward of a copy of the model gives each call's inputs and dy, then a standalone ``F.batch_norm`` /
   ``torch.native_batch_norm`` on clones of those inputs gives y, the running statistics after the call and
   dx / dweight / dbias; they are saved as float32 ``.npy`` (16-bit values are exact in float32) under
   ``ROOT/<dump>-expected/<call index>-<field>.npy``;
3. imports msprobe, creates ONE ``msprobe.pytorch.PrecisionDebugger`` and dumps every model with it, switching
   task / level / dump_path between dumps through msprobe's config hot reload (``"dump_enable": true`` in the
   config makes the debugger re-read its config file when the file changes; ``set_init_step(0)`` keeps every dump in
   ``step0``); each dump lives in ``ROOT/<dump>/step0/proc<pid>/``;
4. writes ``ROOT/manifest.json``: per dump its level, task, dtype and the BatchNorm calls in forward order, written
   from the model's definition (module paths, call order, shapes, eps, momentum, training flag, dtypes), never from
   the dump itself -- the tests check that dump.json agrees.

msprobe 26.2.0 names the calls ``Functional.batch_norm.<n>`` (the nn.BatchNormNd modules, n counting those calls in
forward order) and ``Torch.native_batch_norm.<n>`` (the direct call); the manifest records these expected names.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
CONFIG = "msprobe-config.json"


@dataclass(frozen=True)
class Spec:
    name: str
    level: str  # msprobe level: "L1" or "mix"
    task: str  # msprobe task: "tensor" or "statistics"
    dtype: str  # "fp32" | "fp16" | "bf16": the whole model is cast to it
    mode: str  # "train" | "eval" (eval: one training step first, outside the debugger)


SPECS = (
    Spec("L1-fp32", "L1", "tensor", "fp32", "train"),
    Spec("L1-fp16", "L1", "tensor", "fp16", "train"),
    Spec("L1-bf16", "L1", "tensor", "bf16", "train"),
    Spec("mix-fp32", "mix", "tensor", "fp32", "train"),
    Spec("mix-fp16", "mix", "tensor", "fp16", "train"),
    Spec("stats-bf16", "L1", "statistics", "bf16", "train"),
    Spec("eval-fp32", "L1", "tensor", "fp32", "eval"),
)

TORCH_DTYPE = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}

# The model's shapes and BatchNorm hyper-parameters; the manifest is written from these.
N, H, W = 6, 4, 4
X_SHAPE = (N, 3, H, W)  # image input
V_SHAPE = (2, 2, 3, 3, 3)  # volume input
SIDE_EPS, SIDE_MOMENTUM = 1e-2, 0.25  # the direct torch.native_batch_norm call

# The BatchNorm calls in forward order: (msprobe api prefix, module path or None, module class, x shape, eps, momentum)
CALLS = (
    ("Functional.batch_norm", "bn1", "BatchNorm2d", (N, 4, H, W), 1e-5, 0.1),
    ("Functional.batch_norm", "bn2", "BatchNorm2d", (N, 6, H, W), 1e-3, 0.3),
    ("Functional.batch_norm", "head.1", "BatchNorm1d", (N, 5), 1e-5, 0.1),
    ("Functional.batch_norm", "vol.1", "BatchNorm3d", (2, 3, 3, 3, 3), 1e-5, 0.1),
    ("Torch.native_batch_norm", None, None, (N, 2, H, W), SIDE_EPS, SIDE_MOMENTUM),
)


def make_dumps(root: Path) -> dict[str, Path]:
    """Generate every dump of SPECS under root (in a subprocess) and return {dump name: its msprobe dump_path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(root)], check=False,
                          cwd=root, capture_output=True, text=True, timeout=600)
    (root / "generator.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"msprobe dump generation failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    manifest = json.loads((root / MANIFEST).read_text())
    return {name: root / d["dump_path"] for name, d in manifest["dumps"].items()}


# ---------------------------------------------------------------------------------------------------- generator ---
# Everything below runs in the subprocess only.

def _torch():
    import torch

    return torch


def _net_class():
    torch = _torch()
    nn = torch.nn

    class Net(nn.Module):
        """conv -> BN2d -> ReLU -> conv -> BN2d(eps=1e-3, momentum=0.3) -> flatten -> Linear -> BN1d;
        Conv3d -> BN3d on a volume; a 1x1 conv -> direct torch.native_batch_norm(eps=1e-2, momentum=0.25)."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(4)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(6, eps=1e-3, momentum=0.3)
            self.head = nn.Sequential(nn.Linear(6 * H * W, 5), nn.BatchNorm1d(5))
            self.vol = nn.Sequential(nn.Conv3d(2, 3, 1), nn.BatchNorm3d(3))
            self.side = nn.Conv2d(3, 2, 1)
            self.side_weight = nn.Parameter(torch.ones(2))
            self.side_bias = nn.Parameter(torch.zeros(2))
            self.register_buffer("side_mean", torch.zeros(2))
            self.register_buffer("side_var", torch.ones(2))
            self.tap = None  # reference pass only: sees the direct call's input and outputs

        def forward(self, x, v):
            a = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            b = self.head(torch.flatten(a, 1))
            c = self.vol(v)
            s = self.side(x)
            out = torch.native_batch_norm(s, self.side_weight, self.side_bias, self.side_mean, self.side_var,
                                          self.training, SIDE_MOMENTUM, SIDE_EPS)
            if self.tap is not None:
                self.tap(s, out)
            return a, b, c, out[0]

    return Net


def _bn_parts(model):
    """(weight, bias, running_mean, running_var) of each call of CALLS, in order."""
    parts = []
    for _, path, _, _, _, _ in CALLS:
        if path is None:
            parts.append((model.side_weight, model.side_bias, model.side_mean, model.side_var))
        else:
            m = model.get_submodule(path)
            parts.append((m.weight, m.bias, m.running_mean, m.running_var))
    return parts


def _loss(outs, weights):
    a, b, c, d = outs
    wa, wb, wc, wd = weights
    # every BatchNorm output is weighted by fixed random numbers: the sum of a BN output would give it dy ~ 0
    return (a * wa).sum() + (b * wb).sum() + (c * wc).sum() + (d * wd).sum()


def _build(spec: Spec):
    """A fresh model of spec's dtype and mode, its inputs and loss weights; all deterministic."""
    torch = _torch()
    torch.manual_seed(1234)
    model = _net_class()()
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for weight, bias, mean, var in _bn_parts(model):
            c = weight.numel()
            weight.copy_(1 + 0.25 * torch.randn(c, generator=g))
            bias.copy_(0.2 * torch.randn(c, generator=g))
            mean.copy_(0.5 * torch.randn(c, generator=g))
            var.copy_(0.5 + 1.5 * torch.rand(c, generator=g))
    x = 1.5 * torch.randn(X_SHAPE, generator=g) + 0.5
    v = 0.8 * torch.randn(V_SHAPE, generator=g) - 0.3
    shapes = [CALLS[1][3], (N, 5), (2, 3, 3, 3, 3), CALLS[4][3]]
    weights = [torch.randn(s, generator=g) for s in shapes]
    if spec.mode == "eval":
        # one training step (forward updates the running statistics, plain SGD moves the parameters)
        x0 = 1.5 * torch.randn(X_SHAPE, generator=g) + 0.5
        v0 = 0.8 * torch.randn(V_SHAPE, generator=g) - 0.3
        model.train()
        _loss(model(x0, v0), weights).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    if spec.dtype == "fp16":
        model.half()
    elif spec.dtype == "bf16":
        model.bfloat16()
    model.train(spec.mode == "train")
    return model, x.to(dt), v.to(dt), [w.to(dt) for w in weights]


def as_numpy(t):
    torch = _torch()
    t = t.detach()
    return (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()


def check(ok, msg):
    if not ok:
        raise RuntimeError(msg)


def same_tensor(a, b):
    torch = _torch()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _reference(spec: Spec, model, x, v, weights, root: Path):
    """Torch's own values for every BatchNorm call (msprobe not imported yet); returns the manifest's calls."""
    torch = _torch()
    F = torch.nn.functional
    training = spec.mode == "train"
    ref = copy.deepcopy(model)
    before = [[t.detach().clone() for t in p] for p in _bn_parts(ref)]
    seen = [None] * len(CALLS)

    def hook(i):
        def f(_mod, inp, out):
            out.retain_grad()
            seen[i] = (inp[0].detach().clone(), out)
        return f

    for i, (_, path, _, _, _, _) in enumerate(CALLS):
        if path is not None:
            ref.get_submodule(path).register_forward_hook(hook(i))

    def tap(s, out):
        out[0].retain_grad()
        seen[-1] = (s.detach().clone(), out[0])

    ref.tap = tap
    _loss(ref(x, v), weights).backward()

    outdir = root / f"{spec.name}-expected"
    outdir.mkdir(parents=True, exist_ok=True)
    calls = []
    fwd_index = {}
    for i, ((api, path, cls, shape, eps, momentum), (xi, yi), (w0, b0, m0, v0), live) in enumerate(
            zip(CALLS, seen, before, _bn_parts(ref))):
        dy = yi.grad
        check(dy is not None and bool((dy != 0).any()), f"{spec.name} call {i}: no dy")
        xc = xi.clone().requires_grad_()
        wc, bc = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        rm, rv = m0.clone(), v0.clone()
        arrays = {"x": xi, "running_mean": m0, "running_var": v0, "weight": w0, "bias": b0}
        if path is None:
            y, save_mean, save_invstd = torch.native_batch_norm(xc, wc, bc, rm, rv, training, momentum, eps)
            arrays.update(save_mean=save_mean, save_invstd=save_invstd)
        else:
            y = F.batch_norm(xc, rm, rv, wc, bc, training, momentum, eps)
        y.backward(dy)
        arrays.update(y=y, dy=dy, dx=xc.grad, dweight=wc.grad, dbias=bc.grad)
        if training:
            arrays.update(running_mean_after=rm, running_var_after=rv)
        # the standalone call and the model's own pass must agree bit for bit (else this oracle is wrong)
        check(tuple(xi.shape) == shape, f"{spec.name} call {i}: x shape {tuple(xi.shape)}")
        check(same_tensor(y.detach(), yi.detach()), f"{spec.name} call {i}: standalone y != model y")
        check(same_tensor(wc.grad, live[0].grad) and same_tensor(bc.grad, live[1].grad),
              f"{spec.name} call {i}: dweight")
        check(same_tensor(rm, live[2]) and same_tensor(rv, live[3]), f"{spec.name} call {i}: running stats after")
        files = {}
        for field, t in arrays.items():
            f = outdir / f"{i}-{field}.npy"
            save_array(f, as_numpy(t))
            files[field] = f.relative_to(root).as_posix()
        n = fwd_index.get(api, 0)
        fwd_index[api] = n + 1
        calls.append({
            "index": i,
            "api": api,
            "api_name": f"{api}.{n}",
            "module": path,
            "module_class": cls,
            "mix_module": None if path is None else f"Module.{path}.{cls}",
            "x_shape": list(shape),
            "channels": shape[1],
            "training": training,
            "eps": eps,
            "momentum": momentum,
            "affine": True,
            "has_backward": True,
            "x_dtype": TORCH_DTYPE[spec.dtype],
            "param_dtype": TORCH_DTYPE[spec.dtype],
            "running_dtype": TORCH_DTYPE[spec.dtype],
            "outputs": ["y", "save_mean", "save_invstd"] if path is None else ["y"],
            "expected": files,
        })
    # what the model must hold after the dumped step (checked once msprobe has run it)
    after = [[t.detach().clone() for t in p[2:]] for p in _bn_parts(ref)]
    grads = [[t.grad.clone() for t in p[:2]] for p in _bn_parts(ref)]
    return calls, after, grads


def save_array(path: Path, a):
    import numpy as np

    np.save(path, np.ascontiguousarray(a))


def write_config(path: Path, spec: Spec, dump_path: Path):
    task_cfg = {"scope": [], "list": [], "data_mode": ["all"]}
    if spec.task == "statistics":
        task_cfg["summary_mode"] = "statistics"
    cfg = {"task": spec.task, "dump_path": str(dump_path), "rank": [], "step": [], "level": spec.level,
           "dump_enable": True, spec.task: task_cfg}
    path.write_text(json.dumps(cfg, indent=1))


def dump_all(root: Path, jobs, loss=None):
    """Dump every (spec, model, x, v, weights) with one PrecisionDebugger, re-configured by hot reload; ``loss``
    (default this file's) makes the scalar each model's outputs are differentiated through."""
    loss = _loss if loss is None else loss
    t0 = time.time()
    from msprobe.pytorch import PrecisionDebugger

    print(f"msprobe imported in {time.time() - t0:.1f} s", flush=True)
    cfg = root / CONFIG
    dbg = None
    for spec, model, x, v, weights in jobs:
        dump_path = root / spec.name
        write_config(cfg, spec, dump_path)
        if dbg is None:
            dbg = PrecisionDebugger(config_path=str(cfg))
        else:
            # the debugger re-reads a changed config file at start() once its check interval has passed
            time.sleep(getattr(PrecisionDebugger, "_CONFIG_CHECK_INTERVAL_ENABLED_S", 0.5) + 0.1)
        PrecisionDebugger.set_init_step(0)
        dbg.start(model=model)
        got = (dbg.config.task, dbg.config.level, Path(dbg.config.dump_path).resolve())
        if got != (spec.task, spec.level, dump_path.resolve()):
            raise RuntimeError(f"{spec.name}: msprobe did not take the new config (runs {got})")
        loss(model(x, v), weights).backward()
        dbg.stop()
        dbg.step()
        print(f"{spec.name}: dumped ({time.time() - t0:.1f} s)", flush=True)


def generate(root: Path, names=None):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch = _torch()
    specs = [s for s in SPECS if names is None or s.name in names]
    jobs, dumps, checks = [], {}, []
    for spec in specs:
        model, x, v, weights = _build(spec)
        calls, after, grads = _reference(spec, model, x, v, weights, root)
        jobs.append((spec, model, x, v, weights))
        checks.append((spec, model, after, grads))
        dumps[spec.name] = {
            "name": spec.name,
            "dump_path": spec.name,
            "expected_dir": f"{spec.name}-expected",
            "level": spec.level,
            "task": spec.task,
            "dtype": spec.dtype,
            "torch_dtype": TORCH_DTYPE[spec.dtype],
            "mode": spec.mode,
            "n_bn_calls": len(calls),
            "calls": calls,
        }
    print(f"references computed in {time.time() - t0:.1f} s", flush=True)
    dump_all(root, jobs)
    # msprobe ran the same step as the reference pass: the models must now hold the reference's state
    for spec, model, after, grads in checks:
        for i, (p, (rm, rv), (gw, gb)) in enumerate(zip(_bn_parts(model), after, grads)):
            if not (same_tensor(p[2], rm) and same_tensor(p[3], rv) and same_tensor(p[0].grad, gw)
                    and same_tensor(p[1].grad, gb)):
                raise RuntimeError(f"{spec.name} call {i}: the dumped step differs from the reference pass")
    import importlib.metadata as md

    manifest = {
        "format": "bnprobe-msprobe-fixtures/1",
        "msprobe_version": md.version("mindstudio-probe"),
        "torch_version": torch.__version__,
        "dumps": dumps,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"done in {time.time() - t0:.1f} s", flush=True)
    return manifest


if __name__ == "__main__":
    # run as a script, Python puts tests/ first on sys.path, where folders such as tests/kernels could shadow a
    # package torch or msprobe tries to import; this file needs nothing from there
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/msprobe_dumps.py OUT_DIR [DUMP_NAME ...]")
    generate(Path(sys.argv[1]), set(sys.argv[2:]) or None)

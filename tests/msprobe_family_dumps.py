"""Real MindStudio Probe (msprobe) dumps of the normalisation family's calls (and a BatchNorm beside them), for
bnprobe's tests.

This module is an independent oracle: it imports nothing from bnprobe.  ``make_family_dumps(root)`` runs this file
as a script in a subprocess (``python tests/msprobe_family_dumps.py ROOT``), so msprobe's patching of torch never
reaches the calling (pytest) process.  The script

1. builds, per dump, a fresh deterministic model (``Net`` below): ``nn.BatchNorm2d`` -> ``nn.GroupNorm(4, 8)`` ->
   ``nn.InstanceNorm2d(8, affine=True)`` on an image, and ``nn.LayerNorm(32)`` -> ``F.layer_norm`` over (4, 32)
   (γ, β and ε passed as keywords) -> ``torch.native_layer_norm`` (ε 1e-4) -> ``nn.RMSNorm(32)`` on a sequence
   (msprobe hooks no rms_norm: the RMSNorm is a module record at the mix level only, not a call);
2. computes torch's own values for every call *before msprobe is imported*: a plain forward + backward of a copy of
   the model gives each call's x and dy, then the functional call alone on clones of those inputs gives y (and the
   native call's mean and rstd), dx, dγ, dβ — checked bit for bit against the model's own pass — saved as float32
   ``.npy`` (16-bit values are exact in float32) under ``ROOT/<dump>-expected/<call index>-<field>.npy``;
3. imports msprobe, creates ONE ``msprobe.pytorch.PrecisionDebugger`` and dumps every model with it, switching
   task / level / dump_path between dumps through msprobe's config hot reload; each dump lives in
   ``ROOT/<dump>/step0/proc<pid>/``;
4. writes ``ROOT/manifest.json``: per dump its level, task, dtype and the calls in forward order, written from the
   model's definition (record names, module paths, shapes, layer, ε), never from the dump itself.
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
    dtype: str  # "fp32" | "bf16": the whole model is cast to it


SPECS = (
    Spec("L1-fp32", "L1", "tensor", "fp32"),
    Spec("L1-bf16", "L1", "tensor", "bf16"),
    Spec("mix-fp32", "mix", "tensor", "fp32"),
    Spec("mix-bf16", "mix", "tensor", "bf16"),
    Spec("stats-fp32", "L1", "statistics", "fp32"),
)
TORCH_DTYPE = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}

N = 3
IMG = (N, 3, 4, 4)
SEQ = (N, 4, 16)
# the calls in forward order: (record name, module path, module class, layer, x shape, normalized_shape, groups, eps)
CALLS = (
    ("Functional.batch_norm.0", "bn", "BatchNorm2d", "batch", (N, 8, 4, 4), None, None, 1e-5),
    ("Functional.group_norm.0", "gn", "GroupNorm", "group", (N, 8, 4, 4), None, 4, 1e-5),
    ("Functional.instance_norm.0", "inorm", "InstanceNorm2d", "instance", (N, 8, 4, 4), None, None, 1e-5),
    ("Functional.layer_norm.0", "ln", "LayerNorm", "layer", (N, 4, 32), (32,), None, 1e-5),
    ("Functional.layer_norm.1", None, None, "layer", (N, 4, 32), (4, 32), None, 1e-3),
    ("Torch.native_layer_norm.0", None, None, "layer", (N, 4, 32), (32,), None, 1e-4),
)


def make_family_dumps(root: Path) -> dict[str, Path]:
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

def _shared():
    """tests/msprobe_dumps.py, whose generator pieces (saving, msprobe's config, the dump loop, the tensor checks)
    this one shares: loaded by its path, as the subprocess keeps tests/ off sys.path."""
    import importlib.util

    if "bnprobe_msprobe_dumps" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bnprobe_msprobe_dumps",
                                                      Path(__file__).with_name("msprobe_dumps.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bnprobe_msprobe_dumps"]


def _torch():
    import torch

    return torch


def _net_class():
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class Net(nn.Module):
        """conv -> BN2d -> GroupNorm(4, 8) -> InstanceNorm2d(8, affine) on an image; Linear -> LayerNorm(32) ->
        F.layer_norm over (4, 32) (keywords, ε 1e-3) -> torch.native_layer_norm (ε 1e-4) -> RMSNorm(32) on a
        sequence."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.gn = nn.GroupNorm(4, 8)
            self.inorm = nn.InstanceNorm2d(8, affine=True)
            self.proj = nn.Linear(16, 32)
            self.ln = nn.LayerNorm(32)
            self.w2 = nn.Parameter(torch.ones(4, 32))
            self.b2 = nn.Parameter(torch.zeros(4, 32))
            self.w3 = nn.Parameter(torch.ones(32))
            self.b3 = nn.Parameter(torch.zeros(32))
            self.rms = nn.RMSNorm(32, eps=1e-6)
            self.tap = None  # reference pass only: sees the functional calls' inputs and outputs

        def forward(self, img, seq):
            a = self.inorm(self.gn(self.bn(self.conv(img))))
            h = self.ln(self.proj(seq))
            f = F.layer_norm(h, (4, 32), weight=self.w2, bias=self.b2, eps=1e-3)
            out = torch.native_layer_norm(f, [32], self.w3, self.b3, 1e-4)
            if self.tap is not None:
                self.tap(h, f, out)
            return a, self.rms(out[0])

    return Net


def _params(model):
    """(weight, bias) of each call of CALLS, in order."""
    return [(model.bn.weight, model.bn.bias), (model.gn.weight, model.gn.bias),
            (model.inorm.weight, model.inorm.bias), (model.ln.weight, model.ln.bias), (model.w2, model.b2),
            (model.w3, model.b3)]


def _loss(outs, weights):
    # every output weighted by fixed random numbers: the sum of a normalised output would give it dy ~ 0
    return sum((o * w).sum() for o, w in zip(outs, weights))


def _build(spec: Spec):
    """A fresh model of spec's dtype, its inputs and loss weights; all deterministic."""
    torch = _torch()
    torch.manual_seed(1234)
    model = _net_class()()
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for weight, bias in _params(model):
            weight.copy_(1 + 0.25 * torch.randn(weight.shape, generator=g))
            bias.copy_(0.2 * torch.randn(bias.shape, generator=g))
    img = 1.5 * torch.randn(IMG, generator=g) + 0.5
    seq = 0.8 * torch.randn(SEQ, generator=g) - 0.3
    weights = [torch.randn(CALLS[2][4], generator=g), torch.randn(CALLS[5][4], generator=g)]
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype]
    if spec.dtype == "bf16":
        model.bfloat16()
    model.train()
    return model, img.to(dt), seq.to(dt), [w.to(dt) for w in weights]








def _standalone(i, xc, w, b, before):
    """Call ``i`` of CALLS alone on clones of its inputs: (y, extra outputs by name)."""
    torch = _torch()
    F = torch.nn.functional
    _, _, _, layer, _, ns, groups, eps = CALLS[i]
    if layer == "batch":
        rm, rv = before
        return F.batch_norm(xc, rm.clone(), rv.clone(), w, b, True, 0.1, eps), {}
    if layer == "group":
        return F.group_norm(xc, groups, w, b, eps), {}
    if layer == "instance":
        return F.instance_norm(xc, None, None, w, b, True, 0.1, eps), {}
    if i == 5:
        y, mean, rstd = torch.native_layer_norm(xc, list(ns), w, b, eps)
        return y, {"mean": mean, "rstd": rstd}
    return F.layer_norm(xc, ns, w, b, eps), {}


def _reference(spec: Spec, model, img, seq, weights, root: Path):
    """Torch's own values for every call (msprobe not imported yet); returns the manifest's calls."""
    ms = _shared()
    ref = copy.deepcopy(model)
    before = [(p[0].detach().clone(), p[1].detach().clone()) for p in _params(ref)]
    running = (ref.bn.running_mean.clone(), ref.bn.running_var.clone())
    seen = [None] * len(CALLS)

    def hook(i):
        def f(_mod, inp, out):
            out.retain_grad()
            seen[i] = (inp[0].detach().clone(), out)
        return f

    for i, (_, path, *_rest) in enumerate(CALLS):
        if path is not None:
            ref.get_submodule(path).register_forward_hook(hook(i))

    def tap(h, f, out):
        f.retain_grad()
        out[0].retain_grad()
        seen[4] = (h.detach().clone(), f)
        seen[5] = (f.detach().clone(), out[0])

    ref.tap = tap
    _loss(ref(img, seq), weights).backward()

    outdir = root / f"{spec.name}-expected"
    outdir.mkdir(parents=True, exist_ok=True)
    calls = []
    for i, ((api, path, cls, layer, shape, ns, groups, eps), (xi, yi), (w0, b0), live) in enumerate(
            zip(CALLS, seen, before, _params(ref))):
        dy = yi.grad
        ms.check(dy is not None and bool((dy != 0).any()), f"{spec.name} call {i}: no dy")
        xc = xi.clone().requires_grad_()
        wc, bc = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        y, extra = _standalone(i, xc, wc, bc, running)
        y.backward(dy)
        arrays = {"x": xi, "weight": w0, "bias": b0, "y": y, "dy": dy, "dx": xc.grad, "dweight": wc.grad,
                  "dbias": bc.grad, **extra}
        if layer == "batch":
            arrays.update(running_mean=running[0], running_var=running[1])
        # the standalone call and the model's own pass must agree bit for bit (else this oracle is wrong)
        ms.check(tuple(xi.shape) == shape, f"{spec.name} call {i}: x shape {tuple(xi.shape)}")
        ms.check(ms.same_tensor(y.detach(), yi.detach()), f"{spec.name} call {i}: standalone y != model y")
        ms.check(ms.same_tensor(wc.grad, live[0].grad) and ms.same_tensor(bc.grad, live[1].grad),
                 f"{spec.name} call {i}: dweight")
        files = {}
        for field, t in arrays.items():
            f = outdir / f"{i}-{field}.npy"
            ms.save_array(f, ms.as_numpy(t))
            files[field] = f.relative_to(root).as_posix()
        calls.append({
            "index": i,
            "api_name": api,
            "module": path,
            "module_class": cls,
            "mix_module": None if path is None else f"Module.{path}.{cls}",
            "norm": layer,
            "x_shape": list(shape),
            "normalized_shape": None if ns is None else list(ns),
            "groups": groups,
            "eps": eps,
            # F.instance_norm's own backward record holds its y view's gradient: dx comes from its module (mix)
            "has_backward": layer != "instance" or spec.level == "mix",
            "x_dtype": TORCH_DTYPE[spec.dtype],
            "expected": files,
        })
    return calls








def generate(root: Path, names=None):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch = _torch()
    specs = [s for s in SPECS if names is None or s.name in names]
    jobs, dumps = [], {}
    for spec in specs:
        model, img, seq, weights = _build(spec)
        calls = _reference(spec, model, img, seq, weights, root)
        jobs.append((spec, model, img, seq, weights))
        dumps[spec.name] = {"name": spec.name, "dump_path": spec.name, "expected_dir": f"{spec.name}-expected",
                            "level": spec.level, "task": spec.task, "dtype": spec.dtype,
                            "torch_dtype": TORCH_DTYPE[spec.dtype], "calls": calls,
                            "rms_modules": ["Module.rms.RMSNorm.forward.0"] if spec.level == "mix" else []}
    print(f"references computed in {time.time() - t0:.1f} s", flush=True)
    _shared().dump_all(root, jobs, _loss)
    import importlib.metadata as md

    manifest = {"format": "bnprobe-msprobe-family-fixtures/1", "msprobe_version": md.version("mindstudio-probe"),
                "torch_version": torch.__version__, "dumps": dumps}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"done in {time.time() - t0:.1f} s", flush=True)
    return manifest


if __name__ == "__main__":
    # run as a script, Python puts tests/ first on sys.path, where folders such as tests/kernels could shadow a
    # package torch or msprobe tries to import; this file needs nothing from there
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/msprobe_family_dumps.py OUT_DIR [DUMP_NAME ...]")
    generate(Path(sys.argv[1]), set(sys.argv[2:]) or None)

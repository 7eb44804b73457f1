"""Capture every BatchNorm call of a small PyTorch CNN, in float32 and in model.half().

    python examples/capture_cnn.py [FP32_OUT [FP16_OUT]]     # default: new folders under reports/

Then runs ``bnprobe compare-precision`` on both captures: every call judged against the FP64 golden on
its own recorded inputs, torch's CPU kernel beside it, and the first call that fails named.

One training step (forward, loss, backward) of the same CNN from the same weights and batch, once as
built and once after ``model.half()``; each is recorded by ``bnprobe.capture`` into a model
dump: ``bnprobe-calls.json`` (the calls in forward order) and one bnprobe dump per call (inputs,
y, the statistics torch's kernel saved, the running statistics after, dy, dx, dγ, dβ).
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from pathlib import Path

from bnprobe import capture
from bnprobe.core.errors import BNProbeError
from bnprobe.reports import new_report_dir


def build_cnn(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(3, 8, 3, padding=1)), ("bn1", nn.BatchNorm2d(8)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(8, 16, 3, padding=1, stride=2)), ("bn2", nn.BatchNorm2d(16)), ("relu2", nn.ReLU()),
        ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()), ("fc", nn.Linear(16, 10)),
        ("bn3", nn.BatchNorm1d(10)),
    ]))


def train_step(model, x, target) -> float:
    import torch

    loss = torch.nn.functional.cross_entropy(model(x).float(), target)
    loss.backward()
    return float(loss.detach())


def main(argv: list[str]) -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed (pip install 'bnprobe[torch]'): nothing to capture")
        return 0
    outs = [Path(a) for a in argv[:2]]
    outs += [new_report_dir("reports", f"capture-cnn-{name}") for name in ("fp32", "fp16")[len(outs):]]
    torch.manual_seed(1)
    x = torch.randn(16, 3, 16, 16) * 2 + 0.5
    target = torch.randint(0, 10, (16,))
    base = build_cnn()
    for (name, to_format), out in zip((("fp32", lambda m: m), ("fp16", lambda m: m.half())), outs):
        model = to_format(copy.deepcopy(base)).train()
        xs = x.to(next(model.parameters()).dtype)
        try:
            with capture(model, out) as cap:
                loss = train_step(model, xs, target)
        except BNProbeError as exc:
            print(f"capture_cnn.py: error: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: loss {loss:.4f}; captured {len(cap.calls)} BatchNorm calls "
              f"({', '.join(cap.calls)}) into {out}")
    # each capture judged call by call on its own recorded inputs, with torch's CPU kernel beside it
    from bnprobe.cli import main as bnprobe

    for out in outs:
        print(f"\n$ bnprobe compare-precision --adapters dump:{out},torch --no-budget --out {out}/report")
        rc = bnprobe(["compare-precision", "--adapters", f"dump:{out},torch", "--no-budget", "--out",
                      str(out / "report")])
        if rc not in (0, 1):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

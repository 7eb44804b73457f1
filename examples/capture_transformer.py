"""Capture every LayerNorm and RMSNorm call of a small transformer block, in float32 and in model.half().

    python examples/capture_transformer.py [FP32_OUT [FP16_OUT]]     # default: new folders under reports/

Then runs ``bnprobe compare-precision`` on both captures: every call judged against the FP64 golden on its own
recorded inputs, torch's CPU kernel beside it.

One training step of a pre-norm block — LayerNorm, an MLP with a residual, then a Hugging Face-style RMSNorm (as
Llama writes it: x in float32, x·rsqrt(mean(x²) + ε) cast back, then ·γ) and a head — from the same weights and
batch, once as built and once after ``model.half()``; ``bnprobe.capture`` records each norm call (x, γ, β, ε, y,
the statistics the kernel saved, dy, dx, dγ, dβ) into a model dump.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from bnprobe import capture
from bnprobe.core.errors import BNProbeError
from bnprobe.reports import new_report_dir


def build_block(hidden: int = 256, seed: int = 0):
    import torch
    from torch import nn

    class LlamaRMSNorm(nn.Module):
        """Hugging Face's Llama RMSNorm, as transformers writes it."""

        def __init__(self, d: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.variance_epsilon = eps

        def forward(self, h):
            t = h.dtype
            h = h.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(t)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.norm = LlamaRMSNorm(hidden)
            self.head = nn.Linear(hidden, 16)

        def forward(self, x):
            h = x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))
            return self.head(self.norm(h))

    torch.manual_seed(seed)
    return Block()


def main(argv: list[str]) -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed (pip install 'bnprobe[torch]'): nothing to capture")
        return 0
    outs = [Path(a) for a in argv[:2]]
    outs += [new_report_dir("reports", f"capture-block-{name}") for name in ("fp32", "fp16")[len(outs):]]
    torch.manual_seed(1)
    x = torch.randn(4, 64, 256) * 3 + 1  # (batch, tokens, hidden)
    base = build_block()
    for (name, to_format), out in zip((("fp32", lambda m: m), ("fp16", lambda m: m.half())), outs):
        model = to_format(copy.deepcopy(base)).train()
        try:
            with capture(model, out) as cap:
                model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        except BNProbeError as exc:
            print(f"capture_transformer.py: error: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: captured {len(cap.calls)} norm calls ({', '.join(cap.calls)}) into {out}")
    from bnprobe.cli import main as bnprobe

    for out in outs:
        print(f"\njudged by: bnprobe compare-precision --adapters dump:{out},torch --no-budget --out {out}/report")
        rc = bnprobe(["compare-precision", "--adapters", f"dump:{out},torch", "--no-budget", "--out",
                      str(out / "report")])
        if rc not in (0, 1):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

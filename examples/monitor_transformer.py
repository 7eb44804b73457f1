"""Watch a transformer-like block's LayerNorm and RMSNorm with bnprobe.monitor: 20 training steps, with one token of
one sample set to NaN in the input at step 12.

    python examples/monitor_transformer.py [OUT]     # default: runs/monitor-block (refused if it holds one)

A pre-norm block — Linear, LayerNorm, an MLP with a residual, a Hugging Face-style RMSNorm (Llama's), a head — on
(batch 4, 16 tokens, hidden 64).  Every step writes each norm call's numbers per row of its (rows, R) view — here a
token — to OUT/family.parquet/ (its exact mean and variance, the kernel's saved rstd, the ranges and NaN/inf counts of
x, y, dx and dy, and y_err/stats_err: the distance from the FP64 golden as a fraction of a correct kernel's bound);
the bad step's calls are listed in OUT/anomalies.csv, named by row, and dumped under OUT/anomalies/step-12/.  Then:

    bnprobe compare-precision --adapters dump:OUT/anomalies/step-12 --no-budget
"""

from __future__ import annotations

import sys

from bnprobe import monitor
from bnprobe.core.errors import BNProbeError

BAD_STEP, STEPS, TOKENS = 12, 20, 16


def build_block(hidden: int = 64):
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
            self.embed, self.ln = nn.Linear(32, hidden), nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.norm, self.head = LlamaRMSNorm(hidden), nn.Linear(hidden, 8)

        def forward(self, x):
            h = self.embed(x)
            h = h + self.down(torch.nn.functional.gelu(self.up(self.ln(h))))
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Block()


def main(out: str) -> int:
    import torch

    net = build_block()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with monitor(net, out) as mon:
        for step in range(STEPS):
            x = torch.randn(4, TOKENS, 32, generator=gen)
            if step == BAD_STEP:
                x[2, 5, 7] = float("nan")  # sample 2, token 5
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss):  # (a non-finite step skipped, as a GradScaler does)
                opt.step()
            mon.step()
    print(f"monitored {STEPS} steps of {mon.family_modules} norm layers into {out}/family.parquet/")
    for a in mon.anomalies:
        rows = [int(r) for r in a["channels"].split()]
        where = ", ".join(f"row {r} = sample {r // TOKENS}, token {r % TOKENS}" for r in rows)
        steps = f"{a['first_step']}" + (f" to {a['last_step']} ({a['count']} steps)" if a["count"] > 1 else "")
        print(f"anomaly at step {steps}, {a['layer']} ({a['phase']}): {a['reason']} [{where}] -> {a['dump']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/monitor-block"))
    except BNProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

"""Watch a training run with bnprobe.monitor: a small CNN trained in float16 (model.half()) for 40 steps, with one
batch at step 25 scaled by 3·10⁴ so that the first convolution overflows float16.

    python examples/monitor_cnn.py [--step-on] [OUT]   # default OUT: runs/monitor-cnn (refused if it holds one)

Every step writes its per-layer, per-channel statistics to OUT/monitor.parquet/; the overflowing step's calls are
listed in OUT/anomalies.csv and dumped under OUT/anomalies/step-25/.  The optimizer skips a step whose loss is not
finite, as a GradScaler does, so the run goes on; with --step-on it steps on, the weights go NaN, and every later step
repeats the anomalies of step 25: each is listed once with the steps it went on to, and dumped once, at step 25.
Then:

    bnprobe plot-stats --monitor OUT                 # figures, the anomalies as findings
    bnprobe overflow --adapter dump:OUT/anomalies/step-25
"""

from __future__ import annotations

import sys

from bnprobe import monitor
from bnprobe.core.errors import BNProbeError

BAD_STEP, STEPS = 25, 40


def main(out: str, step_on: bool = False) -> int:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).half()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with monitor(net, out) as mon:
        for step in range(STEPS):
            x = torch.randn(16, 3, 16, 16, generator=gen).half()
            if step == BAD_STEP:
                x = x * 3e4
            loss = net(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss) or step_on:
                opt.step()
            mon.step()
    print(f"monitored {STEPS} steps of 2 BatchNorm layers into {out}/monitor.parquet/")
    for a in mon.anomalies:  # each once: the step it showed first (and the last, where it went on)
        steps = f"{a['first_step']}" + (f" to {a['last_step']} ({a['count']} steps)" if a["count"] > 1 else "")
        print(f"anomaly at step {steps}, {a['layer']} ({a['phase']}): {a['reason']} -> {a['dump']}")
    return 0


if __name__ == "__main__":
    try:
        args = [a for a in sys.argv[1:] if a != "--step-on"]
        sys.exit(main(args[0] if args else "runs/monitor-cnn", step_on="--step-on" in sys.argv[1:]))
    except BNProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

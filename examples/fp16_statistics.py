"""Where does an FP16 BatchNorm lose accuracy?  Run one layer three ways and read the trace.

    python examples/fp16_statistics.py

1. mixed precision (FP16 tensors, FP32 statistics) on ordinary activations;
2. the same with FP16 accumulation and single-pass variance on activations with a
   large mean: the sum of squares overflows and the channel silently collapses to beta;
3. the same input with two-pass variance: no overflow, ordinary FP16 error.

The golden here is FP64 on the unrounded input, so the error includes storing x
in FP16: near 100 the FP16 spacing is 0.0625, which alone costs ~0.03 in y on
channel 3.  (`bnprobe trace` instead compares on the same rounded inputs, to
isolate the kernel's own error.)
"""

import numpy as np

import bnprobe

rng = np.random.default_rng(0)
x = rng.standard_normal((8, 4, 8, 8))
x[:, 3] += 100.0  # one channel with a large mean, as after a ReLU-free layer with a big bias
gamma, beta = np.ones(4), np.zeros(4)
golden = bnprobe.forward_train(x, gamma, beta, policy="fp64").y

for policy in ("fp16", "fp16-acc16:variance=naive", "fp16-acc16"):
    res = bnprobe.forward_train(x, gamma, beta, policy=policy)
    err = np.abs(res.y.astype(np.float64) - golden).max(axis=(0, 2, 3))
    first = res.trace.first("overflow")
    print(f"{policy:28s} max |y - golden| per channel: {np.array2string(err, precision=4)}")
    print(f"{'':28s} first overflow: {first.name if first else 'none'}"
          + (f" in channels {np.flatnonzero(first.counters['overflow']).tolist()}" if first else ""))

# the trace as a table, for the broken run
res = bnprobe.forward_train(x, gamma, beta, policy="fp16-acc16:variance=naive")
print(res.trace.to_frame()[["stage", "format", "min", "max", "overflow", "posinf"]].to_string(index=False))

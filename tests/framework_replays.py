"""Other frameworks' CPU normalisation kernels replayed from their sources in plain numpy, each a yardstick written
from the kernel's code (nothing here imports bnprobe): checked bit for bit against the framework itself in
tests/adapters/test_frameworks_family_native.py (in its own environment, .ci/frameworks) and against bnprobe's
policy of it in tests/kernels/test_norm_framework_policies.py (in the default suite, without the framework)."""

from __future__ import annotations

import numpy as np

F32 = np.float32
H = np.float16



def paddle_group_replay(x: np.ndarray, groups: int, eps: float, g: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Paddle 3.3.1's CPU GroupNorm forward (phi/kernels/cpu/group_norm_kernel.cc, NCHW) in float32 scalar steps:
    per channel 8 accumulators of x and x·x from zero over its whole blocks of 8, std::accumulate'd in order into the
    group's sums, then the channel's tail one by one; mean = Σx/R, var = max(Σx²/R − mean·mean, 0); var_inv =
    1/√(var + ε) formed in double (3.3.1's ε is a double attribute: libphi_core.so's GroupNormKernel<float> takes
    ``double epsilon``) and rounded to float; y = ((x − mean)·var_inv)·γ + β, each step rounded."""
    n, c = x.shape[:2]
    xr = x.reshape(n, c, -1).astype(F32)
    hw, cg = xr.shape[2], c // groups
    full = hw - hw % 8
    y = np.empty_like(xr)
    for i in range(n):
        for gi in range(groups):
            chans = list(range(gi * cg, (gi + 1) * cg))
            s, q = F32(0), F32(0)
            for ch in chans:
                row = xr[i, ch]
                ls, lq = np.zeros(8, F32), np.zeros(8, F32)
                for k in range(0, full, 8):
                    ls, lq = ls + row[k:k + 8], lq + row[k:k + 8] * row[k:k + 8]
                for lane in range(8):
                    s, q = F32(s + ls[lane]), F32(q + lq[lane])
                for v in row[full:]:
                    s, q = F32(s + v), F32(q + F32(v * v))
            m = F32(s / F32(cg * hw))
            var = max(F32(F32(q / F32(cg * hw)) - F32(m * m)), F32(0))
            inv = F32(1.0 / np.sqrt(np.float64(var) + eps))
            for ch in chans:
                y[i, ch] = F32(F32(F32(xr[i, ch] - m) * inv) * g[ch]) + b[ch]
    return y.reshape(x.shape)


def mindspore_layer_replay(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """MindSpore 2.10's CPU LayerNorm (ops.LayerNorm) on fp16 x, γ, β over the last axis: the row's mean and biased
    variance (float32, from float64 sums: exact here), then every step in float16 as its LaunchKernel<float16>
    writes y[j] = (x[j] − T(mean)) / T(√(var + ε)) · γ + β with T = float16 — the mean and σ rounded to fp16, each
    operation rounded to fp16."""
    xd = x.astype(np.float64)
    m = xd.mean(-1, keepdims=True)
    var = ((xd - m) ** 2).mean(-1, keepdims=True)
    sd = H(np.sqrt(F32(F32(var) + F32(eps))))
    return H(H(H(H(x - H(F32(m))) / sd) * g) + b)

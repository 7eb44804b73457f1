"""The monitor's one-pass profile of a tensor's bit patterns (``bnprobe.recordings.monitor_profile`` calls it):
per channel, its least and greatest values and the counts of NaN, ±inf, values at the largest finite magnitude,
zeros and subnormals.  Integer arithmetic over the bits: exact, and vectorised by LLVM.

Imported only when a monitor profiles a large CPU tensor with the compiled route allowed.  One thread, the caller's:
the monitor runs inside a training process whose torch already keeps a thread per core, and a second pool of threads
(numba's OpenMP layer, a libgomp of its own) spinning beside torch's after each call cost more than it saved.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from bnprobe.compiled.codes import JIT_OPTIONS

# the formats profile reads, as the codes it takes
KIND_F64, KIND_F32, KIND_F16, KIND_BF16 = range(4)


@njit(**JIT_OPTIONS)
def _value(bits, kind):  # pragma: no cover - compiled
    """The float64 value of one format's bit pattern (sign-extended into an int64)."""
    if kind == KIND_F64:
        return np.int64(bits).view(np.float64)
    if kind == KIND_F32:
        return np.float64(np.int32(bits).view(np.float32))
    if kind == KIND_BF16:
        return np.float64(np.int32((bits & 0xFFFF) << 16).view(np.float32))
    e, m = (bits >> 10) & 0x1F, bits & 0x3FF  # fp16
    if e == 0x1F:
        v = np.inf if m == 0 else np.nan
    elif e == 0:
        v = m * 2.0 ** -24
    else:
        v = (1024 + m) * 2.0 ** (e - 25)
    return -v if (bits & 0x8000) else v


@njit(**JIT_OPTIONS)
def profile(bits, kind, mask, inf, big, tiny, out):  # pragma: no cover - compiled
    """``bits`` (N, C, S) integers of a float format's width, the format named by ``kind``; ``mask`` clears the sign,
    ``inf``, ``big`` and ``tiny`` are the bits of inf, the largest finite value and the smallest normal.  ``out``
    (7, C) float64 receives per channel: the least and the greatest value (NaN where the channel holds a NaN, as
    torch's amin and amax), then the counts of NaN, ±inf, at the largest magnitude, zeros and subnormals.

    The order key of a value is its bits with the lower ones flipped where the sign is set: an integer ordered as
    the values are (NaN aside, -0 just below +0)."""
    n, c, s = bits.shape
    acc = np.zeros((7, c), np.int64)  # per channel: least and greatest key, then the counts
    acc[0, :] = 0x7FFF_FFFF_FFFF_FFFF
    acc[1, :] = -0x7FFF_FFFF_FFFF_FFFF - 1
    for i in range(n):  # the tensor in memory order: each row (sample, channel) reduced, then merged
        for ch in range(c):
            row = bits[i, ch]
            kmin, kmax = np.int64(0x7FFF_FFFF_FFFF_FFFF), np.int64(-0x7FFF_FFFF_FFFF_FFFF - 1)
            nan = infs = at_max = zero = sub = np.int64(0)
            for j in range(s):
                v = np.int64(row[j])
                a = v & mask
                k = v ^ ((v >> 63) & mask)
                kmin = min(kmin, k)
                kmax = max(kmax, k)
                nan += np.int64(a > inf)
                infs += np.int64(a == inf)
                at_max += np.int64(a == big)
                zero += np.int64(a == 0)
                sub += np.int64((a != 0) & (a < tiny))
            acc[0, ch] = min(acc[0, ch], kmin)
            acc[1, ch] = max(acc[1, ch], kmax)
            acc[2, ch] += nan
            acc[3, ch] += infs
            acc[4, ch] += at_max
            acc[5, ch] += zero
            acc[6, ch] += sub
    for ch in range(c):
        kmin, kmax = acc[0, ch], acc[1, ch]
        if n * s == 0 or acc[2, ch]:  # no value, or a NaN: min and max are NaN
            out[0, ch] = out[1, ch] = np.nan
        else:
            out[0, ch] = _value(kmin ^ ((kmin >> 63) & mask), kind)  # the key's involution gives the bits back
            out[1, ch] = _value(kmax ^ ((kmax >> 63) & mask), kind)
        for q in range(2, 7):
            out[q, ch] = acc[q, ch]

"""What the compiled route's kernels and their caller (``bnprobe.kernels.fused``) agree on: a format as the
tuple of floats the kernels take (:data:`SPEC_FIELDS`), the codes of the reduction orders, addends and
formulas, the layout of a stage's counters and of one rounding's events, and numba's options.

Imported with the kernels (``bnprobe.compiled.kernels``), only when a kernel runs.
"""

from __future__ import annotations

import numpy as np
from numba import config, njit

# a format and its rounding, as the tuple of floats the kernels take
SPEC_FIELDS: tuple[str, ...] = ("kind", "mantissa_bits", "emin", "rounding", "saturate", "flush", "max", "tiny")
KIND_FP64, KIND_FP32, KIND_BITS = 0.0, 1.0, 2.0  # identity; a float32 cast (nearest-even); integer rounding
ROUNDING_CODES: dict[str, int] = {"nearest_even": 0, "nearest_away": 1, "toward_zero": 2, "up": 3, "down": 4}
# counters of one stage, in Trace's order (COUNTERS without "negative", which no elementwise stage has)
N_COUNTS = 8
(COUNT_NAN, COUNT_POSINF, COUNT_NEGINF, COUNT_OVERFLOW, COUNT_SATURATED, COUNT_UNDERFLOW, COUNT_FLUSHED,
 COUNT_SUBNORMAL) = range(8)
# events of one rounding, as bits
EV_OVERFLOW, EV_SATURATED, EV_UNDERFLOW, EV_FLUSHED = 1, 2, 4, 8

# reduction orders and the addends a reduction forms
ORDER_CODES: dict[str, int] = {"sequential": 0, "pairwise": 1, "lanes": 2}
ADD_X, ADD_SQUARE, ADD_DEV_SQUARE, ADD_PRODUCT = 0, 1, 2, 3
# y formulas (policy.Y_FORMULAS) and dx formulas
Y_XHAT, Y_SCALE, Y_AFFINE = 0, 1, 2
DX_STANDARD, DX_ASCEND, DX_CONSTANT = 0, 1, 2
# normalise's stages, in the order Trace records them
N_X_COMPUTE, N_CENTERED, N_XHAT, N_AFFINE, N_Y = range(5)

# numba's thread ids are below this: read in each process and passed to the kernels (a cached kernel must not
# keep the value of the process that compiled it)
THREAD_SLOTS = config.NUMBA_NUM_THREADS

# every kernel's and helper's numba options: compiled code cached (where: see fused.kernels), the GIL released
JIT_OPTIONS = dict(cache=True, nogil=True)


def _new_stats(k, stages):
    cnt = np.zeros((k, stages, N_COUNTS), dtype=np.int64)
    rg = np.empty((k, stages, 2), dtype=np.float64)
    rg[:, :, 0] = np.inf
    rg[:, :, 1] = -np.inf
    return cnt, rg


# the counters (k, stages, N_COUNTS) and ranges (k, stages, [least, greatest]) of a pass, empty
new_stats = njit(**JIT_OPTIONS)(_new_stats)

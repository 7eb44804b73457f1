"""The compiled route: BatchNorm's elementwise passes and reductions as numba kernels, the one module
``bnprobe.kernels.fused`` loads and calls them through.

Two families, one module each:

- the general kernels (``compiled_general``): any format and rounding the route takes, on float64 blocks,
  rounded in float64 exactly as the numpy route rounds, every counter counted;
- the fast kernels (``compiled_fast``): binary32 arithmetic for runs whose every operation is fp32 with the
  default rounding, vectorised, which flag the channels where something rare may have happened for the
  general kernels to compute again.

Both take the codes of ``compiled_codes`` (a format as a tuple of floats, :data:`SPEC_FIELDS`).  Channels run
in parallel (``prange``); each channel is computed by one thread from start to end, so results do not depend
on the thread count.

Imported only when a kernel runs with the compiled route (see ``bnprobe.kernels.fused``), so that
``import bnprobe`` and ``bnprobe --help`` never load numba.
"""

from __future__ import annotations

from bnprobe.compiled.codes import (
    ADD_DEV_SQUARE,
    ADD_PRODUCT,
    ADD_SQUARE,
    ADD_X,
    DX_ASCEND,
    DX_CONSTANT,
    DX_STANDARD,
    KIND_BITS,
    KIND_FP32,
    KIND_FP64,
    ORDER_CODES,
    ROUNDING_CODES,
    SPEC_FIELDS,
    THREAD_SLOTS,
    Y_AFFINE,
    Y_SCALE,
    Y_XHAT,
)
from bnprobe.compiled.fast import (
    backward_fast,
    center_scale_fast,
    dx_fast,
    dx_source_fast,
    load_fast,
    normalise_fast,
    reduce_fast,
)
from bnprobe.compiled.general import cast, center_scale, dx, normalise, reduce

__all__ = [
    # the general kernels
    "cast", "reduce", "normalise", "center_scale", "dx",
    # the fast kernels
    "load_fast", "reduce_fast", "backward_fast", "dx_source_fast", "normalise_fast", "center_scale_fast", "dx_fast",
    # the codes fused passes them
    "SPEC_FIELDS", "KIND_FP64", "KIND_FP32", "KIND_BITS", "ROUNDING_CODES", "ORDER_CODES", "THREAD_SLOTS",
    "ADD_X", "ADD_SQUARE", "ADD_DEV_SQUARE", "ADD_PRODUCT", "Y_XHAT", "Y_SCALE", "Y_AFFINE",
    "DX_STANDARD", "DX_ASCEND", "DX_CONSTANT",
]

"""The doctor's catalogue of known LayerNorm, RMSNorm, GroupNorm and InstanceNorm defects, each taken from a public
thread and each an emulated policy of :mod:`bnprobe.kernels.norms`: the careful kernel (fp32 statistics and
arithmetic, two-pass variance, x̂·γ + β rounded once) with the one choice the thread describes.

A model names a kernel's failure only where its emulation reproduces the failing outputs on that input
(:func:`reproduces`): bit for bit, or within the judge's bound of them (the error a correct kernel's accumulation
can make, plus half an ulp, element by element) — never the closest model when none is close."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.formats import get_format
from bnprobe.engine.rules import within_bound
from bnprobe.kernels.policy import Policy

__all__ = ["FamilyBug", "FAMILY_BUGS", "model_policies", "reproduces", "BIT_FOR_BIT", "WITHIN_BOUND",
           "THREAD_CANDIDATES"]

NARROW = ("fp16", "bf16")
#: the thread counts the per-thread-buffer model tries when the kernel declares none (and the machine's cores)
THREAD_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
BIT_FOR_BIT = "bit for bit"
WITHIN_BOUND = "within the judge's bound"


@dataclass(frozen=True)
class FamilyBug:
    """One defect: its id, what it does in words (``{fmt}``: the run's format), the public thread it is from, the
    outputs it changes, the layers and formats it applies to, and the policy changes that make the careful kernel
    into it (``options(fmt)``); ``threads``: the model takes its thread count from the kernel (PyTorch's per-thread
    buffers), each candidate one policy."""

    id: str
    text: str
    thread: str
    outputs: tuple[str, ...]
    layers: tuple[str, ...]
    narrow_only: bool
    options: Callable[[str], dict[str, Any]]
    threads: bool = False

    def applies(self, norm: str, fmt: str) -> bool:
        """Whether the model is a defect of ``norm`` in ``fmt`` (a 16-bit defect is the careful kernel in fp32)."""
        return norm in self.layers and (fmt in NARROW or not self.narrow_only)

    def words(self, fmt: str) -> str:
        """The model in words, with its thread."""
        return f"{self.text.format(fmt=get_format(fmt).name)} ({self.thread})"


_ALL = ("layer", "rms", "group", "instance")
_CENTRED = ("layer", "group", "instance")
_PARAMS = ("dgamma", "dbeta")

FAMILY_BUGS: tuple[FamilyBug, ...] = (
    FamilyBug("one-pass-variance", "variance taken in one pass as E[x²] − E[x]², not clamped: it cancels at a large "
                                   "mean, goes negative and gives NaN",
              "microsoft/onnxruntime#28463: [40000, 40001, 40002, 40003] normalises to NaN",
              ("y", "saved_rstd", "dx", "dgamma"), _CENTRED, False,
              lambda fmt: {"variance": "naive", "clamp_var": False}),
    FamilyBug("statistics-accumulated-in-16-bit", "sums accumulated in x's format ({fmt}) — in fp16 the sum of "
                                                  "squares overflows past 65504: rstd 0, y all zeros",
              "microsoft/onnxruntime#29034, fixed by #29043",
              ("y", "saved_mean", "saved_rstd", "dx", "dgamma", "dbeta"), _ALL, True,
              lambda fmt: {"accumulate": fmt}),
    FamilyBug("eps-in-16-bit", "ε rounded to x's format ({fmt}) before it is added",
              "pytorch/pytorch#140092, fixed by #142848", ("y", "saved_rstd", "dx", "dgamma"), _ALL, True,
              lambda fmt: {"eps_format": fmt}),
    FamilyBug("xhat-cast-before-gamma", "x̂ rounded to x's format ({fmt}) before γ multiplies it: two roundings where "
                                        "a kernel meant to round once has one",
              "HF Llama's RMSNorm against TransformerEngine's, NVIDIA/TransformerEngine#1132", ("y",), _ALL, True,
              lambda fmt: {"cast_point": "before_gamma"}),
    FamilyBug("rstd-rounded-to-16-bit", "rstd rounded to x's format ({fmt}) before x is multiplied by it",
              "amd/IRON#139: inv_rms cast to bf16", ("y", "dx", "dgamma"), _ALL, True,
              lambda fmt: {"rstd_cast": fmt}),
    FamilyBug("approximate-rsqrt", "rstd from an approximate rsqrt (a 12-bit estimate) without a Newton step",
              "tenstorrent/tt-metal#51420", ("y", "saved_rstd", "dx", "dgamma"), _ALL, False,
              lambda fmt: {"rsqrt": "table", "rsqrt_bits": 12, "rsqrt_newton": 0}),
    FamilyBug("dgamma-summed-in-16-bit", "dγ and dβ reduced in x's format ({fmt}): each product and each partial sum "
                                         "rounded to it",
              "linkedin/Liger-Kernel#950: tl.sum over a bf16 tensor", _PARAMS, _ALL, True,
              lambda fmt: {"grad_sum_format": fmt}),
    FamilyBug("dgamma-per-thread-16-bit-buffers", "dγ, dβ summed in per-thread buffers of x's format ({fmt}), the "
                                                  "buffers added in fp32",
              "PyTorch's CPU LayerNorm backward: layer_norm_kernel.cpp", _PARAMS, _ALL, True,
              lambda fmt: {"grad_sum_format": fmt, "order": "sequential"}, threads=True),
)


def model_policies(bug: FamilyBug, careful: Policy, declared: int | None) -> list[Policy]:
    """The policies of ``bug``'s model on top of ``careful`` (the careful kernel's policy in the run's formats): one,
    or for a model that takes the kernel's thread count one per candidate — the kernel's declared threads first
    (``declared``, its Capabilities.threads), then the machine's cores, then :data:`THREAD_CANDIDATES`."""
    fmt = careful.storage
    base = careful.with_options(name=f"{careful.name}+{bug.id}", **bug.options(fmt))
    if not bug.threads:
        return [base]
    counts = [t for t in (declared, os.cpu_count(), *THREAD_CANDIDATES) if t]
    return [base.with_options(threads=t) for t in dict.fromkeys(counts)]


def _rms(d: np.ndarray) -> float:
    with np.errstate(all="ignore"):
        return float(np.sqrt(np.nanmean(d * d))) if d.size else 0.0


def reproduces(got: Any, model: Any, *, golden: Any, fmt: str, bound: tuple[np.ndarray, str] | None) -> str | None:
    """How a model's output reproduces a kernel's: :data:`BIT_FOR_BIT`; or :data:`WITHIN_BOUND` — every element
    within the judge's bound of the model's (the error a correct kernel's accumulation can make there, ``bound``, one
    per element, plus half an ulp: compare-precision's :func:`~bnprobe.engine.rules.within_bound` with the model in
    the golden's place) and the kernel's RMS distance to the model at most half its distance to the golden (the model
    explains the error); else None (NaN or inf where the model has none, or the other way round: not the same
    kernel)."""
    a = np.asarray(got, dtype=np.float64)
    m = np.asarray(model, dtype=np.float64).reshape(a.shape) if np.size(model) == a.size else None
    if m is None:
        return None
    if np.array_equal(a, m, equal_nan=True):
        return BIT_FOR_BIT
    if not np.array_equal(np.isfinite(a), np.isfinite(m)) or bound is None:
        return None
    fin = np.isfinite(a)
    if not np.array_equal(a[~fin], m[~fin], equal_nan=True):
        return None
    g = np.asarray(golden, dtype=np.float64).reshape(a.shape)
    if np.size(bound[0]) != a.size:
        return None
    b = (np.asarray(bound[0], dtype=np.float64).reshape(a.shape), bound[1])
    with np.errstate(all="ignore"):
        explains = _rms((a - m)[fin]) <= 0.5 * _rms((a - g)[fin & np.isfinite(g)])
        return WITHIN_BOUND if explains and within_bound(np.where(fin, a, 0.0), np.where(fin, m, 0.0), fmt, b) \
            is not None else None

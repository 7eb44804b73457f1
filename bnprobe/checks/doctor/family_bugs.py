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

from bnprobe.adapters.base import Capabilities, Saved, outputs_only
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.core.call import NORMS
from bnprobe.core.formats import get_format
from bnprobe.engine.rules import within_bound
from bnprobe.kernels.policy import Policy

__all__ = ["FamilyBug", "FAMILY_BUGS", "model_policies", "reproduces", "BIT_FOR_BIT", "WITHIN_BOUND",
           "THREAD_CANDIDATES", "model_outputs", "reproduced_by", "models_of", "BACKWARD_OUTPUTS"]

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
    FamilyBug("normalised-in-16-bit", "y = (x − μ)/σ·γ + β with every step in x's format ({fmt}): μ and σ rounded "
                                      "to it first — at a large mean the rounded μ is off by up to half its ulp "
                                      "(1/32 at 100 in fp16)",
              "MindSpore's CPU LayerNorm with 16-bit γ, β: layer_norm_cpu_kernel.cc, LaunchKernel<float16>",
              ("y",), _CENTRED, True, lambda fmt: {"compute": fmt, "rsqrt": "sqrt_div", "y_formula": "xhat_div"}),
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


def models_of(tensor: str, norm: str, fmt: str) -> list[FamilyBug]:
    """The models that change ``tensor`` and are defects of the layer ``norm`` in the format ``fmt``."""
    return [b for b in FAMILY_BUGS if tensor in b.outputs and b.applies(norm, fmt)]


#: the outputs of a family call's backward (the rest are its forward's)
BACKWARD_OUTPUTS = ("dx", "dgamma", "dbeta")


def model_outputs(policy: Policy, rec: Any, modes: tuple[str, ...], saved: Saved | None,
                  part: str = "forward") -> dict[str, Any]:
    """A bug model's outputs (its emulated kernel under ``policy``) on a recorded family call ``rec``: its forward's
    (``part`` forward), or — where ``modes`` hold the backward and the kernel saved statistics (``saved``) — its
    backward's from those statistics, as the kernel's backward takes them (a forward's defect reaches the backward
    through them; ``part`` backward)."""
    caps = Capabilities(formats=(policy.storage,), traced=True, norms=NORMS)
    a = outputs_only(PolicyAdapter(f"emulated:{policy.name}", lambda p, mode: policy, caps))
    call = rec.call()
    out: dict[str, Any] = {}
    with np.errstate(all="ignore"):
        if part == "forward":
            fwd = a.train(call.with_inputs(rec.tensors["train"]["inputs"]))
            out["y"] = fwd.y
            if fwd.saved is not None:
                out.update({"saved_rstd": fwd.saved.value} if fwd.saved.mean is None else
                           {"saved_mean": fwd.saved.mean, "saved_rstd": fwd.saved.value})
        elif "backward" in modes and saved is not None:
            ins = rec.tensors["backward"]["inputs"]
            g = a.backward_of(call.with_(dy=ins["dy"], x=ins["x"], gamma=ins.get("gamma")), saved)
            out.update({"dx": g.dx, "dgamma": g.dgamma, **({} if g.dbeta is None else {"dbeta": g.dbeta})})
    return out


def reproduced_by(bug: FamilyBug, tensor: str, got: Any, golden: Any, fmt: str,
                  bound: tuple[np.ndarray, str] | None, *, careful: Policy, threads: int | None,
                  outputs: Callable[[str, Policy], dict[str, Any]]) -> tuple[str, int | None] | None:
    """How ``bug``'s model reproduces a kernel's output ``tensor`` (``got``, returned in ``fmt``; the golden's
    ``golden``, the judge's ``bound``) — :func:`reproduces` — and the thread count it took, or None.  ``outputs(key,
    policy, part)`` gives the model's outputs of its forward or its backward on the call (:func:`model_outputs`,
    kept by the caller under ``key``); a model that takes the kernel's thread count tries each candidate, the
    kernel's declared ``threads`` first."""
    part = "backward" if tensor in BACKWARD_OUTPUTS else "forward"
    for pol in model_policies(bug, careful, threads):
        out = outputs(f"{bug.id}/{pol.threads}/{part}", pol, part).get(tensor)
        how = None if out is None else reproduces(got, out, golden=golden, fmt=fmt, bound=bound)
        if how is not None:
            return how, pol.threads if bug.threads else None
    return None


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

"""An emulator of how Ascend NPU kernels compute BatchNorm, from their public operator sources: CANN's TBE
operators (``bn_training_reduce.py``, ``bn_training_update.py``, ``bn_training_reduce_grad.py``,
``bn_training_update_grad.py``) and BatchNormV3 in hicann/ops-nn (``norm/batch_norm_v3``, ``arch35`` for 950).

Presets
-------
``ascend-tbe``   BNTrainingReduce + BNTrainingUpdate (classic 910, A2/A3 outside BatchNormV3's
                 cases): FP32 sum and sum of squares, mean = sum·fl(1/R), single-pass variance
                 (clamped at 0 on 310P/910B and later), mult = γ/sqrt(var+ε) with the division as a
                 reciprocal estimate + Newton steps where the chip has no divider, y = mult·x +
                 addend; saves the biased variance; running var with R/(R-1), 0 for R = 1; when
                 fewer channel blocks (C1 = ceil(C/16)) than cores, N·H·W is split across cores and
                 the partial sums are combined by FP32 atomic adds in a random order that changes
                 from call to call (seeded), as the hardware's arrival order does.
``ascend-bnv3``  A2 BatchNormV3: R < 8192 two-pass with pre-scaled pairwise trees, R >= 8192 64-lane
                 Welford (mean += δ·fl(1/n), M2 += δ²·fl((n-1)/n)) merged by Chan's formula;
                 y = (x - mean)·w + β with w = γ/sqrt(var+ε) on the scalar unit; BF16 output rounded
                 half away from zero; running var NaN for R = 1; channels split across cores only.
``ascend-950``   rstd via 1/v, sqrt and two Newton corrections (the second with an FMA residual);
                 per-core partials merged deterministically by Chan's formula; saves invstd.
Inference is BNInfer: y = A·x + B from the running statistics.

Options: ``ascend-tbe:chip=910`` (910, 910b, 910_93, 310p, 310, 950), ``cores=N``, ``seed=S``.
What those sources do not show, and is inferred (the reciprocal estimate's precision, modelled as a
12-bit table; the in-core reduction order, modelled as 64 lanes; the A2 BatchNormV3 backward,
modelled as the TBE BNTrainingReduceGrad form), is a modelling choice and says so here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnprobe.adapters.base import Capabilities, Prepared
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.policy import Policy

__all__ = ["CHIPS", "Chip", "AscendAdapter", "KERNELS", "C0"]

C0 = 16  # NC1HWC0: channels are padded to blocks of 16
BNV3_WELFORD_FROM = 8192  # BatchNormV3 switches from the full-reduce to the Welford path at this R


@dataclass(frozen=True)
class Chip:
    name: str
    overflow: str  # "ieee" or "saturate"
    clamp_var: bool  # the TBE single-pass variance is clamped at 0 on 310P/910B and later
    native_div: bool  # vdiv in hardware; otherwise reciprocal estimate + Newton
    recip_newton: int
    cores: int


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("910", "saturate", False, False, 2, 32),  # classic 910 training: saturation mode
    Chip("910b", "ieee", True, False, 2, 24),  # Atlas A2
    Chip("910_93", "ieee", True, False, 2, 24),  # Atlas A3
    Chip("310p", "saturate", True, False, 2, 8),
    Chip("310", "saturate", False, False, 1, 2),
    Chip("950", "ieee", True, True, 2, 32),
)}
KERNELS: dict[str, str] = {"tbe": "910b", "bnv3": "910b", "950": "950"}  # kernel -> default chip


def _chip_options(kernel: str, options: dict[str, str]) -> tuple[Chip, int, int]:
    chip_name = options.pop("chip", KERNELS[kernel])
    if chip_name not in CHIPS:
        raise BNProbeError(f"unknown Ascend chip {chip_name!r}; valid: {', '.join(CHIPS)}")
    chip = CHIPS[chip_name]
    try:
        cores = int(options.pop("cores", chip.cores))
        seed = int(options.pop("seed", 0))
    except ValueError:
        raise BNProbeError("ascend options cores= and seed= take integers") from None
    if cores < 1:
        raise BNProbeError(f"cores must be >= 1, got {cores}")
    if options:
        raise BNProbeError(f"unknown ascend option(s) {', '.join(options)}; valid: chip, cores, seed")
    return chip, cores, seed


class AscendAdapter(PolicyAdapter):
    """``ascend-tbe``, ``ascend-bnv3``, ``ascend-950``, with ``:chip=...,cores=N,seed=S`` options."""

    def __init__(self, kernel: str, options: str = "") -> None:
        if kernel not in KERNELS:
            raise BNProbeError(f"unknown Ascend kernel {kernel!r}; valid: {', '.join(KERNELS)}")
        opts: dict[str, str] = {}
        for item in filter(None, (o.strip() for o in options.split(","))):
            k, eq, v = item.partition("=")
            if not eq:
                raise BNProbeError(f"ascend option {item!r} is not key=value")
            opts[k.strip()] = v.strip()
        self.kernel = kernel
        self.chip, self.cores, seed = _chip_options(kernel, opts)
        self._calls = 0
        self._rng = np.random.default_rng([seed, 0xA5CE])
        name = f"ascend-{kernel}" + (f":{options}" if options else "")
        caps = Capabilities(formats=("fp32", "fp16", "bf16"), saved="invstd" if kernel == "950" else "var",
                            deterministic=kernel != "tbe", traced=True, training_r1=True)
        super().__init__(name, self._policy_for, caps)

    def _common(self, p: Prepared) -> dict[str, object]:
        chip = self.chip
        return dict(storage=p.dtype, params="fp32", compute="fp32", accumulate="fp32", overflow=chip.overflow,
                    division="exact" if chip.native_div else "reciprocal", recip="table", recip_bits=12,
                    recip_newton=chip.recip_newton, backward_formula="ascend")

    def _policy_for(self, p: Prepared, mode: str) -> Policy:
        common = self._common(p)
        r = p.lay.reduce_size
        seed = int(self._rng.integers(2**31))  # a new atomic-add order on every call, like the hardware
        self._calls += 1
        if mode == "infer":  # BNInfer: y = A·x + B from the running statistics
            rsqrt = "ascend950" if self.kernel == "950" else "sqrt_div"
            return Policy(name=f"{self.name}/BNInfer", y_formula="affine", rsqrt=rsqrt, **common)  # type: ignore[arg-type]
        if self.kernel == "tbe":
            c1 = -(-p.lay.channels // C0)
            parts = 1 if c1 >= self.cores else min(max(1, self.cores // c1), r)
            return Policy(name=f"{self.name}/BNTraining", variance="naive", mean_by="reciprocal", order="lanes",
                          lanes=64, clamp_var=self.chip.clamp_var, y_formula="affine", rsqrt="sqrt_div",
                          core_parts=parts, core_combine="atomic", unbiased_r1="zero", seed=seed,
                          **common)  # type: ignore[arg-type]
        if self.kernel == "bnv3":
            big = r >= BNV3_WELFORD_FROM
            out_round = "nearest_away" if p.dtype == "bf16" else None
            common = {**common, "division": "exact"}  # w is formed on the scalar unit, which divides
            if big:
                return Policy(name=f"{self.name}/BatchNormV3-welford", variance="welford_ascend", lanes=64,
                              order="pairwise", y_formula="scale", rsqrt="sqrt_div", output_rounding=out_round,
                              unbiased_r1="nan", **common)  # type: ignore[arg-type]
            return Policy(name=f"{self.name}/BatchNormV3-full-reduce", variance="two_pass", order="pairwise",
                          mean_by="prescaled", y_formula="scale", rsqrt="sqrt_div", output_rounding=out_round,
                          unbiased_r1="nan", **common)  # type: ignore[arg-type]
        # 950: per-core partials (tiles = cores), deterministic Chan merge; its own rstd sequence
        return Policy(name=f"{self.name}/BatchNormV3-arch35", variance="chan", tiles=self.cores, order="pairwise",
                      y_formula="scale", rsqrt="ascend950", fma=True, unbiased_r1="nan",
                      **common)  # type: ignore[arg-type]

"""Adapters backed by bnprobe's instrumented kernels: the FP64 reference and any emulated Policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.adapters.base import (BackwardOutput, BaseAdapter, Capabilities, FamilyPrepared, ForwardOutput, Prepared,
                                   Saved)
from bnprobe.core.call import NORMS
from bnprobe.core.conventions import get_convention
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.kernels import Execution, backward, forward_infer, forward_train, get_policy
from bnprobe.kernels.norms import backward as family_backward
from bnprobe.kernels.norms import forward as family_forward
from bnprobe.kernels.policy import Policy
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.rsqrt import divide
from bnprobe.numerics.rsqrt import sqrt as nsqrt

__all__ = ["PolicyAdapter", "ReferenceAdapter", "EmulatedAdapter", "CarefulAdapter", "careful_family_policy"]

ALL_FORMATS = ("fp64", "fp32", "fp16", "bf16")


# the methods that run a call: a subclass overriding any of them computes something other than its policy
RUNNING = ("train", "infer", "backward_of", "forward_train", "forward_infer", "backward", "_forward_train_impl",
           "_forward_infer_impl", "_backward_impl", "_family_forward_impl", "_family_backward_impl")


class PolicyAdapter(BaseAdapter):
    """Runs the instrumented kernels with a Policy chosen per call (by dtype, params format, shape, mode): its
    capabilities say so (``staged``: bnprobe can rerun it stage by stage, :meth:`policy_for` naming the policy).
    A subclass that overrides how a call runs (:data:`RUNNING`) is not staged: its outputs need not be its
    policy's, so no check may stand the policy's run in for its own."""

    def __init__(self, name: str, make_policy: Callable[[Prepared, str], Policy], caps: Capabilities) -> None:
        self.name = name
        self.keep_arrays = True  # keep every intermediate in the traces (False: counters and ranges only)
        self.counters = True  # False: no trace at all, the outputs alone (the same bits, without counting events)
        self._make_policy = make_policy
        own = all(getattr(type(self), m) is getattr(PolicyAdapter, m) for m in RUNNING)
        self._caps = replace(caps, staged=own)

    def capabilities(self) -> Capabilities:
        return self._caps

    def policy(self, p: Prepared, mode: str) -> Policy:
        return self._make_policy(p, mode)

    def policy_for(self, x: np.ndarray, *, dtype: str, mode: str = "train", layout: str = "channels_first",
                   params: str = "fp32") -> Policy:
        """The Policy this adapter would run ``x`` with (for analyses that rerun the kernel themselves)."""
        p = self._prepare("infer" if mode == "infer" else "train", x, dtype, layout, params, {})
        return self.policy(p, mode)

    def _execution(self, p: Prepared) -> Execution:
        """How the kernels run a call: in its layout, keeping what this adapter's traces keep."""
        return Execution(layout=p.lay.layout, keep_arrays=self.keep_arrays, counters=self.counters)

    def _saved(self, res: Any) -> Saved:
        if self._caps.saved == "var":
            return Saved(res.mean, "var", res.var)
        return Saved(res.mean, "invstd", res.invstd)

    @staticmethod
    def _tensor(a: np.ndarray, p: Prepared, pol: Policy) -> np.ndarray:
        """A tensor the base rounded to the run's format (float64 holding its values) in that format's own dtype
        when it is the policy's storage format: the same values (the conversion is exact), but the compiled
        route's fast kernels read float32, fp16 and bf16 tensors, not float64 ones (those take the general
        kernels: the bench's backward on ResNet-50's largest BatchNorm input in compare-precision took 128 ms so,
        under 25 ms now), and the numpy route does not round them again."""
        dt = get_format(p.dtype).dtype
        if get_format(pol.storage).name != p.dtype or a.dtype == dt:
            return a
        with np.errstate(invalid="ignore"):  # (a NaN stays a NaN)
            return a.astype(dt)

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        pol = self.policy(p, "train")
        v = p.vectors
        res = forward_train(self._tensor(p.x, p, pol), v["gamma"], v["beta"], v["running_mean"], v["running_var"],
                            momentum=momentum, eps=eps, policy=pol, execution=self._execution(p))
        return ForwardOutput(res.y, self._saved(res), res.running_mean, res.running_var, res.trace,
                             {"policy": pol.describe()})

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        pol = self.policy(p, "infer")
        v = p.vectors
        res = forward_infer(self._tensor(p.x, p, pol), v["gamma"], v["beta"], v["running_mean"], v["running_var"],
                            eps=eps, policy=pol, execution=self._execution(p))
        return ForwardOutput(res.y, None, None, None, res.trace, {"policy": pol.describe()})

    def _invstd_from_var(self, var: np.ndarray, eps: float, pol: Policy) -> np.ndarray:
        """1/sqrt(var + eps) the way the policy's kernel recomputes it from a saved variance."""
        acc = Arith(pol.accumulate, pol.spec)
        with np.errstate(all="ignore"):
            var_eps = acc.add(acc.round(var), acc.round(eps))
            sigma = nsqrt(var_eps, acc, method=pol.sqrt)
            return divide(np.ones_like(sigma), sigma, acc, method=pol.division, recip_method=pol.recip,
                          newton=pol.recip_newton, form=pol.newton_form, bits=pol.recip_bits)

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        pol = self.policy(p, "backward")
        if saved.kind == "invstd":
            invstd, var = saved.value, None
        else:
            var = saved.value
            invstd = self._invstd_from_var(var, eps, pol)
        res = backward(self._tensor(dy, p, pol), self._tensor(p.x, p, pol), p.vectors["gamma"], saved.mean, invstd,
                       policy=pol, training=training, saved_var=var, eps=eps, execution=self._execution(p))
        return BackwardOutput(res.dx, res.dgamma, res.dbeta, res.trace, {"policy": pol.describe()})


    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        pol = self.policy(p, "train")  # type: ignore[arg-type]
        c = p.call
        # (x in its format's dtype: the compiled route reads it so, bnprobe.kernels.norms_compiled)
        res = family_forward(self._tensor(p.x, p, pol), p.gamma, p.beta, shape=p.shape,  # type: ignore[arg-type]
                             eps=eps, policy=pol, weight_offset=c.weight_offset, keep_arrays=self.keep_arrays,
                             counters=self.counters)
        return ForwardOutput(res.y, Saved(res.mean, "invstd", res.rstd), None, None, res.trace,
                             {"policy": pol.describe(), "param_trace": res.param_trace})

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved, *, eps: float) -> BackwardOutput:
        pol = self.policy(p, "backward")  # type: ignore[arg-type]
        res = family_backward(self._tensor(dy, p, pol), self._tensor(p.x, p, pol),  # type: ignore[arg-type]
                              p.gamma, saved.mean, saved.value, shape=p.shape, policy=pol,
                              weight_offset=p.call.weight_offset, keep_arrays=self.keep_arrays,
                              counters=self.counters)
        meta = {"policy": pol.describe(), "param_trace": res.param_trace}
        if res.dbeta is None:
            meta["missing"] = ("dbeta",)  # (RMSNorm has no β)
        return BackwardOutput(res.dx, res.dgamma, res.dbeta, res.trace, meta)  # type: ignore[arg-type]


class ReferenceAdapter(PolicyAdapter):
    """The FP64 golden: inputs rounded to the requested format, then everything computed in float64; its running
    variance updated with the variance ``convention`` says (:mod:`bnprobe.core.conventions`: unbiased by default)."""

    def __init__(self, convention: str = "torch") -> None:
        conv = get_convention(convention)
        gold = get_policy("fp64").with_options(name="reference", running_var=conv.running_var)
        name = "reference" if conv.name == "torch" else f"reference ({conv.name} convention)"
        super().__init__(name, lambda p, mode: gold,
                         Capabilities(formats=ALL_FORMATS, traced=True, output="fp64", convention=conv.name,
                                      golden=True, norms=NORMS))


class EmulatedAdapter(PolicyAdapter):
    """``emulated`` (the preset named by the dtype) or ``emulated:<policy spec>``."""

    def __init__(self, spec: str = "") -> None:
        if spec:
            base = get_policy(spec)

            def make(p: Prepared, mode: str) -> Policy:
                if p.dtype != base.storage:
                    raise BNProbeError(f"adapter emulated:{spec} runs {base.storage} only, not {p.dtype}")
                return base

            super().__init__(f"emulated:{spec}", make, Capabilities(formats=(base.storage,), traced=True,
                                                                    training_r1=base.unbiased_r1 != "error",
                                                                    params=base.params_format, norms=NORMS))
        else:
            def make(p: Prepared, mode: str) -> Policy:
                return get_policy(p.dtype).with_options(name=f"emulated:{p.dtype}", params=p.params)

            super().__init__("emulated", make, Capabilities(formats=ALL_FORMATS, traced=True, norms=NORMS))


def careful_family_policy(dtype: str, params: str, name: str = "careful") -> Policy:
    """The careful kernel's policy for a LayerNorm, RMSNorm, GroupNorm or InstanceNorm call in ``dtype`` with
    parameters in the format ``params`` (fp32 or the input's): the format's preset — fp32 sums, statistics and
    arithmetic, two-pass variance, x̂·γ + β rounded once."""
    return get_policy(dtype).with_options(name=f"{name}:{get_format(dtype).name}", params=params)


class CarefulAdapter(PolicyAdapter):
    """``careful``: the bench compare-precision judges kernels against, in the role msprobe gives a GPU —
    the best a kernel can do under the interface: each format's preset (fp32 sums, statistics and
    arithmetic, two-pass variance, pairwise order) with the run's parameter format, keeping the statistics
    it computed in its compute format for its own forward and rounding only what the interface stores
    (saved mean / invstd, running statistics, y), as CUDA's kernels do; inference is the folded
    y = x·A + B of cuDNN, PyTorch and Ascend's BNInfer.  A kernel that normalises with the statistics
    rounded to a narrow parameter format (PyTorch's CPU kernel with bf16/fp16 parameters,
    pytorch/pytorch#140112) is not the bench: it is judged against it."""

    def __init__(self, *, rounded_stats: bool = False, convention: str = "torch") -> None:
        """``rounded_stats``: the careful kernel with one choice changed, as :mod:`bnprobe.engine.recipes` names
        it — normalising with the statistics rounded to the parameter format (not the bench).  ``convention``: the
        running variance's bias of that framework (:mod:`bnprobe.core.conventions`)."""
        conv = get_convention(convention)
        name = "careful:rounded-stats" if rounded_stats else "careful"
        name += "" if conv.name == "torch" else f" ({conv.name} convention)"

        def make(p: Prepared | FamilyPrepared, mode: str) -> Policy:
            if isinstance(p, FamilyPrepared):  # a family layer's careful kernel: its statistics as computed, x̂·γ + β
                return careful_family_policy(p.dtype, p.params, name)
            narrow = rounded_stats and p.params not in ("fp32", "fp64")
            return get_policy(p.dtype).with_options(name=f"{name}:{p.dtype}", params=p.params, stored_stats=narrow,
                                                    y_formula="affine" if mode == "infer" else "xhat",
                                                    running_var=conv.running_var)

        super().__init__(name, make, Capabilities(formats=ALL_FORMATS, traced=True, convention=conv.name,
                                                  norms=NORMS if not rounded_stats else ("batch",)))

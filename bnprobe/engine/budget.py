"""The error budget: which stage of an emulated kernel its output's error comes from."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from bnprobe.adapters.base import params_format
from bnprobe.core.call import EPS
from bnprobe.kernels import Execution, forward_train
from bnprobe.numerics.rounding import round_to

__all__ = ["BUDGET_CHANNELS", "error_budget", "budget_cause"]

BUDGET_CHANNELS = 8  # the error budget reruns the kernel on the first channels of a layer (channels are independent)


def error_budget(adapter: Any, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, *, dtype: str,
                 eps: float = EPS, params: str = "fp32", channels: int = BUDGET_CHANNELS) -> list[dict[str, Any]]:
    """Rerun the training forward of an emulated kernel (``adapter``'s capabilities say it is staged: its
    ``policy_for`` names its policy) with one stage at a time replaced by its FP64 value (the same stage of the
    golden run on the same inputs); report how much of the output's error (RMSE of y against the golden)
    disappears.  The output cast's share is y left unrounded.  Every stage downstream of an error's source removes
    it too, so the *cause* is the earliest stage, in computation order, that removes most of it (see
    :func:`budget_cause`).  Shares need not add up to 100%."""
    k = min(channels, x.shape[1])
    xs = np.ascontiguousarray(x[:, :k])
    pf = params_format(dtype, params)
    xs = round_to(xs, dtype)
    g, b = round_to(gamma[:k], pf), round_to(beta[:k], pf)
    pol = adapter.policy_for(xs, dtype=dtype, params=params)
    pol = replace(pol, core_combine="ordered") if pol.core_combine == "atomic" else pol  # same order every rerun
    gold = forward_train(xs, g, b, eps=eps, policy=pol.golden())
    base = forward_train(xs, g, b, eps=eps, policy=pol)
    gy = gold.trace["y"].value

    def rmse(res: Any) -> float:
        """Error of the y stage as the kernel formed it (the trace's value: an override of y survives there)."""
        with np.errstate(all="ignore"):
            d = res.trace["y"].value - gy
            d = d[~np.isnan(d)]
            return float(np.sqrt(np.mean(d * d))) if d.size else float("nan")

    e0 = rmse(base)
    rows = []
    skip = {"x", "x_acc", "x_compute", "var_unbiased", "running_mean", "running_var"}
    for st in base.trace:
        if st.name in skip:
            continue
        if st.name == "y":  # the output cast: y at its unrounded (compute-format) value
            ov, label = {"y": st.wide}, "y (output cast)"
        elif st.name in gold.trace:
            ov, label = {st.name: gold.trace[st.name].value}, st.name
        else:
            continue
        e = rmse(forward_train(xs, g, b, eps=eps, policy=pol, execution=Execution(overrides=ov)))
        removed = (1.0 - e / e0) if e0 > 0 else 0.0
        rows.append({"adapter": adapter.name, "dtype": dtype, "order": len(rows), "stage": label,
                     "format": st.format, "rmse_with_stage_exact": e, "rmse": e0, "error_removed": removed})
    return rows


def budget_cause(shares: list[tuple[str, float]], share: float = 0.9) -> tuple[str, float]:
    """The earliest stage (``shares`` in computation order) removing at least ``share`` of the largest
    removal: the intermediate where the error arises."""
    if not shares:
        return "", float("nan")
    top = max(v for _, v in shares)
    if not top > 0:
        return "", top
    for stage, v in shares:
        if v >= share * top:
            return stage, v
    return shares[-1]

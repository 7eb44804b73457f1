"""The numerical recipes a kernel may follow where its interface leaves it free, each a careful kernel with one
choice changed, to name what a failing output matches.

compare-precision fails an output against the careful bench (the best a kernel can do under the interface); when
a recipe reproduces the kernel's failing output — the kernel is no farther from the recipe than the bench is from
the golden (or one ulp RMS of the output), and at most half as far as it is from the golden — the failure is
named by that recipe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.adapters.base import params_format
from bnprobe.adapters.emulated import CarefulAdapter
from bnprobe.call import BNCall
from bnprobe.formats import get_format

__all__ = ["Recipe", "RECIPES", "RECIPE", "STATS_ROUNDED", "recipe_fits"]

STATS_ROUNDED = "stats-rounded-to-params"


@dataclass(frozen=True)
class Recipe:
    """One recipe: its id, what it does in words, a note (who is known to do it), the kernel that follows it, the
    calls it can differ on and the outputs it changes."""

    id: str
    text: str
    note: str
    kernel: Callable[[], Any]
    applies: Callable[[BNCall], bool]
    outputs: tuple[str, ...]

    def words(self, call: BNCall) -> str:
        return f"{self.text.format(params=params_format(call.dtype, call.params))} ({self.note})"


RECIPES: tuple[Recipe, ...] = (
    Recipe(STATS_ROUNDED, "normalises with the batch statistics rounded to the parameter format ({params}) before "
                          "using them, where a careful kernel keeps them in its compute format and rounds only what it "
                          "stores",
           "PyTorch's CPU kernel does this with same-format parameters: pytorch/pytorch#140112",
           lambda: CarefulAdapter(rounded_stats=True),
           lambda call: call.training and params_format(call.dtype, call.params) not in ("fp32", "fp64"), ("y",)),
)

RECIPE = {rp.id: rp for rp in RECIPES}  # by id (a compare-precision row's ``cause``)


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(all="ignore"):
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
        d = d[np.isfinite(d)]
    return float(np.sqrt(np.mean(d * d))) if d.size else float("nan")


def recipe_fits(got: Any, recipe_out: Any, bench: Any, golden: Any, fmt: str) -> bool:
    """Whether a recipe's output reproduces a kernel's: within the bench's own error against the golden (or one
    ulp RMS of the output, whichever is larger) and at most half the kernel's error against the golden."""
    g = np.asarray(golden, dtype=np.float64)
    if np.shape(got) != g.shape or np.shape(recipe_out) != g.shape:
        return False
    ulp = get_format(fmt).ulp(g[np.isfinite(g)])
    floor = max(_rmse(bench, g), float(np.sqrt(np.mean(ulp * ulp))) if ulp.size else 0.0)
    to_recipe, to_gold = _rmse(got, recipe_out), _rmse(got, g)
    return bool(to_recipe <= floor and to_recipe <= 0.5 * to_gold)

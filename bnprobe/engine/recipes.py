"""The numerical recipes a kernel may follow where its interface leaves it free, each a careful kernel with one
choice changed, to name what a failing output matches.

compare-precision fails an output against the careful bench (the best a kernel can do under the interface); when
a recipe reproduces the kernel's failing output — the kernel is no farther from the recipe than the bench is from
the golden (or one ulp RMS of the output), and at most half as far as it is from the golden — the failure is
named by that recipe.  A recipe's outputs come from a careful kernel with the choice changed, run on the call, or
are derived from what the kernel itself returned (its y recomputed from the statistics it stored, whatever way it
computed them): a kernel whose statistics differ from the careful ones by an ulp is still named by what it does
with them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.adapters.base import Saved, outputs_only, params_format
from bnprobe.adapters.emulated import CarefulAdapter, ReferenceAdapter
from bnprobe.core.call import BNCall
from bnprobe.core.formats import get_format

__all__ = ["Recipe", "RECIPES", "RECIPE", "STATS_ROUNDED", "RUNNING_IN_PARAMS", "VAR_ABOUT_STORED_MEAN",
           "SAVED_IN_INPUT_FORMAT", "recipe_fits"]

STATS_ROUNDED = "stats-rounded-to-params"
RUNNING_IN_PARAMS = "running-update-in-params"
VAR_ABOUT_STORED_MEAN = "variance-about-stored-mean"
SAVED_IN_INPUT_FORMAT = "saved-stats-in-input-format"


@dataclass(frozen=True)
class Recipe:
    """One recipe: its id, what it does in words, a note (who is known to do it), the kernel that follows it (or
    None), the calls it can differ on, the outputs it changes, and ``derive``: the outputs it gives computed from
    the call and the kernel's own outputs (``got``, ``saved``: a :class:`~bnprobe.engine.run.CallRun`'s), or None."""

    id: str
    text: str
    note: str
    kernel: Callable[[], Any] | None
    applies: Callable[[BNCall], bool]
    outputs: tuple[str, ...]
    derive: Callable[[BNCall, dict[str, Any], Any], dict[str, Any]] | None = None  # an array or a list of them

    def words(self, call: BNCall) -> str:
        return f"{self.text.format(params=params_format(call.dtype, call.params), dtype=get_format(call.dtype).name)}" \
            f" ({self.note})"


def _training_narrow(call: BNCall) -> bool:
    """A training call whose parameters (and so its stored statistics) are in a 16-bit format."""
    return call.training and params_format(call.dtype, call.params) not in ("fp32", "fp64")


def _var_about(x: np.ndarray, mean: Any) -> np.ndarray:
    """Per channel, mean((x − mean)²) of channels-first ``x`` about the per-channel ``mean`` (biased)."""
    from bnprobe.kernels.layout import layout_of, reduce_axes

    with np.errstate(all="ignore"):
        d = x - layout_of(x).column(np.asarray(mean, dtype=np.float64))
        return (d * d).mean(axis=reduce_axes(x))


def _y_from(call: BNCall, mean: np.ndarray, invstd: np.ndarray, fmt: str) -> np.ndarray:
    """y normalised exactly with these statistics, rounded once to ``fmt``."""
    from bnprobe.kernels.layout import layout_of
    from bnprobe.numerics.rounding import round_to

    lay = layout_of(call.x)
    c = np.shape(mean)[0]
    g = np.ones(c) if call.gamma is None else np.asarray(call.gamma, dtype=np.float64)
    b = np.zeros(c) if call.beta is None else np.asarray(call.beta, dtype=np.float64)
    with np.errstate(all="ignore"):
        y = ((np.asarray(call.x, dtype=np.float64) - lay.column(np.asarray(mean, dtype=np.float64)))
             * lay.column(np.asarray(invstd, dtype=np.float64) * g) + lay.column(b))
    return round_to(y, fmt)


def _rounded_batch_stats(call: BNCall, pf: str) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((mean, invstd) of the batch as PyTorch's CPU kernel stores them: the mean and the variance each rounded to
    ``pf``, invstd from that variance rounded too; (mean, invstd) exact)."""
    from bnprobe.kernels.layout import reduce_axes
    from bnprobe.numerics.rounding import round_to

    x = np.asarray(call.x, dtype=np.float64)
    with np.errstate(all="ignore"):
        mean, var = x.mean(axis=reduce_axes(x)), x.var(axis=reduce_axes(x))
        rounded = (round_to(mean, pf), round_to(1.0 / np.sqrt(round_to(var, pf) + call.eps), pf))
        return rounded, (mean, 1.0 / np.sqrt(var + call.eps))


def _from_rounded(call: BNCall, got: dict[str, Any], saved: Any) -> dict[str, list[np.ndarray]]:
    """The outputs of a kernel that normalises with rounded statistics: y two ways — with the statistics the kernel
    stored (its saved mean and invstd, however it computed them), and, for a kernel that saves none, as in a dump of
    torch's functional call, with the batch's as PyTorch's CPU kernel stores them (:func:`_rounded_batch_stats`) —
    and the golden's backward from such statistics (dx in the input's format, dγ in the parameters'): a kernel that
    keeps only its rounded statistics computes its gradients from them too, as PyTorch's CPU backward does from the
    save_mean and save_invstd it is handed.  The backward takes the stored statistics only where they are the
    batch's rounded (within an ulp): statistics wrong otherwise (a bug's) make the golden backward from them
    reproduce any backward."""
    from bnprobe.numerics.rounding import round_to

    pf = params_format(call.dtype, call.params)
    rounded, exact = _rounded_batch_stats(call, pf)
    stored = None if saved is None else (saved.mean, saved.invstd(call.eps))
    out: dict[str, list[np.ndarray]] = {}
    if "y" in got:
        fmt = get_format(np.asarray(got["y"]).dtype).name
        out["y"] = [_y_from(call, *s, fmt) for s in ((stored,) if stored is not None else ()) + (rounded,)]
    wanted = [k for k in ("dx", "dgamma") if k in got]
    if call.dy is None or not wanted:
        return out
    ulp = get_format(pf).ulp
    with np.errstate(all="ignore"):
        near = stored is not None and all(np.all(np.abs(np.asarray(v, dtype=np.float64) - e) <= ulp(e))
                                          for v, e in zip(stored, exact))
        ref = outputs_only(ReferenceAdapter())
        for mean, inv in ((stored, rounded) if near else (rounded,)):
            b = ref.backward_of(call, Saved(np.asarray(mean, dtype=np.float64), "invstd",
                                            np.asarray(inv, dtype=np.float64)))
            for k, v in (("dx", b.dx), ("dgamma", b.dgamma)):
                if k in wanted:
                    out.setdefault(k, []).append(round_to(v, get_format(np.asarray(got[k]).dtype).name))
    return out


def _var_about_stored_mean(call: BNCall, got: dict[str, Any], saved: Any) -> dict[str, np.ndarray]:
    """The saved invstd (or variance) of a variance taken about the mean as the kernel stored it (rounded to the
    parameter format), not about the mean it computed: mean((x − stored mean)²), which exceeds the batch's variance
    by (stored − exact mean)²."""
    from bnprobe.numerics.rounding import round_to

    if saved is None:
        return {}
    var = _var_about(np.asarray(call.x, dtype=np.float64), saved.mean)
    out = {}
    for key, value in (("saved_invstd", 1.0 / np.sqrt(var + call.eps)), ("saved_var", var)):
        if key in got:
            out[key] = round_to(value, get_format(np.asarray(got[key]).dtype).name)
    return out


def _running_in_params(call: BNCall, got: dict[str, Any], saved: Any) -> dict[str, list[np.ndarray]]:
    """The running statistics updated in the parameter format's arithmetic: momentum m and 1 − m rounded to it,
    each product and the sum rounded to it; the batch's mean, and its unbiased variance as the golden has it or
    (a kernel that took it about its stored mean, :func:`_var_about_stored_mean`) about the saved mean."""
    from bnprobe.kernels.layout import layout_of, reduce_axes
    from bnprobe.numerics.rounding import round_to

    m = call.momentum
    if m is None or call.running_mean is None or call.running_var is None:
        return {}
    pf = params_format(call.dtype, call.params)
    x = np.asarray(call.x, dtype=np.float64)
    n = layout_of(x).reduce_size
    if n < 2:
        return {}
    r = lambda v: round_to(np.asarray(v, dtype=np.float64), pf)  # noqa: E731
    km, kb = r(1.0 - m), r(m)
    batch = {"running_mean": [x.mean(axis=reduce_axes(x))], "running_var": [x.var(axis=reduce_axes(x)) * n / (n - 1)]}
    if saved is not None:
        batch["running_var"].append(_var_about(x, saved.mean) * n / (n - 1))
    old = {"running_mean": call.running_mean, "running_var": call.running_var}
    return {k: [r(r(r(old[k]) * km) + r(r(b) * kb)) for b in batch[k]] for k in batch if k in got}


def _mixed_narrow(call: BNCall) -> bool:
    """A training call of 16-bit input under mixed precision (its parameters and statistics in fp32)."""
    return call.training and get_format(call.dtype).name in ("fp16", "bf16") and \
        params_format(call.dtype, call.params) == "fp32"


def _backward_from_input_format(call: BNCall, got: dict[str, Any], saved: Any) -> dict[str, np.ndarray]:
    """The saved statistics as the batch's rounded to the input's format, and the golden's backward computed from
    the statistics the kernel saved (dx rounded to the input's format, dγ and dβ to the parameters'): what a kernel
    that keeps its saved mean and invstd in the input's format returns."""
    from bnprobe.kernels.layout import reduce_axes
    from bnprobe.numerics.rounding import round_to

    fmt, pf = get_format(call.dtype).name, params_format(call.dtype, call.params)
    x = np.asarray(call.x, dtype=np.float64)
    ax = reduce_axes(x)
    out: dict[str, np.ndarray] = {}
    if saved is None:
        return out
    with np.errstate(all="ignore"):
        mean, inv = (np.asarray(v, dtype=np.float64) for v in (saved.mean, saved.invstd(call.eps)))
        exact = (x.mean(axis=ax), 1.0 / np.sqrt(x.var(axis=ax) + call.eps))
        ulp = get_format(fmt).ulp
        # only a kernel whose saved mean and invstd are both the batch's, rounded to the input's format (a kernel
        # whose statistics are wrong, or computed coarsely, is named by what makes them so), and not what a careful
        # kernel saves (which the input's format may happen to hold)
        if not all(np.array_equal(round_to(v, fmt), v, equal_nan=True) and np.all(np.abs(v - e) <= ulp(e))
                   for v, e in zip((mean, inv), exact)) or \
                all(np.array_equal(v, round_to(e, pf), equal_nan=True) for v, e in zip((mean, inv), exact)):
            return out
        for key, e in (("saved_mean", exact[0]), ("saved_invstd", exact[1])):
            if key in got:
                out[key] = round_to(e, fmt)
    if call.dy is None:
        return out
    # the golden's backward, handed the statistics the kernel saved
    b = outputs_only(ReferenceAdapter()).backward_of(call, Saved(mean, "invstd", inv))
    out.update({k: round_to(v, f) for k, v, f in (("dx", b.dx, fmt), ("dgamma", b.dgamma, pf),
                                                   ("dbeta", b.dbeta, pf)) if k in got})
    return out


RECIPES: tuple[Recipe, ...] = (
    Recipe(STATS_ROUNDED, "normalises with the batch statistics rounded to the parameter format ({params}) before "
                          "using them, where a careful kernel keeps them in its compute format and rounds only what it "
                          "stores",
           "PyTorch's CPU kernel does this with same-format parameters: pytorch/pytorch#140112",
           lambda: CarefulAdapter(rounded_stats=True), _training_narrow, ("y", "dx", "dgamma"),
           derive=_from_rounded),
    Recipe(RUNNING_IN_PARAMS, "updates the running statistics in the parameter format's arithmetic ({params}): the "
                              "momentum and each product rounded to it, where a careful kernel updates them in its "
                              "compute format and rounds once",
           "PyTorch's CPU kernel does this with same-format parameters: the running mean of a constant 1.5 input "
           "drifts to 1.4922 in one bf16 step",
           None, _training_narrow, ("running_mean", "running_var"),
           derive=_running_in_params),
    Recipe(VAR_ABOUT_STORED_MEAN, "takes the variance about the mean as rounded to the parameter format ({params}), "
                                  "not about the mean it computed: the variance grows by the mean's rounding error "
                                  "squared",
           "PyTorch's CPU kernel does this with same-format parameters: in bf16, x = [9984, 10048] gives invstd "
           "0.0221 (variance 2048, not 1024) and y = [0, 1.414]",
           None, _training_narrow, ("saved_invstd", "saved_var"),
           derive=_var_about_stored_mean),
    Recipe(SAVED_IN_INPUT_FORMAT, "saves the batch mean and invstd in the input's format ({dtype}), not the "
                                  "parameters' ({params}), and its backward computes from them",
           "torch.compile on the CPU does this: its decomposition casts save_mean and save_rstd to the input's dtype",
           None, _mixed_narrow, ("saved_mean", "saved_invstd", "dx", "dgamma"),
           derive=_backward_from_input_format),
)

RECIPE = {rp.id: rp for rp in RECIPES}  # by id (a compare-precision row's ``cause``)


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(all="ignore"):
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
        d = d[np.isfinite(d)]
    return float(np.sqrt(np.mean(d * d))) if d.size else float("nan")


def recipe_fits(got: Any, recipe_out: Any, bench: Any, golden: Any, fmt: str, terms: int = 1, *,
                at_recipe_scale: bool = False) -> bool:
    """Whether a recipe's output reproduces a kernel's: within the bench's own error against the golden (or one
    ulp RMS of the output, whichever is larger) and at most half the kernel's error against the golden; where the
    kernel gives NaN/inf and the golden does not, the recipe gives the same there, and the finite rest is within
    that floor.  ``at_recipe_scale``: the ulps taken at the larger of the golden's and the recipe's magnitudes (a
    logic bug's model can be far larger than the golden, and a kernel with that bug rounds at its size; a recipe's
    stays near the golden, and its floor at the golden's ulps keeps a kernel whose statistics are wrong in a
    larger way from being named by a recipe applied to them).  A
    per-channel output summed over ``terms`` values (dγ, dβ: the kernel's own sum, in its own order, against a
    recipe's exact one) is allowed √terms ulps RMS: a sum's rounding errors in an unknown order grow as a random
    walk of its terms."""
    g = np.asarray(golden, dtype=np.float64)
    if np.shape(got) != g.shape or np.shape(recipe_out) != g.shape:
        return False
    a, o = np.asarray(got, dtype=np.float64), np.asarray(recipe_out, dtype=np.float64)
    new_nonfinite = ~np.isfinite(a) & np.isfinite(g)
    if new_nonfinite.any():
        # NaN/inf where the golden has none: the recipe must give the very same there (a value NaN/inf, its sign),
        # which says more than any distance; what stays finite must then be within the floor below
        if not np.array_equal(a[new_nonfinite], o[new_nonfinite], equal_nan=True):
            return False
        keep = np.isfinite(a) & np.isfinite(g)
        a, o, g, bench = a[keep], o[keep], g[keep], np.asarray(bench, dtype=np.float64)[keep]
        if not a.size:
            return True
        return bool(_rmse(a, o) <= _floor(bench, g, o if at_recipe_scale else g, fmt, terms))
    to_recipe, to_gold = _rmse(a, o), _rmse(a, g)
    return bool(to_recipe <= _floor(bench, g, o if at_recipe_scale else g, fmt, terms) and to_recipe <= 0.5 * to_gold)


def _floor(bench: Any, g: np.ndarray, scale: np.ndarray, fmt: str, terms: int) -> float:
    """How far a kernel following a recipe may be from it: the bench's RMSE against the golden, or one ulp RMS
    (√terms for a sum) at the larger of the golden's and ``scale``'s magnitudes, whichever is larger."""
    with np.errstate(invalid="ignore"):
        size = np.fmax(np.abs(g), np.abs(scale))
    ulp = get_format(fmt).ulp(size[np.isfinite(size)])
    ulps = float(np.sqrt(np.mean(ulp * ulp))) if ulp.size else 0.0
    return max(_rmse(bench, g), ulps * max(1.0, float(np.sqrt(terms))))

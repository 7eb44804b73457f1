"""What identify has established about the BatchNorm kernels users run: the one table of it (``kernels.json``
beside this module, written by ``python benchmarks/kernel_table.py --write``, which also renders it as the docs
page docs/kernels.md), read at run time by compare-precision and doctor to name a real kernel's failures by what it
computes.

A row of the table is identify's result for one kernel (an adapter's name), format and parameter format: the recipe
(a policy spec that ``emulated:<spec>`` runs exactly) where identify reproduced the kernel bit for bit, the
forward's recipe where only its backward departs, and the layouts the recipe was also confirmed on.  A recipe is a
*candidate* only: the table was made with the framework releases and the CPU it names (the CPU's vector width
decides a summation order's lanes), so a check trusts it on a call only after its emulation reproduces that call's
output.  A plugin whose kernel identify reproduces can add its recipe (:func:`register_recipe`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bnprobe.core.kernel import params_format

__all__ = ["DATA", "KnownRecipe", "Known", "table", "known", "register_recipe"]

DATA = Path(__file__).with_name("kernels.json")

#: the forward's outputs (what a forward recipe covers where identify departs at the backward)
FORWARD_OUTPUTS = ("saved_mean", "saved_invstd", "saved_var", "y", "running_mean", "running_var", "y_infer")


@dataclass(frozen=True)
class KnownRecipe:
    """identify's recipe for ``kernel`` in ``format`` with ``params`` parameters (``fp32`` or ``same``): its policy
    ``spec``, the ``outputs`` it reproduces in each of its ``layouts`` (every output the kernel returns, or the
    forward's where identify departs at the backward), and where it was found (``made_with``: the machine and the
    releases)."""

    kernel: str
    format: str
    params: str
    spec: str
    outputs: dict[str, tuple[str, ...]]  # layout -> the outputs identify found the recipe reproduces there
    made_with: str = ""

    def covers(self, output: str, layout: str = "channels_first") -> bool:
        """Whether identify found this recipe reproduces ``output`` in ``layout`` (a saved variance counts as the
        saved invstd it is computed from)."""
        have = self.outputs.get(layout, ())
        return output in have or (output == "saved_var" and "saved_invstd" in have)

    @property
    def words(self) -> str:
        """"identify's recipe for torch fp16", with the parameter format where it is the input's."""
        return f"identify's recipe for {self.kernel} {self.format}" + \
            (f" with {_params_words(self.params)}" if self.params == "same" else "")


@dataclass(frozen=True)
class Known:
    """What the table says about one kernel, format, parameter format and layout: its recipe (None where there is
    none) and, without one, why not in words (``text``)."""

    recipe: KnownRecipe | None
    text: str


@functools.cache
def table(path: str = str(DATA)) -> dict[str, Any]:
    """The table as kernel_table.py wrote it: ``machine``, ``versions`` and ``rows`` (read once)."""
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]


_REGISTERED: dict[tuple[str, str, str], KnownRecipe] = {}  # plugins' recipes (register_recipe), before the table's


def register_recipe(recipe: KnownRecipe) -> Callable[[], None]:
    """Make ``recipe`` the known recipe of its kernel, format and parameter format (in place of the table's row, if
    any); returns the function that takes it back."""
    key = (recipe.kernel, recipe.format, recipe.params)
    before = _REGISTERED.get(key)
    _REGISTERED[key] = recipe

    def undo() -> None:
        if before is None:
            _REGISTERED.pop(key, None)
        else:
            _REGISTERED[key] = before
    return undo


def _covered(row: dict[str, Any], spec_outputs: list[str]) -> dict[str, tuple[str, ...]]:
    """Per layout, the outputs of ``spec_outputs`` a row's recipe reproduces: all of them in the layout identify
    searched (channels_first), and in another layout those it did not list there as not reproduced."""
    out = {"channels_first": tuple(spec_outputs)}
    for lay, said in (row.get("other_layouts") or {}).items():
        said = str(said)
        if said == "reproduced":
            out[lay] = tuple(spec_outputs)
        elif said.startswith("not reproduced: "):
            off = {o.strip() for o in said.removeprefix("not reproduced: ").split(",")}
            out[lay] = tuple(o for o in spec_outputs if o not in off)
    return out


def _recipe_of(row: dict[str, Any], made_with: str) -> KnownRecipe | None:
    """A row's recipe: reproduced (every output), or the forward's where only the backward departs; None for a
    departure (a closest recipe is not one) and for a kernel not run."""
    outputs = list(row.get("outputs") or [])
    if row.get("result") == "reproduced" and row.get("recipe"):
        spec = row["recipe"]
    elif row.get("result") == "departs" and row.get("forward_recipe"):
        spec = row["forward_recipe"]
        outputs = [o for o in outputs if o in FORWARD_OUTPUTS and o not in (row.get("departing") or [])]
    else:
        return None
    return KnownRecipe(row["kernel"], row["format"], row["params"], spec, _covered(row, outputs), made_with)


def known(kernel: str, fmt: str, params: str, layout: str = "channels_first") -> Known:
    """What is known of ``kernel`` in ``fmt`` with ``params`` parameters (``fp32`` or ``same``) in ``layout``: its
    recipe where identify found one that covers this layout, else in words what the table says (a departure, a
    kernel not run where the table was made, or no row)."""
    doc = table()
    made_with = f"{doc.get('machine', '?')}; {doc.get('versions', '?')}"
    who = f"{kernel} {fmt}"
    # (fp32 parameters of an fp32 kernel are its input's format: "fp32" and "same" are one parameter format there)
    pf = params_format(fmt, params)
    reg = next((v for (k, f, p), v in _REGISTERED.items() if (k, f) == (kernel, fmt) and params_format(f, p) == pf),
               None)
    rows = [r for r in doc.get("rows", []) if (r.get("kernel"), r.get("format")) == (kernel, fmt)]
    row = next((r for r in rows if params_format(fmt, str(r.get("params"))) == pf), None)
    rec = reg or (_recipe_of(row, made_with) if row is not None else None)
    if rec is not None and rec.outputs.get(layout):
        return Known(rec, f"{rec.words}: `{rec.spec}`")
    if rec is not None:
        return Known(None, f"{rec.words} was not confirmed in {layout}")
    if row is None:
        other = " or ".join(_params_words(str(r.get("params"))) for r in rows)
        return Known(None, f"no identified recipe for {who}" + (f" with {_params_words(params)} (the table has it "
                                                                f"with {other})" if other else ""))
    if row.get("result") == "not run":
        return Known(None, f"no identified recipe for {who}: not run where the table was made ({row.get('why')})")
    size = f" ({', '.join(row.get('departing') or [])}: {row['departure_size']})" if row.get("departure_size") else ""
    return Known(None, f"no identified recipe for {who}: identify departs at the {row.get('departs')} stage{size}")


def _params_words(params: str) -> str:
    return "same-format parameters" if params == "same" else f"{params} parameters"

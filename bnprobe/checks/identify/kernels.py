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

__all__ = ["DATA", "KnownRecipe", "Known", "table", "known", "recipe_of_row", "register_recipe"]

DATA = Path(__file__).with_name("kernels.json")

#: the forward's outputs (what a forward recipe covers where identify departs at the backward)
FORWARD_OUTPUTS = ("saved_mean", "saved_invstd", "saved_var", "y", "running_mean", "running_var", "y_infer")


@dataclass(frozen=True)
class KnownRecipe:
    """identify's recipe for ``kernel`` in ``format`` with ``params`` parameters (``fp32`` or ``same``) in ``layout``:
    its policy ``spec``, the ``outputs`` identify found it reproduces there (every output the kernel returns, or the
    forward's where identify departs at the backward), and where it was found (``made_with``: the machine and the
    releases)."""

    kernel: str
    format: str
    params: str
    spec: str
    outputs: tuple[str, ...]
    layout: str = "channels_first"
    made_with: str = ""

    def covers(self, output: str) -> bool:
        """Whether identify found this recipe reproduces ``output`` (a saved variance counts as the saved invstd it
        is computed from)."""
        return output in self.outputs or (output == "saved_var" and "saved_invstd" in self.outputs)

    @property
    def words(self) -> str:
        """"identify's recipe for torch fp16", with the parameter format where it is the input's and the layout
        where it is not channels_first."""
        return f"identify's recipe for {self.kernel} {self.format}" + \
            (f" with {_params_words(self.params)}" if self.params == "same" else "") + \
            (f" in {self.layout}" if self.layout != "channels_first" else "")


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


_REGISTERED: dict[tuple[str, str, str, str], KnownRecipe] = {}  # plugins' recipes (register_recipe), first


def register_recipe(recipe: KnownRecipe) -> Callable[[], None]:
    """Make ``recipe`` the known recipe of its kernel, format, parameter format and layout (in place of the table's
    row, if any); returns the function that takes it back."""
    key = (recipe.kernel, recipe.format, recipe.params, recipe.layout)
    before = _REGISTERED.get(key)
    _REGISTERED[key] = recipe

    def undo() -> None:
        if before is None:
            _REGISTERED.pop(key, None)
        else:
            _REGISTERED[key] = before
    return undo


#: how kernel_table.py's rows say another layout's result (:meth:`~bnprobe.checks.identify.results.LayoutResult
#: .summary`): the searched layout's recipe reproduces every output there, or all but those listed, or the layout has
#: a recipe of its own; anything else ("departs at ...") gives no recipe there
_SAME = ("reproduced by the same recipe", "reproduced")
_OFF = ("not reproduced: ", "computed as the other layout; the recipe misses ")
_OWN = "its own recipe `"


def _in_layout(row: dict[str, Any], lay: str, spec: str, outputs: list[str]) -> tuple[str, list[str]] | None:
    """(the recipe, the outputs it reproduces) in layout ``lay`` of a row whose searched layout's recipe is ``spec``
    reproducing ``outputs``; None where identify found none there (or did not try)."""
    said = str((row.get("other_layouts") or {}).get(lay, ""))
    if said in _SAME:
        return spec, outputs
    if said.startswith(_OWN) and said.endswith("`"):
        return said[len(_OWN):-1], list(row.get("outputs") or [])
    for head in _OFF:
        if said.startswith(head):
            off = {o.strip() for o in said[len(head):].removesuffix(" on its fresh inputs").split(",")}
            return spec, [o for o in outputs if o not in off]
    return None


def recipe_of_row(row: dict[str, Any], layout: str = "channels_first", made_with: str = "") -> KnownRecipe | None:
    """A row's recipe (a row of the table as kernel_table.py writes it) in ``layout``: reproduced (every output), or
    the forward's where only the backward departs; in another layout than the searched one (channels_first), as
    the row says of it.  None for a departure (a closest recipe is not one), a kernel not run, and a layout without
    one."""
    outputs = list(row.get("outputs") or [])
    if row.get("result") == "reproduced" and row.get("recipe"):
        spec = row["recipe"]
    elif row.get("result") == "departs" and row.get("forward_recipe"):
        spec = row["forward_recipe"]
        outputs = [o for o in outputs if o in FORWARD_OUTPUTS and o not in (row.get("departing") or [])]
    else:
        spec = ""
    if layout != "channels_first":
        found = _in_layout(row, layout, spec, outputs) if spec or row.get("other_layouts") else None
        spec, outputs = found if found is not None and found[0] else ("", [])
    if not spec or not outputs:
        return None
    return KnownRecipe(row["kernel"], row["format"], row["params"], spec, tuple(outputs), layout, made_with)


def known(kernel: str, fmt: str, params: str, layout: str = "channels_first", *,
          doc: dict[str, Any] | None = None) -> Known:
    """What is known of ``kernel`` in ``fmt`` with ``params`` parameters (``fp32`` or ``same``) in ``layout``: its
    recipe where identify found one that covers this layout, else in words what the table says (a departure, a
    kernel not run where the table was made, or no row).  ``doc``: the table to read (default: the package's)."""
    doc = table() if doc is None else doc
    made_with = f"{doc.get('machine', '?')}; {doc.get('versions', '?')}"
    who = f"{kernel} {fmt}"
    # (fp32 parameters of an fp32 kernel are its input's format: "fp32" and "same" are one parameter format there)
    pf = params_format(fmt, params)
    reg = next((v for (k, f, p, lay), v in _REGISTERED.items()
                if (k, f, lay) == (kernel, fmt, layout) and params_format(f, p) == pf), None)
    rows = [r for r in doc.get("rows", []) if (r.get("kernel"), r.get("format")) == (kernel, fmt)]
    row = next((r for r in rows if params_format(fmt, str(r.get("params"))) == pf), None)
    rec = reg or (recipe_of_row(row, layout, made_with) if row is not None else None)
    if rec is not None:
        return Known(rec, f"{rec.words}: `{rec.spec}`")
    if row is not None and row.get("result") != "not run" and layout != "channels_first":
        said = (row.get("other_layouts") or {}).get(layout)
        return Known(None, f"no identified recipe for {who} in {layout}" + (f" ({said})" if said else
                                                                           ": identify did not run it there"))
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

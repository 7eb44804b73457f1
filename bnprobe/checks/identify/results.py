"""What identify returns: the policy found, each output's match (:class:`OutputMatch`), the fields the probes
could not tell apart (:class:`Undistinguished`), a dump's calls (:class:`IdentifiedCalls`), and the choices known
to lose accuracy (:func:`lossy_choices`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from bnprobe.core.errors import BNProbeError
from bnprobe.engine.result import Judged
from bnprobe.kernels.policy import PRESETS, Policy


__all__ = ["Identified", "IdentifiedCalls", "LayoutResult", "OutputMatch", "Undistinguished", "LOSSY",
           "lossy_choices", "policy_spec", "value_text"]


# ---- results --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutputMatch:
    """One output of the kernel against the identified policy: on the search's probes and on fresh inputs."""

    output: str
    stage: str
    probes_exact: bool
    fresh_exact: bool | None  # None: not observed on the fresh inputs
    mismatches: int
    elements: int
    max_ulps: float

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "stage": self.stage, "bit_for_bit": self.probes_exact and
                self.fresh_exact is not False, "probes_exact": self.probes_exact, "fresh_exact": self.fresh_exact,
                "mismatches": self.mismatches, "elements": self.elements, "max_ulps": self.max_ulps}


@dataclass(frozen=True)
class Undistinguished:
    """Candidates of one stage that the probes could not tell apart: each alternative (the fields it changes, as
    ``key=value``) reproduced what the stage pins as well as the chosen policy."""

    stage: str
    fields: tuple[str, ...]
    chosen: str  # the chosen policy's values of those fields
    alternatives: tuple[str, ...]
    probe: str  # what would tell them apart

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "fields": list(self.fields), "chosen": self.chosen,
                "alternatives": list(self.alternatives), "would_tell": self.probe}


#: a departing stage's best candidate is called close, and shown as the closest recipe, only when it reproduces
#: that stage's outputs on all but this share of their values, each within CLOSE_ULPS: a candidate further off is
#: no explanation, and naming it would be a guess
CLOSE_SHARE = 0.1
CLOSE_ULPS = 4.0


@dataclass
class Identified(Judged):
    """What identify found for one kernel (or one recorded call)."""

    adapter: str
    dtype: str
    params: str
    policy: Policy
    spec: str
    outputs: list[OutputMatch]
    undistinguished: list[Undistinguished]
    departs: str | None  # the first stage no candidate reproduced, None when every observed output is bit for bit
    stages: dict[str, dict[str, Any]]
    probes: list[str]
    unobserved: list[str]
    evaluations: int
    seconds: float
    nondeterministic: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    label: str = ""
    layouts: dict[str, LayoutResult] = field(default_factory=dict)  # each other layout probed: its result
    departing_probes: list[str] = field(default_factory=list)  # the probes whose outputs show the departure
    norm: str = "batch"  # the layer identified (BatchNorm, or LayerNorm, RMSNorm, GroupNorm: identify --norm)

    @property
    def departing(self) -> list[OutputMatch]:
        """The departing stage's outputs that the policy found does not reproduce."""
        return [o for o in self.outputs if o.stage == self.departs and not (o.probes_exact and
                                                                            o.fresh_exact is not False)]

    def _departing_size(self) -> tuple[int, int, float]:
        """(values that differ, values, the largest residual in ULPs) over the departing outputs."""
        off = self.departing
        return (sum(o.mismatches for o in off), sum(o.elements for o in off),
                max((o.max_ulps for o in off), default=0.0))

    @property
    def close(self) -> bool:
        """Whether the policy found is close to the kernel where it departs (:data:`CLOSE_SHARE`,
        :data:`CLOSE_ULPS`): False when it reproduces everything too (it is then no departure)."""
        mism, elems, ulps = self._departing_size()
        return elems > 0 and mism <= CLOSE_SHARE * elems and ulps <= CLOSE_ULPS

    @property
    def established(self) -> list[str]:
        """The stages before the departing one whose outputs the policy reproduces bit for bit."""
        if self.departs is None:
            return []
        before = list(self.stages)[:list(self.stages).index(self.departs)] if self.departs in self.stages else []
        return [st for st in before if self.stages[st].get("exact") is True]

    def departure_size(self) -> str:
        """How far the policy found is from the departing outputs: values that differ, the largest residual, and
        the probes that show it."""
        mism, elems, ulps = self._departing_size()
        where = f", on the {', '.join(self.departing_probes)} probe(s)" if self.departing_probes else ""
        return f"{mism} of {elems} values differ, up to {ulps:.4g} ULPs{where}"

    def departure(self) -> str:
        """The departure in words: the outputs no recipe reproduces, by how much, where; what is established."""
        known = (f"; established bit for bit: the {', '.join(self.established)} stage(s)" if self.established
                 else "")
        return (f"no recipe in the space reproduces {', '.join(o.output for o in self.departing)} "
                f"({self.departure_size()}){known}")

    @property
    def reproduced(self) -> bool:
        """Every observed output bit for bit, on the probes and on the fresh inputs."""
        return all(o.probes_exact and o.fresh_exact is not False for o in self.outputs)

    @property
    def passed(self) -> bool:
        """What identify's exit status says: :attr:`reproduced`, and every other layout probed reproduced too (by
        this recipe or by its own, :attr:`layouts`)."""
        return self.reproduced and all(v.reproduced for v in self.layouts.values())

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per output (:meth:`to_frame`)."""
        return self.to_frame()

    def found(self) -> str:
        """What identify found, in words (not :attr:`verdict`, the result protocol's PASS/FAIL): the recipe that
        reproduces it, the closest where it departs when close, or where no recipe does."""
        if self.reproduced:
            return f"reproduced bit for bit by emulated:{self.spec}"
        if self.close:
            return (f"departs from the policy space at the {self.departs} stage; closest (all but {CLOSE_SHARE:.0%} of "
                    f"its values within {CLOSE_ULPS:g} ULPs): emulated:{self.spec} "
                    f"({', '.join(o.output for o in self.departing)}: {self.departure_size()})")
        return f"departs from the policy space at the {self.departs} stage: {self.departure()}"

    def to_dict(self) -> dict[str, Any]:
        layer = {} if self.norm == "batch" else {"norm": self.norm}  # (BatchNorm's result as it always was)
        return {"adapter": self.adapter, **layer, "label": self.label, "dtype": self.dtype, "params": self.params,
                "policy": self.spec, "policy_fields": {k: v for k, v in self.policy.to_dict().items() if k != "name"},
                "reproduced": self.reproduced, "departs": self.departs,
                "closest": self.spec if self.departs is not None and self.close else None,
                "departure": self.departure() if self.departs is not None else None,
                "departure_size": self.departure_size() if self.departs is not None else None,
                "outputs": [o.to_dict() for o in self.outputs],
                "undistinguished": [u.to_dict() for u in self.undistinguished], "stages": self.stages,
                "probes": self.probes, "unobserved": self.unobserved, "nondeterministic": self.nondeterministic,
                "layouts": {k: v.to_dict() for k, v in self.layouts.items()},
                "evaluations": self.evaluations, "seconds": self.seconds, "notes": self.notes}

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([o.to_dict() for o in self.outputs])


@dataclass
class LayoutResult:
    """identify in a layout other than the one it searched: the outputs the search's recipe does not reproduce there
    (``off``; empty: it reproduces them all), and where it does not, that layout's own search from it (``own``: a
    kernel's layout branch is another kernel — its recipe, or the stage where it departs and by how much)."""

    layout: str
    off: list[str]
    own: Identified | None = None
    same: bool = False  # the kernel returned the same outputs in both layouts on those inputs: not searched
    # (same) the search's recipe reproduces them bit for bit on the inputs in the searched layout: the kernel computes
    # this layout as that one (its adapter hands the framework the searched layout), which bnprobe's own run of the
    # recipe in this layout does not
    as_searched: bool = False

    @property
    def reproduced(self) -> bool:
        """Every output bit for bit in this layout: by the search's recipe (in this layout, or in the searched one
        where the kernel computes both alike), or by the layout's own."""
        return not self.off or self.as_searched or (self.own is not None and self.own.reproduced)

    def summary(self) -> str:
        """The layout's result in one line."""
        if not self.off:
            return "reproduced by the same recipe"
        if self.same and self.as_searched:
            return "computed as the other layout: reproduced by the same recipe on the inputs in that layout"
        if self.same:
            return f"computed as the other layout; the recipe misses {', '.join(self.off)} on its fresh inputs"
        if self.own is None:
            return f"not reproduced: {', '.join(self.off)}"
        own = self.own
        if own.reproduced:
            return f"its own recipe `{own.spec}`"
        return f"departs at {own.departs}: " + (f"closest `{own.spec}` ({own.departure_size()})" if own.close
                                                 else own.departure())

    def to_dict(self) -> dict[str, Any]:
        own = self.own
        return {"not_reproduced": self.off, "reproduced": self.reproduced, "same_as_searched": self.same,
                "reproduced_as_searched": self.as_searched,
                "policy": None if own is None or not (own.reproduced or own.close) else own.spec,
                "departs": None if own is None else own.departs,
                "departure": None if own is None or own.departs is None else own.departure(),
                "search": None if own is None else own.to_dict()}


@dataclass
class IdentifiedCalls(Judged):
    """identify over the calls of a recording, in forward order (``notes``: the run's own; each call's are its
    result's)."""

    source: str
    results: list[Identified]
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return all(r.reproduced for r in self.results)

    @property
    def passed(self) -> bool:
        """The same as :attr:`reproduced` (what identify's exit status says)."""
        return self.reproduced

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per output of each call, with its call."""
        import pandas as pd

        return pd.DataFrame([{"call": r.label, **o.to_dict()} for r in self.results for o in r.outputs])

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "reproduced": self.reproduced, "calls": [r.to_dict() for r in self.results]}


_NARROW = ("fp16", "bf16")
_ESTIMATES = ("magic", "table", "frsqrte")
# the choices known to lose accuracy against a careful kernel, in words (doctor names a kernel's recipe by them)
LOSSY: tuple[tuple[Callable[[Policy], bool], Callable[[Policy], str]], ...] = (
    (lambda p: p.variance == "naive",
     lambda p: "a single-pass variance E[x²] − E[x]², which cancels at large means (variance=naive)"),
    (lambda p: p.accumulate in _NARROW,
     lambda p: f"sums and statistics accumulated in {p.accumulate} (accumulate={p.accumulate})"),
    (lambda p: p.compute in _NARROW,
     lambda p: f"the normalisation computed in {p.compute} (compute={p.compute})"),
    (lambda p: p.stored_stats,
     lambda p: f"the batch statistics rounded to {p.params_format} before use (stored_stats=true)"),
    (lambda p: p.running_format in _NARROW,
     lambda p: f"the running statistics updated in {p.running_format} (running_format={p.running_format})"),
    (lambda p: p.rsqrt in _ESTIMATES and p.rsqrt_newton == 0,
     lambda p: f"an rsqrt estimate without a Newton step (rsqrt={p.rsqrt}, rsqrt_newton=0)"),
    (lambda p: p.rsqrt == "sqrt_div" and p.division == "reciprocal" and p.recip_newton == 0,
     lambda p: f"division by a reciprocal estimate without a Newton step (recip={p.recip}, recip_newton=0)"),
    (lambda p: p.y_formula == "affine",
     lambda p: "y = x·A + B with B = β − μ·A, which cancels at large mean/σ (y_formula=affine)"),
    (lambda p: p.subnormals == "flush", lambda p: "subnormals flushed to zero (subnormals=flush)"),
    (lambda p: "toward_zero" in (p.rounding, p.output_rounding),
     lambda p: "rounding toward zero (rounding/output_rounding=toward_zero)"),
)


def lossy_choices(policy: Policy) -> list[str]:
    """The choices of ``policy`` known to lose accuracy against a careful kernel, in words with field and value."""
    return [words(policy) for test, words in LOSSY if test(policy)]


def policy_spec(policy: Policy) -> str:
    """The shortest ``preset:key=value,...`` spec that :func:`~bnprobe.kernels.policy.get_policy` turns back into
    ``policy`` (every field but the name)."""
    best = None
    for name, preset in PRESETS.items():
        if preset.storage != policy.storage:
            continue
        diff = [f.name for f in fields(Policy) if f.name not in ("name",) and getattr(policy, f.name) !=
                getattr(preset, f.name)]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    if best is None:
        raise BNProbeError(f"no preset stores {policy.storage}")
    name, diff = best

    return name + (":" + ",".join(f"{k}={value_text(getattr(policy, k))}" for k in diff) if diff else "")


def value_text(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

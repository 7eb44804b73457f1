"""A real kernel's failing output named by what the kernel computes: the recipe identify found for it (the package's
table, :mod:`bnprobe.checks.identify.kernels`), once that recipe's emulation reproduces the output on the call, and
the recipe's choice the failure comes from.

The recipe is a policy; the careful bench is another.  Where they differ, their fields are grouped into the choices
that belong together (:data:`CHOICES`: the summation order, the variance algorithm, how 1/sqrt(var + ε) is formed,
...).  Each differing choice is reset to the careful kernel's, one at a time, and the output judged again: a choice
whose reset makes it pass is one the failure needs (:class:`Attribution`); where no reset alone makes it pass, each
choice is put alone into the careful kernel to see which make it fail by themselves.  The runs and the judging are
the caller's (compare-precision's engine and rules); this module holds the choices, the variants' policies and the
words."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace

from bnprobe.kernels.policy import Policy

__all__ = ["Choice", "CHOICES", "CONVENTION_FIELDS", "choices_differing", "resettable", "with_choices", "Attribution",
           "attribute", "CAUSE"]

CAUSE = "identified-recipe"  # a row's ``cause`` when identify's recipe names it (":<choice ids>" after it)


@dataclass(frozen=True)
class Choice:
    """One choice of a policy: its id (stable, in a row's ``cause``), what it is in words, and its fields."""

    id: str
    words: str
    fields: tuple[str, ...]


#: the policy's choices, each a group of fields that belong together (reset together: a field of one may constrain
#: another, e.g. backward_fma needs order=vec, variance_fma and dx_fma=body need threads)
CHOICES: tuple[Choice, ...] = (
    Choice("summation-order", "the summation order and its fused multiply-adds",
           ("order", "lanes", "unroll", "tiles", "kahan", "core_parts", "core_combine", "threads", "thread_split",
            "packet_lanes", "backward_sums", "backward_lanes", "backward_fma", "variance_fma", "dx_fma")),
    Choice("code-path", "the second code path it takes where its vector width divides the channel count",
           ("path_channels", "channel_path")),
    Choice("accumulation", "the format its sums are accumulated in", ("accumulate", "sum_format")),
    Choice("variance", "the variance algorithm", ("variance", "clamp_var", "mean_by")),
    Choice("rsqrt", "how 1/sqrt(var + eps) is formed",
           ("rsqrt", "rsqrt_newton", "rsqrt_bits", "rsqrt_constant", "newton_form", "sqrt", "rstd_format", "division",
            "recip", "recip_newton", "recip_bits", "infer_rsqrt")),
    Choice("y-formula", "how y is formed from the statistics", ("y_formula", "fma", "infer_y_formula")),
    Choice("backward-formula", "the backward's formula", ("backward_formula",)),
    Choice("stored-statistics", "the statistics it stores and normalises with", ("params", "stored_stats",
                                                                                   "saved_format")),
    Choice("compute", "the format of its elementwise arithmetic", ("compute", "storage")),
    Choice("running-update", "the running statistics' update",
           ("running_format", "unbiased_by", "running_var_sum", "unbiased_r1")),
    Choice("rounding", "its rounding", ("rounding", "output_rounding", "overflow", "subnormals")),
)
#: the framework's convention (what the momentum weighs, the running variance's bias): the careful bench follows the
#: kernel's, so these are never a cause
CONVENTION_FIELDS = ("running_momentum", "running_var")
_NOT_CHOICES = ("name", "seed", *CONVENTION_FIELDS)


def _choices() -> list[Choice]:
    """:data:`CHOICES`, and a choice of its own for each Policy field none of them holds (a field added later is
    still tried, named by its field)."""
    held = {f for c in CHOICES for f in c.fields}
    return list(CHOICES) + [Choice(f.name, f"`{f.name}`", (f.name,)) for f in fields(Policy)
                            if f.name not in held and f.name not in _NOT_CHOICES]


def choices_differing(recipe: Policy, careful: Iterable[Policy]) -> list[Choice]:
    """The choices in which ``recipe`` differs from one of the ``careful`` policies (the careful kernel's in each
    mode an output depends on)."""
    cs = list(careful)
    return [c for c in _choices() if any(getattr(recipe, f) != getattr(k, f) for k in cs for f in c.fields)]


def resettable(choices: list[Choice], valid: Callable[[list[Choice]], bool]) -> list[Choice]:
    """``choices`` as they can be reset: each one alone where ``valid([c])`` (resetting it gives valid policies),
    else joined with the first other choice that makes it valid (e.g. torch.compile's variance=inductor needs its
    order=inductor: the order is reset with the variance), else left as it is (it will be said not tried)."""
    out: list[Choice] = []
    for c in choices:
        if valid([c]):
            out.append(c)
            continue
        partner = next((d for d in choices if d is not c and valid([c, d])), None)
        out.append(c if partner is None else Choice(f"{c.id}-with-{partner.id}", f"{c.words} with {partner.words}",
                                                    c.fields + partner.fields))
    return out


def with_choices(base: Policy, source: Policy, choices: Iterable[Choice], name: str = "") -> Policy:
    """``base`` with the fields of ``choices`` taken from ``source`` (a BNProbeError where the result is not a valid
    policy)."""
    return replace(base, name=name or base.name, **{f: getattr(source, f) for c in choices for f in c.fields})


def _values(policy: Policy, choice: Choice, other: Policy) -> str:
    """The fields of ``choice`` where ``policy`` differs from ``other``, as ``field=value``."""
    return ", ".join(f"{f}={getattr(policy, f)}" for f in choice.fields if getattr(policy, f) != getattr(other, f))


@dataclass
class Attribution:
    """Which of the recipe's choices (those differing from the careful kernel's: ``tried``) a failing output comes
    from: ``necessary``, each one whose reset to the careful kernel's makes the output pass; where none does,
    ``sufficient``, each one that makes the careful kernel fail it alone; ``untried``: choices that cannot be reset
    alone (with why)."""

    output: str
    tried: list[Choice]
    necessary: list[Choice] = field(default_factory=list)
    sufficient: list[Choice] = field(default_factory=list)
    untried: list[tuple[Choice, str]] = field(default_factory=list)

    @property
    def cause(self) -> str:
        """The row's ``cause``: identified-recipe:<choice> (several: joined by + when they act together, by ,
        when each is enough alone), plain identified-recipe when no choice explains it."""
        if self.necessary:
            return f"{CAUSE}:" + "+".join(c.id for c in self.necessary)
        if self.sufficient:
            return f"{CAUSE}:" + ",".join(c.id for c in self.sufficient)
        return CAUSE

    def words(self, recipe: Policy, careful: Policy) -> str:
        """Where the output's error comes from, in words that hold for every output it names alike (``careful``: the
        careful kernel's policy, for the values)."""
        def say(cs: list[Choice]) -> list[str]:
            return [f"{c.words} ({_values(recipe, c, careful)}; the careful kernel's: {_values(careful, c, recipe)})"
                    for c in cs]

        left = "" if not self.untried else \
            "; not tried alone: " + "; ".join(f"{c.words} ({why})" for c, why in self.untried)
        if len(self.necessary) == 1:
            return f"its error comes from {say(self.necessary)[0]}: with the careful kernel's choice it passes{left}"
        if self.necessary:
            return (f"its error comes from {' together with '.join(say(self.necessary))}: with the careful kernel's "
                    f"choice in any one of them it passes{left}")
        if len(self.sufficient) == 1:
            return (f"its error comes from {say(self.sufficient)[0]}, enough alone (it makes the careful kernel fail), "
                    f"though with it reset the recipe's other choices still fail it{left}")
        if self.sufficient:
            return (f"its error comes from {' and from '.join(say(self.sufficient))}, each enough alone (each makes "
                    f"the careful kernel fail; with one careful choice the other still fails it){left}")
        if not self.tried:
            return f"it differs from the careful kernel in no choice but its convention{left}"
        return (f"no single choice explains it: with any one of {'; '.join(say(self.tried))} reset to the careful "
                f"kernel's it still fails, and none alone makes the careful kernel fail{left}")


def attribute(output: str, tried: list[Choice], passes_without: Callable[[Choice], bool | str],
              fails_with: Callable[[Choice], bool | str]) -> Attribution:
    """The choices of ``tried`` a failing ``output`` comes from: ``passes_without(c)``, whether the output passes
    with choice ``c`` reset to the careful kernel's; ``fails_with(c)``, whether the careful kernel with the recipe's
    ``c`` fails it (asked only where no reset alone makes it pass).  Either may answer with a string instead: why
    the variant cannot be run (the choice is then left untried)."""
    out = Attribution(output, list(tried))
    for c in tried:
        ok = passes_without(c)
        if isinstance(ok, str):
            out.untried.append((c, ok))
        elif ok:
            out.necessary.append(c)
    if out.necessary:
        return out
    for c in (c for c in tried if c not in dict(out.untried)):
        bad = fails_with(c)
        if bad is True:
            out.sufficient.append(c)
    return out

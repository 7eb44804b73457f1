"""The report of identify: the policy found, per output whether it is reproduced bit for bit, the stages, the
fields the probes could not tell apart, and where the kernel departs from the policy space."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bnprobe._table import render_table
from bnprobe.core.call import NORM_NAMES
from bnprobe.engine.result import OfCalls
from bnprobe.reports import Report, file_stem

if TYPE_CHECKING:  # pragma: no cover
    from bnprobe.checks.identify.results import Identified, IdentifiedCalls

__all__ = ["identify_report"]


def _ulps(v: float) -> Any:
    return "-" if v == 0 else ("inf" if v == float("inf") else v)


def _blocks(res: Identified) -> list[str]:
    """The outputs, stages and undistinguished fields of one identification."""
    rows = [{"output": o.output, "stage": o.stage, "bit": "yes" if o.probes_exact and o.fresh_exact is not False
             else "NO", "probes": "exact" if o.probes_exact else "differs",
             "fresh": {True: "exact", False: "differs", None: "-"}[o.fresh_exact],
             "mism": f"{o.mismatches}/{o.elements}", "ulps": _ulps(o.max_ulps)} for o in res.outputs]
    out = [render_table(rows, ["output", "stage", "bit", "probes", "fresh", "mism", "ulps"],
                        headers=["output", "stage", "bit for bit", "search probes", "fresh inputs",
                                 "mismatching", "max ULPs off"])]
    stages = [{"stage": st, "pinned": ", ".join(v.get("pinned_by", [])) or "(not observed)",
               "cands": v.get("candidates", 0), "exact": {True: "yes", False: "NO", None: "-"}[v.get("exact")],
               "tied": v.get("tied", "-")} for st, v in res.stages.items()]
    out += ["", render_table(stages, ["stage", "pinned", "cands", "exact", "tied"],
                             headers=["stage", "pinned by", "candidates", "reproduced", "tied"])]
    if res.undistinguished:
        out += ["", "not distinguished by these probes (each alternative reproduced the stage as well):"]
        out += [f"  {u.stage}: {u.chosen} or {' | '.join(u.alternatives[:4])}"
                + (f" (+{len(u.alternatives) - 4} more)" if len(u.alternatives) > 4 else "")
                + f" — would tell: {u.probe}" for u in res.undistinguished]
    if res.unobserved:
        out.append(f"not returned by the kernel, so not identified: {', '.join(res.unobserved)}")
    return out


def _title(res: Identified, what: str) -> str:
    return f"identify {what}: {res.found()}"


def _markdown(title: str, blocks: list[str], notes: list[str]) -> str:
    return f"# {title}\n\n```\n" + "\n".join(blocks) + "\n```\n\n" + "".join(f"- {n}\n" for n in notes)


def identify_report(res: Identified | IdentifiedCalls) -> Report:
    """identify on one kernel (generated probes), or on every call of a recording (one row per call, then each
    call's outputs)."""
    if isinstance(res, OfCalls):
        return _identified_calls(res)
    layer = "" if res.norm == "batch" else f" {NORM_NAMES[res.norm]}"
    title = _title(res, f"{res.adapter}{layer} in {res.dtype}, params {res.params}")
    blocks = _blocks(res)
    for lay, other in res.layouts.items():  # (a layout the kernel computes another way: its own search)
        if other.own is not None:
            blocks += ["", f"{lay}: {other.own.found()}", *_blocks(other.own)]
    blocks.append(f"{len(res.probes)} probes ({', '.join(res.probes)}); {res.evaluations} candidate evaluations, "
                  f"{res.seconds:.1f} s")
    return Report(title, blocks, list(res.notes), res.passed, res.to_dict(),
                  file_stem("identify", res.adapter, res.dtype), res.frame, _markdown(title, blocks, res.notes))


def _identified_calls(run: IdentifiedCalls) -> Report:
    """identify on every recorded call: one row per call, then each call's outputs."""
    rows = [{"#": i, "call": r.label, "format": r.dtype, "params": r.params,
             "found": "bit for bit" if r.reproduced else f"departs at {r.departs}",
             "policy": r.spec if r.reproduced or r.close else "(no recipe close)"}
            for i, r in enumerate(run.results)]
    table = render_table(rows, ["#", "call", "format", "params", "found", "policy"],
                         headers=["#", "call (forward order)", "format", "params", "reproduced", "policy"])
    kernel = run.results[0].adapter if run.results else "the dump"
    title = (f"identify {kernel} on {len(run.results)} recorded call(s) of {run.source}: "
             + ("every call reproduced bit for bit" if run.reproduced else
                f"{sum(not r.reproduced for r in run.results)} call(s) depart from the policy space"))
    blocks = [table]
    for r in run.results:
        blocks += ["", f"{r.label}: emulated:{r.spec}", *_blocks(r)]
    notes = list(run.notes) + [f"{r.label}: {n}" for r in run.results for n in r.notes]
    return Report(title, blocks, notes, run.passed, run.to_dict(), file_stem("identify", kernel, "recorded"),
                  run.frame, _markdown(title, blocks, notes))

"""What each kernel computes: identify run on every BatchNorm kernel users run, each format, and what it loses
against the careful bench; the table written as its data (bnprobe/checks/identify/kernels.json, which compare-precision
and doctor read to name a real kernel's failures by its recipe) and as a docs page made from it (docs/kernels.md), so
both stay what the search finds — re-run it after a change to the policy space or a new framework version.

    python benchmarks/kernel_table.py [--kernels torch,torch-compile,onnxruntime] [--python jax=VENV/bin/python]
                                      [--shape 8,16,14,14] [--write] [--update] [--render] [--family]

Each framework's kernels run in the interpreter that has the framework: here when it is importable, otherwise in
the one given by ``--python NAME=PYTHON`` (repeatable; NAME an adapter or a framework extra: jax, tensorflow,
paddle, mindspore), which runs this script there for those rows — the frameworks pin conflicting packages, so
.ci/frameworks gives each a virtual environment of its own.  A kernel run nowhere is listed as not run, with the
install that would run it; nothing is guessed for it.  Without --write the table is printed; each row is printed
to stderr as soon as it is measured (identify takes up to a minute per kernel and format on 2 cores).  With --update
the kernels run replace their rows of the written data and the others' are kept (made on the same machine, versions
and shape, or it refuses).  The table's second section is the normalisation family's (LayerNorm, RMSNorm, GroupNorm:
identify --norm on :data:`FAMILY_KERNELS`); ``--family`` re-measures that section alone and keeps the BatchNorm rows
(made on the same machine, or it refuses).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bnprobe.checks.identify.kernels import DATA  # noqa: E402 - the package's table: its one copy

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "kernels.md"

#: (adapter, formats, params): the kernels of the table, in its order (params: how a model holds γ, β and the
#: running statistics for that kernel: mixed precision where the framework does so, the input's type in an ONNX node)
KERNELS = (
    ("torch", ("fp32", "fp16", "bf16"), "fp32"),
    ("torch-compile", ("fp32", "fp16", "bf16"), "fp32"),
    ("onnxruntime", ("fp32", "fp16"), "same"),
    ("jax", ("fp32", "fp16", "bf16"), "fp32"),
    ("tensorflow", ("fp32", "fp16", "bf16"), "fp32"),
    ("keras", ("fp32", "fp16", "bf16"), "fp32"),
    ("paddle", ("fp32",), "same"),
    ("mindspore", ("fp32", "fp16"), "fp32"),
)

#: (adapter, layers, formats, params): the normalisation family's kernels, in its section's order
FAMILY_KERNELS = (
    ("torch", ("layer", "rms", "group"), ("fp32", "fp16", "bf16"), "fp32"),
    ("torch-compile", ("layer", "rms", "group"), ("fp32", "fp16", "bf16"), "fp32"),
)
#: the groups of the GroupNorm probes the family section is measured on
FAMILY_GROUPS = 2

#: the packages whose releases the table records (a kernel's bits change with its framework's release)
PACKAGES = ("bnprobe", "torch", "onnxruntime", "jax", "flax", "tensorflow", "keras", "paddlepaddle", "mindspore")


def versus_careful(kernel, fmt: str, params: str, shape: str) -> dict:  # noqa: ANN001 - a kernel adapter
    """compare-precision of ``kernel`` in ``fmt`` on ``shape`` with the stress inputs, by msprobe's benchmark rule
    against the careful bench: the outputs that fail, and the output most worse than the careful kernel (its RMSE
    ratio and the input it shows on), or None where none is materially worse."""
    from bnprobe.checks.compare.precision import CallOptions, Judging, compare_precision, worse_rows
    from bnprobe.engine.cases import select_cases

    kernels, cases, _ = select_cases([kernel], shape=shape)
    rows = compare_precision(kernels, (fmt,), cases, options=CallOptions(params=params),
                             judging=Judging(bench="careful")).rows
    failing = sorted(set(rows.loc[rows["verdict"] != "PASS", "tensor"])) if len(rows) else []
    worse = worse_rows(rows)
    top = worse.loc[worse["rmse_vs_bench"].fillna(float("inf")).idxmax()] if len(worse) else None
    return {"shape": shape, "failing": failing,
            "worst": None if top is None else {"output": str(top["tensor"]), "input": str(top["case"]),
                                               "rmse_ratio": round(float(top["rmse_vs_bench"]), 3)}}


def row(adapter: str, fmt: str, params: str, shape: str | None = None) -> dict:
    """identify on one kernel and format: its recipe or its departure, per layout, and the time it took; with
    ``shape``, also its convention and what it loses against the careful bench (:func:`versus_careful`)."""
    from bnprobe.adapters.registry import BUILTIN
    from bnprobe.core.errors import BNProbeError

    info = BUILTIN[adapter]
    why = info.why_unavailable()
    base = {"kernel": adapter, "format": fmt, "params": params}
    if why:
        return {**base, "result": "not run", "why": why}
    from bnprobe.adapters import get_adapter
    from bnprobe.checks.identify.search import identify
    from bnprobe.core.conventions import get_convention

    kernel = get_adapter(adapter)
    t = time.perf_counter()
    try:
        res = identify(kernel, fmt, params=params)
    except BNProbeError as exc:
        return {**base, "result": "not run", "why": str(exc)}
    seconds = time.perf_counter() - t
    conv = get_convention(kernel.capabilities().convention)
    layouts = {lay: other.summary() for lay, other in res.layouts.items()}
    out = {**base, "result": "reproduced" if res.reproduced else "departs",
           "recipe": res.spec if res.reproduced or res.close else None,
           # (where only the backward departs, the spec is the forward's recipe: every forward stage reproduced)
           "forward_recipe": res.spec if res.departs == "backward" else None,
           "departs": res.departs, "departure": None if res.reproduced else res.departure(),
           "departing": [o.output for o in res.departing],
           "departure_size": None if res.reproduced else res.departure_size(),
           "outputs": [o.output for o in res.outputs], "other_layouts": layouts,
           "seconds": round(seconds, 1), "compile_seconds": round(getattr(kernel, "compile_seconds", 0.0), 1),
           # (a kernel that does not train keeps no running statistics and saves none: its convention is moot)
           **({"running_var": conv.running_var, "saved": conv.saved} if "train" in kernel.capabilities().modes
              else {"running_var": "-", "saved": "- (inference only)"})}
    if shape:
        out["vs_careful"] = versus_careful(kernel, fmt, params, shape)
    return out


def family_row(adapter: str, norm: str, fmt: str, params: str) -> dict:
    """identify --norm ``norm`` on one kernel and format: its recipe or its departure, and the time it took (the
    part of it spent compiling apart, for a kernel that compiles)."""
    from bnprobe.adapters.registry import BUILTIN
    from bnprobe.core.errors import BNProbeError

    base = {"kernel": adapter, "norm": norm, "format": fmt, "params": params}
    why = BUILTIN[adapter].why_unavailable()
    if why:
        return {**base, "result": "not run", "why": why}
    from bnprobe.adapters import get_adapter
    from bnprobe.checks.identify.family import identify_family

    kernel = get_adapter(adapter)
    t = time.perf_counter()
    try:
        res = identify_family(kernel, norm, fmt, params=params, groups=FAMILY_GROUPS if norm == "group" else None)
    except BNProbeError as exc:
        return {**base, "result": "not run", "why": str(exc)}
    return {**base, "result": "reproduced" if res.reproduced else "departs",
            "recipe": res.spec if res.reproduced or res.close else None,
            "departs": res.departs, "departure": None if res.reproduced else res.departure(),
            "departing": [o.output for o in res.departing],
            "departure_size": None if res.reproduced else res.departure_size(),
            "outputs": [o.output for o in res.outputs],
            "undistinguished": [f"{u.stage}: {u.chosen} or {' | '.join(u.alternatives)}" for u in res.undistinguished],
            "seconds": round(time.perf_counter() - t, 1),
            "compile_seconds": round(getattr(kernel, "compile_seconds", 0.0), 1)}


def family_rows() -> list[dict]:
    """The family section's rows (:data:`FAMILY_KERNELS`), each printed to stderr as it is measured."""
    rows = []
    for adapter, norms, fmts, params in FAMILY_KERNELS:
        for norm in norms:
            for fmt in fmts:
                rows.append(family_row(adapter, norm, fmt, params))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _render_family(rows: list[dict]) -> list[str]:
    """The family section of the page."""
    from bnprobe.core.call import NORM_NAMES

    intro = ("identify --norm on the LayerNorm, RMSNorm and GroupNorm kernels: the family's own search (its "
             "statistics' algorithm and lanes, ε's format and the inverse root, the saved statistics' format, y's "
             "formula, the backward's formula, threads and buffers; see [the normalisation family](norms.md)), on "
             f"designed probes (GroupNorm's with {FAMILY_GROUPS} groups) and confirmed on fresh inputs. The fields "
             "the probes could not tell apart are listed beside each recipe: each alternative reproduced every "
             "output as well. torch-compile's seconds include compiling each probe's kernels, given apart in "
             "brackets.")
    lines = ["", "## LayerNorm, RMSNorm, GroupNorm", "", *textwrap.wrap(intro, 116), "",
             "| kernel | layer | format | params | found | recipe or departure | not told apart | identify s "
             "(compiling) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        layer = NORM_NAMES[r["norm"]]
        if r["result"] == "not run":
            lines.append(f"| {r['kernel']} | {layer} | {r['format']} | {r['params']} | not run | {r['why']} | | |")
            continue
        what = f"`{r['recipe']}`" if r["result"] == "reproduced" else (
            f"departs at {r['departs']}: " + (f"closest `{r['recipe']}` ({', '.join(r['departing'])}: "
                                              f"{r['departure_size']})" if r["recipe"] else r["departure"]))
        ties = "; ".join(r["undistinguished"]) or "-"
        timing = f"{r['seconds']:g}" + (f" ({r['compile_seconds']:g})" if r.get("compile_seconds") else "")
        lines.append(f"| {r['kernel']} | {layer} | {r['format']} | {r['params']} | {r['result']} | {what} | "
                     f"{ties} | {timing} |")
    return lines


def _vs_careful_cell(r: dict) -> str:
    vs = r.get("vs_careful")
    if not vs:
        return ""
    fails = f"{len(vs['failing'])} fail" + (f" ({', '.join(vs['failing'])})" if vs["failing"] else "")
    w = vs["worst"]
    return fails + (f"; most worse: {w['output']} on {w['input']}, {w['rmse_ratio']:g}x" if w else "; none worse")


def render(doc: dict) -> str:
    """The docs page of the table in ``doc`` (kernels.json's content)."""
    intro = ("identify run on the BatchNorm kernels users run, each format, on designed probes and confirmed on fresh "
             "inputs (see [identify](commands/identify.md)). A **recipe** is a policy spec: "
             "`bnprobe compare-precision --adapters emulated:<recipe>` runs bnprobe's exact emulation of that kernel "
             "anywhere. A **departure** says which stage no recipe in the space reproduces, by how much and where; "
             "a closest recipe is shown only when it is close. Generated by `python benchmarks/kernel_table.py "
             "--write` — not edited by hand; its data is bnprobe's `bnprobe/checks/identify/kernels.json`, which "
             "compare-precision and doctor read to name a real kernel's failing outputs by its recipe (a recipe "
             "trusted on a call only where its emulation reproduces that call).")
    losses = ("What each kernel loses against the careful bench (the best a kernel can do under the interface): "
              f"compare-precision on {doc.get('shape', '?')} with the stress inputs, msprobe's benchmark rule; the "
              "outputs that fail, and the output most worse than the careful kernel with its RMSE ratio. The "
              "convention is the framework's own (running variance; the statistics it saves), by which its running "
              "statistics are judged ([frameworks](frameworks.md)).")
    lines = ["# What each kernel computes", "", *textwrap.wrap(intro, 116), "",
             *textwrap.wrap(f"Machine: {doc['machine']}; {doc['versions']}.", 116), "",
             "| kernel | format | params | found | recipe or departure | other layout | identify s (compiling) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        if r["result"] == "not run":
            lines.append(f"| {r['kernel']} | {r['format']} | {r['params']} | not run | {r['why']} | | |")
            continue
        what = f"`{r['recipe']}`" if r["result"] == "reproduced" else (
            (f"forward reproduced by `{r['forward_recipe']}`; " if r.get("forward_recipe") else "")
            + f"departs at {r['departs']}: " + (f"closest `{r['recipe']}` ({', '.join(r['departing'])}: "
                                                f"{r['departure_size']})" if r["recipe"] else r["departure"]))
        other = "; ".join(f"{k}: {v}" for k, v in r["other_layouts"].items()) or "-"
        timing = f"{r['seconds']:g}" + (f" ({r['compile_seconds']:g})" if r["compile_seconds"] else "")
        lines.append(f"| {r['kernel']} | {r['format']} | {r['params']} | {r['result']} | {what} | {other} | "
                     f"{timing} |")
    ran = [r for r in doc["rows"] if r.get("vs_careful")]
    if ran:
        lines += ["", "## Against the careful bench", "", *textwrap.wrap(losses, 116), "",
                  "| kernel | format | running var | saved | vs careful bench |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['kernel']} | {r['format']} | {r['running_var']} | {r['saved']} | {_vs_careful_cell(r)} |"
                  for r in ran]
    if doc.get("family_rows"):
        lines += _render_family(doc["family_rows"])
    return "\n".join(lines) + "\n"


def versions() -> list[str]:
    """``package release`` of each of :data:`PACKAGES` installed in this interpreter."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in PACKAGES:
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            continue
    return out


def _elsewhere(python: str, kernels: list[str], shape: str) -> dict:
    """This script's rows of ``kernels`` measured by the interpreter ``python`` (with this checkout first on its
    path), and that interpreter's package releases."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:  # (a file, not stdout: frameworks print to stdout as they load)
        answer = Path(tmp) / "rows.json"
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--kernels", ",".join(kernels), "--shape",
                               shape, "--rows-to", str(answer)], cwd=ROOT, env=env, check=False)
        if proc.returncode or not answer.is_file():
            sys.exit(f"kernel_table: {python} failed on {', '.join(kernels)} (exit {proc.returncode})")
        return json.loads(answer.read_text())


def _parse_pythons(given: list[str]) -> dict[str, str]:
    """``--python NAME=PYTHON`` values as {adapter: python}; NAME an adapter of the table or a framework extra."""
    from bnprobe.adapters.frameworks import FRAMEWORKS

    known = {k for k, _, _ in KERNELS}
    out = {}
    for item in given:
        name, sep, python = item.partition("=")
        if not sep or not python:
            sys.exit(f"kernel_table: --python takes NAME=PYTHON, not {item!r}")
        names = [name] if name in known else [a for a, (_, _, extra) in FRAMEWORKS.items() if extra == name]
        if not names:
            sys.exit(f"kernel_table: --python {name}: not a kernel of the table nor a framework extra")
        if not Path(python).is_file():
            sys.exit(f"kernel_table: --python {name}: {python} is not a file")
        out.update(dict.fromkeys(names, python))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(k for k, _, _ in KERNELS))
    ap.add_argument("--python", action="append", default=[], metavar="NAME=PYTHON",
                    help="run NAME's rows (an adapter, or a framework extra) in that interpreter")
    ap.add_argument("--shape", default="8,16,14,14", help="compare-precision's input shape against the careful bench")
    ap.add_argument("--write", action="store_true", help="write the table's data and docs/kernels.md")
    ap.add_argument("--update", action="store_true", help="with --write: replace only the rows of --kernels")
    ap.add_argument("--render", action="store_true", help="only re-make docs/kernels.md from the table's data")
    ap.add_argument("--family", action="store_true", help="re-measure only the normalisation family's section")
    ap.add_argument("--rows-to", help=argparse.SUPPRESS)  # (how a --python run answers: its rows as JSON there)
    args = ap.parse_args()
    from bnprobe._files import atomic_write_text as write_text

    if args.render:
        write_text(PAGE, render(json.loads(DATA.read_text())))
        print(f"wrote {PAGE} from {DATA}")
        return
    if args.family:
        _family_only(args.write, write_text)
        return
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(wanted) - {k for k, _, _ in KERNELS})
    if unknown:
        sys.exit(f"kernel_table: unknown kernel(s) {', '.join(unknown)}; known: "
                 + ", ".join(k for k, _, _ in KERNELS))
    from bnprobe.adapters.registry import BUILTIN

    pythons = _parse_pythons(args.python)
    rows, found = [], versions()
    for adapter, fmts, params in KERNELS:
        if adapter not in wanted:
            continue
        if adapter in pythons and BUILTIN[adapter].why_unavailable():
            there = _elsewhere(pythons[adapter], [adapter], args.shape)
            rows += there["rows"]
            found += [v for v in there["versions"] if v not in found]
            continue
        for fmt in fmts:
            rows.append(row(adapter, fmt, params, args.shape))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.rows_to:
        write_text(Path(args.rows_to), json.dumps({"rows": rows, "versions": found}))
        return
    import torch

    cpu = torch.backends.cpu.get_cpu_capability()
    doc = {"machine": f"{platform.machine()} ({cpu}), {torch.get_num_threads()} threads",
           "versions": ", ".join(found), "shape": args.shape, "rows": rows}
    if not args.update and "torch" in wanted:  # (a whole table re-measures the family's section too)
        doc["family_rows"] = family_rows()
    if args.update:
        old = json.loads(DATA.read_text())
        # (a run of some kernels sees only their frameworks' versions: each must be one the table was made with)
        unseen = [v for v in found if v not in old.get("versions", "").split(", ")]
        if old.get("machine") != doc["machine"] or unseen or old.get("shape") not in (None, doc["shape"]):
            sys.exit(f"kernel_table: --update on another machine, versions or shape than the table's "
                     f"({old['machine']}; {old['versions']}; {old.get('shape')}): re-make the whole table")
        doc["versions"] = old["versions"]
        new = {(r["kernel"], r["format"]): r for r in rows}
        doc["rows"] = [new.get((r["kernel"], r["format"]), r) for r in old["rows"]]
        if "family_rows" in old:
            doc["family_rows"] = old["family_rows"]
    if args.write:
        write_text(DATA, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        write_text(PAGE, render(doc))
        print(f"wrote {PAGE} and {DATA}")
    else:
        print(render(doc))


def _family_only(write: bool, write_text) -> None:  # noqa: ANN001 - bnprobe._files.atomic_write_text
    """--family: the family's section measured again, the BatchNorm rows kept (the same machine, or it refuses)."""
    import torch

    doc = json.loads(DATA.read_text())
    cpu = torch.backends.cpu.get_cpu_capability()
    machine = f"{platform.machine()} ({cpu}), {torch.get_num_threads()} threads"
    here = [v for v in versions() if v.split()[0] in ("bnprobe", "torch")]
    if doc.get("machine") != machine or any(v not in doc.get("versions", "").split(", ") for v in here):
        sys.exit(f"kernel_table: --family on another machine or versions than the table's ({doc.get('machine')}; "
                 f"{doc.get('versions')}): re-make the whole table")
    doc["family_rows"] = family_rows()
    if write:
        write_text(DATA, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        write_text(PAGE, render(doc))
        print(f"wrote {PAGE} and {DATA}")
    else:
        print(render(doc))


if __name__ == "__main__":
    main()

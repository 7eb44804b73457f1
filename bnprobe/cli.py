"""The ``bnprobe`` command line: parse, call the library once, render.

The only module that prints.  Bad input of any kind is one line on stderr,
``bnprobe: error: ...``, and exit status 2.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from bnprobe import __version__
from bnprobe.errors import BNProbeError
from bnprobe.reports import dumps_json

app = typer.Typer(
    name="bnprobe",
    help="Numerical precision and debugging toolkit for BatchNorm: an FP64 golden, exact FP32/FP16/BF16 "
         "emulation and instrumented kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bnprobe {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit."),
          max_memory: Optional[str] = typer.Option(None, "--max-memory", metavar="SIZE",
                                                   help="Refuse runs estimated to need more memory than SIZE (e.g. "
                                                        "4G; default: the memory available, or $BNPROBE_MAX_MEMORY). "
                                                        "Also accepted after the command.")) -> None:
    """bnprobe: BatchNorm precision checks."""
    from bnprobe.guard import parse_size, set_memory_limit

    set_memory_limit(parse_size(max_memory) if max_memory is not None else None)


@app.command()
def trace(
    policy: Optional[str] = typer.Option(None, help="Preset (fp64, fp32, fp16, bf16, fp16-acc16, bf16-acc16) with "
                                                    "optional overrides, e.g. 'fp16:variance=naive,order=lanes' "
                                                    "(default fp16; for a recorded call, its format's preset)."),
    shape: Optional[str] = typer.Option(None, help="Input shape N,C[,L|H,W|D,H,W] for generated input "
                                                   "(default 8,16,14,14)."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed of the generated input and parameters (default 0)."),
    mean: Optional[float] = typer.Option(None, help="Mean of the generated input (default 0)."),
    std: Optional[float] = typer.Option(None, help="Standard deviation of the generated input (default 1)."),
    dist: Optional[str] = typer.Option(None, help="Distribution: normal (default), uniform, student_t, constant."),
    mode: Optional[str] = typer.Option(None, help="train (default; a recorded call's own), infer or backward."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (> 0; default 1e-5)."),
    momentum: Optional[float] = typer.Option(None, help="Running-stat momentum (PyTorch convention; default 0.1)."),
    layout: Optional[str] = typer.Option(None, help="channels_first (default) or channels_last."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 or same (γ, β, running and saved "
                                                    "statistics in the input's format); default: the policy's own "
                                                    "(a recording's own)."),
    input: Optional[Path] = typer.Option(None, "--input", help="Use this .npy/.npz tensor as x instead, or a dump "
                                                               "DIR[#NAME] of one call (all its inputs and scalars)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="The recorded call to trace (glob), when --input is a "
                                                              "dump of several."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """Run one BatchNorm layer and show every stage: range, error vs the FP64 golden, anomalies."""
    import numpy as np

    from bnprobe.checks.recorded import check_params, given, is_dump_path, one_call, refuse
    from bnprobe.checks.stages import trace_recorded, trace_run
    from bnprobe.inputs import make_params
    from bnprobe.kernels.layout import Layout, layout_of

    check_params(params)
    if input is not None and is_dump_path(input):
        call, rec = one_call(input, calls, "trace", guard="trace")
        refuse(given(shape=shape, seed=seed, mean=mean, std=std, dist=dist, eps=eps, momentum=momentum),
               str(input).partition("#")[0])
        if layout is not None and layout != rec.layout:
            raise BNProbeError(f"--layout {layout} contradicts the recording: {call.label} is {rec.layout}")
        cmp = trace_recorded(rec, policy=policy, mode=mode, label=call.label, params=params)
        source = f"recorded call {call.label} of {str(input).partition('#')[0]} (its γ, β, running statistics, dy)"
        mode, eps_v, mom_v, lay = cmp.mode, rec.eps, rec.momentum, Layout(tuple(cmp.shape), rec.layout)
    else:
        if calls is not None:
            raise BNProbeError("--calls selects recorded calls: give a dump as --input DIR")
        mode, eps_v, mom_v = mode or "train", 1e-5 if eps is None else eps, 0.1 if momentum is None else momentum
        m, s, sd, d = 0.0 if mean is None else mean, 1.0 if std is None else std, 0 if seed is None else seed, \
            dist or "normal"
        x = _input_tensor("trace", input, shape or "8,16,14,14", d, m, s, sd)
        source = str(input) if input is not None else f"{d}(mean={m:g}, std={s:g}), seed {sd}"
        lay = layout_of(x, layout or "channels_first")
        c = lay.channels
        prm = make_params(c, sd)
        rng = np.random.default_rng([sd, 2])
        dy = rng.standard_normal(x.shape) if mode == "backward" else None
        cmp = trace_run(x, policy=policy or "fp16", mode=mode, gamma=prm["gamma"], beta=prm["beta"],
                        running_mean=np.full(c, m), running_var=np.full(c, max(s, 0.0) ** 2),
                        dy=dy, eps=eps_v, momentum=mom_v, layout=lay.layout, params=params)
    if as_json:
        out = cmp.to_dict()
        out["input"] = source
        typer.echo(dumps_json(out))
        return
    from bnprobe._table import render_table

    meta = cmp.meta
    typer.echo(f"policy   {cmp.policy.describe()}")
    typer.echo(f"input    {source}, shape {tuple(lay.shape)} ({lay.layout}), C = {lay.channels}, R = N*spatial = "
               f"{lay.reduce_size}")
    typer.echo(f"mode     {mode}; eps {eps_v:g} (as used: {meta.get('eps_effective', eps_v):.6g})"
               + ((f", momentum {mom_v:g}" if mom_v is not None else ", momentum None (cumulative average)")
                  if mode == "train" else ""))
    typer.echo("errors   against the FP64 golden (same algorithm, same rounded inputs); "
               "ulp = in the stage's own format")
    typer.echo("")
    rows = []
    for r in cmp.rows:
        d_ = r.to_dict()
        d_["anomalies"] = " ".join(f"{k}={v}" for k, v in r.anomalies.items()) or ""
        if r.mismatched_nonfinite:
            d_["anomalies"] = (d_["anomalies"] + f" nonfinite-vs-golden={r.mismatched_nonfinite}").strip()
        rows.append(d_)
    typer.echo(render_table(rows, ["stage", "format", "kind", "min", "max", "max_abs_err", "max_rel_err",
                                   "max_ulp_err", "anomalies"],
                            headers=["stage", "format", "kind", "min", "max", "max abs err", "max rel err",
                                     "max ulp", "anomalies"]))
    inp = cmp.trace["x"] if cmp.trace is not None and "x" in cmp.trace else None
    if inp is not None and (inp.count("nan") or inp.count("posinf") or inp.count("neginf")):
        typer.echo("\nnote: NaN/inf present in the input itself (input-borne, not a kernel fault)")


def _input_tensor(command: str, input: Optional[Path], shape: str, dist: str, mean: float, std: float,  # noqa: ANN202
                  seed: int):
    """The --input tensor, or one generated from --shape/--dist/--mean/--std/--seed; refused before it is loaded
    or made when ``command`` on it would exceed the memory limit."""
    from bnprobe.guard import require_run
    from bnprobe.inputs import array_header, load_array, make_input, parse_shape

    if input is not None:
        shp = array_header(input)[0]
        require_run(command, shp, f"{command} on {input} (shape {shp})")
        return load_array(input)
    shp = parse_shape(shape)
    require_run(command, shp)
    return make_input(shp, dist=dist, mean=mean, std=std, seed=seed)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p, 0) for p in text.split(",") if p.strip())
    except ValueError:
        raise BNProbeError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values:
        raise BNProbeError(f"{what} is empty")
    return values


@app.command("rsqrt")
def rsqrt_cmd(
    op: str = typer.Option("rsqrt", help="rsqrt, reciprocal, sqrt or divide."),
    format: str = typer.Option("fp32", "--format", help="fp32, fp16 or bf16."),
    method: str = typer.Option("magic", help="exact, magic, table, frsqrte (rsqrt), frecpe (reciprocal), "
                                              "exp_log (sqrt)."),
    constant: Optional[str] = typer.Option(None, help="Bit-trick constant, e.g. 0x5f3759df (default per format)."),
    bits: int = typer.Option(12, help="Significant fraction bits of a table estimate."),
    newton: str = typer.Option("0,1,2", help="Newton (Heron for exp_log) step counts to analyse."),
    form: str = typer.Option("standard", help="Newton form: standard, fma (Ascend 950) or arm (FRSQRTS)."),
    working: Optional[str] = typer.Option(None, help="Format of the Newton steps (e.g. fp64, as the literature "
                                                     "measures seeds); default: the format itself."),
    subnormals: str = typer.Option("keep", help="keep, or zero (subnormal inputs treated as 0)."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Every positive finite input (fp32: all 2^31, "
                                                                "minutes)."),
    samples: Optional[int] = typer.Option(None, help="Analyse N random inputs instead."),
    seed: int = typer.Option(0, min=0, help="Seed of the random inputs."),
    out: Optional[Path] = typer.Option(None, help="Write CSV, JSON and the error plot (PNG) to this folder."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> None:
    """ULP and relative error of rsqrt / reciprocal / sqrt / divide methods as accelerators compute them.

    Default domain: every input for fp16 and bf16; for fp32 a proven-reduced domain (one period, the
    subnormals and the extreme binades) confirmed by random samples over the whole range.
    """
    from bnprobe._progress import Progress
    from bnprobe._table import render_table
    from bnprobe.checks.mathfn import MathSpec, analyze

    try:
        c = int(constant, 0) if constant is not None else None
    except ValueError:
        raise BNProbeError(f"--constant must be an integer such as 0x5f3759df, got {constant!r}") from None
    spec = MathSpec(op=op, format=format, method=method, constant=c, bits=bits, form=form,
                    subnormals=subnormals, working=working)
    if exhaustive and samples is not None:
        raise BNProbeError("give --exhaustive or --samples, not both")
    if samples is not None and samples < 1:
        raise BNProbeError(f"--samples must be >= 1, got {samples}")
    domain = "exhaustive" if exhaustive else ("samples" if samples is not None else "auto")
    steps = _int_list(newton, "--newton")
    stem = f"{op}-{spec.format}-{method}"
    sink = _output(out, force, "", f"{stem}.csv", f"{stem}.json", f"{stem}.png")
    bar = Progress(f"{spec.label()}")
    try:
        result = analyze(spec, steps, domain=domain, samples=samples or (1 << 20), seed=seed, progress=bar)
    finally:
        bar.close()
    targets: list[Path] = []
    if sink is not None:
        from bnprobe.plots import plot_math_error

        sink.write_text(f"{stem}.csv", result.to_frame().to_csv(index=False))
        sink.write_text(f"{stem}.json", dumps_json(result.to_dict()))
        if result.curve:
            sink.save_figure(f"{stem}.png", plot_math_error(result), dpi=120)
        targets = sink.commit()
    if as_json:
        typer.echo(dumps_json(result.to_dict()))
        return
    typer.echo(f"{spec.label()}: {spec.form} Newton form"
               + (f", steps in {spec.working}" if spec.working else "") + f"; domain {result.domain}")
    rows = [{**s.row(), "correct %": 100.0 * s.correctly_rounded} for s in result.steps]
    typer.echo(render_table(rows, ["newton", "inputs", "max_ulp_normal", "mean_ulp_normal", "max_rel_normal",
                                   "correct %", "max_ulp", "nonfinite", "nonfinite_mismatch"],
                            headers=["newton", "inputs", "max ulp", "mean ulp", "max rel err", "correct %",
                                     "max ulp (incl. subnormal)", "non-finite", "of which wrong"]))
    for st in result.steps:
        if st.histogram:
            total = sum(st.histogram.values())
            parts = "  ".join(f"{k}: {100.0 * v / total:.3g}%" for k, v in st.histogram.items())
            typer.echo(f"ulp histogram, {st.newton} step(s): {parts}")
    last = result.steps[-1]
    if last.worst:
        typer.echo(f"\nworst normal inputs after {last.newton} step(s):")
        typer.echo(render_table(last.worst[:5], ["x", "result", "exact", "ulp"]))
    for note in result.notes:
        typer.echo(f"note: {note}")
    if targets:
        typer.echo("wrote " + ", ".join(str(t) for t in targets))


@app.command("adapters")
def adapters_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List every kernel adapter, whether it is available here, and if not, why."""
    from bnprobe._table import render_table
    from bnprobe.adapters.registry import list_adapters

    rows = list_adapters()
    if as_json:
        typer.echo(dumps_json(rows))
        return
    for r in rows:
        r["status"] = "yes" if r["available"] else f"no: {r['why']}"
    typer.echo(render_table(rows, ["name", "status", "description"], headers=["adapter", "available", "what"]))
    typer.echo("\noptions: emulated:<policy>, ascend-tbe:chip=910,cores=8, dump:DIR[#CALL-GLOB]; "
               "plugins: package.module:Name or the 'bnprobe.adapters' entry-point group")


@app.command("dump")
def dump_cmd(
    adapter: str = typer.Option(..., "--adapter", help="Adapter to record, e.g. torch, ascend-tbe, emulated:fp16."),
    out: Path = typer.Option(..., "--out", help="Folder to write bnprobe-dump.json and tensors.npz into."),
    dtype: str = typer.Option("fp16", help="Format to run in: fp64, fp32, fp16, bf16."),
    params: str = typer.Option("fp32", help="Parameter precision: fp32 (mixed precision) or same."),
    shape: str = typer.Option("8,16,14,14", help="Shape of generated input N,C[,...]."),
    seed: int = typer.Option(0, min=0, help="Seed of the generated input, parameters and dy."),
    mean: float = typer.Option(0.0, help="Mean of the generated input."),
    std: float = typer.Option(1.0, help="Standard deviation of the generated input."),
    dist: str = typer.Option("normal", help="normal, uniform, student_t, constant."),
    input: Optional[Path] = typer.Option(None, "--input", help="Use this .npy/.npz tensor as x."),
    modes: str = typer.Option("train,infer,backward", help="Which calls to record."),
    eps: float = typer.Option(1e-5, help="BatchNorm epsilon."),
    momentum: float = typer.Option(0.1, help="Running-stat momentum."),
    layout: str = typer.Option("channels_first", help="channels_first or channels_last."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing dump."),
) -> None:
    """Record an adapter's inputs and outputs as a bnprobe dump, to replay and compare anywhere."""
    import numpy as np

    from bnprobe.adapters import get_adapter
    from bnprobe.adapters.dump import record, write_dump
    from bnprobe.checks.recorded import check_params
    from bnprobe.inputs import make_params
    from bnprobe.kernels.layout import layout_of

    check_params(params)
    _output(out, force, "", "bnprobe-dump.json", "tensors.npz")
    wanted = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in wanted if m not in ("train", "infer", "backward")]
    if bad or not wanted:
        raise BNProbeError(f"--modes takes train, infer, backward; got {modes!r}")
    a = get_adapter(adapter)
    x = _input_tensor("dump", input, shape, dist, mean, std, seed)
    lay = layout_of(x, layout)
    c = lay.channels
    prm = make_params(c, seed)
    dy = np.random.default_rng([seed, 2]).standard_normal(x.shape)
    rec = record(a, x=x, gamma=prm["gamma"], beta=prm["beta"], running_mean=np.full(c, mean),
                 running_var=np.full(c, std**2 if std > 0 else 1.0), dy=dy, dtype=dtype, eps=eps, momentum=momentum,
                 layout=layout, params=params, modes=wanted,
                 meta={"seed": seed, "input": str(input) if input else f"{dist}(mean={mean}, std={std})"})
    files = write_dump(rec, out, force=force)
    typer.echo(f"recorded {a.name} ({', '.join(rec.modes)}) in {rec.dtype}: " + ", ".join(str(f) for f in files))
    typer.echo(f"replay it as an adapter: --adapter dump:{out}")


_SINKS: list = []  # the output folders of the running command: discarded by main() when it fails


def _output(out: Optional[Path], force: bool, stem: str = "", *names: str):  # noqa: ANN202 - OutputDir | None
    """The run's output folder, checked and created now, before any work (``None`` without ``--out`` unless
    ``stem`` names a default ``reports/<stem>-<time>``); the files ``names`` refused now if they exist. A run that
    fails leaves neither the folder (when it created it) nor any file in it."""
    if out is None and not stem:
        return None
    from bnprobe.reports import output_dir

    sink = output_dir(out, stem, force=force)
    _SINKS.append(sink)
    sink.claim(*names)
    return sink


def _write_reports(sink, stem: str, frame, doc: dict, markdown: str) -> list[Path]:
    """CSV, JSON and Markdown of one result into the output folder, all or nothing, never over existing files
    without ``--force``."""
    sink.write_text(f"{stem}.csv", frame.to_csv(index=False))
    sink.write_text(f"{stem}.json", dumps_json(doc))
    sink.write_text(f"{stem}.md", markdown)
    return sink.commit()


def _close(notes: list[str], written: list[Path] | None) -> None:
    """A report's closing lines: its notes, and the files written (when any were)."""
    for n in notes:
        typer.echo(f"note: {n}")
    if written is not None:
        typer.echo("wrote " + ", ".join(str(w) for w in written))


@app.command("gradcheck")
def gradcheck_cmd(
    adapter: str = typer.Option("emulated", help="Adapter whose backward is checked, or dump:DIR[#NAME] (every "
                                                 "recorded call, each on its own inputs)."),
    dtype: Optional[str] = typer.Option(None, help="Format: fp16 (default), bf16, fp32 or fp64; a recording's own."),
    shape: Optional[str] = typer.Option(None, help="Input shape N,C[,...] of generated inputs (default 4,3,5,5)."),
    mode: Optional[str] = typer.Option(None, help="train (default) or infer; a recording's own."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed of the generated inputs (default 0)."),
    formula: Optional[str] = typer.Option(None, help="Check a backward formula instead: standard, seed, ascend "
                                                     "or module:function (f(dy, x, gamma, mean, var, eps) -> dx)."),
    rtol: Optional[float] = typer.Option(None, help="Relative tolerance (give with --atol)."),
    atol: Optional[float] = typer.Option(None, help="Absolute tolerance (give with --rtol)."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (default 1e-5; a recording's own)."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same "
                                                    "(γ, β, running and saved statistics in the input's format); a "
                                                    "recording's own."),
    input: Optional[Path] = typer.Option(None, "--input", help="A dump folder (bnprobe or msprobe): run the adapter "
                                                               "on every recorded call's own inputs."),
    calls: Optional[str] = typer.Option(None, "--calls", help="Recorded calls to check (glob on the call or module "
                                                              "name), e.g. '*layer1*'."),
    out: Optional[Path] = typer.Option(None, help="Write CSV, JSON and Markdown to this folder."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
) -> int:
    """Numerical vs analytic gradients (FP64 finite differences), the adapter's backward vs the FP64
    golden, the gradient identities, or a candidate backward formula; on a dump, every recorded call on
    its own inputs. Exit 1 when a check fails."""
    from bnprobe._table import render_table
    from bnprobe.checks.gradients import check_formula, gradcheck, gradcheck_recorded
    from bnprobe.checks.recorded import check_options, check_params, given, is_dump_path, recording_of
    from bnprobe.guard import require_run
    from bnprobe.inputs import parse_shape
    from bnprobe.kernels.layout import check_eps

    if eps is not None:
        check_eps(eps)
    check_params(params)
    if input is not None and not is_dump_path(input):
        raise BNProbeError(f"--input {input}: gradcheck takes a dump folder (bnprobe or msprobe) as --input")
    sink = _output(out, force)
    recorded = recording_of(adapter, input, calls, guard="gradcheck")
    if recorded is not None:
        if formula is not None:
            raise BNProbeError("--formula checks a formula on generated inputs: it contradicts the recording; drop "
                               "one of them")
        check_options(recorded, given=given(shape=shape, eps=eps, seed=seed), dtype=dtype, params=params)
        run = gradcheck_recorded(recorded, mode=mode, rtol=rtol, atol=atol)
        summary = []
        failed = []
        for i, res in enumerate(run.results):
            bad = res.failed()
            fd = [r for r in res.rows if r.check == "finite-differences"]
            summary.append({"#": i, "call": res.call, "format": res.dtype, "mode": res.mode, "checks": len(res.rows),
                            "failed": len(bad), "failing": ", ".join(dict.fromkeys(r.tensor for r in bad)),
                            "fd": ("full" if any(r.detail.startswith("full") for r in fd) else "projections")
                            if fd else "-", "used %": 100.0 * max((r.used for r in res.rows), default=0.0)})
            failed += [{**r.to_dict(), "call": res.call, "used %": 100.0 * r.used} for r in bad]
        table = render_table(summary, ["#", "call", "format", "mode", "checks", "failed", "failing", "fd", "used %"],
                             headers=["#", "call (forward order)", "format", "mode", "checks", "failed", "failing",
                                      "finite diff.", "worst tol used %"])
        title = (f"gradcheck {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
                 f"{'PASS' if run else 'FAIL'}")
        if out is not None:
            md = f"# {title}\n\n```\n{table}\n```\n\n" + "\n".join(f"- {n}" for n in run.notes) + "\n"
            stem = f"gradcheck-{run.kernel.replace(':', '_').replace('/', '_')}-recorded"
            written = _write_reports(sink, stem, run.to_frame(), run.to_dict(), md)
        if as_json:
            typer.echo(dumps_json(run.to_dict()))
            return 0 if run else 1
        typer.echo(title)
        typer.echo(table)
        if failed:
            typer.echo("\nfailed checks:")
            typer.echo(render_table(failed, ["call", "check", "tensor", "max_abs", "used %", "min_atol", "min_rtol",
                                             "where"],
                                    headers=["call", "check", "tensor", "max abs err", "tol used %", "needs atol",
                                             "needs rtol", "worst at"]))
        notes = list(run.notes) + [f"{r.call}: {n}" for r in run.results for n in r.notes
                                   if not n.startswith("finite differences on")]
        _close(notes, written if out is not None else None)
        return 0 if run else 1
    shp = parse_shape(shape or "4,3,5,5")
    require_run("gradcheck", shp)
    e = 1e-5 if eps is None else eps
    s = 0 if seed is None else seed
    if formula is not None:
        if params is not None:
            raise BNProbeError("--formula checks a formula in FP64: --params does not apply; drop it")
        result = check_formula(formula, shp, seed=s, eps=e, rtol=rtol, atol=atol)
    else:
        result = gradcheck(adapter, dtype or "fp16", shp, mode=mode or "train", seed=s, eps=e, rtol=rtol, atol=atol,
                           params=params)
    rows = [{**r.to_dict(), "used %": 100.0 * r.used} for r in result.rows]
    cols = ["check", "tensor", "status", "max_abs", "max_rel", "used %", "min_rtol", "where"]
    heads = ["check", "tensor", "status", "max abs err", "max rel err", "tol used %", "needs rtol", "worst at"]
    table = render_table(rows, cols, headers=heads)
    title = (f"gradcheck {result.adapter} in {result.dtype}"
             + (f" (params {params})" if params is not None and formula is None else "")
             + f", {result.mode}, shape {tuple(result.shape)}, seed {result.seed}: {'PASS' if result else 'FAIL'}")
    if out is not None:
        md = f"# {title}\n\n```\n{table}\n```\n\n" + "\n".join(f"- {n}" for n in result.notes) + "\n"
        stem = f"gradcheck-{result.adapter.replace(':', '_').replace('/', '_')}-{result.dtype}-{result.mode}"
        written = _write_reports(sink, stem, result.to_frame(), result.to_dict(), md)
    if as_json:
        typer.echo(dumps_json(result.to_dict()))
    else:
        typer.echo(title)
        typer.echo(table)
        _close(result.notes, written if out is not None else None)
    return 0 if result else 1


@app.command("compare-precision")
def compare_precision_cmd(
    adapters: str = typer.Option("emulated", help="Comma-separated adapters, e.g. emulated,ascend-tbe,torch, or "
                                                  "dump:DIR (every BatchNorm call of a bnprobe/msprobe dump)."),
    dtypes: Optional[str] = typer.Option(None, help="Comma-separated formats (default fp16,bf16,fp32; a recording's "
                                                    "own format)."),
    shape: Optional[str] = typer.Option(None, help="One input shape N,C[,...] instead of the ResNet-50 set."),
    shapes: str = typer.Option("resnet50", help="Shape set when --shape is not given: resnet50."),
    batch: Optional[int] = typer.Option(None, min=1, max=65_536,
                                        help="Batch size of the ResNet-50 shapes (default 2)."),
    dist: Optional[str] = typer.Option(None, help="Distribution of generated input: normal, uniform, student_t, "
                                                  "constant."),
    mean: Optional[float] = typer.Option(None, help="Mean of the generated input (default 0)."),
    std: Optional[float] = typer.Option(None, help="Standard deviation of the generated input (default 1)."),
    input: Optional[Path] = typer.Option(None, "--input", help="Real activations: .npy, .npz, or a dump folder "
                                                               "(every recorded call's inputs)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="Recorded calls to run (glob on the call or module "
                                                              "name), e.g. '*layer1*'."),
    stress: bool = typer.Option(True, "--stress/--no-stress", help="Add the stress inputs (large means, heavy "
                                                                   "tails, near FP16 max, var near eps, ...)."),
    mode: str = typer.Option("all", help="train, infer, backward or all."),
    seed: int = typer.Option(0, min=0, help="Seed of generated inputs."),
    rule: str = typer.Option("benchmark", help="Kernel verdict: benchmark (msprobe's method: the kernel's error "
                                               "against the bench's, both against the FP64 golden), or an absolute "
                                               "rule: scaled, accumulated, threshold."),
    bench: str = typer.Option("careful", help="The bench of the benchmark rule: a careful kernel in the same "
                                              "formats (careful), or any runnable adapter, e.g. torch."),
    budget: bool = typer.Option(True, "--budget/--no-budget", help="Per-stage error budget (emulated kernels)."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (default 1e-5; a recording's own)."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same "
                                                    "(the input's format); a recording's own."),
    out: Optional[Path] = typer.Option(None, help="Report folder (default reports/compare-precision-<time>)."),
    format: str = typer.Option("csv,json,md,html", "--format", help="Report files to write."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
) -> int:
    """FP16/BF16/FP32 vs the FP64 golden for every BatchNorm output, per tensor, per channel and per
    stage; on a dump, every recorded call on its own inputs. Exit 0 when all are within standard, 1 when
    some are not."""
    from bnprobe._progress import Progress
    from bnprobe._table import render_table
    from bnprobe.adapters import get_adapter
    from bnprobe.adapters.base import PARAM_PRECISIONS
    from bnprobe.adapters.dump import DumpAdapter
    from bnprobe.checks.compare import (
        REPORT_FORMATS,
        Case,
        compare_precision,
        first_failing_call,
        per_call,
        recorded_cases,
        report_files,
        resnet50_cases,
        stress_cases,
        summarize,
        write_report,
    )
    from bnprobe.guard import require_run
    from bnprobe.inputs import parse_shape
    from bnprobe.kernels.layout import check_eps

    if eps is not None:
        check_eps(eps)
    if params is not None and params not in PARAM_PRECISIONS:
        raise BNProbeError(f"--params takes {' or '.join(PARAM_PRECISIONS)}, got {params!r}")
    fmts = tuple(f.strip() for f in format.split(",") if f.strip())
    bad = [f for f in fmts if f not in REPORT_FORMATS]
    if bad:
        raise BNProbeError(f"--format: unknown report format(s) {', '.join(bad)}; valid: {', '.join(REPORT_FORMATS)}")
    names = [a.strip() for a in adapters.split(",") if a.strip()]
    if not names:
        raise BNProbeError("--adapters is empty")
    resolved = [get_adapter(a) for a in names]
    dumps = [a for a in resolved if isinstance(a, DumpAdapter)]
    recorded = None
    if input is not None and input.is_dir():
        if dumps:
            raise BNProbeError("--input DIR and a dump adapter both give the recorded inputs; give one of them")
        from bnprobe.adapters.dump import open_dump

        recorded = open_dump(input, calls)  # its calls are cases: the memory check of the largest case covers them
    elif dumps:
        recorded = dumps[0].calls.select(calls)
        dumps[0].calls = recorded
    elif calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapters dump:DIR or --input DIR)")
    if recorded is not None:
        given = [f"--{n}" for n, v in (("shape", shape), ("batch", batch), ("dist", dist), ("mean", mean),
                                        ("std", std)) if v is not None]
        if given:
            raise BNProbeError(f"{', '.join(given)} contradict{'s' if len(given) == 1 else ''} the recording: its "
                               "calls bring their own inputs")
        cases = recorded_cases(recorded)
        has = {m: any(m in c.modes for c in recorded.calls) for m in ("train", "infer", "backward")}
        if mode in has and not has[mode]:
            raise BNProbeError(f"--mode {mode}: no call of {recorded.source} recorded it (it recorded "
                               f"{', '.join(m for m, v in has.items() if v)})")
    elif input is not None:
        x = _input_tensor("compare-precision", input, "", "", 0.0, 1.0, seed)
        cases = [Case(f"input/{input.name}", tuple(x.shape), x=x, seed=seed)]
    elif shape is not None:
        d, m, s_ = dist or "normal", 0.0 if mean is None else mean, 1.0 if std is None else std
        cases = [Case(f"{d}(mean={m:g}, std={s_:g})", parse_shape(shape), d, m, s_, seed)]
    else:
        if shapes != "resnet50":
            raise BNProbeError(f"unknown shape set {shapes!r}; valid: resnet50 (or give --shape)")
        b = 2 if batch is None else batch
        if b < 1:
            raise BNProbeError(f"--batch must be >= 1, got {b}")
        cases = resnet50_cases(b, seed, dist or "normal")
    if stress and input is None and shape is None and recorded is None:
        cases = cases + stress_cases(seed)
    dts = tuple(d.strip() for d in dtypes.split(",") if d.strip()) if dtypes is not None else None
    if dts == ():
        raise BNProbeError("--dtypes is empty")
    biggest = max(cases, key=lambda c: math.prod(c.shape))
    require_run("compare-precision", biggest.shape, f"compare-precision on {biggest.name} (shape {biggest.shape})")
    sink = _output(out, force, "compare-precision", *report_files(fmts)) if fmts else None
    bar = Progress("compare-precision")
    try:
        result = compare_precision(resolved, dts, cases, mode=mode, eps=eps, params=params, seed=seed, rule=rule,
                                   bench=bench, budget=budget, progress=bar)
    finally:
        bar.close()
    paths = write_report(result, sink, fmts) if sink is not None else []
    rows = summarize(result)
    for r in rows:
        r["budget"] = f"{r['budget_top']} ({100 * r['budget_share']:.0f}%)" if r["budget_top"] else ""
        r["worst / bound"] = r["worst_ratio"]
    what = f"{len(cases)} recorded call(s) of {recorded.source}" if recorded is not None else f"{len(cases)} inputs"
    n_fail = int((result.rows["verdict"] == "FAIL").sum()) if len(result.rows) else 0
    n_warn = int((result.rows["format_check"] == "WARN").sum()) if len(result.rows) else 0
    judged = (f"benchmark vs {result.meta['bench']}" if result.meta["rule"] == "benchmark"
              else f"absolute rule {result.meta['rule']}")
    typer.echo(f"compare-precision: {what}, {len(result.rows)} outputs vs the FP64 golden ({judged}), "
               f"{result.meta['seconds']} s: " + ("all pass" if result.passed else f"{n_fail} fail")
               + f"; {n_warn} format warning(s)")
    typer.echo(render_table(rows, ["adapter", "dtype", "checked", "failed", "worst", "worst / bound",
                                   "format_warnings", "format_worst", "budget"],
                            headers=["adapter", "format", "outputs", "failed", "worst output", "worst/bound",
                                     "format warnings", "worst format warning", "error-budget cause (share)"]))
    if recorded is not None:
        typer.echo("")
        typer.echo(render_table(per_call(result), ["order", "call", "adapter", "dtype", "outputs", "failed", "failing"],
                                headers=["#", "call (forward order)", "adapter", "format", "outputs", "failed",
                                         "failing outputs"]))
        first = first_failing_call(result)
        typer.echo("first call that fails: " + (f"#{first['order']} {first['call']} ({first['failing']}, "
                                                       f"{first['adapter']})" if first else "none"))
    for n in [*(recorded.notes if recorded is not None else ()), *result.meta["notes"]]:
        typer.echo(f"note: {n}")
    if paths:
        typer.echo(f"report: {sink.path}/ ({', '.join(p.name for p in paths)})")
    return 0 if result.passed else 1


@app.command("overflow")
def overflow_cmd(
    adapter: str = typer.Option("emulated", help="Adapter to scan (a traced one shows every stage), or "
                                                 "dump:DIR[#NAME] (every recorded call's outputs vs the golden)."),
    dtype: Optional[str] = typer.Option(None, help="Format: fp16 (default), bf16, fp32; a recording's own."),
    accumulate: Optional[str] = typer.Option(None, help="Accumulator/compute format for emulated kernels, e.g. "
                                                        "fp16 for a naive port."),
    input: Optional[Path] = typer.Option(None, "--input", help="Input tensor .npy/.npz, or a dump folder (the adapter "
                                                               "on every recorded call's own inputs)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="Recorded calls to scan (glob on the call or module "
                                                              "name)."),
    shape: Optional[str] = typer.Option(None, help="Shape of generated input (default 8,16,14,14)."),
    dist: Optional[str] = typer.Option(None, help="normal (default), uniform, student_t, constant."),
    mean: Optional[float] = typer.Option(None, help="Mean of the generated input (default 0)."),
    std: Optional[float] = typer.Option(None, help="Standard deviation of the generated input (default 1)."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed (default 0)."),
    mode: Optional[str] = typer.Option(None, help="train (default), infer or backward; on a recording: every mode "
                                                  "each call recorded unless given."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (default 1e-5; a recording's own)."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same "
                                                    "(γ, β, running and saved statistics in the input's format); a "
                                                    "recording's own."),
    out: Optional[Path] = typer.Option(None, help="Write CSV, JSON and Markdown to this folder."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> int:
    """Where, in which channel and why a BatchNorm goes non-finite or silently wrong; headroom predicted
    from the input; remedies verified; on a dump, every recorded call's outputs against the golden (an
    msprobe statistics dump: its summaries). Exit 0 when clean, 1 when anomalies are found."""
    from bnprobe._table import render_table
    from bnprobe.checks.overflow import scan, scan_recorded
    from bnprobe.checks.recorded import check_options, check_params, given, recording_of
    from bnprobe.kernels.layout import check_eps

    if eps is not None:
        check_eps(eps)
    check_params(params)
    if mode not in (None, "train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")
    sink = _output(out, force)
    recorded = recording_of(adapter, input, calls, guard="overflow")
    if recorded is not None:
        check_options(recorded, given=given(shape=shape, dist=dist, mean=mean, std=std, seed=seed, eps=eps,
                                            accumulate=accumulate), dtype=dtype, mode=mode, params=params)
        run = scan_recorded(recorded, mode=mode)
        frame = run.to_frame()
        summary = []
        for i, rep in enumerate(run.results):
            tight = min(rep.headroom, key=lambda h: h.headroom_binades, default=None)
            summary.append({"#": i, "call": rep.call, "format": rep.dtype, "mode": rep.mode,
                            "findings": len(rep.findings),
                            "anomalies": ", ".join(dict.fromkeys(f"{f.anomaly}@{f.stage}" for f in rep.findings)),
                            "headroom": f"{tight.headroom_binades:.1f} ({tight.stage})" if tight else ""})
        table = render_table(summary, ["#", "call", "format", "mode", "findings", "anomalies", "headroom"],
                             headers=["#", "call (forward order)", "format", "mode", "findings", "anomaly@output",
                                      "least headroom, binades (stage)"])
        ftable = render_table(frame.to_dict(orient="records"), ["call", "anomaly", "stage", "format", "channels",
                                                               "count", "first_element", "detail"],
                              headers=["call", "anomaly", "output", "format", "channels", "count", "first element",
                                       "detail"]) if len(frame) else "no anomalies"
        title = (f"overflow scan of {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
                 + ("clean" if run else f"{sum(len(r.findings) for r in run.results)} finding(s)"))
        if out is not None:
            md = f"# {title}\n\n```\n{table}\n```\n\n## Findings\n\n```\n{ftable}\n```\n\n" + \
                 "\n".join(f"- {n}" for n in run.notes) + "\n"
            written = _write_reports(sink, f"overflow-{run.kernel.replace(':', '_').replace('/', '_')}-recorded", frame,
                                     run.to_dict(), md)
        if as_json:
            typer.echo(dumps_json(run.to_dict()))
            return 0 if run else 1
        typer.echo(title)
        typer.echo(table)
        if len(frame):
            typer.echo("")
            typer.echo(ftable)
        notes = list(run.notes) + [f"{r.call}: {n}" for r in run.results for n in r.notes
                                   if not n.startswith(("headroom of the sums is predicted", "policy:"))]
        heads = [n for r in run.results for n in r.notes if n.startswith("headroom of the sums is predicted")]
        _close(notes + heads[:1], written if out is not None else None)
        return 0 if run else 1
    check_eps(1e-5 if eps is None else eps)
    s = 0 if seed is None else seed
    x = _input_tensor("overflow", input, shape or "8,16,14,14", dist or "normal", 0.0 if mean is None else mean,
                      1.0 if std is None else std, s)
    rep = scan(adapter, x, dtype=dtype or "fp16", accumulate=accumulate, mode=mode or "train",
               eps=1e-5 if eps is None else eps, seed=s, params=params)
    frame = rep.to_frame()
    head = [{**h.__dict__} for h in rep.headroom]
    table = render_table(frame.to_dict(orient="records"), ["anomaly", "stage", "format", "channels", "count",
                                                          "first_element", "detail"]) if len(frame) else "no anomalies"
    htable = render_table(head, ["stage", "format", "predicted_max", "headroom_binades", "overflows", "actual_max",
                                 "actually_overflowed"],
                          headers=["stage", "format", "predicted |max|", "headroom (binades)", "predicted overflow",
                                   "actual |max|", "overflowed"]) if head else ""
    if out is not None:
        md = f"# bnprobe overflow: {rep.adapter} in {rep.dtype}, {rep.mode}\n\n```\n{table}\n```\n\n" \
             f"## Headroom\n\n```\n{htable}\n```\n"
        written = _write_reports(sink, f"overflow-{rep.adapter.replace(':', '_')}-{rep.dtype}-{rep.mode}", frame,
                                 rep.to_dict(), md)
    if as_json:
        typer.echo(dumps_json(rep.to_dict()))
        return 0 if rep.passed else 1
    typer.echo(f"overflow scan of {rep.adapter} in {rep.dtype} ({rep.mode}"
               + (f", params {params}" if params is not None else "") + "): "
               + ("clean" if rep.passed else f"{len(rep.findings)} finding(s)"))
    typer.echo(table)
    for f in rep.findings:
        if f.remedies:
            typer.echo(f"remedies for {f.anomaly} at {f.stage}: " + "; ".join(
                f"{r.name} {'fixes it' if r.fixed else 'does not'} (max err {r.y_error:.3g})" for r in f.remedies))
        typer.echo(f"  {f.anomaly}: input at {f.first_element}: {f.inputs}")
    if htable:
        typer.echo("\nheadroom predicted from the input's statistics, checked against the run:")
        typer.echo(htable)
    for s_ in rep.saturation:
        typer.echo(f"{s_['overflow_mode']:>8} mode: outputs finite {100 * s_['finite_share']:.0f}%, max |output| "
                   f"{s_['max_abs_output']:.4g}, max error {s_['max_abs_error']:.4g}")
    _close(rep.notes, written if out is not None else None)
    return 0 if rep.passed else 1


@app.command("fold")
def fold_cmd(
    layer: str = typer.Option("conv2d", help="Built-in layer before the BatchNorm: conv2d or linear."),
    weights: Optional[Path] = typer.Option(None, help=".npz with weight, gamma, beta, running_mean, running_var "
                                                      "(optional bias, eps, groups, padding, x)."),
    dtype: str = typer.Option("fp16", help="Format: fp16, bf16, fp32, fp64."),
    accumulate: Optional[str] = typer.Option(None, help="Accumulator of the layer's dot products (default fp32)."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (default: the layer's, 1e-5)."),
    groups: int = typer.Option(1, help="Groups of the built-in conv2d (its 16 input channels must divide)."),
    seed: int = typer.Option(0, min=0, help="Seed of the built-in layer."),
    out: Optional[Path] = typer.Option(None, help="Write CSV, JSON and Markdown to this folder."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> int:
    """Check BatchNorm folding into a Conv2D/Linear (and fused forms) per output channel in a format.
    Exit 1 when a channel's folded result breaks the standard."""
    from bnprobe._table import render_table
    from bnprobe.checks.fold import check_fold, load_layer, make_layer, torch_fusion_check

    if groups < 1 or 16 % groups:
        raise BNProbeError(f"--groups must divide the built-in conv2d's 16 input channels, got {groups}")
    sink = _output(out, force)
    lay = load_layer(weights) if weights is not None else make_layer(layer, seed=seed, groups=groups)
    rep = check_fold(lay, dtype, accumulate=accumulate, eps=eps)
    try:
        import torch  # noqa: F401

        if lay.groups == 1 and rep.dtype in ("fp32", "fp64"):
            rep.torch = torch_fusion_check(lay, rep.dtype)
    except ImportError:
        rep.notes.append("torch not installed: no comparison with torch.nn.utils.fusion")
    ch = rep.channels
    shown = ch.sort_values(["verdict", "A"], ascending=[True, False]).head(10)
    table = render_table(shown.to_dict(orient="records"),
                         ["channel", "A", "var_over_eps", "folded_w_absmax", "w_headroom_binades", "err_unfused",
                          "err_folded", "verdict"],
                         headers=["channel", "A", "var/eps", "max|W'|", "W' headroom", "err unfused", "err folded",
                                  "verdict"])
    if out is not None:
        md = f"# bnprobe fold: {rep.layer} + BN in {rep.dtype}\n\n```\n{table}\n```\n"
        written = _write_reports(sink, f"fold-{rep.layer}-{rep.dtype}", ch, rep.to_dict(), md)
    if as_json:
        typer.echo(dumps_json(rep.to_dict()))
        return 0 if rep.passed else 1
    n_fail = int((ch.verdict == "FAIL").sum())
    typer.echo(f"fold {rep.layer} + BatchNorm in {rep.dtype} (accumulate {rep.accumulate}), {len(ch)} output channels: "
               + ("all pass" if rep.passed else f"{n_fail} break the standard")
               + " (largest A / failing channels first)")
    typer.echo(table)
    typer.echo("\nforms, max |error| against the FP64 golden:")
    typer.echo(render_table(rep.forms.to_dict(orient="records"), ["form", "max_abs_err"]))
    e = rep.eps_rule
    typer.echo(f"\neps rule (Ascend's folding pass: eps < 1e-8 becomes 1e-5): eps {e['eps']:g} -> "
               f"{e['eps_after_rule']:g}; output changes by up to {e['max_abs_change']:.4g}")
    if len(rep.wrong_stats):
        typer.echo("folding with the wrong statistics changes the output by up to:")
        typer.echo(render_table(rep.wrong_stats.to_dict(orient="records"), ["folded with", "max_abs_change"]))
    if rep.torch:
        typer.echo(f"torch.nn.utils.fusion ({rep.torch['torch']}, {rep.torch['dtype']}): folded weights differ by at "
                   f"most {rep.torch['max_rel_weight_diff']:.3g} relative, bias {rep.torch['max_rel_bias_diff']:.3g}")
    _close(rep.notes, written if out is not None else None)
    return 0 if rep.passed else 1


@app.command("doctor")
def doctor_cmd(
    adapter: str = typer.Option("reference", help="Adapter to diagnose, or dump:DIR[#NAME] (every recorded call on "
                                                  "its own inputs)."),
    dtype: Optional[str] = typer.Option(None, help="Format (default: fp64 if the adapter runs it, else its first; a "
                                                   "recording's own)."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same "
                                                    "(γ, β, running and saved statistics in the input's format); a "
                                                    "recording's own."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed of the diagnostic inputs (default 0)."),
    stability: Optional[bool] = typer.Option(None, "--stability/--no-stability",
                                             help="Include the stress inputs (default on; a replayed dump cannot "
                                                  "run them)."),
    input: Optional[Path] = typer.Option(None, "--input", help="Your input too: a tensor .npy/.npz (x), or a dump "
                                                               "folder (the adapter on every recorded call's own "
                                                               "inputs)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="Recorded calls to diagnose (glob on the call or module "
                                                              "name)."),
    out: Optional[Path] = typer.Option(None, help="Write CSV, JSON and Markdown to this folder."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> int:
    """The expert's checklist for a BatchNorm kernel on a diagnostic input, stress inputs and yours:
    PASS/WARN/FAIL with evidence, the known bug each failure matches, and what is wrong where none
    does; on a dump, every recorded call's outputs on its own inputs. Exit 0 when healthy, 1 when
    something failed."""
    import pandas as pd

    from bnprobe._table import render_table
    from bnprobe.checks.diagnosis import doctor, doctor_recorded
    from bnprobe.checks.recorded import check_options, check_params, given, is_dump_path, recording_of

    def details(failed: list[tuple[str, tuple[str, ...] | list[str]]]) -> None:
        """What is wrong, per failing check, one line per input and output."""
        for name, lines in failed:
            if lines:
                typer.echo(f"\n{name}:")
                for line in lines:
                    typer.echo(f"  {line}")

    check_params(params)
    tensor = input if input is not None and not is_dump_path(input) else None
    sink = _output(out, force)
    recorded = recording_of(adapter, None if tensor is not None else input, calls, guard="doctor")
    if recorded is not None:
        refused = dict(seed=seed, stability=None if stability is None or not recorded.replay else True)
        check_options(recorded, given=given(**refused), dtype=dtype, params=params)
        run = doctor_recorded(recorded, dtype=dtype, params=params, stability=stability is not False)
        summary, items = [], []
        for i, rep in enumerate(run.results):
            bad = [it for it in rep.items if it.status != "PASS"]
            summary.append({"#": i, "call": rep.call, "format": rep.dtype, "params": rep.params,
                            "status": "healthy" if rep.passed else "FAIL", "items": len(rep.items),
                            "failed": sum(it.status == "FAIL" for it in rep.items),
                            "diagnosis": "; ".join(rep.diagnosis)})
            items += [{"call": rep.call, **it.to_dict()} for it in bad]
        table = render_table(summary, ["#", "call", "format", "params", "status", "items", "failed", "diagnosis"],
                             headers=["#", "call (forward order)", "format", "params", "status", "items", "failed",
                                      "diagnosis"])
        title = (f"doctor {run.kernel} on {len(run.results)} recorded call(s) of {run.source}: "
                 + ("healthy" if run else "something failed"))
        if out is not None:
            rows = [{"call": rep.call, **it.to_dict()} for rep in run.results for it in rep.items]
            md = f"# {title}\n\n```\n{table}\n```\n\n" + "\n".join(f"- {n}" for n in run.notes) + "\n"
            written = _write_reports(sink, f"doctor-{run.kernel.replace(':', '_').replace('/', '_')}-recorded",
                                     pd.DataFrame(rows), run.to_dict(), md)
        if as_json:
            typer.echo(dumps_json(run.to_dict()))
            return 0 if run else 1
        typer.echo(title)
        typer.echo(table)
        if items:
            typer.echo("")
            typer.echo(render_table(items, ["call", "status", "name", "evidence"],
                                    headers=["call", "status", "check", "evidence"]))
            details([(f"{it['call']}: {it['name']}", it["details"]) for it in items])
        notes = list(run.notes) + [f"{rep.call}: {n}" for rep in run.results for n in rep.notes]
        _close(notes, written if out is not None else None)
        return 0 if run else 1
    if calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    rep = doctor(adapter, dtype, seed=0 if seed is None else seed, stability=True if stability is None else stability,
                 params=params, x=None if tensor is None else _input_tensor("doctor", tensor, "", "", 0.0, 1.0, 0))
    rows = [i.to_dict() for i in rep.items]
    table = render_table(rows, ["status", "name", "evidence"], headers=["status", "check", "evidence"])
    title = f"doctor {rep.adapter} in {rep.dtype}, params {rep.params}: " + \
        ("healthy" if rep.passed else "something failed")
    if out is not None:
        md = f"# bnprobe {title}\n\n```\n{table}\n```\n\ndiagnosis: {'; '.join(rep.diagnosis) or 'none'}\n\n" + \
            "".join(f"- {it.name}: {d}\n" for it in rep.items for d in it.details)
        written = _write_reports(sink, f"doctor-{rep.adapter.replace(':', '_')}-{rep.dtype}", pd.DataFrame(rows),
                                 rep.to_dict(), md)
    if as_json:
        typer.echo(dumps_json(rep.to_dict()))
        return 0 if rep.passed else 1
    typer.echo(title)
    typer.echo(f"inputs: {', '.join(rep.inputs)}")
    typer.echo(table)
    details([(it.name, it.details) for it in rep.items])
    if rep.diagnosis:
        typer.echo("diagnosis: " + "; ".join(rep.diagnosis))
    _close(rep.notes, written if out is not None else None)
    return 0 if rep.passed else 1


@app.command("shrink")
def shrink_cmd(
    adapter: str = typer.Option(..., "--adapter", help="Adapter whose comparison with the FP64 reference fails (a "
                                                       "runnable one: a dump cannot be rerun on smaller inputs)."),
    dtype: Optional[str] = typer.Option(None, help="Format (default fp16; a recording's own)."),
    params: Optional[str] = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same "
                                                    "(γ, β, running and saved statistics in the input's format); a "
                                                    "recording's own."),
    mode: Optional[str] = typer.Option(None, help="train (default), infer or backward."),
    predicate: str = typer.Option("compare", help="compare (vs the reference), overflow, or module:function "
                                                  "(f(x) -> True when the case fails)."),
    input: Optional[Path] = typer.Option(None, "--input", help="The failing input .npy/.npz, or a dump folder "
                                                               "DIR[#NAME] of one call (its x, γ, β, eps, ...)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="The recorded call to shrink (glob), when --input is "
                                                              "a dump of several."),
    shape: Optional[str] = typer.Option(None, help="Shape of generated input (default 16,64,28,28)."),
    dist: Optional[str] = typer.Option(None, help="normal (default), uniform, student_t, constant."),
    mean: Optional[float] = typer.Option(None, help="Mean of the generated input (default 0)."),
    std: Optional[float] = typer.Option(None, help="Standard deviation of the generated input (default 1)."),
    seed: Optional[int] = typer.Option(None, min=0, help="Seed (default 0)."),
    seconds: float = typer.Option(120.0, help="Time budget in seconds (> 0)."),
    out: Optional[Path] = typer.Option(None, help="Folder for x.npy, the dump and shrink.json "
                                                  "(default reports/shrink-<time>)."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
) -> int:
    """Reduce a failing case (channels, batch, spatial size, then values) to a minimal one that still
    fails; write it as a dump plus the exact command that replays it."""
    from bnprobe._progress import Progress
    from bnprobe.checks.recorded import check_options, check_params, given, recording_of
    from bnprobe.checks.shrinking import (
        RecordedParams,
        compare_predicate,
        load_predicate,
        overflow_predicate,
        runnable,
        shrink,
        write_shrink,
    )
    import numpy as np

    if mode not in (None, "train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")
    if not 0 < seconds <= 86400:
        raise BNProbeError(f"--seconds must be > 0 and at most 86400 (a day), got {seconds}")
    check_params(params)
    sink = _output(out, force, "shrink", "x.npy", "shrink.json")
    a = runnable(adapter)
    recorded = recording_of(a, input, calls, guard="shrink")
    kept = None
    if recorded is not None:
        recorded.calls.require_tensors("shrink")
        found = recorded.calls.calls
        if len(found) != 1:
            shown = ", ".join(c.label for c in found[:4]) + (", ..." if len(found) > 4 else "")
            raise BNProbeError(f"{recorded.calls.source} holds {len(found)} BatchNorm calls ({shown}); shrink takes "
                               "one: select it with DIR#NAME or --calls")
        check_options(recorded, given=given(shape=shape, dist=dist, mean=mean, std=std, seed=seed), dtype=dtype,
                      mode=mode, params=params)
        rec = found[0].load()
        ci = rec.call_inputs()
        x = ci["x"] if rec.layout == "channels_first" or ci["x"].ndim <= 2 else np.moveaxis(ci["x"], -1, 1)
        kept = RecordedParams.of(rec, found[0].label)
        params = kept.params
        dtype, mode = rec.dtype, mode or ("train" if rec.training else "infer")
    else:
        x = _input_tensor("shrink", input, shape or "16,64,28,28", dist or "normal", 0.0 if mean is None else mean,
                          1.0 if std is None else std, 0 if seed is None else seed)
        dtype, mode, params = dtype or "fp16", mode or "train", params or "fp32"
    fails = (compare_predicate(a, dtype=dtype, mode=mode, recorded=kept, params=params) if predicate == "compare"
             else overflow_predicate(a, dtype=dtype, mode=mode, recorded=kept, params=params)
             if predicate == "overflow" else load_predicate(predicate))
    bar = Progress("shrink")
    steps = [0]

    def tick(_: str) -> None:
        steps[0] += 1
        bar(min(steps[0], 20), 20)

    try:
        res = shrink(x, fails, seconds=seconds, progress=tick)
    finally:
        bar.close()
    files, cmd = write_shrink(res, sink, adapter=adapter, dtype=dtype, mode=mode, predicate=predicate,
                              recorded=kept, params=params)
    typer.echo(f"shrunk {tuple(res.original_shape)} ({int(np.prod(res.original_shape))} values) to "
               f"{tuple(res.x.shape)} ({res.x.size} values) in {res.evaluations} checks, {res.seconds:.1f} s"
               + (" (time budget reached)" if res.timed_out else ""))
    if kept is not None:
        typer.echo(f"input: recorded call {kept.source} (its γ, β, running statistics, eps {kept.eps:g}, "
                   f"momentum, {dtype}, params {kept.params}); channels kept: "
                   f"{res.channels.tolist() if res.channels is not None else 'all'}")
    typer.echo(f"x = {np.array2string(res.x.reshape(-1), precision=6, threshold=20)}")
    typer.echo("wrote " + ", ".join(str(f) for f in files))
    typer.echo(f"replay: {cmd}")
    return 0


@app.command("plot-stats")
def plot_stats_cmd(
    simulate: bool = typer.Option(False, "--simulate", help="Record a built-in training run (the default when no "
                                                           "--log or --dumps is given)."),
    steps: int = typer.Option(200, min=1, max=20_000, help="Steps of the simulated training run (1 to 20000)."),
    policies: str = typer.Option("fp32,fp16,bf16", help="Policies of the simulated run, side by side."),
    seed: int = typer.Option(0, min=0, help="Seed of the simulated run."),
    log: Optional[Path] = typer.Option(None, "--log", help="CSV/Parquet log: step, layer, channel, mean, var "
                                                           "[, running_mean, running_var]."),
    dumps: Optional[Path] = typer.Option(None, "--dumps", help="Folder of dumps, one sub-folder per step."),
    channels: int = typer.Option(6, help="Channels per figure (the most drifting first)."),
    eps: float = typer.Option(1e-5, help="BatchNorm epsilon (for var/eps)."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default reports/plot-stats-<time>)."),
    format: str = typer.Option("png", "--format", help="png or svg."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files in --out."),
) -> int:
    """Plot μ and σ² and the running statistics over training, per channel and per format, and flag
    divergence, collapse toward eps, non-finite statistics and a wrong momentum. Exit 1 when flagged."""
    from bnprobe.checks.stats import find, load_dump_series, load_log, simulate as run_simulation
    from bnprobe.kernels.layout import check_eps
    from bnprobe.plots import plot_channel_stats, plot_distributions, plot_divergence, plot_layer_summary
    from bnprobe.reports import dumps_json, html_report

    check_eps(eps)
    if format not in ("png", "svg"):
        raise BNProbeError(f"--format takes png or svg, got {format!r}")
    if sum(v is not None for v in (log, dumps)) + bool(simulate) > 1:
        raise BNProbeError("give one source: --simulate, --log or --dumps")
    if channels < 1:
        raise BNProbeError(f"--channels must be >= 1, got {channels}")
    sink = _output(out, force, "plot-stats", "stats.csv", "findings.json", "index.md", "index.html")
    if log is not None:
        df, source = load_log(log), str(log)
    elif dumps is not None:
        df, source = load_dump_series(dumps), str(dumps)
    else:
        pols = tuple(p.strip() for p in policies.split(",") if p.strip())
        if not pols:
            raise BNProbeError("--policies is empty")
        df, source = run_simulation(pols, steps=steps, seed=seed, eps=eps), f"simulated run, seed {seed}"
    findings = find(df, eps=eps)
    files: list[tuple[str, str]] = []

    def file_name(stem: str) -> str:
        """A file name from user-given layer and policy names: safe characters only, never two alike."""
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._")[:100] or "figure"
        name, k = f"{base}.{format}", 1
        while any(name == f for f, _ in files):
            name, k = f"{base}-{k}.{format}", k + 1
        return name

    for pol in df["policy"].unique():
        for layer in df[df["policy"] == pol]["layer"].unique():
            name = file_name(f"stats-{pol}-{layer}")
            sink.save_figure(name, plot_channel_stats(df, pol, layer, channels), dpi=110)
            files.append((name, f"μ and σ² over steps: {layer}, {pol}"))
        name = file_name(f"summary-{pol}")
        sink.save_figure(name, plot_layer_summary(df, pol), dpi=110)
        files.append((name, f"layer x step drift of the running mean: {pol}"))
    if "fp32" in set(df["policy"]) and df["policy"].nunique() > 1:
        sink.save_figure(f"divergence.{format}", plot_divergence(df), dpi=110)
        files.append((f"divergence.{format}", "low precision vs fp32 over steps"))
    sink.save_figure(f"distributions.{format}", plot_distributions(df, eps), dpi=110)
    files.append((f"distributions.{format}", "mean²/var and var/eps per channel"))
    sink.write_text("stats.csv", df.to_csv(index=False))
    sink.write_text("findings.json", dumps_json([f.to_dict() for f in findings]))
    lines = [f"# bnprobe plot-stats: {source}", "", f"{len(findings)} finding(s)", ""]
    lines += [f"- **{f.kind}** ({f.policy} {f.layer}, step {f.step}"
              + (f", channels {list(f.channels)[:8]}" if f.channels else "") + f"): {f.detail}" for f in findings]
    lines += ["", "## Figures", ""] + [f"- [{desc}]({name})" for name, desc in files]
    sink.write_text("index.md", "\n".join(lines) + "\n")
    import html as _html

    body = "".join(f'<h2>{_html.escape(desc)}</h2><a href="{_html.escape(name)}"><img src="{_html.escape(name)}" '
                   f'alt="{_html.escape(desc)}"></a>' for name, desc in files)
    page = html_report(f"bnprobe plot-stats: {source}", f"{len(findings)} finding(s)",
                       [("Findings", "; ".join(f"{f.kind} ({f.policy} {f.layer}, step {f.step}): {f.detail}"
                                               for f in findings) or "none")])
    sink.write_text("index.html", page.replace("</body>", body + "</body>"))
    sink.commit()
    typer.echo(f"plot-stats ({source}): {df['step'].nunique()} steps, {df['layer'].nunique()} layer(s), "
               f"{df['policy'].nunique()} run(s); {len(findings)} finding(s)")
    for f in findings:
        typer.echo(f"  {f.kind}: {f.policy} {f.layer} step {f.step}: {f.detail}")
    typer.echo(f"figures and index: {sink.path}/index.html")
    return 1 if findings else 0


def _click_classes() -> tuple[type, type, type | None]:
    """UsageError, ClickException and NoArgsIsHelpError of the click that typer runs on.

    typer >= 0.29 vendors its own click, so ``click.exceptions`` would not match
    what it raises; its BadParameter's bases are the right classes either way.
    """
    mro = {c.__name__: c for c in typer.BadParameter.__mro__}
    module = sys.modules[mro["UsageError"].__module__]
    return mro["UsageError"], mro["ClickException"], getattr(module, "NoArgsIsHelpError", None)


def _hoist_max_memory(args: list[str]) -> list[str]:
    """``--max-memory SIZE`` anywhere on the line is the root option (it applies to every command)."""
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith("--max-memory="):
            return [a, *args[:i], *args[i + 1:]]
        if a == "--max-memory" and i + 1 < len(args):
            return [a, args[i + 1], *args[:i], *args[i + 2:]]
    return args


def _report_warnings(caught: list) -> None:
    """Warnings raised during the run (numpy's, torch's...), each distinct one once, as one line on stderr."""
    seen: dict[str, int] = {}
    for w in caught:
        text = " ".join(str(w.message).split())
        seen[text] = seen.get(text, 0) + 1
    for text, n in seen.items():
        typer.echo(f"bnprobe: note: a library warned: {text[:300]}" + (f" ({n} times)" if n > 1 else ""), err=True)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one-line errors and exit status 2 for bad input; warnings reported once, not leaked."""
    import warnings

    args = _hoist_max_memory(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _run(args)
    if code in (0, 1):
        _report_warnings(caught)
    return code


def _run(args: list[str]) -> int:
    usage_error, click_exception, no_args = _click_classes()
    try:
        try:
            rv = app(args=args, prog_name="bnprobe", standalone_mode=False)
        except BaseException:
            for sink in _SINKS:
                sink.discard()
            raise
        finally:
            _SINKS.clear()
    except typer.Exit as exc:
        return int(getattr(exc, "exit_code", 0))
    except typer.Abort:
        typer.echo("bnprobe: aborted", err=True)
        return 130
    except Exception as exc:
        if no_args is not None and isinstance(exc, no_args):
            ctx = getattr(exc, "ctx", None)
            typer.echo(ctx.get_help() if ctx is not None else str(exc))
            return 0
        if isinstance(exc, usage_error):
            ctx = getattr(exc, "ctx", None)
            cmd = ctx.command_path if ctx is not None else "bnprobe"
            typer.echo(f"{cmd}: error: {exc.format_message()}", err=True)
            return 2
        if isinstance(exc, (click_exception, BNProbeError)):
            msg = exc.format_message() if isinstance(exc, click_exception) else str(exc)
            typer.echo(f"bnprobe: error: {msg}", err=True)
            return 2
        if isinstance(exc, BrokenPipeError):  # pragma: no cover - e.g. piped into head
            return 0
        if isinstance(exc, NotImplementedError):  # a plugin adapter without a method this command needs
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "a method this command needs"
            typer.echo(f"bnprobe: error: an adapter does not implement {first[:200]}", err=True)
            return 2
        if isinstance(exc, OSError):  # a path the user gave: too long, unreadable, a full disk...
            name = exc.filename if exc.filename is not None else ""
            typer.echo(f"bnprobe: error: {str(name)[:200]}{': ' if name else ''}"
                       f"{exc.strerror or type(exc).__name__}", err=True)
            return 2
        if isinstance(exc, MemoryError):  # the guard's estimate was short of what the allocator could give
            from bnprobe.guard import format_size, memory_limit

            limit, source = memory_limit()
            typer.echo(f"bnprobe: error: ran out of memory (the {format_size(limit)} {source}); give a smaller "
                       "input or fewer calls", err=True)
            return 2
        raise
    return int(rv) if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

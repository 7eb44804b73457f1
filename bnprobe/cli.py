"""The ``bnprobe`` command line: parse, call the library once, render.

The only module that prints.  Bad input of any kind is one line on stderr,
``bnprobe: error: ...``, and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from bnprobe import __version__
from bnprobe.core.call import BNCall, EPS, MOMENTUM
from bnprobe.core.errors import BNProbeError
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


# the library's parameters whose flag is not theirs spelled --name (underscores as dashes)
_FLAGS = {"x": "--input", "dtypes": "--dtype"}


def flag(field: str) -> str:
    """The flag of a library parameter that an error names (:func:`bnprobe.core.errors.named`): ``eps`` is
    ``--eps``, ``max_memory`` ``--max-memory``, ``x`` ``--input``."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _command(name: str):  # noqa: ANN202 - typer's decorator
    """Register a command of the registry (bnprobe.core.commands) under its name."""
    from bnprobe.core.commands import command

    return app.command(command(name).name)


# ---- options several commands share ------------------------------------------------------------------

_PARAMS = typer.Option(None, help="Parameter format: fp32 (mixed precision, the default) or same (γ, β, running and "
                                  "saved statistics in the input's format); a recording's own.")
_EPS = typer.Option(None, help="BatchNorm epsilon (> 0; default 1e-5; a recording's own).")
_MOMENTUM = typer.Option(None, help="Running-stat momentum m, the batch's weight (PyTorch's spelling, in every "
                                     "convention; default 0.1).")
_CONVENTION = typer.Option(None, "--convention", help="The framework convention the kernels follow (a plugin's, a "
                                                      "dump's): torch, tensorflow, keras, flax, paddle, mindspore; "
                                                      "the golden's and the bench's running variance follow it.")
_SEED = typer.Option(None, min=0, help="Seed of the generated input and parameters (default 0).")
_MEAN = typer.Option(None, help="Mean of the generated input (default 0).")
_STD = typer.Option(None, help="Standard deviation of the generated input (default 1).")
_DIST = typer.Option(None, help="Distribution of the generated input: normal (default), uniform, student_t, constant.")
_OUT = typer.Option(None, help="Write CSV, JSON and Markdown to this folder.")
_FORCE = typer.Option(False, "--force", help="Overwrite existing files in --out.")
_JSON = typer.Option(False, "--json", help="Print JSON instead of the table.")


_SWEEP = typer.Option(False, "--sweep", help="Run every recorded call as one task of a sweep, in parallel (automatic "
                                             "when the dump root holds several step*/rank* dumps).")
_WORKERS = typer.Option(None, min=1, max=1024, help="Sweep: local worker processes (default: the cores).")
_SCHEDULER = typer.Option(None, "--scheduler", metavar="ADDR",
                          help="Sweep on a dask.distributed cluster, e.g. tcp://HOST:8786 (default $BNPROBE_SCHEDULER; "
                               "needs bnprobe[dist]); its workers read the dump files themselves.")
_RESUME = typer.Option(False, "--resume", help="Sweep: continue the interrupted sweep in --out, keeping its finished "
                                               "calls.")


def _calls(what: str):  # noqa: ANN202 - typer's OptionInfo
    return typer.Option(None, "--calls", help=f"Recorded calls to {what} (glob on the call or module name), e.g. "
                                              "'*layer1*'.")


def _show(report, sink=None, as_json: bool = False) -> int:  # noqa: ANN001 - Report, OutputDir | None
    """Write the report's files (when there is an output folder), then print its JSON or its text; exit status 0
    when it passed, 1 when not."""
    from bnprobe.reports import write_result

    written = write_result(sink, report) if sink is not None else None
    _echo(report.lines(written) if not as_json else [dumps_json(report.doc)])
    return 0 if report.passed else 1


# every command takes both spellings: --adapter / --adapters, --dtype / --dtypes (compare-precision lists several)
_A, _D = ("--adapter", "--adapters"), ("--dtype", "--dtypes")

def split_adapters(text: str) -> list[str]:
    """``--adapters``' list: comma-separated adapters, where a ``key=value`` after a comma continues the adapter
    before it (``emulated:fp16:order=lanes,lanes=16,torch`` is two adapters: a policy spec identify printed, and
    torch)."""
    out: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if out and "=" in tok and ":" not in tok.partition("=")[0]:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def _in_convention(adapter: str, convention: Optional[str]):  # noqa: ANN202 - str | KernelAdapter
    """``adapter`` judged in ``convention`` (as given when None)."""
    if convention is None:
        return adapter
    from bnprobe.adapters import get_adapter
    from bnprobe.adapters.convention import in_convention
    from bnprobe.core.conventions import get_convention

    conv = get_convention(convention)  # (an unknown name is refused before the adapter is loaded)
    return in_convention(get_adapter(adapter), conv)


def _dump_scalars(adapters: list[str], input: Optional[Path], eps: Optional[float],
                  momentum: Optional[float] = None) -> tuple[list[str], Optional[Path], Optional[float],
                                                             Optional[float]]:
    """``--eps`` / ``--momentum`` where the kernel or ``--input`` is a dump: the layer's ε and momentum, for a dump
    that does not record them (msprobe's MindSpore dumps; one that records others refuses them when read), handed to
    the reader as ``DIR,eps=E,momentum=M``; they are then no longer options of generated input (returned None)."""
    from bnprobe.engine.recorded import is_dump_path

    opts = ",".join(f"{k}={v!r}" for k, v in (("eps", eps), ("momentum", momentum)) if v is not None)
    dumps = [i for i, a in enumerate(adapters) if a.startswith("dump:")]
    to_input = input is not None and is_dump_path(input)
    if not opts or not (dumps or to_input):
        return adapters, input, eps, momentum
    out = [f"{a},{opts}" if i in dumps else a for i, a in enumerate(adapters)]
    return out, Path(f"{input},{opts}") if to_input else input, None, None


def _echo(lines: list[str]) -> None:
    for line in lines:
        typer.echo(line)


def _check_common(eps: Optional[float] = None, params: Optional[str] = None, mode: Optional[str] = None) -> None:
    """The options most commands share, checked before any work."""
    from bnprobe.engine.recorded import check_params
    from bnprobe.kernels.layout import check_eps

    if eps is not None:
        check_eps(eps)
    check_params(params)
    if mode not in (None, "train", "infer", "backward"):
        raise BNProbeError(f"unknown mode {mode!r}; valid: train, infer, backward")


def _sweep_root(adapter: str, input: Optional[Path], flags: tuple) -> Optional[tuple[Path, Optional[str]]]:
    """(dump root, the runnable adapter or None for the recorded outputs) when this run is a sweep: asked for
    (``flags``: --sweep, --workers, --scheduler, --resume), or a dump root holding several step/rank dumps."""
    from bnprobe.sweep.command import find_root

    return find_root(adapter, input, any(f not in (None, False) for f in flags))


def _check_sweep(as_json: bool, options: tuple[str, ...], root: str) -> None:
    """Options a sweep does not take: --json (its report is a folder) and those its recordings give."""
    from bnprobe.engine.recorded import refuse

    if as_json:
        raise BNProbeError("a sweep writes its report to a folder (--out; sweep.json in it): drop --json")
    refuse(options, root)


def _run_sweep(command: str, found: tuple[Path, Optional[str]], calls: Optional[str], out: Optional[Path],
               force: bool, workers: Optional[int], scheduler: Optional[str], resume: bool, **spec) -> int:
    """A check over every (step, rank, call) of a dump root, one task each (bnprobe.sweep.command), then its report."""
    from bnprobe._progress import Progress
    from bnprobe.reports.sweep import sweep_lines, write_sweep
    from bnprobe.sweep.command import SWEEP_FILES, SweepInterrupted, SweepRequest, execute, prepare

    plan = prepare(SweepRequest(command, *found, calls=calls, out=out, force=force, workers=workers,
                                scheduler=scheduler, resume=resume, options=spec))
    sink = _output(plan.out, force, f"{command}-sweep", *SWEEP_FILES)
    try:
        with Progress(f"{command} sweep") as bar:
            result = execute(plan, sink.path, progress=lambda d, t, f: bar(d, t, f"{d}/{t} calls, {f} failed to run"),
                             words=flag)
    except SweepInterrupted as stop:
        typer.echo(f"bnprobe: {stop}; the same command with --resume --out {stop.out} continues from there", err=True)
        raise typer.Exit(130) from None
    write_sweep(result, sink)
    _echo(sweep_lines(result, sink.path if plan.keep else None))
    if not plan.keep:
        plan.cleanup()
        typer.echo(f"nothing written: {command} writes files where --out says (--out DIR keeps the sweep's report "
                   "and lets --resume continue an interrupted sweep)")
    return 0 if result.passed else 1


# ---- commands ---------------------------------------------------------------------------------------

@_command("trace")
def trace(
    policy: Optional[str] = typer.Option(None, help="Preset (fp64, fp32, fp16, bf16, fp16-acc16, bf16-acc16) with "
                                                    "optional overrides, e.g. 'fp16:variance=naive,order=lanes' "
                                                    "(default fp16; for a recorded call, its format's preset)."),
    shape: Optional[str] = typer.Option(None, help="Input shape N,C[,L|H,W|D,H,W] for generated input "
                                                   "(default 8,16,14,14)."),
    seed: Optional[int] = _SEED, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    dist: Optional[str] = _DIST,
    mode: Optional[str] = typer.Option(None, help="train (default; a recorded call's own), infer or backward."),
    eps: Optional[float] = _EPS,
    momentum: Optional[float] = _MOMENTUM,
    layout: Optional[str] = typer.Option(None, help="channels_first (default) or channels_last."),
    params: Optional[str] = _PARAMS,
    input: Optional[Path] = typer.Option(None, "--input", help="Use this .npy/.npz tensor as x instead, or a dump "
                                                               "DIR[#NAME] of one call (all its inputs and scalars)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="The recorded call to trace (glob), when --input is a "
                                                              "dump of several."),
    as_json: bool = _JSON,
) -> None:
    """Run one BatchNorm layer and show every stage: range, error vs the FP64 golden, anomalies."""
    import numpy as np

    from bnprobe.engine.recorded import given, is_dump_path, one_call, refuse
    from bnprobe.checks.trace.stages import trace_recorded, trace_run
    from bnprobe.inputs import input_tensor, make_params
    from bnprobe.kernels.layout import Layout, layout_of
    from bnprobe.reports.checks import trace_lines

    _check_common(params=params)
    if input is not None and is_dump_path(input):
        _, input, eps, momentum = _dump_scalars([], input, eps, momentum)
        call, rec = one_call(input, calls, "trace", guard="trace")
        refuse(given(shape=shape, seed=seed, mean=mean, std=std, dist=dist, eps=eps, momentum=momentum),
               str(input).partition("#")[0])
        if layout is not None and layout != rec.layout:
            raise BNProbeError(f"--layout {layout} contradicts the recording: {call.label} is {rec.layout}")
        cmp = trace_recorded(rec, policy=policy, mode=mode, label=call.label, params=params)
        source = f"recorded call {call.label} of {str(input).partition('#')[0]} (its γ, β, running statistics, dy)"
        eps_v, mom_v, lay = rec.eps, rec.momentum, Layout(tuple(cmp.shape), rec.layout)
    else:
        if calls is not None:
            raise BNProbeError("--calls selects recorded calls: give a dump as --input DIR")
        eps_v, mom_v = EPS if eps is None else eps, MOMENTUM if momentum is None else momentum
        m, s, sd, d = 0.0 if mean is None else mean, 1.0 if std is None else std, seed or 0, dist or "normal"
        x = input_tensor("trace", input, ("8,16,14,14" if shape is None else shape), d, m, s, sd)
        source = str(input) if input is not None else f"{d}(mean={m:g}, std={s:g}), seed {sd}"
        lay = layout_of(x, layout or "channels_first")
        prm = make_params(lay.channels, sd)
        dy = np.random.default_rng([sd, 2]).standard_normal(x.shape) if mode == "backward" else None
        cmp = trace_run(x, policy=policy or "fp16", mode=mode or "train", gamma=prm["gamma"], beta=prm["beta"],
                        running_mean=np.full(lay.channels, m), running_var=np.full(lay.channels, max(s, 0.0) ** 2),
                        dy=dy, eps=eps_v, momentum=mom_v, layout=lay.layout, params=params)
    _echo([dumps_json({**cmp.to_dict(), "input": source})] if as_json else trace_lines(cmp, source, lay, eps_v, mom_v))


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p, 0) for p in text.split(",") if p.strip())
    except ValueError:
        raise BNProbeError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values:
        raise BNProbeError(f"{what} is empty")
    return values


@_command("rsqrt")
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
    force: bool = _FORCE,
    as_json: bool = _JSON,
) -> None:
    """ULP and relative error of rsqrt / reciprocal / sqrt / divide methods as accelerators compute them.

    Default domain: every input for fp16 and bf16; for fp32 a proven-reduced domain (one period, the
    subnormals and the extreme binades) confirmed by random samples over the whole range.
    """
    from bnprobe._progress import Progress
    from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze
    from bnprobe.reports.rsqrt import math_files, math_lines, write_math

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
    steps = _int_list(newton, "--newton")
    stem = f"{op}-{spec.format}-{method}"
    sink = _output(out, force, "", *math_files(stem))
    with Progress(spec.label()) as bar:
        result = analyze(spec, steps, domain="exhaustive" if exhaustive else "samples" if samples is not None
                         else "auto", samples=samples or (1 << 20), seed=seed, progress=bar)
    written = write_math(result, sink, stem) if sink is not None else []
    _echo([dumps_json(result.to_dict())] if as_json else
          math_lines(result) + (["wrote " + ", ".join(str(t) for t in written)] if written else []))


@_command("adapters")
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
    typer.echo("\noptions: emulated:<policy>, ascend-tbe:chip=910,cores=8, syncbn:ranks=2+14,merge=chan|sums|"
               "unweighted,reduce=fp16, dump:DIR[#CALL-GLOB]; plugins: package.module:Name or the 'bnprobe.adapters' "
               "entry-point group")


@_command("dump")
def dump_cmd(
    adapter: str = typer.Option(..., *_A, help="Adapter to record, e.g. torch, ascend-tbe, emulated:fp16."),
    out: Path = typer.Option(..., "--out", help="Folder to write bnprobe-dump.json and tensors.npz into."),
    dtype: str = typer.Option("fp16", *_D, help="Format to run in: fp64, fp32, fp16, bf16."),
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
    from bnprobe.recordings import record, write_dump
    from bnprobe.inputs import input_tensor, make_params
    from bnprobe.kernels.layout import layout_of

    _check_common(params=params)
    _output(out, force, "", "bnprobe-dump.json", "tensors.npz")
    wanted = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in wanted if m not in ("train", "infer", "backward")]
    if bad or not wanted:
        raise BNProbeError(f"--modes takes train, infer, backward; got {modes!r}")
    a = get_adapter(adapter)
    x = input_tensor("dump", input, shape, dist, mean, std, seed)
    c = layout_of(x, layout).channels
    prm = make_params(c, seed)
    dy = np.random.default_rng([seed, 2]).standard_normal(x.shape)
    rec = record(a, BNCall(x=x, gamma=prm["gamma"], beta=prm["beta"], running_mean=np.full(c, mean),
                           running_var=np.full(c, std**2 if std > 0 else 1.0), dy=dy, dtype=dtype, eps=eps,
                           momentum=momentum, layout=layout, params=params), modes=wanted,
                 meta={"seed": seed, "input": str(input) if input else f"{dist}(mean={mean}, std={std})"})
    files = write_dump(rec, out, force=force)
    typer.echo(f"recorded {a.name} ({', '.join(rec.modes)}) in {rec.dtype}: " + ", ".join(str(f) for f in files))
    if "params_note" in rec.meta:
        typer.echo(f"note: {rec.meta['params_note']}")
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


@_command("gradcheck")
def gradcheck_cmd(
    adapter: str = typer.Option("emulated", *_A, help="Adapter whose backward is checked, or dump:DIR[#NAME] (every "
                                                 "recorded call, each on its own inputs)."),
    dtype: Optional[str] = typer.Option(None, *_D,
                                        help="Format: fp16 (default), bf16, fp32 or fp64; a recording's own."),
    shape: Optional[str] = typer.Option(None, help="Input shape N,C[,...] of generated inputs (default 4,3,5,5)."),
    mode: Optional[str] = typer.Option(None, help="train (default) or infer; a recording's own."),
    seed: Optional[int] = _SEED,
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    formula: Optional[str] = typer.Option(None, help="Check a backward formula instead: standard, seed, ascend "
                                                     "or module:function (f(dy, x, gamma, mean, var, eps) -> dx)."),
    rtol: Optional[float] = typer.Option(None, help="Relative tolerance (give with --atol)."),
    atol: Optional[float] = typer.Option(None, help="Absolute tolerance (give with --rtol)."),
    eps: Optional[float] = _EPS,
    params: Optional[str] = _PARAMS,
    input: Optional[Path] = typer.Option(None, "--input", help="A dump folder (bnprobe or msprobe): run the adapter "
                                                               "on every recorded call's own inputs."),
    calls: Optional[str] = _calls("check"),
    convention: Optional[str] = _CONVENTION,
    out: Optional[Path] = _OUT,
    force: bool = _FORCE,
    as_json: bool = _JSON,
) -> int:
    """Numerical vs analytic gradients (FP64 finite differences), the adapter's backward vs the FP64
    golden, the gradient identities, or a candidate backward formula; on a dump, every recorded call on
    its own inputs. Exit 1 when a check fails."""
    from bnprobe.checks.gradcheck.gradients import check_formula, gradcheck, gradcheck_recorded
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.guard import require_run
    from bnprobe.inputs import make_input, parse_shape
    from bnprobe.reports.checks import gradcheck_recorded_report, gradcheck_report

    _check_common(eps=eps, params=params)
    if input is not None and not is_dump_path(input):
        raise BNProbeError(f"--input {input}: gradcheck takes a dump folder (bnprobe or msprobe) as --input")
    sink = _output(out, force)
    (adapter,), input, eps, _ = _dump_scalars([adapter], input, eps)
    kernel = _in_convention(adapter, convention)
    recorded = recording_of(kernel, input, calls, guard="gradcheck")
    if recorded is not None:
        if formula is not None:
            raise BNProbeError("--formula checks a formula on generated inputs: it contradicts the recording; drop "
                               "one of them")
        check_options(recorded, given=given(shape=shape, eps=eps, seed=seed, dist=dist, mean=mean, std=std),
                      dtype=dtype, params=params)
        return _show(gradcheck_recorded_report(gradcheck_recorded(recorded, mode=mode, rtol=rtol, atol=atol)), sink,
                     as_json)
    shp = parse_shape(("4,3,5,5" if shape is None else shape))
    require_run("gradcheck", shp)
    e, s = EPS if eps is None else eps, seed or 0
    if formula is not None:
        if off := given(params=params, dist=dist, mean=mean, std=std):
            raise BNProbeError(f"--formula checks a formula in FP64 on its own inputs: {', '.join(off)} "
                               f"do{'es' if len(off) == 1 else ''} not apply; drop {'it' if len(off) == 1 else 'them'}")
        return _show(gradcheck_report(check_formula(formula, shp, seed=s, eps=e, rtol=rtol, atol=atol)), sink, as_json)
    x = None if (dist, mean, std) == (None, None, None) else \
        make_input(shp, dist=dist or "normal", mean=0.0 if mean is None else mean, std=1.0 if std is None else std,
                   seed=s)
    result = gradcheck(kernel, dtype or "fp16", shp, mode=mode or "train", seed=s, eps=e, rtol=rtol, atol=atol,
                       params=params, x=x)
    return _show(gradcheck_report(result, params), sink, as_json)


def _formats_and_dtypes(format: str, dtypes: Optional[str]) -> tuple[list, tuple[str, ...] | None]:
    """compare-precision's report formats and its --dtypes (None: each adapter's defaults), checked."""
    from bnprobe.reports.compare import report_formats

    try:
        fmts = report_formats(format)
    except BNProbeError as exc:
        raise BNProbeError(f"--format: {exc}") from None
    dts = tuple(d.strip() for d in dtypes.split(",") if d.strip()) if dtypes is not None else None
    if dts == ():
        raise BNProbeError("--dtypes is empty")
    return fmts, dts


def _listed(adapters: str) -> tuple[list[str], list[bool]]:
    """--adapters' names, ``builtin`` expanded to the built-in set (torch where installed), and which of them it
    brought."""
    from bnprobe.adapters.registry import builtin_adapters

    listed = [(n, a == "builtin") for a in split_adapters(adapters)
              for n in (builtin_adapters() if a == "builtin" else [a])]
    return [n for n, _ in listed], [b for _, b in listed]


def _builtin_for(resolved: list, builtin: list[bool], dtypes: tuple[str, ...] | None, recorded: Any) -> list:
    """The adapters to run: of those the built-in set brought (``builtin``, aligned with ``resolved``), the ones
    that run every format asked for (``dtypes``, else the ``recorded`` calls' formats; neither: each runs its own);
    the adapters named outright, all (one that cannot run a format is refused by compare-precision, not dropped)."""
    from bnprobe.core.formats import get_format

    fmts = {get_format(d).name for d in dtypes} if dtypes else \
        {c.dtype for c in recorded.calls} if recorded is not None else None
    if fmts is None or not any(builtin):
        return resolved
    keep = [k for k, b in zip(resolved, builtin) if not b or fmts <= set(k.capabilities().formats)]
    if not keep:
        raise BNProbeError(f"no built-in kernel runs {', '.join(sorted(fmts))}: name the adapters (--adapters)")
    return keep


@_command("compare-precision")
def compare_precision_cmd(
    adapters: str = typer.Option("builtin", "--adapters", "--adapter",
                                 help="Comma-separated adapters, e.g. emulated,ascend-tbe,torch, or dump:DIR (every "
                                      "BatchNorm call of a bnprobe/msprobe dump); builtin: the Ascend emulators "
                                      "(ascend-tbe, ascend-bnv3, ascend-950), the 16-bit-accumulator ports "
                                      "(emulated:fp16-acc16, emulated:bf16-acc16) and torch where installed."),
    dtypes: Optional[str] = typer.Option(None, "--dtypes", "--dtype",
                                         help="Comma-separated formats (default fp16,bf16,fp32; a recording's "
                                                    "own format)."),
    shape: Optional[str] = typer.Option(None, help="One input shape N,C[,...] instead of the ResNet-50 set."),
    shapes: str = typer.Option("sample", help="Shape set when --shape is not given: sample (two ResNet-50 shapes) "
                                             "or resnet50 (every distinct one)."),
    batch: Optional[int] = typer.Option(None, min=1, max=65_536,
                                        help="Batch size of the ResNet-50 shapes (default 2)."),
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    input: Optional[Path] = typer.Option(None, "--input", help="Real activations: .npy, .npz, or a dump folder "
                                                               "(every recorded call's inputs)."),
    calls: Optional[str] = _calls("run"),
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
    eps: Optional[float] = _EPS,
    momentum: Optional[float] = _MOMENTUM,
    params: Optional[str] = _PARAMS,
    convention: Optional[str] = _CONVENTION,
    out: Optional[Path] = typer.Option(None, help="Report folder (default reports/compare-precision-<time>)."),
    format: str = typer.Option("csv,json,md,html", "--format", help="Report files to write."),
    force: bool = _FORCE,
    sweep: bool = _SWEEP, workers: Optional[int] = _WORKERS, scheduler: Optional[str] = _SCHEDULER,
    resume: bool = _RESUME,
) -> int:
    """FP16/BF16/FP32 vs the FP64 golden for every BatchNorm output, per tensor, per channel and per
    stage; on a dump, every recorded call on its own inputs. Exit 0 when all are within standard, 1 when
    some are not."""
    from bnprobe._progress import Progress
    from bnprobe.adapters import get_adapter
    from bnprobe.engine.cases import Distribution, select_cases
    from bnprobe.checks.compare.precision import CallOptions, Judging, compare_precision
    from bnprobe.engine.recorded import given
    from bnprobe.reports.compare import compare_lines, report_files, write_report

    _check_common(eps=eps, params=params)
    fmts, dts = _formats_and_dtypes(format, dtypes)
    names, builtin = _listed(adapters)
    if not names:
        raise BNProbeError("--adapters is empty")
    if (found := _sweep_root(names[0], input, (sweep, workers, scheduler, resume))) is not None:
        if len(names) > 1:
            raise BNProbeError("a sweep runs one adapter over the dump root (or its recorded outputs): give one")
        _check_sweep(False, given(dtypes=dtypes, shape=shape, batch=batch, dist=dist, mean=mean, std=std, eps=eps,
                                  momentum=momentum, params=params), str(found[0]))
        return _run_sweep("compare-precision", found, calls, out, force, workers, scheduler, resume, mode=mode,
                          rule=rule, bench=bench, budget=budget, convention=convention)
    names, input, eps, momentum = _dump_scalars(names, input, eps, momentum)
    kernels = [get_adapter(a) if convention is None else _in_convention(a, convention) for a in names]
    resolved, cases, recorded = select_cases(kernels, input=input, calls=calls, shape=shape,
                                             shapes=shapes, batch=batch, values=Distribution(dist, mean, std),
                                             seed=seed, mode=mode, stress=stress)
    resolved = _builtin_for(resolved, builtin, dts, recorded)
    sink = _output(out, force, "compare-precision", *report_files(fmts)) if fmts else None
    with Progress("compare-precision") as bar:
        result = compare_precision(resolved, dts, cases, mode=mode, seed=seed, budget=budget, progress=bar,
                                   options=CallOptions(eps=eps, momentum=momentum, params=params),
                                   judging=Judging(rule=rule, bench=bench))
    paths = write_report(result, sink, fmts) if sink is not None else []
    what = f"{len(cases)} recorded call(s) of {recorded.source}" if recorded is not None else f"{len(cases)} inputs"
    _echo(compare_lines(result, what, recorded.notes if recorded is not None else (), recorded is not None))
    if paths:
        typer.echo(f"report: {sink.path}/ ({', '.join(p.name for p in paths)})")
    return 0 if result.passed else 1


@_command("overflow")
def overflow_cmd(
    adapter: str = typer.Option("emulated", *_A, help="Adapter to scan (a traced one shows every stage), or "
                                                 "dump:DIR[#NAME] (every recorded call's outputs vs the golden)."),
    dtype: Optional[str] = typer.Option(None, *_D, help="Format: fp16 (default), bf16, fp32; a recording's own."),
    accumulate: Optional[str] = typer.Option(None, help="Accumulator/compute format for emulated kernels, e.g. "
                                                        "fp16 for a naive port."),
    input: Optional[Path] = typer.Option(None, "--input", help="Input tensor .npy/.npz, or a dump folder (the adapter "
                                                               "on every recorded call's own inputs)."),
    calls: Optional[str] = _calls("scan"),
    shape: Optional[str] = typer.Option(None, help="Shape of generated input (default 8,16,14,14)."),
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    seed: Optional[int] = _SEED,
    mode: Optional[str] = typer.Option(None, help="train (default), infer or backward; on a recording: every mode "
                                                  "each call recorded unless given."),
    eps: Optional[float] = _EPS,
    params: Optional[str] = _PARAMS,
    convention: Optional[str] = _CONVENTION,
    dy: Optional[str] = typer.Option(None, "--dy", help="Upstream gradient of the generated backward: shifted "
                                     "(default: N(0, 1) plus a mean per channel, as real losses give, so Σdy grows "
                                     "with R), normal, heavy (Student t, 2 d.o.f., shifted)."),
    out: Optional[Path] = _OUT,
    force: bool = _FORCE,
    as_json: bool = _JSON,
    sweep: bool = _SWEEP, workers: Optional[int] = _WORKERS, scheduler: Optional[str] = _SCHEDULER,
    resume: bool = _RESUME,
) -> int:
    """Where, in which channel and why a BatchNorm goes non-finite or silently wrong; headroom predicted
    from the input; remedies verified; on a dump, every recorded call's outputs against the golden (an
    msprobe statistics dump: its summaries). Exit 0 when clean, 1 when anomalies are found."""
    from bnprobe.engine.cases import DY_KINDS
    from bnprobe.checks.overflow.scan import scan, scan_recorded
    from bnprobe.engine.recorded import check_options, given, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import overflow_recorded_report, overflow_report

    _check_common(eps=eps, params=params, mode=mode)
    if dy is not None and dy not in DY_KINDS:
        raise BNProbeError(f"--dy {dy!r}: valid kinds are {', '.join(DY_KINDS)}")
    if (found := _sweep_root(adapter, input, (sweep, workers, scheduler, resume))) is not None:
        _check_sweep(as_json, given(dtype=dtype, accumulate=accumulate, shape=shape, dist=dist, mean=mean, std=std,
                                   seed=seed, eps=eps, params=params, dy=dy), str(found[0]))
        return _run_sweep("overflow", found, calls, out, force, workers, scheduler, resume, mode=mode,
                          convention=convention)
    sink = _output(out, force)
    (adapter,), input, eps, _ = _dump_scalars([adapter], input, eps)
    kernel = _in_convention(adapter, convention)
    recorded = recording_of(kernel, input, calls, guard="overflow")
    if recorded is not None:
        check_options(recorded, given=given(shape=shape, dist=dist, mean=mean, std=std, seed=seed, eps=eps,
                                            accumulate=accumulate, dy=dy), dtype=dtype, mode=mode, params=params)
        return _show(overflow_recorded_report(scan_recorded(recorded, mode=mode)), sink, as_json)
    x = input_tensor("overflow", input, "8,16,14,14" if shape is None else shape, dist or "normal",
                     0.0 if mean is None else mean,
                     1.0 if std is None else std, seed or 0)
    rep = scan(kernel, x, dtype=dtype or "fp16", accumulate=accumulate, mode=mode or "train",
               eps=EPS if eps is None else eps, seed=seed or 0, params=params, dy=dy)
    return _show(overflow_report(rep, params), sink, as_json)


@_command("fold")
def fold_cmd(
    layer: str = typer.Option("conv2d", help="Built-in layer before the BatchNorm: conv2d or linear."),
    weights: Optional[Path] = typer.Option(None, help=".npz with weight, gamma, beta, running_mean, running_var "
                                                      "(optional bias, eps, groups, padding, x)."),
    folded: Optional[Path] = typer.Option(None, "--folded", help="Your folded layer, an .npz with weight (W'), bias "
                                                                 "(b') and optional eps: judged against the FP64 fold "
                                                                 "of --weights (needs --weights)."),
    dtype: Optional[str] = typer.Option(None, *_D, help="Format: fp16, bf16, fp32, fp64 (default fp16; with --folded, "
                                                   "the file's)."),
    accumulate: Optional[str] = typer.Option(None, help="Accumulator of the layer's dot products (default fp32)."),
    eps: Optional[float] = typer.Option(None, help="BatchNorm epsilon (default: the layer's, 1e-5)."),
    groups: int = typer.Option(1, help="Groups of the built-in conv2d (its 16 input channels must divide)."),
    seed: int = typer.Option(0, min=0, help="Seed of the built-in layer."),
    onnx: Optional[Path] = typer.Option(None, "--onnx", help="An ONNX model: every Conv/ConvTranspose/Gemm/MatMul -> "
                                                             "BatchNormalization pair folded in --dtype (a list: "
                                                             "fp16,bf16) and judged (needs bnprobe[onnx])."),
    fused: Optional[Path] = typer.Option(None, "--fused", help="With --onnx: the fused model a runtime or converter "
                                                               "made of it, each fused layer judged against the FP64 "
                                                               "fold, and in fp16."),
    fuse: Optional[str] = typer.Option(None, "--fuse", help="With --onnx: fuse it with onnxruntime's graph optimizer "
                                                            "(ort: extended level; ort-basic, ort-all), judge that."),
    out: Optional[Path] = _OUT,
    force: bool = _FORCE,
    as_json: bool = _JSON,
) -> int:
    """Check BatchNorm folding into a Conv2D/Linear (and fused forms) per output channel in a format, with
    --folded your own folded weights, or with --onnx every pair of an ONNX model (and --fused / --fuse ort its
    fused model). Exit 1 when a channel's folded result breaks the standard."""
    from bnprobe.checks.fold.layer import check_fold, load_layer, make_layer
    from bnprobe.reports.checks import fold_report

    if onnx is not None or fused is not None or fuse is not None:
        given = {"--weights": weights is not None, "--folded": folded is not None, "--eps": eps is not None,
                 "--groups": groups != 1, "--seed": seed != 0, "--layer": layer != "conv2d"}
        return _fold_onnx(onnx, fused, fuse, dtype, accumulate, [k for k, v in given.items() if v], out, force,
                          as_json)
    if groups < 1 or 16 % groups:
        raise BNProbeError(f"--groups must divide the built-in conv2d's 16 input channels, got {groups}")
    if folded is not None:
        from bnprobe.checks.fold.folded import check_folded, load_folded

        if weights is None:
            raise BNProbeError("--folded FILE needs --weights LAYER.npz: the layer (weight, gamma, beta, running_mean, "
                               "running_var) it was folded from")
        for name, given in (("--dtype", dtype), ("--accumulate", accumulate)):
            if given is not None:
                raise BNProbeError(f"--folded judges the file as stored (its format is its own, the golden is FP64): "
                                   f"drop {name}")
        sink = _output(out, force)
        lay = load_layer(weights)
        return _show(fold_report(check_folded(lay, load_folded(folded, lay), eps=eps)), sink, as_json)
    sink = _output(out, force)
    lay = load_layer(weights) if weights is not None else make_layer(layer, seed=seed, groups=groups)
    return _show(fold_report(check_fold(lay, dtype or "fp16", accumulate=accumulate, eps=eps, against_torch=True)),
                 sink, as_json)


def _fold_onnx(onnx: Optional[Path], fused: Optional[Path], fuse: Optional[str], dtype: Optional[str],
               accumulate: Optional[str], conflicting: list[str], out: Optional[Path], force: bool,
               as_json: bool) -> int:
    """fold --onnx: the checks of bnprobe.checks.fold.onnx_model, its report, and the report as HTML beside the
    others."""
    if onnx is None:
        raise BNProbeError(f"{'--fused' if fused is not None else '--fuse'} checks the fused model of an ONNX model: "
                           "give that model with --onnx MODEL.onnx")
    if conflicting:
        raise BNProbeError(f"--onnx reads every layer, its parameters and each BatchNormalization's ε from the model: "
                           f"drop {', '.join(conflicting)}")
    from bnprobe.checks.fold.onnx_model import check_onnx
    from bnprobe.reports.checks import fold_onnx_html, fold_onnx_report

    dtypes = [d.strip() for d in (dtype or "fp16").split(",")]
    sink = _output(out, force)
    rep = check_onnx(onnx, dtypes, fused=fused, fuse=fuse, accumulate=accumulate)
    report = fold_onnx_report(rep)
    if sink is not None:
        report.pages[f"{report.stem}.html"] = fold_onnx_html(rep, report)
    return _show(report, sink, as_json)


@_command("doctor")
def doctor_cmd(
    adapter: str = typer.Option("reference", *_A,
                                help="Adapter to diagnose, or dump:DIR[#NAME] (every recorded call on "
                                                  "its own inputs)."),
    dtype: Optional[str] = typer.Option(None, *_D,
                                        help="Format (default: fp64 if the adapter runs it, else its first; a "
                                                   "recording's own)."),
    params: Optional[str] = _PARAMS,
    seed: Optional[int] = typer.Option(None, min=0, help="Seed of the diagnostic inputs (default 0)."),
    eps: Optional[float] = _EPS, momentum: Optional[float] = _MOMENTUM,
    shape: Optional[str] = typer.Option(None, help="Shape N,C[,...] of one more input, generated from --dist, --mean, "
                                                   "--std and --seed and checked like --input (default 8,4,4,4 when "
                                                   "only those are given); the designed inputs keep their shapes."),
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    stability: Optional[bool] = typer.Option(None, "--stability/--no-stability",
                                             help="Include the stress inputs (default on; a replayed dump cannot "
                                                  "run them)."),
    recipe: bool = typer.Option(False, "--recipe", help="When something fails, also identify the kernel's recipe "
                                                        "and name its choices known to lose accuracy (a few seconds "
                                                        "more; up to a minute for a kernel outside the space)."),
    input: Optional[Path] = typer.Option(None, "--input", help="Your input too: a tensor .npy/.npz (x), or a dump "
                                                               "folder (the adapter on every recorded call's own "
                                                               "inputs)."),
    calls: Optional[str] = _calls("diagnose"),
    convention: Optional[str] = _CONVENTION,
    out: Optional[Path] = _OUT,
    force: bool = _FORCE,
    as_json: bool = _JSON,
    sweep: bool = _SWEEP, workers: Optional[int] = _WORKERS, scheduler: Optional[str] = _SCHEDULER,
    resume: bool = _RESUME,
) -> int:
    """The expert's checklist for a BatchNorm kernel on a diagnostic input, stress inputs and yours:
    PASS/WARN/FAIL with evidence, the known bug each failure matches, and what is wrong where none
    does; on a dump, every recorded call's outputs on its own inputs. --eps and --momentum are the
    layer's, used on every input (a kernel that ignores them fails); --shape, --dist, --mean, --std
    make one more input, "generated". Exit 0 when healthy, 1 when something failed."""
    from bnprobe.checks.doctor.diagnosis import doctor, doctor_recorded
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import doctor_recorded_report, doctor_report

    _check_common(eps=eps, params=params)
    generating = given(shape=shape, dist=dist, mean=mean, std=std)
    if recipe and (input is not None and is_dump_path(input) or adapter.startswith("dump:")):
        raise BNProbeError("--recipe identifies a kernel on designed probes: for a recording run "
                           "`bnprobe identify --adapter dump:DIR` (each call on its own inputs)")
    if (found := _sweep_root(adapter, input, (sweep, workers, scheduler, resume))) is not None:
        _check_sweep(as_json, given(dtype=dtype, params=params, seed=seed, stability=stability, eps=eps,
                                    momentum=momentum) + generating, str(found[0]))
        return _run_sweep("doctor", found, calls, out, force, workers, scheduler, resume, convention=convention)
    tensor = input if input is not None and not is_dump_path(input) else None
    sink = _output(out, force)
    (adapter,), input, eps, momentum = _dump_scalars([adapter], input, eps, momentum)
    kernel = _in_convention(adapter, convention)
    recorded = recording_of(kernel, None if tensor is not None else input, calls, guard="doctor")
    if recorded is not None:
        refused = dict(seed=seed, stability=None if stability is None or not recorded.replay else True, eps=eps,
                       momentum=momentum)
        check_options(recorded, given=given(**refused) + generating, dtype=dtype, params=params)
        run = doctor_recorded(recorded, dtype=dtype, params=params, stability=stability is not False)
        return _show(doctor_recorded_report(run), sink, as_json)
    if calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    if tensor is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input {input}; "
                           "drop one")
    made = input_tensor("doctor", None, "8,4,4,4" if shape is None else shape, dist or "normal",
                        0.0 if mean is None else mean, 1.0 if std is None else std, seed or 0) if generating else None
    rep = doctor(kernel, dtype, seed=seed or 0, stability=stability is not False, params=params,
                 x=None if tensor is None else input_tensor("doctor", tensor), eps=EPS if eps is None else eps,
                 momentum=MOMENTUM if momentum is None else momentum, generated=made, recipe=recipe)
    return _show(doctor_report(rep), sink, as_json)


@_command("identify")
def identify_cmd(
    adapter: str = typer.Option("torch", *_A, help="The black-box kernel: an adapter (torch, ascend-bnv3, a plugin "
                                              "pkg.mod:Name...) or dump:DIR[#NAME] (every recorded call, each on its "
                                              "own inputs)."),
    dtype: Optional[str] = typer.Option(None, *_D,
                                        help="Format: fp16 (default), bf16, fp32 or fp64; a recording's own."),
    params: Optional[str] = _PARAMS,
    input: Optional[Path] = typer.Option(None, "--input", help="Your input x (.npy/.npz), to confirm the recipe on "
                                                               "too, or a dump folder (the adapter on every recorded "
                                                               "call's own inputs)."),
    shape: Optional[str] = typer.Option(None, help="Shape N,C[,...] of one more input to confirm the recipe on, "
                                                   "generated from --dist, --mean, --std and --seed."),
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    seed: Optional[int] = _SEED,
    eps: Optional[float] = _EPS, momentum: Optional[float] = _MOMENTUM,
    calls: Optional[str] = _calls("identify"),
    out: Optional[Path] = _OUT,
    force: bool = _FORCE,
    as_json: bool = _JSON,
) -> int:
    """How a black-box kernel computes: the policy (emulated:<spec>) that reproduces its every output bit for bit,
    searched stage by stage on designed probes and confirmed on fresh inputs; the fields the probes could not tell
    apart, and where no policy reproduces it, the closest and the stage where it departs. Exit 0 when every output
    it returns is reproduced bit for bit, 1 when not."""
    from bnprobe._progress import Progress
    from bnprobe.checks.identify.search import identify, identify_recorded
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.identify import identify_recorded_report, identify_report

    _check_common(eps=eps, params=params)
    if momentum is not None:
        from bnprobe.kernels.layout import check_momentum

        check_momentum(momentum)
    generating = given(shape=shape, dist=dist, mean=mean, std=std)
    tensor = input if input is not None and not is_dump_path(input) else None
    if tensor is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input {input}; "
                           "drop one")
    if generating and shape is None:
        raise BNProbeError(f"{', '.join(generating)} describe a generated input: give its --shape too")
    if tensor is not None and adapter.startswith("dump:"):
        raise BNProbeError(f"--input and the dump adapter {adapter} both give the inputs: a dump runs on its own "
                           "recorded inputs; drop --input")
    sink = _output(out, force)
    (adapter,), input, eps, momentum = _dump_scalars([adapter], input, eps, momentum)
    progress = Progress("identify")
    recorded = recording_of(adapter, None if tensor is not None else input, calls, guard="identify")
    if recorded is not None:
        check_options(recorded, given=given(shape=shape, dist=dist, mean=mean, std=std, seed=seed, eps=eps,
                                            momentum=momentum), dtype=dtype, params=params)
        return _show(identify_recorded_report(identify_recorded(recorded, progress=progress)), sink, as_json)
    if calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    x = None
    if tensor is not None or shape is not None:
        x = input_tensor("identify", tensor, shape or "", dist or "normal", 0.0 if mean is None else mean,
                         1.0 if std is None else std, seed or 0)
    res = identify(adapter, dtype or "fp16", params=params or "fp32", x=x, seed=seed or 0,
                   eps=EPS if eps is None else eps, momentum=MOMENTUM if momentum is None else momentum,
                   progress=progress)
    return _show(identify_report(res), sink, as_json)


@_command("shrink")
def shrink_cmd(
    adapter: str = typer.Option(..., *_A, help="Adapter whose comparison with the FP64 reference fails (a "
                                                       "runnable one: a dump cannot be rerun on smaller inputs)."),
    dtype: Optional[str] = typer.Option(None, *_D, help="Format (default fp16; a recording's own)."),
    params: Optional[str] = _PARAMS,
    mode: Optional[str] = typer.Option(None, help="train (default), infer or backward."),
    predicate: str = typer.Option("compare", help="compare (vs the reference), overflow, or module:function "
                                                  "(f(x) -> True when the case fails)."),
    input: Optional[Path] = typer.Option(None, "--input", help="The failing input .npy/.npz, or a dump folder "
                                                               "DIR[#NAME] of one call (its x, γ, β, eps, ...)."),
    calls: Optional[str] = typer.Option(None, "--calls", help="The recorded call to shrink (glob), when --input is "
                                                              "a dump of several."),
    shape: Optional[str] = typer.Option(None, help="Shape of generated input (default 16,64,28,28)."),
    dist: Optional[str] = _DIST, mean: Optional[float] = _MEAN, std: Optional[float] = _STD,
    seed: Optional[int] = _SEED,
    seconds: float = typer.Option(120.0, help="Time budget in seconds (> 0)."),
    convention: Optional[str] = _CONVENTION,
    out: Optional[Path] = typer.Option(None, help="Folder for x.npy, the dump and shrink.json "
                                                  "(default reports/shrink-<time>)."),
    force: bool = _FORCE,
) -> int:
    """Reduce a failing case (channels, batch, spatial size, then values) to a minimal one that still
    fails; write it as a dump plus the exact command that replays it."""
    from bnprobe._progress import Progress
    from bnprobe.engine.recorded import given, recording_of
    from bnprobe.checks.shrink.shrinking import predicate_for, recorded_case, runnable, shrink
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.shrink import shrink_lines, write_shrink

    _check_common(params=params, mode=mode)
    if not 0 < seconds <= 86400:
        raise BNProbeError(f"--seconds must be > 0 and at most 86400 (a day), got {seconds}")
    sink = _output(out, force, "shrink", "x.npy", "shrink.json")
    a = runnable(_in_convention(adapter, convention))
    recorded = recording_of(a, input, calls, guard="shrink")
    kept = None
    if recorded is not None:
        x, kept, dtype, mode = recorded_case(recorded, given=given(shape=shape, dist=dist, mean=mean, std=std,
                                                                   seed=seed), dtype=dtype, mode=mode, params=params)
        params = kept.params
    else:
        x = input_tensor("shrink", input, "16,64,28,28" if shape is None else shape, dist or "normal",
                         0.0 if mean is None else mean,
                         1.0 if std is None else std, seed or 0)
        dtype, mode, params = dtype or "fp16", mode or "train", params or "fp32"
    fails = predicate_for(predicate, a, dtype=dtype, mode=mode, recorded=kept, params=params)
    with Progress("shrink") as bar:
        res = shrink(x, fails, seconds=seconds, progress=bar.steps(20))
    files, cmd = write_shrink(res, sink, adapter=adapter, dtype=dtype, mode=mode, predicate=predicate,
                              recorded=kept, params=params, convention=convention)
    _echo(shrink_lines(res, files, cmd, dtype, kept))
    return 0


@_command("plot-stats")
def plot_stats_cmd(
    simulate: bool = typer.Option(False, "--simulate", help="Record a built-in training run (the default when no "
                                                           "--log or --dumps is given)."),
    steps: int = typer.Option(200, min=1, max=20_000, help="Steps of the simulated training run (1 to 20000)."),
    policies: str = typer.Option("fp32,fp16,bf16", help="Policies of the simulated run, side by side."),
    seed: int = typer.Option(0, min=0, help="Seed of the simulated run."),
    log: Optional[Path] = typer.Option(None, "--log", help="CSV/Parquet log: step, layer, channel, mean, var "
                                                           "[, running_mean, running_var]."),
    dumps: Optional[Path] = typer.Option(None, "--dumps", help="Folder of dumps, one sub-folder per step."),
    monitor: Optional[Path] = typer.Option(None, "--monitor", help="Folder a bnprobe.monitor writes (every "
                                                                   "rank's; re-read as the run grows)."),
    channels: int = typer.Option(6, help="Channels per figure (the most drifting first)."),
    eps: float = typer.Option(1e-5, help="BatchNorm epsilon (for var/eps)."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default reports/plot-stats-<time>)."),
    format: str = typer.Option("png", "--format", help="png or svg."),
    force: bool = _FORCE,
) -> int:
    """Plot μ and σ² and the running statistics over training, per channel and per format, and flag
    divergence, collapse toward eps, non-finite statistics and a wrong momentum. Exit 1 when flagged."""
    from bnprobe.checks.plot_stats.stats import find, load_dump_series, load_log, load_monitor
    from bnprobe.checks.plot_stats.stats import simulate as run_simulation
    from bnprobe.reports.stats import STATS_FILES, stats_lines, write_stats

    _check_common(eps=eps)
    if format not in ("png", "svg"):
        raise BNProbeError(f"--format takes png or svg, got {format!r}")
    if sum(v is not None for v in (log, dumps, monitor)) + bool(simulate) > 1:
        raise BNProbeError("give one source: --simulate, --log, --dumps or --monitor")
    if channels < 1:
        raise BNProbeError(f"--channels must be >= 1, got {channels}")
    sink = _output(out, force, "plot-stats", *STATS_FILES)
    found: list = []
    if monitor is not None:
        (df, found), source = load_monitor(monitor), f"monitor {monitor}"
    elif log is not None:
        df, source = load_log(log), str(log)
    elif dumps is not None:
        df, source = load_dump_series(dumps), str(dumps)
    else:
        pols = tuple(p.strip() for p in policies.split(",") if p.strip())
        if not pols:
            raise BNProbeError("--policies is empty")
        df, source = run_simulation(pols, steps=steps, seed=seed, eps=eps), f"simulated run, seed {seed}"
    findings = found + find(df, eps=eps)
    write_stats(df, findings, source, sink, eps=eps, channels=channels, ext=format)
    _echo(stats_lines(df, findings, source, sink))
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


class _PipeSafe:
    """A stream whose writes to a reader that has gone (``| head -1``) are dropped: the command still ends with its
    verdict's exit status (click turned the broken pipe into exit 1, a pass reported as a failure).  Its binary
    ``buffer`` (click writes there when the text stream's encoding does not suit it) is guarded the same way."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._gone = stream, False
        self._buffer: _PipeSafe | None = None

    def _guard(self, call: Any, *args: Any) -> Any:
        if not self._gone:
            try:
                return call(*args)
            except BrokenPipeError:
                self._gone = True
        return None

    def write(self, data: Any) -> int:
        n = self._guard(self._stream.write, data)
        return len(data) if n is None else n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    @property
    def gone(self) -> bool:
        """Whether the reader went: a write or flush here or through ``buffer`` met a broken pipe."""
        return self._gone or (self._buffer is not None and self._buffer.gone)

    @property
    def buffer(self) -> Any:
        if self._buffer is None:
            self._buffer = _PipeSafe(self._stream.buffer)
        return self._buffer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one-line errors and exit status 2 for bad input; warnings reported once, not leaked;
    the exit status is the verdict's even when stdout's reader stops reading."""
    import warnings

    from bnprobe.guard import tune_process

    tune_process()
    args = _hoist_max_memory(list(sys.argv[1:] if argv is None else argv))
    stdout = sys.stdout  # None when the process was started with stdout closed: nothing to guard
    guarded = None if stdout is None else _PipeSafe(stdout)
    if guarded is not None:
        sys.stdout = guarded
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = _run(args)
        if code in (0, 1):
            _report_warnings(caught)
        if guarded is not None:
            guarded.flush()
    finally:
        sys.stdout = stdout
    if guarded is not None and guarded.gone:  # what stayed in its buffer would fail the interpreter's flush at exit
        _silence_stdout()
    return code


def _silence_stdout() -> None:
    """stdout pointed at /dev/null, so the interpreter's flush at exit cannot fail on a pipe that is gone."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to silence
        pass


def _stderr_gone() -> bool:
    """Whether stderr's reader has gone (a write to it fails on a broken pipe)."""
    try:
        if sys.stderr is None:
            return True
        sys.stderr.write("")
        sys.stderr.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    return False


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
    except Exception as exc:  # noqa: BLE001 - the last resort: a crash is one line and exit 3, never 0 or 1
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
            msg = exc.format_message() if isinstance(exc, click_exception) else exc.worded(flag)
            typer.echo(f"bnprobe: error: {msg}", err=True)
            return 2
        if isinstance(exc, BrokenPipeError) and _stderr_gone():  # stdout's reader gone is handled in main
            return 1  # the run's report did not reach its reader: not a pass (other broken pipes: an OSError below)
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
        return _internal_error(exc)
    return int(rv) if isinstance(rv, int) else 0


INTERNAL_ERROR = 3  # exit status of a crash: never 0 (pass) or 1 (a verdict FAIL), nor 2 (bad input)


def _internal_error(exc: Exception) -> int:
    """A bug of bnprobe's own: one line saying so and where (``BNPROBE_TRACEBACK=1`` prints the traceback), exit 3."""
    import os
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame is not None else ""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    typer.echo(f"bnprobe: internal error (a bug in bnprobe, not a verdict on your kernel): {type(exc).__name__}"
               f"{': ' + first if first else ''}{where}; BNPROBE_TRACEBACK=1 prints the traceback", err=True)
    if os.environ.get("BNPROBE_TRACEBACK"):
        traceback.print_exception(exc)
    return INTERNAL_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``bnprobe`` command line: parse, call the library once, render.

The only module that prints.  Bad input of any kind is one line on stderr,
``bnprobe: error: ...``, and exit status 2.  The options several commands share are declared once, in groups
(:class:`Group`); a command names the groups it takes and is handed one instance of each, checked.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, get_type_hints

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
_FLAGS = {"x": "--input"}


def flag(name: str) -> str:
    """The flag of a library parameter an error names (:func:`bnprobe.core.errors.named`): ``eps`` is ``--eps``,
    ``max_memory`` ``--max-memory``, ``x`` ``--input``."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _if_given(**options: Any) -> dict[str, Any]:
    """The options given (not None), to pass on as keywords: the library's default applies to the others (where
    None means something else there, as a momentum of None, a cumulative average)."""
    return {k: v for k, v in options.items() if v is not None}


# ---- options several commands share: each declared once, in its group -----------------------------------------

_WORDING = ("help", "default", "flags", "shown", "check")  # what a command's wording of a group's option may set


def option(*flags: str, help: str = "", default: Any = None, **typer_kw: Any) -> Any:
    """One option of a group, declared once: its flags (none: ``--<field name>``), help, default, and what else typer
    takes (metavar, min, max); a dataclass field, expanded into the signature of each command that takes it."""
    return field(default=default, metadata={"option": {"flags": flags, "help": help, "default": default, **typer_kw}})


class Group:
    """Options several commands share: a frozen dataclass whose fields are declared with :func:`option`.  A command
    takes a group as a parameter whose default is :meth:`use`; :func:`_command` expands it into the group's options
    and hands the command one instance, checked (:meth:`check`) before the command's body runs."""

    @classmethod
    def use(cls, *names: str, **wording: Any) -> Use:
        """The group's options ``names`` (all when none is named), in that order, each as the group declares it
        unless ``wording`` says otherwise: a str is its help; a dict sets any of its help, default, flags,
        ``shown`` (a default the library resolves, stated in the help where click would state it), ``check``
        (False: the command's library checks it in its own words), and the fields of the declared help."""
        return Use(cls, names or tuple(f.name for f in fields(cls)), wording)  # type: ignore[arg-type]

    def check(self, names: frozenset[str]) -> None:
        """Refuse bad values of the options ``names`` before any work (nothing to check unless a group says)."""


@dataclass(frozen=True)
class Use:
    """A command's use of a group: which of its options, and their wording (:meth:`Group.use`)."""

    group: type[Group]
    names: tuple[str, ...]
    wording: dict[str, Any]

    def parameters(self) -> list[inspect.Parameter]:
        """The options as the command's typer parameters."""
        declared = {f.name: f.metadata["option"] for f in fields(self.group)}  # type: ignore[arg-type]
        hints = get_type_hints(self.group)
        return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=hints[n],
                                  default=_declared(declared[n], self.wording.get(n))) for n in self.names]

    def take(self, values: dict[str, Any]) -> Group:
        """The group's instance made of its options' ``values`` (taken out of them), checked."""
        group = self.group(**{n: values.pop(n) for n in self.names})
        unchecked = {n for n, w in self.wording.items() if isinstance(w, dict) and w.get("check") is False}
        group.check(frozenset(self.names) - unchecked)
        return group


def _declared(declared: dict[str, Any], wording: str | dict[str, Any] | None) -> Any:
    """typer's declaration of a group's option, as the group declares it and a command words it."""
    own = {"help": wording} if isinstance(wording, str) else dict(wording or {})
    fill = {k: v for k, v in own.items() if k not in _WORDING}
    text = own["help"] if "help" in own else declared["help"].format(**fill)
    if "shown" in own:  # click states only a default it holds; this one the library resolves
        text += f"  [default: {own['shown']}]"
    rest = {k: v for k, v in declared.items() if k not in ("flags", "help", "default")}
    return typer.Option(own.get("default", declared["default"]), *own.get("flags", declared["flags"]), help=text,
                        **rest)


def _command(name: str, order: str = ""):  # noqa: ANN202 - typer's decorator
    """Register a command of the registry (bnprobe.core.commands) under its name: each of its parameters whose
    default is a :class:`Use` becomes that group's options, where it stands (``order``: every option's name in
    --help's order, where the groups' options and the command's own interleave), and the command is handed one
    instance of the group, checked before its body runs."""
    from bnprobe.core.commands import command

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints, params, uses = get_type_hints(fn), [], {}
        for p in inspect.signature(fn).parameters.values():
            if isinstance(p.default, Use):
                uses[p.name] = p.default
                params += p.default.parameters()
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]))
        if order:
            if sorted(order.split()) != sorted(p.name for p in params):
                raise TypeError(f"{name}: the order {order!r} does not name each of its options once")
            params.sort(key=lambda p: order.split().index(p.name))

        def run(**values: Any) -> Any:
            groups = {g: use.take(values) for g, use in uses.items()}
            return fn(**values, **groups)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        run.__name__, run.__doc__ = fn.__name__, fn.__doc__
        return app.command(command(name).name)(run)

    return register


def _not_empty(group: Group, names: frozenset[str], fields: tuple[str, ...]) -> None:
    """The ``group``'s options ``fields`` that were given (of ``names``) as an empty string refused in one line: an
    empty value names nothing, and taking the default instead would answer another question than the one asked."""
    from bnprobe.core.errors import named

    for f in fields:
        value = getattr(group, f)
        if f in names and isinstance(value, str) and not value.strip():
            raise BNProbeError(f"{named(f)} is empty")


@dataclass(frozen=True)
class Kernel(Group):
    """The kernel checked: its adapter (each command words it and has its own default), the format it runs in,
    and an emulated kernel's accumulator."""

    adapter: Optional[str] = option("--adapter", "--adapters", help="The adapter.")
    dtype: Optional[str] = option("--dtype", "--dtypes", help="Format (default fp16; a recording's own).")
    accumulate: Optional[str] = option(help="Accumulator/compute format for emulated kernels, e.g. fp16 for a naive "
                                            "port.")

    def check(self, names: frozenset[str]) -> None:
        """A format given empty refused (it would run the default format unasked)."""
        _not_empty(self, names, ("dtype", "accumulate"))


@dataclass(frozen=True)
class Generated(Group):
    """The generated input: its shape (each command words its own default) and how it is drawn."""

    shape: Optional[str] = option(help="Shape of generated input (default 8,16,14,14).")
    seed: Optional[int] = option(min=0, help="Seed of the generated input and parameters (default 0).")
    mean: Optional[float] = option(help="Mean of the generated input (default 0).")
    std: Optional[float] = option(help="Standard deviation of the generated input (default 1).")
    dist: Optional[str] = option(help="Distribution of the generated input: normal (default), uniform, student_t, "
                                      "constant.")


@dataclass(frozen=True)
class Call(Group):
    """The BatchNorm call: its mode, scalars, layout, parameter format and framework convention."""

    mode: Optional[str] = option(help="train (default), infer or backward.")
    eps: Optional[float] = option(help="BatchNorm epsilon (> 0; default 1e-5; a recording's own).")
    momentum: Optional[float] = option(help="Running-stat momentum m, the batch's weight (PyTorch's spelling, in "
                                            "every convention; default 0.1).")
    layout: Optional[str] = option(help="channels_first (default) or channels_last.")
    params: Optional[str] = option(help="Parameter format: fp32 (mixed precision, the default) or same (γ, β, "
                                        "running and saved statistics in the input's format); a recording's own.")
    convention: Optional[str] = option("--convention", help="The framework convention the kernels follow (a "
                                                             "plugin's, a dump's): torch, tensorflow, keras, flax, "
                                                             "paddle, mindspore; the golden's and the bench's "
                                                             "running variance follow it.")

    def check(self, names: frozenset[str]) -> None:
        """ε a number the library takes, the parameter format one it knows, the mode train, infer or backward."""
        from bnprobe.engine.recorded import check_params
        from bnprobe.kernels.layout import check_eps

        if "eps" in names and self.eps is not None:
            check_eps(self.eps)
        if "params" in names:
            check_params(self.params)
        if "mode" in names and self.mode not in (None, "train", "infer", "backward"):
            raise BNProbeError(f"unknown mode {self.mode!r}; valid: train, infer, backward")
        _not_empty(self, names, ("convention",))


@dataclass(frozen=True)
class Norm(Group):
    """The layer: BatchNorm (the default) or one of its siblings, with what places its statistics."""

    norm: str = option("--norm", default="batch", help="The layer: batch (BatchNorm, the default), layer "
                                                       "(LayerNorm), rms (RMSNorm), group (GroupNorm), instance "
                                                       "(InstanceNorm).")
    normalized_shape: Optional[str] = option("--normalized-shape", help="LayerNorm, RMSNorm: the normalised "
                                                                        "trailing dims, e.g. 4096 or 16,64 (default: "
                                                                        "the last dim).")
    groups: Optional[int] = option("--num-groups", min=1, help="GroupNorm: the number of channel groups.")

    def check(self, names: frozenset[str]) -> None:
        """The layer one bnprobe knows; the normalised shape a list of sizes; each option only where it applies."""
        from bnprobe.core.call import NORMS

        if self.norm not in NORMS:
            raise BNProbeError(f"unknown norm {self.norm!r}; valid: {', '.join(NORMS)}")
        if self.normalized_shape is not None and self.norm not in ("layer", "rms"):
            raise BNProbeError("--normalized-shape applies to --norm layer and rms")
        if self.groups is not None and self.norm != "group":
            raise BNProbeError("--num-groups applies to --norm group")
        if self.norm == "group" and self.groups is None:
            raise BNProbeError("--norm group needs --num-groups (the number of channel groups)")
        self.dims()

    def dims(self) -> tuple[int, ...] | None:
        """--normalized-shape as sizes (None: the last dim)."""
        if self.normalized_shape is None:
            return None
        try:
            dims = tuple(int(p) for p in self.normalized_shape.split(",") if p.strip())
        except ValueError:
            raise BNProbeError(f"--normalized-shape {self.normalized_shape!r} is not a comma-separated list of "
                               "integers, e.g. 4096") from None
        if not dims or any(d < 1 for d in dims):
            raise BNProbeError(f"--normalized-shape {self.normalized_shape!r} must be sizes >= 1")
        return dims


@dataclass(frozen=True)
class Source(Group):
    """Where the input comes from instead: a tensor file or a dump, and the recorded calls to take."""

    input: Optional[Path] = option("--input", help="Input tensor .npy/.npz, or a dump folder.")
    calls: Optional[str] = option("--calls", help="Recorded calls to {what} (glob on the call or module name), e.g. "
                                                  "'*layer1*'.")

    def check(self, names: frozenset[str]) -> None:
        """An empty glob refused (it selects no call: taking every call instead would answer another question)."""
        _not_empty(self, names, ("calls",))


@dataclass(frozen=True)
class Output(Group):
    """Where the report goes, whether it may overwrite, and JSON instead of the table."""

    out: Optional[Path] = option(help="Write CSV, JSON and Markdown to this folder.")
    force: bool = option("--force", default=False, help="Overwrite existing files in --out.")
    as_json: bool = option("--json", default=False, help="Print JSON instead of the table.")

    def sink(self, stem: str = "", *names: str):  # noqa: ANN201 - OutputDir | None
        """The run's output folder, checked and created now (see :func:`_output`)."""
        return _output(self.out, self.force, stem, *names)

    def show(self, report, sink) -> int:  # noqa: ANN001 - Report, OutputDir | None
        """The report written and printed (see :func:`_show`); the exit status."""
        return _show(report, sink, self.as_json)


@dataclass(frozen=True)
class Sweep(Group):
    """A sweep over a dump root: asked for, its local workers or its dask scheduler, resuming."""

    sweep: bool = option("--sweep", default=False, help="Run every recorded call as one task of a sweep, in "
                                                        "parallel (automatic when the dump root holds several "
                                                        "step*/rank* dumps).")
    workers: Optional[int] = option(min=1, max=1024, help="Sweep: local worker processes (default: the cores).")
    scheduler: Optional[str] = option("--scheduler", metavar="ADDR",
                                      help="Sweep on a dask.distributed cluster, e.g. tcp://HOST:8786 (default "
                                           "$BNPROBE_SCHEDULER; needs bnprobe[dist]); its workers read the dump "
                                           "files themselves.")
    resume: bool = option("--resume", default=False, help="Sweep: continue the interrupted sweep in --out, keeping "
                                                          "its finished calls.")

    @property
    def asked(self) -> bool:
        """Whether one of the sweep's options was given."""
        return self.sweep or self.resume or self.workers is not None or self.scheduler is not None


def _show(report, sink=None, as_json: bool = False) -> int:  # noqa: ANN001 - Report, OutputDir | None
    """Write the report's files (when there is an output folder), then print its JSON or its text; exit status 0
    when it passed, 1 when not."""
    from bnprobe.reports import write_result

    written = write_result(sink, report) if sink is not None else None
    _echo(report.lines(written) if not as_json else [dumps_json(report.doc)])
    return 0 if report.passed else 1


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


def _sweep_root(adapter: str, input: Optional[Path], sweep: Sweep) -> Optional[tuple[Path, Optional[str]]]:
    """(dump root, the runnable adapter or None for the recorded outputs) when this run is a sweep: asked for (one
    of the sweep's options given), or a dump root holding several step/rank dumps."""
    from bnprobe.sweep.command import find_root

    return find_root(adapter, input, sweep.asked)


def _check_sweep(as_json: bool, options: tuple[str, ...], root: str) -> None:
    """Options a sweep does not take: --json (its report is a folder) and those its recordings give."""
    from bnprobe.engine.recorded import refuse

    if as_json:
        raise BNProbeError("a sweep writes its report to a folder (--out; sweep.json in it): drop --json")
    refuse(options, root)


def _run_sweep(command: str, found: tuple[Path, Optional[str]], calls: Optional[str], report: Output, sweep: Sweep,
               **spec) -> int:
    """A check over every (step, rank, call) of a dump root, one task each (bnprobe.sweep.command), then its report."""
    from bnprobe._progress import Progress
    from bnprobe.reports.sweep import sweep_lines, write_sweep
    from bnprobe.sweep.command import SWEEP_FILES, SweepInterrupted, SweepRequest, execute, prepare

    plan = prepare(SweepRequest(command, *found, calls=calls, out=report.out, force=report.force,
                                workers=sweep.workers, scheduler=sweep.scheduler, resume=sweep.resume, options=spec))
    sink = _output(plan.out, report.force, f"{command}-sweep", *SWEEP_FILES)
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


# ---- commands ---------------------------------------------------------------------------------------

@_command("trace")
def trace(
    policy: Optional[str] = typer.Option(None, help="Preset (fp64, fp32, fp16, bf16, fp16-acc16, bf16-acc16) with "
                                                    "optional overrides, e.g. 'fp16:variance=naive,order=lanes' "
                                                    "(default fp16; for a recorded call, its format's preset)."),
    layer: Norm = Norm.use(),
    gen: Generated = Generated.use("shape", "seed", "mean", "std", "dist",
                                   shape="Input shape N,C[,L|H,W|D,H,W] for generated input (default 8,16,14,14; "
                                         "--norm layer or rms 4,128,768; group or instance 4,64,16,16)."),
    bn: Call = Call.use("mode", "eps", "momentum", "layout", "params",
                        mode="train (default; a recorded call's own), infer or backward.",
                        eps="The layer's epsilon (> 0; default 1e-5; a recording's own)."),
    src: Source = Source.use(input="Use this .npy/.npz tensor as x instead, or a dump DIR[#NAME] of one call (all "
                                   "its inputs and scalars).",
                             calls="The recorded call to trace (glob), when --input is a dump of several."),
    report: Output = Output.use("as_json"),
) -> None:
    """Run one BatchNorm layer (or with --norm a LayerNorm, RMSNorm, GroupNorm or InstanceNorm) and show every stage:
    range, error vs the FP64 golden, anomalies."""
    import numpy as np

    from bnprobe.engine.recorded import given, is_dump_path, one_call, refuse
    from bnprobe.checks.trace.stages import trace_run
    from bnprobe.inputs import Draw, input_tensor, make_params
    from bnprobe.kernels.layout import Layout, layout_of
    from bnprobe.kernels.policy import get_policy
    from bnprobe.reports.checks import trace_lines

    if layer.norm != "batch":
        return _trace_norm(policy, layer, gen, bn, src, report)
    input, mode, layout, params = src.input, bn.mode, bn.layout, bn.params
    if input is not None and is_dump_path(input):
        _, input, eps, momentum = _dump_scalars([], input, bn.eps, bn.momentum)
        one = one_call(input, src.calls, "trace", guard="trace")
        call, rec = one.calls.calls[0], one.calls.calls[0].load()
        refuse(given(shape=gen.shape, seed=gen.seed, mean=gen.mean, std=gen.std, dist=gen.dist, eps=eps,
                     momentum=momentum), str(input).partition("#")[0])
        if layout is not None and layout != rec.layout:
            raise BNProbeError(f"--layout {layout} contradicts the recording: {call.label} is {rec.layout}")
        cmp = trace_run(one, policy=policy, mode=mode, params=params)
        source = f"recorded call {call.label} of {str(input).partition('#')[0]} " + \
            ("(its γ, β, running statistics, dy)" if cmp.layer is None else "(its γ, β, dy)")
        lay = Layout(tuple(cmp.shape), rec.layout)
    else:
        if src.calls is not None:
            raise BNProbeError("--calls selects recorded calls: give a dump as --input DIR")
        d = Draw(gen.dist, gen.mean, gen.std, gen.seed).resolved()
        x = input_tensor("trace", input, gen.shape, d.dist, d.mean, d.std, d.seed)
        source = str(input) if input is not None else f"{d.dist}(mean={d.mean:g}, std={d.std:g}), seed {d.seed}"
        lay = layout_of(x, layout)
        _training_on_one_value(x.shape, lay.reduce_size, mode != "infer",
                               get_policy(policy or "fp16").unbiased_r1 != "error", "training",
                               "--mode infer traces its inference")
        prm = make_params(lay.channels, d.seed)
        dy = np.random.default_rng([d.seed, 2]).standard_normal(x.shape) if mode == "backward" else None
        call = BNCall(x, prm["gamma"], prm["beta"], np.full(lay.channels, d.mean),
                      np.full(lay.channels, max(d.std, 0.0) ** 2), dy, layout=lay.layout,
                      **_if_given(eps=bn.eps, momentum=bn.momentum))
        cmp = trace_run(call, policy=policy, mode=mode, params=params)
    _echo([dumps_json({**cmp.to_dict(), "input": source})] if report.as_json else trace_lines(cmp, source, lay))


def _family_shape(norm: str) -> str:
    """A family layer's generated input where no shape is given: compare-precision's first case of it (transformer
    hidden states for LayerNorm and RMSNorm, convolution activations for GroupNorm and InstanceNorm)."""
    from bnprobe.engine.cases import family_cases

    return ",".join(map(str, family_cases(norm)[0].shape))


def _family_call(command: str, layer: Norm, gen: Generated, input: Optional[Path], eps: Optional[float],
                 backward: bool) -> tuple[BNCall, str]:
    """A family layer's call on a generated input (the layer's own shape where none is given) or on --input: γ and β
    of its parameter shape as BatchNorm's commands draw them per channel (β none for RMSNorm), dy where ``backward``;
    and the input in words."""
    import math

    import numpy as np

    from bnprobe.inputs import Draw, input_tensor, make_params
    from bnprobe.kernels.layout import NormShape

    d = Draw(gen.dist, gen.mean, gen.std, gen.seed).resolved()
    x = input_tensor(command, input, None if input is not None else gen.shape or _family_shape(layer.norm), d.dist,
                     d.mean, d.std, d.seed)
    sh = NormShape.of(layer.norm, x.shape, layer.dims(), layer.groups)
    _family_rows(layer, x.shape)
    prm = make_params(math.prod(sh.param_shape), d.seed)
    dy = np.random.default_rng([d.seed, 2]).standard_normal(x.shape) if backward else None
    call = BNCall(x, prm["gamma"].reshape(sh.param_shape),
                  None if layer.norm == "rms" else prm["beta"].reshape(sh.param_shape), dy=dy, norm=layer.norm,
                  normalized_shape=layer.dims(), groups=layer.groups, **_if_given(eps=eps))
    return call, str(input) if input is not None else f"{d.dist}(mean={d.mean:g}, std={d.std:g}), seed {d.seed}"


def _refuse_running(layer: Norm, bn: Call) -> None:
    """BatchNorm's options of its running statistics and layout, refused for a family layer in one line."""
    from bnprobe.core.call import NORM_NAMES

    name = NORM_NAMES[layer.norm]
    if bn.momentum is not None:
        raise BNProbeError(f"--momentum applies to BatchNorm's running statistics: {name} keeps none")
    if bn.layout not in (None, "channels_first"):
        raise BNProbeError(f"--layout {bn.layout}: {name} takes x as it is laid out (channels_first); --layout is "
                           "BatchNorm's")


def _one_value_per_channel(x: Any) -> bool:
    """Whether the tensor ``x`` (channels_first) holds exactly one value per channel (R = N·H·W = 1); an empty or
    shapeless x is not (the command refuses it in its own words)."""
    return x.ndim >= 2 and x.size > 0 and x.size == x.shape[1]


def _training_on_one_value(shape: tuple[int, ...], reduce_size: int, training: bool, defined: bool, what: str,
                           instead: str) -> None:
    """Training (``training``: asked for, or the command's one mode) on one value per channel (``reduce_size``
    R = N·H·W = 1) refused before any work, in one line naming the cause and the option that runs ``instead`` —
    unless the kernel defines it there (``defined``: a policy whose unbiased running variance at R = 1 is 0 or NaN,
    as TensorFlow's)."""
    from bnprobe.core.kernel import one_value_per_channel

    if training and reduce_size == 1 and not defined:
        raise BNProbeError(one_value_per_channel(shape, what, instead))


def _family_rows(layer: Norm, shape: tuple[int, ...]) -> None:
    """A family layer's input whose rows of statistics hold one value each, refused in one line before any work (its
    statistics are of one value: no output a check could judge depends on x as the layer's does)."""
    from bnprobe.core.call import NORM_NAMES
    from bnprobe.core.kernel import one_value_per_row
    from bnprobe.kernels.layout import NormShape

    if NormShape.of(layer.norm, tuple(shape), layer.dims(), layer.groups).r < 2:
        raise BNProbeError(one_value_per_row(NORM_NAMES[layer.norm], shape))


def _trace_norm(policy: Optional[str], layer: Norm, gen: Generated, bn: Call, src: Source, report: Output) -> None:
    """trace --norm layer, rms, group or instance: the layer on a generated input or --input (a recorded call brings
    its own layer: trace --input DIR reads it without --norm)."""
    from bnprobe.checks.trace.stages import trace_run
    from bnprobe.engine.recorded import is_dump_path
    from bnprobe.reports.checks import trace_lines

    _refuse_running(layer, bn)
    if src.input is not None and is_dump_path(src.input) or src.calls is not None:
        raise BNProbeError(f"--norm {layer.norm} contradicts the dump: its call brings its own layer (trace --input "
                           "DIR traces it as recorded): drop --norm")
    call, source = _family_call("trace", layer, gen, src.input, bn.eps, bn.mode == "backward")
    cmp = trace_run(call, policy=policy, mode=bn.mode, params=bn.params)
    _echo([dumps_json({**cmp.to_dict(), "input": source})] if report.as_json else trace_lines(cmp, source))


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
    gen: Generated = Generated.use("seed", seed=dict(default=0, help="Seed of the random inputs.")),
    report: Output = Output.use(out="Write CSV, JSON and the error plot (PNG) to this folder."),
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
    sink = report.sink("", *math_files(stem))
    with Progress(spec.label()) as bar:
        result = analyze(spec, steps, domain="exhaustive" if exhaustive else "samples" if samples is not None
                         else "auto", samples=samples or (1 << 20), seed=gen.seed, progress=bar)
    written = write_math(result, sink, stem) if sink is not None else []
    _echo([dumps_json(result.to_dict())] if report.as_json else
          math_lines(result) + (["wrote " + ", ".join(str(t) for t in written)] if written else []))


@_command("adapters")
def adapters_cmd(report: Output = Output.use("as_json", as_json="Print JSON.")) -> None:
    """List every kernel adapter, whether it is available here, and if not, why."""
    from bnprobe._table import render_table
    from bnprobe.adapters.registry import list_adapters

    rows = list_adapters()
    if report.as_json:
        typer.echo(dumps_json(rows))
        return
    for r in rows:
        r["status"] = "yes" if r["available"] else f"no: {r['why']}"
    typer.echo(render_table(rows, ["name", "status", "description"], headers=["adapter", "available", "what"]))
    typer.echo("\noptions: emulated:<policy>, ascend-tbe:chip=910,cores=8, syncbn:ranks=2+14,merge=chan|sums|"
               "unweighted,reduce=fp16, dump:DIR[#CALL-GLOB]; plugins: package.module:Name or the 'bnprobe.adapters' "
               "entry-point group")


@_command("dump", order="adapter out dtype norm normalized_shape groups params shape seed mean std dist input modes "
                        "eps momentum layout force")
def dump_cmd(
    target: Kernel = Kernel.use("adapter", "dtype",
                                adapter=dict(default=..., help="Adapter to record, e.g. torch, ascend-tbe, "
                                                               "emulated:fp16."),
                                dtype=dict(help="Format to run in: fp64, fp32, fp16, bf16.", shown="fp16")),
    report: Output = Output.use("out", "force", out=dict(default=..., help="Folder to write bnprobe-dump.json and "
                                                                           "tensors.npz into."),
                                force="Overwrite an existing dump."),
    gen: Generated = Generated.use(shape=dict(help="Shape of generated input N,C[,...] (--norm layer or rms: "
                                                   "4,128,768; group or instance: 4,64,16,16).", shown="8,16,14,14"),
                                   seed=dict(default=0, help="Seed of the generated input, parameters and dy."),
                                   mean=dict(help="Mean of the generated input.", shown=0.0),
                                   std=dict(help="Standard deviation of the generated input.", shown=1.0),
                                   dist=dict(help="normal, uniform, student_t, constant.", shown="normal")),
    src: Source = Source.use("input", input="Use this .npy/.npz tensor as x."),
    modes: Optional[str] = typer.Option(None, help="Which calls to record.  [default: train,infer,backward; "
                                                   "--norm: train,backward]"),
    bn: Call = Call.use("params", "eps", "momentum", "layout",
                        params=dict(help="Parameter precision: fp32 (mixed precision) or same.", shown="fp32"),
                        eps=dict(help="The layer's epsilon.", shown=EPS),
                        momentum=dict(help="Running-stat momentum.", shown=MOMENTUM),
                        layout=dict(help="channels_first or channels_last.", shown="channels_first")),
    layer: Norm = Norm.use(),
) -> None:
    """Record an adapter's inputs and outputs as a bnprobe dump, to replay and compare anywhere. --norm layer, rms,
    group or instance: a call of that layer (its training forward and backward; it keeps no running statistics)."""
    import numpy as np

    from bnprobe.adapters import get_adapter
    from bnprobe.recordings import record, write_dump
    from bnprobe.inputs import Draw, input_tensor, make_params
    from bnprobe.kernels.layout import layout_of

    out, input = report.out, src.input
    report.sink("", "bnprobe-dump.json", "tensors.npz")
    if modes is None:  # (a family layer keeps no running statistics: its inference is its training forward)
        modes = "train,infer,backward" if layer.norm == "batch" else "train,backward"
    wanted = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in wanted if m not in ("train", "infer", "backward")]
    if bad or not wanted:
        raise BNProbeError(f"--modes takes train, infer, backward; got {modes!r}")
    a = get_adapter(target.adapter)
    d = Draw(gen.dist, gen.mean, gen.std, gen.seed).resolved()
    if layer.norm != "batch":
        _refuse_running(layer, bn)
        call, _ = _family_call("dump", layer, gen, input, bn.eps, backward=True)
        call = call.with_(dtype=target.dtype or "fp16", **_if_given(params=bn.params))
    else:
        x = input_tensor("dump", input, gen.shape, d.dist, d.mean, d.std, d.seed)
        lay = layout_of(x, bn.layout)
        _training_on_one_value(x.shape, lay.reduce_size, bool({"train", "backward"} & set(wanted)),
                               a.capabilities().training_r1, "recording training",
                               "--modes infer records its inference")
        prm = make_params(lay.channels, d.seed)
        dy = np.random.default_rng([d.seed, 2]).standard_normal(x.shape)
        # the call's format is dump's own default (fp16), not a BNCall's (fp32); its scalars not given are BNCall's
        call = BNCall(x=x, gamma=prm["gamma"], beta=prm["beta"], running_mean=np.full(lay.channels, d.mean),
                      running_var=np.full(lay.channels, d.std**2 if d.std > 0 else 1.0), dy=dy,
                      dtype=target.dtype or "fp16", layout=lay.layout,
                      **_if_given(eps=bn.eps, momentum=bn.momentum, params=bn.params))
    rec = record(a, call, modes=wanted,
                 meta={"seed": d.seed, "input": str(input) if input else f"{d.dist}(mean={d.mean}, std={d.std})"})
    files = write_dump(rec, out, force=report.force)
    typer.echo(f"recorded {a.name} ({', '.join(rec.modes)}) in {rec.dtype}: " + ", ".join(str(f) for f in files))
    for note in [*rec.meta.get("notes", []), *([rec.meta["params_note"]] if "params_note" in rec.meta else [])]:
        typer.echo(f"note: {note}")
    typer.echo(f"replay it as an adapter: --adapter dump:{out}")


@_command("gradcheck", order="adapter dtype norm normalized_shape groups shape mode seed dist mean std formula rtol "
                             "atol eps params input calls convention out force as_json")
def gradcheck_cmd(
    target: Kernel = Kernel.use("adapter", "dtype",
                                adapter=dict(default="emulated", help="Adapter whose backward is checked, or "
                                                                      "dump:DIR[#NAME] (every recorded call, each on "
                                                                      "its own inputs)."),
                                dtype="Format: fp16 (default), bf16, fp32 or fp64; a recording's own."),
    gen: Generated = Generated.use(shape="Input shape N,C[,...] of generated inputs (default 4,3,5,5; --norm layer "
                                         "or rms 4,6,16; group or instance 2,8,4,4)."),
    bn: Call = Call.use("mode", "eps", "params", "convention",
                        mode=dict(help="train (default) or infer; a recording's own.", check=False),
                        eps="The layer's epsilon (> 0; default 1e-5; a recording's own)."),
    formula: Optional[str] = typer.Option(None, help="Check a backward formula instead: standard, seed, ascend "
                                                     "or module:function (f(dy, x, gamma, mean, var, eps) -> dx)."),
    rtol: Optional[float] = typer.Option(None, help="Relative tolerance (give with --atol)."),
    atol: Optional[float] = typer.Option(None, help="Absolute tolerance (give with --rtol)."),
    src: Source = Source.use(input="A dump folder (bnprobe or msprobe): run the adapter on every recorded call's "
                                   "own inputs.", calls=dict(what="check")),
    report: Output = Output.use(),
    layer: Norm = Norm.use(),
) -> int:
    """Numerical vs analytic gradients (FP64 finite differences), the adapter's backward vs the FP64
    golden, the gradient identities, or a candidate backward formula; on a dump, every recorded call on
    its own inputs. --norm layer, rms, group or instance: the same for that layer, on generated inputs. Exit 1
    when a check fails."""
    from bnprobe.checks.gradcheck.gradients import check_formula, gradcheck
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.inputs import input_shape, make_input
    from bnprobe.reports.checks import gradcheck_report

    if layer.norm != "batch":
        return _gradcheck_norm(target, gen, bn, layer, src, report, formula=formula, tol=(rtol, atol))
    input, mode, params, as_json = src.input, bn.mode, bn.params, report.as_json
    if input is not None and not is_dump_path(input):
        raise BNProbeError(f"--input {input}: gradcheck takes a dump folder (bnprobe or msprobe) as --input")
    sink = report.sink()
    (adapter,), input, eps, _ = _dump_scalars([target.adapter], input, bn.eps)
    kernel = _in_convention(adapter, bn.convention)
    recorded = recording_of(kernel, input, src.calls, guard="gradcheck")
    if recorded is not None:
        if formula is not None:
            raise BNProbeError("--formula checks a formula on generated inputs: it contradicts the recording; drop "
                               "one of them")
        check_options(recorded, given=given(shape=gen.shape, eps=eps, seed=gen.seed, dist=gen.dist, mean=gen.mean,
                                            std=gen.std), dtype=target.dtype, params=params)
        return _show(gradcheck_report(gradcheck(recorded, mode=mode, rtol=rtol, atol=atol)), sink, as_json)
    shp = input_shape("gradcheck", gen.shape)
    if formula is not None:
        if off := given(params=params, dist=gen.dist, mean=gen.mean, std=gen.std):
            raise BNProbeError(f"--formula checks a formula in FP64 on its own inputs: {', '.join(off)} "
                               f"do{'es' if len(off) == 1 else ''} not apply; drop {'it' if len(off) == 1 else 'them'}")
        return _show(gradcheck_report(check_formula(formula, shp, seed=gen.seed, eps=eps, rtol=rtol, atol=atol)),
                     sink, as_json)
    x = None if (gen.dist, gen.mean, gen.std) == (None, None, None) else \
        make_input(shp, dist=gen.dist, mean=gen.mean, std=gen.std, seed=gen.seed)
    result = gradcheck(kernel, target.dtype, shp, mode=mode, seed=gen.seed, eps=eps, rtol=rtol, atol=atol,
                       params=params, x=x)
    return _show(gradcheck_report(result), sink, as_json)


def _gradcheck_norm(target: Kernel, gen: Generated, bn: Call, layer: Norm, src: Source, report: Output, *,
                    formula: Optional[str], tol: tuple[Optional[float], Optional[float]]) -> int:
    """gradcheck --norm layer, rms, group or instance: the layer on generated inputs (what applies to BatchNorm
    alone — a formula, a dump, the inference mode — refused in one line)."""
    from bnprobe.checks.gradcheck.family import FAMILY_SHAPES, Layer, gradcheck_norm
    from bnprobe.core.call import NORM_NAMES
    from bnprobe.inputs import input_shape, make_input
    from bnprobe.reports.checks import gradcheck_report

    name = NORM_NAMES[layer.norm]
    if formula is not None:
        raise BNProbeError(f"--formula checks a BatchNorm backward formula: drop it or --norm {layer.norm}")
    if src.input is not None or src.calls is not None:
        raise BNProbeError(f"--norm {layer.norm} checks generated inputs: {name} from a dump is not read yet; drop "
                           f"{'--input' if src.input is not None else '--calls'}")
    if bn.mode not in (None, "train"):
        raise BNProbeError(f"--mode {bn.mode}: {name} keeps no running statistics, so its backward is its training "
                           "forward's: drop --mode")
    sink = report.sink()
    shp = input_shape("gradcheck", gen.shape or ",".join(map(str, FAMILY_SHAPES[layer.norm])))
    x = None if (gen.dist, gen.mean, gen.std) == (None, None, None) else \
        make_input(shp, dist=gen.dist, mean=gen.mean, std=gen.std, seed=gen.seed)
    result = gradcheck_norm(_in_convention(target.adapter, bn.convention), Layer(layer.norm, layer.dims(),
                                                                                   layer.groups),
                            target.dtype, shp, seed=gen.seed, eps=bn.eps, params=bn.params, rtol=tol[0], atol=tol[1],
                            x=x)
    return _show(gradcheck_report(result), sink, report.as_json)


def _formats_and_dtypes(format: str, dtypes: Optional[str]) -> tuple[list, tuple[str, ...] | None]:
    """compare-precision's report formats and its --dtypes (None: each adapter's defaults), checked."""
    from bnprobe.reports.compare import report_formats

    try:
        fmts = report_formats(format)
    except BNProbeError as exc:
        raise BNProbeError(f"--format: {exc}") from None
    if not fmts:
        raise BNProbeError("--format is empty; valid: csv, json, md, html")
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


def _running_the_layer(norm: str, kernels: list, builtin: list[bool]) -> tuple[list, list[bool]]:
    """Of the built-in set, the kernels that run the layer ``norm`` (torch, the 16-bit ports: the Ascend emulators
    run BatchNorm only); the adapters named outright, all (one that cannot is refused by compare-precision)."""
    if norm == "batch":
        return kernels, builtin
    keep = [not b or norm in k.capabilities().norms for k, b in zip(kernels, builtin)]
    kernels = [k for k, ok in zip(kernels, keep) if ok]
    if not kernels:
        raise BNProbeError(f"no built-in kernel runs --norm {norm}: name the adapters (--adapters torch, emulated, "
                           "...)")
    return kernels, [b for b, ok in zip(builtin, keep) if ok]


@_command("compare-precision", order="adapter dtype norm normalized_shape groups shape shapes batch dist mean std "
                                     "input calls stress mode seed rule bench budget eps momentum params convention "
                                     "out format force sweep workers scheduler resume")
def compare_precision_cmd(
    target: Kernel = Kernel.use(
        "adapter", "dtype",
        adapter=dict(default="builtin", flags=("--adapters", "--adapter"),
                     help="Comma-separated adapters, e.g. emulated,ascend-tbe,torch, or dump:DIR (every BatchNorm "
                          "call of a bnprobe/msprobe dump); builtin: the Ascend emulators (ascend-tbe, ascend-bnv3, "
                          "ascend-950), the 16-bit-accumulator ports (emulated:fp16-acc16, emulated:bf16-acc16) and "
                          "torch where installed."),
        dtype=dict(flags=("--dtypes", "--dtype"), check=False,  # (checked as a list: "--dtypes is empty")
                   help="Comma-separated formats (default fp16,bf16,fp32; a recording's own format).")),
    gen: Generated = Generated.use(shape="One input shape N,C[,...] instead of the ResNet-50 set.",
                                   seed=dict(default=0, help="Seed of generated inputs.")),
    shapes: str = typer.Option("sample", help="Shape set when --shape is not given: sample (two ResNet-50 shapes) "
                                             "or resnet50 (every distinct one)."),
    batch: Optional[int] = typer.Option(None, min=1, max=65_536,
                                        help="Batch size of the ResNet-50 shapes (default 2)."),
    src: Source = Source.use(input="Real activations: .npy, .npz, or a dump folder (every recorded call's inputs).",
                             calls=dict(what="run")),
    stress: bool = typer.Option(True, "--stress/--no-stress", help="Add the stress inputs (large means, heavy "
                                                                   "tails, near FP16 max, var near eps, ...)."),
    bn: Call = Call.use("mode", "eps", "momentum", "params", "convention",
                        mode=dict(default="all", help="train, infer, backward or all.", check=False)),
    rule: str = typer.Option("benchmark", help="Kernel verdict: benchmark (msprobe's method: the kernel's error "
                                               "against the bench's, both against the FP64 golden), or an absolute "
                                               "rule: scaled, accumulated, threshold."),
    bench: str = typer.Option("careful", help="The bench of the benchmark rule: a careful kernel in the same "
                                              "formats (careful), or any runnable adapter, e.g. torch."),
    budget: bool = typer.Option(True, "--budget/--no-budget", help="Per-stage error budget (emulated kernels)."),
    report: Output = Output.use("out", "force", out="Report folder (default reports/compare-precision-<time>)."),
    format: str = typer.Option("csv,json,md,html", "--format", help="Report files to write."),
    sweep: Sweep = Sweep.use(),
    layer: Norm = Norm.use(),
) -> int:
    """FP16/BF16/FP32 vs the FP64 golden for every BatchNorm output, per tensor, per channel and per
    stage; on a dump, every recorded call on its own inputs. --norm layer, rms, group or instance: the same for
    that layer, on transformer- or convolution-shaped inputs. Exit 0 when all are within standard, 1 when
    some are not."""
    from bnprobe._progress import Progress
    from bnprobe.adapters import get_adapter
    from bnprobe.engine.cases import select_cases
    from bnprobe.inputs import Draw
    from bnprobe.checks.compare.precision import CallOptions, Judging, compare_precision
    from bnprobe.engine.recorded import given
    from bnprobe.reports.compare import report_files

    dtypes, mode, convention = target.dtype, bn.mode, bn.convention
    fmts, dts = _formats_and_dtypes(format, dtypes)
    names, builtin = _listed(target.adapter)
    if not names:
        raise BNProbeError("--adapters is empty")
    if (found := _sweep_root(names[0], src.input, sweep)) is not None:
        if len(names) > 1:
            raise BNProbeError("a sweep runs one adapter over the dump root (or its recorded outputs): give one")
        _check_sweep(False, given(dtypes=dtypes, shape=gen.shape, batch=batch, dist=gen.dist, mean=gen.mean,
                                  std=gen.std, eps=bn.eps, momentum=bn.momentum, params=bn.params), str(found[0]))
        return _run_sweep("compare-precision", found, src.calls, report, sweep, mode=mode, rule=rule, bench=bench,
                          budget=budget, convention=convention)
    names, input, eps, momentum = _dump_scalars(names, src.input, bn.eps, bn.momentum)
    kernels = [get_adapter(a) if convention is None else _in_convention(a, convention) for a in names]
    kernels, builtin = _running_the_layer(layer.norm, kernels, builtin)
    resolved, cases, recorded = select_cases(kernels, input=input, calls=src.calls, shape=gen.shape, shapes=shapes,
                                             batch=batch, values=Draw(gen.dist, gen.mean, gen.std, gen.seed),
                                             mode=mode, stress=stress, norm=layer.norm)
    resolved = _builtin_for(resolved, builtin, dts, recorded)
    sink = report.sink("compare-precision", *report_files(fmts)) if fmts else None
    with Progress("compare-precision") as bar:
        result = compare_precision(resolved, dts, cases, mode=mode, seed=gen.seed, budget=budget, progress=bar,
                                   options=CallOptions(eps=eps, momentum=momentum, params=bn.params,
                                                       norm=layer.norm, normalized_shape=layer.dims(),
                                                       groups=layer.groups),
                                   judging=Judging(rule=rule, bench=bench))
    what = f"{len(cases)} recorded call(s) of {recorded.source}" if recorded is not None else f"{len(cases)} inputs"
    _compare_report(result, sink, fmts, what, recorded)
    return 0 if result.passed else 1


def _compare_report(result: Any, sink: Any, fmts: tuple[str, ...], what: str, recorded: Any) -> None:
    """compare-precision's report files (into ``sink``, when given) and terminal text, from one summary."""
    from bnprobe.checks.compare.precision import summarize
    from bnprobe.guard import release_free_memory
    from bnprobe.reports.compare import compare_lines, write_report

    release_free_memory()  # (the run's freed arrays are not counted again in the report's peak)
    summary = summarize(result)  # (the report's files and the terminal's table: made once)
    paths = write_report(result, sink, fmts, summary=summary) if sink is not None else []
    _echo(compare_lines(result, what, recorded.notes if recorded is not None else (), recorded is not None,
                        summary=summary))
    if paths:
        typer.echo(f"report: {sink.path}/ ({', '.join(p.name for p in paths)})")


@_command("overflow")
def overflow_cmd(
    target: Kernel = Kernel.use(adapter=dict(default="emulated", help="Adapter to scan (a traced one shows every "
                                                                      "stage), or dump:DIR[#NAME] (every recorded "
                                                                      "call's outputs vs the golden)."),
                                dtype="Format: fp16 (default), bf16, fp32; a recording's own."),
    src: Source = Source.use(input="Input tensor .npy/.npz, or a dump folder (the adapter on every recorded call's "
                                   "own inputs).", calls=dict(what="scan")),
    gen: Generated = Generated.use("shape", "dist", "mean", "std", "seed"),
    bn: Call = Call.use("mode", "eps", "params", "convention",
                        mode="train (default), infer or backward; on a recording: every mode each call recorded "
                             "unless given."),
    dy: Optional[str] = typer.Option(None, "--dy", help="Upstream gradient of the generated backward: shifted "
                                     "(default: N(0, 1) plus a mean per channel, as real losses give, so Σdy grows "
                                     "with R), normal, heavy (Student t, 2 d.o.f., shifted)."),
    report: Output = Output.use(),
    sweep: Sweep = Sweep.use(),
    layer: Norm = Norm.use(),
) -> int:
    """Where, in which channel and why a BatchNorm goes non-finite or silently wrong; headroom predicted
    from the input; remedies verified; on a dump, every recorded call's outputs against the golden (an
    msprobe statistics dump: its summaries). --norm layer, rms, group or instance: the same for that layer, row
    by row of its statistics (a token, a sample's group or channel). Exit 0 when clean, 1 when anomalies are
    found."""
    from bnprobe.engine.cases import DY_KINDS
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.engine.recorded import check_options, given, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import overflow_report

    input, mode, params, as_json = src.input, bn.mode, bn.params, report.as_json
    if dy is not None and dy not in DY_KINDS:
        raise BNProbeError(f"--dy {dy!r}: valid kinds are {', '.join(DY_KINDS)}")
    if layer.norm != "batch":
        return _overflow_layer(layer, target, src, gen, bn, report, dy=dy, sweep=sweep.asked)
    if (found := _sweep_root(target.adapter, input, sweep)) is not None:
        _check_sweep(as_json, given(dtype=target.dtype, accumulate=target.accumulate, shape=gen.shape, dist=gen.dist,
                                    mean=gen.mean, std=gen.std, seed=gen.seed, eps=bn.eps, params=params, dy=dy),
                     str(found[0]))
        return _run_sweep("overflow", found, src.calls, report, sweep, mode=mode, convention=bn.convention)
    sink = report.sink()
    (adapter,), input, eps, _ = _dump_scalars([target.adapter], input, bn.eps)
    kernel = _in_convention(adapter, bn.convention)
    recorded = recording_of(kernel, input, src.calls, guard="overflow")
    if recorded is not None:
        check_options(recorded, given=given(shape=gen.shape, dist=gen.dist, mean=gen.mean, std=gen.std, seed=gen.seed,
                                            eps=eps, accumulate=target.accumulate, dy=dy), dtype=target.dtype,
                      mode=mode, params=params)
        return _show(overflow_report(scan(recorded, mode=mode)), sink, as_json)
    x = input_tensor("overflow", input, gen.shape, gen.dist, gen.mean, gen.std, gen.seed)
    if _one_value_per_channel(x):
        from bnprobe.adapters.registry import as_adapter

        kernel = as_adapter(kernel)
        caps = kernel.capabilities()
        _training_on_one_value(x.shape, 1, mode in ("train", "backward") or mode is None and
                               "train" in caps.modes, caps.training_r1, "training", "--mode infer scans its inference")
    rep = scan(kernel, BNCall(x, **_if_given(eps=eps)), dtype=target.dtype, accumulate=target.accumulate, mode=mode,
               seed=gen.seed, params=params, dy=dy)
    return _show(overflow_report(rep), sink, as_json)


#: the generated input of overflow --norm and shrink --norm when no --shape is given: transformer hidden states
#: (batch, tokens, hidden) for LayerNorm and RMSNorm, convolution activations (N, C, H, W) for the others
FAMILY_INPUT = {"layer": "2,16,1024", "rms": "2,16,1024", "group": "2,32,8,8", "instance": "2,32,8,8"}


def _overflow_layer(layer: Norm, target: Kernel, src: Source, gen: Generated, bn: Call, report: Output, *,
                    dy: Optional[str], sweep: bool) -> int:
    """overflow --norm layer|rms|group|instance on a kernel and generated input or --input x (a dump's calls
    bring their own layer: --norm does not apply to them)."""
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.core.call import NORM_NAMES
    from bnprobe.engine.recorded import is_dump_path
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import overflow_report

    name = NORM_NAMES[layer.norm]
    if sweep or src.calls is not None or target.adapter.startswith("dump:") or \
            (src.input is not None and is_dump_path(src.input)):
        raise BNProbeError(f"--norm {layer.norm} scans a kernel on generated input or --input x.npy: a dump's calls "
                           f"bring their own layer ({name} among them); drop --norm")
    if bn.convention is not None:
        raise BNProbeError(f"--convention is BatchNorm's running variance: {name} keeps no running statistics; drop "
                           "it")
    sink = report.sink()
    x = input_tensor("overflow", src.input, gen.shape or (None if src.input is not None else FAMILY_INPUT[layer.norm]),
                     gen.dist, gen.mean, gen.std, gen.seed)
    _family_rows(layer, x.shape)
    call = BNCall(x, **_if_given(eps=bn.eps), norm=layer.norm, normalized_shape=layer.dims(), groups=layer.groups)
    rep = scan(target.adapter, call, dtype=target.dtype, accumulate=target.accumulate, mode=bn.mode, seed=gen.seed,
               params=bn.params, dy=dy)
    return _show(overflow_report(rep), sink, report.as_json)


@_command("fold", order="layer weights folded dtype accumulate eps groups seed onnx fused fuse out force as_json")
def fold_cmd(
    layer: str = typer.Option("conv2d", help="Built-in layer before the BatchNorm: conv2d or linear."),
    weights: Optional[Path] = typer.Option(None, help=".npz with weight, gamma, beta, running_mean, running_var "
                                                      "(optional bias, eps, groups, padding, x)."),
    folded: Optional[Path] = typer.Option(None, "--folded", help="Your folded layer, an .npz with weight (W'), bias "
                                                                 "(b') and optional eps: judged against the FP64 fold "
                                                                 "of --weights (needs --weights)."),
    target: Kernel = Kernel.use("dtype", "accumulate",
                                dtype="Format: fp16, bf16, fp32, fp64 (default fp16; with --folded, the file's).",
                                accumulate="Accumulator of the layer's dot products (default fp32)."),
    bn: Call = Call.use("eps", eps=dict(help="BatchNorm epsilon (default: the layer's, 1e-5).", check=False)),
    groups: int = typer.Option(1, help="Groups of the built-in conv2d (its 16 input channels must divide)."),
    gen: Generated = Generated.use("seed", seed=dict(default=0, help="Seed of the built-in layer.")),
    onnx: Optional[Path] = typer.Option(None, "--onnx", help="An ONNX model: every Conv/ConvTranspose/Gemm/MatMul -> "
                                                             "BatchNormalization pair folded in --dtype (a list: "
                                                             "fp16,bf16) and judged (needs bnprobe[onnx])."),
    fused: Optional[Path] = typer.Option(None, "--fused", help="With --onnx: the fused model a runtime or converter "
                                                               "made of it, each fused layer judged against the FP64 "
                                                               "fold, and in fp16."),
    fuse: Optional[str] = typer.Option(None, "--fuse", help="With --onnx: fuse it with onnxruntime's graph optimizer "
                                                            "(ort: extended level; ort-basic, ort-all), judge that."),
    report: Output = Output.use(),
) -> int:
    """Check BatchNorm folding into a Conv2D/Linear (and fused forms) per output channel in a format, with
    --folded your own folded weights, or with --onnx every pair of an ONNX model (and --fused / --fuse ort its
    fused model). Exit 1 when a channel's folded result breaks the standard."""
    from bnprobe.checks.fold.layer import check_fold, load_layer, make_layer
    from bnprobe.reports.checks import fold_report

    dtype, accumulate, eps, seed = target.dtype, target.accumulate, bn.eps, gen.seed
    if onnx is not None or fused is not None or fuse is not None:
        given = {"--weights": weights is not None, "--folded": folded is not None, "--eps": eps is not None,
                 "--groups": groups != 1, "--seed": seed != 0, "--layer": layer != "conv2d"}
        return _fold_onnx(onnx, fused, fuse, target, [k for k, v in given.items() if v], report)
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
        sink = report.sink()
        lay = load_layer(weights)
        return report.show(fold_report(check_folded(lay, load_folded(folded, lay), eps=eps)), sink)
    sink = report.sink()
    lay = load_layer(weights) if weights is not None else make_layer(layer, seed=seed, groups=groups)
    return report.show(fold_report(check_fold(lay, dtype, accumulate=accumulate, eps=eps, against_torch=True)), sink)


def _fold_onnx(onnx: Optional[Path], fused: Optional[Path], fuse: Optional[str], target: Kernel,
               conflicting: list[str], report: Output) -> int:
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

    dtypes = None if target.dtype is None else [d.strip() for d in target.dtype.split(",")]
    sink = report.sink()
    rep = check_onnx(onnx, dtypes, fused=fused, fuse=fuse, accumulate=target.accumulate)
    out = fold_onnx_report(rep)
    if sink is not None:
        out.pages[f"{out.stem}.html"] = fold_onnx_html(rep, out)
    return report.show(out, sink)


@_command("doctor", order="adapter dtype norm normalized_shape groups params seed eps momentum shape dist mean std "
                          "stability recipe input calls convention out force as_json sweep workers scheduler resume")
def doctor_cmd(
    target: Kernel = Kernel.use("adapter", "dtype",
                                adapter=dict(default="reference", help="Adapter to diagnose, or dump:DIR[#NAME] "
                                                                       "(every recorded call on its own inputs); "
                                                                       "with --norm, a kernel that runs the layer "
                                                                       "(e.g. torch)."),
                                dtype="Format (default: fp64 if the adapter runs it, else its first; with --norm, "
                                      "the first of fp16, bf16, fp32 it runs; a recording's own)."),
    bn: Call = Call.use("params", "eps", "momentum", "convention"),
    gen: Generated = Generated.use(seed="Seed of the diagnostic inputs (default 0).",
                                   shape="Shape N,C[,...] of one more input, generated from --dist, --mean, --std and "
                                         "--seed and checked like --input (default 8,4,4,4 when only those are "
                                         "given); the designed inputs keep their shapes."),
    stability: Optional[bool] = typer.Option(None, "--stability/--no-stability",
                                             help="Include the stress inputs (default on; a replayed dump cannot "
                                                  "run them)."),
    recipe: bool = typer.Option(False, "--recipe", help="When something fails, also identify the kernel's recipe "
                                                        "and name its choices known to lose accuracy (a few seconds "
                                                        "more; up to a minute for a kernel outside the space)."),
    src: Source = Source.use(input="Your input too: a tensor .npy/.npz (x), or a dump folder (the adapter on every "
                                   "recorded call's own inputs).", calls=dict(what="diagnose")),
    report: Output = Output.use(),
    sweep: Sweep = Sweep.use(),
    layer: Norm = Norm.use(),
) -> int:
    """The expert's checklist for a BatchNorm kernel on a diagnostic input, stress inputs and yours:
    PASS/WARN/FAIL with evidence, the known bug each failure matches, and what is wrong where none
    does; on a dump, every recorded call's outputs on its own inputs. --eps and --momentum are the
    layer's, used on every input (a kernel that ignores them fails); --shape, --dist, --mean, --std
    make one more input, "generated". --norm layer, rms, group or instance: the same for that layer,
    each output judged by compare-precision's judge, each failure named by the public defect whose
    emulation reproduces it. Exit 0 when healthy, 1 when something failed."""
    from bnprobe.checks.doctor.diagnosis import doctor
    from bnprobe.checks.doctor.inputs import GENERATED, USER
    from bnprobe.core.kernel import inference_alone
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import doctor_report

    if layer.norm != "batch":
        return _doctor_layer(layer, target, bn, gen, src, report, stability, recipe or sweep.asked)
    adapter, input, calls, dtype, params, as_json = \
        target.adapter, src.input, src.calls, target.dtype, bn.params, report.as_json
    generating = given(shape=gen.shape, dist=gen.dist, mean=gen.mean, std=gen.std)
    if recipe and (input is not None and is_dump_path(input) or adapter.startswith("dump:")):
        raise BNProbeError("--recipe identifies a kernel on designed probes: for a recording run "
                           "`bnprobe identify --adapter dump:DIR` (each call on its own inputs)")
    if (found := _sweep_root(adapter, input, sweep)) is not None:
        _check_sweep(as_json, given(dtype=dtype, params=params, seed=gen.seed, stability=stability, eps=bn.eps,
                                    momentum=bn.momentum) + generating, str(found[0]))
        return _run_sweep("doctor", found, calls, report, sweep, convention=bn.convention)
    tensor = input if input is not None and not is_dump_path(input) else None
    sink = report.sink()
    (adapter,), input, eps, momentum = _dump_scalars([adapter], input, bn.eps, bn.momentum)
    kernel = _in_convention(adapter, bn.convention)
    recorded = recording_of(kernel, None if tensor is not None else input, calls, guard="doctor")
    if recorded is not None:
        refused = dict(seed=gen.seed, stability=None if stability is None or not recorded.replay else True, eps=eps,
                       momentum=momentum)
        check_options(recorded, given=given(**refused) + generating, dtype=dtype, params=params)
        run = doctor(recorded, dtype, params=params, stability=stability is not False)
        return _show(doctor_report(run), sink, as_json)
    if calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    if tensor is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input {input}; "
                           "drop one")
    made = input_tensor("doctor", None, gen.shape, gen.dist, gen.mean, gen.std, gen.seed) if generating else None
    x = None if tensor is None else input_tensor("doctor", tensor)
    rep = doctor(kernel, dtype, seed=gen.seed, stability=stability is not False, params=params, x=x, eps=eps,
                 generated=made, recipe=recipe, **_if_given(momentum=momentum))
    # an input of one value per channel is judged in inference alone (training is undefined there): said
    ones = [n for n, t in ((USER, x), (GENERATED, made)) if t is not None and _one_value_per_channel(t)]
    if ones:
        rep.notes.append(inference_alone(ones))
    left = f"training forward and backward not judged on {', '.join(ones)} (R = N·H·W = 1 value per channel)"
    return _show(doctor_report(rep, left_out=left if ones else ""), sink, as_json)


def _doctor_layer(layer: Norm, target: Kernel, bn: Call, gen: Generated, src: Source, report: Output,
                  stability: Optional[bool], refused: bool) -> int:
    """doctor --norm layer|rms|group|instance on the kernel (``refused``: --recipe or a sweep was asked for)."""
    from bnprobe.checks.compare.precision import CallOptions
    from bnprobe.checks.doctor.family import doctor_family
    from bnprobe.engine.recorded import given, is_dump_path
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.checks import doctor_report

    from bnprobe.core.call import NORM_NAMES

    name = NORM_NAMES[layer.norm]
    running = given(momentum=bn.momentum, convention=bn.convention)
    if running:
        raise BNProbeError(f"{', '.join(running)} appl{'ies' if len(running) == 1 else 'y'} to BatchNorm's running "
                           f"statistics: {name} keeps none")
    if refused:
        raise BNProbeError(f"--recipe and the sweep's options are BatchNorm's: doctor --norm {layer.norm} takes none")
    if src.calls is not None or src.input is not None and is_dump_path(src.input) or target.adapter.startswith("dump:"):
        raise BNProbeError(f"a dump's {name} calls are not read yet: doctor --norm {layer.norm} runs a kernel on its "
                           "designed inputs (and on --input, a tensor .npy/.npz)")
    generating = given(shape=gen.shape, dist=gen.dist, mean=gen.mean, std=gen.std)
    if src.input is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input "
                           f"{src.input}; drop one")
    sink = report.sink()
    made = input_tensor("doctor", None, gen.shape, gen.dist, gen.mean, gen.std, gen.seed) if generating else None
    x = None if src.input is None else input_tensor("doctor", src.input)
    for t in (x, made):
        if t is not None:
            _family_rows(layer, t.shape)
    rep = doctor_family(target.adapter, target.dtype, seed=gen.seed, stability=stability is not False, x=x,
                        generated=made,
                        options=CallOptions(eps=bn.eps, params=bn.params, norm=layer.norm,
                                            normalized_shape=layer.dims(), groups=layer.groups))
    return _show(doctor_report(rep), sink, report.as_json)


@_command("identify", order="adapter dtype norm groups params input shape normalized_shape dist mean std seed eps "
                            "momentum calls out force as_json")
def identify_cmd(
    target: Kernel = Kernel.use("adapter", "dtype",
                                adapter=dict(default="torch", help="The black-box kernel: an adapter (torch, "
                                                                   "ascend-bnv3, a plugin pkg.mod:Name...) or "
                                                                   "dump:DIR[#NAME] (every recorded call, each on its "
                                                                   "own inputs)."),
                                dtype="Format: fp16 (default), bf16, fp32 or fp64; a recording's own."),
    bn: Call = Call.use("params", "eps", "momentum"),
    src: Source = Source.use(input="Your input x (.npy/.npz), to confirm the recipe on too, or a dump folder (the "
                                   "adapter on every recorded call's own inputs).", calls=dict(what="identify")),
    gen: Generated = Generated.use(shape="Shape N,C[,...] of one more input to confirm the recipe on, generated "
                                         "from --dist, --mean, --std and --seed."),
    report: Output = Output.use(),
    layer: Norm = Norm.use(),
) -> int:
    """How a black-box kernel computes: the policy (emulated:<spec>) that reproduces its every output bit for bit,
    searched stage by stage on designed probes and confirmed on fresh inputs; the fields the probes could not tell
    apart, and where no policy reproduces it, the closest and the stage where it departs. --norm layer, rms or
    group: the same for that layer's kernel. Exit 0 when every output it returns is reproduced bit for bit, 1 when
    not."""
    from bnprobe._progress import Progress
    from bnprobe.checks.identify.search import identify
    from bnprobe.engine.recorded import check_options, given, is_dump_path, recording_of
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.identify import identify_report

    adapter, input, calls, shape, as_json = target.adapter, src.input, src.calls, gen.shape, report.as_json
    if bn.momentum is not None:
        from bnprobe.kernels.layout import check_momentum

        check_momentum(bn.momentum)
    generating = given(shape=shape, dist=gen.dist, mean=gen.mean, std=gen.std)
    tensor = input if input is not None and not is_dump_path(input) else None
    if tensor is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input {input}; "
                           "drop one")
    if generating and shape is None:
        raise BNProbeError(f"{', '.join(generating)} describe a generated input: give its --shape too")
    if tensor is not None and adapter.startswith("dump:"):
        raise BNProbeError(f"--input and the dump adapter {adapter} both give the inputs: a dump runs on its own "
                           "recorded inputs; drop --input")
    sink = report.sink()
    if layer.norm != "batch":
        return _show(identify_report(_identify_layer(layer, target, bn, src, gen)), sink, as_json)
    if layer.normalized_shape is not None:
        raise BNProbeError("--normalized-shape applies to --norm layer and rms")
    (adapter,), input, eps, momentum = _dump_scalars([adapter], input, bn.eps, bn.momentum)
    progress = Progress("identify")
    recorded = recording_of(adapter, None if tensor is not None else input, calls, guard="identify")
    if recorded is not None:
        check_options(recorded, given=given(shape=shape, dist=gen.dist, mean=gen.mean, std=gen.std, seed=gen.seed,
                                            eps=eps, momentum=momentum), dtype=target.dtype, params=bn.params)
        return _show(identify_report(identify(recorded, progress=progress)), sink, as_json)
    if calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    x = None
    if tensor is not None or shape is not None:
        x = input_tensor("identify", tensor, shape, gen.dist, gen.mean, gen.std, gen.seed)
    res = identify(adapter, target.dtype, params=bn.params, x=x, seed=gen.seed, eps=eps, progress=progress,
                   **_if_given(momentum=momentum))
    return _show(identify_report(res), sink, as_json)


def _identify_layer(layer: Norm, target: Kernel, bn: Call, src: Source, gen: Generated) -> Any:
    """identify --norm layer|rms|group: the family's search on a runnable kernel (its own probes; --input or --shape
    one more input to confirm on, normalised as --normalized-shape says)."""
    import numpy as np

    from bnprobe._progress import Progress
    from bnprobe.checks.identify.family import identify_family
    from bnprobe.core.call import NORM_NAMES, BNCall
    from bnprobe.engine.recorded import given, is_dump_path
    from bnprobe.inputs import input_tensor

    name = NORM_NAMES[layer.norm]
    if target.adapter.startswith("dump:") or (src.input is not None and is_dump_path(src.input)):
        raise BNProbeError(f"identify --norm {layer.norm} searches a runnable kernel on its own probes: a dump's "
                           f"{name} calls are not searched (give --adapter torch, a plugin...)")
    if src.calls is not None:
        raise BNProbeError("--calls selects recorded calls: give a dump (--adapter dump:DIR or --input DIR)")
    if bn.momentum is not None:
        raise BNProbeError(f"--momentum applies to BatchNorm's running statistics: {name} has none")
    generating = given(shape=gen.shape, dist=gen.dist, mean=gen.mean, std=gen.std)
    if src.input is not None and generating:
        raise BNProbeError(f"{', '.join(generating)} make an input of their own: they do not apply to --input "
                           f"{src.input}; drop one")
    if generating and gen.shape is None:
        raise BNProbeError(f"{', '.join(generating)} describe a generated input: give its --shape too")
    extra = []
    if src.input is not None or gen.shape is not None:
        from bnprobe.kernels.layout import NormShape

        x = input_tensor("identify", src.input, gen.shape, gen.dist, gen.mean, gen.std, gen.seed)
        sh = NormShape.of(layer.norm, x.shape, layer.dims(), layer.groups)
        _family_rows(layer, x.shape)
        rng = np.random.default_rng([gen.seed or 0, 5])
        extra.append(BNCall(x, gamma=rng.uniform(0.3, 3.0, sh.param_shape),
                            beta=None if layer.norm == "rms" else rng.normal(0.0, 1.0, sh.param_shape),
                            dy=rng.standard_normal(x.shape), eps=bn.eps if bn.eps is not None else 1e-5,
                            dtype=target.dtype or "fp16", params=bn.params or "fp32", norm=layer.norm,
                            normalized_shape=layer.dims(), groups=layer.groups))
    elif layer.normalized_shape is not None:
        raise BNProbeError("--normalized-shape says how your input (--input or --shape) is normalised: give one "
                           "(identify's own probes choose their rows)")
    return identify_family(target.adapter, layer.norm, target.dtype, params=bn.params, seed=gen.seed or 0,
                           eps=bn.eps, groups=layer.groups, extra=extra, progress=Progress("identify"))


@_command("shrink", order="adapter dtype norm normalized_shape groups params mode predicate input calls shape dist "
                          "mean std seed seconds convention out force")
def shrink_cmd(
    target: Kernel = Kernel.use("adapter", "dtype",
                                adapter=dict(default=..., help="Adapter whose comparison with the FP64 reference "
                                                               "fails (a runnable one: a dump cannot be rerun on "
                                                               "smaller inputs)."),
                                dtype="Format (default fp16; a recording's own)."),
    bn: Call = Call.use("params", "mode", "convention"),
    predicate: str = typer.Option("compare", help="compare (vs the reference), overflow, or module:function "
                                                  "(f(x) -> True when the case fails)."),
    src: Source = Source.use(input="The failing input .npy/.npz, or a dump folder DIR[#NAME] of one call (its x, γ, "
                                   "β, eps, ...).",
                             calls="The recorded call to shrink (glob), when --input is a dump of several."),
    gen: Generated = Generated.use("shape", "dist", "mean", "std", "seed",
                                   shape="Shape of generated input (default 16,64,28,28)."),
    seconds: float = typer.Option(120.0, help="Time budget in seconds (> 0)."),
    report: Output = Output.use("out", "force", out="Folder for x.npy, the dump and shrink.json (default "
                                                    "reports/shrink-<time>)."),
    layer: Norm = Norm.use(),
) -> int:
    """Reduce a failing case (channels, batch, spatial size, then values) to a minimal one that still
    fails; write it as a dump plus the exact command that replays it. --norm layer, rms, group or instance: that
    layer's input, in its (rows, R) view (fewer rows, a shorter R, then values)."""
    from bnprobe._progress import Progress
    from bnprobe.engine.recorded import given, recording_of
    from bnprobe.checks.shrink.shrinking import generated_case, predicate_for, recorded_case, runnable, shrink
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.shrink import shrink_lines, write_shrink

    adapter, dtype, mode, params, convention = target.adapter, target.dtype, bn.mode, bn.params, bn.convention
    if not 0 < seconds <= 86400:
        raise BNProbeError(f"--seconds must be > 0 and at most 86400 (a day), got {seconds}")
    if layer.norm != "batch":
        return _shrink_layer(layer, target, bn, predicate, src, gen, seconds, report)
    sink = report.sink("shrink", "x.npy", "shrink.json")
    a = runnable(_in_convention(adapter, convention))
    recorded = recording_of(a, src.input, src.calls, guard="shrink")
    kept = None
    if recorded is not None:
        x, kept, dtype, mode, notes = recorded_case(recorded, given=given(shape=gen.shape, dist=gen.dist,
                                                                          mean=gen.mean, std=gen.std, seed=gen.seed),
                                                    dtype=dtype, mode=mode, params=params)
        params = kept.params
    else:
        x = input_tensor("shrink", src.input, gen.shape, gen.dist, gen.mean, gen.std, gen.seed)
        dtype, mode, params, notes = generated_case(dtype, mode, params, kernel=a)
    if _one_value_per_channel(x):  # (a training case of one value per channel never fails its predicate)
        _training_on_one_value(x.shape, 1, mode != "infer", False, "shrinking a training failure",
                               "--mode infer shrinks an inference failure")
    fails = predicate_for(predicate, a, dtype=dtype, mode=mode, recorded=kept, params=params)
    with Progress("shrink") as bar:
        res = shrink(x, fails, seconds=seconds, progress=bar.steps(20))
    res.notes[:0] = notes
    files, cmd = write_shrink(res, sink, adapter=adapter, dtype=dtype, mode=mode, predicate=predicate,
                              recorded=kept, params=params, convention=convention)
    _echo(shrink_lines(res, files, cmd, dtype, kept))
    return 0


def _shrink_layer(layer: Norm, target: Kernel, bn: Call, predicate: str, src: Source, gen: Generated,
                  seconds: float, report: Output) -> int:
    """shrink --norm layer|rms|group|instance: a failing input of that layer (--input x.npy or generated) shrunk in
    its (rows, R) view; x.npy, shrink.json and the replay command written."""
    from bnprobe._progress import Progress
    from bnprobe.checks.shrink.shrinking import FamilyLayer, generated_case, predicate_for, runnable, shrink
    from bnprobe.core.call import NORM_NAMES
    from bnprobe.engine.recorded import is_dump_path
    from bnprobe.inputs import input_tensor
    from bnprobe.reports.shrink import shrink_lines, write_shrink

    name = NORM_NAMES[layer.norm]
    if src.calls is not None or (src.input is not None and is_dump_path(src.input)):
        raise BNProbeError(f"--norm {layer.norm} shrinks an input tensor (--input x.npy, or generated): a dump's "
                           f"calls bring their own layer; drop --norm")
    if bn.convention is not None:
        raise BNProbeError(f"--convention is BatchNorm's running variance: {name} keeps no running statistics; drop "
                           "it")
    a = runnable(target.adapter)
    dtype, mode, params, notes = generated_case(target.dtype, bn.mode, bn.params, kernel=a)
    x = input_tensor("shrink", src.input, gen.shape or (None if src.input is not None else FAMILY_INPUT[layer.norm]),
                     gen.dist, gen.mean, gen.std, gen.seed)
    fam = FamilyLayer.of(layer.norm, tuple(x.shape), layer.dims(), layer.groups)
    _family_rows(layer, x.shape)
    fails = predicate_for(predicate, a, dtype=dtype, mode=mode, recorded=None, params=params, layer=fam)
    sink = report.sink("shrink", "x.npy", "shrink.json")
    with Progress("shrink") as bar:
        res = shrink(x, fails, seconds=seconds, progress=bar.steps(20), layer=fam)
    res.notes[:0] = notes
    files, cmd = write_shrink(res, sink, adapter=target.adapter, dtype=dtype, mode=mode, predicate=predicate,
                              params=params, layer=fam)
    _echo(shrink_lines(res, files, cmd, dtype, None))
    return 0


@_command("plot-stats", order="simulate steps policies seed log dumps monitor channels eps out format force")
def plot_stats_cmd(
    simulate: bool = typer.Option(False, "--simulate", help="Record a built-in training run (the default when no "
                                                           "--log or --dumps is given)."),
    steps: int = typer.Option(200, min=1, max=20_000, help="Steps of the simulated training run (1 to 20000)."),
    policies: str = typer.Option("fp32,fp16,bf16", help="Policies of the simulated run, side by side."),
    gen: Generated = Generated.use("seed", seed=dict(default=0, help="Seed of the simulated run.")),
    log: Optional[Path] = typer.Option(None, "--log", help="CSV/Parquet log: step, layer, channel, mean, var "
                                                           "[, running_mean, running_var]."),
    dumps: Optional[Path] = typer.Option(None, "--dumps", help="Folder of dumps, one sub-folder per step."),
    monitor: Optional[Path] = typer.Option(None, "--monitor", help="Folder a bnprobe.monitor writes (every "
                                                                   "rank's; re-read as the run grows)."),
    channels: int = typer.Option(6, help="Channels per figure (the most drifting first)."),
    bn: Call = Call.use("eps", eps=dict(help="BatchNorm epsilon (for var/eps).", shown=EPS)),
    report: Output = Output.use("out", "force", out="Output folder (default reports/plot-stats-<time>)."),
    format: str = typer.Option("png", "--format", help="png or svg."),
) -> int:
    """Plot μ and σ² and the running statistics over training, per channel and per format, and flag
    divergence, collapse toward eps, non-finite statistics and a wrong momentum. Exit 1 when flagged."""
    from bnprobe.checks.plot_stats.stats import find, load_dump_series, load_log, load_monitor
    from bnprobe.checks.plot_stats.stats import simulate as run_simulation
    from bnprobe.reports.stats import STATS_FILES, stats_lines, write_stats

    eps, seed = bn.eps, gen.seed
    if format not in ("png", "svg"):
        raise BNProbeError(f"--format takes png or svg, got {format!r}")
    if sum(v is not None for v in (log, dumps, monitor)) + bool(simulate) > 1:
        raise BNProbeError("give one source: --simulate, --log, --dumps or --monitor")
    if channels < 1:
        raise BNProbeError(f"--channels must be >= 1, got {channels}")
    sink = report.sink("plot-stats", *STATS_FILES)
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

"""shrink's output folder: the minimal input, a dump of the kernel on it, shrink.json, and the command that
replays the failure; and the terminal text."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import numpy as np

from bnprobe.adapters import get_adapter
from bnprobe.checks.shrink.shrinking import FamilyLayer, RecordedParams, ShrinkResult
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import record, write_dump
from bnprobe.core.call import BNCall
from bnprobe.reports import OutputDir, dumps_json, output_dir

__all__ = ["write_shrink", "shrink_lines"]


def write_shrink(result: ShrinkResult, out: str | Path | OutputDir, *, adapter: str, dtype: str, mode: str,
                 predicate: str = "compare", recorded: RecordedParams | None = None,
                 params: str = "fp32", convention: str | None = None,
                 layer: FamilyLayer | None = None) -> tuple[list[Path], str]:
    """x.npy, a bnprobe dump of the adapter on it, shrink.json, and the command that replays the failure
    (with ``recorded``: the dump carries the recorded call's parameters and scalars, and the replay runs the
    adapter on the dump's inputs; else parameters as ``params``).  ``out``: a folder, or the run's
    :class:`~bnprobe.reports.OutputDir` (whose ``force`` applies); x.npy and shrink.json are renamed into place
    only when everything else succeeded.  ``layer``: x is that family layer's input (no dump: bnprobe records
    BatchNorm calls; the replay names the layer)."""
    if layer is not None:
        return _write_family(result, out, adapter=adapter, dtype=dtype, mode=mode, predicate=predicate, params=params,
                             layer=layer)
    sink = out if isinstance(out, OutputDir) else output_dir(out, "shrink")
    folder = sink.path
    sink.claim("x.npy", "shrink.json")
    c = result.x.shape[1]
    modes = ("train", "infer") if result.x.size // c < 2 else ("train", "infer", "backward")
    buf = io.BytesIO()
    np.save(buf, result.x)
    xpath = sink.write_bytes("x.npy", buf.getvalue())
    files = [xpath]
    try:
        if recorded is not None:
            rec = recorded.channels(result.channels).record(get_adapter(adapter), result.x, dtype, modes)
            rec.meta["shrunk_from"] = list(result.original_shape)
        else:
            rec = record(get_adapter(adapter), BNCall(x=result.x, gamma=None, beta=None, running_mean=np.zeros(c),
                                                      running_var=np.ones(c), dy=np.ones_like(result.x), dtype=dtype,
                                                      params=params), modes=modes,
                         meta={"shrunk_from": list(result.original_shape)})
        files += write_dump(rec, folder / "dump", force=sink.force)
    except BNProbeError as exc:  # the dump is a convenience; the replay command is what matters
        if recorded is not None:
            sink.discard()
            raise
        result.steps.append(f"no dump written: {exc}")
    # with recorded parameters the replay reruns the adapter on the dump's inputs (x, γ, β, eps, ...)
    prm = "" if recorded is not None or params == "fp32" else f" --params {params}"
    q = lambda path: shlex.quote(str(path))  # noqa: E731 - a user's folder may hold spaces or ; $ `
    given = f"--input {q(folder / 'dump')}" if recorded is not None else f"--dtype {dtype}{prm} --input {q(xpath)}"
    conv = f" --convention {shlex.quote(convention)}" if convention else ""
    if predicate == "overflow":
        cmd = f"bnprobe overflow --adapter {shlex.quote(adapter)} --mode {mode} {given}{conv}"
    else:
        given = (f"--input {q(folder / 'dump')}" if recorded is not None
                 else f"--dtypes {dtype}{prm} --input {q(xpath)}")
        cmd = (f"bnprobe compare-precision --adapters {shlex.quote(adapter)} --mode {mode} {given} --no-budget "
               f"--out {q(folder / 'replay-report')}{conv}")
    files.append(sink.write_text("shrink.json", dumps_json({
        **result.to_dict(), "adapter": adapter, "dtype": dtype, "mode": mode,
        "params": recorded.params if recorded is not None else params, "predicate": predicate, "convention": convention,
        "replay": cmd})))
    sink.commit()
    return files, cmd


def _write_family(result: ShrinkResult, out: str | Path | OutputDir, *, adapter: str, dtype: str, mode: str,
                  predicate: str, params: str, layer: FamilyLayer) -> tuple[list[Path], str]:
    """x.npy, shrink.json and the replay command of a family layer's shrunk input."""
    sink = out if isinstance(out, OutputDir) else output_dir(out, "shrink")
    folder = sink.path
    sink.claim("x.npy", "shrink.json")
    buf = io.BytesIO()
    np.save(buf, result.x)
    xpath = sink.write_bytes("x.npy", buf.getvalue())
    q = lambda path: shlex.quote(str(path))  # noqa: E731 - a user's folder may hold spaces or ; $ `
    prm = "" if params == "fp32" else f" --params {params}"
    lay = layer.flags(result.x.shape)
    if predicate == "overflow":
        cmd = f"bnprobe overflow --adapter {shlex.quote(adapter)} {lay} --mode {mode} --dtype {dtype}{prm} " \
              f"--input {q(xpath)}"
    else:
        cmd = (f"bnprobe compare-precision --adapters {shlex.quote(adapter)} {lay} --mode {mode} --dtypes {dtype}{prm} "
               f"--input {q(xpath)} --no-budget --out {q(folder / 'replay-report')}")
    files = [xpath, sink.write_text("shrink.json", dumps_json({
        **result.to_dict(), "adapter": adapter, "dtype": dtype, "mode": mode, "params": params,
        "predicate": predicate, "norm": layer.norm, **layer.options(result.x.shape), "replay": cmd}))]
    sink.commit()
    return files, cmd


def shrink_lines(res: ShrinkResult, files: list[Path], cmd: str, dtype: str, kept: RecordedParams | None) -> list[str]:
    """The terminal text: the shapes before and after, the recorded call's parameters kept, x, the files and the
    replay command."""
    lines = [f"shrunk {tuple(res.original_shape)} ({int(np.prod(res.original_shape))} values) to "
             f"{tuple(res.x.shape)} ({res.x.size} values) in {res.evaluations} checks, {res.seconds:.1f} s"
             + (" (time budget reached)" if res.timed_out else "")]
    if kept is not None:
        lines.append(f"input: recorded call {kept.source} (its γ, β, running statistics, eps {kept.eps:g}, "
                     f"momentum, {dtype}, params {kept.params}); channels kept: "
                     f"{res.channels.tolist() if res.channels is not None else 'all'}")
    return lines + [f"x = {np.array2string(res.x.reshape(-1), precision=6, threshold=20)}",
                    "wrote " + ", ".join(str(f) for f in files), f"replay: {cmd}"] + [f"note: {n}" for n in res.notes]

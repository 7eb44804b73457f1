"""MindSpore's static-graph dumps (``GRAPH_MODE`` or ``jit``): msprobe's level ``L2`` there is MindSpore's own
kernel-by-kernel dump, one ``.npy`` per kernel input and output:
``[rank_<r>/<net>/<graph>/<iteration>/]<Op>.<scope>.<task>.<stream>.<time>.<input|output>.<slot>.<format>.<dtype>.npy``.

BatchNorm is the kernel ``BatchNorm`` (inputs x, scale, bias, mean, variance, is_training, ε, momentum, data format;
outputs y, two aliases, the saved mean and the saved biased variance) and its gradient ``BatchNormGrad`` (dy, x,
scale, the saved mean and variance, a reserve, is_training, ε, format; outputs dx, dγ, dβ).  The graph's scope names
do not tell a gradient's layer (MindSpore may name it after another), so each gradient is paired with the forward
whose x and saved mean it was given.  The moving statistics are dumped after the kernel has updated them in place:
in a training call the running statistics it was given are not recorded, so they are not checked (said).  The
primitive's momentum is m, the batch's weight (``nn.BatchNorm2d(momentum=0.9)`` passes 0.1)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.inputs import npy_header
from bnprobe.numerics.rounding import is_representable
from bnprobe.recordings.types import CallRef, Recording, check_eps_momentum

__all__ = ["graph_folders", "graph_calls"]

_FILE = re.compile(r"^(?P<op>[A-Za-z0-9]+)\.(?P<scope>.+)\.(?P<task>\d+)\.(?P<stream>\d+)\.(?P<time>\d+)\."
                   r"(?P<io>input|output)\.(?P<slot>\d+)\.(?P<layout>[A-Za-z0-9_]+)\.(?P<dtype>[A-Za-z0-9]+)\.npy$")
FORWARD, GRAD = "BatchNorm", "BatchNormGrad"
_FWD_IN = {0: "x", 1: "gamma", 2: "beta", 3: "running_mean", 4: "running_var"}
_GRAD_IN = {0: "dy", 1: "x", 2: "gamma", 3: "saved_mean", 4: "saved_value"}
_FLOATS = {"float16", "float32", "float64", "bfloat16"}


def graph_folders(path: Path) -> list[Path]:
    """The iteration folders of a MindSpore graph dump under ``path`` (the dump path, a rank folder or an iteration
    folder itself) that hold BatchNorm kernels, in rank, graph and iteration order (numbers as numbers)."""
    if not path.is_dir():
        return []
    found = {f.parent for pattern in ("BatchNorm.*.npy", "*/*/*/BatchNorm.*.npy", "rank_*/*/*/*/BatchNorm.*.npy")
             for f in path.glob(pattern) if _FILE.match(f.name)}
    return sorted(found, key=lambda f: [(0, int(t), "") if t.isdigit() else (1, 0, t)
                                        for t in re.split(r"(\d+)", f.relative_to(path).as_posix())])


def _kernels(folder: Path) -> dict[tuple[str, str, str, str], dict[str, dict[int, tuple[Path, str, int]]]]:
    """(op, scope, task, stream) -> io -> slot -> (file, dtype, time) of the BatchNorm kernels in one folder."""
    out: dict[tuple[str, str, str, str], dict[str, dict[int, tuple[Path, str, int]]]] = {}
    for f in folder.iterdir():
        m = _FILE.match(f.name)
        if m is None or m["op"] not in (FORWARD, GRAD):
            continue
        k = (m["op"], m["scope"], m["task"], m["stream"])
        slots = out.setdefault(k, {"input": {}, "output": {}})[m["io"]]
        if int(m["slot"]) in slots:
            raise BNProbeError(f"{folder}: kernel {m['op']}.{m['scope']} has {m['io']} {m['slot']} twice (one "
                               "iteration folder holds one launch of each kernel)")
        slots[int(m["slot"])] = (f, m["dtype"].lower(), int(m["time"]))
    return out


def _load(entry: tuple[Path, str, int], what: str, want: tuple[int, ...] | None = None) -> tuple[np.ndarray, str]:
    """A dumped tensor as float64 (or its scalar's own type) and its format, checked against its file name."""
    path, declared, _ = entry
    with open(path, "rb") as fh:
        shape, dtype = npy_header(fh, str(path), path.stat().st_size)
    if want is not None and shape != want:
        raise BNProbeError(f"{path}: {what} has shape {list(shape)}, expected {list(want)}")
    a = np.load(path, allow_pickle=False)
    if declared not in _FLOATS:
        return a, declared
    fmt = get_format(declared).name
    if dtype.kind != "f":
        raise BNProbeError(f"{path}: holds {dtype} data but its name says {declared}")
    stored = get_format(a.dtype).name
    out = a.astype(np.float64)
    if stored != fmt and not is_representable(out, fmt).all():
        raise BNProbeError(f"{path}: holds values that are not {fmt}, as its name says")
    return out, fmt


def _header(entry: tuple[Path, str, int]) -> tuple[int, ...]:
    with open(entry[0], "rb") as fh:
        return npy_header(fh, str(entry[0]), entry[0].stat().st_size)[0]


def _scalar(entry: tuple[Path, str, int] | None, what: str, where: str) -> Any:
    if entry is None:
        raise BNProbeError(f"{where}: the kernel's {what} input is not in the dump")
    a, _ = _load(entry, what, ())
    return a.item()


def graph_calls(path: Path, assume: dict[str, float] | None = None) -> tuple[list[CallRef], list[str]]:
    """Every BatchNorm kernel of a MindSpore graph dump in launch order (folders in rank, graph, iteration order),
    each with the gradient it was given to, and notes.  ``assume``: ε and momentum the user gave, which must agree
    with the recorded ones."""
    folders = graph_folders(path)
    calls: list[CallRef] = []
    for folder in folders:
        ks = _kernels(folder)
        fwds = sorted((k for k in ks if k[0] == FORWARD), key=lambda k: min(t for _, _, t in ks[k]["input"].values()))
        grads = [k for k in ks if k[0] == GRAD]
        prefix = "" if len(folders) == 1 else f"{folder.relative_to(path).as_posix()}/"
        for k in fwds:
            io, where = ks[k], f"{folder}: {k[0]}.{k[1]}"
            for slot in (0, 5, 6, 7):
                if slot not in io["input"]:
                    raise BNProbeError(f"{where}: input {slot} is not in the dump")
            if 0 not in io["output"]:
                raise BNProbeError(f"{where}: output 0 (y) is not in the dump")
            training = bool(_scalar(io["input"][5], "is_training", where))
            grad = _gradient_of(ks, io, grads, where) if grads else None
            shape = _header(io["input"][0])
            calls.append(CallRef(
                name=f"{prefix}{k[0]}.{k[1]}", module=None, shape=shape, dtype=get_format(io["input"][0][1]).name,
                training=training, has_backward=grad is not None, task="tensor",
                load=_loader(folder, {n: ks[n] for n in (k, grad) if n is not None}, k, grad, assume),
                recorded=("train" if training else "infer",) + (("backward",) if grad is not None else ())))
    notes = [f"{len(folders)} graph dump folders (ranks, graphs, iterations) read; calls are named by their folder"] \
        if len(folders) > 1 else []
    return calls, notes


def _gradient_of(ks: dict, io: dict, grads: list, where: str) -> tuple[str, str, str, str] | None:
    """The BatchNormGrad kernel given this forward's saved mean (and x), or None."""
    if 3 not in io["output"]:
        return None
    mean, _ = _load(io["output"][3], "saved mean")
    found = []
    for g in grads:
        gi = ks[g]["input"]
        if 3 in gi and 1 in gi and _header(gi[3]) == mean.shape and _header(gi[1]) == _header(io["input"][0]) and \
                np.array_equal(_load(gi[3], "saved mean")[0], mean, equal_nan=True):
            found.append(g)
    if len(found) > 1:  # the same statistics twice: told apart by x
        x = _load(io["input"][0], "x")[0]
        found = [g for g in found if np.array_equal(_load(ks[g]["input"][1], "x")[0], x, equal_nan=True)]
    if len(found) > 1:
        raise BNProbeError(f"{where}: {len(found)} BatchNormGrad kernels were given this call's x and statistics; "
                           "cannot tell which is its gradient")
    return found[0] if found else None


def _loader(folder: Path, ks: dict, k: tuple[str, str, str, str], grad: tuple[str, str, str, str] | None,
            assume: dict[str, float] | None) -> Callable[[], Recording]:
    return lambda: read_graph_call(folder, ks, k, grad, assume)


def read_graph_call(folder: Path, ks: dict, k: tuple[str, str, str, str], grad: tuple[str, str, str, str] | None,
                    assume: dict[str, float] | None = None) -> Recording:
    """One BatchNorm kernel of a graph dump (and its gradient) as a Recording, in MindSpore's convention; ``ks``:
    the folder's kernels as :func:`graph_calls` listed them (their files; the folder is not listed again)."""
    io, where = ks[k], f"{folder}: {k[0]}.{k[1]}"
    x, dtype = _load(io["input"][0], "x")
    if x.ndim < 2:
        raise BNProbeError(f"{where}: x has shape {list(x.shape)}; BatchNorm takes N, C[, ...]")
    c = x.shape[1]
    layout = _scalar(io["input"].get(8), "data format", where) if 8 in io["input"] else 0
    if layout != 0:
        raise BNProbeError(f"{where}: data format {layout} (bnprobe reads MindSpore's NCHW graph kernels, format 0)")
    tensors, formats = {"x": x}, {"x": dtype}
    for slot, name in list(_FWD_IN.items())[1:]:
        if slot not in io["input"]:
            raise BNProbeError(f"{where}: input {slot} ({name}) is not in the dump")
        tensors[name], formats[name] = _load(io["input"][slot], name, (c,))
    training = bool(_scalar(io["input"][5], "is_training", where))
    eps, momentum = (float(_scalar(io["input"][s], n, where)) for s, n in ((6, "epsilon"), (7, "momentum")))
    for name, value in (assume or {}).items():
        recorded = eps if name == "eps" else momentum
        if not np.isclose(recorded, value, rtol=2.0**-23, atol=0):  # recorded as float32
            raise BNProbeError(f"{where}: records {name} = {recorded!r}; {name}={value:g} contradicts it")
    eps, momentum = check_eps_momentum(eps, momentum, formats["gamma"], where)
    y, fy = _load(io["output"][0], "y", x.shape)
    outputs, out_formats = {"y": y}, {"y": fy}
    notes = []
    saved_kind = None
    if training and 3 in io["output"] and 4 in io["output"]:
        for slot, name in ((3, "saved_mean"), (4, "saved_value")):
            outputs[name], out_formats[name] = _load(io["output"][slot], name, (c,))
        saved_kind = "var"
    if training:
        notes.append("a graph dump holds the moving statistics after the kernel updated them in place, not the ones "
                     "it was given: the running statistics are not checked")
    mode = "train" if training else "infer"
    rec = Recording(adapter=f"mindspore-graph:{k[1]}", dtype=dtype, params=formats["gamma"], layout="channels_first",
                    eps=eps, momentum=momentum, saved_kind=saved_kind,
                    meta={"framework": "mindspore", "task": "tensor", "level": "L2", "call": f"{k[0]}.{k[1]}",
                          "training": training, "affine": True, "notes": notes}, source=str(folder))
    rec.tensors[mode] = {"inputs": dict(tensors), "outputs": outputs}
    rec.formats.update({f"{mode}.inputs.{n}": f for n, f in formats.items()})
    rec.formats.update({f"{mode}.outputs.{n}": f for n, f in out_formats.items()})
    if grad is not None:
        _read_grad(rec, ks[grad], f"{folder}: {grad[0]}.{grad[1]}", x, eps)
    return rec


def _read_grad(rec: Recording, io: dict, where: str, x: np.ndarray, eps: float) -> None:
    c = x.shape[1]
    ins, fins = {}, {}
    for slot, name in _GRAD_IN.items():
        if slot not in io["input"]:
            raise BNProbeError(f"{where}: input {slot} ({name}) is not in the dump")
        ins[name], fins[name] = _load(io["input"][slot], name, x.shape if slot < 2 else (c,))
    if not np.array_equal(ins["x"], x, equal_nan=True):
        raise BNProbeError(f"{where}: its x is not the forward's")
    g_eps = float(_scalar(io["input"].get(7), "epsilon", where))
    if not np.isclose(g_eps, eps, rtol=2.0**-23, atol=0):
        raise BNProbeError(f"{where}: ε {g_eps:g} differs from its forward's {eps:g}")
    outs, fouts = {}, {}
    for slot, name, shape in ((0, "dx", x.shape), (1, "dgamma", (c,)), (2, "dbeta", (c,))):
        if slot not in io["output"]:
            raise BNProbeError(f"{where}: output {slot} ({name}) is not in the dump")
        outs[name], fouts[name] = _load(io["output"][slot], name, shape)
    rec.tensors["backward"] = {"inputs": ins, "outputs": outs}
    rec.formats.update({f"backward.inputs.{n}": f for n, f in fins.items()})
    rec.formats.update({f"backward.outputs.{n}": f for n, f in fouts.items()})

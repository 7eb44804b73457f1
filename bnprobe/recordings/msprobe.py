"""MindStudio Probe (msprobe) dumps: every BatchNorm call, forward and backward, as recordings.

Layouts read (mindstudio-probe 26.x and older): ``step*/proc<pid>/`` (one process), ``step*/rank*/``
and ``rank*/`` (torch.distributed), a folder holding ``dump.json``, or the path of ``dump.json``
itself; tensors in ``dump_tensor_data/`` as ``.pt`` or ``.npy``.  The BatchNorm kernels are the API
records ``Functional.batch_norm.N`` (what ``nn.BatchNorm1d/2d/3d`` call), ``Torch.batch_norm``,
``Torch.native_batch_norm``, ``Aten.native_batch_norm`` and the other aten variants; the mix level's
``Module.<path>.BatchNorm*.forward.K`` records name them (through ``construct.json``) and its
``parameters_grad`` records are checked against the kernel's dγ and dβ.

MindSpore's dumps (``"framework": "mindspore"``): the primitive ``Primitive.bn_train.BatchNorm.N`` at L1 and mix
(ε and momentum, its attributes, are not recorded: MindSpore's defaults or the user's, said), and at L0 the cells
``Cell.<name>.BatchNorm2d.forward.K`` (:func:`read_cell`).  MindSpore's GRAPH_MODE dumps (level L2) are read by
:mod:`bnprobe.recordings.ms_graph`.

The normalisation family's records in a PyTorch dump (``Functional.layer_norm``, ``Functional.group_norm``,
``Functional.instance_norm``, their ``Torch``/``Aten`` forms, ``NPU.npu_rms_norm``...) are read by
:mod:`bnprobe.recordings.msprobe_family`; :func:`msprobe_calls` lists them among BatchNorm's, in forward order.

A ``statistics`` dump holds max/min/mean/norm per tensor and no tensors: its calls carry summaries
only (see :attr:`~bnprobe.recordings.types.CallRef.task`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.recordings.msprobe_family import (family_api, family_ref, read_family_call, read_family_summaries,
                                               rms_modules)
from bnprobe.recordings.msprobe_records import (
    SUMMARY_KEYS,
    check_parameters_grad,
    is_tensor,
    json_kind,
    load_tensor,
    read_construct,
    read_dump_json,
    record_list,
    scalar_of,
    summary_value,
    tensor_entries,
    tensor_format,
    tensor_shape,
)
from bnprobe.recordings.types import CallRef, Recording, check_eps_momentum

__all__ = ["MSPROBE_BN_APIS", "MsprobeCall", "find_dump_jsons", "msprobe_calls", "read_call", "read_cell",
           "read_summaries", "SUMMARY_KEYS"]

MSPROBE_BN_APIS = ("batch_norm", "native_batch_norm", "cudnn_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional")
# positional order of each API's arguments
_F_ORDER = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_ATEN_ORDER = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_NO_TRAINING_ORDER = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
# MindSpore's primitive (ops.BatchNorm: x, scale, bias, mean, variance; ε and momentum are its attributes, not
# recorded: MindSpore's defaults are assumed and said); its outputs y, batch_mean, batch_variance (zeros on the
# CPU), reserve_space_1 = the mean, reserve_space_2 = the biased variance
MS_PRIMITIVE = "BatchNorm"
_MS_ORDER = ("input", "weight", "bias", "running_mean", "running_var")
# msprobe's kwarg names for cudnn's arguments
_ALIASES = {"exponential_average_factor": "momentum", "epsilon": "eps"}


def find_dump_jsons(path: str | Path) -> list[Path]:
    """Every ``dump.json`` a path stands for: the file itself, the folder's own, or those of its
    ``step*/proc*``, ``step*/rank*`` and ``rank*`` sub-folders, in step then rank order (numbers compared as
    numbers: step2 before step10)."""
    p = Path(path)
    if p.is_file():
        if p.name != "dump.json":
            raise BNProbeError(f"{p}: not a dump.json (give an msprobe dump folder or its dump.json)")
        return [p]
    if not p.is_dir():
        raise BNProbeError(f"dump {str(p)!r} does not exist")
    if (p / "dump.json").is_file():
        return [p / "dump.json"]
    found = {*p.glob("step*/proc*/dump.json"), *p.glob("step*/rank*/dump.json"), *p.glob("rank*/dump.json"),
             *p.glob("proc*/dump.json")}
    return sorted(found, key=lambda f: [(0, int(t), "") if t.isdigit() else (1, 0, t)
                                        for t in re.split(r"(\d+)", f.relative_to(p).as_posix())])


@dataclass(frozen=True)
class MsprobeCall:
    """One BatchNorm kernel call of an msprobe dump, nothing loaded: ``ref`` describes it as the calls of every
    dump are described (named by its API record, prefixed with its step/rank folder when a dump has several; its
    module the enclosing ``Module.1.BatchNorm2d.forward.0`` record at the mix level; ``load()`` gives its
    Recording, or its summaries in a statistics dump), ``api`` and ``dump_json`` where msprobe recorded it."""

    ref: CallRef
    api: str  # the API record, e.g. Functional.batch_norm.0
    dump_json: Path  # the dump.json holding it
    framework: str = "pytorch"  # as dump.json says (pytorch, mindspore)


def _api_of(call: str) -> tuple[str, str] | None:
    """(api_type, api) of a record name without its .forward/.backward, when it is a BatchNorm kernel."""
    parts = call.split(".")
    if len(parts) < 3 or not parts[-1].isdigit() or parts[0] in ("Module", "Cell"):
        return None
    if parts[0] == "Primitive" and len(parts) == 4 and parts[2] == MS_PRIMITIVE and \
            parts[1] in ("bn_train", "bn_infer"):
        return "Primitive", MS_PRIMITIVE  # MindSpore's ops.BatchNorm (nn.BatchNorm2d's bn_train / bn_infer)
    api = parts[1]
    return (parts[0], api) if api in MSPROBE_BN_APIS else None


def _args(call: str, api_type: str, api: str, fwd: dict[str, Any], where: str) -> dict[str, Any]:
    order = _MS_ORDER if api_type == "Primitive" else _NO_TRAINING_ORDER if api.endswith("no_training") else (
        _F_ORDER if api_type == "Functional" else _ATEN_ORDER)
    pos = fwd.get("input_args", [])
    kw = fwd.get("input_kwargs", {})
    kw = {} if kw is None else kw
    if not isinstance(pos, list) or not isinstance(kw, dict):
        raise BNProbeError(f"{where}: {call}.forward has input_args/input_kwargs of the wrong JSON type")
    args: dict[str, Any] = dict(zip(order, pos))
    args.update({_ALIASES.get(k, k): v for k, v in kw.items()})
    if not is_tensor(args.get("input")):
        raise BNProbeError(f"{where}: {call}.forward has no input tensor")
    keyword = {_ALIASES.get(k, k): k for k in kw}
    for name in _TENSOR_ARGS:
        v = args.get(name)
        # a tensor argument is a tensor record, or None (recorded as null or as a record whose value is null)
        if v is not None and not is_tensor(v) and not (isinstance(v, dict) and v.get("value") is None):
            at = f"input_kwargs.{keyword[name]}" if name in keyword else f"input_args[{order.index(name)}]"
            raise BNProbeError(f"{where}: {call}.forward {name} ({at}) is {json_kind(v)}, not a tensor record or "
                               "null")
    return args


_TENSOR_ARGS = ("weight", "bias", "running_mean", "running_var")


def msprobe_calls(path: str | Path, assume: dict[str, float] | None = None) -> tuple[list[MsprobeCall], list[str]]:
    """Every BatchNorm call (and normalisation-family call) of an msprobe dump in forward order, and notes on what
    is not read.  ``assume``: ε
    and momentum (keys ``eps``, ``momentum``) for the calls whose dump does not record them (MindSpore's
    primitive), in place of the framework's defaults."""
    jsons = find_dump_jsons(path)
    if not jsons:
        raise BNProbeError(f"{path}: no msprobe dump.json (looked for dump.json, step*/proc*/, step*/rank*/, "
                           "rank*/)")
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    calls: list[MsprobeCall] = []
    notes: list[str] = []
    unread: list[str] = []  # the RMSNorm modules no API record of the family stands for
    for dj in jsons:
        doc = read_dump_json(dj)
        data = doc["data"]
        task = str(doc.get("task") or "tensor")
        if task not in ("tensor", "statistics"):
            raise BNProbeError(f"{dj}: task {task!r}; bnprobe reads msprobe's tensor and statistics dumps")
        construct = read_construct(dj.parent)
        prefix = "" if len(jsons) == 1 else f"{dj.parent.relative_to(root).as_posix()}/"
        found = 0
        for key, fwd in data.items():
            if not key.endswith(".forward"):
                continue
            call = key[: -len(".forward")]
            api = _api_of(call)
            if api is None:
                if family_api(call) is not None and str(doc.get("framework") or "pytorch") == "pytorch":
                    module = construct.get(key)
                    calls.append(MsprobeCall(family_ref(prefix + call, dj, doc, call, family_api(call), module,
                                                        _family_loader(dj, call, task, module, assume)),
                                             api=call, dump_json=dj))
                continue
            where = str(dj)
            if not isinstance(fwd, dict):
                raise BNProbeError(f"{where}: {key} is not a JSON object")
            args = _args(call, *api, fwd, where)
            x = args["input"]
            training = _training(args, api[1], call, where)
            calls.append(MsprobeCall(CallRef(
                name=prefix + call, module=construct.get(key), shape=tensor_shape(x, where),
                dtype=tensor_format(x, where),
                training=training, has_backward=f"{call}.backward" in data, task=task,
                load=_loader(dj, call, task, construct.get(key), assume)), api=call, dump_json=dj,
                framework=str(doc.get("framework") or "pytorch")))
            found += 1
        modules = [k for k in data if k.startswith(("Module.", "Cell.")) and ".BatchNorm" in k and ".forward." in k]
        if not found and modules and (modules[0].startswith("Module.") or task != "tensor"):
            raise BNProbeError(f"{dj}: only module-level (L0) BatchNorm records ({modules[0]}, ...): "
                               + ("a statistics dump's cell records hold no tensors to tell the training flag by"
                                  if modules[0].startswith("Cell.") else
                                  "they hold x, y, weight and bias but not eps, momentum, the running statistics or "
                                  "the training flag") + "; dump at level L1 or mix")
        if not found and modules:  # MindSpore's L0: the cells alone
            for key in modules:
                call = prefix + key.replace(".forward.", ".")
                rec = read_cell(dj, doc, key, assume, backward=False)  # the forward tells the training flag
                backward = key.replace(".forward.", ".backward.") in data
                calls.append(MsprobeCall(CallRef(
                    name=call, module=None, shape=tuple(rec.tensors[rec.modes[0]]["inputs"]["x"].shape),
                    dtype=rec.dtype, training=rec.training, has_backward=backward, task=task,
                    load=_cell_loader(dj, key, assume), recorded=(*rec.modes, *(("backward",) if backward else ()))),
                    api=key, dump_json=dj, framework=str(doc.get("framework") or "mindspore")))
        if str(doc.get("framework") or "pytorch") == "pytorch":
            unread.extend(prefix + k for k in rms_modules(data, construct))
    if len(jsons) > 1:
        notes.append(f"{len(jsons)} dump.json files (steps/ranks) read; calls are named by their folder")
    if unread:
        note = (f"{len(unread)} RMSNorm module record{'s' if len(unread) > 1 else ''} ({unread[0]}"
                f"{', ...' if len(unread) > 1 else ''}) not read: msprobe hooks no rms_norm API, and a module's record "
                "holds x, y and γ but not ε")
        if not calls:
            raise BNProbeError(f"{path}: {note}")
        notes.append(note)
    return calls, notes


def _loader(dj: Path, call: str, task: str, module: str | None = None,
            assume: dict[str, float] | None = None) -> Callable[[], Any]:
    def load() -> Any:
        doc = read_dump_json(dj)
        return read_call(dj, doc, call, module, assume) if task == "tensor" else read_summaries(dj, doc, call)

    return load


def _family_loader(dj: Path, call: str, task: str, module: str | None,
                   assume: dict[str, float] | None) -> Callable[[], Any]:
    def load() -> Any:
        doc = read_dump_json(dj)
        return read_family_call(dj, doc, call, module, assume) if task == "tensor" else \
            read_family_summaries(dj, doc, call)

    return load


def read_call(dj: Path, doc: dict[str, Any], call: str, module: str | None = None,
              assume: dict[str, float] | None = None) -> Any:
    """One BatchNorm call of an msprobe tensor dump as a Recording (forward, and backward when dumped).
    ``module``: the enclosing module's forward record (mix level), whose ``parameters_grad`` record is
    checked against the call's dγ and dβ.  ``assume``: ε and momentum where the dump records none (see
    :func:`msprobe_calls`); one that contradicts a recorded value is an error."""
    data = doc["data"]
    api_type, api = _api_of(call) or ("", "")
    where = str(dj)
    args = _args(call, api_type, api, data[f"{call}.forward"], where)
    base = dj.parent
    training = _training(args, api, call, where)
    x, dtype = load_tensor(base, args["input"], f"{call}.forward input")
    if x.ndim < 2:
        raise BNProbeError(f"{where}: {call}.forward input has shape {list(x.shape)}; BatchNorm takes N, C[, ...]")
    tensors: dict[str, np.ndarray] = {"x": x}
    formats = {"x": dtype}
    for ours, theirs in (("gamma", "weight"), ("beta", "bias"), ("running_mean", "running_mean"),
                         ("running_var", "running_var")):
        if is_tensor(args.get(theirs)):
            tensors[ours], formats[ours] = load_tensor(base, args[theirs], f"{call}.forward {theirs}")
    params = formats.get("gamma", formats.get("running_mean", dtype))
    given = dict(assume or {})
    for name in given:
        if name in args and _present(args, name, None, call, where) != given[name]:
            raise BNProbeError(f"{where}: {call} records {name} = {_present(args, name, None, call, where)!r}; "
                               f"{name}={given[name]:g} contradicts it")
    eps, momentum = check_eps_momentum(_present(args, "eps", given.get("eps", 1e-5), call, where),
                                       _present(args, "momentum", given.get("momentum", 0.1), call, where), params,
                                       f"{where}: {call}")
    notes = []
    if api == MS_PRIMITIVE:
        said = [f"{k} {v:g} as given" for k, v in (("ε", given.get("eps")), ("momentum", given.get("momentum")))
                if v is not None]
        assumed = [f"{k} {v:g}" for k, v, n in (("ε", eps, "eps"), ("momentum", momentum, "momentum"))
                   if n not in given]
        notes.append("ε and momentum are attributes of MindSpore's BatchNorm primitive, not in the dump: "
                     + "; ".join(said + ([f"MindSpore's default{'s' if len(assumed) > 1 else ''} assumed: "
                                          f"{', '.join(assumed)} (nn.BatchNorm2d's momentum=0.9 is m = 0.1); give "
                                          "the layer's as --eps/--momentum (or dump:DIR,eps=E,momentum=M)"]
                                         if assumed else [])))
    outs = tensor_entries(data[f"{call}.forward"], "output", f"{where}: {call}.forward")
    if not outs:
        raise BNProbeError(f"{where}: {call}.forward records no output tensor")
    c = x.shape[1] if x.ndim > 1 else 0
    outputs: dict[str, np.ndarray] = {}
    out_formats: dict[str, str] = {}
    outputs["y"], out_formats["y"] = load_tensor(base, outs[0], f"{call}.forward output 0")
    saved_kind = None
    # the saved statistics: native variants' outputs 1, 2 (save_mean, save_invstd[, new running stats]); MindSpore's
    # outputs 3, 4 (reserve_space_1, _2: the mean and the biased variance)
    first, kind = (3, "var") if api == MS_PRIMITIVE else (1, "invstd")
    saved = [o for o in outs[first:first + 2] if tensor_shape(o, where) == (c,)]
    if training and len(saved) == 2:
        outputs["saved_mean"], out_formats["saved_mean"] = load_tensor(base, saved[0],
                                                                        f"{call}.forward output {first}")
        outputs["saved_value"], out_formats["saved_value"] = load_tensor(base, saved[1],
                                                                          f"{call}.forward output {first + 1}")
        saved_kind = kind
    if api == "_native_batch_norm_legit_functional" and len(outs) >= 5:
        outputs["running_mean_out"], out_formats["running_mean_out"] = load_tensor(base, outs[3], f"{call} output 3")
        outputs["running_var_out"], out_formats["running_var_out"] = load_tensor(base, outs[4], f"{call} output 4")
    mode = "train" if training else "infer"
    rec = Recording(adapter=f"msprobe:{call}", dtype=dtype, params=params, layout="channels_first", eps=eps,
                    momentum=momentum, saved_kind=saved_kind,
                    meta={"framework": doc.get("framework"), "task": doc.get("task"), "level": doc.get("level"),
                          "call": call, "training": training, "affine": "gamma" in tensors, "notes": notes},
                    source=str(dj))
    rec.tensors[mode] = {"inputs": dict(tensors), "outputs": outputs}
    rec.formats.update({f"{mode}.inputs.{k}": f for k, f in formats.items()})
    rec.formats.update({f"{mode}.outputs.{k}": f for k, f in out_formats.items()})
    bwd = data.get(f"{call}.backward")
    if bwd is not None:
        _read_backward(rec, base, where, call, bwd, tensors, formats, outputs, out_formats)
        if module:
            check_parameters_grad(rec, data, base, module)
    return rec


def _cell_loader(dj: Path, key: str, assume: dict[str, float] | None) -> Callable[[], Any]:
    return lambda: read_cell(dj, read_dump_json(dj), key, assume)


def read_cell(dj: Path, doc: dict[str, Any], key: str, assume: dict[str, float] | None = None, *,
              backward: bool = True) -> Any:
    """One MindSpore cell record of an L0 dump (``Cell.<name>.BatchNorm2d.forward.K``) as a Recording: x, y, γ, β
    and the moving statistics (recorded after the call's update), the backward's dy and dx, and dγ, dβ from the
    cell's ``parameters_grad``.  The record holds no ε, momentum or training flag: ε and momentum are MindSpore's
    defaults or ``assume``'s, and the mode is the one whose float64 y is nearer the recorded one (said in a note);
    the running statistics it was given are not recorded, so a training call's are not checked.  ``backward``
    False: the forward alone (what opening the dump needs to tell the training flag)."""
    data, where, base = doc["data"], str(dj), dj.parent
    fwd = data[key]
    if not isinstance(fwd, dict):
        raise BNProbeError(f"{where}: {key} is not a JSON object")
    ins, outs = tensor_entries(fwd, "input_args", f"{where}: {key}"), tensor_entries(fwd, "output", f"{where}: {key}")
    prm = fwd.get("parameters") if isinstance(fwd.get("parameters"), dict) else {}
    if not ins or not outs:
        raise BNProbeError(f"{where}: {key} records no input or output tensor")
    x, dtype = load_tensor(base, ins[0], f"{key} input 0")
    if x.ndim < 2:
        raise BNProbeError(f"{where}: {key} input has shape {list(x.shape)}; BatchNorm takes N, C[, ...]")
    tensors, formats = {"x": x}, {"x": dtype}
    for ours, theirs in (("gamma", "gamma"), ("beta", "beta"), ("running_mean", "moving_mean"),
                         ("running_var", "moving_variance")):
        if not is_tensor(prm.get(theirs)):
            raise BNProbeError(f"{where}: {key} records no {theirs} parameter")
        tensors[ours], formats[ours] = load_tensor(base, prm[theirs], f"{key} parameter {theirs}")
    y, fy = load_tensor(base, outs[0], f"{key} output 0")
    if y.shape != x.shape:
        raise BNProbeError(f"{where}: {key} output has shape {list(y.shape)}, its input {list(x.shape)}")
    given = dict(assume or {})
    eps, momentum = check_eps_momentum(given.get("eps", 1e-5), given.get("momentum", 0.1), formats["gamma"],
                                       f"{where}: {key}")
    training, why = _cell_mode(tensors, y, eps)
    notes = ["ε and momentum are not in a MindSpore cell's record: " + "; ".join(
        [f"{k} {given[n]:g} as given" for k, n in (("ε", "eps"), ("momentum", "momentum")) if n in given]
        + ([f"MindSpore's default{'s' if len(given) == 0 else ''} assumed: " + ", ".join(
            f"{k} {v:g}" for k, v, n in (("ε", eps, "eps"), ("momentum", momentum, "momentum")) if n not in given)
            + " (nn.BatchNorm2d's momentum=0.9 is m = 0.1); give the layer's as --eps/--momentum"]
           if len(given) < 2 else [])), why]
    if training:
        notes.append("a cell's record holds its moving statistics after the update, not the ones it was given: the "
                     "running statistics are not checked")
    mode = "train" if training else "infer"
    rec = Recording(adapter=f"msprobe:{key}", dtype=dtype, params=formats["gamma"], layout="channels_first", eps=eps,
                    momentum=momentum, saved_kind=None,
                    meta={"framework": doc.get("framework"), "task": doc.get("task"), "level": doc.get("level"),
                          "call": key, "training": training, "affine": True, "notes": notes}, source=where)
    rec.tensors[mode] = {"inputs": dict(tensors), "outputs": {"y": y}}
    rec.formats.update({f"{mode}.inputs.{k}": f for k, f in formats.items()})
    rec.formats[f"{mode}.outputs.y"] = fy
    bwd = data.get(key.replace(".forward.", ".backward.")) if backward else None
    if bwd is not None:
        pg = data.get(key.replace(".forward.", ".parameters_grad."))
        pg = pg if isinstance(pg, dict) else {}
        found = {ours: tensor_entries(pg, theirs, f"{where}: {key} parameters_grad")
                 for ours, theirs in (("dgamma", "gamma"), ("dbeta", "beta"))}
        named = {ours: load_tensor(base, e[0], f"{key} parameters_grad {ours[1:]}") for ours, e in found.items() if e}
        _read_backward(rec, base, where, key, bwd, tensors, formats, {}, {}, named=named)
    return rec


def _cell_mode(t: dict[str, np.ndarray], y: np.ndarray, eps: float) -> tuple[bool, str]:
    """Whether a cell ran in training mode: its y is nearer (in float64) to the batch's statistics' than to the
    moving statistics', and the note that says so with both distances."""
    ax = tuple(i for i in range(t["x"].ndim) if i != 1)
    shape = [1] * t["x"].ndim
    shape[1] = -1

    def col(v: np.ndarray) -> np.ndarray:
        return np.reshape(v, shape)

    def bn(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        return col(t["gamma"]) * (t["x"] - col(mean)) / np.sqrt(col(var) + eps) + col(t["beta"])

    scale = float(np.nanmax(np.abs(y))) or 1.0
    off = [float(np.nanmax(np.abs(bn(m, v) - y))) / scale
           for m, v in ((t["x"].mean(axis=ax), t["x"].var(axis=ax)), (t["running_mean"], t["running_var"]))]
    training = not off[1] < off[0]
    near, far = (("batch", off[0]), ("moving", off[1])) if training else (("moving", off[1]), ("batch", off[0]))
    return training, (f"the training flag is not in a cell's record: taken as {'training' if training else 'inference'}"
                      f", its y being nearer the {near[0]} statistics' ({near[1]:.2g} of max|y|) than the {far[0]} "
                      f"statistics' ({far[1]:.2g})")


def _present(args: dict[str, Any], name: str, default: Any, call: str, where: str) -> Any:
    """The recorded value of argument ``name`` (``default`` when the call did not pass it); a value recorded as
    null is an error, not the default."""
    if name not in args:
        return default
    v = scalar_of(args[name], None)
    if v is None:
        raise BNProbeError(f"{where}: {call} records {name} = null")
    return v


def _training(args: dict[str, Any], api: str, call: str, where: str) -> bool:
    if api == MS_PRIMITIVE and "training" not in args:  # MindSpore: nn.BatchNorm2d names its training primitive
        return ".bn_train." in f"{call}."
    t = _present(args, "training", not api.endswith("no_training"), call, where)
    if not isinstance(t, bool):
        raise BNProbeError(f"{where}: {call} records training = {t!r}, not true or false")
    return t


def _read_backward(rec: Any, base: Path, where: str, call: str, bwd: Any, tensors: dict[str, np.ndarray],
                   formats: dict[str, str], outputs: dict[str, np.ndarray], out_formats: dict[str, str],
                   named: dict[str, tuple[np.ndarray, str]] | None = None) -> None:
    """The backward record of ``call``: dy in, dx and (unless ``named`` gives them, from a cell's parameters_grad)
    dγ, dβ out."""
    if not isinstance(bwd, dict):
        raise BNProbeError(f"{where}: {call}.backward is not a JSON object")
    x = tensors["x"]
    grads_in = tensor_entries(bwd, "input", f"{where}: {call}.backward")
    grads_out = tensor_entries(bwd, "output", f"{where}: {call}.backward")
    if not grads_in or not grads_out:
        raise BNProbeError(f"{where}: {call}.backward lacks its gradient tensors (dy in, dx out)")
    dy, fdy = load_tensor(base, grads_in[0], f"{call}.backward input 0")
    if dy.shape != x.shape:
        raise BNProbeError(f"{where}: {call}.backward input 0 has shape {list(dy.shape)}, x has {list(x.shape)}")
    loaded = [(tensor_shape(o, where), o, i) for i, o in enumerate(grads_out)]
    dx_e = next(((o, i) for s, o, i in loaded if s == x.shape), None)
    vecs = [(o, i) for s, o, i in loaded if s == (x.shape[1],)]
    if dx_e is None:
        raise BNProbeError(f"{where}: {call}.backward output holds no dx (no tensor of x's shape)")
    affine = "gamma" in tensors and "beta" in tensors and named is None
    if affine and len(vecs) < 2:
        raise BNProbeError(f"{where}: {call}.backward output lacks the gradients of weight and bias")
    dx, fdx = load_tensor(base, dx_e[0], f"{call}.backward output {dx_e[1]}")
    c = x.shape[1]
    ins: dict[str, np.ndarray] = {"dy": dy, "x": x, "gamma": tensors.get("gamma", np.ones(c))}
    fins = {"dy": fdy, "x": formats["x"], "gamma": formats.get("gamma", rec.params)}
    if "saved_mean" in outputs:
        ins.update(saved_mean=outputs["saved_mean"], saved_value=outputs["saved_value"])
        fins.update(saved_mean=out_formats["saved_mean"], saved_value=out_formats["saved_value"])
    elif not rec.meta["training"] and "running_mean" in tensors:  # inference backward: the running statistics
        ins.update(saved_mean=tensors["running_mean"], saved_value=tensors["running_var"])
        fins.update(saved_mean=formats["running_mean"], saved_value=formats["running_var"])
    outs: dict[str, np.ndarray] = {"dx": dx}
    fouts = {"dx": fdx}
    if affine:
        a, b = (load_tensor(base, e, f"{call}.backward output {i}") for e, i in vecs[:2])
        if rec.meta.get("framework") == "mindspore":  # msprobe 26.2 lists MindSpore's as dβ, dγ, dx
            a, b = _by_sum_dy(a, b, dy, rec)
        (outs["dgamma"], fouts["dgamma"]), (outs["dbeta"], fouts["dbeta"]) = a, b
    for k, (v, f) in (named or {}).items():
        if v.shape != (c,):
            raise BNProbeError(f"{where}: {call}: {k} has shape {list(v.shape)}, not ({c},)")
        outs[k], fouts[k] = v, f
    rec.tensors["backward"] = {"inputs": ins, "outputs": outs}
    rec.formats.update({f"backward.inputs.{k}": f for k, f in fins.items()})
    rec.formats.update({f"backward.outputs.{k}": f for k, f in fouts.items()})


def _by_sum_dy(first: tuple[np.ndarray, str], second: tuple[np.ndarray, str], dy: np.ndarray,
               rec: Any) -> tuple[tuple[np.ndarray, str], tuple[np.ndarray, str]]:
    """(dγ, dβ) of two recorded channel gradients, told apart by content: dβ is Σdy (the one closer to it, in
    float64; msprobe 26.2 records MindSpore's in the order dβ, dγ); a note when neither is close (not told)."""
    sdy = np.nansum(dy, axis=tuple(i for i in range(dy.ndim) if i != 1))
    off = [float(np.nanmax(np.abs(v[0] - sdy) / (np.abs(sdy) + 1e-30))) for v in (first, second)]
    if min(off) > 1e-2:
        rec.meta.setdefault("notes", []).append("neither recorded channel gradient is Σdy: taken as dβ, dγ, "
                                                "msprobe's order for MindSpore")
        return second, first
    return (second, first) if off[0] <= off[1] else (first, second)


def read_summaries(dj: Path, doc: dict[str, Any], call: str) -> dict[str, dict[str, Any]]:
    """A statistics-task call: per recorded tensor (``forward.input.x``, ``forward.output.y``,
    ``backward.input.dy``, ``backward.output.dx``...), its dtype, shape and max/min/mean/norm."""
    data = doc["data"]
    api_type, api = _api_of(call) or ("", "")
    where = str(dj)
    fwd = data[f"{call}.forward"]
    args = _args(call, api_type, api, fwd, where)
    out: dict[str, dict[str, Any]] = {}

    def put(key: str, e: Any) -> None:
        if is_tensor(e):
            out[key] = {"dtype": tensor_format(e, where), "shape": list(tensor_shape(e, where)),
                        **{k: summary_value(e.get(k)) for k in SUMMARY_KEYS}}

    for ours, theirs in (("x", "input"), ("gamma", "weight"), ("beta", "bias"), ("running_mean", "running_mean"),
                         ("running_var", "running_var")):
        put(f"forward.input.{ours}", args.get(theirs))
    for i, e in enumerate(record_list(fwd, "output", f"{where}: {call}.forward")):
        put(f"forward.output.{('y', 'saved_mean', 'saved_invstd', 'running_mean', 'running_var')[i] if i < 5 else i}",
            e)
    bwd = data.get(f"{call}.backward")
    if isinstance(bwd, dict):
        for i, e in enumerate(record_list(bwd, "input", f"{where}: {call}.backward")):
            put(f"backward.input.{'dy' if i == 0 else i}", e)
        names = iter(("dgamma", "dbeta"))
        for i, e in enumerate(record_list(bwd, "output", f"{where}: {call}.backward")):
            if is_tensor(e):
                put(f"backward.output.{'dx' if i == 0 else next(names, i)}", e)
    return out



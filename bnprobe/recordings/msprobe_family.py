"""MindStudio Probe (msprobe) dumps: the normalisation family's calls (LayerNorm, RMSNorm, GroupNorm, InstanceNorm) as
recordings, each named by its layer as a family call is (``norm``, ``normalized_shape``, ``groups``).

The records read (PyTorch dumps; what msprobe 26.x hooks, ``pytorch/dump/api_dump/support_wrap_ops.yaml``):

- ``Functional.layer_norm`` (what ``nn.LayerNorm`` calls), ``Torch.layer_norm``, ``Torch.native_layer_norm`` and
  ``Aten.native_layer_norm`` (msprobe's ACL-graph dumper names aten ops so; read with the native function's
  arguments, the aten schema's — not seen in a real dump here: msprobe 26.2 hooks no aten op on the CPU);
- ``Functional.group_norm`` (``nn.GroupNorm``), ``Torch.group_norm``, ``Torch.native_group_norm``,
  ``Aten.native_group_norm``;
- ``Functional.instance_norm`` (``nn.InstanceNorm1d/2d/3d``) and ``Torch.instance_norm``;
- ``NPU.npu_rms_norm`` and ``NPU.npu_add_rms_norm`` (torch_npu's fused RMSNorm; for the latter the residual sum
  ``x1 + x2`` that the kernel returns as its third output is the normalised x).

msprobe records only the outermost hooked call (``F.layer_norm`` does not also give ``Torch.layer_norm``) and no
``rms_norm`` at all: ``nn.RMSNorm`` has no API record.  Each record holds the call's arguments (``input_args``,
``input_kwargs``) and outputs; the functional records hold y alone (the statistics the kernel saved are not among
their outputs: the engine uses the golden's), the ``native_*`` ones y, mean and rstd, ``npu_rms_norm`` y and rstd.
A backward record holds the gradients of the autograd node behind the first output (msprobe hooks ``grad_fn``):
dy in, dx, dγ, dβ out (null where nothing required them).  ``F.instance_norm``'s output comes from a view of the
batch-norm kernel's (y reshaped from (1, N·C, ...)), so its backward record holds that view's gradient — dy again,
not dx: at the mix level the module's own records give dx (``Module.<path>.InstanceNorm2d.backward.K``) and dγ,
dβ (its ``parameters_grad``); at L1 its backward is not read, and a note says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.layout import NormShape
from bnprobe.numerics.rounding import round_to
from bnprobe.recordings.msprobe_records import (
    SUMMARY_KEYS,
    check_parameters_grad,
    is_tensor,
    json_kind,
    load_tensor,
    record_list,
    scalar_of,
    summary_value,
    tensor_format,
    tensor_shape,
)
from bnprobe.recordings.types import CallRef, Recording, check_eps_momentum

__all__ = ["FamilyApi", "FAMILY_APIS", "family_api", "family_ref", "read_family_call", "read_family_summaries",
           "rms_modules"]


@dataclass(frozen=True)
class FamilyApi:
    """One hooked API of the family: its layer, its positional arguments by name (the schema's order), ε's default
    (None: the schema has none, the record must hold it), its outputs and its backward's outputs, by name."""

    norm: str
    order: tuple[str, ...]
    eps_default: float | None
    outputs: tuple[str, ...] = ("y",)
    grads: tuple[str, ...] = ("dx", "dgamma", "dbeta")


_LAYER = ("input", "normalized_shape", "weight", "bias", "eps")
_NATIVE_GROUP = ("input", "weight", "bias", "N", "C", "HxW", "group", "eps")
_SAVED = ("y", "saved_mean", "saved_rstd")
# keyed by the record's prefix and API; the orders are torch's signatures (torch/nn/functional.py, the native
# functions' schemas) and torch_npu's (npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor,
# Tensor); npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor))
FAMILY_APIS = {
    ("Functional", "layer_norm"): FamilyApi("layer", _LAYER, 1e-5),
    ("Torch", "layer_norm"): FamilyApi("layer", (*_LAYER, "cudnn_enable"), 1e-5),
    ("Torch", "native_layer_norm"): FamilyApi("layer", _LAYER, None, _SAVED),
    ("Aten", "native_layer_norm"): FamilyApi("layer", _LAYER, None, _SAVED),
    ("Functional", "group_norm"): FamilyApi("group", ("input", "num_groups", "weight", "bias", "eps"), 1e-5),
    ("Torch", "group_norm"): FamilyApi("group", ("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"),
                                       1e-5),
    ("Torch", "native_group_norm"): FamilyApi("group", _NATIVE_GROUP, None, _SAVED),
    ("Aten", "native_group_norm"): FamilyApi("group", _NATIVE_GROUP, None, _SAVED),
    ("Functional", "instance_norm"): FamilyApi("instance", ("input", "running_mean", "running_var", "weight", "bias",
                                                            "use_input_stats", "momentum", "eps"), 1e-5),
    ("Torch", "instance_norm"): FamilyApi("instance", ("input", "weight", "bias", "running_mean", "running_var",
                                                       "use_input_stats", "momentum", "eps", "cudnn_enabled"), None),
    ("NPU", "npu_rms_norm"): FamilyApi("rms", ("input", "weight", "eps"), 1e-6, ("y", "saved_rstd"), ("dx", "dgamma")),
    ("NPU", "npu_add_rms_norm"): FamilyApi("rms", ("x1", "x2", "weight", "eps"), 1e-6, ("y", "saved_rstd", "x"), ()),
}
# keyword names as the APIs spell them -> ours
_KWARGS = {"self": "input", "gamma": "weight", "beta": "bias", "epsilon": "eps"}
_TENSOR_ARGS = ("weight", "bias", "running_mean", "running_var", "x1", "x2")


def family_api(call: str) -> FamilyApi | None:
    """The family API a record name (without .forward/.backward) stands for, or None."""
    parts = call.split(".")
    if len(parts) != 3 or not parts[-1].isdigit():
        return None
    return FAMILY_APIS.get((parts[0], parts[1]))


def rms_modules(data: dict[str, Any], construct: dict[str, str]) -> list[str]:
    """The forward records of RMSNorm modules (``Module.<path>.<Class>.forward.K``, a class whose name ends in
    RMSNorm: torch's, Llama's...) that no family API record of the dump stands for (msprobe hooks no ``rms_norm``:
    ``nn.RMSNorm`` and Hugging Face's RMSNorm show only as modules, whose records hold no ε)."""
    inside = {construct.get(k) for k in data if k.endswith(".forward") and family_api(k[: -len(".forward")])}
    return [k for k in data if k.startswith("Module.") and ".forward." in k
            and k.split(".forward.")[0].endswith("RMSNorm") and k not in inside]


def _args(call: str, api: FamilyApi, fwd: dict[str, Any], where: str) -> dict[str, Any]:
    """The call's arguments by name: positional ones in the schema's order, then the keywords."""
    pos, kw = fwd.get("input_args", []), fwd.get("input_kwargs", {})
    kw = {} if kw is None else kw
    if not isinstance(pos, list) or not isinstance(kw, dict):
        raise BNProbeError(f"{where}: {call}.forward has input_args/input_kwargs of the wrong JSON type")
    if len(pos) > len(api.order):
        raise BNProbeError(f"{where}: {call}.forward has {len(pos)} positional arguments; the API takes "
                           f"{len(api.order)} ({', '.join(api.order)})")
    args: dict[str, Any] = dict(zip(api.order, pos))
    args.update({_KWARGS.get(k, k): v for k, v in kw.items()})
    first = "x1" if "x1" in api.order else "input"
    for name in (first, *(("x2",) if first == "x1" else ())):
        if not is_tensor(args.get(name)):
            raise BNProbeError(f"{where}: {call}.forward has no {name} tensor ({json_kind(args.get(name))})")
    for name in _TENSOR_ARGS:
        v = args.get(name)
        if v is not None and not is_tensor(v) and not (isinstance(v, dict) and v.get("value") is None):
            raise BNProbeError(f"{where}: {call}.forward {name} is {json_kind(v)}, not a tensor record or null")
    return args


def _scalar(args: dict[str, Any], name: str, default: Any, call: str, where: str) -> Any:
    """The recorded value of argument ``name``; ``default`` when not passed (None: it must be recorded)."""
    v = scalar_of(args[name], None) if name in args else default
    if v is None:
        raise BNProbeError(f"{where}: {call} records no {name}" + (" (null)" if name in args else ""))
    return v


def _int(v: Any, name: str, call: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BNProbeError(f"{where}: {call} records {name} = {v!r}, not an integer")
    return v


def _ints(entry: Any, call: str, where: str) -> tuple[int, ...]:
    """normalized_shape as recorded: a list of int entries, a torch.Size entry, or one int."""
    v = entry
    if isinstance(v, dict):
        v = v.get("value")
    if isinstance(v, list):
        v = [e.get("value") if isinstance(e, dict) else e for e in v]
        if v and all(isinstance(d, int) and not isinstance(d, bool) for d in v):
            return tuple(v)
    elif isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    raise BNProbeError(f"{where}: {call} records normalized_shape as {json_kind(entry)}, not a list of integers")


@dataclass(frozen=True)
class _Layer:
    """What places a call's statistics, read from its arguments: the layer's shape, ε, and notes."""

    shape: NormShape
    eps: float
    notes: tuple[str, ...] = ()


def _layer(call: str, api: FamilyApi, args: dict[str, Any], x_shape: tuple[int, ...], where: str) -> _Layer:
    """The layer of a call from its arguments and x's shape (checked: each problem in one line)."""
    notes: list[str] = []
    normalized: tuple[int, ...] | None = None
    groups: int | None = None
    if api.norm == "layer":
        if args.get("normalized_shape") is None:
            raise BNProbeError(f"{where}: {call} records no normalized_shape")
        normalized = _ints(args["normalized_shape"], call, where)
    elif api.norm == "rms":  # torch_npu's RMSNorm normalises over γ's dims
        if not is_tensor(args.get("weight")):
            raise BNProbeError(f"{where}: {call} records no gamma tensor, whose dims are the ones normalised")
        normalized = tensor_shape(args["weight"], where)
    elif api.norm == "group" and "num_groups" in api.order:
        groups = _int(_scalar(args, "num_groups", None, call, where), "num_groups", call, where)
    elif api.norm == "group":
        n, c, hxw, groups = (_int(_scalar(args, k, None, call, where), k, call, where)
                             for k in ("N", "C", "HxW", "group"))
        if len(x_shape) < 2 or (n, c, hxw) != (x_shape[0], x_shape[1], math.prod(x_shape[2:])):
            raise BNProbeError(f"{where}: {call} records N, C, HxW = {n}, {c}, {hxw}, which disagree with x's shape "
                               f"{list(x_shape)}")
    else:  # instance
        if _scalar(args, "use_input_stats", True, call, where) is not True:
            raise BNProbeError(f"{where}: {call} normalises with its running statistics (use_input_stats false): "
                               "bnprobe's InstanceNorm is the batch-statistics kernel")
        if is_tensor(args.get("running_mean")) or is_tensor(args.get("running_var")):
            notes.append("the running statistics (track_running_stats) the kernel updates are not judged: msprobe "
                         "records them before the call only")
    try:
        shape = NormShape.of(api.norm, x_shape, normalized, groups)
    except BNProbeError as exc:
        raise BNProbeError(f"{where}: {call}: {exc}") from None
    eps = _scalar(args, "eps", api.eps_default, call, where)
    if "eps" not in args:
        notes.append(f"ε not recorded (the call left it to the API's default): {api.eps_default:g} assumed")
    return _Layer(shape, eps, tuple(notes))


@dataclass(frozen=True)
class _Backward:
    """Where a call's backward is read: its own record's (``api``), its module's (``module``: an InstanceNorm's at
    the mix level), or nowhere (``None``, with the reason)."""

    source: str | None
    why: str = ""


def _backward_source(data: dict[str, Any], call: str, api: FamilyApi, x_shape: tuple[int, ...], module: str | None,
                     where: str) -> _Backward:
    bwd = data.get(f"{call}.backward")
    if bwd is None:
        return _Backward(None)
    if not api.grads:
        return _Backward(None, f"{call}.backward is not read: torch_npu registers no derivative for npu_add_rms_norm "
                               "(op-plugin's derivatives.yaml), so the record is not its kernel's backward")
    if not isinstance(bwd, dict):
        raise BNProbeError(f"{where}: {call}.backward is not a JSON object")
    outs = record_list(bwd, "output", f"{where}: {call}.backward")
    if api.norm == "instance" and not any(is_tensor(o) and tensor_shape(o, where) == x_shape for o in outs):
        mod_bwd = module.replace(".forward.", ".backward.") if module else None
        if mod_bwd is not None and isinstance(data.get(mod_bwd), dict):
            return _Backward("module")
        return _Backward(None, f"{call}.backward is not read: F.instance_norm's y is a view of the batch-norm "
                               "kernel's output, and msprobe records that view's gradient (dy as (1, N·C, ...)), not "
                               "dx, dγ, dβ; a mix-level dump's InstanceNorm module record holds them")
    return _Backward("api")


def family_ref(name: str, dj: Path, doc: dict[str, Any], call: str, api: FamilyApi, module: str | None,
               load: Callable[[], Any]) -> CallRef:
    """The CallRef of a family record, nothing loaded: its shape and format, training (a family layer always
    normalises with its own statistics), whether a readable backward was recorded."""
    data, where, task = doc["data"], str(dj), str(doc.get("task") or "tensor")
    fwd = data[f"{call}.forward"]
    if not isinstance(fwd, dict):
        raise BNProbeError(f"{where}: {call}.forward is not a JSON object")
    args = _args(call, api, fwd, where)
    x = args["x1" if "x1" in args else "input"]
    shape = tensor_shape(x, where)
    back = _backward_source(data, call, api, shape, module, where)
    return CallRef(name=name, module=module, shape=shape, dtype=tensor_format(x, where), training=True,
                   has_backward=back.source is not None, task=task, load=load)


def read_family_call(dj: Path, doc: dict[str, Any], call: str, module: str | None = None,
                     assume: dict[str, float] | None = None) -> Recording:
    """One family call of an msprobe tensor dump as a Recording: x, γ, β, ε, the layer in its meta (norm,
    normalized_shape, groups), y and the statistics the kernel returned (native and NPU calls), and with a backward
    dy, dx, dγ, dβ (where recorded).  ``module``: the enclosing module's forward record (mix level), whose
    ``parameters_grad`` is checked against dγ and dβ (and gives them, with the module's backward, to an InstanceNorm
    call).  ``assume``: an ε given for the call (dump:DIR,eps=E) replaces the API's default where the record holds
    none, and must agree with a recorded one."""
    data, where, base = doc["data"], str(dj), dj.parent
    api = family_api(call)
    if api is None:
        raise BNProbeError(f"{where}: {call} is not a normalisation-family record")
    fwd = data[f"{call}.forward"]
    args = _args(call, api, fwd, where)
    notes: list[str] = []
    outs = record_list(fwd, "output", f"{where}: {call}.forward")
    if "x1" in args:  # npu_add_rms_norm: the normalised x is the residual sum x1 + x2, its third output
        x, dtype = _residual_sum(base, where, call, args, outs, notes)
    else:
        x, dtype = load_tensor(base, args["input"], f"{call}.forward input")
    given = (assume or {}).get("eps")
    if given is not None and "eps" in args and scalar_of(args["eps"], None) != given:
        raise BNProbeError(f"{where}: {call} records eps = {scalar_of(args['eps'], None)!r}; eps={given:g} "
                           "contradicts it")
    if given is not None and "eps" not in args:
        notes.append(f"ε not recorded (the call left it to the API's default): {given:g} as given")
        args = {"eps": {"type": "float", "value": given}, **args}
    layer = _layer(call, api, args, tuple(x.shape), where)
    ns = layer.shape
    notes.extend(layer.notes)
    tensors: dict[str, np.ndarray] = {"x": x}
    formats = {"x": dtype}
    for ours, theirs in (("gamma", "weight"), ("beta", "bias")):
        if is_tensor(args.get(theirs)):
            if api.norm == "rms" and ours == "beta":
                continue
            a, f = load_tensor(base, args[theirs], f"{call}.forward {theirs}")
            if a.size != math.prod(ns.param_shape):
                raise BNProbeError(f"{where}: {call}.forward {theirs} has shape {list(a.shape)}, the layer's "
                                   f"parameters {list(ns.param_shape)}")
            tensors[ours], formats[ours] = a.reshape(ns.param_shape), f
    params = formats.get("gamma", formats.get("beta", dtype))
    eps, _ = check_eps_momentum(layer.eps, None, params, f"{where}: {call}")
    outputs, out_formats = _outputs(base, where, call, api, outs, ns)
    saved = "saved_value" in outputs
    meta = {"framework": doc.get("framework"), "task": doc.get("task"), "level": doc.get("level"), "call": call,
            "training": True, "affine": "gamma" in tensors, "norm": api.norm,
            "normalized_shape": list(ns.normalized) if api.norm in ("layer", "rms") else None,
            "groups": ns.groups if api.norm == "group" else None, "weight_offset": 0.0, "notes": notes}
    rec = Recording(adapter=f"msprobe:{call}", dtype=dtype, params=params, layout="channels_first", eps=eps,
                    momentum=None, saved_kind="invstd" if saved else None, meta=meta, source=where)
    rec.tensors["train"] = {"inputs": dict(tensors), "outputs": outputs}
    rec.formats.update({f"train.inputs.{k}": f for k, f in formats.items()})
    rec.formats.update({f"train.outputs.{k}": f for k, f in out_formats.items()})
    back = _backward_source(data, call, api, tuple(x.shape), module, where)
    if back.why:
        notes.append(back.why)
    if back.source == "api":
        _read_backward(rec, base, where, call, data[f"{call}.backward"], api, ns, (outputs, out_formats))
        if module:
            check_parameters_grad(rec, data, base, module)
    elif back.source == "module" and module:
        _module_backward(rec, base, where, data, module, ns, (outputs, out_formats))
    return rec


def _residual_sum(base: Path, where: str, call: str, args: dict[str, Any], outs: list[Any],
                  notes: list[str]) -> tuple[np.ndarray, str]:
    """npu_add_rms_norm's normalised x: its third output (x1 + x2 as the kernel returns it, in the inputs' format),
    checked against x1 + x2 rounded once; x1 + x2 rounded once where the record lacks it."""
    x1, f1 = load_tensor(base, args["x1"], f"{call}.forward x1")
    x2, f2 = load_tensor(base, args["x2"], f"{call}.forward x2")
    if x1.shape != x2.shape or f1 != f2:
        raise BNProbeError(f"{where}: {call}.forward x1 and x2 differ in shape or format ({list(x1.shape)} {f1}, "
                           f"{list(x2.shape)} {f2})")
    exact = round_to(x1 + x2, f1)  # (the sum of two 16- or 32-bit values, rounded once from float64)
    if len(outs) > 2 and is_tensor(outs[2]):
        x, fx = load_tensor(base, outs[2], f"{call}.forward output 2")
        if x.shape != x1.shape or fx != f1:
            raise BNProbeError(f"{where}: {call}.forward output 2 (x = x1 + x2) has shape {list(x.shape)} in {fx}, "
                               f"x1 {list(x1.shape)} in {f1}")
        off = int(np.count_nonzero(~((x == exact) | (np.isnan(x) & np.isnan(exact)))))
        notes.append("npu_add_rms_norm: x, the input normalised, is the residual sum x1 + x2 the kernel returned "
                     f"(its third output, in {f1})" + ("" if not off else
                                                        f"; it differs from x1 + x2 rounded once at {off} of "
                                                        f"{x.size} elements"))
        return x, fx
    notes.append(f"npu_add_rms_norm: x, the input normalised, is the residual sum x1 + x2 rounded once to {f1} (the "
                 "record lacks the kernel's third output)")
    return exact, f1


def _outputs(base: Path, where: str, call: str, api: FamilyApi, outs: list[Any], ns: NormShape
             ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """y and, where the API returns them, the saved mean and rstd (one value per row)."""
    if not outs or not is_tensor(outs[0]):
        raise BNProbeError(f"{where}: {call}.forward records no output tensor y")
    y, fy = load_tensor(base, outs[0], f"{call}.forward output 0")
    if y.shape != ns.shape:
        raise BNProbeError(f"{where}: {call}.forward output 0 (y) has shape {list(y.shape)}, x {list(ns.shape)}")
    got, fmts = {"y": y}, {"y": fy}
    for i, name in enumerate(api.outputs):
        if name not in ("saved_mean", "saved_rstd") or i >= len(outs) or not is_tensor(outs[i]):
            continue
        a, f = load_tensor(base, outs[i], f"{call}.forward output {i}")
        if a.size != ns.rows:
            raise BNProbeError(f"{where}: {call}.forward output {i} ({name[6:]}) has {a.size} values; the layer has "
                               f"{ns.rows} rows (a statistic each)")
        key = "saved_mean" if name == "saved_mean" else "saved_value"
        got[key], fmts[key] = a.reshape(-1), f
    if "saved_mean" in got and "saved_value" not in got:  # (a mean without its rstd is not a Saved)
        del got["saved_mean"], fmts["saved_mean"]
    return got, fmts


def _grad(base: Path, where: str, call: str, entries: list[Any], i: int, want: tuple[int, ...], name: str
          ) -> tuple[np.ndarray, str] | None:
    """Backward output ``i`` (None when null), checked to hold ``want``'s number of values."""
    if i >= len(entries) or not is_tensor(entries[i]):
        return None
    a, f = load_tensor(base, entries[i], f"{call}.backward output {i}")
    if a.size != math.prod(want):
        raise BNProbeError(f"{where}: {call}.backward output {i} ({name}) has shape {list(a.shape)}, not "
                           f"{list(want)}")
    return a.reshape(want), f


def _put_backward(rec: Recording, dy: tuple[np.ndarray, str], grads: dict[str, tuple[np.ndarray, str]],
                  forward: tuple[dict[str, np.ndarray], dict[str, str]]) -> None:
    ins = rec.tensors["train"]["inputs"]
    b_ins = {"dy": dy[0], "x": ins["x"], **({"gamma": ins["gamma"]} if "gamma" in ins else {})}
    fins = {"dy": dy[1], "x": rec.formats["train.inputs.x"],
            **({"gamma": rec.formats["train.inputs.gamma"]} if "gamma" in ins else {})}
    outputs, out_formats = forward
    for k in ("saved_mean", "saved_value"):  # (the statistics the kernel's backward read, where it returned them)
        if k in outputs:
            b_ins[k], fins[k] = outputs[k], out_formats[k]
    rec.tensors["backward"] = {"inputs": b_ins, "outputs": {k: v[0] for k, v in grads.items()}}
    rec.formats.update({f"backward.inputs.{k}": f for k, f in fins.items()})
    rec.formats.update({f"backward.outputs.{k}": v[1] for k, v in grads.items()})


def _read_backward(rec: Recording, base: Path, where: str, call: str, bwd: dict[str, Any], api: FamilyApi,
                   ns: NormShape, forward: tuple[dict[str, np.ndarray], dict[str, str]]) -> None:
    """The call's own backward record: dy in, its gradients out by the API's order (null ones not computed)."""
    ins = record_list(bwd, "input", f"{where}: {call}.backward")
    if not ins or not is_tensor(ins[0]):
        raise BNProbeError(f"{where}: {call}.backward records no dy")
    dy = load_tensor(base, ins[0], f"{call}.backward input 0")
    if dy[0].shape != ns.shape:
        raise BNProbeError(f"{where}: {call}.backward input 0 (dy) has shape {list(dy[0].shape)}, x "
                           f"{list(ns.shape)}")
    outs = record_list(bwd, "output", f"{where}: {call}.backward")
    grads = {}
    for i, name in enumerate(api.grads):
        if name == "dbeta" and "beta" not in rec.tensors["train"]["inputs"]:
            continue
        g = _grad(base, where, call, outs, i, ns.shape if name == "dx" else ns.param_shape, name)
        if g is not None:
            grads[name] = g
    if not grads:
        rec.meta["notes"].append(f"{call}.backward holds no gradient (nothing required one): dx, dγ, dβ not judged")
    _put_backward(rec, dy, grads, forward)


def _module_backward(rec: Recording, base: Path, where: str, data: dict[str, Any], module: str, ns: NormShape,
                     forward: tuple[dict[str, np.ndarray], dict[str, str]]) -> None:
    """An InstanceNorm call's backward from its module's records (mix level): dy and dx from the module's backward,
    dγ and dβ from its parameters_grad when the module ran once in the dump (else they sum its calls: not read)."""
    key = module.replace(".forward.", ".backward.")
    bwd = data[key]
    ins, outs = (record_list(bwd, k, f"{where}: {key}") for k in ("input", "output"))
    if not ins or not is_tensor(ins[0]):
        raise BNProbeError(f"{where}: {key} records no dy")
    dy = load_tensor(base, ins[0], f"{key} input 0")
    if dy[0].shape != ns.shape:
        raise BNProbeError(f"{where}: {key} input 0 (dy) has shape {list(dy[0].shape)}, x {list(ns.shape)}")
    grads = {}
    dx = _grad(base, where, key, outs, 0, ns.shape, "dx")
    if dx is not None:
        grads["dx"] = dx
    head = module[: module.index(".forward.")]
    runs = sum(1 for k in data if k.startswith(f"{head}.forward."))
    pg = data.get(module.replace(".forward.", ".parameters_grad."))
    taken = []
    if runs == 1 and isinstance(pg, dict):
        for ours, theirs in (("dgamma", "weight"), ("dbeta", "bias")):
            if ours[1:] not in rec.tensors["train"]["inputs"]:
                continue
            e = [v for v in record_list(pg, theirs, f"{where}: {key}") if is_tensor(v)]
            g = _grad(base, where, f"{key} parameters_grad {theirs}", e, 0, ns.param_shape, ours) if e else None
            if g is not None:
                grads[ours] = g
                taken.append(theirs)
    rec.meta["notes"].append(
        f"the backward is read from the module's records: dy and dx from {key}"
        + (f", d{'γ' if taken[0] == 'weight' else 'β'}{', dβ' if len(taken) > 1 else ''} from its parameters_grad"
           if taken else "")
        + ("" if runs == 1 else f"; dγ, dβ not read: the module ran {runs} times, and its parameters' gradients "
                                "sum its calls"))
    _put_backward(rec, dy, grads, forward)


def read_family_summaries(dj: Path, doc: dict[str, Any], call: str) -> dict[str, dict[str, Any]]:
    """A statistics-task family call: per recorded tensor (``forward.input.x``, ``forward.input.gamma``,
    ``forward.output.y``, ``forward.output.saved_rstd``, ``backward.input.dy``, ``backward.output.dx``...), its
    dtype, shape and max/min/mean/norm."""
    data, where = doc["data"], str(dj)
    api = family_api(call)
    if api is None:
        raise BNProbeError(f"{where}: {call} is not a normalisation-family record")
    args = _args(call, api, data[f"{call}.forward"], where)
    out: dict[str, dict[str, Any]] = {}

    def put(key: str, e: Any) -> None:
        if is_tensor(e):
            out[key] = {"dtype": tensor_format(e, where), "shape": list(tensor_shape(e, where)),
                        **{k: summary_value(e.get(k)) for k in SUMMARY_KEYS}}

    x_in = args["x1" if "x1" in args else "input"]
    x_shape = tensor_shape(x_in, where)
    outs = record_list(data[f"{call}.forward"], "output", f"{where}: {call}.forward")
    if "x1" in args:
        put("forward.input.x1", args["x1"])
        put("forward.input.x2", args["x2"])
        put("forward.input.x", outs[2] if len(outs) > 2 else None)
    else:
        put("forward.input.x", x_in)
    put("forward.input.gamma", args.get("weight"))
    if api.norm != "rms":
        put("forward.input.beta", args.get("bias"))
    for i, name in enumerate(api.outputs):
        if name != "x" and i < len(outs):
            put(f"forward.output.{name}", outs[i])
    bwd = data.get(f"{call}.backward")
    if isinstance(bwd, dict) and api.grads:
        ins = record_list(bwd, "input", f"{where}: {call}.backward")
        put("backward.input.dy", ins[0] if ins else None)
        grads = record_list(bwd, "output", f"{where}: {call}.backward")
        for i, name in enumerate(api.grads):
            e = grads[i] if i < len(grads) else None
            if name == "dx" and is_tensor(e) and tensor_shape(e, where) != x_shape:
                continue  # (F.instance_norm's: the gradient of y's view, not dx)
            put(f"backward.output.{name}", e)
    return out

"""Recorded tensors as an adapter: bnprobe's own dumps and msprobe dump directories.

bnprobe dump: a folder with ``bnprobe-dump.json`` (metadata: adapter, dtype, params format,
layout, eps, momentum, seed, and for each recorded mode its tensors with shape and format) and
``tensors.npz`` (every tensor; 16-bit formats stored exactly as float32).  Written through
temporary files and renamed into place, tensors first and metadata last, so a folder with
metadata is complete.

msprobe dump: ``dump.json`` + ``dump_tensor_data/`` (``.npy``, or ``.pt`` when torch is
installed) as MindStudio Probe writes them (layout in shared/reference/msprobe-metrics.md),
for its BatchNorm APIs, forward and backward.
"""

from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    ForwardOutput,
    KernelAdapter,
    Prepared,
    Saved,
)
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.numerics.rounding import is_representable
from bnprobe.reports import atomic_write_bytes, atomic_write_text, check_targets

__all__ = ["Recording", "write_dump", "load_dump", "DumpAdapter", "read_msprobe", "MSPROBE_BN_APIS", "META_NAME",
           "TENSORS_NAME"]

META_NAME = "bnprobe-dump.json"
TENSORS_NAME = "tensors.npz"
FORMAT_TAG = "bnprobe-dump"

# inputs and outputs of each mode, in a fixed vocabulary
INPUTS = {"train": ("x", "gamma", "beta", "running_mean", "running_var"),
          "infer": ("x", "gamma", "beta", "running_mean", "running_var"),
          "backward": ("dy", "x", "gamma", "saved_mean", "saved_value")}
OUTPUTS = {"train": ("y", "saved_mean", "saved_value", "running_mean_out", "running_var_out"),
           "infer": ("y",), "backward": ("dx", "dgamma", "dbeta")}


@dataclass
class Recording:
    """What one kernel did: per mode, its input and output tensors (float64, each a value of its format)."""

    adapter: str
    dtype: str
    params: str
    layout: str
    eps: float
    momentum: float | None
    saved_kind: str | None
    tensors: dict[str, dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)  # mode -> io -> name
    formats: dict[str, str] = field(default_factory=dict)  # "mode.io.name" -> format
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in ("train", "infer", "backward") if m in self.tensors)

    def get(self, mode: str, io: str, name: str) -> np.ndarray | None:
        return self.tensors.get(mode, {}).get(io, {}).get(name)


# ---- bnprobe's own format -------------------------------------------------------------------------

def _storage(a: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(a, dtype=np.float64 if fmt == "fp64" else np.float32)


def write_dump(rec: Recording, out: str | Path, *, force: bool = False) -> list[Path]:
    """Write a Recording as a bnprobe dump folder; returns the files written."""
    out = Path(out)
    meta_path, tensor_path = out / META_NAME, out / TENSORS_NAME
    check_targets([meta_path, tensor_path], force=force)
    arrays: dict[str, np.ndarray] = {}
    entries: dict[str, Any] = {}
    for mode, ios in rec.tensors.items():
        entries[mode] = {}
        for io, named in ios.items():
            entries[mode][io] = {}
            for name, a in named.items():
                key = f"{mode}.{io}.{name}"
                fmt = rec.formats[key]
                arrays[key] = _storage(a, fmt)
                entries[mode][io][name] = {"key": key, "shape": list(np.shape(a)), "format": fmt}
    import io as _io

    buf = _io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(tensor_path, buf.getvalue())
    meta = {"format": FORMAT_TAG, "version": 1, "adapter": rec.adapter, "dtype": rec.dtype, "params": rec.params,
            "layout": rec.layout, "eps": rec.eps, "momentum": rec.momentum, "saved_kind": rec.saved_kind,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "meta": rec.meta, "records": entries}
    atomic_write_text(meta_path, json.dumps(meta, indent=2, default=str))
    return [tensor_path, meta_path]


def load_dump(path: str | Path) -> Recording:
    """Read a bnprobe dump folder (or msprobe dump folder), checking every tensor against the metadata."""
    p = Path(path)
    if not p.exists():
        raise BNProbeError(f"dump {str(p)!r} does not exist")
    if p.is_dir() and not (p / META_NAME).exists():
        return read_msprobe(p)
    meta_path = p if p.is_file() else p / META_NAME
    folder = meta_path.parent
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise BNProbeError(f"{meta_path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise BNProbeError(f"{meta_path}: not a bnprobe dump (no \"format\": \"{FORMAT_TAG}\")")
    for key in ("adapter", "dtype", "params", "layout", "eps", "records"):
        if key not in meta:
            raise BNProbeError(f"{meta_path}: metadata lacks {key!r}")
    tensor_path = folder / TENSORS_NAME
    if not tensor_path.is_file():
        raise BNProbeError(f"{tensor_path}: missing (the dump is incomplete)")
    try:
        with open(tensor_path, "rb") as fh, np.load(fh, allow_pickle=False) as npz:
            stored = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise BNProbeError(f"{tensor_path}: corrupt ({str(exc).splitlines()[0]})") from None
    rec = Recording(meta["adapter"], meta["dtype"], meta["params"], meta["layout"], float(meta["eps"]),
                    meta.get("momentum"), meta.get("saved_kind"), meta=meta.get("meta", {}), source=str(folder))
    for mode, ios in meta["records"].items():
        for io, named in ios.items():
            for name, entry in named.items():
                key = entry["key"]
                if key not in stored:
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} named in {META_NAME} is missing")
                a = stored[key].astype(np.float64)
                if list(a.shape) != list(entry["shape"]):
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} has shape {list(a.shape)} but {META_NAME} "
                                       f"says {entry['shape']}")
                if not is_representable(a, entry["format"]).all():
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} holds values that are not {entry['format']}")
                rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = a
                rec.formats[key] = entry["format"]
    return rec


# ---- msprobe ---------------------------------------------------------------------------------

MSPROBE_BN_APIS = ("batch_norm", "native_batch_norm", "cudnn_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional")
# positional order of each API's arguments
_F_ORDER = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_ATEN_ORDER = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
_NO_TRAINING_ORDER = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")


def _find_dump_json(folder: Path) -> Path:
    direct = folder / "dump.json"
    if direct.is_file():
        return direct
    found = sorted(folder.glob("step*/rank*/dump.json")) + sorted(folder.glob("rank*/dump.json"))
    if not found:
        raise BNProbeError(f"{folder}: neither a bnprobe dump ({META_NAME}) nor an msprobe dump (dump.json)")
    return found[0]


def _torch_dtype_name(s: str) -> str:
    return get_format(s.replace("torch.", "")).name


def _load_tensor(folder: Path, entry: dict[str, Any], where: str) -> tuple[np.ndarray, str]:
    name = entry.get("data_name")
    if not name:
        raise BNProbeError(f"{where}: tensor record has no data_name")
    path = folder / "dump_tensor_data" / name
    if not path.is_file():
        alt = [path.with_suffix(s) for s in (".npy", ".pt") if path.with_suffix(s).is_file()]
        if not alt:
            raise BNProbeError(f"{path}: missing (named in {where})")
        path = alt[0]
    try:
        if path.suffix == ".pt":
            try:
                import torch
            except ImportError:
                raise BNProbeError(f"{path}: a .pt tensor needs torch (pip install 'bnprobe[torch]')") from None
            t = torch.load(path, map_location="cpu", weights_only=True)
            a = t.detach().to(torch.float64).numpy()
        else:
            a = np.load(path, allow_pickle=False).astype(np.float64)
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure is a corrupt file to the user
        raise BNProbeError(f"{path}: corrupt or unreadable ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    shape = entry.get("shape")
    if shape is not None and list(a.shape) != list(shape):
        raise BNProbeError(f"{path}: shape {list(a.shape)} disagrees with dump.json's {list(shape)}")
    fmt = _torch_dtype_name(entry.get("dtype", "torch.float32"))
    return a, fmt


def _is_tensor(entry: Any) -> bool:
    return isinstance(entry, dict) and "data_name" in entry


def read_msprobe(folder: str | Path, call: str | None = None) -> Recording:
    """The first BatchNorm call (or ``call``, e.g. ``Functional.batch_norm.0``) of an msprobe dump."""
    folder = Path(folder)
    dj = _find_dump_json(folder)
    try:
        doc = json.loads(dj.read_text())
        data = doc["data"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BNProbeError(f"{dj}: not an msprobe dump.json ({type(exc).__name__})") from None
    calls = []
    for key in data:
        parts = key.split(".")
        if len(parts) >= 4 and parts[-1] == "forward" and parts[-3] in MSPROBE_BN_APIS:
            calls.append(".".join(parts[:-1]))
    if not calls:
        raise BNProbeError(f"{dj}: no BatchNorm API among {len(data)} records ({', '.join(MSPROBE_BN_APIS)})")
    if call is None:
        call = calls[0]
    elif call not in calls:
        raise BNProbeError(f"{dj}: no BatchNorm call {call!r}; found {', '.join(calls)}")
    api_type, api = call.split(".")[0], call.split(".")[-2]
    base = dj.parent
    fwd = data[f"{call}.forward"]
    order = _NO_TRAINING_ORDER if api.endswith("no_training") else (
        _F_ORDER if api_type == "Functional" else _ATEN_ORDER)
    args: dict[str, Any] = dict(zip(order, fwd.get("input_args", [])))
    args.update(fwd.get("input_kwargs", {}) or {})
    if "input" not in args or not _is_tensor(args["input"]):
        raise BNProbeError(f"{dj}: {call}.forward has no input tensor")

    def value(name: str, default: Any) -> Any:
        e = args.get(name)
        return e.get("value", default) if isinstance(e, dict) and not _is_tensor(e) else (default if e is None else e)

    training = bool(value("training", not api.endswith("no_training")))
    eps = float(value("eps", 1e-5))
    momentum = value("momentum", 0.1)
    x, dtype = _load_tensor(base, args["input"], f"{call}.forward input")
    tensors: dict[str, np.ndarray] = {"x": x}
    formats = {"x": dtype}
    for ours, theirs in (("gamma", "weight"), ("beta", "bias"), ("running_mean", "running_mean"),
                         ("running_var", "running_var")):
        if _is_tensor(args.get(theirs)):
            tensors[ours], formats[ours] = _load_tensor(base, args[theirs], f"{call}.forward {theirs}")
    params = formats.get("gamma", formats.get("running_mean", dtype))
    mode = "train" if training else "infer"
    outs = [o for o in fwd.get("output", []) if _is_tensor(o)]
    if not outs:
        raise BNProbeError(f"{dj}: {call}.forward records no output tensor")
    outputs: dict[str, np.ndarray] = {}
    out_formats: dict[str, str] = {}
    outputs["y"], out_formats["y"] = _load_tensor(base, outs[0], f"{call}.forward output 0")
    saved_kind = None
    if training and len(outs) >= 3:  # native variants: (y, save_mean, save_invstd[, ...])
        outputs["saved_mean"], out_formats["saved_mean"] = _load_tensor(base, outs[1], f"{call}.forward output 1")
        outputs["saved_value"], out_formats["saved_value"] = _load_tensor(base, outs[2], f"{call}.forward output 2")
        saved_kind = "invstd"
    rec = Recording(adapter=f"msprobe:{call}", dtype=dtype, params=params, layout="channels_first", eps=eps,
                    momentum=None if momentum is None else float(momentum), saved_kind=saved_kind,
                    meta={"framework": doc.get("framework"), "task": doc.get("task"), "call": call,
                          "calls": calls}, source=str(dj))
    rec.tensors[mode] = {"inputs": {k: v for k, v in tensors.items()}, "outputs": outputs}
    for k in tensors:
        rec.formats[f"{mode}.inputs.{k}"] = formats[k]
    for k in outputs:
        rec.formats[f"{mode}.outputs.{k}"] = out_formats[k]
    bwd = data.get(f"{call}.backward")
    if bwd is not None and saved_kind is not None:
        grads_in = [o for o in bwd.get("input", []) if _is_tensor(o)]
        grads_out = [o for o in bwd.get("output", []) if _is_tensor(o)]
        if not grads_in or not grads_out:
            raise BNProbeError(f"{dj}: {call}.backward lacks its gradient tensors")
        dy, fdy = _load_tensor(base, grads_in[0], f"{call}.backward input 0")
        loaded = [_load_tensor(base, o, f"{call}.backward output {i}") for i, o in enumerate(grads_out)]
        dx = next((a for a, _ in loaded if a.shape == x.shape), None)
        vecs = [(a, f) for a, f in loaded if a.shape == (x.shape[1],)]
        if dx is None or len(vecs) < 2:
            raise BNProbeError(f"{dj}: {call}.backward output does not hold dx, dweight and dbias")
        rec.tensors["backward"] = {
            "inputs": {"dy": dy, "x": x, "gamma": tensors.get("gamma", np.ones(x.shape[1])),
                       "saved_mean": outputs["saved_mean"], "saved_value": outputs["saved_value"]},
            "outputs": {"dx": dx, "dgamma": vecs[0][0], "dbeta": vecs[1][0]}}
        rec.formats.update({"backward.inputs.dy": fdy, "backward.inputs.x": dtype,
                            "backward.inputs.gamma": params, "backward.inputs.saved_mean": out_formats["saved_mean"],
                            "backward.inputs.saved_value": out_formats["saved_value"],
                            "backward.outputs.dx": dtype, "backward.outputs.dgamma": vecs[0][1],
                            "backward.outputs.dbeta": vecs[1][1]})
    return rec


# ---- recording an adapter and replaying a recording ----------------------------------------------

def record(adapter: KernelAdapter, *, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
           running_mean: np.ndarray, running_var: np.ndarray, dy: np.ndarray, dtype: str, eps: float = 1e-5,
           momentum: float | None = 0.1, layout: str = "channels_first", params: str = "fp32",
           modes: tuple[str, ...] = ("train", "infer", "backward"), meta: dict[str, Any] | None = None) -> Recording:
    """Run ``adapter`` in each mode on these inputs and keep every input and output."""
    from bnprobe.numerics.rounding import round_to

    fmt = get_format(dtype).name
    pf = fmt if params == "same" else ("fp64" if fmt == "fp64" else "fp32")
    caps = adapter.capabilities()
    c = np.shape(x)[1] if layout == "channels_first" or np.ndim(x) == 2 else np.shape(x)[-1]
    g = round_to(np.ones(c) if gamma is None else np.asarray(gamma, dtype=np.float64), pf)
    b = round_to(np.zeros(c) if beta is None else np.asarray(beta, dtype=np.float64), pf)
    rm, rv = round_to(np.asarray(running_mean, dtype=np.float64), pf), round_to(np.asarray(running_var, dtype=np.float64), pf)
    xs, dys = round_to(np.asarray(x, dtype=np.float64), fmt), round_to(np.asarray(dy, dtype=np.float64), fmt)
    rec = Recording(adapter.name, fmt, pf, layout, eps, momentum, caps.saved, meta=dict(meta or {}))

    def put(mode: str, io: str, name: str, a: np.ndarray, f: str) -> None:
        rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = np.asarray(a, dtype=np.float64)
        rec.formats[f"{mode}.{io}.{name}"] = f

    common = dict(dtype=fmt, eps=eps, layout=layout, params=params)
    saved: Saved | None = None
    if "train" in modes or "backward" in modes:
        out = adapter.forward_train(xs, g, b, rm, rv, momentum=momentum, **common)
        saved = out.saved
        if "train" in modes:
            for name, a, f in (("x", xs, fmt), ("gamma", g, pf), ("beta", b, pf), ("running_mean", rm, pf),
                               ("running_var", rv, pf)):
                put("train", "inputs", name, a, f)
            put("train", "outputs", "y", out.y, fmt)
            if saved is not None:
                sf = get_format(np.asarray(saved.value).dtype).name
                put("train", "outputs", "saved_mean", saved.mean, sf)
                put("train", "outputs", "saved_value", saved.value, sf)
            if out.running_mean is not None and out.running_var is not None:
                put("train", "outputs", "running_mean_out", out.running_mean, pf)
                put("train", "outputs", "running_var_out", out.running_var, pf)
    if "infer" in modes:
        out = adapter.forward_infer(xs, g, b, rm, rv, **common)
        for name, a, f in (("x", xs, fmt), ("gamma", g, pf), ("beta", b, pf), ("running_mean", rm, pf),
                           ("running_var", rv, pf)):
            put("infer", "inputs", name, a, f)
        put("infer", "outputs", "y", out.y, fmt)
    if "backward" in modes and saved is not None:
        bw = adapter.backward(dys, xs, g, saved, **common)
        sf = rec.formats.get("train.outputs.saved_value", "fp64")
        for name, a, f in (("dy", dys, fmt), ("x", xs, fmt), ("gamma", g, pf), ("saved_mean", saved.mean, sf),
                           ("saved_value", saved.value, sf)):
            put("backward", "inputs", name, a, f)
        put("backward", "outputs", "dx", bw.dx, fmt)
        put("backward", "outputs", "dgamma", bw.dgamma, pf)
        put("backward", "outputs", "dbeta", bw.dbeta, pf)
    return rec


class DumpAdapter(BaseAdapter):
    """Replays a Recording: given the recorded inputs, returns the recorded outputs."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.name = f"dump:{rec.source or rec.adapter}"

    def capabilities(self) -> Capabilities:
        return Capabilities(formats=(self.rec.dtype,), modes=self.rec.modes, layouts=(self.rec.layout,),
                            saved=self.rec.saved_kind or "none", deterministic=True, training_r1=True)

    def _check_inputs(self, mode: str, given: dict[str, np.ndarray | None]) -> None:
        want = self.rec.tensors[mode]["inputs"]
        for name, a in given.items():
            if name not in want or a is None:
                continue
            b = want[name]
            a = np.asarray(a, dtype=np.float64)
            if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
                raise BNProbeError(f"{self.name}: the {mode} input {name!r} differs from the recorded one; a dump "
                                   "replays only its own inputs (take them from the recording)")

    def inputs(self, mode: str) -> dict[str, np.ndarray]:
        """The recorded inputs of ``mode``, to call other adapters with."""
        if mode not in self.rec.tensors:
            raise BNProbeError(f"{self.name} recorded no {mode} call (it has {', '.join(self.rec.modes)})")
        return dict(self.rec.tensors[mode]["inputs"])

    def _out(self, mode: str, name: str) -> np.ndarray | None:
        a = self.rec.get(mode, "outputs", name)
        if a is None:
            return None
        return a.astype(get_format(self.rec.formats[f"{mode}.outputs.{name}"]).dtype)

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_inputs("train", {"x": p.x, **p.vectors})
        sm, sv = self._out("train", "saved_mean"), self._out("train", "saved_value")
        saved = Saved(sm, self.rec.saved_kind, sv) if sm is not None and sv is not None and self.rec.saved_kind \
            else None
        return ForwardOutput(self._out("train", "y"), saved, self._out("train", "running_mean_out"),
                             self._out("train", "running_var_out"), meta={"replayed": self.rec.source})

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_inputs("infer", {"x": p.x, **p.vectors})
        return ForwardOutput(self._out("infer", "y"), meta={"replayed": self.rec.source})

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        self._check_inputs("backward", {"dy": dy, "x": p.x, "gamma": p.vectors["gamma"]})
        return BackwardOutput(self._out("backward", "dx"), self._out("backward", "dgamma"),
                              self._out("backward", "dbeta"), meta={"replayed": self.rec.source})

    def _check_forward(self, out: ForwardOutput, p: Prepared, *, training: bool) -> None:
        if np.shape(out.y) != p.lay.shape:
            raise BNProbeError(f"{self.name}: recorded y has shape {np.shape(out.y)}, x has {p.lay.shape}")

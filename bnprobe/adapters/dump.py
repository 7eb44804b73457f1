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

import fnmatch
import json
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    ForwardOutput,
    MODES,
    KernelAdapter,
    Prepared,
    Saved,
    SAVED_KINDS,
    params_format,
    params_mode,
)
from bnprobe.adapters.msprobe import MSPROBE_BN_APIS, check_eps_momentum, read_json
from bnprobe.errors import BNProbeError
from bnprobe.formats import get_format
from bnprobe.inputs import npy_header
from bnprobe.kernels.layout import LAYOUTS
from bnprobe.numerics.rounding import is_representable
from bnprobe._files import atomic_write_bytes, atomic_write_text, check_targets

__all__ = ["Recording", "write_dump", "load_dump", "open_dump", "DumpAdapter", "read_msprobe", "record", "CallRef",
           "RecordedCalls", "read_calls", "MSPROBE_BN_APIS", "META_NAME", "TENSORS_NAME", "CALLS_NAME", "CALLS_TAG"]

META_NAME = "bnprobe-dump.json"
TENSORS_NAME = "tensors.npz"
FORMAT_TAG = "bnprobe-dump"

# the tensors a recorded mode cannot lack (a backward may lack a gradient the kernel did not compute)
REQUIRED = {"train": ({"x"}, {"y"}), "infer": ({"x", "running_mean", "running_var"}, {"y"}),
            "backward": ({"dy", "x"}, set())}


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
        return tuple(m for m in MODES if m in self.tensors)

    def get(self, mode: str, io: str, name: str) -> np.ndarray | None:
        return self.tensors.get(mode, {}).get(io, {}).get(name)

    @property
    def training(self) -> bool:
        """Whether the call ran in training mode (batch statistics)."""
        return "train" in self.tensors or bool(self.meta.get("training", False))

    @property
    def params_mode(self) -> str:
        """``same`` or ``fp32``: how the recorded parameter format relates to the input's."""
        return params_mode(self.dtype, self.params)

    def call_inputs(self) -> dict[str, Any]:
        """Everything a kernel was called with: x, gamma, beta, running_mean, running_var (None where not
        recorded), dy (None without a backward), eps, momentum, training, dtype, params ("same"/"fp32")."""
        mode = "train" if "train" in self.tensors else ("infer" if "infer" in self.tensors else "backward")
        ins = self.tensors[mode]["inputs"]
        bw = self.tensors.get("backward", {}).get("inputs", {})
        return {"x": ins["x"], "gamma": ins.get("gamma"), "beta": ins.get("beta"),
                "running_mean": ins.get("running_mean", bw.get("saved_mean") if not self.training else None),
                "running_var": ins.get("running_var", bw.get("saved_value") if not self.training else None),
                "dy": bw.get("dy"), "eps": self.eps, "momentum": self.momentum, "training": self.training,
                "dtype": self.dtype, "params": self.params_mode, "layout": self.layout}


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


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """A bnprobe dump's metadata, its keys and their JSON types checked."""
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise BNProbeError(f"{meta_path}: not a bnprobe dump (no \"format\": \"{FORMAT_TAG}\")")
    for key in ("adapter", "dtype", "params", "layout", "eps", "records"):
        if key not in meta:
            raise BNProbeError(f"{meta_path}: metadata lacks {key!r}")
    for key in ("adapter", "dtype", "params", "layout"):
        if not isinstance(meta[key], str):
            raise BNProbeError(f"{meta_path}: {key} is {meta[key]!r}, not a string")
    if meta["layout"] not in LAYOUTS:
        raise BNProbeError(f"{meta_path}: layout is {meta['layout']!r}, not one of {', '.join(LAYOUTS)}")
    recs = meta["records"]
    if not isinstance(recs, dict) or not recs or any(m not in MODES for m in recs):
        raise BNProbeError(f"{meta_path}: \"records\" must map some of {', '.join(MODES)} to their tensors")
    for mode, ios in recs.items():
        if not isinstance(ios, dict) or not all(isinstance(v, dict) for v in ios.values()):
            raise BNProbeError(f"{meta_path}: records of {mode} are not objects of tensors")
        if not isinstance(ios.get("inputs"), dict) or not isinstance(ios.get("outputs"), dict):
            raise BNProbeError(f"{meta_path}: records of {mode} lack their inputs or outputs")
        for io, named in ios.items():
            for name, entry in named.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or \
                        not isinstance(entry.get("shape"), list) or not isinstance(entry.get("format"), str):
                    raise BNProbeError(f"{meta_path}: tensor {mode}.{io}.{name} lacks its key, shape or format")
                if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"]):
                    raise BNProbeError(f"{meta_path}: tensor {mode}.{io}.{name} has shape {entry['shape']!r}, not a "
                                       "list of integers >= 0")
                try:
                    get_format(entry["format"])
                except BNProbeError as exc:
                    raise BNProbeError(f"{meta_path}: tensor {mode}.{io}.{name}: {exc}") from None
        for io, need in zip(("inputs", "outputs"), REQUIRED[mode]):
            if need - set(ios[io]):
                raise BNProbeError(f"{meta_path}: records of {mode} lack the {io} "
                                   f"{', '.join(sorted(need - set(ios[io])))}")
    try:
        get_format(meta["dtype"])
        params = get_format(meta["params"]).name
    except BNProbeError as exc:
        raise BNProbeError(f"{meta_path}: {exc}") from None
    check_eps_momentum(meta["eps"], meta.get("momentum"), params, str(meta_path))
    if meta.get("saved_kind") not in (None, "none", *SAVED_KINDS):
        raise BNProbeError(f"{meta_path}: saved_kind is {meta['saved_kind']!r}, not one of {', '.join(SAVED_KINDS)}, "
                           "none or null")
    inner = meta.get("meta")
    if inner is not None and not isinstance(inner, dict) or \
            isinstance(inner, dict) and not isinstance(inner.get("training", False), bool):
        raise BNProbeError(f"{meta_path}: \"meta\" must be an object whose training, when given, is true or false")
    return meta


def _read_tensors(tensor_path: Path, shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The arrays ``shapes`` names from a dump's tensors.npz, each member's header checked against its shape in
    the metadata (and its float32/float64 storage) before its data is read."""
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(tensor_path) as zf:
            members = {i.filename.removesuffix(".npy"): i for i in zf.infolist()}
            for key, shape in shapes.items():
                info = members.get(key)
                if info is None:
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} named in {META_NAME} is missing")
                with zf.open(info) as fh:
                    found, dtype = npy_header(fh, f"{tensor_path}: tensor {key!r}", info.file_size)
                if list(found) != list(shape):
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} has shape {list(found)} but {META_NAME} "
                                       f"says {shape}")
                if dtype not in (np.float32, np.float64):
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} is stored as {dtype}, not float32 or float64 "
                                       "as bnprobe writes it")
                with zf.open(info) as fh:
                    out[key] = np.lib.format.read_array(fh, allow_pickle=False)
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zip, zlib and numpy errors alike: a damaged file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BNProbeError(f"{tensor_path}: corrupt ({first})") from None
    return out


def load_dump(path: str | Path) -> Recording:
    """Read a bnprobe dump folder, checking every tensor against the metadata (for an msprobe dump or a
    model dump: its first call; :func:`open_dump` gives every call)."""
    p = Path(path)
    if not p.exists():
        raise BNProbeError(f"dump {str(p)!r} does not exist")
    if p.is_dir() and not (p / META_NAME).exists() or p.is_file() and p.name != META_NAME:
        found = open_dump(p)
        found.require_tensors("reading a call's tensors")
        return found.calls[0].load()
    meta_path = p if p.is_file() else p / META_NAME
    folder = meta_path.parent
    meta = _read_meta(meta_path)
    tensor_path = folder / TENSORS_NAME
    if not tensor_path.is_file():
        raise BNProbeError(f"{tensor_path}: missing (the dump is incomplete)")
    stored = _read_tensors(tensor_path, {e["key"]: e["shape"] for ios in meta["records"].values()
                                         for named in ios.values() for e in named.values()})
    inner = meta.get("meta") if isinstance(meta.get("meta"), dict) else {}
    mom = meta.get("momentum")
    rec = Recording(str(meta["adapter"]), get_format(str(meta["dtype"])).name, get_format(str(meta["params"])).name,
                    str(meta["layout"]), float(meta["eps"]), None if mom is None else float(mom),
                    meta.get("saved_kind") if meta.get("saved_kind") in SAVED_KINDS else None, meta=inner,
                    source=str(folder))
    for mode, ios in meta["records"].items():
        for io, named in ios.items():
            for name, entry in named.items():
                key = entry["key"]
                a = stored[key].astype(np.float64)
                if list(a.shape) != list(entry["shape"]):
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} has shape {list(a.shape)} but {META_NAME} "
                                       f"says {entry['shape']} for {mode}.{io}.{name}")
                if not is_representable(a, entry["format"]).all():
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} holds values that are not {entry['format']}")
                rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = a
                rec.formats[key] = entry["format"]
    return rec


# ---- many calls: model dumps (capture), msprobe dumps -------------------------------------------

CALLS_NAME = "bnprobe-calls.json"
CALLS_TAG = "bnprobe-calls"


@dataclass(frozen=True)
class CallRef:
    """One recorded BatchNorm call of a dump, nothing loaded: ``load()`` reads its tensors (a
    :class:`Recording`), or for an msprobe statistics dump its summaries."""

    name: str
    module: str | None
    shape: tuple[int, ...]
    dtype: str
    training: bool
    has_backward: bool
    task: str  # "tensor" or "statistics"
    load: Callable[[], Any] = field(compare=False, repr=False)
    recorded: tuple[str, ...] = ()  # the modes recorded (train, infer, backward) where known without loading

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this call recorded: as stored, or its training flag and whether a backward was dumped."""
        return self.recorded or ("train" if self.training else "infer", *(("backward",) if self.has_backward else ()))

    @property
    def label(self) -> str:
        shown = self.module and not self.name.startswith(f"{self.module}#")  # capture names calls module#index
        return f"{self.name} ({self.module})" if shown else self.name

    def matches(self, pattern: str) -> bool:
        return any(fnmatch.fnmatchcase(s, pattern) for s in (self.name, self.label, self.module or ""))


@dataclass(frozen=True)
class RecordedCalls:
    """The BatchNorm calls of a dump, in forward order."""

    source: str
    kind: str  # bnprobe, capture or msprobe
    calls: tuple[CallRef, ...]
    notes: tuple[str, ...] = ()

    @property
    def task(self) -> str:
        return "statistics" if self.calls and all(c.task == "statistics" for c in self.calls) else "tensor"

    def select(self, pattern: str | None) -> RecordedCalls:
        """The calls whose name, module or label matches the glob ``pattern`` (all when None)."""
        if not pattern:
            return self
        picked = tuple(c for c in self.calls if c.matches(pattern))
        if not picked:
            shown = ", ".join(c.label for c in self.calls[:8]) + (", ..." if len(self.calls) > 8 else "")
            raise BNProbeError(f"{self.source}: no BatchNorm call matches {pattern!r}; it holds {shown}")
        return replace(self, calls=picked)

    def require_tensors(self, what: str) -> None:
        if self.task == "statistics":
            raise BNProbeError(f"{self.source} is a statistics-only msprobe dump (max/min/mean/norm, no tensors): "
                               f"{what} needs a tensor dump (task \"tensor\"); bnprobe overflow reads the summaries")


def _bnprobe_call(folder: Path, name: str | None = None, module: str | None = None) -> CallRef:
    meta_path = folder / META_NAME
    meta = _read_meta(meta_path)
    recs = meta["records"]
    mode = "train" if "train" in recs else ("infer" if "infer" in recs else next(iter(recs), None))
    x = recs.get(mode, {}).get("inputs", {}).get("x") if mode else None
    if not isinstance(x, dict) or not isinstance(x.get("shape"), list):
        raise BNProbeError(f"{meta_path}: records no input x")
    inner = meta.get("meta") if isinstance(meta.get("meta"), dict) else {}
    training = "train" in recs or bool(inner.get("training", False))
    return CallRef(name or str(inner.get("call") or folder.name), module, tuple(x["shape"]), str(meta["dtype"]),
                   training, "backward" in recs, "tensor", lambda: load_dump(folder),
                   tuple(m for m in MODES if m in recs))


def read_calls(folder: str | Path) -> dict[str, Any]:
    """The index of a model dump (``bnprobe-calls.json``), checked for its format tag and call list."""
    index = Path(folder) / CALLS_NAME
    doc = read_json(index)
    if not isinstance(doc, dict) or doc.get("format") != CALLS_TAG or not isinstance(doc.get("calls"), list):
        raise BNProbeError(f"{index}: not a bnprobe model dump (no \"format\": \"{CALLS_TAG}\" with a calls list)")
    for i, c in enumerate(doc["calls"]):
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("name", "dir", "module")):
            raise BNProbeError(f"{index}: call {i} lacks its name, dir or module")
    return doc


def _model_calls(index: Path) -> RecordedCalls:
    """A model dump written by :func:`bnprobe.capture`: an index and one bnprobe dump per call."""
    doc = read_calls(index.parent)
    if not doc["calls"]:
        raise BNProbeError(f"{index}: the model dump holds no BatchNorm call")
    calls = []
    for e in doc["calls"]:
        folder = (index.parent / e["dir"]).resolve()
        if index.parent.resolve() not in folder.parents:
            raise BNProbeError(f"{index}: call {e['name']!r} points outside the dump ({e['dir']!r})")
        if not (folder / META_NAME).is_file():
            raise BNProbeError(f"{folder}: missing (call {e['name']!r} named in {CALLS_NAME})")
        calls.append(_bnprobe_call(folder, e["name"], e["module"]))
    notes = tuple(str(n) for n in doc.get("notes", []) if isinstance(n, str)) if isinstance(doc.get("notes"), list) \
        else ()
    return RecordedCalls(str(index.parent), "capture", tuple(calls), notes)


def open_dump(spec: str | Path, calls: str | None = None) -> RecordedCalls:
    """Every BatchNorm call of a dump: ``DIR`` (a bnprobe dump, a bnprobe model dump or an msprobe dump in
    any of its layouts), the path of its ``dump.json`` / ``bnprobe-dump.json``, optionally ``#NAME``
    (a call name, module name or glob) to select; ``calls`` selects by glob as well."""
    text = str(spec)
    path_text, _, name = text.partition("#")
    p = Path(path_text)
    if not p.exists():
        raise BNProbeError(f"dump {path_text!r} does not exist")
    if p.is_file() and p.name in (META_NAME, CALLS_NAME):
        p = p.parent
    if p.is_dir() and (p / CALLS_NAME).is_file():
        found = _model_calls(p / CALLS_NAME)
    elif p.is_dir() and (p / META_NAME).is_file():
        found = RecordedCalls(str(p), "bnprobe", (_bnprobe_call(p),))
    else:
        from bnprobe.adapters.msprobe import find_dump_jsons, msprobe_calls

        if p.is_dir() and not find_dump_jsons(p):
            raise BNProbeError(f"{p}: neither a bnprobe dump ({META_NAME}, {CALLS_NAME}) nor an msprobe dump "
                               "(dump.json, step*/proc*/, step*/rank*/, rank*/)")
        ms, notes = msprobe_calls(p)
        found = RecordedCalls(str(p), "msprobe", tuple(
            CallRef(c.name, c.module, c.shape, c.dtype, c.training, c.has_backward, c.task, c.load) for c in ms),
            tuple(notes))
        if not found.calls:
            raise BNProbeError(f"{p}: no BatchNorm call in the msprobe dump (looked for "
                               f"{', '.join(MSPROBE_BN_APIS)})")
    return found.select(name or None).select(calls)


def read_msprobe(folder: str | Path, call: str | None = None) -> Recording:
    """The first BatchNorm call (or ``call``, e.g. ``Functional.batch_norm.0``) of an msprobe dump."""
    found = open_dump(folder, call)
    found.require_tensors("reading a call's tensors")
    return found.calls[0].load()

# ---- recording an adapter and replaying a recording ----------------------------------------------

def record(adapter: KernelAdapter, *, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
           running_mean: np.ndarray, running_var: np.ndarray, dy: np.ndarray, dtype: str, eps: float = 1e-5,
           momentum: float | None = 0.1, layout: str = "channels_first", params: str = "fp32",
           modes: tuple[str, ...] = ("train", "infer", "backward"), meta: dict[str, Any] | None = None) -> Recording:
    """Run ``adapter`` in each mode on these inputs and keep every input and output."""
    from bnprobe.numerics.rounding import round_to

    fmt = get_format(dtype).name
    pf = params_format(fmt, params)
    caps = adapter.capabilities()
    c = np.shape(x)[1] if layout == "channels_first" or np.ndim(x) == 2 else np.shape(x)[-1]
    g = round_to(np.ones(c) if gamma is None else np.asarray(gamma, dtype=np.float64), pf)
    b = round_to(np.zeros(c) if beta is None else np.asarray(beta, dtype=np.float64), pf)
    rm = round_to(np.asarray(running_mean, dtype=np.float64), pf)
    rv = round_to(np.asarray(running_var, dtype=np.float64), pf)
    xs, dys = round_to(np.asarray(x, dtype=np.float64), fmt), round_to(np.asarray(dy, dtype=np.float64), fmt)
    rec = Recording(adapter.name, fmt, pf, layout, eps, momentum, caps.saved,
                    meta={**(meta or {}), "training": "train" in modes or "backward" in modes})

    def put(mode: str, io: str, name: str, a: np.ndarray, f: str) -> None:
        # an output is stored in the format the kernel returned it in (the reference returns float64)
        dt = np.asarray(a).dtype
        if io == "outputs" and dt != np.float64:
            f = get_format(dt).name
        elif io == "outputs":
            f = "fp64"
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
    """Replays recorded calls: given a call's recorded inputs and scalars, returns its recorded outputs.

    Built on one :class:`Recording` or on a dump's :class:`RecordedCalls`; :meth:`bind` gives the
    adapter of one call.  A call that differs from the recording in any tensor or scalar is an error
    naming what differs: a replay never answers with the outputs of another call."""

    def __init__(self, rec: Recording | RecordedCalls) -> None:
        if isinstance(rec, Recording):
            self.calls = RecordedCalls(rec.source or rec.adapter, "bnprobe", (
                CallRef(str(rec.meta.get("call") or rec.adapter), None, tuple(rec.call_inputs()["x"].shape),
                        rec.dtype, rec.training, "backward" in rec.tensors, "tensor", lambda: rec),))
            self._rec: Recording | None = rec
        else:
            self.calls, self._rec = rec, None
        self.name = f"dump:{self.calls.source}"

    @property
    def rec(self) -> Recording:
        """The bound call's recording (a single-call dump binds its call on first use)."""
        if self._rec is None:
            if len(self.calls.calls) != 1:
                raise BNProbeError(f"{self.name} holds {len(self.calls.calls)} BatchNorm calls; select one with "
                                   "dump:DIR#NAME or --calls, or let the command run them one at a time")
            self.calls.require_tensors("replaying a call")
            self._rec = self.calls.calls[0].load()
        return self._rec

    def bind(self, rec: Recording) -> DumpAdapter:
        """This dump's adapter for one of its calls (already loaded)."""
        out = DumpAdapter(rec)
        out.calls, out.name = self.calls, self.name
        return out

    def capabilities(self) -> Capabilities:
        if self._rec is None and (len(self.calls.calls) != 1 or self.calls.task != "tensor"):
            cs = self.calls.calls
            modes = {m for c in cs for m in c.modes}
            return Capabilities(formats=tuple(dict.fromkeys(c.dtype for c in cs)),
                                modes=tuple(m for m in MODES if m in modes), layouts=("channels_first",),
                                saved="none", deterministic=True, training_r1=True, recorded=True)
        return Capabilities(formats=(self.rec.dtype,), modes=self.rec.modes, layouts=(self.rec.layout,),
                            saved=self.rec.saved_kind or "none", deterministic=True, training_r1=True, recorded=True)

    def _differs(self, what: str, asked: Any, recorded: Any) -> BNProbeError:
        call = self.rec.meta.get("call") or "the recording"
        return BNProbeError(f"{self.name}: the call asks {what} = {asked!r} but {call} was made with {what} = "
                            f"{recorded!r}; a recording answers only its own call")

    def _check_call(self, mode: str, given: dict[str, np.ndarray | None], p: Prepared, *, eps: float,
                    momentum: float | None = None, training: bool | None = None) -> None:
        rec = self.rec
        if eps != rec.eps:
            raise self._differs("eps", eps, rec.eps)
        if p.params != rec.params:
            raise self._differs("the parameter format", p.params, rec.params)
        if training is not None and training != rec.training:
            raise self._differs("training", training, rec.training)
        want = rec.tensors[mode]["inputs"]
        if mode == "train" and "running_mean" in want and momentum != rec.momentum:
            raise self._differs("momentum", momentum, rec.momentum)
        # what the recording lacks must be what its absence means: γ = 1, β = 0, no running statistics
        absent = {"gamma": 1.0, "beta": 0.0}
        for name, a in given.items():
            if name not in want:
                if a is None or (name in absent and np.all(np.asarray(a, dtype=np.float64) == absent[name])):
                    continue
                raise BNProbeError(f"{self.name}: the {mode} call gives {name!r} but the recording has none (a call "
                                   "without it); a dump replays only its own inputs")
            b = want[name]
            if a is None:
                raise BNProbeError(f"{self.name}: the {mode} call gives no {name!r} but the recording has one")
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
        self._check_call("train", {"x": p.x, **p.vectors}, p, eps=eps, momentum=momentum)
        sm, sv = self._out("train", "saved_mean"), self._out("train", "saved_value")
        saved = Saved(sm, self.rec.saved_kind, sv) if sm is not None and sv is not None and self.rec.saved_kind \
            else None
        return ForwardOutput(self._out("train", "y"), saved, self._out("train", "running_mean_out"),
                             self._out("train", "running_var_out"), meta={"replayed": self.rec.source})

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_call("infer", {"x": p.x, **p.vectors}, p, eps=eps)
        return ForwardOutput(self._out("infer", "y"), meta={"replayed": self.rec.source})

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        given = {"dy": dy, "x": p.x, "gamma": p.vectors["gamma"]}
        if "saved_mean" in self.rec.tensors["backward"]["inputs"] and self.rec.saved_kind:
            # the statistics the recorded backward was given: the same ones, of the same kind
            if saved.kind != self.rec.saved_kind:
                raise self._differs("saved statistics of kind", saved.kind, self.rec.saved_kind)
            given.update(saved_mean=saved.mean, saved_value=saved.value)
        self._check_call("backward", given, p, eps=eps, training=training)
        # a gradient the kernel did not compute (x without requires_grad, affine=False) was not recorded:
        # NaN in its place, and meta["missing"] names it so checks leave it out
        got = {k: self._out("backward", k) for k in ("dx", "dgamma", "dbeta")}
        missing = tuple(k for k, v in got.items() if v is None)
        fill = {"dx": p.lay.shape, "dgamma": (p.lay.channels,), "dbeta": (p.lay.channels,)}
        dx, dg, db = (np.full(fill[k], np.nan) if v is None else v for k, v in got.items())
        return BackwardOutput(dx, dg, db, meta={"replayed": self.rec.source, "missing": missing})

    def _check_forward(self, out: ForwardOutput, p: Prepared, *, training: bool) -> None:
        if np.shape(out.y) != p.lay.shape:
            raise BNProbeError(f"{self.name}: recorded y has shape {np.shape(out.y)}, x has {p.lay.shape}")

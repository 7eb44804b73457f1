"""bnprobe's own dump format: recording an adapter's calls, writing them, and reading them back.

A bnprobe dump is a folder with ``bnprobe-dump.json`` (metadata: adapter, dtype, params format, layout, eps,
momentum, seed, and for each recorded mode its tensors with shape and format) and ``tensors.npz`` (every
tensor; 16-bit formats stored exactly as float32).  Written through temporary files and renamed into place,
tensors first and metadata last, so a folder with metadata is complete.  A model dump
(:func:`bnprobe.capture`) is one bnprobe dump per call and an index, ``bnprobe-calls.json``
(:func:`read_calls`).
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.call import NORM_NAMES, BNCall
from bnprobe.core.kernel import MODES, SAVED_KINDS, Saved, modes_left_out, needs_modes, params_format
from bnprobe.core.errors import BNProbeError
from bnprobe.core.errors import named as param_named  # (`named` is a loop's variable below)
from bnprobe.core.formats import get_format
from bnprobe.inputs import npy_header
from bnprobe.kernels.layout import LAYOUTS, NormShape
from bnprobe.numerics.rounding import is_representable
from bnprobe.recordings.types import (
    CALLS_NAME,
    CALLS_TAG,
    META_NAME,
    TENSORS_NAME,
    Recording,
    check_eps_momentum,
    read_json,
)
from bnprobe._files import atomic_write_text, atomic_write_with, check_targets

__all__ = ["write_dump", "read_meta", "read_dump", "read_calls", "record", "FORMAT_TAG"]

FORMAT_TAG = "bnprobe-dump"
DUMP_VERSION = 2  # 2: entries may share one stored array (a call's x, recorded for its backward too); 1 read as well

# the tensors a recorded mode cannot lack (a backward may lack a gradient the kernel did not compute)
REQUIRED = {"train": ({"x"}, {"y"}), "infer": ({"x", "running_mean", "running_var"}, {"y"}),
            "backward": ({"dy", "x"}, set())}


def _storage(a: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(a, dtype=np.float64 if fmt == "fp64" else np.float32)


def write_dump(rec: Recording, out: str | Path, *, force: bool = False) -> list[Path]:
    """Write a Recording as a bnprobe dump folder; returns the files written.  Its arrays may be float64 or the
    format's own dtype (a capture's fp16/bf16 arrays): each is stored as float32 (float64 for fp64) as it is
    written, one at a time, straight into the file."""
    out = Path(out)
    meta_path, tensor_path = out / META_NAME, out / TENSORS_NAME
    check_targets([meta_path, tensor_path], force=force)
    # each array once, under the key of its first entry: an array recorded twice (a training call's x, again for
    # its backward) is stored once, both entries naming that key (``arrays`` holds every array, so no id is reused)
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    keys: dict[tuple[int, str], str] = {}
    entries: dict[str, Any] = {}
    for mode, ios in rec.tensors.items():
        entries[mode] = {}
        for io, named in ios.items():
            entries[mode][io] = {}
            for name, a in named.items():
                a, fmt = np.asarray(a), rec.formats[f"{mode}.{io}.{name}"]
                key = keys.setdefault((id(a), fmt), f"{mode}.{io}.{name}")
                arrays.setdefault(key, (a, fmt))
                entries[mode][io][name] = {"key": key, "shape": list(a.shape), "format": fmt}

    def write(fh: Any) -> None:
        """Uncompressed (float data deflates by about 7%, at 20x the time), one member at a time, each widened to
        its storage type as it is written."""
        with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for key, (a, fmt) in arrays.items():
                with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, _storage(a, fmt), allow_pickle=False)

    atomic_write_with(tensor_path, write)
    meta = {"format": FORMAT_TAG, "version": DUMP_VERSION, "adapter": rec.adapter, "dtype": rec.dtype,
            "params": rec.params, "layout": rec.layout, "eps": rec.eps, "momentum": rec.momentum,
            "saved_kind": rec.saved_kind,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "meta": rec.meta, "records": entries}
    atomic_write_text(meta_path, json.dumps(meta, indent=2, default=str))
    return [tensor_path, meta_path]


def read_meta(meta_path: Path) -> dict[str, Any]:
    """A bnprobe dump's metadata, its keys and their JSON types checked."""
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise BNProbeError(f"{meta_path}: not a bnprobe dump (no \"format\": \"{FORMAT_TAG}\")")
    version = meta.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= DUMP_VERSION:
        raise BNProbeError(f"{meta_path}: a bnprobe dump of version {version!r}; this bnprobe reads versions 1 to "
                           f"{DUMP_VERSION} (a newer bnprobe wrote it?)")
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


def read_dump(meta_path: Path) -> Recording:
    """The bnprobe dump of ``meta_path`` (its ``bnprobe-dump.json``), every tensor checked against the metadata
    (:func:`bnprobe.recordings.load_dump` reads any dump)."""
    folder = meta_path.parent
    meta = read_meta(meta_path)
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
    wide: dict[str, np.ndarray] = {}  # each stored array widened once, however many entries name it
    checked: set[tuple[str, str]] = set()
    for mode, ios in meta["records"].items():
        for io, named in ios.items():
            for name, entry in named.items():
                key = entry["key"]
                a = stored[key]
                if list(a.shape) != list(entry["shape"]):
                    raise BNProbeError(f"{tensor_path}: tensor {key!r} has shape {list(a.shape)} but {META_NAME} "
                                       f"says {entry['shape']} for {mode}.{io}.{name}")
                if (key, entry["format"]) not in checked:  # on the stored values (float32 or float64), once
                    if not is_representable(a, entry["format"]).all():
                        raise BNProbeError(f"{tensor_path}: tensor {key!r} holds values that are not "
                                           f"{entry['format']}")
                    checked.add((key, entry["format"]))
                if key not in wide:  # one array under several names (the checks copy what they change; it is
                    wide[key] = a.astype(np.float64)  # left writable: torch.from_numpy warns on read-only ones)
                rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = wide[key]
                rec.formats[f"{mode}.{io}.{name}"] = entry["format"]
    return rec


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


# ---- recording an adapter -------------------------------------------------------------------------

def record(adapter: Any, call: BNCall, *, modes: tuple[str, ...] = ("train", "infer", "backward"),
           meta: dict[str, Any] | None = None) -> Recording:
    """Run ``adapter`` (a :class:`bnprobe.adapters.KernelAdapter`) in each mode on ``call`` and keep every input and
    output.  The call's tensors are taken as given and rounded here: x and dy to its ``dtype``; γ (None: ones), β
    (None: zeros) and the running statistics, which it must have, as dy, to its parameter format.  Of ``modes``,
    those the adapter runs (an inference-only kernel: inference), the others named in the recording's notes (which
    every command run on it prints); none of them is an error.

    A call of a family layer (``call.norm`` layer, rms, group or instance: :func:`_record_family`) is recorded with
    its layer — norm, normalised shape, groups, γ's offset — in the dump's meta, which every reader gives back
    (:meth:`~bnprobe.recordings.types.Recording.call`)."""
    if call.norm != "batch":
        return _record_family(adapter, call, modes, meta)
    return _record_batchnorm(adapter, call, modes, meta)


def _record_batchnorm(adapter: Any, call: BNCall, modes: tuple[str, ...], meta: dict[str, Any] | None) -> Recording:
    """A BatchNorm call recorded (see :func:`record`)."""
    from bnprobe.numerics.rounding import round_to

    if call.running_mean is None or call.running_var is None or call.dy is None:
        raise BNProbeError("record needs the call's running statistics and dy")
    runs = adapter.capabilities().modes
    if not any(m in runs for m in modes):
        raise BNProbeError(needs_modes(f"{param_named('modes')} {','.join(modes)}", modes, adapter.name, runs),
                           field="modes")
    left_out = modes_left_out(adapter.name, runs, modes, verb="recorded")
    modes = tuple(m for m in modes if m in runs)
    x, gamma, beta, dy = call.x, call.gamma, call.beta, call.dy
    dtype, eps, momentum, layout, params = call.dtype, call.eps, call.momentum, call.layout, call.params
    fmt = get_format(dtype).name
    pf = params_format(fmt, params)
    caps = adapter.capabilities()
    c = np.shape(x)[1] if layout == "channels_first" or np.ndim(x) == 2 else np.shape(x)[-1]
    g = round_to(np.ones(c) if gamma is None else np.asarray(gamma, dtype=np.float64), pf)
    b = round_to(np.zeros(c) if beta is None else np.asarray(beta, dtype=np.float64), pf)
    rm = round_to(np.asarray(call.running_mean, dtype=np.float64), pf)
    rv = round_to(np.asarray(call.running_var, dtype=np.float64), pf)
    xs, dys = round_to(np.asarray(x, dtype=np.float64), fmt), round_to(np.asarray(dy, dtype=np.float64), fmt)
    extra = {} if caps.params in (None, pf) else {"kernel_params": caps.params, "params_note": (
        f"{adapter.name} reads γ, β and the running statistics in {caps.params} (its policy's) whatever it is given: "
        f"recorded as given ({pf}); the outputs it returns in {caps.params}")}
    rec = Recording(adapter.name, fmt, pf, layout, eps, momentum, caps.saved,
                    meta={**(meta or {}), **extra, "training": "train" in modes or "backward" in modes})
    if left_out is not None:
        rec.meta["notes"] = [*rec.meta.get("notes", []), left_out]

    def put(mode: str, io: str, name: str, a: np.ndarray, f: str) -> None:
        # an output is stored in the format the kernel returned it in (the reference returns float64)
        dt = np.asarray(a).dtype
        if io == "outputs" and dt != np.float64:
            f = get_format(dt).name
        elif io == "outputs":
            f = "fp64"
        rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = np.asarray(a, dtype=np.float64)
        rec.formats[f"{mode}.{io}.{name}"] = f

    stored = BNCall(xs, g, b, rm, rv, dys, eps=eps, momentum=momentum, dtype=fmt, params=params, layout=layout)
    saved: Saved | None = None
    if "train" in modes or "backward" in modes:
        out = adapter.train(stored)
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
        out = adapter.infer(stored.with_(training=False))
        for name, a, f in (("x", xs, fmt), ("gamma", g, pf), ("beta", b, pf), ("running_mean", rm, pf),
                           ("running_var", rv, pf)):
            put("infer", "inputs", name, a, f)
        put("infer", "outputs", "y", out.y, fmt)
    if "backward" in modes and saved is not None:
        bw = adapter.backward_of(stored, saved)
        sf = rec.formats.get("train.outputs.saved_value", "fp64")
        for name, a, f in (("dy", dys, fmt), ("x", xs, fmt), ("gamma", g, pf), ("saved_mean", saved.mean, sf),
                           ("saved_value", saved.value, sf)):
            put("backward", "inputs", name, a, f)
        put("backward", "outputs", "dx", bw.dx, fmt)
        put("backward", "outputs", "dgamma", bw.dgamma, pf)
        put("backward", "outputs", "dbeta", bw.dbeta, pf)
    return rec


def _family_modes(adapter: Any, call: BNCall, modes: tuple[str, ...]) -> tuple[NormShape, tuple[str, ...], list[str]]:
    """Where a family call's statistics sit, the modes of ``modes`` the adapter runs (those it records) and the notes
    naming those it does not; what a family call is not recorded with refused in one line."""
    name = NORM_NAMES.get(call.norm, call.norm)
    if call.running_mean is not None or call.running_var is not None:
        raise BNProbeError(f"{name} keeps no running statistics: record it without them")
    if call.layout != "channels_first":
        raise BNProbeError(f"{name} takes x as it is laid out (layout channels_first), not {call.layout}",
                           field="layout")
    sh = NormShape.of(call.norm, np.shape(call.x), call.normalized_shape, call.groups)
    if "infer" in modes:
        raise BNProbeError(f"{param_named('modes')} {','.join(modes)}: {name} keeps no running statistics, so its "
                           "inference is its training forward: give train, backward or both", field="modes")
    runs = adapter.capabilities().modes
    if not any(m in runs for m in modes):
        raise BNProbeError(needs_modes(f"{param_named('modes')} {','.join(modes)}", modes, adapter.name, runs),
                           field="modes")
    if "backward" in modes and call.dy is None:
        raise BNProbeError("recording a backward needs the call's dy")
    notes = [n for n in (modes_left_out(adapter.name, runs, modes, verb="recorded"),) if n is not None]
    return sh, tuple(m for m in modes if m in runs), notes


def _record_family(adapter: Any, call: BNCall, modes: tuple[str, ...], meta: dict[str, Any] | None) -> Recording:
    """A LayerNorm, RMSNorm, GroupNorm or InstanceNorm call recorded as :func:`record` records BatchNorm's: x and dy
    rounded to the call's format, γ (None: ones) and β (None: zeros; none for RMSNorm) of the layer's parameter shape
    to its parameter format; the training forward's y and the statistics the kernel saved per row (saved_mean,
    none for RMSNorm, and rstd as saved_value, kind invstd), the backward's dx, dγ and dβ from them.  The layer keeps
    no running statistics: its inference is its training forward (``modes`` with infer is refused).  The meta holds
    the layer: norm, normalized_shape (LayerNorm's and RMSNorm's, as resolved), groups (GroupNorm's), weight_offset."""
    from bnprobe.numerics.rounding import round_to

    sh, wanted, notes = _family_modes(adapter, call, modes)
    fmt = get_format(call.dtype).name
    pf = params_format(fmt, call.params)
    caps = adapter.capabilities()
    with np.errstate(all="ignore"):
        g = round_to(np.ones(sh.param_shape) if call.gamma is None else
                     np.asarray(call.gamma, dtype=np.float64).reshape(sh.param_shape), pf)
        b = None if call.norm == "rms" else round_to(
            np.zeros(sh.param_shape) if call.beta is None else
            np.asarray(call.beta, dtype=np.float64).reshape(sh.param_shape), pf)
        xs = round_to(np.asarray(call.x, dtype=np.float64), fmt)
        dys = None if call.dy is None else round_to(np.asarray(call.dy, dtype=np.float64), fmt)
    layer = {"norm": call.norm, "normalized_shape": list(sh.normalized) if call.norm in ("layer", "rms") else None,
             "groups": sh.groups if call.norm == "group" else None, "weight_offset": float(call.weight_offset)}
    extra = {} if caps.params in (None, pf) else {"kernel_params": caps.params, "params_note": (
        f"{adapter.name} reads γ and β in {caps.params} (its policy's) whatever it is given: recorded as given "
        f"({pf}); the outputs it returns in {caps.params}")}
    stored = BNCall(xs, g, b, None, None, dys, eps=call.eps, momentum=None, dtype=fmt, params=call.params,
                    norm=call.norm, normalized_shape=tuple(sh.normalized) or None, groups=layer["groups"],
                    weight_offset=layer["weight_offset"])
    out = adapter.train(stored)
    saved = out.saved
    rec = Recording(adapter.name, fmt, pf, "channels_first", call.eps, None, None if saved is None else "invstd",
                    meta={**(meta or {}), **extra, "training": True, **layer})
    if notes:
        rec.meta["notes"] = [*rec.meta.get("notes", []), *notes]

    def put(mode: str, io: str, key: str, a: np.ndarray, f: str) -> None:
        # an output is stored in the format the kernel returned it in (the reference returns float64)
        if io == "outputs":
            dt = np.asarray(a).dtype
            f = "fp64" if dt == np.float64 else get_format(dt).name
        rec.tensors.setdefault(mode, {}).setdefault(io, {})[key] = np.asarray(a, dtype=np.float64)
        rec.formats[f"{mode}.{io}.{key}"] = f

    params_in = (("gamma", g),) + ((("beta", b),) if b is not None else ())
    stats: tuple[tuple[str, np.ndarray], ...] = ()
    if saved is not None:
        stats = ((("saved_mean", saved.mean),) if saved.mean is not None else ()) + (("saved_value", saved.value),)
    if "train" in wanted:
        for key, a in (("x", xs), *params_in):
            put("train", "inputs", key, a, fmt if key == "x" else pf)
        put("train", "outputs", "y", out.y, fmt)
        for key, a in stats:
            put("train", "outputs", key, np.reshape(a, -1), fmt)
    if "backward" in wanted and saved is not None:
        bw = adapter.backward_of(stored, saved)
        sf = {key: get_format(np.asarray(a).dtype).name if np.asarray(a).dtype != np.float64 else "fp64"
              for key, a in stats}
        # (without a training forward recorded, β comes with the backward's inputs: the call keeps its every input)
        beta_in = (("beta", b, pf),) if b is not None and "train" not in wanted else ()
        for key, a, f in (("dy", dys, fmt), ("x", xs, fmt), ("gamma", g, pf), *beta_in,
                          *((key, np.reshape(a, -1), sf[key]) for key, a in stats)):
            put("backward", "inputs", key, a, f)
        for key, a, f in (("dx", bw.dx, fmt), ("dgamma", bw.dgamma, pf), ("dbeta", bw.dbeta, pf)):
            if a is not None:
                put("backward", "outputs", key, a, f)
    elif "backward" in wanted:
        rec.meta["notes"] = [*rec.meta.get("notes", []), f"{adapter.name} saved no statistics: its backward is not "
                             "recorded"]
    return rec

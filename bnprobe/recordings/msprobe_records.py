"""msprobe's record format, shared by the readers of its dumps (BatchNorm's in :mod:`bnprobe.recordings.msprobe`,
the normalisation family's in :mod:`bnprobe.recordings.msprobe_family`).

A dump.json maps record names to records; a record's entries are tensors (type, dtype, shape, Max, Min, Mean, Norm,
requires_grad, data_name) or builtins (``{"type": "float", "value": 1e-05}``), lists of entries, or null.  The
tensors themselves are files in ``dump_tensor_data/`` (``.pt`` or ``.npy``), loaded here checked against their
entries.  msprobe's construct.json maps an API record to the module record enclosing it (mix level).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.inputs import npy_header
from bnprobe.numerics.rounding import held_exactly, is_representable
from bnprobe.recordings.types import message_line, read_json

__all__ = ["SUMMARY_KEYS", "read_dump_json", "is_tensor", "scalar_of", "json_kind", "record_list", "tensor_entries",
           "tensor_format", "tensor_shape", "read_construct", "tensor_path", "load_pt", "load_npy", "load_tensor",
           "check_parameters_grad", "summary_value"]

SUMMARY_KEYS = ("Max", "Min", "Mean", "Norm")


def read_dump_json(dj: Path) -> dict[str, Any]:
    """A dump.json: a JSON object with a "data" object (and a task, when given, that is a string)."""
    doc = read_json(dj)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise BNProbeError(f"{dj}: not an msprobe dump.json (no \"data\" object)")
    if doc.get("task") is not None and not isinstance(doc["task"], str):
        raise BNProbeError(f"{dj}: \"task\" is {doc['task']!r}, not a string")
    return doc


def is_tensor(entry: Any) -> bool:
    """Whether a record entry is a tensor's (its type ends in Tensor: torch.Tensor, mindspore.Tensor...)."""
    return isinstance(entry, dict) and str(entry.get("type", "")).endswith("Tensor")


def scalar_of(entry: Any, default: Any) -> Any:
    """The value of a non-tensor entry (``{"type": "float", "value": 1e-05}``, or the bare value), ``default`` for
    null; a bool written as text read as a bool."""
    if isinstance(entry, dict) and not is_tensor(entry):
        entry = entry.get("value", default)
    if isinstance(entry, str) and entry.lower() in ("true", "false"):  # a bool written as text
        return entry.lower() == "true"
    return default if entry is None else entry


def json_kind(v: Any) -> str:
    """What a JSON value is, for an error message."""
    if isinstance(v, dict):
        return f"an object of type {str(v.get('type'))[:40]!r}" if "type" in v else "an object without a type"
    if isinstance(v, list):
        return f"a list of {len(v)} value{'s' if len(v) != 1 else ''}"
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    return f"{'a boolean' if isinstance(v, bool) else 'the number'} {json.dumps(v)}"


def record_list(record: dict[str, Any], key: str, where: str) -> list[Any]:
    """``record[key]`` as a list (one record is a list of one), [] when absent."""
    v = record.get(key)
    if v is None:
        return []
    if isinstance(v, dict):
        return [v]
    if not isinstance(v, list):
        raise BNProbeError(f"{where} has {key} of the wrong JSON type ({type(v).__name__}, not a list)")
    return v


def tensor_entries(record: dict[str, Any], key: str, where: str) -> list[Any]:
    """The tensor records of ``record[key]``."""
    return [e for e in record_list(record, key, where) if is_tensor(e)]


def tensor_format(entry: dict[str, Any], where: str) -> str:
    """The bnprobe format of a tensor entry's dtype (torch.bfloat16 -> bf16); one line when it is none."""
    try:
        return get_format(str(entry.get("dtype", "")).replace("torch.", "")).name
    except BNProbeError:
        raise BNProbeError(f"{where}: dtype {entry.get('dtype')!r} is not a floating format bnprobe knows") from None


def tensor_shape(entry: dict[str, Any], where: str) -> tuple[int, ...]:
    """A tensor entry's shape, as a tuple of non-negative ints."""
    s = entry.get("shape")
    if not isinstance(s, list) or not all(isinstance(v, int) and v >= 0 for v in s):
        raise BNProbeError(f"{where}: tensor record has no valid shape")
    return tuple(s)


def read_construct(folder: Path) -> dict[str, str]:
    """construct.json: API record -> enclosing module record (mix level); {} when absent or empty (msprobe writes
    it empty below the mix level).  A construct.json that is there but does not parse is a one-line error naming
    it, as for dump.json."""
    p = folder / "construct.json"
    if not p.is_file():
        return {}
    try:
        if not p.read_bytes().strip():
            return {}
    except OSError as exc:
        raise BNProbeError(f"{p}: not readable ({type(exc).__name__}: {message_line(exc)})") from None
    doc = read_json(p)
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(doc, dict) else {}


def tensor_path(folder: Path, name: str, where: str) -> Path:
    """The file of ``data_name`` inside ``dump_tensor_data`` (with its .npy/.pt suffix when the name has none);
    a name that leads outside that folder is refused."""
    data_dir = folder / "dump_tensor_data"
    inside = data_dir.resolve()
    path = data_dir / name
    alt = [path, path.with_suffix(".npy"), path.with_suffix(".pt")]
    for p in alt:
        if Path(name).is_absolute() or not p.resolve().is_relative_to(inside):
            raise BNProbeError(f"{folder / 'dump.json'}: {where}: data_name {name!r} points outside the dump's "
                               "dump_tensor_data folder; refused")
    found = next((p for p in alt if p.is_file()), None)
    if found is None:
        raise BNProbeError(f"{path}: missing (named in {where})")
    return found


# the storages of a plain tensor file read without torch: torch's class name -> (numpy dtype, format)
_STORAGES = {"HalfStorage": (np.float16, "fp16"), "FloatStorage": (np.float32, "fp32"),
             "DoubleStorage": (np.float64, "fp64"), "BFloat16Storage": ("bfloat16", "bf16")}


@dataclass(frozen=True)
class _Storage:
    kind: str  # a key of _STORAGES
    key: str  # its file, data/<key>
    numel: int


@dataclass(frozen=True)
class _Plain:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, hooks: Any, *meta: Any) -> _Plain:
    """torch._utils._rebuild_tensor_v2's arguments, kept (a tensor with hooks or metadata is not a plain one)."""
    if not isinstance(storage, _Storage) or hooks or any(meta) or not isinstance(offset, int):
        raise pickle.UnpicklingError("not a plain tensor")
    return _Plain(storage, offset, tuple(size), tuple(stride))


class _PlainUnpickler(pickle.Unpickler):
    """Reads torch.save's data.pkl of one plain tensor and nothing else: three globals (the rebuild function, a float
    storage class, OrderedDict for the empty hooks), storages as persistent ids; anything else stops it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGES
                and isinstance(pid[2], str) and pid[3] == "cpu" and isinstance(pid[4], int)):
            raise pickle.UnpicklingError("not a CPU storage")
        return _Storage(pid[1], pid[2], pid[4])


def _plain_tensor(zf: zipfile.ZipFile) -> tuple[np.ndarray, str] | None:
    """The tensor of a torch.save file holding one plain, C-contiguous float tensor in little-endian storage, read
    without torch (as float64, and its format): the same values torch.load gives; None for any other file (torch
    reads it then, and says what it holds)."""
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        return None
    top = pkl[0][: -len("data.pkl")]
    if top + "byteorder" in names and zf.read(top + "byteorder") != b"little":
        return None
    try:
        t = _PlainUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError, AttributeError, IndexError):
        return None
    if not isinstance(t, _Plain) or not t.size or not all(isinstance(d, int) and d > 0 for d in t.size):
        return None
    contiguous = tuple(int(np.prod(t.size[i + 1:], dtype=np.int64)) for i in range(len(t.size)))
    if t.stride != contiguous or (top + "data/" + t.storage.key) not in names:
        return None
    dtype, fmt = _STORAGES[t.storage.kind]
    dt = np.dtype(get_format("bf16").dtype if dtype == "bfloat16" else dtype)
    raw = zf.read(top + "data/" + t.storage.key)
    count = int(np.prod(t.size, dtype=np.int64))
    if len(raw) != t.storage.numel * dt.itemsize or t.offset < 0 or t.offset + count > t.storage.numel:
        return None
    a = np.frombuffer(raw, dtype=dt, count=count, offset=t.offset * dt.itemsize).reshape(t.size)
    return a.astype(np.float64), fmt


def load_pt(path: Path, declared: Any) -> tuple[np.ndarray, str]:
    """A .pt tensor file (loaded weights-only) as float64 and its format: a plain float tensor read without torch
    (:func:`_plain_tensor`; importing torch is most of reading a small dump), any other by torch."""
    zipped = zipfile.is_zipfile(path)
    if zipped:
        with zipfile.ZipFile(path) as zf:
            if any(i.compress_type != zipfile.ZIP_STORED for i in zf.infolist()):
                raise BNProbeError(f"{path}: has compressed members, which torch.save never writes; refused")
            plain = _plain_tensor(zf)
        if plain is not None:
            return held_exactly(plain[0], plain[1]), plain[1]
    try:
        import torch
    except ImportError:
        raise BNProbeError(f"{path}: a .pt tensor needs torch (pip install 'bnprobe[torch]')") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols are no concern of the user's
            t = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message: its own advice (not passed on), then why its weights-only reader stopped
        why = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not
               ln.startswith(("Weights only load failed", "Please file an issue", "Check the documentation"))]
        raise BNProbeError(f"{path}: refused to unpickle, it is not a plain tensor file"
                           f"{f' ({why[0]})' if why else ''}; bnprobe loads .pt files weights-only and runs no "
                           "code from a file") from None
    if not isinstance(t, torch.Tensor):
        raise BNProbeError(f"{path}: holds {type(t).__name__}, not a tensor")
    if not t.is_floating_point():
        raise BNProbeError(f"{path}: holds {t.dtype} data but dump.json says {declared}")
    fmt = get_format(str(t.dtype).replace("torch.", "")).name
    return held_exactly(t.detach().to(torch.float64).numpy(), fmt), fmt


def load_npy(path: Path, shape: tuple[int, ...], declared: Any) -> tuple[np.ndarray, str]:
    """A .npy tensor file (its header checked first) as float64 and its format."""
    with open(path, "rb") as fh:
        found, dtype = npy_header(fh, str(path), path.stat().st_size)
    if found != shape:
        raise BNProbeError(f"{path}: shape {list(found)} disagrees with dump.json's {list(shape)}")
    if dtype.kind != "f":
        raise BNProbeError(f"{path}: holds {dtype} data but dump.json says {declared}")
    arr = np.load(path, allow_pickle=False)
    fmt = get_format(arr.dtype).name
    return held_exactly(arr.astype(np.float64), fmt), fmt


def load_tensor(folder: Path, entry: dict[str, Any], where: str) -> tuple[np.ndarray, str]:
    """A recorded tensor as float64 (exact) and its format, checked against its dump.json record."""
    name = entry.get("data_name")
    if not isinstance(name, str) or not name:
        raise BNProbeError(f"{where}: tensor record has no data_name (a statistics dump holds no tensors)")
    path = tensor_path(folder, name, where)
    fmt = tensor_format(entry, where)
    shape = tensor_shape(entry, where)
    try:
        a, stored = load_pt(path, entry.get("dtype")) if path.suffix == ".pt" else \
            load_npy(path, shape, entry.get("dtype"))
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure is a corrupt file to the user
        raise BNProbeError(f"{path}: corrupt or unreadable ({type(exc).__name__}: {message_line(exc)})") from None
    if list(a.shape) != list(shape):
        raise BNProbeError(f"{path}: shape {list(a.shape)} disagrees with dump.json's {list(shape)}")
    if stored != fmt and not (path.suffix == ".npy" and fmt == "bf16" and stored == "fp32"):
        raise BNProbeError(f"{path}: holds {stored} data but dump.json says {entry.get('dtype')}")
    if stored != fmt and not is_representable(a, fmt).all():
        raise BNProbeError(f"{path}: holds values that are not {fmt}, as dump.json says")
    return a, fmt


def check_parameters_grad(rec: Any, data: dict[str, Any], base: Path, module: str) -> None:
    """The mix level's ``Module.<path>.<Class>.parameters_grad.K`` holds the module's weight and bias gradients:
    they equal the kernel's dγ and dβ unless the module ran more than once (they accumulate); say which."""
    key = module.replace(".forward.", ".parameters_grad.")
    pg = data.get(key)
    outs = rec.tensors["backward"]["outputs"]
    if not isinstance(pg, dict):
        return
    for ours, names in (("dgamma", ("weight", "gamma")), ("dbeta", ("bias", "beta"))):  # torch's, MindSpore's
        theirs = next((n for n in names if n in pg), names[0])
        entries = pg.get(theirs)
        entries = [e for e in (entries if isinstance(entries, list) else [entries]) if is_tensor(e)]
        if not entries or ours not in outs:
            continue
        a, _ = load_tensor(base, entries[0], f"{key} {theirs}")
        same = a.shape == outs[ours].shape and np.array_equal(a, outs[ours], equal_nan=True)
        rec.meta.setdefault("checks", []).append(f"{key} {theirs} {'equals' if same else 'differs from'} {ours}")
        if not same:
            rec.meta.setdefault("notes", []).append(
                f"{key}: the module's {theirs} gradient differs from the kernel's {ours} (the module ran more than "
                "once, so its parameter gradients accumulate); the kernel's own output is judged")


def summary_value(v: Any) -> float:
    """A summary value as a float: msprobe writes inf/nan as strings or JSON Infinity/NaN."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan

"""The hostile-input table walked by tests/test_hostile.py (issue 20, "What to build" item 5).

Every case is ``Case(cls, id, argv, setup)``: ``setup(ctx)`` builds the hostile files under ``ctx.inp`` (and may
prepare ``ctx.cwd``, the fresh current folder the case runs in) and returns a dict of names for the ``{name}``
placeholders of ``argv`` (``{root}``, ``{inp}`` and ``{cwd}`` are always there).  The classes:

- ``memory``   huge shapes, batches, steps, samples, lanes, paddings and ``.npy`` headers, run with
               ``BNPROBE_MAX_MEMORY=256M`` (the runner also caps the process's address space as a backstop);
- ``files``    corrupt, degenerate and malicious ``.npy``/``.npz``/``.pt`` inputs and fold weights;
- ``metadata`` bnprobe and msprobe dumps whose JSON metadata is malformed;
- ``options``  out-of-range, empty, malformed and unknown option values, crossed with every command taking them;
- ``paths``    bad ``--out``/``--input`` locations and existing report folders (never overwritten);
- ``plugins``  ``module:Name`` adapters, predicates, formulas and ``bnprobe.adapters`` entry points that are not
               what they claim (``os:abort`` among them: the runner replaces it by a recorder);
- ``logs``     malformed plot-stats logs, and HTML in user strings (layer names).

Kinds are crossed with the commands that take them: the kinds issue 20 names with every such command, the others
with one or two commands in rotation, so that every command meets many kinds and the file runs in about a minute.
``must_refuse`` marks inputs that are invalid beyond doubt (exit 2 is the only right answer); every other case
may also be accepted with a result.  Nothing here imports bnprobe at module level; setups write valid dumps with
bnprobe's own writer (as tests/recordings/test_dumps.py does) and then damage them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

MEMORY_LIMIT = "256M"
HTML_PROBES = ("<script>alert(1)</script>", "<img src=x onerror=alert(1)>")
MARKER_PREFIX = "PWNED"  # any file of this name prefix under the case's root means hostile code ran


# ------------------------------------------------------------------------------------------------ the table ---

@dataclass
class Ctx:
    """What a setup gets: the case's root (tmp_path), its input folder and current folder."""

    root: Path
    inp: Path
    cwd: Path
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    syspath: list[Path] = field(default_factory=list)

    @property
    def marker(self) -> Path:
        """Written by the malicious pickles' payload, should any reader ever unpickle them."""
        return self.root / f"{MARKER_PREFIX}-pickle"


@dataclass(frozen=True)
class Case:
    cls: str
    id: str
    argv: tuple[str, ...]
    setup: Optional[Callable[[Ctx], dict]] = None
    env: tuple[tuple[str, str], ...] = ()
    must_refuse: bool = False  # acceptance would be a silent wrong answer: exit 2 is the only right outcome
    needs: tuple[str, ...] = ()  # optional modules (torch) the setup needs
    unprivileged: bool = False  # meaningless as root (file permissions do not bind root)

    @property
    def test_id(self) -> str:
        return f"{self.cls}:{self.id}"


COMMANDS = ("trace", "rsqrt", "adapters", "dump", "gradcheck", "compare-precision", "overflow", "fold", "doctor",
            "shrink", "plot-stats")

# A fast, valid invocation of every command (tiny shapes, no plots unless the case asks for them).
CP = ("compare-precision", "--no-stress", "--no-budget", "--dtypes", "fp16", "--format", "json")
BASE: dict[str, tuple[str, ...]] = {
    "trace": ("trace", "--shape", "2,3,4,4"),
    "rsqrt": ("rsqrt", "--format", "fp16"),
    "adapters": ("adapters",),
    "dump": ("dump", "--adapter", "emulated", "--out", "{cwd}/dumpout", "--shape", "2,3,4,4"),
    "gradcheck": ("gradcheck", "--shape", "2,3,2,2"),
    "compare-precision": CP + ("--shape", "2,3,4,4"),
    "overflow": ("overflow", "--shape", "2,3,4,4"),
    "fold": ("fold",),
    "doctor": ("doctor", "--no-stability"),
    "shrink": ("shrink", "--adapter", "emulated:fp16-acc16", "--shape", "2,3,4,4", "--mean", "1000", "--seconds",
               "5"),
    "plot-stats": ("plot-stats", "--steps", "3", "--policies", "fp32"),
}
# plot-stats on a tiny log is ~2x faster than a simulated run; used where the option is not the simulation's
PLOT_LOG = ("plot-stats", "--log", "{log}")


# ---------------------------------------------------------------------------------------------- file makers ---

class Evil:
    """Unpickling this runs code: it writes the case's marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (exec, (f"open({self.marker!r}, 'w').write('unpickled')",))


def npy_bytes(a: np.ndarray, allow_pickle: bool = False) -> bytes:
    b = io.BytesIO()
    np.save(b, a, allow_pickle=allow_pickle)
    return b.getvalue()


def header_only_npy(shape: tuple[int, ...], descr: str = "<f8", pad_to: int = 128) -> bytes:
    """A .npy of just a header declaring ``shape`` (no data): 128 bytes for 100000x100000."""
    b = io.BytesIO()
    np.lib.format.write_array_header_1_0(b, {"descr": descr, "fortran_order": False, "shape": shape})
    data = b.getvalue()
    return data + b"\0" * max(0, pad_to - len(data))


def npz_bytes(members: dict[str, bytes]) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return b.getvalue()


def x_small(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3, 4, 4))


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def evil_pt(path: Path, marker: Path) -> Path:
    import torch

    torch.save(Evil(marker), path)
    return path


def x_file(kind: str, ctx: Ctx, name: str = "x") -> Path:
    """One hostile tensor file of ``kind`` under ctx.inp."""
    d = ctx.inp
    x = x_small()
    if kind == "truncated":
        return _write(d / f"{name}.npy", npy_bytes(x)[:-100])
    if kind == "wrong-magic":
        return _write(d / f"{name}.npy", b"\x93NUMPZ" + npy_bytes(x)[6:])
    if kind == "zero-bytes":
        return _write(d / f"{name}.npy", b"")
    if kind == "bad-header":
        raw = npy_bytes(x)
        return _write(d / f"{name}.npy", raw.replace(b"'shape': (2, 3, 4, 4)", b"'shape': (-2, 3, 4, 4)"))
    if kind == "header-syntax":
        raw = npy_bytes(x)
        return _write(d / f"{name}.npy", raw.replace(b"'descr'", b"(descr("))
    if kind == "object-pickle":
        a = np.empty(2, dtype=object)
        a[0], a[1] = Evil(ctx.marker), 1.0
        return _write(d / f"{name}.npy", npy_bytes(a, allow_pickle=True))
    if kind == "raw-pickle":
        return _write(d / f"{name}.npy", pickle.dumps(Evil(ctx.marker)))
    if kind == "pickle-after-npy-magic":
        return _write(d / f"{name}.npy", b"\x93NUMPY" + pickle.dumps(Evil(ctx.marker)))
    if kind == "complex":
        return _write(d / f"{name}.npy", npy_bytes(x + 1j * x))
    if kind == "0-d":
        return _write(d / f"{name}.npy", npy_bytes(np.array(1.5)))
    if kind == "1-d":
        return _write(d / f"{name}.npy", npy_bytes(np.arange(5.0)))
    if kind == "6-d":
        return _write(d / f"{name}.npy", npy_bytes(np.ones((1, 2, 1, 2, 1, 2))))
    if kind == "empty":
        return _write(d / f"{name}.npy", npy_bytes(np.zeros((0, 3, 4, 4))))
    if kind == "zero-channels":
        return _write(d / f"{name}.npy", npy_bytes(np.zeros((2, 0, 4, 4))))
    if kind == "single-value":
        return _write(d / f"{name}.npy", npy_bytes(np.ones((1, 1))))
    if kind == "all-nan":
        return _write(d / f"{name}.npy", npy_bytes(np.full((2, 3, 4, 4), np.nan)))
    if kind == "all-inf":
        return _write(d / f"{name}.npy", npy_bytes(np.full((2, 3, 4, 4), np.inf)))
    if kind == "mixed-nonfinite":
        y = x.copy()
        y[0, 0, 0, :] = [np.nan, np.inf, -np.inf, 1.0]
        return _write(d / f"{name}.npy", npy_bytes(y))
    if kind == "1e308":
        return _write(d / f"{name}.npy", npy_bytes(x / np.abs(x).max() * 1.5e308))  # finite, near float64's max
    if kind == "int64-huge":
        return _write(d / f"{name}.npy", npy_bytes(np.full((2, 3, 4, 4), 2**62, dtype=np.int64)))
    if kind == "bool":
        return _write(d / f"{name}.npy", npy_bytes(x > 0))
    if kind == "string":
        return _write(d / f"{name}.npy", npy_bytes(np.array([["a", "b"], ["c", "d"]])))
    if kind == "structured":
        return _write(d / f"{name}.npy", npy_bytes(np.zeros((2, 3), dtype=[("a", "<f8"), ("b", "<i4")])))
    if kind == "float128":
        return _write(d / f"{name}.npy", npy_bytes(x.astype(np.longdouble)))
    if kind == "big-endian":
        return _write(d / f"{name}.npy", npy_bytes(x.astype(">f4")))
    if kind == "npz-empty":
        return _write(d / f"{name}.npz", npz_bytes({}))
    if kind == "npz-two-arrays":
        return _write(d / f"{name}.npz", npz_bytes({"a.npy": npy_bytes(x), "b.npy": npy_bytes(x)}))
    if kind == "npz-object-pickle":
        a = np.empty(2, dtype=object)
        a[0], a[1] = Evil(ctx.marker), 1.0
        return _write(d / f"{name}.npz", npz_bytes({"x.npy": npy_bytes(a, allow_pickle=True)}))
    if kind == "npz-raw-pickle-member":
        return _write(d / f"{name}.npz", npz_bytes({"x.npy": pickle.dumps(Evil(ctx.marker))}))
    if kind == "npz-corrupt":
        return _write(d / f"{name}.npz", b"PK\x03\x04" + os.urandom(200))
    if kind == "npz-non-npy-member":
        return _write(d / f"{name}.npz", npz_bytes({"x": b"just bytes"}))
    if kind == "pt-malicious":
        return evil_pt(d / f"{name}.pt", ctx.marker)
    if kind == "pt-malicious-as-npz":
        return evil_pt(d / f"{name}.npz", ctx.marker)
    if kind == "pt-legacy-malicious":
        import torch

        p = d / f"{name}.npy"
        torch.save(Evil(ctx.marker), p, _use_new_zipfile_serialization=False)
        return p
    if kind == "huge-header":
        return _write(d / f"{name}.npy", header_only_npy((100000, 100000)))
    if kind == "huge-header-4d":
        return _write(d / f"{name}.npy", header_only_npy((1024, 1024, 256, 256), "<f2"))
    if kind == "huge-header-npz":
        return _write(d / f"{name}.npz", npz_bytes({"x.npy": header_only_npy((100000, 100000))}))
    if kind == "fifo":
        p = d / f"{name}.npy"
        os.mkfifo(p)
        return p
    if kind == "symlink-loop":
        p = d / f"{name}.npy"
        p.symlink_to(p)
        return p
    if kind == "valid":
        return _write(d / f"{name}.npy", npy_bytes(x))
    raise AssertionError(kind)


NEEDS_TORCH = {"pt-malicious", "pt-malicious-as-npz", "pt-legacy-malicious"}


# --------------------------------------------------------------------------------------------------- dumps ---

def bnprobe_dump(folder: Path, *, meta: dict | None = None, dtype: str = "fp16") -> Path:
    """A valid bnprobe dump of one small call (train, infer, backward), written by bnprobe's own writer."""
    from bnprobe.adapters import get_adapter
    from bnprobe.recordings import record, write_dump
    from bnprobe.core.call import BNCall

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 2, 2)) + 2.0
    rec = record(get_adapter("reference"), BNCall(x=x, gamma=rng.uniform(0.5, 1.5, 3), beta=rng.normal(0, 0.1, 3),
                                                  running_mean=np.zeros(3), running_var=np.ones(3),
                                                  dy=rng.standard_normal(x.shape), dtype=dtype),
                 meta=meta or {"seed": 0})
    write_dump(rec, folder)
    return folder


def _edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    doc = json.loads(path.read_text())
    new = fn(doc)
    path.write_text(new if isinstance(new, str) else json.dumps(new))


def _set(doc: dict, dotted: str, value: Any) -> dict:
    cur = doc
    keys = dotted.split(".")
    for k in keys[:-1]:
        cur = cur[k]
    cur[keys[-1]] = value
    return doc


def _del(doc: dict, dotted: str) -> dict:
    cur = doc
    keys = dotted.split(".")
    for k in keys[:-1]:
        cur = cur[k]
    del cur[keys[-1]]
    return doc


DEEP_JSON = "[" * 200000 + "]" * 200000

# name -> function(doc) -> doc | str, applied to bnprobe-dump.json
BNPROBE_DAMAGE: dict[str, Callable[[Any], Any]] = {
    "records-empty-list": lambda d: _set(d, "records", []),
    "records-string": lambda d: _set(d, "records", "train"),
    "records-null": lambda d: _set(d, "records", None),
    "records-missing": lambda d: _del(d, "records"),
    "record-is-list": lambda d: _set(d, "records.train", []),
    "inputs-is-list": lambda d: _set(d, "records.train.inputs", ["x"]),
    "outputs-null": lambda d: _set(d, "records.train.outputs", None),
    "x-entry-string": lambda d: _set(d, "records.train.inputs.x", "train.inputs.x"),
    "x-key-missing": lambda d: _del(d, "records.train.inputs.x.key"),
    "x-shape-string": lambda d: _set(d, "records.train.inputs.x.shape", "2,3,4,4"),
    "x-shape-negative": lambda d: _set(d, "records.train.inputs.x.shape", [-2, 3, 4, 4]),
    "x-format-bogus": lambda d: _set(d, "records.train.inputs.x.format", "fp8"),
    "x-missing": lambda d: _del(d, "records.train.inputs.x"),
    "eps-string": lambda d: _set(d, "eps", "1e-5"),
    "eps-null": lambda d: _set(d, "eps", None),
    "eps-negative": lambda d: _set(d, "eps", -1.0),
    "eps-zero": lambda d: _set(d, "eps", 0.0),
    "eps-nan": lambda d: json.dumps(d).replace('"eps": 1e-05', '"eps": NaN'),
    "eps-huge": lambda d: _set(d, "eps", 1e300),
    "momentum-string": lambda d: _set(d, "momentum", "x"),
    "dtype-int8": lambda d: _set(d, "dtype", "int8"),
    "dtype-null": lambda d: _set(d, "dtype", None),
    "params-bogus": lambda d: _set(d, "params", "fp8"),
    "layout-bogus": lambda d: _set(d, "layout", "diagonal"),
    "saved-kind-bogus": lambda d: _set(d, "saved_kind", "stddev"),
    "meta-list": lambda d: _set(d, "meta", ["seed", 0]),
    "version-999": lambda d: _set(d, "version", 999),
    "root-list": lambda d: [d],
    "root-string": lambda d: json.dumps("bnprobe-dump"),
    "empty-file": lambda d: "",
    "deep-nesting": lambda d: DEEP_JSON,
    "invalid-utf8": lambda d: json.dumps(d).replace('"fp16"', '"fp16\udcff"', 1),
}


def _bnprobe_damaged(name: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        d = bnprobe_dump(ctx.inp / "series" / "step0")
        dj = d / "bnprobe-dump.json"
        if name == "invalid-utf8":
            dj.write_bytes(dj.read_bytes().replace(b'"fp16"', b'"fp16\xff\xfe"', 1))
        else:
            _edit_json(dj, BNPROBE_DAMAGE[name])
        return {"dump": str(d), "series": str(d.parent)}

    return setup


def _bnprobe_tensor_damage(kind: str) -> Callable[[Ctx], dict]:
    """A valid bnprobe-dump.json with a hostile tensors.npz member."""

    def setup(ctx: Ctx) -> dict:
        d = bnprobe_dump(ctx.inp / "series" / "step0")
        with np.load(d / "tensors.npz", allow_pickle=False) as z:
            members = {f"{k}.npy": npy_bytes(z[k]) for k in z.files}
        key = "train.inputs.x.npy"
        if kind == "object-pickle":
            a = np.empty(2, dtype=object)
            a[0], a[1] = Evil(ctx.marker), 1.0
            members[key] = npy_bytes(a, allow_pickle=True)
        elif kind == "raw-pickle":
            members[key] = pickle.dumps(Evil(ctx.marker))
        elif kind == "complex":
            x = np.load(io.BytesIO(members[key]))
            members[key] = npy_bytes(x + 1j)
        elif kind == "all-nan":
            for k in list(members):
                if k.endswith(".x.npy") or k.endswith(".dy.npy"):
                    x = np.load(io.BytesIO(members[k]))
                    members[k] = npy_bytes(np.full_like(x, np.nan))
        elif kind == "huge-header":
            members[key] = header_only_npy((100000, 100000))
        else:
            raise AssertionError(kind)
        (d / "tensors.npz").write_bytes(npz_bytes(members))
        return {"dump": str(d), "series": str(d.parent)}

    return setup


def msprobe_dump(folder: Path, *, suffix: str = ".npy") -> Path:
    """A small msprobe L1 tensor dump of one aten native_batch_norm call (forward and backward), as msprobe
    writes it (step0/rank0/dump.json + dump_tensor_data/): tests/recordings/test_dumps.py's, its other calls left
    out."""
    from tests.recordings.test_dumps import build_msprobe

    build_msprobe(folder, suffix)
    rank = folder / "step0" / "rank0"
    doc = json.loads((rank / "dump.json").read_text())
    doc["data"] = {k: v for k, v in doc["data"].items() if k.startswith("Aten.native_batch_norm.0.")}
    (rank / "dump.json").write_text(json.dumps(doc))
    return rank


FWD = "data.Aten.native_batch_norm.0.forward"
BWD = "data.Aten.native_batch_norm.0.backward"


def _ms_set(path: str, value: Any) -> Callable[[Any], Any]:
    def fn(d: dict) -> dict:
        cur = d
        keys = path.split(".")
        # the call name itself holds dots: "data", "<call>.forward", rest
        if path.startswith("data.Aten.native_batch_norm.0."):
            rest = path[len("data.Aten.native_batch_norm.0."):].split(".")
            cur = d["data"]
            keys = ["Aten.native_batch_norm.0." + rest[0]] + rest[1:]
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        last = keys[-1]
        if isinstance(cur, list):
            cur[int(last)] = value
        elif value is _DELETE:
            del cur[last]
        else:
            cur[last] = value
        return d

    return fn


_DELETE = object()

MSPROBE_DAMAGE: dict[str, Callable[[Any], Any]] = {
    "data-list": lambda d: {**d, "data": []},
    "data-string": lambda d: {**d, "data": "Aten.native_batch_norm.0.forward"},
    "data-null": lambda d: {**d, "data": None},
    "forward-list": _ms_set(FWD, []),
    "forward-string": _ms_set(FWD, "x"),
    "input-args-object": _ms_set(f"{FWD}.input_args", {}),
    "input-args-null": _ms_set(f"{FWD}.input_args", None),
    "input-args-empty": _ms_set(f"{FWD}.input_args", []),
    "input-kwargs-list": _ms_set(f"{FWD}.input_kwargs", [1, 2]),
    "input-kwargs-string": _ms_set(f"{FWD}.input_kwargs", "eps=1e-5"),
    "x-data-name-missing": _ms_set(f"{FWD}.input_args.0.data_name", _DELETE),
    "x-data-name-int": _ms_set(f"{FWD}.input_args.0.data_name", 5),
    "x-data-name-empty": _ms_set(f"{FWD}.input_args.0.data_name", ""),
    "x-data-name-absolute": _ms_set(f"{FWD}.input_args.0.data_name", "/etc/passwd"),
    "x-dtype-int8": _ms_set(f"{FWD}.input_args.0.dtype", "torch.int8"),
    "x-dtype-missing": _ms_set(f"{FWD}.input_args.0.dtype", _DELETE),
    "x-shape-string": _ms_set(f"{FWD}.input_args.0.shape", "4,3,2,2"),
    "x-shape-wrong": _ms_set(f"{FWD}.input_args.0.shape", [4, 3, 2, 3]),
    "x-entry-string": _ms_set(f"{FWD}.input_args.0", "tensor"),
    "weight-entry-list": _ms_set(f"{FWD}.input_args.1", [1, 2, 3]),
    "eps-string": _ms_set(f"{FWD}.input_args.7", {"type": "float", "value": "1e-5"}),
    "eps-null": _ms_set(f"{FWD}.input_args.7", {"type": "float", "value": None}),
    "eps-negative": _ms_set(f"{FWD}.input_args.7", {"type": "float", "value": -1.0}),
    "eps-object": _ms_set(f"{FWD}.input_args.7", {"type": "float", "value": {"v": 1}}),
    "momentum-string": _ms_set(f"{FWD}.input_args.6", {"type": "float", "value": "fast"}),
    "training-string": _ms_set(f"{FWD}.input_args.5", {"type": "bool", "value": "maybe"}),
    "output-object": _ms_set(f"{FWD}.output", {"y": 1}),
    "output-empty": _ms_set(f"{FWD}.output", []),
    "output-numbers": _ms_set(f"{FWD}.output", [1, 2, 3]),
    "backward-string": _ms_set(BWD, "x"),
    "backward-input-string": _ms_set(f"{BWD}.input", "dy"),
    "backward-output-object": _ms_set(f"{BWD}.output", {"dx": 1}),
    "backward-output-numbers": _ms_set(f"{BWD}.output", [1, 2, 3]),
    "task-bogus": lambda d: {**d, "task": "overflow_check"},
    "root-list": lambda d: [d],
    "empty-file": lambda d: "",
    "deep-nesting": lambda d: DEEP_JSON,
    "deep-nesting-in-data": lambda d: '{"task": "tensor", "data": {"Aten.native_batch_norm.0.forward": '
                                      + "[" * 200000 + "]" * 200000 + "}}",
    "nan-stats": lambda d: json.dumps(d).replace('"Max": ', '"Max": NaN, "_": '),
}


def _msprobe_damaged(name: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        root = ctx.inp / "series" / "step0"
        rank = msprobe_dump(root)
        _edit_json(rank / "dump.json", MSPROBE_DAMAGE[name])
        return {"dump": str(root), "series": str(root.parent)}

    return setup


def _msprobe_special(kind: str) -> Callable[[Ctx], dict]:
    """Hostile tensor files and names inside an otherwise valid msprobe dump."""

    def setup(ctx: Ctx) -> dict:
        root = ctx.inp / "series" / "step0"
        rank = msprobe_dump(root, suffix=".pt" if kind.startswith("pt") else ".npy")
        dd = rank / "dump_tensor_data"
        xname = "Aten.native_batch_norm.0.forward.input.0"
        if kind == "pt-malicious":
            evil_pt(dd / f"{xname}.pt", ctx.marker)
        elif kind == "pt-malicious-output":
            evil_pt(dd / "Aten.native_batch_norm.0.forward.output.0.pt", ctx.marker)
        elif kind == "npy-object-pickle":
            a = np.empty(2, dtype=object)
            a[0], a[1] = Evil(ctx.marker), 1.0
            (dd / f"{xname}.npy").write_bytes(npy_bytes(a, allow_pickle=True))
        elif kind == "npy-raw-pickle":
            (dd / f"{xname}.npy").write_bytes(pickle.dumps(Evil(ctx.marker)))
        elif kind == "npy-huge-header":
            (dd / f"{xname}.npy").write_bytes(header_only_npy((100000, 100000), "<f2"))
        elif kind == "npy-all-nan":
            (dd / f"{xname}.npy").write_bytes(npy_bytes(np.full((4, 3, 2, 2), np.nan, np.float16)))
        elif kind == "path-traversal":
            # a perfectly readable x outside the dump: reading it would take a file the dump does not own
            secret = ctx.inp / "outside.npy"
            np.save(secret, np.load(dd / f"{xname}.npy"))
            _edit_json(rank / "dump.json", _ms_set(f"{FWD}.input_args.0.data_name", "../../../../outside.npy"))
        elif kind == "symlink-out":
            secret = ctx.inp / "outside.npy"
            np.save(secret, np.load(dd / f"{xname}.npy"))
            (dd / f"{xname}.npy").unlink()
            (dd / f"{xname}.npy").symlink_to(secret)
        elif kind == "construct-malformed":
            (rank / "construct.json").write_text(json.dumps({"Aten.native_batch_norm.0.forward": ["x"], "a": 5}))
        elif kind == "construct-html":
            (rank / "construct.json").write_text(json.dumps({"Aten.native_batch_norm.0.forward": HTML_PROBES[0]}))
        else:
            raise AssertionError(kind)
        return {"dump": str(root), "series": str(root.parent)}

    return setup


# ------------------------------------------------------------------------------------------------ fold .npz ---

def fold_npz(ctx: Ctx, name: str = "w", **override: Any) -> Path:
    rng = np.random.default_rng(0)
    arrays: dict[str, Any] = {"weight": rng.standard_normal((4, 3, 3, 3)), "gamma": rng.uniform(0.5, 1.5, 4),
                              "beta": rng.normal(0, 0.1, 4), "running_mean": rng.normal(0, 0.1, 4),
                              "running_var": rng.uniform(0.5, 1.5, 4)}
    raw: dict[str, bytes] = {}
    for k, v in override.items():
        if v is _DELETE:
            arrays.pop(k, None)
        elif isinstance(v, bytes):
            raw[f"{k}.npy"] = v
            arrays.pop(k, None)
        else:
            arrays[k] = v
    members = {f"{k}.npy": npy_bytes(np.asarray(v)) for k, v in arrays.items()}
    members.update(raw)
    return _write(ctx.inp / f"{name}.npz", npz_bytes(members))


def _evil_object(ctx: Ctx) -> bytes:
    a = np.empty(2, dtype=object)
    a[0], a[1] = Evil(ctx.marker), 1.0
    return npy_bytes(a, allow_pickle=True)


FOLD_DAMAGE: dict[str, Callable[[Ctx], dict]] = {
    "missing-gamma": lambda c: {"gamma": _DELETE},
    "weight-1d": lambda c: {"weight": np.ones(4)},
    "weight-empty": lambda c: {"weight": np.zeros((0, 3, 3, 3)), "gamma": np.zeros(0), "beta": np.zeros(0),
                               "running_mean": np.zeros(0), "running_var": np.zeros(0)},
    "gamma-wrong-shape": lambda c: {"gamma": np.ones(5)},
    "complex-weight": lambda c: {"weight": np.ones((4, 3, 3, 3)) * (1 + 1j)},
    "object-pickle-weight": lambda c: {"weight": _evil_object(c)},
    "object-pickle-gamma": lambda c: {"gamma": _evil_object(c)},
    "raw-pickle-member": lambda c: {"beta": pickle.dumps(Evil(c.marker))},
    "nan-weight": lambda c: {"weight": np.full((4, 3, 3, 3), np.nan)},
    "negative-var": lambda c: {"running_var": -np.ones(4)},
    "groups-0": lambda c: {"groups": np.array(0)},
    "groups-negative": lambda c: {"groups": np.array(-1)},
    "groups-not-dividing": lambda c: {"groups": np.array(7)},
    "padding-negative": lambda c: {"padding": np.array(-5)},
    "padding-string": lambda c: {"padding": np.array("same")},
    "eps-negative": lambda c: {"eps": np.array(-1.0)},
    "eps-nan": lambda c: {"eps": np.array(np.nan)},
    "kind-bogus": lambda c: {"kind": np.array("conv3d")},
    "x-too-many-channels": lambda c: {"x": np.ones((2, 5, 8, 8))},
    "x-wrong-ndim": lambda c: {"x": np.ones((2, 3))},
    "x-nan": lambda c: {"x": np.full((2, 3, 8, 8), np.nan)},
    "linear-x-mismatch": lambda c: {"weight": np.ones((4, 6)), "x": np.ones((5, 7))},
}


# ------------------------------------------------------------------------------------------------- plot logs ---

LOG_HEADER = "step,layer,channel,mean,var"


def log_rows(steps: int = 3, layer: str = "l1", channels: int = 2, var: str = "1.0") -> list[str]:
    return [f"{s},{layer},{c},0.{c + 1},{var}" for s in range(steps) for c in range(channels)]


def _log(text: str | bytes, name: str = "log.csv") -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        return {"log": str(_write(ctx.inp / name, text))}

    return setup


def _csv(*rows: str, header: str = LOG_HEADER) -> str:
    return "\n".join([header, *rows]) + "\n"


LONG_NAME = "L" * 300
LOGS: dict[str, str | bytes] = {
    "ok": _csv(*log_rows()),
    "negative-var": _csv(*log_rows(), "3,l1,0,0.1,-1.0", "3,l1,1,0.1,-2.0"),
    "nan-var": _csv(*log_rows(), "3,l1,0,0.1,nan", "3,l1,1,0.1,NaN"),
    "all-nan-var": _csv(*log_rows(var="nan")),
    "inf-var": _csv(*log_rows(), "3,l1,0,0.1,inf", "3,l1,1,-inf,1.0"),
    "missing-var-column": _csv("0,l1,0,0.1", "1,l1,0,0.1", header="step,layer,channel,mean"),
    "missing-step-column": _csv("l1,0,0.1,1.0", header="layer,channel,mean,var"),
    "only-header": _csv(),
    "zero-bytes": "",
    "non-numeric-var": _csv(*log_rows(), "3,l1,0,0.1,abc"),
    "non-numeric-step": _csv(*log_rows(), "x,l1,0,0.1,1.0"),
    "huge-step-and-channel": _csv("0,l1,0,0.1,1.0", f"{10**18},l1,{10**12},0.1,1.0"),
    "step-overflow-int64": _csv("0,l1,0,0.1,1.0", f"{10**30},l1,0,0.1,1.0"),
    "duplicate-rows": _csv(*log_rows(), *log_rows()[:2]),
    "running-mean-only": _csv("0,l1,0,0.1,1.0,0.0", "1,l1,0,0.1,1.0,0.0",
                              header="step,layer,channel,mean,var,running_mean"),
    "negative-running-var": _csv("0,l1,0,0.1,1.0,0.0,-1.0", "1,l1,0,0.1,1.0,0.0,-1.0",
                                 header="step,layer,channel,mean,var,running_mean,running_var"),
    "html-layer-script": _csv(*log_rows(layer=HTML_PROBES[0])),
    "html-layer-img": _csv(*log_rows(layer=f'"{HTML_PROBES[1]}"')),
    "long-layer-name": _csv(*log_rows(layer=LONG_NAME)),
    "newline-layer-name": _csv(*log_rows(layer='"two\nlines"')),
    "binary-garbage": bytes(range(256)) * 4,
}


# ---------------------------------------------------------------------------------------------- plugin files ---

PLUGIN_SRC = '''
import numpy as np
MARK = {mark!r}


def _touch(tag):
    with open(MARK + "-" + tag, "w") as fh:
        fh.write(tag)


def returns_int():
    return 42


def returns_none():
    return None


def needs_args(a, b):
    _touch("needs_args")
    return a


class NotAdapter:
    def __init__(self):
        _touch("NotAdapter")


def raises():
    raise RuntimeError("plugin exploded\\nwith a second line")


def always_true(x):
    return True


def never(x):
    return False


def predicate_raises(x):
    raise ZeroDivisionError("division by zero")


def predicate_returns_array(x):
    return x


VALUE = 5


def formula_wrong_shape(dy, x, gamma, mean, var, eps):
    return np.zeros(3)


def formula_nan(dy, x, gamma, mean, var, eps):
    return np.full_like(x, np.nan)


def formula_raises(dy, x, gamma, mean, var, eps):
    raise ZeroDivisionError("division by zero")


def formula_returns_string(dy, x, gamma, mean, var, eps):
    return "dx"
'''


def plugin_setup(ctx: Ctx) -> dict:
    d = ctx.root / "plugins"
    d.mkdir()
    (d / "hostile_plugin.py").write_text(PLUGIN_SRC.format(mark=str(ctx.root / f"{MARKER_PREFIX}-call")))
    (d / "hostile_broken.py").write_text('raise RuntimeError("import-time failure\\nsecond line")\n')
    (d / "hostile_syntax.py").write_text("def (:\n")
    # a distribution on the path whose 'bnprobe.adapters' entry points are not adapters
    info = d / "hostile_dist-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-dist\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[bnprobe.adapters]\n" + "".join(
        f"{name} = {target}\n" for name, target in ENTRY_POINTS.items()))
    ctx.syspath.append(d)
    return {}


ENTRY_POINTS = {"evil-notadapter": "hostile_plugin:NotAdapter", "evil-broken": "hostile_broken:X",
                "evil-abort": "os:abort", "evil-int": "hostile_plugin:returns_int",
}


# ------------------------------------------------------------------------------------------------ the cases ---

def _tensor_readers(path: str) -> dict[str, tuple[str, ...]]:
    """Every command that reads a tensor file, with ``path`` as its input."""
    return {
        "trace": ("trace", "--input", path),
        "dump": ("dump", "--adapter", "emulated", "--out", "{cwd}/dumpout", "--input", path),
        "compare-precision": CP + ("--input", path),
        "overflow": ("overflow", "--input", path),
        "doctor": ("doctor", "--no-stability", "--input", path),
        "shrink": ("shrink", "--adapter", "emulated:fp16-acc16", "--seconds", "5", "--input", path),
    }


def _dump_readers(dump: str = "{dump}", series: str = "{series}") -> dict[str, tuple[str, ...]]:
    """Every command that reads a dump folder."""
    return {
        "trace": ("trace", "--input", dump),
        "gradcheck": ("gradcheck", "--adapter", f"dump:{dump}"),
        "compare-precision": ("compare-precision", "--adapters", f"dump:{dump}", "--no-budget", "--format", "json"),
        "overflow": ("overflow", "--adapter", f"dump:{dump}"),
        "doctor": ("doctor", "--adapter", f"dump:{dump}"),
        "shrink": ("shrink", "--adapter", "emulated:fp16-acc16", "--seconds", "5", "--input", dump),
        "plot-stats": ("plot-stats", "--dumps", series),
    }


def _one_file(kind: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        return {"x": str(x_file(kind, ctx))}

    return setup


def _fold(damage: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        return {"w": str(fold_npz(ctx, **FOLD_DAMAGE[damage](ctx)))}

    return setup


def onnx_model(ctx: Ctx, damage: str = "") -> Path:
    """A Conv -> BatchNormalization model (fold --onnx), damaged as ``damage`` says."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w", rng.standard_normal((4, 3, 3, 3))), ("g", np.ones(4)), ("b", np.zeros(4)), ("m", np.zeros(4)),
        ("v", np.ones(4)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn")]
    if damage == "cycle":
        nodes[0].input[0] = "y"
    if damage == "written-twice":
        nodes[1].output[0] = "c"
    if damage == "absurd-dims":
        del inits[0].dims[:]
        inits[0].dims.extend([100000, 100000, 3, 3])
    if damage == "external-escape":
        _write(ctx.root / "outside.bin", b"\0" * 432)
        inits[0].ClearField("raw_data")
        inits[0].data_location = TensorProto.EXTERNAL
        inits[0].external_data.add(key="location", value="../outside.bin")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    if damage == "truncated":
        data = data[: len(data) // 2]
    return _write(ctx.inp / "model.onnx", data)


ONNX_DAMAGE = ("truncated", "cycle", "written-twice", "absurd-dims", "external-escape")


def _onnx(damage: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        return {"m": str(onnx_model(ctx, damage))}

    return setup


MEM_ENV = (("BNPROBE_MAX_MEMORY", MEMORY_LIMIT),)


def rotate(names: list[str], i: int, k: int) -> list[str]:
    """k of ``names``, starting at the i-th: crossing kinds with commands this way, every command meets many
    kinds and the table stays small enough to run in about a minute."""
    return [names[(i * k + j) % len(names)] for j in range(min(k, len(names)))]


def memory_cases() -> list[Case]:
    out: list[Case] = []

    def add(cid: str, argv: tuple[str, ...], setup: Callable[[Ctx], dict] | None = None) -> None:
        out.append(Case("memory", cid, argv, setup, env=MEM_ENV))

    huge_shapes = {"46340x46340": "46340,46340", "1x128x1024x1024": "1,128,1024,1024", "2p31": "2,1073741824",
                   "4x64x512x512": "4,64,512,512", "5d": "8,64,64,64,64", "over-2p31": "65536,65536"}
    shape_cmds = {"trace": BASE["trace"][:1], "dump": BASE["dump"][:5], "gradcheck": ("gradcheck",),
                  "compare-precision": CP, "overflow": ("overflow",),
                  "shrink": ("shrink", "--adapter", "emulated:fp16-acc16", "--seconds", "5")}
    for i, (sid, shape) in enumerate(huge_shapes.items()):
        cmds = list(shape_cmds) if i < 2 else rotate(list(shape_cmds), i, 1)
        for cmd in cmds:
            add(f"{cmd}-shape-{sid}", shape_cmds[cmd] + ("--shape", shape))
    for b in ("100000", str(2**63 - 1)):
        add(f"compare-precision-batch-{b}", CP + ("--batch", b))
    add("compare-precision-batch-and-stress", ("compare-precision", "--no-budget", "--dtypes", "fp16", "--format",
                                               "json", "--batch", "4096"))
    for s in ("100000000", str(10**12)):
        add(f"plot-stats-steps-{s}", ("plot-stats", "--steps", s, "--policies", "fp32"))
    for i, kind in enumerate(("huge-header", "huge-header-4d", "huge-header-npz")):
        readers = _tensor_readers("{x}")
        for cmd in (list(readers) if i == 0 else rotate(list(readers), i, 2)):
            add(f"{cmd}-{kind}", readers[cmd], _one_file(kind))
    add("fold-huge-header-weight", ("fold", "--weights", "{w}"),
        lambda c: {"w": str(fold_npz(c, weight=header_only_npy((100000, 100000, 3, 3))))})
    add("fold-huge-header-x", ("fold", "--weights", "{w}"),
        lambda c: {"w": str(fold_npz(c, x=header_only_npy((100000, 3, 1000, 1000))))})
    for pad in (10**6, 10**9):
        add(f"fold-padding-{pad}", ("fold", "--weights", "{w}"),
            lambda c, pad=pad: {"w": str(fold_npz(c, padding=np.array(pad)))})
    for i, lanes in enumerate(("lanes=1000000000", "order=lanes,lanes=1000000000", "tiles=1000000000",
                               "lanes=4294967296")):
        if i % 2 == 0:
            add(f"trace-policy-{lanes}", ("trace", "--shape", "2,3,4,4", "--policy", f"fp16:{lanes}"))
        else:
            add(f"overflow-adapter-{lanes}", ("overflow", "--shape", "2,3,4,4", "--adapter",
                                              f"emulated:fp16:{lanes}"))
    huge_lanes = "emulated:fp16:lanes=1000000000"
    add("gradcheck-policy-lanes-1e9", ("gradcheck", "--shape", "2,3,2,2", "--adapter", huge_lanes))
    add("compare-precision-policy-lanes-1e9", CP + ("--shape", "2,3,4,4", "--adapters", huge_lanes))
    for fmt, n in (("fp32", str(10**9)), ("fp32", str(2**62)), ("fp16", str(10**12))):
        add(f"rsqrt-{fmt}-samples-{n}", ("rsqrt", "--format", fmt, "--samples", n))
    for n in ("1000000", "1000000000", "0," + ",".join(str(i) for i in range(1, 2000))):
        add(f"rsqrt-newton-{n[:12]}", ("rsqrt", "--format", "fp16", "--newton", n))
    add("rsqrt-bits-1000", ("rsqrt", "--format", "fp16", "--method", "table", "--bits", "1000"))
    add("rsqrt-bits-62", ("rsqrt", "--format", "fp32", "--method", "table", "--bits", "62"))
    # a bnprobe / msprobe dump whose metadata and tensor header declare a huge x
    add("trace-bnprobe-dump-huge-header", ("trace", "--input", "{dump}"), _bnprobe_tensor_damage("huge-header"))
    add("overflow-bnprobe-dump-huge-header", ("overflow", "--adapter", "dump:{dump}"),
        _bnprobe_tensor_damage("huge-header"))
    add("doctor-msprobe-huge-header", ("doctor", "--adapter", "dump:{dump}"), _msprobe_special("npy-huge-header"))
    add("plot-stats-log-huge-step", PLOT_LOG, _log(LOGS["huge-step-and-channel"]))
    add("adapters", ("adapters",))
    add("adapters--json", ("adapters", "--json"))
    return out


FILE_KINDS = ["truncated", "wrong-magic", "zero-bytes", "bad-header", "header-syntax", "object-pickle", "raw-pickle",
              "pickle-after-npy-magic", "complex", "0-d", "1-d", "6-d", "empty", "zero-channels", "single-value",
              "all-nan", "all-inf", "mixed-nonfinite", "1e308", "int64-huge", "bool", "string", "structured",
              "float128", "big-endian", "npz-empty", "npz-two-arrays", "npz-object-pickle", "npz-raw-pickle-member",
              "npz-corrupt", "npz-non-npy-member", "pt-malicious", "pt-malicious-as-npz", "pt-legacy-malicious",
              "symlink-loop", "valid"]
# the kinds every tensor reader gets; each of the rest goes to one reader, rotating (keeps the file fast)
FILE_KINDS_ALL_READERS = {"object-pickle", "raw-pickle", "all-nan", "pt-malicious"}


def file_cases() -> list[Case]:
    out: list[Case] = []
    for i, kind in enumerate(FILE_KINDS):
        readers = _tensor_readers("{x}")
        names = list(readers)
        chosen = names if kind in FILE_KINDS_ALL_READERS else rotate(names, i, 1)
        for cmd in chosen:
            out.append(Case("files", f"{cmd}-{kind}", readers[cmd], _one_file(kind),
                            needs=("torch",) if kind in NEEDS_TORCH else ()))
    out.append(Case("files", "trace-fifo", ("trace", "--input", "{x}"), _one_file("fifo")))
    out.append(Case("files", "compare-precision-dev-urandom", CP + ("--input", "/dev/urandom")))
    # gradcheck takes dump folders only: a tensor file is refused
    out.append(Case("files", "gradcheck-npy-input", ("gradcheck", "--input", "{x}"), _one_file("valid")))
    out.append(Case("files", "gradcheck-pickle-input", ("gradcheck", "--input", "{x}"), _one_file("raw-pickle")))
    # fold --weights
    for damage in FOLD_DAMAGE:
        out.append(Case("files", f"fold-{damage}", ("fold", "--weights", "{w}"), _fold(damage)))
    for kind in ("raw-pickle", "npz-object-pickle", "pt-malicious-as-npz"):
        out.append(Case("files", f"fold-file-{kind}", ("fold", "--weights", "{x}"), _one_file(kind),
                        needs=("torch",) if kind in NEEDS_TORCH else ()))
    out.append(Case("files", "fold-ok", ("fold", "--weights", "{w}", "--dtype", "fp32"),
                    lambda c: {"w": str(fold_npz(c))}))
    # fold --onnx (and --fuse ort, which must refuse the model before onnxruntime sees it)
    for i, damage in enumerate(ONNX_DAMAGE):
        fuse = ("--fuse", "ort") if i % 2 else ()
        out.append(Case("files", f"fold-onnx-{damage}", ("fold", "--onnx", "{m}", *fuse, "--out", "{cwd}/r"),
                        _onnx(damage), must_refuse=True, needs=("onnx", "onnxruntime")))
    out.append(Case("files", "fold-onnx-not-a-model", ("fold", "--onnx", "{x}"), _one_file("raw-pickle"),
                    must_refuse=True, needs=("onnx",)))
    out.append(Case("files", "fold-onnx-ok", ("fold", "--onnx", "{m}", "--fuse", "ort", "--json"), _onnx(""),
                    needs=("onnx", "onnxruntime")))
    # a malicious .pt and a pickle inside a dump
    readers = _dump_readers()
    for i, kind in enumerate(("pt-malicious", "pt-malicious-output", "npy-object-pickle", "npy-raw-pickle",
                              "npy-all-nan")):
        for cmd in (list(readers) if i == 0 else rotate(list(readers)[:5], i, 1)):
            out.append(Case("files", f"{cmd}-msprobe-{kind}", readers[cmd], _msprobe_special(kind),
                            needs=("torch",) if kind.startswith("pt") else ()))
    for i, kind in enumerate(("object-pickle", "raw-pickle", "complex", "all-nan")):
        for cmd in rotate(["trace", "gradcheck", "compare-precision", "overflow"], i, 1):
            out.append(Case("files", f"{cmd}-bnprobe-tensors-{kind}", readers[cmd], _bnprobe_tensor_damage(kind)))
    return out


PLOT_DAMAGE = ("bnprobe:records-empty-list", "bnprobe:x-key-missing", "bnprobe:eps-string", "bnprobe:meta-list",
               "msprobe:data-list", "msprobe:forward-string", "msprobe:eps-string", "msprobe:output-object")


def metadata_cases() -> list[Case]:
    out: list[Case] = []
    readers = _dump_readers()
    names = [n for n in readers if n != "plot-stats"]  # plot-stats (slow figures) gets the damages of PLOT_DAMAGE
    for name in PLOT_DAMAGE:
        kind, _, damage = name.partition(":")
        setup = _bnprobe_damaged(damage) if kind == "bnprobe" else _msprobe_damaged(damage)
        out.append(Case("metadata", f"plot-stats-{kind}-{damage}", readers["plot-stats"], setup))
    # each damage through one reader (two for the kinds the issue names), rotating over the other six
    for i, name in enumerate(BNPROBE_DAMAGE):
        for cmd in rotate(names, i, 2 if name.startswith(("records", "eps")) else 1):
            out.append(Case("metadata", f"{cmd}-bnprobe-{name}", readers[cmd], _bnprobe_damaged(name)))
    for i, name in enumerate(MSPROBE_DAMAGE):
        for cmd in rotate(names, i, 2 if name.startswith(("data", "forward", "input-kwargs", "eps")) else 1):
            out.append(Case("metadata", f"{cmd}-msprobe-{name}", readers[cmd], _msprobe_damaged(name)))
    for kind in ("path-traversal", "symlink-out"):
        for cmd in (("trace", "gradcheck", "overflow", "doctor") if kind == "path-traversal" else ("trace",)):
            out.append(Case("metadata", f"{cmd}-msprobe-{kind}", readers[cmd], _msprobe_special(kind),
                            must_refuse=kind == "path-traversal"))
    for kind in ("construct-malformed", "construct-html"):
        for cmd in ("trace", "compare-precision"):
            out.append(Case("metadata", f"{cmd}-msprobe-{kind}", readers[cmd], _msprobe_special(kind)))
    out.append(Case("metadata", "compare-precision-html-msprobe-construct",
                    ("compare-precision", "--adapters", "dump:{dump}", "--no-budget", "--format", "html"),
                    _msprobe_special("construct-html")))
    # controls: the undamaged dumps are read
    for i, cmd in enumerate(readers):  # one control per reader, bnprobe and msprobe dumps alternating
        if i % 2:
            out.append(Case("metadata", f"{cmd}-bnprobe-ok", readers[cmd],
                            lambda c: {"dump": str(bnprobe_dump(c.inp / "series" / "step0")),
                                       "series": str(c.inp / "series")}))
        else:
            out.append(Case("metadata", f"{cmd}-msprobe-ok", readers[cmd],
                            lambda c: {"dump": str(msprobe_dump(c.inp / "series" / "step0").parent.parent),
                                       "series": str(c.inp / "series")}))
    # a bnprobe dump whose call name is HTML, plotted
    out.append(Case("metadata", "plot-stats-bnprobe-html-call", ("plot-stats", "--dumps", "{series}"),
                    lambda c: {"series": str(bnprobe_dump(c.inp / "series" / "step0",
                                                          meta={"call": HTML_PROBES[0]}).parent)}))
    # a dump folder that is something else
    for i, cmd in enumerate(("trace", "gradcheck", "doctor")):
        if i:
            continue
        out.append(Case("metadata", f"{cmd}-empty-dump-folder", readers[cmd],
                        lambda c: {"dump": str((c.inp / "series" / "step0").mkdir(parents=True) or
                                               c.inp / "series" / "step0"), "series": str(c.inp / "series")}))
        out.append(Case("metadata", f"{cmd}-dump-json-is-folder", readers[cmd], _dump_json_is_folder))
        out.append(Case("metadata", f"{cmd}-model-calls-malformed", readers[cmd], _calls_json("malformed")))
        out.append(Case("metadata", f"{cmd}-model-calls-traversal", readers[cmd], _calls_json("traversal")))
    return out


def _dump_json_is_folder(ctx: Ctx) -> dict:
    d = ctx.inp / "series" / "step0"
    (d / "bnprobe-dump.json").mkdir(parents=True)
    return {"dump": str(d), "series": str(d.parent)}


def _calls_json(kind: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        d = ctx.inp / "series" / "step0"
        d.mkdir(parents=True)
        if kind == "malformed":
            doc: Any = {"format": "bnprobe-calls", "calls": [{"module": 5}, "x", None]}
        else:
            bnprobe_dump(ctx.inp / "elsewhere")
            doc = {"format": "bnprobe-calls", "calls": [{"module": "bn1", "dir": "../../elsewhere", "training": True,
                                                         "name": "bn1.0"}]}
        (d / "bnprobe-calls.json").write_text(json.dumps(doc))
        return {"dump": str(d), "series": str(d.parent)}

    return setup


# option -> (commands taking it, bad values); each value crossed with each command
OPTION_VALUES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "--seed": (("trace", "rsqrt", "dump", "gradcheck", "compare-precision", "overflow", "fold", "doctor", "shrink",
                "plot-stats"), ("-1", str(2**64))),
    "--eps": (("trace", "dump", "gradcheck", "compare-precision", "overflow", "fold", "plot-stats"),
              ("1e300", "0", "nan", "-1e-5", "inf", "1e-320")),
    "--momentum": (("trace", "dump"), ("2", "-1", "nan", "inf")),
    "--mode": (("trace", "gradcheck", "compare-precision", "overflow", "shrink"), ("bogus", "")),
    "--layout": (("trace", "dump"), ("bogus", "")),
    "--shape": (("trace", "dump", "gradcheck", "compare-precision", "overflow", "shrink"),
                ("0,3", "3", "a,b", "1,2,3,4,5,6", "", "2,-3", "2,3,4.5", "1,1", "99999999999999999999,2")),
    "--dtype": (("dump", "gradcheck", "overflow", "fold", "doctor", "shrink"), ("", "bogus", "int8")),
    "--params": (("trace", "dump", "gradcheck", "compare-precision", "overflow", "doctor", "shrink"), ("bogus",)),
    "--dist": (("trace", "dump", "compare-precision", "overflow", "shrink"), ("bogus",)),
    "--mean": (("trace", "dump", "compare-precision", "overflow", "shrink"), ("nan", "inf", "1e308")),
    "--std": (("trace", "dump", "compare-precision", "overflow", "shrink"), ("-1", "nan", "1e300", "0")),
    "--accumulate": (("overflow", "fold"), ("bogus", "int8")),
    "--calls": (("trace", "gradcheck", "compare-precision", "overflow", "doctor", "shrink"), ("*",)),
    "--bogus-option": (COMMANDS, ("1", "2")),
}
# values that are invalid beyond doubt: accepting them can only be a silent wrong answer
MUST_REFUSE = {("--eps", "0"), ("--eps", "nan"), ("--eps", "-1e-5"), ("--eps", "inf"), ("--mode", "bogus"),
               ("--mode", ""), ("--layout", ""), ("--dtype", ""),  # (empty: names nothing; not the default)
               ("--layout", "bogus"), ("--shape", "a,b"), ("--shape", "0,3"), ("--shape", "2,-3"),
               ("--dtype", "bogus"), ("--params", "bogus"), ("--dist", "bogus"), ("--std", "-1"), ("--mean", "nan"),
               ("--accumulate", "bogus"), ("--seed", "abc"), ("--bogus-option", "1")}


def _with_option(cmd: str, opt: str, value: str) -> tuple[tuple[str, ...], Callable[[Ctx], dict] | None]:
    base = BASE[cmd]
    if cmd == "plot-stats" and opt == "--eps":
        return PLOT_LOG + (opt, value), _log(LOGS["ok"])
    if opt == "--shape":
        i = base.index("--shape")
        base = base[:i] + base[i + 2:]
    if opt == "--dtype" and cmd == "dump":
        return base + ("--dtype", value), None
    if opt == "--bogus-option":
        return base + ("--bogus-option", value), None
    return base + (opt, value), None


# the values issue 20 names: crossed with every command taking the option; other values go to one command each
EVERY_COMMAND = {("--seed", "-1"), ("--eps", "1e300"), ("--eps", "0"), ("--eps", "nan"), ("--momentum", "2"),
                 ("--mode", "bogus"), ("--layout", "bogus"), ("--shape", "0,3"), ("--shape", "3"), ("--shape", "a,b"),
                 ("--shape", "1,2,3,4,5,6")}


def option_cases() -> list[Case]:
    out: list[Case] = []
    k = 0
    for opt, (cmds, values) in OPTION_VALUES.items():
        for value in values:
            if (opt, value) in EVERY_COMMAND:
                chosen = list(cmds)
            else:
                chosen, k = rotate(list(cmds), k, 1), k + 1
            for cmd in chosen:
                argv, setup = _with_option(cmd, opt, value)
                out.append(Case("options", f"{cmd}{opt}={value!r}", argv, setup,
                                must_refuse=(opt, value) in MUST_REFUSE))
    add = out.append
    # command-specific options: (id, argv, setup, must_refuse)
    log = _log(LOGS["ok"])
    specific = [
        ("compare-precision--dtypes=''", CP[:3] + ("--format", "json", "--shape", "2,3,4,4", "--dtypes", ""), None,
         True),
        ("compare-precision--dtypes=,", CP[:3] + ("--format", "json", "--shape", "2,3,4,4", "--dtypes", ","), None,
         False),
        ("compare-precision--adapters=''", CP + ("--shape", "2,3,4,4", "--adapters", ""), None, True),
        ("compare-precision--adapters=,bogus", CP + ("--shape", "2,3,4,4", "--adapters", ",bogus"), None, True),
        ("plot-stats--policies=''", ("plot-stats", "--steps", "3", "--policies", ""), None, True),
        ("plot-stats--policies=bogus", ("plot-stats", "--steps", "3", "--policies", "fp32,bogus"), None, True),
        ("compare-precision--format=bogus", CP[:5] + ("--shape", "2,3,4,4", "--format", "csv,bogus"), None, True),
        ("plot-stats--format=pdf", PLOT_LOG + ("--format", "pdf"), log, True),
        ("plot-stats--format=../png", PLOT_LOG + ("--format", "../png"), log, True),
        ("rsqrt--format=bogus", ("rsqrt", "--format", "bogus"), None, True),
        ("rsqrt--format=''", ("rsqrt", "--format", ""), None, True),
        ("rsqrt--op=sin", ("rsqrt", "--format", "fp16", "--op", "sin"), None, True),
        ("rsqrt--method=bogus", ("rsqrt", "--format", "fp16", "--method", "bogus"), None, True),
        ("rsqrt--method=frecpe", ("rsqrt", "--format", "fp16", "--method", "frecpe"), None, False),
        ("rsqrt--form=bogus", ("rsqrt", "--format", "fp16", "--form", "bogus"), None, True),
        ("rsqrt--subnormals=bogus", ("rsqrt", "--format", "fp16", "--subnormals", "bogus"), None, True),
        ("rsqrt--working=bogus", ("rsqrt", "--format", "fp16", "--working", "bogus"), None, True),
        ("rsqrt-fp16--constant=0", ("rsqrt", "--format", "fp16", "--constant", "0"), None, False),
        ("rsqrt-fp16--constant=0x7fffffff", ("rsqrt", "--format", "fp16", "--constant", "0x7fffffff"), None, False),
        ("rsqrt-fp16--constant=-1", ("rsqrt", "--format", "fp16", "--constant", "-1"), None, False),
        ("rsqrt-fp16--constant=1e30", ("rsqrt", "--format", "fp16", "--constant", str(10**30)), None, False),
        ("rsqrt-fp16--constant=abc", ("rsqrt", "--format", "fp16", "--constant", "abc"), None, True),
        ("rsqrt-bf16--constant=0", ("rsqrt", "--format", "bf16", "--constant", "0"), None, False),
        ("rsqrt-fp32--constant=0x7fffffff", ("rsqrt", "--format", "fp32", "--samples", "2000", "--constant",
                                             "0x7fffffff"), None, False),
        ("rsqrt--newton=99", ("rsqrt", "--format", "fp16", "--newton", "99"), None, False),
        ("rsqrt--newton=-1", ("rsqrt", "--format", "fp16", "--newton", "-1"), None, True),
        ("rsqrt--newton=''", ("rsqrt", "--format", "fp16", "--newton", ""), None, True),
        ("rsqrt--newton=a", ("rsqrt", "--format", "fp16", "--newton", "a"), None, True),
        ("rsqrt--samples=0", ("rsqrt", "--format", "fp32", "--samples", "0"), None, True),
        ("rsqrt--samples=-5", ("rsqrt", "--format", "fp32", "--samples", "-5"), None, True),
        ("rsqrt--exhaustive+samples", ("rsqrt", "--format", "fp16", "--exhaustive", "--samples", "10"), None, True),
        ("rsqrt--bits=0", ("rsqrt", "--format", "fp16", "--method", "table", "--bits", "0"), None, False),
        ("rsqrt--bits=-1", ("rsqrt", "--format", "fp16", "--method", "table", "--bits", "-1"), None, False),
        ("fold--groups=0", ("fold", "--groups", "0"), None, True),
        ("fold--groups=-1", ("fold", "--groups", "-1"), None, True),
        ("fold--groups=3", ("fold", "--groups", "3"), None, True),
        ("fold--groups=1e9", ("fold", "--groups", str(10**9)), None, False),
        ("fold-weights--groups=0", ("fold", "--weights", "{w}", "--groups", "0"),
         lambda c: {"w": str(fold_npz(c))}, False),
        ("fold--layer=conv3d", ("fold", "--layer", "conv3d"), None, True),
        ("shrink--seconds=-1", BASE["shrink"][:-2] + ("--seconds", "-1"), None, True),
        ("shrink--seconds=0", BASE["shrink"][:-2] + ("--seconds", "0"), None, False),
        ("shrink--seconds=nan", BASE["shrink"][:-2] + ("--seconds", "nan"), None, True),
        ("shrink--seconds=inf", BASE["shrink"][:-2] + ("--seconds", "inf"), None, False),
        ("plot-stats--steps=0", ("plot-stats", "--steps", "0", "--policies", "fp32"), None, True),
        ("plot-stats--channels=-1", PLOT_LOG + ("--channels", "-1"), log, True),
        ("compare-precision--batch=0", CP + ("--batch", "0"), None, True),
        ("compare-precision--batch=-1", CP + ("--batch", "-1"), None, True),
        ("compare-precision--shapes=bogus", CP + ("--shapes", "bogus"), None, True),
        ("compare-precision--rule=bogus", CP + ("--shape", "2,3,4,4", "--rule", "bogus"), None, True),
        ("compare-precision--bench=bogus", CP + ("--shape", "2,3,4,4", "--bench", "bogus"), None, True),
        ("dump--modes=''", BASE["dump"] + ("--modes", ""), None, True),
        ("dump--modes=bogus", BASE["dump"] + ("--modes", "train,bogus"), None, True),
        ("trace--policy=bogus", BASE["trace"] + ("--policy", "bogus"), None, True),
        ("trace--policy=fp16:lanes=abc", BASE["trace"] + ("--policy", "fp16:lanes=abc"), None, True),
        ("trace--policy=fp16:variance=bogus", BASE["trace"] + ("--policy", "fp16:variance=bogus"), None, True),
        ("trace--policy=fp16:=", BASE["trace"] + ("--policy", "fp16:="), None, False),
        ("gradcheck--adapter=emulated:fp16:lanes=0", BASE["gradcheck"] + ("--adapter", "emulated:fp16:lanes=0"),
         None, True),
        ("gradcheck--adapter=emulated:fp16:nokey=1", BASE["gradcheck"] + ("--adapter", "emulated:fp16:nokey=1"),
         None, True),
        ("overflow--adapter=ascend-tbe:chip=bogus", BASE["overflow"] + ("--adapter", "ascend-tbe:chip=bogus"), None,
         True),
        ("overflow--adapter=ascend-tbe:cores=0", BASE["overflow"] + ("--adapter", "ascend-tbe:cores=0"), None, True),
        ("overflow--adapter=ascend-tbe:cores=1e8", BASE["overflow"] + ("--adapter", "ascend-tbe:cores=100000000"),
         None, False),
        ("overflow--adapter=dump:", BASE["overflow"] + ("--adapter", "dump:"), None, True),
        ("gradcheck--rtol=-1", BASE["gradcheck"] + ("--rtol", "-1", "--atol", "1e-3"), None, True),
        ("gradcheck--rtol=nan", BASE["gradcheck"] + ("--rtol", "nan", "--atol", "1e-3"), None, True),
        ("gradcheck--rtol-alone", BASE["gradcheck"] + ("--rtol", "1e-3"), None, False),
        ("gradcheck--formula=bogus", BASE["gradcheck"] + ("--formula", "bogus"), None, True),
        ("gradcheck--formula=module:", BASE["gradcheck"] + ("--formula", "module:"), None, True),
        ("shrink--predicate=bogus", BASE["shrink"] + ("--predicate", "bogus"), None, True),
        # a spec given empty names nothing (issue 57 item 8): refused, never the default in its place
        ("trace--policy=''", BASE["trace"] + ("--policy", ""), None, True),
        ("trace--policy=fp16:", BASE["trace"] + ("--policy", "fp16:"), None, True),
        ("gradcheck--adapter=emulated:", BASE["gradcheck"] + ("--adapter", "emulated:"), None, True),
        ("gradcheck--adapter=emulated:fp16:", BASE["gradcheck"] + ("--adapter", "emulated:fp16:"), None, True),
        ("compare-precision--adapters=ascend-tbe:", CP + ("--shape", "2,3,4,4", "--adapters", "ascend-tbe:"), None,
         True),
        ("compare-precision--bench=careful:", CP + ("--shape", "2,3,4,4", "--bench", "careful:"), None, True),
        ("compare-precision--format=''", CP[:5] + ("--shape", "2,3,4,4", "--format", ""), None, True),
        ("overflow--convention=''", BASE["overflow"] + ("--convention", ""), None, True),
        ("overflow--accumulate=''", BASE["overflow"] + ("--accumulate", ""), None, True),
        ("doctor--adapter=dump:", BASE["doctor"] + ("--adapter", "dump:"), None, True),
        ("gradcheck--calls=''", ("gradcheck", "--adapter", "dump:{dump}", "--calls", ""),
         lambda c: {"dump": str(bnprobe_dump(c.inp / "d"))}, True),
        # one value per channel (R = N·H·W = 1): training undefined, refused where it is asked for or is the
        # command's one mode; compare-precision and doctor judge inference and say so (tests/test_one_value.py)
        ("compare-precision--shape=1,3", CP + ("--shape", "1,3"), None, False),
        ("compare-precision--shape=1,3--mode=train", CP + ("--shape", "1,3", "--mode", "train"), None, True),
        ("compare-precision--shape=1,3,1,1--mode=backward", CP + ("--shape", "1,3,1,1", "--mode", "backward"), None,
         True),
        ("doctor--shape=1,3", BASE["doctor"] + ("--shape", "1,3"), None, False),
        ("trace--shape=1,3", ("trace", "--shape", "1,3"), None, True),
        ("gradcheck--shape=1,3,1,1", ("gradcheck", "--shape", "1,3,1,1"), None, True),
        ("overflow--shape=1,3", ("overflow", "--shape", "1,3"), None, True),
        ("dump--shape=1,3", ("dump", "--adapter", "emulated", "--out", "{cwd}/dumpout", "--shape", "1,3"), None,
         True),
        ("shrink--shape=1,3", ("shrink", "--adapter", "emulated:fp16-acc16", "--shape", "1,3", "--mean", "1000",
                               "--seconds", "5"), None, True),
        ("trace--norm=layer--shape=2,1", ("trace", "--norm", "layer", "--shape", "2,1"), None, True),
        ("compare-precision--norm=rms--shape=2,1", CP + ("--norm", "rms", "--shape", "2,1"), None, True),
        ("overflow--norm=instance--shape=2,3,1", ("overflow", "--norm", "instance", "--shape", "2,3,1"), None, True),
        ("dump--norm=group--shape=2,4,1,1", ("dump", "--adapter", "emulated", "--out", "{cwd}/dumpout", "--norm",
                                             "group", "--num-groups", "4", "--shape", "2,4,1,1"), None, True),
    ]
    for cid, argv, setup, refuse in specific:
        add(Case("options", cid, argv, setup, must_refuse=refuse))
    # the memory limit itself
    for i, v in enumerate(("abc", "0", "-1", "256Q", "", "1T")):
        where = ("root", "command", "env")[i % 3]
        if where == "root":
            add(Case("options", f"trace-root--max-memory={v!r}", ("--max-memory", v) + BASE["trace"]))
        elif where == "command":
            add(Case("options", f"compare-precision--max-memory={v!r}", CP + ("--shape", "2,3,4,4", "--max-memory",
                                                                               v)))
        else:
            add(Case("options", f"overflow-env-BNPROBE_MAX_MEMORY={v!r}", BASE["overflow"],
                     env=(("BNPROBE_MAX_MEMORY", v),)))
    # stray arguments and misuse
    for cmd in ("trace", "adapters", "fold", "plot-stats"):
        add(Case("options", f"{cmd}-positional", BASE[cmd] + ("stray",), must_refuse=True))
    add(Case("options", "no-command-bogus", ("bogus-command",), must_refuse=True))
    add(Case("options", "adapters--json-twice", ("adapters", "--json", "--json")))
    add(Case("options", "plot-stats-two-sources", ("plot-stats", "--simulate", "--log", "{log}"), _log(LOGS["ok"]),
             must_refuse=True))
    # controls: the base invocations are accepted
    for cmd in COMMANDS:
        if cmd != "plot-stats":  # its controls are in the logs class (a simulated run is slow)
            add(Case("options", f"{cmd}-ok", BASE[cmd]))
    return out


WRITERS: dict[str, tuple[str, ...]] = {  # BASE's invocations, without an --out of their own
    **{c: BASE[c] for c in ("rsqrt", "gradcheck", "compare-precision", "overflow", "fold", "doctor", "shrink")},
    "dump": tuple(a for a in BASE["dump"] if a not in ("--out", "{cwd}/dumpout")),
    "plot-stats": PLOT_LOG,
}
DEFAULT_REPORT_WRITERS = ("compare-precision", "shrink", "plot-stats")


def _paths_setup(kind: str, cmd: str) -> Callable[[Ctx], dict]:
    def setup(ctx: Ctx) -> dict:
        names: dict[str, str] = {}
        if cmd == "plot-stats":
            names["log"] = str(_write(ctx.inp / "log.csv", LOGS["ok"]))
        if kind == "existing-file":
            names["out"] = str(_write(ctx.inp / "precious.txt", "the user's file\n"))
        elif kind == "under-a-file":
            names["out"] = str(_write(ctx.inp / "precious.txt", "the user's file\n") / "sub")
        elif kind == "too-long-name":
            names["out"] = str(ctx.inp / ("o" * 300))
        elif kind == "too-long-path":
            names["out"] = str(ctx.inp / "/".join(["d" * 200] * 30))
        elif kind == "unwritable-folder":
            ro = ctx.inp / "ro"
            ro.mkdir()
            ro.chmod(0o500)
            ctx.cleanups.append(lambda: ro.chmod(0o700))
            names["out"] = str(ro / "sub")
        elif kind == "unwritable-out":
            ro = ctx.inp / "ro"
            ro.mkdir()
            ro.chmod(0o500)
            ctx.cleanups.append(lambda: ro.chmod(0o700))
            names["out"] = str(ro)
        elif kind == "dangling-symlink":
            link = ctx.inp / "link"
            link.symlink_to(ctx.inp / "nowhere" / "deeper")
            names["out"] = str(link)
        elif kind == "symlink-to-file":
            target = _write(ctx.inp / "precious.txt", "the user's file\n")
            (ctx.inp / "link").symlink_to(target)
            names["out"] = str(ctx.inp / "link")
        elif kind == "dev-null":
            names["out"] = "/dev/null"
        elif kind == "existing-report":
            d = ctx.inp / "report"
            names["out"] = str(d)
            _run_quietly(WRITERS[cmd] + ("--out", str(d)), names)
            if not any(d.iterdir()):
                raise AssertionError(f"setup: {cmd} wrote nothing into {d}")
        elif kind == "existing-user-files":
            # the user's own files under the names a report uses
            d = ctx.inp / "report"
            d.mkdir()
            for n in ("index.html", "stats.csv", "report.html", "compare.json", "summary.md", "x.npy",
                      "shrink.json", "bnprobe-dump.json", "tensors.npz", "findings.json", "index.md"):
                (d / n).write_text(f"the user's own {n}\n")
            names["out"] = str(d)
        elif kind == "unwritable-cwd":
            ctx.cwd.chmod(0o500)
            ctx.cleanups.append(lambda: ctx.cwd.chmod(0o700))
        else:
            raise AssertionError(kind)
        return names

    return setup


def _run_quietly(argv: tuple[str, ...], names: dict[str, str]) -> None:
    import contextlib

    from bnprobe.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main([a.format(**names) for a in argv])
    if code not in (0, 1):
        raise AssertionError(f"setup run {' '.join(argv)} exited {code}")


PATH_KINDS = ("existing-file", "under-a-file", "too-long-name", "too-long-path", "unwritable-folder", "unwritable-out",
              "dangling-symlink", "symlink-to-file", "dev-null", "existing-report", "existing-user-files")


def path_cases() -> list[Case]:
    out: list[Case] = []
    every = ("existing-file", "under-a-file", "existing-report")
    for i, kind in enumerate(PATH_KINDS):
        for cmd in (list(WRITERS) if kind in every else rotate(list(WRITERS), i, 2 if kind == "dev-null" else 1)):
            argv = WRITERS[cmd]
            if cmd == "dump":
                argv = argv[:3] + ("--out", "{out}") + argv[3:]
            else:
                argv = argv + ("--out", "{out}")
            out.append(Case("paths", f"{cmd}-out-{kind}", argv, _paths_setup(kind, cmd),
                            unprivileged=kind.startswith("unwritable"),
                            must_refuse=kind in ("existing-file", "under-a-file", "dev-null", "symlink-to-file",
                                                 "existing-report")))
    for cmd in DEFAULT_REPORT_WRITERS:
        out.append(Case("paths", f"{cmd}-unwritable-cwd", WRITERS[cmd], _paths_setup("unwritable-cwd", cmd),
                        unprivileged=True))
    # bad input paths
    bad_inputs = {"missing": "{inp}/nope.npy", "folder-not-dump": "{inp}", "under-a-file": "{x}/sub.npy",
                  "too-long": "{inp}/" + "i" * 300 + ".npy", "empty": "", "hash-only": "#", "dir-hash": "{inp}#",
                  "missing-hash": "{inp}/nope#call"}
    for i, (kid, path) in enumerate(bad_inputs.items()):
        readers = {**_tensor_readers(path), "gradcheck": ("gradcheck", "--input", path)}
        for cmd in rotate(list(readers), i, 1):
            out.append(Case("paths", f"{cmd}-input-{kid}", readers[cmd], _one_file("valid")))
    for kid, path in (("missing", "{inp}/nope.npz"), ("folder", "{inp}"), ("too-long", "{inp}/" + "w" * 300)):
        out.append(Case("paths", f"fold-weights-{kid}", ("fold", "--weights", path)))
        out.append(Case("paths", f"plot-stats-log-{kid}", ("plot-stats", "--log", path)))
    out.append(Case("paths", "plot-stats-dumps-missing", ("plot-stats", "--dumps", "{inp}/nope")))
    out.append(Case("paths", "plot-stats-dumps-is-file", ("plot-stats", "--dumps", "{x}"), _one_file("valid")))
    out.append(Case("paths", "plot-stats-dumps-no-steps", ("plot-stats", "--dumps", "{inp}"), _one_file("valid")))
    out.append(Case("paths", "plot-stats-dumps-empty-steps", ("plot-stats", "--dumps", "{inp}"),
                    lambda c: (c.inp / "step0").mkdir() or (c.inp / "step1").mkdir() or {}))
    for cmd in ("trace", "overflow", "doctor", "compare-precision"):
        out.append(Case("paths", f"{cmd}-input-unreadable", _tensor_readers("{x}")[cmd], _unreadable,
                        unprivileged=True))
    # HTML in a user file name reaches compare-precision's HTML report
    out.append(Case("paths", "compare-precision-html-file-name",
                    CP[:5] + ("--format", "html", "--input", "{x}"),
                    lambda c: {"x": str(_write(c.inp / f"{HTML_PROBES[1]}.npy", npy_bytes(x_small())))}))
    return out


def _unreadable(ctx: Ctx) -> dict:
    p = x_file("valid", ctx)
    p.chmod(0)
    ctx.cleanups.append(lambda: p.chmod(0o600))
    return {"x": str(p)}


PLUGIN_SPECS = (":Name", ".:X", "math:sqrt", "os:abort", "os:_exit", "os:getpid", "builtins:object", "sys:exit",
                "json:JSONDecoder", "no_such_module_xyz:Thing", "math:no_such_attr", "hostile_plugin:returns_int",
                "hostile_plugin:needs_args", "hostile_plugin:NotAdapter", "hostile_plugin:raises",
                "hostile_plugin:VALUE", "hostile_broken:X", "hostile_syntax:X", "..:X",
                "bnprobe.adapters.base:BaseAdapter", "bnprobe.adapters:get_adapter")
# none of these names a KernelAdapter class or a factory of one: every one must be refused
PLUGIN_MUST_REFUSE = set(PLUGIN_SPECS)


def plugin_cases() -> list[Case]:
    out: list[Case] = []
    users = {"dump": lambda s: ("dump", "--adapter", s, "--out", "{cwd}/dumpout", "--shape", "2,3,4,4"),
             "gradcheck": lambda s: ("gradcheck", "--shape", "2,3,2,2", "--adapter", s),
             "compare-precision": lambda s: CP + ("--shape", "2,3,4,4", "--adapters", s),
             "overflow": lambda s: ("overflow", "--shape", "2,3,4,4", "--adapter", s),
             "doctor": lambda s: ("doctor", "--no-stability", "--adapter", s),
             "shrink": lambda s: BASE["shrink"][:2] + (s,) + BASE["shrink"][3:]}
    names = list(users)
    for i, spec in enumerate(PLUGIN_SPECS):
        chosen = names if spec in ("os:abort", "math:sqrt", ":Name") else rotate(names, i, 1)
        for cmd in chosen:
            out.append(Case("plugins", f"{cmd}--adapter={spec}", users[cmd](spec), plugin_setup,
                            must_refuse=spec in PLUGIN_MUST_REFUSE))
    for spec in ("os:abort", "hostile_plugin:raises"):
        out.append(Case("plugins", f"compare-precision--bench={spec}", CP + ("--shape", "2,3,4,4", "--bench", spec),
                        plugin_setup, must_refuse=True))
    preds = ("os:getcwd", "math:sqrt", "os:abort", "builtins:print", "nomod_xyz:f", "hostile_plugin:predicate_raises",
             "hostile_plugin:predicate_returns_array", "hostile_plugin:NotAdapter", "sys:exit")
    for p in preds:
        out.append(Case("plugins", f"shrink--predicate={p}", BASE["shrink"] + ("--predicate", p), plugin_setup,
                        must_refuse=p not in ("hostile_plugin:always_true", "hostile_plugin:never", "builtins:len",
                                              "hostile_plugin:predicate_returns_array", "builtins:print")))
    formulas = ("math:sqrt", "os:abort", "nomod_xyz:f", "hostile_plugin:formula_wrong_shape",
                "hostile_plugin:formula_nan", "hostile_plugin:formula_raises")
    for f in formulas:
        out.append(Case("plugins", f"gradcheck--formula={f}", BASE["gradcheck"] + ("--formula", f), plugin_setup,
                        # a function of the documented signature may be run and reported as failing
                        must_refuse=not f.startswith("hostile_plugin:formula_")))
    # entry points of an installed distribution
    out.append(Case("plugins", "adapters-evil-entry-points", ("adapters",), plugin_setup))
    out.append(Case("plugins", "adapters--json-evil-entry-points", ("adapters", "--json"), plugin_setup))
    for i, name in enumerate(ENTRY_POINTS):
        cmd = names[i % 6]
        out.append(Case("plugins", f"{cmd}--adapter=entry-point-{name}", users[cmd](name), plugin_setup,
                        must_refuse=True))
    # controls
    out.append(Case("plugins", "gradcheck--formula=standard", BASE["gradcheck"] + ("--formula", "standard")))
    out.append(Case("plugins", "shrink--predicate=always_true", BASE["shrink"] + ("--predicate",
                                                                                  "hostile_plugin:always_true"),
                    plugin_setup))
    return out


LOG_CASES = ("ok", "negative-var", "nan-var", "all-nan-var", "inf-var", "missing-var-column", "missing-step-column",
             "only-header", "zero-bytes", "non-numeric-var", "non-numeric-step", "step-overflow-int64",
             "duplicate-rows", "running-mean-only", "negative-running-var", "html-layer-script", "html-layer-img",
             "long-layer-name", "newline-layer-name", "binary-garbage")


def log_cases() -> list[Case]:
    out: list[Case] = []
    for name in LOG_CASES:
        out.append(Case("logs", f"plot-stats-{name}", PLOT_LOG, _log(LOGS[name]),
                        must_refuse=name in ("missing-var-column", "missing-step-column", "only-header",
                                             "zero-bytes", "non-numeric-var", "non-numeric-step", "binary-garbage",
                                             "duplicate-rows", "running-mean-only")))
    out.append(Case("logs", "plot-stats-parquet-junk", PLOT_LOG, _log(b"PAR1" + os.urandom(64) + b"PAR1",
                                                                      "log.parquet"), must_refuse=True))
    out.append(Case("logs", "plot-stats-parquet-is-csv", PLOT_LOG, _log(LOGS["ok"], "log.parquet")))
    out.append(Case("logs", "plot-stats-log-npy", PLOT_LOG, lambda c: {"log": str(x_file("valid", c))}))
    out.append(Case("logs", "plot-stats-log-pickle", PLOT_LOG,
                    lambda c: {"log": str(_write(c.inp / "log.pkl", pickle.dumps(Evil(c.marker))))}))
    out.append(Case("logs", "plot-stats-html-svg", PLOT_LOG + ("--format", "svg"), _log(LOGS["html-layer-script"])))
    return out


def all_cases() -> list[Case]:
    cases = memory_cases() + file_cases() + metadata_cases() + option_cases() + path_cases() + plugin_cases() + \
        log_cases()
    ids = Counter(c.test_id for c in cases)
    dup = [i for i, n in ids.items() if n > 1]
    assert not dup, f"duplicate case ids: {dup[:5]}"
    return cases


CASES = all_cases()


def counts() -> dict[str, int]:
    return dict(Counter(c.cls for c in CASES))


if __name__ == "__main__":
    for cls, n in counts().items():
        print(f"{cls:10} {n}")
    print(f"{'total':10} {len(CASES)}")

"""Seeded test inputs for BatchNorm, and loading a user's tensor from disk."""

from __future__ import annotations

import math
import zipfile
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bnprobe.core.errors import BNProbeError

__all__ = ["DISTRIBUTIONS", "SEED", "Draw", "make_input", "make_params", "parse_shape", "input_shape", "load_array",
           "array_header", "npy_header"]

# normal: N(mean, std²); uniform: same mean and std; student_t: heavy tails (3 degrees of
# freedom, scaled to the same std); constant: every value equal to mean (var = 0, eps decides).
DISTRIBUTIONS: tuple[str, ...] = ("normal", "uniform", "student_t", "constant")
SEED = 0  # the seed of generated inputs (and parameters) where none is given


@dataclass(frozen=True)
class Draw:
    """How generated values are drawn: their distribution (one of :data:`DISTRIBUTIONS`), mean, std and seed, each
    None where not given (a caller may refuse what was given: a recording brings its own values); :meth:`resolved`
    gives those their defaults, N(0, 1) and seed :data:`SEED`."""

    dist: str | None = None
    mean: float | None = None
    std: float | None = None
    seed: int | None = None

    def resolved(self) -> Draw:
        """This draw with each value not given (None) its default."""
        return Draw("normal" if self.dist is None else self.dist, 0.0 if self.mean is None else self.mean,
                    1.0 if self.std is None else self.std, SEED if self.seed is None else self.seed)


def parse_shape(text: str) -> tuple[int, ...]:
    """'8,16,14,14' -> (8, 16, 14, 14), with a clear error for anything else."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise BNProbeError(f"shape {text!r} is not a comma-separated list of integers, e.g. 8,16,14,14") from None
    if not 2 <= len(shape) <= 5:
        raise BNProbeError(f"shape {text!r} must have 2 to 5 dimensions (N,C[,L|H,W|D,H,W])")
    if any(s <= 0 for s in shape):
        raise BNProbeError(f"shape {text!r} has a dimension <= 0")
    if math.prod(shape) > 2**31:
        raise BNProbeError(f"shape {text!r} has {math.prod(shape):,} elements; bnprobe takes at most 2**31")
    return shape


def make_input(shape: tuple[int, ...], *, dist: str | None = None, mean: float | None = None,
               std: float | None = None, seed: int | None = None) -> np.ndarray:
    """A float64 tensor of the given shape drawn from ``dist`` with the given mean and std (None: the
    :class:`Draw`'s default)."""
    dist, mean, std, seed = astuple(Draw(dist, mean, std, seed).resolved())
    if dist not in DISTRIBUTIONS:
        raise BNProbeError(f"unknown distribution {dist!r}; valid: {', '.join(DISTRIBUTIONS)}")
    if not (math.isfinite(mean) and math.isfinite(std)) or std < 0:
        raise BNProbeError(f"mean must be finite and std finite and >= 0, got mean={mean}, std={std}")
    rng = np.random.default_rng(seed)
    if dist == "normal":
        z = rng.standard_normal(shape)
    elif dist == "uniform":
        z = rng.uniform(-math.sqrt(3), math.sqrt(3), shape)
    elif dist == "student_t":
        z = rng.standard_t(3, shape) / math.sqrt(3.0)  # var of t(3) is 3
    else:
        z = np.zeros(shape)
    return mean + std * z


def make_params(channels: int, seed: int | None = None) -> dict[str, np.ndarray]:
    """gamma ~ U(0.5, 1.5) and beta ~ N(0, 0.1²), seeded (None: :data:`SEED`), as after some training."""
    rng = np.random.default_rng([SEED if seed is None else seed, 1])
    return {"gamma": rng.uniform(0.5, 1.5, channels), "beta": rng.normal(0.0, 0.1, channels)}


def npy_header(fh: BinaryIO, where: str, size: int) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a .npy stream of ``size`` bytes declares, read from its header without loading the
    data (the one reader of untrusted .npy headers: inputs, dump tensors, fold weights); a header that does not
    parse, object (pickled) data, a bad shape or a stream shorter than the header says are one-line errors."""
    from numpy.lib import format as npformat

    try:
        version = npformat.read_magic(fh)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"version {version[0]}.{version[1]}")
        read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
        shape, _, dtype = read(fh)
    except Exception as exc:  # noqa: BLE001 - a forged header can fail numpy's parser in any way (TokenError...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise BNProbeError(f"{where}: corrupt .npy header ({type(exc).__name__}: {first})") from None
    if dtype.hasobject:
        raise BNProbeError(f"{where}: holds Python objects (a pickle); bnprobe refuses to unpickle")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BNProbeError(f"{where}: bad shape {shape} in its header")
    need = fh.tell() + math.prod(shape) * dtype.itemsize
    if size < need:
        raise BNProbeError(f"{where}: {size} bytes, shorter than the {need} its header declares for shape "
                           f"{list(shape)} of {dtype} (truncated or forged)")
    return tuple(shape), dtype


def array_header(path: str | Path, key: str = "x") -> tuple[tuple[int, ...], np.dtype, str]:
    """Shape, dtype and array name of what :func:`load_array` would load, read from the headers alone."""
    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"input file {str(p)!r} does not exist")
    with open(p, "rb") as fh:
        magic = fh.read(6)
    if magic == b"\x93NUMPY":
        with open(p, "rb") as fh:
            shape, dtype = npy_header(fh, str(p), p.stat().st_size)
        return shape, dtype, ""
    if magic[:4] != b"PK\x03\x04":
        raise BNProbeError(f"{p}: not a .npy or .npz file (its first bytes are neither a NUMPY header nor a zip)")
    try:
        with zipfile.ZipFile(p) as z:
            members = {n[:-4]: n for n in z.namelist() if n.endswith(".npy")}
            if key in members:
                name = key
            elif len(members) == 1:
                name = next(iter(members))
            elif not members:
                raise BNProbeError(f"{p}: a zip without any .npy array")
            else:
                raise BNProbeError(f"{p}: no array {key!r} among {', '.join(members)}")
            info = z.getinfo(members[name])
            with z.open(info) as fh:
                shape, dtype = npy_header(fh, f"{p}[{name}]", info.file_size)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as exc:
        raise BNProbeError(f"{p}: not a readable .npz file ({str(exc).splitlines()[0] if str(exc) else exc})") \
            from None
    return shape, dtype, name


def load_array(path: str | Path, key: str = "x") -> np.ndarray:
    """Load a tensor from ``.npy`` or ``.npz`` (array ``key``, or the only array) as float64.

    The headers are read first: an object array, a header promising more data than the file holds, or an array
    too large for the memory limit (:mod:`bnprobe.guard`) is refused before anything is allocated."""
    from bnprobe.guard import PER_ELEMENT, format_size, require

    p = Path(path)
    shape, dtype, name = array_header(p, key)
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
        raise BNProbeError(f"{p}: expected a real numeric array, got {dtype}")
    n = math.prod(shape)
    require(n * (dtype.itemsize + PER_ELEMENT["load"]),
            f"loading {p} (shape {shape}, {dtype}, {format_size(n * dtype.itemsize)})")
    try:
        if name:
            with np.load(p, allow_pickle=False) as z:
                a = z[name]
        else:
            a = np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BNProbeError(f"{p}: not a readable .npy/.npz file ({str(exc).splitlines()[0]})") from None
    with np.errstate(invalid="ignore", over="ignore"):
        return a.astype(np.float64)


def input_shape(command: str, shape: str | None = None) -> tuple[int, ...]:
    """The shape of ``command``'s generated input: ``shape`` parsed, else the command's own (its registry entry's);
    refused when ``command`` on it would exceed the memory limit."""
    from bnprobe.core.commands import command as entry
    from bnprobe.guard import require_run

    shp = parse_shape(shape if shape is not None else entry(command).shape or "")
    require_run(command, shp)
    return shp


def input_tensor(command: str, path: str | Path | None, shape: str | None = None, dist: str | None = None,
                 mean: float | None = None, std: float | None = None, seed: int | None = None) -> np.ndarray:
    """The tensor at ``path`` (``.npy``/``.npz``), or one generated from ``shape``/``dist``/``mean``/``std``/``seed``
    (None: the command's shape, the :class:`Draw`'s default); refused before it is loaded or made when ``command``
    on it would exceed the memory limit."""
    from bnprobe.guard import require_run

    if path is not None:
        shp = array_header(Path(path))[0]
        require_run(command, shp, f"{command} on {path} (shape {shp})")
        return load_array(path)
    return make_input(input_shape(command, shape), dist=dist, mean=mean, std=std, seed=seed)

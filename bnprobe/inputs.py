"""Seeded test inputs for BatchNorm, and loading a user's tensor from disk."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from bnprobe.errors import BNProbeError

__all__ = ["DISTRIBUTIONS", "make_input", "make_params", "parse_shape", "load_array"]

# normal: N(mean, std²); uniform: same mean and std; student_t: heavy tails (3 degrees of
# freedom, scaled to the same std); constant: every value equal to mean (var = 0, eps decides).
DISTRIBUTIONS: tuple[str, ...] = ("normal", "uniform", "student_t", "constant")


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


def make_input(shape: tuple[int, ...], *, dist: str = "normal", mean: float = 0.0, std: float = 1.0,
               seed: int = 0) -> np.ndarray:
    """A float64 tensor of the given shape drawn from ``dist`` with the given mean and std."""
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


def make_params(channels: int, seed: int = 0) -> dict[str, np.ndarray]:
    """gamma ~ U(0.5, 1.5) and beta ~ N(0, 0.1²), seeded, as after some training."""
    rng = np.random.default_rng([seed, 1])
    return {"gamma": rng.uniform(0.5, 1.5, channels), "beta": rng.normal(0.0, 0.1, channels)}


def load_array(path: str | Path, key: str = "x") -> np.ndarray:
    """Load a tensor from ``.npy`` or ``.npz`` (array ``key``, or the only array) as float64."""
    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"input file {str(p)!r} does not exist")
    with open(p, "rb") as fh:
        magic = fh.read(6)
    if magic[:4] == b"PK\x03\x04":
        kind = "npz"
    elif magic == b"\x93NUMPY":
        kind = "npy"
    else:
        raise BNProbeError(f"{p}: not a .npy or .npz file (its first bytes are neither a NUMPY header nor a zip)")
    try:
        if kind == "npz":
            with np.load(p, allow_pickle=False) as z:
                names = list(z.files)
                if key in names:
                    a = z[key]
                elif len(names) == 1:
                    a = z[names[0]]
                else:
                    raise BNProbeError(f"{p}: no array {key!r} among {', '.join(names)}")
        else:
            a = np.load(p, allow_pickle=False)
    except BNProbeError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BNProbeError(f"{p}: not a readable .npy/.npz file ({str(exc).splitlines()[0]})") from None
    if not isinstance(a, np.ndarray) or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise BNProbeError(f"{p}: expected a numeric array, got {getattr(a, 'dtype', type(a))}")
    with np.errstate(invalid="ignore"):
        return a.astype(np.float64)

"""Writing results to disk: atomically (temporary file, then rename) and never over an existing file silently."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from bnprobe.errors import BNProbeError

__all__ = ["atomic_write_text", "atomic_write_bytes", "save_figure", "check_targets", "to_jsonable", "dumps_json"]


def _atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    _atomic(Path(path), lambda fh: fh.write(text.encode("utf-8")))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    _atomic(Path(path), lambda fh: fh.write(data))


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> None:
    """Save a matplotlib Figure through a temporary file (format from the suffix)."""
    p = Path(path)
    _atomic(p, lambda fh: fig.savefig(fh, format=p.suffix.lstrip(".") or "png", **kwargs))


def check_targets(paths: list[Path], *, force: bool) -> None:
    """Refuse to overwrite existing report files unless ``force``."""
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise BNProbeError(f"{existing[0]} exists; refusing to overwrite (pass --force, or choose another --out)")


def to_jsonable(o: Any) -> Any:
    """numpy scalars/arrays to Python, NaN/inf to strings, tuples to lists."""
    import numpy as np

    if isinstance(o, dict):
        return {str(k): to_jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return to_jsonable(o.tolist())
    if isinstance(o, np.generic):
        return to_jsonable(o.item())
    if isinstance(o, float) and not math.isfinite(o):
        return "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o


def dumps_json(o: Any) -> str:
    return json.dumps(to_jsonable(o), indent=2, default=str)

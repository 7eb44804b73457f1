"""The files bnprobe writes, in one place (below the recordings and adapters that write dumps, which use it too).

- An output folder is checked and created **before any work** (:func:`output_dir`): an existing file, a path under
  a file, a folder that cannot be written or a name too long is a one-line error, not a traceback after the run.
- Default report folders are unique even for runs started in the same second (created with ``mkdir``, which only
  one process can win).
- Every file goes to a temporary name next to its target and is renamed into place only when the whole run has
  succeeded (:class:`OutputDir`): a failed or interrupted run leaves no partial file, and removes the folders it
  created.
- Existing files are never replaced unless the user passed ``--force``; files get the user's usual permissions
  (``0666`` less the umask), not ``mkstemp``'s ``0600``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from bnprobe.core.errors import BNProbeError, named

__all__ = ["append_text", "atomic_write_text", "atomic_write_bytes", "atomic_write_with", "atomic_write_path",
           "check_targets", "output_dir",
           "OutputDir",
           "file_mode", "save_figure", "to_jsonable", "dumps_json"]

_UMASK: int | None = None


_PLAIN = (str, int, bool, type(None))  # what JSON writes as it is (bool and int subclasses included)


def to_jsonable(o: Any) -> Any:
    """numpy scalars/arrays to Python, NaN/inf to strings, tuples to lists."""
    import numpy as np

    if isinstance(o, _PLAIN):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {str(k): to_jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return to_jsonable(o.tolist())
    if isinstance(o, np.generic):
        return to_jsonable(o.item())
    return o


def dumps_json(o: Any) -> str:
    """``json.dumps(to_jsonable(o), indent=2, default=str)``, the same text: json's indenting encoder is its pure
    Python one (a report's 2,000 rows took 1.7 s), so each container of plain values is written by json's C encoder
    with the indent's line breaks as its separators (a string's own line breaks are escaped by then)."""
    return _indented(to_jsonable(o), 0)


_ONE = json.JSONEncoder(default=str).encode  # a plain value (or a container, unindented)


def _indented(o: Any, level: int) -> str:
    """``o`` (made by :func:`to_jsonable`) as ``json.dumps(o, indent=2, default=str)`` writes it at depth ``level``."""
    if isinstance(o, dict):
        items = o.items()
    elif isinstance(o, list):
        items = None
    else:
        return _ONE(o)
    if not o:
        return "{}" if items is not None else "[]"
    inner, outer = "\n" + "  " * (level + 1), "\n" + "  " * level
    values = o.values() if items is not None else o
    if not any(isinstance(v, (dict, list)) for v in values):  # one C encoder call, its separators the line breaks
        flat = json.JSONEncoder(default=str, separators=("," + inner, ": ")).encode(o)
        return flat[0] + inner + flat[1:-1] + outer + flat[-1]
    if items is not None:
        body = ("," + inner).join(f"{_ONE(k)}: {_indented(v, level + 1)}" for k, v in items)
        return "{" + inner + body + outer + "}"
    return "[" + inner + ("," + inner).join(_indented(v, level + 1) for v in o) + outer + "]"


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file: ``0o666`` less the process umask."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return 0o666 & ~_UMASK


def _temp_for(path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def _write_temp(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """``write`` into a fresh temporary file beside ``path`` (with the user's permissions); its path."""
    tmp = _temp_for(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.chmod(tmp, file_mode())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename."""
    _atomic(Path(path), lambda fh: fh.write(text.encode("utf-8")))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _atomic(Path(path), lambda fh: fh.write(data))


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` to ``path`` (created when missing) and flush it: a journal's lines, each complete on disk
    when this returns, so a run interrupted later keeps every line before it."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()


def atomic_write_with(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write(fh)`` streams into a temporary file beside ``path``, renamed to it when done (nothing is left
    when it raises): for files too large to build in memory first."""
    _atomic(Path(path), write)


def atomic_write_path(path: str | Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` writes the file at ``tmp``, a fresh temporary path beside ``path``, renamed to it when done
    (nothing is left when it raises): for a library that opens the file itself (pyarrow's Parquet writer on a path
    writes through its own file, with the GIL released)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_for(p)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> None:
    """Save a matplotlib Figure through a temporary file (format from the suffix)."""
    p = Path(path)
    _atomic(p, lambda fh: fig.savefig(fh, format=p.suffix.lstrip(".") or "png", **kwargs))


def check_targets(paths: Iterable[Path], *, force: bool) -> None:
    """Refuse to overwrite existing files unless ``force``."""
    for p in paths:
        p = Path(p)
        if p.is_dir():
            raise BNProbeError(f"{p} is a folder; cannot write a file there")
        if p.exists() and not force:
            raise BNProbeError(f"{p} exists; refusing to overwrite (pass {named('force')}, or choose another "
                               f"{named('out')})")


def _oserror(what: str, path: Path, exc: OSError) -> BNProbeError:
    reason = exc.strerror or type(exc).__name__
    if exc.errno == errno.ENAMETOOLONG:
        reason = "name too long"
    return BNProbeError(f"cannot create {what} {path}: {reason}")


def _check_writable(path: Path, what: str) -> list[Path]:
    """Check that folder ``path`` exists or can be created; the folders that would have to be created, outermost
    first.  Nothing is created."""
    long = [part for part in path.parts if len(os.fsencode(part)) > 255]
    if long or len(os.fsencode(str(path.absolute()))) > 4000:
        raise BNProbeError(f"cannot create {what} {str(path)[:60]}...: name too long")
    missing: list[Path] = []
    p = path
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        if p == path:
            raise BNProbeError(f"{what} {path} is a file, not a folder")
        raise BNProbeError(f"cannot create {what} {path}: {p} is a file")
    if p.is_symlink() and not p.exists():
        raise BNProbeError(f"cannot create {what} {path}: {p} is a broken symbolic link")
    if not os.access(p, os.W_OK | os.X_OK):
        raise BNProbeError(f"cannot create {what} {path}: {p} is not writable")
    try:
        name_max = os.pathconf(p, "PC_NAME_MAX")
    except (OSError, ValueError):  # pragma: no cover - platforms without pathconf
        name_max = 255
    long = [m.name for m in missing if len(os.fsencode(m.name)) > name_max]
    if long or len(os.fsencode(str(path.absolute()))) > 4000:
        raise BNProbeError(f"cannot create {what} {str(path)[:60]}...: name too long")
    return missing[::-1]


class OutputDir:
    """A folder written as one transaction.  Files are staged under temporary names; :meth:`commit` renames them
    into place (refusing, before renaming any, to replace an existing file without ``force``); :meth:`discard`
    removes the staged files and the folders this run created.  As a context manager it commits on success and
    discards on any exception (``KeyboardInterrupt`` included)."""

    def __init__(self, path: Path, *, force: bool = False, created: list[Path] | None = None) -> None:
        self.path = Path(path)
        self.force = force
        self.created = list(created or [])
        self._staged: dict[str, Path] = {}
        self.written: list[Path] = []

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def target(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
            raise BNProbeError(f"bad report file name {name!r}")
        return self.path / name

    def claim(self, *names: str) -> None:
        """Refuse now, before any work, when a file this run will write exists already (unless ``force``)."""
        check_targets([self.target(n) for n in names], force=self.force)

    def write_with(self, name: str, write: Callable[[BinaryIO], Any]) -> Path:
        target = self.target(name)
        self.claim(name)
        old = self._staged.pop(name, None)
        if old is not None:
            old.unlink(missing_ok=True)
        self._staged[name] = _write_temp(target, write)
        return target

    def write_text(self, name: str, text: str) -> Path:
        return self.write_with(name, lambda fh: fh.write(text.encode("utf-8")))

    def write_bytes(self, name: str, data: bytes) -> Path:
        return self.write_with(name, lambda fh: fh.write(data))

    def save_figure(self, name: str, fig: Any, **kwargs: Any) -> Path:
        """A matplotlib figure, in the format of the name's suffix."""
        fmt = Path(name).suffix.lstrip(".") or "png"
        return self.write_with(name, lambda fh: fig.savefig(fh, format=fmt, **kwargs))

    def commit(self) -> list[Path]:
        """Rename every staged file into place; the paths written."""
        try:
            check_targets([self.target(n) for n in self._staged], force=self.force)
        except BaseException:
            self.discard()
            raise
        for name, tmp in list(self._staged.items()):
            os.replace(tmp, self.target(name))
            self.written.append(self.target(name))
            del self._staged[name]
        return list(self.written)

    def discard(self) -> None:
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()
        for folder in reversed(self.created):
            try:
                folder.rmdir()  # only when empty: a file someone else put there stays
            except OSError:
                break


def output_dir(out: str | Path | None, stem: str, *, force: bool = False, root: str | Path = "reports",
               what: str = named("out")) -> OutputDir:
    """The output folder of a run, created now: ``out`` when given, else a new ``<root>/<stem>-<time>`` that no other
    run can share.  Raises a one-line :class:`BNProbeError` when it cannot be created or written."""
    if out is not None:
        path = Path(out)
        missing = _check_writable(path, what)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _oserror(what, path, exc) from None
        return OutputDir(path, force=force, created=missing)
    root = Path(root)
    missing = _check_writable(root, "the report folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _oserror("the report folder", root, exc) from None
    base = root / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    for k in range(10_000):
        path = base if k == 0 else base.with_name(f"{base.name}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise _oserror("the report folder", path, exc) from None
        return OutputDir(path, force=force, created=[*missing, path])
    raise BNProbeError(f"cannot create a new report folder under {root}: 10000 exist for this second")

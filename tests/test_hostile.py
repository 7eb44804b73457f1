"""Hostile input, every command (issue 20, "What to build" item 5).

Each case of tests/hostile_cases.py runs ``bnprobe.cli.main(argv)`` in-process, in a fresh current folder, and
must end in one of two ways:

- exit 2 with exactly one non-empty line on stderr, ``bnprobe...: error: ...``, and the file tree exactly as it
  was (nothing created, removed or changed: no partial report, no empty folder);
- exit 0 or 1 with a result on stdout (valid JSON when ``--json`` was asked), every pre-existing file unchanged
  (bytes and mtime).

Always: no exception escapes ``main`` (it would be a traceback for the user), no warning escapes it (it would be
printed raw on stderr), no pickle payload or plugin object that is not an adapter runs (marker files), ``os.abort``
/ ``os._exit`` are never called, no user string reaches an HTML report unescaped, and no error passes on torch's
advice to load with ``weights_only=False``.  ``memory`` cases run with ``BNPROBE_MAX_MEMORY=256M``; every case
runs with the process's address space capped a few GiB above its current size and a time limit, so a missing
guard is a failure here rather than an exhausted machine.  Cases marked ``must_refuse`` are invalid beyond doubt:
for them only exit 2 is right.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import resource
import signal
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest

from hostile_cases import CASES, HTML_PROBES, MARKER_PREFIX, Ctx, counts

from bnprobe.cli import main

CASE_SECONDS = 10  # a hostile case must be refused (or done) well within this
ADDRESS_SPACE_HEADROOM = 3 << 30  # backstop above the process's current address space


class CaseTimeout(BaseException):
    """Raised by SIGALRM when a case runs too long (a BaseException: bnprobe's `except Exception` cannot eat it)."""


class ForbiddenCall(BaseException):
    """os.abort / os._exit was called: in a real run the process would have died."""


# ------------------------------------------------------------------------------------------------- helpers ---

def snapshot(root: Path) -> dict[str, tuple]:
    """path -> (kind, mode, size, mtime_ns, sha256) of everything under root (symlinks not followed)."""
    snap: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                snap[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                snap[rel] = ("dir", st.st_mode & 0o7777)
            elif not os.path.isfile(p):
                snap[rel] = ("special", st.st_mode)
            else:
                try:
                    with open(p, "rb") as fh:
                        digest = hashlib.sha256(fh.read()).hexdigest()
                except OSError:
                    digest = "unreadable"
                snap[rel] = ("file", st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, digest)
    return snap


def _current_address_space() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def guarded(seconds: int):
    """A time limit (SIGALRM -> CaseTimeout) and an address-space cap, both restored afterwards."""
    old_handler = signal.getsignal(signal.SIGALRM)

    def on_alarm(signum, frame):  # noqa: ANN001
        raise CaseTimeout(f"still running after {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _current_address_space() + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        if cap > ADDRESS_SPACE_HEADROOM:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _user_warning_filters() -> None:
    """What a user running the CLI sees: Python's default filters (deprecations of libraries hidden), every
    other warning shown each time (recorded here)."""
    warnings.resetwarnings()
    warnings.simplefilter("always")
    for cat in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", cat)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _skip_reason(case) -> str | None:  # noqa: ANN001
    if case.unprivileged and os.geteuid() == 0:
        return "file permissions do not bind root"
    for mod in case.needs:
        try:
            importlib.import_module(mod)
        except ImportError:
            return f"{mod} not installed"
    return None


# --------------------------------------------------------------------------------------------------- tests ---

@pytest.mark.parametrize("case", CASES, ids=[c.test_id for c in CASES])
def test_hostile_input(case, tmp_path, monkeypatch, capfd):  # noqa: ANN001
    why = _skip_reason(case)
    if why:
        pytest.skip(why)
    root = tmp_path
    ctx = Ctx(root=root, inp=root / "in", cwd=root / "cwd")
    ctx.inp.mkdir()
    ctx.cwd.mkdir()
    monkeypatch.chdir(ctx.cwd)
    monkeypatch.delenv("BNPROBE_MAX_MEMORY", raising=False)
    for k, v in case.env:
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    modules_before = set(sys.modules)
    forbidden: list[str] = []
    real_module = os.abort.__module__

    def fake(name: str):  # noqa: ANN202
        # the same signature and module as the real ones, so a kind check treats both alike
        def abort():
            forbidden.append("os.abort()")
            raise ForbiddenCall("os.abort() was called")

        def _exit(n):  # noqa: ANN001
            forbidden.append(f"os._exit({n!r})")
            raise ForbiddenCall("os._exit() was called")

        f = {"abort": abort, "_exit": _exit}[name]
        f.__module__, f.__qualname__ = real_module, name
        return f

    monkeypatch.setattr(os, "abort", fake("abort"))
    monkeypatch.setattr(os, "_exit", fake("_exit"))
    try:
        names = case.setup(ctx) if case.setup else {}
        for d in ctx.syspath:
            monkeypatch.syspath_prepend(str(d))
        fmt = {"root": str(root), "inp": str(ctx.inp), "cwd": str(ctx.cwd), **(names or {})}
        argv = [a.format(**fmt) for a in case.argv]
        capfd.readouterr()
        before = snapshot(root)
        escaped: BaseException | None = None
        code = None
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            _user_warning_filters()
            try:
                with guarded(CASE_SECONDS):
                    code = main(argv)
            except BaseException as exc:  # noqa: BLE001 - anything escaping main is the finding
                escaped = exc
        seconds = time.monotonic() - t0
        out, err = capfd.readouterr()
        after = snapshot(root)
    finally:
        for undo in reversed(ctx.cleanups):
            undo()
        for m in set(sys.modules) - modules_before:
            if m.startswith("hostile_"):
                del sys.modules[m]

    problems: list[str] = []
    if isinstance(escaped, CaseTimeout):
        problems.append(f"no answer within {CASE_SECONDS} s (time limit)")
    elif isinstance(escaped, ForbiddenCall):
        problems.append(f"called {forbidden[0]}: the process would have died")
    elif escaped is not None:
        problems.append(f"exception escaped main (traceback): {type(escaped).__name__}: "
                        f"{_first_line(str(escaped))[:200]}")
    if forbidden and not isinstance(escaped, ForbiddenCall):
        problems.append(f"called {forbidden[0]} (the call was swallowed, but a real one kills the process)")
    if escaped is None:
        if code == 2:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            if len(lines) != 1 or not lines[0].startswith("bnprobe") or "error:" not in lines[0]:
                problems.append(f"exit 2 but stderr is not one 'bnprobe: error: ...' line: {err[:300]!r}")
        elif code in (0, 1):
            if case.must_refuse:
                problems.append(f"accepted (exit {code}) an input that must be refused; stdout: "
                                f"{_first_line(out)[:160]!r}")
            if not out.strip():
                problems.append(f"exit {code} without a result on stdout")
            elif "--json" in argv:
                try:
                    json.loads(out)
                except ValueError as exc:
                    problems.append(f"--json output is not JSON ({exc})")
        else:
            problems.append(f"exit status {code!r} (expected 2, or 0/1 with a result)")
    if "Traceback (most recent call last)" in err:
        problems.append("a traceback on stderr")
    leaked = [f"{w.category.__name__}: {_first_line(str(w.message))[:120]}" for w in caught]
    if leaked:
        problems.append(f"{len(leaked)} warning(s) escaped main (printed raw to a user): {leaked[0]}")
    raw = [ln for ln in err.splitlines() if "Warning:" in ln or "warnings.warn" in ln]
    if raw:
        problems.append(f"raw warning text on stderr: {raw[0][:160]}")
    if "weights_only=False" in out + err:
        problems.append("passes on torch's advice to load with weights_only=False")
    markers = sorted(p.name for p in root.iterdir() if p.name.startswith(MARKER_PREFIX))
    if markers:
        problems.append(f"hostile code ran: {', '.join(markers)}")

    created = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p] and before[p][0] != "dir")
    if escaped is None and code == 2 and created:
        problems.append(f"exit 2 but left {len(created)} new file(s)/folder(s) behind: {created[:3]}")
    if removed:
        problems.append(f"removed pre-existing {removed[:3]}")
    if changed:
        problems.append(f"changed pre-existing {changed[:3]} (overwritten or touched)")
    for rel in created + changed:
        if rel.endswith((".html", ".htm", ".svg")) and after[rel][0] == "file":
            text = (root / rel).read_text(errors="replace")
            bad = [p for p in HTML_PROBES if p in text]
            if bad:
                problems.append(f"{rel} holds the user's {bad[0]!r} unescaped")

    summary = f"[{case.test_id}] bnprobe {' '.join(argv)} -> " + (
        f"{type(escaped).__name__}" if escaped is not None else f"exit {code}") + f" in {seconds:.1f} s"
    assert not problems, summary + "\n  " + "\n  ".join(problems)


def test_hostile_case_counts():
    """How many hostile cases each class has (printed with -s; the note quotes them)."""
    by_class = counts()
    print("\nhostile cases by class: " + ", ".join(f"{k} {v}" for k, v in by_class.items())
          + f"; total {sum(by_class.values())}")
    assert set(by_class) == {"memory", "files", "metadata", "options", "paths", "plugins", "logs"}
    per_command = Counter()
    from hostile_cases import COMMANDS

    for c in CASES:
        words = [a for a in c.argv if a in COMMANDS]
        if words:
            per_command[(words[0], c.cls)] += 1
    for cmd in COMMANDS:
        classes = {cls for (c, cls) in per_command if c == cmd}
        assert len(classes) >= 2, f"{cmd} appears in only {classes}"


if __name__ == "__main__":
    for cls, n in counts().items():
        print(f"{cls:10} {n}")
    print(f"{'total':10} {len(CASES)}")

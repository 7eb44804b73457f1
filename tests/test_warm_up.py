"""No run waits for numba (bnprobe.compiled.jit, bnprobe.compiled.warm_up): under BNPROBE_JIT=auto a large call takes
numpy's route until the background warm-up has compiled the kernels, and starts that warm-up once."""

import io
import os
import subprocess
import sys
import threading

import pytest

from bnprobe.compiled import jit, warm_up

BIG = jit.COMPILED_MIN_ELEMENTS


@pytest.fixture
def cold(monkeypatch, tmp_path):
    """An empty numba cache, auto mode, background warm-ups, this process's state fresh; posix_spawn recorded (the
    pid it returns: this process's, alive) instead of started."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BNPROBE_JIT", raising=False)
    monkeypatch.setenv("BNPROBE_WARM_UP", "background")
    jit.warm_up_paths.cache_clear()
    monkeypatch.setattr(jit, "_STARTED", threading.Event())
    monkeypatch.setattr(jit, "_READY", threading.Event())
    monkeypatch.setattr(jit, "_IN_USE", threading.Event())
    monkeypatch.setattr(jit, "_RECHECK_SECONDS", 0.0)
    spawned = []

    def spawn(path, argv, env, **kw):
        spawned.append((argv, env))
        return os.getpid()

    monkeypatch.setattr(jit.os, "posix_spawn", spawn)
    yield spawned
    jit.warm_up_paths.cache_clear()


def test_a_cold_large_call_takes_numpys_route_and_starts_the_warm_up_once(cold, monkeypatch):
    ready, lock, log = jit.warm_up_paths()
    assert not jit.jit_for(BIG - 1) and not cold  # a small call: numpy's route, nothing started
    assert not jit.jit_for(BIG) and not jit.jit_for(None)
    assert len(cold) == 1  # one warm-up, not one per call
    argv, env = cold[0]
    assert argv[-2:] == ["bnprobe.compiled.warm_up", str(lock)] and env["BNPROBE_JIT"] == "1"
    assert lock.read_text() == str(os.getpid()) and log.exists() and not ready.exists()
    monkeypatch.setattr(jit, "_STARTED", threading.Event())  # another process, while this warm-up runs
    assert not jit.jit_for(BIG) and len(cold) == 1
    ready.write_text("done\n")
    assert not jit.jit_for(BIG - 1)  # the kernels compiled, none loaded yet: a small call stays on numpy's route
    assert jit.jit_for(BIG) and jit.jit_for(BIG - 1) and jit.jit_for(1)  # loaded by a large call: small ones too
    assert len(cold) == 1


def test_small_calls_take_the_compiled_route_only_after_a_large_call_on_warmed_kernels(cold, monkeypatch):
    """In foreground mode (numba compiles on first use) a large call compiles its kernels, and a small call would
    compile its own: small calls stay on numpy's route; so do they after a cheap kernel compiled in a cold run."""
    assert jit.jit_for(BIG, cheap=True) and not jit.jit_for(BIG - 1)
    monkeypatch.setenv("BNPROBE_WARM_UP", "foreground")
    assert jit.jit_for(BIG) and not jit.jit_for(BIG - 1)
    jit.warm_up_paths()[0].write_text("done\n")  # (the test suite's mode, on a machine whose warm-up has run)
    assert jit.jit_for(BIG) and not jit.jit_for(BIG - 1)


def test_a_cheap_kernel_is_compiled_in_the_run_and_starts_the_warm_up(cold):
    """bnprobe.compiled.bits' casts and ulps compile in about a second each: taken cold, the rest left to the
    warm-up."""
    assert jit.jit_for(BIG, cheap=True) and not jit.jit_for(BIG - 1, cheap=True)
    assert len(cold) == 1 and not jit.jit_for(BIG)


def test_a_lock_left_by_a_warm_up_that_is_gone_is_taken_over(cold):
    _, lock, _ = jit.warm_up_paths()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.parent.mkdir(parents=True)
    lock.write_text(gone.stdout.strip())
    assert not jit.jit_for(BIG) and len(cold) == 1


@pytest.mark.parametrize("env, route", [({"BNPROBE_WARM_UP": "foreground"}, True), ({"BNPROBE_JIT": "1"}, True),
                                        ({"BNPROBE_JIT": "0"}, False)], ids=["foreground", "jit-on", "jit-off"])
def test_the_other_modes_start_no_warm_up(cold, monkeypatch, env, route):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert jit.jit_for(BIG) is route and not cold
    assert not jit.warm_up_paths()[1].exists()


def test_the_mark_names_these_sources(cold, tmp_path):
    """The ready mark lives in NUMBA_CACHE_DIR and carries a digest of the compiled route's sources: a mark of
    other sources is not this one's."""
    ready, lock, _ = jit.warm_up_paths()
    assert ready.parent == tmp_path / "bnprobe" and ready.stem == lock.stem
    (tmp_path / "bnprobe").mkdir()
    (tmp_path / "bnprobe" / "warm-up-0000000000000000.ready").write_text("other sources\n")
    assert not jit.jit_for(BIG)


@pytest.mark.parametrize("codes, marked", [((0, 1), True), ((0, 2), False)], ids=["ran", "a-command-failed"])
def test_the_warm_up_marks_the_kernels_ready_only_when_every_command_ran(cold, monkeypatch, codes, marked):
    """A check's failure (exit 1) ran the kernels; an error (exit 2) may not have: then no mark."""
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, codes[len(calls) % 2], "", "error\n")

    monkeypatch.setattr(warm_up.subprocess, "run", run)
    log = io.StringIO()
    assert warm_up.warm_up(log=log) is marked
    assert [c[c.index("bnprobe") + 1:][:2] for c in calls] == [w[:2] for w in warm_up.WORKLOAD]
    assert ("error" in log.getvalue()) is not marked
    assert jit.warm_up_paths()[0].exists() is marked

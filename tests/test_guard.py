"""The resource guard: refusals before allocation, and its estimates checked against the peak resident memory the
kernel measures for a real run (``getrusage``), not against bnprobe's own figures."""

import importlib.util
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError
from bnprobe.guard import (
    ENV,
    available_memory,
    format_size,
    memory_limit,
    parse_size,
    require_run,
    run_bytes,
    set_memory_limit,
)


@pytest.fixture(autouse=True)
def _no_limit(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    set_memory_limit(None)
    yield
    set_memory_limit(None)


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text, expected", [("512M", 512 * 2**20), ("4G", 4 * 2**30), ("1.5GiB", 3 * 2**29),
                                            ("2000000", 2_000_000), ("64k", 65536), ("1T", 2**40), ("3 MB", 3 << 20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0", "1X", "nan", "1e400", "G"])
def test_parse_size_refuses(text):
    with pytest.raises(BNProbeError) as e:
        parse_size(text)
    assert "\n" not in str(e.value)


def test_available_memory_is_what_proc_says():
    avail, source = available_memory()
    with open("/proc/meminfo") as fh:
        line = next(li for li in fh if li.startswith("MemAvailable:"))
    proc = int(line.split()[1]) * 1024
    assert 0 < avail <= proc * 1.05 and source


def test_limit_sources(monkeypatch):
    monkeypatch.setenv(ENV, "300M")
    assert memory_limit() == (300 * 2**20, f"{ENV} limit")
    set_memory_limit(2**30)
    assert memory_limit() == (2**30, "--max-memory limit")
    set_memory_limit(None)
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(BNProbeError, match=ENV):
        memory_limit()


def test_require_run_names_size_and_limit():
    set_memory_limit(100 * 2**20)
    with pytest.raises(BNProbeError) as e:
        require_run("trace", (46340, 46340))
    msg = str(e.value)
    assert "trace on shape (46340, 46340)" in msg and format_size(run_bytes("trace", 46340**2)) in msg
    assert "100.0 MiB --max-memory limit" in msg and "\n" not in msg
    with pytest.raises(BNProbeError):  # the limit is on the whole process: the interpreter and libraries count
        require_run("trace", (2, 3, 4, 4))
    set_memory_limit(300 * 2**20)
    require_run("trace", (2, 3, 4, 4))


@pytest.mark.parametrize("argv", [
    ["--max-memory", "200M", "trace", "--shape", "46340,46340"],
    ["trace", "--shape", "1,128,1024,1024", "--max-memory", "200M"],
    ["trace", "--max-memory=200M", "--shape", "1,128,1024,1024"],
    ["overflow", "--shape", "64,256,64,64", "--max-memory", "200M"],
    ["gradcheck", "--shape", "64,256,64,64", "--max-memory", "200M"],
    ["compare-precision", "--shape", "64,256,64,64", "--max-memory", "200M", "--no-stress"],
    ["compare-precision", "--batch", "4096", "--max-memory", "200M"],
    ["shrink", "--adapter", "emulated", "--shape", "64,256,64,64", "--max-memory", "200M"],
    ["dump", "--adapter", "emulated", "--shape", "64,256,64,64", "--out", "d", "--max-memory", "200M"],
])
def test_cli_refuses_before_allocating(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and "needs about" in err and "--max-memory limit" in err
    assert time.monotonic() - t0 < 5  # refused up front, not after a run
    assert list(tmp_path.iterdir()) == []  # no report folder, no dump folder left behind


def test_env_limit_and_bad_option(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV, "150M")
    code, _, err = run(capsys, "trace", "--shape", "64,256,64,64")
    assert code == 2 and f"{ENV} limit" in err
    code, _, err = run(capsys, "trace", "--max-memory", "lots")
    assert code == 2 and err.startswith("bnprobe: error: memory size 'lots'")


def test_forged_npy_header_refused_before_loading(capsys, tmp_path):
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (100000, 100000), }"
    header += " " * (117 - len(header)) + "\n"
    p = tmp_path / "forged.npy"
    p.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
    assert p.stat().st_size == 128
    for cmd in (["trace"], ["overflow"], ["compare-precision", "--no-stress"], ["doctor"],
                ["shrink", "--adapter", "emulated"]):
        code, _, err = run(capsys, *cmd, "--input", str(p), "--out" if cmd[0] != "trace" else "--json",
                           *([str(tmp_path / "o")] if cmd[0] != "trace" else []))
        assert code == 2 and "truncated or forged" in err and err.count("\n") == 1, (cmd, err)
    assert not (tmp_path / "o").exists()


def test_big_npy_refused_under_limit(capsys, tmp_path):
    p = tmp_path / "x.npy"
    np.save(p, np.zeros((16, 64, 32, 32), np.float32))  # 4 MiB on disk, 1 M values
    code, _, err = run(capsys, "--max-memory", "300M", "trace", "--input", str(p))
    assert code == 2 and "trace on" in err and "needs about" in err


def _peak_rss(argv: list[str]) -> int:
    """Peak resident bytes of ``bnprobe argv`` in a child process, as the kernel accounts it."""
    code = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'bnprobe', *sys.argv[1:]], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); assert r.returncode in (0, 1), r.stderr; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.parametrize("command, extra", [("trace", ["--mode", "backward"]), ("overflow", ["--mode", "backward"]),
                                            ("compare-precision", ["--no-stress", "--format", "csv", "--out", "{o}"])])
def test_estimate_bounds_the_measured_peak(tmp_path, command, extra):
    """The estimate is above what the run really takes, and not far above (a guard refusing runs that fit would
    be a false alarm): checked at two sizes, so both the base and the per-element figure are tested."""
    peaks = {}
    for shape in ((4, 64, 32, 32), (16, 64, 32, 32)):
        n = math.prod(shape)
        args = [a.replace("{o}", str(tmp_path / f"o{n}")) for a in extra]
        peak = _peak_rss([command, "--shape", ",".join(map(str, shape)), *args])
        # compare-precision's default set runs torch's kernel where torch is installed
        with_torch = command == "compare-precision" and importlib.util.find_spec("torch") is not None
        est = run_bytes(command, n, torch=with_torch)
        assert peak <= est, f"{command} {shape}: measured {format_size(peak)} > estimated {format_size(est)}"
        peaks[n] = peak
    (n0, p0), (n1, p1) = sorted(peaks.items())
    slope = (p1 - p0) / (n1 - n0)
    assert slope <= run_bytes(command, 1) - run_bytes(command, 0) <= 2.5 * slope + 64, (command, slope)


@pytest.fixture(scope="module")
def recorded_dumps(tmp_path_factory):
    """Emulated fp16 dumps of 1 M and 4 M values: large enough that the call's data, not the imports' transient
    peak, sets the peak (at 0.26 M values the import's peak hid the data's and the slope measured half of it)."""
    dumps = {}
    for shape in ((16, 64, 32, 32), (64, 64, 32, 32)):
        n = math.prod(shape)
        d = tmp_path_factory.mktemp(f"dump{n}")
        subprocess.run([sys.executable, "-m", "bnprobe", "dump", "--adapter", "emulated", "--dtype", "fp16",
                        "--shape", ",".join(map(str, shape)), "--out", str(d), "--force"], check=True,
                       capture_output=True)
        dumps[n] = d
    return dumps


@pytest.mark.parametrize("command", ["compare-precision", "overflow", "gradcheck", "doctor"])
def test_estimate_bounds_a_recorded_calls_measured_peak(tmp_path, recorded_dumps, command):
    """A dump's call (one format, loaded alone) has its own figure: above the measured peak at two sizes, and
    growing with the call as the peak does, within 2.5x (doctor's bug models grow with it until they reach their
    cap)."""
    peaks = {}
    for n, d in recorded_dumps.items():
        opt = "--adapters" if command == "compare-precision" else "--adapter"
        out = ["--out", str(tmp_path / f"o{n}")] if command in ("compare-precision", "doctor") else []
        peak = _peak_rss([command, opt, f"dump:{d}", *out])
        assert peak <= run_bytes(command, n, recorded=True), (command, n, format_size(peak))
        peaks[n] = peak
    (n0, p0), (n1, p1) = sorted(peaks.items())
    slope, est = (p1 - p0) / (n1 - n0), (run_bytes(command, n1, recorded=True) - run_bytes(command, n0, recorded=True))
    assert slope <= est / (n1 - n0) <= 2.5 * slope + 64, (command, slope, est / (n1 - n0))


def test_an_address_space_limit_is_the_limit():
    """Under ``ulimit -v`` the guard refuses what the allocator would refuse, instead of a MemoryError."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY)); "
            "from bnprobe.cli import main; raise SystemExit(main(['trace', '--shape', '64,64,56,56']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "address space left under ulimit -v" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("argv", [["overflow", "--adapter", "dump:{d}"], ["doctor", "--adapter", "dump:{d}"],
                                  ["gradcheck", "--adapter", "dump:{d}"], ["trace", "--input", "{d}"],
                                  ["shrink", "--adapter", "emulated", "--input", "{d}"],
                                  ["compare-precision", "--adapters", "dump:{d}"]])
def test_recorded_calls_are_guarded_before_loading(capsys, tmp_path, monkeypatch, argv):
    """A dump's calls are checked against the limit by their recorded shapes, before any tensor is read."""
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "dump", "--adapter", "emulated", "--shape", "2,3,4,4", "--out", "d")[0] == 0
    code, _, err = run(capsys, "--max-memory", "200M", *[a.replace("{d}", "d") for a in argv])
    assert code == 2 and "needs about" in err and "(shape (2, 3, 4, 4))" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("env, imported_first, want", [(None, True, False), (None, False, False), ("1", True, True),
                                                       ("1", False, True)])
def test_commands_do_not_ask_numpy_for_huge_pages_unless_the_user_does(env, imported_first, want):
    """tune_process turns off numpy's MADV_HUGEPAGE (numpy imported before it or after), and keeps a
    NUMPY_MADVISE_HUGEPAGE the user set."""
    code = ("import sys\nif sys.argv[1] == 'y': import numpy\nfrom bnprobe.guard import tune_process\ntune_process()\n"
            "import numpy\nprint(numpy._core.multiarray._get_madvise_hugepage())")
    child_env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        child_env["NUMPY_MADVISE_HUGEPAGE"] = env
    out = subprocess.run([sys.executable, "-c", code, "y" if imported_first else "n"], capture_output=True, text=True,
                         env=child_env, check=True)
    assert out.stdout.strip() == str(want)


@pytest.mark.parametrize("var, env, want", [("OMP_WAIT_POLICY", None, "PASSIVE"),
                                            ("OMP_WAIT_POLICY", "ACTIVE", "ACTIVE"),
                                            ("OPENBLAS_THREAD_TIMEOUT", None, "4"),
                                            ("OPENBLAS_THREAD_TIMEOUT", "28", "28")])
def test_commands_let_idle_threads_sleep_unless_the_user_says(var, env, want):
    """tune_process sets OpenMP's wait policy before the compiled kernels' threads start (two processes' spinning
    threads on the same cores hold each other off at every barrier) and makes OpenBLAS's threads sleep once a call
    is done (set before numpy loads), and keeps an OMP_WAIT_POLICY or OPENBLAS_THREAD_TIMEOUT the user set."""
    code = f"import os\nfrom bnprobe.guard import tune_process\ntune_process()\nprint(os.environ['{var}'])"
    child_env = {k: v for k, v in os.environ.items() if k != var}
    if env is not None:
        child_env[var] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, check=True)
    assert out.stdout.strip() == want


def test_a_kernel_run_on_a_dumps_inputs_is_guarded_as_a_generated_input(capsys, tmp_path, monkeypatch):
    """A dump replayed takes the recorded call's figures; a runnable kernel on the same dump's inputs runs the
    kernel, and takes those of a generated input (a reviewer measured overflow --adapter emulated --input DIR at
    1.9 GB where the recorded figure estimated 1.5 GB)."""
    from bnprobe.guard import format_size

    monkeypatch.chdir(tmp_path)
    assert run(capsys, "dump", "--adapter", "emulated", "--shape", "16,64,32,32", "--out", "d")[0] == 0
    n = 16 * 64 * 32 * 32
    replay, kernel = run_bytes("overflow", n, recorded=True), run_bytes("overflow", n)
    assert replay < kernel
    limit = format_size((replay + kernel) // 2).replace(" ", "").replace("iB", "")
    code, _, err = run(capsys, "--max-memory", limit, "overflow", "--adapter", "emulated", "--input", "d")
    assert code == 2 and "needs about" in err, err
    assert run(capsys, "--max-memory", limit, "overflow", "--adapter", "dump:d")[0] in (0, 1)


@pytest.mark.parametrize("tuned", [True, False])
def test_free_heap_memory_goes_back_to_the_system_in_a_commands_process_only(tuned):
    """release_free_memory returns what the heap keeps after arrays are freed (below tune_process's trim threshold a
    command's heap keeps it, in the holes between arrays still in use): the resident size falls by most of the
    100 MiB freed; in a process tune_process did not tune (a user's own) nothing is done to its allocator."""
    code = ("import sys\nfrom pathlib import Path\nimport numpy as np\nfrom bnprobe.guard import release_free_memory, "
            "tune_process\nif sys.argv[1] == 'y': tune_process()\n"
            "rss = lambda: int(Path('/proc/self/statm').read_text().split()[1]) * 4096 >> 20\n"
            "keep = [np.ones(1 << 17) for _ in range(200)]  # 1 MiB each: from the heap (tuned)\n"
            "del keep[::2]  # holes between arrays in use: the heap's end cannot shrink\n"
            "before = rss()\nrelease_free_memory()\nprint(before - rss())")
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    out = subprocess.run([sys.executable, "-c", code, "y" if tuned else "n"], capture_output=True, text=True,
                         check=True)
    freed = int(out.stdout.strip())
    assert (freed > 80) if tuned else (freed < 10), freed


def test_sleeping_blas_threads_give_the_same_dot_products():
    """With OpenBLAS's threads sleeping after each call (tune_process) a dot product above OpenBLAS's threading
    threshold has the same bits as with its default spinning (the threads, so the split and its sum, are the same),
    and one thread gives other bits on the same data (the check could see a change of split)."""
    code = ("import os, sys\nif sys.argv[1] == 't': from bnprobe.guard import tune_process; tune_process()\n"
            "import numpy as np\nrng = np.random.default_rng(1)\n"
            "print([float(np.dot(rng.standard_normal(n), rng.standard_normal(n))).hex() for n in (100_352, 200_704)])")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS",
                                                             "OMP_NUM_THREADS")}
    tuned, default = (subprocess.run([sys.executable, "-c", code, w], capture_output=True, text=True, env=env,
                                     check=True).stdout for w in ("t", "d"))
    assert tuned == default
    if (os.cpu_count() or 1) > 1:
        one = subprocess.run([sys.executable, "-c", code, "d"], capture_output=True, text=True, check=True,
                             env={**env, "OPENBLAS_NUM_THREADS": "1"}).stdout
        assert one != default

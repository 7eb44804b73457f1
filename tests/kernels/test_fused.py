"""The compiled route (bnprobe.kernels.fused; the kernels of compiled_general and compiled_fast) beyond the
equality matrix of test_carriers.py: its roundings against numpy's and ml_dtypes' casts and round_detail, bit
for bit; the fast binary32 kernels taken where they apply and left for the general ones where something rare
happened; results that do not depend on the thread count, the layout or concurrent callers; and the switches
that choose the route."""

import importlib.util
import io
import os
import subprocess
import sys
import threading
import zlib

import ml_dtypes
import numba
import numpy as np
import pytest
from numba import njit

from bnprobe.kernels import Execution, backward, forward_infer, forward_train
from bnprobe.compiled import codes as C
from bnprobe.compiled import fast as F
from bnprobe.compiled import general as G
from bnprobe.compiled import kernels as K
from bnprobe.kernels import fused
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import reduce_sum
from bnprobe.numerics.rounding import RoundingSpec, round_detail


@pytest.fixture(autouse=True)
def jit_on(monkeypatch):
    monkeypatch.setenv("BNPROBE_JIT", "1")


@njit
def _rnd_all(v, s):
    r = np.empty_like(v)
    ev = np.empty(v.shape, dtype=np.int64)
    for i in range(v.size):
        r[i], ev[i] = G._rnd(v[i], s)
    return r, ev


@njit
def _bits_all(a, which):
    out = np.empty(a.shape, dtype=np.uint16)
    for i in range(a.size):
        if which == "bf16":
            out[i] = F._bf16_rne_bits(a[i])
        elif which == "fp16 bits":
            out[i] = F._f16_rne_bits(a[i])
        else:  # the conversion the kernels use on this CPU (its hardware's where it has one)
            out[i] = F._f16_bits(a[i])
    return out


def _edges(fmt: str) -> np.ndarray:
    """Values around every boundary of fmt: max and the overflow midpoint, the smallest normal, the
    subnormals and half the smallest one, ties at several exponents, zeros, infinities, NaN."""
    f = Arith(fmt).fmt
    ulp_max = 2.0 ** (f.emax - f.mantissa_bits)
    sub = f.smallest_subnormal
    pts = [f.max, f.max + ulp_max / 2, f.max + ulp_max / 4, f.tiny, f.tiny - sub / 2, sub, sub / 2, 3 * sub / 2,
           sub / 4, 1.0 + f.eps / 2, 1.0 + 3 * f.eps / 2, 1.0 + f.eps / 2 + 2.0 ** -60, 2.0 ** f.emin * 1.5,
           1e-300, 5e-324, 1e300]
    pts = np.array(pts)
    near = np.concatenate([np.nextafter(pts, np.inf), np.nextafter(pts, -np.inf), pts])
    return np.concatenate([near, -near, [0.0, -0.0, np.inf, -np.inf, np.nan]])


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away", "toward_zero", "up", "down"])
@pytest.mark.parametrize("overflow,subnormals", [("ieee", "keep"), ("saturate", "flush")])
def test_compiled_rounding_equals_round_detail_with_its_events(fmt, rounding, overflow, subnormals):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{rounding}".encode()))
    scale = {"fp32": 140, "fp16": 30, "bf16": 140}[fmt]
    v = rng.standard_normal(200_000) * 2.0 ** rng.integers(-scale, scale, 200_000)
    v = np.concatenate([v, _edges(fmt)])
    spec = RoundingSpec(rounding, overflow, subnormals)
    ar = Arith(fmt, spec)
    r, ev = _rnd_all(v, fused.spec_vector(ar))
    want, over, sat, flushed = round_detail(v, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals)
    with np.errstate(invalid="ignore"):
        under = (v != 0) & np.isfinite(v) & (want == 0)
    assert np.array_equal(r, want, equal_nan=True)
    assert np.array_equal(np.signbit(r[~np.isnan(r)]), np.signbit(want[~np.isnan(want)]))
    for bit, mask in ((C.EV_OVERFLOW, over), (C.EV_SATURATED, sat), (C.EV_UNDERFLOW, under),
                      (C.EV_FLUSHED, flushed)):
        assert np.array_equal((ev & bit) != 0, mask), (bit, np.flatnonzero(((ev & bit) != 0) != mask)[:5])
    assert over.any() and under.any()  # the boundaries were reached


@pytest.mark.parametrize("which", ["fp16 bits", "fp16 host", "bf16"])
def test_binary32_to_16_bit_roundings_equal_numpy_and_ml_dtypes(which):
    """Every 389th float32 bit pattern (11 million) plus the boundaries, against the library casts: the bit
    arithmetic, and the conversion the kernels use on this CPU (``HALF_NATIVE``: its hardware's)."""
    bf16 = which == "bf16"
    bits = np.arange(0, 1 << 32, 389, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        edges = [_edges(f).astype(np.float32) for f in ("fp16", "bf16")]
    a = np.concatenate([bits.view(np.float32), *edges])
    got = _bits_all(a, which)
    with np.errstate(over="ignore", invalid="ignore"):
        want = a.astype(ml_dtypes.bfloat16 if bf16 else np.float16).view(np.uint16)
    nan = np.isnan(a)
    assert np.array_equal(got[~nan], want[~nan])
    g = got[nan].view(ml_dtypes.bfloat16 if bf16 else np.float16).astype(np.float32)
    assert np.isnan(g).all() and np.array_equal(np.signbit(g), np.signbit(a[nan]))


@njit
def _source_values(h, lut):
    out = np.empty(h.shape, dtype=np.float64)
    for i in range(h.size):
        out[i] = F._value(h[i], lut)
    return out


@pytest.mark.parametrize("bits,fmt", [(np.uint16, np.float16), (np.int16, ml_dtypes.bfloat16)])
def test_every_16_bit_pattern_reads_as_numpy_and_ml_dtypes_read_it(bits, fmt):
    """A 16-bit tensor reaches the fast kernels as its bit patterns, fp16 in uint16 and bf16 in int16
    (fused._TAGS): every pattern's value is the library's (fp16 by the CPU's conversion where it has one)."""
    h = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # (ml_dtypes' cast of a NaN pattern)
        want = h.view(fmt).astype(np.float64)
    got = _source_values(h.view(bits), fused._fp16_table())
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint64), want[~nan].view(np.uint64))  # zeros' signs included
    assert np.isnan(got[nan]).all() and np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))


def _case(kind: str, shape=(6, 5, 7, 9), dtype=np.float32):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    x = rng.standard_normal(shape)
    if kind == "special":
        x[0, 1, 0, 0] = np.inf
        x[2, 3, 1, 1] = -np.inf  # two flagged channels apart: each redone on its own
    return x.astype(dtype), rng.standard_normal(shape).astype(dtype)


def _all(policy, x, dy, keep, layout="channels_first"):
    c = x.shape[1] if layout == "channels_first" else x.shape[-1]
    ex = Execution(layout=layout, keep_arrays=keep)
    f = forward_train(x, None, None, np.zeros(c), np.ones(c), policy=policy, execution=ex)
    b = backward(dy, x, None, f.mean, f.invstd, policy=policy, execution=ex)
    i = forward_infer(x, None, None, f.running_mean, f.running_var, policy=policy, execution=ex)
    return f, b, i


def _same_runs(a, b):
    for ra, rb in zip(a, b):
        for name in ("y", "mean", "invstd", "var", "running_mean", "running_var", "dx", "dgamma", "dbeta"):
            if hasattr(ra, name):
                va, vb = (np.asarray(getattr(r, name), dtype=np.float64) for r in (ra, rb))
                assert np.array_equal(va, vb, equal_nan=True), name
        assert ra.trace.names() == rb.trace.names()
        for sa, sb in zip(ra.trace, rb.trace):
            assert all(np.array_equal(sa.counters[k], sb.counters[k]) for k in sa.counters), sa.name
            assert np.array_equal([sa.vmin, sa.vmax], [sb.vmin, sb.vmax], equal_nan=True), sa.name


def test_fast_kernels_run_where_they_apply_and_the_general_ones_take_over_a_flagged_block(monkeypatch):
    seen = []
    real = fused.Fused._fast

    def spy(result, general):
        flagged, redone = set(np.flatnonzero(result[-1])), set()

        def counted(sel):
            redone.update(range(sel.start, sel.stop))
            return general(sel)
        seen.append(bool(flagged))
        out = real(result, counted)
        assert redone == flagged  # the general kernels redo the flagged channels, and no others
        return out

    monkeypatch.setattr(fused.Fused, "_fast", staticmethod(spy))
    for kind, flagged in (("normal", False), ("special", True)):
        seen.clear()
        x, dy = _case(kind)
        got = _all("fp16", x, dy, False)
        assert seen and any(seen) == flagged and all(r.trace.meta["route"] == "compiled" for r in got)
        _same_runs(_all("fp16", x, dy, True), got)


def _tiny_runs(x, dy, layout):
    """fp16 forward, backward and inference (with the batch statistics) with gamma 2^-23 and eps 2^-60 (x is
    near 2^-14: eps would dominate its variance): xhat of order 1, so y and dx in fp16's subnormal range, some
    lost to zero."""
    c = x.shape[1] if layout == "channels_first" else x.shape[-1]
    g, eps = np.full(c, 2.0 ** -23), 2.0 ** -60
    kw = dict(policy="fp16", execution=Execution(keep_arrays=False, layout=layout), eps=eps)
    f = forward_train(x, g, None, np.zeros(c), np.ones(c), **kw)
    b = backward(dy, x, g, f.mean, f.invstd, **kw)
    i = forward_infer(x, g, None, f.mean, f.var, **kw)
    return f, b, i


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_counts_add_up_over_rows_and_longer_rows_take_the_general_kernels(layout, monkeypatch):
    """The fast kernels count each row of (N, C, S) in int32 and add the rows' counts per channel; rows longer
    than fused.ROW_MAX (2^31 - 1; made small here: no test holds such a row) take the general kernels.  In every
    channel, the stored x, dy, y and dx have fp16 subnormals and values lost to zero, over several rows; all
    three runs (numpy route, fast kernels, general kernels) agree on every output and counter.  channels_first
    takes the fused backward (backward_fast, dx_source_fast), channels_last the separate passes (dx_fast)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 3, 5, 6)) * 2.0 ** -14  # about 70% below fp16's smallest normal, 2^-14
    x[:, :, 0, :2] = 2.0 ** -26  # below half fp16's smallest subnormal (2^-24): stored as zero
    dy = rng.standard_normal(x.shape) * 2.0 ** -12
    dy[:, :, 1, :2] = 2.0 ** -27
    if layout == "channels_last":
        x, dy = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (x, dy))
    x, dy = x.astype(np.float32), dy.astype(np.float32)
    kernels = {"load_fast", "normalise_fast",
               *(("backward_fast", "dx_source_fast") if layout == "channels_first" else ("dx_fast",))}
    ran = []
    for name in kernels:
        monkeypatch.setattr(K, name, lambda *a, _real=getattr(K, name), _name=name: ran.append(_name) or _real(*a))
    fast = _tiny_runs(x, dy, layout)
    assert set(ran) == kernels and all(r.trace.meta["route"] == "compiled" for r in fast)
    for run, stages in zip(fast, (("x", "y"), ("dy", "x", "dx"), ("y",))):
        for name in stages:
            s = run.trace[name]
            assert (s.counters["subnormal"] > 0).all() and (s.counters["underflow"] > 0).all(), name
    assert (fast[0].trace["x"].counters["underflow"] == 4 * 2).all()  # two from each of the four rows
    ran.clear()
    monkeypatch.setattr(fused, "ROW_MAX", 29)  # rows of 30 values
    general = _tiny_runs(x, dy, layout)
    assert not ran and all(r.trace.meta["route"] == "compiled" for r in general)
    monkeypatch.setenv("BNPROBE_JIT", "0")
    numpy_route = _tiny_runs(x, dy, layout)
    _same_runs(numpy_route, fast)
    _same_runs(numpy_route, general)


@pytest.mark.parametrize("shape,layout", [((7, 6), "channels_first"), ((4, 3, 11), "channels_first"),
                                          ((2, 3, 4, 5, 6), "channels_first"), ((3, 5, 4, 6), "channels_last")])
def test_compiled_route_in_every_layout_and_rank(shape, layout):
    x, dy = _case("normal", shape)
    for policy in ("fp16", "bf16:y_formula=affine", "fp16-acc16"):
        _same_runs(_all(policy, x, dy, True, layout=layout), _all(policy, x, dy, False, layout=layout))


def test_results_do_not_depend_on_the_thread_count_or_on_concurrent_callers():
    x, dy = _case("normal", (16, 12, 9, 9))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _all("bf16", x, dy, False)
    finally:
        numba.set_num_threads(before)
    _same_runs(one, _all("bf16", x, dy, False))
    results, errors = [], []

    def work():
        try:
            results.append(_all("bf16", x, dy, False))
        except Exception as e:  # noqa: BLE001 - any error in a thread is reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    for r in results:
        _same_runs(one, r)


def test_the_route_is_recorded_and_switched_off_by_the_environment(monkeypatch):
    x, _ = _case("normal")
    route = lambda policy, keep=False: forward_train(  # noqa: E731
        x, policy=policy, execution=Execution(keep_arrays=keep)).trace.meta["route"]
    assert route("fp16") == "compiled" and route("fp16-acc16") == "compiled"
    assert route("fp16", keep=True) == "float64 carriers"  # arrays kept: the float64 route
    assert route("fp64") == "float64 carriers"  # native float64 already
    assert route("fp16:rounding=stochastic") == "float64 carriers"  # numpy draws its random stream
    monkeypatch.setenv("BNPROBE_JIT", "0")
    assert route("fp16") == "float32 carriers" and route("fp16-acc16") == "float64 carriers"


def test_reductions_do_not_depend_on_the_thread_slots_their_process_has():
    """The per-thread addend buffers are sized by the process's NUMBA_NUM_THREADS, passed at each call (a cached
    kernel must not keep the count of the process that compiled it); a thread beyond them takes its own."""
    a = np.random.default_rng(3).standard_normal((5, 1001)).astype(np.float32)
    m = np.zeros(5)
    for order in (0, 1, 2):
        want = K.reduce_fast(a, a, m, K.ADD_SQUARE, order, 64, 0.0, K.THREAD_SLOTS)
        got = K.reduce_fast(a, a, m, K.ADD_SQUARE, order, 64, 0.0, 0)  # no slots: every thread its own buffer
        assert all(np.array_equal(w, g) for w, g in zip(want, got))
        name = ("sequential", "pairwise", "lanes")[order]
        assert np.array_equal(got[0], reduce_sum((a * a).astype(np.float64), Arith("fp32"), order=name, lanes=64))


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32])
def test_integer_tensors_are_read_by_value_not_as_16_bit_patterns(dtype, monkeypatch):
    """An int16 / uint16 tensor has the dtype the fast kernels hold bf16 / fp16 bit patterns in; its values
    are integers, converted as the numpy route converts them."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 8, (3, 4, 5)).astype(dtype)  # as bit patterns: tiny subnormals, nothing flagged
    dy = rng.integers(0, 5, x.shape).astype(dtype)
    for policy in ("bf16", "fp16"):
        monkeypatch.setenv("BNPROBE_JIT", "1")  # the compiled route at this small size
        got = _all(policy, x, dy, False)
        assert all(r.trace.meta["route"] == "compiled" for r in got)
        monkeypatch.setenv("BNPROBE_JIT", "0")
        want = _all(policy, x, dy, False)
        _same_runs(want, got)


def test_small_calls_take_the_numpy_route_unless_told(monkeypatch):
    """BNPROBE_JIT unset (auto): a call below COMPILED_MIN_ELEMENTS values takes the numpy route, a call of that
    many the compiled one, with the same values; BNPROBE_JIT=1 compiles every call, 0 none."""
    from bnprobe.compiled.jit import COMPILED_MIN_ELEMENTS

    rng = np.random.default_rng(8)
    small = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    big = rng.standard_normal((2, 4, COMPILED_MIN_ELEMENTS // 8)).astype(np.float32)
    monkeypatch.delenv("BNPROBE_JIT", raising=False)
    route = lambda x: forward_train(x, policy="fp16", execution=Execution(keep_arrays=False)).trace.meta["route"]  # noqa: E731
    assert route(small) == "float32 carriers" and route(big) == "compiled"
    monkeypatch.setenv("BNPROBE_JIT", "auto")
    assert route(small) == "float32 carriers"
    monkeypatch.setenv("BNPROBE_JIT", "1")
    compiled = forward_train(small, policy="fp16", execution=Execution(keep_arrays=False))
    assert compiled.trace.meta["route"] == "compiled"
    monkeypatch.setenv("BNPROBE_JIT", "0")
    assert route(big) == "float32 carriers"
    monkeypatch.delenv("BNPROBE_JIT")
    numpy_route = forward_train(small, policy="fp16", execution=Execution(keep_arrays=False))
    np.testing.assert_array_equal(numpy_route.y, compiled.y)


def test_a_generic_cpu_target_rounds_fp16_by_bit_arithmetic():
    """With NUMBA_CPU_NAME=generic (caches shared between CPUs) LLVM's half conversions would be calls numba
    does not link (the process aborted): the kernels use the bit arithmetic, whatever this CPU has."""
    code = ("import numpy as np\n"
            "from numba import njit\n"
            "from bnprobe.compiled import fast as F\n"
            "f = njit(lambda a: F._f16_bits(a))\n"
            "a = np.float32(1 + 2.0 ** -11)\n"  # a tie: to even, 1.0
            "print(F.HALF_NATIVE, hex(f(a)), hex(f(np.float32(65520.0))), hex(f(np.float32(-2.0 ** -25))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "0x3c00", "0x7c00", "0x8000"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_first_compile_is_announced_once_on_a_terminal_and_a_cached_kernel_is_not(tmp_path, monkeypatch):
    """A first run compiles the kernels for a minute or more: one line says so on a terminal (not when piped),
    once per process; a kernel numba's cache holds loads silently."""
    src = tmp_path / "cold_kernel.py"
    src.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(a):\n    return a + 1\n")
    cold = _module(src, "cold_kernel_a").f
    monkeypatch.setattr(fused, "_ANNOUNCED", threading.Event())
    piped = io.StringIO()
    fused.announce_compiling(cold, piped)
    assert piped.getvalue() == ""  # not a terminal
    term = _Terminal()
    fused.announce_compiling(cold, term)
    fused.announce_compiling(cold, term)
    assert term.getvalue().count("compiling its numba kernels") == 1 and str(tmp_path) in term.getvalue()
    assert cold(1) == 2  # compiled, and written to the cache beside the source
    monkeypatch.setattr(fused, "_ANNOUNCED", threading.Event())
    warm = _module(src, "cold_kernel_b").f  # a new process's view: nothing compiled yet, the cache filled
    assert not warm.overloads and not fused._compiles(warm)
    term = _Terminal()
    fused.announce_compiling(warm, term)
    assert term.getvalue() == ""

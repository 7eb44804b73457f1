"""float32 carriers and the compiled route (traces without arrays) give exactly what float64 carriers give.

The float64 route is the one checked against exact rational arithmetic
(tests/oracle.py), torch float64 and the error bounds; here every output,
statistic and trace counter and range of the float32 route and of the compiled
(numba) route must equal it bit for bit, special values included.
"""

import zlib

import numpy as np
import pytest

from bnprobe.core.formats import get_format
from bnprobe.kernels import Execution, backward, forward_infer, forward_train, get_policy
from bnprobe.kernels.batchnorm import carrier_for
from bnprobe.numerics.arith import Arith, Tally
from bnprobe.numerics.rounding import RoundingSpec

POLICIES = [
    "fp32", "fp16", "bf16",
    "fp16:variance=naive", "fp16:variance=welford,lanes=4", "bf16:variance=chan,tiles=3",
    "bf16:variance=welford_ascend,lanes=5", "fp16:order=sequential", "fp16:order=lanes,lanes=8",
    "fp32:order=sequential,kahan=true", "fp16:y_formula=scale", "bf16:y_formula=affine", "fp16:fma=true",
    "bf16:y_formula=affine,fma=true", "fp16:rsqrt=magic,rsqrt_newton=1", "bf16:rsqrt=frsqrte,rsqrt_newton=2",
    "fp16:rsqrt=sqrt_div,division=reciprocal", "fp16:backward_formula=ascend", "fp16:mean_by=reciprocal",
    "fp16:mean_by=prescaled", "bf16:output_rounding=nearest_away", "fp16:core_parts=3,core_combine=atomic",
    "fp16:clamp_var=true,variance=naive", "fp16:rsqrt=ascend950",
    # 16-bit parameters (model.half()): per-channel values in their own format, the arithmetic still fp32
    "fp16:params=fp16", "bf16:params=bf16", "fp16:params=fp16,stored_stats=true", "bf16:params=bf16,y_formula=affine",
    "fp16:params=bf16,variance=welford,lanes=4", "fp32:params=fp16",
]


GAMMA = np.array([1.0, -0.75, 0.0, 1.5, -2.0, 0.5])
BETA = np.array([0.0, 0.25, -1.0, 0.0, 3.0, -0.5])
# the trace counters the compiled route's cases made nonzero (see test_the_compiled_cases_hit_every_counter)
_SEEN_COUNTERS: set[str] = set()
_MATRIX_RAN: set[tuple[str, str]] = set()  # the compiled-only cases this process ran (pytest-xdist splits them)


def _inputs(kind: str, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    x = rng.standard_normal((4, 6, 3, 5))
    dy = rng.standard_normal(x.shape)
    if kind == "offset":  # large mean / small spread: cancellation in the statistics
        x = 1000.0 + 0.01 * x
    elif kind == "special":  # non-finite values in two channels, a constant channel
        x[0, 1, 0, 0], x[2, 1, 1, 1], x[1, 2, 0, 3] = np.inf, -np.inf, np.nan
        dy[3, 4, 2, 2] = np.nan
        x[:, 3] = 2.5
    elif kind == "huge":  # overflow of fp16 storage, of squares and sums in fp32
        x[:, 0] *= 7e4
        x[:, 1] *= 3e19
        dy[:, 2] *= 6e4
    elif kind == "tiny":  # fp16 subnormals and underflow; fp32 subnormal products
        x[:, 0] *= 1e-6
        x[:, 1] *= 1e-20
        dy[:, 1] *= 1e-25
        x[:, 2] = 0.0
    elif kind == "relu":  # many exact zeros, in x and dy
        x = np.maximum(x, 0.0)
        dy = np.where(rng.random(x.shape) < 0.5, 0.0, dy)
    return x.astype(dtype), dy.astype(dtype)


def _same(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, what
    assert np.array_equal(a, b, equal_nan=True), what
    # signs of zeros must agree; a NaN's sign is not a value (IEEE 754 leaves it open when both operands of an
    # operation are NaN, and compilers may swap the operands of + and x)
    number = ~np.isnan(a)
    assert np.array_equal(np.signbit(a[number]), np.signbit(b[number])), f"{what}: signs of zero"


def _same_trace(t64, t32, what):
    assert t64.names() == t32.names(), what
    for s64, s32 in zip(t64, t32):
        for k in s64.counters:
            _same(s64.counters[k], s32.counters[k], f"{what}: {s64.name}.{k}")
        _same([s64.vmin, s64.vmax, s64.absmax], [s32.vmin, s32.vmax, s32.absmax], f"{what}: {s64.name} range")


def _runs(pol, x, dy, keep):
    """Forward, backward (through the statistics and with them constant) and inference, in two channel blocks."""
    c = x.shape[1]
    args = dict(policy=pol, execution=Execution(chunk_elements=3 * 60, keep_arrays=keep))
    # gamma of both signs and zero: y is increasing, decreasing or constant in x (the compiled route's
    # ranges are carried through monotone stages)
    g, b = GAMMA[:c].astype(x.dtype), BETA[:c].astype(x.dtype)
    f = forward_train(x, g, b, np.zeros(c), np.ones(c), **args)
    out = {"forward": f}
    for training in (True, False):
        out[f"backward training={training}"] = backward(dy, x, g, f.mean, f.invstd, saved_var=f.var,
                                                        training=training, **args)
    out["infer"] = forward_infer(x, g, b, f.running_mean, f.running_var, **args)
    return out


def _same_runs(ref, got, route, what):
    """Every output, statistic, trace counter and range of ``got`` (a trace without arrays) equals ``ref``."""
    for mode, r in ref.items():
        g = got[mode]
        assert (r.trace.meta["route"], g.trace.meta["route"]) == ("float64 carriers", route), what
        for name in ("y", "mean", "invstd", "var", "running_mean", "running_var", "dx", "dgamma", "dbeta"):
            if hasattr(r, name):
                _same(getattr(r, name), getattr(g, name), f"{what} {mode}: {name}")
        _same_trace(r.trace, g.trace, f"{what} {mode}")
        if route == "compiled":
            _SEEN_COUNTERS.update(k for s in g.trace for k, v in s.counters.items() if v.any())


@pytest.mark.parametrize("kind", ["normal", "offset", "special", "huge", "tiny", "relu"])
@pytest.mark.parametrize("spec", POLICIES)
def test_float32_carriers_and_compiled_route_equal_float64_carriers(spec, kind, monkeypatch):
    pol = get_policy(spec)
    assert carrier_for(pol, False, None) is np.float32
    for dtype in (np.float32, np.float64):
        x, dy = _inputs(kind, dtype)
        ref = _runs(pol, x, dy, True)
        for route, jit in (("float32 carriers", "0"), ("compiled", "1")):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            _same_runs(ref, _runs(pol, x, dy, False), route, f"{spec} {kind} {dtype.__name__} {route}")


def test_float32_carriers_only_where_every_operation_is_fp32():
    assert carrier_for(get_policy("fp16"), True, None) is np.float64  # arrays kept: float64 wides
    assert carrier_for(get_policy("fp16"), False, {"mean": np.zeros(2)}) is np.float64  # overrides are float64
    for spec in ("fp64", "fp16-acc16", "bf16-acc16", "fp16:compute=fp16", "fp16:rounding=toward_zero",
                 "fp16:overflow=saturate", "fp16:subnormals=flush", "fp16:rounding=stochastic"):
        assert carrier_for(get_policy(spec), False, None) is np.float64, spec


def _special_fp32(rng, n):
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-45, 39, n)
    v[:, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -1.2e-38, 1e-45]
    with np.errstate(over="ignore"):
        return v.astype(np.float32)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "sqrt"])
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_arith_on_float32_carriers_equals_the_float64_route(op, fmt):
    rng = np.random.default_rng(7)
    a = _special_fp32(rng, (3, 4000))
    b = _special_fp32(rng, (3, 4000))
    ar = Arith(fmt)
    if fmt != "fp32":  # operands of the format itself
        a, b = ar.round(a), ar.round(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    args32, args64 = ((a,), (a64,)) if op == "sqrt" else ((a, b), (a64, b64))
    t32, t64 = Tally(3), Tally(3)
    r32 = getattr(ar, op)(*args32, tally=t32)
    r64 = getattr(ar, op)(*args64, tally=t64)
    assert r32.dtype == np.float32 and r64.dtype == np.float64
    _same(r32, r64, f"{fmt} {op}")
    for k in t64.counts:
        _same(t32.counts[k], t64.counts[k], f"{fmt} {op} tally {k}")
    # the cases exercise what they are meant to: overflow and underflow both happen
    if fmt == "fp32" and op == "mul":
        assert t64.counts["overflow"].sum() > 0 and t64.counts["underflow"].sum() > 0


def test_float32_operand_that_is_not_a_binary32_value_takes_the_float64_route():
    ar = Arith("fp32")
    a = np.full((2, 3), 3.0, dtype=np.float32)
    b = np.full((2, 1), 1 + 2.0**-24 + 2.0**-50)  # not a binary32 value
    r = ar.mul(a, b)
    assert r.dtype == np.float32
    # 3b = 3 + 0.75 ulp rounds once to 3 + 1 ulp; rounding b first (to 1 + 2^-23) would give a tie
    # at 3 + 1.5 ulp and 3 + 2 ulp
    assert np.all(r == np.float32(3 + 2.0**-22))
    assert np.float32(3.0) * np.float32(b[0, 0]) == np.float32(3 + 2.0**-21)


@pytest.mark.parametrize("kind", ["normal", "special", "huge", "tiny"])
@pytest.mark.parametrize("spec", ["fp16", "bf16", "fp32", "fp16:overflow=saturate", "bf16:subnormals=flush",
                                  "fp16:rounding=stochastic", "fp16-acc16"])
def test_tensors_already_in_the_storage_format_give_what_their_float64_values_give(spec, kind):
    pol = get_policy(spec)
    x, dy = _inputs(kind, np.float64)
    dt = np.dtype(get_format(pol.storage).dtype)
    with np.errstate(over="ignore"):
        xs, dys = x.astype(dt), dy.astype(dt)  # inputs in the storage dtype (skipped rounding when exact)
    wide_x, wide_dy = xs.astype(np.float64), dys.astype(np.float64)  # the same values, rounded by the kernel
    c = x.shape[1]
    for keep in (True, False):
        a = forward_train(xs, None, None, np.zeros(c), np.ones(c), policy=pol, execution=Execution(keep_arrays=keep))
        b = forward_train(wide_x, None, None, np.zeros(c), np.ones(c), policy=pol,
                          execution=Execution(keep_arrays=keep))
        for name in ("y", "mean", "invstd", "var", "running_mean", "running_var"):
            _same(getattr(a, name), getattr(b, name), f"{spec} {kind} keep={keep}: {name}")
        _same_trace(a.trace, b.trace, f"{spec} {kind} keep={keep} forward")
        ga = backward(dys, xs, None, a.mean, a.invstd, policy=pol, execution=Execution(keep_arrays=keep))
        gb = backward(wide_dy, wide_x, None, a.mean, a.invstd, policy=pol, execution=Execution(keep_arrays=keep))
        for name in ("dx", "dgamma", "dbeta"):
            _same(getattr(ga, name), getattr(gb, name), f"{spec} {kind} keep={keep}: {name}")
        _same_trace(ga.trace, gb.trace, f"{spec} {kind} keep={keep} backward")


# policies the compiled route runs that float32 carriers do not: fp64 parameters, 16-bit arithmetic, other roundings,
# saturation and flushing (with their events), and variance algorithms whose sums stay in numpy
COMPILED_ONLY = [
    "fp16:params=fp64", "fp16-acc16", "bf16-acc16", "fp16:overflow=saturate",
    "bf16-acc16:overflow=saturate,y_formula=affine",
    "bf16:subnormals=flush", "fp16-acc16:subnormals=flush,order=sequential,kahan=true",
    "fp16:rounding=toward_zero", "bf16:rounding=up,order=lanes,lanes=4", "fp16-acc16:rounding=down,y_formula=scale",
    "fp16:rounding=nearest_away,fma=true", "fp16:compute=fp16,backward_formula=ascend",
    "fp32:accumulate=fp16,variance=naive,mean_by=prescaled", "fp16-acc16:variance=welford,lanes=4",
    "bf16-acc16:variance=chan,tiles=3,rsqrt=sqrt_div", "fp16:core_parts=3", "fp16-acc16:stored_stats=true",
    "bf16:output_rounding=toward_zero,overflow=saturate",
    "fp32:variance=naive,order=sequential",  # its E[x²] - E[x]² of the offset input is negative in 5 channels
]


@pytest.mark.parametrize("kind", ["normal", "offset", "special", "huge", "tiny", "relu"])
@pytest.mark.parametrize("spec", COMPILED_ONLY)
def test_compiled_route_equals_float64_route_where_float32_carriers_do_not_apply(spec, kind, monkeypatch):
    monkeypatch.setenv("BNPROBE_JIT", "1")
    pol = get_policy(spec)
    for dtype in (np.float32, np.float64):
        x, dy = _inputs(kind, dtype)
        _same_runs(_runs(pol, x, dy, True), _runs(pol, x, dy, False), "compiled", f"{spec} {kind} {dtype.__name__}")
    _MATRIX_RAN.add((spec, kind))


def test_the_compiled_cases_hit_every_counter():
    """Run after the matrices above (same module, in order): every trace counter was nonzero in some compiled
    run, so a counter the compiled route got wrong could not hide behind zeros."""
    from bnprobe.kernels.trace import COUNTERS

    if len(_MATRIX_RAN) < 6 * len(COMPILED_ONLY):
        pytest.skip("the compiled-only matrix did not all run in this process (selected alone, or split by xdist)")
    assert set(COUNTERS) <= _SEEN_COUNTERS, set(COUNTERS) - _SEEN_COUNTERS


# counters=False (outputs only, no trace) must not change a bit: the roundings' random draws, the statistics, the
# outputs; here on every policy above, the presets and the general ones (stochastic rounding, a wider rstd, a
# narrow running update, torch's backward, flax's running statistics)
NO_TRACE = POLICIES + COMPILED_ONLY + [
    "fp64", "fp16:rounding=stochastic", "fp16-acc16:rounding=stochastic", "fp32:rstd_format=fp64",
    "fp16:running_format=fp16", "fp32:backward_formula=torch", "bf16:running_var=biased,running_momentum=old",
    "fp32:backward_formula=torch,backward_sums=plane_reduce,lanes=8,backward_fma=tail,sum_format=fp64"]


# the compiled route's kernels count in themselves whatever the flag (it only stops the recording): a few policies
# there, whose kernels the matrices above compile anyway (each policy's general kernels take seconds to compile)
NO_TRACE_COMPILED = ["fp16", "bf16", "fp16-acc16", "bf16-acc16:overflow=saturate,y_formula=affine"]


@pytest.mark.parametrize(("spec", "jit"), [(s, "0") for s in NO_TRACE] + [(s, "1") for s in NO_TRACE_COMPILED])
def test_a_run_without_a_trace_gives_the_same_outputs_bit_for_bit(spec, jit, monkeypatch):
    monkeypatch.setenv("BNPROBE_JIT", jit)
    pol = get_policy(spec)
    c = 6
    g, b = GAMMA, BETA
    for kind in ("normal", "offset", "special", "huge", "tiny", "relu"):
        for dtype in (np.float32, np.float64):
            x, dy = _inputs(kind, dtype)
            runs = []
            for counters in (True, False):
                args = dict(policy=pol,
                            execution=Execution(chunk_elements=3 * 60, keep_arrays=False, counters=counters))
                f = forward_train(x, g, b, np.zeros(c), np.ones(c), **args)
                outs = [f.y, f.mean, f.invstd, f.var, f.running_mean, f.running_var]
                for training in (True, False):
                    d = backward(dy, x, g, f.mean, f.invstd, saved_var=f.var, training=training, **args)
                    outs += [d.dx, d.dgamma, d.dbeta]
                i = forward_infer(x, g, b, f.running_mean, f.running_var, **args)
                runs.append((outs + [i.y], [f.trace, d.trace, i.trace]))
            (traced, t_on), (plain, t_off) = runs
            assert all(len(t.stages) > 0 for t in t_on), spec
            assert all(t.stages == [] and t.meta["policy"] == pol.name for t in t_off), spec  # metadata only
            for k, (u, v) in enumerate(zip(traced, plain)):
                _same(u, v, f"{spec} {kind} {dtype.__name__} jit={jit}: output {k}")


def test_arith_without_counting_rounds_the_same_and_leaves_the_tally_empty():
    rng = np.random.default_rng(11)
    a, b = _special_fp32(rng, (3, 4000)), _special_fp32(rng, (3, 4000))
    for fmt in ("fp32", "fp16", "bf16", "fp8_e4m3fn"):
        for spec in (None, RoundingSpec(overflow="saturate"), RoundingSpec(subnormals="flush")):
            on, off = Arith(fmt, spec), Arith(fmt, spec, counting=False)
            for args in ((a, b), (a.astype(np.float64), b.astype(np.float64))):
                t_on, t_off = Tally(3), Tally(3)
                _same(on.mul(*args, tally=t_on), off.mul(*args, tally=t_off), f"{fmt} {spec}")
                with np.errstate(over="ignore"):
                    wide = args[0] * 1e3
                _same(on.round(wide, t_on), off.round(wide, t_off), f"{fmt} {spec} round")
                assert any(v.any() for v in t_on.counts.values()), (fmt, spec)  # the inputs make events
                assert not any(v.any() for v in t_off.counts.values()), (fmt, spec)

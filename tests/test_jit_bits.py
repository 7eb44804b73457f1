"""bnprobe.compiled.bits.half against numpy's own float16 cast (correctly rounded, ties to even, overflow to ±inf from
65520): every float16 value, every midpoint between neighbours and the float64 values either side of it, both
signs, random float64 and float32 bit patterns (NaN payloads, subnormals, huge values), and the edges."""

import numpy as np
import pytest

pytest.importorskip("numba")

from bnprobe.compiled.bits import half  # noqa: E402 - after the skip
from bnprobe.core.formats import get_format  # noqa: E402


def _inputs():
    rng = np.random.default_rng(11)
    every = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float64)
    fin = np.unique(every[np.isfinite(every)])
    mid = (fin[:-1] + fin[1:]) / 2  # exact in float64: the ties
    near = [mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)]
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, np.nextafter(65520.0, 0), 65520.0, 2.0 ** -24,
             2.0 ** -25, np.nextafter(2.0 ** -25, 1), 3 * 2.0 ** -26, 5e-324, 1e300, 2.0 ** -14, 2.0 ** -14 * 1.5]
    bits = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 200_000, dtype=np.int64).view(np.float64)
    scaled = rng.standard_normal(200_000) * np.exp2(rng.integers(-30, 20, 200_000))
    x = np.concatenate([every, *near, *(-v for v in near), edges, -np.array(edges), bits, scaled])
    x32 = np.concatenate([rng.integers(-2**31, 2**31 - 1, 200_000, dtype=np.int64).astype(np.int32).view(np.float32),
                          mid.astype(np.float32), np.nextafter(mid.astype(np.float32), np.float32(np.inf))])
    return x, x32


X64, X32 = _inputs()


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], want[~nan]) and np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.parametrize("src", ["float64", "float32"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_half_is_numpys_float16_cast(src, dtype):
    x = X64 if src == "float64" else X32
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(dtype)
    _same(half(x, dtype), want)
    _same(half(x.reshape(2, -1) if x.size % 2 == 0 else x[1:].reshape(2, -1), dtype),
          (want if x.size % 2 == 0 else want[1:]).reshape(2, -1))  # any shape


def test_shapes_are_kept_zero_d_included():
    from bnprobe.core.formats import get_format

    x = np.array(70000.0)
    assert half(x, np.float64).shape == () and half(x, np.float64) == np.inf
    assert half(np.ones((2, 0, 3)), np.float32).shape == (2, 0, 3)
    f = get_format("fp16")
    import bnprobe.compiled.bits as jb

    got = jb.ulp(np.float64(f.max), f.emin, f.mantissa_bits)
    assert np.ndim(got) == 0 and got == 32.0  # a scalar for a scalar, as numpy's route gives
    assert jb.ulp(np.full((2, 3), 1.0), f.emin, f.mantissa_bits).shape == (2, 3)


# ---- the routes through their callers, as a review found them differ --------------------------------------------

def _both(monkeypatch, f):
    out = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        out[jit] = f()
    return out["0"], out["1"]


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
def test_compare_on_a_transposed_input_is_the_same_on_both_routes(monkeypatch, fmt):
    """numpy lays out an elementwise result in its input's memory order and msprobe's float32 means add in that
    order: a Fortran-ordered output keeps numpy's route, so rmse and ulp_mean stay numpy's to the last bit."""
    from dataclasses import asdict

    from bnprobe.engine.metrics import compare

    g = np.random.default_rng(11).standard_normal((8, 8)).T
    a = g * 1.001
    old, new = _both(monkeypatch, lambda: asdict(compare(a, g, fmt)))
    for k in old:
        np.testing.assert_array_equal(np.asarray(new[k], dtype=object if isinstance(old[k], tuple) else None),
                                      np.asarray(old[k], dtype=object if isinstance(old[k], tuple) else None),
                                      err_msg=k)


def test_layout_and_nan_payload_are_numpys(monkeypatch):
    from bnprobe.core.formats import get_format
    from bnprobe.numerics.rounding import round_to

    x = np.random.default_rng(2).standard_normal((30, 20)).T
    old, new = _both(monkeypatch, lambda: get_format("fp16").ulp(x))
    assert old.strides == new.strides and np.array_equal(old, new)
    y = np.array([0.0, 1.0, 70000.0])
    y.view(np.uint64)[0] = 0x7FF8000000000123  # a NaN with a payload
    old, new = _both(monkeypatch, lambda: round_to(y, "fp16"))
    assert np.array_equal(old.view(np.uint64), new.view(np.uint64))


@pytest.mark.parametrize("a,g,scale", [
    ([1e-320, 0.0], [1e-320, 0.0], None),  # the floor: error_floor times a subnormal largest golden, 0
    ([1e-40, 1.0], [0.0, 1.0], [5e-324, 1.0]),  # error_floor times a subnormal scale: 0, and 1e-40/0
    ([1.0, 0.0, 2.0], [1.0, 0.0, 2.5], None)])
def test_absolute_where_the_floor_underflows_is_the_same_on_both_routes(monkeypatch, a, g, scale):
    from bnprobe.engine.rules import absolute

    sc = None if scale is None else np.array(scale)
    old, new = _both(monkeypatch, lambda: tuple(absolute(np.array(a), np.array(g), "fp32", "scaled", scale=sc)))
    assert old[:2] == new[:2] and np.array_equal(old[2:], new[2:], equal_nan=True)


def _checker_case(fmt, n, kind, rng):
    f = get_format(fmt)
    g = rng.standard_normal(n) * np.exp2(rng.integers(-30, 12, n))
    a = g.astype(f.dtype if fmt != "fp32" else np.float32).astype(np.float64)
    if kind == "noisy":  # errors beyond the format's rounding
        a = a * (1 + rng.standard_normal(n) * 1e-3)
    if kind == "special":  # NaN, inf of either sign, small values at the threshold and below the atol, zeros
        k = max(1, n // 50)
        idx = rng.choice(n, k * 6)
        g[idx[:k]], a[idx[k:2 * k]], g[idx[2 * k:3 * k]] = np.nan, np.inf, 2.0 ** -10
        a[idx[3 * k:4 * k]], g[idx[4 * k:5 * k]], a[idx[5 * k:]] = 0.0, 1e-17, -np.inf
        g[:4] = [0.0, -0.0, 7e4, 1e-45][:min(4, n)]
    if kind == "huge":  # beyond fp16's range: left out as non-finite where the device holds them so
        g, a = g * 1e30, a * 1e30
    return a, g


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("kind", ["plain", "noisy", "special", "huge"])
def test_the_checkers_metrics_in_two_compiled_passes_are_numpys(fmt, kind, monkeypatch):
    """msprobe's checker figures (small-value ratio, RMSE, largest and mean relative error, error balance) on the
    compiled route equal numpy's route bit for bit and in type, at sizes on both sides of numpy's pairwise blocks
    (8, 128) and of its splits: the means are numpy's pairwise sums, the compacted relative errors' included."""
    from bnprobe.engine import metrics as M
    from bnprobe.core.tolerances import MSPROBE_CHECKER

    rng = np.random.default_rng([5, len(fmt), len(kind)])
    for n in (1, 7, 8, 9, 128, 129, 1000, 70001):
        a, g = _checker_case(fmt, n, kind, rng)
        got = {}
        for jit in ("0", "1"):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            got[jit] = M._checker(a, g, MSPROBE_CHECKER[fmt])
        for key, want in got["0"].items():
            have = got["1"][key]
            assert type(have) is type(want), (n, key)
            assert have == want or (np.isnan(want) and np.isnan(have)), (n, key, want, have)

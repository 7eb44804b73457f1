"""bnprobe._jit_bits.half against numpy's own float16 cast (correctly rounded, ties to even, overflow to ±inf from
65520): every float16 value, every midpoint between neighbours and the float64 values either side of it, both
signs, random float64 and float32 bit patterns (NaN payloads, subnormals, huge values), and the edges."""

import numpy as np
import pytest

pytest.importorskip("numba")

from bnprobe._jit_bits import half  # noqa: E402 - after the skip


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
    from bnprobe.formats import get_format

    x = np.array(70000.0)
    assert half(x, np.float64).shape == () and half(x, np.float64) == np.inf
    assert half(np.ones((2, 0, 3)), np.float32).shape == (2, 0, 3)
    f = get_format("fp16")
    import bnprobe._jit_bits as jb

    got = jb.ulp(np.float64(f.max), f.emin, f.mantissa_bits)
    assert np.ndim(got) == 0 and got == 32.0  # a scalar for a scalar, as numpy's route gives
    assert jb.ulp(np.full((2, 3), 1.0), f.emin, f.mantissa_bits).shape == (2, 3)

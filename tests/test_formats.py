import ml_dtypes
import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import FORMATS, format_names, get_format

FINFO = {
    "fp64": np.finfo(np.float64), "fp32": np.finfo(np.float32), "fp16": np.finfo(np.float16),
    "bf16": ml_dtypes.finfo(ml_dtypes.bfloat16), "fp8_e4m3fn": ml_dtypes.finfo(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": ml_dtypes.finfo(ml_dtypes.float8_e5m2),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_limits_match_finfo(name):
    f, fi = FORMATS[name], FINFO[name]
    assert f.max == float(fi.max)
    assert f.tiny == float(fi.tiny)
    assert f.smallest_subnormal == float(fi.smallest_subnormal)
    assert f.eps == float(fi.eps)
    assert f.mantissa_bits == fi.nmant
    assert f.emin == fi.minexp


@pytest.mark.parametrize("alias,name", [
    ("half", "fp16"), ("float16", "fp16"), ("FP16", "fp16"), ("bfloat16", "bf16"), ("float", "fp32"),
    ("float32", "fp32"), ("double", "fp64"), ("float64", "fp64"), ("e4m3", "fp8_e4m3fn"), ("torch.float16", "fp16"),
])
def test_aliases(alias, name):
    assert get_format(alias).name == name


def test_dtype_lookup():
    assert get_format(np.float16).name == "fp16"
    assert get_format(np.dtype(ml_dtypes.bfloat16)).name == "bf16"


def test_unknown_name_lists_valid_ones():
    with pytest.raises(BNProbeError, match="unknown format 'fp12'.*fp16/float16/half.*bf16/bfloat16"):
        get_format("fp12")
    assert "half" in format_names()


@pytest.mark.parametrize("name", ["fp64", "fp32", "fp16", "bf16"])
def test_torch_dtype(name):
    torch = pytest.importorskip("torch")
    t = get_format(name).torch_dtype
    assert torch.tensor([1.0], dtype=t).element_size() == get_format(name).itemsize


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_ulp(name):
    f = get_format(name)
    one = np.array([1.0, 1.5, f.tiny, f.smallest_subnormal * 3, f.max])
    expect = [f.eps, f.eps, f.smallest_subnormal, f.smallest_subnormal, f.eps * 2.0 ** f.emax]
    np.testing.assert_array_equal(f.ulp(one), expect)


def test_holds_is_exact_inclusion_of_the_value_sets():
    from bnprobe.core.formats import FORMATS

    for big in FORMATS.values():
        for small in FORMATS.values():
            if big.holds(small):  # every finite value of small, subnormals and max included, is one of big
                vals = np.array([small.max, small.tiny, small.smallest_subnormal, 1 + small.eps])
                assert np.all(vals.astype(big.dtype).astype(np.float64) == vals), (big.name, small.name)
    assert FORMATS["fp32"].holds(FORMATS["bf16"]) and FORMATS["fp32"].holds(FORMATS["fp16"])
    assert not FORMATS["bf16"].holds(FORMATS["fp16"]) and not FORMATS["fp16"].holds(FORMATS["bf16"])


def test_the_package_imports_its_public_names_on_first_use():
    """``import bnprobe`` loads neither numpy-heavy modules nor torch until a name is used, and every name in
    __all__ resolves."""
    import subprocess
    import sys

    code = ("import sys, bnprobe\n"
            "assert 'bnprobe.kernels' not in sys.modules and 'ml_dtypes' not in sys.modules, sorted(sys.modules)\n"
            "[getattr(bnprobe, n) for n in bnprobe.__all__]\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _ulp_oracle(v, f):
    """2^(max(e, emin) - mantissa) from math.frexp (e of a float64 subnormal or zero below every emin; inf and NaN
    at float64's exponent field 2047, as the bits say)."""
    import math

    out = []
    for x in np.abs(v).tolist():
        if not math.isfinite(x):
            e = 1024
        elif x == 0 or x < 2.0 ** -1022:
            e = -1023
        else:
            e = math.frexp(x)[1] - 1
        out.append(math.ldexp(1.0, max(e, f.emin) - f.mantissa_bits))
    return np.array(out)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("jit", ["0", "1"])
def test_ulp_on_both_routes_against_frexp(name, jit, monkeypatch):
    """Format.ulp on numpy's route and on the compiled one (BNPROBE_JIT=1: every array) against math.frexp, on
    random float64 bit patterns (every binade, subnormals, inf and NaN payloads) and each format's edges."""
    if jit == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("BNPROBE_JIT", jit)
    f = get_format(name)
    rng = np.random.default_rng(3)
    v = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 20_000, dtype=np.int64).view(np.float64)
    edges = [0.0, -0.0, f.tiny, f.smallest_subnormal, f.max, 1.0, 1 + f.eps, np.inf, -np.inf, np.nan, 5e-324,
             2.0 ** -1022, np.nextafter(2.0 ** -1022, 0), 1.7976931348623157e308]
    v = np.concatenate([v, edges, -np.array(edges)]).reshape(2, -1)  # any shape
    got = f.ulp(v)
    assert got.shape == v.shape
    np.testing.assert_array_equal(got.reshape(-1), _ulp_oracle(v.reshape(-1), f))


def test_ulps_apart_counts_the_format_s_values_between() -> None:
    """Against counting: stepping with nextafter in float32 and float16, and fp32's bit patterns read by struct;
    0 to 0.01 is ~10⁹ fp32 values apart (never |Δ|/smallest subnormal ≈ 10⁴³), ±0 the same place, NaN infinite."""
    import struct

    from bnprobe.core.formats import get_format

    for fmt, dt in (("fp32", np.float32), ("fp16", np.float16)):
        f = get_format(fmt)
        for start in (dt(0), dt(-3e-3), dt(1.5), dt(-2.0)):
            v, n = start, 0
            for _ in range(37):
                v, n = np.nextafter(v, dt(np.inf)), n + 1
            assert f.ulps_apart(np.array([start]), np.array([v]))[0] == n
    f32 = get_format("fp32")
    bits = struct.unpack("<I", struct.pack("<f", 0.01))[0]
    assert f32.ulps_apart(np.array([0.0]), np.array([np.float32(0.01)]))[0] == bits
    assert f32.ulps_apart(np.array([-0.0, np.nan, 1.0]), np.array([0.0, 1.0, np.inf])).tolist() == [0, np.inf, np.inf]
    assert get_format("bf16").ulps_apart(np.array([1.0]), np.array([1.0078125]))[0] == 1

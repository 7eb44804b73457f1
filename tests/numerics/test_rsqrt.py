"""rsqrt / reciprocal / sqrt methods against the literature and exact references."""

import re

import ml_dtypes
import numpy as np
import pytest
from oracle import round_fraction, round_rsqrt, round_sqrt

from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze
from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.rsqrt import (
    MAGIC_RECIP,
    MAGIC_RSQRT,
    Working,
    divide,
    reciprocal,
    rsqrt,
    rsqrt_estimate,
    sqrt,
)


@pytest.fixture(scope="module")
def fp32_1_4():
    """Every binary32 value in [1, 4): one full period of every rsqrt method."""
    bits = np.arange(np.float32(1).view(np.uint32), np.float32(4).view(np.uint32), dtype=np.uint32)
    x = bits.view(np.float32).astype(np.float64)
    return x, 1 / np.sqrt(x)


def max_rel(y, exact):
    return float(np.max(np.abs(y / exact - 1)))


@pytest.mark.parametrize("constant,figures", [
    (0x5F3759DF, (3.4376e-2, 1.75223e-3, 4.603e-6)),
    (0x5F375A86, (3.4365e-2, 1.75119e-3, 4.597e-6)),  # Lomont
    (0x5F37642F, (3.4213e-2, 1.7758e-3, 4.727e-6)),
])
def test_magic_seed_matches_the_literature(fp32_1_4, constant, figures):
    x, exact = fp32_1_4
    for steps, figure in enumerate(figures):
        y = rsqrt(x, "fp32", method="magic", constant=constant, newton=steps,
                  working=Working("fp64", round_result=False))
        digits = len(f"{figure:.6e}".split("e")[0].rstrip("0").replace(".", "")) - 1
        assert abs(max_rel(y, exact) - figure) <= 0.5 * 10.0 ** (np.floor(np.log10(figure)) - digits + 1), steps


def test_magic_two_fp32_steps(fp32_1_4):
    x, exact = fp32_1_4
    y = rsqrt(x, "fp32", method="magic", newton=2)
    assert abs(max_rel(y, exact) - 4.73e-6) < 0.01e-6  # the facts file: "in float32 two steps give ~4.73e-6"


def test_arm_frsqrte_bit_exact_figures(fp32_1_4):
    x, exact = fp32_1_4
    got = [max_rel(rsqrt(x, "fp32", method="frsqrte", newton=n, form="arm"), exact) for n in (0, 1, 2)]
    assert abs(got[0] - 3.28e-3) < 0.005e-3
    assert abs(got[1] - 1.62e-5) < 0.005e-5
    assert abs(got[2] - 1.31e-7) < 0.005e-7


def test_table_estimates(fp32_1_4):
    x, exact = fp32_1_4
    assert max_rel(rsqrt_estimate(x, "fp32", "table", bits=12), exact) <= 1.5 * 2.0**-12  # RSQRTPS's documented bound
    e8 = max_rel(rsqrt_estimate(x, "fp32", "table", bits=8), exact)
    assert 3.1e-3 < e8 < 3.4e-3  # an 8-bit estimate is ~3.3e-3, like ARM FRSQRTE
    r12 = reciprocal(x, "fp32", method="table", bits=12)
    assert max_rel(r12, 1 / x) <= 1.5 * 2.0**-12  # RCPPS's documented bound


def arm_entry(a9):
    """ARM RecipSqrtEstimate worked with plain integers, for one u0.9 input."""
    a10 = a9 * 2 + 1 if a9 < 256 else (a9 | 1) * 2
    b = 512
    while a10 * (b + 1) ** 2 < 2**28:
        b += 1
    return (b + 1) // 2


def test_arm_table_against_hand_computed_entries():
    # x = 0.25 = 0.25 * 4^0: u0.9 input 128; 1/sqrt(0.25) = 2, the 8-bit entry is 511/256
    assert arm_entry(128) == 511
    assert rsqrt_estimate(np.array([0.25]), "fp32", "frsqrte")[0] == 511 / 256
    # x = 0.5 = 0.5 * 4^0: u0.9 input 256; x = 3 = 0.75 * 4^1: input 384, result scaled by 2^-1
    assert rsqrt_estimate(np.array([0.5]), "fp32", "frsqrte")[0] == arm_entry(256) / 256
    assert rsqrt_estimate(np.array([3.0]), "fp32", "frsqrte")[0] == arm_entry(384) / 256 / 2
    assert abs(arm_entry(384) / 256 / 2 - 1 / np.sqrt(3)) < 4e-3


def magic_search(fmt, op):
    """Independent re-run of the constant search: numpy bit operations, float64 Newton steps."""
    dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    hi = 4.0 if op == "rsqrt" else 2.0
    b0, b1 = (int(np.array([v], dtype=dt).view(np.uint16)[0]) for v in (1.0, hi))
    bits = np.arange(b0, b1, dtype=np.int64)
    x = bits.astype(np.uint16).view(dt).astype(np.float64)
    m, bias = {"fp16": (10, 15), "bf16": (7, 127)}[fmt]
    centre = int(1.5 * 2**m * (bias - 0.045)) if op == "rsqrt" else 2 * bias * 2**m

    def err(c):
        i = c - (bits >> 1) if op == "rsqrt" else c - bits
        y = (i & 0xFFFF).astype(np.uint16).view(dt).astype(np.float64)
        y = y * (1.5 - 0.5 * x * y * y) if op == "rsqrt" else y * (2 - x * y)
        return np.max(np.abs(y * (np.sqrt(x) if op == "rsqrt" else x) - 1))

    return min(range(centre - 600, centre + 300), key=err)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_default_constants_are_the_one_step_optimum(fmt):
    assert magic_search(fmt, "rsqrt") == MAGIC_RSQRT[fmt]
    assert magic_search(fmt, "recip") == MAGIC_RECIP[fmt]


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("op", ["rsqrt", "reciprocal", "sqrt"])
def test_exact_is_correctly_rounded_on_every_input(fmt, op):
    a = analyze(MathSpec(op, fmt, "exact"), (0,))
    s = a.steps[0]
    assert a.domain == "exhaustive" and s.inputs == {"fp16": 0x7C00, "bf16": 0x7F80}[fmt] - 1
    assert s.max_ulp <= 0.5 and s.correctly_rounded == 1.0
    # and the reference itself against integer-square-root oracles on a sample
    rng = np.random.default_rng(0)
    dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt]
    x = rng.integers(1, 0x7C00, 500).astype(np.uint16).view(dt).astype(np.float64)
    fn = {"rsqrt": lambda v: rsqrt(v, fmt), "reciprocal": lambda v: reciprocal(v, fmt),
          "sqrt": lambda v: sqrt(v, fmt)}[op]
    from fractions import Fraction
    oracle = {"rsqrt": lambda v: round_rsqrt(v, fmt), "sqrt": lambda v: round_sqrt(v, fmt),
              "reciprocal": lambda v: round_fraction(1 / Fraction(v), fmt)}[op]
    np.testing.assert_array_equal(fn(x), [oracle(float(v)) for v in x])


def test_scale_invariance_behind_the_reduced_domain():
    """y(4^k x) = 2^-k y(x) bit for bit for every method while everything stays normal."""
    rng = np.random.default_rng(1)
    x = np.float32(1) + rng.random(20000).astype(np.float32) * np.float32(2.999)
    x = x.astype(np.float64)
    for method, kw in [("magic", {}), ("table", {"bits": 9}), ("frsqrte", {"form": "arm"}),
                       ("magic", {"form": "fma"})]:
        base = rsqrt(x, "fp32", method=method, newton=2, **kw)
        for k in (-40, -7, 3, 30):
            np.testing.assert_array_equal(rsqrt(x * 4.0**k, "fp32", method=method, newton=2, **kw), base * 2.0**-k)


def test_reduced_domain_analysis_is_confirmed_by_samples():
    a = analyze(MathSpec("rsqrt", "fp16", "magic"), (0, 1), domain="reduced", samples=4096)
    assert any("confirmed" in n for n in a.notes)
    full = analyze(MathSpec("rsqrt", "fp16", "magic"), (0, 1), domain="exhaustive")
    for r, f in zip(a.steps, full.steps):
        assert r.max_ulp == f.max_ulp and r.max_ulp_normal == f.max_ulp_normal


def test_specials():
    x = np.array([0.0, -0.0, -2.0, np.inf, np.nan, 4.0])
    for method in ("magic", "table", "frsqrte"):
        y = rsqrt(x, "fp32", method=method, newton=2)
        assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2]) and y[3] == 0 and np.isnan(y[4])
        assert abs(y[5] - 0.5) < 1e-5
    r = reciprocal(np.array([0.0, -0.0, np.inf, -np.inf, -4.0]), "fp16", method="magic", newton=3)
    assert r[0] == np.inf and r[1] == -np.inf and r[2] == 0 and np.signbit(r[3]) and abs(r[4] + 0.25) < 1e-3
    s = sqrt(np.array([0.0, np.inf, -1.0, 4.0]), "fp32", method="exp_log")
    assert s[0] == 0 and s[1] == np.inf and np.isnan(s[2]) and s[3] == 2.0
    sub = np.array([1e-40])
    assert rsqrt(sub, "fp32", method="magic", newton=1, subnormals="zero")[0] == np.inf
    assert np.isfinite(rsqrt(sub, "fp32", method="magic", newton=1, subnormals="keep")[0])


@pytest.mark.parametrize("form", ["standard", "fma", "arm"])
def test_newton_forms_converge(fp32_1_4, form):
    x, exact = fp32_1_4
    y = rsqrt(x[::16], "fp32", method="frsqrte", newton=2, form=form)
    assert max_rel(y, exact[::16]) < 3e-7
    r = reciprocal(x[::16], "fp32", method="frecpe", newton=2, form=form)
    assert max_rel(r, 1 / x[::16]) < 3e-7


def test_fma_form_is_at_least_as_accurate_as_standard(fp32_1_4):
    x, exact = fp32_1_4
    a = analyze(MathSpec("rsqrt", "fp32", "magic", form="standard"), (2,), domain="samples", samples=50000)
    b = analyze(MathSpec("rsqrt", "fp32", "magic", form="fma"), (2,), domain="samples", samples=50000)
    assert b.steps[0].max_ulp_normal <= a.steps[0].max_ulp_normal


def test_division_by_reciprocal():
    rng = np.random.default_rng(3)
    a = np.float32(rng.standard_normal(5000)).astype(np.float64)
    b = np.float32(rng.uniform(0.1, 10, 5000)).astype(np.float64)
    exact = divide(a, b, "fp32")
    approx = divide(a, b, "fp32", method="reciprocal", recip_method="table", newton=2)
    ulps = np.abs(approx - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert 0 < np.count_nonzero(approx != exact) and ulps.max() <= 3
    with pytest.raises(BNProbeError, match="unknown division method"):
        divide(a, b, "fp32", method="guess")


def test_exp_log_sqrt_needs_heron_steps():
    a0 = analyze(MathSpec("sqrt", "bf16", "exp_log"), (0, 3))
    assert a0.steps[0].max_ulp > 4 and a0.steps[1].max_ulp < 1


def test_bad_arguments():
    with pytest.raises(BNProbeError, match="unknown rsqrt method"):
        rsqrt(np.ones(2), "fp32", method="guess")
    with pytest.raises(BNProbeError, match="table bits"):
        rsqrt(np.ones(2), "bf16", method="table", bits=9)
    with pytest.raises(BNProbeError, match="unknown Newton form"):
        rsqrt(np.ones(2), "fp32", method="magic", newton=1, form="halley")
    with pytest.raises(BNProbeError, match="supports fp32, fp16 and bf16"):
        MathSpec("rsqrt", "fp64", "magic")
    with pytest.raises(BNProbeError, match="unknown op"):
        MathSpec("exp", "fp32", "magic")


# ---- hostile options: refused at their edges; non-finite results counted, never hidden --------------------------

TOP = {"fp32": 0x7F7FFFFF, "fp16": 0x7BFF, "bf16": 0x7F7F}  # bit pattern of each format's largest finite value
MANTISSA = {"fp32": 23, "fp16": 10, "bf16": 7}


def one_line(info):
    msg = str(info.value)
    assert type(info.value) is BNProbeError and msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_magic_constant_is_a_positive_finite_bit_pattern(fmt):
    for ok in (1, TOP[fmt]):
        assert MathSpec("rsqrt", fmt, "magic", constant=ok).constant == ok
    for bad in (0, TOP[fmt] + 1, -1):
        with pytest.raises(BNProbeError) as info:
            MathSpec("rsqrt", fmt, "magic", constant=bad)
        assert f"must be in 0x1..{TOP[fmt]:#x}" in one_line(info)
    with pytest.raises(BNProbeError) as info:
        MathSpec("rsqrt", fmt, "table", constant=1, bits=4)
    assert "the table method takes none" in one_line(info)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_table_bits_within_the_format(fmt):
    for ok in (1, MANTISSA[fmt]):
        MathSpec("reciprocal", fmt, "table", bits=ok)
    for bad in (0, MANTISSA[fmt] + 1):
        with pytest.raises(BNProbeError) as info:
            MathSpec("reciprocal", fmt, "table", bits=bad)
        assert f"in 1..{MANTISSA[fmt]} for {fmt}, got {bad}" in one_line(info)


@pytest.mark.parametrize("kw,message", [
    (dict(newton=(9,)), "newton steps must be distinct integers from 0 to 8, got \\[9\\]"),
    (dict(newton=(-1,)), "from 0 to 8, got \\[-1\\]"), (dict(newton=(1, 1)), "got \\[1, 1\\]"),
    (dict(newton=()), "got \\[\\]"),
    (dict(samples=0), "samples must be an integer from 1 to 67108864"),
    (dict(samples=(1 << 26) + 1), "samples must be an integer from 1 to 67108864 \\(2\\*\\*26\\), got 67108865"),
    (dict(seed=-1), "seed must be an integer >= 0, got -1"),
])
def test_unbounded_options_are_refused(kw, message):
    with pytest.raises(BNProbeError) as info:
        analyze(MathSpec("rsqrt", "fp16", "magic"), **{"newton": (0,), "domain": "samples", **kw})
    assert re.search(message, one_line(info))


def test_the_option_edges_are_accepted():
    a = analyze(MathSpec("rsqrt", "fp32", "magic"), (0, 8), domain="samples", samples=1, seed=0)
    assert [s.newton for s in a.steps] == [0, 8] and a.steps[0].inputs == 1


def test_reciprocal_overflow_of_the_format_is_counted_and_not_a_defect():
    """1/x beyond fp16's range (x below 1/65520, where rounding reaches inf) is inf for the correctly rounded
    result too: every result counted as non-finite, none as the method's defect, the ULP figures finite."""
    x = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    overflowing = int(np.count_nonzero(x < 1 / 65520))  # 65520 = 65504 + half an ulp rounds to inf
    assert overflowing == 256
    for method in ("frecpe", "exact"):
        a = analyze(MathSpec("reciprocal", "fp16", method), (2,) if method == "frecpe" else (0,))
        s = a.steps[0]
        assert (s.nonfinite, s.nonfinite_mismatch) == (overflowing, 0)
        assert np.isfinite(s.max_ulp) and s.max_ulp < 2
        assert any(f"{overflowing} of {s.inputs} results are inf as the correctly rounded" in n for n in a.notes)


def test_non_finite_results_of_a_bad_method_are_infinite_errors_not_max_ulp_0():
    """fp16 rsqrt with the valid but worst constant 0x1: after a Newton step nearly every result is inf or NaN;
    the maximum ULP error says inf, not the 0 of the few finite ones."""
    a = analyze(MathSpec("rsqrt", "fp16", "magic", constant=1), (1,))
    s = a.steps[0]
    assert s.nonfinite == s.nonfinite_mismatch > 0.99 * s.inputs
    assert s.max_ulp == s.max_ulp_normal == s.mean_ulp_normal == np.inf
    assert s.worst and s.worst[0]["ulp"] == np.inf and not np.isfinite(s.worst[0]["result"])


def test_divide_splits_the_formats_overflow_from_the_methods_defects():
    a = analyze(MathSpec("divide", "fp16", "magic"), (2,), samples=1 << 14)
    exact = analyze(MathSpec("divide", "fp16", "exact"), (0,), samples=1 << 14)
    s, e = a.steps[0], exact.steps[0]
    assert e.nonfinite > 0 and e.nonfinite_mismatch == 0 and np.isfinite(e.max_ulp)  # a/b overflows fp16
    # the method's inf where the quotient overflows is the format's (some such pairs it leaves finite)
    assert 0 < s.nonfinite - s.nonfinite_mismatch <= e.nonfinite
    assert s.nonfinite_mismatch > 0 and s.max_ulp == np.inf


def test_divide_has_its_histogram_and_refuses_options_it_does_not_model():
    """The ULP histogram of a divide is filled like the others', and options the
    divide analysis does not model are refused instead of ignored."""
    from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze

    res = analyze(MathSpec(op="divide", format="fp16", method="magic"), (0, 1), samples=4000, seed=3)
    for st in res.steps:
        assert st.histogram and 3600 < sum(st.histogram.values()) <= 4000  # the finite results, as for rsqrt
    for bad in (dict(subnormals="zero"), dict(working="fp64")):
        with pytest.raises(BNProbeError, match="do not apply"):
            analyze(MathSpec(op="divide", format="fp16", method="magic", **bad), (0,), samples=100)
    with pytest.raises(BNProbeError, match="do not apply"):
        analyze(MathSpec(op="divide", format="fp16", method="magic"), (0,), domain="exhaustive")

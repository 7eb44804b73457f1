"""The judge's rules (bnprobe.engine.rules): each at its edge, by hand and against the correctly rounded golden."""

import math
import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.engine.cases import stress_cases
from bnprobe.engine.rules import absolute
from bnprobe.numerics.rounding import round_to

OUTPUT_FORMATS = ("fp16", "bf16", "fp32")


def test_verdict_rules_by_hand():
    g = np.array([1.0, 2.0, 1e-6])
    # fp32 accumulated: (|d-b| - half an fp32 ulp at b) / max(|b|, 2^-14) <= 2^-11 (4.88e-4); at b = 1 and 2
    # half an ulp is 2^-24 relative
    ok, why, score, bound = absolute(g * (1 + 4e-4), g, "fp32", "accumulated")
    assert ok and bound == 2.0**-11 and score == pytest.approx(4e-4 - 2.0**-24, rel=1e-6)
    bad = g.copy()
    bad[2] += 1e-7  # 1e-7 / 2^-14 = 1.6e-3 > bound with msprobe's absolute floor...
    assert not absolute(bad, g, "fp32", "accumulated").passed
    assert absolute(bad, g, "fp32", "scaled").passed is False  # ...and with the floor relative to max|b| = 2
    assert absolute(bad, g, "fp32", "scaled", scale=np.array([1.0, 2.0, 1e4])).passed  # a large natural scale
    # threshold: relative error <= 2^-20 for fp32
    assert not absolute(g * (1 + 2e-6), g, "fp32", "threshold").passed
    assert absolute(g * (1 + 5e-7), g, "fp32", "threshold").passed
    assert not absolute(np.array([1.0, np.nan]), np.array([1.0, 2.0]), "fp16").passed


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
@pytest.mark.parametrize("rule", ["scaled", "accumulated", "threshold"])
def test_the_correctly_rounded_golden_always_passes(seed, fmt, rule):
    """Every output of every stress input, rounded once from the FP64 golden to the output's format, passes
    every rule: the only error left is the format's own rounding (subnormals, tiny values and all)."""
    ref = get_adapter("reference")
    for case in stress_cases(seed):
        x = case.make()
        c = x.shape[1]
        g, b = np.random.default_rng(seed).uniform(0.5, 1.5, c), np.zeros(c)
        f = ref.forward_train(x, g, b, np.zeros(c), np.ones(c), dtype=fmt)
        dy = np.random.default_rng([seed, 1]).standard_normal(x.shape) * (300.0 if seed == 2 else 1.0)
        bw = ref.backward(dy, x, g, f.saved, dtype=fmt)
        inf = ref.forward_infer(x, g, b, np.zeros(c), np.ones(c), dtype=fmt)
        for name, gold in (("y", f.y), ("mean", f.saved.mean), ("invstd", f.saved.value),
                           ("running_var", f.running_var), ("y_infer", inf.y), ("dx", bw.dx),
                           ("dgamma", bw.dgamma), ("dbeta", bw.dbeta)):
            with np.errstate(all="ignore"):
                rounded = round_to(gold, fmt)
            ok, why, *_ = absolute(rounded, gold, fmt, rule)
            assert ok, f"{case.name} {name} in {fmt}: {why}"


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_the_rounding_floor_is_exactly_half_an_ulp(fmt):
    """Just inside and just outside each rule's bound once half an ulp of the format is taken off: the
    floor forgives the format's own rounding and nothing more."""
    from bnprobe.core.formats import get_format
    from bnprobe.core.tolerances import MSPROBE_STANDARDS

    std, f = MSPROBE_STANDARDS[fmt], get_format(fmt)
    g = np.array([0.75, 1.0, 1.5])  # |g| above the small-value threshold and the accumulated floor
    half = 0.5 * f.ulp(g)
    for rule, bound in (("threshold", std.rtol), ("accumulated", std.accumulated)):
        assert absolute(g + half + 0.99 * bound * g, g, fmt, rule).passed, rule
        assert not absolute(g + half + 1.01 * bound * g, g, fmt, rule).passed, rule
    tiny = np.array([f.smallest_subnormal * 3, 0.0])  # subnormal spacing at the bottom of the range
    assert absolute(tiny + 0.5 * f.smallest_subnormal, tiny, fmt, "threshold").passed


@pytest.mark.parametrize("rule", ["threshold", "accumulated", "scaled"])
def test_failure_message_says_where_like_torch_testing(rule):
    """"Mismatched elements: k / n (p%)", the worst element's index and channel, its value, the expected value
    and what was allowed, like torch.testing.assert_close."""
    g = np.random.default_rng(0).standard_normal((2, 3, 4, 4))
    a = g.copy()
    a[1, 2, 3, 0] += 0.5
    a[0, 1, 0, 0] += 0.25
    ok, why, _, _ = absolute(a.astype(np.float16), g, "fp16", rule)
    assert not ok
    assert why.startswith("Mismatched elements: 2 / 96 (2.08%")
    assert "index (1, 2, 3, 0) (channel 2)" in why
    assert f"{float(np.float16(a[1, 2, 3, 0])):.6g} vs {g[1, 2, 3, 0]:.6g} expected" in why and "allowed" in why
    v = np.linspace(1, 2, 5)
    ok, why, _, _ = absolute(np.where(np.arange(5) == 3, v + 0.5, v).astype(np.float16), v, "fp16", rule)
    assert not ok and "at channel 3:" in why


def test_outputs_within_a_correct_kernels_rounding_do_not_fail_on_msprobes_relative_metrics():
    """y = x̂·γ + β and dx cancel near zero: an output there errs by a few units of fp32 times its natural magnitude,
    which msprobe's small-value ratio (absolute error above 1e-9 for |golden| <= 2^-20) and error balance count as a
    failure when the bench happens to round better. Every element within 8 units (+ half an ulp) passes, saying so
    and naming the metrics; one element at 1.5 times that fails, whichever metric failed."""
    from types import SimpleNamespace

    from bnprobe.engine.rules import within_rounding
    from bnprobe.core.tolerances import MSPROBE_STANDARDS, SMALL_VALUE_ULPS

    u = 2.0 ** -24
    natural = np.array([4.0, 4.0, 3.0])  # |x·rstd·γ| + |μ·rstd·γ| + |β| per output
    golden = np.array([1.5, 2e-8, -0.75])  # the second is a small value for fp32
    assert abs(golden[1]) <= MSPROBE_STANDARDS["fp32"].small_threshold
    only_small = SimpleNamespace(status={"small_value": "error", "rmse": "pass", "max_rel": "pass"})
    half_ulp = 0.5 * float(np.spacing(np.float32(2e-8)))
    assert SMALL_VALUE_ULPS == 8.0
    edge = 8.0 * u * 4.0 + half_ulp  # the constant by value: loosening it lets 1.5 x the edge pass
    ok = within_rounding(only_small, golden + [0, 0.95 * edge, 0], golden, "fp32", lambda: natural)
    assert ok is not None and 0.9 < ok[0] <= 1.0 and "small_value magnifies" in ok[1]
    assert within_rounding(only_small, golden + [0, 1.5 * edge, 0], golden, "fp32", lambda: natural) is None
    also_eb = SimpleNamespace(status={"small_value": "error", "eb": "error"})
    ok = within_rounding(also_eb, golden + [0, 0.5 * edge, 0], golden, "fp32", lambda: natural)
    assert ok is not None and "small_value, eb magnify" in ok[1]
    assert within_rounding(also_eb, golden + [0, 1.5 * edge, 0], golden, "fp32", lambda: natural) is None
    assert within_rounding(only_small, golden, golden, "fp32", None) is None  # no natural scale: no say
    passing = SimpleNamespace(status={"small_value": "pass"})
    assert within_rounding(passing, golden, golden, "fp32", lambda: natural) is None  # nothing to forgive


def test_the_rules_constants_by_value():
    """The tolerances every rule reads, pinned by value (msprobe's by its own table: tests/test_metrics_msprobe.py
    checks them against msprobe's functions), so that loosening one fails here."""
    from bnprobe.core.tolerances import (
        DOCTOR_TOLERANCES,
        GRAD_TOLERANCES,
        MSPROBE_STANDARDS,
        SMALL_VALUE_ULPS,
        accumulation_bound,
    )

    assert SMALL_VALUE_ULPS == 8.0
    assert DOCTOR_TOLERANCES == {"fp64": 4e-7, "fp32": 4e-5, "fp16": 8e-3, "bf16": 6.4e-2}
    assert GRAD_TOLERANCES == {"fp64": (1e-7, 1e-7), "fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3),
                               "bf16": (1.6e-2, 1.6e-2)}
    fp16 = MSPROBE_STANDARDS["fp16"]
    assert (fp16.small_threshold, fp16.small_atol, fp16.rtol, fp16.error_floor, fp16.accumulated) == \
        (2.0**-10, 2.0**-16, 2.0**-10, 2.0**-11, 2.0**-8)
    assert accumulation_bound("fp16", 1000) == pytest.approx(1000 * 2.0**-24, rel=1e-4)  # fp32 accumulation


@pytest.mark.parametrize("fmt,rtol", [("fp64", 4e-7), ("fp32", 4e-5), ("fp16", 8e-3), ("bf16", 6.4e-2)])
def test_the_doctors_rule_at_its_edge(fmt, rtol):
    """A wrong output just beyond the doctor's tolerance fails, just inside passes; the tolerance by value, so a
    looser table fails the first assertion."""
    from bnprobe.engine.rules import channel_rule
    from bnprobe.core.formats import get_format

    want = np.array([[1.0, -0.5, 0.25], [2.0, 0.125, -1.0]]).T.reshape(3, 2)  # 3 elements per channel, 2 channels
    scale = np.abs(want).max(axis=0)
    half = 0.5 * get_format(fmt).ulp(want)
    for share, passes in ((0.98, True), (1.02, False)):
        got = want + half + share * rtol * scale
        ratio, why = channel_rule("y", got, want, None, fmt, describe=True)
        assert (ratio <= 1) is passes, (fmt, share, ratio)
        assert passes or why.startswith(f"y ({fmt}): Mismatched elements: 6 / 6 (100%); greatest error ")


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_the_rounding_exemption_at_its_edge_in_every_format(fmt):
    """The rounding exemption forgives 8 units of the accumulation format (fp32) times the natural magnitude
    plus half an ulp, in every format it is used with, and not 1.1 times that."""
    from types import SimpleNamespace

    from bnprobe.engine.rules import within_rounding
    from bnprobe.core.formats import get_format
    from bnprobe.core.tolerances import MSPROBE_STANDARDS

    only_small = SimpleNamespace(status={"small_value": "error"})
    tiny = MSPROBE_STANDARDS[fmt].small_threshold / 4
    golden = np.array([1.0, tiny])
    natural = np.array([3.0, 3.0])
    edge = 8.0 * 2.0**-24 * 3.0 + 0.5 * float(get_format(fmt).ulp(np.array([tiny]))[0])
    assert within_rounding(only_small, golden + [0, 0.99 * edge], golden, fmt, lambda: natural) is not None
    assert within_rounding(only_small, golden + [0, 1.1 * edge], golden, fmt, lambda: natural) is None


@pytest.mark.parametrize("tensor", ["dbeta", "running_mean"])
@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_the_accumulation_exemption_at_its_edge(fmt, tensor):
    """A per-channel sum within γ_R·Σ|terms| + half an ulp is forgiven, just beyond it is not; and only sums are."""
    from bnprobe.engine.rules import within_accumulation
    from bnprobe.core.formats import get_format

    terms, mag = 1024, np.array([500.0, 800.0])
    golden = np.array([1e-3, -2e-3])
    gamma = terms * 2.0**-24 / (1 - terms * 2.0**-24)
    edge = gamma * mag + 0.5 * get_format(fmt).ulp(golden)
    assert within_accumulation(tensor, golden + 0.99 * edge, golden, fmt, mag, terms) is not None
    assert within_accumulation(tensor, golden + 1.01 * edge, golden, fmt, mag, terms) is None
    assert within_accumulation("dx", golden + 0.5 * edge, golden, fmt, mag, terms) is None  # not a sum


@pytest.mark.parametrize("terms", [4097, 65536, 401408, 2**24, 2**30])
def test_the_accumulation_exemption_past_4096_terms_is_a_blocked_sums(terms):
    """Past 4096 terms a sum is forgiven a blocked sum's rounding: blocks of b = max(4096, ⌈√R⌉) added in any order,
    then their ⌈R/b⌉ sums, γ_(b + ⌈R/b⌉) (written out here by hand, in exact rationals), finite where the any-order
    γ_R is infinite (R·u ≥ 1 from 2²⁴ in fp32); at its edge as at 1024 terms; the reason names the blocks."""
    from fractions import Fraction

    from bnprobe.core.formats import get_format
    from bnprobe.core.tolerances import accumulation_bound
    from bnprobe.engine.rules import within_accumulation

    b = max(4096, math.isqrt(terms - 1) + 1)
    m = b + -(-terms // b)
    u = Fraction(1, 2**24)
    gamma = float(m * u / (1 - m * u))
    assert accumulation_bound("fp16", terms) == pytest.approx(gamma, rel=1e-15) and math.isfinite(gamma)
    assert (terms * u >= 1) == (terms >= 2**24)  # (where the any-order bound is infinite)
    mag, golden = np.array([500.0, 800.0]), np.array([1e-3, -2e-3])
    edge = gamma * mag + 0.5 * get_format("fp32").ulp(golden)
    assert within_accumulation("dbeta", golden + 1.01 * edge, golden, "fp32", mag, terms) is None
    ok = within_accumulation("dbeta", golden + 0.99 * edge, golden, "fp32", mag, terms)
    assert ok is not None and f"blocks of {b}: {b} + {m - b} additions in a row" in ok[1], ok


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_worse_than_the_bench_at_its_edges(fmt):
    """Named above 10x the bench's RMSE (or largest error) and 2 ulps RMS of the output, not below either; the ratios
    by hand (numpy on the errors), unfloored."""
    from bnprobe.engine.rules import WORSE_THAN_BENCH, WORSE_ULPS, versus_bench
    from bnprobe.core.formats import get_format

    assert (WORSE_THAN_BENCH, WORSE_ULPS) == (10.0, 2.0)
    golden = np.linspace(1.0, 1.9, 64)  # one binade: the ulp is the same everywhere
    ulp = float(get_format(fmt).ulp(np.array([1.0]))[0])
    bench = golden + 3.0 * ulp  # the bench errs by 3 ulps everywhere
    for times, named in ((10.0 * 0.99, False), (10.0 * 1.01, True)):
        vs = versus_bench(golden + times * 3.0 * ulp, bench, golden, fmt)
        assert vs.rmse_ratio == pytest.approx(times) and vs.max_ratio == pytest.approx(times)
        assert vs.rmse == pytest.approx(np.sqrt(np.mean((times * 3.0 * ulp) ** 2)))
        assert bool(vs.worse("careful", "it passes")) is named, (fmt, times)
    exact = golden.copy()  # an exact bench: the ratio is inf, named only beyond 2 ulps RMS
    for ulps, named in ((1.98, False), (2.02, True)):
        vs = versus_bench(golden + ulps * ulp, exact, golden, fmt)
        assert math.isinf(vs.rmse_ratio) and bool(vs.worse("careful", "it passes")) is named, (fmt, ulps)
    msg = versus_bench(golden + 60 * ulp, bench, golden, fmt).worse("careful", "it passes: within x")
    assert msg.startswith("worse than careful: RMSE 20x (") and msg.endswith("; it passes: within x")
    assert "named above 10x the bench's error" in msg


def test_versus_bench_where_it_has_no_say():
    from bnprobe.engine.rules import versus_bench

    g = np.array([1.0, 2.0])
    assert versus_bench(g, g, g, "fp32").rmse_ratio == 1.0  # both exact: as good as the bench
    assert versus_bench(g[:1], g, g, "fp32") is None  # shapes differ
    assert versus_bench(np.array([np.nan, np.inf]), g, g, "fp32") is None  # no finite element
    vs = versus_bench(np.array([np.nan, 2.5]), g, g, "fp32")  # the NaN is left to the non-finite rule
    assert vs.max_err == 0.5 and math.isinf(vs.max_ratio)


@pytest.mark.parametrize("store", ["float16", "bfloat16", "float32", "float64", "list", "strided"])
@pytest.mark.parametrize("at", [0, 517, 1023])
def test_nonfinite_mismatch_in_every_storage(store, at):
    """NaN/inf where the golden rounded to the format has none (or the reverse), found whatever the output is
    stored in (its exponent bits are read for contiguous IEEE arrays, not its float64 copy), at the first, a
    middle and the last element; counted and placed as plain Python counts them."""
    import math

    import ml_dtypes

    from bnprobe.engine.rules import nonfinite_mismatch

    fmt = {"float16": "fp16", "bfloat16": "bf16"}.get(store, "fp32")
    dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}[fmt]
    rng = np.random.default_rng(at)
    g = rng.standard_normal(1024)
    a = g.astype(dt).astype(np.float64)
    assert nonfinite_mismatch(a, g, fmt) == ""
    for bad_a, bad_g in ((np.nan, None), (-np.inf, None), (None, 1e39), (np.inf, 1e39), (None, np.nan)):
        aa, gg = a.copy(), g.copy()
        if bad_a is not None:
            aa[at] = bad_a
        if bad_g is not None:
            gg[at] = bad_g
        held = {"float16": aa.astype(np.float16), "bfloat16": aa.astype(ml_dtypes.bfloat16),
                "float32": aa.astype(np.float32), "float64": aa, "list": aa.tolist(),
                "strided": np.repeat(aa, 2)[::2]}[store]
        with np.errstate(over="ignore"):
            rounded = [float(v) for v in gg.astype(dt).astype(np.float64)]
        want = [i for i, (x, y) in enumerate(zip(aa.tolist(), rounded))
                if math.isfinite(x) != math.isfinite(y) or (not math.isfinite(x) and x != y
                                                            and not (math.isnan(x) and math.isnan(y)))]
        got = nonfinite_mismatch(held, gg, fmt)
        if not want:
            assert got == "", (bad_a, bad_g, got)
        else:
            assert f"{len(want)} / 1024 elements, first at index {want[0]}" in got, (bad_a, bad_g, got)

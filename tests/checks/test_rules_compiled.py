"""msprobe's scaled and accumulated absolute rules on the compiled route (one pass) and on numpy's: the same
verdict, reason, score and bound, on passing and failing outputs of every judged format, with and without a
natural scale per element, with non-finite elements left out as the rule leaves them; and the figures checked
against a plain-Python evaluation of the rule's definition."""

import math

import numpy as np
import pytest

from bnprobe.engine.rules import MSPROBE_STANDARDS, absolute
from bnprobe.core.formats import get_format

pytest.importorskip("numba")

FORMATS = ("fp16", "bf16", "fp32")


def _pair(fmt, bad, rng, n=5000):
    f = get_format(fmt)
    g = rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))
    g[:7] = [0.0, -0.0, f.tiny, f.tiny / 4, 1.0, 2.0 ** -14, 3.0]  # zero, subnormal, powers of two
    a = g.astype(f.dtype).astype(np.float64)  # correctly rounded
    if bad:
        a[rng.choice(n, 9, replace=False)] *= 1.01
    return a, g


def _plain(a, g, fmt, rule, scale):
    """The rule as written: error beyond half an ulp of fmt at the golden, over max(|g|, floor)."""
    f, std = get_format(fmt), MSPROBE_STANDARDS[get_format(fmt).name]
    gmax = max(abs(v) for v in g)
    worst, at = -math.inf, 0
    for i, (x, y) in enumerate(zip(a.tolist(), g.tolist())):
        e = max(math.frexp(abs(y))[1] - 1 if y else -1023, f.emin) - f.mantissa_bits
        d = max(abs(x - y) - 0.5 * math.ldexp(1.0, e), 0.0)
        mag = (scale[i] if scale is not None else gmax) if rule == "scaled" else None
        floor = std.error_floor * (mag if mag and mag > 0 else 1.0) if mag is not None else std.error_floor
        r = d / max(abs(y), floor)
        if r > worst:
            worst, at = r, i
    return worst, at


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", ["scaled", "accumulated"])
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
def test_both_routes_give_the_same_verdict(fmt, rule, bad, with_scale, monkeypatch):
    rng = np.random.default_rng([7, FORMATS.index(fmt), bad, with_scale])
    a, g = _pair(fmt, bad, rng)
    scale = np.abs(rng.standard_normal(g.size)) * 4 if with_scale else None
    if with_scale:
        scale[:5] = [0.0, -1.0, np.nan, np.inf, 1e-30]  # the floor's edges: 1.0 in place of 0, negative and NaN
    a[100], g[100] = np.nan, np.nan  # a NaN where the golden has one: left out
    verdicts = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        verdicts[jit] = tuple(absolute(a, g, fmt, rule, scale=scale))
    assert verdicts["0"][:2] == verdicts["1"][:2]
    assert verdicts["0"][2] == verdicts["1"][2] and verdicts["0"][3] == verdicts["1"][3]
    keep = np.isfinite(a)
    worst, _ = _plain(a[keep], g[keep], fmt, rule, None if scale is None else scale[keep])
    assert verdicts["1"][2] == worst
    assert verdicts["1"][0] == (worst <= MSPROBE_STANDARDS[get_format(fmt).name].accumulated)
    if bad:
        assert not verdicts["1"][0] and "element" in verdicts["1"][1]


# ---- the doctor's per-channel rule ----------------------------------------------------------------------------

def _channel_pair(fmt, kind, rng, shape=(3, 5, 6, 7)):
    f = get_format(fmt)
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-10, 10, shape[1]))[:, None, None]
    w[0, 0, :2, :2] = [[0.0, -0.0], [f.tiny / 4, 2.0 ** -14]]  # zero, subnormal, a power of two
    w[:, 3] *= 1e-12  # a channel far smaller than the rest: its own allowance
    a = w.astype(f.dtype).astype(np.float64)
    big = np.abs(w).max(axis=(0, 2, 3))
    if kind == "bad":
        a[1, 2, 3, 4] += 0.5 * big[2]
        a[2, 4, 0, 1] -= 0.25 * big[4]
    if kind == "tie":  # two equal worst ratios in one channel: the first is reported
        w[1, 2, 3, 4] = w[0, 2, 3, 4]
        a[0, 2, 3, 4] = a[1, 2, 3, 4] = w[0, 2, 3, 4] + 0.5 * big[2]
    if kind == "tie-across":  # equal worst ratios in two equal channels, the later channel's first in memory
        w[0, 2, 3, 4] = w[1, 2, 3, 4]
        w[:, 4] = w[:, 2]
        a = w.astype(f.dtype).astype(np.float64)
        a[1, 2, 3, 4] = a[0, 4, 3, 4] = w[1, 2, 3, 4] + 0.5 * big[2]
    if kind == "nonfinite":  # judged by excess's rules: NaN with NaN, inf where the golden rounds to it
        a[0, 1, 0, 0] = w[0, 1, 0, 0] = np.nan
        w[1, 1, 1, 1], a[1, 1, 1, 1] = f.max * 1.5 if fmt != "fp64" else np.inf, np.inf
        a[2, 2, 2, 2] = np.inf
    return a, w


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("kind", ["good", "bad", "tie", "tie-across", "nonfinite"])
@pytest.mark.parametrize("extra", ["none", "natural", "bound"])
def test_the_doctors_channel_rule_is_the_same_on_both_routes(fmt, kind, extra, monkeypatch):
    from bnprobe.engine.rules import channel_rule

    rng = np.random.default_rng([11, ["fp16", "bf16", "fp32", "fp64"].index(fmt), len(kind), len(extra)])
    a, w = _channel_pair(fmt, kind, rng)
    # a natural scale up to 3x the channel's largest golden: an allowance of its own, the corruptions still beyond it
    finite = np.where(np.isfinite(w), np.abs(w), 0.0)  # (as the doctor hands natural scales: finite)
    natural = finite.max(axis=(0, 2, 3)) * rng.uniform(0.5, 3, 5) if extra == "natural" else None
    bound = (np.array([0.0, np.nan, 1e-3, np.inf, 1e-30]), "a bound") if extra == "bound" else None
    got = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        got[jit] = [channel_rule("y", a, w, natural, fmt, describe, bound) for describe in (False, True)]
    assert got["0"] == got["1"]
    ratio, why = got["1"][1]
    assert (ratio > 1) == bool(why) and (ratio > 1) == (kind != "good")
    if kind.startswith("tie") and extra == "none":  # (a natural scale or bound per channel breaks the tie)
        assert f"at index (0, {2 if kind == 'tie' else 4}, 3, 4)" in why


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("kind", ["plain", "nan", "equal", "wide"])
def test_the_kernel_against_the_bench_is_the_same_on_both_routes(fmt, kind, monkeypatch):
    """versus_bench's RMSEs, largest errors and RMS ulp: numpy's pairwise means reproduced on the compiled route, at
    sizes around numpy's blocks (8, 128) and its splits; a NaN sends the pair to numpy's route, which leaves it out."""
    from bnprobe.engine.rules import versus_bench

    rng = np.random.default_rng([13, len(fmt), len(kind)])
    for n in (1, 8, 9, 128, 129, 4097, 70001):
        g = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
        a, b = g * (1 + rng.standard_normal(n) * 1e-3), g * (1 + rng.standard_normal(n) * 1e-4)
        if kind == "nan":
            a[n // 2], g[0] = np.nan, 0.0
        if kind == "equal":
            a, b = g.copy(), g.copy()
        if kind == "wide":  # subnormal goldens: their ulp is the format's smallest spacing
            g[: n // 3] *= 1e-300
        got = {}
        for jit in ("0", "1"):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            got[jit] = versus_bench(a, b, g, fmt)
        assert got["0"] == got["1"], (n, got)


def test_the_channel_rule_s_edges_are_numpys_on_both_routes(monkeypatch):
    """A NaN allowance (a NaN natural scale) makes numpy's worst NaN, and an empty output has no worst: the
    compiled route leaves both to numpy's."""
    from bnprobe.engine.rules import channel_rule

    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 3, 2, 2))
    a = w * (1 + 1e-3 * rng.standard_normal(w.shape))
    cases = [(a, w, np.array([np.nan, 0.0, 0.0])), (np.zeros((2, 0, 2, 2)), np.zeros((2, 0, 2, 2)), None)]
    for got, want, natural in cases:
        out = {}
        for jit in ("0", "1"):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            out[jit] = [channel_rule("y", got, want, natural, "fp32", describe) for describe in (False, True)]
        assert str(out["0"]) == str(out["1"])  # (NaN == NaN as text)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("with_std", [True, False])
def test_a_rows_shares_are_the_same_on_both_routes(fmt, with_std, monkeypatch):
    """The shares a compare row reports (ULP errors over the limit, small, subnormal and beyond-range goldens) on
    both routes, against plain Python counting their definitions: values at each threshold exactly, NaN, inf,
    signed zeros, non-finite ULP errors; no standard; no element."""
    from bnprobe.engine.rules import output_shares

    f = get_format(fmt)
    std = MSPROBE_STANDARDS.get(f.name) if with_std else None
    rng = np.random.default_rng([17, len(fmt), with_std])
    with np.errstate(over="ignore"):  # (fp64's next value is inf)
        edges = [0.0, -0.0, np.nan, np.inf, -np.inf, 2.0 ** f.emin, -(2.0 ** f.emin) / 2, f.max, -f.max,
                 np.nextafter(f.max, np.inf), 1e-3, 2.0 ** -10, 2.0 ** -16]
    for n in (0, 1, 13, 5000):
        g = rng.standard_normal(n) * np.exp2(rng.integers(-140, 130, n) if fmt in ("fp32", "bf16", "fp64")
                                              else rng.integers(-26, 18, n))
        g[: min(n, len(edges))] = edges[: min(n, len(edges))]
        if std is not None and n > 20:
            g[14] = std.small_threshold
        u = np.abs(rng.standard_normal(n)) * 4
        u[: min(n, 4)] = [np.nan, np.inf, 1.0, 0.0][: min(n, 4)]
        lim = None if std is None else std.ulp
        fin = [v for v in u.tolist() if math.isfinite(v)]
        want = (sum(v > lim for v in fin) / len(fin) if fin and lim is not None else 0.0,
                *(sum(map(test, g.tolist())) / n if n else 0.0 for test in (
                    lambda v: std is not None and abs(v) <= std.small_threshold,
                    lambda v: f.name != "fp64" and 0 < abs(v) < 2.0 ** f.emin,
                    lambda v: abs(v) > f.max)))
        for jit in ("0", "1"):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            got = output_shares(u, g, fmt, std)
            assert got == pytest.approx(want, rel=1e-15, abs=0) and all(type(v) is float for v in got), (jit, n, got)
        monkeypatch.setenv("BNPROBE_JIT", "0")
        numpy_route = output_shares(u, g, fmt, std)
        monkeypatch.setenv("BNPROBE_JIT", "1")
        assert output_shares(u, g, fmt, std) == numpy_route

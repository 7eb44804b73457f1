"""msprobe's scaled and accumulated absolute rules on the compiled route (one pass) and on numpy's: the same
verdict, reason, score and bound, on passing and failing outputs of every judged format, with and without a
natural scale per element, with non-finite elements left out as the rule leaves them; and the figures checked
against a plain-Python evaluation of the rule's definition."""

import math

import numpy as np
import pytest

from bnprobe.checks.rules import MSPROBE_STANDARDS, absolute
from bnprobe.formats import get_format

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

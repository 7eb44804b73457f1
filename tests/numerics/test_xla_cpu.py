"""XLA's CPU arithmetic as bnprobe emulates it — the ``xla`` reduction order (XLA's own loop, its
TreeReductionRewriter's windows, YNNPACK's tiled sum) and XLA's Newton steps on x86's RSQRTPS estimate — each
against a replay written here from its source, without bnprobe: scalar float32 loops (YNNPACK's
``sum_float_kn`` with its clock and its Kahan step, as ynnpack/kernels/reduce/sum.h writes them), exact rationals
(the fused multiply-adds), and the figures FPRev reads off jax's own sum.  Against jax itself:
tests/adapters/test_flax_xla.py (in the jax environment); the RSQRTPS estimate against the instruction:
tests/numerics/test_rsqrt_x86.py."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from oracle import round_fraction

from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import CallShape, reduce_sum
from bnprobe.numerics.rsqrt import rsqrt

f32 = np.float32
ACC = Arith("fp32")


# ---- replays (no bnprobe) ---------------------------------------------------------------------------------------

def _kn_call(col: list[float]) -> f32:
    """YNNPACK's sum_float_kn over one column, literally: partial_sum_kn adds 4 rows from 0 into acc[0]; every 16
    rows (clock & 15 == 0) acc[0] goes into acc[1], every 256 (clock & 255 == 0) acc[1] into acc[2] by kahan_sum;
    a remainder of k % 4 rows is one more partial sum; then the flush of both levels; k <= 4 is one partial sum."""
    k = len(col)
    if k <= 4:
        s = f32(0)
        for v in col:
            s = f32(s + f32(v))
        return s
    a0 = a1 = a2 = err = f32(0)

    def kahan(a: f32, acc: f32, e: f32) -> tuple[f32, f32]:
        y = f32(a - e)
        t = f32(acc + y)
        e = f32(f32(t - acc) - y)
        return t, (e if math.isfinite(e) else f32(0))

    clock, i = 0, 0
    while k - i >= 4:
        part = f32(0)
        for v in col[i:i + 4]:
            part = f32(part + f32(v))
        a0 = f32(a0 + part)
        i += 4
        clock += 4
        if clock & 15 == 0:
            a1, a0 = f32(a1 + a0), f32(0)
            if clock & 255 == 0:
                a2, err = kahan(a1, a2, err)
                a1 = f32(0)
    if i < k:
        part = f32(0)
        for v in col[i:]:
            part = f32(part + f32(v))
        a0 = f32(a0 + part)
    a1 = f32(a1 + a0)
    a2, err = kahan(a1, a2, err)
    return a2


def _ynn_replay(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """XLA + YNNPACK's reduce of an (N, ..., C) array over all but C: one call up to 32768 values; else tiles of
    ⌊32768 / per-n⌋ n (fold 1) or of 1 n added in pairs, then one call over the tiles' sums."""
    n, c = shape[0], shape[-1]
    rows = x.reshape(n, -1, c)
    per_n = x.size // n
    out = np.empty(c, dtype=f32)
    for ch in range(c):
        if x.size <= 32768:
            out[ch] = f32(0) + _kn_call(list(rows[:, :, ch].ravel()))
            continue
        tile, pair = (32768 // per_n, 1) if per_n <= 32768 else (1, 2)
        sums = [_kn_call(list(rows[i:i + tile, :, ch].ravel())) for i in range(0, n, tile)]
        parts = []
        for i in range(0, len(sums), pair):
            s = f32(0)
            for t in sums[i:i + pair]:
                s = f32(s + t)
            parts.append(s)
        out[ch] = f32(0) + _kn_call(parts)
    return out


def _loop_replay(x: np.ndarray) -> np.ndarray:
    """XLA's loop: from +0, left to right in row-major order, with windows of 32 (kSame) while an axis is longer."""
    dims, c = x.shape[:-1], x.shape[-1]
    while max(dims) > 32:
        win = [min(d, 32) for d in dims]
        outs = [-(-d // w) for d, w in zip(dims, win)]
        low = [(o * w - d) // 2 for d, w, o in zip(dims, win, outs)]
        nxt = np.zeros((*outs, c), dtype=f32)
        for idx in np.ndindex(*outs):
            for ch in range(c):
                s = f32(0)
                for off in np.ndindex(*win):
                    pos = tuple(i * w + o - lo for i, w, o, lo in zip(idx, win, off, low))
                    if all(0 <= p < d for p, d in zip(pos, dims)):
                        s = f32(s + x[pos + (ch,)])
                nxt[idx + (ch,)] = s
        x, dims = nxt, tuple(outs)
    out = np.zeros(c, dtype=f32)
    for row in x.reshape(-1, c):
        out = (out + row).astype(f32)
    return out


def _xla_sum(x: np.ndarray) -> np.ndarray:
    """bnprobe's order=xla on an (N, ..., C) float32 array."""
    cr = np.moveaxis(x, -1, 0).reshape(x.shape[-1], -1).astype(np.float64)
    return reduce_sum(cr, ACC, order="xla", row=CallShape(x.shape[:-1], x.shape[-1])).astype(f32)


def _spread(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-14, 14, shape)
    x[..., 0] += 3e3  # a large value among small ones: every order shows
    return x.astype(f32)


# ---- the reduction order ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 1, 2048, 2), (3, 7, 23, 19), (1, 30, 9, 16), (1, 31, 17, 16),
                                   (2, 16, 16, 16), (1, 16, 257, 1), (2, 1, 1, 2050)])
def test_ynn_one_call_is_the_replay_of_sum_h(shape):
    """4096 to 32768 values: one sum_float_kn call (R = 2048 rows of 2; 483 with 2 blocks; 1300 with 5 blocks, where
    the Kahan step shows; 4112 of one channel; R = 2 rows of 2050 channels: k <= 4)."""
    x = _spread(np.random.default_rng(len(shape) + sum(shape)), shape)
    assert np.array_equal(_xla_sum(x), _ynn_replay(x, shape))


@pytest.mark.parametrize("shape", [(9, 16, 16, 16), (40, 16, 16, 16), (3, 31, 31, 16), (2, 17, 29, 64),
                                   (5, 20, 20, 100)])
def test_ynn_tiles_are_the_replay(shape):
    """More than 32768 values: tiles of 8, 8 (5 tile sums: the final call's chain of 4 and its remainder), 2 and 1 n;
    pairs of single n (40000 values per n)."""
    x = _spread(np.random.default_rng(sum(shape)), shape)
    assert np.array_equal(_xla_sum(x), _ynn_replay(x, shape))


def test_ynn_kahan_step_is_not_a_plain_sum():
    """The level-2 Kahan step changes sums of three or more blocks of 256 rows: a plain sum of the blocks differs
    (the emulation does not pass for want of a case that shows it)."""
    rng = np.random.default_rng(3)
    x = _spread(rng, (1, 1, 1300, 4))
    got = _xla_sum(x)
    blocks = []
    for b in range(0, 1300, 256):
        blocks.append(np.array([_kn_call(list(x[0, 0, b:b + 256, ch])) for ch in range(4)], dtype=f32))
    plain = np.zeros(4, dtype=f32)
    for b in blocks:
        plain = (plain + b).astype(f32)
    assert not np.array_equal(got, plain)


def test_ynn_tree_is_the_one_fprev_reads_off_jax():
    """FPRev (Xie et al., ATC 2025) on jax 0.10.2's own sum of (3, 7, 23, 19), read on this machine: with +M and −M at
    rows i and j among ones, the sum counts the ones outside the smallest subtree holding both; the subtrees it
    found: chains of 4 rows, groups of 16 (LCA 8, 12, 16 inside, 32 between groups 0 and 1), the first 256 rows
    one block and the rest another (LCA of rows 255 and 256: all 483)."""
    r, c = 483, 19
    big = f32(2.0**40)
    found = {}
    pairs = [(0, 1), (2, 3), (3, 4), (7, 8), (11, 12), (15, 16), (31, 32), (47, 48), (255, 256), (256, 257), (479, 480)]
    x = np.ones((3, 7, 23, c), dtype=f32)
    flat = x.reshape(r, c)
    for ch, (i, j) in enumerate(pairs):
        flat[i, ch], flat[j, ch] = big, -big
    got = _xla_sum(x)
    for ch, pair in enumerate(pairs):
        found[pair] = r - int(got[ch])
    assert found == {(0, 1): 2, (2, 3): 4, (3, 4): 8, (7, 8): 12, (11, 12): 16, (15, 16): 32, (31, 32): 48,
                     (47, 48): 64, (255, 256): 483, (256, 257): 2, (479, 480): 227}


@pytest.mark.parametrize("shape", [(3, 7, 11, 6), (2, 8, 5, 6), (6, 9, 13, 5), (2, 1, 3, 3), (1, 1, 100, 3),
                                   (3, 70, 5, 3), (200, 5), (40, 3, 3, 3), (1, 1, 4000, 1)])
def test_xla_loop_and_windows_are_the_replay(shape):
    """Fewer than 4096 values: XLA's loop, after TreeReductionRewriter's windows where an axis is longer than 32 (4
    windows of 18, 32, 32, 18; windows over N and H; a rank-2 input; two rounds for 4000 values)."""
    x = _spread(np.random.default_rng(sum(shape)), shape)
    assert np.array_equal(_xla_sum(x), _loop_replay(x))


def test_xla_sums_start_from_positive_zero():
    """XLA and YNNPACK start every sum at +0: a column of -0 sums to +0 (a sum that started from its first value
    would keep -0)."""
    for shape in [(2, 3, 4, 2), (4, 16, 16, 4)]:
        got = _xla_sum(np.full(shape, -0.0, dtype=f32))
        assert np.all(got == 0) and not np.signbit(got).any()


def test_xla_order_needs_the_call_shape():
    from bnprobe.core.errors import BNProbeError

    with pytest.raises(BNProbeError, match="CallShape"):
        reduce_sum(np.ones((2, 8)), ACC, order="xla")
    with pytest.raises(BNProbeError, match="does not fit"):
        reduce_sum(np.ones((2, 8)), ACC, order="xla", row=CallShape((3, 3), 2))


# ---- RSQRTSS and XLA's Newton steps --------------------------------------------------------------------------------

def _rsqrtps_entry(a: float) -> Fraction:
    """RSQRTPS's estimate of a in [1, 4) by integers (tests/numerics/test_rsqrt_x86.py checks the estimate itself):
    the interval (2^-10 wide on [1, 2), 2^-9 on [2, 4)) holding a, and the 13-bit q nearest to 2^13 / sqrt(its
    midpoint): q / 2^13, 12 fraction bits below 1."""
    fa = Fraction(a)
    width = Fraction(1, 1024) if fa < 2 else Fraction(1, 512)
    mid = (fa // width) * width + width / 2
    shift = 12 if mid == 1 else 13  # 1/sqrt(mid) < 1 except at mid = 1, which never is a midpoint
    # q = round(2^shift / sqrt(mid)): q^2 * mid compared with 2^(2 shift) at the half-integers
    target = Fraction(4**shift) / mid
    q = math.isqrt(int(target))
    while Fraction(q + 1) ** 2 <= target:
        q += 1
    # q <= 2^shift/sqrt(mid) < q + 1: round up when (q + 1/2)^2 < target (never equal: mid is not a square of that)
    if Fraction(2 * q + 1, 2) ** 2 < target:
        q += 1
    return Fraction(q, 2**shift)


def _fma32(a: float, b: float, c: float) -> float:
    return round_fraction(Fraction(a) * Fraction(b) + Fraction(c), "fp32")


def test_xla_newton_steps_are_the_ir_s():
    """XLA's CPU rsqrt (its LLVM IR): y0 = rsqrtps(v); twice a = fl(v·y), h = fl(−0.5·y), y = fma(h, fma(a, y, −1), y)
    — replayed with exact rational fused multiply-adds; the result is within an ulp of 1/sqrt(v)."""
    rng = np.random.default_rng(0)
    v = np.concatenate([2.0 ** rng.uniform(-30, 30, 300), [1e-5, 1.0, 2.0, 3.999]]).astype(f32).astype(np.float64)
    got = rsqrt(v, "fp32", method="rsqrtps", newton=2, form="xla")
    for vi, gi in zip(v, got):
        y = float(_rsqrtps_entry(float(vi) * 4.0 ** -math.floor(math.log(vi, 4))) *
                  Fraction(2) ** -math.floor(math.log(vi, 4)))
        for _ in range(2):
            a, h = float(f32(vi * y)), float(f32(-0.5 * y))
            y = _fma32(h, _fma32(a, y, -1.0), y)
        assert gi == y
        assert abs(gi * math.sqrt(vi) - 1) < 2.0**-22

"""The at::vec-style order and the fused dot product, against scalar loops written here (every addition rounded by
numpy's float32 or float16 scalar arithmetic, every fused multiply-add rounded once from exact rationals)."""

from fractions import Fraction

import numpy as np
import pytest

from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import reduce_sum, vec_dot

DT = {"fp32": np.float32, "fp16": np.float16}


def loop_vec(x, dt, lanes, unroll, row):
    """Per row: full blocks of lanes*unroll values into the lanes (value p to lane p mod lanes), the rest into a scalar
    tail, both carried across rows; then tail + (((l0 + l1) + l2) + ...)."""
    c, r = x.shape
    out = []
    for ch in range(c):
        lane = [dt(0)] * lanes
        tail = dt(0)
        for start in range(0, r, row):
            seg = x[ch, start:start + row]
            full = (row // (lanes * unroll)) * lanes * unroll
            for p in range(full):
                lane[p % lanes] = dt(lane[p % lanes] + dt(seg[p]))
            for p in range(full, row):
                tail = dt(tail + dt(seg[p]))
        h = lane[0]
        for v in lane[1:]:
            h = dt(h + v)
        out.append(float(dt(tail + h)))
    return np.array(out)


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("lanes,unroll,rows,row", [(8, 2, 3, 37), (8, 1, 2, 16), (4, 2, 5, 7), (16, 1, 1, 40),
                                                   (8, 2, 4, 48)])
def test_vec_order_matches_the_scalar_loop(fmt, lanes, unroll, rows, row):
    rng = np.random.default_rng([lanes, unroll, rows, row])
    x = (rng.standard_normal((3, rows * row)) * 2.0 ** rng.integers(-6, 6, (3, rows * row))).astype(DT[fmt])
    x = x.astype(np.float64)
    got = reduce_sum(x, Arith(fmt), order="vec", lanes=lanes, unroll=unroll, row=row)
    np.testing.assert_array_equal(got, loop_vec(x, DT[fmt], lanes, unroll, row))


def fma32(a, b, c):
    """fl32(a*b + c) from the exact rational value, ties to even."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    cands = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.uint32)) & 1))


@pytest.mark.parametrize("fused_tail", [True, False])
def test_vec_dot_matches_fused_scalar_loops(fused_tail):
    rng = np.random.default_rng(7)
    lanes, unroll, rows, row = 8, 2, 3, 21
    a = rng.standard_normal((2, rows * row)).astype(np.float32)
    b = (rng.standard_normal((2, rows * row)) * 100).astype(np.float32)
    got = vec_dot(a.astype(np.float64), b.astype(np.float64), Arith("fp32"), lanes=lanes, unroll=unroll, row=row,
                  fused_tail=fused_tail)
    want = []
    for ch in range(2):
        lane = [np.float32(0)] * lanes
        tail = np.float32(0)
        for s in range(0, rows * row, row):
            full = (row // (lanes * unroll)) * lanes * unroll
            for p in range(row):
                i = s + p
                if p < full:
                    lane[p % lanes] = fma32(a[ch, i], b[ch, i], lane[p % lanes])
                elif fused_tail:
                    tail = fma32(a[ch, i], b[ch, i], tail)
                else:
                    tail = np.float32(tail + np.float32(a[ch, i] * b[ch, i]))
        h = lane[0]
        for v in lane[1:]:
            h = np.float32(h + v)
        want.append(float(np.float32(tail + h)))
    np.testing.assert_array_equal(got, want)

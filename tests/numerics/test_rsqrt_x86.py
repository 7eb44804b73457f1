"""Intel's RSQRTPS estimate and Eigen 3.3's fast packet sqrt (Paddle's CPU BatchNorm), against the instruction itself
where this machine is an Intel x86-64 (run through a few bytes of machine code), against a bit-level replay written
here, and against values read off the instruction."""

import ctypes
import mmap
import platform
import struct

import numpy as np
import pytest

from bnprobe.numerics.rsqrt import rsqrt_estimate, sqrt_eigen_fast

f32 = np.float32


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def replay_rsqrtps(v: float) -> float:
    """From the bits: the exponent's parity and the first 10 fraction bits pick an interval; its midpoint's 1/sqrt is
    kept to 12 fraction bits (nearest), scaled by the exponent's half."""
    b = _bits(v)
    e, frac = (b >> 23) & 0xFF, b & 0x7FFFFF
    if e == 0:
        return float("inf")  # (subnormals are taken as zero)
    odd = (e - 127) & 1
    j = frac >> 13
    mid = (1 + (2 * j + 1) / 2048) * (2 if odd else 1)
    r = 1 / np.sqrt(mid)  # in (0.5, 1]
    q = round(r * 2**13) / 2**13  # 12 fraction bits after the leading one at 2^-1
    return q * 2.0 ** (-((e - 127 - odd) // 2))


# read off vrsqrtss on an Intel Xeon (2026-12): the first and last interval of each binade parity
MEASURED = {1.0: 0x3F7FF000, 1.0 + 2**-10: 0x3F7FD000, 2.0 - 2**-10: 0x3F350800, 2.0: 0x3F34F800,
            2.0 + 2**-9: 0x3F34E000, 4.0 - 2**-9: 0x3F000800}


@pytest.mark.parametrize("v", sorted(MEASURED))
def test_rsqrtps_gives_the_values_read_off_the_instruction(v: float) -> None:
    assert _bits(float(rsqrt_estimate(np.array([v]), "fp32", "rsqrtps")[0])) == MEASURED[v]
    assert _bits(replay_rsqrtps(v)) == MEASURED[v]


def test_rsqrtps_matches_the_bit_level_replay_on_every_interval() -> None:
    rng = np.random.default_rng(0)
    j = np.arange(2048)
    v = ((1 + (j % 1024 + rng.random(2048)) / 1024) * 2.0 ** (j // 1024)).astype(f32)
    v = np.concatenate([v, (2.0 ** rng.uniform(-120, 120, 500)).astype(f32)])
    got = rsqrt_estimate(v.astype(np.float64), "fp32", "rsqrtps")
    assert got.tolist() == [replay_rsqrtps(float(a)) for a in v]


def _intel_x86_64() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def hw_rsqrt():  # noqa: ANN201
    """vrsqrtss itself: `rsqrtss xmm0, xmm0; ret` in an executable page, called with ctypes."""
    if not _intel_x86_64():
        pytest.skip("the instruction is checked on an Intel x86-64 Linux machine (AMD's estimates differ)")
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xF3, 0x0F, 0x52, 0xC0, 0xC3]))
    fn = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_float)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return lambda v, _keep=page: float(fn(float(v)))  # (the page stays mapped while the function lives)


def test_rsqrtps_matches_the_instruction(hw_rsqrt) -> None:  # noqa: ANN001
    rng = np.random.default_rng(1)
    j = np.arange(2048)
    v = ((1 + (j % 1024 + rng.random(2048)) / 1024) * 2.0 ** (j // 1024)).astype(f32)
    v = np.concatenate([v, (2.0 ** rng.uniform(-125, 127, 3000) * rng.random(3000)).astype(f32),
                        np.array([1e-40, 2.0**-126, 1.0, 4.0], f32)])
    got = rsqrt_estimate(v.astype(np.float64), "fp32", "rsqrtps")
    assert got.tolist() == [hw_rsqrt(a) for a in v]


def replay_eigen_fast_sqrt(v: float, rsqrt) -> float:  # noqa: ANN001
    """Eigen 3.3 psqrt<Packet8f> with EIGEN_FAST_MATH, one lane: half = x·0.5; y = rsqrt(x);
    y = y·(1.5 − half·(y·y)); x·y; 0 for 0 <= x < FLT_MIN."""
    x = f32(v)
    if 0 <= x < f32(2.0**-126):
        return 0.0
    half = f32(x * f32(0.5))
    y = f32(rsqrt(float(x)))
    y = f32(y * f32(f32(1.5) - f32(half * f32(y * y))))
    return float(f32(x * y))


def test_eigen_fast_sqrt_matches_its_replay_and_differs_from_the_exact_sqrt() -> None:
    rng = np.random.default_rng(2)
    v = (2.0 ** rng.uniform(-60, 60, 4000)).astype(f32).astype(np.float64)
    got = sqrt_eigen_fast(v, "fp32")
    assert got.tolist() == [replay_eigen_fast_sqrt(a, replay_rsqrtps) for a in v]
    exact = np.sqrt(v).astype(f32)
    off = np.abs(got - exact) / np.spacing(exact)
    assert 0 < np.count_nonzero(off) and off.max() <= 4  # (a fast path: off by a few ulps, not everywhere)
    assert sqrt_eigen_fast(np.array([0.0, 1e-40, 4.0]), "fp32").tolist()[:2] == [0.0, 0.0]


def test_eigen_fast_sqrt_with_the_instruction(hw_rsqrt) -> None:  # noqa: ANN001
    rng = np.random.default_rng(3)
    v = (2.0 ** rng.uniform(-60, 60, 2000)).astype(f32).astype(np.float64)
    assert sqrt_eigen_fast(v, "fp32").tolist() == [replay_eigen_fast_sqrt(a, hw_rsqrt) for a in v]

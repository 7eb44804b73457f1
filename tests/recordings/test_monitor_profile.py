"""The monitor's one-pass profile (min, max and the counts of NaN, ±inf, values at the format's maximum, zeros and
subnormals per channel, read from the bits) against numpy on the values widened to float64, in every format it
reads, on every special value and on random bit patterns (every NaN payload, subnormals, both zeros); and a
monitored training run giving the same table on the one-pass route as on torch's reductions."""

import numpy as np
import pytest

from bnprobe.recordings.monitor_profile import FIELDS, MIN_ELEMENTS, one_pass, profile_bits, profile_tensor

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
WIDTH = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def oracle(t):
    """numpy on the float64 values, channels on dim 1."""
    v = np.moveaxis(t.double().numpy(), 1, 0).reshape(t.shape[1], -1)
    fi = torch.finfo(t.dtype)
    a = np.abs(v)
    with np.errstate(invalid="ignore"):
        nan = np.isnan(v).any(axis=1)
        lo = np.where(nan, np.nan, np.nanmin(np.where(np.isnan(v), np.inf, v), axis=1))
        hi = np.where(nan, np.nan, np.nanmax(np.where(np.isnan(v), -np.inf, v), axis=1))
    return {"min": lo, "max": hi, "nan": np.isnan(v).sum(1), "inf": np.isinf(v).sum(1),
            "at_max": (a == fi.max).sum(1), "zero": (v == 0).sum(1), "subnormal": ((a > 0) & (a < fi.tiny)).sum(1)}


def specials(dtype):
    fi = torch.finfo(dtype)
    sub_min = fi.tiny * fi.eps  # the smallest subnormal
    vals = [0.0, -0.0, fi.max, -fi.max, fi.tiny, -fi.tiny, sub_min, -sub_min, fi.tiny - sub_min,
            -(fi.tiny - sub_min), float("inf"), float("-inf"), float("nan"), 1.0, -1.0, fi.eps, 3.0]
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


def assert_profile(got, want):
    for k in FIELDS:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_channel_by_channel(dtype):
    """Each channel holds one special value among ordinary ones (and one channel all of them): min, max and
    every count as numpy finds them, NaN propagating to min and max as torch's amin/amax."""
    s = specials(dtype)
    t = torch.linspace(-2, 2, 3 * (len(s) + 1) * 5).to(dtype).reshape(3, len(s) + 1, 5).contiguous()
    for ch, v in enumerate(s):
        t[1, ch, 2] = v
    t[:, -1, :] = s[:15].reshape(3, 5)
    got = profile_tensor(t)
    assert_profile(got, oracle(t))
    # torch's own reductions agree on min and max
    np.testing.assert_array_equal(got["min"], torch.amin(t, dim=(0, 2)).double().numpy())
    np.testing.assert_array_equal(got["max"], torch.amax(t, dim=(0, 2)).double().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_bit_patterns(dtype):
    """Bit patterns drawn uniformly: every NaN payload and sign, infinities, subnormals and both zeros show up
    (16-bit formats) or are planted (float32/float64), on 2-d, 4-d and 5-d shapes."""
    gen = torch.Generator().manual_seed(7)
    w = WIDTH[dtype]
    info = torch.iinfo(w)
    for shape in [(64, 9), (5, 7, 11, 13), (2, 3, 4, 5, 6)]:
        bits = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(w)
        t = bits.view(dtype).clone()
        flat = t.view(-1)
        flat[::97] = 0.0
        flat[5::131] = torch.finfo(dtype).tiny * torch.finfo(dtype).eps * 3  # subnormal
        flat[7::151] = float("inf")
        flat[9::173] = -torch.finfo(dtype).max
        assert_profile(profile_tensor(t), oracle(t))


def _spread(dtype):
    """Each special value in a channel of its own."""
    t = torch.randn(4, 6, 8, 8).to(dtype)
    t[0, 1, 2, 3], t[1, 2, 0, 0], t[2, 3, 1, 1] = float("nan"), float("-inf"), 0.0
    t[3, 4, 2, 2] = torch.finfo(dtype).max
    t[0, 5, 0, 1] = torch.finfo(dtype).tiny / 2
    return t


def _together(dtype):
    """NaN, the maximum, zero and a subnormal all in channel 1, the other channels plain (a NaN minimum and
    maximum must not hide the other counts)."""
    t = torch.randn(4, 3, 8, 8).to(dtype) + 3
    t[0, 1, 0, 0], t[1, 1, 0, 0], t[2, 1, 0, 0] = float("nan"), torch.finfo(dtype).max, 0.0
    t[3, 1, 0, 0] = torch.finfo(dtype).tiny / 2
    return t


@pytest.mark.parametrize("make", [_spread, _together])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_one_pass_route_equals_torchs_reductions(dtype, make):
    """The monitor's two routes on one tensor: torch's amin/amax/|t| passes and the compiled pass give the same
    numbers, NaN channels and counts included, and numpy's."""
    from bnprobe.recordings.monitor import _profile

    t = make(dtype)
    assert one_pass(t, "on") and not one_pass(t, "off")
    a, b = _profile(t, "x", "off"), _profile(t, "x", "on")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert_profile({k: a[f"x_{k}"] for k in FIELDS}, oracle(t))


FRESH = """
import torch
from bnprobe.recordings.monitor_profile import one_pass, profile_tensor
small = torch.zeros(2, 4, 8, 8)
before = one_pass(small, "auto")
profile_tensor(torch.zeros(2, 4, 64, 64))
print(int(before), int(one_pass(small, "auto")), int(one_pass(torch.zeros(64, 4), "auto")))
"""


def test_small_tensors_take_the_one_pass_once_it_is_loaded():
    """In a fresh process a small tensor takes torch's route (numba is not loaded for it); once a large tensor has
    loaded the pass, small ones take it too, (N, C) ones still not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("BNPROBE_JIT", None)
    r = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "1", "0"]


def test_which_tensors_take_the_one_pass():
    big = torch.zeros(2, 4, 64, 64)
    assert big.numel() >= MIN_ELEMENTS and one_pass(big, "auto")
    assert one_pass(torch.zeros(2, 4, 8, 8), "on")
    flat = torch.zeros(4096, 256)  # (N, C): a channel's values far apart, one per row
    assert flat.numel() >= MIN_ELEMENTS and not one_pass(flat, "auto") and one_pass(flat, "on")
    assert not one_pass(big.to(memory_format=torch.channels_last), "on")  # not contiguous
    assert not one_pass(big.to(torch.int32), "on")
    assert not one_pass(torch._neg_view(big), "on")  # a negated view: its bits are not its values
    assert not one_pass(big, "off")


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_child_forked_after_the_kernel_ran_takes_the_one_pass_too():
    """The kernel runs on the caller's thread (no OpenMP pool, which GNU OpenMP aborts in a forked child that starts
    it again): a child forked after it ran takes the one pass, and gets numpy's numbers."""
    import os

    t = _spread(torch.float32)
    want = oracle(t)
    profile_tensor(t)  # the kernel ran in this process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            from bnprobe.recordings.monitor import _profile

            got = _profile(t, "x", "on")
            same = all(np.array_equal(got[f"x_{k}"], want[k], equal_nan=True) for k in FIELDS)
            os.write(write, b"%d%d" % (one_pass(t, "on"), same))
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 8)
    os.waitpid(pid, 0)
    assert answer == b"11"  # the one pass, numpy's numbers


def test_bits_of_the_wrong_width_are_refused():
    with pytest.raises(ValueError, match="int16 bits of float16"):
        profile_bits(np.zeros((1, 2, 3), dtype=np.int32), "float16")
    with pytest.raises(ValueError, match="not 2-d int32"):
        profile_bits(np.zeros((2, 3), dtype=np.int32), "float32")


@pytest.mark.parametrize("dtype,bad", [(torch.float32, "nan"), (torch.float16, "scale")])
def test_a_monitored_run_is_the_same_on_both_routes(tmp_path, monkeypatch, dtype, bad):
    """The same training run (a NaN pixel in fp32; an fp16 overflow from a scaled batch) monitored with every
    tensor on the compiled pass and with none: the same Parquet and the same anomalies."""
    from tests.recordings.test_monitor import table, train

    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("BNPROBE_JIT", mode)
        mon, _ = train(tmp_path / mode, dtype=dtype, bad_step=3, bad=bad, steps=6)
        runs[mode] = (table(tmp_path / mode).sort_values(["step", "layer", "channel"]).reset_index(drop=True),
                      [(a["first_step"], a["last_step"], a["layer"], a["reason"]) for a in mon.anomalies])
    (t1, a1), (t0, a0) = runs["1"], runs["0"]
    assert a1 == a0 and any(step == 3 for step, _, _, _ in a1)
    assert t1[{"nan": "x_nan", "scale": "x_inf"}[bad]].sum() > 0
    for col in t0.columns:
        if t0[col].dtype.kind == "f":
            np.testing.assert_array_equal(t1[col].to_numpy(), t0[col].to_numpy(), err_msg=col)
        else:
            assert (t1[col] == t0[col]).all(), col

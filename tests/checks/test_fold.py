import re

import numpy as np
import pytest

from bnprobe.checks.fold import (
    check_fold,
    fold_params,
    layer_forward,
    load_layer,
    make_layer,
    torch_fusion_check,
)
from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.kernels import forward_infer
from bnprobe.numerics.rounding import round_to


@pytest.mark.parametrize("kind,groups", [("conv2d", 1), ("conv2d", 4), ("conv2d", 16), ("linear", 1)])
def test_fp64_folding_matches_unfused_to_1e_12(kind, groups):
    lay = make_layer(kind, groups=groups)
    r = check_fold(lay, "fp64")
    row = r.forms.set_index("form").loc["FP64 folded vs FP64 unfused", "max_abs_err"]
    scale = np.abs(forward_infer(layer_forward(kind, lay.x, lay.weight, lay.bias, groups=groups, pad=lay.padding,
                                               accumulate="fp64", out="fp64"),
                                 lay.gamma, lay.beta, lay.running_mean, lay.running_var, policy="fp64").y).max()
    assert row <= 1e-12 * scale
    assert r.passed


def test_conv_emulation_against_an_independent_direct_convolution():
    lay = make_layer("conv2d", groups=2)
    x, w, b = lay.x, lay.weight, lay.bias
    n, cin, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    direct = np.zeros((n, w.shape[0], h, wd))
    per = w.shape[0] // 2
    for o in range(w.shape[0]):  # plain loops over output channels and taps
        gi = o // per
        for i in range(w.shape[1]):
            for dy in range(3):
                for dx in range(3):
                    direct[:, o] += w[o, i, dy, dx] * xp[:, gi * w.shape[1] + i, dy:dy + h, dx:dx + wd]
        direct[:, o] += b[o]
    np.testing.assert_allclose(layer_forward("conv2d", x, w, b, groups=2, pad=1, accumulate="fp64", out="fp64"),
                               direct, rtol=1e-12, atol=1e-12)
    z32 = layer_forward("conv2d", round_to(x, "fp16"), round_to(w, "fp16"), round_to(b, "fp16"), groups=2, pad=1,
                        accumulate="fp32", out="fp32")
    assert np.abs(z32 - direct).max() < 1e-2  # fp16 weights/inputs, fp32 sums


def test_tiny_variance_channel_is_predicted_to_overflow_in_fp16_and_does():
    lay = make_layer("conv2d")
    lay.running_var[5], lay.eps = 1e-12, 1e-12  # A = gamma / sqrt(2e-12) ~ 5e5: W' = W * A beyond 65504
    r = check_fold(lay, "fp16")
    ch = r.channels.set_index("channel")
    assert ch.loc[5, "w_headroom_binades"] < 0 and ch.loc[5, "w_overflows"]  # predicted from W and A
    assert ch.loc[5, "verdict"] == "FAIL" and "non-finite" in ch.loc[5, "why"]  # and it does overflow
    assert not r.passed and (ch.drop(index=5).w_headroom_binades > 0).all()
    assert r.eps_rule["replaced"] and r.eps_rule["eps_after_rule"] == 1e-5
    fp32 = check_fold(lay, "fp32").channels.set_index("channel")
    assert not fp32.loc[5, "w_overflows"]  # fp32 has the range


def test_wrong_statistics_change_the_output():
    r = check_fold(make_layer("linear"), "fp32")
    ws = r.wrong_stats.set_index("folded with")["max_abs_change"]
    assert (ws > 1e-3).all()  # each of the classic mistakes is visible


def test_formats_pass_on_realistic_layers():
    for kind in ("conv2d", "linear"):
        for seed in range(3):
            for dtype in ("fp16", "bf16", "fp32"):
                assert check_fold(make_layer(kind, seed=seed), dtype).passed, (kind, seed, dtype)


def test_bf16_folding_can_double_the_error():
    """In bf16 the extra rounding of W' = W*A (2^-9 relative) can push a channel past msprobe's 2x RMSE
    benchmark limit: a real cost of folding in bf16, reported as such."""
    r = check_fold(make_layer("linear", seed=3), "bf16")
    ch = r.channels.set_index("channel")
    assert ch.loc[15, "verdict"] == "FAIL" and "RMSE x2.2" in ch.loc[15, "why"]
    assert (ch.verdict == "FAIL").sum() == 1 and check_fold(make_layer("linear", seed=3), "fp16").passed


def test_fold_formula_by_hand():
    a, b, w2, b2 = fold_params(np.array([2.0]), np.array([1.0]), np.array([3.0]), np.array([4.0 - 1e-5]), 1e-5,
                               np.array([[0.5, -1.0]]), np.array([0.25]))
    assert a[0] == pytest.approx(1.0) and b[0] == pytest.approx(1.0 - 3.0)
    np.testing.assert_allclose(w2, [[0.5, -1.0]])
    assert b2[0] == pytest.approx(0.25 * 1.0 + (1.0 - 3.0))


def test_torch_fusion_agrees_in_fp32():
    pytest.importorskip("torch")
    for kind in ("conv2d", "linear"):
        t = torch_fusion_check(make_layer(kind), "fp32")
        assert t["max_rel_weight_diff"] < 1e-6 and t["max_rel_bias_diff"] < 1e-5


def test_layer_from_npz_and_its_errors(tmp_path):
    lay = make_layer("linear")
    p = tmp_path / "l.npz"
    np.savez(p, weight=lay.weight, gamma=lay.gamma, beta=lay.beta, running_mean=lay.running_mean,
             running_var=lay.running_var, bias=lay.bias, x=lay.x)
    got = load_layer(p)
    assert got.kind == "linear" and check_fold(got, "fp16").passed
    bad = tmp_path / "bad.npz"
    np.savez(bad, weight=lay.weight, gamma=lay.gamma[:3], beta=lay.beta, running_mean=lay.running_mean,
             running_var=lay.running_var)
    with pytest.raises(BNProbeError, match=r"gamma has shape \(3,\) but the weight has 32 output channels"):
        load_layer(bad)
    missing = tmp_path / "m.npz"
    np.savez(missing, weight=lay.weight)
    with pytest.raises(BNProbeError, match="missing array"):
        load_layer(missing)


def test_cli(tmp_path, capsys):
    assert main(["fold", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "all pass" in out and "eps rule" in out
    assert main(["fold", "--eps", "1e-12", "--dtype", "bf16", "--layer", "linear"]) in (0, 1)
    capsys.readouterr()
    lay = make_layer("conv2d")
    p = tmp_path / "w.npz"
    lay.running_var[2] = 1e-12
    np.savez(p, weight=lay.weight, gamma=lay.gamma, beta=lay.beta, running_mean=lay.running_mean,
             running_var=lay.running_var, eps=np.array(1e-12), x=lay.x)
    assert main(["fold", "--weights", str(p), "--out", str(tmp_path / "o")]) == 1
    assert len(list((tmp_path / "o").iterdir())) == 3
    capsys.readouterr()
    assert main(["fold", "--layer", "mlp"]) == 2
    assert "unknown layer" in capsys.readouterr().err


def _npz(tmp_path, lay, **change):
    arrays = dict(weight=lay.weight, gamma=lay.gamma, beta=lay.beta, running_mean=lay.running_mean,
                  running_var=lay.running_var, bias=lay.bias, x=lay.x)
    arrays.update(change)
    p = tmp_path / "w.npz"
    np.savez(p, **{k: v for k, v in arrays.items() if v is not None})
    return p


CONV = make_layer("conv2d")  # weight (32, 16, 3, 3), x (2, 16, 12, 12)
LINEAR = make_layer("linear")  # weight (32, 64), x (16, 64)


@pytest.mark.parametrize("lay,change,match", [
    (CONV, dict(x=np.ones((2, 20, 12, 12))),
     r"x has shape \(2, 20, 12, 12\); the conv2d weight \(32, 16, 3, 3\) takes a non-empty \(N, 16, H, W\)"),
    (CONV, dict(x=np.ones((2, 8, 12, 12))), r"x has shape \(2, 8, 12, 12\)"),
    (CONV, dict(x=np.ones((2, 16, 12))), r"x has shape \(2, 16, 12\)"),
    (CONV, dict(x=np.ones((0, 16, 12, 12))), r"x has shape \(0, 16, 12, 12\)"),
    (LINEAR, dict(x=np.ones((16, 70))), r"x has shape \(16, 70\); the linear weight \(32, 64\) takes .* \(N, 64\)"),
    (CONV, dict(weight=CONV.weight + 1j), "weight holds complex128 values, not real numbers"),
    (CONV, dict(gamma=CONV.gamma.astype(np.complex64)), "gamma holds complex64 values"),
    (CONV, dict(x=CONV.x.astype(np.complex64)), "x holds complex64 values"),
    (CONV, dict(weight=CONV.weight.astype(str)), "weight holds <U32 values"),
    (CONV, dict(running_var=CONV.running_var > 0), "running_var holds bool values"),
    (CONV, dict(weight=np.full(CONV.weight.shape, 2**60 + 1)), "integers too large to be exact in float64"),
    (CONV, dict(groups=0), "groups is 0, not an integer >= 1"),
    (CONV, dict(groups=-2), "groups is -2, not an integer >= 1"),
    (CONV, dict(groups=1.5), "groups is 1.5, not an integer"),
    (CONV, dict(groups=np.array([1, 2])), r"groups has shape \(2,\), not a single value"),
    (CONV, dict(groups=3, weight=np.ones((32, 5, 3, 3)), x=np.ones((2, 15, 12, 12))),
     "groups is 3: it must be an integer >= 1 dividing the 32 output channels"),
    (LINEAR, dict(groups=2, weight=np.ones((32, 32))), "a linear layer has none"),
    (CONV, dict(padding=-1), "padding is -1: it must be an integer from 0 to 2 for a 3x3 kernel"),
    (CONV, dict(padding=3), "padding is 3: it must be an integer from 0 to 2"),
    (CONV, dict(padding=10**6), "padding is 1000000"),
    (CONV, dict(padding=1.7), "padding is 1.7, not an integer"),
    (LINEAR, dict(padding=1), "padding is 1: a linear layer has none"),
    (CONV, dict(kind="conv3d"), "kind is 'conv3d'; valid: conv2d, linear"),
    (CONV, dict(kind=np.array(["conv2d", "linear"])), r"kind has shape \(2,\)"),
    (CONV, dict(weight=np.ones((32, 16, 15, 15))), "the 15x15 kernel is larger than x's 12x12 plane padded by 1"),
    (CONV, dict(eps=np.array([1e-5, 1e-5])), r"eps has shape \(2,\), not a single value"),
    (CONV, dict(eps="abc"), "eps is 'abc', not a number"),
])
def test_weights_that_do_not_fit_are_one_line_errors(tmp_path, lay, change, match):
    """Nothing truncated, cast away or left to numpy's broadcasting: each is refused, naming the shapes."""
    with pytest.raises(BNProbeError) as info:
        check_fold(load_layer(_npz(tmp_path, lay, **change)), "fp16")
    msg = str(info.value)
    assert type(info.value) is BNProbeError and "\n" not in msg
    assert re.search(match, msg)


def test_the_edges_of_groups_and_padding_are_accepted(tmp_path):
    for change in (dict(padding=0), dict(padding=2), dict(groups=2, weight=CONV.weight[:, :8])):
        assert len(check_fold(load_layer(_npz(tmp_path, CONV, **change)), "fp16").channels) == 32
    lin = load_layer(_npz(tmp_path, LINEAR, weight=(LINEAR.weight * 8).astype(np.int64)))
    assert check_fold(lin, "fp16").channels.shape[0] == 32


def test_negative_or_nan_statistics_are_reported_not_refused(tmp_path):
    rv = CONV.running_var.copy()
    rv[[1, 4]] = -1.0
    rep = check_fold(load_layer(_npz(tmp_path, CONV, running_var=rv)), "fp16")
    assert any("running_var is negative at channel(s) [1, 4]" in n for n in rep.notes)
    assert set(rep.channels.query("verdict == 'FAIL'").channel) >= {1, 4}
    x = CONV.x.copy()
    x[0, 0, 0, 0] = np.nan
    rep = check_fold(load_layer(_npz(tmp_path, CONV, x=x)), "fp16")
    assert any(n.startswith("NaN or inf in x") for n in rep.notes)


def test_cli_refuses_truncating_weights_in_one_line(tmp_path, capsys):
    p = _npz(tmp_path, CONV, x=np.ones((2, 20, 12, 12)))
    assert main(["fold", "--weights", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnprobe: error: ") and err.count("\n") == 1 and "x has shape (2, 20, 12, 12)" in err
    assert not (tmp_path / "o").exists()


# ---- members that are no .npy array; memory ---------------------------------------------------------------------

class Evil:
    """Unpickling it would leave a marker file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _with_member(tmp_path, name, data):
    import zipfile

    p = _npz(tmp_path, CONV)
    with zipfile.ZipFile(p, "a") as z:
        z.writestr(name, data)
    return p


@pytest.mark.parametrize("name", ["beta2.npy", "notes.txt"])
def test_a_member_that_is_no_npy_array_is_refused_and_never_unpickled(tmp_path, name):
    """np.load hands such a member back as raw bytes: it ended in AttributeError: 'bytes' object has no
    attribute 'dtype'."""
    import pickle

    marker = tmp_path / "unpickled"
    p = _with_member(tmp_path, name, pickle.dumps(Evil(marker)))
    with pytest.raises(BNProbeError) as info:
        load_layer(p)
    msg = str(info.value)
    assert type(info.value) is BNProbeError and "\n" not in msg
    assert msg == (f"{p}: member {name!r} is not a .npy array (np.savez writes only .npy members); refused, nothing "
                   "in it is loaded or unpickled")
    assert not marker.exists()


def test_a_truncated_or_object_member_is_refused_from_its_header(tmp_path):
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros((1000, 1000)))
    p = _with_member(tmp_path, "big.npy", buf.getvalue()[:4096])
    with pytest.raises(BNProbeError, match=r"big: 4096 bytes, shorter than the \d+ its header declares"):
        load_layer(p)
    buf = io.BytesIO()
    np.save(buf, np.array([1, "a"], dtype=object), allow_pickle=True)
    p = _with_member(tmp_path, "obj.npy", buf.getvalue())
    with pytest.raises(BNProbeError, match="obj: holds Python objects"):
        load_layer(p)


def test_a_layer_too_large_for_the_memory_limit_is_refused_before_it_runs(tmp_path, capsys):
    """x (8, 16, 64, 64) through 64 3x3 filters: 302 M products, each rounded and summed in float64 carriers,
    about 10 GiB at fold's peak; refused at once under --max-memory."""
    import time

    from bnprobe.checks.fold import fold_bytes
    from bnprobe.guard import set_memory_limit

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16, 3, 3))
    p = _npz(tmp_path, CONV, weight=w, gamma=np.ones(64), beta=np.zeros(64), running_mean=np.zeros(64),
             running_var=np.ones(64), bias=None, x=rng.standard_normal((8, 16, 64, 64)))
    est = fold_bytes("conv2d", (8, 16, 64, 64), w.shape, pad=1)
    assert 8 * 2**30 < est < 16 * 2**30
    assert fold_bytes("conv2d", (8, 16, 64, 64), w.shape, pad=1, accumulate="fp64") < 2**30  # no products held
    t0 = time.monotonic()
    try:
        assert main(["--max-memory", "2G", "fold", "--weights", str(p), "--out", str(tmp_path / "o")]) == 2
    finally:
        set_memory_limit(None)
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 5 and err.count("\n") == 1
    assert err.startswith("bnprobe: error: fold of a conv2d layer (weight (64, 16, 3, 3)) on x of shape "
                          "(8, 16, 64, 64) needs about ") and "--max-memory limit" in err
    assert not (tmp_path / "o").exists()


def test_the_fold_estimate_bounds_the_measured_peak(tmp_path):
    """The estimate is above the peak resident memory of a real run (getrusage of a child process), and not
    more than twice it."""
    import subprocess
    import sys

    from bnprobe.checks.fold import fold_bytes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 16, 3, 3))
    x = rng.standard_normal((4, 16, 32, 32))  # 18.9 M products
    p = _npz(tmp_path, CONV, weight=w, x=x)
    code = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'bnprobe', 'fold', "
            "'--weights', sys.argv[1]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); "
            "assert r.returncode in (0, 1), r.stderr; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True)
    peak = int(out.stdout.strip()) * 1024
    est = fold_bytes("conv2d", x.shape, w.shape, pad=1)
    assert peak <= est <= 2 * peak, (peak, est)

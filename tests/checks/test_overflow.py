import math

import numpy as np
import pytest

from bnprobe.checks.overflow.scan import predict_headroom, scan
from bnprobe.cli import main
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.inputs import make_input
from bnprobe.kernels import get_policy

from .bn_plugins import Fp16RunningVar, InvstdFlushed, NumpyBN, ZeroY


def by(rep):
    return {f.anomaly: f for f in rep.findings}


def crafted(shape=(8, 4, 8, 8), hot=2, **kw):
    x = make_input(shape, seed=0)
    x[:, hot] = make_input((shape[0],) + shape[2:], seed=1, **kw)
    return x


def test_overflow_and_inf_in_the_fp16_sum_of_squares_of_one_channel():
    x = crafted(mean=100.0)  # only channel 2 is large: 512 * 100^2 > 65504
    f = by(scan("emulated:fp16-acc16:variance=naive", x, dtype="fp16"))
    assert f["overflow"].stage == "sum_sq" and f["overflow"].channels == (2,)
    assert f["inf"].stage == "sum_sq" and "channel 2: mean 99.9" in f["overflow"].inputs
    assert any(r.fixed and "wider accumulator" in r.name for r in f["overflow"].remedies)
    assert any(r.fixed and "two-pass" in r.name for r in f["overflow"].remedies)


def test_saturation_is_found_even_though_every_output_is_finite():
    x = crafted(mean=100.0)
    rep = scan("emulated:fp16-acc16:variance=naive,overflow=saturate", x, dtype="fp16")
    f = by(rep)
    assert f["saturated"].stage == "sum_sq" and f["saturated"].channels == (2,)
    assert "inf" not in f  # saturation hid it as a finite maximum


def test_ieee_vs_saturation_side_by_side():
    x = make_input((8, 4, 8, 8), seed=0)
    rep = scan("emulated:fp16", BNCall(x, np.array([1.0, 1.0, 3e4, 1.0])), dtype="fp16")  # y beyond 65504
    f = by(rep)
    assert f["overflow"].stage == "y" and f["overflow"].channels == (2,)
    modes = {s["overflow_mode"]: s for s in rep.saturation}
    assert modes["ieee"]["finite_share"] < 1.0 and modes["saturate"]["finite_share"] == 1.0
    assert modes["saturate"]["max_abs_output"] == 65504.0  # a plausible-looking wrong number


def test_underflow_subnormal_and_flush():
    x = make_input((8, 4, 8, 8), seed=0)
    g = np.array([1.0, 1e-6, 1.0, 1.0])  # channel 1's outputs are ~1e-6: fp16 subnormals
    f = by(scan("emulated:fp16", BNCall(x, g, np.zeros(4)), dtype="fp16"))
    assert f["subnormal"].stage == "y" and f["subnormal"].channels == (1,)
    g2 = np.array([1.0, 1e-9, 1.0, 1.0])  # below half the smallest subnormal: zero
    f2 = by(scan("emulated:fp16", BNCall(x, g2, np.zeros(4)), dtype="fp16"))
    assert f2["underflow"].stage == "y" and f2["underflow"].channels == (1,)
    f3 = by(scan("emulated:fp16:subnormals=flush", BNCall(x, g, np.zeros(4)), dtype="fp16"))
    assert f3["flushed"].stage == "y" and f3["flushed"].channels == (1,)


def test_negative_variance_and_cancellation():
    x = 1000.0 + make_input((8, 64), seed=2) * 1e-4  # near-constant channels far from zero
    x[:, 0] = make_input((8,), seed=3)  # and one ordinary channel
    f = by(scan("emulated:fp32:variance=naive", x, dtype="fp32"))
    assert f["negative_var"].stage == "var" and 0 not in f["negative_var"].channels
    assert f["cancellation"].stage == "var" and 0 not in f["cancellation"].channels
    assert len(f["cancellation"].channels) == 63
    assert any(r.fixed and "clamp" in r.name for r in f["negative_var"].remedies)
    assert any(r.fixed and "two-pass" in r.name for r in f["cancellation"].remedies)


def test_input_nan_is_input_borne():
    x = make_input((8, 4, 8, 8), seed=0)
    x[3, 0, 2, 2] = np.nan
    f = by(scan("emulated:fp16", x, dtype="fp16"))
    assert f["input_nonfinite"].input_borne and f["input_nonfinite"].first_element == "index (3, 0, 2, 2) (channel 0)"
    assert f["nan"].input_borne and f["nan"].channels == (0,)


@pytest.mark.parametrize("stage,accumulate,variance", [("sum_sq", "fp16", "naive"), ("sum", "fp16", "two_pass"),
                                                       ("sum_sq_dev", "fp16", "two_pass")])
def test_headroom_prediction_agrees_with_the_overflow_boundary(stage, accumulate, variance):
    """Scale the input up by powers of two; the predicted and actual overflow boundaries differ by <= 1 binade."""
    base = make_input((4, 2, 8, 8), seed=3) + (8.0 if stage == "sum" else 0.0)
    pol = get_policy("fp16-acc16").with_options(variance=variance)
    predicted = actual = None
    for k in range(0, 24):
        x = base * 2.0**k
        h = {r.stage: r for r in predict_headroom(x, pol)}
        if stage not in h:
            continue
        if predicted is None and h[stage].overflows:
            predicted = k
        if actual is None:
            rep = scan(f"emulated:fp16-acc16:variance={variance}", x, dtype="fp16", remedies=False)
            if any(f.anomaly in ("overflow", "inf") and f.stage == stage for f in rep.findings):
                actual = k
        if predicted is not None and actual is not None:
            break
    assert predicted is not None and actual is not None and abs(predicted - actual) <= 1


@pytest.mark.parametrize("adapter,dtype", [("emulated", "fp16"), ("emulated", "bf16"), ("emulated", "fp32"),
                                           ("ascend-tbe", "fp16"), ("ascend-bnv3", "bf16"), ("ascend-950", "fp32"),
                                           ("torch", "fp16"), ("reference", "fp32")])
@pytest.mark.parametrize("mode", ["train", "infer", "backward"])
def test_no_false_alarms_on_ordinary_activations(adapter, dtype, mode):
    if adapter == "torch":
        pytest.importorskip("torch")
    for seed in range(2):
        x = make_input((8, 16, 7, 7), seed=seed) * 2 + 0.5
        rep = scan(adapter, x, dtype=dtype, mode=mode, seed=seed)
        assert rep.passed, [(f.anomaly, f.stage, f.count) for f in rep.findings]


def test_cli(capsys, tmp_path):
    assert main(["overflow"]) == 0
    assert "clean" in capsys.readouterr().out
    code = main(["overflow", "--accumulate", "fp16", "--mean", "300", "--shape", "8,4,8,8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "sum_sq_dev" in out and "headroom" in out
    assert len(list(tmp_path.glob("overflow-*"))) == 3
    assert main(["overflow", "--mode", "sideways"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    with pytest.raises(BNProbeError, match="needs an input"):
        scan("emulated", None)
    assert math.isinf(predict_headroom(np.zeros((4, 2)), get_policy("fp16"))[0].headroom_binades)


# ---- kernels without a trace (plugins): outputs against the golden, never "clean" when they are wrong ----------

def alternating(a, shape=(8, 2, 2, 2)):
    """Channel 0 ordinary, channel 1 = ±a (mean 0, Σ(x - mean)² = R·a², biased variance a²)."""
    x = make_input(shape, seed=0)
    x[:, 1] = np.where(np.indices(x[:, 1].shape).sum(axis=0) % 2, a, -a)
    return x


@pytest.mark.parametrize("params", ["fp32", "same"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_a_plugin_whose_y_is_all_zero_is_never_clean(dtype, params):
    x = make_input((4, 3, 2, 2), seed=0)
    for mode, outputs in (("train", {"y", "y_eval"}), ("infer", {"y_infer"})):
        assert scan(NumpyBN(), x, dtype=dtype, mode=mode, params=params)  # the same kernel without the fault
        rep = scan(ZeroY(), x, dtype=dtype, mode=mode, params=params)
        zero = [f for f in rep.findings if f.anomaly == "zero_output"]
        assert not rep and {f.stage for f in zero} == outputs, rep.findings
        assert all(f.channels == (0, 1, 2) and f.count == x.size and f.format == dtype for f in zero)


@pytest.mark.parametrize("a,overflows", [(44.0, False), (46.0, True)])
def test_a_running_variance_summed_in_fp16_overflows_and_destroys_inference(a, overflows):
    """params=same in fp16: Σ(x - mean)² = 32·a² is 61952 (held by fp16) or 67712 (beyond 65504) while the
    variance itself (a²·32/31 ≈ 2000) is well inside fp16; a kernel that sums in fp16 gets inf, and the
    inference with that running_var returns β (= 0 here) for the whole channel."""
    x = alternating(a)
    assert (32 * a * a > 65504) == overflows
    assert scan(NumpyBN(), x, dtype="fp16", params="same")  # a correct kernel: nothing to find
    rep = scan(Fp16RunningVar(), x, dtype="fp16", params="same")
    got = {(f.anomaly, f.stage, f.channels) for f in rep.findings}
    assert got == ({("inf", "running_var", (1,)), ("zero_output", "y_eval", (1,))} if overflows else set())
    if overflows:
        f = next(f for f in rep.findings if f.stage == "y_eval")
        assert f.detail.startswith("inference with the running statistics the training step left")


def test_a_running_variance_beyond_the_parameters_format_is_found_for_a_correct_kernel():
    x = alternating(300.0)  # variance 9e4·32/31: beyond fp16 (65504), x itself well inside
    rep = scan(NumpyBN(), BNCall(x, running_var=np.ones(2), momentum=1.0), dtype="fp16", params="same")
    assert {(f.anomaly, f.stage, f.channels) for f in rep.findings} == {("overflow", "running_var", (1,)),
                                                                        ("zero_output", "y_eval", (1,))}
    assert scan(NumpyBN(), BNCall(x, momentum=1.0), dtype="fp16", params="fp32")  # fp32 running statistics hold it


@pytest.mark.parametrize("a,expect", [(16000.0, set()), (20000.0, {"subnormal"})])
def test_a_saved_invstd_that_underflows(a, expect):
    """params=same in fp16: invstd = 1/a is 6.25e-5 (normal) or 5e-5 (below fp16's smallest normal 6.1e-5,
    a subnormal); a kernel that flushes subnormals saves 0, and its dx and dγ for that channel are 0.
    (momentum 0 keeps the running variance, which fp16 could not hold, at 1.)"""
    x, kw = BNCall(alternating(a), running_var=np.ones(2), momentum=0.0), dict(dtype="fp16", params="same")
    rep = scan(NumpyBN(), x, **kw)
    assert {f.anomaly for f in rep.findings} == expect and all(f.stage == "saved_invstd" for f in rep.findings)
    flushed = scan(InvstdFlushed(), x, **kw)
    assert {(f.anomaly, f.stage, f.channels) for f in flushed.findings} == (
        {("underflow", "saved_invstd", (1,))} if expect else set())
    if expect:
        back = scan(InvstdFlushed(), x, mode="backward", **kw)
        assert {(f.anomaly, f.stage, f.channels) for f in back.findings} >= {("zero_output", "dx", (1,))}


def test_cli_scans_a_plugin_with_same_format_parameters(capsys):
    code = main(["overflow", "--adapter", "tests.checks.bn_plugins:ZeroY", "--dtype", "bf16", "--params", "same",
                 "--shape", "4,3,2,2"])
    out = capsys.readouterr().out
    assert code == 1 and "(train, params same): 2 finding(s)" in out and "zero_output  y_eval" in out
    assert main(["overflow", "--params", "bf16"]) == 2
    assert "--params takes same or fp32" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_torch_with_same_format_parameters_raises_no_false_alarm(dtype):
    pytest.importorskip("torch")
    x = make_input((8, 16, 7, 7), seed=0) * 2 + 0.5
    for mode in ("train", "infer", "backward"):
        rep = scan("torch", x, dtype=dtype, mode=mode, params="same")
        assert rep, [(f.anomaly, f.stage, f.count) for f in rep.findings]


def test_accumulate_is_refused_for_a_kernel_that_is_not_emulated():
    """--accumulate would be silently ignored by torch's kernel (it computes in its own accumulator)."""
    pytest.importorskip("torch")
    with pytest.raises(BNProbeError, match="^accumulate sets the accumulator of an emulated kernel") as exc:
        scan("torch", np.ones((2, 3, 2, 2)), dtype="fp16", accumulate="fp16")
    assert exc.value.field == "accumulate"  # the library names its parameter; the command line, --accumulate


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mean", [1e3, 1e4])
def test_a_careful_kernel_is_clean_at_large_means(fmt, mean):
    """x − mean of a two-pass kernel is exact: the digits the data costs there (the mean's own rounding) are a
    note, not a finding, for the careful bench and the emulated preset; a one-pass variance still is one."""
    x = make_input((8, 16, 14, 14), mean=mean, std=1.0, seed=0)
    for adapter in ("careful", "emulated"):
        rep = scan(adapter, x, dtype=fmt)
        assert rep.clean, (adapter, [f.detail for f in rep.findings])
        assert any(n.startswith("cancellation at ") and "cannot keep them" in n for n in rep.notes)
    assert not scan(f"emulated:{fmt}:variance=naive", x, dtype=fmt).clean


# ---- the generated upstream gradient: shifted by default, so Σdy grows with R as a real loss makes it -------------

def test_a_shifted_dy_overflows_an_fp16_gradient_sum_that_a_zero_mean_dy_hides():
    x = make_input((1024, 2, 8, 8), seed=0)
    shifted = scan("emulated:fp16-acc16", x, mode="backward", remedies=False)
    normal = scan("emulated:fp16-acc16", x, mode="backward", remedies=False, dy="normal")
    assert {f.stage for f in shifted.findings if f.anomaly in ("inf", "overflow")} >= {"sum_dy"}
    assert not [f for f in normal.findings if f.stage == "sum_dy"]


def test_cli_dy_kind_is_validated_before_any_work(capsys):
    assert main(["overflow", "--dy", "sideways"]) == 2
    err = capsys.readouterr().err
    assert "--dy 'sideways'" in err and "shifted" in err and "Traceback" not in err


def test_an_output_passed_over_unread_has_nothing_to_find():
    """scan_call skips an output whose few reductions show nothing to find: whenever it does, the full check
    finds nothing either — outputs with NaN, inf, the format's largest value, zeros and subnormals where the output
    is positive, a constant or all-zero channel, a golden beyond the format or NaN, in float16, bfloat16, float32
    and float64 storage, each judged both ways; clean outputs do take the short way."""
    import ml_dtypes

    from bnprobe.checks.overflow.outputs import _nothing_to_find, _output_findings
    from bnprobe.core.formats import get_format
    from bnprobe.kernels.layout import layout_of

    rng = np.random.default_rng(41)
    skipped = found = 0
    for trial in range(600):
        key = ("y", "dx", "saved_invstd", "running_var", "saved_mean")[trial % 5]
        fmt = ("fp16", "fp32", "bf16")[trial % 3]
        f = get_format(fmt)
        x = rng.standard_normal((3, 4, 5))
        lay = layout_of(x)
        shape = x.shape if key in ("y", "dx") else (4,)
        g = rng.standard_normal(shape) * (10.0 ** rng.integers(-2, 3))
        if key in ("saved_invstd", "running_var"):
            g = np.abs(g) + 0.5
        dt = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}[fmt]
        a = g.astype(dt).astype(np.float64)
        kind = trial // 15 % 10
        flat = a.reshape(-1)
        i = int(rng.integers(flat.size))
        if kind == 1:
            flat[i] = np.nan
        elif kind == 2:
            flat[i] = -np.inf
        elif kind == 3:
            flat[i] = f.max
        elif kind == 4:
            flat[i] = 0.0
        elif kind == 5:
            flat[i] = f.tiny / 4
        elif kind == 6 and a.ndim == 3:
            a[:, 1, :] = a[0, 1, 0]
        elif kind == 7:
            a[...] = 0.0
        elif kind == 8:
            g.reshape(-1)[i] = f.max * 4
        elif kind == 9:
            g.reshape(-1)[i] = np.nan
        store = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)[trial % 4]
        with np.errstate(all="ignore"):
            held = a.astype(store)
        full = _output_findings(key, held, g, fmt, lay, lay.to_cr(x), False)
        fast = _nothing_to_find(key, held, g, fmt, lay)
        assert not (fast and full), (trial, key, fmt, kind, store, [o.anomaly for o in full])
        skipped += fast
        found += bool(full)
    assert skipped > 100 and found > 100, (skipped, found)

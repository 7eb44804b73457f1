import math

import numpy as np
import pytest

from bnprobe.checks.overflow import predict_headroom, scan
from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.inputs import make_input
from bnprobe.kernels import get_policy


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
    rep = scan("emulated:fp16", x, dtype="fp16", gamma=np.array([1.0, 1.0, 3e4, 1.0]))  # y beyond 65504
    f = by(rep)
    assert f["overflow"].stage == "y" and f["overflow"].channels == (2,)
    modes = {s["overflow_mode"]: s for s in rep.saturation}
    assert modes["ieee"]["finite_share"] < 1.0 and modes["saturate"]["finite_share"] == 1.0
    assert modes["saturate"]["max_abs_output"] == 65504.0  # a plausible-looking wrong number


def test_underflow_subnormal_and_flush():
    x = make_input((8, 4, 8, 8), seed=0)
    g = np.array([1.0, 1e-6, 1.0, 1.0])  # channel 1's outputs are ~1e-6: fp16 subnormals
    f = by(scan("emulated:fp16", x, dtype="fp16", gamma=g, beta=np.zeros(4)))
    assert f["subnormal"].stage == "y" and f["subnormal"].channels == (1,)
    g2 = np.array([1.0, 1e-9, 1.0, 1.0])  # below half the smallest subnormal: zero
    f2 = by(scan("emulated:fp16", x, dtype="fp16", gamma=g2, beta=np.zeros(4)))
    assert f2["underflow"].stage == "y" and f2["underflow"].channels == (1,)
    f3 = by(scan("emulated:fp16:subnormals=flush", x, dtype="fp16", gamma=g, beta=np.zeros(4)))
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
        assert rep.clean, [(f.anomaly, f.stage, f.count) for f in rep.findings]


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

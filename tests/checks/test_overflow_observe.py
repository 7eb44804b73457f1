"""overflow judges what a kernel's results show (bnprobe/checks/overflow/observe.py): the saved statistics, y's
per-channel moments and dx's identities against the FP64 golden, traced kernels and kernels without a trace
alike.  A one-pass variance (E[x²] − E[x]²) at a large mean against the spread is found; a careful kernel
(two-pass or Welford, the careful bench, the emulated presets, PyTorch, float64 numpy) never is."""

import math

import numpy as np
import pytest

from bnprobe.checks.overflow.scan import scan
from bnprobe.engine.recorded import recording_of
from bnprobe.cli import main
from bnprobe.inputs import make_input
from bnprobe.recordings import record, write_dump
from bnprobe.core.call import BNCall

from .bn_plugins import NaiveVariance, NumpyBN, ScaledInvstd

NEW = {"mean_error", "variance_error", "y_moments", "dx_identity"}
FORMATS = ("fp16", "bf16", "fp32")
LARGE_MEANS = (10.0, 100.0, 1000.0, 1e4)  # mean/σ with σ = 1
SHAPE = (8, 16, 14, 14)


def new_findings(rep):
    return {(f.anomaly, f.stage) for f in rep.findings if f.anomaly in NEW}


# ---- careful kernels: never a new finding -------------------------------------------------------------------

@pytest.mark.parametrize("mean", (0.0,) + LARGE_MEANS, ids=lambda m: f"mean{m:g}")
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("adapter", ["emulated", "careful", "emulated:{d}:variance=welford"])
def test_careful_traced_kernels_raise_no_alarm_at_any_mean(adapter, dtype, mean):
    x = make_input(SHAPE, mean=mean)
    for mode in ("train", "backward"):
        rep = scan(adapter.format(d=dtype), x, dtype=dtype, mode=mode, remedies=False)
        assert not new_findings(rep), [f.detail for f in rep.findings if f.anomaly in NEW]


@pytest.mark.parametrize("mean", (0.0,) + LARGE_MEANS, ids=lambda m: f"mean{m:g}")
@pytest.mark.parametrize("dtype", FORMATS)
def test_correct_untraced_kernels_stay_clean_at_any_mean(dtype, mean):
    x = make_input(SHAPE, mean=mean)
    kernels = [NumpyBN()]
    try:
        import torch  # noqa: F401

        kernels.append("torch")
    except ImportError:
        pass
    for a in kernels:
        for mode in ("train", "backward"):
            for params in ("fp32", "same"):
                rep = scan(a, x, dtype=dtype, mode=mode, params=params)
                assert rep, (a, mode, params, [f.detail for f in rep.findings])


# ---- a one-pass variance: found -----------------------------------------------------------------------------

@pytest.mark.parametrize("mean", [100.0, 1000.0], ids=lambda m: f"mean{m:g}")
@pytest.mark.parametrize("dtype", FORMATS)
def test_a_traced_one_pass_variance_is_named_cancellation_in_the_variance(dtype, mean):
    rep = scan(f"emulated:{dtype}:variance=naive", make_input(SHAPE, mean=mean), dtype=dtype, remedies=False)
    f = {x.anomaly: x for x in rep.findings}
    assert not rep and "variance_error" in f
    v = f["variance_error"]
    assert v.stage == "variance (saved)" and v.detail.startswith("cancellation in the variance (E[x²] − E[x]²)")
    assert "FP64 golden" in v.detail and "allowed" in v.detail and len(v.channels) >= 8


def test_the_bf16_one_pass_kernel_that_was_called_clean():
    """issue 29 item 6: bf16 throughout, one-pass variance, mean 7: the headroom table predicts |y| <= 4.53 and the
    run gives 7.875; before, no finding."""
    rep = scan("emulated:bf16-acc16:variance=naive", make_input(SHAPE, mean=7.0), dtype="bf16", remedies=False)
    y = next(h for h in rep.headroom if h.stage == "y")
    assert y.actual_max > 1.5 * y.predicted_max  # the case is the one reported: y far above its prediction
    assert {("variance_error", "variance (saved)"), ("y_moments", "y: per-channel std")} <= new_findings(rep)


def test_an_untraced_one_pass_variance_is_found_in_every_observable():
    x = make_input(SHAPE, mean=1000.0)
    train = scan(NaiveVariance(), x, dtype="fp32")
    assert {("variance_error", "variance (saved)"), ("y_moments", "y: per-channel std")} <= new_findings(train)
    assert next(f for f in train.findings if f.anomaly == "variance_error").detail.startswith("variance off")
    back = scan(NaiveVariance(), x, dtype="fp32", mode="backward", dy="normal")  # a shifted dy: Σdy widens the bound
    assert ("dx_identity", "dx: Σdx·x̂ identity") in new_findings(back)
    assert scan(NaiveVariance(), make_input(SHAPE), dtype="fp32")  # centred data: it is right, and clean


def test_cli_exit_1_on_a_one_pass_variance(capsys):
    code = main(["overflow", "--adapter", "tests.checks.bn_plugins:NaiveVariance", "--dtype", "fp32",
                 "--mean", "1000", "--shape", "8,16,14,14"])
    out = capsys.readouterr().out
    assert code == 1 and "variance (saved)" in out and "y: per-channel std" in out


# ---- the bound at its edge ----------------------------------------------------------------------------------

def careful_relative_bound(r, params_u):
    """The module's bound on the invstd's relative error for centred fp32 data of unit variance, written out from
    its definition: ½·((γ_R + 3u)(σ² + δμ²) + δμ²)/(σ² + ε) + 8u + u_params, δμ = γ_R·mean|x| + u_params·|mean|
    (mean ~ 0 here; mean|x| = sqrt(2/π) for a standard normal, taken as 1: an upper estimate)."""
    u = 2.0**-24
    gam = r * u / (1 - r * u)
    dmu = gam * 1.0
    return 0.5 * ((gam + 3 * u) * (1 + dmu**2) + dmu**2) + 8 * u + params_u


@pytest.mark.parametrize("share,found", [(0.5, False), (2.0, True)])
def test_a_saved_invstd_off_by_a_share_of_the_bound(share, found):
    """The saved invstd alone scaled by 1 + share·bound: inside the bound at half of it, outside at twice; a
    threshold loosened or tightened by 2× fails one of the two."""
    x = make_input(SHAPE)
    rel = careful_relative_bound(SHAPE[0] * SHAPE[2] * SHAPE[3], 2.0**-24)
    rep = scan(ScaledInvstd(share * rel), x, dtype="fp32")
    assert (("variance_error", "variance (saved)") in new_findings(rep)) is found, [f.detail for f in rep.findings]
    assert math.isfinite(rel) and rel < 1e-3


# ---- recorded dumps: the same judgement of their recorded outputs ------------------------------------------

@pytest.mark.parametrize("kernel,found", [(NaiveVariance, True), (NumpyBN, False)], ids=["one-pass", "numpy"])
def test_a_recorded_one_pass_variance_is_found_and_a_correct_recording_is_clean(tmp_path, kernel, found):
    x = make_input((8, 16, 7, 7), mean=1000.0)
    rng = np.random.default_rng(0)
    rec = record(kernel(), BNCall(x=x, gamma=None, beta=None, running_mean=np.full(16, 1000.0), running_var=np.ones(16),
                                  dy=rng.standard_normal(x.shape), dtype="fp32"), modes=("train", "backward"))
    write_dump(rec, tmp_path)
    reports = scan(recording_of(f"dump:{tmp_path}")).results
    stages = {(f.anomaly, f.stage) for r in reports for f in r.findings}
    if found:
        assert {("variance_error", "variance (saved)"), ("dx_identity", "dx: Σdx·x̂ identity")} <= stages
    else:
        assert not stages, stages

"""trace of LayerNorm, RMSNorm, GroupNorm and InstanceNorm (--norm): the golden's stages are torch's float64 values
(LayerNorm's mean, rstd and y from torch.native_layer_norm, GroupNorm's from torch.native_group_norm, RMSNorm's mean
square and y from torch's ops, InstanceNorm's from F.instance_norm; the backward from torch's autograd in float64 and
from the formula replayed in numpy on the statistics the traced forward saved); the error columns are the traced
stage's distance to those independent values; each layer shows its own stages (RMSNorm no mean, no dβ); a defect is
seen in the stage it happens in; bad input is one line, exit 2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bnprobe.checks.trace.stages import trace_run
from bnprobe.cli import main
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.numerics.rounding import round_to

torch = pytest.importorskip("torch")
F = torch.nn.functional

EPS = 1e-5
# float64 against float64 by another algorithm (torch's Welford, its own sums): a few units of float64's roundoff
# scaled by R and the values' size
FP64_RTOL = 1e-12

# (norm, x shape, normalized_shape, groups): the layers and where their statistics sit
LAYERS = [("layer", (3, 5, 24), None, None), ("layer", (2, 3, 4, 6), (4, 6), None), ("rms", (3, 5, 24), None, None),
          ("group", (2, 6, 3, 4), None, 3), ("instance", (2, 4, 3, 5), None, None)]
IDS = ["layer", "layer-2d", "rms", "group", "instance"]


def _call(norm, shape, ns, groups, *, seed=0, mean=0.0, offset=0.0, dy=True) -> BNCall:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 2.0, shape[:1] + (1,) * (len(shape) - 1)) + mean
    pshape = (tuple(ns) if ns else shape[-1:]) if norm in ("layer", "rms") else shape[1:2]
    gamma = rng.uniform(0.5, 1.5, pshape)
    beta = None if norm == "rms" else rng.normal(0.0, 0.1, pshape)
    return BNCall(x, gamma, beta, dy=rng.standard_normal(shape) + 1.0 if dy else None, eps=EPS, norm=norm,
                  normalized_shape=ns, groups=groups, weight_offset=offset)


def _t(a) -> "torch.Tensor":  # noqa: ANN001
    return torch.tensor(np.asarray(a, dtype=np.float64))


def _torch_forward(call: BNCall, x: np.ndarray, g: np.ndarray, b: np.ndarray | None):  # noqa: ANN202
    """y, mean (None for RMSNorm) and rstd per row (and the variance, or RMSNorm's mean square) by torch in float64,
    rows in the trace's order."""
    xt, gt = _t(x), _t(g) + call.weight_offset
    bt = None if b is None else _t(b)
    if call.norm in ("layer", "rms"):
        ns = tuple(call.normalized_shape or x.shape[-1:])
        dims = tuple(range(x.ndim - len(ns), x.ndim))
        if call.norm == "layer":
            y, mean, rstd = torch.native_layer_norm(xt, list(ns), gt, bt, EPS)
            var = xt.var(dim=dims, unbiased=False)
        else:
            var = (xt * xt).mean(dim=dims)  # the mean square
            mean, rstd = None, torch.rsqrt(var + EPS)
            y = F.rms_norm(xt, list(ns), gt, EPS)
        return y, mean, rstd, var
    n, c = x.shape[:2]
    groups = call.groups if call.norm == "group" else c
    if call.norm == "group":
        y, mean, rstd = torch.native_group_norm(xt, gt, bt, n, c, math.prod(x.shape[2:]), groups, EPS)
    else:
        y = F.instance_norm(xt, weight=gt, bias=bt, eps=EPS)
        mean, rstd = None, None
    v, m = torch.var_mean(xt.reshape(n, groups, -1), dim=-1, unbiased=False)
    if mean is None:
        mean, rstd = m, torch.rsqrt(v + EPS)
    return y, mean, rstd, v


def _flat(a) -> np.ndarray:  # noqa: ANN001
    return np.asarray(a.detach().numpy() if hasattr(a, "detach") else a, dtype=np.float64).reshape(-1)


def _close(actual: np.ndarray, expected: np.ndarray, scale: float | None = None) -> None:
    scale = float(np.max(np.abs(expected))) if scale is None else scale
    np.testing.assert_allclose(np.reshape(actual, -1), np.reshape(expected, -1), rtol=0, atol=FP64_RTOL * scale)


@pytest.mark.parametrize("norm,shape,ns,groups", LAYERS, ids=IDS)
@pytest.mark.parametrize("policy", ["fp16", "bf16-acc16", "fp32:variance=welford,order=sequential"])
def test_the_golden_forward_stages_are_torchs_float64_values(norm, shape, ns, groups, policy) -> None:  # noqa: ANN001
    call = _call(norm, shape, ns, groups, mean=3.0)
    cmp = trace_run(call, policy=policy)
    pol = cmp.policy
    x = round_to(call.x, pol.storage)  # the inputs as the kernel and the golden see them
    g = round_to(call.gamma, pol.params_format)
    b = None if call.beta is None else round_to(call.beta, pol.params_format)
    y, mean, rstd, var = _torch_forward(call, x, g, b)
    gold = cmp.golden
    _close(gold["y"].value, _flat(y))
    _close(gold["rstd"].value, _flat(rstd))
    if norm == "rms":
        _close(gold["mean_square"].value, _flat(var))
    else:
        _close(gold["mean"].value, _flat(mean), scale=float(np.max(np.abs(x))))
        _close(gold["var"].value, _flat(var))
    # the error column of y is the traced y's distance to torch's float64 y (up to float64's own rounding)
    row = next(r for r in cmp.rows if r.stage == "y")
    want = float(np.max(np.abs(np.reshape(cmp.trace["y"].value, -1) - _flat(y))))
    assert row.max_abs_err == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert row.format == pol.storage and row.kind == "element"


@pytest.mark.parametrize("norm,shape,ns,groups", LAYERS, ids=IDS)
def test_the_fp64_policys_backward_is_torchs_autograd(norm, shape, ns, groups) -> None:  # noqa: ANN001
    call = _call(norm, shape, ns, groups)
    cmp = trace_run(call, policy="fp64", mode="backward")
    xt = _t(call.x).requires_grad_(True)
    gt = _t(call.gamma).requires_grad_(True)
    bt = None if call.beta is None else _t(call.beta).requires_grad_(True)
    if norm in ("layer", "rms"):
        nsl = list(ns or shape[-1:])
        y = F.layer_norm(xt, nsl, gt, bt, EPS) if norm == "layer" else F.rms_norm(xt, nsl, gt, EPS)
    elif norm == "group":
        y = F.group_norm(xt, groups, gt, bt, EPS)
    else:
        y = F.instance_norm(xt, weight=gt, bias=bt, eps=EPS)
    y.backward(_t(call.dy))
    _close(cmp.trace["dx"].value, _flat(xt.grad))
    _close(cmp.param_trace["dgamma"].value, _flat(gt.grad))
    if bt is not None:
        _close(cmp.param_trace["dbeta"].value, _flat(bt.grad))
    named = {r.stage: r for r in cmp.rows}
    # the parameters' gradients are stages shaped as γ (kind param)
    assert named["dgamma"].kind == "param"
    # (the policy is fp64: the trace is its own golden, the errors 0)
    assert named["dx"].max_abs_err == 0
    if norm == "rms":
        assert "dbeta" not in named and "sum_g" not in named
    else:
        assert named["dbeta"].kind == "param"


@pytest.mark.parametrize("norm,shape,ns,groups", LAYERS, ids=IDS)
def test_the_backward_golden_is_the_formula_on_the_statistics_the_forward_saved(norm, shape, ns, groups) -> None:  # noqa: ANN001, E501
    """fp16: both backwards read the statistics the fp16 forward saved (in fp32); the golden is the formula
    dx = rstd·(g − Σg/R − x̂·Σ(g·x̂)/R) (RMSNorm without Σg) replayed in numpy on them, dγ = Σ dy·x̂, dβ = Σ dy."""
    call = _call(norm, shape, ns, groups, mean=2.0)
    cmp = trace_run(call, policy="fp16", mode="backward")
    fw = trace_run(call, policy="fp16")
    mean = None if norm == "rms" else fw.trace["mean"].value.astype(np.float64)
    # the saved statistics: the forward's, rounded to the parameters' format (fp32) as saved
    rstd = round_to(fw.trace["rstd"].value, "fp32")
    mean = None if mean is None else round_to(mean, "fp32")
    x = round_to(call.x, "fp16")
    dy = round_to(call.dy, "fp16")
    gamma = round_to(call.gamma, "fp32")
    rows = rstd.size
    xr, dyr = x.reshape(rows, -1), dy.reshape(rows, -1)
    if norm in ("layer", "rms"):
        ge = np.broadcast_to(gamma.reshape(1, -1), xr.shape)
    else:
        c = shape[1]
        grp = groups or c
        ge = np.repeat(gamma.reshape(grp, c // grp), math.prod(shape[2:]), axis=1)
        ge = np.tile(ge.reshape(1, -1), (shape[0], 1)).reshape(xr.shape)
    xhat = (xr - (0.0 if mean is None else mean[:, None])) * rstd[:, None]
    gdy = dyr * ge
    r = xr.shape[1]
    dx = gdy - xhat * (gdy * xhat).sum(1, keepdims=True) / r
    if mean is not None:
        dx = dx - gdy.sum(1, keepdims=True) / r
    dx = dx * rstd[:, None]
    _close(cmp.golden["dx"].value, dx, scale=float(np.max(np.abs(dx))) * r)
    if norm in ("layer", "rms"):
        dgamma, dbeta = (dyr * xhat).sum(0), dyr.sum(0)
    else:
        n, c = shape[:2]
        dgamma, dbeta = (dyr * xhat).reshape(n, c, -1).sum(axis=(0, 2)), dyr.reshape(n, c, -1).sum(axis=(0, 2))
    _close(cmp.golden_params["dgamma"].value, dgamma, scale=float(np.max(np.abs(dyr * xhat))) * xr.size)
    if norm != "rms":
        _close(cmp.golden_params["dbeta"].value, dbeta, scale=float(np.max(np.abs(dyr))) * xr.size)
    # the error columns: the traced fp16 run's distance to those values
    rows_by = {row.stage: row for row in cmp.rows}
    want_dx = float(np.max(np.abs(np.reshape(cmp.trace["dx"].value, -1) - dx.reshape(-1))))
    assert rows_by["dx"].max_abs_err == pytest.approx(want_dx, rel=1e-9)
    want_dg = float(np.max(np.abs(cmp.param_trace["dgamma"].value - dgamma)))
    assert rows_by["dgamma"].max_abs_err == pytest.approx(want_dg, rel=1e-6, abs=1e-13)
    assert rows_by["dx"].max_ulp_err <= 1.0  # a correct kernel: dx within an ulp of fp16


def test_each_layer_shows_its_own_stages() -> None:
    names = {norm: [r.stage for r in trace_run(_call(norm, shape, ns, groups)).rows]
             for norm, shape, ns, groups in LAYERS}
    assert names["rms"][:6] == ["x", "squares", "sum_squares", "mean_square", "var_eps", "rstd"]
    assert "mean" not in names["rms"] and "centered" not in names["rms"]
    for norm in ("layer", "group", "instance"):
        assert {"mean", "var", "rstd", "centered", "xhat", "y"} <= set(names[norm])
    off = trace_run(_call("rms", (3, 5, 24), None, None, offset=1.0))
    assert next(r for r in off.rows if r.stage == "gamma_offset").kind == "param"


def test_a_16_bit_accumulation_overflows_in_the_stage_that_overflows() -> None:
    """fp16 accumulation of Σx² at mean 30 over R = 768 (768·900 > 65504): the naive variance's sum of squares
    overflows and the trace says so there; the careful policy's does not."""
    call = _call("layer", (2, 4, 768), None, None, mean=30.0)
    bad = {r.stage: r for r in trace_run(call, policy="fp16-acc16:variance=naive").rows}
    assert bad["sum_sq"].anomalies.get("posinf", 0) == 8 and bad["sum_sq"].mismatched_nonfinite == 8
    good = trace_run(call, policy="fp16")
    assert not any(r.anomalies.get("posinf") or r.anomalies.get("nan") for r in good.rows)


def run(capsys, *args):  # noqa: ANN001, ANN002, ANN201
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,shape,r", [(["--norm", "layer"], (4, 128, 768), 768),
                                          (["--norm", "rms", "--mode", "backward", "--shape", "2,8,64"], (2, 8, 64),
                                           64),
                                          (["--norm", "group", "--num-groups", "32"], (4, 64, 16, 16), 512),
                                          (["--norm", "instance", "--shape", "2,3,5,5"], (2, 3, 5, 5), 25)])
def test_the_cli_traces_each_layer(capsys, args, shape, r) -> None:  # noqa: ANN001
    code, out, err = run(capsys, "trace", *args, "--json")
    assert code == 0 and err == "", err
    doc = json.loads(out)
    assert tuple(doc["shape"]) == shape and doc["r"] == r and doc["norm"] == args[1]
    final = "dx" if "backward" in args else "y"
    row = next(s for s in doc["stages"] if s["stage"] == final)
    assert row["format"] == "fp16" and row["max_ulp_err"] <= 1.0
    code, out, err = run(capsys, "trace", *args)
    assert code == 0 and out.splitlines()[2].startswith("layer    ") and f"R = {r} " in out.splitlines()[2]


def test_the_cli_traces_a_recorded_family_call_on_its_own_inputs(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "dump", "--norm", "rms", "--adapter", "emulated", "--shape", "2,4,32", "--out",
                       tmp_path / "d")
    assert code == 0, err
    code, out, err = run(capsys, "trace", "--input", tmp_path / "d", "--mode", "backward", "--json")
    assert code == 0, err
    doc = json.loads(out)
    # the recorded call's inputs: the same stages as the generated call's trace made the same way
    code, out2, _ = run(capsys, "trace", "--norm", "rms", "--shape", "2,4,32", "--mode", "backward", "--json")
    gen = json.loads(out2)
    assert [s["stage"] for s in doc["stages"]] == [s["stage"] for s in gen["stages"]]
    assert [s["max_abs_err"] for s in doc["stages"]] == [s["max_abs_err"] for s in gen["stages"]]


@pytest.mark.parametrize("args,message", [
    (["--norm", "layer", "--normalized-shape", "5"], "normalized_shape [5] is not x's trailing dimensions"),
    (["--norm", "group", "--num-groups", "5"], "groups must divide the 64 channels, got 5"),
    (["--norm", "group"], "--norm group needs --num-groups"),
    (["--norm", "instance", "--normalized-shape", "5"], "--normalized-shape applies to --norm layer and rms"),
    (["--norm", "layer", "--num-groups", "2"], "--num-groups applies to --norm group"),
    (["--norm", "rms", "--mode", "infer"], "--mode infer: RMSNorm keeps no running statistics"),
    (["--norm", "layer", "--momentum", "0.2"], "--momentum applies to BatchNorm's running statistics"),
    (["--norm", "layer", "--layout", "channels_last"], "--layout channels_last: LayerNorm takes x as it is laid out"),
    (["--norm", "layer", "--policy", "fp16:y_formula=affine_mr"], "is a BatchNorm kernel's choice"),
    (["--norm", "instance", "--policy", "fp16:backward_formula=torch", "--mode", "backward"],
     "InstanceNorm's PyTorch kernel is BatchNorm's"),
    (["--norm", "layer", "--shape", "2,4,1", "--mode", "backward"], "more than one value per row"),
    (["--norm", "batchy"], "unknown norm 'batchy'"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, message) -> None:  # noqa: ANN001
    code, out, err = run(capsys, "trace", *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_dump_brings_its_own_layer(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "dump", "--norm", "layer", "--adapter", "emulated", "--shape", "2,4,8", "--out",
                       tmp_path / "d")
    assert code == 0, err
    code, _, err = run(capsys, "trace", "--norm", "layer", "--input", tmp_path / "d")
    assert code == 2 and "its call brings its own layer" in err and err.count("\n") == 1


def test_a_library_call_that_does_not_fit_is_refused() -> None:
    with pytest.raises(BNProbeError, match="keeps no running statistics"):
        trace_run(_call("layer", (2, 3, 8), None, None).with_(running_mean=np.zeros(3), running_var=np.ones(3)))
    with pytest.raises(BNProbeError, match="RMSNorm has no β"):
        trace_run(_call("rms", (2, 3, 8), None, None).with_(beta=np.zeros(8)))

"""The family layers through the adapter interface: torch's LayerNorm, RMSNorm, GroupNorm and InstanceNorm are the
functions users call (F.layer_norm, F.rms_norm, F.group_norm, F.instance_norm and their autograd), bit for bit;
bnprobe's own kernels run them; an adapter that runs BatchNorm only, and a call that does not fit, are refused in
one line."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import Saved
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.layout import NormShape

torch = pytest.importorskip("torch")
F = torch.nn.functional
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

CASES = [("layer", (4, 6, 32), {}), ("rms", (3, 5, 48), {}), ("group", (2, 8, 5, 5), {"groups": 4}),
         ("instance", (2, 3, 6, 7), {})]


def _call(norm: str, shape: tuple[int, ...], kw: dict, fmt: str, params: str = "fp32", seed: int = 0) -> BNCall:
    rng = np.random.default_rng(seed)
    sh = NormShape.of(norm, shape, **kw)
    x = rng.standard_normal(shape) * 2 + 1
    return BNCall(x, gamma=rng.uniform(0.5, 2, sh.param_shape),
                  beta=None if norm == "rms" else rng.normal(0, 1, sh.param_shape), dy=rng.standard_normal(shape),
                  dtype=fmt, params=params, norm=norm, **kw)


def _torch_direct(c: BNCall, pf: str) -> tuple[np.ndarray, ...]:
    """y, dx, dγ, dβ of torch's functional API with autograd, on the call's values in their formats."""
    def t(a: np.ndarray, fmt: str, grad: bool = False):  # noqa: ANN202
        return torch.tensor(a).to(TORCH_DTYPE[fmt]).requires_grad_(grad)

    x, g = t(c.x, c.dtype, True), t(c.gamma, pf, True)
    b = None if c.beta is None else t(c.beta, pf, True)
    sh = NormShape.of(c.norm, c.x.shape, c.normalized_shape, c.groups)
    if c.norm == "layer":
        y = F.layer_norm(x, sh.normalized, g, b, c.eps)
    elif c.norm == "rms":
        y = F.rms_norm(x, sh.normalized, g, c.eps)
    elif c.norm == "group":
        y = F.group_norm(x, sh.groups, g, b, c.eps)
    else:
        y = F.instance_norm(x, weight=g, bias=b, eps=c.eps)
    y.backward(t(c.dy, c.dtype))
    as_np = [v.detach().to(torch.float64).numpy() for v in (y, x.grad, g.grad)]
    return (*as_np, None if b is None else b.grad.detach().to(torch.float64).numpy())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fmt,params", [("fp32", "fp32"), ("fp16", "same"), ("bf16", "same"), ("fp16", "fp32")])
@pytest.mark.parametrize("norm,shape,kw", CASES, ids=lambda v: str(v))
def test_torch_adapter_is_torchs_functional_api_bit_for_bit(norm, shape, kw, fmt, params) -> None:  # noqa: ANN001
    c = _call(norm, shape, kw, fmt, params)
    pf = fmt if params == "same" else "fp32"
    if c.dtype == "fp16" and params == "fp32" and norm in ("group",):
        pytest.skip("torch's GroupNorm takes γ and β in the input's dtype")
    # (the values as the call's formats hold them: rounded by torch, exactly as the adapter's inputs are)
    c = c.with_(x=torch.tensor(c.x).to(TORCH_DTYPE[fmt]).double().numpy(),
                dy=torch.tensor(c.dy).to(TORCH_DTYPE[fmt]).double().numpy(),
                gamma=torch.tensor(c.gamma).to(TORCH_DTYPE[pf]).double().numpy(),
                beta=None if c.beta is None else torch.tensor(c.beta).to(TORCH_DTYPE[pf]).double().numpy())
    a = get_adapter("torch")
    out = a.train(c)
    grads = a.backward_of(c, out.saved)
    y, dx, dg, db = _torch_direct(c, pf)
    np.testing.assert_array_equal(out.y.astype(np.float64), y)
    np.testing.assert_array_equal(grads.dx.astype(np.float64), dx)
    np.testing.assert_array_equal(grads.dgamma.astype(np.float64), dg)
    if db is not None:
        np.testing.assert_array_equal(grads.dbeta.astype(np.float64), db)
    assert out.saved.value.shape == (NormShape.of(norm, shape, **kw).rows,)


@pytest.mark.parametrize("name", ["reference", "careful", "emulated", "emulated:bf16:cast_point=before_gamma"])
def test_bnprobes_kernels_run_the_family(name) -> None:  # noqa: ANN001
    a = get_adapter(name)
    fmt = "bf16" if "bf16" in name else "fp16"
    for norm, shape, kw in CASES:
        c = _call(norm, shape, kw, fmt)
        out = a.train(c)
        grads = a.backward_of(c, out.saved)
        assert out.y.shape == shape and grads.dx.shape == shape
        assert (out.saved.mean is None) == (norm == "rms")
        assert a.infer(c).saved is None


@pytest.mark.parametrize("name", ["ascend-bnv3"])
def test_a_batchnorm_only_adapter_refuses_a_family_call(name) -> None:  # noqa: ANN001
    try:
        a = get_adapter(name)
    except BNProbeError as e:
        pytest.skip(str(e))
    with pytest.raises(BNProbeError, match=r"runs BatchNorm only, not LayerNorm"):
        a.train(_call("layer", (2, 8), {}, "fp16"))


def test_torch_compile_refuses_the_instance_norm_it_does_not_compile() -> None:
    """torch-compile runs BatchNorm, LayerNorm, RMSNorm and GroupNorm compiled; InstanceNorm it refuses in one line
    (before compiling anything)."""
    try:
        a = get_adapter("torch-compile")
    except BNProbeError as e:
        pytest.skip(str(e))
    with pytest.raises(BNProbeError, match=r"runs BatchNorm, LayerNorm, RMSNorm, GroupNorm only, not InstanceNorm"):
        a.train(_call("instance", (2, 3, 8), {}, "fp16"))
    assert a.compiles == 0


@pytest.mark.parametrize("change,says", [
    ({"gamma": np.ones(7)}, "gamma must have shape [32]"),
    ({"norm": "rms", "beta": np.zeros(32)}, "RMSNorm has no β"),
    ({"running_mean": np.zeros(32), "running_var": np.ones(32)}, "without running statistics"),
    ({"layout": "channels_last"}, "takes x as it is laid out"),
    ({"normalized_shape": (6, 30)}, "not x's trailing dimensions"),
])
def test_a_family_call_that_does_not_fit_is_refused_in_one_line(change, says) -> None:  # noqa: ANN001
    c = _call("layer", (4, 6, 32), {}, "fp16").with_(**change)
    with pytest.raises(BNProbeError) as e:
        get_adapter("careful").train(c)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_saved_statistics_of_another_layer_are_refused() -> None:
    c = _call("rms", (3, 16), {}, "fp32")
    with pytest.raises(BNProbeError, match="mean None"):
        get_adapter("reference").backward_of(c, Saved(np.zeros(3), "invstd", np.ones(3)))

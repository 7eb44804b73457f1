"""bnprobe.capture on the normalisation family's modules: nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.InstanceNorm1d
and a Hugging Face-style RMSNorm are recorded, each call's tensors equal to what torch's functional API and autograd
give on the recorded inputs (computed here, apart from the hooks), read back as that layer's call, and judged by
compare-precision: an fp32 capture passes everything."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.checks.compare.precision import compare_precision
from bnprobe.recordings import open_dump

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


class LlamaRMSNorm(nn.Module):
    """Hugging Face's Llama RMSNorm, as transformers writes it."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, h):  # noqa: ANN001, ANN201
        t = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(t)


class GemmaRMSNorm(nn.Module):
    """Gemma's: γ stored as w, applied as 1 + w."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):  # noqa: ANN001, ANN201
        o = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (o * (1.0 + self.weight.float())).type_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 64)
        self.ln = nn.LayerNorm(64)
        self.rms = nn.RMSNorm(64, eps=1e-5)
        self.hf = LlamaRMSNorm(64)
        self.gemma = GemmaRMSNorm(64)
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.inorm = nn.InstanceNorm1d(16, affine=True)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = self.gemma(self.hf(self.rms(self.ln(self.l1(x)))))
        c = self.inorm(self.gn(self.conv(h.reshape(x.shape[0], 8, -1))))
        return h.sum() + c.sum()


@pytest.fixture(scope="module")
def captured(tmp_path_factory):  # noqa: ANN001, ANN201
    import bnprobe

    torch.manual_seed(0)
    m = Block()
    with torch.no_grad():
        m.gemma.weight.normal_(0, 0.1)
        m.hf.weight.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("cap") / "family"
    with bnprobe.capture(m, out):
        m(torch.randn(4, 8, 64)).backward()
    return out, {c.name: c.load() for c in open_dump(out, None).calls}


def _t(a: np.ndarray, grad: bool = False):  # noqa: ANN202
    return torch.tensor(np.asarray(a, dtype=np.float32)).requires_grad_(grad)


def test_each_module_is_recorded_as_its_layer(captured) -> None:  # noqa: ANN001
    _, recs = captured
    layers = {name: (r.call().norm, r.call().normalized_shape, r.call().groups, r.call().weight_offset)
              for name, r in recs.items()}
    assert layers == {"ln#0": ("layer", (64,), None, 0.0), "rms#0": ("rms", (64,), None, 0.0),
                      "hf#0": ("rms", (64,), None, 0.0), "gemma#0": ("rms", (64,), None, 1.0),
                      "gn#0": ("group", None, 4, 0.0), "inorm#0": ("instance", None, None, 0.0)}
    assert recs["hf#0"].eps == pytest.approx(1e-6) and recs["rms#0"].eps == pytest.approx(1e-5)


@pytest.mark.parametrize("name", ["ln#0", "rms#0", "hf#0", "gemma#0", "gn#0", "inorm#0"])
def test_the_recorded_call_is_torchs_on_its_inputs(captured, name) -> None:  # noqa: ANN001
    """y, the saved statistics and dx, dγ, dβ as the functional API and autograd give them on the recorded x, γ, β
    and dy (bit for bit: the same fp32 kernels)."""
    _, recs = captured
    r = recs[name]
    c = r.call()
    x, g = _t(c.x, True), _t(c.gamma, True)
    b = None if c.beta is None else _t(c.beta, True)
    if c.norm == "layer":
        y, mean, rstd = torch.native_layer_norm(x, [64], g, b, c.eps)
        want_saved = (mean.detach().numpy().reshape(-1), rstd.detach().numpy().reshape(-1))
    elif c.norm == "group":
        n, ch = c.x.shape[:2]
        y, mean, rstd = torch.native_group_norm(x, g, b, n, ch, c.x.shape[2], 4, c.eps)
        want_saved = (mean.detach().numpy().reshape(-1), rstd.detach().numpy().reshape(-1))
    elif c.norm == "instance":
        y = F.instance_norm(x, weight=g, bias=b, eps=c.eps)
        want_saved = None
    else:  # (RMSNorm's torch function; Llama's and Gemma's written out as they are)
        y = F.rms_norm(x, [64], g, c.eps) if name == "rms#0" else \
            (g + c.weight_offset) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps))
        want_saved = None
    np.testing.assert_allclose(r.get("train", "outputs", "y"), y.detach().numpy(), rtol=0, atol=2e-6)
    if want_saved is not None:
        np.testing.assert_array_equal(r.get("train", "outputs", "saved_mean"), want_saved[0])
        np.testing.assert_array_equal(r.get("train", "outputs", "saved_value"), want_saved[1])
    dy = torch.tensor(np.asarray(c.dy, dtype=np.float32))
    grads = torch.autograd.grad(y, [x, g] + ([b] if b is not None else []), dy)
    out = r.tensors["backward"]["outputs"]
    np.testing.assert_allclose(out["dx"], grads[0].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["dgamma"].reshape(-1), grads[1].numpy().reshape(-1), rtol=1e-5, atol=1e-5)
    if b is not None:
        np.testing.assert_allclose(out["dbeta"].reshape(-1), grads[2].numpy().reshape(-1), rtol=1e-5, atol=1e-5)


def test_an_fp32_capture_passes_compare_precision(captured) -> None:  # noqa: ANN001
    from bnprobe.adapters import get_adapter

    out, _ = captured
    res = compare_precision([get_adapter(f"dump:{out}")], budget=False)
    rows = res.rows
    assert set(rows.case) == {"ln#0", "rms#0", "hf#0", "gemma#0", "gn#0", "inorm#0"}
    assert set(rows.tensor) >= {"y", "saved_mean", "saved_rstd", "dx", "dgamma", "dbeta"}
    assert not rows.verdict.astype(str).str.endswith("FAIL").any(), rows[rows.verdict.astype(str).str.endswith(
        "FAIL")][["case", "tensor", "why"]].to_string()

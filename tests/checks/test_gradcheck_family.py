"""gradcheck --norm: LayerNorm, RMSNorm, GroupNorm and InstanceNorm.  The identities it relies on hold in torch's
float64 autograd (an independent oracle, before bnprobe relies on them); a correct kernel — careful, emulated,
torch, and a kernel written here from the formulas — passes in fp16, bf16 and fp32; a backward with one planted
mistake fails on the checks that see it, in every format; torch's CPU LayerNorm, whose 16-bit backward sums dγ and
dβ in x's format, fails there alone; the identities' bound is met at its edge and a correct 16-bit kernel uses a
real share of it; what gradcheck cannot run is refused in one line."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import BackwardOutput, BaseAdapter, ForwardOutput, Saved, outputs_only
from bnprobe.checks.gradcheck.family import FAMILY_SHAPES, Layer, _identities, family_inputs, gradcheck_norm
from bnprobe.cli import main
from bnprobe.core.call import NORMS
from bnprobe.core.errors import BNProbeError
from bnprobe.core.kernel import Capabilities
from bnprobe.engine.run import Golden, generated_call, run_call

# (bf16 and fp32 run with the slow tests, .ci/run's second stage: the default suite keeps within its 10 minutes)
FORMATS = ["fp16", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("fp32", marks=pytest.mark.slow)]
LAYERS = {"layer": Layer("layer"), "rms": Layer("rms"), "group": Layer("group", groups=2),
          "instance": Layer("instance")}
_DTYPE = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _failing(res) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(r.check, r.tensor) for r in res.rows if not r.passed]


# ---- the identities, in torch's float64 autograd (no bnprobe) --------------------------------------------------------

def _torch_layer(norm: str, eps: float, offset: float = 0.0):  # noqa: ANN202
    """x, dy, γ as applied, dx, dγ, dβ and the rows (x, dy, g, dx as (rows, R); per-parameter gather) of one torch
    float64 call with autograd."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(7)
    shape = (3, 5, 16) if norm in ("layer", "rms") else (2, 6, 3, 4)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1.7 + 0.8).requires_grad_()
    n = shape[-1] if norm in ("layer", "rms") else shape[1]
    w = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    b = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
    dy = torch.randn(shape, generator=gen, dtype=torch.float64) + 1.0
    if norm == "layer":
        y = F.layer_norm(x, (n,), w + offset, b, eps)
    elif norm == "rms":
        y = F.rms_norm(x, (n,), w + offset, eps)
    elif norm == "group":
        y = F.group_norm(x, 2, w + offset, b, eps)
    else:
        y = F.instance_norm(x, weight=w + offset, bias=b, eps=eps)
    y.backward(dy)
    to = lambda t: t.detach().numpy()  # noqa: E731
    ga = to(w) + offset
    if norm in ("layer", "rms"):
        rows = lambda a: a.reshape(-1, n)  # noqa: E731
        gam = np.broadcast_to(ga, rows(to(x)).shape)
        per_param = lambda a: a.sum(0)  # noqa: E731
    else:
        groups = 2 if norm == "group" else n
        rows = lambda a: a.reshape(shape[0] * groups, -1)  # noqa: E731
        gam = rows(np.broadcast_to(ga[None, :, None, None], shape))
        per_param = lambda a: a.reshape(shape[0], n, -1).sum((0, 2)).reshape(-1)  # noqa: E731
    return (rows(to(x)), rows(dy.numpy()), rows(dy.numpy()) * gam, rows(to(x.grad)), to(w.grad),
            None if norm == "rms" else to(b.grad), per_param, rows)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
@pytest.mark.parametrize("norm", ["layer", "group", "instance"])
def test_the_centred_layers_identities_hold_in_torch_autograd(norm, eps) -> None:  # noqa: ANN001
    """Σdx = 0 per row; Σdx·x̂ = ε·rstd³·Σ(g·x̂) per row — zero only when ε = 0; dβ = Σdy, dγ = Σdy·x̂."""
    xr, dyr, g, dx, dgamma, dbeta, per_param, rows = _torch_layer(norm, eps)
    mu, var = xr.mean(1, keepdims=True), xr.var(1, keepdims=True)
    rstd = 1 / np.sqrt(var + eps)
    xhat = (xr - mu) * rstd
    scale = np.abs(dx).sum(1)
    assert np.all(np.abs(dx.sum(1)) <= 1e-13 * scale)
    want = (eps * rstd**3).ravel() * (g * xhat).sum(1)
    assert np.allclose((dx * xhat).sum(1), want, rtol=1e-9, atol=1e-13 * scale.max())
    if eps == 0.5:  # (the guard: with ε the sum is far from 0, so "Σdx·x̂ = 0" would be wrong)
        assert np.abs(want).max() > 0.1
    assert np.allclose(dbeta, per_param(rows(dyr)), rtol=1e-12, atol=1e-12)
    assert np.allclose(dgamma, per_param(rows(dyr * xhat)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_the_rms_identities_hold_in_torch_autograd(eps, offset) -> None:  # noqa: ANN001
    """Σdx·x = ε·rstd²·Σ(g·x̂) per row — zero only when ε = 0; dγ = Σdy·x̂, with γ applied as offset + w too."""
    xr, dyr, g, dx, dgamma, _, per_param, _ = _torch_layer("rms", eps, offset)
    rstd = 1 / np.sqrt((xr**2).mean(1, keepdims=True) + eps)
    xhat = xr * rstd
    want = (eps * rstd**2).ravel() * (g * xhat).sum(1)
    assert np.allclose((dx * xr).sum(1), want, rtol=1e-9, atol=1e-13 * np.abs(dx * xr).sum(1).max())
    if eps == 0.5:
        assert np.abs(want).max() > 0.1
    assert np.allclose(dgamma, per_param(dyr * xhat), rtol=1e-12, atol=1e-12)


# ---- a kernel written here from the formulas, with one mistake planted or none --------------------------------------

class Written(BaseAdapter):
    """LayerNorm, RMSNorm, GroupNorm and InstanceNorm from their formulas in float64, each output rounded once to
    its format (statistics saved in float64): a correct kernel, or with ``bug`` one mistake in its backward —
    ``sum_g``: dx without its −Σg/R term; ``sum_gx``: without −x̂·Σ(g·x̂)/R; ``offset``: γ without its offset."""

    def __init__(self, bug: str | None = None) -> None:
        self.bug, self.name = bug, f"written{'' if bug is None else ':' + bug}"

    def capabilities(self) -> Capabilities:
        return Capabilities(formats=("fp64", "fp32", "fp16", "bf16"), layouts=("channels_first",), norms=NORMS)

    @staticmethod
    def _parts(p):  # noqa: ANN001, ANN205
        """x as rows, γ (as the call stores it) and β as rows, and how to sum per parameter (its rows are contiguous:
        each layer's statistics run over x's trailing values)."""
        sh, x = p.shape, np.asarray(p.x, dtype=np.float64)
        n = math.prod(sh.param_shape)
        gamma = np.ones(n) if p.gamma is None else p.gamma
        beta = np.zeros(n) if p.beta is None else p.beta
        if sh.norm in ("layer", "rms"):
            rows = lambda v: np.broadcast_to(v, (sh.rows, sh.r))  # noqa: E731
            per_param = lambda a: a.sum(0)  # noqa: E731
        else:
            full = (x.shape[0], x.shape[1], -1)
            rows = lambda v: np.broadcast_to(v[None, :, None], (x.shape[0], x.shape[1], math.prod(x.shape[2:]))  # noqa: E731
                                             ).reshape(sh.rows, sh.r)
            per_param = lambda a: a.reshape(full).sum((0, 2))  # noqa: E731
        return x.reshape(sh.rows, sh.r), gamma, rows, per_param, beta

    def _family_forward_impl(self, p, *, eps: float) -> ForwardOutput:  # noqa: ANN001
        xr, gamma, rows, _, beta = self._parts(p)
        rms = p.shape.norm == "rms"
        mu = np.zeros(len(xr)) if rms else xr.mean(1)
        var = (xr**2).mean(1) if rms else ((xr - mu[:, None]) ** 2).mean(1)
        rstd = 1 / np.sqrt(var + eps)
        y = (xr - mu[:, None]) * rstd[:, None] * rows(gamma + p.call.weight_offset) + (0 if rms else rows(beta))
        return ForwardOutput(y.reshape(p.shape.shape).astype(_DTYPE[p.dtype]),
                             Saved(None if rms else mu, "invstd", rstd))

    def _family_backward_impl(self, p, dy, saved, *, eps: float) -> BackwardOutput:  # noqa: ANN001
        xr, gamma, rows, per_param, _ = self._parts(p)
        rms = p.shape.norm == "rms"
        dyr = np.asarray(dy, dtype=np.float64).reshape(xr.shape)
        rstd = np.asarray(saved.value, dtype=np.float64)[:, None]
        xhat = (xr - (0 if rms else np.asarray(saved.mean, dtype=np.float64)[:, None])) * rstd
        g = dyr * rows(gamma + (0 if self.bug == "offset" else p.call.weight_offset))
        d = g - (0 if self.bug == "sum_gx" else xhat * (g * xhat).mean(1, keepdims=True))
        if not rms and self.bug != "sum_g":
            d = d - g.mean(1, keepdims=True)
        ps, pf = p.shape.param_shape, _DTYPE[p.params]
        return BackwardOutput((rstd * d).reshape(p.shape.shape).astype(_DTYPE[p.dtype]),
                              per_param(dyr * xhat).reshape(ps).astype(pf),
                              None if rms else per_param(dyr).reshape(ps).astype(pf),
                              meta={"missing": ("dbeta",)} if rms else {})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("adapter", ["careful", "emulated", "emulated:{fmt}:variance=welford,lanes=8",
                                     "emulated:{fmt}:y_formula=affine,fma=true", "written"])
@pytest.mark.parametrize("norm", list(LAYERS))
def test_a_correct_kernel_passes(norm, adapter, fmt) -> None:  # noqa: ANN001
    a = Written() if adapter == "written" else adapter.format(fmt=fmt)
    res = gradcheck_norm(a, LAYERS[norm], fmt)
    assert res and not _failing(res)
    checks = {r.check for r in res.rows}
    assert checks == {"finite-differences", "vs-fp64", "identity"}
    assert [r.tensor for r in res.rows if r.check == "vs-fp64"] == ["dx", "dgamma"] + ([] if norm == "rms" else
                                                                                        ["dbeta"])
    # the finite differences are of its own forward where it runs fp64 (a policy of one format's: the reference's)
    own = "fp64" in (get_adapter(a) if isinstance(a, str) else a).capabilities().formats
    assert f"finite differences on {res.adapter if own else 'reference'} in fp64: full Jacobian" in res.notes[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("norm", list(LAYERS))
def test_torchs_kernels_pass_except_layernorms_16_bit_parameter_sums(norm, fmt) -> None:  # noqa: ANN001
    """torch's CPU LayerNorm sums dγ and dβ in x's format when x is 16-bit (compare-precision fails it too): its
    dγ and dβ fail against the golden and their identities, its dx passes; everything else passes."""
    pytest.importorskip("torch")
    res = gradcheck_norm("torch", LAYERS[norm], fmt)
    assert "finite differences on torch in fp64" in res.notes[0]
    if norm == "layer" and fmt != "fp32":
        assert sorted(_failing(res)) == [("identity", "dbeta = sum(dy)"), ("identity", "dgamma = sum(dy*xhat)"),
                                         ("vs-fp64", "dbeta"), ("vs-fp64", "dgamma")]
        why = next(r.detail for r in res.rows if (r.check, r.tensor) == ("vs-fp64", "dgamma"))
        # named as compare-precision and doctor name it: the model of torch's per-thread buffers of x's format
        assert "it matches the model of: dγ, dβ summed in per-thread buffers" in why
    else:
        assert not _failing(res)


@pytest.mark.parametrize("adapter", ["careful", "emulated", "torch", "written"])
def test_gemmas_offset_gamma_passes_when_the_kernel_applies_it(adapter) -> None:  # noqa: ANN001
    if adapter == "torch":
        pytest.importorskip("torch")
    res = gradcheck_norm(Written() if adapter == "written" else adapter, Layer("rms", weight_offset=1.0), "bf16")
    assert res and "γ applied as 1 + w" in res.layer


PLANTED = [("layer", "sum_g"), ("group", "sum_g"), ("instance", "sum_g"), ("rms", "sum_gx"), ("layer", "sum_gx")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("norm,bug", PLANTED)
def test_a_backward_missing_a_term_fails(norm, bug, fmt) -> None:  # noqa: ANN001
    res = gradcheck_norm(Written(bug), LAYERS[norm], fmt)
    failing = _failing(res)
    assert not res
    # its fp64 forward against its backward, and its backward against the golden
    assert ("finite-differences", "dx") in failing and ("vs-fp64", "dx") in failing
    # (dγ and dβ are right: only dx is blamed)
    assert all(t == "dx" for c, t in failing if c != "identity")
    ident = {t for c, t in failing if c == "identity"}
    if bug == "sum_g":  # dx no longer sums to 0 over a row
        assert "sum(dx) = 0" in ident
    elif norm == "rms":
        assert ident == {"sum(dx*x) = sum(g*xhat)*(1-mean(xhat^2))"}
    else:
        assert "sum(dx*xhat) = rstd*sum(g*xhat)*(1-mean(xhat^2))" in ident


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_backward_that_drops_gammas_offset_fails(norm, fmt) -> None:  # noqa: ANN001
    layer = Layer(norm, weight_offset=1.0)
    assert gradcheck_norm(Written(), layer, fmt)  # (the same kernel with the offset applied passes)
    failing = _failing(gradcheck_norm(Written("offset"), layer, fmt))
    assert ("finite-differences", "dx") in failing and ("vs-fp64", "dx") in failing


# ---- the identities' bound: met at its edge, and used --------------------------------------------------------------

def _careful_run(fmt: str):  # noqa: ANN202
    a = outputs_only(get_adapter("careful"))
    rec = generated_call(family_inputs(LAYERS["layer"], FAMILY_SHAPES["layer"], 0).with_(dtype=fmt),
                         modes=("backward",), label="gradcheck")
    return run_call(a, rec, modes=("backward",), golden=Golden(outputs_only(get_adapter("reference")), rec),
                    quiet=True)


def _sum_dx_row(run, fmt: str):  # noqa: ANN001, ANN202
    return next(r for r in _identities(run, fmt) if r.tensor == "sum(dx) = 0")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_sum_of_dx_is_judged_at_its_bound(fmt) -> None:  # noqa: ANN001
    """A row's Σdx one part in 10⁶ inside its bound passes, one part outside fails; the bound read from one probe
    and the residual recomputed here from the formula (Σdx + rstd·Σx̂·Σ(g·x̂)/R)."""
    run = _careful_run(fmt)
    c, k = run.inputs, 5
    r = 16
    dx = np.asarray(run.got["dx"], dtype=np.float64).reshape(-1, r).copy()
    mu = np.asarray(run.saved.mean, dtype=np.float64)[k]
    rstd = np.asarray(run.saved.value, dtype=np.float64)[k]
    xhat = (c.x.reshape(-1, r)[k] - mu) * rstd
    g = c.dy.reshape(-1, r)[k] * c.gamma.reshape(-1)
    r0 = dx[k].sum() + rstd * xhat.sum() * (g * xhat).sum() / r
    s = 1.0 if r0 >= 0 else -1.0

    def binade(v: float) -> float:
        return float(np.floor(np.log2(abs(v))))

    # an element that the probe's move (the largest of the three) keeps in its binade: its ulp is unchanged
    i = next(int(j) for j in np.argsort(-np.abs(dx[k]))
             if binade(dx[k, j] + s * 0.05 * abs(dx[k, j])) == binade(dx[k, j]))

    def judged(delta: float):  # noqa: ANN202
        moved = dx.copy()
        moved[k, i] += delta
        assert binade(moved[k, i]) == binade(dx[k, i])
        run.got["dx"] = moved.reshape(c.x.shape)
        return _sum_dx_row(run, fmt)

    probe = judged(s * 0.05 * abs(dx[k, i]))
    bound = (abs(r0) + 0.05 * abs(dx[k, i])) / probe.used
    inside, outside = judged(s * (bound * (1 - 1e-6) - abs(r0))), judged(s * (bound * (1 + 1e-6) - abs(r0)))
    assert inside.passed and not outside.passed
    assert inside.used == pytest.approx(1.0, abs=2e-6) and outside.used == pytest.approx(1.0, abs=2e-6)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_a_correct_16_bit_kernel_uses_a_real_share_of_the_bound(fmt) -> None:  # noqa: ANN001
    assert _sum_dx_row(_careful_run(fmt), fmt).used > 0.1


# ---- refusals --------------------------------------------------------------------------------------------------------

class ForwardOnly(Written):
    """Runs the layers' forward, and no backward."""

    name = "forward-only"

    def capabilities(self) -> Capabilities:
        return Capabilities(formats=("fp32",), modes=("train", "infer"), layouts=("channels_first",), norms=NORMS)


@pytest.mark.parametrize("adapter,layer,kw,says", [
    ("ascend-tbe", Layer("layer"), {}, "adapter ascend-tbe runs BatchNorm only, not LayerNorm"),
    (ForwardOnly(), Layer("rms"), {}, "gradcheck needs the kernel's backward"),
    ("emulated:fp16-acc16", Layer("layer"), {"dtype": "bf16"}, "does not run bf16"),
    ("careful", Layer("layer", normalized_shape=(5,)), {}, "not x's trailing dimensions"),
    ("careful", Layer("group", groups=3), {}, "groups must divide the 8 channels"),
    ("careful", Layer("batch"), {}, "norm must be one of layer, rms, group, instance here"),
    ("careful", Layer("layer"), {"shape": (4, 6, 1)}, "R = 1"),
    ("careful", Layer("layer"), {"params": "half"}, "params takes"),
    ("careful", Layer("rms"), {"rtol": 1e-3}, "give rtol and atol both"),
])
def test_what_gradcheck_cannot_run_is_refused_in_one_line(adapter, layer, kw, says) -> None:  # noqa: ANN001
    with pytest.raises(BNProbeError) as e:
        gradcheck_norm(adapter, layer, **kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_dump_is_refused(tmp_path, capsys) -> None:  # noqa: ANN001
    assert main(["dump", "--adapter", "careful", "--shape", "2,3,4,4", "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    with pytest.raises(BNProbeError, match="LayerNorm from a dump is not read yet"):
        gradcheck_norm(f"dump:{tmp_path / 'd'}", "layer")


@pytest.mark.parametrize("args,says", [
    (["--adapter", "ascend-tbe"], "adapter ascend-tbe runs BatchNorm only, not LayerNorm"),
    (["--formula", "seed"], "--formula checks a BatchNorm backward formula"),
    (["--input", "somewhere"], "LayerNorm from a dump is not read yet; drop --input"),
    (["--mode", "infer"], "--mode infer: LayerNorm keeps no running statistics"),
    (["--num-groups", "2"], "--num-groups applies to --norm group"),
    (["--normalized-shape", "5"], "not x's trailing dimensions"),
])
def test_the_command_refuses_in_one_line(capsys, args, says) -> None:  # noqa: ANN001
    code = main(["gradcheck", "--norm", "layer", *args])
    _, err = capsys.readouterr()
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_the_command_runs_the_layer_and_says_which(capsys) -> None:  # noqa: ANN001
    code = main(["gradcheck", "--norm", "group", "--num-groups", "4", "--adapter", "careful", "--dtype", "bf16",
                 "--shape", "2,8,3,3", "--mean", "3"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.startswith("gradcheck careful GroupNorm of 4 groups in bf16, train, shape (2, 8, 3, 3), seed 0: PASS")


@pytest.mark.parametrize("norm,shape,bug,part", [
    ("layer", (2, 64, 256), "sum_g", "on rows 0-7 of 128"), ("rms", (2, 64, 256), "sum_gx", "on rows 0-7 of 128"),
    ("group", (2, 16, 12, 12), "sum_g", "on sample 0 of 2")])
def test_a_large_call_is_differenced_on_its_first_rows_and_still_sees_a_planted_mistake(norm, shape, bug,
                                                                                       part) -> None:  # noqa: ANN001
    good, bad = (gradcheck_norm(Written(b), LAYERS[norm], "fp32", shape) for b in (None, bug))
    assert good and f"finite differences on written in fp64 {part}: random projections" in good.notes[0]
    fd = [r.tensor for r in bad.rows if r.check == "finite-differences" and not r.passed]
    assert "dx (v^T J u)" in fd and "sampled entries" in fd

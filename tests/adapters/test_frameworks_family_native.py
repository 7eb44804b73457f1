"""Paddle's and MindSpore's LayerNorm, RMSNorm and GroupNorm through their adapters: the adapter's outputs are the
framework's own function's, called directly here (bit for bit, forward and autodiff backward); compare-precision
judges each against the FP64 golden in every format it runs — MindSpore's and Paddle's LayerNorm pass, Paddle's CPU
GroupNorm fails on large means, and a float32 replay of its one-pass variance (E[x²] − E[x]², from its source)
reproduces that error while a two-pass one does not; what a framework cannot run on the CPU is refused in one line.

Each framework is an optional extra: these tests skip where it is not installed (the default suite), and
``.ci/frameworks`` runs them in the framework's own virtual environment."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.checks.compare.precision import CallOptions, compare_precision
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError

from tests.framework_replays import mindspore_layer_replay, paddle_group_replay

F32 = np.float32
# adapter: the (layer, format, params) it runs
RUNS = {
    "paddle": [("layer", "fp32", "fp32"), ("layer", "fp64", "fp32"), ("rms", "fp32", "fp32"),
               ("group", "fp32", "fp32"), ("group", "fp64", "fp32")],
    "mindspore": [("layer", "fp32", "fp32"), ("layer", "fp16", "fp32"), ("layer", "fp16", "same"),
                  ("group", "fp32", "fp32"), ("group", "fp16", "same")],
}
NP = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16}


def _adapter(name: str):  # noqa: ANN202
    why = why_unavailable(name)
    if why:
        pytest.skip(why)
    return get_adapter(name)


def _call(norm: str, fmt: str, params: str, *, seed: int = 0, beta: bool = True, offset: float = 0.0) -> BNCall:
    rng = np.random.default_rng([seed, 55])
    if norm == "group":
        x, ps, kw = rng.standard_normal((3, 6, 4, 5)) * 2 + 1, (6,), {"groups": 3}
    else:
        x, ps, kw = rng.standard_normal((2, 3, 4, 13)) * 2 + 1, (4, 13), {"normalized_shape": (4, 13)}
    return BNCall(x, rng.uniform(0.5, 2, ps), rng.standard_normal(ps) if beta and norm != "rms" else None,
                  dy=rng.standard_normal(x.shape), norm=norm, dtype=fmt, params=params, eps=1e-5,
                  weight_offset=offset, **kw)


def _np(a: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(NP[fmt])


def _paddle_direct(c: BNCall) -> dict[str, np.ndarray]:
    """Paddle's own function on the call, and its autograd with the call's dy (float32 parameters: Paddle's)."""
    import paddle
    import paddle.incubate.nn.functional as incubate

    fmt = c.dtype
    x = paddle.to_tensor(_np(c.x, fmt), stop_gradient=False)
    w = paddle.to_tensor(_np(np.reshape(c.gamma, -1), fmt), stop_gradient=False)
    leaves = [x, w]
    b = None
    if c.beta is not None:
        b = paddle.to_tensor(_np(np.reshape(c.beta, -1), fmt), stop_gradient=False)
        leaves.append(b)
    we = w + c.weight_offset if c.weight_offset else w
    if c.norm == "layer":
        y = paddle.nn.functional.layer_norm(x, list(c.normalized_shape), we, b, c.eps)
    elif c.norm == "rms":
        return {"y": incubate.fused_rms_norm(x, we, None, c.eps, x.ndim - len(c.normalized_shape))[0].numpy()}
    else:
        y = paddle.nn.functional.group_norm(x, c.groups, c.eps, we, b, "NCHW")
    grads = paddle.grad([y], leaves, [paddle.to_tensor(_np(c.dy, fmt))])
    return {"y": y.numpy(), "dx": grads[0].numpy(), "dgamma": grads[1].numpy(),
            **({"dbeta": grads[2].numpy()} if b is not None else {})}


def _mindspore_direct(c: BNCall) -> dict[str, np.ndarray]:
    """MindSpore's own layer (nn.LayerNorm, nn.GroupNorm with the call's γ and β) and its gradient with the call's
    dy; GroupNorm's statistics from the primitive ops.group_norm calls."""
    import mindspore as ms

    fmt, pf = c.dtype, (c.dtype if c.params == "same" else "fp32")
    x = ms.Tensor(_np(c.x, fmt))
    g = np.asarray(c.gamma, dtype=np.float64)
    b = np.zeros_like(g) if c.beta is None else np.asarray(c.beta, dtype=np.float64)
    if c.norm == "layer" and pf != fmt:  # (fp32 γ, β with fp16 x: the primitive itself; nn.LayerNorm casts them)
        axis = x.ndim - len(c.normalized_shape)
        args = [x, ms.Tensor(_np(g, pf)), ms.Tensor(_np(b, pf))]
        prim = ms.ops.LayerNorm(axis, axis, c.eps)
        y = prim(*args)[0].asnumpy()
        _, vjp = ms.vjp(lambda *a: prim(*a)[0], *args)
        dx, dg, db = (t.asnumpy() for t in vjp(ms.Tensor(_np(c.dy, fmt))))
        return {"y": y, "dx": dx, "dgamma": dg, **({"dbeta": db} if c.beta is not None else {})}
    if c.norm == "layer":
        axis = x.ndim - len(c.normalized_shape)
        cell = ms.nn.LayerNorm(tuple(c.normalized_shape), begin_norm_axis=axis, begin_params_axis=axis,
                               epsilon=c.eps, dtype=ms.float16 if pf == "fp16" else ms.float32)
        stats = {}
    else:
        from mindspore.ops.auto_generate.gen_ops_prim import group_norm_op

        cell = ms.nn.GroupNorm(c.groups, x.shape[1], eps=c.eps)
        _, mean, rstd = group_norm_op(x, c.groups, ms.Tensor(_np(g, pf)), ms.Tensor(_np(b, pf)), c.eps)
        stats = {"saved_mean": mean.asnumpy().reshape(-1), "saved_rstd": rstd.asnumpy().reshape(-1)}
    cell.gamma.set_data(ms.Tensor(_np(g, pf)))
    cell.beta.set_data(ms.Tensor(_np(b, pf)))
    y = cell(x)
    dx, (dg, db) = _ms_grads(ms, cell, x, _np(c.dy, fmt))
    out = {"y": y.asnumpy(), "dx": dx, "dgamma": dg, **stats}
    if c.beta is not None:
        out["dbeta"] = db
    return out


def _ms_grads(ms, cell, x, dy):  # noqa: ANN001, ANN202
    """dx, (dγ, dβ) of ``cell`` at x with the sensitivity dy (MindSpore's GradOperation over the cell's input and
    parameters)."""
    params = ms.ParameterTuple(cell.trainable_params())
    (dx,), pg = ms.ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(cell, params)(x, ms.Tensor(dy))
    return dx.asnumpy(), (pg[0].asnumpy(), pg[1].asnumpy())


@pytest.mark.parametrize("name,norm,fmt,params", [(n, *r) for n, rs in RUNS.items() for r in rs])
def test_the_adapter_returns_the_frameworks_own_outputs(name: str, norm: str, fmt: str, params: str) -> None:
    a = _adapter(name)
    c = _call(norm, fmt, params)
    f = a.train(c)
    want = _paddle_direct(c) if name == "paddle" else _mindspore_direct(c)
    assert f.y.dtype == NP[fmt] and np.array_equal(f.y, want["y"])
    if "saved_mean" in want:  # (MindSpore's GroupNorm: the mean and rstd its primitive returns)
        assert np.array_equal(f.saved.mean, want["saved_mean"]) and np.array_equal(f.saved.value, want["saved_rstd"])
    else:  # (they save the variance, not the rstd the interface takes: declared, none returned)
        assert f.saved is None and norm in a.capabilities().unsaved_norms
    if norm == "rms":  # (Paddle's CPU RMSNorm has no backward)
        with pytest.raises(BNProbeError, match="no CPU backward for RMSNorm"):
            a.backward_of(c, f.saved)
        return
    b = a.backward_of(c, f.saved)
    ps = np.shape(c.gamma)
    assert np.array_equal(b.dx, want["dx"])
    assert np.array_equal(b.dgamma, want["dgamma"].reshape(ps)) and np.array_equal(b.dbeta,
                                                                                     want["dbeta"].reshape(ps))


@pytest.mark.parametrize("name,norm", [("paddle", "layer"), ("paddle", "group"), ("mindspore", "layer"),
                                       ("mindspore", "group")])
def test_without_beta_and_with_gemmas_offset_the_adapter_still_is_the_framework(name: str, norm: str) -> None:
    a = _adapter(name)
    c = _call(norm, "fp32", "fp32", seed=1, beta=False, offset=1.0 if name == "paddle" else 0.0)
    f = a.train(c)
    b = a.backward_of(c, f.saved)
    want = _paddle_direct(c) if name == "paddle" else _mindspore_direct(c)
    assert np.array_equal(f.y, want["y"]) and np.array_equal(b.dx, want["dx"]) and b.dbeta is None


def _failing(res) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(r.case, r.tensor) for r in res.rows.itertuples() if str(r.verdict).endswith("FAIL")]


@pytest.mark.parametrize("name,norm,fmt,params", [(n, *r) for n, rs in RUNS.items() for r in rs
                                                  if r not in (("group", "fp32", "fp32"), ("layer", "fp16", "same"))
                                                  or n == "mindspore" and r[0] == "group"])
def test_compare_precision_passes_the_kernel_against_the_fp64_golden(name: str, norm: str, fmt: str,
                                                                     params: str) -> None:
    a = _adapter(name)
    res = compare_precision([a], (fmt,), mode="train" if norm == "rms" else "all",
                            options=CallOptions(norm=norm, params=params, groups=4 if norm == "group" else None))
    assert len(res.rows) > 0
    assert not _failing(res), _failing(res)


def _group_replay(x: np.ndarray, groups: int, eps: float, *, one_pass: bool) -> np.ndarray:
    """GroupNorm in float32 scalar steps as Paddle's CPU kernel (phi/kernels/cpu/group_norm_kernel.cc) writes it:
    per channel 8 lanes of Σx and Σx², added in order into sums carried across the group's channels, the tail
    last; mean = Σx/R, var = max(Σx²/R − mean², 0) (``one_pass``), or the two-pass Σ(x − mean)²/R."""
    n, c = x.shape[:2]
    xr = x.reshape(n, c, -1).astype(F32)
    hw, cg = xr.shape[2], c // groups
    y = np.empty_like(xr)
    for i in range(n):
        for gi in range(groups):
            chans = range(gi * cg, (gi + 1) * cg)
            m, v = F32(0), F32(0)
            for ch in chans:
                row, full = xr[i, ch], hw - hw % 8
                ma, va = np.zeros(8, F32), np.zeros(8, F32)
                for k in range(0, full, 8):
                    ma, va = ma + row[k:k + 8], va + row[k:k + 8] * row[k:k + 8]
                for lane in range(8):
                    m, v = F32(m + ma[lane]), F32(v + va[lane])
                for k in range(full, hw):
                    m, v = F32(m + row[k]), F32(v + F32(row[k] * row[k]))
            m = F32(m / F32(cg * hw))
            if one_pass:
                v = max(F32(F32(v / F32(cg * hw)) - F32(m * m)), F32(0))
            else:
                v = F32(sum((F32(t) for t in ((xr[i, list(chans)] - m) ** 2).reshape(-1)), F32(0)) / F32(cg * hw))
            inv = F32(F32(1) / F32(np.sqrt(F32(v + F32(eps)))))
            y[i, list(chans)] = (xr[i, list(chans)] - m) * inv
    return y.reshape(x.shape)


def test_paddle_groupnorm_fails_on_large_means_and_its_one_pass_variance_is_why() -> None:
    a = _adapter("paddle")
    res = compare_precision([a], ("fp32",), options=CallOptions(norm="group", groups=4))
    failing = _failing(res)
    assert failing and {case for case, _ in failing} <= {"stress/mean=100", "stress/var-near-eps"}, failing
    # independently: a float32 replay of its source's one-pass variance errs as Paddle does; a two-pass one does not
    rng = np.random.default_rng(3)
    x = (100 + rng.standard_normal((2, 8, 3, 5))).astype(F32).astype(np.float64)
    y = a.train(BNCall(x, None, None, norm="group", groups=2, dtype="fp32", eps=1e-5)).y.astype(np.float64)
    xg = x.reshape(2, 2, -1)
    gold = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    one, two = (_group_replay(x, 2, 1e-5, one_pass=p).astype(np.float64) for p in (True, False))
    err = np.abs(y - gold).max()
    assert err > 1e-3  # (thousands of ulps of values near 1)
    # the one-pass replay: within a few ulps of Paddle's y (|y| < 4), a thousandth of its error
    assert np.abs(y - one).max() <= 4 * 2.0**-22 < err / 1000
    assert np.abs(two - gold).max() < 1e-2 * err  # a two-pass variance in the same float32 steps: no such error


@pytest.mark.parametrize("name,call,message", [
    ("paddle", dict(norm="rms", dtype="fp64"), "runs fp32 only"),
    ("paddle", dict(norm="layer", dtype="fp32", normalized_shape=(4, 6)), "normalises after a leading dimension"),
    ("paddle", dict(norm="layer", dtype="fp16"), "does not run fp16"),
    ("mindspore", dict(norm="rms", dtype="fp32"), "runs BatchNorm, LayerNorm, GroupNorm only, not RMSNorm"),
    ("mindspore", dict(norm="group", groups=2, dtype="fp16", params="fp32"), "use params same"),
])
def test_what_the_cpu_kernels_do_not_run_is_refused_in_one_line(name: str, call: dict, message: str) -> None:
    a = _adapter(name)
    x = np.random.default_rng(0).standard_normal((4, 6))
    with pytest.raises(BNProbeError, match=message) as e:
        a.train(BNCall(x, **call))
    assert "\n" not in str(e.value)


def test_mindspore_layernorm_with_fp16_parameters_fails_on_y_where_fp32_ones_pass() -> None:
    """nn.LayerNorm casts γ and β to an fp16 x's format: MindSpore 2.10's CPU LayerNorm then loses accuracy in y
    (up to thousands of times the bound on a large mean), while the same primitive with fp32 γ and β passes (above)."""
    a = _adapter("mindspore")
    res = compare_precision([a], ("fp16",), options=CallOptions(norm="layer", params="same"))
    failing = _failing(res)
    assert ("stress/mean=100", "y") in failing and {t for _, t in failing} <= {"y", "dx"}, failing
    # named by the model of what its source does (every step in fp16, dividing by σ): each failing y
    rows = res.rows[res.rows.verdict.astype(str).str.endswith("FAIL")]
    assert set(rows[rows.tensor == "y"].cause) == {"normalised-in-16-bit"}, rows[["case", "tensor", "cause"]]


# ---- what each failing kernel computes: replayed from its source in plain numpy (tests/framework_replays.py) ------
H = np.float16


def test_paddle_groupnorm_is_its_source_replayed_bit_for_bit_and_its_bnprobe_policy() -> None:
    from bnprobe.kernels.layout import NormShape
    from bnprobe.kernels.norms import forward

    _adapter("paddle")
    import paddle

    policy = "fp32:variance=naive,clamp_var=true,order=lanes_tail,lanes=8,rstd_format=fp64"
    rng = np.random.default_rng(11)
    tells = {"float eps": 0, "two-pass": 0}
    for shape, groups, mean, std in (((2, 8, 3, 5), 2, 100, 1), ((2, 64, 8, 8), 4, 100, 1),
                                     ((2, 64, 8, 8), 4, 0.5, 1e-5**0.5), ((3, 6, 7, 3), 3, 1, 2),
                                     ((2, 12, 1, 1), 3, 5, 1), ((1, 4, 9), 1, -3, 0.1)):
        x = (mean + std * rng.standard_normal(shape)).astype(F32)
        g, b = rng.uniform(0.5, 2, shape[1]).astype(F32), rng.standard_normal(shape[1]).astype(F32)
        y = paddle.nn.functional.group_norm(paddle.to_tensor(x), groups, 1e-5, paddle.to_tensor(g),
                                            paddle.to_tensor(b), "NCHW").numpy()
        assert np.array_equal(paddle_group_replay(x, groups, 1e-5, g, b), y)
        sh = NormShape.of("group", shape, groups=groups)
        emu = forward(x.astype(float), g.astype(float), b.astype(float), shape=sh, eps=1e-5, policy=policy,
                      keep_arrays=False, counters=False).y
        assert np.array_equal(emu, y)
        # guards: the replay's choices are seen (ε added in float32, or a two-pass variance, miss)
        for name, p in (("float eps", policy.replace(",rstd_format=fp64", "")),
                        ("two-pass", policy.replace("variance=naive", "variance=two_pass"))):
            tells[name] += int((forward(x.astype(float), g.astype(float), b.astype(float), shape=sh, eps=1e-5,
                                        policy=p, keep_arrays=False, counters=False).y != y).sum())
    assert tells["float eps"] > 0 and tells["two-pass"] > 1000, tells


def test_mindspore_fp16_layernorm_is_its_source_replayed_bit_for_bit_and_its_bnprobe_policy() -> None:
    from bnprobe.kernels.layout import NormShape
    from bnprobe.kernels.norms import forward

    _adapter("mindspore")
    import mindspore as ms

    policy = "fp16:params=fp16,compute=fp16,rsqrt=sqrt_div,y_formula=xhat_div"
    rng = np.random.default_rng(5)
    misses = 0
    for mean, std, hid in ((100, 1, 1024), (0, 1, 768), (0, 200, 4096), (0, 3e-3, 1024), (3, 0.5, 77)):
        x = (mean + std * rng.standard_normal((8, hid))).astype(H)
        g, b = rng.uniform(0.5, 2, hid).astype(H), rng.standard_normal(hid).astype(H)
        y = ms.ops.LayerNorm(1, 1, 1e-7)(ms.Tensor(x), ms.Tensor(g), ms.Tensor(b))[0].asnumpy()
        assert np.array_equal(mindspore_layer_replay(x, g, b, 1e-7), y)
        sh = NormShape.of("layer", x.shape, (hid,))
        emu = forward(x.astype(float), g.astype(float), b.astype(float), shape=sh, eps=1e-7, policy=policy,
                      keep_arrays=False, counters=False).y
        assert np.array_equal(emu, y)
        # guard: multiplying by rstd rather than dividing by σ misses
        misses += int((forward(x.astype(float), g.astype(float), b.astype(float), shape=sh, eps=1e-7,
                               policy=policy.replace(",y_formula=xhat_div", ""), keep_arrays=False,
                               counters=False).y != y).sum())
        if mean == 100:  # the mean rounded to fp16 (ulp 1/16 at 100) is what errs: a float32 mean does not
            xd = x.astype(np.float64)
            gold = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-7) * g + b
            exact_mean = H(H(H(H(F32(x) - F32(xd.mean(-1, keepdims=True))) / H(np.sqrt(xd.var(-1, keepdims=True))))
                             * g) + b)
            assert np.abs(y - gold).max() > 4 * np.abs(exact_mean - gold).max()
    assert misses > 0


@pytest.mark.parametrize("name,norm,fmt,kw,want", [
    ("paddle", "group", "fp32", {"groups": 2},
     {"variance": "naive", "clamp_var": True, "order": "lanes_tail", "lanes": 8, "rstd_format": "fp64"}),
    ("mindspore", "layer", "fp16", {"params": "same"},
     {"compute": "fp16", "y_formula": "xhat_div", "rsqrt": "sqrt_div"}),
])
def test_identify_reproduces_the_failing_forward_bit_for_bit_and_departs_at_its_backward(
        name: str, norm: str, fmt: str, kw: dict, want: dict) -> None:
    """What the replays established, found by identify's own search: Paddle's GroupNorm (one pass, clamped, eight
    lanes per channel, rstd in double) and MindSpore's fp16 LayerNorm (every step in fp16, dividing by σ); their
    backward kernels are outside the space."""
    from bnprobe.checks.identify.family import identify_family

    res = identify_family(_adapter(name), norm, fmt, **kw)
    y = next(o for o in res.outputs if o.output == "y")
    assert y.probes_exact and y.fresh_exact and res.departs == "backward", res.found()
    assert {k: getattr(res.policy, k) for k in want} == want

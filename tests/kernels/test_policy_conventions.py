"""The policy fields real kernels need beyond PyTorch's conventions — the running update's meaning of momentum,
Bessel's factor and format, inference's own formula, the batch rstd in double, the at::vec order and PyTorch CPU's
backward — against formulas written here in float64 and numpy float32, and against torch itself."""

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels import Execution, backward, forward_infer, forward_train, get_policy

TORCH_CPU = ("order=vec,lanes=8,unroll=2,rstd_format=fp64,rsqrt=sqrt_div,y_formula=affine,fma=true,"
             "unbiased_by=divide,backward_formula=torch")
TORCH_FMA = {"fp16": "all", "bf16": "body"}  # the backward's Σ(x - mean)·dy tail is fused for fp16 only


def call(shape=(4, 3, 5, 7), seed=0, mean=3.0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    return (rng.standard_normal(shape) * 2 + mean, rng.uniform(0.5, 2, c), rng.normal(0, 1, c), rng.normal(0, 1, c),
            rng.uniform(0.5, 2, c))


@pytest.mark.parametrize("momentum_of,var", [("new", "unbiased"), ("old", "biased"), ("old", "unbiased")])
def test_running_update_conventions_in_fp64(momentum_of, var):
    x, g, b, rm, rv = call()
    m = 0.9 if momentum_of == "old" else 0.1
    r = forward_train(x, g, b, rm, rv, momentum=m, policy=get_policy("fp64").with_options(
        running_momentum=momentum_of, running_var=var))
    mean, v = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    n = x.size // x.shape[1]
    batch_w = m if momentum_of == "new" else 1 - m
    v_batch = v * n / (n - 1) if var == "unbiased" else v
    np.testing.assert_allclose(r.running_mean, (1 - batch_w) * rm + batch_w * mean, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(r.running_var, (1 - batch_w) * rv + batch_w * v_batch, rtol=1e-13, atol=1e-14)


def test_unbiased_by_division_is_the_sum_of_squares_over_r_minus_1_in_fp32():
    x, g, b, rm, rv = call(shape=(3, 2, 1, 5))
    x = x.astype(np.float32).astype(np.float64)
    pol = get_policy("fp32").with_options(order="sequential", unbiased_by="divide")
    r = forward_train(x, g, b, rm, rv, momentum=0.5, policy=pol)
    for c in range(2):
        xs = x[:, c].ravel().astype(np.float32)
        s = np.float32(0)
        for v in xs:
            s = np.float32(s + v)
        mean = np.float32(s / np.float32(xs.size))
        q = np.float32(0)
        for v in xs:
            d = np.float32(v - mean)
            q = np.float32(q + np.float32(d * d))
        unb = np.float32(q / np.float32(xs.size - 1))
        want = np.float32(np.float32(np.float32(0.5) * np.float32(rv[c])) + np.float32(np.float32(0.5) * unb))
        assert np.float32(r.running_var[c]) == want


def test_rstd_in_double_then_rounded():
    x, g, b, rm, rv = call()
    r = forward_train(x.astype(np.float16), g, b, rm, rv,
                      policy=get_policy("fp16").with_options(
        rstd_format="fp64", rsqrt="sqrt_div"),
                      execution=Execution(keep_arrays=False))
    want = (1.0 / np.sqrt(np.asarray(r.var, dtype=np.float32).astype(np.float64) + 1e-5)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(r.invstd, dtype=np.float32), want)


def test_inference_formula_of_its_own():
    x, g, b, rm, rv = call(mean=300.0)
    rm = x.mean(axis=(0, 2, 3)) + 0.1  # a large running mean: y = A·x + B cancels
    xs = x.astype(np.float16)
    own = forward_infer(xs, g, b, rm, rv, policy=get_policy("fp16").with_options(infer_y_formula="affine")).y
    fold = forward_infer(xs, g, b, rm, rv, policy=get_policy("fp16").with_options(y_formula="affine")).y
    plain = forward_infer(xs, g, b, rm, rv, policy=get_policy("fp16")).y
    np.testing.assert_array_equal(own, fold)
    assert not np.array_equal(own, plain)  # (the folded form loses more at mean 300: the field must matter)


def test_backward_fma_needs_the_vec_order():
    with pytest.raises(BNProbeError, match="order=vec"):
        get_policy("fp16:backward_fma=all")


def test_plane_sums_are_the_torch_backward_s_and_take_its_fused_tail():
    """backward_sums=plane_reduce is PyTorch's backward's: with another formula it is an error; it takes
    backward_fma whatever the forward's order."""
    with pytest.raises(BNProbeError, match="backward_formula=torch"):
        get_policy("fp32:backward_sums=plane_reduce")
    pol = get_policy("fp32:order=sequential,backward_formula=torch,backward_sums=plane_reduce,backward_fma=tail")
    assert (pol.order, pol.backward_fma) == ("sequential", "tail")


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_the_pytorch_cpu_recipe_is_torch_bit_for_bit(fmt):
    torch = pytest.importorskip("torch")
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    pol = get_policy(f"{fmt}:{TORCH_CPU},backward_fma={TORCH_FMA[fmt]}")
    rng = np.random.default_rng(11)
    for _ in range(12):
        n, c, hw = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(2, 70))
        x = torch.tensor(rng.standard_normal((n, c, hw)) * rng.uniform(0.1, 5) + rng.choice([0, 30, 1000])).to(tdt)
        dy = torch.tensor(rng.standard_normal((n, c, hw)) + rng.normal(0, 1, (1, c, 1))).to(tdt)
        g, b = torch.tensor(rng.uniform(0.3, 3, c), dtype=torch.float32), torch.tensor(rng.normal(0, 1, c),
                                                                                      dtype=torch.float32)
        rm, rv = torch.tensor(rng.normal(0, 1, c), dtype=torch.float32), torch.tensor(rng.uniform(.5, 2, c),
                                                                                     dtype=torch.float32)
        rm0, rv0 = rm.numpy().copy(), rv.numpy().copy()
        y, sm, si = torch.native_batch_norm(x, g, b, rm, rv, True, 0.1, 1e-5)
        yi = torch.nn.functional.batch_norm(x, torch.tensor(rm0), torch.tensor(rv0), g, b, False, 0.1, 1e-5)
        dx, dg, db = torch.ops.aten.native_batch_norm_backward(dy, x, g, None, None, sm, si, True, 1e-5, [True] * 3)

        def f64(t):
            return t.float().numpy().astype(np.float64)

        xs, dys = f64(x), f64(dy)
        r = forward_train(xs, g.numpy(), b.numpy(), rm0, rv0, momentum=0.1, policy=pol,
                          execution=Execution(keep_arrays=False))
        ri = forward_infer(xs, g.numpy(), b.numpy(), rm0, rv0, policy=pol, execution=Execution(keep_arrays=False))
        rb = backward(dys, xs, g.numpy(), sm.numpy(), si.numpy(), policy=pol, execution=Execution(keep_arrays=False))
        for mine, theirs in ((r.y, y), (r.mean, sm), (r.invstd, si), (r.running_mean, rm), (r.running_var, rv),
                             (ri.y, yi), (rb.dx, dx), (rb.dgamma, dg), (rb.dbeta, db)):
            np.testing.assert_array_equal(np.asarray(mine, dtype=np.float64), f64(theirs))


def test_unbiased_by_division_undoes_a_prescaled_sum():
    x, g, b, rm, rv = call()
    r = forward_train(x, g, b, rm, rv, momentum=1.0, policy=get_policy("fp32").with_options(
        mean_by="prescaled", unbiased_by="divide"))
    np.testing.assert_allclose(r.running_var, x.var(axis=(0, 2, 3), ddof=1), rtol=1e-5)


def test_the_torch_backward_counts_its_events():
    rng = np.random.default_rng(0)
    pol = get_policy("fp16-acc16").with_options(order="vec", lanes=8, backward_formula="torch", backward_fma="body")
    x = rng.standard_normal((2, 3, 4, 8)) * 200
    r = backward(x * 1.5, x, None, np.zeros(3), np.full(3, 32.0), policy=pol)
    assert sum(st.count("overflow") for st in r.trace) > 0

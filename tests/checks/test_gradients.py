"""gradcheck against deliberately wrong kernels, torch, the seed formula and tightened tolerances."""

import importlib.util

import numpy as np
import pytest

from bnprobe.adapters import BackwardOutput
from bnprobe.adapters.emulated import ReferenceAdapter
from bnprobe.checks.gradcheck.gradients import check_formula, formula_ascend, formula_standard, gradcheck, make_inputs
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.metrics import cosine
from bnprobe.core.tolerances import grad_tolerance


class Buggy(ReferenceAdapter):
    """The FP64 reference with one classic backward bug (as a user's plugin kernel would have)."""

    def __init__(self, bug):
        super().__init__()
        self.bug = bug
        self.name = f"buggy:{bug}"

    def _backward_impl(self, p, dy, saved, *, eps, training):
        x = p.x
        ax = (0,) + tuple(range(2, x.ndim))
        col = lambda v: np.asarray(v).reshape((1, -1) + (1,) * (x.ndim - 2))  # noqa: E731
        mean, var, g = saved.mean, saved.var(eps), p.vectors["gamma"]
        xhat = (x - col(mean)) / np.sqrt(col(var) + eps)
        dbeta = dy.sum(axis=ax)
        dgamma = (dy * xhat).sum(axis=ax)
        factor = g / np.sqrt(var + eps)
        z = xhat
        if self.bug == "missing-sqrt":
            factor = g / (var + eps)
        elif self.bug == "x-not-xhat":
            z = x
        elif self.bug == "dgamma-without-rstd":
            dgamma = (dy * (x - col(mean))).sum(axis=ax)
        elif self.bug == "dbeta-mean":
            dbeta = dy.mean(axis=ax)
        if training:
            dx = col(factor) * (dy - dy.mean(axis=ax, keepdims=True) - z * (dy * z).mean(axis=ax, keepdims=True))
        else:
            dx = dy * col(factor)
        return BackwardOutput(dx, dgamma, dbeta)


@pytest.mark.parametrize("bug,tensor", [("missing-sqrt", "dx"), ("x-not-xhat", "dx"),
                                        ("dgamma-without-rstd", "dgamma"), ("dbeta-mean", "dbeta")])
def test_a_buggy_backward_fails_on_the_right_tensor(bug, tensor):
    r = gradcheck(Buggy(bug), "fp64", (4, 2, 3, 3))
    assert not r
    fd = {row.tensor for row in r.failed() if row.check == "finite-differences"}
    vs = {row.tensor for row in r.failed() if row.check == "vs-fp64"}
    assert fd == {tensor} and vs == {tensor}
    # and where it can be seen, the identities point at it too
    if bug == "dbeta-mean":
        assert "dbeta = sum(dy)" in {row.tensor for row in r.failed()}


def test_reference_passes_in_both_modes():
    assert gradcheck("reference", "fp64")
    assert gradcheck("reference", "fp64", mode="infer")
    assert gradcheck("reference", "fp64", (16, 8, 10, 10))  # projections path


def test_torch_passes():
    pytest.importorskip("torch")
    for dtype in ("fp64", "fp32", "fp16", "bf16"):
        for params in ("fp32", "same"):
            assert gradcheck("torch", dtype, (4, 2, 3, 3), params=params), (dtype, params)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(3))
def test_low_precision_emulation_passes_default_and_fails_tightened_tolerances(dtype, seed):
    small = (4, 2, 3, 3)
    assert gradcheck("emulated", dtype, small, seed=seed)
    assert gradcheck("emulated", dtype, small, seed=seed, mode="infer")
    tight = gradcheck("emulated", dtype, small, seed=seed, rtol=1e-6, atol=1e-7)  # far below one ULP of the format
    assert not tight and "dx" in {r.tensor for r in tight.failed() if r.check == "vs-fp64"}


def test_smallest_passing_tolerance_is_reported_honestly():
    r = gradcheck("emulated", "fp16")
    dx = next(row for row in r.rows if row.check == "vs-fp64" and row.tensor == "dx")
    # passing exactly at the reported atol (with the same rtol) and failing just below it
    at_limit = gradcheck("emulated", "fp16", rtol=dx.rtol, atol=dx.min_atol * 1.0001 + 1e-300)
    below = gradcheck("emulated", "fp16", rtol=0.0, atol=dx.max_abs * 0.99)
    assert next(x for x in at_limit.rows if x.check == "vs-fp64" and x.tensor == "dx").passed
    assert not next(x for x in below.rows if x.check == "vs-fp64" and x.tensor == "dx").passed


def test_seed_formula_fails_and_the_fix_is_named():
    r = check_formula("seed")
    assert not r
    by = {row.tensor: row.passed for row in r.rows if row.check == "formula"}
    assert by == {"seed as printed: dx": False, "seed with √ on the factor: dx": False,
                  "seed with x̂ in place of X: dx": False, "seed with both corrections: dx": True}
    assert any("γ/√(σ²+ε)" in n and "x̂" in n for n in r.notes)


@pytest.mark.parametrize("name", ["standard", "ascend"])
def test_correct_formulas_pass(name):
    assert check_formula(name)


def test_formula_identities_by_hand():
    """The two correct forms agree with each other (independent algebra) and with finite differences."""
    inp = make_inputs((3, 2, 4), 1)
    mean = inp.x.mean(axis=(0, 2))
    var = inp.x.var(axis=(0, 2))
    a = formula_standard(inp.dy, inp.x, inp.gamma, mean, var, 1e-5)
    b = formula_ascend(inp.dy, inp.x, inp.gamma, mean, var, 1e-5)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def user_formula(dy, x, gamma, mean, var, eps):
    return formula_standard(dy, x, gamma, mean, var, eps) * 1.01  # 1% off


def test_user_formula_by_module_path():
    r = check_formula("tests.checks.test_gradients:user_formula")
    assert not r and any(row.tensor.endswith("dx") for row in r.failed())
    with pytest.raises(BNProbeError, match="unknown formula"):
        check_formula("nope")


def test_bad_arguments():
    with pytest.raises(BNProbeError, match="rtol and atol both"):
        gradcheck("emulated", "fp16", rtol=1e-3)
    with pytest.raises(BNProbeError, match="does not run fp64"):
        gradcheck("ascend-tbe", "fp64")
    with pytest.raises(BNProbeError, match="mode must be train or infer"):
        gradcheck("reference", "fp64", mode="backward")
    with pytest.raises(BNProbeError, match="more than one value per channel"):
        gradcheck("reference", "fp64", (1, 3))


class OneElementOff(ReferenceAdapter):
    """The FP64 reference with dx's smallest element moved by ``by`` times its own allowance atol + rtol·|dx|."""

    def __init__(self, by, fmt):
        super().__init__()
        self.by, self.tol = by, grad_tolerance(fmt)
        self.name = f"one-element-off*{by:g}"

    def _backward_impl(self, p, dy, saved, *, eps, training):
        out = super()._backward_impl(p, dy, saved, eps=eps, training=training)
        dx = np.array(out.dx, dtype=np.float64)
        i = np.unravel_index(np.argmin(np.abs(dx)), dx.shape)
        rtol, atol = self.tol
        self.move = self.by * (atol + rtol * abs(dx[i]))
        dx[i] += self.move
        self.where, self.largest = i, float(np.abs(dx).max())
        return BackwardOutput(dx, out.dgamma, out.dbeta)


@pytest.mark.parametrize("fmt", ["fp64", "fp32", "fp16", "bf16"])
def test_one_small_element_breaks_its_own_tolerance_while_the_largest_would_pass(fmt):
    """With --rtol/--atol, elementwise |a - e| <= atol + rtol·|e|: the smallest element of dx moved by 1.5x its own
    allowance fails, though the move is within what the tensor's largest element is allowed (a max-based rule would
    pass it); moved by 0.9x its allowance it passes."""
    rtol, atol = grad_tolerance(fmt)
    off = OneElementOff(1.5, fmt)
    r = gradcheck(off, fmt, (4, 2, 3, 3), rtol=rtol, atol=atol)
    assert off.move < atol + rtol * off.largest  # the largest element's allowance would forgive it
    bad = [row for row in r.failed() if row.check == "vs-fp64"]
    assert [row.tensor for row in bad] == ["dx"] and 1.4 < bad[0].used < 1.6
    assert bad[0].where == f"index {tuple(int(v) for v in off.where)} (channel {int(off.where[1])})"
    assert next(row for row in gradcheck(OneElementOff(0.9, fmt), fmt, (4, 2, 3, 3), rtol=rtol, atol=atol).rows
                if row.check == "vs-fp64" and row.tensor == "dx").passed


def test_cosine_of_a_gradient_and_its_negation_is_minus_one():
    g = np.random.default_rng(0).standard_normal(100)
    # msprobe's dot(a, b) / (|a|·|b|): the product of the two rounded norms may be an ulp off |g|²
    assert cosine(-g, g) == pytest.approx(-1.0, abs=2**-52) and cosine(-g, g) == -cosine(g, g)
    assert cosine(-np.ones(4), np.ones(4)) == -1.0  # exact where the norms are (|g| = 2)
    r = gradcheck(Negated(), "fp64", (4, 2, 3, 3))
    row = next(x for x in r.rows if x.check == "vs-fp64" and x.tensor == "dx")
    assert not row.passed and row.cosine == pytest.approx(-1.0, abs=1e-12)


class Negated(ReferenceAdapter):
    """dx with the wrong sign."""

    def __init__(self):
        super().__init__()
        self.name = "negated-dx"

    def _backward_impl(self, p, dy, saved, *, eps, training):
        out = super()._backward_impl(p, dy, saved, eps=eps, training=training)
        return BackwardOutput(-np.asarray(out.dx), out.dgamma, out.dbeta)


def test_cli_params(capsys):
    from bnprobe.cli import main

    args = ["gradcheck", "--adapter", "emulated", "--dtype", "bf16", "--params", "same", "--shape", "4,2,3,3"]
    assert main(args) == 0
    assert "in bf16 (params same)" in capsys.readouterr().out
    assert main(["gradcheck", "--formula", "seed", "--params", "same"]) == 2
    assert "--params does not apply" in capsys.readouterr().err


class NanDgamma(ReferenceAdapter):
    """A backward whose dγ is NaN in every channel."""

    def __init__(self):
        super().__init__()
        self.name = "nan-dgamma"

    def _backward_impl(self, p, dy, saved, *, eps, training):
        out = super()._backward_impl(p, dy, saved, eps=eps, training=training)
        return BackwardOutput(out.dx, np.full_like(np.asarray(out.dgamma, dtype=np.float64), np.nan), out.dbeta)


def test_a_nan_gradient_fails_its_identity_instead_of_crashing():
    """An all-NaN dγ used to end in numpy's 'All-NaN slice encountered' ValueError in the identities."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = gradcheck(NanDgamma(), "fp64", (4, 2, 3, 3))
    row = next(x for x in r.rows if x.check == "identity" and x.tensor == "dgamma = sum(dy*xhat)")
    assert not row.passed and row.used == np.inf and row.where == "channel 0 (NaN/inf)"
    assert next(x for x in r.rows if x.check == "identity" and x.tensor == "dbeta = sum(dy)").passed


def test_a_recorded_call_without_dgamma_dbeta_is_judged_on_dx_alone(tmp_path):
    """affine=False: the recording holds no dγ, dβ (the replay answers NaN for them); gradcheck leaves them out
    and says so, rather than failing them or crashing on their all-NaN identities."""
    from bnprobe.adapters import get_adapter
    from bnprobe.engine.recorded import recording_of
    from bnprobe.recordings import record, write_dump
    from bnprobe.core.call import BNCall

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5))
    rec = record(get_adapter("reference"), BNCall(x, None, None, np.zeros(3), np.ones(3), rng.standard_normal(x.shape),
                                                  dtype="fp32"))
    for name in ("dgamma", "dbeta"):
        del rec.tensors["backward"]["outputs"][name]
    write_dump(rec, tmp_path)
    (result,) = gradcheck(recording_of(f"dump:{tmp_path}")).results
    assert result, [row.to_dict() for row in result.failed()]
    assert {row.tensor for row in result.rows if row.check == "vs-fp64"} == {"dx"}
    assert not [row for row in result.rows if row.check != "finite-differences"  # (those are the golden's)
                and ("dgamma" in row.tensor or "dbeta" in row.tensor)]
    assert any("no dgamma, dbeta recorded" in n for n in result.notes)


def formula_raises_two_lines(dy, x, gamma, mean, var, eps):
    raise RuntimeError("first line\nsecond line")


def formula_complex(dy, x, gamma, mean, var, eps):
    return formula_standard(dy, x, gamma, mean, var, eps) + 1j


def formula_nothing(dy, x, gamma, mean, var, eps):
    return ()


def formula_ragged(dy, x, gamma, mean, var, eps):
    return [[1.0], [1.0, 2.0]]


@pytest.mark.parametrize("name,detail", [
    ("formula_raises_two_lines", "the formula raised RuntimeError: first line"),
    ("formula_complex", "returned an array of dtype complex128, not a real array"),
    ("formula_nothing", "returned a tuple of 0, not dx or (dx, dgamma, dbeta)"),
    ("formula_ragged", "returned a list, not an array (ValueError: "),
])
def test_a_formula_that_fails_or_returns_no_real_array_is_one_failing_row(name, detail):
    """The row's detail is one line (a multi-line exception message is cut to its first), and a complex result
    is refused rather than cast with a ComplexWarning; a formula that returns nothing does not pass."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = check_formula(f"tests.checks.test_gradients:{name}")
    assert not r
    (row,) = [x for x in r.rows if x.check == "formula"]
    assert row.detail.startswith(detail) and "\n" not in row.detail and row.tensor.endswith("dx")


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_a_large_mean_is_no_false_alarm_and_a_wrong_backward_still_fails(fmt):
    """Issue 29: gradcheck failed torch's and the careful kernel's fp32 backward at mean/σ = 1e4 (dx 165%, dγ 214% of
    tolerance) where compare-precision and doctor pass them. Now dx, dγ, dβ carry compare-precision's verdict and
    the identities the condition 1 + |mean|·rstd of x − mean; a backward that drops -mean(dy) still fails there."""
    from bnprobe.inputs import make_input

    from .bn_plugins import NumpyBN

    shape = (4, 3, 5, 5)
    x = make_input(shape, mean=1e4, std=1.0, seed=0)
    kernels = ["careful", NumpyBN()] + (["torch"] if importlib.util.find_spec("torch") else [])
    for k in kernels:
        r = gradcheck(k, fmt, shape, x=x)
        assert r.passed, (k, fmt, [(row.check, row.tensor, row.used) for row in r.failed()])
    bad = gradcheck(NumpyBN("dx-drops-mean"), fmt, shape, x=x)
    assert {row.tensor for row in bad.failed() if row.check == "vs-fp64"} == {"dx"}



@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("shape", [(3, 4, 5, 2), (6, 3), (2, 5, 3, 3, 2)])
def test_the_references_columns_by_channel_equal_the_whole_forwards(mode, shape):
    """The reference's finite differences run only the channel a column moves: the same column, bit for bit, as
    moving it in the whole forward (other channels' differences 0, or NaN where y is not finite)."""
    from bnprobe.checks.gradcheck.gradients import _Jacobian

    rng = np.random.default_rng(len(shape))
    inp = make_inputs(shape, seed=3)
    inp.x[0, 1] = np.inf  # y of channel 1 is not finite: its unmoved differences are NaN, not 0
    by_channel = _Jacobian(ReferenceAdapter(), inp, mode, 1e-5)
    whole = _Jacobian(ReferenceAdapter(), inp, mode, 1e-5)
    whole.by_channel = False
    assert by_channel.by_channel
    for i in [*rng.choice(by_channel.m, 12, replace=False), *range(by_channel.m, by_channel.p)]:
        np.testing.assert_array_equal(by_channel.column(int(i)), whole.column(int(i)), err_msg=f"column {i}")
    assert np.isnan(whole.column(0)).any()  # (the case is what it says)


def test_a_subclass_of_the_reference_is_differenced_whole():
    """Only bnprobe's own reference runs a column by channel: a subclass's forward may mix channels (here it scales
    channel k by k + 1), and its finite differences must see that."""
    from bnprobe.adapters import ForwardOutput
    from bnprobe.checks.gradcheck.gradients import _Jacobian

    class Scaled(ReferenceAdapter):
        def _forward_train_impl(self, p, **kw):
            out = super()._forward_train_impl(p, **kw)
            k = np.arange(1, p.lay.channels + 1).reshape(1, -1, *([1] * (np.ndim(out.y) - 2)))
            return ForwardOutput(out.y * k, out.saved, out.running_mean, out.running_var, out.trace, out.meta)

    inp = make_inputs((3, 4, 2, 2), seed=1)
    jac = _Jacobian(Scaled(), inp, "train", 1e-5)
    assert not jac.by_channel
    plain = _Jacobian(ReferenceAdapter(), inp, "train", 1e-5)
    i = 2 * 4 + 2  # an element of channel 2
    col = jac.column(i).reshape(inp.x.shape)
    np.testing.assert_allclose(col[:, 2], 3 * plain.column(i).reshape(inp.x.shape)[:, 2], rtol=1e-6)

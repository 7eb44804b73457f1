"""The bug models with a memo shared across bugs (what no bug changes, computed once per call: doctor's cost on a
large call) give every output bit for bit as each model computed alone, whatever order the bugs come in, and a
caller changing one model's outputs in place does not change another's."""

import numpy as np
import pytest

from bnprobe.checks.doctor.bugs import BUGS, RECIPES, model
from bnprobe.core.call import BNCall


def _call(seed=0, shape=(6, 4, 5, 5)):
    rng = np.random.default_rng(seed)
    c = shape[1]
    return BNCall(rng.standard_normal(shape) * 3 + 1, rng.uniform(0.5, 1.5, c), rng.normal(0, 0.3, c),
                  rng.normal(0, 1, c), rng.uniform(0.5, 2, c), rng.standard_normal(shape), eps=1e-5, momentum=0.1)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("saved", [False, True])
def test_a_shared_memo_changes_no_output(training, saved):
    call = _call()
    kw = {"saved": (call.running_mean + 0.01, 1 / np.sqrt(call.running_var + 1e-5))} if saved and training else {}
    shared: dict = {}
    bugs = [None, *BUGS]
    for recipe in (None, *RECIPES):
        for bug in bugs[::-1] if recipe else bugs:  # another order for the recipe
            call = _call()  # the same values afresh (a model may hand an input back as an output)
            alone = model(call.with_(training=training), bug=bug, recipe=recipe, **kw)
            memo = model(call.with_(training=training), bug=bug, recipe=recipe, shared=shared, **kw)
            assert alone.keys() == memo.keys()
            for k in alone:
                np.testing.assert_array_equal(memo[k], alone[k], err_msg=f"{bug} {recipe} {k}")
            for v in memo.values():  # a caller writing into the outputs
                np.asarray(v)[...] = np.nan
    assert shared  # the memo was used


def test_the_memo_is_per_recipe():
    call, shared = _call(1), {}
    plain = model(call, shared=shared)
    one_pass = model(call, recipe=next(iter(RECIPES)), shared=shared)
    assert not np.array_equal(plain["saved_invstd"], one_pass["saved_invstd"])


@pytest.mark.parametrize("training", [True, False])
def test_outputs_are_formed_when_read_and_do_not_depend_on_the_order_or_on_writes(training):
    """A check reads one group's outputs: the others are not formed (on a 9.4 M-value call, each elementwise
    output is a pass over the call); what is formed later is what it would have been first."""
    saved = (_call().running_mean + 0.01, 1 / np.sqrt(_call().running_var + 1e-5)) if training else None
    for bug in (None, *BUGS):
        first = model(_call().with_(training=training), bug=bug, saved=saved)
        assert first.held_bytes() == 0
        y = first["y"]
        assert first.held_bytes() == y.nbytes  # only y was formed
        keys = list(first)
        expect = {k: np.array(first[k]) for k in keys}
        later = model(_call().with_(training=training), bug=bug, saved=saved)
        for k in reversed(keys):  # the other order, each output overwritten once read
            np.testing.assert_array_equal(later[k], expect[k], err_msg=f"{bug} {k}")
            np.asarray(later[k])[...] = np.nan
    with pytest.raises(KeyError):
        first["nope"]


def test_an_output_is_formed_under_the_error_handling_of_its_model():
    rng = np.random.default_rng(0)
    x = 1e10 + rng.standard_normal((4, 2, 3, 3))  # with the mean not subtracted, gamma * rstd * x overflows
    call = BNCall(x, np.full(2, 1e300), np.zeros(2), np.zeros(2), np.ones(2), np.ones_like(x), eps=1e-5, momentum=0.1)
    with np.errstate(all="raise"):
        loud = model(call, bug="mean-not-subtracted")
    with np.errstate(all="ignore"), pytest.raises(FloatingPointError):
        loud["y"]
    with np.errstate(all="ignore"):
        quiet = model(call, bug="mean-not-subtracted")
    with np.errstate(all="raise"):
        assert np.isinf(quiet["y"]).all()


@pytest.mark.parametrize("training", [True, False])
def test_every_output_is_the_same_on_both_routes(training, monkeypatch):
    """y and y_infer (one compiled pass for γ·((x - μ)·rstd) + β, and its swapped and uncentred bugs), the
    gradients built on x̂ (one pass for (x - μ)·rstd) and dx's last expression f·(dy - t1 + s·z·t2) (one pass, a
    large call with its errors ignored as the doctor ignores them) are numpy's bit for bit, sign of zero and NaN
    included (where two NaN operands meet, IEEE does not say which one's sign a product keeps), for every bug and
    recipe, with a non-finite x and dy, a zero γ and a -0.0 in x."""
    call = _call(6, (4, 3, 5, 6))
    call.x[0, 0, 0, 0], call.dy[1, 1, 1, 1], call.x[2, 2, 2, 2], call.gamma[1] = np.inf, np.nan, -0.0, 0.0
    saved = (call.running_mean + 0.01, 1 / np.sqrt(call.running_var + 1e-5)) if training else None
    for recipe in (None, *RECIPES):
        for bug in (None, *BUGS):
            got = {}
            for jit in ("0", "1"):
                monkeypatch.setenv("BNPROBE_JIT", jit)
                with np.errstate(all="ignore"):
                    m = model(call.with_(training=training), bug=bug, saved=saved, recipe=recipe)
                    got[jit] = {k: np.array(m[k]) for k in m}
            for k in got["0"]:
                np.testing.assert_array_equal(got["1"][k], got["0"][k], err_msg=f"{k} {bug} {recipe}")
                num = ~np.isnan(got["0"][k])
                assert np.array_equal(np.signbit(got["1"][k][num]), np.signbit(got["0"][k][num])), (k, bug, recipe)


def test_dx_under_raised_errors_takes_numpys_route(monkeypatch):
    monkeypatch.setenv("BNPROBE_JIT", "1")
    x = np.ones((2, 2, 3, 3)) * np.arange(9).reshape(3, 3)
    dy = np.arange(x.size, dtype=np.float64).reshape(x.shape)  # gamma * rstd * dy overflows in the last product only
    with np.errstate(all="raise"):
        m = model(BNCall(x, np.full(2, 1e308), np.zeros(2), np.zeros(2), np.ones(2), dy, eps=1e-5, momentum=0.1))
        with pytest.raises(FloatingPointError):
            m["dx"]


def test_xhat_keeps_the_sign_of_zero_on_both_routes(monkeypatch):
    """x̂ = (x - μ)·rstd in one compiled pass adds -0.0 after multiplying by 1: -0.0 stays -0.0 (x = -0.0 at
    μ = 0), as numpy's expression gives it, and so do NaN, inf and subnormal results."""
    from bnprobe.checks.doctor.bugs import _xhat

    x = np.random.default_rng(3).standard_normal((3, 2, 4, 4))
    x[0, 0, 0, :4] = [-0.0, 0.0, np.inf, np.nan]
    x[1, 1, 0, 0] = 1e-310
    m, rs = np.array([0.0, 0.0]), np.array([1.0, 0.5])
    got = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        with np.errstate(all="ignore"):
            got[jit] = _xhat(x, m, rs)
    np.testing.assert_array_equal(got["1"], got["0"])
    assert np.array_equal(np.signbit(got["1"]), np.signbit(got["0"])) and np.signbit(got["1"][0, 0, 0, 0])


def test_vectors_of_another_length_take_numpys_route(monkeypatch):
    """Per-channel vectors longer than x's one channel: numpy broadcasts them (a reviewer's case), the compiled
    passes take one value per channel, so such a model is formed on numpy's route, the same on both."""
    x = np.random.default_rng(2).standard_normal((2, 1, 4, 4))
    got = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        with np.errstate(all="ignore"):
            m = model(BNCall(x, np.ones(3), np.zeros(3), np.zeros(3), np.ones(3), x, eps=1e-5, momentum=0.1))
            got[jit] = {k: np.array(m[k]) for k in ("y", "y_infer", "dx")}
    for k in got["0"]:
        np.testing.assert_array_equal(got["1"][k], got["0"][k], err_msg=k)

"""The run engine (bnprobe.engine.run): one vocabulary of outputs, one golden per call, and the behaviour chosen
where compare-precision's former engine and the recorded-call engine had drifted apart."""

import warnings

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.core.call import EPS, MOMENTUM, BNCall
from bnprobe.engine.cases import Case
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.engine.run import OUTPUT_MODE, Golden, generated_call, run_call
from tests.checks.bn_plugins import NumpyBN


def _call(dtype="fp32", shape=(4, 3, 5, 5), seed=0, **kw):
    rng = np.random.default_rng(seed)
    c = shape[1]
    return BNCall(rng.standard_normal(shape) * 2 + 1, rng.uniform(0.5, 1.5, c), rng.normal(0, 0.3, c),
                  np.zeros(c), np.ones(c), rng.standard_normal(shape), dtype=dtype, **kw)


def test_the_defaults_are_defined_once():
    assert (EPS, MOMENTUM) == (1e-5, 0.1)
    c = BNCall(np.zeros((2, 3)))
    assert (c.eps, c.momentum, c.training, c.params, c.layout) == (1e-5, 0.1, True, "fp32", "channels_first")


@pytest.mark.parametrize("adapter,saved", [("emulated", "saved_invstd"), ("ascend-tbe", "saved_var")])
def test_one_vocabulary_and_statistics_as_saved(adapter, saved):
    """Every output is named by OUTPUT_MODE; y is "y"; the saved statistic keeps the kind the kernel saved (a
    variance is not turned into an invstd by the engine), and invstd_view gives the invstd it stands for."""
    rec = generated_call(_call(), label="c")
    run = run_call(get_adapter(adapter), rec)
    assert set(run.got) <= set(OUTPUT_MODE) and "y" in run.got and saved in run.got
    assert list(run.got) == [k for k in ("y", "saved_mean", saved, "running_mean", "running_var", "y_infer", "dx",
                                         "dgamma", "dbeta") if k in run.got]
    got, gold, formats = run.invstd_view()
    assert "saved_var" not in got and formats["saved_invstd"] == run.formats[saved]
    np.testing.assert_allclose(gold["saved_invstd"], run.gold_saved.invstd(rec.eps), rtol=0)
    if saved == "saved_var":
        np.testing.assert_allclose(got["saved_invstd"], 1 / np.sqrt(run.got["saved_var"].astype(np.float64) + EPS))


class _CountingReference:
    """The reference adapter, counting its calls."""

    def __init__(self):
        self.ref, self.calls = get_adapter("reference"), 0
        self.name = self.ref.name

    def capabilities(self):
        return self.ref.capabilities()

    def __getattr__(self, name):
        fn = getattr(self.ref, name)

        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)
        return counted


def test_the_golden_of_a_call_is_computed_once_for_every_kernel():
    ref = _CountingReference()
    rec = generated_call(_call(), label="c")
    golden = Golden(ref, rec)
    for name in ("emulated", "careful", "ascend-tbe"):
        run_call(get_adapter(name), rec, golden=golden)
    assert ref.calls == 3  # one training forward, one inference, one backward


def test_the_scales_and_bounds_of_a_call_are_computed_once_for_every_kernel():
    """Kernels run on one golden share its natural scales and bounds (the same arrays), and they equal those of a
    run on a golden of its own; a run's dicts are its own (adding to one leaves the others as they were)."""
    rec = generated_call(_call(shape=(4, 3, 6, 5)), label="c")
    golden = Golden(get_adapter("reference"), rec)
    runs = [run_call(get_adapter(name), rec, golden=golden) for name in ("emulated", "careful")]
    alone = run_call(get_adapter("careful"), rec)
    assert set(runs[0].scales) >= {"dx", "dgamma", "dbeta"} and set(runs[0].bounds) >= {"dx", "saved_invstd"}
    for key in runs[0].scales:
        assert runs[1].scales[key] is runs[0].scales[key]
        np.testing.assert_array_equal(alone.scales[key], runs[0].scales[key])
    for key in runs[0].bounds:
        assert runs[1].bounds[key] is runs[0].bounds[key]
        np.testing.assert_array_equal(alone.bounds[key][0], runs[0].bounds[key][0])
    runs[0].scales["extra"] = np.zeros(1)
    assert "extra" not in runs[1].scales


def test_the_collections_between_calls_thaw_what_they_froze():
    """CallCollector freezes what survives a collection and thaws it when the loop ends; a process that froze
    objects itself keeps its own freeze."""
    import gc

    from bnprobe.engine.run import CallCollector

    assert gc.get_freeze_count() == 0
    with CallCollector() as c:
        c.collect()
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        with CallCollector() as c:
            made = [{"i": i} for i in range(10_000)]  # (alive at the collection: frozen, were it to freeze)
            c.collect()
            assert gc.get_freeze_count() <= mine  # (frozen objects that die leave the count)
        assert gc.get_freeze_count() <= mine and made
    finally:
        gc.unfreeze()


def test_compare_and_the_engine_judge_the_same_arrays():
    """compare-precision's rows are the engine's outputs: each row's msprobe metrics are those of the engine's
    arrays in the format the engine says each was returned in."""
    case = Case("c", (4, 3, 5, 5), mean=1.0, std=2.0, seed=3)
    r = compare_precision(["emulated:fp16-acc16"], ("fp16",), [case], budget=False).rows.set_index("tensor")
    from bnprobe.checks.compare.precision import _generated

    rec, modes = _generated(case, case.make(), "fp16", "fp32", EPS, MOMENTUM, ("train", "infer", "backward"))
    run = run_call(get_adapter("emulated:fp16-acc16"), rec, modes=modes)
    from bnprobe.engine.metrics import compare

    assert list(r.index) == list(run.got)
    for key in run.got:
        m = compare(run.got[key], run.gold[key], run.formats[key])
        assert r.loc[key, "format"] == run.formats[key]
        assert (r.loc[key, "max_abs"], r.loc[key, "rmse"]) == (m.max_abs, m.rmse), key


def test_an_eval_mode_backward_has_natural_scales():
    """(Drift resolved: compare-precision's engine gave an eval-mode backward no natural scale.) The scales of dx,
    dγ, dβ come from the statistics the backward used: the running statistics in eval mode."""
    call = _call(training=False)
    rec = generated_call(call, modes=("infer",), label="c")
    rec.tensors["backward"] = {"inputs": {"dy": rec.tensors["infer"]["inputs"]["x"] * 0 + 1.0,
                                          "x": rec.tensors["infer"]["inputs"]["x"],
                                          "gamma": rec.tensors["infer"]["inputs"]["gamma"]}, "outputs": {}}
    run = run_call(get_adapter("emulated"), rec)
    assert {"dx", "dgamma", "dbeta"} <= set(run.scales) and np.all(np.isfinite(run.scales["dx"]))


def test_scales_leave_nan_out():
    """(Drift resolved: one engine took mean/max, the other nanmean/nanmax.) A NaN in x leaves the other values'
    scales of its channel finite."""
    call = _call()
    x = call.x.copy()
    x[0, 1, 0, 0] = np.nan
    run = run_call(get_adapter("emulated"), generated_call(call.with_(x=x), label="c"))
    assert np.all(np.isfinite(run.scales["saved_mean"]))


class _SavesNothing(NumpyBN):
    """A correct kernel that saves no statistics (as a recorded functional call): its backward recomputes them."""

    def capabilities(self):
        from dataclasses import replace

        return replace(super().capabilities(), saved="none")

    def _forward_train_impl(self, p, *, momentum, eps):
        from dataclasses import replace

        return replace(super()._forward_train_impl(p, momentum=momentum, eps=eps), saved=None)


def test_a_kernel_that_saves_nothing_is_backpropagated_from_the_golden_statistics():
    """(One rule for "the kernel saved no statistics".) A kernel declaring saved="none" whose training forward
    returns no statistics: its backward gets the golden's, in backward-only mode as with the forward."""
    k = _SavesNothing()
    for modes in (("train", "backward"), ("backward",)):
        run = run_call(k, generated_call(_call(), modes=modes, label="c"), modes=("backward",))
        assert run.saved is None and "dx" in run.got
        np.testing.assert_allclose(run.got["dx"], run.gold["dx"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", ["0", "1"])
@pytest.mark.parametrize("where", ["none", "x", "dy", "inf"])
def test_natural_scales_are_numpys_nan_reductions_bit_for_bit(where, jit, monkeypatch):
    """natural_scales takes numpy's plain reductions where no NaN is there to leave out: the same figures, bit for
    bit, as the nan* reductions written out here; with a NaN in x or dy, or an inf in x (0·inf in dy·x̂ is NaN),
    the nan* ones.  On both routes (the compiled one reproduces numpy's pairwise sums of each channel's row)."""
    from bnprobe.adapters import Saved
    from bnprobe.engine.run import natural_scales

    monkeypatch.setenv("BNPROBE_JIT", jit)

    call = _call(shape=(6, 4, 7, 7), seed=3)
    x, dy = call.x.copy(), call.dy.copy()
    if where == "x":
        x[1, 2, 3, 3] = np.nan
    elif where == "dy":
        dy[0, 1, 0, 0] = np.nan
    elif where == "inf":
        x[2, 0, 1, 1], dy[2, 0, 1, 1] = np.inf, 0.0
    call = call.with_(x=x, dy=dy)
    with np.errstate(all="ignore"):
        mean, var = np.nanmean(x, axis=(0, 2, 3)), np.nanvar(x, axis=(0, 2, 3))
    stats = Saved(mean, "var", var)
    got = natural_scales(call, stats, dy)
    xcr = np.moveaxis(x, 1, 0).reshape(4, -1)
    dycr = np.moveaxis(dy, 1, 0).reshape(4, -1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: NaN scales
        xhat = (xcr - mean[:, None]) / np.sqrt(stats.var(call.eps)[:, None] + call.eps)
        prod = dycr * xhat
        want = {"saved_mean": np.nanmean(np.abs(xcr), axis=1), "dbeta": np.nansum(np.abs(dycr), axis=1),
                "dgamma": np.nansum(np.abs(prod), axis=1)}
        gr = np.abs(call.gamma) / np.sqrt(stats.var(call.eps) + call.eps)
        want["dx"] = gr * (np.nanmax(np.abs(dycr), axis=1) + np.abs(np.nanmean(dycr, axis=1))
                           + np.nanmax(np.abs(xhat), axis=1) * np.abs(np.nanmean(prod, axis=1)))
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("shape, layout", [((3, 4, 5), "channels_first"), ((2, 3, 8, 1), "channels_first"),
                                           ((1, 2, 16, 8), "channels_first"), ((4, 2, 129), "channels_first"),
                                           ((5, 3, 41, 37), "channels_first"), ((2, 1, 3, 4, 700), "channels_first"),
                                           ((64, 2, 4100), "channels_first"), ((3, 5, 6, 4), "channels_last"),
                                           ((50, 6), "channels_first"), ((64, 4, 1), "channels_first"),
                                           ((33, 3, 1, 1), "channels_first"), ((1, 3, 1, 200), "channels_first")])
def test_scales_and_bounds_are_the_same_on_both_routes(shape, layout, monkeypatch):
    """The natural scales and the accumulation bounds built on them, bit for bit on both routes, with rows of
    fewer than 8, exactly 128, 129 and many values (numpy's pairwise blocks and splits), a channel of zero variance
    with ε = 0 (x̂ = 0/0: numpy's nan* reductions), -0.0 in dy, and the layouts the compiled route leaves to numpy
    (channels-last, (N, C) and (N, C, 1, ...): numpy adds those rows in order)."""
    from bnprobe.adapters import Saved
    from bnprobe.engine.run import cancellation_bounds, natural_scales, statistics_bounds

    rng = np.random.default_rng([29, *shape])
    ax = 1 if layout == "channels_first" or len(shape) == 2 else len(shape) - 1
    axes = tuple(i for i in range(len(shape)) if i != ax)
    c = shape[ax]
    for eps, edit in ((1e-5, None), (0.0, "constant"), (1e-5, "negzero")):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 9)) + rng.standard_normal()
        dy = rng.standard_normal(shape)
        if edit == "constant":
            np.moveaxis(x, ax, 0)[0] = 1.5
        if edit == "negzero":
            dy[...] = -0.0
        call = BNCall(x, gamma=rng.standard_normal(c), running_mean=rng.standard_normal(c), running_var=np.ones(c),
                      eps=eps, layout=layout)
        stats = Saved(x.mean(axis=axes), "var", x.var(axis=axes))
        got = {}
        for jit in ("0", "1"):
            monkeypatch.setenv("BNPROBE_JIT", jit)
            sc = natural_scales(call, stats, dy)
            with np.errstate(all="ignore"):
                got[jit] = (sc, natural_scales(call, None, None), cancellation_bounds(call, stats, sc),
                            statistics_bounds(call, stats, sc["saved_mean"]), statistics_bounds(call, stats))
        for part0, part1 in zip(got["0"], got["1"]):
            assert part0.keys() == part1.keys()
            for k in part0:
                v0, v1 = (part0[k][0], part1[k][0]) if isinstance(part0[k], tuple) else (part0[k], part1[k])
                np.testing.assert_array_equal(v0, v1, err_msg=f"{k} {edit}")


def test_statistics_shorter_than_the_channels_broadcast_on_both_routes(monkeypatch):
    """Statistics of one value for three channels broadcast as numpy broadcasts them: the compiled route leaves
    them to numpy's instead of reading past their end."""
    from bnprobe.adapters import Saved
    from bnprobe.engine.run import cancellation_bounds, natural_scales

    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((4, 3, 10, 10)), rng.standard_normal((4, 3, 10, 10))
    call, stats = BNCall(x, gamma=np.ones(3)), Saved(np.array([0.1]), "var", np.array([1.2]))
    got = {}
    for jit in ("0", "1"):
        monkeypatch.setenv("BNPROBE_JIT", jit)
        sc = natural_scales(call, stats, dy)
        got[jit] = (sc, cancellation_bounds(call, stats, sc))
    for k in got["0"][0]:
        np.testing.assert_array_equal(got["0"][0][k], got["1"][0][k], err_msg=k)
        assert np.isfinite(got["1"][0][k]).all(), k
    for k in got["0"][1]:
        np.testing.assert_array_equal(got["0"][1][k][0], got["1"][1][k][0], err_msg=k)


def test_a_case_is_a_named_call_given_whole_recorded_or_made():
    """One named-input type: doctor's and identify's inputs give their call whole, compare-precision's a recorded
    call or what makes x; each knows its shape and makes its x."""
    from bnprobe.engine.cases import recorded_cases
    from bnprobe.recordings import RecordedCalls
    from bnprobe.recordings.types import CallRef

    x = np.arange(24.0).reshape(2, 3, 4)
    whole = Case("probe", call=BNCall(x), purpose="what it shows")
    assert whole.shape == (2, 3, 4) and whole.make() is x and whole.recorded is None
    rec = generated_call(BNCall(x, dtype="fp32"), modes=("train",))
    ref = CallRef("bn", None, (2, 3, 4), "fp32", True, False, "tensor", lambda: rec)
    (case,) = recorded_cases(RecordedCalls("d", "bnprobe", (ref,)))
    assert case.recorded is ref and case.shape == (2, 3, 4) and np.array_equal(case.make(), x)
    assert Case("made", (2, 3, 4), seed=1).make().shape == (2, 3, 4)

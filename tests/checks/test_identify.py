"""identify: the recipe of a black-box kernel, found in the policy space and checked bit for bit on inputs it never
saw — by running the identified spec and the kernel side by side here, not by identify's own verdict."""

import json

import numpy as np
import pytest

from bnprobe.adapters.base import BackwardOutput, BaseAdapter, Capabilities, ForwardOutput, params_mode
from bnprobe.adapters.emulated import EmulatedAdapter
from bnprobe.core.call import BNCall
from bnprobe.checks.identify.results import policy_spec
from bnprobe.checks.identify.search import identify
from bnprobe.engine.recorded import recording_of
from bnprobe.engine.run import generated_call, run_call
from bnprobe.cli import main
from bnprobe.kernels.policy import Policy, get_policy

from .bn_plugins import NumpyBN

OUTPUTS = ("y", "saved_mean", "saved_invstd", "running_mean", "running_var", "y_infer", "dx", "dgamma", "dbeta")


class BlackBox(BaseAdapter):
    """An emulated policy behind the plain adapter interface: outputs only, no trace, no name that tells."""

    def __init__(self, policy: Policy) -> None:
        self._k = EmulatedAdapter(policy_spec(policy))
        self._k.keep_arrays = False
        self._fmt = policy.storage
        self.name = "black-box"

    def capabilities(self):
        return Capabilities(formats=(self._fmt,), saved="invstd")

    def _opts(self, p):
        return dict(dtype=p.dtype, layout=p.lay.layout, params=params_mode(p.dtype, p.params))

    def _forward_train_impl(self, p, *, momentum, eps):
        v = p.vectors
        o = self._k.forward_train(p.x, v["gamma"], v["beta"], v["running_mean"], v["running_var"], momentum=momentum,
                                  eps=eps, **self._opts(p))
        return ForwardOutput(o.y, o.saved, o.running_mean, o.running_var)

    def _forward_infer_impl(self, p, *, eps):
        v = p.vectors
        return ForwardOutput(self._k.forward_infer(p.x, v["gamma"], v["beta"], v["running_mean"], v["running_var"],
                                                   eps=eps, **self._opts(p)).y)

    def _backward_impl(self, p, dy, saved, *, eps, training):
        o = self._k.backward(dy, p.x, p.vectors["gamma"], saved, eps=eps, training=training, **self._opts(p))
        return BackwardOutput(o.dx, o.dgamma, o.dbeta)


def draw(rng: np.random.Generator) -> Policy:
    """A policy with random fields (the choices real kernels make), as a target to recover."""
    fmt = str(rng.choice(["fp16", "bf16", "fp32"]))
    params = fmt if fmt != "fp32" and rng.random() < 0.3 else "fp32"
    acc = fmt if fmt != "fp32" and rng.random() < 0.3 else "fp32"
    order = [dict(order="sequential"), dict(order="pairwise"), dict(order="lanes", lanes=int(rng.choice([8, 16, 32]))),
             dict(order="vec", lanes=8, unroll=int(rng.choice([1, 2])))][rng.integers(4)]
    rsqrt = [dict(rsqrt="exact"), dict(rsqrt="sqrt_div"), dict(rsqrt="table", rsqrt_newton=1, rsqrt_bits=7),
             dict(rsqrt="magic", rsqrt_newton=2)][rng.integers(4)]
    f = dict(storage=fmt, params=params, accumulate=acc, compute=acc, **order, **rsqrt,
             mean_by=str(rng.choice(["divide", "reciprocal"])),
             variance=str(rng.choice(["two_pass", "naive", "welford"])),
             y_formula=str(rng.choice(["xhat", "scale", "affine"])), fma=bool(rng.random() < 0.5),
             running_momentum=str(rng.choice(["new", "old"])), running_var=str(rng.choice(["unbiased", "biased"])),
             backward_formula=str(rng.choice(["standard", "ascend"])),
             infer_y_formula=[None, "affine"][rng.integers(2)])
    if f["variance"] == "welford":
        f.update(lanes=8, order="pairwise", unroll=1)
    return Policy("target", **f)


TARGETS = [draw(np.random.default_rng([2026, i])) for i in range(10)]
# the default run searches three of them (each storage format, Welford's variance once); the other seven, 10 to 60 s
# each, are marked slow (pytest -m slow; .ci/run runs them too). Of those, fp16:params=fp16,order=vec and
# fp16:order=sequential were in the default run until the suite outgrew its 10 minutes: each field they recover is
# recovered by a default search too — these three, torch's bf16 kernel (order=vec; order=sequential on channels-last,
# test_torch_cpu_16_bit_is_reproduced_bit_for_bit_on_fresh_inputs) and docs/commands/identify.md's fp16 transcript
DEFAULT_TARGETS = ("fp32:order=lanes", "bf16-acc16:params=fp32", "fp16:params=fp16,variance=welford")


def fresh_call(fmt: str, params: str, seed: int, layout: str = "channels_first") -> BNCall:
    """Inputs identify never saw: another seed, shape and scale (large per-channel means and scales)."""
    rng = np.random.default_rng([seed, 77])
    c = 7
    means = rng.choice([-2e3, -40.0, 0.0, 5.0, 300.0, 1e3], c) * (3.0 if fmt != "fp16" else 1.0)
    x = means[None, :, None, None] + rng.uniform(0.02, 6.0, c)[None, :, None, None] * rng.standard_normal((5, c, 6, 19))
    dy = rng.standard_normal(x.shape) + rng.normal(0, 2, c)[None, :, None, None]
    if layout == "channels_last":
        x, dy = np.moveaxis(x, 1, -1), np.moveaxis(dy, 1, -1)
    return BNCall(np.ascontiguousarray(x), rng.uniform(0.2, 4, c), rng.normal(0, 2, c), means + rng.normal(0, 1, c),
                  rng.uniform(0.1, 9, c), np.ascontiguousarray(dy), 1e-5, 0.1, True, fmt, params, layout)


def side_by_side(kernel, spec: str, call: BNCall) -> dict[str, int]:
    """Mismatching elements per output of the kernel and emulated:<spec> on the call (NaN equal to NaN)."""
    rec = generated_call(call, label="fresh")
    a = run_call(kernel, rec, quiet=True)
    b = run_call(EmulatedAdapter(spec), rec, golden=None, quiet=True)
    out = {}
    for k in a.got:
        x, y = np.asarray(a.got[k], dtype=np.float64), np.asarray(b.got[k], dtype=np.float64)
        out[k] = int((~((x == y) | (np.isnan(x) & np.isnan(y)))).sum())
    return out


@pytest.mark.parametrize("target", [pytest.param(t, id=policy_spec(t), marks=() if policy_spec(t).startswith(
    DEFAULT_TARGETS) else pytest.mark.slow) for t in TARGETS])
def test_a_black_box_policy_is_recovered_bit_for_bit_on_inputs_it_never_saw(target):
    res = assert_recovered(target, seed=99)
    assert get_policy(res.spec).storage == target.storage


def assert_recovered(target, seed: int, kernel=None):
    """identify on ``target`` behind the plain interface (``kernel``, default a :class:`BlackBox` of it) reproduces
    it, and the spec it finds runs side by side with the kernel bit for bit on a channels-first call the search never
    saw (made with ``seed``); the result."""
    params = params_mode(target.storage, target.params_format)
    kernel = BlackBox(target) if kernel is None else kernel
    res = identify(kernel, target.storage, params=params)
    assert res.reproduced, (res.spec, res.departs)
    off = side_by_side(kernel, res.spec, fresh_call(target.storage, params, seed=seed))
    assert set(off) >= set(OUTPUTS)
    assert not any(off.values()), off
    return res


def test_the_spec_round_trips():
    for t in TARGETS:
        back = get_policy(policy_spec(t))
        assert {k: v for k, v in back.to_dict().items() if k != "name"} == \
            {k: v for k, v in t.to_dict().items() if k != "name"}


# fp16 runs with the slow tests: the default suite runs the same search as docs/commands/identify.md's transcript
# (tests/test_readme.py), which pins both specs it finds, and holds those specs to torch bit for bit
# (tests/kernels/test_policy_conventions.py: channels-first; tests/kernels/test_threads.py: channels-last)
@pytest.mark.parametrize("fmt", [pytest.param("fp16", marks=pytest.mark.slow), "bf16"])
def test_torch_cpu_16_bit_is_reproduced_bit_for_bit_on_fresh_inputs(fmt):
    pytest.importorskip("torch")
    res = identify("torch", fmt)
    assert res.reproduced and res.departs is None, res.spec
    for seed in (5, 6):
        off = side_by_side(get_adapter_torch(), res.spec, fresh_call(fmt, "fp32", seed))
        assert set(off) >= set(OUTPUTS) and not any(off.values()), off
    # torch's channels_last kernel computes another way: identify says so, and finds that kernel's own recipe
    assert_channels_last_is_its_own(res)
    assert res.passed


def assert_channels_last_is_its_own(res):
    """The channels-last branch is not reproduced by the channels-first recipe, has a recipe of its own found by
    identify (its sums split across torch's thread count), and that recipe is torch's bit for bit on inputs the
    search never saw — run side by side here."""
    import torch

    cl = res.layouts["channels_last"]
    assert cl.off and cl.own is not None and cl.own.reproduced, cl.summary()
    assert cl.own.policy.threads == torch.get_num_threads()
    assert any(n.startswith("channels_last: the kernel computes this layout another way") for n in res.notes)
    assert res.to_dict()["layouts"]["channels_last"]["policy"] == cl.own.spec
    for seed in (5, 6):
        off = side_by_side(get_adapter_torch(), cl.own.spec, fresh_call(res.dtype, "fp32", seed, "channels_last"))
        assert set(off) >= set(OUTPUTS) and not any(off.values()), off


@pytest.mark.slow  # about 30 s each
@pytest.mark.parametrize("fmt,threads", [("fp32", None), ("fp16", 1), ("fp32", 1)])
def test_torch_cpu_channels_last_is_identified_at_the_thread_count_torch_runs(fmt, threads):
    """torch's channels-last kernels, whose sums split across its threads: in fp32 too (whose channels-first
    backward departs), and at one thread."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        assert_channels_last_is_its_own(identify("torch", fmt))
    finally:
        torch.set_num_threads(before)


class TwoLayouts(BlackBox):
    """A black box whose channels-last branch is another kernel — another policy — as PyTorch's CPU kernel's is."""

    def __init__(self, first: Policy, last: Policy) -> None:
        super().__init__(first)
        self._last = BlackBox(last)

    def _forward_train_impl(self, p, *, momentum, eps):
        own = self._last if p.lay.layout == "channels_last" else super()
        return own._forward_train_impl(p, momentum=momentum, eps=eps)

    def _forward_infer_impl(self, p, *, eps):
        own = self._last if p.lay.layout == "channels_last" else super()
        return own._forward_infer_impl(p, eps=eps)

    def _backward_impl(self, p, dy, saved, *, eps, training):
        own = self._last if p.lay.layout == "channels_last" else super()
        return own._backward_impl(p, dy, saved, eps=eps, training=training)


def test_a_layout_computed_another_way_is_identified_on_its_own():
    """A hidden channels-last recipe (its sums split across 3 threads, partials added in double, fused sums of
    squares; a number of threads the kernel does not say) is found by the layout's own search and reproduces the
    kernel bit for bit on inputs it never saw; the channels-first recipe is found as before."""
    first = get_policy("fp32:order=pairwise,y_formula=affine")
    last = get_policy("fp32:order=sequential,threads=3,sum_format=fp64,variance_fma=true,y_formula=affine")
    kernel = TwoLayouts(first, last)
    res = identify(kernel, "fp32")
    assert res.reproduced and res.passed, res.spec
    cl = res.layouts["channels_last"]
    assert cl.off and cl.own is not None and cl.own.reproduced, cl.summary()
    assert (cl.own.policy.threads, cl.own.policy.sum_format, cl.own.policy.variance_fma) == (3, "fp64", True)
    off = side_by_side(kernel, cl.own.spec, fresh_call("fp32", "fp32", 99, "channels_last"))
    assert set(off) >= set(OUTPUTS) and not any(off.values()), off


def get_adapter_torch():
    from bnprobe.adapters import get_adapter

    return get_adapter("torch")


@pytest.mark.slow  # 40 s of the suite's CPU: run by -m slow (.ci/run)
def test_torch_cpu_fp32_is_reproduced_bit_for_bit_on_fresh_inputs():
    """torch's fp32 CPU kernel: its forward (double sums of float terms, invstd in double, the running variance's
    double update, y by a fused multiply-add) and its backward (each H·W plane's sums in 8 float lanes, the planes
    added in double) bit for bit, on inputs the search never saw."""
    pytest.importorskip("torch")
    res = identify("torch", "fp32")
    assert res.reproduced and res.departs is None, res.spec
    assert res.policy.sum_format == "fp64" and res.policy.running_var_sum == "fp64"
    assert res.policy.backward_sums == "plane_reduce"
    for seed in (5, 6):
        off = side_by_side(get_adapter_torch(), res.spec, fresh_call("fp32", "fp32", seed))
        assert set(off) >= set(OUTPUTS) and not any(off.values()), off


@pytest.mark.slow  # 56 s of the suite's CPU: run by -m slow (.ci/run)
def test_a_kernel_outside_the_space_is_never_called_a_match():
    res = identify(NumpyBN("eps-on-sigma"), "fp16", passes=1)  # 1/(σ + ε): no policy puts ε there
    assert not res.reproduced
    assert res.departs in ("rsqrt", "variance", "mean", "y")
    assert any(o.max_ulps > 0 and not o.probes_exact for o in res.outputs)


class _InferOnly(EmulatedAdapter):
    """An emulated kernel that offers its inference alone, as a deployment runtime does."""

    def capabilities(self):
        caps = super().capabilities()
        return Capabilities(formats=caps.formats, modes=("infer",), saved="none")


@pytest.mark.parametrize("spec", ["fp32:y_formula=affine,fma=true,rsqrt=sqrt_div,rstd_format=fp32",
                                  "fp16:params=fp16,compute=fp16,infer_y_formula=scale",
                                  "fp32:infer_y_formula=xhat,accumulate=fp64"])
def test_an_inference_only_kernel_is_identified_from_its_inference_alone(spec):
    """A hidden policy behind an inference-only interface: the search runs the infer stage alone and reproduces
    it on inputs it never saw."""
    pol = get_policy(spec)
    res = identify(_InferOnly(spec), pol.storage, params="same" if pol.params == pol.storage else "fp32", passes=1)
    assert [o.output for o in res.outputs] == ["y_infer"]
    assert res.reproduced, res.departure()
    call = fresh_call(pol.storage, "same" if pol.params == pol.storage else "fp32", 11).with_(training=False)
    got = _InferOnly(spec).infer(call).y
    assert np.array_equal(got, EmulatedAdapter(res.spec).infer(call).y)


def test_onnxruntime_inference_is_reproduced_bit_for_bit():
    pytest.importorskip("onnxruntime")
    for fmt in ("fp32", "fp16"):
        res = identify("onnxruntime", fmt, params="same", passes=1)
        assert res.reproduced, res.departure()


def test_closest_is_said_only_when_close(capsys):
    """A recipe off by a few ulps on a few values is the closest; one far off is not named at all."""
    from bnprobe.checks.identify.results import CLOSE_SHARE, CLOSE_ULPS, Identified, OutputMatch
    from bnprobe.reports.identify import identify_report

    def result(mism, ulps):
        out = [OutputMatch("saved_mean", "mean", False, True, mism, 100, ulps)]
        return Identified("k", "fp16", "fp32", get_policy("fp16"), "fp16:order=lanes", out, [], "mean",
                          {"mean": {"exact": False}}, ["pairs"], [], 1, 0.1, departing_probes=["pairs"])

    near, far, wide = result(int(CLOSE_SHARE * 100), CLOSE_ULPS), result(50, 2.0), result(3, 1e4)
    assert near.close and not far.close and not wide.close
    assert "closest" in identify_report(near).lines()[0]
    for r in (far, wide):
        line = identify_report(r).lines()[0]
        assert "closest" not in line and "fp16:order=lanes" not in line
        assert "no recipe in the space reproduces saved_mean" in line and "pairs" in line
        assert r.to_dict()["closest"] is None


def test_a_nondeterministic_kernel_is_reported_as_such():
    res = identify("ascend-tbe", "fp16", passes=1)
    assert res.nondeterministic and not res.reproduced
    assert any("nondeterministic" in n for n in res.notes)


def test_cli_json_and_bad_input(capsys, tmp_path):
    assert main(["identify", "--adapter", "emulated:fp16-acc16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reproduced"] and doc["policy"].startswith("fp16-acc16")
    assert main(["identify", "--adapter", "emulated:fp16", "--dtype", "bf16"]) == 2
    assert "does not run bf16" in capsys.readouterr().err
    assert main(["identify", "--adapter", "emulated:fp16", "--mean", "3"]) == 2
    assert "--shape" in capsys.readouterr().err
    assert main(["identify", "--adapter", "emulated:fp16", "--calls", "x*"]) == 2
    capsys.readouterr()


def test_cli_on_a_dump_per_call(capsys, tmp_path):
    d = tmp_path / "d"
    assert main(["dump", "--adapter", "emulated:fp16:order=lanes,lanes=16,y_formula=affine", "--dtype", "fp16",
                 "--shape", "4,8,6,6", "--mean", "20", "--out", str(d)]) in (0, None)
    capsys.readouterr()
    assert main(["identify", "--adapter", f"dump:{d}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (call,) = doc["calls"]
    assert call["reproduced"] and "order=lanes" in call["policy"] and "y_formula=affine" in call["policy"]


def test_identify_recorded_names_every_call_and_searches_a_spread_of_channels(tmp_path, monkeypatch):
    """A recorded call larger than the search's budget of values is searched on a spread of its channels, then
    confirmed on every channel. The budget (SEARCH_VALUES, 65,536 values: a call past it cost 30-80 s of search)
    is lowered to 4,096 here, the call with it: the same branch, on 8 of 40 channels of 512 values."""
    from bnprobe.checks.identify import search

    monkeypatch.setattr(search, "SEARCH_VALUES", 1 << 12)
    d = tmp_path / "d"
    assert main(["dump", "--adapter", "emulated:bf16", "--dtype", "bf16", "--shape", "2,40,16,16", "--out",
                 str(d)]) in (0, None)
    run = identify(recording_of(f"dump:{d}"))
    (res,) = run.results
    assert res.reproduced
    spread = [n for n in res.notes if "confirmed on every channel" in n]
    assert spread and "channels 0, 6, 11, 17, 22, 28, 33, 39 of 40" in spread[0], res.notes


def test_doctor_names_a_lossy_recipe_in_words_with_field_and_value(capsys):
    from bnprobe.checks.doctor.diagnosis import doctor

    rep = doctor("emulated:fp16:variance=naive", "fp16", recipe=True, stability=True)
    assert not rep.passed
    words = [d for d in rep.diagnosis if d.startswith("its recipe")]
    assert words and "variance=naive" in words[0] and "single-pass" in words[0]
    assert main(["doctor", "--adapter", "dump:/nonexistent", "--recipe"]) == 2
    assert "bnprobe identify" in capsys.readouterr().err


def test_an_identified_spec_runs_in_compare_precision_as_one_adapter():
    from bnprobe.cli import split_adapters

    spec = "emulated:fp16:variance=chan,tiles=32,y_formula=scale,fma=true"
    assert split_adapters(f"{spec},torch, ascend-tbe:chip=910,cores=8") == \
        [spec, "torch", "ascend-tbe:chip=910,cores=8"]
    assert split_adapters("emulated,careful") == ["emulated", "careful"]

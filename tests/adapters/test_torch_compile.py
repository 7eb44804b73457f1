"""The torch-compile adapter (TorchInductor on the CPU), the onnxruntime adapter, and the recipe that names what
torch.compile's 16-bit BatchNorm does to its backward — each against something independent of bnprobe: autograd
through torch.compile itself, torch float64, numpy float64."""

import numpy as np
import pytest

from bnprobe.adapters.registry import get_adapter
from bnprobe.core.call import BNCall
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.recipes import RECIPE, SAVED_IN_INPUT_FORMAT, recipe_fits
from bnprobe.numerics.rounding import round_to

torch = pytest.importorskip("torch")


def _call(dtype="fp16", shape=(4, 3, 6, 6), seed=0, mean=3.0, params="fp32"):
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal(shape) * 2.0 + mean, dtype)
    dy = round_to(rng.standard_normal(shape), dtype)
    c = shape[1]
    return BNCall(x, round_to(rng.uniform(0.5, 1.5, c), "fp32"), round_to(rng.uniform(-0.5, 0.5, c), "fp32"),
                  np.zeros(c), np.ones(c), dy=dy, dtype=dtype, params=params)


# ---- the recipe, against torch float64 (no compile: the default suite) -------------------------------------

def test_the_recipe_backward_is_torch_float64_from_the_rounded_statistics():
    """The recipe's dx, dγ, dβ are the exact backward from statistics saved in the input's format: torch's float64
    backward handed the same fp16-rounded mean and invstd, rounded once."""
    call = _call("fp16")
    x = np.asarray(call.x, dtype=np.float64)
    mean16 = round_to(x.mean(axis=(0, 2, 3)), "fp16")
    inv16 = round_to(1.0 / np.sqrt(x.var(axis=(0, 2, 3)) + call.eps), "fp16")

    class Saved:
        mean = mean16

        @staticmethod
        def invstd(eps):
            return inv16

    got = {k: None for k in ("saved_mean", "saved_invstd", "dx", "dgamma", "dbeta")}
    out = RECIPE[SAVED_IN_INPUT_FORMAT].derive(call, got, Saved)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
    dx, dg, db = torch.ops.aten.native_batch_norm_backward(
        t(call.dy), t(x), t(call.gamma), None, None, t(mean16), t(inv16), True, call.eps, [True, True, True])
    assert np.array_equal(out["dx"], round_to(dx.numpy(), "fp16"))
    np.testing.assert_allclose(out["dgamma"], round_to(dg.numpy(), "fp32"), rtol=2 ** -22)
    np.testing.assert_allclose(out["dbeta"], round_to(db.numpy(), "fp32"), rtol=2 ** -22)
    assert np.array_equal(out["saved_mean"], mean16) and np.array_equal(out["saved_invstd"], inv16)


def test_the_recipe_does_not_claim_statistics_saved_finer():
    """A kernel that saved fp32 statistics (eager torch under mixed precision) is not this recipe's backward."""
    call = _call("fp16")
    x = np.asarray(call.x, dtype=np.float64)

    class Saved:
        mean = round_to(x.mean(axis=(0, 2, 3)), "fp32")

        @staticmethod
        def invstd(eps):
            return round_to(1.0 / np.sqrt(x.var(axis=(0, 2, 3)) + eps), "fp32")

    out = RECIPE[SAVED_IN_INPUT_FORMAT].derive(call, {"dx": None, "dgamma": None}, Saved)
    assert "dx" not in out and "dgamma" not in out
    assert not RECIPE[SAVED_IN_INPUT_FORMAT].applies(_call("fp32"))  # fp32 input: nothing narrower to save in
    assert not RECIPE[SAVED_IN_INPUT_FORMAT].applies(_call("fp16", params="same"))


def test_a_reduction_may_differ_from_the_exact_recipe_by_its_own_sum_order_only():
    """dγ summed in fp32 in another order is within √R ulps of the exact recipe; an unrelated error is not."""
    rng = np.random.default_rng(3)
    gold = rng.standard_normal(64) * 40
    recipe = gold + rng.standard_normal(64) * 0.01  # the recipe's own departure from the golden
    ulp = np.spacing(np.float32(np.abs(gold))).astype(np.float64)
    near = recipe + ulp * rng.standard_normal(64) * 4  # a few ulps from the recipe: the kernel's sum order
    bench = gold + ulp * 0.5
    assert not recipe_fits(near, recipe, bench, gold, "fp32")  # one ulp RMS: too strict for a sum
    assert recipe_fits(near, recipe, bench, gold, "fp32", terms=392)
    far = gold + rng.standard_normal(64) * 0.01  # as wrong as the recipe, another way
    assert not recipe_fits(far, recipe, bench, gold, "fp32", terms=392)


# ---- onnxruntime ---------------------------------------------------------------------------------------------

def test_onnxruntime_is_inference_only_and_said_so():
    pytest.importorskip("onnxruntime")
    a = get_adapter("onnxruntime")
    assert a.capabilities().modes == ("infer",)
    with pytest.raises(BNProbeError, match="does not support train"):
        a.train(_call("fp32"))
    with pytest.raises(BNProbeError, match="use params same"):
        a.infer(_call("fp16").with_(training=False))


def test_onnxruntime_refusals_name_the_flag_on_the_command_line(capsys):
    pytest.importorskip("onnxruntime")
    from bnprobe.cli import main

    assert main(["identify", "--adapter", "onnxruntime", "--dtype", "fp16"]) == 2
    assert capsys.readouterr().err.strip().endswith("in x's type (fp16): use --params same")
    assert main(["compare-precision", "--adapters", "onnxruntime", "--dtypes", "fp32", "--shape", "2,3,4,4",
                 "--no-stress", "--mode", "train"]) == 2
    assert capsys.readouterr().err.strip() == ("bnprobe: error: --mode train needs the kernel's training forward; "
                                               "onnxruntime runs inference only")


def test_compare_precision_judges_an_inference_only_kernel_on_inference_and_says_what_it_left_out(tmp_path):
    """The default modes on a deployment runtime's kernel: inference judged, training and backward named as not
    judged in the result's notes (the CLI prints them), beside a kernel that runs every mode."""
    pytest.importorskip("onnxruntime")
    from bnprobe.checks.compare.precision import compare_precision
    from bnprobe.engine.cases import select_cases

    kernels, cases, _ = select_cases([get_adapter("onnxruntime"), get_adapter("emulated")], shape="2,3,4,4")
    res = compare_precision(kernels, ("fp32",), cases)
    by = res.rows.groupby("adapter")["tensor"].agg(set)
    assert by["onnxruntime"] == {"y_infer"}
    assert {"y", "dx", "y_infer"} <= by["emulated"]
    assert ("onnxruntime runs inference only: its training forward (y, saved and running statistics) and backward "
            "(dx, dgamma, dbeta) are not judged") in res.meta["notes"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_onnxruntime_inference_is_close_to_float64(dtype):
    """Its y against numpy float64's (x − μ)/√(v + ε)·γ + β: within a few ulps of the terms a folded x·s + b adds
    (near y = 0 the fold cancels, so the bound is on the terms, not on y)."""
    pytest.importorskip("onnxruntime")
    call = _call(dtype, params="same").with_(training=False, running_mean=round_to(np.array([2.5, 3.0, 3.5]), dtype),
                                              running_var=round_to(np.array([3.0, 4.0, 5.0]), dtype))
    call = call.with_(gamma=round_to(call.gamma, dtype), beta=round_to(call.beta, dtype))
    y = get_adapter("onnxruntime").infer(call).y.astype(np.float64)
    col = lambda v: np.asarray(v, dtype=np.float64)[None, :, None, None]  # noqa: E731
    exact = (call.x - col(call.running_mean)) / np.sqrt(col(call.running_var) + np.float32(call.eps)) \
        * col(call.gamma) + col(call.beta)
    scale = col(call.gamma) / np.sqrt(col(call.running_var) + np.float32(call.eps))
    terms = np.abs(call.x * scale) + np.abs(col(call.beta) - col(call.running_mean) * scale)
    u = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11}[dtype]
    assert np.all(np.abs(y - exact) <= 4 * u * terms)


def test_torch_compile_options_are_checked_before_any_compile():
    a = get_adapter("torch-compile:mode=max-autotune,dynamic=true")
    assert (a.mode, a.dynamic, a.compiles) == ("max-autotune", True, 0)
    assert a.capabilities().saved == "invstd" and a.capabilities().modes == ("train", "infer", "backward")
    with pytest.raises(BNProbeError, match="mode must be one of default"):
        get_adapter("torch-compile:mode=fastest")
    with pytest.raises(BNProbeError, match="unknown option 'fullgraph=0'"):
        get_adapter("torch-compile:fullgraph=0")


# ---- torch-compile (each compiles: slow) ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_torch_compile_backward_is_autograd_through_the_compiled_forward(dtype):
    """The adapter's backward (native_batch_norm_backward compiled, on the forward's own saved statistics) is
    bit for bit what autograd through torch.compile of F.batch_norm gives; its saved statistics are in the
    input's format, and its outputs differ from eager's."""
    call = _call(dtype, shape=(4, 3, 6, 6))
    a = get_adapter("torch-compile")
    fwd = a.train(call)
    bwd = a.backward_of(call, fwd.saved)
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.from_numpy(np.asarray(call.x)).to(tdt).requires_grad_()
    w = torch.from_numpy(np.asarray(call.gamma)).float().requires_grad_()
    b = torch.from_numpy(np.asarray(call.beta)).float().requires_grad_()
    f = torch.compile(lambda x, w, b, rm, rv: torch.nn.functional.batch_norm(x, rm, rv, w, b, True, 0.1, call.eps),
                      dynamic=False, fullgraph=True)
    y = f(x, w, b, torch.zeros(3), torch.ones(3))
    y.backward(torch.from_numpy(np.asarray(call.dy)).to(tdt))
    assert np.array_equal(fwd.y.astype(np.float64), y.detach().double().numpy())
    assert np.array_equal(bwd.dx.astype(np.float64), x.grad.double().numpy())
    assert np.array_equal(bwd.dgamma.astype(np.float64), w.grad.double().numpy())
    assert fwd.saved.mean.dtype == {"fp16": np.float16, "fp32": np.float32}.get(dtype, fwd.saved.mean.dtype)
    assert fwd.meta["saved_format"] == dtype
    tdt_of = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    nbn = torch.compile(lambda *args: torch.ops.aten.native_batch_norm(*args), dynamic=False, fullgraph=True)
    raw = nbn(x.detach(), w.detach(), b.detach(), None, None, True, 0.1, call.eps)
    assert raw[1].dtype == raw[2].dtype == tdt_of[dtype]  # inductor's own choice: the input's dtype
    assert a.compiles >= 1 and a.compile_seconds > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # dynamo's own, tracing torch
def test_capture_of_a_compiled_model_says_what_it_recorded(tmp_path):
    """A torch.compile'd model's capture records each BatchNorm's forward as inductor computed it (the adapter
    reproduces its y bit for bit) and says, in the dump and each call, that the backward is not recorded."""
    import bnprobe
    from bnprobe.recordings import open_dump
    from bnprobe.recordings.capture import COMPILED_NOTE

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    cm = torch.compile(m)
    with bnprobe.capture(cm, tmp_path / "cap"):
        cm(torch.randn(4, 3, 10, 10)).sum().backward()
    d = open_dump(str(tmp_path / "cap"))
    assert any("torch.compile" in n for n in d.notes)
    (c,) = d.calls
    rec = c.load()
    assert COMPILED_NOTE in rec.meta["notes"] and not rec.meta["backward"]
    y = get_adapter("torch-compile").train(rec.call()).y
    assert np.array_equal(y, rec.get("train", "outputs", "y"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # dynamo's own, tracing torch
def test_monitor_of_a_compiled_model_says_what_it_watched(tmp_path):
    """The monitor on a torch.compile'd model watches each BatchNorm's forward and says, in its dumps' index and
    in each dumped call, that the backward is not watched."""
    import json

    import bnprobe
    from bnprobe.recordings.capture import COMPILED_NOTE

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    cm = torch.compile(m)
    with bnprobe.monitor(cm, tmp_path / "mon") as mon:
        x = torch.randn(4, 3, 10, 10)
        x[0, 0, 0, 0] = float("nan")  # an anomaly, so a call is dumped
        cm(x).sum().backward()
        mon.step()
    assert mon.compiled == ["_orig_mod.1"]
    (index,) = sorted((tmp_path / "mon").rglob("bnprobe-calls.json"))
    assert any("torch.compile" in n for n in json.loads(index.read_text())["notes"])
    (dump,) = sorted(index.parent.rglob("bnprobe-dump.json"))
    assert COMPILED_NOTE in json.loads(dump.read_text())["meta"]["notes"]

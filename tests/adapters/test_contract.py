"""The contract every available adapter passes: shapes, layouts, dtypes, saved statistics, running
statistics, agreement with the FP64 reference, and clear errors on bad input."""

import sys
from pathlib import Path

import numpy as np
import pytest

from bnprobe.adapters import Saved, get_adapter, list_adapters
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import record
from bnprobe.core.call import BNCall
from bnprobe.core.formats import get_format
from bnprobe.core.tolerances import KERNEL_AGREEMENT as TOL  # |y - reference| allowed per format

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # examples/ as a package path for the plugin

NAMES = ["reference", "emulated", "emulated:fp16-acc16", "ascend-tbe", "ascend-tbe:chip=910", "ascend-bnv3",
         "ascend-950", "torch", "examples.plugin_adapter:NumpyFP32BatchNorm"]
SHAPES = [(16, 4), (8, 4, 9), (4, 4, 5, 6), (2, 4, 3, 4, 5)]


def available(name):
    base = name.split(":")[0]
    row = next((r for r in list_adapters() if r["name"] == base), None)
    return row is None or row["available"]


ADAPTERS = [n for n in NAMES if available(n)]


def dtypes_of(adapter):
    return [d for d in ("fp32", "fp16", "bf16", "fp64") if d in adapter.capabilities().formats]


def make(shape, seed=0, layout="channels_first"):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * 1.5 + 0.5
    if layout == "channels_last":
        x = np.moveaxis(x, 1, -1).copy()
    return x, rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.normal(0, 0.2, c), rng.uniform(0.5, 2, c)


@pytest.fixture(params=ADAPTERS)
def adapter(request):
    return get_adapter(request.param)


@pytest.fixture(scope="module")
def reference():
    return get_adapter("reference")


def test_protocol_and_capabilities(adapter):
    caps = adapter.capabilities()
    assert isinstance(adapter.name, str) and caps.formats and set(caps.modes) <= {"train", "infer", "backward"}
    assert caps.saved in ("invstd", "var", "none")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_train_matches_reference(adapter, reference, shape):
    for dtype in dtypes_of(adapter):
        for layout in adapter.capabilities().layouts:
            if len(shape) == 2 and layout == "channels_last":
                continue
            x, g, b, rm, rv = make(shape, layout=layout)
            out = adapter.forward_train(x, g, b, rm, rv, dtype=dtype, layout=layout)
            ref = reference.forward_train(x, g, b, rm, rv, dtype=dtype, layout=layout)
            fmt = get_format(dtype)
            assert out.y.shape == x.shape
            assert out.y.dtype == get_format(adapter.capabilities().output or fmt.name).dtype
            assert np.abs(out.y.astype(np.float64) - ref.y).max() <= TOL[dtype], (dtype, layout)
            caps = adapter.capabilities()
            assert out.saved.kind == caps.saved and out.saved.mean.shape == (shape[1],)
            np.testing.assert_allclose(out.saved.mean.astype(np.float64), ref.saved.mean, rtol=0,
                                       atol=10 * TOL[dtype] * 0.1 + 1e-12)
            np.testing.assert_allclose(out.saved.invstd(1e-5), ref.saved.invstd(1e-5), rtol=10 * TOL[dtype])
            # running statistics move 10% of the way to the batch statistics (unbiased variance)
            np.testing.assert_allclose(out.running_mean.astype(np.float64), ref.running_mean, atol=1e-6 + TOL[dtype])
            np.testing.assert_allclose(out.running_var.astype(np.float64), ref.running_var, rtol=1e-5 + TOL[dtype])


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_infer_and_backward_match_reference(adapter, reference, shape):
    x, g, b, rm, rv = make(shape, seed=1)
    dy = np.random.default_rng(2).standard_normal(shape)
    for dtype in dtypes_of(adapter):
        inf = adapter.forward_infer(x, g, b, rm, rv, dtype=dtype)
        assert np.abs(inf.y.astype(np.float64) - reference.forward_infer(x, g, b, rm, rv, dtype=dtype).y).max() \
            <= TOL[dtype]
        f = adapter.forward_train(x, g, b, rm, rv, dtype=dtype)
        bw = adapter.backward(dy, x, g, f.saved, dtype=dtype)
        rb = reference.backward(dy, x, g, f.saved, dtype=dtype)  # the reference on the adapter's own statistics
        assert bw.dx.shape == x.shape and bw.dgamma.shape == bw.dbeta.shape == (shape[1],)
        assert np.abs(bw.dx.astype(np.float64) - rb.dx).max() <= 2 * TOL[dtype]
        scale = np.abs(dy).sum() / shape[1]
        assert np.abs(bw.dbeta.astype(np.float64) - rb.dbeta).max() <= TOL[dtype] * scale * 0.1 + 1e-9
        assert np.abs(bw.dgamma.astype(np.float64) - rb.dgamma).max() <= TOL[dtype] * scale * 0.1 + 1e-9
        ib = adapter.backward(dy, x, g, Saved(rm, "var", rv), dtype=dtype, training=False)
        rib = reference.backward(dy, x, g, Saved(rm, "var", rv), dtype=dtype, training=False)
        assert np.abs(ib.dx.astype(np.float64) - rib.dx).max() <= 2 * TOL[dtype]


@pytest.mark.parametrize("call,match", [
    (lambda a, d: a.forward_train(np.ones((4, 3, 2)), np.ones(4), dtype=d), r"gamma has shape \(4,\) but x has 3"),
    (lambda a, d: a.forward_train(np.ones(5), dtype=d), r"2 to 5 dimensions"),
    (lambda a, d: a.forward_train(np.ones((4, 3)), eps=0, dtype=d), r"eps must be a finite number > 0"),
    (lambda a, d: a.forward_infer(np.ones((4, 3)), None, None, np.zeros(2), np.ones(3), dtype=d),
     r"running_mean has shape"),
    (lambda a, d: a.backward(np.ones((4, 2)), np.ones((4, 3)), None, Saved(np.zeros(3), "invstd", np.ones(3)),
                             dtype=d), r"dy has shape"),
    (lambda a, d: a.forward_train(np.ones((4, 3)), dtype="fp8_e5m2"), r"does not run fp8_e5m2"),
    (lambda a, d: a.forward_train(np.ones((4, 3)), dtype=d, params="double"), r"params must be one of"),
])
def test_bad_input_is_a_clear_error(adapter, call, match):
    with pytest.raises(BNProbeError, match=match):
        call(adapter, dtypes_of(adapter)[0])


def test_a_replayed_dump_passes_the_contract(tmp_path, reference):
    """A dump replays exactly what was recorded, and only for the recorded inputs."""
    from bnprobe.recordings import load_dump, write_dump

    x, g, b, rm, rv = make((4, 4, 5, 6), seed=3)
    dy = np.random.default_rng(4).standard_normal(x.shape)
    src = get_adapter("ascend-bnv3")
    write_dump(record(src, BNCall(x, g, b, rm, rv, dy, dtype="bf16")), tmp_path)
    rep = DumpAdapter(load_dump(tmp_path))
    i = rep.inputs("train")
    out = rep.forward_train(i["x"], i["gamma"], i["beta"], i["running_mean"], i["running_var"], dtype="bf16")
    ref = reference.forward_train(i["x"], i["gamma"], i["beta"], i["running_mean"], i["running_var"], dtype="bf16")
    assert out.y.dtype == get_format("bf16").dtype and np.abs(out.y.astype(np.float64) - ref.y).max() <= TOL["bf16"]
    assert out.saved.kind == "var"
    bi = rep.inputs("backward")
    bw = rep.backward(bi["dy"], bi["x"], bi["gamma"], Saved(bi["saved_mean"], "var", bi["saved_value"]),
                      dtype="bf16")
    assert bw.dx.shape == x.shape
    with pytest.raises(BNProbeError, match="differs from the recorded one"):
        rep.forward_train(i["x"] + 1, i["gamma"], i["beta"], i["running_mean"], i["running_var"], dtype="bf16")
    with pytest.raises(BNProbeError, match="does not run fp16"):
        rep.forward_train(i["x"], dtype="fp16")


@pytest.mark.parametrize("name, staged, golden", [
    ("reference", True, True), ("emulated", True, False), ("emulated:bf16-acc16", True, False),
    ("careful", True, False), ("ascend-tbe", True, False), ("ascend-bnv3", True, False), ("ascend-950", True, False),
    ("syncbn", False, False), ("tests.checks.bn_plugins:NumpyBN", False, False),
    ("examples.plugin_adapter:NumpyFP32BatchNorm", False, False),
])
def test_the_capabilities_say_what_bnprobe_can_run_stage_by_stage_and_which_is_the_golden(name, staged, golden):
    """The checks ask the capabilities, never the adapter's class or name: staged (bnprobe runs it stage by stage,
    its policy_for names the Policy) and golden (the FP64 reference), as declared and through a convention's view."""
    from bnprobe.adapters.convention import in_convention, reference_for

    a = get_adapter(name)
    caps = a.capabilities()
    assert (caps.staged, caps.golden) == (staged, golden)
    assert caps.staged == callable(getattr(a, "policy_for", None))
    view = in_convention(a, "flax").capabilities()
    assert (view.staged, view.golden, view.convention) == (staged, golden, "flax")
    assert reference_for("flax").capabilities().golden

"""The dump adapter replays a recording: each call is answered with the outputs recorded for it, and a call that
differs from the recording in any scalar or tensor is refused, naming what differs."""

import numpy as np
import pytest

from bnprobe.adapters import Saved
from bnprobe.adapters.dump import DumpAdapter
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import load_dump
from tests.recordings.test_dumps import recorded  # one recording helper for both test files


@pytest.mark.parametrize("change,match", [
    (dict(eps=0.5), r"asks eps = 0.5 but .* was made with eps = 1e-05"),
    (dict(momentum=0.3), r"asks momentum = 0.3 but .* momentum = 0.1"),
    (dict(params="same"), r"asks the parameter format = 'fp16' but .* = 'fp32'"),
])
def test_a_replay_with_other_scalars_names_the_argument(tmp_path, change, match):
    rec = recorded(tmp_path)
    rep = DumpAdapter(load_dump(tmp_path))
    i = rep.inputs("train")
    kw = dict(dtype="fp16", eps=1e-5, momentum=0.1, params="fp32")
    out = rep.forward_train(i["x"], i["gamma"], i["beta"], i["running_mean"], i["running_var"], **kw)
    np.testing.assert_array_equal(out.y.astype(np.float64), rec.tensors["train"]["outputs"]["y"])
    with pytest.raises(BNProbeError, match=match):
        rep.forward_train(i["x"], i["gamma"], i["beta"], i["running_mean"], i["running_var"], **{**kw, **change})


def test_a_replay_without_the_recorded_running_stats_or_in_the_other_mode_is_refused(tmp_path):
    recorded(tmp_path)
    rep = DumpAdapter(load_dump(tmp_path))
    i = rep.inputs("train")
    with pytest.raises(BNProbeError, match="gives no 'running_mean' but the recording has one"):
        rep.forward_train(i["x"], i["gamma"], i["beta"], dtype="fp16")
    b = rep.inputs("backward")
    with pytest.raises(BNProbeError, match=r"asks training = False but .* training = True"):
        rep.backward(b["dy"], b["x"], b["gamma"], Saved(b["saved_mean"], "invstd", b["saved_value"]), dtype="fp16",
                     training=False)
    with pytest.raises(BNProbeError, match="asks eps = 0.001"):
        rep.backward(b["dy"], b["x"], b["gamma"], Saved(b["saved_mean"], "invstd", b["saved_value"]), dtype="fp16",
                     eps=1e-3)


def test_a_replay_refuses_what_the_recording_lacks_and_other_saved_statistics(tmp_path):
    """A call recorded without γ/β or running statistics answers only a call without them; a backward
    recorded with saved statistics answers only those statistics."""
    rec = recorded(tmp_path)
    ins = rec.tensors["train"]["inputs"]
    del ins["gamma"], ins["running_mean"], ins["running_var"]
    rep = DumpAdapter(rec)
    i = rep.inputs("train")
    with pytest.raises(BNProbeError, match="gives 'gamma' but the recording has none"):
        rep.forward_train(i["x"], np.full(3, 5.0), i["beta"], dtype="fp16")
    with pytest.raises(BNProbeError, match="gives 'running_mean' but the recording has none"):
        rep.forward_train(i["x"], None, i["beta"], np.zeros(3), np.ones(3), dtype="fp16")
    rep.forward_train(i["x"], None, i["beta"], dtype="fp16")  # γ absent means γ = 1
    b = DumpAdapter(load_dump(tmp_path)).inputs("backward")
    rep = DumpAdapter(load_dump(tmp_path))
    good = Saved(b["saved_mean"], "invstd", b["saved_value"])
    rep.backward(b["dy"], b["x"], b["gamma"], good, dtype="fp16")
    with pytest.raises(BNProbeError, match="'saved_mean' differs"):
        rep.backward(b["dy"], b["x"], b["gamma"], Saved(b["saved_mean"] + 1, "invstd", b["saved_value"]), dtype="fp16")
    with pytest.raises(BNProbeError, match="saved statistics of kind"):
        rep.backward(b["dy"], b["x"], b["gamma"], Saved(b["saved_mean"], "var", b["saved_value"]), dtype="fp16")


def test_the_replayed_inputs_compare_as_numpy_compares_them():
    """A recording answers its own inputs: the same bits, or the same values by numpy's comparison (-0 for 0, a NaN
    of another payload), and nothing else."""
    from bnprobe.adapters.dump import _same_values

    a = np.array([1.0, -0.0, np.nan, 2.5])
    b = np.array([1.0, 0.0, -np.nan, 2.5])
    assert _same_values(a, a.copy()) and _same_values(a, b)
    assert not _same_values(a, np.array([1.0, 0.0, np.nan, 2.5000000000000004]))
    assert _same_values(a, a.astype(np.float32).astype(np.float64))
    assert _same_values(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0], dtype=np.float32))  # (numpy's compare)
    assert not _same_values(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.5], dtype=np.float32))

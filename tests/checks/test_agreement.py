"""One verdict per call across commands: compare-precision and gradcheck judge the same output of the same recorded
call by the same rule, so they agree wherever both judge it, and doctor fails every gradient compare-precision
fails — on a matrix of kernels (correct, and wrong by a chosen amount either side of the bounds) × formats ×
inputs."""

import numpy as np
import pytest

from bnprobe.adapters.dump import DumpAdapter
from bnprobe.checks.compare import compare_precision
from bnprobe.checks.diagnosis import doctor_recorded
from bnprobe.checks.gradients import gradcheck_recorded
from bnprobe.checks.recorded import Recorded
from bnprobe.recordings import load_dump, record, write_dump
from tests.checks.bn_plugins import NumpyBN

KERNELS = {"correct": lambda: NumpyBN(), "dx+0.1%": lambda: NumpyBN(scaled="dx", scale=1e-3),
           "dx+1%": lambda: NumpyBN(scaled="dx", scale=1e-2), "dx-30%": lambda: NumpyBN(scaled="dx", scale=-0.3),
           "dgamma-mean": lambda: NumpyBN("dgamma-mean"), "dx-drops-mean": lambda: NumpyBN("dx-drops-mean")}
INPUTS = {"normal": (0.0, 1.0), "mean=100": (100.0, 1.0)}


def _dump(tmp_path, kernel, fmt, mean, std):
    rng = np.random.default_rng(5)
    x = mean + std * rng.standard_normal((8, 4, 6, 6))
    dy = rng.standard_normal(x.shape) + 0.5  # a non-zero mean per channel, as real losses give
    rec = record(kernel, x=x, gamma=rng.uniform(0.5, 1.5, 4), beta=rng.normal(0, 0.1, 4), running_mean=np.zeros(4),
                 running_var=np.ones(4), dy=dy, dtype=fmt, modes=("train", "backward"))
    write_dump(rec, tmp_path)
    return DumpAdapter(load_dump(tmp_path))


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_compare_precision_and_gradcheck_agree_on_every_gradient(tmp_path, fmt, inputs):
    verdicts = {}
    for name, make in KERNELS.items():
        dump = _dump(tmp_path / name, make(), fmt, *INPUTS[inputs])
        rows = compare_precision([dump], budget=False).rows
        compare = {r.tensor: r.verdict == "PASS" for r in rows.itertuples() if r.tensor in ("dx", "dgamma", "dbeta")}
        g = gradcheck_recorded(Recorded(dump, dump.calls)).results[0]
        grad = {r.tensor: r.passed for r in g.rows if r.check == "vs-fp64"}
        assert compare == grad, (name, compare, grad)
        verdicts[name] = all(compare.values())
        # doctor fails the gradients wherever compare-precision fails one (it may fail more: its own rule)
        doc = doctor_recorded(Recorded(dump, dump.calls)).results[0]
        backward = next(i for i in doc.items if i.name.startswith("backward"))
        assert verdicts[name] or backward.status == "FAIL", (name, compare, backward.evidence)
        assert not (name == "correct" and backward.status == "FAIL"), backward.evidence
    # the matrix is not trivial: the correct kernel passes, the gross bugs fail, in every format and input
    assert verdicts["correct"] and not verdicts["dx-30%"] and not verdicts["dgamma-mean"], verdicts

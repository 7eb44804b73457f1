"""The adapters backed by bnprobe's own kernels (bnprobe/adapters/emulated.py)."""

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import counters_only
from bnprobe.compiled import kernels as compiled
from bnprobe.kernels import Execution, backward, forward_infer, forward_train
from bnprobe.numerics.rounding import round_to


@pytest.mark.parametrize("name", ["careful", "emulated"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_policy_adapters_hand_the_fast_kernels_tensors_in_their_formats_own_dtype(name, dtype, monkeypatch):
    """The base rounds x and dy to the run's format and holds them in float64; the adapter passes them to the
    kernels in the format's own dtype (an exact conversion), which the compiled route's fast kernels read (a
    float64 tensor takes its general kernels, 10x slower).  The results equal the kernels' on the float64
    tensors: every output and every trace counter and range."""
    monkeypatch.setenv("BNPROBE_JIT", "1")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6, 5, 5)) * 3 + 1
    dy = rng.standard_normal(x.shape)
    x[0, 0, 0, :3] = (2.0**-20, -(2.0**-26), 0.0)  # an fp16 subnormal, one lost to zero, a zero
    rm, rv = np.zeros(6), np.ones(6)
    seen = []
    for k in ("load_fast", "backward_fast", "dx_source_fast"):
        monkeypatch.setattr(compiled, k, lambda *a, _real=getattr(compiled, k), _k=k: seen.append(
            (_k, a[0].dtype)) or _real(*a))
    a = counters_only(get_adapter(name))
    f = a.forward_train(x, None, None, rm, rv, dtype=dtype)
    b = a.backward(dy, x, None, f.saved, dtype=dtype)
    i = a.forward_infer(x, None, None, rm, rv, dtype=dtype)
    assert {k for k, _ in seen} == {"load_fast", "backward_fast", "dx_source_fast"}
    assert all(dt != np.float64 for _, dt in seen)
    assert all(r.trace.meta["route"] == "compiled" for r in (f, b, i))

    xr, dyr = round_to(x, dtype), round_to(dy, dtype)  # float64, as the base holds them
    assert xr.dtype == np.float64
    kw = dict(execution=Execution(keep_arrays=False))
    want_f = forward_train(xr, None, None, rm, rv, policy=a.policy_for(x, dtype=dtype, mode="train"), **kw)
    want_b = backward(dyr, xr, None, want_f.mean, want_f.invstd, policy=a.policy_for(x, dtype=dtype, mode="backward"),
                      **kw)
    want_i = forward_infer(xr, None, None, rm, rv, policy=a.policy_for(x, dtype=dtype, mode="infer"), **kw)
    for got, want in ((f.y, want_f.y), (f.saved.mean, want_f.mean), (f.saved.value, want_f.invstd),
                      (f.running_mean, want_f.running_mean), (f.running_var, want_f.running_var),
                      (b.dx, want_b.dx), (b.dgamma, want_b.dgamma), (b.dbeta, want_b.dbeta), (i.y, want_i.y)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    for got, want in ((f, want_f), (b, want_b), (i, want_i)):
        assert got.trace.names() == want.trace.names()
        for sg, sw in zip(got.trace, want.trace):
            assert all(np.array_equal(sg.counters[k], sw.counters[k]) for k in sg.counters), sg.name
            assert np.array_equal([sg.vmin, sg.vmax], [sw.vmin, sw.vmax], equal_nan=True), sg.name

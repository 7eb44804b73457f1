"""The adapter interface's helpers (bnprobe.adapters.base)."""

import numpy as np

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import counters_only, outputs_only
from bnprobe.engine.cases import Case
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.checks.doctor.diagnosis import doctor


def test_counters_only_copies_a_traced_adapter_and_leaves_the_callers_unchanged():
    a = get_adapter("emulated:fp16")
    twin = counters_only(a)
    assert twin is not a and twin.keep_arrays is False and a.keep_arrays is True and twin.name == a.name
    assert counters_only(twin) is twin  # already counters-only: itself
    plain = object()  # an adapter without traces is returned as it is
    assert counters_only(plain) is plain


def test_outputs_only_copies_a_traced_adapter_gives_its_outputs_and_no_trace():
    a = get_adapter("emulated:fp16-acc16")
    twin = outputs_only(a)
    assert twin is not a and (twin.keep_arrays, twin.counters) == (False, False)
    assert (a.keep_arrays, a.counters) == (True, True) and twin.name == a.name
    assert outputs_only(twin) is twin
    plain = object()
    assert outputs_only(plain) is plain
    x = np.random.default_rng(2).standard_normal((3, 4, 5, 5)) * 300  # fp16-acc16: sums of squares overflow
    f, g = a.forward_train(x, dtype="fp16"), twin.forward_train(x, dtype="fp16")
    np.testing.assert_array_equal(f.y, g.y)
    assert f.trace.stages and not g.trace.stages
    dy = np.ones_like(x)
    bf, bg = a.backward(dy, x, None, f.saved, dtype="fp16"), twin.backward(dy, x, None, g.saved, dtype="fp16")
    for u, v in ((bf.dx, bg.dx), (bf.dgamma, bg.dgamma), (bf.dbeta, bg.dbeta)):
        np.testing.assert_array_equal(u, v)


def test_checks_leave_the_callers_adapters_as_they_were():
    """compare_precision and doctor run traced kernels without traces on copies, never changing what was passed."""
    a = get_adapter("emulated:fp16")
    compare_precision([a], ("fp16",), [Case("n", (2, 3, 4, 4), seed=0)], budget=False)
    assert a.keep_arrays is True and a.counters is True
    doctor(a, "fp16", stability=False, x=np.ones((2, 3, 2, 2)))
    assert a.keep_arrays is True and a.counters is True

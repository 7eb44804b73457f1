"""The adapter interface's helpers (bnprobe.adapters.base)."""

import numpy as np

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import counters_only
from bnprobe.checks.cases import Case
from bnprobe.checks.compare import compare_precision
from bnprobe.checks.diagnosis import doctor


def test_counters_only_copies_a_traced_adapter_and_leaves_the_callers_unchanged():
    a = get_adapter("emulated:fp16")
    twin = counters_only(a)
    assert twin is not a and twin.keep_arrays is False and a.keep_arrays is True and twin.name == a.name
    assert counters_only(twin) is twin  # already counters-only: itself
    plain = object()  # an adapter without traces is returned as it is
    assert counters_only(plain) is plain


def test_checks_leave_the_callers_adapters_as_they_were():
    """compare_precision and doctor run traced kernels counters-only on copies, never changing what was passed."""
    a = get_adapter("emulated:fp16")
    compare_precision([a], ("fp16",), [Case("n", (2, 3, 4, 4), seed=0)], budget=False)
    assert a.keep_arrays is True
    doctor(a, "fp16", stability=False, x=np.ones((2, 3, 2, 2)))
    assert a.keep_arrays is True

import numpy as np
import pytest

from bnprobe.adapters import Saved, get_adapter

pytest.importorskip("torch")

# torch's result vs the FP64 reference on the same rounded inputs: a few ulps of |y| <= ~5
from bnprobe.core.tolerances import KERNEL_AGREEMENT as TOL


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("layout,shape", [("channels_first", (8, 6, 5, 5)), ("channels_last", (8, 5, 5, 6)),
                                          ("channels_first", (16, 6)), ("channels_last", (2, 3, 4, 5, 6))])
@pytest.mark.parametrize("params", ["fp32", "same"])
def test_torch_agrees_with_reference(dtype, layout, shape, params):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 2 + 1
    c = 6
    g, b, rm, rv = rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), np.zeros(c), np.ones(c)
    t, ref = get_adapter("torch"), get_adapter("reference")
    kw = dict(dtype=dtype, layout=layout, params=params)
    a, r = t.forward_train(x, g, b, rm, rv, **kw), ref.forward_train(x, g, b, rm, rv, **kw)
    assert np.abs(a.y.astype(np.float64) - r.y).max() <= TOL[dtype]
    np.testing.assert_allclose(a.running_var.astype(np.float64), r.running_var, rtol=max(TOL[dtype], 1e-6))
    np.testing.assert_allclose(a.saved.invstd(1e-5), r.saved.invstd(1e-5), rtol=max(TOL[dtype] / 4, 1e-6))
    dy = rng.standard_normal(x.shape)
    ab, rb = t.backward(dy, x, g, a.saved, **kw), ref.backward(dy, x, g, a.saved, **kw)
    assert np.abs(ab.dx.astype(np.float64) - rb.dx).max() <= 2 * TOL[dtype]
    ai = t.forward_infer(x, g, b, rm, rv, **kw)
    assert np.abs(ai.y.astype(np.float64) - ref.forward_infer(x, g, b, rm, rv, **kw).y).max() <= TOL[dtype]
    ib = t.backward(dy, x, g, Saved(rm, "var", rv), training=False, **kw)
    assert np.abs(ib.dx.astype(np.float64) - ref.backward(dy, x, g, Saved(rm, "var", rv), training=False,
                                                          **kw).dx).max() <= 2 * TOL[dtype]

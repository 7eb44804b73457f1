"""identify on Paddle's and MindSpore's live CPU BatchNorm: each reproduced bit for bit (forward, running statistics,
inference and backward), and the recipe it names run by bnprobe equals the framework on shapes identify never saw —
H·W a whole number of SIMD packets or not, fewer and more channels than a packet.

Each framework is an optional extra: these tests skip where it is not installed (the default suite), and
``.ci/frameworks`` runs them in the framework's own virtual environment."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.base import Capabilities
from bnprobe.adapters.emulated import PolicyAdapter
from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.checks.identify.search import identify
from bnprobe.core.call import BNCall
from bnprobe.kernels.policy import get_policy

# adapter, format: the fields its recipe must hold (what was read in the sources and measured)
EXPECTED = {
    ("paddle", "fp32"): ("order=eigen", "lanes=8", "rsqrt=sqrt_recip", "sqrt=eigen_fast", "y_formula=affine_mr",
                         "backward_formula=paddle", "running_momentum=keep", "running_var=biased",
                         "infer_rsqrt=sqrt_div"),
    ("mindspore", "fp32"): ("order=omp_simd", "lanes=4", "rsqrt=sqrt_div", "backward_formula=onednn",
                            "backward_lanes=1"),
    ("mindspore", "fp16"): ("order=omp_simd", "lanes=4", "rsqrt=sqrt_div", "backward_formula=onednn",
                            "backward_lanes=1"),
}
SHAPES = [(3, 5, 7, 11), (4, 9, 8, 8), (2, 19, 3, 161), (5, 3, 6, 7), (1, 2, 1, 3)]


def _adapter(name: str):  # noqa: ANN202
    why = why_unavailable(name)
    if why:
        pytest.skip(why)
    return get_adapter(name)


@pytest.fixture(scope="module", params=sorted(EXPECTED), ids=lambda k: f"{k[0]}-{k[1]}")
def found(request):  # noqa: ANN001, ANN201
    name, fmt = request.param
    kernel = _adapter(name)
    return name, fmt, kernel, identify(kernel, fmt, params="fp32")


def test_identify_reproduces_the_kernel_bit_for_bit(found) -> None:  # noqa: ANN001
    name, fmt, _, res = found
    assert res.departs is None, res.departs
    off = [o.output for o in res.outputs if not (o.probes_exact and o.fresh_exact is not False)]
    assert not off, off
    assert {o.output for o in res.outputs} >= {"saved_mean", "y", "running_mean", "running_var", "y_infer", "dx",
                                                "dgamma", "dbeta"}
    for field in EXPECTED[(name, fmt)]:
        assert field in res.spec, (field, res.spec)
    # (its adapter hands the framework NCHW: channels-last is computed, and reproduced, as channels-first)
    assert res.layouts and all(lay.reproduced for lay in res.layouts.values()), res.notes


def _call(shape: tuple[int, ...], fmt: str, seed: int) -> BNCall:
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.normal(0, 20, c)[None, :, None, None] + rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape)
    if fmt == "fp16":
        x = x / 8
    return BNCall(x, dy=rng.standard_normal(shape) + 1.0, dtype=fmt, params="fp32", gamma=rng.uniform(0.3, 3, c),
                  beta=rng.normal(0, 1, c), running_mean=rng.normal(0, 1, c), running_var=rng.uniform(0.5, 2, c),
                  momentum=0.1, eps=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_recipe_equals_the_framework_on_shapes_identify_never_saw(found, shape) -> None:  # noqa: ANN001
    name, fmt, kernel, res = found
    pol = get_policy(res.spec)
    # (the recipe, saving what the kernel saves)
    emu = PolicyAdapter("recipe", lambda p, mode: pol, Capabilities(formats=(fmt,), saved=kernel.capabilities().saved))
    call = _call(shape, fmt, sum(shape))
    a, b = kernel.train(call), emu.train(call)
    assert a.saved.kind == b.saved.kind
    pairs = {"y": (a.y, b.y), "saved_mean": (a.saved.mean, b.saved.mean), "saved": (a.saved.value, b.saved.value),
             "running_mean": (a.running_mean, b.running_mean), "running_var": (a.running_var, b.running_var),
             "y_infer": (kernel.infer(call).y, emu.infer(call).y)}
    ga, gb = kernel.backward_of(call, a.saved), emu.backward_of(call, a.saved)
    pairs.update(dx=(ga.dx, gb.dx), dgamma=(ga.dgamma, gb.dgamma), dbeta=(ga.dbeta, gb.dbeta))
    for k, (got, want) in pairs.items():
        assert np.array_equal(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)), (name, k)

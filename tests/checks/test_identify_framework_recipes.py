"""identify on hidden recipes of the frameworks' CPU kernels (Paddle's Eigen sums and fast packet sqrt, MindSpore's
oneDNN omp-simd sums and backward; tests/kernels/test_framework_recipes.py replays them from the sources), behind the
plain adapter interface: each recovered and then checked bit for bit on inputs the search never saw, by running the
identified spec and the black box side by side.  The live frameworks: tests/adapters/test_frameworks_identified.py."""

import pytest

from bnprobe.adapters.base import params_mode
from bnprobe.checks.identify.search import identify
from bnprobe.kernels.policy import get_policy

from .test_identify import OUTPUTS, BlackBox, fresh_call, side_by_side

PADDLE = ("fp32:order=eigen,lanes=8,y_formula=affine_mr,rsqrt=sqrt_recip,sqrt=eigen_fast,backward_formula=paddle,"
          "running_momentum=keep,running_var=biased,infer_rsqrt=sqrt_div")
MINDSPORE = "{fmt}:order=omp_simd,lanes=4,y_formula=scale,rsqrt=sqrt_div,backward_formula=onednn,backward_lanes=1"


@pytest.mark.parametrize("spec", [
    PADDLE, MINDSPORE.format(fmt="fp32"),
    # (fp16's y hides the training formula; inference shows it: the slowest of the three, a second search)
    pytest.param(MINDSPORE.format(fmt="fp16"), marks=pytest.mark.slow)])
def test_a_framework_recipe_is_recovered_bit_for_bit_on_inputs_it_never_saw(spec: str) -> None:
    target = get_policy(spec)
    params = params_mode(target.storage, target.params_format)
    kernel = BlackBox(target)
    res = identify(kernel, target.storage, params=params)
    assert res.reproduced, (res.spec, res.departs)
    off = side_by_side(kernel, res.spec, fresh_call(target.storage, params, seed=5))
    assert set(off) >= set(OUTPUTS)
    assert not any(off.values()), off

"""bnprobe's policies of two frameworks' CPU kernels, against plain-numpy replays of those kernels' sources
(tests/framework_replays.py, each checked bit for bit against its framework by .ci/frameworks), without the
frameworks: Paddle 3.3.1's GroupNorm (``order=lanes_tail``: each channel's blocks of 8 in 8 lanes, then its tail;
one-pass variance clamped at 0; ε added in double) and MindSpore 2.10's fp16 LayerNorm (``y_formula=xhat_div``:
(x − μ)/σ with μ and σ rounded to fp16, every step in fp16). Each choice is seen: the neighbouring policy misses."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.layout import NormShape
from bnprobe.kernels.norms import forward
from tests.framework_replays import mindspore_layer_replay, paddle_group_replay

F32, H = np.float32, np.float16
PADDLE = "fp32:variance=naive,clamp_var=true,order=lanes_tail,lanes=8,rstd_format=fp64"
MINDSPORE = "fp16:params=fp16,compute=fp16,rsqrt=sqrt_div,y_formula=xhat_div"


def _y(x: np.ndarray, g: np.ndarray, b: np.ndarray, sh: NormShape, eps: float, policy: str) -> np.ndarray:
    return forward(x.astype(float), g.astype(float), b.astype(float), shape=sh, eps=eps, policy=policy,
                   keep_arrays=False, counters=False).y


@pytest.mark.parametrize("shape,groups,mean,std", [((2, 8, 3, 5), 2, 100, 1), ((2, 16, 8, 8), 4, 100, 1),
                                                   ((2, 16, 8, 8), 4, 0.5, 1e-5**0.5), ((3, 6, 7, 3), 3, 1, 2),
                                                   ((2, 12, 1, 1), 3, 5, 1), ((1, 4, 9), 1, -3, 0.1)])
def test_paddle_groupnorm_policy_is_its_source_replayed(shape, groups, mean, std) -> None:  # noqa: ANN001
    rng = np.random.default_rng(sum(shape) + groups)
    x = (mean + std * rng.standard_normal(shape)).astype(F32)
    g, b = rng.uniform(0.5, 2, shape[1]).astype(F32), rng.standard_normal(shape[1]).astype(F32)
    sh = NormShape.of("group", shape, groups=groups)
    want = paddle_group_replay(x, groups, 1e-5, g, b)
    assert np.array_equal(_y(x, g, b, sh, 1e-5, PADDLE), want)
    if mean == 100:  # the lanes and the tail are seen: plain 8 lanes over the group's values (no tail per channel)
        assert not np.array_equal(_y(x, g, b, sh, 1e-5, PADDLE.replace("order=lanes_tail", "order=lanes")), want)


@pytest.mark.parametrize("mean,std,hid", [(100, 1, 1024), (0, 1, 768), (0, 200, 4096), (0, 3e-3, 1024),
                                          (3, 0.5, 77)])
def test_mindspore_fp16_layernorm_policy_is_its_source_replayed(mean, std, hid) -> None:  # noqa: ANN001
    rng = np.random.default_rng(hid)
    x = (mean + std * rng.standard_normal((8, hid))).astype(H)
    g, b = rng.uniform(0.5, 2, hid).astype(H), rng.standard_normal(hid).astype(H)
    sh = NormShape.of("layer", x.shape, (hid,))
    want = mindspore_layer_replay(x, g, b, 1e-7)
    assert np.array_equal(_y(x, g, b, sh, 1e-7, MINDSPORE), want)
    # dividing by σ is seen: multiplying by 1/σ misses
    assert not np.array_equal(_y(x, g, b, sh, 1e-7, MINDSPORE.replace(",y_formula=xhat_div", "")), want)


def test_the_new_choices_are_refused_where_they_mean_nothing() -> None:
    sh = NormShape.of("layer", (4, 32), (32,))
    with pytest.raises(BNProbeError, match="xhat_div"):
        _y(np.ones((4, 32)), np.ones(32), np.zeros(32), sh, 1e-5, "fp16:y_formula=xhat_div,rsqrt=exact")

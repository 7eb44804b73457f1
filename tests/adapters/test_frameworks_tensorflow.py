"""TensorFlow's fused BatchNorm (oneDNN's kernels behind it, TensorFlow's Eigen gradient for fp16) and Keras 3's
BatchNormalization on TensorFlow (its backward TensorFlow's autodiff), reproduced bit for bit by bnprobe's emulation:
the recipes identify finds, on shapes that take each code path (channel counts that the vector width divides and
not; fewer samples than threads and more), and identify itself on both adapters.  Skipped where TensorFlow is not
installed (the default suite); `.ci/frameworks` runs this file in its tensorflow environment.

The recipes name what depends on the machine: the thread count T (oneDNN splits the batch over TensorFlow's
intra-op threads: os.cpu_count() here), the vector width that selects oneDNN's JIT kernel (fp32: 4, SSE4.1 up;
bf16 and fp16: 16, on AVX-512 with bf16 and fp16 support) and Intel's RSQRTPS table (Keras's rsqrt, TensorFlow's
fp16 gradient); a machine without them skips the tests that need them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.core.call import BNCall
from bnprobe.engine.run import generated_call

THREADS = os.cpu_count() or 1
TENSORFLOW = {
    "fp32": "fp32:order=sequential,subnormals=flush,y_formula=scale,rsqrt=sqrt_div,backward_formula=onednn,"
            "threads={t},thread_split=samples,path_channels=4,unbiased_by=momentum_factor",
    "bf16": "bf16:order=sequential,subnormals=flush,y_formula=scale,rsqrt=sqrt_div,backward_formula=onednn,"
            "threads={t},thread_split=samples,path_channels=16,unbiased_by=momentum_factor",
    "fp16": "fp16:order=sequential,y_formula=scale,rsqrt=sqrt_div,backward_formula=tf_eigen,threads={t},"
            "thread_split=samples,path_channels=16,packet_lanes=8,unbiased_by=momentum_factor",
}
# (TensorFlow flushes float32 subnormals; fp16's are made by the final conversion, which keeps them)
KERAS = ("{fmt}:order=interleave4,y_formula=affine,rsqrt=rsqrtps,rsqrt_newton=1,newton_form=eigen,packet_lanes=8,"
         "running_var=biased,backward_formula=keras_tf")
FLUSH = {"fp32": ",subnormals=flush", "bf16": ",subnormals=flush", "fp16": ""}
# (N, C, H, W): the C++ loop (C = 19, 6, 7), the JIT kernel (C = 12: fp32 only; 16, 32), one sample (threads idle in
# the C++ loop, positions split in the JIT kernel), more samples than threads
SHAPES = [(4, 19, 5, 7), (3, 6, 9, 11), (1, 12, 6, 6), (5, 7, 3, 3), (2, 16, 3, 5), (1, 32, 3, 5), (6, 5, 9, 13)]


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return set()
    text = info.read_text()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return set(flags) | ({"intel"} if "GenuineIntel" in text else set())


def _needs(fmt: str, *, rsqrt: bool = False) -> None:
    why = why_unavailable("tensorflow")
    if why:
        pytest.skip(why)
    flags = _cpu_flags()
    if fmt == "bf16" and "avx512_bf16" not in flags or fmt == "fp16" and "avx512_fp16" not in flags:
        pytest.skip(f"oneDNN's {fmt} JIT kernel (channel counts 16 divides) needs AVX-512 with {fmt} support")
    if rsqrt and "intel" not in flags:
        pytest.skip("the RSQRTPS table emulated is Intel's")


def _call(shape: tuple[int, ...], fmt: str, seed: int) -> BNCall:
    from bnprobe.numerics.rounding import round_to

    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, shape) + rng.normal(0, 30, c)[None, :, None, None]
    dy = rng.standard_normal(shape) + rng.normal(0, 2, c)[None, :, None, None]
    vec = [round_to(v, "fp32") for v in (rng.uniform(0.3, 3, c), rng.normal(0, 1, c), rng.normal(0, 1, c),
                                         rng.uniform(0.5, 2, c))]
    return BNCall(round_to(x, fmt), *vec, dy=round_to(dy, fmt), eps=1e-3, momentum=0.1, dtype=fmt, params="fp32")


def _mismatches(kernel, spec: str, call: BNCall) -> dict[str, int]:
    """Mismatching elements per output (train, inference, backward from the kernel's own saved statistics) of the
    kernel and emulated:<spec>, as identify scores them."""
    from bnprobe.checks.identify.probes import emulate, observe, score_outputs
    from bnprobe.engine.cases import Case
    from bnprobe.kernels.policy import get_policy

    obs = observe(kernel, Case("probe", call=call, purpose="a shape"), generated_call(call, label="probe"))
    assert set(obs.got) >= {"y", "y_infer", "dx", "dgamma", "dbeta"}
    saved = kernel.capabilities().saved
    mine = emulate(get_policy(spec), obs, ("train", "infer", "backward"), saved)
    return {k: v.mismatches for k, v in score_outputs([obs], [mine], tuple(obs.got)).items()}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_tensorflow_fused_batch_norm_is_reproduced_bit_for_bit(fmt: str) -> None:
    _needs(fmt, rsqrt=fmt == "fp16")
    kernel = get_adapter("tensorflow")
    spec = TENSORFLOW[fmt].format(t=THREADS)
    for i, shape in enumerate(SHAPES):
        off = _mismatches(kernel, spec, _call(shape, fmt, 100 + i))
        assert not any(off.values()), (shape, off)


def test_tensorflow_fp16_gradient_on_a_batch_eigen_splits_over_its_threads() -> None:
    """A batch large enough (R = 32768, C = 24) that TensorFlow's ReduceOuterDimensions runs its row blocks on
    separate threads: the recipe's thread count decides the sums."""
    _needs("fp16", rsqrt=True)
    if THREADS < 2:
        pytest.skip("one thread: no split")
    call = _call((32, 24, 32, 32), "fp16", 5)
    off = _mismatches(get_adapter("tensorflow"), TENSORFLOW["fp16"].format(t=THREADS), call)
    assert not any(off.values()), off


def test_the_tensorflow_recipe_fails_where_its_choices_matter() -> None:
    """Guards: one thread instead of the machine's, or never the JIT kernel, misses (on a machine with threads)."""
    _needs("fp32")
    if THREADS < 2:
        pytest.skip("one thread: no split to get wrong")
    kernel = get_adapter("tensorflow")
    call = _call((4, 19, 5, 7), "fp32", 7)
    assert any(_mismatches(kernel, TENSORFLOW["fp32"].format(t=1), call).values())
    assert any(_mismatches(kernel, TENSORFLOW["fp32"].format(t=THREADS).replace("path_channels=4", "path_channels=0"),
                           _call((2, 16, 3, 5), "fp32", 8)).values())


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_keras_batch_normalization_is_reproduced_bit_for_bit(fmt: str) -> None:
    """Keras's training and inference forwards and its backward (TensorFlow's autodiff through the layer's ops)."""
    _needs("fp32", rsqrt=True)
    if why_unavailable("keras"):
        pytest.skip(why_unavailable("keras"))
    kernel = get_adapter("keras")
    for i, shape in enumerate(SHAPES):
        off = _mismatches(kernel, KERAS.format(fmt=fmt) + FLUSH[fmt], _call(shape, fmt, 200 + i))
        assert not any(off.values()), (shape, off)


def test_the_keras_recipe_fails_where_its_choices_matter() -> None:
    """Guards: sums in order (not Eigen's four accumulators), or RSQRTPS on every channel, miss."""
    _needs("fp32", rsqrt=True)
    kernel = get_adapter("keras")
    call = _call((4, 19, 5, 7), "fp32", 9)
    assert any(_mismatches(kernel, KERAS.format(fmt="fp32").replace("interleave4", "sequential"), call).values())
    assert any(_mismatches(kernel, KERAS.format(fmt="fp32").replace("packet_lanes=8", "packet_lanes=0"),
                           call).values())


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_identify_reproduces_tensorflow(fmt: str) -> None:
    from bnprobe.checks.identify.search import identify

    _needs(fmt, rsqrt=fmt == "fp16")
    res = identify("tensorflow", fmt)
    assert res.reproduced, (res.spec, res.departs)
    assert f"threads={THREADS}" in res.spec or THREADS == 1


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_identify_reproduces_keras(fmt: str) -> None:
    from bnprobe.checks.identify.search import identify

    _needs("fp32", rsqrt=True)
    res = identify("keras", fmt)
    assert res.reproduced, (res.spec, res.departs)
    assert "backward_formula=keras_tf" in res.spec and "rsqrt=rsqrtps" in res.spec

"""compare-precision on LayerNorm, RMSNorm, GroupNorm and InstanceNorm (--norm): a correct kernel — any summation
order, variance algorithm or y formula bnprobe emulates, in fp32 arithmetic — passes every default input in every
format; a naive 16-bit port fails; torch's CPU LayerNorm, whose 16-bit backward sums dγ and dβ in x's format,
fails there and says so; inputs that do not fit are refused before any work."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bnprobe.core.call import NORM_NAMES
from bnprobe.checks.compare.precision import CallOptions, compare_precision
from bnprobe.core.errors import BNProbeError
from bnprobe.engine.cases import family_cases
from bnprobe.numerics.rounding import round_to

CORRECT = ["order=sequential", "variance=welford,lanes=8", "y_formula=affine,fma=true", "y_formula=scale",
           "order=lanes,lanes=16,mean_by=reciprocal"]


def _failing(res) -> list[str]:  # noqa: ANN001
    rows = res.rows
    return [f"{r.adapter} {r.dtype} {r.case} {r.tensor}: {r.why[:160]}" for r in rows.itertuples()
            if str(r.verdict).endswith("FAIL")]


@pytest.mark.parametrize("norm,groups", [("layer", None), ("rms", None), ("group", 16), ("instance", None)])
# (bf16 and fp32 run with the slow tests, .ci/run's second stage: the default suite keeps within its 10 minutes)
@pytest.mark.parametrize("fmt", ["fp16", pytest.param("bf16", marks=pytest.mark.slow),
                                 pytest.param("fp32", marks=pytest.mark.slow)])
def test_a_correct_kernel_never_fails(norm, groups, fmt) -> None:  # noqa: ANN001
    adapters = [f"emulated:{fmt}:{c}" for c in CORRECT]
    res = compare_precision(adapters, (fmt,), options=CallOptions(norm=norm, groups=groups))
    assert len(res.rows) > 0
    assert not _failing(res), _failing(res)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_naive_16_bit_port_fails(norm) -> None:  # noqa: ANN001
    res = compare_precision(["emulated:fp16-acc16"], ("fp16",), options=CallOptions(norm=norm))
    failing = res.rows[res.rows.verdict.astype(str).str.endswith("FAIL")]
    assert len(failing)
    # named by the model of what the port does (fp16 sums; LayerNorm's preset takes E[x²] − E[x]²) where its
    # emulation reproduces the output — the port also computes in fp16, which no model has: the rest say so
    named = failing[failing.cause.notna()]
    assert set(named.cause) <= {"statistics-accumulated-in-16-bit", "one-pass-variance"}
    assert "statistics-accumulated-in-16-bit" in set(named.cause)
    assert named.why.str.contains("it matches the model of: ").all()
    unnamed = failing[failing.cause.isna()]
    assert unnamed.unnamed.str.contains(f"no bug model of {NORM_NAMES[norm]} reproduces it").all()


@pytest.mark.parametrize("norm,fmt,choice,model",
                         [("rms", "fp16", "accumulate=fp16", "statistics-accumulated-in-16-bit"),
                          ("layer", "bf16", "cast_point=before_gamma", "xhat-cast-before-gamma")])
def test_compare_precision_names_a_planted_defect_as_doctor_does(norm, fmt, choice, model) -> None:  # noqa: ANN001
    """compare-precision names each failing output of a planted defect by the doctor's model of it (one naming for
    both commands: tests/checks/test_doctor_family.py plants the same kernels)."""
    res = compare_precision([f"emulated:{fmt}:{choice}"], (fmt,), options=CallOptions(norm=norm))
    failing = res.rows[res.rows.verdict.astype(str).str.endswith("FAIL")]
    assert len(failing) and (failing.cause == model).all(), failing[["case", "tensor", "cause"]]
    assert failing.why.str.contains("bit for bit").all()


def test_what_no_model_reproduces_says_what_is_known() -> None:
    """dγ, dβ summed in fp16 buffers on 3 threads (no thread count the per-thread model tries: the kernel declares
    none, and 3 is neither this machine's count nor a power of two): unnamed, and the row says that its errors
    are of the size of fp16's rounding — what a sum carried in fp16 gives."""
    if os.cpu_count() == 3:
        pytest.skip("3 is this machine's thread count: the per-thread model tries it")
    cases = [c for c in family_cases("layer") if c.name == "hidden/768"]
    res = compare_precision(["emulated:fp16:grad_sum_format=fp16,order=sequential,threads=3"], ("fp16",), cases,
                            options=CallOptions(norm="layer"))
    failing = res.rows[res.rows.verdict.astype(str).str.endswith("FAIL")]
    assert sorted(failing.tensor) == ["dbeta", "dgamma"]
    for why in failing.unnamed:
        assert "its errors are of the size of fp16's rounding" in why
        assert "no bug model of LayerNorm reproduces it" in why


def test_torch_layernorm_16_bit_backward_fails_and_says_it_summed_in_x_format() -> None:
    pytest.importorskip("torch")
    cases = [c for c in family_cases("layer") if c.name == "hidden/768"]
    res = compare_precision(["torch"], ("fp16", "bf16"), cases, options=CallOptions(norm="layer"))
    rows = res.rows.set_index(["dtype", "tensor"])
    for fmt in ("fp16", "bf16"):
        for t in ("dgamma", "dbeta"):
            r = rows.loc[(fmt, t)]
            assert str(r.verdict).endswith("FAIL")
            # named by the doctor's model of torch's per-thread buffers of x's format, reproduced bit for bit
            assert r.cause == "dgamma-per-thread-16-bit-buffers" and "bit for bit" in r.why
        assert str(rows.loc[(fmt, "y")].verdict).endswith("PASS")
    # (independently: on one thread torch's own dγ, by autograd, holds only values of x's format: its buffer)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(4, 128, 768, dtype=torch.float16, requires_grad=True)
        w = torch.ones(768, requires_grad=True)
        torch.nn.functional.layer_norm(x, (768,), w, None, 1e-5).backward(torch.randn(4, 128, 768,
                                                                                     dtype=torch.float16))
    finally:
        torch.set_num_threads(threads)
    g = w.grad.double().numpy()
    assert np.array_equal(round_to(g, "fp16"), g)


@pytest.mark.parametrize("adapters,options,says", [
    (["ascend-tbe"], CallOptions(norm="layer"), "runs no LayerNorm"),
    (["careful"], CallOptions(norm="layer", normalized_shape=(5,)), "not x's trailing dimensions"),
    (["careful"], CallOptions(norm="group", groups=7), "groups must divide"),
])
def test_what_does_not_fit_is_refused_before_any_work(adapters, options, says) -> None:  # noqa: ANN001
    with pytest.raises(BNProbeError, match=None) as e:
        compare_precision(adapters, ("fp16",), options=options)
    assert says in str(e.value)


def test_inference_alone_is_refused_for_a_layer_without_running_statistics() -> None:
    with pytest.raises(BNProbeError, match="keeps no running statistics"):
        compare_precision(["careful"], ("fp16",), mode="infer", options=CallOptions(norm="rms"))


def test_a_nan_row_does_not_take_the_bound_from_the_finite_rows(tmp_path) -> None:  # noqa: ANN001
    """InstanceNorm captured from torch with a NaN pixel in one sample, dy = 1 everywhere it is finite: dx is exactly
    0 in every finite row (a constant dy normalises away), torch's is rounding noise there, within a correct kernel's
    accumulation bound — the NaN rows (the golden's NaN too) must not make that bound unusable for the rest."""
    torch = pytest.importorskip("torch")
    from bnprobe import capture
    from bnprobe.engine.rules import within_bound

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.InstanceNorm2d(8, affine=True))
    x = torch.randn(4, 3, 16, 16)
    x[1, :, 5, 5] = float("nan")
    with capture(m, tmp_path / "cap"):
        m(x).nan_to_num().sum().backward()
    res = compare_precision([f"dump:{tmp_path / 'cap'}"], None)
    dx = res.rows[res.rows.tensor == "dx"].iloc[0]
    assert str(dx.verdict).endswith("PASS"), dx.why
    # the exemption is for the golden's own NaN only: a NaN where the golden is finite, or a finite value where it
    # is NaN, is not within any bound
    g = np.array([0.0, np.nan, 1.0])
    bound = (np.full(3, 1e-6), "test")
    assert within_bound(np.array([1e-7, np.nan, 1.0]), g, "fp32", bound) is not None
    assert within_bound(np.array([np.nan, np.nan, 1.0]), g, "fp32", bound) is None
    assert within_bound(np.array([1e-7, 0.0, 1.0]), g, "fp32", bound) is None
    assert within_bound(np.array([1e-7, np.inf, 1.0]), g, "fp32", bound) is None

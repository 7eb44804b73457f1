"""The compiled route of LayerNorm and RMSNorm (bnprobe.kernels.norms_compiled, bnprobe.compiled.family) against the
numpy route, bit for bit: y, the saved statistics, dx, dγ, dβ, and every stage's counters and ranges of both traces
and of the parameters' traces, over policies x layers x formats x shapes, with NaN and inf rows, values near fp16's
range and values whose results are fp16 subnormals or lost to zero.  The numpy route is the one
tests/kernels/test_norms.py checks against a plain-Python replay and torch; small calls are forced through the
compiled route (BNPROBE_JIT=1), the larger grid is marked slow."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from bnprobe.kernels.norms import NormShape, backward, forward
from bnprobe.kernels.norms_compiled import numpy_route, takes_compiled
from bnprobe.kernels.policy import get_policy

pytest.importorskip("numba")

STORAGE = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# the presets, the careful kernel's policy with 16-bit parameters (compare-precision's bench for model.half()),
# and the saved statistics in another format
POLICIES = ("fp32", "fp16", "bf16", "fp16:params=fp16", "bf16:params=bf16", "fp16:saved_format=fp16")


@pytest.fixture(autouse=True)
def _compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BNPROBE_JIT", "1")


def _bits(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a).view(f"u{np.asarray(a).dtype.itemsize}")


def _same_outputs(got: object, want: object, names: tuple[str, ...]) -> None:
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert np.array_equal(_bits(a), _bits(b)), f"{name} differs at {np.flatnonzero(_bits(a) != _bits(b))[:5]}"


def _same_trace(got: object, want: object) -> None:
    assert got.names() == want.names()
    for a, b in zip(got.stages, want.stages):
        assert (a.format, a.size, a.elementwise) == (b.format, b.size, b.elementwise), a.name
        for key in b.counters:
            assert np.array_equal(a.counters[key], b.counters[key]), (a.name, key)
        for key in ("vmin", "vmax", "absmax"):
            va, vb = getattr(a, key), getattr(b, key)
            assert va == vb or (np.isnan(va) and np.isnan(vb)), (a.name, key, va, vb)


def _inputs(kind: str, shape: tuple[int, ...], storage: str, seed: int) -> tuple[np.ndarray, ...]:
    """x, dy (storage values), γ and β (float64) of one kind of input."""
    rng = np.random.default_rng(seed)
    r = shape[-1]
    x = rng.standard_normal(shape) * 2 + 0.5
    dy = rng.standard_normal(shape)
    g, b = rng.standard_normal(r), rng.standard_normal(r)
    if kind == "special":  # a NaN row, an inf row, a constant row
        flat = x.reshape(-1, r)
        flat[0, r // 2] = np.nan
        if flat.shape[0] > 2:  # (a row left unflagged: the compiled route takes the call)
            flat[-1, 0] = np.inf
            flat[1] = 3.0
    elif kind == "large":  # near fp16's largest: y overflows fp16 at a row's outlier, dx in a row of large dy
        x = np.clip(x * 20000.0, -65000, 65000)
        g = (1 + 0.05 * g) * 15000.0
        x.reshape(-1, r)[0, -1] = 65000.0
        dy.reshape(-1, r)[1] *= 60000.0
    elif kind == "denormal":  # rows near the formats' smallest: 16-bit subnormal x, binary32 subnormal stages
        flat = x.reshape(-1, r)
        flat[0] *= 1e-6 if storage == "fp16" else 1e-39
        flat[1] *= 1e-37
        if flat.shape[0] > 3:
            flat[2, : r // 2] = 1e-30
            dy.reshape(-1, r)[3] *= 1e-30
    elif kind == "tiny":  # y and dx fp16 subnormals and values lost to zero
        g = g * 1e-6
        b = b * 1e-7
        dy = dy * 1e-6
    dt = STORAGE[storage]
    with np.errstate(all="ignore"):
        return x.astype(dt), dy.astype(dt), g, b


def _check(norm: str, policy: str, shape: tuple[int, ...], kind: str, *, offset: float = 0.0, counters: bool = True,
           beta: bool = True, seed: int = 0) -> None:
    pol = get_policy(policy)
    x, dy, g, b = _inputs(kind, shape, pol.storage, seed)
    b = b if beta else None
    sh = NormShape.of(norm, shape)
    assert takes_compiled(pol, norm, x.size, sh.r, False)
    def run() -> tuple:
        f = forward(x, g, b, shape=sh, policy=pol, weight_offset=offset, keep_arrays=False, counters=counters)
        return f, backward(dy, x, g, f.mean, f.rstd, shape=sh, policy=pol, weight_offset=offset, keep_arrays=False,
                           counters=counters)
    f1, b1 = run()
    with numpy_route():
        f2, b2 = run()
    if kind == "normal" or sh.rows > 3:  # (rows left unflagged: the compiled route took the call)
        assert f1.trace.meta.get("route") == b1.trace.meta.get("route") == "compiled"
    assert "route" not in f2.trace.meta
    _same_outputs(f1, f2, ("y", "mean", "rstd", "var"))
    _same_outputs(b1, b2, ("dx", "dgamma", "dbeta"))
    for t1, t2 in ((f1.trace, f2.trace), (f1.param_trace, f2.param_trace), (b1.trace, b2.trace),
                   (b1.param_trace, b2.param_trace)):
        _same_trace(t1, t2)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [(3, 5, 100), (7, 33), (2, 3, 1)])
def test_compiled_equals_numpy(norm: str, policy: str, shape: tuple[int, ...]) -> None:
    """Rows of R not a multiple of any vector width and row counts not a power of two (the pairwise trees' folds),
    and R = 1."""
    _check(norm, policy, shape, "normal")


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("policy", ["fp16", "bf16", "fp32", "fp16:params=fp16"])
@pytest.mark.parametrize("kind", ["special", "large", "tiny", "denormal"])
def test_compiled_equals_numpy_on_rare_values(norm: str, policy: str, kind: str) -> None:
    """NaN, inf and constant rows (the flagged rows computed by numpy, the NaN columns of dγ and dβ summed again),
    overflows of fp16's range, subnormal and vanished 16-bit outputs (counted by the kernels), subnormal inputs and
    binary32 subnormal stages (flagged)."""
    _check(norm, policy, (6, 40), kind)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_compiled_options(norm: str) -> None:
    """A weight offset (Gemma's 1 + w, its stage in the parameters' trace), RMSNorm with a β, a run without a trace,
    and normalised shapes of two dims."""
    _check(norm, "fp16", (4, 3, 20), "normal", offset=1.0)
    _check(norm, "bf16", (4, 3, 20), "special", counters=False)
    _check(norm, "fp16", (5, 17), "normal", beta=norm == "layer")
    pol = get_policy("fp16")
    x, dy, g, b = _inputs("normal", (3, 4, 6), "fp16", 1)
    sh = NormShape.of(norm, (3, 4, 6), (4, 6))
    f1 = forward(x, g.repeat(4)[:24], None, shape=sh, policy=pol, keep_arrays=False)
    with numpy_route():
        f2 = forward(x, g.repeat(4)[:24], None, shape=sh, policy=pol, keep_arrays=False)
    assert f1.trace.meta["route"] == "compiled"
    _same_outputs(f1, f2, ("y", "mean", "rstd", "var"))
    _same_trace(f1.trace, f2.trace)


def test_the_route_refuses_what_it_does_not_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Policies outside the route, traces keeping arrays, another layer, BNPROBE_JIT=0 and small calls under auto
    take numpy; so does an x holding values its format does not (the numpy route rounds and counts them)."""
    fp16 = get_policy("fp16")
    assert takes_compiled(fp16, "layer", 100, 10, False)
    for spec in ("fp16:order=sequential", "fp16:fma=true", "fp16:variance=welford", "fp16:y_formula=affine",
                 "fp16:backward_formula=torch", "fp16:rounding=toward_zero", "fp16-acc16", "fp64",
                 "fp16:cast_point=before_gamma", "fp16:eps_format=fp16", "fp16:grad_sum_format=bf16",
                 "fp16:rsqrt=magic", "fp16:rstd_cast=bf16"):
        assert not takes_compiled(get_policy(spec), "layer", 100, 10, False), spec
    assert not takes_compiled(fp16, "layer", 100, 10, True)
    assert not takes_compiled(fp16, "group", 100, 10, False)
    monkeypatch.setenv("BNPROBE_JIT", "auto")
    assert not takes_compiled(fp16, "layer", 100, 10, False)
    assert takes_compiled(fp16, "layer", 1 << 22, 4096, False)
    monkeypatch.setenv("BNPROBE_JIT", "0")
    assert not takes_compiled(fp16, "layer", 1 << 22, 4096, False)
    monkeypatch.setenv("BNPROBE_JIT", "1")
    x = np.random.default_rng(2).standard_normal((4, 30))  # float64 values fp16 does not hold
    sh = NormShape.of("layer", x.shape)
    f = forward(x, shape=sh, policy=fp16, keep_arrays=False)
    with numpy_route():
        want = forward(x, shape=sh, policy=fp16, keep_arrays=False)
    assert "route" not in f.trace.meta
    _same_outputs(f, want, ("y", "mean", "rstd", "var"))
    held = x.astype(np.float16).astype(np.float64)  # float64 values fp16 holds: taken
    assert forward(held, shape=sh, policy=fp16, keep_arrays=False).trace.meta["route"] == "compiled"


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("policy", POLICIES + ("bf16:params=fp16", "fp32:params=bf16"))
@pytest.mark.parametrize("shape", [(64, 1000), (33, 4096), (2, 129, 257), (1, 2, 5000)])
@pytest.mark.parametrize("kind", ["normal", "special", "large", "tiny", "denormal"])
def test_compiled_equals_numpy_grid(norm: str, policy: str, shape: tuple[int, ...], kind: str) -> None:
    _check(norm, policy, shape, kind, seed=len(shape) + shape[-1])

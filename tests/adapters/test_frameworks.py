"""The other frameworks' live adapters, each against an independent float64 numpy BatchNorm in its own convention,
in every format it claims; the same kernel under another convention fails and is named.

Each framework is an optional extra: these tests skip where it is not installed (the default suite), and `.ci/run`
runs them in one virtual environment per framework (``.ci/frameworks``)."""

from __future__ import annotations

import numpy as np
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.adapters.frameworks import why_unavailable
from bnprobe.adapters.convention import in_convention
from bnprobe.checks.doctor.diagnosis import doctor
from bnprobe.checks.gradcheck.gradients import gradcheck
from bnprobe.core.conventions import get_convention
from bnprobe.core.errors import BNProbeError

# adapter: (the module it needs, its formats, the formats it runs with parameters in x's format)
FRAMEWORKS = {
    "jax": ("flax", ("fp32", "fp16", "bf16"), ("fp16", "bf16")),
    "tensorflow": ("tensorflow", ("fp32", "fp16", "bf16"), ()),
    "keras": ("keras", ("fp32", "fp16", "bf16"), ("fp16", "bf16")),
    "paddle": ("paddle", ("fp32", "fp64"), ()),
    "mindspore": ("mindspore", ("fp32", "fp16"), ()),
}
U = {"fp64": 2.0**-53, "fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
NP = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16}


def _adapter(name: str):  # noqa: ANN202
    why = why_unavailable(name)
    if why:
        pytest.skip(why)
    return get_adapter(name)


def _cases() -> list:
    return [(n, f) for n, (_, fmts, _) in FRAMEWORKS.items() for f in fmts]


def _oracle(x: np.ndarray, g: np.ndarray, b: np.ndarray, rm: np.ndarray, rv: np.ndarray, m: float, eps: float,
            conv: str) -> dict[str, np.ndarray]:
    """BatchNorm in float64 numpy (NCHW), running statistics as the framework's documentation defines them."""
    ax = (0, 2, 3)
    r = x.size // x.shape[1]
    mean, var = x.mean(axis=ax), x.var(axis=ax)
    col = lambda v: v[None, :, None, None]  # noqa: E731
    y = col(g) * (x - col(mean)) / np.sqrt(col(var) + eps) + col(b)
    batch_var = var if conv in ("flax", "keras", "paddle") else var * r / (r - 1)
    return {"y": y, "running_mean": (1 - m) * rm + m * mean, "running_var": (1 - m) * rv + m * batch_var,
            "mean": mean, "var": var}


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6, 5, 5)) * 2 + 3
    return x, rng.uniform(0.5, 2, 6), rng.standard_normal(6), rng.standard_normal(6), rng.uniform(0.5, 2, 6)


def _stored(a: np.ndarray, fmt: str) -> np.ndarray:
    """``a`` rounded to ``fmt`` (bf16 by ml_dtypes' cast, the framework's own input)."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if fmt == "bf16" else NP[fmt]
    return a.astype(dt).astype(np.float64)


@pytest.mark.parametrize("name,fmt", _cases())
def test_training_forward_and_running_statistics_match_the_oracle_in_its_convention(name: str, fmt: str) -> None:
    a = _adapter(name)
    conv = get_convention(a.capabilities().convention)
    x, g, b, rm, rv = _inputs()
    xs = _stored(x, fmt)
    pf = "fp64" if fmt == "fp64" else "fp32"
    g, b, rm, rv = (_stored(v, pf) for v in (g, b, rm, rv))
    out = a.forward_train(xs, g, b, rm, rv, dtype=fmt, momentum=0.1, eps=1e-3, params="fp32")
    # Paddle keeps ε and momentum as float32 attributes even in fp64 (the exact ones miss by 1e-11 in y)
    attr = (lambda v: float(np.float32(v))) if name == "paddle" else float  # noqa: E731
    k = 1 - attr(0.9) if name == "paddle" else 0.1
    want = _oracle(xs, g, b, rm, rv, k, attr(1e-3), conv.name)
    # y: within a few units of the format's rounding of values up to max|y| (the statistics are at least fp32)
    err = np.abs(np.asarray(out.y, dtype=np.float64) - want["y"]).max()
    assert err <= 4 * U[fmt] * np.abs(want["y"]).max() + 64 * U["fp32" if fmt != "fp64" else "fp64"], (name, err)
    tol = 1e-5 if fmt != "fp64" else 1e-12
    np.testing.assert_allclose(np.asarray(out.running_mean, dtype=np.float64), want["running_mean"], rtol=tol,
                               atol=tol)
    np.testing.assert_allclose(np.asarray(out.running_var, dtype=np.float64), want["running_var"], rtol=tol)
    if out.saved is not None:  # what the framework saves: as its convention says
        assert out.saved.kind == conv.saved
        np.testing.assert_allclose(np.asarray(out.saved.var(1e-3), dtype=np.float64), want["var"], rtol=1e-4)


@pytest.mark.parametrize("name,fmt", _cases())
def test_doctor_finds_the_framework_healthy_in_its_convention(name: str, fmt: str) -> None:
    a = _adapter(name)
    rep = doctor(a, fmt, params="fp32", stability=False)
    bad = {i.name: i.evidence for i in rep.items if i.status == "FAIL"}
    if name == "jax" and fmt in ("fp16", "bf16"):
        # flax with dtype=float16/bfloat16 runs its backward's arithmetic in that format: dx is less accurate than
        # a careful kernel's (msprobe's benchmark rule), a real loss, not a convention
        assert set(bad) == {"backward: dx, dgamma, dbeta"}, bad
        assert "less accurate than a careful kernel" in bad["backward: dx, dgamma, dbeta"]
        return
    assert not bad, bad
    assert not rep.diagnosis


@pytest.mark.parametrize("name", [n for n, (_, _, same) in FRAMEWORKS.items() if same])
def test_parameters_in_the_input_format(name: str) -> None:
    a = _adapter(name)
    for fmt in FRAMEWORKS[name][2]:
        rep = doctor(a, fmt, params="same", stability=False)
        assert all(i.status != "FAIL" or i.name.startswith("backward") for i in rep.items), rep.items


@pytest.mark.parametrize("name", [n for n, (_, fmts, same) in FRAMEWORKS.items()
                                  if any(f not in same and f not in ("fp32", "fp64") for f in fmts)])
def test_a_parameter_format_the_framework_lacks_is_refused_in_one_line(name: str) -> None:
    a = _adapter(name)
    fmt = next(f for f in FRAMEWORKS[name][1] if f not in ("fp32", "fp64"))
    x, g, b, rm, rv = _inputs()
    with pytest.raises(BNProbeError, match=f"adapter {name}: .*fp32"):
        a.forward_train(_stored(x, fmt), g, b, rm, rv, dtype=fmt, params="same")


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_under_another_convention_the_running_variance_fails_and_is_named(name: str) -> None:
    a = _adapter(name)
    conv = get_convention(a.capabilities().convention)
    wrong = "torch" if conv.running_var == "biased" else "flax"
    rep = doctor(in_convention(a, wrong), "fp32", params="fp32", stability=False)
    failed = [i for i in rep.items if i.status == "FAIL"]
    assert [i.name.split(":")[0] for i in failed] == ["running statistics"], failed
    words = ("running_var updated with the biased variance" if wrong == "torch"
             else "running_var updated with the unbiased variance (× R/(R-1), torch's convention, not flax's)")
    assert rep.diagnosis == [words]


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_gradcheck_runs_every_framework_whatever_it_saves(name: str) -> None:
    a = _adapter(name)
    res = gradcheck(a, "fp32", (4, 3, 5, 5))
    assert res.passed, [r for r in res.rows if not r.passed]
    if a.capabilities().saved == "none":
        assert any("saves no statistics" in n for n in res.notes)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_channels_last_input_gives_the_same_values(name: str) -> None:
    a = _adapter(name)
    x, g, b, rm, rv = _inputs()
    xs = _stored(x, "fp32")
    first = a.forward_train(xs, g, b, rm, rv, dtype="fp32")
    last = a.forward_train(np.moveaxis(xs, 1, -1), g, b, rm, rv, dtype="fp32", layout="channels_last")
    np.testing.assert_array_equal(np.moveaxis(np.asarray(last.y), -1, 1), np.asarray(first.y))


def test_flax_fp16_backward_error_is_beyond_rounding_of_the_exact_gradient() -> None:
    """The doctor's finding on flax fp16, checked independently: its dx errs by more than rounding the float64
    gradient to fp16 does (a careful kernel's error), on the doctor's own input shape."""
    a = _adapter("jax")
    rng = np.random.default_rng(3)
    x = _stored(rng.standard_normal((8, 16, 6, 6)) * 3 + 5, "fp16")
    dy = _stored(rng.standard_normal(x.shape) * 100, "fp16")
    g = _stored(rng.uniform(0.5, 2, 16), "fp32")
    out = a.backward(dy, x, g, a.forward_train(x, g, None, dtype="fp16").saved or _saved(x), dtype="fp16")
    ax = (0, 2, 3)
    mean, var = x.mean(axis=ax, keepdims=True), x.var(axis=ax, keepdims=True)
    r = 1 / np.sqrt(var + 1e-5)
    xh = (x - mean) * r
    exact = g[None, :, None, None] * r * (dy - dy.mean(axis=ax, keepdims=True)
                                          - xh * (dy * xh).mean(axis=ax, keepdims=True))
    got = np.abs(np.asarray(out.dx, dtype=np.float64) - exact).max()
    rounding = np.abs(_stored(exact, "fp16") - exact).max()
    assert got > 1.2 * rounding, (got, rounding)


def _saved(x: np.ndarray):  # noqa: ANN202 - the golden's statistics, for a kernel that saves none
    from bnprobe.adapters.base import Saved

    ax = (0, 2, 3)
    return Saved(x.mean(axis=ax), "var", x.var(axis=ax))


def test_a_stand_in_module_is_not_taken_for_the_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    # msprobe's import puts tensorboard's stub in sys.modules["tensorflow"]; find_spec would then answer with it
    import sys
    import types

    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorboard.compat.tensorflow_stub"))
    why = why_unavailable("tensorflow")
    assert why is not None and "stand-in" in why and "tensorboard.compat.tensorflow_stub" in why
    with pytest.raises(BNProbeError, match="adapter tensorflow is unavailable here: tensorflow in this process"):
        get_adapter("tensorflow")


@pytest.mark.parametrize("level,fmt", [("L1", "fp32"), ("mix", "fp16"), ("L0", "fp32"), ("graph", "fp32")])
def test_real_msprobe_mindspore_dumps_made_here_are_read_and_pass(level: str, fmt: str, tmp_path) -> None:
    """tests/data/msprobe_mindspore/make_dumps.py run with the real MindSpore and mindstudio-probe (where both are
    installed: .ci/frameworks' mindspore environment), each dump read by bnprobe and passed by doctor with the
    second layer's scalars."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if why_unavailable("mindspore") or importlib.util.find_spec("msprobe") is None:
        pytest.skip("needs mindspore and mindstudio-probe")
    from bnprobe.cli import main
    from bnprobe.recordings import open_dump

    script = Path(__file__).resolve().parent.parent / "data" / "msprobe_mindspore" / "make_dumps.py"
    out = tmp_path / "dump"
    done = subprocess.run([sys.executable, str(script), level, fmt, str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = open_dump(out)
    assert found.convention == "mindspore" and len(found.calls) == 2
    assert all(c.has_backward for c in found.calls)
    assert main(["doctor", "--adapter", f"dump:{out}#{found.calls[0].name}"]) == 0
    second = ["--eps", "1e-3"] + (["--momentum", "0.2"] if level != "graph" else [])
    assert main(["doctor", "--adapter", f"dump:{out}#{found.calls[1].name}", *second]) == 0

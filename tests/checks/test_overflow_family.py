"""overflow on LayerNorm, RMSNorm, GroupNorm and InstanceNorm (--norm): a correct kernel (torch, careful, the
reference) on ordinary inputs is clean; each defect from the public threads (onnxruntime's 16-bit sum of squares,
one-pass variance at a large mean, ε lost in fp16) is flagged at its stage and in its rows — the rows checked
against facts computed here independently (exact sums in Python fractions, numpy float32 replays); a dump of the
family's calls is observed, not crashed on; bad input is one line, exit 2."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from bnprobe.checks.doctor.family_inputs import family_probes
from bnprobe.checks.overflow.scan import scan
from bnprobe.core.call import BNCall

FP16_MAX = 65504


def _found(rep, anomaly: str, stage: str | None = None):  # noqa: ANN001, ANN202
    return [f for f in rep.findings if f.anomaly == anomaly and (stage is None or f.stage == stage)]


@pytest.mark.parametrize("norm,groups", [("layer", None), ("rms", None), ("group", 16), ("instance", None)])
@pytest.mark.parametrize("adapter", ["careful", "reference", "torch"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_a_correct_kernel_on_ordinary_input_is_clean(norm, groups, adapter, fmt) -> None:  # noqa: ANN001
    if adapter == "torch":
        pytest.importorskip("torch")
    case = family_probes(norm, 0, groups=groups, stress=False)[0]  # hidden states, or convolution activations
    for mode in ("train", "backward"):
        for params in ("fp32", "same"):
            rep = scan(adapter, case.call, dtype=fmt, mode=mode, params=params)
            assert rep.passed, [(f.anomaly, f.stage, f.detail[:200]) for f in rep.findings]
            assert rep.layer is not None and "rows" in rep.layer


def test_rms_sum_of_squares_in_fp16_overflows_in_exactly_the_rows_whose_exact_sum_exceeds_65504() -> None:
    # onnxruntime#29034: Σx² accumulated in fp16 overflows, rstd becomes 0 and y all zeros, silently
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 64))
    x[0, 3] *= 60  # every |x| < 256 (x² itself below 65504) but Σx² far beyond
    x[1, 5] *= 45
    x = np.clip(x, -250, 250)
    rep = scan("emulated:fp16-acc16", BNCall(x, norm="rms"), dtype="fp16")
    xs = x.astype(np.float16).reshape(16, 64)  # what the kernel reads
    exact = [sum(Fraction(float(v)) ** 2 for v in row) for row in xs]
    over = {i for i, s in enumerate(exact) if s > FP16_MAX}
    assert over == {3, 13}  # (the guard: the input is what the test means)
    assert all(float(v) ** 2 < FP16_MAX for v in xs.reshape(-1))
    (f,) = _found(rep, "overflow", "sum_squares")
    assert set(f.channels) == over
    assert f.first_element == "row 3 (token (0, 3))"
    assert f"exact Σx² is {float(exact[3]):.6g}" in f.detail
    (z,) = [z for z in _found(rep, "zero_output") if z.stage == "y"]
    assert set(z.channels) == over
    fixes = {r.name: r.fixed for r in f.remedies}
    assert fixes["wider accumulator (fp32)"] is True
    # the careful kernel (fp32 sums) on the same input: clean
    assert scan("careful", BNCall(x, norm="rms"), dtype="fp16").passed


def test_one_pass_variance_at_a_large_mean_is_flagged_in_its_row_only() -> None:
    # onnxruntime#28463: [40000, 40001, 40002, 40003] in fp32, E[x²] − E[x]²: the variance cancels
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 4, 4))
    x[0, 2] = [40000, 40001, 40002, 40003]
    pol = "emulated:fp32:variance=naive,clamp_var=false"
    rep = scan(pol, BNCall(x, norm="layer"), dtype="fp32")
    # independently: the exact variance is 1.25; E[x²] − E[x]² in float32 is not within a factor 2 of it
    row = np.array([40000, 40001, 40002, 40003], dtype=np.float32)
    s, s2 = np.float32(0), np.float32(0)
    for v in row:
        s, s2 = np.float32(s + v), np.float32(s2 + v * v)
    one_pass = float(np.float32(s2 / 4) - np.float32(s / 4) * np.float32(s / 4))
    exact = Fraction(sum(Fraction(int(v)) ** 2 for v in row), 4) - Fraction(int(row.sum()), 4) ** 2
    assert exact == Fraction(5, 4) and not 0.625 < one_pass < 2.5
    for anomaly, stage in (("cancellation", "var"), ("variance_error", "rstd (saved)"), ("y_error", "y")):
        (f,) = _found(rep, anomaly, stage)
        assert f.channels == (2,), (anomaly, f.channels)
        assert f.first_element.startswith("row 2 (token (0, 2))")
    assert "E[x²] − E[x]²" in _found(rep, "variance_error")[0].detail
    fixes = {r.name: r.fixed for r in _found(rep, "cancellation")[0].remedies}
    assert fixes["two-pass variance"] and fixes["Welford variance"]
    assert scan("emulated:fp32", BNCall(x, norm="layer"), dtype="fp32").passed  # two passes: clean


def test_group_norm_eps_lost_in_fp16_is_flagged_and_a_constant_group_divides_by_zero() -> None:
    # keras-team/keras#22586: GroupNorm under mixed_float16, ε = 1e-12 underflows and inputs near 6e4 give NaN
    rng = np.random.default_rng(3)
    x = rng.uniform(6e4, 6.5e4, (1, 16, 4, 4))
    x[0, 4:6] = 61440.0  # group 2 (channels 4, 5 of 8 groups) holds one value
    call = BNCall(x, norm="group", groups=8, eps=1e-12)
    rep = scan("emulated:fp16:eps_format=fp16", call, dtype="fp16")
    assert float(np.float16(1e-12)) == 0.0  # independently: ε is 0 in fp16
    (e,) = _found(rep, "eps_underflow")
    assert e.stage == "eps" and len(e.channels) == 8
    assert e.first_element == "row 2 (sample 0, group 2)"  # the row of least spread: the constant one
    (inf,) = _found(rep, "inf")
    assert inf.channels == (2,) and inf.stage == "rstd"
    assert {r.name: r.fixed for r in e.remedies}["ε added in fp32"]
    # ε added in fp32 (the careful kernel): no underflow, no NaN
    assert not _found(scan("careful", call, dtype="fp16"), "eps_underflow")


def test_rows_are_named_where_they_sit() -> None:
    x = np.random.default_rng(4).standard_normal((2, 3, 16))
    x[1, 2] *= 100  # its Σ(x − μ)² beyond fp16's largest value, the other rows' far below it
    rep = scan("emulated:fp16-acc16", BNCall(x, norm="layer"), dtype="fp16")
    (f,) = _found(rep, "overflow")
    assert f.channels == (5,) and f.first_element == "row 5 (token (1, 2))", rep.findings
    xi = np.random.default_rng(5).standard_normal((2, 4, 8, 8))
    xi[1, 3] += 3e4
    rep = scan("emulated:fp16:variance=naive", BNCall(xi, norm="instance"), dtype="fp16")
    assert any(f.first_element == "row 7 (sample 1, channel 3)" for f in rep.findings), rep.findings


def test_a_family_dump_is_observed_not_crashed_on(msprobe_family_dumps) -> None:  # noqa: ANN001
    from bnprobe.engine.recorded import recording_of

    root, manifest = msprobe_family_dumps
    for name in ("L1-fp32", "mix-bf16"):
        path = root / manifest["dumps"][name]["dump_path"]
        run = scan(recording_of(f"dump:{path}", None, None, guard="overflow"))
        layers = [r.layer for r in run.results]
        assert sum(lay is not None for lay in layers) == 5  # GroupNorm, InstanceNorm and three LayerNorms
        assert run.passed, [(r.call, f.anomaly, f.detail[:160]) for r in run.results for f in r.findings]


def test_a_family_dump_with_a_nan_is_located_in_its_row(msprobe_family_dumps, tmp_path) -> None:  # noqa: ANN001
    import shutil

    from bnprobe.engine.recorded import recording_of

    root, manifest = msprobe_family_dumps
    src = root / manifest["dumps"]["L1-fp32"]["dump_path"]
    dst = tmp_path / "dump"
    shutil.copytree(src, dst)
    torch = pytest.importorskip("torch")
    y = next(dst.rglob("Functional.layer_norm.0.forward.output.0.pt"))
    a = torch.load(y)
    a[1, 2, 5] = float("nan")
    torch.save(a, y)
    run = scan(recording_of(f"dump:{dst}", None, "Functional.layer_norm.0", guard="overflow"))
    (rep,) = run.results
    (f,) = _found(rep, "nan", "y")
    assert f.channels == (6,) and f.first_element == "index (1, 2, 5) (row 6 (token (1, 2)))"


def _cli(capsys, *args: str) -> tuple[int, str, str]:  # noqa: ANN001
    from bnprobe.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_flags_the_row_and_says_the_layer(capsys) -> None:  # noqa: ANN001
    code, out, err = _cli(capsys, "overflow", "--norm", "rms", "--adapter", "emulated:fp16-acc16", "--shape",
                          "2,4,64", "--std", "40", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["layer"] == "RMSNorm over (64,): 8 rows (tokens) of R = 64"
    assert any(f["anomaly"] == "overflow" and f["stage"] == "sum_squares" for f in doc["findings"])
    assert _cli(capsys, "overflow", "--norm", "layer", "--adapter", "careful", "--shape", "2,4,64")[0] == 0


@pytest.mark.parametrize("args,says", [
    (["--norm", "group"], "--norm group needs --num-groups"),
    (["--norm", "layer", "--mode", "infer"], "LayerNorm keeps no running statistics"),
    (["--norm", "layer", "--normalized-shape", "5"], "is not x's trailing dimensions"),
    (["--norm", "instance", "--adapter", "ascend-tbe"], "runs BatchNorm only, not InstanceNorm"),
    (["--norm", "layer", "--num-groups", "2"], "--num-groups applies to --norm group"),
    (["--norm", "rms", "--adapter", "dump:/nonexistent"], "drop --norm"),
    (["--norm", "rms", "--convention", "keras"], "keeps no running statistics"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, args, says) -> None:  # noqa: ANN001
    code, out, err = _cli(capsys, "overflow", *args)
    assert code == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], err

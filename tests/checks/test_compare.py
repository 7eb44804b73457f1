import numpy as np
import pandas as pd
import pytest

from bnprobe.adapters import get_adapter
from bnprobe.checks.compare import (
    Case,
    compare_precision,
    error_budget,
    resnet50_cases,
    stress_cases,
    verdict,
)
from bnprobe.cli import main
from bnprobe.errors import BNProbeError
from bnprobe.numerics.rounding import round_to


def test_verdict_rules_by_hand():
    g = np.array([1.0, 2.0, 1e-6])
    # fp32 accumulated: |d-b| / max(|b|, 2^-14) <= 2^-11 (4.88e-4)
    ok, why, score, bound = verdict(g * (1 + 4e-4), g, "fp32", "accumulated")
    assert ok and bound == 2.0**-11 and score == pytest.approx(4e-4, rel=1e-6)
    bad = g.copy()
    bad[2] += 1e-7  # 1e-7 / 2^-14 = 1.6e-3 > bound with msprobe's absolute floor...
    assert not verdict(bad, g, "fp32", "accumulated")[0]
    assert verdict(bad, g, "fp32", "scaled")[0] is False  # ...and with the floor relative to max|b| = 2
    assert verdict(bad, g, "fp32", "scaled", scale=np.array([1.0, 2.0, 1e4]))[0]  # a large natural scale
    # threshold: relative error <= 2^-20 for fp32
    assert not verdict(g * (1 + 2e-6), g, "fp32", "threshold")[0]
    assert verdict(g * (1 + 5e-7), g, "fp32", "threshold")[0]
    assert not verdict(np.array([1.0, np.nan]), np.array([1.0, 2.0]), "fp16")[0]


def test_emulated_presets_pass_resnet50_and_a_naive_port_does_not():
    cases = resnet50_cases(batch=1)[-3:]  # the three layer4 shapes, batch 1
    good = compare_precision(["emulated"], ("fp16", "bf16", "fp32"), cases, budget=False)
    assert good.passed, good.rows[good.rows.verdict == "FAIL"][["dtype", "case", "tensor", "why"]]
    naive = compare_precision(["emulated:fp16-acc16"], ("fp16",), cases, budget=False)
    assert not naive.passed


def test_single_pass_variance_fails_where_it_cancels():
    cases = [Case("mean=1e3", (8, 16, 8, 8), mean=1e3)]
    r = compare_precision(["ascend-tbe", "emulated"], ("fp32",), cases, budget=False)
    var = r.rows[r.rows.tensor.isin(["saved_var", "saved_invstd"])].set_index("adapter")
    assert var.loc["ascend-tbe", "verdict"] == "FAIL" and var.loc["emulated", "verdict"] == "PASS"
    ch = r.channels[r.channels.adapter == "ascend-tbe"]
    assert (ch.mean2_over_var > 1e5).all()  # the explanation: mean²/var is huge


def cause(rows):
    from bnprobe.checks.compare import budget_cause

    df = pd.DataFrame(rows).sort_values("order")
    return budget_cause(list(zip(df.stage, df.error_removed)))


def test_error_budget_blames_the_variance_when_single_pass_cancels():
    x = round_to(np.random.default_rng(0).standard_normal((16, 8, 8, 8)) + 300.0, "fp32")
    rows = error_budget(get_adapter("emulated:fp32:variance=naive"), x, np.ones(8), np.zeros(8), dtype="fp32")
    stage, share = cause(rows)
    assert stage == "var" and share > 0.9  # E[x²] - E[x]² is where the error arises
    by = pd.DataFrame(rows).set_index("stage")["error_removed"]
    assert by["sum"] < 0.5 and by["y (output cast)"] < 0.1  # earlier stages alone do not explain it


def test_error_budget_blames_rstd_for_a_poor_estimate():
    x = round_to(np.random.default_rng(1).standard_normal((16, 8, 8, 8)), "fp16")
    rows = error_budget(get_adapter("emulated:fp16:rsqrt=magic,rsqrt_newton=0"), x, np.ones(8), np.zeros(8),
                        dtype="fp16")
    assert cause(rows)[0] == "rstd" and cause(rows)[1] > 0.9


def test_error_budget_blames_the_output_cast_of_a_good_fp16_kernel():
    x = round_to(np.random.default_rng(2).standard_normal((16, 8, 8, 8)), "fp16")
    rows = error_budget(get_adapter("emulated"), x, np.ones(8), np.zeros(8), dtype="fp16")
    assert cause(rows)[0] == "y (output cast)"


def test_stress_cases_are_what_they_say():
    names = {c.name: c for c in stress_cases()}
    assert names["stress/R=2"].shape == (2, 16) and names["stress/constant"].make().std() == 0
    assert abs(names["stress/mean/std=10000"].make().mean() - 1e4) < 1


def test_bad_arguments():
    with pytest.raises(BNProbeError, match="does not run fp64"):
        compare_precision(["ascend-tbe"], ("fp64",), [Case("c", (4, 3))])
    with pytest.raises(BNProbeError, match="unknown standard rule"):
        compare_precision(["emulated"], ("fp16",), [Case("c", (4, 3))], rule="vibes")
    with pytest.raises(BNProbeError, match="unknown mode"):
        compare_precision(["emulated"], ("fp16",), [Case("c", (4, 3))], mode="sideways")


def test_default_run_writes_every_file_and_never_clobbers(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["compare-precision"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "report: reports/compare-precision-" in out
    first = next((tmp_path / "reports").iterdir())
    names = sorted(p.name for p in first.iterdir())
    assert names == ["budget.csv", "channels.csv", "compare.csv", "compare.json", "report.html", "summary.md"]
    html = (first / "report.html").read_text()
    assert "data:image/png;base64," in html and "<table" in html and "Error budget" in html
    df = pd.read_csv(first / "compare.csv")
    assert {"fp16", "bf16", "fp32"} == set(df.dtype) and len(df) > 500
    resnet = df[df.case.str.startswith("resnet50")]
    assert (resnet.verdict == "PASS").all()  # the emulated presets are within standard on ResNet-50 shapes
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    code = main(["compare-precision", "--shape", "4,3,5,5", "--no-budget", "--dtypes", "fp16"])
    capsys.readouterr()
    dirs = sorted((tmp_path / "reports").iterdir())
    assert len(dirs) == 2
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("args,message", [
    (["compare-precision", "--adapters", "nvidia"], "unknown adapter"),
    (["compare-precision", "--dtypes", "fp64", "--adapters", "ascend-tbe"], "does not run fp64"),
    (["compare-precision", "--rule", "vibes", "--shape", "4,3"], "unknown standard rule"),
    (["compare-precision", "--shapes", "vgg", "--no-stress"], "unknown shape set"),
    (["compare-precision", "--batch", "0"], "--batch must be >= 1"),
    (["compare-precision", "--shape", "4,3", "--format", "pdf"], "unknown report format"),
    (["compare-precision", "--input", "/nope.npy"], "does not exist"),
])
def test_cli_bad_input(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").rglob("*.csv"))

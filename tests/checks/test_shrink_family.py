"""shrink on LayerNorm, RMSNorm, GroupNorm and InstanceNorm inputs (--norm): a failing input of a defective kernel
shrinks to a smaller one that still fails — replayed through the command shrink prints, and in the layer's own
terms (whole groups, the normalised dims followed) — while a correct kernel fails on neither the input nor the
shrunk one; bad input is one line, exit 2."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from bnprobe.checks.shrink.shrinking import FamilyLayer, compare_predicate, overflow_predicate, shrink
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError

NAIVE = "emulated:fp16-acc16"  # sums, statistics and arithmetic in fp16: fails compare-precision's rule


@pytest.mark.parametrize("norm,shape,groups", [("layer", (2, 8, 256), None), ("rms", (2, 8, 256), None),
                                               ("group", (4, 16, 4, 4), 4), ("instance", (2, 8, 8, 8), None)])
def test_a_failing_family_input_shrinks_to_a_smaller_one_that_still_fails(norm, shape, groups) -> None:
    x = np.random.default_rng(0).standard_normal(shape) * 3 + 30  # a mean of 30: fp16 sums of 256 terms lose it
    layer = FamilyLayer.of(norm, shape, None, groups)
    fails = compare_predicate(NAIVE, dtype="fp16", layer=layer)
    res = shrink(x, fails, seconds=60, layer=layer)
    assert res.x.size < x.size and res.x.ndim == x.ndim
    assert fails(res.x)
    sh = layer.shape(res.x.shape)  # the layer still fits: whole groups, R >= 2
    assert sh.r >= 2
    if norm == "group":
        assert res.x.shape[1] % (shape[1] // groups) == 0 and sh.groups == res.x.shape[1] // 4
    # a correct kernel (fp32 sums and arithmetic) fails on neither: the shrunk case is the defect's, not the input's
    careful = compare_predicate("careful", dtype="fp16", layer=layer)
    assert not careful(x) and not careful(res.x)


def test_the_shrunk_case_replays_through_the_command_shrink_prints(tmp_path, capsys) -> None:  # noqa: ANN001
    code = main(["shrink", "--norm", "layer", "--adapter", NAIVE, "--shape", "2,8,256", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((tmp_path / "shrink.json").read_text())
    assert doc["norm"] == "layer" and doc["normalized_shape"] == [np.load(tmp_path / "x.npy").shape[-1]]
    replay = shlex.split(doc["replay"])
    assert replay[:2] == ["bnprobe", "compare-precision"] and f"replay: {doc['replay']}" in out
    assert main(replay[1:] + ["--force", "--format", "json"]) == 1  # it still fails, as compare-precision judges it
    capsys.readouterr()


def test_overflow_predicate_keeps_the_rms_sum_of_squares_overflow() -> None:
    # RMSNorm's Σx² in fp16: shrunk with a predicate that asks for the overflow itself, the shrunk row's exact
    # sum of squares (Python floats: exact for these few fp16 values) is still beyond 65504
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.core.call import BNCall

    x = np.random.default_rng(1).standard_normal((2, 8, 64)) * 40
    layer = FamilyLayer.of("rms", x.shape)
    base = overflow_predicate(NAIVE, dtype="fp16", layer=layer)

    def overflows(v: np.ndarray) -> bool:
        rep = scan(NAIVE, BNCall(v, norm="rms", normalized_shape=v.shape[-1:]), dtype="fp16", remedies=False)
        return base(v) and any(f.anomaly == "overflow" and f.stage == "sum_squares" for f in rep.findings)

    res = shrink(x, overflows, seconds=60, layer=layer)
    assert res.x.size < x.size
    rows = res.x.astype(np.float16).astype(np.float64).reshape(-1, res.x.shape[-1])
    assert max(sum(float(v) ** 2 for v in row) for row in rows) > 65504


def test_a_correct_kernel_is_not_shrunk() -> None:
    x = np.random.default_rng(2).standard_normal((2, 4, 64))
    layer = FamilyLayer.of("layer", x.shape)
    with pytest.raises(BNProbeError, match="nothing to shrink"):
        shrink(x, compare_predicate("careful", dtype="fp16", layer=layer), layer=layer)


@pytest.mark.parametrize("args,says", [
    (["--norm", "group", "--adapter", NAIVE], "--norm group needs --num-groups"),
    (["--norm", "layer", "--adapter", NAIVE, "--mode", "infer"], "keeps no running statistics"),
    (["--norm", "layer", "--adapter", NAIVE, "--shape", "2,4,6", "--normalized-shape", "5"],
     "is not x's trailing dimensions"),
    (["--norm", "group", "--num-groups", "3", "--adapter", NAIVE, "--shape", "2,8,4,4"], "groups must divide"),
    (["--norm", "layer", "--adapter", "careful", "--shape", "2,4,64"], "nothing to shrink"),
    (["--norm", "layer", "--adapter", NAIVE, "--convention", "keras"], "keeps no running statistics"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, args, says, tmp_path) -> None:  # noqa: ANN001
    code = main(["shrink", *args, "--out", str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "o").exists()

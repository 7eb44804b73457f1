import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))

# what each example must print (its point), and the arguments it is run with (folders under tmp_path)
EXPECT = {
    "fp16_statistics.py": ([], ["first overflow: sum_sq in channels [3]", "first overflow: none"]),
    "plugin_adapter.py": ([], ["numpy-fp32: max |y - reference| ="]),
    "capture_cnn.py": (["{tmp}/fp32", "{tmp}/fp16"],
                       ["captured 3 BatchNorm calls (bn1#0, bn2#0, bn3#0)", "3 recorded call(s) of {tmp}/fp32",
                        "first call that fails:", "3 recorded call(s) of {tmp}/fp16"]),
    "capture_transformer.py": (["{tmp}/fp32", "{tmp}/fp16"],
                               ["fp32: captured 2 norm calls (ln#0, norm#0)", "2 recorded call(s) of {tmp}/fp32",
                                "2 recorded call(s) of {tmp}/fp16"]),
    "monitor_cnn.py": (["{tmp}/mon"], ["monitored 40 steps of 2 BatchNorm layers into {tmp}/mon/monitor.parquet/",
                                       "anomaly at step 25, 1 (forward): NaN in x", "-> {tmp}/mon/anomalies/step-25"]),
    "monitor_transformer.py": (["{tmp}/mon"], ["monitored 20 steps of 2 norm layers into {tmp}/mon/family.parquet/",
                                               "anomaly at step 12, ln (forward): NaN in x (row 37)",
                                               "[row 37 = sample 2, token 5] -> {tmp}/mon/anomalies/step-12"]),
    "make_onnx_model.py": (["{tmp}"], ["wrote {tmp}/model.onnx (conv1, dw, fc, each followed by a BatchNormalization)",
                                       "{tmp}/fused_bias_not_scaled.onnx (folded, conv1's bias not scaled by A)"]),
}
# optional extras an example imports
NEEDS = {"capture_cnn.py": "torch", "capture_transformer.py": "torch", "monitor_cnn.py": "torch",
         "monitor_transformer.py": "torch",
         "make_onnx_model.py": "onnx"}


def test_every_example_has_expectations():
    assert sorted(p.name for p in EXAMPLES) == sorted(EXPECT)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    if script.name in NEEDS:
        pytest.importorskip(NEEDS[script.name])
    from tests.test_readme import RUN

    needs = [need for command, need in RUN.items() if command.startswith(f"python examples/{script.name}")]
    if any(need is None or importlib.util.find_spec(need) is not None for need in needs):
        pytest.skip("the README's transcript of this example runs it and compares its whole output")
    args, wanted = EXPECT[script.name]
    out = subprocess.run([sys.executable, str(script), *(a.format(tmp=tmp_path) for a in args)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    for w in wanted:
        assert w.format(tmp=tmp_path) in out.stdout, out.stdout

"""docs/kernels.md, "what each kernel computes", is what benchmarks/kernel_table.py makes of its data — the package's
table (bnprobe/checks/identify/kernels.json, which compare-precision and doctor read), its one copy — and its data is
what identify finds now (re-checked on the kernels that are quick to identify)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_table  # noqa: E402


def test_the_page_is_the_script_s_rendering_of_its_data():
    from bnprobe.checks.identify.kernels import DATA, table

    doc = json.loads(kernel_table.DATA.read_text())
    assert kernel_table.DATA == DATA and table() == doc  # the script writes what the package reads
    assert not (ROOT / "docs" / "kernels.json").exists()  # and no second copy beside the page
    assert kernel_table.PAGE.read_text() == kernel_table.render(doc), \
        "re-make it: python benchmarks/kernel_table.py --render (or --write, re-running identify)"
    kinds = {(r["kernel"], r["format"]) for r in doc["rows"]}
    assert kinds == {(k, f) for k, fmts, _ in kernel_table.KERNELS for f in fmts}  # every kernel listed, run or not
    for r in doc["rows"]:
        assert r["result"] in ("reproduced", "departs", "not run")
        if r["result"] == "departs":  # a departure is said in words; a recipe beside it only when close
            assert r["departure"].startswith("no recipe in the space reproduces") and r["departure_size"]
    family = {(r["kernel"], r["norm"], r["format"]) for r in doc["family_rows"]}
    assert family == {(k, n, f) for k, norms, fmts, _ in kernel_table.FAMILY_KERNELS for n in norms for f in fmts}


def test_the_family_s_recipes_reproduce_torch_on_inputs_identify_never_saw():
    """Each recipe of the family's section for eager torch, run as emulated:<recipe>, against torch on shapes neither
    identify's probes nor its fresh inputs have (where the table was made with this torch)."""
    _check_family_rows("torch")


@pytest.mark.slow  # (each row compiles its kernels)
def test_the_family_s_torch_compile_recipes_reproduce_it_on_inputs_identify_never_saw():
    """The same for torch.compile's rows: each recipe against the compiled kernels."""
    _check_family_rows("torch-compile")


def _check_family_rows(kernel: str) -> None:
    torch = pytest.importorskip("torch")
    import numpy as np

    from bnprobe.adapters import get_adapter
    from bnprobe.core.call import BNCall
    from bnprobe.engine.run import generated_call, run_call

    doc = json.loads(kernel_table.DATA.read_text())
    if f"torch {torch.__version__}" not in doc["versions"]:
        pytest.skip(f"the table was made with other versions ({doc['versions']})")
    rng = np.random.default_rng(77)
    rows = [r for r in doc["family_rows"] if r["kernel"] == kernel]
    assert rows
    for r in rows:
        assert r["result"] == "reproduced", r
        shape = (6, 3, 70) if r["norm"] != "group" else (3, 10, 21)
        pshape = shape[-1:] if r["norm"] != "group" else shape[1:2]
        call = BNCall(rng.standard_normal(shape) * 0.2 + 40.0, gamma=rng.uniform(0.5, 2, pshape),
                      beta=None if r["norm"] == "rms" else rng.normal(0, 1, pshape), dy=rng.standard_normal(shape),
                      dtype=r["format"], params=r["params"], norm=r["norm"],
                      groups=kernel_table.FAMILY_GROUPS if r["norm"] == "group" else None)
        rec = generated_call(call, modes=("train", "backward"), label="unseen")
        want = run_call(get_adapter(r["kernel"]), rec, quiet=True, skip_missing=True).got
        got = run_call(get_adapter(f"emulated:{r['recipe']}"), rec, quiet=True, skip_missing=True).got
        for k in want:
            assert np.array_equal(np.asarray(got[k], dtype=np.float64), np.asarray(want[k], dtype=np.float64)), \
                (r["norm"], r["format"], k)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,fmt", [("onnxruntime", "fp32"), ("onnxruntime", "fp16"), ("torch", "fp16")])
def test_the_table_s_rows_are_what_identify_finds_now(kernel, fmt):
    pytest.importorskip("torch")
    doc = json.loads(kernel_table.DATA.read_text())
    (want,) = [r for r in doc["rows"] if (r["kernel"], r["format"]) == (kernel, fmt)]
    if want["result"] == "not run":
        pytest.skip(f"{kernel} was not run where the table was made")
    from importlib.metadata import version

    package = "onnxruntime" if kernel == "onnxruntime" else "torch"
    if f"{package} {version(package)}" not in doc["versions"]:  # (another release may compute another way)
        pytest.skip(f"the table was made with other versions ({doc['versions']}); here {package} {version(package)}")
    got = kernel_table.row(kernel, fmt, want["params"])
    assert (got["result"], got["recipe"]) == (want["result"], want["recipe"])

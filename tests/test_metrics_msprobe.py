"""bnprobe.engine.metrics against mindstudio-probe 26.2.0's own functions, value for value.

msprobe runs in a child process: this file run as a script (``_oracle`` below, which imports nothing from
bnprobe).  Importing msprobe's compare algorithms loads ~500 modules and puts a stub at
``sys.modules["tensorflow"]``; its accuracy checker imports ``msprobe.pytorch`` (the PrecisionDebugger and all,
~1100 modules, 3-4 s) — no torch function is patched, but tests/recordings/test_msprobe_fixtures.py requires that
no msprobe submodule enters the test process.

The oracle feeds msprobe the tensors as it reads them itself: torch tensors of the format, bf16 converted to
float32 and squeezed (read_pt_data); its checker gets the golden one precision level up and converts as
Comparator._compare_torch_tensor does; its benchmark verdict reads both devices' metrics back from the detail
CSV it writes itself.  Every figure is compared for exact equality (``==`` / np.testing.assert_equal): bnprobe
uses msprobe's own operations in msprobe's dtypes, so nothing is left to a tolerance.
"""

from __future__ import annotations

import json
import sys

import numpy as np

_TORCH = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
_UP = {"fp16": "fp32", "bf16": "fp32", "fp32": "fp64"}  # the checker's golden: one precision level up


def _oracle(inp: str, out: str) -> None:
    """msprobe's own figures for every case in ``inp`` (.npz + .json), written to ``out`` (JSON)."""
    import os
    import tempfile

    import torch
    from msprobe.core.common.const import CompareConst
    from msprobe.core.common.file_utils import read_csv, write_csv
    from msprobe.core.compare.multiprocessing_compute import check_accuracy
    from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply
    from msprobe.core.compare.utils import get_relative_err
    from msprobe.pytorch.api_accuracy_checker.compare.algorithm import get_ulp_err
    from msprobe.pytorch.api_accuracy_checker.compare.compare import Comparator
    from msprobe.pytorch.api_accuracy_checker.compare.compare_column import ApiPrecisionOutputColumn, CompareColumn
    from msprobe.pytorch.api_accuracy_checker.compare.compare_input import CompareInput, PrecisionCompareInput
    from msprobe.pytorch.api_accuracy_checker.compare.compare_utils import DETAIL_TEST_ROWS
    from msprobe.pytorch.api_accuracy_checker.precision_standard.benchmark_compare import (
        BenchmarkCompare, BenchmarkPrecisionCompare)
    from msprobe.pytorch.api_accuracy_checker.precision_standard.ulp_compare import UlpCompare
    from msprobe.pytorch.compare.utils import _prepare_tensor_for_numpy

    arrays = np.load(inp + ".npz")
    cases = json.loads(open(inp + ".json").read())

    def tensor(values: np.ndarray, fmt: str) -> torch.Tensor:
        return torch.from_numpy(values).to(getattr(torch, _TORCH[fmt]))

    def as_read(t: torch.Tensor) -> np.ndarray:  # read_pt_data
        return np.squeeze(_prepare_tensor_for_numpy(t).numpy())

    def plain(v):  # JSON-able, with the numpy type kept for the checker's CSV formatting
        return v if isinstance(v, str) else float(v)

    def checker(device_t: torch.Tensor, golden_t: torch.Tensor) -> tuple[CompareColumn, dict]:
        dtype = device_t.dtype
        if dtype == torch.bfloat16:  # Comparator._compare_torch_tensor
            golden_t, device_t = golden_t.to(torch.float32), device_t.to(torch.float32)
        bench, device = golden_t.numpy(), device_t.numpy()
        col = CompareColumn()
        col.bench_type, col.npu_type, col.shape = str(golden_t.dtype), str(dtype), tuple(device.shape)
        BenchmarkCompare(CompareInput(bench, device, col, dtype)).compare()
        ulp = get_ulp_err(bench, device, dtype)
        fig = {k: plain(getattr(col, k)) for k in ("small_value_err_ratio", "max_rel_error", "mean_rel_error",
                                                  "rmse", "eb")}
        fig["ulp_max"] = float(UlpCompare._stat_max_ulp_err(ulp))
        fig["ulp_mean"] = float(UlpCompare._stat_mean_ulp_err(ulp))
        return col, fig

    def verdict(dev: CompareColumn, ben: CompareColumn, api: str, folder: str) -> dict:
        rows = {}
        for who, col in (("npu", dev), ("gpu", ben)):  # the detail CSVs, as acc_check writes them
            path = os.path.join(folder, f"{who}.csv")
            if os.path.exists(path):  # write_csv appends
                os.remove(path)
            write_csv(DETAIL_TEST_ROWS, path)
            write_csv(Comparator._get_acc_check_detail([f"Functional.{api}.0", "pass", " ",
                                                        [col.to_column_value("pass", "")], [], 0]), path)
            rows[who] = read_csv(path).iloc[0]
        out = ApiPrecisionOutputColumn()
        result = BenchmarkPrecisionCompare(PrecisionCompareInput(rows["npu"], rows["gpu"], rows["npu"]["DEVICE Dtype"],
                                                                 out, api_name=api)).compare()
        keys = ("small_value_err_ratio", "rmse_ratio", "max_rel_err_ratio", "mean_rel_err_ratio", "eb_ratio",
                "small_value_err_status", "rmse_status", "max_rel_err_status", "mean_rel_err_status", "eb_status",
                "compare_message")
        return {"result": result, **{k: plain(getattr(out, k)) for k in keys}}

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            name, fmt, gfmt = case["name"], case["fmt"], case["golden_fmt"]
            res: dict = {}
            if case["kind"] == "metrics":  # a benchmark verdict on given metric values
                cols = []
                for side in ("device", "bench"):
                    col = CompareColumn()
                    col.npu_type = col.bench_type = f"torch.{_TORCH[fmt]}"
                    col.update({k: case[side][m] for k, m in (("small_value_err_ratio", "small_value"),
                                                              ("rmse", "rmse"), ("max_rel_error", "max_rel"),
                                                              ("mean_rel_error", "mean_rel"), ("eb", "eb"))})
                    cols.append(col)
                res["verdict"] = verdict(cols[0], cols[1], case["api"], folder)
                results[name] = res
                continue
            actual, golden = arrays[name + "/actual"], arrays[name + "/golden"]
            n = as_read(tensor(actual, fmt))
            b = as_read(tensor(golden, gfmt))
            checked = ValidateTensor().check_tensor(CompareResult(n, b))  # MultiProcessCompare.compare_by_op
            values, msg = compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag, checked.err_msg,
                                            column_names=CompareConst.BUILTIN_COMPARE_COLUMNS)
            res["compare"] = {"values": [plain(v) for v in values], "msg": msg,
                              "accuracy": check_accuracy(values[0], values[2])}
            if isinstance(checked.n_value, np.ndarray) and not checked.error_flag:
                res["compare"]["max_rel"] = float(np.max(np.abs(get_relative_err(checked.n_value, checked.b_value))))
            if fmt in _UP:
                dev_col, res["checker"] = checker(tensor(actual, fmt), tensor(golden, _UP[fmt]))
                if name + "/bench" in arrays.files:
                    ben_col, _ = checker(tensor(arrays[name + "/bench"], fmt), tensor(golden, _UP[fmt]))
                    res["verdict"] = verdict(dev_col, ben_col, "batch_norm", folder)
            results[name] = res
    with open(out, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    _oracle(sys.argv[1], sys.argv[2])
    sys.exit(0)

# ---- the tests (the oracle above runs in its own process) --------------------------------------------------

import ast  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import subprocess  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import ml_dtypes  # noqa: E402
import pytest  # noqa: E402

if importlib.util.find_spec("torch") is None:  # only the child process imports it
    pytest.skip("torch is not installed", allow_module_level=True)
pytest.importorskip("msprobe")

from bnprobe.engine.metrics import (  # noqa: E402
    BENCHMARK_METRICS, MSPROBE_BENCHMARK_LIMITS, MSPROBE_CHECKER, benchmark, benchmark_level, benchmark_verdict,
    compare, ulp_error)

DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp64": np.float64}
FORMATS = ("fp16", "bf16", "fp32")
SHAPE = (4, 8, 5, 5)
SMALL = {"fp16": 2.0**-10, "bf16": 2.0**-10, "fp32": 2.0**-20}  # msprobe's small-value thresholds (its source)
ATOL = {"fp16": 1e-16, "bf16": 1e-16, "fp32": 2.0**-30}  # its benchmark small-value atol


def rnd(values, fmt: str) -> np.ndarray:
    """``values`` rounded to ``fmt`` (ml_dtypes / numpy casts, round to nearest even), as float64."""
    return np.asarray(values, dtype=np.float64).astype(DTYPES[fmt]).astype(np.float64)


def above(v: float, fmt: str) -> float:
    """The next value of ``fmt`` above ``v``."""
    x = np.asarray(v, dtype=DTYPES[fmt])
    return float(np.nextafter(x, np.asarray(np.inf, dtype=DTYPES[fmt])).astype(np.float64))


@dataclass
class Case:
    name: str
    fmt: str
    actual: np.ndarray
    golden: np.ndarray
    golden_fmt: str  # the golden's format: fmt (a dump pair) or one level up
    bench: np.ndarray | None = None


def _noisy(golden: np.ndarray, fmt: str, rng: np.random.Generator, ulps: float = 3.0) -> np.ndarray:
    eps = 2.0 ** -{"fp16": 10, "bf16": 7, "fp32": 23}[fmt]
    return rnd(golden * (1 + ulps * eps * rng.standard_normal(golden.shape)), fmt)


def _cases() -> list[Case]:
    out: list[Case] = []
    for k, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([20260, k])
        g = rnd(rng.standard_normal(SHAPE), fmt)
        out.append(Case(f"{fmt}-random", fmt, _noisy(g, fmt, rng), g, fmt))
        gz = g.copy()
        gz.flat[rng.choice(gz.size, gz.size // 10, replace=False)] = 0.0
        az = _noisy(gz, fmt, rng)
        zeros = np.flatnonzero(gz == 0)
        az.flat[zeros[::2]] = rnd(1e-3 * rng.standard_normal(zeros[::2].size), fmt)  # errors where the golden is 0
        out.append(Case(f"{fmt}-zeros-in-golden", fmt, az, gz, fmt))
        out.append(Case(f"{fmt}-all-zero-actual", fmt, np.zeros(SHAPE), g, fmt))
        out.append(Case(f"{fmt}-all-zero-golden", fmt, g, np.zeros(SHAPE), fmt))
        out.append(Case(f"{fmt}-both-zero", fmt, np.zeros(SHAPE), np.zeros(SHAPE), fmt))
        specials = np.array([np.inf, -np.inf, np.nan, np.inf])
        gs, a_s = g.reshape(-1).copy(), _noisy(g, fmt, rng).reshape(-1)
        gs[[3, 50, 77, 120]] = specials
        same = a_s.copy()
        same[[3, 50, 77, 120]] = specials
        out.append(Case(f"{fmt}-nonfinite-same-places", fmt, same, gs, fmt))
        flip = same.copy()
        flip[3] = -np.inf  # +inf against -inf: msprobe's match, bnprobe's nonfinite_mismatch
        out.append(Case(f"{fmt}-plus-inf-vs-minus-inf", fmt, flip, gs, fmt))
        moved = same.copy()
        moved[77] = 1.0  # NaN in the golden, a number in the output
        out.append(Case(f"{fmt}-nan-vs-number", fmt, moved, gs, fmt))
        swap = same.copy()
        swap[50] = np.nan  # -inf against NaN
        out.append(Case(f"{fmt}-inf-vs-nan", fmt, swap, gs, fmt))
        out.append(Case(f"{fmt}-single", fmt, np.array([above(1.5, fmt)]), np.array([1.5]), fmt))
        out.append(Case(f"{fmt}-single-zero-golden", fmt, np.array([2.0**-12]), np.array([0.0]), fmt))
        out.append(Case(f"{fmt}-single-inf", fmt, np.array([np.inf]), np.array([np.inf]), fmt))
        # small values: a golden at the threshold (inside) and the next value of the golden's format above it
        up = _UP[fmt]
        for where, v in (("inside", SMALL[fmt]), ("outside", above(SMALL[fmt], up))):
            gv = rnd(rng.standard_normal(64), up)
            gv[:8] = v * np.array([1, -1, 1, -1, 1, -1, 1, -1])
            av = rnd(gv * (1 + 0.01 * rng.standard_normal(64)), fmt)
            out.append(Case(f"{fmt}-small-value-{where}", fmt, av, gv, up))
        # a small value's error at the checker's atol (inside: not an error) and just above it (outside)
        for where, v in (("inside", ATOL[fmt]), ("outside", above(ATOL[fmt], up))):
            gv = rnd(1 + rng.random(16), up)  # the others far from the small values
            gv[0] = rnd(v, up)
            av = rnd(gv, fmt)
            av[0] = 0.0
            out.append(Case(f"{fmt}-small-value-atol-{where}", fmt, av, gv, up))
        # the golden computed one level up, and a bench device's correctly rounded output for the benchmark
        gw = rnd(rng.standard_normal(SHAPE), up)
        gw.flat[rng.choice(gw.size, 40, replace=False)] = 0.0
        gw.flat[rng.choice(gw.size, 40, replace=False)] *= 1e-4  # small values
        gw = rnd(gw, up)
        bench = rnd(gw, fmt)
        out.append(Case(f"{fmt}-wide-golden", fmt, _noisy(gw, fmt, rng), gw, up, bench))
        out.append(Case(f"{fmt}-bench-same", fmt, bench.copy(), gw, up, bench))
        close = bench.copy()
        close.flat[::7] = _noisy(gw.flat[::7], fmt, rng, 1.0)
        out.append(Case(f"{fmt}-bench-close", fmt, close, gw, up, bench))
        far = bench.copy()
        far.flat[::3] = _noisy(gw.flat[::3], fmt, rng, 40.0)
        out.append(Case(f"{fmt}-bench-far", fmt, far, gw, up, bench))
    # a float64 golden (compare-precision's), given to msprobe held in float32 and in float64
    for k, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([20261, k])
        g = rng.standard_normal(SHAPE)
        g.flat[rng.choice(g.size, 40, replace=False)] = 0.0
        a = _noisy(g, fmt, rng)
        a.flat[np.flatnonzero(g == 0)[::2]] = rnd(1e-3, fmt)
        for held in ("fp32", "fp64"):
            out.append(Case(f"{fmt}-fp64-golden-held-{held}", fmt, a, g, held))
    # goldens where floor(log2 |g|) is not the exponent field beyond doubt: powers of two, mantissas just below
    # the next power, subnormals of the golden's dtype, zeros (the compiled ULP leaves these to numpy's log2)
    for k, fmt in enumerate(FORMATS):
        rng = np.random.default_rng([20262, k])
        dt = np.float32 if fmt != "fp32" else np.float64
        p2 = 2.0 ** rng.integers(-12, 13, 64)
        below = np.nextafter(p2.astype(dt), dt(0)).astype(np.float64)  # the largest mantissa under each power
        sub = np.array([np.finfo(dt).smallest_subnormal * m for m in (1, 3, 1000)], dtype=np.float64)
        g = np.concatenate([p2, -below, below * (1 - 2.0 ** -13), sub, [0.0, -0.0], rng.standard_normal(64)])
        g = rnd(g, _UP[fmt])
        out.append(Case(f"{fmt}-ulp-edges", fmt, _noisy(g, fmt, rng, 2.0), g, _UP[fmt]))
    # bf16's ULP factor 2^(7 - e) overflows float32 when e < -120 (msprobe's arithmetic)
    g = rnd([1e-37, 1.0, 2.0, 0.5], "bf16")
    out.append(Case("bf16-tiny-golden-ulp", "bf16", np.array([above(g[0], "bf16"), 1.0, 2.0, 0.5]), g, "bf16"))
    return out


CASES = _cases()
BY_NAME = {c.name: c for c in CASES}


def _edge_cases() -> list[dict]:
    """Benchmark verdicts on given metric values: each judged ratio just inside and just outside its limit
    (bench metric above the floor, then below it), inf/NaN agreement, and error balance over its limit."""
    out = []
    api = {"L0": "batch_norm", "L1": "embedding", "L2": "layer_norm"}
    for fmt in FORMATS:
        floor = MSPROBE_CHECKER[fmt].error_floor
        for level, lim in MSPROBE_BENCHMARK_LIMITS.items():
            for metric in ("small_value", "rmse", "max_rel", "mean_rel"):
                for bench_value in (0.01, floor / 2):  # above the floor; below it (the floor is the denominator)
                    den = max(bench_value, floor)
                    inside = round(lim[metric] * den, 14)
                    while inside / den > lim[metric]:
                        inside = round(inside - 1e-14, 14)
                    outside = round(inside + 1e-14, 14)
                    assert inside / den <= lim[metric] < outside / den  # the pair straddles the limit
                    for where, v in (("inside", inside), ("outside", outside)):
                        bench = dict.fromkeys(BENCHMARK_METRICS, 0.01)
                        bench[metric] = bench_value
                        dev = dict(bench)
                        dev[metric] = v
                        tag = "above-floor" if bench_value > floor else "below-floor"
                        out.append({"name": f"verdict-{fmt}-{level}-{metric}-{tag}-{where}", "kind": "metrics",
                                    "fmt": fmt, "golden_fmt": fmt, "api": api[level], "device": dev, "bench": bench,
                                    "expect": "pass" if where == "inside" else "error"})
        base = dict.fromkeys(BENCHMARK_METRICS, 0.01)
        for tag, d, b, expect in (("inf-both", np.inf, np.inf, "pass"), ("inf-vs-minus-inf", np.inf, -np.inf, "error"),
                                  ("inf-vs-number", np.inf, 0.01, "error"), ("nan-both", np.nan, np.nan, "pass"),
                                  ("nan-vs-number", np.nan, 0.01, "error"), ("eb-over-its-limit", 1.0, 0.01, "pass")):
            metric = "eb" if tag.startswith("eb") else "rmse"
            out.append({"name": f"verdict-{fmt}-{tag}", "kind": "metrics", "fmt": fmt, "golden_fmt": fmt,
                        "api": "batch_norm", "device": {**base, metric: d}, "bench": {**base, metric: b},
                        "expect": expect})
    return out


EDGES = _edge_cases()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    """msprobe's figures for every case, from one child process running this file."""
    folder = tmp_path_factory.mktemp("msprobe-metrics")
    inp = str(folder / "cases")
    np.savez(inp + ".npz", **{f"{c.name}/{k}": getattr(c, k) for c in CASES for k in ("actual", "golden", "bench")
                              if getattr(c, k) is not None})
    spec = [{"name": c.name, "fmt": c.fmt, "golden_fmt": c.golden_fmt, "kind": "tensors"} for c in CASES] + EDGES
    Path(inp + ".json").write_text(json.dumps(spec))
    out = folder / "msprobe.json"
    run = subprocess.run([sys.executable, __file__, inp, str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _ours(case: Case):
    """bnprobe on the case: the default call for a dump pair (the golden holds fmt's values), else golden_fmt."""
    with np.errstate(over="ignore"):
        pair = case.golden_fmt == case.fmt and np.array_equal(rnd(case.golden, case.fmt), case.golden, equal_nan=True)
    if pair:
        return compare(case.actual, case.golden, case.fmt)
    return compare(case.actual, case.golden, case.fmt, golden_fmt=case.golden_fmt)


def _printed(m) -> list:
    return list(m.msprobe_row().values())


@pytest.mark.parametrize("name", list(BY_NAME))
def test_compare_is_msprobes_compare(oracle, name):
    case, want = BY_NAME[name], oracle[name]["compare"]
    m = _ours(case)
    row = m.msprobe_row()
    assert _printed(m)[:6] == want["values"], (_printed(m)[:6], want["values"])
    assert row["Err_message"] == want["msg"]
    assert m.accuracy_reached == row["Accuracy Reached or Not"] == want["accuracy"]
    if "max_rel" in want:  # the unformatted MaxRelativeErr, bit for bit
        assert m.max_rel == want["max_rel"] or (np.isnan(m.max_rel) and np.isnan(want["max_rel"]))


@pytest.mark.parametrize("jit", ["0", "1"])
@pytest.mark.parametrize("name", [c.name for c in CASES if c.fmt in MSPROBE_CHECKER])
def test_checker_figures_are_msprobes(oracle, name, jit, monkeypatch):
    """On numpy's route and on the compiled one (BNPROBE_JIT=1: msprobe's ULP in one pass, any size)."""
    monkeypatch.setenv("BNPROBE_JIT", jit)
    case, want = BY_NAME[name], oracle[name]["checker"]
    m = _ours(case)
    got = {"small_value_err_ratio": m.small_value_err_ratio, "max_rel_error": m.checker_max_rel,
           "mean_rel_error": m.mean_rel, "rmse": m.rmse, "eb": m.error_balance, "ulp_max": m.ulp_max,
           "ulp_mean": m.ulp_mean}
    np.testing.assert_equal(got, want)
    np.testing.assert_equal(ulp_error(case.actual, case.golden, case.fmt).max(), want["ulp_max"])


@pytest.mark.parametrize("name", [c.name for c in CASES if c.bench is not None])
def test_benchmark_verdict_on_tensors_is_msprobes(oracle, name):
    case, want = BY_NAME[name], oracle[name]["verdict"]
    r = benchmark(case.actual, case.bench, case.golden, case.fmt)
    _same_verdict(r, want)


@pytest.mark.parametrize("edge", EDGES, ids=[e["name"] for e in EDGES])
def test_benchmark_verdict_at_each_limit_is_msprobes(oracle, edge):
    want = oracle[edge["name"]]["verdict"]
    assert want["result"] == edge["expect"]  # msprobe itself puts the case on the intended side
    level = benchmark_level(edge["api"])
    r = benchmark_verdict(edge["device"], edge["bench"], edge["fmt"], level=level)
    _same_verdict(r, want)
    assert bool(r) is (edge["expect"] == "pass")


def _same_verdict(r, want: dict) -> None:
    assert r.result == want["result"]
    ours = {f"{k}_ratio" if k != "small_value" else "small_value_err_ratio": v for k, v in r.ratios.items()}
    ours |= {f"{k}_status" if k != "small_value" else "small_value_err_status": v for k, v in r.status.items()}
    theirs = {k: v for k, v in want.items() if k not in ("result", "compare_message")}
    for k in ("max_rel", "mean_rel"):  # msprobe's names
        ours[f"{k}_err_ratio"], ours[f"{k}_err_status"] = ours.pop(f"{k}_ratio"), ours.pop(f"{k}_status")
    np.testing.assert_equal(ours, theirs)
    assert r.message == want["compare_message"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_wider_golden_by_default(oracle, fmt):
    """No golden_fmt and a float64 golden: relative errors as msprobe computes them with the golden held in
    float32 (data of at most fp32), cosine, EucDist and MaxAbsErr as it computes them on the float64 golden."""
    case = BY_NAME[f"{fmt}-fp64-golden-held-fp32"]
    got = _printed(compare(case.actual, case.golden, fmt))
    as32, as64 = (oracle[f"{fmt}-fp64-golden-held-{h}"]["compare"]["values"] for h in ("fp32", "fp64"))
    assert got[3:6] == as32[3:6] and got[:3] == as64[:3]
    assert as32[3] != as64[3]  # the guard: the two holdings differ where the golden is 0 (eps 2^-23 vs 2^-52)


# ---- guards: each case really shows what it is named for --------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_golden_max_rel_is_float32(oracle, fmt):
    m = _ours(BY_NAME[f"{fmt}-zeros-in-golden"])
    assert 1e3 < m.max_rel < 1e6  # |a| / float32's eps (1e-3 / 1.19e-7); float64's eps would give ~1e13


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_side_all_zero_cosine_is_nan_and_both_zero_is_one(oracle, fmt):
    assert np.isnan(_ours(BY_NAME[f"{fmt}-all-zero-actual"]).cosine)
    assert np.isnan(_ours(BY_NAME[f"{fmt}-all-zero-golden"]).cosine)
    assert _ours(BY_NAME[f"{fmt}-both-zero"]).cosine == 1.0
    assert oracle[f"{fmt}-both-zero"]["compare"]["values"][0] == 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_plus_inf_against_minus_inf_matches_in_msprobe_only(fmt):
    flip, same = _ours(BY_NAME[f"{fmt}-plus-inf-vs-minus-inf"]), _ours(BY_NAME[f"{fmt}-nonfinite-same-places"])
    assert not flip.nan_mismatch and flip.nonfinite_mismatch and flip.accuracy_reached == "Yes"
    assert not same.nan_mismatch and not same.nonfinite_mismatch
    for name in ("nan-vs-number", "inf-vs-nan"):
        m = _ours(BY_NAME[f"{fmt}-{name}"])
        assert m.nan_mismatch and m.nonfinite_mismatch and np.isnan(m.max_abs) and m.accuracy_reached == "No"


@pytest.mark.parametrize("fmt", FORMATS)
def test_small_value_threshold_edge(fmt):
    inside, outside = (_ours(BY_NAME[f"{fmt}-small-value-{w}"]) for w in ("inside", "outside"))
    # the 8 values at the threshold are left out of the relative errors; just above it they count
    assert inside.small_value_err_ratio > 0 and inside.mean_rel != outside.mean_rel
    ai, ao = (_ours(BY_NAME[f"{fmt}-small-value-atol-{w}"]) for w in ("inside", "outside"))
    assert ai.small_value_err_ratio == 0 and ao.small_value_err_ratio > 0


def test_benchmark_cases_cover_both_results(oracle):
    got = {c.name: oracle[c.name]["verdict"]["result"] for c in CASES if c.bench is not None}
    assert {"pass", "error"} <= set(got.values()), got


def test_bf16_tiny_golden_ulp_overflows_as_in_msprobe(oracle):
    m = _ours(BY_NAME["bf16-tiny-golden-ulp"])
    assert m.ulp_max == np.inf and oracle["bf16-tiny-golden-ulp"]["checker"]["ulp_max"] == np.inf


def test_the_oracle_uses_nothing_from_bnprobe():
    tree = ast.parse(inspect.getsource(_oracle))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m.split(".")[0] == "bnprobe"]
    ours = {"compare", "benchmark", "benchmark_verdict", "benchmark_level", "ulp_error", "BENCHMARK_METRICS",
            "MSPROBE_CHECKER", "MSPROBE_BENCHMARK_LIMITS"}
    assert not {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & ours

"""Comparison metrics with MindStudio Probe's (msprobe 26.2.0, PyPI ``mindstudio-probe``) definitions and values,
so figures line up with what Ascend users know from it, plus the smallest tolerance that passes.

msprobe defines its metrics in two tools, not always alike; both are mirrored, under distinct names:

* its dump **compare** (``msprobe compare``, ``msprobe/core/compare``): ``cosine`` (Cosine), ``euclidean``
  (EucDist), ``max_abs`` (MaxAbsErr), ``max_rel`` (MaxRelativeErr), ``ratio_1e3`` / ``ratio_5e3`` (One
  Thousandth / Five Thousandths Err Ratio) and ``accuracy_reached`` (Accuracy Reached or Not);
* its API **accuracy checker** (``msprobe/pytorch/api_accuracy_checker``), whose benchmark method judges
  every floating output in 26.2.0: ``checker_max_rel``, ``mean_rel``, ``rmse`` (small values left out),
  ``small_value_err_ratio``, ``error_balance``, ``ulp_max`` / ``ulp_mean``, and :func:`benchmark`, its
  verdict on a device's metrics against a bench device's, both against one golden.

Every field is computed with msprobe's own operations in msprobe's own dtypes (for data of at most fp32 its
relative errors are float32 figures) and kept at full precision; :meth:`Comparison.msprobe_row` gives the
compare's figures as msprobe prints them (12 decimals, cosine rounded to 6 above 0.9999, its words where
it computes nothing).  Comparing never raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import Format, get_format
from bnprobe.numerics.rounding import fp16_as
from bnprobe.core.tolerances import (  # msprobe 26.2.0's constants, with every other threshold (re-exported here)
    MSPROBE_BENCHMARK_APIS,
    MSPROBE_BENCHMARK_LIMITS,
    MSPROBE_CHECKER,
    MSPROBE_COMPARE_LIMITS,
    MSPROBE_CSV_DECIMALS,
    CheckerStandard,
)

__all__ = ["Comparison", "compare", "cosine", "ulp_error", "min_atol", "min_rtol", "BenchmarkResult", "benchmark",
           "BENCHMARK_METRICS",
           "benchmark_verdict", "benchmark_level", "CheckerStandard", "MSPROBE_CHECKER", "MSPROBE_BENCHMARK_LIMITS",
           "MSPROBE_BENCHMARK_APIS", "MSPROBE_COMPARE_LIMITS", "MSPROBE_CSV_DECIMALS", "MSPROBE_ULP_BITS"]



# msprobe's ULP: |actual - golden| * 2^(mantissa - e), e = floor(log2|golden|) clamped at the minimum exponent
MSPROBE_ULP_BITS = {k: (s.ulp_mantissa, s.ulp_min_exp) for k, s in MSPROBE_CHECKER.items() if k[:3] != "fp8"}

# how msprobe's compare holds a tensor of each format (read_pt_data: bf16 and fp8 become float32)
_HELD = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16, "bf16": np.float32,
         "fp8_e4m3fn": np.float32, "fp8_e5m2": np.float32}
_COLUMNS = ("Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio",
            "Five Thousandths Err Ratio")
_SCALAR_MSG = "This is type of 0-d tensor, can not calculate"  # CompareConst.ERR_SCALAR_INPUT
_NAN = float("nan")
BENCHMARK_METRICS = ("small_value", "rmse", "max_rel", "mean_rel", "eb")
_JUDGED = ("small_value", "rmse", "max_rel", "mean_rel")  # the metrics in the benchmark's result
_CSV_NAMES = {"small_value": "小值域错误占比", "rmse": "均方根误差", "max_rel": "相对误差最大值",
              "mean_rel": "相对误差平均值", "eb": "误差均衡性"}  # ApiPrecisionCompareColumn, for its messages


def _array(x: Any) -> np.ndarray:
    """``x`` as numpy, as msprobe reads a tensor: a torch bf16 or fp8 tensor becomes float32."""
    if type(x).__module__.split(".")[0] == "torch":
        t = x.detach().cpu()
        if t.is_floating_point() and str(t.dtype) not in ("torch.float64", "torch.float32", "torch.float16"):
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def _f64(a: Any) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.asarray(_array(a)).astype(np.float64).reshape(-1)


def _format_value(v: float) -> float:
    """msprobe's format_value: the figure as printed with 12 decimals."""
    return float(f"{v:.{int(MSPROBE_COMPARE_LIMITS['decimals'])}f}")


# ---- msprobe's compare --------------------------------------------------------------------------------

def _cosine(n: np.ndarray, b: np.ndarray) -> tuple[float, Any, str]:
    """alg_cosine_similarity.compare on 1-D float64 data: (value, as msprobe returns it, message)."""
    if n.size == 1:  # validate_numpy
        return _NAN, "unsupported", "This is a 1-d tensor of length 1."
    tiny = np.finfo(float).eps  # Const.FLOAT_EPSILON, on the norms
    with np.errstate(all="ignore"):
        num = np.dot(n, b)
        a_norm, b_norm = np.linalg.norm(n), np.linalg.norm(b)
        if a_norm <= tiny and b_norm <= tiny:
            return 1.0, 1.0, ""
        if a_norm <= tiny:
            return _NAN, "Nan", "Cannot compare by Cosine Similarity, All the data is Zero in npu dump data."
        if b_norm <= tiny:
            return _NAN, "Nan", "Cannot compare by Cosine Similarity, All the data is Zero in Bench dump data."
        cos = num / (a_norm * b_norm)
    if np.isnan(cos):
        return _NAN, "Nan", "Cannot compare by Cosine Similarity, the dump data has NaN."
    shown = _format_value(cos)
    if shown > MSPROBE_COMPARE_LIMITS["cosine_rounded_above"]:
        shown = round(shown, 6)
    return float(cos), shown, ""


def _relative_err(n: np.ndarray, b: np.ndarray) -> np.ndarray:
    """get_relative_err: |(n - b) / b| in result_type(n, b, float32), that type's eps added to both where b = 0."""
    with np.errstate(all="ignore"):
        rt = np.result_type(n, b, np.float32)
        zero = b == 0
        nn, bb = n.astype(rt), b.astype(rt)
        eps = np.finfo(rt).eps
        nn[zero] += eps
        bb[zero] += eps
        return np.abs(np.divide(nn - bb, bb))


def _check_accuracy(cos: Any, max_abs: Any) -> str:
    """check_accuracy (msprobe/core/compare/multiprocessing_compute.py) on the compare's printed figures."""
    if cos == "shape unmatched":
        return "Unmatched"
    if "None" in (cos, max_abs):
        return "None"
    if cos == "N/A" or max_abs == "N/A":
        return "No"
    try:
        c, m = float(cos), float(max_abs)
    except ValueError:
        return "None"
    lim = MSPROBE_COMPARE_LIMITS
    if c < lim["cos"] and m > lim["max_abs"]:
        return "No"
    if c < lim["cos_min"] or m > lim["max_abs_max"]:
        return "No"
    return "Yes"


def _compare_figures(x: np.ndarray, y: np.ndarray, n: np.ndarray, b: np.ndarray
                     ) -> tuple[list[float], list[Any], str]:
    """msprobe's six compare columns on data that passed its checks (``x``, ``y``: the pair in float64, 1-D;
    ``n``, ``b``: the same as msprobe holds them, for the relative errors).  A single element is a 0-d tensor to
    msprobe (read_pt_data squeezes it): only MaxAbsErr and MaxRelativeErr, in the data's own dtypes."""
    raw: list[float] = []
    shown: list[Any] = []
    msgs: list[str] = []
    lim = MSPROBE_COMPARE_LIMITS
    if x.size == 1:
        n0, b0 = n.reshape(()), b.reshape(())
        msgs.append("This is type of 0-d tensor, can not calculate 'Cosine', 'EucDist', 'One Thousandth Err Ratio' "
                    "and 'Five Thousandths Err Ratio'. ")  # ValidateTensor._check_scalar
        with np.errstate(all="ignore"):
            figures: list[Any] = [None, None, np.max(np.abs(n0 - b0)), np.max(np.abs(_relative_err(n0, b0))),
                                  None, None]
    else:
        with np.errstate(all="ignore"):
            rel = _relative_err(n, b)
            count = rel.size
            d = x - y
            figures = ["cos",  # _cosine, below
                       np.linalg.norm(d, ord=2), np.max(np.abs(d)), np.max(np.abs(rel)),
                       np.sum(rel < lim["thousandth"]) / count, np.sum(rel < lim["five_thousandths"]) / count]
    for col, v in zip(_COLUMNS, figures):
        if v is None:  # validate_numpy / calc_relative_err_ratio on a 0-d tensor
            raw.append(_NAN)
            shown.append("unsupported")
            msgs.append(_SCALAR_MSG)
        elif col == "Cosine":
            r, s, m = _cosine(x, y)
            raw.append(r)
            shown.append(s)
            msgs.append(m)
        elif col == "EucDist":  # printed unformatted
            raw.append(float(v))
            shown.append(float(v))
        elif col in ("MaxAbsErr", "MaxRelativeErr") and np.isnan(v):
            raw.append(_NAN)
            shown.append("Nan")
            what = "MaxAbsError" if col == "MaxAbsErr" else "MaxRelativeError"
            msgs.append(f"Cannot compare by {what}, the data contains nan/inf/-inf in dump data.")
        else:
            raw.append(float(v))
            shown.append(_format_value(v))
    return raw, shown, "".join(msgs)


# ---- msprobe's accuracy checker ----------------------------------------------------------------------

def _checker(actual: np.ndarray, golden: np.ndarray, std: CheckerStandard, *, ulp: bool = True,
             keep: dict[str, Any] | None = None, given: np.ndarray | None = None) -> dict[str, Any]:
    """BenchmarkCompare._compute_metrics and get_ulp_err on one output, as numpy scalars in msprobe's dtypes
    (they decide how its CSV writes them): the device output held as msprobe holds it, the golden one
    precision level up.  Every figure is msprobe's, bit for bit, by cheaper operations on the same values: a
    float16 output held in float32 (exact; msprobe's float16 arithmetic promotes to float32, its comparisons
    order the same values), signs counted by comparison rather than by the sign of a difference (a difference
    of two values of one format is 0 only where they are equal), a product by the mask where msprobe zeroes
    by ``np.where`` (the values masked are finite there).  ``given``: ``actual`` as the caller had it, when it
    was float16 (a cast of it is the float16 rounding of ``actual``: one pass less)."""
    with np.errstate(all="ignore"):
        bench = golden.astype(std.bench, copy=False)
        half = np.dtype(std.device) == np.float16
        # a float16 output held in float32 (exact; see the docstring): its values stand for the float16 array
        # wherever it is read below, in msprobe's ULP too (whose arithmetic is float32)
        # (``given``: the output as the caller had it before widening it to float64; a float16 one is cast as is)
        dev = (given.astype(np.float32) if given is not None and given.dtype == np.float16 else
               fp16_as(actual, np.float32)) if half else actual.astype(std.device)
        # get_finite_and_infinite_mask: the golden judged finite in the device's dtype (get_error_balance casts
        # it the same way, below)
        bench_as_device = fp16_as(bench, np.float32) if half else bench.astype(std.device)
        if std.msprobe and dev.dtype == bench_as_device.dtype == np.float32 and jit_for(dev.size) \
                and all(a.flags.c_contiguous for a in (dev, bench, bench_as_device)):
            out, abs_err = _checker_compiled(dev, bench, bench_as_device, std), None
        else:
            out, abs_err = _checker_figures(dev, bench, bench_as_device, std)
        if keep is not None:  # the caller keeps the benchmark's metrics (as ulp=False gives them) and the ULPs
            keep["checker"] = dict(out)
        if ulp:  # the benchmark verdict does not read the ULP figures
            u = _ulp(dev, bench, std, abs_err=np.abs(dev - bench) if abs_err is None else abs_err)
            out.update(ulp_max=np.max(u), ulp_mean=np.mean(u))
            if keep is not None:
                keep["ulps"] = u.astype(np.float64).reshape(-1)
    return out


def _checker_figures(dev: np.ndarray, bench: np.ndarray, bench_as_device: np.ndarray, std: CheckerStandard
                     ) -> tuple[dict[str, Any], np.ndarray]:
    """:func:`_checker`'s figures as msprobe computes them, and |device - golden|."""
    abs_bench = np.abs(bench)  # get_abs_bench_with_eps
    both_finite = np.isfinite(dev) & np.isfinite(bench_as_device)
    any_bad = not both_finite.all()
    abs_err = np.abs(dev - bench)  # get_abs_err
    small = (abs_bench <= std.small_value) & both_finite  # get_small_value_mask
    left_out = ~both_finite | small  # get_rel_err's -1; get_rmse's zeros
    n_small = np.int64(np.count_nonzero(small))  # get_small_value_err_ratio
    small_ratio = 0 if n_small == 0 else \
        np.int64(np.count_nonzero(small & (abs_err > std.small_value_atol))) / n_small
    # get_rmse, with msprobe's correction for what it leaves out
    kept_mask = ~left_out
    sq = np.where(left_out, 0, abs_err) if any_bad else abs_err * kept_mask
    mse = np.mean(np.square(sq))
    mse = mse * (abs_err.size / (abs_err.size - np.int64(np.count_nonzero(left_out)) + 0.0001) + 0.0001)
    rmse = np.sqrt(mse)
    # get_error_balance: the golden cast to the output's dtype
    larger = np.int64(np.count_nonzero(dev > bench_as_device))
    smaller = np.int64(np.count_nonzero(dev < bench_as_device))
    eb = abs(larger - smaller) / bench.size if bench.size > 0 else 0
    kept = (abs_err / (abs_bench + std.rel_eps))[kept_mask]  # get_rel_err where it is not -1
    kept = kept[kept >= 0]
    max_rel = np.max(kept) if kept.size > 0 else 0  # get_max_rel_err
    mean_rel = np.mean(kept) if kept.size > 0 else 0  # get_mean_rel_err
    return {"small_value": small_ratio, "rmse": rmse, "max_rel": max_rel, "mean_rel": mean_rel, "eb": eb}, abs_err


def _checker_compiled(dev: np.ndarray, bench: np.ndarray, bench_as_device: np.ndarray, std: CheckerStandard
                      ) -> dict[str, Any]:
    """:func:`_checker_figures` of a large output in two compiled passes (:func:`bnprobe.compiled.bits.checker_sums`):
    the same counts, numpy's pairwise sums of the same values, and the same scalar arithmetic on them below, so
    the same figures in the same types, bit for bit."""
    from bnprobe.compiled.bits import checker_sums

    s = checker_sums(dev.reshape(-1), bench.reshape(-1), bench_as_device.reshape(-1), std.small_value, std.rel_eps,
                     std.small_value_atol)
    size = dev.size
    n_small = np.int64(s["small"])
    small_ratio = 0 if n_small == 0 else np.int64(s["small_err"]) / n_small
    squares = s["squares"]
    mse = squares.dtype.type(squares / np.intp(size))  # numpy's mean: its sum over the count
    mse = mse * (size / (size - np.int64(s["left_out"]) + 0.0001) + 0.0001)
    larger, smaller = np.int64(s["larger"]), np.int64(s["smaller"])
    eb = abs(larger - smaller) / size if size > 0 else 0
    kept, rels = s["kept"], s["rels"]
    max_rel = s["max_rel"] if kept > 0 else 0
    mean_rel = rels.dtype.type(rels / np.intp(kept)) if kept > 0 else 0
    return {"small_value": small_ratio, "rmse": np.sqrt(mse), "max_rel": max_rel, "mean_rel": mean_rel, "eb": eb}


# the exponent field of each float format numpy holds a golden in: (int view, mantissa bits, bias, field mask)
_BITS = {np.dtype(np.float32): (np.int32, 23, 127, 0xFF), np.dtype(np.float64): (np.int64, 52, 1023, 0x7FF)}
_NEAR_POWER_BITS = 12  # a mantissa within 2^-12 of the next power of two: log2 may round up to it


def _floor_log2(abs_bench: np.ndarray, min_exp: int) -> np.ndarray:
    """``np.maximum(np.where(b == 0, 0, np.floor(np.log2(b))), min_exp)`` for |golden| ``b`` (float32 or float64),
    equal element for element: the exponent field where that is floor(log2 b) beyond any rounding of log2 (a
    mantissa at least 2^-12 below the next power of two puts log2 b that far below an integer); numpy's own
    log2 for the rest (powers of two, mantissas near the next one, subnormals, 0, inf, NaN)."""
    view, mant, bias, mask = _BITS[abs_bench.dtype]
    bits = abs_bench.view(view)
    field = (bits >> mant) & mask
    frac = bits & ((1 << mant) - 1)
    e = (field - bias).astype(abs_bench.dtype)
    rest = (frac == 0) | (frac >= ((1 << mant) - (1 << (mant - _NEAR_POWER_BITS)))) | (field == 0) | (field == mask)
    if rest.any():
        b = abs_bench[rest]
        with np.errstate(divide="ignore", invalid="ignore"):
            e[rest] = np.where(b == 0, 0, np.floor(np.log2(b)))
    return np.maximum(e, min_exp)


_EXP2: dict[np.dtype, tuple[int, np.ndarray]] = {}


def _exp2_table(dtype: Any) -> tuple[int, np.ndarray]:
    """(lowest exponent, numpy's exp2 of every integer exponent from where it underflows to 0 to where it overflows
    to inf), in ``dtype``: made once per dtype by numpy's own exp2, so that its values, exact or not (float32's
    exp2(127) is 2^127 + 2^104 on some CPUs' vector routines), are the ones msprobe gets on this machine."""
    dt = np.dtype(dtype)
    if dt not in _EXP2:
        _, mant, bias, _ = _BITS[dt]
        lo = 1 - bias - mant - 3
        with np.errstate(over="ignore", under="ignore"):
            _EXP2[dt] = (lo, np.exp2(np.arange(lo, bias + 3).astype(dt)))
    return _EXP2[dt]


def _pow2(k: np.ndarray, dtype: Any) -> np.ndarray:
    """``np.exp2(k).astype(dtype)`` for integer-valued ``k`` (float32/float64, finite), element for element: numpy's
    exp2 of each integer exponent looked up (0 below the subnormals, inf above the format's range)."""
    view = _BITS[np.dtype(dtype)][0]
    lo, table = _exp2_table(dtype)
    return table[np.clip(k.astype(view), lo, lo + len(table) - 1) - lo]


def _ulp(device: np.ndarray, bench: np.ndarray, std: CheckerStandard, *,
         abs_err: np.ndarray | None = None, compiled: bool = True) -> np.ndarray:
    """get_ulp_err: |device - golden| * 2^(mantissa - e) with e = floor(log2|golden|), 0 where the golden is 0,
    at least the minimum exponent; float32 arithmetic except for fp32 outputs (for bf16 the factor overflows
    to inf when e < -120, as in msprobe).  Formats msprobe has no ULP for: the same in float64.  ``abs_err``:
    |device - golden| when the caller has it (in the ULP's dtype); with it, a large array takes one compiled pass
    (:func:`_ulp_compiled`) unless ``compiled`` is False."""
    with np.errstate(all="ignore"):
        abs_bench = np.abs(bench)
        if not std.msprobe:  # 2^(mantissa - e) would overflow float64 for fp64 near 0: divide instead
            eb = np.where(abs_bench == 0, 0, np.floor(np.log2(abs_bench)))
            eb = np.maximum(eb, std.ulp_min_exp)
            e64 = eb.astype(np.int64) - std.ulp_mantissa
            return np.abs((device.astype(np.float64) - bench.astype(np.float64)) / np.ldexp(1.0, e64))
        dt = std.ulp_dtype
        if compiled and abs_err is not None and _compiled(dt, abs_bench, abs_err, device, bench):
            return _ulp_compiled(device, bench, std, abs_bench, abs_err)
        if bench.dtype != dt or abs_bench.dtype not in _BITS:  # msprobe's operations as written
            eb = np.maximum(np.where(abs_bench == 0, 0, np.floor(np.log2(abs_bench))), std.ulp_min_exp)
            return np.abs((device.astype(dt) - bench).astype(dt) * np.exp2(-eb + std.ulp_mantissa).astype(dt))
        eb = _floor_log2(abs_bench, std.ulp_min_exp)
        finite = np.isfinite(eb)
        k = np.where(finite, -eb + std.ulp_mantissa, 0) if not finite.all() else -eb + std.ulp_mantissa
        factor = _pow2(k, dt)
        if not finite.all():  # inf / NaN golden: exp2 of -inf / NaN, as msprobe computes it
            factor[~finite] = np.exp2(-eb[~finite] + std.ulp_mantissa).astype(dt)
        if abs_err is None:
            abs_err = np.abs((device.astype(dt) - bench).astype(dt))
        return abs_err * factor  # |d * f| = |d| * f: f is a power of two, inf, 0 or NaN


def _compiled(dt: Any, abs_bench: np.ndarray, abs_err: np.ndarray, *others: np.ndarray) -> bool:
    """Whether msprobe's ULP takes the compiled pass: a large golden and error held in the ULP's dtype, every
    array C-contiguous (numpy lays a result out in its inputs' memory order, and msprobe's float32 mean adds in
    that order)."""
    return abs_bench.dtype == dt == abs_err.dtype and abs_bench.dtype in _BITS and jit_for(abs_bench.size) \
        and all(a.flags.c_contiguous for a in (abs_bench, abs_err, *others))


def _ulp_compiled(device: np.ndarray, bench: np.ndarray, std: CheckerStandard, abs_bench: np.ndarray,
                  abs_err: np.ndarray) -> np.ndarray:
    """:func:`_ulp` in one compiled pass where floor(log2 |golden|) is its exponent field beyond doubt (see
    :func:`_floor_log2`); the rest (powers of two, mantissas near the next one, subnormals, 0, inf, NaN) as
    :func:`_ulp` computes them, element for element."""
    from bnprobe.compiled.bits import ulp_scaled

    layout = _BITS[abs_bench.dtype]
    mant = layout[1]
    lo, table = _exp2_table(abs_bench.dtype)
    err = abs_err.reshape(-1)  # (C-contiguous: see _compiled)
    u, rest = ulp_scaled(abs_bench.reshape(-1), err, table, lo, layout,
                         (1 << mant) - (1 << (mant - _NEAR_POWER_BITS)), std.ulp_min_exp, std.ulp_mantissa)
    if rest.any():
        u[rest] = _ulp(device.reshape(-1)[rest], bench.reshape(-1)[rest], std, abs_err=err[rest], compiled=False)
    return u.reshape(abs_err.shape)


def ulp_error(actual: Any, golden: Any, fmt: str | Format) -> np.ndarray:
    """Per-element ULP error of ``actual`` (values of ``fmt``) against ``golden``, msprobe's get_ulp_err
    (1-D, float64 values); see :data:`MSPROBE_CHECKER` for how each format is held."""
    std = MSPROBE_CHECKER[get_format(fmt).name]
    with np.errstate(over="ignore"):
        device, bench = _f64(actual).astype(std.device), _f64(golden).astype(std.bench)
    return _ulp(device, bench, std).astype(np.float64)


def cosine(actual: Any, golden: Any) -> float:
    """msprobe's compare cosine (alg_cosine_similarity): 1.0 when both norms are at most float64's eps, NaN
    when one is (msprobe: "Nan"), or for a single element (msprobe: "unsupported")."""
    return _cosine(_f64(actual), _f64(golden))[0]


def min_atol(actual: np.ndarray, golden: np.ndarray, rtol: float) -> float:
    """The smallest atol with |a - g| <= atol + rtol·|g| everywhere (finite elements)."""
    a, g = _f64(actual), _f64(golden)
    ok = np.isfinite(a) & np.isfinite(g)
    if not ok.any():
        return 0.0
    return float(max(0.0, np.max(np.abs(a[ok] - g[ok]) - rtol * np.abs(g[ok]))))


def min_rtol(actual: np.ndarray, golden: np.ndarray, atol: float) -> float:
    """The smallest rtol with |a - g| <= atol + rtol·|g| everywhere (inf if some |a-g| > atol where g = 0)."""
    a, g = _f64(actual), _f64(golden)
    ok = np.isfinite(a) & np.isfinite(g)
    if not ok.any():
        return 0.0
    excess = np.abs(a[ok] - g[ok]) - atol
    gg = np.abs(g[ok])
    need = np.where(excess <= 0, 0.0, np.where(gg > 0, excess / np.where(gg > 0, gg, 1.0), np.inf))
    return float(need.max())


# ---- the comparison ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    """msprobe's metrics of one tensor against its golden (the msprobe function each mirrors: by its field).

    Compare (msprobe compare): ``cosine``, ``euclidean``, ``max_abs``, ``max_rel``, ``ratio_1e3``,
    ``ratio_5e3``, ``accuracy_reached`` ("Yes", "No", "Unmatched" or "None", msprobe's words).  NaN where msprobe
    computes nothing (its "Nan", "N/A", "unsupported"): see ``msprobe_row()`` and ``problem``.
    Accuracy checker (benchmark method): ``checker_max_rel``, ``mean_rel``, ``rmse``, ``small_value_err_ratio``,
    ``error_balance``, ``ulp_max``, ``ulp_mean``.

    ``nan_mismatch``: msprobe's check failed — the positions of inf (either sign) or of NaN differ; its compare
    then reports N/A.  Where they match msprobe zeroes those elements first, so +inf against -inf is a match.
    ``nonfinite_mismatch``: bnprobe's stricter check — some element is not the same non-finite value on both
    sides (+inf against -inf, inf against NaN, a non-finite value against a finite one).
    ``worst_index``: the element with the largest |actual - golden| where both are finite (-1 if none).
    ``problem``: msprobe's message for the tensor ("" when it has none), or why nothing could be compared.
    """

    # which msprobe function each field mirrors (compare: msprobe/core/compare/algorithm/builtin_algorithm;
    # checker: msprobe/pytorch/api_accuracy_checker/compare/algorithm.py)
    size: int
    cosine: float  # alg_cosine_similarity.compare
    euclidean: float  # alg_euclidean_distance.compare
    max_abs: float  # alg_max_absolute_error.compare
    max_rel: float  # alg_max_relative_error.compare (get_relative_err): compare's MaxRelativeErr
    mean_rel: float  # checker get_mean_rel_err: small values left out
    rmse: float  # checker get_rmse: small values left out, with its correction
    ratio_1e3: float  # alg_one_thousand_error.compare (calc_relative_err_ratio): share with relative error < 0.001
    ratio_5e3: float  # alg_five_thousand_error.compare
    error_balance: float  # checker get_error_balance: |#(a > g) - #(a < g)| / n, the golden cast to a's dtype
    ulp_max: float  # checker get_ulp_err, then UlpCompare._stat_max_ulp_err
    ulp_mean: float  # UlpCompare._stat_mean_ulp_err
    worst_index: int
    nan_mismatch: bool  # npy_compare.handle_inf_nan failed
    accuracy_reached: str  # multiprocessing_compute.check_accuracy
    checker_max_rel: float = _NAN  # checker get_max_rel_err: small values left out
    small_value_err_ratio: float = _NAN  # checker get_small_value_err_ratio
    nonfinite_mismatch: bool = False
    problem: str = ""
    _printed: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    # computed on the way, kept so that the benchmark verdict and the ULP rule need not compute them again: the
    # checker's metrics as benchmark_verdict takes them (None where checker_metrics gives none) and the ULP errors
    _checker: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _ulps: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return d

    @property
    def checker_metrics(self) -> dict[str, Any] | None:
        """What :func:`checker_metrics` gives for this pair (None when it gives none), computed once."""
        return self._checker

    @property
    def ulps(self) -> np.ndarray | None:
        """:func:`ulp_error` of this pair (float64, 1-D), computed once; None when the pair was not compared."""
        return self._ulps

    def msprobe_row(self) -> dict[str, Any]:
        """The compare's row as msprobe writes it: its column names, figures printed with 12 decimals (EucDist
        unrounded, cosine with 6 above 0.9999), "Nan" / "N/A" / "unsupported" / "shape unmatched" where it
        computes nothing, Accuracy Reached or Not and Err_message."""
        return dict(zip((*_COLUMNS, "Accuracy Reached or Not", "Err_message"), self._printed))


def _unusable(size: int, word: str, accuracy: str, problem: str, printed_msg: str = "") -> Comparison:
    printed = (*(word,) * len(_COLUMNS), accuracy, printed_msg or problem)
    return Comparison(size, *(_NAN,) * 11, -1, False, accuracy, problem=problem, _printed=printed)


def _holds(y: np.ndarray, dtype: Any) -> bool:
    """Whether float64 ``y`` holds values of ``dtype`` only (NaN included): a prefix first, as a golden that
    does not usually shows it in its first elements."""
    for part in (y[:4096], y):
        back = fp16_as(part, np.float64) if dtype is np.float16 else part.astype(dtype).astype(np.float64)
        if not np.array_equal(back, part, equal_nan=True):
            return False
    return True


def compare(actual: Any, golden: Any, fmt: str | Format = "fp32", *, golden_fmt: str | Format | None = None
            ) -> Comparison:
    """msprobe's metrics of ``actual`` (values of ``fmt``; numpy, torch or a list) against ``golden``.

    Compare figures: cosine, EucDist and MaxAbsErr in float64 of the values given; relative errors in
    float32 for data of at most fp32, as msprobe computes them (a golden with more digits is rounded to
    float32 for them).  ``golden_fmt="fp64"``: the golden is float64 data, and msprobe's numpy promotion then
    computes the relative errors in float64, eps 2^-52 where the golden is 0 (its message on differing dtypes
    included).  Checker figures: the golden held one precision level up (fp16/bf16 -> fp32, fp32 -> fp64),
    as msprobe's accuracy checker computes it.  Never raises: an unusable pair gives NaN figures and a
    ``problem``.
    """
    try:
        f = get_format(fmt)
        gf = None if golden_fmt is None else get_format(golden_fmt)
        a_in, g_in = _array(actual), _array(golden)
        a, g = a_in.astype(np.float64, copy=False), g_in.astype(np.float64, copy=False)
    except (BNProbeError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        return _unusable(0, "unsupported", "None", f"cannot compare: {exc}")
    if a.size == 0:  # ValidateTensor: empty, then shape (as read_pt_data squeezes it), 0-d, inf/nan, dtype
        return _unusable(0, "unsupported", "None", "This is empty data, can not compare.")
    if np.squeeze(a).shape != np.squeeze(g).shape:
        return _unusable(int(a.size), "shape unmatched", "Unmatched",
                         f"Shape of NPU and bench tensor do not match. Skipped. (actual {tuple(a.shape)}, golden "
                         f"{tuple(g.shape)})", "Shape of NPU and bench tensor do not match. Skipped.")
    g = g.reshape(a.shape)
    std = MSPROBE_CHECKER[f.name]
    kept: dict[str, Any] = {}
    checker = {k: float(v) for k, v in _checker(a, g, std, keep=kept, given=a_in).items()}
    judged = not _judged(f, "L0")[1] and a_in.shape == g_in.shape  # as checker_metrics decides
    kept = dict(_checker=kept["checker"] if judged else None, _ulps=kept["ulps"])
    # the compare's data, flat, as msprobe holds it: the output in its format; the golden in golden_fmt when
    # given, else like the output when it holds fmt's values (a dump pair), else float32 (float64 for fp64)
    n_dt = _HELD[f.name]
    x, y = a.reshape(-1), g.reshape(-1)
    with np.errstate(all="ignore"):
        if gf is not None:
            b_dt = _HELD[gf.name]
            y = y.astype(b_dt).astype(np.float64)
        else:
            b_dt = n_dt if _holds(y, n_dt) else (np.float64 if n_dt is np.float64 else np.float32)
    dtype_msg = "Dtype of NPU and bench tensor do not match." if b_dt != n_dt and gf is not None else ""
    if np.isfinite(x).all() and np.isfinite(y).all():
        nan_mismatch, all_same, worst = False, True, int(np.argmax(np.abs(x - y)))
    else:
        n_inf, b_inf, n_nan, b_nan = np.isinf(x), np.isinf(y), np.isnan(x), np.isnan(y)
        fin = ~(n_inf | n_nan) & ~(b_inf | b_nan)
        with np.errstate(invalid="ignore"):
            all_same = bool((fin | (n_nan & b_nan) | (n_inf & (x == y))).all())
        # handle_inf_nan: a match when the inf positions (either sign) and NaN positions agree
        nan_mismatch = not (np.array_equal(n_inf, b_inf) and np.array_equal(n_nan, b_nan))
        worst = int(np.argmax(np.abs(np.where(fin, x, 0.0) - np.where(fin, y, 0.0))))
        if x.size > 1 and not nan_mismatch:  # msprobe zeroes the non-finite elements (the same on both sides)
            bad = n_inf | n_nan
            x, y = np.where(bad, 0.0, x), np.where(bad, 0.0, y)
    common = dict(size=int(x.size), mean_rel=checker["mean_rel"], rmse=checker["rmse"], error_balance=checker["eb"],
                  ulp_max=checker["ulp_max"], ulp_mean=checker["ulp_mean"], worst_index=worst,
                  nan_mismatch=nan_mismatch, checker_max_rel=checker["max_rel"],
                  small_value_err_ratio=checker["small_value"], nonfinite_mismatch=not all_same)
    if x.size > 1 and nan_mismatch:  # a 0-d tensor skips msprobe's inf/nan check
        msg = "The position of inf or nan in NPU and bench Tensor do not match."
        return Comparison(cosine=_NAN, euclidean=_NAN, max_abs=_NAN, max_rel=_NAN, ratio_1e3=_NAN, ratio_5e3=_NAN,
                          accuracy_reached="No", problem=msg, _printed=(*("N/A",) * len(_COLUMNS), "No", msg),
                          **common, **kept)
    with np.errstate(all="ignore"):  # (float16 data held in float32 where it is only read as float32: the relative
        n, b = (fp16_as(v, np.float32) if dt is np.float16 and v.size > 1 else v.astype(dt)  # errors' dtype is
                for v, dt in ((x, n_dt), (y, b_dt)))  # result_type(n, b, float32) either way)
    raw, shown, msg = _compare_figures(x, y, n, b)
    if x.size > 1:  # ValidateTensor stops at the 0-d check, before the dtype one
        msg = dtype_msg + msg
    accuracy = _check_accuracy(shown[0], shown[2])
    return Comparison(cosine=raw[0], euclidean=raw[1], max_abs=raw[2], max_rel=raw[3], ratio_1e3=raw[4],
                      ratio_5e3=raw[5], accuracy_reached=accuracy, problem=msg, _printed=(*shown, accuracy, msg),
                      **common, **kept)


# ---- the benchmark verdict ---------------------------------------------------------------------------

def benchmark_level(api: str) -> str:
    """msprobe's benchmark level of an API (StandardConfig.get_api_level): L2, L1, or L0 (batch_norm)."""
    return next((lvl for lvl in ("L2", "L1") if api in MSPROBE_BENCHMARK_APIS[lvl]), "L0")


@dataclass(frozen=True)
class BenchmarkResult:
    """msprobe's benchmark verdict on one floating output (BenchmarkPrecisionCompare): each device metric over
    the bench device's (floored at the format's error floor), an error above its level's limit.  ``result``:
    "pass" or "error" (26.2.0 never gives "warning" here), "skip" where msprobe's benchmark does not judge.
    ``device`` / ``bench``: the metrics as its CSV carries them; ``needed``: the largest ratio / limit over the
    judged metrics — the smallest scale of the limits that would have passed (inf for an inf/NaN mismatch).
    Truthy when it passed."""

    fmt: str
    level: str
    result: str
    ratios: dict[str, float]
    status: dict[str, str]
    limits: dict[str, float]
    device: dict[str, float]
    bench: dict[str, float]
    floor: float
    needed: float
    message: str = ""
    problem: str = ""

    @property
    def passed(self) -> bool:
        return self.result == "pass"

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _as_written(v: Any) -> float:
    """A checker metric as api_precision_compare reads it back: the detail CSV holds a Python float (numpy
    float64 included) with 14 decimals (Comparator._get_acc_check_detail), anything else (float32) as str()."""
    if isinstance(v, float):
        return float(f"{v:.{MSPROBE_CSV_DECIMALS}f}")
    return float(str(v))


def _skip(fmt: str, level: str, problem: str) -> BenchmarkResult:
    return BenchmarkResult(fmt, level, "skip", {}, {}, {}, {}, {}, _NAN, _NAN, problem=problem)


def _judged(fmt: str | Format, level: str) -> tuple[str, str]:
    """(format name, "") when msprobe's benchmark judges ``fmt`` at ``level``, else (name, why not)."""
    try:
        f = get_format(fmt).name
    except BNProbeError as exc:
        return str(fmt), str(exc)
    if level not in MSPROBE_BENCHMARK_LIMITS:
        return f, f"unknown benchmark level {level!r}; valid: {', '.join(MSPROBE_BENCHMARK_LIMITS)}"
    if f not in ("fp16", "bf16", "fp32"):
        return f, "msprobe's benchmark judges fp16, bf16 and fp32 outputs (it skips float64, judges fp8 by ULP)"
    return f, ""


def benchmark_verdict(device: Mapping[str, Any], bench: Mapping[str, Any], fmt: str | Format = "fp16", *,
                      level: str = "L0") -> BenchmarkResult:
    """msprobe's benchmark verdict from the metrics of a device (``device``) and a bench device (``bench``)
    against the same golden, keyed as :data:`BENCHMARK_METRICS` (small_value, rmse, max_rel, mean_rel, eb)."""
    f, why = _judged(fmt, level)
    if why:
        return _skip(f, level, why)
    floor = MSPROBE_CHECKER[f].error_floor
    limits = MSPROBE_BENCHMARK_LIMITS[level]
    dev = {k: _as_written(device[k]) for k in BENCHMARK_METRICS}
    ben = {k: _as_written(bench[k]) for k in BENCHMARK_METRICS}
    ratios: dict[str, float] = {}
    status: dict[str, str] = {}
    message = ""
    for k in BENCHMARK_METRICS:
        x, y = dev[k], ben[k]
        if not (np.isfinite(x) and np.isfinite(y)):  # check_inf_or_nan
            same = x == y if (np.isinf(x) and np.isinf(y)) else (np.isnan(x) and np.isnan(y))
            ratios[k] = _NAN
            status[k] = "pass" if same else "error"
            message += f"{_CSV_NAMES[k]}同为同号inf或nan\n" if same else f"{_CSV_NAMES[k]}inf或nan不一致\n"
            continue
        ratios[k] = abs(x) / max(abs(y), floor)  # calc_ratio: the floor applies to the bench metric
        status[k] = "error" if ratios[k] > limits[k] else "pass"  # _get_single_metric_status
    shares = [np.inf if status[k] == "error" and np.isnan(ratios[k]) else
              (0.0 if np.isnan(ratios[k]) else ratios[k] / limits[k]) for k in _JUDGED]
    result = "error" if any(status[k] == "error" for k in _JUDGED) else "pass"
    return BenchmarkResult(f, level, result, ratios, status, dict(limits), dev, ben, floor, float(max(shares)),
                           message)


def checker_metrics(actual: Any, golden: Any, fmt: str | Format = "fp16") -> dict[str, Any] | None:
    """The accuracy checker's metrics of one output against the golden, keyed as :data:`BENCHMARK_METRICS`
    (what :func:`benchmark_verdict` takes), or None when they cannot be computed (format, shape)."""
    name, why = _judged(fmt, "L0")
    if why:
        return None
    try:
        given, g = _array(actual), _array(golden).astype(np.float64)
        a = given.astype(np.float64)
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None
    if g.size == 0 or a.shape != g.shape:
        return None
    return _checker(a, g, MSPROBE_CHECKER[name], ulp=False, given=given)


def benchmark(actual: Any, bench: Any, golden: Any, fmt: str | Format = "fp16", *, level: str = "L0"
              ) -> BenchmarkResult:
    """msprobe's benchmark verdict on a device output ``actual`` and a bench device's output ``bench`` (values of
    ``fmt``) against one ``golden`` (held one precision level up, as its accuracy checker computes it).  The
    level is the API's (:func:`benchmark_level`; BatchNorm is L0).  Never raises."""
    name, why = _judged(fmt, level)
    if why:
        return _skip(name, level, why)
    try:
        a, b, g = (_array(v).astype(np.float64) for v in (actual, bench, golden))
    except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
        return _skip(name, level, f"cannot compare: {exc}")
    if g.size == 0:
        return _skip(name, level, "There is not bench calculation result.")
    std = MSPROBE_CHECKER[name]
    for who, v in (("device", a), ("bench", b)):
        if v.shape != g.shape:
            return BenchmarkResult(name, level, "error", {}, {}, dict(MSPROBE_BENCHMARK_LIMITS[level]), {}, {},
                                   std.error_floor, np.inf,
                                   problem=f"the {who} output's shape {v.shape} is not the golden's {g.shape}")
    return benchmark_verdict(_checker(a, g, std, ulp=False), _checker(b, g, std, ulp=False), name, level=level)

"""BatchNorm folding and fusion for inference, checked in every format.

Folding: A = γ/√(σ²+ε), B = β − γμ/√(σ²+ε); a preceding Conv2D or Linear gets W' = W·A (per
output channel) and b' = b·A + B.  Folded and unfused (layer, then BN inference) are both computed
in the format under test — inputs and weights stored in it, the layer's dot products accumulated in
an explicit accumulator format — and compared with the FP64 unfused golden, per output channel.

The verdict is msprobe's benchmark method (its rule for BatchNorm-level operators) with the unfused
computation in the same format as the benchmark, decided by the judge
(:func:`bnprobe.engine.closeness.bench_ratio_rule`): a channel passes when folding's RMSE is at most 2x
and its largest error at most 10x the unfused path's, each denominator floored at the format's
error floor times the channel's RMS (fp16 2^-11, bf16 2^-8, fp32 2^-14).  Running the layer in a
format at all costs precision; folding must not add materially to it.
"""

from __future__ import annotations

import math
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.core.call import EPS
from bnprobe._loading import first_line
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Judged, Verdict
from bnprobe.kernels import forward_infer, get_policy
from bnprobe.kernels.layout import layout_of
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import reduce_sum
from bnprobe.numerics.rounding import round_to
from bnprobe.engine.closeness import bench_ratio_rule

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["Layer", "FoldReport", "make_layer", "load_layer", "check_layer", "fold_params", "layer_forward",
           "check_fold", "fold_bytes", "ASCEND_EPS_FLOOR", "ASCEND_EPS_REPLACEMENT"]

# Ascend's Conv+BN folding pass on the host replaces an eps below 1e-8 by 1e-5
ASCEND_EPS_FLOOR = 1e-8
ASCEND_EPS_REPLACEMENT = 1e-5


@dataclass
class Layer:
    """A Conv2D (weight (Cout, Cin/groups, kh, kw)) or Linear (weight (Cout, Cin)) followed by BatchNorm."""

    kind: str
    weight: np.ndarray
    bias: np.ndarray | None
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    eps: float = EPS
    groups: int = 1
    padding: int = 0
    x: np.ndarray | None = None  # an input to run it on
    batch_mean: np.ndarray | None = None  # statistics of the last training batch (for the wrong-stats check)
    batch_var: np.ndarray | None = None
    source: str = "built-in"
    x_generated: bool = False  # x made up by load_layer (the file has none): no batch statistics to speak of

    @property
    def channels(self) -> int:
        return self.weight.shape[0]


def make_layer(kind: str = "conv2d", *, seed: int = 0, dead: int = 3, groups: int = 1) -> Layer:
    """A random layer with realistic BN statistics, including ``dead`` near-dead channels whose running
    variance is tiny (1e-7..1e-5): there A = γ/√(σ²+ε) is huge."""
    rng = np.random.default_rng([seed, 0xF01D])
    if kind == "conv2d":
        cin, cout, k = 16, 32, 3
        w = rng.standard_normal((cout, cin // groups, k, k)) * math.sqrt(2 / (cin * k * k / groups))
        x = np.maximum(rng.standard_normal((2, cin, 12, 12)), 0) * 2  # post-ReLU activations
    elif kind == "linear":
        cin, cout = 64, 32
        w = rng.standard_normal((cout, cin)) * math.sqrt(2 / cin)
        x = np.maximum(rng.standard_normal((16, cin)), 0) * 2
    else:
        raise BNProbeError(f"unknown layer {kind!r}; valid: conv2d, linear")
    bias = rng.normal(0, 0.1, cout)
    z = ref_forward(kind, x, w, bias, groups, 1 if kind == "conv2d" else 0)
    ax = (0, 2, 3) if z.ndim == 4 else (0,)
    bm, bv = z.mean(axis=ax), z.var(axis=ax)
    rm = bm + rng.normal(0, 0.05, cout) * np.sqrt(bv)  # running stats near the batch's
    rv = bv * rng.uniform(0.8, 1.2, cout)
    dead_ch = rng.choice(cout, size=min(dead, cout), replace=False)
    rv[dead_ch] = 10.0 ** rng.uniform(-7, -5, dead_ch.size)
    gamma = rng.uniform(0.5, 1.5, cout)
    return Layer(kind, w, bias, gamma, rng.normal(0, 0.1, cout), rm, rv, 1e-5, groups,
                 1 if kind == "conv2d" else 0, x, bm, bv)


def _real(p: Path, name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as float64, refused unless it holds real numbers that convert exactly (no complex, text or bool)."""
    if a.dtype.kind not in "iuf":
        raise BNProbeError(f"{p}: {name} holds {a.dtype} values, not real numbers")
    out = a.astype(np.float64)
    if a.dtype.kind in "iu" and not np.array_equal(out.astype(a.dtype), a):
        raise BNProbeError(f"{p}: {name} holds integers too large to be exact in float64")
    return out


def npz_scalar(p: Path, name: str, a: np.ndarray, kind: type) -> Any:
    """The one value of ``a`` as ``kind`` (int: an integral number; float; str)."""
    if a.size != 1:
        raise BNProbeError(f"{p}: {name} has shape {a.shape}, not a single value")
    v = a.reshape(()).item()
    if kind is str:
        if not isinstance(v, str):
            raise BNProbeError(f"{p}: {name} is {v!r}, not a text")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise BNProbeError(f"{p}: {name} is {v!r}, not {'an integer' if kind is int else 'a number'}")
    return kind(v)


def read_npz(p: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz, each member's .npy header read first: a member that is not a .npy array (raw bytes,
    a pickle: numpy would hand them back as bytes), holds Python objects or is shorter than its header says is
    refused, and all of them together are checked against the memory limit before any data is read."""
    from bnprobe.inputs import npy_header
    from bnprobe.guard import PER_ELEMENT, format_size, require

    try:
        with zipfile.ZipFile(p) as zf:
            headers = {}
            for info in zf.infolist():
                key = info.filename.removesuffix(".npy")
                with zf.open(info) as fh:
                    magic = fh.read(6)
                if not info.filename.endswith(".npy") or magic != b"\x93NUMPY":
                    raise BNProbeError(f"{p}: member {info.filename!r} is not a .npy array (np.savez writes only "
                                       ".npy members); refused, nothing in it is loaded or unpickled")
                if key in headers:
                    raise BNProbeError(f"{p}: member {info.filename!r} is there twice")
                with zf.open(info) as fh:
                    headers[key] = (info, *npy_header(fh, f"{p}: {key}", info.file_size))
            values = sum(math.prod(shape) for _, shape, _ in headers.values())
            stored = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in headers.values())
            # the arrays as stored and as float64, plus the loader's own per-value overhead
            require(stored + values * (8 + PER_ELEMENT["load"]), f"loading {p} ({format_size(stored)} of arrays)")
            out = {}
            for key, (info, _, _) in headers.items():
                with zf.open(info) as fh:
                    out[key] = np.lib.format.read_array(fh, allow_pickle=False)
            return out
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zip, zlib and numpy errors alike: a damaged file
        raise BNProbeError(f"{p}: not a readable .npz ({first_line(exc)})") from None


def load_layer(path: str | Path) -> Layer:
    """A layer from an .npz with weight, gamma, beta, running_mean, running_var (optional: bias, eps,
    groups, padding, x, kind), checked as :func:`check_layer` does."""
    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"weights file {str(p)!r} does not exist")
    d = read_npz(p)
    need = [k for k in ("weight", "gamma", "beta", "running_mean", "running_var") if k not in d]
    if need:
        raise BNProbeError(f"{p}: missing array(s) {', '.join(need)}")
    arrays = {k: _real(p, k, d[k]) for k in ("weight", "gamma", "beta", "running_mean", "running_var", "bias", "x")
              if k in d}
    w = arrays["weight"]
    kind = npz_scalar(p, "kind", d["kind"], str) if "kind" in d else ("conv2d" if w.ndim == 4 else "linear")
    if kind not in ("conv2d", "linear"):
        raise BNProbeError(f"{p}: kind is {kind!r}; valid: conv2d, linear")
    if (kind == "conv2d" and w.ndim != 4) or (kind == "linear" and w.ndim != 2):
        raise BNProbeError(f"{p}: weight has shape {w.shape}, not a {kind} weight")
    cout = w.shape[0]
    for k in ("gamma", "beta", "running_mean", "running_var", "bias"):
        if k in d and d[k].shape != (cout,):
            raise BNProbeError(f"{p}: {k} has shape {d[k].shape} but the weight has {cout} output channels")
    groups = npz_scalar(p, "groups", d["groups"], int) if "groups" in d else 1
    if groups < 1:
        raise BNProbeError(f"{p}: groups is {groups}, not an integer >= 1")
    cin = w.shape[1] * groups
    x = arrays["x"] if "x" in d else (
        np.maximum(np.random.default_rng(0).standard_normal((2, cin, 12, 12) if kind == "conv2d" else (16, cin)),
                   0) * 2)
    layer = Layer(kind, w, arrays.get("bias"), arrays["gamma"], arrays["beta"], arrays["running_mean"],
                  arrays["running_var"], npz_scalar(p, "eps", d["eps"], float) if "eps" in d else 1e-5, groups,
                  npz_scalar(p, "padding", d["padding"], int) if "padding" in d else (1 if kind == "conv2d" else 0), x,
                  source=str(p), x_generated="x" not in d)
    try:
        check_layer(layer)
    except BNProbeError as exc:
        raise BNProbeError(f"{p}: {exc}") from None
    return layer


def check_layer(layer: Layer) -> None:
    """Refuse a layer whose parts do not fit together: its kind, groups and padding, the weight and
    the per-channel vectors, the input's shape and channels (never truncated), the kernel against the input."""
    w, kind = np.asarray(layer.weight), layer.kind
    if kind not in ("conv2d", "linear"):
        raise BNProbeError(f"unknown layer {kind!r}; valid: conv2d, linear")
    if w.ndim != (4 if kind == "conv2d" else 2) or 0 in w.shape:
        raise BNProbeError(f"weight has shape {w.shape}, not a non-empty {kind} weight")
    arrays = {"weight": w, "gamma": layer.gamma, "beta": layer.beta, "running_mean": layer.running_mean,
              "running_var": layer.running_var, "bias": layer.bias, "x": layer.x}
    for name, a in arrays.items():
        if a is not None and np.iscomplexobj(a):
            raise BNProbeError(f"{name} is complex: folding takes real numbers")
    cout = w.shape[0]
    for name in ("gamma", "beta", "running_mean", "running_var", "bias"):
        a = arrays[name]
        if a is not None and np.shape(a) != (cout,):
            raise BNProbeError(f"{name} has shape {np.shape(a)} but the weight has {cout} output channels")
    groups, pad = layer.groups, layer.padding
    if not isinstance(groups, (int, np.integer)) or groups < 1 or cout % groups:
        raise BNProbeError(f"groups is {groups!r}: it must be an integer >= 1 dividing the {cout} output channels")
    if kind == "linear" and groups != 1:
        raise BNProbeError(f"groups is {groups}: a linear layer has none (groups 1)")
    x = layer.x
    if x is None:
        return
    want = (f"(N, {w.shape[1] * groups}, H, W)" if kind == "conv2d" else f"(N, {w.shape[1]})")
    if np.ndim(x) != w.ndim or np.shape(x)[1] != w.shape[1] * groups or np.size(x) == 0:
        raise BNProbeError(f"x has shape {np.shape(x)}; the {kind} weight {w.shape}"
                           f"{f' with groups {groups}' if groups > 1 else ''} takes a non-empty {want}")
    if kind == "conv2d":
        kh, kw = w.shape[2:]
        # beyond k - 1 a padded row or column meets no input at all
        if not isinstance(pad, (int, np.integer)) or not 0 <= pad < min(kh, kw):
            raise BNProbeError(f"padding is {pad!r}: it must be an integer from 0 to {min(kh, kw) - 1} for a "
                               f"{kh}x{kw} kernel")
        h, wd = np.shape(x)[2:]
        if h + 2 * pad < kh or wd + 2 * pad < kw:
            raise BNProbeError(f"the {kh}x{kw} kernel is larger than x's {h}x{wd} plane padded by {pad}")
    elif pad != 0:
        raise BNProbeError(f"padding is {pad!r}: a linear layer has none (padding 0)")


#: fold's peak memory, in bytes per value (the slopes of ``/usr/bin/time -f %M bnprobe fold --weights W.npz`` between
#: two sizes of each quantity, x 1.3): per product of the widest group of ``layer_forward`` (N·(Cout/g)·Ho·Wo·
#: (Cin/g·kh·kw): every product rounded to the accumulator, then summed; 25 B measured), per im2col column value
#: (N·Ho·Wo·(Cin/g·kh·kw) of a group; 8 B), per output value (N·Cout·Ho·Wo: every path's output in float64, their
#: channel rows, errors and the wrong-statistics variants; 163 B) and per input value (x stored, rounded and
#: regrouped; 28 B).  An fp64 accumulator runs the einsum golden alone: no products are held.
FOLD_BYTES_PER_PRODUCT = 33
FOLD_BYTES_PER_COLUMN = 11
FOLD_BYTES_PER_OUTPUT = 212
FOLD_BYTES_PER_INPUT = 37


def fold_bytes(kind: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, groups: int = 1, pad: int = 0,
               accumulate: str = "fp32") -> int:
    """The estimated peak memory of :func:`check_fold` on a layer of these shapes (see FOLD_BYTES_PER_*)."""
    from bnprobe.guard import BASE_BYTES

    n, cout = int(x_shape[0]), int(w_shape[0])
    if kind == "conv2d":
        h, w = int(x_shape[2]), int(x_shape[3])
        kh, kw = int(w_shape[2]), int(w_shape[3])
        spatial = max(h + 2 * pad - kh + 1, 0) * max(w + 2 * pad - kw + 1, 0)
        k = int(w_shape[1]) * kh * kw  # (Cin/g)·kh·kw
    else:
        spatial, k = 1, int(w_shape[1])
    columns = n * spatial * k
    products = columns * (cout // max(groups, 1))
    outputs = n * cout * spatial
    inputs = math.prod(int(d) for d in x_shape)
    held = 0 if get_format(accumulate).name == "fp64" else products
    return (BASE_BYTES + FOLD_BYTES_PER_PRODUCT * held + FOLD_BYTES_PER_COLUMN * columns
            + FOLD_BYTES_PER_OUTPUT * outputs + FOLD_BYTES_PER_INPUT * inputs)


def fold_params(gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float,
                weight: np.ndarray, bias: np.ndarray | None, arith: Arith | None = None) -> tuple[np.ndarray, ...]:
    """(A, B, W', b') with every operation rounded in ``arith``'s format (exact FP64 when None)."""
    ar = arith or Arith("fp64")
    with np.errstate(all="ignore"):
        a = ar.div(ar.round(gamma), ar.sqrt(ar.add(ar.round(var), ar.round(eps))))
        b = ar.sub(ar.round(beta), ar.mul(a, ar.round(mean)))
        col = a.reshape((-1,) + (1,) * (weight.ndim - 1))
        w2 = ar.mul(ar.round(weight), col)
        b2 = b if bias is None else ar.add(ar.mul(ar.round(bias), a), b)
    return a, b, w2, b2


def _im2col(x: np.ndarray, kh: int, kw: int, pad: int) -> np.ndarray:
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    cols = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))  # n, c, ho, wo, kh, kw
    return cols.transpose(0, 2, 3, 1, 4, 5).reshape(n, ho, wo, c * kh * kw)


def ref_forward(kind: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, groups: int, pad: int) -> np.ndarray:
    """The layer in FP64 (numpy einsum)."""
    if kind == "linear":
        z = x @ w.T
        return z + (0 if b is None else b)
    cout = w.shape[0]
    g_out = cout // groups
    outs = []
    for g in range(groups):
        xg = x[:, g * w.shape[1]:(g + 1) * w.shape[1]]
        cols = _im2col(xg, w.shape[2], w.shape[3], pad)
        outs.append(np.einsum("nhwk,ok->nohw", cols, w[g * g_out:(g + 1) * g_out].reshape(g_out, -1)))
    z = np.concatenate(outs, axis=1)
    return z + (0 if b is None else b.reshape(1, -1, 1, 1))


def layer_forward(kind: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, *, groups: int = 1, pad: int = 0,
                  accumulate: str = "fp32", out: str = "fp32", order: str = "pairwise") -> np.ndarray:
    """The layer with every product rounded to the accumulator format and the dot products summed in it
    (``order``), the bias added in it, then the result rounded to ``out``.  x and w must already be
    values of their storage format."""
    acc = Arith(accumulate)
    if get_format(accumulate).name == "fp64":
        z = ref_forward(kind, x, w, b, groups, pad)
        return round_to(z, out)
    cout = w.shape[0]
    if kind == "linear":
        prods = acc.mul(x[:, None, :], w[None, :, :])  # n, cout, k
        n = x.shape[0]
        z = reduce_sum(prods.reshape(n * cout, -1), acc, order=order).reshape(n, cout)
        if b is not None:
            z = acc.add(z, acc.round(b))
        return round_to(z, out)
    g_out = cout // groups
    outs = []
    for g in range(groups):
        xg = x[:, g * w.shape[1]:(g + 1) * w.shape[1]]
        cols = _im2col(xg, w.shape[2], w.shape[3], pad)  # n, ho, wo, k
        wg = w[g * g_out:(g + 1) * g_out].reshape(g_out, -1)
        prods = acc.mul(cols[:, None], wg[None, :, None, None, :])  # n, o, ho, wo, k
        n, o, ho, wo, k = prods.shape
        outs.append(reduce_sum(prods.reshape(-1, k), acc, order=order).reshape(n, o, ho, wo))
    z = np.concatenate(outs, axis=1)
    if b is not None:
        z = acc.add(z, acc.round(b).reshape(1, -1, 1, 1))
    return round_to(z, out)


@dataclass
class FoldReport(Judged):
    layer: str
    dtype: str
    accumulate: str
    channels: pd.DataFrame  # per output channel
    forms: pd.DataFrame  # folded vs unfused vs the other forms, per format
    eps_rule: dict[str, Any]
    wrong_stats: pd.DataFrame
    torch: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    folded: dict[str, Any] | None = None  # fold --folded: the user's file, its formats and the likely cause
    causes: pd.DataFrame | None = None  # fold --folded: each candidate wrong fold against the user's numbers

    @property
    def passed(self) -> bool:
        return bool((self.channels["verdict"] == Verdict.PASS).all())

    @property
    def frame(self) -> pd.DataFrame:
        """One row per output channel (``channels``)."""
        return self.channels

    def to_dict(self) -> dict[str, Any]:
        doc = {"layer": self.layer, "dtype": self.dtype, "accumulate": self.accumulate, "passed": self.passed,
               "channels": self.channels.to_dict(orient="records"), "forms": self.forms.to_dict(orient="records"),
               "eps_rule": self.eps_rule, "wrong_stats": self.wrong_stats.to_dict(orient="records"),
               "torch": self.torch, "notes": self.notes}
        if self.folded is not None:
            doc["folded"] = self.folded
            doc["causes"] = None if self.causes is None else self.causes.to_dict(orient="records")
        return doc


@dataclass
class _Fold:
    """One layer run every way check_fold compares: the FP64 golden, unfused and folded in the format, ReLU fused or
    not; ``xs``/``ws``/``bs`` are the inputs as stored in the format."""

    layer: Layer
    fmt: Any
    acc: str
    eps: float
    xs: np.ndarray
    ws: np.ndarray
    bs: np.ndarray | None
    z_gold: np.ndarray
    y_gold: np.ndarray
    a64: np.ndarray
    fold64: np.ndarray
    w2: np.ndarray
    w2s: np.ndarray
    y_unfused: np.ndarray
    y_xhat: np.ndarray
    y_folded: np.ndarray
    relu_fused: np.ndarray | None
    relu_unfused: np.ndarray | None


def _run_fold(layer: Layer, fmt: Any, acc: str, eps: float, relu: bool) -> _Fold:
    kind, groups, pad = layer.kind, layer.groups, layer.padding
    pol = get_policy("fp64").with_options(name="fp64")
    # golden: FP64 layer then BN inference on the same stored inputs
    xs, ws = round_to(layer.x, fmt), round_to(layer.weight, fmt)
    bs = None if layer.bias is None else round_to(layer.bias, fmt)
    g, b, rm, rv = layer.gamma, layer.beta, layer.running_mean, layer.running_var
    z_gold = ref_forward(kind, xs, ws, bs, groups, pad)
    y_gold = forward_infer(z_gold, g, b, rm, rv, eps=eps, policy=pol).y
    a64, b64, w64, bb64 = fold_params(g, b, rm, rv, eps, ws, bs)
    fold64 = ref_forward(kind, xs, w64, bb64, groups, pad)
    # unfused in the format: layer (explicit accumulator) -> stored in fmt -> BN inference policy of fmt
    bn_pol = get_policy(fmt.name if fmt.name in ("fp64", "fp32") else fmt.name).with_options(
        name=f"{fmt.name} BN inference", accumulate=acc if acc != "fp64" or fmt.name == "fp64" else "fp32")
    z = layer_forward(kind, xs, ws, bs, groups=groups, pad=pad, accumulate=acc, out=fmt.name)
    y_unfused = forward_infer(z, g, b, rm, rv, eps=eps, policy=bn_pol.with_options(y_formula="affine")).y
    y_xhat = forward_infer(z, g, b, rm, rv, eps=eps, policy=bn_pol.with_options(y_formula="xhat")).y
    # folded in the format: A, B, W', b' formed in the accumulator format, stored in fmt
    _, _, w2, b2 = fold_params(g, b, rm, rv, eps, ws, bs, Arith(acc))
    w2s, b2s = round_to(w2, fmt), round_to(b2, fmt)
    y_folded = layer_forward(kind, xs, w2s, b2s, groups=groups, pad=pad, accumulate=acc, out=fmt.name)
    relu_fused = round_to(np.maximum(y_unfused.astype(np.float64), 0), fmt) if relu else None
    relu_unfused = np.maximum(round_to(y_unfused.astype(np.float64), fmt), 0) if relu else None
    return _Fold(layer, fmt, acc, eps, xs, ws, bs, z_gold, y_gold, a64, fold64, w2, w2s, y_unfused, y_xhat, y_folded,
                 relu_fused, relu_unfused)


def _channel_table(f: _Fold) -> Any:
    """Per output channel: folded vs unfused error against the golden (msprobe's benchmark ratios), the folded
    weights' headroom and rounding, the verdict."""
    import pandas as pd

    fmt, cout, rv, eps = f.fmt, f.layer.channels, f.layer.running_var, f.eps
    lay = layout_of(f.y_gold)  # outputs are (N, C) or (N, C, H, W): channel-first rows per output channel
    yg, yf, yu = lay.to_cr(f.y_gold), lay.to_cr(f.y_folded), lay.to_cr(f.y_unfused)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # a channel whose folded weights overflowed is all NaN/inf: reported as non-finite below
        warnings.filterwarnings("ignore", message="(All-NaN slice|Mean of empty slice)", category=RuntimeWarning)
        err_f = np.nanmax(np.abs(yf - yg), axis=1)
        err_u = np.nanmax(np.abs(yu - yg), axis=1)
        wmax = np.nanmax(np.abs(f.w2.reshape(cout, -1)), axis=1)
        wnum = f.w2.reshape(cout, -1)
        w_rel = np.nanmax(np.abs(round_to(wnum, fmt) - wnum) / np.where(wnum != 0, np.abs(wnum), np.nan), axis=1)
    rows = []
    for c in range(cout):
        ok, why, _, _ = bench_ratio_rule(yf[c], yu[c], yg[c], fmt.name, what="folded", bench_name="unfused")
        with np.errstate(all="ignore"):
            head = math.log2(fmt.max / wmax[c]) if wmax[c] > 0 and np.isfinite(wmax[c]) else -math.inf
        rows.append({"channel": c, "A": float(f.a64[c]), "running_var": float(rv[c]),
                     "var_over_eps": float(rv[c] / eps), "folded_w_absmax": float(wmax[c]),
                     "w_headroom_binades": head,
                     "w_overflows": bool(head < 0) or not np.all(np.isfinite(f.w2s.reshape(cout, -1)[c])),
                     "w_rel_rounding": float(w_rel[c]), "err_folded": float(err_f[c]), "err_unfused": float(err_u[c]),
                     "error_added_by_folding": float(err_f[c]) - float(err_u[c]), "verdict": Verdict.of(ok),
                     "why": why})
    return pd.DataFrame(rows)


def _forms_table(f: _Fold) -> Any:
    """The largest error of each way to compute the layer (folded, unfused affine or x-hat, ReLU fused or not)."""
    import pandas as pd

    def err(y: np.ndarray | None) -> float:
        if y is None:
            return math.nan
        with np.errstate(all="ignore"):
            d = np.abs(np.asarray(y, dtype=np.float64) - (np.maximum(f.y_gold, 0)
                                                          if y is f.relu_fused or y is f.relu_unfused else f.y_gold))
        return float(np.nanmax(d)) if np.isfinite(d).any() else math.inf

    return pd.DataFrame([
        {"form": "folded conv/linear (W' = W*A, b' = b*A + B)", "max_abs_err": err(f.y_folded)},
        {"form": "unfused, BN as A*x + B", "max_abs_err": err(f.y_unfused)},
        {"form": "unfused, BN as (x - mean)*rstd*gamma + beta", "max_abs_err": err(f.y_xhat)},
        {"form": "BN + ReLU fused (ReLU before the output cast)", "max_abs_err": err(f.relu_fused)},
        {"form": "BN then ReLU (cast, then ReLU)", "max_abs_err": err(f.relu_unfused)},
        {"form": "FP64 folded vs FP64 unfused", "max_abs_err": float(np.max(np.abs(f.fold64 - f.y_gold)))},
    ])


def _eps_rule(f: _Fold) -> dict[str, Any]:
    """Ascend's eps rule, in FP64 (so only the rule differs)."""
    ly = f.layer
    eps_used = ASCEND_EPS_REPLACEMENT if f.eps < ASCEND_EPS_FLOOR else f.eps
    y_rule = ref_forward(ly.kind, f.xs, *fold_params(ly.gamma, ly.beta, ly.running_mean, ly.running_var, eps_used,
                                                      f.ws, f.bs)[2:], ly.groups, ly.padding)
    return {"eps": f.eps, "eps_after_rule": eps_used, "replaced": eps_used != f.eps,
            "max_abs_change": float(np.max(np.abs(y_rule - f.y_gold)))}


def _wrong_statistics(f: _Fold) -> Any:
    """Folding with the wrong statistics (batch instead of running, biased/unbiased mix-ups), in FP64."""
    import pandas as pd

    ly = f.layer
    rm, rv = ly.running_mean, ly.running_var
    wrong = []
    r_count = int(np.prod(f.z_gold.shape)) // ly.channels
    if ly.batch_mean is not None and ly.batch_var is not None:
        for label, m_, v_ in (("batch statistics instead of running", ly.batch_mean, ly.batch_var),
                              ("running var made biased (x (R-1)/R)", rm, rv * (r_count - 1) / r_count),
                              ("running var made 'unbiased' again (x R/(R-1))", rm, rv * r_count / (r_count - 1))):
            yw = ref_forward(ly.kind, f.xs, *fold_params(ly.gamma, ly.beta, m_, v_, f.eps, f.ws, f.bs)[2:],
                              ly.groups, ly.padding)
            wrong.append({"folded with": label, "max_abs_change": float(np.max(np.abs(yw - f.y_gold)))})
    return pd.DataFrame(wrong)


def _fold_notes(layer: Layer, ch: Any) -> list[str]:
    notes = []
    inputs = {"x": layer.x, "weight": layer.weight, "bias": layer.bias, "gamma": layer.gamma, "beta": layer.beta,
              "running_mean": layer.running_mean, "running_var": layer.running_var}
    nonfinite = [k for k, v in inputs.items() if v is not None and not np.isfinite(v).all()]
    if nonfinite:
        notes.append(f"NaN or inf in {', '.join(nonfinite)}: the outputs they reach are non-finite on every path")
    bad_var = np.flatnonzero(np.asarray(layer.running_var, dtype=np.float64) < 0)
    if bad_var.size:
        notes.append(f"running_var is negative at channel(s) {bad_var.tolist()}: not a variance; A = γ/√(σ²+ε) is "
                     "NaN where σ²+ε < 0")
    risky = ch[ch.w_overflows | (ch.verdict == Verdict.FAIL)]
    if len(risky):
        notes.append(f"channels at risk: {risky.channel.tolist()} (A up to {risky.A.abs().max():.3g})")
    return notes


def check_fold(layer: Layer, dtype: str | None = None, *, accumulate: str | None = None, eps: float | None = None,
               relu: bool = True, against_torch: bool = False) -> FoldReport:
    """Folded vs unfused in ``dtype`` (default fp16) against the FP64 golden, per output channel, with the risks
    explained; with ``against_torch``, the folded weights also against torch's fusion (in fp16/bf16: both folded in
    fp32 and cast, as a deployment does; a note when torch is not installed)."""
    from bnprobe.guard import require

    fmt = get_format(dtype or "fp16")
    acc = get_format(accumulate or ("fp64" if fmt.name == "fp64" else "fp32")).name
    eps = layer.eps if eps is None else eps
    if not eps > 0:
        raise BNProbeError(f"eps must be > 0, got {eps}")
    if layer.x is None:
        raise BNProbeError("the layer has no input to run on")
    check_layer(layer)
    kind, groups = layer.kind, layer.groups
    require(fold_bytes(kind, np.shape(layer.x), np.shape(layer.weight), groups=groups, pad=layer.padding,
                       accumulate=acc),
            f"fold of a {kind} layer (weight {tuple(np.shape(layer.weight))}"
            f"{f', groups {groups}' if groups > 1 else ''}) on x of shape {tuple(np.shape(layer.x))}")
    f = _run_fold(layer, fmt, acc, eps, relu)
    ch = _channel_table(f)
    rep = FoldReport(kind, fmt.name, acc, ch, _forms_table(f), _eps_rule(f), _wrong_statistics(f), None,
                     _fold_notes(layer, ch))
    if against_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            rep.notes.append("torch not installed: no comparison with torch.nn.utils.fusion")
        else:
            rep.torch = torch_fusion_check(layer, rep.dtype)
    return rep


def torch_fusion_check(layer: Layer, dtype: str = "fp32") -> dict[str, Any]:
    """bnprobe's folded weights against torch.nn.utils.fusion.fuse_conv_bn_eval (Conv2d) / fuse_linear_bn_eval."""
    import torch
    from torch.nn.utils import fusion

    fmt = get_format(dtype)
    # fp16/bf16: folded as deployments do it, in fp32 and then cast (torch's own fusion in a 16-bit dtype would be
    # 16-bit arithmetic, which no exporter uses); bnprobe's fold alike, rounded once to the format
    work = fmt if fmt.name in ("fp32", "fp64") else get_format("fp32")
    td = work.torch_dtype
    if layer.kind == "conv2d":
        conv = torch.nn.Conv2d(layer.weight.shape[1] * layer.groups, layer.channels, layer.weight.shape[2:],
                               padding=layer.padding, groups=layer.groups, bias=layer.bias is not None)
    else:
        conv = torch.nn.Linear(layer.weight.shape[1], layer.channels, bias=layer.bias is not None)
    bn = torch.nn.BatchNorm2d(layer.channels, eps=layer.eps) if layer.kind == "conv2d" else \
        torch.nn.BatchNorm1d(layer.channels, eps=layer.eps)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(layer.weight))
        if layer.bias is not None:
            conv.bias.copy_(torch.from_numpy(layer.bias))
        bn.weight.copy_(torch.from_numpy(layer.gamma))
        bn.bias.copy_(torch.from_numpy(layer.beta))
        bn.running_mean.copy_(torch.from_numpy(layer.running_mean))
        bn.running_var.copy_(torch.from_numpy(layer.running_var))
    conv, bn = conv.to(td).eval(), bn.to(td).eval()
    fused = fusion.fuse_conv_bn_eval(conv, bn) if layer.kind == "conv2d" else fusion.fuse_linear_bn_eval(conv, bn)
    ws, bs = round_to(layer.weight, work), None if layer.bias is None else round_to(layer.bias, work)
    _, _, w2, b2 = fold_params(layer.gamma, layer.beta, layer.running_mean, layer.running_var, layer.eps, ws, bs,
                               Arith(work))
    w2, b2 = round_to(w2, fmt), round_to(b2, fmt)
    tw = fused.weight.detach().to(fmt.torch_dtype).to(torch.float64).numpy()
    tb = fused.bias.detach().to(fmt.torch_dtype).to(torch.float64).numpy()
    with np.errstate(all="ignore"):
        rel_w = float(np.max(np.abs(tw - w2) / np.maximum(np.abs(w2), 1e-30)))
        rel_b = float(np.max(np.abs(tb - b2) / np.maximum(np.abs(b2), 1e-30)))
    return {"torch": torch.__version__, "dtype": fmt.name, "max_rel_weight_diff": rel_w, "max_rel_bias_diff": rel_b}

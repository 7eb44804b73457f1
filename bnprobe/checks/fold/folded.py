"""A user's folded layer (a converter's or exporter's W' and b') judged against the FP64 golden fold of its layer.

The golden: A = γ/√(σ²+ε), B = β − μ·A, W' = W·A per output channel and b' = b·A + B, in FP64 from the layer's
own parameters.  Per output channel the user's W' and b' pass when each value lies within half an ulp of the format
the file stores it in plus a few units of fp32 computation (:func:`bnprobe.core.tolerances.folded_tolerance`); the
layer's output on x is judged with that tolerance carried through the layer, |Δy| ≤ |x| * tol(W') + tol(b').  The
judge decides both (:func:`bnprobe.engine.closeness.bounded_rule` and :func:`~bnprobe.engine.closeness.error_within`).

When the fold is wrong, each known way of getting it wrong is rebuilt from the layer in FP64 and judged against the
user's numbers with the same tolerance: a cause is named only when it reproduces every channel and the correct fold
does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe.checks.fold.layer import (
    ASCEND_EPS_FLOOR,
    ASCEND_EPS_REPLACEMENT,
    FoldReport,
    Layer,
    read_npz,
    ref_forward,
    npz_scalar,
    check_layer,
    fold_bytes,
    fold_params,
)
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Verdict
from bnprobe.kernels.layout import layout_of
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.rounding import is_representable, round_to
from bnprobe.core.tolerances import FOLD_SUM_SLACK, folded_tolerance
from bnprobe.engine.closeness import bound_shares, bounded_rule, error_within, off_by

__all__ = ["Folded", "load_folded", "check_folded", "FRAMEWORK_EPS"]

#: ε a converter may put in place of the layer's: the defaults of torch.nn.BatchNorm* and keras BatchNormalization
FRAMEWORK_EPS = {1e-5: "PyTorch's default", 1e-3: "Keras' default"}
_STORED = {"float16": "fp16", "float32": "fp32", "float64": "fp64", "bfloat16": "bf16"}
_NARROWER = ("bf16", "fp16", "fp32")  # lowest precision first: every bf16 value in fp16's range is an fp16 value too


@dataclass(frozen=True)
class Folded:
    """A user's folded layer: W' and b' as float64, the format each is judged in and how it was read, and the ε the
    file names (None: it names none)."""

    weight: np.ndarray
    bias: np.ndarray
    weight_format: str
    bias_format: str
    eps: float | None = None
    source: str = ""
    read_as: tuple[str, ...] = ()


def read_stored(p: Path, name: str, a: np.ndarray) -> tuple[np.ndarray, str, str]:
    """(``a`` as float64, the format it is judged in, how that was decided)."""
    how = "its dtype"
    if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype.names is None:
        a, how = a.view(get_format("bf16").dtype), "2-byte void: read as bfloat16, as np.savez stores ml_dtypes'"
    fmt = _STORED.get(a.dtype.name)
    if fmt is None:
        raise BNProbeError(f"{p}: {name} holds {a.dtype} values; a folded layer is stored as float16, bfloat16, "
                           "float32 or float64")
    v = a.astype(np.float64)
    finite = v[np.isfinite(v)]
    for narrow in _NARROWER:
        if get_format(narrow).precision < get_format(fmt).precision and finite.size \
                and is_representable(finite, narrow).all():
            fmt, how = narrow, f"stored as {a.dtype.name} but every value is a {narrow} value"
            break
    return v, fmt, f"{name}: {fmt} ({how})"


def load_folded(path: str | Path, layer: Layer) -> Folded:
    """The folded layer in an .npz with ``weight`` (W', the layer's weight shape), ``bias`` (b', one per output
    channel) and optionally ``eps`` (the ε it was folded with), read as :func:`bnprobe.checks.fold.layer.load_layer`
    reads a layer: nothing in it is unpickled or executed."""
    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"folded file {str(p)!r} does not exist")
    d = read_npz(p)
    need = [k for k in ("weight", "bias") if k not in d]
    if need:
        raise BNProbeError(f"{p}: missing array(s) {', '.join(need)} (a folded layer holds weight W' and bias b')")
    w, wf, w_how = read_stored(p, "weight", d["weight"])
    b, bf, b_how = read_stored(p, "bias", d["bias"])
    if w.shape != np.shape(layer.weight):
        raise BNProbeError(f"{p}: weight has shape {w.shape} but the layer's weight has {np.shape(layer.weight)}")
    if b.shape != (layer.channels,):
        raise BNProbeError(f"{p}: bias has shape {b.shape} but the layer has {layer.channels} output channels")
    eps = None
    if "eps" in d:
        eps = npz_scalar(p, "eps", d["eps"], float)
        if not (math.isfinite(eps) and eps > 0):
            raise BNProbeError(f"{p}: eps is {eps!r}, not a positive number")
    return Folded(w, b, wf, bf, eps, str(p), (w_how, b_how))


@dataclass(frozen=True)
class _Model:
    """One way to fold the layer, in FP64: W', b' and the size of the terms each b' is formed from."""

    cause: str
    a: np.ndarray
    weight: np.ndarray
    bias: np.ndarray
    magnitude: np.ndarray


def _model(layer: Layer, cause: str, mean: np.ndarray, var: np.ndarray, eps: float, *, scaled: bool = True,
           storage: str | None = None, op_by_op: bool = False) -> _Model:
    """The fold with these statistics and ε; ``scaled=False``: b' = b + B; ``storage``: A and B rounded to it before
    they multiply (``op_by_op``: every operation of the fold rounded to it)."""
    bias = np.zeros(layer.channels) if layer.bias is None else np.asarray(layer.bias, dtype=np.float64)
    a, b, w2, b2 = fold_params(layer.gamma, layer.beta, mean, var, eps, layer.weight, bias,
                               Arith(storage) if op_by_op else None)
    with np.errstate(all="ignore"):
        if storage and not op_by_op:
            a, b = round_to(a, storage), round_to(b, storage)
            w2 = layer.weight * a.reshape((-1,) + (1,) * (layer.weight.ndim - 1))
            b2 = bias * a + b
        if not scaled:
            b2 = bias + b
        magnitude = np.abs(bias * a if scaled else bias) + np.abs(layer.beta) + np.abs(mean * a)
    return _Model(cause, a, w2, b2, magnitude)


def _candidates(layer: Layer, eps: float, folded: Folded) -> list[_Model]:
    """The correct fold first, then every known wrong one that differs from it for this layer."""
    m, v = layer.running_mean, layer.running_var
    out = [_model(layer, "correct", m, v, eps)]
    if layer.bias is not None and np.any(layer.bias != 0):
        out.append(_model(layer, "bias not scaled by A: b' = b + B instead of b·A + B", m, v, eps, scaled=False))
    tried = {eps}
    others = [(0.0, "ε ignored (0)")]
    if eps < ASCEND_EPS_FLOOR:
        others.append((ASCEND_EPS_REPLACEMENT, f"ε {eps:g} replaced by {ASCEND_EPS_REPLACEMENT:g} (Ascend's folding "
                                               f"pass replaces ε < {ASCEND_EPS_FLOOR:g})"))
    if folded.eps is not None:
        others.append((folded.eps, f"ε {folded.eps:g} (the folded file's) instead of the layer's {eps:g}"))
    others += [(e, f"ε {e:g} ({why}) instead of the layer's {eps:g}") for e, why in FRAMEWORK_EPS.items()]
    for e, cause in others:
        if not any(abs(e - t) <= 1e-6 * t for t in tried):  # ε as float32 (ONNX's) is the same ε
            tried.add(e)
            out.append(_model(layer, cause, m, v, e))
    if not layer.x_generated:
        z = ref_forward(layer.kind, layer.x, layer.weight, layer.bias, layer.groups, layer.padding)
        axes = (0, 2, 3) if z.ndim == 4 else (0,)
        out.append(_model(layer, "batch statistics of x instead of the running ones", z.mean(axis=axes),
                          z.var(axis=axes), eps))
        r = z.size // layer.channels
        if r > 1:
            out += [_model(layer, f"running variance x R/(R-1) (made unbiased, R = {r} from x)", m, v * r / (r - 1),
                           eps),
                    _model(layer, f"running variance x (R-1)/R (made biased, R = {r} from x)", m, v * (r - 1) / r,
                           eps)]
    fmt = folded.weight_format
    if fmt in ("fp16", "bf16"):
        out += [_model(layer, f"A and B rounded to {fmt} before W·A and b·A + B", m, v, eps, storage=fmt),
                _model(layer, f"the whole fold computed in {fmt} arithmetic", m, v, eps, storage=fmt, op_by_op=True)]
    return out


def _variance_factor(layer: Layer, eps: float, folded: Folded) -> float | None:
    """The k with A' = γ/√(k·σ² + ε) that the folded weights show, one for every channel (their median), from each
    channel's largest weight; None when the weights show no such k."""
    cout = layer.channels
    w, wf = layer.weight.reshape(cout, -1), folded.weight.reshape(cout, -1)
    k = np.argmax(np.abs(w), axis=1)
    rows = np.arange(cout)
    with np.errstate(all="ignore"):
        a_f = wf[rows, k] / w[rows, k]
        ks = ((layer.gamma / a_f) ** 2 - eps) / layer.running_var
    ks = ks[np.isfinite(ks) & (layer.running_var > 10 * eps) & (w[rows, k] != 0)]
    if not ks.size:
        return None
    factor = float(np.median(ks))
    return factor if math.isfinite(factor) and factor > 0 and abs(factor - 1) > 1e-4 else None


def _fitted_candidates(layer: Layer, eps: float, folded: Folded, gold: _Model) -> list[_Model]:
    """Wrong folds whose one free number is read from the user's numbers, then judged on every channel: the
    variance made (un)biased with the batch size R the weights show (when x does not give R), and the output
    channels permuted (each folded channel matched to the golden one nearest in weights)."""
    out = []
    factor = _variance_factor(layer, eps, folded) if layer.x_generated else None
    if factor is not None:
        r = round(factor / (factor - 1)) if factor > 1 else round(1 / (1 - factor))
        if r >= 2:
            exact = r / (r - 1) if factor > 1 else (r - 1) / r
            kind = "made unbiased" if factor > 1 else "made biased"
            out.append(_model(layer, f"running variance x {'R/(R-1)' if factor > 1 else '(R-1)/R'} ({kind}; R = {r}, "
                                     "read from the folded weights)", layer.running_mean, layer.running_var * exact,
                              eps))
    perm = _permutation(folded, gold)
    if perm is not None:
        moved = np.flatnonzero(perm != np.arange(perm.size)).tolist()
        out.append(_Model(f"output channels permuted ({', '.join(f'{c} holds {perm[c]}' for c in moved[:6])}"
                          f"{', ...' if len(moved) > 6 else ''})", gold.a[perm], gold.weight[perm], gold.bias[perm],
                          gold.magnitude[perm]))
    return out


def _permutation(folded: Folded, gold: _Model) -> np.ndarray | None:
    """perm with folded channel c ≈ golden channel perm[c], matched on a random projection of the weights (16
    numbers per channel, seed 0); None when that is no permutation or the identity."""
    cout = gold.bias.shape[0]
    if cout < 2:
        return None
    wf, wg = folded.weight.reshape(cout, -1), gold.weight.reshape(cout, -1)
    proj = np.random.default_rng([0, 0x9E7]).standard_normal((wg.shape[1], 16))
    with np.errstate(all="ignore"):
        sf, sg = np.nan_to_num(wf @ proj), wg @ proj
        dist = np.zeros((cout, cout))
        for lo in range(0, cout, 256):  # (256, Cout, 16) at a time
            dist[lo:lo + 256] = np.abs(sf[lo:lo + 256, None, :] - sg[None, :, :]).max(axis=2)
    perm = np.argmin(dist, axis=1)
    if np.unique(perm).size != cout or np.array_equal(perm, np.arange(cout)):
        return None
    return perm


@dataclass(frozen=True)
class _Judged:
    """A model against the user's numbers: per value the tolerance and the error as a share of it."""

    model: _Model
    w_tol: np.ndarray  # (Cout, k)
    w_ratio: np.ndarray
    b_tol: np.ndarray  # (Cout,)
    b_ratio: np.ndarray

    @property
    def channel_ratio(self) -> np.ndarray:
        """Per channel, the largest error as a share of its tolerance (<= 1: the channel is reproduced)."""
        return np.maximum(self.w_ratio.max(axis=1), self.b_ratio)


def _judge(folded: Folded, m: _Model) -> _Judged:
    cout = m.bias.shape[0]
    w, wm = folded.weight.reshape(cout, -1), m.weight.reshape(cout, -1)
    w_tol = folded_tolerance(wm, folded.weight_format)
    b_tol = folded_tolerance(m.bias, folded.bias_format, np.abs(m.bias) + m.magnitude)
    return _Judged(m, w_tol, bound_shares(w, wm, w_tol), b_tol, bound_shares(folded.bias, m.bias, b_tol))


def _output(layer: Layer, folded: Folded, gold: _Judged) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel: the largest |Δy| the user's fold makes in the layer's output on x, what the tolerance allows
    there, and whether every output is within what it allows (the FP64 layer run on W' − W'gold, b' − b'gold)."""
    g = gold.model
    with np.errstate(all="ignore"):
        dw = np.where(folded.weight == g.weight, 0.0, folded.weight - g.weight)
        db = np.where(folded.bias == g.bias, 0.0, folded.bias - g.bias)
        dy = np.abs(ref_forward(layer.kind, layer.x, dw, db, layer.groups, layer.padding))
    allowed = ref_forward(layer.kind, np.abs(layer.x), gold.w_tol.reshape(g.weight.shape), gold.b_tol, layer.groups,
                           layer.padding)
    lay = layout_of(dy)
    dy, allowed = lay.to_cr(dy), lay.to_cr(allowed)
    dy = np.where(np.isnan(dy), np.inf, dy)
    worst = np.argmax(dy, axis=1)
    rows = np.arange(dy.shape[0])
    ok = error_within(dy, allowed, slack=FOLD_SUM_SLACK, axis=1)
    return dy[rows, worst], allowed[rows, worst], ok


def _channels(layer: Layer, folded: Folded, gold: _Judged) -> Any:
    """Per output channel: the worst W' and the b' against the golden and their tolerance, the output, the verdict."""
    import pandas as pd

    cout = layer.channels
    y_err, y_allowed, y_ok = _output(layer, folded, gold)
    w, wg = folded.weight.reshape(cout, -1), gold.model.weight.reshape(cout, -1)
    a = gold.model.a
    rows = []
    for c in range(cout):
        wj = bounded_rule(w[c], wg[c], gold.w_tol[c])
        bj = bounded_rule(folded.bias[c], gold.model.bias[c], gold.b_tol[c])
        k = wj.worst
        need = max(wj.used, bj.used)
        finite = bool(np.isfinite(w[c]).all() and np.isfinite(folded.bias[c]))
        ok = finite and bool(wj) and bool(bj) and bool(y_ok[c])
        why = ("NaN or inf in the folded file" if not finite else
               "within tolerance" if ok else
               off_by(f"W'[{c}] element {k}", w[c, k], wg[c, k], gold.w_tol[c, k]) if wj.used >= bj.used else
               off_by(f"b'[{c}]", folded.bias[c], gold.model.bias[c], gold.b_tol[c]))
        rows.append({"channel": c, "A": float(a[c]) if np.isfinite(a[c]) else math.nan,
                     "w_err": float(np.abs(w[c, k] - wg[c, k])), "w_allowed": float(gold.w_tol[c, k]),
                     "b_err": float(abs(folded.bias[c] - gold.model.bias[c])), "b_allowed": float(gold.b_tol[c]),
                     "needs_x_tolerance": need, "y_err": float(y_err[c]), "y_allowed": float(y_allowed[c]),
                     "verdict": Verdict.of(ok), "why": why})
    return pd.DataFrame(rows)


def _causes(judged: list[_Judged]) -> Any:
    """Each candidate fold against the user's numbers: how many channels it reproduces and the tolerance it needs."""
    import pandas as pd

    rows = []
    for j in judged:
        r = j.channel_ratio
        rows.append({"cause": j.model.cause, "channels_reproduced": int((r <= 1).sum()), "channels": int(r.size),
                     "needs_x_tolerance": float(r.max()), "fits": bool((r <= 1).all())})
    return pd.DataFrame(rows)


def _verdict_notes(layer: Layer, folded: Folded, ch: Any, causes: Any) -> tuple[list[str], list[str]]:
    """(the likely causes, the notes): a cause only when it reproduces every channel and the correct fold does not."""
    notes = [f"read {how}" for how in folded.read_as]
    bad_w = sorted({int(c) for c in np.flatnonzero(~np.isfinite(folded.weight.reshape(layer.channels, -1)).all(1))})
    bad_b = np.flatnonzero(~np.isfinite(folded.bias)).tolist()
    if bad_w or bad_b:
        notes.append("NaN or inf in the folded file: " + "; ".join(
            f"{k} at channel(s) {v}" for k, v in (("weight", bad_w), ("bias", bad_b)) if v))
    fmt = get_format(folded.weight_format)
    with np.errstate(all="ignore"):
        wmax = np.max(np.abs(layer.weight.reshape(layer.channels, -1)), axis=1) * np.abs(ch["A"].to_numpy())
    over = np.flatnonzero(wmax > fmt.max).tolist()
    if over:
        notes.append(f"channel(s) {over}: the correct W' reaches {wmax[over].max():.4g}, beyond {fmt.name}'s largest "
                     f"{fmt.max:g}: this fold cannot be stored in {fmt.name}")
    if (ch.verdict == Verdict.PASS).all():
        return [], notes
    likely = causes[causes.fits & (causes.cause != "correct")].cause.tolist()
    if not likely:
        w = ch.sort_values("needs_x_tolerance", ascending=False).iloc[0]
        notes.append(f"no known cause matches: worst channel {int(w.channel)}: {w.why}, "
                     f"x{w.needs_x_tolerance:.3g} the tolerance")
    if layer.x_generated:
        notes.append("the weights file has no x: batch statistics were not tried, and a variance made (un)biased only "
                     "with the batch size R the folded weights show")
    return likely, notes


def check_folded(layer: Layer, folded: Folded, *, eps: float | None = None) -> FoldReport:
    """The user's folded W' and b' against the FP64 golden fold of ``layer`` (ε: the layer's unless given), per
    output channel, parameters and the layer's output on its x; when wrong, the known causes that reproduce it."""
    from bnprobe.guard import require

    eps = layer.eps if eps is None else eps
    if not (math.isfinite(eps) and eps > 0):
        raise BNProbeError(f"eps must be a positive number, got {eps}")
    if layer.x is None:
        raise BNProbeError("the layer has no input to run on")
    check_layer(layer)
    require(fold_bytes(layer.kind, np.shape(layer.x), np.shape(layer.weight), groups=layer.groups,
                       pad=layer.padding, accumulate="fp64"),
            f"fold --folded of a {layer.kind} layer (weight {tuple(np.shape(layer.weight))}) on x of shape "
            f"{tuple(np.shape(layer.x))}")
    judged = [_judge(folded, m) for m in _candidates(layer, eps, folded)]
    if (judged[0].channel_ratio > 1).any():
        judged += [_judge(folded, m) for m in _fitted_candidates(layer, eps, folded, judged[0].model)]
    ch = _channels(layer, folded, judged[0])
    causes = _causes(judged)
    likely, notes = _verdict_notes(layer, folded, ch, causes)
    fmt = folded.weight_format if folded.weight_format == folded.bias_format else \
        f"{folded.weight_format} (bias {folded.bias_format})"
    info = {"file": folded.source, "weight_format": folded.weight_format, "bias_format": folded.bias_format,
            "eps": eps, "eps_in_file": folded.eps,
            "x": "generated, seed 0: the weights file has none" if layer.x_generated else "the weights file's",
            "likely_causes": likely}
    import pandas as pd

    return FoldReport(layer.kind, fmt, "fp64", ch, pd.DataFrame(), {}, pd.DataFrame(), None, notes, info, causes)

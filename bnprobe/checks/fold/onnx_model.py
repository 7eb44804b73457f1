"""``bnprobe fold --onnx``: every layer -> BatchNormalization pair of an ONNX model folded and judged, and a runtime's
or converter's fused model judged against the golden fold.

Per pair (:mod:`bnprobe.checks.fold.onnx_graph` finds them), the layer becomes a
:class:`~bnprobe.checks.fold.layer.Layer` named by its node, run on a generated post-ReLU input (seed 0; an ONNX
model carries no activations), and:

- :func:`~bnprobe.checks.fold.layer.check_fold` in each format asked for: A per output channel, the folded weights'
  range and headroom, folded vs unfused against the FP64 golden, the risks;
- with a fused model (``--fused``, or onnxruntime's own graph optimizer), the fused layer's W' and b' judged by
  :func:`~bnprobe.checks.fold.folded.check_folded` (the same judge as ``fold --folded``), with the likely cause;
- the fp16 deployment view: the fused W' and b' rounded to fp16 by numpy (round to nearest even, beyond 65504 to
  inf; not onnxconverter-common, whose converter clips by default) and judged the same way, with what each channel
  loses (values overflowed, flushed to zero, made subnormal, the largest relative change).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe._loading import first_line
from bnprobe.checks.fold.layer import ASCEND_EPS_FLOOR, FoldReport, Layer, check_fold, check_layer, fold_bytes
from bnprobe.checks.fold.folded import Folded, read_stored, check_folded
from bnprobe.checks.fold.onnx_graph import (
    Model,
    Pair,
    Skipped,
    bn_eps,
    bn_params,
    check_between,
    import_onnx,
    layer_params,
    load_model,
)
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Judged, Verdict

__all__ = ["OnnxLayer", "OnnxFoldReport", "check_onnx", "ort_fused", "FUSE_LEVELS", "NEAR_DEAD_SHARE",
           "X_SPATIAL", "X_BUDGET"]

#: onnxruntime's optimisation levels ``--fuse`` takes (CPU provider); ``all`` adds layout changes (NCHWc) that
#: may reorder a conv's weights, so ``ort`` is the extended level, where Conv+BN and MatMul+BN are fused
FUSE_LEVELS = {"ort": "ORT_ENABLE_EXTENDED", "ort-basic": "ORT_ENABLE_BASIC", "ort-all": "ORT_ENABLE_ALL"}
#: a near-dead channel: running variance below ε or below this share of the layer's median running variance (its
#: output is almost constant, A = γ/√(σ² + ε) is set by ε rather than by the data, and W·A is large)
NEAR_DEAD_SHARE = 1e-4
X_SPATIAL = 12  # the generated input's plane, as fold --weights makes one (smaller when the layer is large)
X_BUDGET = 512 * 2**20  # the largest fold estimate a generated input is shrunk to (the guard still has the last say)
_CONV_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "FusedConv", "FusedGemm")  # onnxruntime's fused activations


@dataclass
class OnnxLayer:
    """One pair: the layer's node name and op, the BatchNormalization's, the fold layer and what was left out."""

    name: str
    op: str
    bn: str
    between: tuple[str, ...]
    layer: Layer
    notes: tuple[str, ...] = ()


@dataclass
class OnnxFoldReport(Judged):
    """Every pair's fold analysis per format, its fused layer's verdict and its fp16 deployment view."""

    model: str
    dtypes: list[str]
    layers: list[OnnxLayer]
    analysis: dict[tuple[str, str], FoldReport]
    fused_source: str | None = None
    fused: dict[str, FoldReport | str] = field(default_factory=dict)  # str: why there is no fused layer
    fp16: dict[str, FoldReport] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pairs: dict[str, Pair] = field(default_factory=dict)  # the graph's pairs by layer name (for the fused check)

    @property
    def passed(self) -> bool:
        reps = [*self.analysis.values(), *(r for r in self.fused.values() if not isinstance(r, str)),
                *self.fp16.values()]
        return all(r.passed for r in reps)

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """Every channel of every check (:meth:`to_frame`)."""
        return self.to_frame()

    def summary(self) -> list[dict[str, Any]]:
        """One row per layer and check: channels, ε, the largest A, the risks, failures and the verdict."""
        rows = []
        for ly in self.layers:
            lay = ly.layer
            for d in self.dtypes:
                rep = self.analysis[(ly.name, d)]
                ch = rep.channels
                rows.append({"layer": ly.name, "op": ly.op, "bn": ly.bn, "check": f"fold in {d}",
                             "channels": lay.channels, "eps": lay.eps, "A_max": float(ch.A.abs().max()),
                             "near_dead": _channels(_near_dead(lay), ch),
                             "overflow": _channels(ch.w_overflows, ch),
                             "min_headroom_binades": float(ch.w_headroom_binades.min()),
                             "failed": _channels(ch.verdict == Verdict.FAIL, ch),
                             "cause": "; ".join(dict.fromkeys(ch.why[ch.verdict == Verdict.FAIL])),
                             "verdict": rep.verdict})
            for label, rep in (("fused", self.fused.get(ly.name)), ("fused in fp16", self.fp16.get(ly.name))):
                if rep is None:
                    continue
                if isinstance(rep, str):
                    rows.append({"layer": ly.name, "op": ly.op, "bn": ly.bn, "check": label, "channels": lay.channels,
                                 "eps": lay.eps, "cause": rep,
                                 "verdict": Verdict.NOT_FUSED if rep.startswith("not fused") else Verdict.NOT_CHECKED})
                    continue
                ch = rep.channels
                rows.append({"layer": ly.name, "op": ly.op, "bn": ly.bn, "check": f"{label} ({rep.dtype})",
                             "channels": lay.channels, "eps": lay.eps, "A_max": float(ch.A.abs().max()),
                             "overflow": _channels(ch.get("w_overflow", ch.A * 0) > 0, ch),
                             "failed": _channels(ch.verdict == Verdict.FAIL, ch),
                             "cause": "; ".join(rep.folded["likely_causes"]),
                             "verdict": rep.verdict})
        return rows

    def to_frame(self) -> Any:
        """Every channel of every check, one row each (the report's CSV)."""
        import pandas as pd

        parts = []
        for (name, d), rep in self.analysis.items():
            parts.append(rep.channels.assign(layer=name, check=f"fold in {d}"))
        for label, reps in (("fused", self.fused), ("fused in fp16", self.fp16)):
            parts += [rep.channels.assign(layer=name, check=label) for name, rep in reps.items()
                      if not isinstance(rep, str)]
        if not parts:
            return pd.DataFrame(columns=["layer", "check", "channel", "verdict"])
        frame = pd.concat(parts, ignore_index=True)
        return frame[["layer", "check", *[c for c in frame.columns if c not in ("layer", "check")]]]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtypes": self.dtypes, "passed": self.passed, "fused_model": self.fused_source,
                "layers": [{"name": ly.name, "op": ly.op, "bn": ly.bn, "between": list(ly.between),
                            "kind": ly.layer.kind, "weight_shape": list(ly.layer.weight.shape),
                            "groups": ly.layer.groups, "eps": ly.layer.eps, "notes": list(ly.notes)}
                           for ly in self.layers],
                "summary": self.summary(),
                "analysis": {f"{n} {d}": r.to_dict() for (n, d), r in self.analysis.items()},
                "fused": {n: r if isinstance(r, str) else r.to_dict() for n, r in self.fused.items()},
                "fp16": {n: r.to_dict() for n, r in self.fp16.items()},
                "skipped": self.skipped, "notes": self.notes}


def _near_dead(lay: Layer) -> Any:
    import pandas as pd

    var = np.asarray(lay.running_var, dtype=np.float64)
    return pd.Series((var < lay.eps) | (var < NEAR_DEAD_SHARE * np.median(var)))


def _channels(mask: Any, ch: Any) -> str:
    picked = ch.channel[mask.to_numpy(dtype=bool)].tolist()
    return (", ".join(str(c) for c in picked[:8]) + (f" (+{len(picked) - 8})" if len(picked) > 8 else "")) \
        if picked else ""


def _input_for(kind: str, weight: np.ndarray, groups: int, pad: int) -> np.ndarray:
    """A post-ReLU input (seed 0) with the layer's input channels; the plane shrunk until the fold's estimate fits
    X_BUDGET or the kernel (an ONNX model carries no activations)."""
    rng = np.random.default_rng(0)
    if kind == "linear":
        return np.maximum(rng.standard_normal((16, weight.shape[1])), 0) * 2
    cin, kh, kw = weight.shape[1] * groups, weight.shape[2], weight.shape[3]
    n, h, w = 2, max(X_SPATIAL, kh) if kh > 1 else 1, max(X_SPATIAL, kw)
    while True:
        if fold_bytes(kind, (n, cin, h, w), weight.shape, groups=groups, pad=pad) <= X_BUDGET:
            break
        if n > 1:
            n = 1
        elif h > kh or w > kw:
            h, w = max(h - 2, kh), max(w - 2, kw)
        else:
            break
    return np.maximum(rng.standard_normal((n, cin, h, w)), 0) * 2


def _layer(m: Model, pair: Pair) -> OnnxLayer:
    """The pair as a fold layer (Skipped: a pair bnprobe does not analyse, and why)."""
    p = layer_params(m, pair.layer, pair.add)
    check_between(m, pair, p.weight.shape[0])
    g, b, mean, var = bn_params(m, pair, p.weight.shape[0])
    x = _input_for(p.kind, p.weight, p.groups, p.padding)
    lay = Layer(p.kind, p.weight, p.bias, g, b, mean, var, bn_eps(pair), p.groups, p.padding, x,
                source=f"{m.path}#{pair.name}", x_generated=True)
    try:
        check_layer(lay)
    except BNProbeError as exc:
        raise BNProbeError(f"{m.path}: node {pair.name!r}: {exc}") from None
    notes = list(p.notes)
    if lay.eps < ASCEND_EPS_FLOOR:
        notes.append(f"tiny ε {lay.eps:g} (below {ASCEND_EPS_FLOOR:g}: Ascend's folding pass would use 1e-5)")
    return OnnxLayer(pair.name, p.op, pair.bn.name or pair.bn.output[0], pair.between, lay, tuple(notes))


def _fused_node(fm: Model, pair: Pair) -> tuple[Any | None, str]:
    """The fused model's node for the pair: by the layer's node name, else the node writing the BatchNormalization's
    output, else the one layer node reading the layer's input; (None, why) when there is none or the BN stayed."""
    nodes = [n for n in fm.proto.graph.node if n.op_type in _CONV_OPS]
    found = [n for n in nodes if pair.layer.name and n.name == pair.layer.name] or \
        [n for n in nodes if pair.bn.output[0] in n.output]
    if not found:
        same = [n for n in nodes if n.input and n.input[0] == pair.layer.input[0]]
        found = same if len(same) == 1 else []
    if not found:
        return None, "no layer node of that name or those tensors in the fused model"
    node = found[0]
    tensor = node.output[0]
    for _ in range(8):  # the BatchNormalization still after it (directly or through a bias Add / Identity / Reshape)
        readers = fm.consumers.get(tensor, [])
        if len(readers) != 1 or readers[0].op_type not in ("BatchNormalization", "Add", "Identity", "Reshape"):
            break
        if readers[0].op_type == "BatchNormalization":
            return None, "not fused: a BatchNormalization still follows the layer in the fused model"
        tensor = readers[0].output[0]
    return node, ""


def _folded_of(fm: Model, node: Any, layer: Layer, label: str, source: str) -> Folded:
    """The fused node's W' and b' (zeros when it has none) in the fold's layout, as the fused model stores them."""
    add = None
    if node.op_type == "MatMul":
        readers = fm.consumers.get(node.output[0], [])
        add = readers[0] if len(readers) == 1 and readers[0].op_type == "Add" else None
    try:
        p = layer_params(fm, node, add)
    except Skipped as exc:
        raise Skipped(f"not comparable: the fused node {label!r}: {exc}") from None
    if p.weight.shape != layer.weight.shape:
        raise Skipped(f"not comparable: the fused node {label!r} holds a weight of shape {p.weight.shape} (in the "
                      f"fold's layout) for the unfused {layer.weight.shape} (a layout change, e.g. onnxruntime's "
                      "NCHWc blocks at ort-all)")
    raw_w = fm.raw(node.input[1])
    _, wf, w_how = read_stored(fm.path, f"{label} weight", raw_w)
    if p.bias is None:
        b, bf, b_how = np.zeros(layer.channels), wf, f"{label} bias: none (zeros)"
    else:
        bias_name = node.input[2] if node.op_type != "MatMul" else \
            next(i for i in add.input if i not in node.output)
        _, bf, b_how = read_stored(fm.path, f"{label} bias", fm.raw(bias_name))
        b = p.bias
    return Folded(p.weight, b, wf, bf, None, f"{source}#{label}", (w_how, b_how))


def _fp16_view(layer: Layer, f: Folded) -> FoldReport:
    """The fused W', b' rounded to fp16 and judged; per channel what the rounding lost."""
    with np.errstate(all="ignore"):
        w16 = f.weight.astype(np.float16).astype(np.float64)
        b16 = f.bias.astype(np.float16).astype(np.float64)
    conv = Folded(w16, b16, "fp16", "fp16", None, f"{f.source} in fp16",
                  ("weight: fp16 (the fused weight rounded to nearest even)", "bias: fp16 (likewise)"))
    rep = check_folded(layer, conv)
    cout = layer.channels
    w, w2 = f.weight.reshape(cout, -1), w16.reshape(cout, -1)
    tiny = get_format("fp16").tiny  # the smallest normal fp16 value
    with np.errstate(all="ignore"):
        rel = np.where(w != 0, np.abs(w2 - w) / np.abs(w), 0.0)
        rel = np.where(np.isfinite(rel), rel, np.nan)
    ch = rep.channels
    ch["w_overflow"] = (np.isfinite(w) & ~np.isfinite(w2)).sum(axis=1)
    ch["w_flushed_to_zero"] = ((w != 0) & (w2 == 0)).sum(axis=1)
    ch["w_subnormal"] = ((w2 != 0) & (np.abs(w2) < tiny)).sum(axis=1)
    ch["w_max_rel_change"] = np.nan_to_num(np.nanmax(np.where(np.isnan(rel), -1, rel), axis=1), nan=0.0).clip(0)
    ch["b_overflow"] = np.isfinite(f.bias) & ~np.isfinite(b16)
    failed = ch.verdict == Verdict.FAIL
    if failed.any() and ((ch.w_overflow > 0) | ch.b_overflow)[failed].all():
        rep.folded["likely_causes"] = ["W' or b' beyond fp16's 65504: inf once the model is converted to fp16"]
    lost = ch[(ch.w_overflow > 0) | (ch.w_flushed_to_zero > 0) | ch.b_overflow]
    for r in lost.itertuples():
        rep.notes.append(f"fp16 channel {r.channel}: {r.w_overflow} weight(s) overflow to inf, "
                         f"{r.w_flushed_to_zero} flushed to zero{', the bias overflows' if r.b_overflow else ''}")
    return rep


@contextlib.contextmanager
def ort_fused(path: Path, level: str = "ort") -> Iterator[Model]:
    """The model as onnxruntime's graph optimizer (CPU provider, the ``level`` of FUSE_LEVELS) writes it, checked
    as any model; the file lives in a temporary folder for as long as the context."""
    import_onnx(f"{named('fuse')} ort", runtime=True)
    import onnxruntime as ort

    if level not in FUSE_LEVELS:
        raise BNProbeError(f"{named('fuse')} {level!r}: valid: {', '.join(FUSE_LEVELS)}")
    with tempfile.TemporaryDirectory(prefix="bnprobe-ort-") as tmp:
        out = Path(tmp) / "fused.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, FUSE_LEVELS[level])
        so.optimized_model_filepath = str(out)
        so.log_severity_level = 3  # errors only: its warnings are not ours to print
        try:
            ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own exception types (Fail, InvalidGraph, ...)
            raise BNProbeError(f"{path}: onnxruntime could not load it to optimise ({first_line(exc)})") from None
        yield load_model(out)


def _analyse(m: Model, dtypes: list[str], accumulate: str | None) -> OnnxFoldReport:
    from bnprobe.checks.fold.onnx_graph import find_pairs

    pairs, skipped = find_pairs(m)
    rep = OnnxFoldReport(str(m.path), dtypes, [], {}, skipped=skipped)
    for pair in pairs:
        try:
            ly = _layer(m, pair)
        except Skipped as exc:
            rep.skipped.append(f"{pair.name}: {exc}")
            continue
        rep.layers.append(ly)
        rep.pairs[ly.name] = pair
        for d in dtypes:
            rep.analysis[(ly.name, d)] = check_fold(ly.layer, d, accumulate=accumulate)
    return rep


def _check_fused(rep: OnnxFoldReport, fm: Model, source: str) -> None:
    rep.fused_source = source
    for ly in rep.layers:
        node, why = _fused_node(fm, rep.pairs[ly.name])
        if node is None:
            rep.fused[ly.name] = why
            continue
        try:
            f = _folded_of(fm, node, ly.layer, node.name or node.output[0], "onnxruntime's fused model"
                           if source.startswith("onnxruntime") else source)
        except Skipped as exc:
            rep.fused[ly.name] = str(exc)
            continue
        rep.fused[ly.name] = check_folded(ly.layer, f)
        rep.fp16[ly.name] = _fp16_view(ly.layer, f)


def check_onnx(path: str | Path, dtypes: list[str] | tuple[str, ...] | None = None, *,
               fused: str | Path | None = None, fuse: str | None = None,
               accumulate: str | None = None) -> OnnxFoldReport:
    """Every layer -> BatchNormalization pair of the model at ``path`` folded in each of ``dtypes`` (default fp16);
    with ``fused`` (a fused model's path) or ``fuse`` (``ort``: onnxruntime's optimizer run on the model), each fused
    layer against the golden fold, and its fp16 deployment view."""
    if fused is not None and fuse is not None:
        raise BNProbeError(f"{named('fused')} and {named('fuse')} both give the fused model: give one")
    if fuse is not None:
        if fuse not in FUSE_LEVELS:
            raise BNProbeError(f"{named('fuse')} {fuse!r}: valid: {', '.join(FUSE_LEVELS)}")
        import_onnx(f"{named('fuse')} ort", runtime=True)
    dtypes = ("fp16",) if dtypes is None else dtypes
    names = [get_format(d).name for d in dtypes]
    if len(set(names)) != len(names) or not names:
        raise BNProbeError(f"{named('dtype')} {','.join(dtypes)}: give each format once")
    m = load_model(path)
    rep = _analyse(m, names, accumulate)
    if fused is not None:
        _check_fused(rep, load_model(fused), str(fused))
    elif fuse is not None:
        with ort_fused(m.path, fuse) as fm:
            _check_fused(rep, fm, f"onnxruntime {_ort_version()} graph optimizer ({FUSE_LEVELS[fuse]}, CPU)")
    if not rep.layers:
        rep.notes.append("no Conv/ConvTranspose/Gemm/MatMul -> BatchNormalization pair to fold in this model")
    elif rep.fused_source is not None and not rep.fp16:
        rep.notes.append(f"no fused layer of {rep.fused_source} could be compared with the golden fold")
    if rep.fp16:
        rep.notes.append("fp16 view: each fused weight and bias rounded to fp16 by numpy (round to nearest even; "
                         "beyond 65504 to inf, no clipping)")
    rep.notes.append("each layer runs on a generated post-ReLU input (seed 0): an ONNX model carries no activations; "
                     "batch statistics cannot be tried as a cause")
    return rep


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__

"""ONNX models read for ``bnprobe fold --onnx``: checked before anything large is allocated, then searched for the
layers a BatchNormalization can be folded into.

Reading: the file is parsed without its external data; every initializer's dims, type and stored size (inline or
in an external file, which must lie inside the model's folder) are checked against each other and the memory limit
before one value is converted; the graph must be acyclic with every tensor produced once.  Anything else is one
:class:`~bnprobe.core.errors.BNProbeError` line.

Pairs: a Conv / ConvTranspose (1-D or 2-D), a Gemm, or a MatMul (optionally + Add of a bias) whose output reaches a
BatchNormalization (inference mode, per-channel) directly or through Identity, or a Reshape that keeps the channel
axis (N, C) <-> (N, C, 1, 1), each intermediate read by nothing else.  Layers are named by their node names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe._loading import first_line
from bnprobe.core.errors import BNProbeError, named

__all__ = ["ONNX_EXTRA", "Model", "Pair", "LayerParams", "Skipped", "import_onnx", "load_model", "find_pairs",
           "layer_params", "check_between", "bn_params", "bn_eps", "MAX_INITIALIZER_DIMS", "MAX_NODES"]

ONNX_EXTRA = 'pip install "bnprobe[onnx]"'
MAX_INITIALIZER_DIMS = 8  # no ONNX operator bnprobe reads takes more
MAX_NODES = 1_000_000  # far beyond any deployed network; refuses a graph built to exhaust the search
_LAYER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_PASS_THROUGH = ("Identity", "Reshape")
_MODEL_READ_FACTOR = 4  # the file's bytes, the parsed message and its copies while reading (measured ~2.6x)


def import_onnx(what: str = named("onnx"), runtime: bool = False) -> Any:
    """The ``onnx`` module (and onnxruntime when ``runtime``), or one line naming the extra to install."""
    try:
        import onnx

        if runtime:
            import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise BNProbeError(f"{what} needs the onnx extra ({exc.name or 'onnx'} is not installed): "
                           f"{ONNX_EXTRA}") from None
    return onnx


@dataclass
class Model:
    """A checked model: its graph, its initializers' protos by name and where it was read from."""

    path: Path
    proto: Any
    inits: dict[str, Any]
    producer: dict[str, Any]  # tensor name -> the node writing it
    consumers: dict[str, list[Any]]  # tensor name -> the nodes reading it

    def raw(self, name: str) -> np.ndarray | None:
        """The initializer ``name`` in its stored dtype (None: not an initializer), through the Identity nodes and
        Constant nodes exporters put before parameters."""
        for _ in range(len(self.producer) + 1):
            node = self.producer.get(name)
            if name in self.inits or node is None or node.op_type != "Identity":
                break
            name = node.input[0]
        t = self.inits.get(name)
        if t is None:
            return None
        from onnx import numpy_helper

        try:
            a = numpy_helper.to_array(t, base_dir=str(self.path.parent))
        except Exception as exc:  # noqa: BLE001 - onnx's own errors and numpy's, alike: a damaged tensor
            raise BNProbeError(f"{self.path}: initializer {name!r} cannot be read ({first_line(exc)})") from None
        if a.dtype.kind not in "iuf" and a.dtype.name != "bfloat16":
            raise BNProbeError(f"{self.path}: initializer {name!r} holds {a.dtype} values, not real numbers")
        return a

    def array(self, name: str) -> np.ndarray | None:
        """The initializer ``name`` as float64 (None: not an initializer)."""
        a = self.raw(name)
        return None if a is None else a.astype(np.float64)


_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}  # TensorProto types
_FIELD = {1: "float_data", 6: "int32_data", 2: "int32_data", 3: "int32_data", 4: "int32_data", 5: "int32_data",
          9: "int32_data", 10: "int32_data", 16: "int32_data", 7: "int64_data", 11: "double_data",
          12: "uint64_data", 13: "uint64_data"}


def _external(path: Path, t: Any, n: int, size: int) -> None:
    """An external initializer's file: relative, inside the model's folder, long enough for its values."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    folder = path.parent.resolve()
    target = (folder / loc).resolve()
    if not loc or Path(loc).is_absolute() or not target.is_relative_to(folder) or target == folder:
        raise BNProbeError(f"{path}: initializer {t.name!r} names external data {loc!r} outside the model's folder; "
                           "refused")
    if not target.is_file():
        raise BNProbeError(f"{path}: initializer {t.name!r}: its external data file {loc!r} does not exist")
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", size))
    except ValueError:
        raise BNProbeError(f"{path}: initializer {t.name!r}: external data offset/length are not integers") from None
    if offset < 0 or length != size or offset + length > target.stat().st_size:
        raise BNProbeError(f"{path}: initializer {t.name!r} of {n} values needs {size} bytes at offset {offset} of "
                           f"{loc!r} ({target.stat().st_size} bytes; length {length})")


def _check_initializer(path: Path, t: Any) -> int:
    """The bytes ``t`` takes as float64, refusing dims, types or stored sizes that do not agree (nothing read)."""
    dims = list(t.dims)
    if len(dims) > MAX_INITIALIZER_DIMS or any(d < 0 for d in dims):
        raise BNProbeError(f"{path}: initializer {t.name!r} has dims {dims[:10]}: not a tensor bnprobe reads")
    n = math.prod(dims)
    if t.data_type not in _ITEMSIZE:
        raise BNProbeError(f"{path}: initializer {t.name!r} has ONNX data type {t.data_type}: not a real number "
                           "type bnprobe reads")
    size = n * _ITEMSIZE[t.data_type]
    if t.data_location == 1:  # EXTERNAL
        _external(path, t, n, size)
    elif t.HasField("raw_data"):
        if len(t.raw_data) != size:
            raise BNProbeError(f"{path}: initializer {t.name!r} has dims {dims} ({n} values, {size} bytes) but "
                               f"holds {len(t.raw_data)} bytes")
    else:
        held = len(getattr(t, _FIELD[t.data_type]))
        want = (n + 1) // 2 if t.data_type in (2, 3) and held != n else n
        if held != want:
            raise BNProbeError(f"{path}: initializer {t.name!r} has dims {dims} ({n} values) but holds {held}")
    return 8 * n


def _graph_maps(path: Path, graph: Any, known: set[str]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(producer, consumers) of every tensor, refusing a tensor written twice or a cycle (Kahn's algorithm)."""
    if len(graph.node) > MAX_NODES:
        raise BNProbeError(f"{path}: {len(graph.node)} nodes, more than bnprobe reads ({MAX_NODES})")
    producer: dict[str, Any] = {}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for o in node.output:
            if o and (o in producer or o in known):
                raise BNProbeError(f"{path}: tensor {o!r} is written twice (node {node.name!r}): not a valid graph")
            if o:
                producer[o] = node
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    pending = {id(n): sum(1 for i in n.input if i in producer) for n in graph.node}
    ready = [n for n in graph.node if pending[id(n)] == 0]
    done = 0
    while ready:
        node = ready.pop()
        done += 1
        for o in node.output:
            for c in consumers.get(o, []):
                pending[id(c)] -= 1  # c is listed once per input of it that o is
                if pending[id(c)] == 0:
                    ready.append(c)
    if done != len(graph.node):
        raise BNProbeError(f"{path}: the graph has a cycle ({len(graph.node) - done} node(s) on or after it): "
                           "not a valid ONNX graph")
    return producer, consumers


def load_model(path: str | Path) -> Model:
    """The model at ``path``, checked as the module says; its external data is not read here."""
    from bnprobe.guard import BASE_BYTES, format_size, require

    onnx = import_onnx()
    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"ONNX model {str(p)!r} does not exist")
    require(BASE_BYTES + _MODEL_READ_FACTOR * p.stat().st_size, f"reading {p} ({format_size(p.stat().st_size)})")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(p.read_bytes())
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and its C implementation's errors alike
        raise BNProbeError(f"{p}: not a readable ONNX model ({first_line(exc) or type(exc).__name__})") from None
    if not proto.HasField("graph") or not len(proto.graph.node):
        raise BNProbeError(f"{p}: not an ONNX model with a graph (no nodes)")
    inits = {}
    total = 0
    for t in proto.graph.initializer:
        if t.name in inits:
            raise BNProbeError(f"{p}: initializer {t.name!r} is there twice")
        total += _check_initializer(p, t)
        inits[t.name] = t
    for node in proto.graph.node:  # a Constant's tensor is an initializer under the name of its output
        value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
        if node.op_type == "Constant" and value is not None and len(node.output) == 1:
            total += _check_initializer(p, value)
            inits.setdefault(node.output[0], value)
    require(BASE_BYTES + 2 * total, f"the initializers of {p} ({format_size(total)} as float64)")
    known = {t.name for t in proto.graph.initializer} | {i.name for i in proto.graph.input}
    producer, consumers = _graph_maps(p, proto.graph, known)
    return Model(p, proto, inits, producer, consumers)


def _attr(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass(frozen=True)
class LayerParams:
    """A layer's parameters as bnprobe's fold takes them: kind conv2d (weight (Cout, Cin/g, kh, kw)) or linear
    (weight (Cout, Cin)), bias or None, groups, padding, and notes on what the analysis leaves out."""

    op: str
    kind: str
    weight: np.ndarray
    bias: np.ndarray | None
    groups: int = 1
    padding: int = 0
    notes: tuple[str, ...] = ()


def _conv_params(m: Model, node: Any, w: np.ndarray, b: np.ndarray | None) -> LayerParams:
    """Conv / ConvTranspose as a conv2d: 1-D kernels as 1 x k; a transposed conv as the equivalent conv (kernel
    flipped, its in/out axes swapped per group, padding k - 1 - p); strides and dilations are left out."""
    name, g = node.name, int(_attr(node, "group", 1))
    if w.ndim not in (3, 4):
        raise Skipped(f"a {w.ndim - 2}-D {node.op_type}: only 1-D and 2-D convolutions are analysed")
    if w.ndim == 3:
        w = w[:, :, None, :]
    notes = []
    if any(s != 1 for s in _attr(node, "strides", [])) or any(d != 1 for d in _attr(node, "dilations", [])):
        notes.append("analysed at stride 1 and dilation 1 (a fold is per weight: neither changes W' or b')")
    pads = list(_attr(node, "pads", [])) or [0]
    auto = _attr(node, "auto_pad", b"NOTSET")
    pad = pads[0] if len(set(pads)) == 1 and auto in (b"NOTSET", "NOTSET") else 0
    if node.op_type == "ConvTranspose":
        cin, per = w.shape[0], w.shape[1]
        w = w.reshape(g, cin // g, per, *w.shape[2:]).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1]
        w = np.ascontiguousarray(w.reshape(g * per, cin // g, *w.shape[3:]))
        pad = max(min(w.shape[2], w.shape[3]) - 1 - pad, 0)
        notes.append("a ConvTranspose analysed as the equivalent convolution (kernel flipped, axes swapped)")
    kmin = min(w.shape[2], w.shape[3])
    if not 0 <= pad < kmin:
        notes.append(f"padding {pads} analysed as 0")
        pad = 0
    if w.shape[0] % g:
        raise BNProbeError(f"{m.path}: node {name!r}: group {g} does not divide its {w.shape[0]} output channels")
    return LayerParams(node.op_type, "conv2d", w, b, g, pad, tuple(notes))


class Skipped(Exception):
    """A layer bnprobe does not analyse, and why (reported, not refused)."""


def _vector(m: Model, name: str, node: Any, cout: int, what: str) -> np.ndarray | None:
    """A per-output-channel vector from an initializer that broadcasts to (Cout,) (scalar, (Cout,), (1, Cout))."""
    a = m.array(name)
    if a is None:
        raise Skipped(f"its {what} {name!r} is computed, not an initializer")
    if a.size == 1:
        return np.full(cout, float(a.reshape(())))
    if a.size != cout or a.shape[-1] != cout:
        raise BNProbeError(f"{m.path}: node {node.name!r}: {what} has shape {a.shape}, not one per its {cout} outputs")
    return a.reshape(cout)


def layer_params(m: Model, node: Any, add: Any | None = None) -> LayerParams:
    """The parameters of a layer node (and the Add of its bias after a MatMul), or Skipped saying why not."""
    w = m.array(node.input[1]) if len(node.input) > 1 else None
    if w is None:
        raise Skipped("its weight is computed, not an initializer")
    if node.op_type in ("Conv", "ConvTranspose", "FusedConv"):  # FusedConv: onnxruntime's Conv + activation
        cout = w.shape[1] * int(_attr(node, "group", 1)) if node.op_type == "ConvTranspose" else w.shape[0]
        b = _vector(m, node.input[2], node, cout, "bias") if len(node.input) > 2 and node.input[2] else None
        return _conv_params(m, node, w, b)
    if w.ndim != 2:
        raise Skipped(f"its weight has shape {w.shape}, not a matrix")
    if node.op_type in ("Gemm", "FusedGemm"):
        if int(_attr(node, "transA", 0)):
            raise Skipped("transA = 1: the weight is the first operand")
        w = w if int(_attr(node, "transB", 0)) else w.T
        w = w * float(_attr(node, "alpha", 1.0))
        b = _vector(m, node.input[2], node, w.shape[0], "bias") if len(node.input) > 2 and node.input[2] else None
        b = None if b is None else b * float(_attr(node, "beta", 1.0))
        return LayerParams(node.op_type, "linear", w, b)
    w = w.T  # MatMul: x (N, Cin) @ W (Cin, Cout)
    b = None
    if add is not None:
        other = add.input[1] if add.input[0] in node.output else add.input[0]
        b = _vector(m, other, add, w.shape[0], "bias")
    return LayerParams("MatMul+Add" if add is not None else "MatMul", "linear", w, b)


@dataclass(frozen=True)
class Pair:
    """A layer node (and its bias Add), the BatchNormalization after it and the nodes between them."""

    layer: Any
    add: Any | None
    bn: Any
    between: tuple[str, ...]
    nodes_between: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return self.layer.name or self.layer.output[0]


def _only_reader(m: Model, tensor: str, graph_outputs: set[str]) -> Any | None:
    readers = m.consumers.get(tensor, [])
    return readers[0] if len(readers) == 1 and tensor not in graph_outputs else None


def _keeps_channels(m: Model, node: Any) -> bool:
    """Identity; a Reshape to a constant shape that keeps axis 1 and adds or drops only trailing 1s."""
    if node.op_type == "Identity":
        return True
    shape = m.array(node.input[1]) if len(node.input) > 1 else None
    return shape is not None and shape.ndim == 1 and 2 <= shape.size <= 4 and bool(np.all(shape[2:] == 1))


def _walk_back(m: Model, bn: Any, outputs: set[str]) -> tuple[Any, Any, list[Any]] | None:
    """From a BatchNormalization's input back to a layer node: (layer, its Add or None, the nodes between)."""
    tensor, between, add = bn.input[0], [], None
    while True:
        node = m.producer.get(tensor)
        if node is None or _only_reader(m, tensor, outputs) is None:
            return None
        if node.op_type in _PASS_THROUGH and _keeps_channels(m, node) and add is None:
            between.append(node)
            tensor = node.input[0]
            continue
        if node.op_type == "Add" and add is None:
            src = [m.producer.get(i) for i in node.input]
            mm = [s for s in src if s is not None and s.op_type == "MatMul"]
            if len(mm) == 1 and any(i in m.inits for i in node.input):
                add, tensor = node, mm[0].output[0]
                continue
            return None
        if node.op_type in _LAYER_OPS and (node.op_type == "MatMul" or add is None):
            return node, add, between
        return None


def find_pairs(m: Model) -> tuple[list[Pair], list[str]]:
    """Every layer -> BatchNormalization pair of the graph, and a note for each BatchNormalization left out."""
    outputs = {o.name for o in m.proto.graph.output}
    pairs, skipped = [], []
    for bn in m.proto.graph.node:
        if bn.op_type != "BatchNormalization":
            continue
        label = bn.name or bn.output[0]
        if int(_attr(bn, "training_mode", 0)) or int(_attr(bn, "spatial", 1)) != 1:
            skipped.append(f"{label}: training mode or spatial = 0: not an inference BatchNorm to fold")
            continue
        found = _walk_back(m, bn, outputs)
        if found is None:
            skipped.append(f"{label}: no Conv/ConvTranspose/Gemm/MatMul before it whose output only it reads")
            continue
        pairs.append(Pair(found[0], found[1], bn, tuple(n.op_type for n in found[2]), tuple(found[2])))
    return pairs, skipped


def check_between(m: Model, pair: Pair, cout: int) -> None:
    """Skipped unless every Reshape between the layer and its BatchNormalization keeps the ``cout`` channels on
    axis 1 (its shape's axis 1 is ``cout`` or 0, "copy"; -1 only on axis 0)."""
    for node in pair.nodes_between:
        if node.op_type != "Reshape":
            continue
        shape = m.array(node.input[1])
        if shape is None or shape[1] not in (0, cout) or np.any(shape[1:] == -1):
            raise Skipped(f"the Reshape {node.name!r} before its BatchNormalization does not keep the {cout} "
                          "channels on axis 1")


def bn_params(m: Model, pair: Pair, cout: int) -> tuple[np.ndarray, ...] | None:
    """(γ, β, mean, var) of the pair's BatchNormalization as float64, each one per channel."""
    out = []
    for name, what in zip(pair.bn.input[1:5], ("scale", "B", "input_mean", "input_var")):
        out.append(_vector(m, name, pair.bn, cout, what))
    return tuple(out)


def bn_eps(pair: Pair) -> float:
    """The BatchNormalization's ε as ONNX holds it (a float32 attribute), default 1e-5."""
    return float(np.float32(_attr(pair.bn, "epsilon", 1e-5)))

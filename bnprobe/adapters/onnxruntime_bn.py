"""``onnxruntime``: one ONNX ``BatchNormalization`` node run by onnxruntime's CPU execution provider — the
inference kernel a deployed model runs.

The model is built in memory for each format (opset 15, inference: x, scale, B, input_mean, input_var → Y, all in
the input's element type, as an exported fp16 or fp32 model holds them) and run with the graph optimiser off, so
the node runs as a BatchNormalization, not folded into a neighbour.  onnxruntime is inference-only here: its
training mode is not what a deployment runs and it saves no statistics, so the adapter declares the ``infer`` mode
alone: every check judges its inference and names what it left out, and one that needs a training forward or a
backward (gradcheck, a mode asked for) refuses it in one line.  fp16 runs whatever
onnxruntime's CPU provider does with an fp16 node (its own fp16 kernel or float kernels behind inserted casts: the
identify table says which arithmetic comes out).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.adapters.base import BaseAdapter, Capabilities, ForwardOutput, Prepared
from bnprobe.adapters.frameworks import missing
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format

__all__ = ["OnnxRuntimeAdapter", "onnxruntime_unavailable", "OPSET"]

OPSET = 15  # BatchNormalization-15: inference with scale/B and mean/var of their own types


def onnxruntime_unavailable() -> str | None:
    """Why onnxruntime cannot run here (None when it can), without importing it."""
    return missing("onnxruntime", ("onnx", "onnxruntime"), "onnx")


class OnnxRuntimeAdapter(BaseAdapter):
    """``onnxruntime``: a BatchNormalization node on onnxruntime's CPU execution provider (inference)."""

    def __init__(self, opts: str = "") -> None:
        if opts.strip():
            raise BNProbeError(f"adapter onnxruntime takes no options, got {opts!r}")
        why = onnxruntime_unavailable()
        if why:
            raise BNProbeError(f"adapter onnxruntime is unavailable here: {why}")
        import onnx
        import onnxruntime

        self._onnx, self._ort = onnx, onnxruntime
        self.name = "onnxruntime"
        self._sessions: dict[tuple[str, float], Any] = {}

    def capabilities(self) -> Capabilities:
        # the node's inputs share one element type: its parameters are in x's format (params "same")
        return Capabilities(formats=("fp64", "fp32", "fp16"), modes=("infer",), saved="none", deterministic=True)

    def _session(self, fmt: str, eps: float) -> Any:
        key = (fmt, eps)
        if key not in self._sessions:
            from onnx import TensorProto, helper

            elem = {"fp64": TensorProto.DOUBLE, "fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[fmt]
            names = ("x", "scale", "B", "input_mean", "input_var")
            node = helper.make_node("BatchNormalization", list(names), ["Y"], epsilon=eps)
            graph = helper.make_graph([node], "bnprobe_bn", [helper.make_tensor_value_info(n, elem, None)
                                                             for n in names],
                                      [helper.make_tensor_value_info("Y", elem, None)])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
            so = self._ort.SessionOptions()
            so.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            so.log_severity_level = 3
            self._sessions[key] = self._ort.InferenceSession(model.SerializeToString(), so,
                                                              providers=["CPUExecutionProvider"])
        return self._sessions[key]

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        if p.params != p.dtype:
            raise BNProbeError(f"adapter onnxruntime: a BatchNormalization node holds scale, B, mean and var in x's "
                               f"type ({p.dtype}): use {named('params')} same")
        dt = get_format(p.dtype).dtype
        x = np.asarray(p.x, dtype=np.float64)
        if p.lay.layout == "channels_last" and x.ndim > 2:
            x = np.moveaxis(x, -1, 1)  # ONNX takes N, C, ...
        v, c = p.vectors, p.lay.channels
        feed = {"x": np.ascontiguousarray(x.astype(dt)),
                "scale": (np.ones(c) if v["gamma"] is None else v["gamma"]).astype(dt),
                "B": (np.zeros(c) if v["beta"] is None else v["beta"]).astype(dt),
                "input_mean": v["running_mean"].astype(dt), "input_var": v["running_var"].astype(dt)}
        # ε is a float attribute of the node: a double kernel adds double(float(ε)), as a model exported so does
        y = np.asarray(self._session(p.dtype, float(np.float32(eps))).run(None, feed)[0], dtype=np.float64)
        if p.lay.layout == "channels_last" and y.ndim > 2:
            y = np.moveaxis(y, 1, -1)
        return ForwardOutput(y.astype(dt), meta={"onnxruntime": self._ort.__version__, "opset": OPSET})

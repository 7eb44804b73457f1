"""A small ONNX model to try ``bnprobe fold --onnx`` on, and a fused copy of it with a classic folding bug.

    python examples/make_onnx_model.py [FOLDER]          # needs bnprobe[onnx]; writes FOLDER/model.onnx and
                                                         # FOLDER/fused_bias_not_scaled.onnx (default: .)
    bnprobe fold --onnx FOLDER/model.onnx --fuse ort --dtype fp16,bf16
    bnprobe fold --onnx FOLDER/model.onnx --fused FOLDER/fused_bias_not_scaled.onnx

model.onnx: conv1 (3 -> 8, 3x3, biased) -> BatchNorm (ε 1e-3) -> Relu -> dw (depthwise 3x3, no bias) -> BatchNorm
(ε 1e-10, channel 5 near-dead: running variance 1e-10, so A = γ/√(σ² + ε) ~ 7e4 and W·A leaves fp16's range) ->
Relu -> GlobalAveragePool -> Flatten -> fc (Gemm 8 -> 4) -> BatchNorm (ε 1e-5).  Every parameter from seed 0.
fused_bias_not_scaled.onnx: the same network folded in float64 numpy, except conv1's bias: b + B instead of b·A + B.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def parameters() -> dict[str, dict[str, np.ndarray | float | None]]:
    rng = np.random.default_rng(0)
    layers: dict[str, dict] = {
        "conv1": {"w": rng.standard_normal((8, 3, 3, 3)) * 0.3, "b": rng.normal(0, 0.5, 8), "eps": 1e-3},
        "dw": {"w": rng.standard_normal((8, 1, 3, 3)) * 0.6, "b": None, "eps": 1e-10},
        "fc": {"w": rng.standard_normal((4, 8)) * 0.5, "b": rng.normal(0, 0.5, 4), "eps": 1e-5},
    }
    for d in layers.values():
        c = d["w"].shape[0]
        d.update(gamma=rng.uniform(0.5, 1.5, c), beta=rng.normal(0, 0.2, c), mean=rng.normal(0, 0.3, c),
                 var=rng.uniform(0.3, 2.0, c))
    layers["dw"]["var"][5] = 1e-10  # a channel the ReLU before it left (almost) constant
    return {n: {k: np.asarray(v, np.float32).astype(np.float64) if isinstance(v, np.ndarray) else v
                for k, v in d.items()} for n, d in layers.items()}


def fold(d: dict, *, scale_bias: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """W' = W·A per output channel and b' = b·A + B (b + B with scale_bias=False), in float64."""
    a = d["gamma"] / np.sqrt(d["var"] + float(np.float32(d["eps"])))
    shift = d["beta"] - d["mean"] * a
    b = np.zeros_like(a) if d["b"] is None else d["b"]
    return d["w"] * a.reshape((-1,) + (1,) * (d["w"].ndim - 1)), (b * a if scale_bias else b) + shift


def build(params: dict, fused: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> onnx.ModelProto:
    inits: list = []

    def init(name: str, a: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(a, np.float32), name))
        return name

    nodes, x = [], "input"
    for name, extra in (("conv1", {"pads": [1, 1, 1, 1]}), ("dw", {"pads": [1, 1, 1, 1], "group": 8}),
                        ("fc", {"transB": 1})):
        d = params[name]
        op = "Gemm" if name == "fc" else "Conv"
        w, b = fused[name] if fused else (d["w"], d["b"])
        ins = [x, init(f"{name}.weight", w)] + ([init(f"{name}.bias", b)] if b is not None else [])
        if fused:
            nodes.append(helper.make_node(op, ins, [f"{name}.y"], name=name, **extra))
        else:
            nodes.append(helper.make_node(op, ins, [f"{name}.z"], name=name, **extra))
            bn_in = [f"{name}.z", *(init(f"{name}.bn.{k}", d[k]) for k in ("gamma", "beta", "mean", "var"))]
            nodes.append(helper.make_node("BatchNormalization", bn_in, [f"{name}.y"], name=f"{name}.bn",
                                          epsilon=d["eps"]))
        x = f"{name}.y"
        if name != "fc":
            nodes.append(helper.make_node("Relu", [x], [f"{name}.relu"], name=f"{name}.relu"))
            x = f"{name}.relu"
        if name == "dw":
            nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"], name="pool"))
            nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flat"))
            x = "flat"
    graph = helper.make_graph(nodes, "bnprobe-example",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="bnprobe example")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    params = parameters()
    onnx.save(build(params), str(folder / "model.onnx"))
    buggy = {n: fold(d, scale_bias=n != "conv1") for n, d in params.items()}
    onnx.save(build(params, buggy), str(folder / "fused_bias_not_scaled.onnx"))
    print(f"wrote {folder / 'model.onnx'} (conv1, dw, fc, each followed by a BatchNormalization) and "
          f"{folder / 'fused_bias_not_scaled.onnx'} (folded, conv1's bias not scaled by A)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))

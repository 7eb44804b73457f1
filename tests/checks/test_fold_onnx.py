"""fold --onnx (issue 33): ONNX models built here with onnx.helper, every number checked against a float64 fold
written in this file with numpy (and that fold checked against onnxruntime's inference of the unfused model), the
fused models' classic bugs each made here and required to fail with their cause named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from bnprobe.checks.fold.onnx_model import check_onnx  # noqa: E402
from bnprobe.cli import main  # noqa: E402

C = 6  # output channels of every conv (a depthwise conv has as many groups)
# layer name -> (op, the BatchNormalization's ε): biased and unbiased convs, a depthwise conv, a Gemm, a MatMul + Add
LAYERS = {"conv1": ("Conv", 1e-3), "dw": ("Conv", 2e-4), "fc": ("Gemm", 1e-5), "proj": ("MatMul", 1e-4)}


def _bn(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    return {"gamma": rng.uniform(0.5, 1.5, c), "beta": rng.normal(0, 0.2, c), "mean": rng.normal(0, 0.3, c),
            "var": rng.uniform(0.3, 2.0, c)}


def make_params(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Float32 parameters of each layer and its BatchNorm (weights in the fold's layout: (Cout, ...))."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    p = {"conv1": {"w": rng.standard_normal((C, 3, 3, 3)) * 0.3, "b": rng.normal(0, 0.5, C)},
         "dw": {"w": rng.standard_normal((C, 1, 3, 3)) * 0.5, "b": None},
         "fc": {"w": rng.standard_normal((5, C * 4 * 4)) * 0.1, "b": rng.normal(0, 0.5, 5)},
         "proj": {"w": rng.standard_normal((4, 5)) * 0.5, "b": rng.normal(0, 0.5, 4)}}
    for name, d in p.items():
        d.update(_bn(rng, d["w"].shape[0]))
        p[name] = {k: None if v is None else f32(v) for k, v in d.items()}
    return p


def golden(d: dict[str, np.ndarray], eps: float, *, var: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(A, W', b') in float64, written out: A = γ/√(σ²+ε), W' = W·A per output channel, b' = (b - μ)·A + β."""
    eps = float(np.float32(eps))  # an ONNX attribute is a float32
    a = d["gamma"] / np.sqrt((d["var"] if var is None else var) + eps)
    b = np.zeros_like(a) if d["b"] is None else d["b"]
    return a, d["w"] * a.reshape((-1,) + (1,) * (d["w"].ndim - 1)), (b - d["mean"]) * a + d["beta"]


def _init(inits: list, name: str, a: np.ndarray, dtype: type = np.float32) -> str:
    inits.append(numpy_helper.from_array(np.asarray(a, dtype), name))
    return name


def _layer_nodes(name: str, x: str, y: str, w: np.ndarray, b: np.ndarray | None, inits: list,
                 dtype: type) -> list:
    """The layer ``name`` from x to y with weight w (the fold's layout) and bias b, as the model writes it."""
    op = LAYERS[name][0]
    if op == "Conv":
        groups = C if name == "dw" else 1
        ins = [x, _init(inits, f"{name}.w", w, dtype)]
        ins += [_init(inits, f"{name}.b", b, dtype)] if b is not None else []
        return [helper.make_node("Conv", ins, [y], name=name, pads=[1, 1, 1, 1], group=groups)]
    if op == "Gemm":
        ins = [x, _init(inits, f"{name}.w", w, dtype), _init(inits, f"{name}.b", b, dtype)]
        return [helper.make_node("Gemm", ins, [y], name=name, transB=1)]
    mm = helper.make_node("MatMul", [x, _init(inits, f"{name}.w", w.T, dtype)], [f"{name}.mm"], name=name)
    return [mm, helper.make_node("Add", [f"{name}.mm", _init(inits, f"{name}.b", b, dtype)], [y], name=f"{name}.add")]


def write_model(path: Path, params: dict, *, fused: dict | None = None, dtype: type = np.float32) -> Path:
    """conv1 -> BN -> Relu -> depthwise dw -> BN -> MaxPool -> Flatten -> fc (Gemm) -> BN -> proj (MatMul + Add)
    -> BN; with ``fused`` (layer -> (W', b')), those layers fused: no BatchNormalization, W' and b' as given."""
    fused = fused or {}
    inits: list = []
    nodes: list = []
    x = "input"
    for name in LAYERS:
        d, eps = params[name], LAYERS[name][1]
        out = f"{name}.bn"
        if name in fused:
            nodes += _layer_nodes(name, x, out, *fused[name], inits, dtype)
        else:
            nodes += _layer_nodes(name, x, f"{name}.out", d["w"], d["b"], inits, dtype)
            bn_in = [f"{name}.out", *(_init(inits, f"{name}.{k}", d[k], dtype) for k in ("gamma", "beta", "mean",
                                                                                           "var"))]
            nodes.append(helper.make_node("BatchNormalization", bn_in, [out], name=f"{name}_bn", epsilon=eps))
        x = out
        if name == "conv1":
            nodes.append(helper.make_node("Relu", [x], ["relu1"], name="relu1"))
            x = "relu1"
        if name == "dw":
            nodes.append(helper.make_node("MaxPool", [x], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
            nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flat"))
            x = "flat"
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph(nodes, "bn-pairs", [helper.make_tensor_value_info("input", elem, [2, 3, 8, 8])],
                              [helper.make_tensor_value_info(x, elem, [2, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture
def model(tmp_path, params):
    return write_model(tmp_path / "model.onnx", params)


def _fold_all(params: dict) -> dict:
    return {n: golden(params[n], LAYERS[n][1])[1:] for n in LAYERS}


# ---- the analysis ----------------------------------------------------------------------------------------------

def test_every_pair_is_found_and_A_is_the_numpy_fold(model, params):
    rep = check_onnx(model, ["fp32", "fp16"])
    assert [(ly.name, ly.op) for ly in rep.layers] == [("conv1", "Conv"), ("dw", "Conv"), ("fc", "Gemm"),
                                                       ("proj", "MatMul+Add")]
    assert {ly.name: ly.layer.groups for ly in rep.layers} == {"conv1": 1, "dw": C, "fc": 1, "proj": 1}
    for ly in rep.layers:
        a, w2, _ = golden(params[ly.name], LAYERS[ly.name][1])
        assert ly.layer.eps == float(np.float32(LAYERS[ly.name][1]))
        for d in ("fp32", "fp16"):
            ch = rep.analysis[(ly.name, d)].channels
            np.testing.assert_allclose(ch.A, a, rtol=1e-13)
            # W stored in the format first (fp16: within half an ulp, 2^-11), then W·A
            np.testing.assert_allclose(ch.folded_w_absmax, np.abs(w2.reshape(len(a), -1)).max(axis=1),
                                       rtol={"fp32": 2e-7, "fp16": 2.0**-11}[d])
    assert rep.passed and not rep.skipped


def test_the_numpy_fold_agrees_with_onnxruntimes_inference_of_the_unfused_model(tmp_path, params):
    """The oracle of these tests is ONNX's BatchNormalization: the model with every pair replaced by the numpy fold
    computes what onnxruntime computes for the unfused model (float32, to a few units of its rounding)."""
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    outs = []
    for name, fused in (("unfused", None), ("folded", _fold_all(params))):
        path = write_model(tmp_path / f"{name}.onnx", params, fused=fused)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        outs.append(ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0])
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5 * np.abs(outs[0]).max()
    wrong = _fold_all({**params, "proj": {**params["proj"], "b": params["proj"]["b"] * 0}})  # a guard: it can differ
    path = write_model(tmp_path / "wrong.onnx", params, fused=wrong)
    other = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert np.abs(outs[0] - other).max() > 1e-2


def test_a_channel_whose_folded_weights_overflow_fp16_is_found(tmp_path, params):
    p = {**params, "conv1": {k: None if v is None else v.copy() for k, v in params["conv1"].items()}}
    p["conv1"]["var"][[2, 4]] = 1e-9  # near-dead: A = γ/√(1e-9 + ε) ~ γ·31.6 with ε 1e-3
    w2 = golden(p["conv1"], LAYERS["conv1"][1])[1]
    p["conv1"]["w"][4] *= 1e5 / np.abs(w2[4]).max()  # |W·A| up to 1e5, beyond fp16's 65504, in channel 4 only
    w2 = golden(p["conv1"], LAYERS["conv1"][1])[1]
    assert np.abs(p["conv1"]["w"]).max() < 65504 < np.abs(w2[4]).max()
    assert np.abs(np.delete(w2, 4, axis=0)).max() < 65504
    rep = check_onnx(write_model(tmp_path / "m.onnx", p), ["fp16", "bf16"])
    row = next(r for r in rep.summary() if r["layer"] == "conv1" and r["check"] == "fold in fp16")
    assert row["overflow"] == "4" and row["near_dead"] == "2, 4" and row["verdict"] == "FAIL"
    assert "4" in row["failed"].split(", ")
    bf = next(r for r in rep.summary() if r["layer"] == "conv1" and r["check"] == "fold in bf16")
    assert bf["overflow"] == "" and bf["near_dead"] == "2, 4"  # bf16 has fp32's range


def _single(path: Path, nodes: list, inits: list, x_shape: list, y: str, y_shape: list) -> Path:
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("group", [1, 2])
def test_a_conv_transpose_is_analysed_as_the_convolution_onnxruntime_computes(tmp_path, group):
    """The ConvTranspose, as the fold analyses it (an equivalent convolution), against onnxruntime's own
    ConvTranspose on the same input; its A against the numpy fold."""
    from bnprobe.checks.fold.layer import ref_forward

    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6 // group, 3, 3)).astype(np.float32)  # (Cin, Cout/group, kh, kw): Cout 6
    d = {k: v.astype(np.float32) for k, v in _bn(rng, 6).items()}
    inits: list = []
    _init(inits, "w", w)
    conv = helper.make_node("ConvTranspose", ["x", "w"], ["c"], name="up", pads=[1, 1, 1, 1], group=group)
    bn = helper.make_node("BatchNormalization", ["c", *(_init(inits, k, d[k]) for k in ("gamma", "beta", "mean",
                                                                                        "var"))], ["y"], name="bn")
    rep = check_onnx(_single(tmp_path / "up.onnx", [conv, bn], inits, [1, 4, 5, 5], "y", [1, 6, 5, 5]), ["fp32"])
    (ly,) = rep.layers
    assert (ly.op, ly.layer.groups) == ("ConvTranspose", group)
    np.testing.assert_allclose(rep.analysis[("up", "fp32")].channels.A, d["gamma"] / np.sqrt(d["var"] + 1e-5),
                               rtol=1e-6)
    only = _single(tmp_path / "only.onnx", [conv], inits[:1], [1, 4, 5, 5], "c", [1, 6, 5, 5])
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    expected = ort.InferenceSession(str(only), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    actual = ref_forward("conv2d", x.astype(np.float64), ly.layer.weight, None, group, ly.layer.padding)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,found", [([0, 5, 1, 1], True), ([-1, 5, 1, 1], True), ([1, 10, 1, 1], False)])
def test_a_reshape_between_gemm_and_batchnorm_is_followed_only_when_it_keeps_the_channels(tmp_path, shape, found):
    rng = np.random.default_rng(4)
    inits: list = []
    d = _bn(rng, 5)
    gemm = helper.make_node("Gemm", ["x", _init(inits, "w", rng.standard_normal((5, 8))),
                                     _init(inits, "b", rng.standard_normal(5))], ["g"], name="fc", transB=1)
    reshape = helper.make_node("Reshape", ["g", _init(inits, "shape", shape, np.int64)], ["r"], name="to4d")
    bn = helper.make_node("BatchNormalization", ["r", *(_init(inits, k, d[k]) for k in ("gamma", "beta", "mean",
                                                                                        "var"))], ["y"], name="bn")
    out_shape = [2, 5, 1, 1] if found else [1, 10, 1, 1]
    if not found:  # 10 channels: the BatchNorm's own parameters must have as many
        inits = inits[:3] + [numpy_helper.from_array(np.ones(10, np.float32), k) for k in ("gamma", "beta", "mean",
                                                                                           "var")]
    rep = check_onnx(_single(tmp_path / "m.onnx", [gemm, reshape, bn], inits, [2, 8], "y", out_shape), ["fp32"])
    if found:
        assert [(ly.name, ly.between) for ly in rep.layers] == [("fc", ("Reshape",))] and rep.passed
    else:
        assert not rep.layers and "does not keep the 5 channels" in rep.skipped[0]


# ---- fused models --------------------------------------------------------------------------------------------

def test_onnxruntimes_fusion_passes_and_matches_the_numpy_fold(model, params):
    rep = check_onnx(model, ["fp32"], fuse="ort")
    assert rep.passed, rep.summary()
    # onnxruntime leaves Gemm + BN, and makes MatMul + Add a Gemm before it looks for MatMul + BN
    assert all(isinstance(rep.fused[n], str) and "not fused" in rep.fused[n] for n in ("fc", "proj"))
    assert rep.fused["conv1"].folded["file"].endswith("#conv1")  # Conv + BN + Relu: its FusedConv
    for name in ("conv1", "dw"):
        ch = rep.fused[name].channels
        assert (ch.verdict == "PASS").all()
        _, w2, b2 = golden(params[name], LAYERS[name][1])
        # onnxruntime folds in float32: W' within a few float32 ulps of the float64 fold
        assert (ch.w_err <= 4 * 2.0**-24 * np.abs(w2.reshape(len(b2), -1)).max(axis=1)).all()
        assert (ch.w_err > 0).any() or (ch.b_err > 0).any()  # it really is onnxruntime's float32 arithmetic
    assert set(rep.fp16) == {"conv1", "dw"} and all(r.passed for r in rep.fp16.values())


def _bug(params: dict, name: str, kind: str) -> tuple[tuple[np.ndarray, np.ndarray], type]:
    """(W', b') of layer ``name`` folded with the classic bug ``kind``, and the storage dtype."""
    d, eps = params[name], LAYERS[name][1]
    a, w2, b2 = golden(d, eps)
    if kind == "bias-not-scaled":
        return (w2, d["b"] + d["beta"] - d["mean"] * a), np.float32
    if kind == "eps-1e-5":
        return golden(d, 1e-5)[1:], np.float32
    if kind == "unbiased-variance":
        return golden(d, eps, var=d["var"] * 64 / 63)[1:], np.float32
    if kind == "permuted":
        perm = np.arange(len(a))
        perm[[0, 2]] = perm[[2, 0]]
        return (w2[perm], b2[perm]), np.float32
    # the whole fold in fp16 arithmetic, every operation rounded to fp16 (numpy's float16 does exactly that)
    h = {k: None if v is None else v.astype(np.float16) for k, v in d.items()}
    a16 = h["gamma"] / np.sqrt(h["var"] + np.float16(eps))
    w16 = h["w"] * a16.reshape((-1,) + (1,) * (d["w"].ndim - 1))
    b16 = (h["b"] * a16 if h["b"] is not None else np.float16(0)) + (h["beta"] - h["mean"] * a16)
    return (w16.astype(np.float64), b16.astype(np.float64)), np.float16


BUGS = {"bias-not-scaled": ("conv1", "bias not scaled by A"),
        "eps-1e-5": ("conv1", "ε 1e-05 (PyTorch's default) instead of the layer's 0.001"),
        "unbiased-variance": ("dw", "running variance x R/(R-1) (made unbiased; R = 64"),
        "permuted": ("fc", "output channels permuted (0 holds 2, 2 holds 0)"),
        "fp16-arithmetic": ("conv1", "fp16")}


@pytest.mark.parametrize("kind", list(BUGS))
def test_each_classic_folding_bug_fails_and_is_named(tmp_path, params, kind):
    name, cause = BUGS[kind]
    folds = _fold_all(params)
    folds[name], dtype = _bug(params, name, kind)
    if dtype == np.float16:  # an fp16 deployment: every layer stored in fp16, only `name` folded wrongly
        folds = {n: tuple(v.astype(np.float16).astype(np.float64) for v in f) for n, f in folds.items()}
        folds[name] = _bug(params, name, kind)[0]
    fused = write_model(tmp_path / "fused.onnx", params, fused=folds, dtype=dtype)
    rep = check_onnx(write_model(tmp_path / "model.onnx", params), ["fp32"], fused=fused)
    bad = {n for n, r in rep.fused.items() if not r.passed}
    assert bad == {name}, rep.summary()
    causes = rep.fused[name].folded["likely_causes"]
    assert any(cause in c for c in causes), causes
    assert rep.fused[name].folded["weight_format"] == ("fp16" if dtype == np.float16 else "fp32")


def test_a_correct_fp16_deployment_passes(tmp_path, params):
    """The guard of the fp16-arithmetic case: the same model with the fold rounded once to fp16 passes."""
    folds = {n: tuple(v.astype(np.float16).astype(np.float64) for v in f) for n, f in _fold_all(params).items()}
    fused = write_model(tmp_path / "fused.onnx", params, fused=folds, dtype=np.float16)
    rep = check_onnx(write_model(tmp_path / "model.onnx", params), ["fp16"], fused=fused)
    assert rep.passed, rep.summary()


def test_the_fp16_view_names_the_channels_that_overflow(tmp_path, params):
    p = {**params, "conv1": {**params["conv1"], "w": params["conv1"]["w"].copy()}}
    p["conv1"]["w"][3] *= 1e5 / np.abs(golden(p["conv1"], LAYERS["conv1"][1])[1][3]).max()  # W'[3] beyond 65504
    model = write_model(tmp_path / "m.onnx", p)
    rep = check_onnx(model, ["fp32"], fuse="ort")
    assert rep.fused["conv1"].passed
    view = rep.fp16["conv1"].channels.set_index("channel")
    _, w2, _ = golden(p["conv1"], LAYERS["conv1"][1])
    assert view.loc[3, "verdict"] == "FAIL" and view.loc[3, "w_overflow"] == int((np.abs(w2[3]) > 65520).sum())
    assert (view.drop(index=3).verdict == "PASS").all() and (view.drop(index=3).w_overflow == 0).all()
    assert any("fp16 channel 3:" in n for n in rep.fp16["conv1"].notes)


# ---- the command ---------------------------------------------------------------------------------------------

def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_every_report_file(tmp_path, capsys, model):
    code, out, err = run(capsys, "fold", "--onnx", model, "--fuse", "ort", "--dtype", "fp16,bf16", "--out",
                         tmp_path / "r")
    assert code == 0 and err == "", err
    assert "4 layer(s) + BatchNorm in fp16, bf16" in out and "all pass" in out
    names = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert names == ["fold-onnx-model.csv", "fold-onnx-model.html", "fold-onnx-model.json", "fold-onnx-model.md"]
    doc = json.loads((tmp_path / "r" / "fold-onnx-model.json").read_text())
    assert doc["passed"] and [ly["name"] for ly in doc["layers"]] == list(LAYERS)
    csv = (tmp_path / "r" / "fold-onnx-model.csv").read_text().splitlines()
    assert csv[0].startswith("layer,check,channel") and len(csv) == 1 + 2 * 21 + 2 * (C + C)
    code, _, err = run(capsys, "fold", "--onnx", model, "--out", tmp_path / "r")
    assert code == 2 and len(err.splitlines()) == 1 and "--force" in err


def test_cli_names_the_bug_and_exits_1(tmp_path, capsys, params):
    folds = _fold_all(params)
    folds["conv1"] = _bug(params, "conv1", "bias-not-scaled")[0]
    fused = write_model(tmp_path / "fused.onnx", params, fused=folds)
    code, out, err = run(capsys, "fold", "--onnx", write_model(tmp_path / "m.onnx", params), "--fused", fused,
                         "--json")
    assert code == 1 and err == ""
    doc = json.loads(out)
    assert not doc["passed"] and doc["fused"]["conv1"]["folded"]["likely_causes"][0].startswith("bias not scaled")
    code, out, _ = run(capsys, "fold", "--onnx", tmp_path / "m.onnx", "--fused", fused)
    assert code == 1 and "likely cause: bias not scaled by A" in out


@pytest.mark.parametrize("argv,match", [
    (("--fused", "{m}"), "give that model with --onnx"),
    (("--fuse", "ort"), "give that model with --onnx"),
    (("--onnx", "{m}", "--weights", "{m}"), "drop --weights"),
    (("--onnx", "{m}", "--eps", "1e-3"), "drop --eps"),
    (("--onnx", "{m}", "--fuse", "ort", "--fused", "{m}"), "give one"),
    (("--onnx", "{m}", "--fuse", "tensorrt"), "--fuse 'tensorrt': valid: ort"),
    (("--onnx", "{m}", "--dtype", "fp16,fp16"), "each format once"),
])
def test_options_that_do_not_go_together_are_one_line_errors(tmp_path, capsys, model, argv, match):
    code, out, err = run(capsys, "fold", *(a.format(m=model) for a in argv))
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and match in err, err


def test_a_missing_extra_names_the_install_command(capsys, model, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    code, _, err = run(capsys, "fold", "--onnx", model)
    assert code == 2 and err.strip().endswith('pip install "bnprobe[onnx]"') and len(err.splitlines()) == 1


# ---- hostile models ------------------------------------------------------------------------------------------

def _proto(model: Path):
    return onnx.load(str(model))


def _save(proto, path: Path) -> Path:
    path.write_bytes(proto.SerializeToString())
    return path


def _truncated(model: Path, tmp: Path) -> Path:
    data = model.read_bytes()
    return _save_bytes(tmp / "cut.onnx", data[: len(data) // 2 + 7])


def _save_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _external_escape(model: Path, tmp: Path) -> Path:
    (tmp / "secret.bin").write_bytes(b"\0" * 4096)
    m = _proto(model)
    t = next(t for t in m.graph.initializer if t.name == "conv1.w")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../secret.bin")
    (tmp / "sub").mkdir()
    return _save(m, tmp / "sub" / "escape.onnx")


def _absurd_dims(model: Path, tmp: Path) -> Path:
    m = _proto(model)
    t = next(t for t in m.graph.initializer if t.name == "conv1.w")
    del t.dims[:]
    t.dims.extend([100000, 100000, 3, 3])  # 9e10 values, 360 GB: the few bytes it holds say otherwise
    return _save(m, tmp / "absurd.onnx")


def _cycle(model: Path, tmp: Path) -> Path:
    m = _proto(model)
    relu = next(n for n in m.graph.node if n.name == "relu1")
    conv = next(n for n in m.graph.node if n.name == "conv1")
    conv.input[0] = relu.output[0]  # conv1 reads what its own BatchNorm's Relu writes
    return _save(m, tmp / "cycle.onnx")


def _written_twice(model: Path, tmp: Path) -> Path:
    m = _proto(model)
    m.graph.node[1].output[0] = m.graph.node[0].output[0]
    return _save(m, tmp / "twice.onnx")


HOSTILE = {"truncated": (_truncated, "not a readable ONNX model"),
           "not-onnx": (lambda m, t: _save_bytes(t / "x.onnx", b"\x93NUMPY not a model" * 40), "not a"),
           "empty": (lambda m, t: _save_bytes(t / "e.onnx", b""), "no nodes"),
           "external-data-escapes": (_external_escape, "outside the model's folder"),
           "absurd-dims": (_absurd_dims, "but holds"),
           "cycle": (_cycle, "cycle"),
           "tensor-written-twice": (_written_twice, "written twice")}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("fuse", [(), ("--fuse", "ort")], ids=["analysis", "fuse-ort"])
def test_hostile_models_are_refused_in_one_line(tmp_path, capsys, model, case, fuse):
    make, match = HOSTILE[case]
    bad = make(model, tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = run(capsys, "fold", "--onnx", bad, *fuse, "--out", tmp_path / "report")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and match in err, err
    assert err.startswith("bnprobe: error: ")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, not even --out


def test_a_hostile_fused_model_is_refused_too(tmp_path, capsys, model):
    code, _, err = run(capsys, "fold", "--onnx", model, "--fused", _absurd_dims(model, tmp_path))
    assert code == 2 and len(err.splitlines()) == 1 and "absurd.onnx" in err


def test_the_readme_example_model(tmp_path, capsys):
    """examples/make_onnx_model.py, as the README runs it: onnxruntime's fusion passes; the near-dead channel 5 of
    dw overflows fp16 (folded in fp16 and in the fp16 view), not bf16; the buggy fused copy fails conv1 only, named."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_onnx_model", Path(__file__).parents[2] / "examples"
                                                  / "make_onnx_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(tmp_path)
    capsys.readouterr()
    code, out, _ = run(capsys, "fold", "--onnx", tmp_path / "model.onnx", "--fuse", "ort", "--dtype", "fp16,bf16",
                       "--json")
    doc = json.loads(out)
    failed = {(r["layer"], r["check"]): r["failed"] for r in doc["summary"] if r["verdict"] == "FAIL"}
    assert code == 1 and failed == {("dw", "fold in fp16"): "5", ("dw", "fused in fp16 (fp16)"): "5"}
    a = example.fold(example.parameters()["dw"])[0]
    assert np.abs(a[5]).max() > 65504 > np.abs(np.delete(a, 5, axis=0)).max()  # the example's premise
    code, out, _ = run(capsys, "fold", "--onnx", tmp_path / "model.onnx", "--fused",
                       tmp_path / "fused_bias_not_scaled.onnx", "--dtype", "bf16", "--json")
    doc = json.loads(out)
    assert code == 1 and {n for n, r in doc["fused"].items() if not r["passed"]} == {"conv1"}
    assert doc["fused"]["conv1"]["folded"]["likely_causes"] == ["bias not scaled by A: b' = b + B instead of b·A + B"]


def _torch_export(path: Path, module, x, *, fold: bool) -> Path:
    import warnings

    import torch

    with warnings.catch_warnings():  # torch 2.9+ says the TorchScript exporter (the one that runs offline) is legacy
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx\.")  # its own internals
        torch.onnx.export(module, (x,), str(path), dynamo=False, do_constant_folding=fold,
                          training=torch.onnx.TrainingMode.EVAL)
    return path


def test_a_torch_export_and_torchs_own_fold(tmp_path):
    """torch.onnx.export's model (parameters behind Identity nodes) is read pair by pair, A against torch's own
    BatchNorm parameters; the export with constant folding (torch folds Conv + BN itself) passes as --fused."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4, eps=1e-3),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 5), torch.nn.BatchNorm1d(5))
    with torch.no_grad():
        for bn in (net[1], net[5]):
            for t, lo, hi in ((bn.weight, 0.5, 1.5), (bn.bias, -0.2, 0.2), (bn.running_mean, -0.3, 0.3),
                              (bn.running_var, 0.3, 2.0)):
                t.uniform_(lo, hi)
    net.eval()
    x = torch.randn(2, 3, 4, 4)
    plain = _torch_export(tmp_path / "plain.onnx", net, x, fold=False)
    folded = _torch_export(tmp_path / "folded.onnx", net, x, fold=True)
    rep = check_onnx(plain, ["fp32"], fused=folded)
    assert [(ly.name, ly.op) for ly in rep.layers] == [("/0/Conv", "Conv"), ("/4/Gemm", "Gemm")]
    for ly, bn in zip(rep.layers, (net[1], net[5])):
        a = (bn.weight.double() / torch.sqrt(bn.running_var.double() + float(np.float32(bn.eps)))).detach().numpy()
        np.testing.assert_allclose(rep.analysis[(ly.name, "fp32")].channels.A, a, rtol=1e-12)
    assert rep.fused["/0/Conv"].passed, rep.summary()  # torch folded Conv + BN in fp32 correctly
    assert rep.passed


def test_a_model_too_large_for_the_memory_limit_is_refused_before_it_is_parsed(tmp_path, capsys, params, monkeypatch):
    monkeypatch.setattr("bnprobe.guard._override", None)  # --max-memory sets it for the process: restored after
    p = {**params, "fc": {**params["fc"], "w": np.ones((5, 60000))}}  # 300,000 float32 values: a 1.2 MB file
    model = write_model(tmp_path / "big.onnx", p)
    code, _, err = run(capsys, "--max-memory", "257M", "fold", "--onnx", model)
    assert code == 2 and len(err.splitlines()) == 1 and "reading" in err and "needs about" in err, err
    code, out, _ = run(capsys, "--max-memory", "300M", "fold", "--onnx", write_model(tmp_path / "m.onnx", params))
    assert code == 0, out  # the guard: the small model fits the same kind of limit


def test_onnxruntimes_layout_changes_are_not_compared_and_say_so(model):
    """ort-all blocks conv1's channels (NCHWc: 6 padded to 16): not a fold to judge, listed as not checked rather
    than passed or refused; the layers it left in place are still judged."""
    rep = check_onnx(model, ["fp32"], fuse="ort-all")
    assert rep.fused["conv1"].startswith("not comparable") and "(16, 3, 3, 3)" in rep.fused["conv1"]
    row = next(r for r in rep.summary() if r["layer"] == "conv1" and r["check"] == "fused")
    assert row["verdict"] == "not checked"
    assert rep.fused["dw"].passed and rep.passed
    assert not any(n.startswith("no fused layer") for n in rep.notes)  # one was compared

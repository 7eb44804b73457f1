"""bnprobe.capture: every BatchNorm call of a live model recorded as bnprobe dumps.

The oracle is torch itself, run independently here: each recorded call is replayed through
``aten.native_batch_norm`` / ``native_batch_norm_backward`` on its recorded inputs and must give the
recorded outputs bit for bit; and the recorded inputs, outputs and gradients are compared with what
this test's own hooks (tensor hooks on x and y, module.weight.grad, the buffers) saw in the model.
"""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from bnprobe import capture
from bnprobe.checks.plot_stats.stats import load_dump_series
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings import CALLS_NAME, load_dump, read_calls

torch = pytest.importorskip("torch")
nn = torch.nn

aten = torch.ops.aten
TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                  "channels_last_3d": torch.channels_last_3d}
# (x dtype, BatchNorm parameter dtype, memory format): plain models, model.half(), model.bfloat16(), a
# half model whose BatchNorms stay float32 (mixed precision), and a channels-last float32 model
CASES = {"fp32": ("fp32", "fp32", "contiguous"), "fp16": ("fp16", "fp16", "contiguous"),
         "bf16": ("bf16", "bf16", "contiguous"), "fp64": ("fp64", "fp64", "contiguous"),
         "fp16-fp32params": ("fp16", "fp32", "contiguous"), "fp32-channels_last": ("fp32", "fp32", "channels_last")}


class Net(nn.Module):
    """Conv2d → BN2d → ReLU → Conv2d → BN2d → pool → Linear → BN1d, plus a Conv3d → BN3d branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 5)
        self.bn3 = nn.BatchNorm1d(5)
        self.conv3d = nn.Conv3d(3, 2, (2, 3, 3))
        self.bn3d = nn.BatchNorm3d(2)
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h)).mean((2, 3))
        out = self.bn3(self.fc(h))
        v = self.bn3d(self.conv3d(x.unsqueeze(2).expand(-1, -1, 3, -1, -1)))
        return out + self.head(v.mean((2, 3, 4)))


BN_ORDER = ["bn1", "bn2", "bn3", "bn3d"]


def make_net(case: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    dtype, params, memory = CASES[case]
    torch.manual_seed(seed)
    model = Net().to(TORCH_DTYPES[dtype])
    with torch.no_grad():  # parameters and statistics away from the defaults, so every tensor matters
        for name in BN_ORDER:
            bn = getattr(model, name)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.8, 1.2)
            bn.to(TORCH_DTYPES[params])
    x = (torch.randn(6, 3, 8, 8) * 2 + 1).to(TORCH_DTYPES[dtype])
    if memory == "channels_last":
        for name in ("conv1", "conv2"):
            getattr(model, name).to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x


# ---- this test's own view of the model, and the replay ------------------------------------------------

class Watch:
    """Independent hooks: per call (in forward order) x, y and, after a backward, dx (x's gradient: each
    BatchNorm's input feeds only that BatchNorm) and dy (y's gradient)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[dict] = []
        self.handles = []
        for path, m in model.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                self.handles.append(m.register_forward_pre_hook(self._pre(path)))
                self.handles.append(m.register_forward_hook(self._post()))

    def _pre(self, path):
        def hook(m, args):
            x = args[0]
            entry = {"module": path, "x": x.detach().clone()}
            if x.requires_grad:
                x.register_hook(lambda g: entry.__setitem__("dx", g.detach().clone()))
            self.calls.append(entry)
        return hook

    def _post(self):
        def hook(m, args, y):
            entry = self.calls[-1]
            entry["y"] = y.detach().clone()
            if y.requires_grad:
                y.register_hook(lambda g: entry.__setitem__("dy", g.detach().clone()))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def T(a: np.ndarray, fmt: str) -> torch.Tensor:
    """A recorded float64 array back in its format (exact: the values belong to it)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(TORCH_DTYPES[fmt])


def assert_bits(actual: torch.Tensor, expected: np.ndarray, fmt: str, what: str) -> None:
    dt = TORCH_DTYPES[fmt]
    assert actual.dtype == dt, f"{what}: dtype {actual.dtype}, recorded as {fmt}"
    a, e = actual.detach().contiguous(), T(expected, fmt)
    assert tuple(a.shape) == tuple(e.shape), f"{what}: shape {tuple(a.shape)} vs recorded {tuple(e.shape)}"
    differ = a.view(INT_VIEW[dt]) != e.view(INT_VIEW[dt])
    assert not differ.any(), (f"{what}: {int(differ.sum())} / {differ.numel()} elements differ in their bits, "
                              f"first at index {np.unravel_index(int(differ.flatten().nonzero()[0]), a.shape)}")


def replay(rec, *, memory_format: str | None = None) -> dict[str, torch.Tensor]:
    """Run torch's kernels on a recording's inputs; assert every recorded output is reproduced."""
    meta, f = rec.meta, rec.formats
    training = "train" in rec.tensors
    mode = "train" if training else "infer"
    ins, outs = rec.tensors[mode]["inputs"], rec.tensors[mode]["outputs"]
    mf = MEMORY_FORMATS[memory_format or meta["memory_format"]]
    x = T(ins["x"], f[f"{mode}.inputs.x"]).contiguous(memory_format=mf)
    w = T(ins["gamma"], f[f"{mode}.inputs.gamma"]) if meta["affine"] else None
    b = T(ins["beta"], f[f"{mode}.inputs.beta"]) if meta["affine"] else None
    rm = T(ins["running_mean"], f[f"{mode}.inputs.running_mean"]) if "running_mean" in ins else None
    rv = T(ins["running_var"], f[f"{mode}.inputs.running_var"]) if "running_var" in ins else None
    got = {}
    y, sm, si = aten.native_batch_norm(x, w, b, rm, rv, training, rec.momentum, rec.eps)
    got["y"] = y
    assert_bits(y, outs["y"], f[f"{mode}.outputs.y"], f"{meta['call']} y")
    if training and "saved_mean" in outs:
        assert_bits(sm, outs["saved_mean"], f["train.outputs.saved_mean"], f"{meta['call']} saved mean")
        assert_bits(si, outs["saved_value"], f["train.outputs.saved_value"], f"{meta['call']} saved invstd")
        got["saved_mean"], got["saved_value"] = sm, si
    if training and rm is not None:
        assert_bits(rm, outs["running_mean_out"], f["train.outputs.running_mean_out"], f"{meta['call']} rm after")
        assert_bits(rv, outs["running_var_out"], f["train.outputs.running_var_out"], f"{meta['call']} rv after")
    if "backward" in rec.tensors:
        bi, bo = rec.tensors["backward"]["inputs"], rec.tensors["backward"]["outputs"]
        dy = T(bi["dy"], f["backward.inputs.dy"]).contiguous(
            memory_format=MEMORY_FORMATS[memory_format or meta["dy_memory_format"]])
        saved = (T(bi["saved_mean"], f["backward.inputs.saved_mean"]),
                 T(bi["saved_value"], f["backward.inputs.saved_value"]))
        args = (None, None, *saved) if training else (*saved, None, None)
        mask = [name in bo for name in ("dx", "dgamma", "dbeta")]
        grads = aten.native_batch_norm_backward(dy, x, w, *args, training, rec.eps, mask)
        for name, g in zip(("dx", "dgamma", "dbeta"), grads):
            if name in bo:
                assert_bits(g, bo[name], f[f"backward.outputs.{name}"], f"{meta['call']} {name}")
                got[name] = g
    return got


def load_calls(out) -> list:
    index = read_calls(out)
    return [(c, load_dump(out / c["dir"])) for c in index["calls"]]


# ---- the CNN in each format ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_train_step_and_eval_reproduce_torch_bit_for_bit(tmp_path, case):
    dtype, params, memory = CASES[case]
    model, x = make_net(case)
    watch = Watch(model)
    out = tmp_path / "dump"
    with capture(model, out) as cap:
        model.train()
        model(x).float().square().mean().backward()
        model.eval()
        model(x)
    watch.close()
    index = json.loads((out / CALLS_NAME).read_text())
    assert index["format"] == "bnprobe-calls" and index["source"] == "capture" and index["torch"] == torch.__version__
    names = [f"{m}#{i}" for i in (0, 1) for m in BN_ORDER]
    assert [c["name"] for c in index["calls"]] == names == cap.calls
    assert [c["order"] for c in index["calls"]] == list(range(8))
    assert [c["training"] for c in index["calls"]] == [True] * 4 + [False] * 4
    assert [c["backward"] for c in index["calls"]] == [True] * 4 + [False] * 4
    assert index["calls"][3]["type"] == "BatchNorm3d" and index["calls"][2]["type"] == "BatchNorm1d"
    assert index["calls"][0]["dir"] == "0000-bn1-0" and index["skipped"] == {}
    for (entry, rec), seen in zip(load_calls(out), watch.calls):
        train = entry["training"]
        mode = "train" if train else "infer"
        bn = getattr(model, entry["module"])
        assert rec.adapter == f"capture:{entry['name']}" and rec.layout == "channels_first"
        assert (rec.dtype, rec.params, rec.eps) == (dtype, params, bn.eps)
        assert rec.modes == (("train", "backward") if train else ("infer",))
        assert rec.saved_kind == ("invstd" if train else None) and rec.momentum == 0.1
        assert rec.meta["module"] == entry["module"] and rec.meta["index"] == entry["index"]
        assert rec.meta["training"] is train and rec.meta["affine"] and rec.meta["torch"] == torch.__version__
        assert rec.meta["momentum_none"] is False and rec.meta["track_running_stats"] is True
        if memory == "channels_last" and entry["module"] in ("bn1", "bn2"):
            assert rec.meta["memory_format"] == "channels_last"
        # the saved statistics are the kernel's own, in the parameters' dtype on CPU (fp16 for model.half())
        if train:
            assert rec.formats["train.outputs.saved_mean"] == rec.formats["train.outputs.saved_value"] == params
        replay(rec)
        # and what the model really saw
        assert_bits(seen["x"], rec.tensors[mode]["inputs"]["x"], dtype, f"{entry['name']} x as the model ran it")
        assert_bits(seen["y"], rec.tensors[mode]["outputs"]["y"], dtype, f"{entry['name']} y as the model ran it")
        if train:
            bwd = rec.tensors["backward"]
            assert_bits(seen["dy"], bwd["inputs"]["dy"], dtype, f"{entry['name']} dy")
            assert_bits(seen["dx"], bwd["outputs"]["dx"], dtype, f"{entry['name']} dx")
            assert_bits(bn.weight.grad, bwd["outputs"]["dgamma"], params, f"{entry['name']} dgamma")
            assert_bits(bn.bias.grad, bwd["outputs"]["dbeta"], params, f"{entry['name']} dbeta")
            assert_bits(bn.running_mean, rec.tensors["train"]["outputs"]["running_mean_out"], params, "rm")
            assert_bits(bn.running_var, rec.tensors["train"]["outputs"]["running_var_out"], params, "rv")
        else:
            assert_bits(bn.running_mean, rec.tensors["infer"]["inputs"]["running_mean"], params, "rm used")


def test_channels_last_replay_needs_its_memory_format(tmp_path):
    """Guard: the channels-last case distinguishes layouts (torch's CPU kernel rounds differently), so the
    recorded memory format is what makes the replay above exact."""
    model, x = make_net("fp32-channels_last")
    with capture(model, tmp_path / "d"):
        model(x).square().mean().backward()
    rec = load_calls(tmp_path / "d")[0][1]
    assert rec.meta["memory_format"] == "channels_last"
    with pytest.raises(AssertionError, match="differ in their bits"):
        replay(rec, memory_format="contiguous")


def test_inference_backward_records_the_running_statistics_as_var(tmp_path):
    model, x = make_net("fp32")
    model.eval()
    x.requires_grad_(True)
    with capture(model, tmp_path / "d"):
        model(x).square().mean().backward()
    for entry, rec in load_calls(tmp_path / "d"):
        assert not entry["training"] and entry["backward"]
        assert rec.modes == ("infer", "backward") and rec.saved_kind == "var"
        assert rec.meta["saved_kind"] == "var" and rec.meta["training"] is False
        ins, bwd = rec.tensors["infer"]["inputs"], rec.tensors["backward"]["inputs"]
        assert np.array_equal(bwd["saved_mean"], ins["running_mean"])
        assert np.array_equal(bwd["saved_value"], ins["running_var"])
        replay(rec)


# ---- module kinds and options -------------------------------------------------------------------------

def _one_bn(bn: nn.Module, channels: int = 3, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(channels, channels, 1), bn).to(dtype)


def _x(dtype=torch.float32, channels: int = 3) -> torch.Tensor:
    torch.manual_seed(2)
    return (torch.randn(5, channels, 4, 4) * 3 + 2).to(dtype)


def test_sync_batchnorm_single_process(tmp_path):
    model = _one_bn(nn.SyncBatchNorm(3))
    with capture(model, tmp_path / "d"):
        model(_x()).square().mean().backward()
    [(entry, rec)] = load_calls(tmp_path / "d")
    assert entry["type"] == "SyncBatchNorm" and entry["name"] == "1#0" and entry["backward"]
    assert rec.meta["grad_fn"] == "NativeBatchNormBackward0"
    replay(rec)


def test_lazy_batchnorm_is_captured_from_its_first_call(tmp_path):
    model = _one_bn(nn.LazyBatchNorm2d())
    with capture(model, tmp_path / "d"):
        model(_x()).square().mean().backward()
    [(entry, rec)] = load_calls(tmp_path / "d")
    assert entry["type"] == "BatchNorm2d" and rec.tensors["train"]["inputs"]["gamma"].shape == (3,)
    replay(rec)


def test_momentum_none_records_the_cumulative_factor(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3, momentum=None))
    with capture(model, tmp_path / "d"):
        for step in range(3):
            model(_x() + step).square().mean().backward()
    recs = [rec for _, rec in load_calls(tmp_path / "d")]
    assert [r.momentum for r in recs] == [1.0, 0.5, 1.0 / 3.0]
    assert all(r.meta["momentum_none"] for r in recs)
    for r in recs:
        replay(r)
    # the chain: each call starts from the running statistics the previous one left
    for a, b in itertools.pairwise(recs):
        assert np.array_equal(a.tensors["train"]["outputs"]["running_mean_out"],
                              b.tensors["train"]["inputs"]["running_mean"])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_affine_false(tmp_path, dtype):
    model = _one_bn(nn.BatchNorm2d(3, affine=False), dtype=TORCH_DTYPES[dtype])
    with capture(model, tmp_path / "d"):
        model(_x(TORCH_DTYPES[dtype])).float().square().mean().backward()
    [(_, rec)] = load_calls(tmp_path / "d")
    ins = rec.tensors["train"]["inputs"]
    assert rec.meta["affine"] is False and rec.params == dtype
    assert np.array_equal(ins["gamma"], np.ones(3)) and np.array_equal(ins["beta"], np.zeros(3))
    assert rec.formats["train.inputs.gamma"] == rec.formats["train.inputs.beta"] == dtype
    assert set(rec.tensors["backward"]["outputs"]) == {"dx"}
    assert rec.meta["backward_missing"] == {"dgamma": "not computed: affine=False",
                                            "dbeta": "not computed: affine=False"}
    replay(rec)


def test_no_running_statistics(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3, track_running_stats=False))
    with capture(model, tmp_path / "d"):
        model(_x()).square().mean().backward()
        model.eval()
        model(_x())
    calls = load_calls(tmp_path / "d")
    # without running statistics torch normalises with the batch's even in eval mode: both are training calls
    assert [e["training"] for e, _ in calls] == [True, True]
    for _, rec in calls:
        assert rec.meta["track_running_stats"] is False
        assert not {"running_mean", "running_var"} & set(rec.tensors["train"]["inputs"])
        assert not {"running_mean_out", "running_var_out"} & set(rec.tensors["train"]["outputs"])
        replay(rec)


def test_input_without_grad_records_what_the_kernel_computed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1))
    with capture(model, tmp_path / "d"):
        model(_x()).square().mean().backward()
    [(entry, rec)] = load_calls(tmp_path / "d")
    assert entry["backward"] and set(rec.tensors["backward"]["outputs"]) == {"dgamma", "dbeta"}
    assert rec.meta["backward_missing"] == {"dx": "not computed: x does not require grad"}
    replay(rec)


def test_training_without_autograd_says_why_no_saved_statistics(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    with capture(model, tmp_path / "d"), torch.no_grad():
        model(_x())
    [(entry, rec)] = load_calls(tmp_path / "d")
    assert entry["training"] and not entry["backward"] and rec.saved_kind is None
    assert "saved_mean" not in rec.tensors["train"]["outputs"]
    assert "no autograd graph" in rec.meta["saved"]
    replay(rec)


def test_backward_false_records_forwards_only(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    with capture(model, tmp_path / "d", backward=False):
        model(_x()).square().mean().backward()
    [(entry, rec)] = load_calls(tmp_path / "d")
    assert not entry["backward"] and rec.modes == ("train",) and rec.saved_kind == "invstd"


def test_calls_per_module_keeps_the_first_and_says_how_many_were_skipped(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    with capture(model, tmp_path / "d", calls_per_module=2) as cap:
        for _ in range(5):
            model(_x())
    index = read_calls(tmp_path / "d")
    assert [c["name"] for c in index["calls"]] == ["1#0", "1#1"] == cap.calls
    assert index["skipped"] == {"1": 3} and index["calls_per_module"] == 2
    assert index["notes"] == ["1: 3 call(s) after the first 2 not recorded (calls_per_module)"]
    with pytest.raises(BNProbeError, match="calls_per_module must be a positive integer"):
        capture(model, tmp_path / "e", calls_per_module=0)


# ---- safety ---------------------------------------------------------------------------------------------

def _hooks(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def test_refuses_an_existing_dump_before_the_model_runs(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    out = tmp_path / "d"
    with capture(model, out):
        model(_x())
        model(_x())
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    ran = []
    with pytest.raises(BNProbeError, match=r"bnprobe-calls.json exists; refusing to overwrite"):
        with capture(model, out):
            ran.append(True)
    assert not ran and {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # force overwrites; the folder of the old second call, not written again, is removed
    with capture(model, out, force=True):
        model(_x())
    assert [c["name"] for c in read_calls(out)["calls"]] == ["1#0"]
    assert sorted(p.name for p in out.iterdir()) == ["0000-1-0", CALLS_NAME]
    # a single bnprobe dump, a capture without its index, and a file are refused as well
    single = tmp_path / "single"
    (single / "a").mkdir(parents=True)
    (single / "bnprobe-dump.json").write_text("{}")
    with pytest.raises(BNProbeError, match="bnprobe-dump.json exists"):
        capture(model, single).__enter__()
    (out / CALLS_NAME).unlink()
    with pytest.raises(BNProbeError, match="without an index"):
        capture(model, out).__enter__()
    (tmp_path / "f").write_text("")
    with pytest.raises(BNProbeError, match="is a file"):
        capture(model, tmp_path / "f").__enter__()
    assert _hooks(model) == [0] * len(_hooks(model))


def test_nothing_written_when_the_body_raises_and_hooks_are_removed(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    user = model[1].register_forward_hook(lambda m, a, y: None)
    before = _hooks(model)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, tmp_path / "d"):
            model(_x()).sum().backward()
            assert _hooks(model) != before
            raise RuntimeError("boom")
    assert not (tmp_path / "d").exists()
    assert _hooks(model) == before
    user.remove()


def test_hooks_removed_after_exit(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    before = _hooks(model)
    with capture(model, tmp_path / "d") as cap:
        y = model(_x())
        recorded = list(cap._records)
    assert _hooks(model) == before and not cap._handles
    with pytest.raises(BNProbeError, match="entered once"), cap:
        pass
    y.square().mean().backward()  # the backward runs after the exit: y's node has no hook left
    assert recorded[0].backward_runs == 0 and not recorded[0].grads_out
    model(_x())
    assert read_calls(tmp_path / "d")["calls"][0]["backward"] is False


def test_refuses_beyond_max_bytes_and_writes_nothing(tmp_path):
    model = _one_bn(nn.BatchNorm2d(3))
    x = _x()  # 5*3*4*4 fp32 = 960 bytes; with a backward possible, 4 copies: 4.0 KiB a call
    # each call is spilled to disk as it is recorded: max_bytes bounds the tensors held at once, not their total
    with capture(model, tmp_path / "ok", max_bytes=6 * 1024) as cap:
        model(x)
        model(x)
        assert cap.reserved_bytes == 0  # both forwards on disk, their backward awaited
    assert len(read_calls(tmp_path / "ok")["calls"]) == 2
    with pytest.raises(BNProbeError, match=r"capture needs 4\.0 KiB to record 1#0 .* over max_bytes = 3\.0 KiB"):
        with capture(model, tmp_path / "d", max_bytes=3 * 1024):
            model(x)
    assert not (tmp_path / "d").exists() and _hooks(model) == [0] * len(_hooks(model))
    # a refusal the body catches still writes nothing
    with pytest.raises(BNProbeError, match="caught inside the capture; nothing written"):
        with capture(model, tmp_path / "d", max_bytes=1024):
            try:
                model(x)
            except BNProbeError:
                pass
    assert not (tmp_path / "d").exists()


def test_model_without_batchnorm_is_refused(tmp_path):
    with pytest.raises(BNProbeError, match="has no BatchNorm module .* or LayerNorm, RMSNorm, GroupNorm, InstanceNorm"):
        capture(nn.Linear(2, 2), tmp_path / "d").__enter__()


def test_bnprobe_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import bnprobe, bnprobe.checks.plot_stats.stats\n"
            "from bnprobe.core.errors import BNProbeError\n"
            "try:\n"
            "    bnprobe.capture(object(), 'unused').__enter__()\n"
            "except BNProbeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "capture needs torch" in out.stdout


# ---- a series of captured steps as statistics ------------------------------------------------------------

def test_a_series_of_captured_steps_loads_as_statistics(tmp_path):
    model, x = make_net("fp32")
    expected = []
    for step in range(3):
        with capture(model, tmp_path / "series" / f"step{step:03d}", calls_per_module=1):
            model(x + step).square().mean().backward()
        expected.append({name: (getattr(model, name).running_mean.double().numpy().copy()) for name in BN_ORDER})
    df = load_dump_series(tmp_path / "series")
    assert sorted(df["layer"].unique()) == sorted(BN_ORDER) and sorted(df["step"].unique()) == [0, 1, 2]
    assert len(df) == 3 * (4 + 6 + 5 + 2)
    for step in range(3):
        rec = load_dump(tmp_path / "series" / f"step{step:03d}" / "0000-bn1-0")
        got = df[(df.step == step) & (df.layer == "bn1")].sort_values("channel")
        outs = rec.tensors["train"]["outputs"]
        assert np.array_equal(got["mean"].to_numpy(), outs["saved_mean"])
        assert np.array_equal(got["var"].to_numpy(), 1.0 / outs["saved_value"] ** 2 - rec.eps)
        for name in BN_ORDER:
            rm = df[(df.step == step) & (df.layer == name)].sort_values("channel")["running_mean"].to_numpy()
            assert np.array_equal(rm, expected[step][name])


def test_each_call_goes_to_disk_as_it_completes_and_a_failure_removes_them(tmp_path):
    """A training step: each forward is spilled at once (nothing held), each dump written when its backward
    arrives (the spill file gone; test_train_step_and_eval_reproduce_torch_bit_for_bit checks the dumps against
    torch, through this path). A body that raises after that leaves nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))
    x = torch.randn(2, 3, 6, 6)
    out = tmp_path / "d"
    with capture(model, out) as cap:
        y = model(x)
        assert cap.reserved_bytes == 0
        spilled = sorted(p.parent.name for p in out.glob("*/forward-spill.npz"))
        assert len(spilled) == 2 and not list(out.glob("*/bnprobe-dump.json"))
        y.square().mean().backward()
        assert not list(out.glob("*/forward-spill.npz")) and len(list(out.glob("*/bnprobe-dump.json"))) == 2
        assert not (out / CALLS_NAME).exists()  # the index comes last
    calls = read_calls(out)["calls"]
    assert [c["backward"] for c in calls] == [True, True]
    for c in calls:
        rec = load_dump(out / c["dir"])
        assert {"train", "backward"} <= set(rec.tensors) and "dx" in rec.tensors["backward"]["outputs"]
    with pytest.raises(RuntimeError, match="after the backward"):
        with capture(model, tmp_path / "e"):
            model(x).sum().backward()
            assert len(list((tmp_path / "e").glob("*/bnprobe-dump.json"))) == 2
            raise RuntimeError("after the backward")
    assert not (tmp_path / "e").exists()

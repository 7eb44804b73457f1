"""Make the msprobe MindSpore dumps of this folder: ``python make_dumps.py LEVEL DTYPE OUT`` (L0, L1 or mix in
PyNative; ``graph``: GRAPH_MODE at msprobe's level L2, MindSpore's kernel-by-kernel dump; fp32 or fp16) in an
environment with mindspore and mindstudio-probe (see README.md)."""

import json
import os
import sys

import mindspore as ms
import mindspore.mint as mint
import numpy as np
from mindspore import Tensor, nn


def _norm(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    """msprobe's statistics call mint.norm, which MindSpore 2.10's CPU backend lacks: the same norm in numpy."""
    return Tensor(np.array(np.linalg.norm(x.asnumpy().astype(np.float64).ravel()), dtype=np.float32))


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=True)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.bn2 = nn.BatchNorm2d(4, eps=1e-3, momentum=0.8)

    def construct(self, x):  # noqa: ANN001, ANN201
        return self.bn2(self.relu(self.bn1(self.conv(x))))


class WithLoss(nn.Cell):
    def __init__(self, net: nn.Cell) -> None:
        super().__init__()
        self.net = net
        self.loss = nn.MSELoss()

    def construct(self, a, b):  # noqa: ANN001, ANN201
        return self.loss(self.net(a).astype(ms.float32), b)


def graph(dtype: str, out: str) -> None:
    """One training step in GRAPH_MODE under msprobe's L2 (the only level msprobe dumps there on the CPU); fp16: the
    BatchNorm cells to_float(float16)."""
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)  # the conv's initial weights
    from msprobe.mindspore import PrecisionDebugger

    os.makedirs(out, exist_ok=True)
    with open(f"{out}/config.json", "w") as f:
        json.dump({"task": "tensor", "dump_path": os.path.abspath(out), "rank": [], "step": [], "level": "L2",
                   "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, f)
    net = Net()
    net.set_train(True)
    if dtype == "fp16":
        net.bn1.to_float(ms.float16)
        net.bn2.to_float(ms.float16)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
    t = Tensor(rng.standard_normal((2, 4, 4, 4)).astype(np.float32))
    step = nn.TrainOneStepCell(WithLoss(net), nn.SGD(net.trainable_params(), 0.01))
    step.set_train(True)
    dbg = PrecisionDebugger(config_path=f"{out}/config.json")
    dbg.start()
    step(x, t)
    dbg.stop()
    dbg.step()


def main(level: str, dtype: str, out: str) -> None:
    if level == "graph":
        return graph(dtype, out)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    mint.norm = _norm
    from msprobe.mindspore import PrecisionDebugger

    os.makedirs(out, exist_ok=True)
    with open(f"{out}/config.json", "w") as f:
        json.dump({"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": level,
                   "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, f)
    net = Net()
    net.set_train(True)
    if dtype == "fp16":
        net.to_float(ms.float16)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
    t = Tensor(rng.standard_normal((2, 4, 4, 4)).astype(np.float32))
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda a, b: loss_fn(net(a).astype(ms.float32), b), None, net.trainable_params())
    opt = nn.SGD(net.trainable_params(), 0.01)
    dbg = PrecisionDebugger(config_path=f"{out}/config.json")
    dbg.start(net)
    _, grads = grad_fn(x, t)
    opt(grads)
    dbg.stop()
    dbg.step()


if __name__ == "__main__":
    main(*sys.argv[1:4])

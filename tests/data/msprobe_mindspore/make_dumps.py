import json, sys, os
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor
ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
level, dtype, out = sys.argv[1], sys.argv[2], sys.argv[3]
import mindspore.mint as mint
def _norm(x, *a, **k):
    return Tensor(np.array(np.linalg.norm(x.asnumpy().astype(np.float64).ravel()), dtype=np.float32))
mint.norm = _norm
from msprobe.mindspore import PrecisionDebugger
cfg = {"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": level,
       "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
os.makedirs(out, exist_ok=True)
with open(out + "/config.json", "w") as f: json.dump(cfg, f)
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=True)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.bn2 = nn.BatchNorm2d(4, eps=1e-3, momentum=0.8)
    def construct(self, x):
        return self.bn2(self.relu(self.bn1(self.conv(x))))
net = Net()
net.set_train(True)
if dtype == "fp16":
    net.to_float(ms.float16)
rng = np.random.default_rng(0)
x = Tensor(rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
t = Tensor(rng.standard_normal((2, 4, 4, 4)).astype(np.float32))
loss_fn = nn.MSELoss()
def forward(x, t):
    return loss_fn(net(x).astype(ms.float32), t)
grad_fn = ms.value_and_grad(forward, None, net.trainable_params())
opt = nn.SGD(net.trainable_params(), 0.01)
dbg = PrecisionDebugger(config_path=out + "/config.json")
dbg.start(net)
loss, grads = grad_fn(x, t)
opt(grads)
dbg.stop()
dbg.step()
print("loss", loss)

"""The FP64 kernels against torch float64 (an independent implementation), to 1e-12 relative."""

import zlib

import numpy as np
import pytest

from bnprobe.kernels import Execution, backward, forward_infer, forward_train, get_policy

torch = pytest.importorskip("torch")
F = torch.nn.functional

SHAPES = [(8, 3), (4, 3, 7), (4, 3, 5, 5), (2, 3, 2, 3, 4), (16, 5, 1, 1)]
GOLD = get_policy("fp64")


def close(a, b, rtol=1e-12):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.max(np.abs(b)) or 1.0
    assert np.max(np.abs(a - b)) <= rtol * scale, (np.max(np.abs(a - b)), scale)


def make(shape, seed, channels_last=False):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3.0, c).reshape((1, c) + (1,) * (len(shape) - 2)) + 2.0
    return x, rng.standard_normal(c), rng.standard_normal(c), rng.standard_normal(c), rng.uniform(0.5, 2, c)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_train_forward_backward_match_torch(shape, momentum, eps):
    x, g, b, rm, rv = make(shape, zlib.crc32(repr((shape, momentum, eps)).encode()) % 1000)
    nbt = 3
    r = forward_train(x, g, b, rm, rv, momentum=momentum, eps=eps, policy=GOLD, num_batches_tracked=nbt)
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(g, requires_grad=True), torch.tensor(b, requires_grad=True)
    rmt, rvt = torch.tensor(rm), torch.tensor(rv)
    bn = torch.nn.BatchNorm1d(shape[1], eps=eps, momentum=momentum, dtype=torch.float64) if len(shape) <= 3 else (
        torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm3d)(
        shape[1], eps=eps, momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.copy_(gt)
        bn.bias.copy_(bt)
        bn.running_mean.copy_(rmt)
        bn.running_var.copy_(rvt)
        bn.num_batches_tracked.fill_(nbt)
    bn.train()
    yt = bn(xt)
    close(r.y, yt.detach().numpy())
    close(r.running_mean, bn.running_mean.numpy())
    close(r.running_var, bn.running_var.numpy())
    assert r.num_batches_tracked == nbt + 1 == int(bn.num_batches_tracked)
    # saved statistics against torch's native op
    _, smean, sinvstd = torch.native_batch_norm(xt.detach(), gt.detach(), bt.detach(), None, None, True, 0.1, eps)
    close(r.mean, smean.numpy())
    close(r.invstd, sinvstd.numpy())
    dy = np.random.default_rng(1).standard_normal(shape)
    yt.backward(torch.tensor(dy))
    for formula in ("standard", "ascend"):
        bw = backward(dy, x, g, r.mean, r.invstd, policy=GOLD.with_options(backward_formula=formula),
                      saved_var=r.var, eps=eps)
        close(bw.dx, xt.grad.numpy())
        close(bw.dgamma, bn.weight.grad.numpy())
        close(bw.dbeta, bn.bias.grad.numpy())


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: "x".join(map(str, s)))
def test_channels_last_matches_channels_first(shape):
    x, g, b, rm, rv = make(shape, 0)
    xl = np.moveaxis(x, 1, -1).copy()
    a = forward_train(x, g, b, rm, rv, policy=GOLD)
    c = forward_train(xl, g, b, rm, rv, policy=GOLD, execution=Execution(layout="channels_last"))
    np.testing.assert_array_equal(np.moveaxis(c.y, -1, 1), a.y)
    np.testing.assert_array_equal(c.running_var, a.running_var)
    dy = np.random.default_rng(2).standard_normal(shape)
    bw1 = backward(dy, x, g, a.mean, a.invstd, policy=GOLD)
    bw2 = backward(np.moveaxis(dy, 1, -1).copy(), xl, g, a.mean, a.invstd, policy=GOLD,
                   execution=Execution(layout="channels_last"))
    np.testing.assert_array_equal(np.moveaxis(bw2.dx, -1, 1), bw1.dx)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("formula", ["xhat", "scale", "affine"])
def test_inference_and_its_backward_match_torch(shape, formula):
    x, g, b, rm, rv = make(shape, 7)
    pol = GOLD.with_options(y_formula=formula)
    r = forward_infer(x, g, b, rm, rv, eps=1e-4, policy=pol)
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(g, requires_grad=True), torch.tensor(b, requires_grad=True)
    yt = F.batch_norm(xt, torch.tensor(rm), torch.tensor(rv), gt, bt, training=False, eps=1e-4)
    close(r.y, yt.detach().numpy())
    dy = np.random.default_rng(3).standard_normal(shape)
    yt.backward(torch.tensor(dy))
    bw = backward(dy, x, g, rm, 1 / np.sqrt(rv + 1e-4), policy=pol, training=False)
    close(bw.dx, xt.grad.numpy())
    close(bw.dgamma, gt.grad.numpy())
    close(bw.dbeta, bt.grad.numpy())


@pytest.mark.parametrize("variance", ["naive", "two_pass", "welford", "chan"])
@pytest.mark.parametrize("order", ["sequential", "pairwise", "lanes"])
@pytest.mark.parametrize("formula", ["xhat", "scale", "affine"])
def test_every_algorithm_in_fp64_matches_torch(variance, order, formula):
    x, g, b, rm, rv = make((4, 3, 6, 6), 11)
    pol = GOLD.with_options(variance=variance, order=order, y_formula=formula, lanes=16)
    r = forward_train(x, g, b, rm, rv, policy=pol)
    yt = F.batch_norm(torch.tensor(x), torch.tensor(rm), torch.tensor(rv), torch.tensor(g), torch.tensor(b),
                      training=True, eps=1e-5)
    close(r.y, yt.numpy(), rtol=1e-11)

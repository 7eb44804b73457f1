"""A user plugin: your own BatchNorm behind bnprobe's adapter interface.

    PYTHONPATH=. bnprobe dump --adapter examples.plugin_adapter:NumpyFP32BatchNorm --dtype fp32 --out /tmp/mine
    python examples/plugin_adapter.py        # runs it against the FP64 reference

Subclass BaseAdapter, declare what you support in capabilities(), and fill in the three
``_*_impl`` methods; the base class validates shapes, channels, eps and dtype and rounds the
inputs to the requested format before calling you.  bnprobe hands an adapter the call whole:
``train(call)``, ``infer(call)`` and ``backward_of(call, saved)``, with ``call`` a BNCall.
Packages can also register adapters under the entry-point group ``bnprobe.adapters``.  (From the
repository root the module is found through ``PYTHONPATH=.``: the ``bnprobe`` command, like every
console script, does not put the current folder on Python's path, and bnprobe never adds it for you.)
"""

from __future__ import annotations

import numpy as np

from bnprobe.adapters import BackwardOutput, BaseAdapter, BNCall, Capabilities, ForwardOutput, Prepared, Saved


class NumpyFP32BatchNorm(BaseAdapter):
    """A straightforward float32 BatchNorm in numpy (NCHW), as one might hand-write a kernel."""

    name = "numpy-fp32"

    def capabilities(self) -> Capabilities:
        return Capabilities(formats=("fp32",), layouts=("channels_first",), saved="invstd")

    @staticmethod
    def _axes(x: np.ndarray) -> tuple[int, ...]:
        return (0,) + tuple(range(2, x.ndim))

    @staticmethod
    def _col(v: np.ndarray, ndim: int) -> np.ndarray:
        return v.reshape((1, -1) + (1,) * (ndim - 2))

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        x = p.x.astype(np.float32)
        ax = self._axes(x)
        mean = x.mean(axis=ax, dtype=np.float32)
        var = ((x - self._col(mean, x.ndim)) ** 2).mean(axis=ax, dtype=np.float32)
        invstd = (np.float32(1) / np.sqrt(var + np.float32(eps))).astype(np.float32)
        g, b = p.vectors["gamma"].astype(np.float32), p.vectors["beta"].astype(np.float32)
        y = (x - self._col(mean, x.ndim)) * self._col(invstd * g, x.ndim) + self._col(b, x.ndim)
        rm = rv = None
        if p.vectors["running_mean"] is not None:
            m = np.float32(0.1 if momentum is None else momentum)
            n = x.size // x.shape[1]
            rm = ((1 - m) * p.vectors["running_mean"].astype(np.float32) + m * mean).astype(np.float32)
            rv = ((1 - m) * p.vectors["running_var"].astype(np.float32) + m * var * np.float32(n / (n - 1))
                  ).astype(np.float32)
        return ForwardOutput(y.astype(np.float32), Saved(mean, "invstd", invstd), rm, rv)

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        x = p.x.astype(np.float32)
        v = {k: a.astype(np.float32) for k, a in p.vectors.items()}
        w = v["gamma"] / np.sqrt(v["running_var"] + np.float32(eps))
        y = (x - self._col(v["running_mean"], x.ndim)) * self._col(w, x.ndim) + self._col(v["beta"], x.ndim)
        return ForwardOutput(y.astype(np.float32))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        x, dy = p.x.astype(np.float32), dy.astype(np.float32)
        ax = self._axes(x)
        mean = saved.mean.astype(np.float32)
        invstd = saved.invstd(eps).astype(np.float32)
        xhat = (x - self._col(mean, x.ndim)) * self._col(invstd, x.ndim)
        g = p.vectors["gamma"].astype(np.float32)
        dbeta = dy.sum(axis=ax, dtype=np.float32)
        dgamma = (dy * xhat).sum(axis=ax, dtype=np.float32)
        if training:
            n = x.size // x.shape[1]
            dx = self._col(g * invstd, x.ndim) * (dy - self._col(dbeta / n, x.ndim)
                                                 - xhat * self._col(dgamma / n, x.ndim))
        else:
            dx = dy * self._col(g * invstd, x.ndim)
        return BackwardOutput(dx.astype(np.float32), dgamma, dbeta)


if __name__ == "__main__":
    from bnprobe.adapters import get_adapter

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4, 6, 6)) * 2 + 1
    mine, ref = NumpyFP32BatchNorm(), get_adapter("reference")
    call = BNCall(x, running_mean=np.zeros(4), running_var=np.ones(4), dtype="fp32")
    a, b = mine.train(call), ref.train(call)
    print(f"{mine.name}: max |y - reference| = {np.abs(a.y - b.y).max():.3g}, "
          f"running_var max diff = {np.abs(a.running_var - b.running_var).max():.3g}")

"""Plugin kernels for the checks' tests: BatchNorm written here in float64 numpy (not with bnprobe's kernels
or the doctor's models), each output cast to the format a framework returns it in — y and dx in the input's
format, the saved and running statistics and dγ, dβ in the parameters' format — with at most one planted bug.

Usable from the command line as plugins, e.g. ``--adapter bn_plugins:DropsTerm`` (tests/ on the path)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bnprobe.adapters import BackwardOutput, BaseAdapter, Capabilities, ForwardOutput, Saved

NP = {"fp64": np.float64, "fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}

# each bug: what the kernel does instead of BatchNorm
BUGS = {
    # forward and saved statistics
    "eps-on-sigma": "rstd = 1/(sqrt(var) + eps)",
    "eps-missing": "rstd = 1/sqrt(var)",
    "eps-ignored": "rstd = 1/sqrt(var + 1e-5) whatever the layer's eps",
    "no-sqrt": "rstd = 1/(var + eps)",
    "eps-max": "rstd = 1/sqrt(max(var, eps)) (vacancy0x0/Synchronized-BatchNorm-PyTorch#38)",
    "unbiased-normalise": "normalises with the unbiased variance",
    "train-uses-running": "training normalises with the running statistics",
    "mean-not-subtracted": "y = gamma*x*rstd + beta",
    "gamma-beta-swapped": "y = beta*xhat + gamma",
    # running statistics
    "biased-running-var": "running_var updated with the biased variance",
    "momentum-1-m": "running = m*running + (1-m)*batch",
    "running-not-updated": "running statistics returned unchanged",
    "running-var-plus-eps": "running_var updated with var + eps",
    # inference
    "infer-uses-batch": "inference normalises with the batch statistics",
    # backward
    "dx-drops-mean": "dx without -mean(dy)",
    "dx-drops-xhat-term": "dx without -xhat*mean(dy*xhat)",
    "dx-sum-dy": "dx with -sum(dy) for -mean(dy)",
    "dx-sum-dy-xhat": "dx with -xhat*sum(dy*xhat) for -xhat*mean(dy*xhat)",
    "dx-plus-xhat-term": "dx with +xhat*mean(dy*xhat)",
    "dx-no-sqrt": "dx factor gamma/(var+eps)",
    "dx-no-gamma": "dx factor rstd without gamma",
    "dx-x-for-xhat": "dx with x for both xhat",
    "dx-centered-for-xhat": "dx with x - mean for both xhat",
    "dx-seed": "the seed's dL/dX as printed: gamma/(var+eps)*(dy - mean(dy) - x*mean(dy*x))",
    "dgamma-no-rstd": "dgamma = sum(dy*(x - mean))",
    "dgamma-x": "dgamma = sum(dy*x)",
    "dgamma-mean": "dgamma = mean(dy*xhat)",
    "dbeta-mean": "dbeta = mean(dy)",
    "dgamma-dbeta-swapped": "dgamma = sum(dy), dbeta = sum(dy*xhat)",
}
# faults of y as returned (no doctor model: the golden comparison and the overflow scan find them)
OUTPUT_FAULTS = {
    "nan-channel": "y of channel 0 is NaN",
    "zero-channel": "y of channel 0 is zero",
    "saturate": "y beyond the format's maximum is returned as the maximum, not inf",
}


def _cast(a, fmt):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(a, dtype=np.float64).astype(NP[fmt])


class NumpyBN(BaseAdapter):
    """BatchNorm in float64 numpy; ``bug`` (a key of BUGS) plants one fault; ``scale`` multiplies one output
    (``scaled``: running_var, saved_invstd, ...) by 1 + scale, a bug of a chosen size."""

    def __init__(self, bug=None, *, scaled=None, scale=0.0):
        assert bug is None or bug in BUGS or bug in OUTPUT_FAULTS, bug
        self.bug, self.scaled, self.scale = bug, scaled, scale
        self.name = f"numpy-bn:{bug}" if bug else ("numpy-bn" if scaled is None else f"numpy-bn:{scaled}*(1{scale:+g})")

    def capabilities(self):
        return Capabilities(formats=tuple(NP), saved="invstd", layouts=("channels_first",))

    @staticmethod
    def _ax(x):
        return (0,) + tuple(range(2, x.ndim))

    @staticmethod
    def _col(v, x):
        return np.asarray(v, dtype=np.float64).reshape((1, -1) + (1,) * (x.ndim - 2))

    def _k(self, name, v):
        return v * (1 + self.scale) if name == self.scaled else v

    def _rstd(self, var, eps):
        if self.bug == "eps-ignored":
            eps = 1e-5
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.bug == "eps-on-sigma":
                return 1 / (np.sqrt(var) + eps)
            if self.bug == "eps-missing":
                return 1 / np.sqrt(var)
            if self.bug == "no-sqrt":
                return 1 / (var + eps)
            if self.bug == "eps-max":
                return 1 / np.sqrt(np.maximum(var, eps))
            return 1 / np.sqrt(var + eps)

    def _y(self, x, mean, rstd, g, b):
        with np.errstate(invalid="ignore"):
            if self.bug == "mean-not-subtracted":
                return x * self._col(rstd * g, x) + self._col(b, x)
            xhat = (x - self._col(mean, x)) * self._col(rstd, x)
            if self.bug == "gamma-beta-swapped":
                return xhat * self._col(b, x) + self._col(g, x)
            return xhat * self._col(g, x) + self._col(b, x)

    def _returned(self, y, fmt):
        """y cast to the format it is returned in, with the output bugs."""
        y = np.array(y, dtype=np.float64)
        if self.bug in ("nan-channel", "zero-channel"):
            y[:, 0] = np.nan if self.bug == "nan-channel" else 0.0
        out = _cast(y, fmt)
        if self.bug == "saturate":
            big = float(ml_dtypes.finfo(NP[fmt]).max)
            out = np.where(np.isinf(out), np.sign(out) * big, out).astype(NP[fmt])
        return out

    def _forward_train_impl(self, p, *, momentum, eps):
        x, ax = p.x, self._ax(p.x)
        r = x.size // x.shape[1]
        v = p.vectors
        mean, var = x.mean(axis=ax), x.var(axis=ax)
        unbiased = var * r / (r - 1)
        m_n, v_n = mean, (unbiased if self.bug == "unbiased-normalise" else var)
        if self.bug == "train-uses-running":
            m_n, v_n = v["running_mean"], v["running_var"]
        rstd = self._k("saved_invstd", self._rstd(v_n, eps))
        y = self._k("y", self._y(x, m_n, rstd, v["gamma"], v["beta"]))
        rm, rv = v["running_mean"], v["running_var"]
        new_rm = new_rv = None
        if rm is not None:
            m = 1.0 if momentum is None else momentum
            batch_var = {"biased-running-var": var, "running-var-plus-eps": unbiased + eps}.get(self.bug, unbiased)
            if self.bug == "momentum-1-m":
                new_rm, new_rv = m * rm + (1 - m) * mean, m * rv + (1 - m) * batch_var
            elif self.bug == "running-not-updated":
                new_rm, new_rv = rm, rv
            else:
                new_rm, new_rv = (1 - m) * rm + m * mean, (1 - m) * rv + m * batch_var
            new_rm, new_rv = _cast(new_rm, p.params), _cast(self._k("running_var", new_rv), p.params)
        return ForwardOutput(self._returned(y, p.dtype), Saved(_cast(m_n, p.params), "invstd", _cast(rstd, p.params)),
                             new_rm, new_rv)

    def _forward_infer_impl(self, p, *, eps):
        x, v = p.x, p.vectors
        mean, var = v["running_mean"], v["running_var"]
        if self.bug == "infer-uses-batch":
            mean, var = x.mean(axis=self._ax(x)), x.var(axis=self._ax(x))
        return ForwardOutput(self._returned(self._y(x, mean, self._rstd(var, eps), v["gamma"], v["beta"]), p.dtype))

    def _backward_impl(self, p, dy, saved, *, eps, training):
        x, ax, g = p.x, self._ax(p.x), p.vectors["gamma"]
        r = x.size // x.shape[1]
        mean, inv = np.asarray(saved.mean, dtype=np.float64), saved.invstd(eps)
        var = saved.var(eps)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            xhat = (x - self._col(mean, x)) * self._col(inv, x)
            dbeta, dgamma = dy.sum(axis=ax), (dy * xhat).sum(axis=ax)
            if not training:
                return BackwardOutput(_cast(self._col(g * inv, x) * dy, p.dtype), _cast(dgamma, p.params),
                                      _cast(dbeta, p.params))
            factor = g * inv
            z = xhat
            mean_dy, mean_dyz = dy.mean(axis=ax, keepdims=True), None
            sign = -1.0
            if self.bug == "dx-no-sqrt":
                factor = g / (var + eps)
            elif self.bug == "dx-no-gamma":
                factor = inv
            elif self.bug == "dx-x-for-xhat":
                z = x
            elif self.bug == "dx-centered-for-xhat":
                z = x - self._col(mean, x)
            elif self.bug == "dx-seed":
                factor, z = g / (var + eps), x
            elif self.bug == "dx-drops-mean":
                mean_dy = 0.0
            elif self.bug == "dx-sum-dy":
                mean_dy = dy.sum(axis=ax, keepdims=True)
            elif self.bug == "dx-drops-xhat-term":
                mean_dyz = 0.0
            elif self.bug == "dx-sum-dy-xhat":
                mean_dyz = (dy * z).sum(axis=ax, keepdims=True)
            elif self.bug == "dx-plus-xhat-term":
                sign = 1.0
            if mean_dyz is None:
                mean_dyz = (dy * z).mean(axis=ax, keepdims=True)
            dx = self._col(factor, x) * (dy - mean_dy + sign * z * mean_dyz)
            if self.bug == "dgamma-no-rstd":
                dgamma = (dy * (x - self._col(mean, x))).sum(axis=ax)
            elif self.bug == "dgamma-x":
                dgamma = (dy * x).sum(axis=ax)
            elif self.bug == "dgamma-mean":
                dgamma = dgamma / r
            elif self.bug == "dbeta-mean":
                dbeta = dbeta / r
            elif self.bug == "dgamma-dbeta-swapped":
                dgamma, dbeta = dbeta, dgamma
        return BackwardOutput(_cast(self._k("dx", dx), p.dtype), _cast(dgamma, p.params), _cast(dbeta, p.params))


class ZeroY(NumpyBN):
    """A kernel whose y is entirely zero (a missing write-back)."""

    name = "zero-y"

    def __init__(self):
        super().__init__()
        self.name = "zero-y"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        return ForwardOutput(np.zeros_like(out.y), out.saved, out.running_mean, out.running_var)

    def _forward_infer_impl(self, p, *, eps):
        out = super()._forward_infer_impl(p, eps=eps)
        return ForwardOutput(np.zeros_like(out.y))


class Fp16RunningVar(NumpyBN):
    """The running variance's update summed in the parameters' format (fp16 with params=same): Σ(x-mean)²
    overflows 65504 although the variance itself does not."""

    def __init__(self):
        super().__init__()
        self.name = "fp16-running-var"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        if out.running_var is None:
            return out
        x, ax = p.x, self._ax(p.x)
        r = x.size // x.shape[1]
        dev = _cast((x - self._col(x.mean(axis=ax), x)) ** 2, p.params)
        with np.errstate(over="ignore"):
            ssq = dev.sum(axis=ax, dtype=NP[p.params])  # accumulates in the parameters' format
            unbiased = _cast(ssq / NP[p.params](r - 1), p.params).astype(np.float64)
        m = 1.0 if momentum is None else momentum
        rv = _cast((1 - m) * p.vectors["running_var"] + m * unbiased, p.params)
        return ForwardOutput(out.y, out.saved, out.running_mean, rv)


class InvstdFlushed(NumpyBN):
    """Saves invstd with subnormals flushed to zero (fp16 with params=same: invstd below 2^-14 = 6.1e-5,
    i.e. a standard deviation above 16384, is saved as 0)."""

    def __init__(self):
        super().__init__()
        self.name = "invstd-flushed"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        inv = np.asarray(out.saved.value)
        tiny = float(np.finfo(np.float16).tiny) if p.params == "fp16" else float(np.finfo(inv.dtype).tiny)
        flushed = np.where(np.abs(inv.astype(np.float64)) < tiny, 0, inv).astype(inv.dtype)
        return ForwardOutput(out.y, Saved(out.saved.mean, "invstd", flushed), out.running_mean, out.running_var)


def DropsTerm():  # noqa: N802 - a plugin factory, named like a class for the command line
    """dx without its last term, -x̂·mean(dy·x̂): the known gap of doctor --dtype bf16."""
    return NumpyBN("dx-drops-xhat-term")


def EpsIgnored():  # noqa: N802
    return NumpyBN("eps-ignored")


def BiasedRunningVar():  # noqa: N802
    return NumpyBN("biased-running-var")


class ScaledInvstd(NumpyBN):
    """Returns its saved invstd multiplied by 1 + scale and nothing else wrong: y uses the true rstd and the
    backward recomputes the statistics from x, so only the check of the saved statistics can see it."""

    def __init__(self, scale):
        super().__init__()
        self.scale_by = scale
        self.name = f"scaled-invstd*(1{scale:+g})"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        inv = np.asarray(out.saved.value)
        wrong = _cast(inv.astype(np.float64) * (1 + self.scale_by), p.params)
        return ForwardOutput(out.y, Saved(out.saved.mean, "invstd", wrong), out.running_mean, out.running_var)

    def _backward_impl(self, p, dy, saved, *, eps, training):
        x, ax = p.x, self._ax(p.x)
        mean = x.mean(axis=ax)
        return super()._backward_impl(p, dy, Saved(mean, "invstd", 1 / np.sqrt(x.var(axis=ax) + eps)), eps=eps,
                                      training=training)


class NaiveVariance(NumpyBN):
    """The variance as E[x²] - E[x]² summed in float32: right on centred data, wrong where the mean is large
    against the spread (catastrophic cancellation)."""

    def __init__(self):
        super().__init__()
        self.name = "naive-variance"

    def _forward_train_impl(self, p, *, momentum, eps):
        x, ax = p.x, self._ax(p.x)
        r = x.size // x.shape[1]
        x32 = x.astype(np.float32)
        mean = x32.sum(axis=ax, dtype=np.float32) / np.float32(r)
        var = np.maximum((x32 * x32).sum(axis=ax, dtype=np.float32) / np.float32(r) - mean * mean, 0)
        mean, var = mean.astype(np.float64), var.astype(np.float64)
        rstd = 1 / np.sqrt(var + eps)
        v = p.vectors
        y = (x - self._col(mean, x)) * self._col(rstd * v["gamma"], x) + self._col(v["beta"], x)
        m = 1.0 if momentum is None else momentum
        rm = _cast((1 - m) * v["running_mean"] + m * mean, p.params)
        rv = _cast((1 - m) * v["running_var"] + m * var * r / (r - 1), p.params)
        return ForwardOutput(_cast(y, p.dtype), Saved(_cast(mean, p.params), "invstd", _cast(rstd, p.params)), rm, rv)


class RoundedStats(NumpyBN):
    """Normalises with the batch mean and 1/sqrt(var + eps) cast to the parameters' format first, as PyTorch's CPU
    kernel does with same-format parameters (pytorch/pytorch#140112); everything else as NumpyBN."""

    def __init__(self):
        super().__init__()
        self.name = "rounded-stats"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        x, ax, v = p.x, self._ax(p.x), p.vectors
        mean = _cast(x.mean(axis=ax), p.params).astype(np.float64)
        rstd = _cast(1 / np.sqrt(x.var(axis=ax) + eps), p.params).astype(np.float64)
        y = (x - self._col(mean, x)) * self._col(rstd, x) * self._col(v["gamma"], x) + self._col(v["beta"], x)
        return ForwardOutput(_cast(y, p.dtype), out.saved, out.running_mean, out.running_var)


class RunningInParams(NumpyBN):
    """Updates the running statistics in the parameters' format's arithmetic — momentum and 1 − momentum cast to it,
    each product and the sum cast to it — as PyTorch's CPU kernel does with same-format parameters; everything else
    as NumpyBN."""

    def __init__(self):
        super().__init__()
        self.name = "running-in-params"

    def _forward_train_impl(self, p, *, momentum, eps):
        out = super()._forward_train_impl(p, momentum=momentum, eps=eps)
        if out.running_mean is None or momentum is None:
            return out
        x, ax, v = p.x, self._ax(p.x), p.vectors
        r = x.size // x.shape[1]
        c = lambda a: _cast(a, p.params).astype(np.float64)  # noqa: E731
        km, kb = c(1 - momentum), c(momentum)
        rm = c(c(c(v["running_mean"]) * km) + c(c(x.mean(axis=ax)) * kb))
        rv = c(c(c(v["running_var"]) * km) + c(c(x.var(axis=ax) * r / (r - 1)) * kb))
        return ForwardOutput(out.y, out.saved, _cast(rm, p.params), _cast(rv, p.params))


# ---- kernels that run some modes only: an inference-only one (a deployment runtime) and a forward-only one --------

class Restricted(BaseAdapter):
    """``inner`` declaring the modes ``modes`` only (its formats, layouts and the rest as it declares them, but not
    staged: no check may rerun its policy in its place): a call of another mode is refused by the base, as an
    inference-only runtime or a plugin without a backward refuses it."""

    def __init__(self, inner, modes, name=None):
        self.inner, self.modes = inner, tuple(modes)
        self.name = name or f"{inner.name}[{'+'.join(self.modes)}]"

    def capabilities(self):
        from dataclasses import replace

        return replace(self.inner.capabilities(), modes=self.modes, staged=False, traced=False, golden=False)

    def _forward_train_impl(self, p, *, momentum, eps):
        return self.inner.train(p.call)

    def _forward_infer_impl(self, p, *, eps):
        return self.inner.infer(p.call)

    def _backward_impl(self, p, dy, saved, *, eps, training):
        return self.inner.backward_of(p.call, saved)


def InferOnly():  # noqa: N802 - a plugin factory, named like a class for the command line
    """bnprobe's emulated kernel (each format's preset) running inference only."""
    from bnprobe.adapters import get_adapter

    return Restricted(get_adapter("emulated"), ("infer",), "emulated-infer-only")


def ForwardOnly():  # noqa: N802
    """bnprobe's emulated kernel running its training and inference forwards, without a backward."""
    from bnprobe.adapters import get_adapter

    return Restricted(get_adapter("emulated"), ("train", "infer"), "emulated-forward-only")


def InferOnlyEpsMissing():  # noqa: N802
    """An inference-only kernel normalising with 1/sqrt(running_var), ε left out."""
    return Restricted(NumpyBN("eps-missing"), ("infer",), "infer-only:eps-missing")


def InferOnlyUsesBatch():  # noqa: N802
    """An inference-only kernel normalising with the batch's statistics, not the running ones."""
    return Restricted(NumpyBN("infer-uses-batch"), ("infer",), "infer-only:infer-uses-batch")

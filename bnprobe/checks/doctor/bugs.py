"""The doctor's catalogue of known BatchNorm bugs: each bug's id, what it is in words, the groups of outputs it
changes, and :func:`model`, BatchNorm in FP64 with one of them.

The ids are stable names for programs (``eps-on-sigma``...); reports print the words (:data:`TEXT`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from bnprobe.compiled.jit import jit_for
from bnprobe.core.call import EPS, BNCall
from bnprobe.core.conventions import get_convention
from bnprobe.core.errors import BNProbeError
from bnprobe.kernels.layout import channel_column, reduce_axes

__all__ = ["BUGS", "TEXT", "GROUPS", "CHECKS", "RECIPES", "CONVENTION_HINTS", "model", "Outputs", "describe",
           "running_item", "bugs_changing", "names_a_bug"]

EPS_ON_SIGMA = "eps-on-sigma"
EPS_MISSING = "eps-missing"
EPS_MAX = "eps-max"
EPS_IGNORED = "eps-ignored"
SQRT_MISSING = "no-sqrt"
UNBIASED = "unbiased-normalise"
TRAIN_RUNNING = "train-uses-running"
NO_CENTER = "mean-not-subtracted"
SWAPPED = "gamma-beta-swapped"
BIASED_RUNNING = "biased-running-var"
KERAS = "momentum-1-m"
NOT_UPDATED = "running-not-updated"
PLUS_EPS = "running-var-plus-eps"
INFER_BATCH = "infer-uses-batch"
DROP_MEAN = "dx-drops-mean"
DROP_XHAT = "dx-drops-xhat-term"
SUM_DY = "dx-sum-dy"
SUM_DY_XHAT = "dx-sum-dy-xhat"
PLUS_XHAT = "dx-plus-xhat-term"
DX_NO_SQRT = "dx-no-sqrt"
DX_NO_GAMMA = "dx-no-gamma"
DX_X = "dx-x-for-xhat"
DX_CENTERED = "dx-centered-for-xhat"
SEED = "dx-seed"
DG_NO_RSTD = "dgamma-no-rstd"
DG_X = "dgamma-x"
DG_MEAN = "dgamma-mean"
DB_MEAN = "dbeta-mean"
DG_DB_SWAPPED = "dgamma-dbeta-swapped"

#: each bug in words, as reports say it
TEXT: dict[str, str] = {
    EPS_ON_SIGMA: "eps added to sigma instead of sigma^2",
    EPS_MISSING: "eps missing",
    EPS_MAX: "eps as a floor on the variance: 1/sqrt(max(var, eps)) (vacancy0x0/Synchronized-BatchNorm-PyTorch#38)",
    EPS_IGNORED: f"eps ignored (uses {EPS:g})",
    SQRT_MISSING: "square root missing: normalised by var + eps",
    UNBIASED: "unbiased variance used for normalisation",
    TRAIN_RUNNING: "training uses running statistics",
    NO_CENTER: "mean not subtracted: y = gamma*x*rstd + beta",
    SWAPPED: "gamma and beta swapped in y",
    BIASED_RUNNING: "running_var updated with the biased variance",
    KERAS: "momentum applied as 1-m (Keras convention)",
    NOT_UPDATED: "running statistics not updated",
    PLUS_EPS: "running_var updated with var + eps",
    INFER_BATCH: "inference uses batch statistics",
    DROP_MEAN: "dx missing its -mean(dy) term",
    DROP_XHAT: "dx missing its -x-hat*mean(dy*x-hat) term",
    SUM_DY: "dx subtracts sum(dy) instead of mean(dy)",
    SUM_DY_XHAT: "dx subtracts x-hat*sum(dy*x-hat) instead of x-hat*mean(dy*x-hat)",
    PLUS_XHAT: "dx adds x-hat*mean(dy*x-hat) instead of subtracting it",
    DX_NO_SQRT: "dx factor without the square root: gamma/(var+eps)",
    DX_NO_GAMMA: "dx factor missing gamma",
    DX_X: "dx uses x instead of x-hat",
    DX_CENTERED: "dx uses x-mean instead of x-hat",
    SEED: "dx is the seed's dL/dX as printed: gamma/(var+eps)*(dy - mean(dy) - x*mean(dy*x))",
    DG_NO_RSTD: "dgamma missing the rstd factor",
    DG_X: "dgamma uses x instead of x-hat",
    DG_MEAN: "dgamma is the mean of dy*x-hat instead of the sum",
    DB_MEAN: "dbeta is the mean of dy instead of the sum",
    DG_DB_SWAPPED: "dgamma and dbeta swapped",
}

_NORMALISE = ("y_train", "saved", "y_infer", "backward", "y_eval")
# each known bug, with the groups of outputs it changes
BUGS: dict[str, tuple[str, ...]] = {  # id: the groups it changes
    EPS_ON_SIGMA: _NORMALISE,
    EPS_MISSING: _NORMALISE,
    EPS_MAX: _NORMALISE,
    EPS_IGNORED: _NORMALISE,
    SQRT_MISSING: _NORMALISE,
    UNBIASED: ("y_train", "saved", "backward"),
    TRAIN_RUNNING: ("y_train", "saved", "backward"),
    NO_CENTER: ("y_train", "y_infer", "y_eval"),
    SWAPPED: ("y_train", "y_infer", "y_eval"),
    BIASED_RUNNING: ("running", "y_eval"),
    KERAS: ("running", "y_eval"),
    NOT_UPDATED: ("running", "y_eval"),
    PLUS_EPS: ("running", "y_eval"),
    INFER_BATCH: ("y_infer", "y_eval"),
    **{bug: ("backward",) for bug in (DROP_MEAN, DROP_XHAT, SUM_DY, SUM_DY_XHAT, PLUS_XHAT, DX_NO_SQRT, DX_NO_GAMMA,
                                      DX_X, DX_CENTERED, SEED, DG_NO_RSTD, DG_X, DG_MEAN, DB_MEAN, DG_DB_SWAPPED)},
}
GROUPS = {"y_train": ("y",), "saved": ("saved_mean", "saved_invstd"), "running": ("running_mean", "running_var"),
          "y_infer": ("y_infer",), "backward": ("dx", "dgamma", "dbeta"), "y_eval": ("y_eval",)}
CHECKS = {  # group: (checklist item, what its outputs are)
    "y_train": ("training forward: batch statistics, epsilon inside the square root", "training outputs y"),
    "saved": ("saved statistics: mean and 1/sqrt(biased variance + eps)", "saved mean and 1/sqrt(var+eps)"),
    "running": ("running statistics: PyTorch momentum convention, unbiased running_var",
                "updated running_mean / running_var"),
    "y_infer": ("train/eval switch: inference normalises with the running statistics", "inference outputs y"),
    "backward": ("backward: dx, dgamma, dbeta", "gradients"),
    "y_eval": ("eval after several training steps: inference with the running statistics they left",
               "inference outputs y after the steps"),
}
ELEMENTWISE = ("y", "y_infer", "dx", "y_eval")


def names_a_bug(cause: Any) -> bool:
    """Whether a compare-precision row's ``cause`` is one of these bugs' models (several joined by ``|`` where the
    call could not tell them apart), not a numerical recipe."""
    return isinstance(cause, str) and bool(cause) and all(part in BUGS for part in cause.split("|"))


def bugs_changing(output: str) -> tuple[str, ...]:
    """The bugs of :data:`BUGS` that change ``output`` (y, saved_mean, saved_invstd, running_mean, running_var,
    y_infer, dx, dgamma, dbeta), in the catalogue's order."""
    return tuple(bug for bug, groups in BUGS.items() if any(output in GROUPS[g] for g in groups))
ONE_PASS = "one-pass-variance"
#: numerical recipes (not bugs: policy options a kernel may choose) that a bug may come on top of, in words
RECIPES: dict[str, str] = {ONE_PASS: "one-pass variance"}


def _recipe_stats(x: np.ndarray, recipe: str) -> tuple[np.ndarray, np.ndarray]:
    """The batch mean and biased variance as ``recipe`` computes them: one-pass, E[x²] − E[x]² with fp32 sums
    (numpy's pairwise order), floored at 0."""
    if recipe != ONE_PASS:
        raise BNProbeError(f"unknown recipe {recipe!r}")
    ax, r = reduce_axes(x), x.size // x.shape[1]
    x32 = x.astype(np.float32)
    mean = x32.sum(axis=ax, dtype=np.float32) / np.float32(r)
    var = np.maximum((x32 * x32).sum(axis=ax, dtype=np.float32) / np.float32(r) - mean * mean, np.float32(0))
    return mean.astype(np.float64), var.astype(np.float64)


def _once(memo: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """``memo[key]``, made by ``make()`` the first time."""
    if key not in memo:
        memo[key] = make()
    return memo[key]


class Outputs(Mapping[str, np.ndarray]):
    """A model's outputs, each formed when first read and kept: a check reads one group's outputs, so the
    elementwise others (y, y_infer, dx: a pass over the call each) are not formed for it.  Each is formed under
    the floating-point error handling in force when the model was made, as if it had been formed then."""

    def __init__(self, make: dict[str, Callable[[], np.ndarray]]) -> None:
        self._make, self._done, self._err = make, {}, np.geterr()

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._done:
            make = self._make[key]  # (KeyError for an output the model has not)
            with np.errstate(**self._err):
                self._done[key] = make()
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)

    def held_bytes(self) -> int:
        """The bytes of the outputs formed so far."""
        return sum(np.asarray(v).nbytes for v in self._done.values())


def _cached(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``, called once on first need."""
    box: list[Any] = []
    return lambda: box[0] if box else (box.append(make()) or box[0])


def model(call: BNCall, *, bug: str | None = None, saved: tuple[np.ndarray, np.ndarray] | None = None,
          recipe: str | None = None, convention: str = "torch", shared: dict[Any, np.ndarray] | None = None) -> Outputs:
    """BatchNorm in FP64 (NC... layout) of ``call`` (x, γ, β, the running statistics and dy float64 arrays, a
    float momentum), correct or with one bug from BUGS; the call's ``training=False``: the backward
    is that of inference (normalised with the running statistics); ``saved`` (mean, invstd): the training
    backward from these statistics, as a kernel's backward takes what its forward stored; ``recipe`` (of
    :data:`RECIPES`): the batch statistics computed that way (the bug on top of that recipe).  ``convention``
    (:mod:`bnprobe.core.conventions`): correct is that framework's running variance; the bug ``biased-running-var`` is
    the other one (in a biased convention, the unbiased variance).  ``shared``: a dict the caller keeps for one
    call's inputs, across bugs, holding what no bug changes (the batch statistics of each recipe, Σdy): computed
    once, the same values.  The outputs are formed when read (:class:`Outputs`), from the inputs as they are then:
    a caller changing ``x`` or ``dy`` in place must read what it needs first (none does)."""
    if bug is not None and bug not in BUGS:
        raise BNProbeError(f"unknown bug model {bug!r}")
    x, gamma, beta, rm, rv, dy = call.x, call.gamma, call.beta, call.running_mean, call.running_var, call.dy
    momentum, eps, training = call.momentum, call.eps, call.training
    if bug == EPS_IGNORED:
        eps = EPS  # the layer's ε replaced by BatchNorm's default
    ax, n = reduce_axes(x), x.ndim
    r = x.size // x.shape[1]
    col = lambda v: channel_column(v, n)  # noqa: E731
    memo = {} if shared is None else shared
    mean, var = (v.copy() for v in _once(memo, ("stats", recipe), lambda: (x.mean(axis=ax), x.var(axis=ax))
                                         if recipe is None else _recipe_stats(x, recipe)))  # (per channel: copies)
    unbiased = var * r / (r - 1) if r > 1 else np.full_like(var, np.nan)

    def rstd_of(v: np.ndarray) -> np.ndarray:
        if bug == EPS_ON_SIGMA:
            return 1 / (np.sqrt(v) + eps)
        if bug == EPS_MISSING:
            return 1 / np.sqrt(v)
        if bug == EPS_MAX:
            return 1 / np.sqrt(np.maximum(v, eps))
        if bug == SQRT_MISSING:
            return 1 / (v + eps)
        return 1 / np.sqrt(v + eps)

    def y_of(m: np.ndarray, rs: np.ndarray) -> np.ndarray:
        p, q = (beta, gamma) if bug == SWAPPED else (gamma, beta)
        if _compiled(x, per_channel=(m, rs, p, q)):  # the same operations in one compiled pass
            from bnprobe.compiled.rules import affine_y

            return affine_y(x, None, None, gamma * rs, beta) if bug == NO_CENTER else affine_y(x, m, rs, p, q)
        if bug == NO_CENTER:
            return col(gamma * rs) * x + col(beta)
        xh = (x - col(m)) * col(rs)
        return col(p) * xh + col(q)

    m_t, v_t = (rm, rv) if bug == TRAIN_RUNNING else (mean, unbiased if bug == UNBIASED else var)
    rstd = rstd_of(v_t)
    biased = (get_convention(convention).running_var == "biased") != (bug == BIASED_RUNNING)
    batch_var = (var if biased else unbiased) + (eps if bug == PLUS_EPS else 0.0)
    if bug == KERAS:
        new_rm, new_rv = momentum * rm + (1 - momentum) * mean, momentum * rv + (1 - momentum) * batch_var
    elif bug == NOT_UPDATED:
        new_rm, new_rv = rm, rv
    else:
        new_rm, new_rv = (1 - momentum) * rm + momentum * mean, (1 - momentum) * rv + momentum * batch_var
    mi, vi = (mean, var) if bug == INFER_BATCH else (rm, rv)
    if training and saved is not None:
        m_b, rs_b = np.asarray(saved[0], dtype=np.float64), np.asarray(saved[1], dtype=np.float64)
        v_b = 1 / (rs_b * rs_b) - eps
    elif training:
        m_b, v_b, rs_b = m_t, v_t, rstd
    else:  # y = γ·(x - rm)·rstd(rv) + β: the statistics are constants
        m_b, v_b = rm, rv
        rs_b = rstd_of(rv)
    sum_dy = _once(memo, "sum_dy", lambda: dy.sum(axis=ax, keepdims=True))
    # the per-channel outputs are copies: a caller writing into one changes no output formed after it
    return Outputs({"y": lambda: y_of(m_t, rstd), "saved_mean": lambda: np.array(m_t),
                    "saved_invstd": lambda: np.array(rstd), "running_mean": lambda: np.array(new_rm),
                    "running_var": lambda: np.array(new_rv), "y_infer": lambda: y_of(mi, rstd_of(vi)),
                    **_gradients(x, dy, gamma, bug=bug, training=training, eps=eps, m_b=m_b, v_b=v_b, rs_b=rs_b,
                                 sum_dy=sum_dy)})


def _gradients(x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, *, bug: str | None, training: bool, eps: float,
               m_b: np.ndarray, v_b: np.ndarray, rs_b: np.ndarray, sum_dy: np.ndarray,
               ) -> dict[str, Callable[[], np.ndarray]]:
    """dx, dgamma and dbeta of :func:`model`, each formed when asked, from the statistics the backward takes."""
    ax, r = reduce_axes(x), x.size // x.shape[1]
    col = lambda v: channel_column(v, x.ndim)  # noqa: E731
    xh_b = _cached(lambda: _xhat(x, m_b, rs_b))

    def parameters() -> tuple[np.ndarray, np.ndarray]:
        dbeta = sum_dy.reshape(-1).copy()
        dgamma = {DG_NO_RSTD: lambda: (dy * (x - col(m_b))).sum(axis=ax), DG_X: lambda: (dy * x).sum(axis=ax),
                  DG_MEAN: lambda: (dy * xh_b()).mean(axis=ax)}.get(bug, lambda: (dy * xh_b()).sum(axis=ax))()
        if bug == DB_MEAN:
            dbeta = dy.mean(axis=ax)
        return (dbeta, dgamma) if bug == DG_DB_SWAPPED else (dgamma, dbeta)

    def dx() -> np.ndarray:
        factor = {DX_NO_SQRT: gamma / (v_b + eps), SEED: gamma / (v_b + eps), DX_NO_GAMMA: rs_b}.get(bug,
                                                                                                     gamma * rs_b)
        if not training:
            return col(factor) * dy
        z = x if bug in (DX_X, SEED) else x - col(m_b) if bug == DX_CENTERED else xh_b()
        t1 = 0.0 if bug == DROP_MEAN else sum_dy / (1 if bug == SUM_DY else r)
        t2 = 0.0 if bug == DROP_XHAT else (dy * z).sum(axis=ax, keepdims=True) / (1 if bug == SUM_DY_XHAT else r)
        sign = 1.0 if bug == PLUS_XHAT else -1.0
        if _compiled(dy, z, per_channel=(factor, t1, t2)):  # the same operations in one compiled pass
            from bnprobe.compiled.rules import affine_dx

            return affine_dx(dy, z, factor, t1, t2, sign)
        return col(factor) * (dy - t1 + sign * z * t2)

    params = _cached(parameters)
    return {"dx": dx, "dgamma": lambda: np.array(params()[0]), "dbeta": lambda: np.array(params()[1])}


def _compiled(*arrays: np.ndarray, per_channel: tuple[Any, ...] = ()) -> bool:
    """Whether an elementwise expression of a model takes one compiled pass: large C-contiguous float64 (N, C, ...)
    arrays of one shape, each of the ``per_channel`` vectors one value per channel or one for all (numpy would
    broadcast other lengths against a single channel), and no floating-point error to raise or warn of (the pass
    signals none; the doctor's models ignore them)."""
    a = arrays[0]
    return a.ndim > 1 and jit_for(a.size) and set(np.geterr().values()) == {"ignore"} and \
        all(isinstance(b, np.ndarray) and b.shape == a.shape and b.dtype == np.float64 and b.flags.c_contiguous
            for b in arrays) and all(np.size(v) in (1, a.shape[1]) for v in per_channel)


def _xhat(x: np.ndarray, m: np.ndarray, rs: np.ndarray) -> np.ndarray:
    """x̂ = (x - m) * rs per channel: numpy's expression, or the same operations in one compiled pass (a large
    call: :func:`_compiled`)."""
    if _compiled(x, per_channel=(m, rs)):
        from bnprobe.compiled.rules import affine_y

        return affine_y(x, m, rs, 1.0, -0.0)
    return (x - channel_column(m, x.ndim)) * channel_column(rs, x.ndim)


def describe(bug: str, convention: str = "torch") -> str:
    """A bug's id in words, relative to ``convention`` (whose running variance is correct)."""
    conv = get_convention(convention)
    if bug == BIASED_RUNNING and conv.running_var == "biased":
        return f"running_var updated with the unbiased variance (× R/(R-1), torch's convention, not {conv.name}'s)"
    return TEXT[bug]


#: what a bug may be instead: another framework's convention (said once, beside the finding)
CONVENTION_HINTS: dict[str, str] = {
    BIASED_RUNNING: "flax, Keras and Paddle update the running variance with the biased variance by convention: "
                    "if the kernel follows one of them, --convention names it (then it is not a bug)",
    KERAS: "flax, Keras, Paddle and MindSpore's nn.BatchNorm2d spell momentum as the old value's weight (k = 1 - m); "
           "bnprobe hands every kernel m, the batch's weight, so an adapter of such a framework must pass it 1 - m",
}


def running_item(convention: str = "torch") -> str:
    """The checklist item of the running statistics in ``convention``'s words."""
    conv = get_convention(convention)
    if conv.name == "torch":
        return CHECKS["running"][0]
    return f"running statistics: {conv.name}'s convention, {conv.running_var} running_var"


"""SyncBatchNorm on one machine: the whole batch in, split along N into ranks, per-rank statistics merged.

``syncbn`` receives the concatenated batch of every rank, splits it along N into ranks of given sizes
(``ranks=3+8+5``; unequal sizes allowed) or into ``world=K`` nearly equal contiguous ranks (default two
halves), computes each rank's partial statistics in the compute format (fp32 for fp16, bf16 and fp32 inputs,
as PyTorch does; fp64 for fp64), exchanges them through an all-reduce / all-gather whose values are rounded
to the ``reduce`` format (fp32, fp16 or bf16; default the compute format) and summed in it in rank order,
merges them by one of the variants real implementations use, and normalises every rank's slice with the
merged statistics:

``chan``        PyTorch's SyncBatchNorm (``batch_norm_stats`` per rank, all-gather of mean, invstd and count,
                ``batch_norm_gather_stats_with_counts``): each rank's variance recovered as 1/invstd² − ε and
                the ranks' (count, mean, M2) merged one after the other by Chan, Golub & LeVeque's formula,
                exactly as the CUDA kernel's loop orders its operations.
``sums``        all-reduced Σx, Σx² and counts, var = E[x²] − E[x]² (Keras' SyncBatchNormalization); not
                clamped, so it cancels when mean² ≫ var.
``unweighted``  the average of the rank means and of the rank variances, counts ignored: wrong for unequal
                ranks (the mean) and whenever the rank means differ (the variance misses their spread).

Per rank the mean and biased variance are two-pass pairwise sums in the compute format (PyTorch's CUDA
kernel uses Welford: the same value up to the compute format's rounding); ``sums`` forms Σx and Σx² by
pairwise sums.  The elementwise steps follow PyTorch's kernels with every operation rounded to the compute
format (no FMA contraction): y = γ·(x − mean)·invstd + β, and the running statistics are updated as
``batch_norm_gather_stats_with_counts`` does, with the unbiased variance over the global count.

Backward is SyncBatchNorm's: per rank Σdy and Σdy·(x − mean) (``batch_norm_backward_reduce``), all-reduced
in the ``reduce`` format, then dx = (dy − Σdy/n − (x − mean)·invstd²·Σdy(x − mean)/n)·γ·invstd with n the
global count (``batch_norm_backward_elemt``).  dγ and dβ are the ranks' partial sums all-reduced in the same
format (what plain BatchNorm on the whole batch computes); each rank's own partials are in the backward's
``meta`` (``rank_dgamma``, ``rank_dbeta``): PyTorch's SyncBatchNorm returns those and leaves the sum to DDP.

:func:`rank_recordings` turns one call into the per-rank :class:`~bnprobe.recordings.Recording` s a real
multi-rank run would dump, for ``step*/rank*/`` dump folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bnprobe.core.call import BNCall
from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    ForwardOutput,
    Prepared,
    Saved,
    params_format,
    stored_inputs,
)
from bnprobe.core.errors import BNProbeError
from bnprobe.core.tolerances import accumulation_format
from bnprobe.core.formats import get_format
from bnprobe.kernels.layout import layout_of
from bnprobe.numerics.arith import Arith
from bnprobe.numerics.reduce import reduce_sum
from bnprobe.numerics.rounding import round_to
from bnprobe.numerics.variance import MomentsMethod, moments
from bnprobe.recordings import Recording

__all__ = ["MERGES", "REDUCE_FORMATS", "GRADS", "SyncBNAdapter", "split_ranks", "compute_format",
           "rank_recordings"]

MERGES = ("chan", "sums", "unweighted")
REDUCE_FORMATS = ("fp32", "fp16", "bf16")
GRADS = ("local", "reduced")  # the dγ/dβ a rank's recording holds: its own partials, or the sum over ranks
_OPTIONS = ("ranks", "world", "merge", "reduce")


def compute_format(dtype: str) -> str:
    """The format SyncBatchNorm computes statistics in for inputs in ``dtype``: fp64 for fp64, else fp32 (the
    accumulation format of :mod:`bnprobe.core.tolerances`)."""
    return accumulation_format(dtype)


def split_ranks(batch: int, ranks: tuple[int, ...] | None = None, world: int = 2) -> tuple[int, ...]:
    """The samples of each rank for a batch of ``batch``: ``ranks`` checked against the batch, or ``world``
    nearly equal contiguous parts (equal when ``world`` divides the batch)."""
    if ranks is not None:
        if sum(ranks) != batch:
            raise BNProbeError(f"ranks {'+'.join(map(str, ranks))} add up to {sum(ranks)} samples but x has a "
                               f"batch of {batch}")
        return tuple(ranks)
    if world > batch:
        raise BNProbeError(f"a batch of {batch} does not split into {world} ranks of at least one sample")
    bounds = [round(i * batch / world) for i in range(world + 1)]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def _parse(options: str) -> dict[str, Any]:
    """``ranks=3+8+5,merge=...,reduce=...`` (or ``world=K``) as SyncBNAdapter's keyword arguments."""
    opts: dict[str, str] = {}
    for item in filter(None, (o.strip() for o in options.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise BNProbeError(f"syncbn option {item!r} is not key=value")
        opts[k.strip()] = v.strip()
    unknown = [k for k in opts if k not in _OPTIONS]
    if unknown:
        raise BNProbeError(f"unknown syncbn option(s) {', '.join(unknown)}; valid: {', '.join(_OPTIONS)}")
    out: dict[str, Any] = {k: opts[k] for k in ("merge", "reduce") if k in opts}
    try:
        if "ranks" in opts:
            out["ranks"] = tuple(int(s) for s in opts["ranks"].split("+"))
        if "world" in opts:
            out["world"] = int(opts["world"])
    except ValueError:
        raise BNProbeError("syncbn takes ranks=N+N+... (samples per rank, e.g. ranks=3+8+5) and world=K (a number "
                           f"of equal ranks); got {options!r}") from None
    return out


class SyncBNAdapter(BaseAdapter):
    """``syncbn[:ranks=3+8+5|world=K,merge=chan|sums|unweighted,reduce=fp32|fp16|bf16]``: SyncBatchNorm
    emulated over ranks that are splits of the batch (see the module notes)."""

    def __init__(self, ranks: tuple[int, ...] | None = None, *, world: int | None = None, merge: str = "chan",
                 reduce: str | None = None) -> None:
        if ranks is not None and world is not None:
            raise BNProbeError("give the rank sizes (ranks=3+8+5) or a number of equal ranks (world=K), not both")
        if ranks is not None and (not ranks or any(int(r) < 1 for r in ranks)):
            raise BNProbeError(f"every rank needs at least one sample; got ranks={'+'.join(map(str, ranks))}")
        if world is not None and int(world) < 1:
            raise BNProbeError(f"world must be >= 1, got {world}")
        if merge not in MERGES:
            raise BNProbeError(f"unknown merge {merge!r}; valid: {', '.join(MERGES)}")
        if reduce is not None and reduce not in REDUCE_FORMATS:
            raise BNProbeError(f"the all-reduce format must be one of {', '.join(REDUCE_FORMATS)}, got {reduce!r}")
        self.ranks = None if ranks is None else tuple(int(r) for r in ranks)
        self.world = 2 if world is None and ranks is None else (None if world is None else int(world))
        self.merge, self.reduce = merge, reduce
        opts = [f"ranks={'+'.join(map(str, self.ranks))}" if self.ranks else "",
                f"world={world}" if world is not None else "", f"merge={merge}" if merge != "chan" else "",
                f"reduce={reduce}" if reduce else ""]
        self.name = "syncbn" + (":" + ",".join(o for o in opts if o) if any(opts) else "")

    @classmethod
    def from_options(cls, options: str = "") -> SyncBNAdapter:
        """The adapter a spec's options name (the text after ``syncbn:``)."""
        return cls(**_parse(options))

    def capabilities(self) -> Capabilities:
        return Capabilities(formats=("fp64", "fp32", "fp16", "bf16"), saved="invstd")

    def sizes(self, batch: int) -> tuple[int, ...]:
        """The samples of each rank for a batch of ``batch`` (a one-line error when they do not fit it)."""
        try:
            return split_ranks(batch, self.ranks, self.world or 2)
        except BNProbeError as exc:
            raise BNProbeError(f"adapter {self.name}: {exc}") from None

    def _setup(self, p: Prepared) -> _Setup:
        comp = compute_format(p.dtype)
        sizes = self.sizes(p.lay.shape[0])
        per = p.lay.reduce_size // p.lay.shape[0]  # values per sample and channel (the spatial size)
        edges = np.cumsum((0, *sizes)) * per
        cols = tuple(slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]))
        return _Setup(Arith(comp), Arith(self.reduce or comp), cols, sizes, p.lay.to_cr(p.x))

    def _meta(self, s: _Setup) -> dict[str, Any]:
        return {"ranks": s.sizes, "merge": self.merge, "reduce": s.red.fmt.name, "compute": s.comp.fmt.name}

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        s = self._setup(p)
        st = _MERGE[self.merge](s, eps)
        g, b = _affine(p, s.comp)
        y = _cast(p.lay.from_cr(_normalise(s.x, st.mean, st.invstd, g, b, s.comp)), p.dtype)
        sd = s.comp.fmt.dtype
        rm, rv = p.vectors["running_mean"], p.vectors["running_var"]
        run_m = run_v = None
        if rm is not None and rv is not None:
            run_m, run_v = _running(s.comp, rm, rv, st, 1.0 if momentum is None else momentum, p.params)
        return ForwardOutput(y, Saved(st.mean.astype(sd), "invstd", st.invstd.astype(sd)), run_m, run_v,
                             meta=self._meta(s))

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        s = self._setup(p)
        comp = s.comp
        mean = comp.round(p.vectors["running_mean"])
        inv = _invstd(comp, comp.round(p.vectors["running_var"]), eps)
        g, b = _affine(p, comp)
        y = _cast(p.lay.from_cr(_normalise(s.x, mean, inv, g, b, comp)), p.dtype)
        return ForwardOutput(y, meta=self._meta(s))

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        s = self._setup(p)
        comp, red = s.comp, s.red
        mean, inv = comp.round(saved.mean), comp.round(saved.invstd(eps))
        g = comp.round(p.vectors["gamma"])
        dycr = p.lay.to_cr(dy)
        xmu = comp.sub(s.x, mean[:, None])
        sum_dy = [reduce_sum(dycr[:, c], comp) for c in s.cols]  # batch_norm_backward_reduce, per rank
        sum_dy_xmu = [reduce_sum(comp.mul(dycr[:, c], xmu[:, c]), comp) for c in s.cols]
        grad_scale = comp.mul(g, inv)
        if training:  # the all-reduce, then batch_norm_backward_elemt with the global count
            norm = comp.round(1.0 / s.x.shape[1])
            mean_dy = comp.mul(_all_reduce(sum_dy, red), norm)
            proj = comp.mul(comp.mul(comp.mul(inv, inv), _all_reduce(sum_dy_xmu, red)), norm)
            d = comp.sub(comp.sub(dycr, mean_dy[:, None]), comp.mul(xmu, proj[:, None]))
        else:  # the statistics are constants: nothing crosses ranks but the parameters' gradients
            d = dycr
        dx = _cast(p.lay.from_cr(comp.mul(d, grad_scale[:, None])), p.dtype)
        dgamma = [comp.mul(v, inv) for v in sum_dy_xmu]
        meta = {**self._meta(s), "rank_dgamma": tuple(_cast(v, p.params) for v in dgamma),
                "rank_dbeta": tuple(_cast(v, p.params) for v in sum_dy)}
        return BackwardOutput(dx, _cast(_all_reduce(dgamma, red), p.params), _cast(_all_reduce(sum_dy, red), p.params),
                              meta=meta)


# ---- the numerics -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Setup:
    """One call: the compute and all-reduce arithmetic, each rank's columns of x as (C, R), the ranks' sizes."""

    comp: Arith
    red: Arith
    cols: tuple[slice, ...]
    sizes: tuple[int, ...]
    x: np.ndarray  # (C, R) float64, values of the input format


@dataclass(frozen=True)
class _Merged:
    """Merged statistics in the compute format: mean, invstd, and the unbiased variance the running update takes."""

    mean: np.ndarray
    invstd: np.ndarray
    unbiased: np.ndarray


def _cast(v: np.ndarray, fmt: str) -> np.ndarray:
    """Compute-format values stored in ``fmt``, in its own numpy dtype (one correct rounding)."""
    with np.errstate(all="ignore"):
        return round_to(v, fmt, dtype=get_format(fmt).dtype)


def _all_reduce(values: list[np.ndarray], red: Arith) -> np.ndarray:
    """Σ values in the all-reduce format, each rounded to it first, added in rank order."""
    total = red.round(values[0])
    for v in values[1:]:
        total = red.add(total, red.round(v))
    return total


def _invstd(comp: Arith, var: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(var + ε), each operation rounded in the compute format (NaN where var + ε < 0)."""
    with np.errstate(invalid="ignore"):
        return comp.div(np.ones_like(var), comp.sqrt(comp.add(var, comp.round(eps))))


def _rank_moments(s: _Setup) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each rank's (mean, biased variance): two-pass pairwise sums in the compute format."""
    out = []
    for c in s.cols:
        m = moments(s.x[:, c], s.comp, MomentsMethod(algorithm="two_pass", order="pairwise"), wide_sums=False)
        out.append((np.asarray(m.mean, dtype=np.float64), np.asarray(m.var, dtype=np.float64)))
    return out


def _unbiased(comp: Arith, var: np.ndarray, n: float | np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return comp.mul(var, comp.round(np.asarray(n, dtype=np.float64) / (np.asarray(n, dtype=np.float64) - 1)))


def _merge_chan(s: _Setup, eps: float) -> _Merged:
    """batch_norm_gather_stats_with_counts: the gathered (mean, invstd, count) merged rank after rank."""
    comp, red = s.comp, s.red
    e = comp.round(eps)
    c = s.x.shape[0]
    avg, var_n, n = np.zeros(c), np.zeros(c), np.zeros(c)
    with np.errstate(all="ignore"):
        for (m_r, v_r), size in zip(_rank_moments(s), (cs.stop - cs.start for cs in s.cols)):
            m, inv, cnt = red.round(m_r), red.round(_invstd(comp, v_r, eps)), red.round(np.full(c, float(size)))
            v = comp.div(np.ones(c), inv)
            v = comp.mul(comp.sub(comp.mul(v, v), e), cnt)
            factor = comp.div(np.ones(c), comp.add(n, cnt))
            d = comp.sub(avg, m)
            var_n = comp.add(var_n, comp.add(v, comp.mul(comp.mul(comp.mul(comp.mul(d, d), n), cnt), factor)))
            avg = comp.add(comp.mul(comp.mul(n, factor), avg), comp.mul(comp.mul(cnt, factor), m))
            n = comp.add(n, cnt)
        inv_all = comp.div(np.ones(c), comp.sqrt(comp.add(comp.div(var_n, n), e)))
        return _Merged(avg, inv_all, comp.div(var_n, comp.sub(n, np.ones(c))))


def _merge_sums(s: _Setup, eps: float) -> _Merged:
    """All-reduced Σx, Σx² and counts; var = E[x²] − E[x]² (not clamped)."""
    comp, red = s.comp, s.red
    c = s.x.shape[0]
    total = _all_reduce([reduce_sum(s.x[:, cs], comp) for cs in s.cols], red)
    squares = _all_reduce([reduce_sum(comp.mul(s.x[:, cs], s.x[:, cs]), comp) for cs in s.cols], red)
    n = _all_reduce([np.full(c, float(cs.stop - cs.start)) for cs in s.cols], red)
    with np.errstate(all="ignore"):
        mean = comp.div(total, n)
        var = comp.sub(comp.div(squares, n), comp.mul(mean, mean))
    return _Merged(mean, _invstd(comp, var, eps), _unbiased(comp, var, n))


def _merge_unweighted(s: _Setup, eps: float) -> _Merged:
    """The average of the rank means and of the rank variances, counts ignored."""
    comp, red = s.comp, s.red
    parts = _rank_moments(s)
    k = comp.round(float(len(parts)))
    mean = comp.div(_all_reduce([m for m, _ in parts], red), k)
    var = comp.div(_all_reduce([v for _, v in parts], red), k)
    return _Merged(mean, _invstd(comp, var, eps), _unbiased(comp, var, float(s.x.shape[1])))


_MERGE = {"chan": _merge_chan, "sums": _merge_sums, "unweighted": _merge_unweighted}


def _affine(p: Prepared, comp: Arith) -> tuple[np.ndarray, np.ndarray]:
    return comp.round(p.vectors["gamma"]), comp.round(p.vectors["beta"])


def _normalise(x: np.ndarray, mean: np.ndarray, inv: np.ndarray, g: np.ndarray, b: np.ndarray,
               comp: Arith) -> np.ndarray:
    """γ·(x − mean)·invstd + β on (C, R) values, each operation rounded in the compute format (the caller
    casts to the output format)."""
    with np.errstate(all="ignore"):
        t = comp.mul(g[:, None], comp.sub(x, mean[:, None]))
        return comp.add(comp.mul(t, inv[:, None]), b[:, None])


def _running(comp: Arith, rm: np.ndarray, rv: np.ndarray, st: _Merged, momentum: float,
             params: str) -> tuple[np.ndarray, np.ndarray]:
    """(1 − m)·running + m·batch in the compute format, stored in the parameter format."""
    keep, f = comp.round(1.0 - momentum), comp.round(momentum)
    with np.errstate(all="ignore"):
        out = [comp.add(comp.mul(keep, comp.round(old)), comp.mul(f, new)) for old, new in
               ((rm, st.mean), (rv, st.unbiased))]
    return _cast(out[0], params), _cast(out[1], params)


# ---- per-rank recordings ------------------------------------------------------------------------------

def rank_recordings(adapter: SyncBNAdapter | str, whole: BNCall, *, grads: str = "local",
                    call: str = "SyncBatchNorm.0") -> dict[int, Recording]:
    """Rank → the :class:`Recording` that rank would dump of one SyncBatchNorm call, ``whole`` (its tensors as given,
    rounded here to its dtype and parameter format; γ None: ones, β None: zeros) on the batch x split by
    ``adapter`` (a :class:`SyncBNAdapter` or its spec, ``syncbn:ranks=3+8+5,...``): its slice of x, the
    shared γ, β and running statistics in; its slice of y, the saved (global) statistics and the updated running
    statistics out; with dy, a backward of its slices of dy and dx and dγ, dβ: its own partial sums
    (``grads="local"``, what SyncBatchNorm's backward returns and capture / msprobe record) or their sum over
    the ranks (``"reduced"``, the parameters' gradient of the whole batch).  ``call`` names the call in the
    recordings."""
    if grads not in GRADS:
        raise BNProbeError(f"grads must be one of {', '.join(GRADS)}, got {grads!r}")
    a = adapter if isinstance(adapter, SyncBNAdapter) else \
        SyncBNAdapter.from_options(adapter.removeprefix("syncbn").removeprefix(":"))
    dtype, params, layout, eps, momentum = whole.dtype, whole.params, whole.layout, whole.eps, whole.momentum
    fmt, pf = get_format(dtype).name, params_format(dtype, params)
    c = layout_of(whole.x, layout).channels
    xs, dys, g, b, rm, rv = stored_inputs(dtype, params, whole.x, whole.dy,
                                          np.ones(c) if whole.gamma is None else whole.gamma,
                                          np.zeros(c) if whole.beta is None else whole.beta, whole.running_mean,
                                          whole.running_var)
    step = BNCall(xs, g, b, rm, rv, dys, eps=eps, momentum=momentum, dtype=fmt, params=params, layout=layout)
    out = a.train(step)
    bw = None if dys is None else a.backward_of(step, out.saved)  # type: ignore[arg-type]
    sizes = a.sizes(np.shape(xs)[0])
    sf = compute_format(fmt)
    recs: dict[int, Recording] = {}
    for r, (lo, hi) in enumerate(zip(np.cumsum((0, *sizes))[:-1], np.cumsum(sizes))):
        rec = Recording(a.name, fmt, pf, layout, eps, momentum, "invstd",
                        meta={"training": True, "call": call, "rank": r, "world_size": len(sizes),
                              "ranks": list(sizes), "merge": a.merge, "grads": grads})
        ins = [("x", xs[lo:hi], fmt), ("gamma", g, pf), ("beta", b, pf)]
        ins += [] if rm is None else [("running_mean", rm, pf), ("running_var", rv, pf)]
        outs = [("y", out.y[lo:hi], fmt), ("saved_mean", out.saved.mean, sf), ("saved_value", out.saved.value, sf)]
        outs += [] if out.running_mean is None else [("running_mean_out", out.running_mean, pf),
                                                     ("running_var_out", out.running_var, pf)]
        _put(rec, "train", "inputs", ins)
        _put(rec, "train", "outputs", outs)
        if bw is not None:
            _put(rec, "backward", "inputs", [("dy", dys[lo:hi], fmt), ("x", xs[lo:hi], fmt), ("gamma", g, pf),
                                             ("saved_mean", out.saved.mean, sf), ("saved_value", out.saved.value, sf)])
            local = grads == "local"
            _put(rec, "backward", "outputs", [
                ("dx", bw.dx[lo:hi], fmt), ("dgamma", bw.meta["rank_dgamma"][r] if local else bw.dgamma, pf),
                ("dbeta", bw.meta["rank_dbeta"][r] if local else bw.dbeta, pf)])
        recs[r] = rec
    return recs


def _put(rec: Recording, mode: str, io: str, items: list[tuple[str, Any, str]]) -> None:
    """Store (name, values, format) items as a recording's ``mode`` ``io`` tensors."""
    for name, v, f in items:
        rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = np.asarray(v, dtype=np.float64)
        rec.formats[f"{mode}.{io}.{name}"] = f

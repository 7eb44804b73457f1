"""Watch a whole training run: per step, layer and channel statistics of every BatchNorm call, and the anomalous
call dumped when it happens.

``with monitor(model, "runs/mon") as mon: ... mon.step()`` hooks every BatchNorm module of ``model`` (the set
:func:`bnprobe.capture` hooks: BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*).  Per call it computes, on the
tensor's device and in its own dtype (the batch statistics from the ones the kernel saved), a few numbers per
channel: the batch mean and variance, invstd, the running statistics after the update, the minimum and maximum of
x and y, the counts of NaN, ±inf, values at the format's largest finite magnitude, subnormals and zeros in x, y and
(when the backward runs) dx, NaN and ±inf in dy, and the gradient's Σdy and Σdy·x̂; a call's numbers reach the host
in one transfer per forward and one per backward (its checks read them there).  Each ``mon.step()`` appends
the step's rows as one Parquet file of the folder ``OUT/monitor.parquet/`` (written by a thread of the monitor while
the training goes on, whole, then renamed; an exception leaving the ``with`` block still writes every step, a process
killed outright loses the step in progress and the few not yet written:
:mod:`bnprobe.recordings.monitor_writer`; ``pandas.read_parquet`` reads the folder as one table)::

    OUT/monitor.parquet/step-<k>.parquet   one file per step: step, rank, layer, call, channel, dtype, ...
    OUT/anomalies.csv                      one row per anomaly: first and last step, count, layer, reason, its dump
    OUT/anomalies/step-<k>/                the anomalous calls of step k as a model dump (bnprobe-calls.json)
    OUT/family.parquet/step-<k>.parquet    the family's calls (below): step, rank, layer, call, norm, row, ...

An anomaly: non-finite values in x, y, dy or dx; values at the format's maximum (saturation) or y overflowing
where x is finite; a training call's batch variance at or below ``var_floor``·ε, or negative; invstd beyond
1/√ε or not positive; running statistics that are not the update of the batch's by the momentum (past a few
units of the parameter format's rounding); a user ``predicate``.  An anomaly is known by its layer, its call (the
k-th of the layer in a step) and its reason without the channels (a predicate's: its text); it goes on while it is
seen at each step (with ``every`` > 1: at each measured step, the steps between check x and y for NaN/inf only), and
one that stops and comes back is a new one.  A persistent anomaly — NaN weights after one NaN batch — is listed once
in anomalies.csv with its first and last step and the number of steps it was seen (the file is rewritten whole at
each step that saw an anomaly, so a killed process leaves a complete one), and dumped once, at its first step: a call
is dumped when one of its anomalies is new, so ``max_dumps`` stays for new anomalies (another layer, another reason).
The call's inputs, outputs and its backward in the same step are written as a bnprobe model dump that every command
replays (``dump:OUT/anomalies/step-<k>``); one call's tensors are held at a time (a call awaiting its backward is
spilled to its folder), ``max_dumps`` bounds how many calls are dumped in the run.  Under torch.distributed with
more than one rank, each rank writes the same layout under ``OUT/rank<r>/``.

The normalisation family's modules are watched too (the set :func:`bnprobe.capture` records: LayerNorm, RMSNorm,
GroupNorm, InstanceNorm without running statistics, Hugging Face-style RMSNorm;
:mod:`bnprobe.recordings.family_modules`), per row of the call's ``(rows, R)`` view — a token for LayerNorm and
RMSNorm, a sample's group or channel for GroupNorm and InstanceNorm — in ``OUT/family.parquet/``: the row's exact mean
and variance (RMSNorm: mean square), the rstd the kernel saved, x's and y's (and the backward's dx's) minimum, maximum
and counts as above, NaN and ±inf in dy, and ``y_err`` and ``stats_err``: the largest |kernel − FP64 golden| over the
row as a fraction of what a correct kernel can err by (:mod:`bnprobe.recordings.monitor_family`). An anomaly there:
non-finite values or saturation as for BatchNorm, named by row; y or the saved statistics beyond a correct kernel's
bound of the golden (above 1); a ``predicate`` (given the row's arrays and ``norm``). Its dump carries the call's
layer (norm, normalized_shape, groups, weight_offset) and replays as that layer's call. BatchNorm's variance floor and
running-statistics checks have no counterpart: a row of equal values is no error for LayerNorm (a zero padding
embedding), the check against the golden says whether the kernel got its statistics right, and the family keeps no
running statistics.

torch and pyarrow (through pandas) are imported only when a monitor starts.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.compiled.jit import jit_mode
from bnprobe._files import atomic_write_text, dumps_json
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.recordings.bnprobe_dump import write_dump
from bnprobe.recordings.monitor_profile import FIELDS, dims, finish, nan_inf, one_pass, profile_tensor, reductions
from bnprobe.recordings.capture import (
    BN_NODES,
    COMPILED_NODE,
    CapturedCall,
    finish_call,
    finish_family_call,
    momentum_factor,
    outside_graph,
    record_family_node_grads,
    record_grads,
    record_module_grads,
    start_call,
    start_family_call,
)
from bnprobe.recordings.family_modules import FamilyModule, family_module, kernel_node, saved_statistics
from bnprobe.recordings.monitor_family import GOLDEN_COLUMNS, golden_rows
from bnprobe.recordings.monitor_writer import StepWriter
from bnprobe.kernels.layout import NormShape
from bnprobe.recordings.types import CALLS_NAME, CALLS_TAG

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["monitor", "Monitor", "PARQUET_NAME", "FAMILY_PARQUET_NAME", "ANOMALIES_NAME", "COUNTS", "TENSORS"]

PARQUET_NAME = "monitor.parquet"
FAMILY_PARQUET_NAME = "family.parquet"  # the family's rows: one per row of a call's (rows, R) view, not per channel
ANOMALIES_NAME = "anomalies.csv"
ANOMALY_COLUMNS = ("first_step", "last_step", "count", "rank", "layer", "call", "dtype", "phase", "reason", "channels",
                   "dump")
COUNTS = ("nan", "inf", "at_max", "subnormal", "zero")  # per tensor and channel
TENSORS = ("x", "y", "dx")
_SPILL = "forward-spill.npz"
# a row's columns of full-precision figures: lz4 finds little to compress in them
_DENSE = ("batch_mean", "batch_var", "invstd", "running_mean", "running_var", "sum_dy", "sum_dy_xhat")
# a row's columns the backward fills
_LATE = ("dx_min", "dx_max", *(f"dx_{n}" for n in COUNTS), "dy_nan", "dy_inf", "sum_dy", "sum_dy_xhat")
# a family row's columns the backward fills (no Σdy, Σdy·x̂ per row: those are dβ, dγ, per parameter)
_FAMILY_LATE = ("dx_min", "dx_max", *(f"dx_{n}" for n in COUNTS), "dy_nan", "dy_inf")
_UNCOMPRESSED = frozenset(_DENSE + GOLDEN_COLUMNS)  # the columns written without lz4
RUNNING_ULPS = 4  # of the parameter format, and of fp32 for the update's own arithmetic
RUNNING_VAR_SLACK = 1e-4  # relative, of var + ε: the kernel's variance against the one its fp32 invstd gives
# (beyond it, one unit of the format the kernel saved its statistics in: the batch's are read back from them)


@dataclass
class _Pending:
    """A call between its forward and its backward: its per-channel row and what a late dump needs."""

    layer: str
    index: int
    module: Any
    row: dict[str, Any]
    reasons: list[str]
    flags: list[tuple[str, list[int]]]  # each reason's kind (its identity over steps) and its channels or rows
    x: Any = None  # the input tensor (autograd keeps it for the backward anyway)
    x_version: int = 0
    running_in: tuple[Any, Any] | None = None  # the running statistics before the call (tensors)
    running_out: tuple[np.ndarray, np.ndarray] | None = None  # and after it (float64, on the host)
    node: Any = None
    dump: CapturedCall | None = None  # its dump being written (forward anomaly): spilled until the backward
    folder: Path | None = None
    done: bool = False
    forward_reasons: int = 0  # how many of its reasons its forward showed (the rest, its backward)
    unit = "channel"  # what an anomaly's indices count


@dataclass
class _FamilyPending(_Pending):
    """A family call between its forward and its backward: its rows are those of its (rows, R) view."""

    fm: FamilyModule | None = None
    shape: NormShape | None = None
    kind: str | None = None  # its kernel node's name (None: RMSNorm's composite, whose module hook gives dx)
    unit = "row"


@dataclass
class _Step:
    rows: list[dict[str, Any]] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    dumped: list[CapturedCall] = field(default_factory=list)
    family_rows: list[dict[str, Any]] = field(default_factory=list)
    family_pending: list[_FamilyPending] = field(default_factory=list)


def _np(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.detach().to("cpu", dtype=torch.float64).numpy()


def _host(parts: list[torch.Tensor]) -> np.ndarray:
    """Tensors of one length (a call's per-channel numbers, on its device) as the rows of one float64 array, in one
    transfer (their common dtype holds each exactly: float32 for any two of fp16, bf16 and float32)."""
    import torch

    return torch.stack(parts).to("cpu", dtype=torch.float64).numpy()


def _reduce(t: torch.Tensor, jit: str) -> list[torch.Tensor]:
    """What :func:`_profiled` needs of ``t`` from its device: torch's reductions, or nothing where ``t`` is empty or
    profiled in one pass on the host (:mod:`bnprobe.recordings.monitor_profile`)."""
    return [] if t.numel() == 0 or one_pass(t, jit) else reductions(t)


def _profiled(t: torch.Tensor, prefix: str, host: np.ndarray) -> dict[str, np.ndarray]:
    """``t``'s profile as row columns ``<prefix>_min`` ... from ``host``, the rows of :func:`_reduce`'s tensors."""
    if t.numel() == 0:
        nanv, zeros = np.full(t.shape[1], np.nan), np.zeros(t.shape[1])
        return {f"{prefix}_min": nanv, f"{prefix}_max": nanv, **{f"{prefix}_{k}": zeros for k in COUNTS}}
    prof = profile_tensor(t) if not len(host) else finish(t, *host)
    return {f"{prefix}_{k}": prof[k] for k in FIELDS}


def _profile(t: torch.Tensor, prefix: str, jit: str) -> dict[str, np.ndarray]:
    """Per channel of ``t`` (channels on dim 1), reduced on its device in its dtype: min, max and the counts
    (:func:`bnprobe.recordings.monitor_profile.finish`).  A large contiguous CPU tensor is profiled in one compiled
    pass instead where ``jit`` (:func:`bnprobe.compiled.jit.jit_mode`) allows."""
    import torch

    with torch.no_grad():
        parts = _reduce(t, jit)
        return _profiled(t, prefix, _host(parts) if parts else np.empty((0, 0)))


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (its global minimum and maximum: NaN and inf show there)."""
    import torch

    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _column(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


def _ulp(v: np.ndarray, dtype: Any) -> np.ndarray:
    """The spacing of the torch dtype's values at |v| (float64)."""
    return get_format(str(dtype)).ulp(v)


class Monitor:
    """The context manager :func:`monitor` returns; see there.  ``anomalies`` lists the anomalies found, one per
    anomaly in the order they first showed (dicts of :data:`ANOMALY_COLUMNS`, an ongoing one's ``last_step`` and
    ``count`` moving on as the run goes; ``reason`` and ``channels`` as at its first step, a family call's
    ``channels`` are its rows), ``dumps`` the dump files written,
    ``steps`` the steps written, ``family_modules`` how many family modules are watched."""

    def __init__(self, model: Any, out: str | Path, *, every: int = 1, capture_on: str = "anomaly",
                 max_dumps: int = 10, predicate: Callable[[dict[str, Any]], str | None] | None = None,
                 var_floor: float = 1.0, force: bool = False) -> None:
        if not isinstance(every, int) or every < 1:
            raise BNProbeError(f"every must be a positive integer, got {every!r}")
        if capture_on not in ("anomaly", "never"):
            raise BNProbeError(f"capture_on must be 'anomaly' or 'never', got {capture_on!r}")
        if not isinstance(max_dumps, int) or max_dumps < 0:
            raise BNProbeError(f"max_dumps must be a non-negative integer, got {max_dumps!r}")
        if predicate is not None and not callable(predicate):
            raise BNProbeError("predicate must be a function of one call's statistics returning a reason or None")
        if not (isinstance(var_floor, (int, float)) and math.isfinite(var_floor) and var_floor >= 0):
            raise BNProbeError(f"var_floor must be a finite number >= 0, got {var_floor!r}")
        self.model, self.root, self.every, self.capture_on = model, Path(out), every, capture_on
        self.max_dumps, self.predicate, self.var_floor, self.force = max_dumps, predicate, float(var_floor), force
        self.out = self.root
        self.rank = 0
        self.anomalies: list[dict[str, Any]] = []
        self.dumps: list[Path] = []
        self.steps: list[int] = []
        self._step_no = 0
        self._step = _Step()
        self._handles: list[Any] = []  # the modules' hooks
        self._node_hooks: list[Any] = []  # the hooks on this step's autograd nodes (they go with the graph)
        self._writer = StepWriter()
        self._before: dict[int, list[tuple[Any, int, Any]]] = {}
        self._counts: dict[str, int] = {}
        self.compiled: list[str] = []  # BatchNorm modules seen running inside a torch.compile'd model
        self._torch: Any = None
        self._entered = False
        self._dumps_made = 0
        self._family_before: dict[int, list[tuple[Any, int]]] = {}
        self._awaiting: dict[int, list[_FamilyPending]] = {}  # an RMSNorm module's calls awaiting its backward hook
        self._open: dict[tuple[str, int, str], int] = {}  # (layer, call, kind) -> its ongoing anomaly in .anomalies
        self._lines: list[str] = []  # each anomaly's line of anomalies.csv
        self._changed: set[int] = set()  # the anomalies seen this step (their lines to render again)
        self.family_modules = 0  # the family modules watched

    # ---- entering ----------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        try:
            import torch
            from torch.nn.modules.batchnorm import _BatchNorm
        except ImportError:
            raise BNProbeError("monitor needs torch (pip install 'bnprobe[torch]')") from None
        try:
            import pyarrow  # noqa: F401 - pandas writes Parquet with it
        except ImportError:
            raise BNProbeError("monitor writes Parquet and needs pyarrow (pip install pyarrow)") from None
        if self._entered:
            raise BNProbeError("a monitor context is entered once; make a new monitor(...) for another run")
        if not isinstance(self.model, torch.nn.Module):
            raise BNProbeError(f"monitor needs a torch.nn.Module, got {type(self.model).__name__}")
        modules = [(path, m) for path, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        family = [(path, m, fm) for path, m in self.model.named_modules()
                  if not isinstance(m, _BatchNorm) and (fm := family_module(m)) is not None]
        if not modules and not family:
            raise BNProbeError(f"{type(self.model).__name__} has no BatchNorm module (a subclass of "
                               "torch.nn.modules.batchnorm._BatchNorm) or LayerNorm, RMSNorm, GroupNorm, InstanceNorm "
                               "module to monitor")
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank = dist.get_rank()
            self.out = self.root / f"rank{self.rank}"
        self._check_out()
        self._torch, self._entered = torch, True
        self._jit = jit_mode()  # whether large CPU tensors are profiled in one compiled pass
        outside = outside_graph(torch)  # (a compiled model's BatchNorm: its forward watched, its backward not)
        try:
            for path, m in modules:
                self._handles.append(m.register_forward_pre_hook(outside(self._pre_hook(path))))
                self._handles.append(m.register_forward_hook(outside(self._post_hook(path))))
            for path, m, fm in family:
                self._handles.append(m.register_forward_pre_hook(outside(self._family_pre_hook()), with_kwargs=True))
                self._handles.append(m.register_forward_hook(outside(self._family_post_hook(path, fm)),
                                                             with_kwargs=True))
                if fm.norm == "rms":  # (RMSNorm's composite has no kernel node: dy and dx from the module's hook)
                    self._handles.append(m.register_full_backward_hook(self._rms_grad_hook()))
        except BaseException:
            self._remove_hooks()
            raise
        self.family_modules = len(family)
        if modules:
            (self.out / PARQUET_NAME).mkdir(parents=True, exist_ok=True)
        if family:
            (self.out / FAMILY_PARQUET_NAME).mkdir(parents=True, exist_ok=True)
        return self

    def _check_out(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise BNProbeError(f"{out} is a file; monitor writes a folder")
        taken = [p for p in (out / PARQUET_NAME, out / FAMILY_PARQUET_NAME, out / ANOMALIES_NAME, out / "anomalies")
                 if p.exists()]
        if taken and not self.force:
            raise BNProbeError(f"{taken[0]} exists; refusing to overwrite a monitor's output (pass force=True, or "
                               "choose another out)")
        for p in taken:  # force: the earlier run's files, and only those
            if p.is_dir():
                for f in sorted(p.rglob("*"), key=lambda q: -len(q.parts)):
                    f.unlink() if f.is_file() else f.rmdir()
                p.rmdir()
            else:
                p.unlink()

    def _remove_hooks(self) -> None:
        for h in self._handles + self._node_hooks:
            h.remove()
        self._handles.clear()
        self._node_hooks.clear()

    # ---- hooks -------------------------------------------------------------------------------------
    def _measure(self) -> bool:
        return self._step_no % self.every == 0

    def _pre_hook(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            rm, rv = module.running_mean, module.running_var
            running = None
            if rm is not None and rv is not None:  # as they were before the call (it updates them in place)
                if rm.dtype == rv.dtype and rm.shape == rv.shape:
                    both = self._torch.stack([rm.detach(), rv.detach()])  # (one copy for the two)
                    running = (both[0], both[1])
                else:
                    running = (rm.detach().clone(), rv.detach().clone())
            self._before.setdefault(id(module), []).append((x, getattr(x, "_version", 0), running))
        return hook

    def _post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            stack = self._before.get(id(module))
            if not stack:
                return
            x, version, running = stack.pop()
            torch = self._torch
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or x.dim() < 2 \
                    or not x.is_floating_point():
                return
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            self._forward(module, path, index, x, version, running, output)
        return hook

    def _forward(self, module: Any, path: str, index: int, x: Any, version: int, running: Any, y: Any) -> None:
        torch = self._torch
        measure = self._measure()
        if not measure:  # a step between measured ones: one finiteness check of x and y
            with torch.no_grad():  # (the backward of such a step is not watched)
                if _finite(x) and _finite(y):
                    return
        node = y.grad_fn
        is_bn = node is not None and type(node).__name__ in BN_NODES
        if node is not None and type(node).__name__ == COMPILED_NODE and path not in self.compiled:
            self.compiled.append(path)  # (its forward is watched; its backward is inside the compiled graph)
        row = self._forward_row(module, path, index, x, y, node if is_bn else None, running)
        p = _Pending(path, index, module, row, [], [], x, version, running,
                     (row["running_mean"], row["running_var"]) if running is not None and module.training else None,
                     node if is_bn else None)
        self._judge_forward(p, module)
        p.forward_reasons = len(p.reasons)
        self._step.pending.append(p)
        if self._is_new(p):
            self._dump_forward(p, y)
        if is_bn and torch.is_grad_enabled():
            self._node_hooks.append(node.register_hook(self._grad_hook(p)))
        else:
            self._close(p)

    def _forward_row(self, module: Any, path: str, index: int, x: Any, y: Any, node: Any,
                     running: Any) -> dict[str, Any]:
        """The call's row: its per-channel numbers reduced on its device and brought to the host in one transfer
        (the running statistics before the call under ``_running_in``, for the checks)."""
        torch = self._torch
        c, eps = x.shape[1], float(module.eps)
        rm, rv = module.running_mean, module.running_var
        train = node is not None and module.training
        with torch.no_grad():
            parts = [node._saved_result1, node._saved_result2] if train else \
                list(torch.var_mean(x.float(), dim=dims(x), unbiased=False))[::-1]
            if rm is not None:
                parts += [rm, rv]
            if running is not None:
                parts += running
            rx, ry = _reduce(x, self._jit), _reduce(y, self._jit)
            host = _host([t.detach() for t in parts + rx + ry])
        k = 4 if rm is not None else 2
        running_in = tuple(host[k:k + 2]) if running is not None else None
        k += 2 if running is not None else 0
        if train:
            mean, invstd = host[0], host[1]
            with np.errstate(all="ignore"):
                var = 1.0 / (invstd * invstd) - eps
            norm = (mean, invstd)
        else:
            mean, var = host[0], host[1]
            use_running = running_in is not None and not module.training
            with np.errstate(all="ignore"):
                invstd = 1.0 / np.sqrt((running_in[1] if use_running else var) + eps)
            norm = (running_in[0] if use_running else mean, invstd)  # what the kernel normalised with
        params = rm.dtype if rm is not None else (module.weight.dtype if module.weight is not None else x.dtype)
        row: dict[str, Any] = {
            "step": self._step_no, "rank": self.rank, "layer": path, "call": index, "channel": np.arange(c),
            "dtype": str(x.dtype).replace("torch.", ""), "params": str(params).replace("torch.", ""),
            "training": bool(module.training), "batch_mean": mean, "batch_var": var, "invstd": invstd, "_norm": norm,
            "running_mean": host[2] if rm is not None else np.full(c, np.nan),
            "running_var": host[3] if rm is not None else np.full(c, np.nan), "_running_in": running_in}
        row.update(_profiled(x, "x", host[k:k + len(rx)]))
        row.update(_profiled(y, "y", host[k + len(rx):]))
        row.update(zip(_LATE, np.full((len(_LATE), c), np.nan)))  # the backward's, NaN until it comes
        return row

    # ---- the family's calls: LayerNorm, RMSNorm, GroupNorm, InstanceNorm ------------------------------------
    def _family_pre_hook(self) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            self._family_before.setdefault(id(module), []).append((x, getattr(x, "_version", 0)))
        return hook

    def _family_post_hook(self, path: str, fm: FamilyModule) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            stack = self._family_before.get(id(module))
            if not stack:
                return
            x, version = stack.pop()
            torch = self._torch
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or x.dim() < 1 \
                    or not x.is_floating_point() or output.shape != x.shape or x.numel() == 0:
                return
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            self._family_forward(module, fm, path, index, (x, version), output)
        return hook

    def _family_forward(self, module: Any, fm: FamilyModule, path: str, index: int, x_in: tuple[Any, int],
                        y: Any) -> None:
        torch = self._torch
        x, version = x_in
        if not self._measure():  # a step between measured ones: one finiteness check of x and y
            with torch.no_grad():
                if _finite(x) and _finite(y):
                    return
        sh = NormShape.of(fm.norm, tuple(x.shape), fm.normalized_shape, fm.groups)
        node, kind = kernel_node(y)
        row = self._family_row(module, fm, sh, (path, index), (x, y), node if kind is not None else None)
        p = _FamilyPending(path, index, module, row, [], [], x, version, None, None, y.grad_fn, fm=fm, shape=sh,
                           kind=kind)
        self._judge_family(p)
        p.forward_reasons = len(p.reasons)
        self._step.family_pending.append(p)
        if self._is_new(p):
            self._dump_forward(p, y)
        if y.grad_fn is not None and torch.is_grad_enabled() and kind is not None:
            self._node_hooks.append(node.register_hook(self._family_grad_hook(p)))
        elif y.grad_fn is not None and torch.is_grad_enabled() and fm.norm == "rms":
            self._awaiting.setdefault(id(module), []).append(p)
        else:
            self._close(p, self._step.family_rows)

    def _family_row(self, module: Any, fm: FamilyModule, sh: NormShape, where: tuple[str, int], xy: tuple[Any, Any],
                    node: Any) -> dict[str, Any]:
        """The call's numbers per row of its (rows, R) view: the row's exact statistics, the kernel's saved rstd, the
        golden check (:mod:`bnprobe.recordings.monitor_family`), and x's and y's profiles."""
        torch = self._torch
        x, y = xy
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        w = w if isinstance(w, torch.Tensor) else None
        b = b if isinstance(b, torch.Tensor) and fm.norm != "rms" else None
        gold = golden_rows(x, y, sh, eps=fm.eps_for(x), gamma=w, beta=b, offset=fm.weight_offset,
                           saved=saved_statistics(node) if node is not None else None)
        rows = np.arange(sh.rows)
        row: dict[str, Any] = {
            "step": self._step_no, "rank": self.rank, "layer": where[0], "call": where[1], "norm": fm.norm,
            # the call's layer as its dump holds it (groups 0: not GroupNorm; normalized_shape "": not LayerNorm,
            # RMSNorm)
            "normalized_shape": ",".join(map(str, fm.normalized_shape or ())), "groups": int(fm.groups or 0),
            "weight_offset": float(fm.weight_offset), "eps": fm.eps_for(x),
            "row": rows, "dtype": str(x.dtype).replace("torch.", ""),
            "params": str((w if w is not None else x).dtype).replace("torch.", ""),
            "training": bool(module.training), **gold}
        with torch.no_grad():  # (x's and y's reductions brought to the host in one transfer)
            xv, yv = x.detach().reshape(1, sh.rows, sh.r), y.detach().reshape(1, sh.rows, sh.r)
            rx, ry = _reduce(xv, self._jit), _reduce(yv, self._jit)
            host = _host(rx + ry) if rx or ry else np.empty((0, 0))
            row.update(_profiled(xv, "x", host[:len(rx)]))
            row.update(_profiled(yv, "y", host[len(rx):]))
        row.update(zip(_FAMILY_LATE, np.full((len(_FAMILY_LATE), sh.rows), np.nan)))
        return row

    def _judge_family(self, p: _FamilyPending) -> None:
        """NaN, ±inf and saturation as for BatchNorm, and the kernel's y and saved statistics against the FP64
        golden on the rows where x and y are finite (a non-finite row is flagged by the counts)."""
        r = p.row
        self._counts_flags(p, ("x", "y"), r["dtype"])
        y_ok = (r["y_nan"] == 0) & (r["y_inf"] == 0)  # (a non-finite y is flagged as such)
        with np.errstate(invalid="ignore"):
            self._flag(p, "y beyond a correct kernel's bound of the FP64 golden", (r["y_err"] > 1) & y_ok)
            self._flag(p, "saved statistics beyond a correct kernel's bound of the FP64 golden", r["stats_err"] > 1)
        self._ask(p, "forward")

    # ---- anomalies ---------------------------------------------------------------------------------
    def _is_new(self, p: _Pending, start: int = 0) -> bool:
        """Whether a reason of ``p`` from its ``start``-th on is a new anomaly: its kind neither ongoing on this layer
        and call (seen at the step before; with ``every`` > 1, at the last measured one or after) nor among the
        call's reasons before ``start``.  Only a call with a new anomaly is dumped: the steps after an anomaly's
        first repeat what its dump holds, and would use up ``max_dumps``."""
        earlier = {k for k, _ in p.flags[:start]}
        return any((p.layer, p.index, k) not in self._open and k not in earlier for k, _ in p.flags[start:])

    def _flag(self, p: _Pending, what: str, bad: np.ndarray) -> None:
        if not bad.any():
            return
        ch = np.flatnonzero(bad)
        p.reasons.append(f"{what} ({p.unit}{'s' if ch.size > 1 else ''} {', '.join(map(str, ch[:8]))}"
                         f"{', ...' if ch.size > 8 else ''})")
        p.flags.append((what, [int(c) for c in ch]))

    def _counts_flags(self, p: _Pending, names: tuple[str, ...], dtype: str) -> None:
        """NaN, ±inf and saturation in each tensor of ``names``; in y (dx) only where x (and dy) are finite, since
        NaN/inf there follow from the input's, which is flagged itself."""
        r = p.row
        for t in names:
            if not (r[f"{t}_nan"].any() or r[f"{t}_inf"].any() or r[f"{t}_at_max"].any()):
                continue  # nothing to flag (the usual case: the checks below find nothing either)
            x_ok = (r["x_nan"] == 0) & (r["x_inf"] == 0)
            ok, where = {"x": (True, ""), "y": (x_ok, " where x is finite"),
                         "dx": (x_ok & (r["dy_nan"] == 0) & (r["dy_inf"] == 0), " where x and dy are finite")}[t]
            self._flag(p, f"NaN in {t}{where}", (r[f"{t}_nan"] > 0) & ok)
            self._flag(p, f"±inf in {t}{where}" + (f" (overflow in {dtype})" if t != "x" else ""),
                       (r[f"{t}_inf"] > 0) & ok)
            self._flag(p, f"{t} at the {dtype} maximum (saturated)", r[f"{t}_at_max"] > 0)

    def _judge_forward(self, p: _Pending, module: Any) -> None:
        r, eps = p.row, float(module.eps)
        self._counts_flags(p, ("x", "y"), r["dtype"])
        if module.training:
            with np.errstate(all="ignore"):
                low = r["batch_var"] <= self.var_floor * eps
                beyond = ~(r["invstd"] > 0) | (r["invstd"] > (1 + 1e-3) / math.sqrt(eps))
                if low.any() or beyond.any():  # (the usual case: neither)
                    x_ok = (r["x_nan"] == 0) & (r["x_inf"] == 0)  # statistics of non-finite x follow from it
                    self._flag(p, f"batch variance at or below {self.var_floor:g}·ε or negative", low & x_ok)
                    self._flag(p, "invstd beyond 1/√ε or not positive", beyond & x_ok)
            self._running_flags(p, module)
        self._ask(p, "forward")

    def _running_flags(self, p: _Pending, module: Any) -> None:
        """The running statistics after the call against the update of the ones before by the batch's."""
        if p.running_in is None or p.node is None or p.running_out is None:
            return
        r, eps, torch = p.row, float(module.eps), self._torch
        if not module.track_running_stats or module.num_batches_tracked is None:
            return
        m = momentum_factor(module)
        n = p.x.numel() // p.x.shape[1]
        rm0, rv0 = r["_running_in"]
        rm1, rv1 = p.running_out
        u32 = float(torch.finfo(torch.float32).eps)
        saved = p.node._saved_result2.dtype  # the statistics read back are rounded to it (bf16/fp16 on some CPUs)
        bessel = n / max(n - 1, 1)
        with np.errstate(all="ignore"):
            em = (1 - m) * rm0 + m * r["batch_mean"]
            ev = (1 - m) * rv0 + m * (r["batch_var"] * bessel)
            dm, dv = np.abs(rm1 - em), np.abs(rv1 - ev)
            am = u32 * (np.abs((1 - m) * rm0) + np.abs(m * r["batch_mean"]))  # the update's own arithmetic
            av = u32 * (np.abs((1 - m) * rv0) + np.abs(m * r["batch_var"]) * bessel)
            # every tolerance below is at least RUNNING_ULPS times these (invstd > 0): within that, every channel
            # passes (a NaN compares False, and the whole check runs)
            if (r["invstd"] > 0).all() and (dm <= RUNNING_ULPS * am).all() and (dv <= RUNNING_ULPS * av).all():
                return
            tm = RUNNING_ULPS * (_ulp(np.maximum(np.abs(em), np.abs(rm1)), p.running_in[0].dtype) + am) \
                + m * _ulp(r["batch_mean"], saved)
            tv = RUNNING_ULPS * (_ulp(np.maximum(np.abs(ev), np.abs(rv1)), p.running_in[1].dtype) + av) \
                + m * bessel * (RUNNING_VAR_SLACK + 2 * _ulp(r["invstd"], saved) / r["invstd"]) \
                * (np.abs(r["batch_var"]) + eps)
            ok_in = np.isfinite(rm0) & np.isfinite(rv0) & np.isfinite(r["batch_mean"]) & np.isfinite(r["batch_var"])
            fin = np.isfinite(rm1) & np.isfinite(rv1)
            self._flag(p, "non-finite running statistics after the update", ok_in & ~fin)
            self._flag(p, f"running statistics are not the momentum-{m:g} update of the batch's",
                       ok_in & fin & ((dm > tm) | (dv > tv)))

    def _ask(self, p: _Pending, phase: str) -> None:
        if self.predicate is None:
            return
        try:
            why = self.predicate({**p.row, "phase": phase})
        except Exception as exc:  # noqa: BLE001 - the user's predicate: its failure is reported, not raised inside autograd
            why = f"predicate raised {type(exc).__name__}: {exc}"
        if why:
            p.reasons.append(f"predicate: {why}")
            p.flags.append((p.reasons[-1], []))  # (the predicate's text is its kind: the same text, the same anomaly)

    # ---- the backward ------------------------------------------------------------------------------
    def _grad_hook(self, p: _Pending) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if p.done:
                return
            before = len(p.reasons)
            dy = grad_outputs[0] if grad_outputs else None
            dx = grad_inputs[0] if grad_inputs else None
            self._backward_row(p, dy, dx, grad_inputs[1:3])
            if p.dump is not None:
                record_grads(p.dump, grad_inputs, grad_outputs)
                self._write_dump(p)
            elif self._is_new(p, before):
                self._dump_late(p, grad_inputs, grad_outputs)
            self._close(p)
        return hook

    def _backward_row(self, p: _Pending, dy: Any, dx: Any, sums: tuple[Any, ...]) -> None:
        """dx's profile, Σdy, Σdy·x̂ (the kernel's own dβ and dγ where it computed them: they are those sums, else
        reduced here in float32), and NaN/inf in dy: counted only when a channel's Σdy is not finite (a float sum
        with a NaN or ±inf addend never is)."""
        torch, r = self._torch, p.row
        with torch.no_grad():  # (dx's reductions and the two sums brought to the host in one transfer)
            parts = _reduce(dx, self._jit) if isinstance(dx, torch.Tensor) else []
            k = len(parts)
            dg, db = (tuple(sums) + (None, None))[:2]
            inv = None
            if isinstance(dg, torch.Tensor) and isinstance(db, torch.Tensor):
                parts += [db.detach(), dg.detach()]
            elif isinstance(dy, torch.Tensor) and p.node is not None and p.x is not None:
                mean, inv = r["_norm"]
                centre = torch.as_tensor(np.nan_to_num(mean), dtype=torch.float32, device=dy.device)
                d = dy.float()
                parts += [d.sum(dim=dims(d)), (d * (p.x.float() - _column(centre, d))).sum(dim=dims(d))]
            host = _host(parts) if parts else np.empty((0, 0))
            if isinstance(dx, torch.Tensor):
                r.update(_profiled(dx, "dx", host[:k]))
            if len(host) > k:
                r["sum_dy"], r["sum_dy_xhat"] = host[k], host[k + 1]
                if inv is not None:
                    with np.errstate(all="ignore"):
                        r["sum_dy_xhat"] = host[k + 1] * inv
            if isinstance(dy, torch.Tensor):
                if np.isfinite(r["sum_dy"]).all():
                    r["dy_nan"] = r["dy_inf"] = np.zeros(dy.shape[1])
                elif one_pass(dy, self._jit):
                    prof = profile_tensor(dy)
                    r["dy_nan"], r["dy_inf"] = prof["nan"], prof["inf"]
                else:
                    r["dy_nan"], r["dy_inf"] = nan_inf(dy)
                self._flag(p, "NaN in dy", r["dy_nan"] > 0)
                self._flag(p, "±inf in dy", r["dy_inf"] > 0)
        if isinstance(dx, torch.Tensor):
            self._counts_flags(p, ("dx",), r["dtype"])
        self._ask(p, "backward")

    # ---- the family's backward -----------------------------------------------------------------------
    def _family_grad_hook(self, p: _FamilyPending) -> Callable[..., None]:
        """The hook on a family kernel's node (LayerNorm's, GroupNorm's, InstanceNorm's BatchNorm under its view)."""
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if p.done:
                return
            dy = grad_outputs[0] if grad_outputs else None
            dx = grad_inputs[0] if grad_inputs else None
            self._family_backward(p, (dy, dx), lambda call: record_family_node_grads(call, grad_inputs, grad_outputs,
                                                                                     str(p.kind)))
        return hook

    def _rms_grad_hook(self) -> Callable[..., None]:
        """RMSNorm's dy and dx from its module's backward hook, to its latest call of the step awaiting them (the
        backward runs the calls in reverse)."""
        def hook(module: Any, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            waiting = [q for q in self._awaiting.get(id(module), []) if not q.done]
            if not waiting:
                return
            dy = grad_output[0] if grad_output else None
            dx = grad_input[0] if grad_input else None
            self._family_backward(waiting[-1], (dy, dx),
                                  lambda call: record_module_grads(call, grad_input, grad_output))
        return hook

    def _family_backward(self, p: _FamilyPending, dy_dx: tuple[Any, Any], record: Callable[[CapturedCall], Any]
                         ) -> None:
        """dx's profile and NaN/±inf in dy per row; the call dumped with its backward (``record`` puts the grads into
        its dump) when its forward or this backward was anomalous."""
        torch, r, sh = self._torch, p.row, p.shape
        assert sh is not None
        before = len(p.reasons)
        dy, dx = dy_dx
        with torch.no_grad():  # (dx's reductions and dy's row sums brought to the host in one transfer)
            dxv = dx.detach().reshape(1, sh.rows, sh.r) if isinstance(dx, torch.Tensor) and \
                dx.numel() == sh.rows * sh.r else None
            d = dy.detach().reshape(1, sh.rows, sh.r) if isinstance(dy, torch.Tensor) and \
                dy.numel() == sh.rows * sh.r else None
            parts = _reduce(dxv, self._jit) if dxv is not None else []
            k = len(parts)
            if d is not None:
                parts.append(d.sum(dim=(0, 2)))
            host = _host(parts) if parts else np.empty((0, 0))
            if dxv is not None:
                r.update(_profiled(dxv, "dx", host[:k]))
            if d is not None:
                # a row's sum is finite only if every value is (NaN and ±inf are counted where one is not)
                if np.isfinite(host[k]).all():
                    r["dy_nan"] = r["dy_inf"] = np.zeros(sh.rows)
                else:
                    r["dy_nan"], r["dy_inf"] = nan_inf(d)
                self._flag(p, "NaN in dy", r["dy_nan"] > 0)
                self._flag(p, "±inf in dy", r["dy_inf"] > 0)
        if isinstance(dx, torch.Tensor):
            self._counts_flags(p, ("dx",), r["dtype"])
        self._ask(p, "backward")
        if p.dump is not None:
            record(p.dump)
            self._write_dump(p)
        elif self._is_new(p, before):
            call = self._new_dump(p)
            if call is not None:  # an anomaly the backward showed: the call from what the forward left (no y)
                finish_family_call(call, None, grad_fn=p.node)
                record(call)
                p.dump = call
                self._write_dump(p)
        self._close(p, self._step.family_rows)

    # ---- dumps -------------------------------------------------------------------------------------
    def _can_dump(self) -> bool:
        return self.capture_on == "anomaly" and self._dumps_made < self.max_dumps

    def _folder(self) -> Path:
        return self.out / "anomalies" / f"step-{self._step_no}"

    def _new_dump(self, p: _Pending) -> CapturedCall | None:
        if not self._can_dump():
            return None
        if p.x is None or p.x._version != p.x_version:
            p.row.setdefault("_note", "x changed in place after the call: not dumped")
            return None
        if isinstance(p, _FamilyPending):
            assert p.fm is not None
            call = start_family_call(p.module, p.fm, p.layer, p.index, len(self._step.dumped), p.x)
            call.meta["x_shape"] = list(p.x.shape)
            if p.fm.norm == "rms":  # (its weight's gradient sums the module's calls of the step)
                call.meta["backward_missing"] = {"dgamma": "not recorded by the monitor: RMSNorm's weight gradient "
                                                           "comes from its weight, summed over the module's calls"}
        else:
            call = start_call(p.module, p.layer, p.index, len(self._step.dumped), p.x, running=p.running_in)
        self._dumps_made += 1
        self._step.dumped.append(call)
        p.folder = self._folder() / call.dir
        return call

    def _dump_forward(self, p: _Pending, y: Any) -> None:
        call = self._new_dump(p)
        if call is None:
            return
        if isinstance(p, _FamilyPending):
            finish_family_call(call, y)
            awaiting = p.node is not None and self._torch.is_grad_enabled() and (p.kind is not None or
                                                                                p.shape.norm == "rms")
        else:
            finish_call(p.module, call, y)  # (a compiled model's call: its note said there)
            awaiting = p.node is not None and self._torch.is_grad_enabled()
        p.dump = call
        if awaiting:
            call.spill(p.folder)  # its backward comes later in the step: one call held at a time
        else:
            self._write_dump(p)

    def _dump_late(self, p: _Pending, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        """An anomaly the backward showed: the call from what the forward left (no y: it was not kept)."""
        call = self._new_dump(p)
        if call is None:
            return
        out = None if p.running_out is None or p.running_in is None else tuple(  # (the values, in their dtype)
            self._torch.from_numpy(v).to(dtype=t.dtype) for v, t in zip(p.running_out, p.running_in))
        finish_call(p.module, call, node=p.node, running_out=out)
        call.meta["y"] = "not kept: the anomaly showed in the backward, after y had gone on"
        record_grads(call, grad_inputs, grad_outputs)
        p.dump = call
        self._write_dump(p)

    def _write_dump(self, p: _Pending) -> None:
        call, folder = p.dump, p.folder
        assert call is not None and folder is not None
        if call.state == "spilled":
            call.unspill(folder)
        call.meta["monitor"] = {"step": self._step_no, "rank": self.rank, "reasons": list(p.reasons)}
        self.dumps += write_dump(call.recording(str(self._torch.__version__)), folder, force=True)
        call.release()
        self._write_index()

    def _write_index(self) -> None:
        calls = [{"name": c.name, "dir": c.dir, "module": c.module, "type": c.type, "index": c.index,
                  "order": c.order, "training": c.training, "backward": c.backward_runs > 0}
                 for c in self._step.dumped if c.state == "written"]
        doc = {"format": CALLS_TAG, "version": 1, "source": "monitor", "torch": str(self._torch.__version__),
               "calls": calls, "calls_per_module": None, "skipped": {}, "rank": self.rank, "step": self._step_no,
               "notes": [f"anomalous calls of step {self._step_no} (rank {self.rank}) written by bnprobe.monitor",
                         *([f"{len(self.compiled)} BatchNorm module(s) ran inside a torch.compile'd model: their "
                            "forward watched, their backward not (each call's note says why)"]
                           if self.compiled else [])]}
        atomic_write_text(self._folder() / CALLS_NAME, dumps_json(doc))

    # ---- closing a call, a step, the run -------------------------------------------------------------
    def _close(self, p: _Pending, rows: list[dict[str, Any]] | None = None) -> None:
        """The call's row kept (measured steps, or any step where it is anomalous) and its anomaly listed; a family
        call's rows go to ``rows``."""
        if p.done:
            return
        p.done = True
        if self._measure() or p.reasons:
            (self._step.rows if rows is None else rows).append(p.row)
        if p.reasons:
            self._list(p)
        p.x = p.node = p.module = None

    def _list(self, p: _Pending) -> None:
        """Each anomaly of the call: a new one listed (where it showed, its reason and channels, its dump), an
        ongoing one's last step and count moved on."""
        where = str(p.folder.parent) if p.dump is not None and p.folder is not None else (
            "not dumped: capture_on='never'" if self.capture_on == "never" else
            p.row.get("_note", f"not dumped: max_dumps={self.max_dumps} reached"))
        step = self._step_no
        for i, (kind, where_ch) in enumerate(p.flags):
            key = (p.layer, p.index, kind)
            k = self._open.get(key)
            if k is None:
                self._open[key] = k = len(self.anomalies)
                self.anomalies.append({"first_step": step, "last_step": step, "count": 1, "rank": self.rank,
                                       "layer": p.layer, "call": p.index, "dtype": p.row["dtype"],
                                       "phase": "forward" if i < p.forward_reasons else "backward",
                                       "reason": p.reasons[i], "channels": " ".join(map(str, where_ch[:32])),
                                       "dump": where})
                self._lines.append("")
            elif self.anomalies[k]["last_step"] != step:  # (a predicate's reason can come in both phases)
                self.anomalies[k]["last_step"] = step
                self.anomalies[k]["count"] += 1
            self._changed.add(k)

    def step(self) -> None:
        """The step is over: its rows appended to the Parquet folder, its anomalies to anomalies.csv."""
        if not self._entered:
            raise BNProbeError("mon.step() is called inside the monitor's with block")
        self._flush()
        self._step_no += 1
        self._counts.clear()

    def _flush(self) -> None:
        st = self._step
        for p in st.pending:
            if not p.done:  # no backward came this step
                if p.dump is not None:
                    self._write_dump(p)
                self._close(p)
        for p in st.family_pending:
            if not p.done:
                if p.dump is not None:
                    self._write_dump(p)
                self._close(p, st.family_rows)
        if st.rows:
            self._write_rows(st.rows)
            self.steps.append(self._step_no)
        if st.family_rows:
            self._write_rows(st.family_rows, FAMILY_PARQUET_NAME)
            if not st.rows:
                self.steps.append(self._step_no)
        if self._changed:
            self._write_anomalies()
        if self._measure():  # an anomaly not seen at a measured step has stopped: if it comes back, it is a new one
            self._open = {key: k for key, k in self._open.items() if self.anomalies[k]["last_step"] == self._step_no}
        self._step = _Step()
        self._node_hooks.clear()  # (a flushed call's hook returns at once; the graph holds it while it lives)
        self._before.clear()
        self._family_before.clear()
        self._awaiting.clear()

    def _write_rows(self, rows: list[dict[str, Any]], folder: str = PARQUET_NAME) -> None:
        """The step's rows as one Parquet file of ``folder``: a table made here, written by the writer's thread
        (:mod:`bnprobe.recordings.monitor_writer`)."""
        self._writer.put(self.out / folder / f"step-{self._step_no:09d}.parquet", rows,
                         "channel" if folder == PARQUET_NAME else "row", _UNCOMPRESSED)

    def _write_anomalies(self) -> None:
        """anomalies.csv, one line per anomaly, written whole and renamed into place: an ongoing anomaly's line
        changes every step it is seen (last step, count), so the file is not a journal to append to; a process
        killed mid-run leaves the file of the last step written, every line complete.  The lines of the anomalies
        not seen this step are kept as text: a rewrite joins them (3.7 ms a step with 10 000 anomalies listed)."""
        for k in sorted(self._changed):
            text = io.StringIO()
            csv.DictWriter(text, fieldnames=ANOMALY_COLUMNS, lineterminator="\n").writerow(self.anomalies[k])
            self._lines[k] = text.getvalue()
        self._changed.clear()
        atomic_write_text(self.out / ANOMALIES_NAME, ",".join(ANOMALY_COLUMNS) + "\n" + "".join(self._lines))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove_hooks()
        try:
            self._flush()  # what the last (unfinished) step recorded; on an exception too: it is what happened
        finally:
            self._writer.close()  # every step on disk when the block ends


def monitor(model: Any, out: str | Path, *, every: int = 1, capture_on: str = "anomaly", max_dumps: int = 10,
            predicate: Callable[[dict[str, Any]], str | None] | None = None, var_floor: float = 1.0,
            force: bool = False) -> Monitor:
    """A context manager watching every BatchNorm call of ``model`` over a training run (and every LayerNorm, RMSNorm,
    GroupNorm and InstanceNorm call, per row: see the module's doc); call ``mon.step()`` after each optimizer step.
    ``every``: per-channel rows every k-th step (other steps check only that x and y are finite; an anomalous call's
    row is always written). ``capture_on``: "anomaly" (dump a call at an anomaly's first step) or "never".
    ``max_dumps``: calls dumped in the whole run (an anomaly that goes on over steps is dumped once).
    ``predicate(row)``: a reason (str) when a call is anomalous to you, given its per-channel numbers (the Parquet
    columns, arrays per channel; a family call's per row, and its ``norm``) and ``phase`` ("forward" or
    "backward"); the same text on the next step is the same anomaly going on. ``var_floor``: a training call's
    batch variance at or below var_floor·ε is an anomaly. ``out`` must not hold a monitor's output unless
    ``force``. See :mod:`bnprobe.recordings.monitor`."""
    return Monitor(model, out, every=every, capture_on=capture_on, max_dumps=max_dumps, predicate=predicate,
                   var_floor=var_floor, force=force)

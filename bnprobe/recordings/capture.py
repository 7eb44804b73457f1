"""Record every BatchNorm call of a live PyTorch model as bnprobe dumps (a "model dump").

``with capture(model, "out/"): ...`` hooks each BatchNorm module of ``model`` (every subclass of
``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*) — and each module of the
normalisation family (LayerNorm, RMSNorm, GroupNorm, InstanceNorm, Hugging Face-style RMSNorm:
:mod:`bnprobe.recordings.family_modules`) — and writes one bnprobe dump per call, then, on a clean exit, an index::

    OUT/bnprobe-calls.json           the calls in forward order (name, dir, module, type, index, ...)
    OUT/<dir>/bnprobe-dump.json      one bnprobe dump per call (bnprobe.recordings.write_dump)
    OUT/<dir>/tensors.npz

What each call records: the inputs as they were before the call (x, γ, β, running statistics), eps and
the momentum factor torch applied; y; in training the statistics the kernel itself saved (mean, invstd),
read from y's autograd node, and the running statistics after the call; and, when a backward runs inside
the context, what that node received and produced (dy; dx, dγ, dβ).  Tensors are copied to CPU in their
own dtype when the hook runs and widened to float64 (exactly) when written.

Memory stays at about one call's tensors: a call whose backward is awaited is spilled to its folder at the
forward (uncompressed, in its own dtypes) and its dump written when the backward arrives; a call with no
backward to wait for is written at once; a call whose backward never came, at the exit.  The index is written
last, so a folder of call dumps without it is an incomplete capture; if the body raises, or a refusal was
caught inside it, every file the capture wrote is removed again.

torch is imported only when a capture starts: bnprobe imports without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.recordings.bnprobe_dump import read_calls, write_dump
from bnprobe.recordings.family_modules import (FamilyModule, family_module, kernel_node_of, ones_like_params,
                                               record_family_grads, saved_statistics)
from bnprobe.recordings.types import CALLS_NAME, CALLS_TAG, META_NAME, TENSORS_NAME, Recording
from bnprobe._files import atomic_write_text, atomic_write_with, dumps_json

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["capture", "Capture", "DEFAULT_MAX_BYTES", "COMPILED_NOTE", "COMPILED_NODE", "outside_graph"]

DEFAULT_MAX_BYTES = 2 * 1024**3  # 2 GiB of captured tensors held in memory at once (calls not yet on disk)
#: said on every call recorded inside a torch.compile'd model, and by every command reading it
COMPILED_NOTE = ("recorded under torch.compile: bnprobe's hooks break the graph around this BatchNorm, so it ran as a "
                 "compiled graph of its own (inductor's kernel, not fused with its neighbours as without the hooks); "
                 "its backward runs inside that graph's compiled autograd function, which does not expose dx, dγ, dβ: "
                 "the backward is not recorded")
#: y's autograd node when the BatchNorm ran inside a torch.compile'd graph (its backward is not observable)
COMPILED_NODE = "CompiledFunctionBackward"
_SPILL = "forward-spill.npz"  # a call's forward tensors, awaiting its backward

# autograd nodes of the BatchNorm kernels: _saved_result1 is the saved mean, _saved_result2 the saved
# 1/sqrt(var + eps) (cuDNN's and MIOpen's "save_var" hold the inverse standard deviation as well)
BN_NODES = ("NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0",
             "NativeBatchNormLegitBackward0", "NativeBatchNormLegitBackward1",
             "NativeBatchNormLegitNoTrainingBackward0", "BatchNormWithUpdateBackward0",
             "BatchNormNoUpdateBackward0")
_VECTORS_PER_CALL = 12  # γ, β, running stats in and out, saved stats, dγ, dβ: an upper bound


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """An exact CPU copy in the tensor's own dtype (bfloat16 as ml_dtypes.bfloat16, bit for bit)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).to("cpu").numpy()
        return np.array(bits, copy=True).view(get_format("bf16").dtype)
    if t.dtype not in (torch.float16, torch.float32, torch.float64):
        raise BNProbeError(f"capture records float16/bfloat16/float32/float64 tensors, got {t.dtype}")
    return np.array(t.to("cpu").numpy(), copy=True, order="C")


def _memory_format(t: torch.Tensor) -> str:
    """How x is laid out in memory: the CPU kernels take a different path (and round differently) for
    channels-last tensors, so a replay needs to know."""
    import torch

    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


def _dir_token(module: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", module) or "root"


@dataclass
class CapturedCall:
    """One BatchNorm call while it is being recorded: arrays in their own dtypes."""

    name: str
    module: str
    type: str
    index: int
    order: int
    training: bool
    eps: float
    momentum: float | None
    meta: dict[str, Any]
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    grads_in: dict[str, np.ndarray] = field(default_factory=dict)  # dy
    grads_out: dict[str, np.ndarray] = field(default_factory=dict)  # dx, dgamma, dbeta
    backward_runs: int = 0
    nbytes: int = 0  # what its tensors reserve of max_bytes while they are held
    state: str = "held"  # held (in memory), spilled (forward on disk, backward awaited), written (its dump)
    runs_written: int = 0  # backward_runs when its dump was written

    def spill(self, folder: Path) -> None:
        """Its forward tensors to ``folder``'s spill file (their own dtypes, uncompressed), released here."""
        folder.mkdir(parents=True, exist_ok=True)
        # each key names its format: numpy stores ml_dtypes' bfloat16 as 2-byte voids
        arrays = {f"{io}.{k}.{get_format(v.dtype).name}": v
                  for io, d in (("inputs", self.inputs), ("outputs", self.outputs)) for k, v in d.items()}
        atomic_write_with(folder / _SPILL, lambda fh: np.savez(fh, **arrays))
        self.inputs, self.outputs, self.state = {}, {}, "spilled"

    def unspill(self, folder: Path) -> None:
        """Its forward tensors back from the spill file, which is removed."""
        with np.load(folder / _SPILL, allow_pickle=False) as z:
            for key in z.files:
                io, name, fmt = key.split(".")
                a = z[key]
                (self.inputs if io == "inputs" else self.outputs)[name] = a.view(get_format(fmt).dtype) \
                    if a.dtype.kind == "V" else a
        (folder / _SPILL).unlink()
        self.state = "held"

    def release(self) -> None:
        self.inputs, self.outputs, self.grads_in, self.grads_out = {}, {}, {}, {}
        self.state, self.runs_written = "written", self.backward_runs

    @property
    def dir(self) -> str:
        return f"{self.order:04d}-{_dir_token(self.module)}-{self.index}"

    def recording(self, torch_version: str) -> Recording:
        """The call as a bnprobe Recording for :func:`~bnprobe.recordings.write_dump`: its arrays in their own
        dtypes, not widened (x once, under both its names: widening each to float64 took a batch-32 capture to
        2.5x the plain step's peak memory)."""
        def fmt(a: np.ndarray) -> str:
            return get_format(a.dtype).name

        ins = self.inputs
        has_saved = ("saved_mean" in self.outputs or self.meta.get("norm") == "rms") and "saved_value" in self.outputs
        has_backward = self.backward_runs > 0
        saved_kind = ("invstd" if has_saved else None) if self.training else ("var" if has_backward else None)
        meta = {"call": self.name, "module": self.module, "type": self.type, "index": self.index,
                "order": self.order, "torch": torch_version, "training": self.training, **self.meta,
                "backward": has_backward}
        if has_backward:
            meta["backward_runs"] = self.backward_runs
            if not self.training:
                meta["saved_kind"] = "var"  # the backward of an inference call reads the running statistics
        rec = Recording(adapter=f"capture:{self.name}", dtype=fmt(ins["x"]), params=fmt(ins["gamma"]),
                        layout="channels_first", eps=self.eps, momentum=self.momentum, saved_kind=saved_kind,
                        meta=meta)

        def put(mode: str, io: str, named: dict[str, np.ndarray]) -> None:
            for name, a in named.items():
                rec.tensors.setdefault(mode, {}).setdefault(io, {})[name] = a
                rec.formats[f"{mode}.{io}.{name}"] = fmt(a)

        mode = "train" if self.training else "infer"
        put(mode, "inputs", ins)
        put(mode, "outputs", self.outputs)
        if has_backward:
            if "norm" in self.meta:  # a family call: its saved statistics where its kernel saved them
                saved = {k: self.outputs[k] for k in ("saved_mean", "saved_value") if k in self.outputs}
            elif self.training:
                saved = {"saved_mean": self.outputs["saved_mean"], "saved_value": self.outputs["saved_value"]}
            else:
                saved = {"saved_mean": ins["running_mean"], "saved_value": ins["running_var"]}
            put("backward", "inputs", {**self.grads_in, "x": ins["x"], "gamma": ins["gamma"], **saved})
            put("backward", "outputs", self.grads_out)
        return rec


def start_call(module: Any, path: str, index: int, order: int, x: torch.Tensor, *,
               running: tuple[Any, Any] | None = None) -> CapturedCall:
    """A call of BatchNorm ``module`` (module path ``path``, its ``index``-th call, ``order``-th recorded) on ``x``,
    its inputs copied as the module passes them to F.batch_norm; ``running``: the running statistics as they were
    before the call, when the module's own have been updated since (a monitor copies them before the forward)."""
    # what torch.nn.modules.batchnorm passes to F.batch_norm
    channels = x.shape[1] if x.dim() > 1 else 0
    training = bool(module.training or (module.running_mean is None and module.running_var is None))
    pass_stats = not module.training or module.track_running_stats
    rm = module.running_mean if pass_stats else None
    rv = module.running_var if pass_stats else None
    if running is not None and rm is not None:
        rm, rv = running
    affine = module.weight is not None
    inputs = {"x": _to_numpy(x)}
    if affine:
        inputs["gamma"], inputs["beta"] = _to_numpy(module.weight), _to_numpy(module.bias)
    else:  # the kernel's parameter dtype: the running statistics', else the input's
        pdt = get_format(str(rm.dtype)).dtype if rm is not None else inputs["x"].dtype
        inputs["gamma"], inputs["beta"] = np.ones(channels, dtype=pdt), np.zeros(channels, dtype=pdt)
    if rm is not None and rv is not None:
        inputs["running_mean"], inputs["running_var"] = _to_numpy(rm), _to_numpy(rv)
    meta: dict[str, Any] = {
        "affine": affine, "track_running_stats": bool(module.track_running_stats),
        "momentum_none": module.momentum is None, "memory_format": _memory_format(x), "device": str(x.device),
        "requires_grad": {"x": bool(x.requires_grad), "gamma": bool(affine and module.weight.requires_grad),
                          "beta": bool(affine and module.bias.requires_grad)}}
    return CapturedCall(f"{path}#{index}", path, type(module).__name__, index, order, training, float(module.eps), None,
                 meta, inputs)


def momentum_factor(module: Any) -> float:
    """The factor torch's BatchNorm ``module`` applies to the batch statistics in its running update now
    (torch.nn.modules.batchnorm: momentum=None is the cumulative average, 1/num_batches_tracked; 0 when it does not
    update, unless a momentum is set)."""
    nbt = module.num_batches_tracked
    if module.training and module.track_running_stats and nbt is not None:
        return 1.0 / float(nbt) if module.momentum is None else float(module.momentum)
    return 0.0 if module.momentum is None else float(module.momentum)


def outside_graph(torch: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """What keeps a hook out of torch.compile's graph (``torch._dynamo.disable``; a torch without dynamo: nothing).
    A hook run, not traced, breaks the graph around its module: dynamo would otherwise try to compile bnprobe's own
    work (its file writes), and the module then runs as a compiled graph of its own."""
    return getattr(getattr(torch, "_dynamo", None), "disable", lambda f: f)


def finish_call(module: Any, call: CapturedCall, y: torch.Tensor | None = None, *, node: Any = None,
                running_out: tuple[Any, Any] | None = None) -> tuple[Any, bool]:
    """``call``'s outputs recorded from the module after its forward and its output ``y``: the momentum factor
    torch applied, y, the statistics the kernel saved, the running statistics after the update; (y's autograd
    node, whether it is a BatchNorm kernel's).  Without ``y`` (a monitor that kept no copy of it), ``node`` is y's
    autograd node and ``running_out`` the running statistics as the call left them."""
    import torch

    call.momentum = momentum_factor(module)
    if y is not None:
        call.outputs["y"] = _to_numpy(y)
        node = y.grad_fn
    node_name = type(node).__name__ if node is not None else None
    call.meta["grad_fn"] = node_name
    is_bn_node = node_name in BN_NODES
    if node_name == COMPILED_NODE:
        call.meta["notes"] = [*call.meta.get("notes", []), COMPILED_NOTE]
        call.meta["compiled"] = "torch.compile"
    if call.training:
        if is_bn_node:
            mean, invstd = node._saved_result1, node._saved_result2
            call.outputs["saved_mean"], call.outputs["saved_value"] = _to_numpy(mean), _to_numpy(invstd)
        else:
            call.meta["saved"] = ("not recorded: the forward built no autograd graph (torch.no_grad, or "
                                  "nothing requires grad)" if node is None else
                                  f"not recorded: y comes from {node_name}, not a BatchNorm kernel's node")
        if "running_mean" in call.inputs:
            rm, rv = running_out if running_out is not None else (module.running_mean, module.running_var)
            call.outputs["running_mean_out"], call.outputs["running_var_out"] = _to_numpy(rm), _to_numpy(rv)
    kernel_x = getattr(node, "_saved_input", None) if is_bn_node else None
    if isinstance(kernel_x, torch.Tensor) and get_format(str(kernel_x.dtype)).dtype != call.inputs["x"].dtype:
        # an autocast that casts BatchNorm's input: the recorded x is the module's, not the kernel's
        call.meta["kernel_input_dtype"] = str(kernel_x.dtype).replace("torch.", "")
    return node, is_bn_node


def start_family_call(module: Any, fm: FamilyModule, path: str, index: int, order: int, x: torch.Tensor
                      ) -> CapturedCall:
    """A call of the family module ``module`` (``fm`` says which layer) on ``x``: x, γ and β as the module holds
    them (γ ones where it has none), ε, and the layer in the call's meta."""
    inputs = {"x": _to_numpy(x)}
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    inputs["gamma"] = _to_numpy(w) if w is not None else ones_like_params(fm, x, inputs["x"].dtype)
    if b is not None and fm.norm != "rms":
        inputs["beta"] = _to_numpy(b)
    meta: dict[str, Any] = {
        **fm.meta(x), "affine": fm.affine, "memory_format": _memory_format(x), "device": str(x.device),
        "requires_grad": {"x": bool(x.requires_grad), "gamma": bool(w is not None and w.requires_grad),
                          "beta": bool(b is not None and b.requires_grad)}}
    return CapturedCall(f"{path}#{index}", path, type(module).__name__, index, order, bool(module.training),
                        fm.eps_for(x), None, meta, inputs)


def finish_family_call(call: CapturedCall, y: torch.Tensor | None, *, grad_fn: Any = None) -> tuple[Any, str | None]:
    """y and the statistics the family kernel saved; (the node whose hook gives the backward, its kind), the kind
    None where no kernel node saved them (RMSNorm's composite, or no autograd: said in the meta).  Without ``y`` (a
    monitor that kept no copy of it), ``grad_fn`` is y's autograd node, and the meta says y was not kept."""
    if y is not None:
        call.outputs["y"] = _to_numpy(y)
        grad_fn = y.grad_fn
    else:
        call.meta["y"] = "not kept: the anomaly showed in the backward, after y had gone on"
    node, kind = kernel_node_of(grad_fn)
    call.meta["grad_fn"] = type(grad_fn).__name__ if grad_fn is not None else None
    if kind is not None:
        mean, rstd = saved_statistics(node)
        call.outputs["saved_mean"] = _to_numpy(mean).reshape(-1)
        call.outputs["saved_value"] = _to_numpy(rstd).reshape(-1)
        if call.meta["norm"] == "instance":  # (the BatchNorm node saves invstd of the (1, N·C, ...) view)
            call.meta["kernel"] = "batch_norm on the (1, N·C, ...) view"
    else:
        call.meta["saved"] = ("not recorded: the forward built no autograd graph (torch.no_grad, or nothing "
                              "requires grad)" if grad_fn is None else
                              f"not recorded: y comes from {call.meta['grad_fn']} (a composite of ops), no kernel's "
                              "node saves the statistics")
    return node, kind


def record_family_node_grads(call: CapturedCall, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...],
                             kind: str) -> bool:
    """The backward of a family ``call`` from its kernel node's hook (dy; dx, dγ, dβ); False when it is not the first
    backward."""
    call.backward_runs += 1
    if call.backward_runs > 1:
        return False
    got = record_family_grads(grad_inputs, int(call.meta["x_shape"][0]), kind)  # (x itself may be spilled by now)
    if grad_outputs and grad_outputs[0] is not None:
        call.grads_in["dy"] = _to_numpy(grad_outputs[0]).reshape(call.meta["x_shape"])
    for name in ("dx", "dgamma", "dbeta"):
        if name in got:
            a = _to_numpy(got[name])
            call.grads_out[name] = a.reshape(call.meta["x_shape"]) if name == "dx" else a
    req = call.meta["requires_grad"]
    missing = {n: (f"not computed: {w} does not require grad" if not req[w] else "not computed by the kernel")
               for n, w in (("dx", "x"), ("dgamma", "gamma"), ("dbeta", "beta"))
               if n not in call.grads_out and not (n == "dbeta" and call.meta["norm"] == "rms")}
    if missing:
        call.meta["backward_missing"] = missing
    return True


def record_module_grads(call: CapturedCall, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
    """dy and dx of a family ``call`` without a kernel node (RMSNorm's composite), from its module's backward hook."""
    call.backward_runs += 1
    if grad_output and grad_output[0] is not None:
        call.grads_in["dy"] = _to_numpy(grad_output[0])
    if grad_input and grad_input[0] is not None:
        call.grads_out["dx"] = _to_numpy(grad_input[0])


def record_grads(call: CapturedCall, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> bool:
    """The backward of ``call`` recorded from its BatchNorm node's hook (dy; dx, dγ, dβ, and why one is missing);
    False when it is not the first backward (retain_graph: the first is kept, the runs counted)."""
    call.backward_runs += 1
    if call.backward_runs > 1:
        return False
    if grad_outputs and grad_outputs[0] is not None:
        call.grads_in["dy"] = _to_numpy(grad_outputs[0])
        call.meta["dy_memory_format"] = _memory_format(grad_outputs[0])
    missing = {}
    req = call.meta["requires_grad"]
    for i, (name, why) in enumerate((("dx", "x"), ("dgamma", "gamma"), ("dbeta", "beta"))):
        g = grad_inputs[i] if i < len(grad_inputs) else None
        if g is not None:
            call.grads_out[name] = _to_numpy(g)
        elif not call.meta["affine"] and name != "dx":
            missing[name] = "not computed: affine=False"
        elif not req[why]:
            missing[name] = f"not computed: {why} does not require grad"
        else:
            missing[name] = "not computed by the kernel"
    if missing:
        call.meta["backward_missing"] = missing
    return True


class Capture:
    """The context manager :func:`capture` returns; see there.  After a clean exit ``calls`` holds the
    recorded call names in forward order, ``skipped`` the calls not recorded per module, ``written`` the
    files written."""

    def __init__(self, model: torch.nn.Module, out: str | Path, *, force: bool = False, backward: bool = True,
                 calls_per_module: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if calls_per_module is not None and (not isinstance(calls_per_module, int) or calls_per_module < 1):
            raise BNProbeError(f"calls_per_module must be a positive integer or None, got {calls_per_module!r}")
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise BNProbeError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.model = model
        self.out = Path(out)
        self.force = force
        self.backward = backward
        self.calls_per_module = calls_per_module
        self.max_bytes = max_bytes
        self.calls: list[str] = []
        self.skipped: dict[str, int] = {}
        self.written: list[Path] = []
        self.reserved_bytes = 0
        self._records: list[CapturedCall] = []
        self._counts: dict[str, int] = {}
        self._pending: dict[int, CapturedCall | None] = {}
        self._handles: list[Any] = []
        self._error: BNProbeError | None = None
        self._entered = False
        self._torch: Any = None
        self._opened = False  # the output folder prepared for the first call's files
        self._created_out = False  # ... and made by this capture (removed again if it fails)
        self._stale: list[Path] = []  # call folders of the capture force overwrites
        self._family: dict[int, FamilyModule] = {}  # the family modules hooked, by id
        self._awaiting: dict[int, list[CapturedCall]] = {}  # an RMSNorm module's calls awaiting their backward
        self._dgamma_seen: set[int] = set()  # the calls whose weight gradient has come (RMSNorm's)

    # ---- entering: checks, then hooks ------------------------------------------------------------
    def _check_out(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise BNProbeError(f"{out} is a file; capture writes a folder")
        if not out.is_dir() or self.force:
            return
        for p in (out / CALLS_NAME, out / META_NAME):
            if p.exists():
                raise BNProbeError(f"{p} exists; refusing to overwrite a dump (pass force=True, or choose another "
                                   "out)")
        partial = sorted(d for d in out.iterdir() if (d / META_NAME).is_file())
        if partial:
            raise BNProbeError(f"{out} holds dump folders without an index ({partial[0].name}, ...), an incomplete "
                               "capture; refusing to write into it (pass force=True, or choose another out)")

    def __enter__(self) -> Capture:
        try:
            import torch
            from torch.nn.modules.batchnorm import _BatchNorm
        except ImportError:
            raise BNProbeError("capture needs torch (pip install 'bnprobe[torch]')") from None
        if self._entered:
            raise BNProbeError("a capture context is entered once; make a new capture(...) for another run")
        if not isinstance(self.model, torch.nn.Module):
            raise BNProbeError(f"capture needs a torch.nn.Module, got {type(self.model).__name__}")
        self._check_out()
        self._family = {id(m): fm for _, m in self.model.named_modules()
                        if not isinstance(m, _BatchNorm) and (fm := family_module(m)) is not None}
        modules = [(path, m) for path, m in self.model.named_modules()
                   if isinstance(m, _BatchNorm) or id(m) in self._family]
        if not modules:
            raise BNProbeError(f"{type(self.model).__name__} has no BatchNorm module (a subclass of "
                               "torch.nn.modules.batchnorm._BatchNorm) or LayerNorm, RMSNorm, GroupNorm, "
                               "InstanceNorm module to capture")
        self._torch = torch
        self._entered = True
        outside = outside_graph(torch)
        try:
            for path, m in modules:
                self._handles.append(m.register_forward_pre_hook(outside(self._pre_hook(path)), with_kwargs=True))
                self._handles.append(m.register_forward_hook(outside(self._post_hook(path)), with_kwargs=True))
                if self.backward and id(m) in self._family and self._family[id(m)].norm == "rms":
                    # (RMSNorm's composite has no kernel node: dx and dy from the module, dγ from its weight)
                    self._handles.append(m.register_full_backward_hook(self._module_grad_hook(m)))
                    if getattr(m, "weight", None) is not None and m.weight.requires_grad:
                        self._handles.append(m.weight.register_hook(self._weight_grad_hook(m)))
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()

    # ---- hooks -------------------------------------------------------------------------------------
    def _refuse(self, message: str) -> NoReturn:
        self._error = BNProbeError(message)
        raise self._error

    def _pre_hook(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._error is not None:  # the body went on after a refusal: record nothing more
                self._pending[id(module)] = None
                return
            index = self._counts.get(path, 0)
            self._counts[path] = index + 1
            if self.calls_per_module is not None and index >= self.calls_per_module:
                self.skipped[path] = self.skipped.get(path, 0) + 1
                self._pending[id(module)] = None
                return
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, self._torch.Tensor):
                self._refuse(f"{path}: BatchNorm called without a tensor input")
            self._pending[id(module)] = self._start(module, path, index, x)
        return hook

    def _start(self, module: Any, path: str, index: int, x: torch.Tensor) -> CapturedCall:
        torch = self._torch
        name = f"{path}#{index}"
        channels = x.shape[1] if x.dim() > 1 else 0
        params = [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]
        channels = max([channels] + [p.numel() for p in params])
        grad_possible = self.backward and torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in params))
        need = x.numel() * x.element_size() * (4 if grad_possible else 2) + channels * 8 * _VECTORS_PER_CALL
        if self.reserved_bytes + need > self.max_bytes:
            self._refuse(f"capture needs {_format_bytes(self.reserved_bytes + need)} to record {name} (x "
                         f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}, {len(self._records)} calls before "
                         f"it), over max_bytes = {_format_bytes(self.max_bytes)}: record fewer calls "
                         "(calls_per_module), a smaller batch, or raise max_bytes")
        self.reserved_bytes += need
        fm = self._family.get(id(module))
        if fm is not None:
            call = start_family_call(module, fm, path, index, len(self._records), x)
            call.meta["x_shape"] = list(x.shape)
        else:
            call = start_call(module, path, index, len(self._records), x)
        call.nbytes = need
        return call

    def _post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            call = self._pending.pop(id(module), None)
            if call is None:
                return
            hooked = self._finish(module, call, output)
            self._records.append(call)
            self.calls.append(call.name)
            self._store(call, awaiting=hooked)
        return hook

    # ---- writing as it goes: one call's tensors in memory at a time -----------------------------------
    def _open(self) -> None:
        """Before the first file: the output folder made, an overwritten capture's index removed (its folders are
        cleaned up at the exit, those this capture does not reuse)."""
        if self._opened:
            return
        out = self.out
        index_path = out / CALLS_NAME
        if self.force and index_path.is_file():
            try:
                self._stale = [out / c["dir"] for c in read_calls(out)["calls"]]
            except BNProbeError:
                self._stale = []
            index_path.unlink()  # while the call folders change, the folder is not a complete dump
        self._created_out = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        self._opened = True

    def _store(self, call: CapturedCall, *, awaiting: bool) -> None:
        """A call just recorded: spilled when its backward is awaited, else written."""
        if self._error is not None:
            return
        try:
            self._open()
            if awaiting:
                call.spill(self.out / call.dir)
                self.reserved_bytes -= call.nbytes
            else:
                self._write_call(call)
        except OSError as exc:
            self._refuse(f"{self.out / call.dir}: cannot write the call ({type(exc).__name__}: {exc})")

    def _write_call(self, call: CapturedCall) -> None:
        """The call's dump, from its tensors (read back from its spill file if there), which are then let go."""
        folder = self.out / call.dir
        if call.state == "spilled":
            call.unspill(folder)
            self.reserved_bytes += call.nbytes
        self.written += write_dump(call.recording(str(self._torch.__version__)), folder, force=self.force)
        call.release()
        self.reserved_bytes -= call.nbytes

    def _finish(self, module: Any, call: CapturedCall, y: Any) -> bool:
        """The call's outputs recorded; True when a hook now awaits its backward."""
        if not isinstance(y, self._torch.Tensor):
            self._refuse(f"{call.name}: the module returned {type(y).__name__}, not a tensor")
        if "norm" in call.meta:
            return self._finish_family(module, call, y)
        node, is_bn_node = finish_call(module, call, y)
        if self.backward and is_bn_node:
            self._handles.append(node.register_hook(self._grad_hook(call)))
            return True
        if self.backward and node is not None and not call.meta.get("compiled"):
            call.meta["backward_note"] = (f"not hooked: y comes from {type(node).__name__}, not a BatchNorm kernel's "
                                          "node")
        return False

    def _finish_family(self, module: Any, call: CapturedCall, y: Any) -> bool:
        """A family call's outputs recorded; True when a hook now awaits its backward (its kernel node's, or for
        RMSNorm's composite the module's own)."""
        node, kind = finish_family_call(call, y)
        if not self.backward or y.grad_fn is None:
            return False
        if kind is not None:
            self._handles.append(node.register_hook(self._family_node_hook(call, kind)))
            return True
        if call.meta["norm"] == "rms":
            self._awaiting.setdefault(id(module), []).append(call)
            return True
        call.meta["backward_note"] = f"not hooked: y comes from {call.meta['grad_fn']}, not a kernel's node"
        return False

    def _family_node_hook(self, call: CapturedCall, kind: str) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if record_family_node_grads(call, grad_inputs, grad_outputs, kind):
                self._write_on_arrival(call)
        return hook

    def _module_grad_hook(self, module: Any) -> Callable[..., None]:
        """RMSNorm's dy and dx, from the module's backward hook, to its latest call awaiting them (backward runs
        the calls in reverse); written at the exit, when its weight's gradient has come too."""
        def hook(mod: Any, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            calls = [c for c in self._awaiting.get(id(module), []) if c.backward_runs == 0]
            if not calls:
                return
            record_module_grads(calls[-1], grad_input, grad_output)
        return hook

    def _weight_grad_hook(self, module: Any) -> Callable[..., None]:
        """RMSNorm's dγ, from its weight's gradient: the call's own only when the module ran once in the step (else
        it is the sum over its calls, and not recorded)."""
        def hook(grad: Any) -> None:
            calls = [c for c in self._awaiting.get(id(module), []) if id(c) not in self._dgamma_seen]
            if len(calls) == 1:
                calls[0].grads_out["dgamma"] = _to_numpy(grad)
            for c in calls:
                self._dgamma_seen.add(id(c))
                if len(calls) > 1:
                    c.meta["backward_missing"] = {"dgamma": "not recorded: the module ran more than once before "
                                                            "this backward, and its weight's gradient sums its calls"}
        return hook

    def _grad_hook(self, call: CapturedCall) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if record_grads(call, grad_inputs, grad_outputs):
                self._write_on_arrival(call)
        return hook

    def _write_on_arrival(self, call: CapturedCall) -> None:
        """A call whose backward just came: its dump written now (its forward was spilled awaiting it)."""
        if call.state == "spilled" and self._error is None:
            try:
                self._write_call(call)
            except (OSError, BNProbeError) as exc:
                self._refuse(str(exc) if isinstance(exc, BNProbeError) else
                             f"{self.out / call.dir}: cannot write the call ({type(exc).__name__}: {exc})")

    # ---- leaving: write ----------------------------------------------------------------------------
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove_hooks()
        if exc_type is not None:
            self._discard()
            return  # the body failed: nothing stays written, its exception goes through
        if self._error is not None:
            self._discard()
            raise BNProbeError(f"{self._error} (caught inside the capture; nothing written)")
        try:
            self._write()
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        """Every file this capture wrote removed again (and the folders it made, when left empty)."""
        for call in self._records:
            folder = self.out / call.dir
            (folder / _SPILL).unlink(missing_ok=True)
        for p in self.written:
            p.unlink(missing_ok=True)
        for call in self._records:
            folder = self.out / call.dir
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if self._created_out and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()
        self.written = []
        self._records.clear()

    def _index(self, version: str) -> dict[str, Any]:
        calls = [{"name": c.name, "dir": c.dir, "module": c.module, "type": c.type, "index": c.index,
                  "order": c.order, "training": c.training, "backward": c.backward_runs > 0} for c in self._records]
        notes = [f"{m}: {n} call(s) after the first {self.calls_per_module} not recorded (calls_per_module)"
                 for m, n in self.skipped.items()]
        compiled = [c.name for c in self._records if c.meta.get("compiled")]
        if compiled:
            notes.append(f"{len(compiled)} of {len(calls)} call(s) recorded inside a torch.compile'd model: their "
                         "forward only (each call's note says why)")
        return {"format": CALLS_TAG, "version": 1, "source": "capture", "torch": version, "calls": calls,
                "calls_per_module": self.calls_per_module, "skipped": dict(self.skipped), "notes": notes}

    def _write(self) -> None:
        """At a clean exit: the calls whose backward never came written, the backward runs of those it came to
        more than once updated, the overwritten capture's unused folders removed, then the index."""
        out = self.out
        self._open()
        index_path = out / CALLS_NAME
        version = str(self._torch.__version__)
        for call in self._records:
            if call.state != "written":
                self._write_call(call)
            elif call.backward_runs != call.runs_written:  # retain_graph: the first backward kept, the runs counted
                meta_path = out / call.dir / META_NAME
                doc = json.loads(meta_path.read_text())
                doc["meta"]["backward_runs"] = call.backward_runs
                atomic_write_text(meta_path, json.dumps(doc, indent=2, default=str))
        keep = {out / c.dir for c in self._records}
        for d in self._stale:  # folders of the overwritten capture that this one does not reuse
            if d in keep or not d.is_dir() or out.resolve() not in d.resolve().parents:
                continue
            for name in (META_NAME, TENSORS_NAME):
                (d / name).unlink(missing_ok=True)
            if not any(d.iterdir()):
                d.rmdir()
        atomic_write_text(index_path, dumps_json(self._index(version)))
        self.written.append(index_path)


def capture(model: torch.nn.Module, out: str | Path, *, force: bool = False, backward: bool = True,
            calls_per_module: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Capture:
    """A context manager recording every call of ``model``'s BatchNorm modules inside it into ``out``.

    ``out`` must not hold a dump yet unless ``force``.  ``backward``: also record the backward of each call
    that runs inside the context.  ``calls_per_module``: keep only each module's first N calls (the index
    lists the rest as skipped).  ``max_bytes``: refuse (BNProbeError, nothing left written) before the tensors
    held in memory (the calls not yet on disk: a training step's forwards are spilled as they run) would exceed
    it.  Each call is written as soon as it is complete; if the body raises, every file the capture wrote is
    removed again (with ``force``, the overwritten capture's index is gone by then); the index is written last.
    """
    return Capture(model, out, force=force, backward=backward, calls_per_module=calls_per_module,
                   max_bytes=max_bytes)

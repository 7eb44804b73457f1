"""``torch-compile``: PyTorch's BatchNorm, LayerNorm, RMSNorm and GroupNorm as ``torch.compile`` runs them on the CPU
(TorchInductor's generated C++).

Inductor does not call aten's BatchNorm kernel: it decomposes ``native_batch_norm`` and its backward into
reductions and pointwise ops (``torch/_decomp/decompositions.py``) and generates a C++ kernel for them.  On the
CPU the decomposition returns the saved mean and 1/√(var + ε) **in the input's format** (fp16 input: fp16 saved
statistics, where eager keeps them in fp32) and the backward reads them so; the statistics are a two-pass sum
at a static per-channel count up to ``use_two_step_variance_threshold`` (1024) and Welford above it.

Each kind of call (training forward, inference, backward) is one compiled function, compiled with static shapes
(``dynamic=False``, what a model of one input shape runs; ``dynamic=true`` for the symbolic-shape kernel a
model meets after its input shape changed) and ``fullgraph=True``.  A new shape or format is a recompile; the
recompile limit is raised for bnprobe's many probes and hitting it is an error, never dynamo's silent fall back to
eager.  The backward is compiled from ``native_batch_norm_backward`` on the forward's own saved statistics: the
same C++ as autograd through the compiled forward (a test holds the two equal bit for bit).  Time spent compiling
is kept apart (:attr:`TorchCompileAdapter.compile_seconds`) from the time running.

The family layers are compiled the same way: ``native_layer_norm`` and ``native_group_norm`` (their saved mean and
rstd in the input's format on the CPU, as the decompositions return them) with their backward ops on those
statistics; RMSNorm as ``F.rms_norm`` (a composite: inductor generates it from pow, mean, rsqrt and the products, and
returns no statistics), its rstd the compiled ``rsqrt(mean(x²) + ε)`` of x in its op-math format, and its backward
autograd through the compiled ``F.rms_norm`` — the compiled backward graph, which reads the forward's own rstd.
InstanceNorm (torch's batch_norm on a view) is not run compiled.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from bnprobe.adapters.base import BackwardOutput, Capabilities, FamilyPrepared, ForwardOutput, Prepared, Saved
from bnprobe.adapters.frameworks import parse_options
from bnprobe.adapters.torch_adapter import TorchAdapter
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["TorchCompileAdapter", "MODES", "RECOMPILE_LIMIT", "COMPILED_NORMS"]

#: torch.compile's modes (on the CPU reduce-overhead's CUDA graphs do not apply; max-autotune may choose other
#: kernels for matmuls, not for BatchNorm's reductions — each is offered because a user's model names one)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: recompiles allowed per compiled function: identify's probes are a few dozen shapes and formats; dynamo's own
#: default (8) would send the rest to eager without a word
RECOMPILE_LIMIT = 512
#: the layers run compiled (InstanceNorm, torch's batch_norm on a (1, N·C, ...) view, is not)
COMPILED_NORMS = ("batch", "layer", "rms", "group")


class TorchCompileAdapter(TorchAdapter):
    """``torch-compile[:mode=...,dynamic=true]``: aten's BatchNorm ops compiled by TorchInductor on the CPU."""

    def __init__(self, opts: str = "") -> None:
        o = parse_options("torch-compile", opts, {"mode": MODES, "dynamic": ("false", "true")})
        super().__init__("cpu")
        self.mode = o.get("mode", "default")
        self.dynamic = o.get("dynamic", "false") == "true"
        self.name = "torch-compile" + (f":{opts.strip()}" if opts.strip() else "")
        self.compile_seconds = 0.0  # wall time of the calls that compiled
        self.compiles = 0
        self._compiled: dict[str, Callable[..., Any]] = {}

    def capabilities(self) -> Capabilities:
        """torch's, with the threads inductor generates its kernels for (``config.cpp.threads``, else torch's own
        thread count): where a vector holds channels and they are few, its kernels split each channel across them."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (inductor's imports: see _op)
            from torch._inductor.utils import parallel_num_threads

            threads = parallel_num_threads()
        return dataclasses.replace(super().capabilities(), threads=threads, norms=COMPILED_NORMS)

    def _stats_format(self, p: Prepared) -> str:
        """Inductor's decomposition returns the saved mean and invstd in the input's dtype on the CPU, whatever the
        parameters', and its backward reads them so."""
        return p.dtype

    # ---- compiling -------------------------------------------------------------------------------
    def _fn(self, kind: str) -> Callable[..., Any]:
        if kind not in self._compiled:
            ops, fn = self.torch.ops.aten, self.torch.nn.functional
            torch = self.torch
            # (one function each: dynamo's recompile limit counts per function)
            plain = {"train": lambda *a: ops.native_batch_norm(*a), "infer": lambda *a: ops.native_batch_norm(*a),
                     "backward": lambda *a: ops.native_batch_norm_backward(*a, [True, True, True]),
                     "layer": lambda *a: ops.native_layer_norm(*a),
                     "layer_backward": lambda *a: ops.native_layer_norm_backward(*a),
                     "group": lambda *a: ops.native_group_norm(*a),
                     "group_backward": lambda *a: ops.native_group_norm_backward(*a, [True, True, True]),
                     "rms": lambda x, n, w, eps: fn.rms_norm(x, n, w, eps),
                     # (x in its op-math format, as the composite upcasts it)
                     "rms_rstd": lambda x, dims, eps: torch.rsqrt(
                         (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).pow(2).mean(
                             dims, keepdim=True) + eps)}[kind]
            self._compiled[kind] = self.torch.compile(plain, mode=self.mode, dynamic=self.dynamic, fullgraph=True)
        return self._compiled[kind]

    def _op(self, kind: str, *args: Any) -> Any:
        """The compiled op of ``kind`` (see :meth:`TorchAdapter._op`); a call that compiled has its time added to
        :attr:`compile_seconds`."""
        from torch._dynamo import config
        from torch._dynamo.utils import counters

        before = sum(counters["stats"].values()) if "stats" in counters else 0
        start = time.perf_counter()
        try:
            with config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT * 4,
                              fail_on_recompile_limit_hit=True), self.torch.no_grad(), warnings.catch_warnings():
                # inductor's own imports warn of torch's deprecations (torch.jit.script_method): nothing the user
                # can act on, and under an error filter they would fail the compile
                warnings.simplefilter("ignore", DeprecationWarning)
                # (rms_norm of a 16-bit x with a float γ says, while tracing, that it takes the composite path —
                # the one compiled here)
                warnings.filterwarnings("ignore", "Mismatch dtype between input and weight", UserWarning)
                if kind == "rms_grad":  # autograd through the compiled forward: its compiled backward graph
                    x, n, w, eps, g = args
                    with self.torch.enable_grad():
                        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
                        out = self.torch.autograd.grad(self._fn("rms")(xg, n, wg, eps), (xg, wg), g)
                else:
                    out = self._fn(kind)(*args)
        except Exception as exc:  # noqa: BLE001 - a compile failure is the kernel's answer, said in one line
            if "recompile" in str(exc).lower() and "limit" in str(exc).lower():
                raise BNProbeError(f"adapter {self.name}: torch.compile hit its recompile limit "
                                   f"({RECOMPILE_LIMIT}); bnprobe never lets it fall back to eager") from None
            raise BNProbeError(f"adapter {self.name}: torch.compile failed: "
                               f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                               ) from None
        if (sum(counters["stats"].values()) if "stats" in counters else 0) != before:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        return out

    def _meta(self, train: Prepared | None = None) -> dict[str, Any]:
        return {"torch": self.torch.__version__, "device": "cpu", "compiled": "inductor", "mode": self.mode,
                "dynamic": self.dynamic, **({"saved_format": self._stats_format(train)} if train is not None else {})}

    # ---- the family layers, compiled ------------------------------------------------------------------
    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        sh = p.shape
        x, w, b = self._family_tensors(p)
        if sh.norm == "layer":
            y, mean, rstd = self._op("layer", x, list(sh.normalized), w, b, eps)
        elif sh.norm == "rms":
            dims = tuple(range(x.ndim - len(sh.normalized), x.ndim))
            y, mean = self._op("rms", x, list(sh.normalized), w, eps), None
            rstd = self._op("rms_rstd", x, dims, eps)
        else:
            n, c = sh.shape[0], sh.shape[1]
            y, mean, rstd = self._op("group", x, w, b, n, c, sh.r * sh.groups // c, sh.groups, eps)
        sf = self._format_of(rstd)
        saved = Saved(None if mean is None else self._array(mean.reshape(-1), sf), "invstd",
                      self._array(rstd.reshape(-1), sf))
        return ForwardOutput(self._array(y, p.dtype), saved, meta=self._meta())

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved, *, eps: float) -> BackwardOutput:
        sh = p.shape
        x, w, b = self._family_tensors(p)
        g = self._tensor(dy, p.dtype)
        sf = get_format(np.asarray(saved.value).dtype).name
        meta = self._meta()
        db = None
        if sh.norm == "layer":
            lead = sh.shape[:len(sh.shape) - len(sh.normalized)]
            stat_shape = (*lead, *(1,) * len(sh.normalized))
            mean = self._tensor(np.reshape(saved.mean, stat_shape), sf)
            rstd = self._tensor(np.reshape(saved.value, stat_shape), sf)
            dx, dw, db = self._op("layer_backward", g, x, list(sh.normalized), mean, rstd, w, b,
                                  [True, True, b is not None])
        elif sh.norm == "group":
            n, c = sh.shape[0], sh.shape[1]
            mean = self._tensor(np.reshape(saved.mean, (n, sh.groups)), sf)
            rstd = self._tensor(np.reshape(saved.value, (n, sh.groups)), sf)
            dx, dw, db = self._op("group_backward", g, x, mean, rstd, w, n, c, sh.r * sh.groups // c, sh.groups)
        else:
            dx, dw = self._op("rms_grad", x, list(sh.normalized), w, eps, g)
            meta["missing"] = ("dbeta",)
            meta["note"] = ("RMSNorm's backward is autograd through the compiled forward: it reads the rstd that "
                            "forward computes, not the saved statistics handed in")
        return BackwardOutput(self._array(dx, p.dtype), self._array(dw.reshape(-1), p.params).reshape(sh.param_shape),
                              None if db is None else self._array(db.reshape(-1), p.params).reshape(sh.param_shape),
                              meta=meta)

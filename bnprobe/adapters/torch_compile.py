"""``torch-compile``: PyTorch's BatchNorm as ``torch.compile`` runs it on the CPU (TorchInductor's generated C++).

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
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

from bnprobe.adapters.base import Capabilities, Prepared
from bnprobe.adapters.frameworks import parse_options
from bnprobe.adapters.torch_adapter import TorchAdapter
from bnprobe.core.errors import BNProbeError

__all__ = ["TorchCompileAdapter", "MODES", "RECOMPILE_LIMIT"]

#: torch.compile's modes (on the CPU reduce-overhead's CUDA graphs do not apply; max-autotune may choose other
#: kernels for matmuls, not for BatchNorm's reductions — each is offered because a user's model names one)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: recompiles allowed per compiled function: identify's probes are a few dozen shapes and formats; dynamo's own
#: default (8) would send the rest to eager without a word
RECOMPILE_LIMIT = 512


class TorchCompileAdapter(TorchAdapter):
    """``torch-compile[:mode=...,dynamic=true]``: aten's BatchNorm ops compiled by TorchInductor on the CPU."""

    def __init__(self, opts: str = "") -> None:
        o = parse_options("torch-compile", opts, {"mode": MODES, "dynamic": ("false", "true")})
        super().__init__("cpu")
        self._family_ops = False  # (its compiled family layers are not run yet: BatchNorm only)
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
        return dataclasses.replace(super().capabilities(), threads=threads)

    def _stats_format(self, p: Prepared) -> str:
        """Inductor's decomposition returns the saved mean and invstd in the input's dtype on the CPU, whatever the
        parameters', and its backward reads them so."""
        return p.dtype

    # ---- compiling -------------------------------------------------------------------------------
    def _fn(self, kind: str) -> Callable[..., Any]:
        if kind not in self._compiled:
            ops = self.torch.ops.aten
            # (one function each: dynamo's recompile limit counts per function)
            plain = {"train": lambda *a: ops.native_batch_norm(*a), "infer": lambda *a: ops.native_batch_norm(*a),
                     "backward": lambda *a: ops.native_batch_norm_backward(*a, [True, True, True])}[kind]
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

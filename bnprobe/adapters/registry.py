"""The lazy adapter registry: names to factories, with why an adapter is unavailable here."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from bnprobe._loading import binds, first_line, kind_of, raised, resolve
from bnprobe.adapters.base import BaseAdapter, Capabilities, KernelAdapter
from bnprobe.adapters.loose import CALL_METHODS, LOOSE_METHODS, LooseKernelAdapter, with_call_methods
from bnprobe.core.errors import BNProbeError

__all__ = ["get_adapter", "as_adapter", "list_adapters", "AdapterInfo", "ENTRY_POINT_GROUP", "BUILTIN_SET",
           "builtin_adapters"]

ENTRY_POINT_GROUP = "bnprobe.adapters"
# compare-precision's default: the built-in kernels side by side, each against the bench (the careful kernel).  The
# Ascend emulators, the 16-bit-accumulator ports (each runs its own format), and torch's CPU kernel where installed;
# not ``emulated`` (each format's preset is the bench's own policy: it would pass every output at half an ulp)
BUILTIN_SET = ("ascend-tbe", "ascend-bnv3", "ascend-950", "emulated:fp16-acc16", "emulated:bf16-acc16")


def builtin_adapters() -> list[str]:
    """:data:`BUILTIN_SET`, and torch where it imports (its absence is said, not an error)."""
    return [*BUILTIN_SET, *(["torch"] if _torch("cpu")() is None else [])]


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    description: str
    why_unavailable: Callable[[], str | None]
    make: Callable[[str], KernelAdapter]  # called with the text after "name:" ("" when none)
    takes_options: str = ""

    @property
    def available(self) -> bool:
        return self.why_unavailable() is None


def _always() -> str | None:
    return None


def _torch(device: str) -> Callable[[], str | None]:
    def why() -> str | None:
        from bnprobe.adapters.torch_adapter import torch_unavailable

        return torch_unavailable(device)

    return why


def _reference(opts: str) -> KernelAdapter:
    from bnprobe.adapters.emulated import ReferenceAdapter

    if opts:
        raise BNProbeError("the reference adapter takes no options")
    return ReferenceAdapter()


def _emulated(opts: str) -> KernelAdapter:
    from bnprobe.adapters.emulated import EmulatedAdapter

    return EmulatedAdapter(opts)


def _careful(opts: str) -> KernelAdapter:
    from bnprobe.adapters.emulated import CarefulAdapter

    if opts:
        raise BNProbeError("the careful adapter takes no options")
    return CarefulAdapter()


def _ascend(kernel: str) -> Callable[[str], KernelAdapter]:
    def make(opts: str) -> KernelAdapter:
        from bnprobe.adapters.ascend import AscendAdapter

        return AscendAdapter(kernel, opts)

    return make


def _syncbn(opts: str) -> KernelAdapter:
    from bnprobe.adapters.syncbn import SyncBNAdapter

    return SyncBNAdapter.from_options(opts)


def _torch_make(device: str) -> Callable[[str], KernelAdapter]:
    def make(opts: str) -> KernelAdapter:
        from bnprobe.adapters.torch_adapter import TorchAdapter

        if opts and device == "cpu" and opts in ("cuda", "npu"):
            return TorchAdapter(opts)
        if opts and opts != device:
            raise BNProbeError(f"unknown torch device {opts!r}; use torch, torch:cuda or torch_npu")
        return TorchAdapter(device)

    return make


def _torch_compile(opts: str) -> KernelAdapter:
    from bnprobe.adapters.torch_compile import TorchCompileAdapter

    return TorchCompileAdapter(opts)


def _onnxruntime_why() -> str | None:
    from bnprobe.adapters.onnxruntime_bn import onnxruntime_unavailable

    return onnxruntime_unavailable()


def _onnxruntime(opts: str) -> KernelAdapter:
    from bnprobe.adapters.onnxruntime_bn import OnnxRuntimeAdapter

    return OnnxRuntimeAdapter(opts)


def _dump(opts: str) -> KernelAdapter:
    from bnprobe.adapters.dump import DumpAdapter
    from bnprobe.recordings import open_dump

    if not opts:
        raise BNProbeError("the dump adapter needs a path: dump:DIR (a bnprobe or msprobe dump folder)")
    return DumpAdapter(open_dump(opts))


def _framework(name: str) -> tuple[Callable[[], str | None], Callable[[str], KernelAdapter]]:
    def why() -> str | None:
        from bnprobe.adapters.frameworks import why_unavailable

        return why_unavailable(name)

    def make(opts: str) -> KernelAdapter:
        from bnprobe.adapters.frameworks import make as make_framework

        return make_framework(name, opts)  # type: ignore[return-value]

    return why, make


# (name, description, options) of the other frameworks' adapters (bnprobe.adapters.frameworks imports none of them)
_FRAMEWORKS = (
    ("jax", "flax.linen.BatchNorm on JAX (flax's convention: biased running variance, k = 1 - m, autodiff); "
     "LayerNorm, RMSNorm, GroupNorm, InstanceNorm",
     "fast_variance=true|false, force_float32=true|false"),
    ("tensorflow", "tf.nn.fused_batch_norm, FusedBatchNormV3 and its gradient op (NHWC, statistics in fp32)", ""),
    ("keras", "keras.layers.BatchNormalization under the float32 / mixed_float16 / mixed_bfloat16 / float16 / "
     "bfloat16 policies; LayerNormalization, RMSNormalization, GroupNormalization", ""),
    ("paddle", "paddle.nn.functional.batch_norm (biased running variance, k = 1 - m; fp32 and fp64 on the CPU)", ""),
    ("mindspore", "mindspore.ops.BatchNorm in PyNative mode (unbiased running variance; fp32 and fp16 on the CPU)",
     ""),
)

BUILTIN: dict[str, AdapterInfo] = {a.name: a for a in (
    AdapterInfo("reference", "FP64 golden: inputs rounded to the format, everything in float64", _always,
                _reference),
    AdapterInfo("emulated", "bnprobe's instrumented kernels; the preset of the dtype, or emulated:<policy>",
                _always, _emulated, "policy spec, e.g. fp16-acc16:variance=naive"),
    AdapterInfo("careful", "the bench of compare-precision: a careful kernel in the run's formats", _always,
                _careful),
    AdapterInfo("ascend-tbe", "Ascend BNTrainingReduce + BNTrainingUpdate (910 / A2 / A3), atomic multi-core sums",
                _always, _ascend("tbe"), "chip=910|910b|910_93|310p|310, cores=N, seed=S"),
    AdapterInfo("ascend-bnv3", "Ascend A2 BatchNormV3: pre-scaled two-pass below R=8192, 64-lane Welford above",
                _always, _ascend("bnv3"), "chip=..., cores=N"),
    AdapterInfo("ascend-950", "Ascend 950 BatchNormV3 (arch35): Newton+FMA rstd, deterministic Chan merge",
                _always, _ascend("950"), "cores=N"),
    AdapterInfo("syncbn", "SyncBatchNorm emulated: the batch split into ranks, per-rank statistics merged through an "
                "all-reduce", _always, _syncbn,
                "ranks=3+8+5|world=K, merge=chan|sums|unweighted, reduce=fp32|fp16|bf16"),
    AdapterInfo("torch", "PyTorch aten native_batch_norm on CPU", _torch("cpu"), _torch_make("cpu"), "cuda"),
    AdapterInfo("torch-compile", "PyTorch's BatchNorm compiled by torch.compile (TorchInductor's C++ on the CPU): "
                "train, infer and backward", _torch("cpu"), _torch_compile,
                "mode=default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs, dynamic=false|true"),
    AdapterInfo("onnxruntime", "an ONNX BatchNormalization node on onnxruntime's CPU provider (inference only; "
                "parameters in x's type)", _onnxruntime_why, _onnxruntime),
    AdapterInfo("torch:cuda", "PyTorch on a CUDA GPU", _torch("cuda"), _torch_make("cuda")),
    AdapterInfo("torch_npu", "PyTorch with torch_npu on an Ascend NPU", _torch("npu"), _torch_make("npu")),
    AdapterInfo("dump", "replay the BatchNorm calls of a bnprobe, capture or msprobe dump: dump:DIR[#CALL-GLOB]",
                _always, _dump, "path"),
    *(AdapterInfo(name, text, *_framework(name), opts) for name, text, opts in _FRAMEWORKS),
)}


def _entry_points() -> dict[str, object]:
    try:
        return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    except Exception:  # noqa: BLE001 - broken metadata of some other package must not break bnprobe
        return {}


# what an adapter has: the call-taking methods, or (kept for one release: bnprobe.adapters.loose) the loose ones
_METHODS = (("capabilities", *CALL_METHODS), ("capabilities", *LOOSE_METHODS))
_NOT_ADAPTER = ("not a KernelAdapter (it needs name, capabilities, train, infer and backward_of, or those of earlier "
                "releases: forward_train, forward_infer and backward)")
# what a BaseAdapter subclass implements to compute anything (the public methods, or their _impl hooks)
_COMPUTES = ("_forward_train_impl", "_forward_infer_impl", "_backward_impl", *CALL_METHODS, *LOOSE_METHODS)


def _class_problem(cls: type) -> str | None:
    """Why the class ``cls`` makes no usable adapter (not one, abstract, or BaseAdapter's unimplemented
    methods left as they are), judged without calling it; None when it does."""
    if not (issubclass(cls, BaseAdapter) or any(all(callable(getattr(cls, m, None)) for m in ms) for ms in _METHODS)):
        return _NOT_ADAPTER
    if inspect.isabstract(cls):
        return f"an abstract class (it does not implement {', '.join(sorted(cls.__abstractmethods__))})"
    if issubclass(cls, BaseAdapter):
        if getattr(cls, "capabilities", None) is BaseAdapter.capabilities:
            return "an adapter base class that does not implement capabilities()"
        if all(getattr(cls, m, None) is getattr(BaseAdapter, m) for m in _COMPUTES):
            return ("an adapter base class that implements none of train, infer and backward_of (nor their _impl "
                    "methods, nor forward_train, forward_infer and backward)")
    return None


def _check_kind(obj: object, where: str, module: str | None = None) -> str:
    """What ``obj`` is as an adapter -- ``class``, ``instance`` or ``factory`` (a Python function of ``module``
    taking no arguments) -- judged **without calling anything of it**; anything else is a one-line error."""
    if isinstance(obj, type):
        why = _class_problem(obj)
        if why:
            raise BNProbeError(f"{where} is {kind_of(obj)}, {why}")
        if not binds(obj):
            raise BNProbeError(f"{where} cannot be called without arguments, as bnprobe makes an adapter")
        return "class"
    if isinstance(obj, (KernelAdapter, LooseKernelAdapter)):
        # (an object that has the protocol's methods as its own attributes is judged by them alone)
        why = _class_problem(type(obj)) if isinstance(obj, BaseAdapter) else None
        if why:
            raise BNProbeError(f"{where} is an instance of {type(obj).__name__}, {why}")
        return "instance"
    if inspect.isfunction(obj) and (module is None or obj.__module__ == module):
        if not binds(obj):
            raise BNProbeError(f"{where} cannot be called without arguments, as bnprobe makes an adapter")
        return "factory"
    raise BNProbeError(f"{where} is {kind_of(obj)}, not a KernelAdapter class or instance, nor a factory "
                       f"function{'' if module is None else f' of {module}'}")


def _construct(make: Callable[[], object], where: str) -> object:
    try:
        return make()
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's constructor may raise anything
        raise BNProbeError(raised(where, exc)) from None


def _instantiate(obj: object, where: str, module: str | None = None, *, plugin: bool = True) -> KernelAdapter:
    """The adapter ``obj`` is (an instance) or makes (a KernelAdapter class, or a Python function of
    ``module`` taking no arguments), its kind checked before it is called, and what it made checked; a
    ``plugin``'s capabilities() must answer a Capabilities (asked once, here, so that a plugin that does not
    implement it is refused before any check runs).  A loose-signature adapter (earlier releases') is returned in
    the shim that gives it the call-taking methods (:func:`~bnprobe.adapters.loose.with_call_methods`)."""
    kind = _check_kind(obj, where, module)
    adapter = obj if kind == "instance" else _construct(obj, where)  # type: ignore[operator]
    if isinstance(adapter, type) or not isinstance(adapter, (KernelAdapter, LooseKernelAdapter)):
        raise BNProbeError(f"{where} made {kind_of(adapter)}, {_NOT_ADAPTER}")
    if kind == "factory" and isinstance(adapter, BaseAdapter) and _class_problem(type(adapter)):
        raise BNProbeError(f"{where} made an instance of {type(adapter).__name__}, {_class_problem(type(adapter))}")
    if not plugin:
        return with_call_methods(adapter)  # type: ignore[no-any-return]
    try:
        caps = adapter.capabilities()
    except NotImplementedError:
        raise BNProbeError(f"{where}: adapter {getattr(adapter, 'name', '?')!r} does not implement "
                           "capabilities()") from None
    except BNProbeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plugin's own code
        raise BNProbeError(raised(f"{where}: capabilities()", exc)) from None
    if not isinstance(caps, Capabilities):
        raise BNProbeError(f"{where}: capabilities() returned {kind_of(caps)}, not a Capabilities")
    return with_call_methods(adapter)  # type: ignore[no-any-return]


def _plugin(spec: str) -> KernelAdapter:
    mod, obj = resolve(spec, "plugin")
    return _instantiate(obj, f"plugin {spec!r}", mod.__name__)


def _entry_point_module(ep: object) -> str:
    return str(getattr(ep, "module", None) or str(getattr(ep, "value", "")).partition(":")[0].strip())


def _load_entry_point(name: str, ep: object) -> tuple[object, str]:
    """The object a ``bnprobe.adapters`` entry point names (its module imported: an installed package's) and
    that module, its kind checked; nothing of it is called.  A standard-library target is refused unloaded."""
    module = _entry_point_module(ep)
    where = f"plugin {name!r} ({getattr(ep, 'value', '?')})"
    if module.partition(".")[0] in sys.stdlib_module_names:
        raise BNProbeError(f"{where} is in the standard library ({module}): an adapter entry point names code of "
                           "its own package")
    try:
        obj = ep.load()  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        raise BNProbeError(f"plugin {name!r} failed to load: {first_line(exc)}") from None
    _check_kind(obj, where, module)
    return obj, module


def refuse_empty_options(spec: str) -> None:
    """A built-in adapter's ``spec`` with a ':' and nothing after it refused in one line: a ':' promises options (a
    DIR for ``dump:``); none given is a mistake, not the adapter's defaults (nor, for ``dump:``, the current folder)."""
    head, sep, opts = spec.strip().partition(":")
    if sep and head in BUILTIN and not opts.strip():
        raise BNProbeError(f"adapter {spec.strip()!r} has nothing after ':'; give " + (
            "dump:DIR" if head == "dump" else f"{head} alone, or {head}:<options>"))


def get_adapter(spec: str | KernelAdapter) -> KernelAdapter:
    """An adapter by name (``emulated:fp16``, ``ascend-tbe:chip=910``, ``dump:DIR``, ``pkg.mod:Name``...)."""
    if not isinstance(spec, str):
        return _instantiate(spec, repr(spec), plugin=False)
    spec = spec.strip()
    if spec in BUILTIN:
        info, opts = BUILTIN[spec], ""
    else:
        head, sep, opts = spec.partition(":")
        info = BUILTIN.get(head) if sep else None
        refuse_empty_options(spec)
    if info is not None:
        why = info.why_unavailable()
        if why and not (info.name == "torch" and opts):
            raise BNProbeError(f"adapter {info.name} is unavailable here: {why}")
        return info.make(opts)
    eps = _entry_points()
    if spec in eps:
        obj, module = _load_entry_point(spec, eps[spec])
        return _instantiate(obj, f"plugin {spec!r} ({getattr(eps[spec], 'value', '?')})", module)
    import difflib

    names = list(BUILTIN) + list(eps)
    head = spec.partition(":")[0]
    near = difflib.get_close_matches(head, names, n=1, cutoff=0.75)
    if ":" in spec and head not in BUILTIN and not (near and _missing_module(head)):
        return _plugin(spec)
    if near:
        raise BNProbeError(f"unknown adapter {spec!r}: did you mean {near[0]!r}? (bnprobe adapters lists them all)")
    raise BNProbeError(f"unknown adapter {spec!r}; known: {', '.join(names)}, or package.module:Name for a plugin")


def as_adapter(adapter: str | Any) -> KernelAdapter:
    """The adapter a library call is given: a spec resolved (:func:`get_adapter`), or the adapter object itself
    (a loose-signature one of earlier releases in its shim, :func:`~bnprobe.adapters.loose.with_call_methods`)."""
    return get_adapter(adapter) if isinstance(adapter, str) else with_call_methods(adapter)  # type: ignore[no-any-return]


def _missing_module(name: str) -> bool:
    """Whether no module ``name`` can be imported (a misspelt adapter rather than a plugin's module)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def list_adapters() -> list[dict[str, object]]:
    """Every adapter bnprobe knows, whether it is available here, and if not, why."""
    rows: list[dict[str, object]] = []
    for info in BUILTIN.values():
        why = info.why_unavailable()
        rows.append({"name": info.name, "available": why is None, "why": why or "", "description": info.description,
                     "options": info.takes_options})
    for name, ep in _entry_points().items():
        # loaded (its module imported) and its kind checked, never called: listing runs no plugin's code
        try:
            _load_entry_point(name, ep)
            why = None
        except BNProbeError as exc:
            why = str(exc)
        rows.append({"name": name, "available": why is None, "why": why or "", "description": f"plugin ({ep.value})",
                     "options": ""})
    return rows

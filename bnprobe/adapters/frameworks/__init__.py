"""Live adapters for other frameworks' own BatchNorm kernels (not re-implementations): each runs the framework's
API on the CPU — training forward, running statistics, inference, and the backward through the framework's own
autodiff (or its gradient op) with the given dy — and declares the framework's convention
(:mod:`bnprobe.core.conventions`), so its running variance, momentum and saved statistics are judged as that
framework defines them.

The adapter interface speaks bnprobe's momentum m (the batch's weight) and channels-first tensors whatever the
framework's own: each adapter passes the framework its own spelling (``1 − m`` where the framework's momentum is
the old value's weight) and its own layout (NHWC where the framework's CPU kernel is).  Each framework is an
optional extra, imported only when its adapter is made; a missing one is a one-line error naming the install.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np

from bnprobe.adapters.base import BaseAdapter, Capabilities, FamilyPrepared, Prepared
from bnprobe.core.conventions import get_convention
from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format

__all__ = ["FrameworkAdapter", "parse_options", "require", "missing", "FRAMEWORKS"]

#: adapter name: (its module, its class, the extra that installs its framework); the registry describes them
FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "jax": ("bnprobe.adapters.frameworks.flax_bn", "FlaxAdapter", "jax"),
    "tensorflow": ("bnprobe.adapters.frameworks.tf_bn", "TensorFlowAdapter", "tensorflow"),
    "keras": ("bnprobe.adapters.frameworks.tf_bn", "KerasAdapter", "tensorflow"),
    "paddle": ("bnprobe.adapters.frameworks.paddle_bn", "PaddleAdapter", "paddle"),
    "mindspore": ("bnprobe.adapters.frameworks.mindspore_bn", "MindSporeAdapter", "mindspore"),
}

#: the modules each adapter imports
_MODULES = {"jax": ("jax", "flax"), "tensorflow": ("tensorflow",), "keras": ("tensorflow", "keras"),
            "paddle": ("paddle",), "mindspore": ("mindspore",)}


def why_unavailable(name: str) -> str | None:
    """Why the framework of adapter ``name`` cannot be imported here (None when it can), without importing it."""
    return missing(name, _MODULES[name], FRAMEWORKS[name][2])


def missing(adapter: str, modules: tuple[str, ...], extra: str) -> str | None:
    """Why ``modules``, which adapter ``adapter`` imports and bnprobe's ``extra`` installs, cannot be imported here
    (None when they can), without importing them."""
    import importlib.util
    import sys

    for m in modules:
        loaded = sys.modules.get(m)
        if loaded is not None and getattr(loaded, "__name__", m) != m:
            # msprobe's import puts tensorboard's stub in sys.modules["tensorflow"]: find_spec would answer with it
            return (f"{m} in this process is a stand-in ({loaded.__name__}, put there by an earlier import such as "
                    f"msprobe's); run the {adapter} adapter in a process that does not import it first")
        if loaded is None and importlib.util.find_spec(m) is None:
            return f"{m} is not installed (pip install \"bnprobe[{extra}]\")"
    return None


def require(name: str) -> None:
    """A one-line error naming the install when the framework of adapter ``name`` is missing."""
    why = why_unavailable(name)
    if why:
        raise BNProbeError(f"adapter {name} is unavailable here: {why}")


def parse_options(name: str, text: str, known: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """``key=value,...`` options of adapter ``name``, each checked against its allowed values."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not sep or key not in known:
            raise BNProbeError(f"adapter {name}: unknown option {part!r}; it takes "
                               + (", ".join(f"{k}={'|'.join(v)}" for k, v in known.items()) or "no options"))
        if value not in known[key]:
            raise BNProbeError(f"adapter {name}: {key} must be one of {', '.join(known[key])}, got {value!r}")
        out[key] = value
    return out


def make(name: str, opts: str) -> BaseAdapter:
    """The adapter ``name`` with options ``opts`` (its framework imported now)."""
    require(name)
    module, cls, _ = FRAMEWORKS[name]
    return getattr(importlib.import_module(module), cls)(opts)


class FrameworkAdapter(BaseAdapter):
    """What the framework adapters share: their convention, formats and layout conversion (to and from the layout
    the framework's kernel takes x in, its convention's)."""

    convention = "torch"
    formats: tuple[str, ...] = ("fp32",)
    same_params: tuple[str, ...] = ()  # formats the framework runs with γ, β and the statistics in x's format
    family: tuple[str, ...] = ()  # the family layers (bnprobe.core.call.NORMS) it runs besides BatchNorm
    unsaved: tuple[str, ...] = ()  # those whose forward returns no mean and rstd (Capabilities.unsaved_norms)

    def capabilities(self) -> Capabilities:
        conv = get_convention(self.convention)
        return Capabilities(formats=self.formats, layouts=("channels_first", "channels_last"), saved=conv.saved,
                            convention=conv.name, norms=("batch", *self.family), unsaved_norms=self.unsaved)

    def family_gamma(self, p: FamilyPrepared) -> np.ndarray:
        """A family call's γ, flat, in its parameter format's own dtype: ones where the call gives none (so that dγ
        is returned; × 1 is exact)."""
        g = np.ones(math.prod(p.shape.param_shape)) if p.gamma is None else p.gamma
        return self.stored(g, p.params)  # type: ignore[return-value]

    def _refuse_offset(self, p: FamilyPrepared, layer: str) -> None:
        """A one-line refusal of a weight offset (Gemma's 1 + w) for a framework ``layer`` that has none."""
        if p.call.weight_offset:
            raise BNProbeError(f"adapter {self.name}: {layer} has no weight offset (Gemma's 1 + w); give "
                               "weight_offset 0")

    def _check_params(self, p: Prepared) -> None:
        """Refuse a parameter format the framework's CPU kernel does not have, naming both."""
        if p.params not in ("fp32", "fp64") and p.dtype not in self.same_params:
            raise BNProbeError(f"adapter {self.name}: {get_convention(self.convention).framework} keeps γ, β and "
                               f"the statistics of {p.dtype} input in fp32 on the CPU: use params fp32")

    def _momentum(self, momentum: float | None, p: Prepared) -> float:
        """The framework's own momentum argument for bnprobe's m (no cumulative average outside torch; without
        running statistics the momentum does nothing, and the framework's default is passed)."""
        conv = get_convention(self.convention)
        if momentum is None:
            if p.vectors.get("running_mean") is None:
                return conv.default_momentum
            raise BNProbeError(f"adapter {self.name}: momentum=None (torch's cumulative average) has no "
                               f"{conv.name} equivalent; give a momentum")
        return conv.framework_momentum(momentum)

    @property
    def native_layout(self) -> str:
        return get_convention(self.convention).layout

    def to_native(self, a: np.ndarray, p: Prepared) -> np.ndarray:
        """x or dy in the framework's layout (the values unchanged)."""
        if p.lay.layout == self.native_layout:
            return np.ascontiguousarray(a)
        return np.ascontiguousarray(np.moveaxis(a, 1, -1) if self.native_layout == "channels_last"
                                    else np.moveaxis(a, -1, 1))

    def from_native(self, a: Any, p: Prepared) -> np.ndarray:
        """A framework's x-shaped result back in the call's layout."""
        a = np.asarray(a)
        if p.lay.layout == self.native_layout:
            return a
        return np.moveaxis(a, -1, 1) if self.native_layout == "channels_last" else np.moveaxis(a, 1, -1)

    def stored(self, a: np.ndarray | None, fmt: str) -> np.ndarray | None:
        """A bnprobe tensor (float64 holding ``fmt`` values) in ``fmt``'s own dtype (the conversion is exact)."""
        if a is None:
            return None
        with np.errstate(invalid="ignore"):
            return np.asarray(a, dtype=np.float64).astype(get_format(fmt).dtype)

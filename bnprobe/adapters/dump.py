"""Recorded calls as an adapter: a replay answers a call with the outputs recorded for it.

The recordings themselves (bnprobe's own dumps, model dumps, msprobe dumps) are read and written by
:mod:`bnprobe.recordings`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bnprobe.adapters.base import (
    BackwardOutput,
    BaseAdapter,
    Capabilities,
    FamilyPrepared,
    ForwardOutput,
    MODES,
    Prepared,
    Saved,
)
from bnprobe.core.call import NORMS
from bnprobe.core.errors import BNProbeError, named
from bnprobe.core.formats import get_format
from bnprobe.recordings import CallRef, RecordedCalls, Recording

__all__ = ["DumpAdapter"]


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal(a, b, equal_nan=True)`` for float64 arrays of one shape: the same bits are the same values
    (one pass over an integer view); numpy's comparison where the bits differ (-0 and 0, NaN payloads)."""
    if a.dtype == b.dtype == np.float64 and a.flags.c_contiguous and b.flags.c_contiguous and \
            np.array_equal(a.view(np.int64), b.view(np.int64)):
        return True
    return bool(np.array_equal(a, b, equal_nan=True))


class DumpAdapter(BaseAdapter):
    """Replays recorded calls: given a call's recorded inputs and scalars, returns its recorded outputs.

    Built on one :class:`Recording` or on a dump's :class:`RecordedCalls`; :meth:`bind` gives the
    adapter of one call.  A call that differs from the recording in any tensor or scalar is an error
    naming what differs: a replay never answers with the outputs of another call."""

    def __init__(self, rec: Recording | RecordedCalls) -> None:
        if isinstance(rec, Recording):
            self.calls = RecordedCalls(rec.source or rec.adapter, "bnprobe", (
                CallRef(str(rec.meta.get("call") or rec.adapter), None, tuple(rec.call().x.shape),
                        rec.dtype, rec.training, "backward" in rec.tensors, "tensor", lambda: rec),))
            self._rec: Recording | None = rec
        else:
            self.calls, self._rec = rec, None
        self.name = f"dump:{self.calls.source}"

    @property
    def rec(self) -> Recording:
        """The bound call's recording (a single-call dump binds its call on first use)."""
        if self._rec is None:
            if len(self.calls.calls) != 1:
                raise BNProbeError(f"{self.name} holds {len(self.calls.calls)} BatchNorm calls; select one with "
                                   f"dump:DIR#NAME or {named('calls')}, or let the command run them one at a time")
            self.calls.require_tensors("replaying a call")
            self._rec = self.calls.calls[0].load()
        return self._rec

    def bind(self, rec: Recording) -> DumpAdapter:
        """This dump's adapter for one of its calls (already loaded)."""
        out = DumpAdapter(rec)
        out.calls, out.name = self.calls, self.name
        return out

    def capabilities(self) -> Capabilities:
        if self._rec is None and (len(self.calls.calls) != 1 or self.calls.task != "tensor"):
            cs = self.calls.calls
            modes = {m for c in cs for m in c.modes}
            return Capabilities(formats=tuple(dict.fromkeys(c.dtype for c in cs)),
                                modes=tuple(m for m in MODES if m in modes), layouts=("channels_first",),
                                saved="none", deterministic=True, training_r1=True, recorded=True,
                                convention=self.calls.convention, norms=NORMS)
        return Capabilities(formats=(self.rec.dtype,), modes=self.rec.modes, layouts=(self.rec.layout,),
                            saved=self.rec.saved_kind or "none", deterministic=True, training_r1=True, recorded=True,
                            convention=self.calls.convention, norms=NORMS)

    def _differs(self, what: str, asked: Any, recorded: Any) -> BNProbeError:
        call = self.rec.meta.get("call") or "the recording"
        return BNProbeError(f"{self.name}: the call asks {what} = {asked!r} but {call} was made with {what} = "
                            f"{recorded!r}; a recording answers only its own call")

    def _check_call(self, mode: str, given: dict[str, np.ndarray | None], p: Prepared, *, eps: float,
                    momentum: float | None = None, training: bool | None = None) -> None:
        rec = self.rec
        if eps != rec.eps:
            raise self._differs("eps", eps, rec.eps)
        if p.params != rec.params:
            raise self._differs("the parameter format", p.params, rec.params)
        if training is not None and training != rec.training:
            raise self._differs("training", training, rec.training)
        want = rec.tensors[mode]["inputs"]
        if mode == "train" and "running_mean" in want and momentum != rec.momentum:
            raise self._differs("momentum", momentum, rec.momentum)
        # what the recording lacks must be what its absence means: γ = 1, β = 0, no running statistics
        absent = {"gamma": 1.0, "beta": 0.0}
        for name, a in given.items():
            if name not in want:
                if a is None or (name in absent and np.all(np.asarray(a, dtype=np.float64) == absent[name])):
                    continue
                raise BNProbeError(f"{self.name}: the {mode} call gives {name!r} but the recording has none (a call "
                                   "without it); a dump replays only its own inputs")
            b = want[name]
            if a is None:
                raise BNProbeError(f"{self.name}: the {mode} call gives no {name!r} but the recording has one")
            a = np.asarray(a, dtype=np.float64)
            if a.shape != b.shape or not _same_values(a, b):
                raise BNProbeError(f"{self.name}: the {mode} input {name!r} differs from the recorded one; a dump "
                                   "replays only its own inputs (take them from the recording)")

    def inputs(self, mode: str) -> dict[str, np.ndarray]:
        """The recorded inputs of ``mode``, to call other adapters with."""
        if mode not in self.rec.tensors:
            raise BNProbeError(f"{self.name} recorded no {mode} call (it has {', '.join(self.rec.modes)})")
        return dict(self.rec.tensors[mode]["inputs"])

    def _out(self, mode: str, name: str) -> np.ndarray | None:
        a = self.rec.get(mode, "outputs", name)
        if a is None:
            return None
        return a.astype(get_format(self.rec.formats[f"{mode}.outputs.{name}"]).dtype)

    def _forward_train_impl(self, p: Prepared, *, momentum: float | None, eps: float) -> ForwardOutput:
        self._check_call("train", {"x": p.x, **p.vectors}, p, eps=eps, momentum=momentum)
        sm, sv = self._out("train", "saved_mean"), self._out("train", "saved_value")
        saved = Saved(sm, self.rec.saved_kind, sv) if sm is not None and sv is not None and self.rec.saved_kind \
            else None
        return ForwardOutput(self._out("train", "y"), saved, self._out("train", "running_mean_out"),
                             self._out("train", "running_var_out"), meta={"replayed": self.rec.source})

    def _forward_infer_impl(self, p: Prepared, *, eps: float) -> ForwardOutput:
        self._check_call("infer", {"x": p.x, **p.vectors}, p, eps=eps)
        return ForwardOutput(self._out("infer", "y"), meta={"replayed": self.rec.source})

    def _backward_impl(self, p: Prepared, dy: np.ndarray, saved: Saved, *, eps: float,
                       training: bool) -> BackwardOutput:
        given = {"dy": dy, "x": p.x, "gamma": p.vectors["gamma"]}
        if "saved_mean" in self.rec.tensors["backward"]["inputs"] and self.rec.saved_kind:
            # the statistics the recorded backward was given: the same ones, of the same kind
            if saved.kind != self.rec.saved_kind:
                raise self._differs("saved statistics of kind", saved.kind, self.rec.saved_kind)
            given.update(saved_mean=saved.mean, saved_value=saved.value)
        self._check_call("backward", given, p, eps=eps, training=training)
        # a gradient the kernel did not compute (x without requires_grad, affine=False) was not recorded:
        # NaN in its place, and meta["missing"] names it so checks leave it out
        got = {k: self._out("backward", k) for k in ("dx", "dgamma", "dbeta")}
        missing = tuple(k for k, v in got.items() if v is None)
        fill = {"dx": p.lay.shape, "dgamma": (p.lay.channels,), "dbeta": (p.lay.channels,)}
        dx, dg, db = (np.full(fill[k], np.nan) if v is None else v for k, v in got.items())
        return BackwardOutput(dx, dg, db, meta={"replayed": self.rec.source, "missing": missing})

    # ---- a recorded family call (LayerNorm, RMSNorm, GroupNorm, InstanceNorm) ----------------------------------
    def _check_family_call(self, mode: str, given: dict[str, np.ndarray | None], p: FamilyPrepared, *,
                           eps: float) -> None:
        """The family call asked is the recorded one: its layer, ε, parameter format and tensors."""
        rec, c = self.rec, p.call
        asked = (c.norm, c.normalized_shape, c.groups, c.weight_offset)
        ns = rec.meta.get("normalized_shape")
        recorded = (rec.meta.get("norm", "batch"), None if ns is None else tuple(ns), rec.meta.get("groups"),
                    float(rec.meta.get("weight_offset", 0.0)))
        if asked != recorded:
            raise self._differs("the layer (norm, normalized_shape, groups, weight_offset)", asked, recorded)
        if eps != rec.eps:
            raise self._differs("eps", eps, rec.eps)
        if p.params != rec.params:
            raise self._differs("the parameter format", p.params, rec.params)
        want = rec.tensors[mode]["inputs"]
        for name, a in given.items():
            b = want.get(name)
            if a is None or b is None:
                if (a is None) != (b is None) and not (name == "gamma" and b is None and np.all(a == 1.0)):
                    raise BNProbeError(f"{self.name}: the {mode} call and the recording differ in whether {name!r} "
                                       "is given; a dump replays only its own inputs")
                continue
            a = np.asarray(a, dtype=np.float64)
            if a.size != b.size or not _same_values(a.reshape(b.shape), np.asarray(b, dtype=np.float64)):
                raise BNProbeError(f"{self.name}: the {mode} input {name!r} differs from the recorded one; a dump "
                                   "replays only its own inputs (take them from the recording)")

    def _family_forward_impl(self, p: FamilyPrepared, *, eps: float) -> ForwardOutput:
        self._check_family_call("train", {"x": p.x, "gamma": p.gamma, "beta": p.beta}, p, eps=eps)
        sm, sv = self._out("train", "saved_mean"), self._out("train", "saved_value")
        saved = Saved(sm, "invstd", sv) if sv is not None else None
        return ForwardOutput(self._out("train", "y"), saved, meta={"replayed": self.rec.source})

    def _family_backward_impl(self, p: FamilyPrepared, dy: np.ndarray, saved: Saved, *, eps: float) -> BackwardOutput:
        self._check_family_call("backward", {"dy": dy, "x": p.x}, p, eps=eps)
        got = {k: self._out("backward", k) for k in ("dx", "dgamma", "dbeta")}
        missing = tuple(k for k, v in got.items() if v is None)
        fill = {"dx": p.shape.shape, "dgamma": p.shape.param_shape, "dbeta": p.shape.param_shape}
        dx, dg, db = (np.full(fill[k], np.nan) if v is None else v.reshape(fill[k]) for k, v in got.items())
        return BackwardOutput(dx, dg, db, meta={"replayed": self.rec.source, "missing": missing})

    def _check_forward(self, out: ForwardOutput, p: Prepared, *, training: bool) -> None:
        if np.shape(out.y) != p.lay.shape:
            raise BNProbeError(f"{self.name}: recorded y has shape {np.shape(out.y)}, x has {p.lay.shape}")

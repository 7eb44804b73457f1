"""Recorded BatchNorm calls: bnprobe's own dumps, model dumps and msprobe dumps, read and written in one place.

:func:`open_dump` lists every call of a dump of any kind (:class:`RecordedCalls`, nothing loaded);
:func:`load_dump` reads one.  The modules: :mod:`~bnprobe.recordings.types` (the types every reader shares),
:mod:`~bnprobe.recordings.bnprobe_dump` (bnprobe's own format: recording an adapter, writing, reading),
:mod:`~bnprobe.recordings.msprobe` (msprobe's dumps) and :mod:`~bnprobe.recordings.capture` (the writer of
model dumps, :func:`bnprobe.capture`).  Replaying a recording is an adapter's work:
:class:`bnprobe.adapters.dump.DumpAdapter`.
"""

from __future__ import annotations

from pathlib import Path

from bnprobe.core.kernel import MODES
from bnprobe.core.errors import BNProbeError
from bnprobe.recordings.bnprobe_dump import read_calls, read_dump, read_meta, record, write_dump
from bnprobe.recordings.msprobe import MSPROBE_BN_APIS, find_dump_jsons, msprobe_calls
from bnprobe.recordings.msprobe_family import FAMILY_APIS
from bnprobe.recordings.ms_graph import graph_calls, graph_folders
from bnprobe.recordings.types import (
    CALLS_NAME,
    CALLS_TAG,
    DUMP_MARKERS,
    META_NAME,
    TENSORS_NAME,
    CallRef,
    RecordedCalls,
    Recording,
)

__all__ = ["Recording", "write_dump", "load_dump", "open_dump", "read_msprobe", "record", "CallRef",
           "RecordedCalls", "read_calls", "split_dump_spec", "MSPROBE_BN_APIS", "META_NAME", "TENSORS_NAME",
           "CALLS_NAME", "CALLS_TAG", "DUMP_MARKERS"]


def load_dump(path: str | Path) -> Recording:
    """Read a bnprobe dump folder, checking every tensor against the metadata (for an msprobe dump or a
    model dump: its first call; :func:`open_dump` gives every call)."""
    p = Path(path)
    if not p.exists():
        raise BNProbeError(f"dump {str(p)!r} does not exist")
    if p.is_dir() and not (p / META_NAME).exists() or p.is_file() and p.name != META_NAME:
        found = open_dump(p)
        found.require_tensors("reading a call's tensors")
        return found.calls[0].load()
    return read_dump(p if p.is_file() else p / META_NAME)


def _bnprobe_call(folder: Path, name: str | None = None, module: str | None = None,
                  assume: dict[str, float] | None = None) -> CallRef:
    meta_path = folder / META_NAME
    meta = read_meta(meta_path)
    for key, value in (assume or {}).items():  # a bnprobe dump records both: a given one must agree
        if meta.get(key) != value:
            raise BNProbeError(f"{meta_path}: the call records {key} = {meta.get(key)!r}; {key}={value:g} "
                               "contradicts it")
    recs = meta["records"]
    mode = "train" if "train" in recs else ("infer" if "infer" in recs else next(iter(recs), None))
    x = recs.get(mode, {}).get("inputs", {}).get("x") if mode else None
    if not isinstance(x, dict) or not isinstance(x.get("shape"), list):
        raise BNProbeError(f"{meta_path}: records no input x")
    inner = meta.get("meta") if isinstance(meta.get("meta"), dict) else {}
    training = "train" in recs or bool(inner.get("training", False))
    return CallRef(name or str(inner.get("call") or folder.name), module, tuple(x["shape"]), str(meta["dtype"]),
                   training, "backward" in recs, "tensor", lambda: load_dump(folder),
                   tuple(m for m in MODES if m in recs))


def _model_calls(index: Path, assume: dict[str, float]) -> RecordedCalls:
    """A model dump written by :func:`bnprobe.capture`: an index and one bnprobe dump per call."""
    doc = read_calls(index.parent)
    if not doc["calls"]:
        raise BNProbeError(f"{index}: the model dump holds no BatchNorm call")
    calls = []
    for e in doc["calls"]:
        folder = (index.parent / e["dir"]).resolve()
        if index.parent.resolve() not in folder.parents:
            raise BNProbeError(f"{index}: call {e['name']!r} points outside the dump ({e['dir']!r})")
        if not (folder / META_NAME).is_file():
            raise BNProbeError(f"{folder}: missing (call {e['name']!r} named in {CALLS_NAME})")
        calls.append(_bnprobe_call(folder, e["name"], e["module"], assume))
    notes = tuple(str(n) for n in doc.get("notes", []) if isinstance(n, str)) if isinstance(doc.get("notes"), list) \
        else ()
    return RecordedCalls(str(index.parent), "capture", tuple(calls), notes)


def open_dump(spec: str | Path, calls: str | None = None) -> RecordedCalls:
    """Every BatchNorm call (and LayerNorm, RMSNorm, GroupNorm, InstanceNorm call) of a dump: ``DIR`` (a bnprobe
    dump, a bnprobe model dump or an msprobe dump in any of its layouts, or MindSpore's GRAPH_MODE kernel dump), the
    path of its ``dump.json`` / ``bnprobe-dump.json``, optionally ``#NAME`` (a call name, module name or glob) to
    select; ``calls`` selects by glob as well.  ``DIR,eps=E,momentum=M``: the layer's ε and momentum where an msprobe
    dump does not record them (MindSpore's primitive)."""
    text, assume = split_dump_spec(str(spec))
    path_text, _, name = text.partition("#")
    p = Path(path_text)
    if not p.exists():
        raise BNProbeError(f"dump {path_text!r} does not exist")
    if p.is_file() and p.name in (META_NAME, CALLS_NAME):
        p = p.parent
    if p.is_dir() and (p / CALLS_NAME).is_file():
        found = _model_calls(p / CALLS_NAME, assume)
    elif p.is_dir() and (p / META_NAME).is_file():
        found = RecordedCalls(str(p), "bnprobe", (_bnprobe_call(p, assume=assume),))
    elif p.is_dir() and not find_dump_jsons(p) and graph_folders(p):  # MindSpore's GRAPH_MODE / jit (L2)
        graph, notes = graph_calls(p, assume)
        found = RecordedCalls(str(p), "msprobe", tuple(graph), tuple(notes), convention="mindspore")
    else:
        if p.is_dir() and not find_dump_jsons(p):
            raise BNProbeError(f"{p}: neither a bnprobe dump ({META_NAME}, {CALLS_NAME}) nor an msprobe dump "
                               "(dump.json, step*/proc*/, step*/rank*/, rank*/; a MindSpore graph dump's "
                               "rank_*/NET/GRAPH/ITERATION/BatchNorm.*.npy)")
        ms, notes = msprobe_calls(p, assume)
        frameworks = {c.framework for c in ms}
        found = RecordedCalls(str(p), "msprobe", tuple(c.ref for c in ms), tuple(notes),
                              convention="mindspore" if frameworks == {"mindspore"} else "torch")
        if not found.calls:
            raise BNProbeError(f"{p}: no BatchNorm call (nor a LayerNorm, RMSNorm, GroupNorm or InstanceNorm one) in "
                               f"the msprobe dump (looked for {', '.join(MSPROBE_BN_APIS)}, MindSpore's "
                               f"Primitive.bn_train.BatchNorm and {', '.join(sorted({a for _, a in FAMILY_APIS}))})")
    return found.select(name or None).select(calls)


def split_dump_spec(text: str) -> tuple[str, dict[str, float]]:
    """``DIR[#NAME][,eps=E][,momentum=M]``: the dump's spec and the scalars given for it (each once)."""
    head, *opts = text.split(",")
    if not opts or not all("=" in o for o in opts):
        return text, {}
    out: dict[str, float] = {}
    for o in opts:
        key, _, value = (t.strip() for t in o.partition("="))
        if key not in ("eps", "momentum"):
            raise BNProbeError(f"dump option {o.strip()!r}: a dump takes eps=E and momentum=M (where it does not "
                               "record them)")
        if key in out:
            raise BNProbeError(f"dump option {key} given twice (as --{key} and in the dump's spec?): give it once")
        try:
            out[key] = float(value)
        except ValueError:
            raise BNProbeError(f"dump option {key}={value!r} is not a number") from None
    return head, out


def read_msprobe(folder: str | Path, call: str | None = None) -> Recording:
    """The first BatchNorm call (or ``call``, e.g. ``Functional.batch_norm.0``) of an msprobe dump."""
    found = open_dump(folder, call)
    found.require_tensors("reading a call's tensors")
    return found.calls[0].load()

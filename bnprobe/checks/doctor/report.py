"""What doctor returns: one checklist item per group of outputs (:class:`Item`) and the report of a kernel
(:class:`DoctorReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bnprobe.engine.result import Judged, Verdict

__all__ = ["Item", "DoctorReport"]


# ---- reports ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    name: str
    status: Verdict  # PASS, WARN or FAIL (given as the text or the member: kept as the member)
    evidence: str
    matches: tuple[str, ...] = ()
    details: tuple[str, ...] = ()  # what is wrong, per input and output (torch.testing style)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Verdict(self.status))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matches"] = list(self.matches)
        d["details"] = list(self.details)
        return d


@dataclass
class DoctorReport(Judged):
    adapter: str
    dtype: str
    items: list[Item]
    diagnosis: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    call: str | None = None  # the recorded call diagnosed (its label), None for the diagnostic inputs
    params: str | None = None  # the parameters' format (fp32, same...), None when not known
    inputs: tuple[str, ...] = ()  # the inputs the checklist ran on
    layer: str | None = None  # the layer diagnosed when not BatchNorm (LayerNorm, RMSNorm, GroupNorm, InstanceNorm)

    @property
    def passed(self) -> bool:
        """No checklist item failed (every result type answers with ``.passed`` and ``bool``)."""
        return all(i.status != Verdict.FAIL for i in self.items)

    @property
    def healthy(self) -> bool:
        """The same as :attr:`passed` (the name its JSON report keeps)."""
        return self.passed

    @property
    def frame(self) -> Any:  # -> pandas.DataFrame
        """One row per checklist item (its CSV)."""
        import pandas as pd

        return pd.DataFrame([i.to_dict() for i in self.items])

    def to_dict(self) -> dict[str, Any]:
        layer = {} if self.layer is None else {"layer": self.layer}
        return {**({} if self.call is None else {"call": self.call}), **layer, "adapter": self.adapter,
                "dtype": self.dtype, "params": self.params, "inputs": list(self.inputs), "healthy": self.healthy,
                "diagnosis": self.diagnosis, "items": [i.to_dict() for i in self.items], "notes": self.notes}

"""What the overflow check reports, and what its two scanners (``overflow_trace``, ``overflow_outputs``) share:
the findings, the headroom and the report of a scan, a run's inputs, the headroom predicted from the input
alone, and how a finding names its first element and the input there.  The check itself is
``bnprobe.checks.overflow.scan``, which re-exports the public names.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.core.call import EPS, NORM_NAMES
from bnprobe.core.formats import get_format
from bnprobe.engine.result import Judged
from bnprobe.kernels.layout import NormShape, layout_of
from bnprobe.kernels.policy import Policy

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

ANOMALIES = ("input_nonfinite", "nan", "inf", "overflow", "saturated", "underflow", "flushed", "subnormal",
             "negative_var", "cancellation", "hidden_nonfinite", "zero_output", "constant_output",
             "mean_error", "variance_error", "y_moments", "dx_identity", "y_error", "dx_error", "eps_underflow")


@dataclass(frozen=True)
class Remedy:
    name: str
    change: str
    fixed: bool
    y_error: float  # max |y - golden| with the remedy
    detail: str = ""


@dataclass(frozen=True)
class OverflowFinding:
    anomaly: str
    stage: str
    format: str
    channels: tuple[int, ...]
    count: int
    first_element: str
    inputs: str
    detail: str
    input_borne: bool = False
    remedies: tuple[Remedy, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        d["remedies"] = [asdict(r) for r in self.remedies]
        return d


@dataclass(frozen=True)
class Headroom:
    stage: str
    format: str
    predicted_max: float
    headroom_binades: float  # log2(format max / predicted magnitude); < 0 predicts overflow
    overflows: bool
    actual_max: float | None = None
    actually_overflowed: bool | None = None


@dataclass
class OverflowReport(Judged):
    adapter: str
    dtype: str
    mode: str
    policy: str
    findings: list[OverflowFinding]
    headroom: list[Headroom]
    saturation: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    call: str | None = None  # the recorded call scanned (its label), None for a given input
    params: str | None = None  # the parameters' format asked for (fp32, same), None when not asked (fp32)
    layer: str | None = None  # a family layer's (rows, R) view in words; None for BatchNorm (its findings' channels)

    @property
    def passed(self) -> bool:
        """No finding (every result type answers with ``.passed`` and ``bool``)."""
        return not self.findings

    @property
    def clean(self) -> bool:
        """The same as :attr:`passed` (the name its JSON report keeps)."""
        return self.passed

    @property
    def frame(self) -> pd.DataFrame:
        """One row per finding (:meth:`to_frame`)."""
        return self.to_frame()

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        rows = []
        for f in self.findings:
            d = f.to_dict()
            d["channels"] = ",".join(map(str, f.channels[:8])) + ("..." if len(f.channels) > 8 else "")
            d["remedies"] = "; ".join(f"{r.name}: {'fixes' if r.fixed else 'does not fix'}" for r in f.remedies)
            rows.append(d)
        frame = pd.DataFrame(rows, columns=["anomaly", "stage", "format", "channels", "count", "first_element",
                                            "inputs", "detail", "input_borne", "remedies"])
        if self.call is not None:
            frame.insert(0, "call", self.call)
        return frame

    def to_dict(self) -> dict[str, Any]:
        return {**({} if self.call is None else {"call": self.call}), "adapter": self.adapter, "dtype": self.dtype,
                "mode": self.mode, "policy": self.policy, **({} if self.layer is None else {"layer": self.layer}),
                "clean": self.clean, "findings": [f.to_dict() for f in self.findings],
                "headroom": [asdict(h) for h in self.headroom], "saturation": self.saturation, "notes": self.notes}


# ---- prediction from the input alone ----------------------------------------------------------------

def predict_headroom(x: np.ndarray, policy: Policy, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
                     eps: float = EPS, layout: str = "channels_first") -> list[Headroom]:
    """Predicted magnitude of each stage from per-channel statistics, and its headroom in binades."""
    lay = layout_of(x, layout)
    cr = lay.to_cr(x)
    r = lay.reduce_size
    with np.errstate(all="ignore"):
        mu = np.nanmean(cr, axis=1)
        var = np.nanvar(cr, axis=1)
        ex2 = np.nanmean(cr * cr, axis=1)
    acc, st = get_format(policy.accumulate), get_format(policy.storage)
    g = np.ones(lay.channels) if gamma is None else np.abs(np.asarray(gamma, dtype=np.float64))
    b = np.zeros(lay.channels) if beta is None else np.abs(np.asarray(beta, dtype=np.float64))
    pre = 2.0 ** -int(r - 1).bit_length() if policy.mean_by == "prescaled" else 1.0
    xmax = nanmax_abs(cr) if cr.size else 0.0
    with np.errstate(all="ignore"):
        dev = np.abs(cr - mu[:, None])
        xhat_max = np.where(np.isnan(dev), -np.inf, dev).max(axis=1) / np.sqrt(var + eps)
    stages = [("x", st, xmax), ("sum", acc, float(np.nanmax(np.abs(mu)) * r * pre))]
    if policy.variance == "naive":
        stages += [("sum_sq", acc, float(np.nanmax(ex2)) * r * pre), ("mean_sq", acc, float(np.nanmax(mu**2)))]
    elif policy.variance == "two_pass":
        stages.append(("sum_sq_dev", acc, float(np.nanmax(var)) * r * pre))
    stages.append(("y", st, nanmax_abs(g * xhat_max + b)))
    out = []
    for name, fmt, mag in stages:
        head = math.log2(fmt.max / mag) if mag > 0 and math.isfinite(mag) else math.inf
        out.append(Headroom(name, fmt.name, mag, head, head < 0))
    return out


def family_headroom(rows: np.ndarray, pol: Policy, norm: str, gamma: np.ndarray | None, beta: np.ndarray | None,
                    eps: float) -> list[Headroom]:
    """Predicted magnitude of each stage of a family kernel from the rows' statistics (``rows``: x's (rows, R)
    view), and its headroom in binades: x; RMSNorm's squares and Σx²; the others' Σx and, as the policy forms the
    variance, Σx² (one pass) or Σ(x − μ)² (two passes); y."""
    r = rows.shape[1]
    with np.errstate(all="ignore"):
        mu, var, ex2 = np.nanmean(rows, axis=1), np.nanvar(rows, axis=1), np.nanmean(rows * rows, axis=1)
        centre = 0.0 if norm == "rms" else mu[:, None]
        spread = ex2 if norm == "rms" else var
        dev = np.abs(rows - centre)
        xhat_max = float(np.nanmax(np.where(np.isnan(dev), -np.inf, dev).max(axis=1) / np.sqrt(spread + eps)))
    acc, st = get_format(pol.accumulate), get_format(pol.storage)
    g = 1.0 if gamma is None else nanmax_abs(gamma)
    b = 0.0 if beta is None else nanmax_abs(beta)
    stages = [("x", st, nanmax_abs(rows) if rows.size else 0.0)]
    if norm == "rms":
        stages += [("squares", acc, float(np.nanmax(rows * rows))), ("sum_squares", acc, float(np.nanmax(ex2)) * r)]
    else:
        stages.append(("sum", acc, float(np.nanmax(np.abs(mu))) * r))
        if pol.variance == "naive":
            stages += [("sum_sq", acc, float(np.nanmax(ex2)) * r), ("mean_sq", acc, float(np.nanmax(mu ** 2)))]
        elif pol.variance == "two_pass":
            stages.append(("sum_sq_dev", acc, float(np.nanmax(var)) * r))
    stages.append(("y", st, g * xhat_max + b))
    out = []
    for name, fmt, mag in stages:
        head = math.log2(fmt.max / mag) if mag > 0 and math.isfinite(mag) else math.inf
        out.append(Headroom(name, fmt.name, mag, head, head < 0))
    return out


def describe_rows(sh: NormShape) -> str:
    """The layer and its (rows, R) view in words, e.g. ``LayerNorm over (32,): 12 rows (tokens) of R = 32``."""
    what = {"layer": "tokens", "rms": "tokens", "group": "sample × group", "instance": "sample × channel"}[sh.norm]
    over = f" over {sh.normalized}" if sh.norm in ("layer", "rms") else \
        f", {sh.groups} groups" if sh.norm == "group" else ""
    return f"{NORM_NAMES[sh.norm]}{over}: {sh.rows} rows ({what}) of R = {sh.r}"


# ---- where a finding is, and the input there ---------------------------------------------------------------

class RowLayout:
    """A family layer's (rows, R) view (:class:`~bnprobe.kernels.layout.NormShape`) in the part of the Layout
    interface the overflow check reads — a row of statistics where BatchNorm has a channel — and each row named by
    where it sits in x: a token (LayerNorm, RMSNorm), a sample's group (GroupNorm) or channel (InstanceNorm)."""

    def __init__(self, shape: NormShape) -> None:
        self.norm_shape = shape
        self.shape = shape.shape
        self.channels, self.reduce_size = shape.rows, shape.r
        self.layout = "rows"

    def to_cr(self, a: Any) -> np.ndarray:
        """x-shaped ``a`` as its (rows, R) view (float64)."""
        return self.norm_shape.to_rows(a)

    def from_cr(self, a: np.ndarray) -> np.ndarray:
        return self.norm_shape.from_rows(a)

    def view3(self, a: np.ndarray) -> np.ndarray:
        """``a`` as (1, rows, R): a row's values along the last axis, as :meth:`Layout.view3` a channel's."""
        return self.to_cr(a)[None]

    def row(self, i: int) -> str:
        """Row ``i`` in words: its index, and the token, (sample, group) or (sample, channel) it is."""
        sh = self.norm_shape
        if sh.norm in ("layer", "rms"):
            lead = sh.shape[:len(sh.shape) - len(sh.normalized)]
            where = f"token {tuple(int(v) for v in np.unravel_index(i, lead))}" if lead else "the only row"
        elif sh.norm == "group":
            where = f"sample {i // sh.groups}, group {i % sh.groups}"
        else:
            where = f"sample {i // sh.shape[1]}, channel {i % sh.shape[1]}"
        return f"row {i} ({where})"

    def element(self, flat_index: int) -> str:
        """Element ``flat_index`` of the (rows, R) view as its index in x, with its row."""
        i, k = divmod(flat_index, self.reduce_size)
        rows = self.to_cr(np.arange(int(np.prod(self.shape)), dtype=np.float64).reshape(self.shape))
        idx = np.unravel_index(int(rows[i, k]), self.shape)
        return f"index {tuple(int(v) for v in idx)} ({self.row(i)})"


def index_str(flat_index: int, lay: Any, elementwise: bool) -> str:
    """Element ``flat_index`` of a channel-first (C, R) array of layout ``lay`` as its index in the tensor (an
    index of channel (C,) arrays, not ``elementwise``, as its channel); of a family layer's (rows, R) view
    (:class:`RowLayout`) as its index and row."""
    if isinstance(lay, RowLayout):
        return lay.element(flat_index) if elementwise else lay.row(flat_index)
    if not elementwise:
        return f"channel {flat_index}"
    c, k = divmod(flat_index, lay.reduce_size)
    rest = list(np.unravel_index(k, tuple(s for i, s in enumerate(lay.shape) if i != lay.channel_axis)))
    rest.insert(lay.channel_axis, c)
    return f"index {tuple(int(v) for v in rest)} (channel {c})"


def input_at(flat_index: int, x_cr: np.ndarray, elementwise: bool, lay: Any = None) -> str:
    """The input at element ``flat_index`` (as :func:`index_str` takes it): its channel's statistics in ``x_cr``
    (x channel-first; a family layer's rows when ``lay`` is its :class:`RowLayout`), and x there when
    ``elementwise``."""
    c = flat_index // x_cr.shape[1] if elementwise else flat_index
    row = x_cr[c]
    unit = f"row {c}" if isinstance(lay, RowLayout) else f"channel {c}"
    with np.errstate(all="ignore"):
        s = f"{unit}: mean {np.nanmean(row):.4g}, std {np.nanstd(row):.4g}, max|x| {nanmax_abs(row):.4g}"
    if elementwise:
        s = f"x = {x_cr.reshape(-1)[flat_index]:.6g}; " + s
    return s


def nanmax_abs(a: np.ndarray) -> float:
    """max |a| over the non-NaN values, NaN when there are none (without numpy's warning)."""
    a = np.abs(np.asarray(a, dtype=np.float64))
    ok = ~np.isnan(a)
    return float(a[ok].max()) if ok.any() else math.nan

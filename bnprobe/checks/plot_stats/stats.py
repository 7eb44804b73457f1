"""Statistics of BatchNorm over training: record them, load them, find what is wrong with them.

Sources: a built-in training run (a small numpy MLP with two BatchNorm layers trained by SGD on a
seeded synthetic task, run under several policies side by side, BN computed by bnprobe's
instrumented kernels); a log (CSV or Parquet with step, layer, channel, mean, var, and optionally
running_mean, running_var); a series of dumps across steps; or a :class:`StatsRecorder` in a
user's own loop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bnprobe.core.call import EPS, MOMENTUM
from bnprobe._loading import first_line
from bnprobe.core.errors import BNProbeError
from bnprobe.kernels import Execution, backward, forward_train, get_policy
from bnprobe.numerics.rounding import round_to

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["StatsRecorder", "simulate", "load_log", "load_dump_series", "load_monitor", "StatsFinding", "find",
           "REQUIRED_COLUMNS", "MAX_ROWS", "MAX_LAYERS"]

REQUIRED_COLUMNS = ("step", "layer", "channel", "mean", "var")
OPTIONAL_COLUMNS = ("running_mean", "running_var")
MAX_ROWS = 10_000_000  # log rows (one per step, layer and channel): about 1 GiB in pandas
MAX_LAYERS = 512  # (run, layer) pairs: plot-stats draws a figure for each
MAX_STEP = 2**53  # steps and channels are integers exact in float64


class StatsRecorder:
    """Collects per-step, per-layer, per-channel statistics; ``frame()`` gives the log."""

    def __init__(self, policy: str = "run") -> None:
        self.policy = policy
        self.rows: list[dict[str, Any]] = []

    def record(self, step: int, layer: str, *, mean: np.ndarray, var: np.ndarray,
               running_mean: np.ndarray | None = None, running_var: np.ndarray | None = None,
               **per_channel: np.ndarray | float) -> None:
        """One layer's statistics at one step (arrays of one value per channel; scalars are broadcast)."""
        mean = np.asarray(mean, dtype=np.float64)
        c = mean.size
        cols: dict[str, np.ndarray] = {"mean": mean, "var": np.asarray(var, dtype=np.float64)}
        if running_mean is not None:
            cols["running_mean"] = np.asarray(running_mean, dtype=np.float64)
            cols["running_var"] = np.asarray(running_var, dtype=np.float64)
        for k, v in per_channel.items():
            cols[k] = np.broadcast_to(np.asarray(v, dtype=np.float64), (c,))
        for ch in range(c):
            self.rows.append({"policy": self.policy, "step": int(step), "layer": layer, "channel": ch,
                              **{k: float(v[ch]) for k, v in cols.items()}})

    def record_result(self, step: int, layer: str, result: Any, **extra: np.ndarray | float) -> None:
        """Record a bnprobe TrainResult (its saved statistics, running statistics and anomaly count)."""
        anomalies = sum(sum(s.anomalies.values()) for s in result.trace) if result.trace is not None else 0
        self.record(step, layer, mean=result.mean, var=result.var, running_mean=result.running_mean,
                    running_var=result.running_var, rstd=result.invstd, anomalies=float(anomalies), **extra)

    def frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.rows)


# ---- the built-in training run -------------------------------------------------------------------------

def _data(seed: int, n: int, dim: int = 16, classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 0x57A7])
    centres = rng.normal(0, 3, (classes, dim)) + 2.0  # features with nonzero means, as activations have
    y = rng.integers(0, classes, n)
    return centres[y] + rng.normal(0, 1, (n, dim)), y


def simulate(policies: tuple[str, ...] = ("fp32", "fp16", "bf16"), *, steps: int = 200, batch: int = 64,
             seed: int = 0, lr: float = 0.05, momentum: float = MOMENTUM, eps: float | None = None) -> pd.DataFrame:
    """Train the same MLP (16 → BN(32) → ReLU → 32 → BN(32) → ReLU → 4) under each policy, from the same
    initial weights and batches, recording every BN layer's statistics per step (``eps`` default 1e-5)."""
    import pandas as pd

    eps = EPS if eps is None else eps
    if steps < 1 or batch < 2:
        raise BNProbeError(f"steps must be >= 1 and batch >= 2, got steps={steps}, batch={batch}")
    pols = [get_policy(p) for p in policies]
    x_all, y_all = _data(seed, steps * batch)
    rng = np.random.default_rng([seed, 1])
    init = {"w1": rng.normal(0, math.sqrt(2 / 16), (16, 32)), "w2": rng.normal(0, math.sqrt(2 / 32), (32, 32)),
            "w3": rng.normal(0, math.sqrt(2 / 32), (32, 4))}
    frames = []
    for pol in pols:
        rec = StatsRecorder(pol.name)
        p = {k: v.copy() for k, v in init.items()}
        bn = {name: {"g": np.ones(32), "b": np.zeros(32), "rm": np.zeros(32), "rv": np.ones(32)}
              for name in ("bn1", "bn2")}
        st = pol.storage
        for t in range(steps):
            xb, yb = x_all[t * batch:(t + 1) * batch], y_all[t * batch:(t + 1) * batch]
            h1 = round_to(xb @ p["w1"], st)
            r1 = forward_train(h1, bn["bn1"]["g"], bn["bn1"]["b"], bn["bn1"]["rm"], bn["bn1"]["rv"], momentum=momentum,
                               eps=eps, policy=pol, execution=Execution(keep_arrays=False))
            a1 = np.maximum(r1.y.astype(np.float64), 0)
            h2 = round_to(a1 @ p["w2"], st)
            r2 = forward_train(h2, bn["bn2"]["g"], bn["bn2"]["b"], bn["bn2"]["rm"], bn["bn2"]["rv"], momentum=momentum,
                               eps=eps, policy=pol, execution=Execution(keep_arrays=False))
            a2 = np.maximum(r2.y.astype(np.float64), 0)
            logits = a2 @ p["w3"]
            prob = np.exp(logits - logits.max(axis=1, keepdims=True))
            prob /= prob.sum(axis=1, keepdims=True)
            dlog = prob.copy()
            dlog[np.arange(batch), yb] -= 1
            dlog /= batch
            da2 = round_to((dlog @ p["w3"].T) * (a2 > 0), st)
            b2 = backward(da2, h2, bn["bn2"]["g"], r2.mean.astype(np.float64), r2.invstd.astype(np.float64), policy=pol,
                          execution=Execution(keep_arrays=False))
            da1 = round_to((b2.dx.astype(np.float64) @ p["w2"].T) * (a1 > 0), st)
            b1 = backward(da1, h1, bn["bn1"]["g"], r1.mean.astype(np.float64), r1.invstd.astype(np.float64), policy=pol,
                          execution=Execution(keep_arrays=False))
            loss = float(-np.mean(np.log(np.maximum(prob[np.arange(batch), yb], 1e-30))))
            for name, r, bw in (("bn1", r1, b1), ("bn2", r2, b2)):
                y = r.y.astype(np.float64)
                with np.errstate(all="ignore"):
                    rec.record_result(t, name, r, y_min=y.min(axis=0), y_max=y.max(axis=0),
                                      grad_gamma=np.abs(bw.dgamma.astype(np.float64)),
                                      grad_norm_x=np.sqrt((bw.dx.astype(np.float64) ** 2).sum(axis=0)), loss=loss)
                bn[name]["rm"] = r.running_mean.astype(np.float64)
                bn[name]["rv"] = r.running_var.astype(np.float64)
            p["w3"] -= lr * (a2.T @ dlog)
            p["w2"] -= lr * (a1.T @ b2.dx.astype(np.float64))
            p["w1"] -= lr * (xb.T @ b1.dx.astype(np.float64))
            for name, bw in (("bn1", b1), ("bn2", b2)):
                bn[name]["g"] -= lr * bw.dgamma.astype(np.float64)
                bn[name]["b"] -= lr * bw.dbeta.astype(np.float64)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


# ---- logs ---------------------------------------------------------------------------------------------

def load_log(path: str | Path) -> pd.DataFrame:
    """A CSV or Parquet log; a malformed one is a clear error naming the column or row."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise BNProbeError(f"log {str(p)!r} does not exist")
    try:
        df = pd.read_parquet(p) if p.suffix in (".parquet", ".pq") else pd.read_csv(p)
    except ImportError:  # pandas' message is several lines of advice: ours is one
        raise BNProbeError(f"{p}: reading Parquet needs pyarrow or fastparquet (pip install pyarrow)") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure is a malformed log to the user
        raise BNProbeError(f"{p}: not a readable CSV/Parquet log ({first_line(exc)})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise BNProbeError(f"{p}: missing column(s) {', '.join(missing)}; a log needs "
                           f"{', '.join(REQUIRED_COLUMNS)} (and optionally {', '.join(OPTIONAL_COLUMNS)})")
    if ("running_mean" in df.columns) != ("running_var" in df.columns):
        raise BNProbeError(f"{p}: give both running_mean and running_var, or neither")
    if df.empty:
        raise BNProbeError(f"{p}: the log holds no rows")
    if len(df) > MAX_ROWS:
        raise BNProbeError(f"{p}: {len(df)} rows, more than the {MAX_ROWS} plot-stats reads")

    def first(bad: Any) -> int:  # the file's line of the first bad row (after the header)
        return int(np.flatnonzero(np.asarray(bad))[0]) + 2

    numeric = [c for c in ("step", "channel", "mean", "var", *OPTIONAL_COLUMNS) if c in df.columns]
    for c in numeric:
        if df[c].dtype == bool:
            raise BNProbeError(f"{p}: column {c} holds true/false, not numbers")
        conv = pd.to_numeric(df[c], errors="coerce")
        bad = conv.isna() & df[c].notna()
        if bad.any():
            raise BNProbeError(f"{p}: row {first(bad)} has a non-numeric {c} ({df[c].iloc[first(bad) - 2]!r})")
        df[c] = conv
    for c in ("step", "channel"):
        v = df[c].to_numpy(dtype=np.float64)
        if np.isnan(v).any():
            raise BNProbeError(f"{p}: row {first(np.isnan(v))} has no {c}")
        bad = (v != np.round(v)) | (v < 0) | (v > MAX_STEP)
        if bad.any():
            raise BNProbeError(f"{p}: row {first(bad)} has {c} {v[first(bad) - 2]:g}, not an integer from 0 to 2**53")
        df[c] = v.astype(np.int64)
    for c in ("layer", "policy"):
        if c in df.columns:
            blank = df[c].isna() | (df[c].astype(str).str.strip() == "")
            if blank.any():
                raise BNProbeError(f"{p}: row {first(blank)} has no {c} name")
            df[c] = df[c].astype(str)
    if "policy" not in df.columns:
        df["policy"] = "log"
    pairs = len(df.groupby(["policy", "layer"], sort=False))
    if pairs > MAX_LAYERS:
        raise BNProbeError(f"{p}: {pairs} (run, layer) pairs, more than the {MAX_LAYERS} plot-stats draws a figure "
                           "for; split the log")
    if df.duplicated(["policy", "step", "layer", "channel"]).any():
        row = int(np.flatnonzero(df.duplicated(["policy", "step", "layer", "channel"]).to_numpy())[0])
        raise BNProbeError(f"{p}: row {row + 2} repeats step/layer/channel of an earlier row")
    return df


def load_dump_series(folder: str | Path) -> pd.DataFrame:
    """Statistics from a series of dumps, one sub-folder per step (sorted by name): bnprobe dumps with a
    training record, msprobe step folders, or model dumps written by :func:`bnprobe.capture.capture`
    (``bnprobe-calls.json``; one layer per module, named by its module path).  Batch statistics are
    the ones the kernel saved where recorded (mean, and 1/invstd² - eps), else computed from x; running
    ones come from the recorded outputs of a training call, or the inputs of an inference call."""
    from bnprobe.recordings import CALLS_NAME, load_dump

    import pandas as pd

    root = Path(folder)
    if not root.is_dir():
        raise BNProbeError(f"dump series {str(root)!r} is not a folder")
    found = _series_folders(root)
    if not found:
        raise BNProbeError(f"{root}: no step sub-folders")
    recs: dict[str, StatsRecorder] = {}
    for step, rank, d in found:
        rec = recs.setdefault(rank, StatsRecorder(f"rank {rank}" if rank else "dumps"))
        if (d / CALLS_NAME).is_file():
            for layer, r in _model_dump_layers(d):
                rec.record(step, layer, **_dump_statistics(r, model_dump=True))
            continue
        r = load_dump(d)
        rec.record(step, str(r.meta.get("call") or "bn"), **_dump_statistics(r, model_dump=False))
    return pd.concat([r.frame() for r in recs.values()], ignore_index=True)


def _series_folders(root: Path) -> list[tuple[int, str, Path]]:
    """(step, rank, folder) of a dump series: one sub-folder per step (``step<k>`` gives k, else the sorted
    position), each a dump or, as a sweep's root has them, ``rank<r>``/``proc<pid>`` folders of dumps."""
    import re

    from bnprobe.recordings import DUMP_MARKERS

    def order(d: Path, prefix: str) -> tuple[int, int, str]:
        """Numbered folders (``<prefix><n>``) first, by n; the others after, by name."""
        m = re.fullmatch(prefix + r"(\d+)", d.name)
        return (0, int(m.group(1)), "") if m else (1, 0, d.name)

    out = []
    for i, d in enumerate(sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: order(d, "step"))):
        first, k, _ = order(d, "step")
        step = k if first == 0 else i
        ranks = sorted((r for r in d.iterdir() if r.is_dir() and re.fullmatch(r"(?:rank|proc)\d+", r.name)),
                       key=lambda r: order(r, "rank"))
        if ranks and not any((d / m).is_file() for m in DUMP_MARKERS):
            out += [(step, r.name[4:] if r.name.startswith("rank") else "", r) for r in ranks]
        else:
            out.append((step, "", d))
    return out


def _model_dump_layers(folder: Path) -> list[tuple[str, Any]]:
    """One Recording per module of a model dump: its last training call in the step, else its last call."""
    from bnprobe.recordings import load_dump, read_calls

    picked: dict[str, dict[str, Any]] = {}
    for c in read_calls(folder)["calls"]:
        prev = picked.get(c["module"])
        if prev is None or c.get("training", False) or not prev.get("training", False):
            picked[c["module"]] = c
    return [(module, load_dump(folder / c["dir"])) for module, c in picked.items()]


def _dump_statistics(r: Any, *, model_dump: bool) -> dict[str, np.ndarray | None]:
    """Batch mean/var (biased) and running statistics of one recorded call, in float64.  For a call of a
    model dump, the saved statistics and an inference call's running statistics (its inputs) are used;
    other dumps keep the older reading (statistics of x, running statistics from the outputs only)."""
    mode = "train" if "train" in r.tensors else r.modes[0]
    ins, outs = r.tensors[mode]["inputs"], r.tensors[mode]["outputs"]
    sm, sv = outs.get("saved_mean"), outs.get("saved_value")
    if model_dump and mode == "train" and sm is not None and sv is not None and r.saved_kind in ("invstd", "var"):
        with np.errstate(all="ignore"):
            var = sv if r.saved_kind == "var" else 1.0 / (sv * sv) - r.eps
        mean = sm
    else:
        x = ins["x"]
        ax = (0,) + tuple(range(2, x.ndim))
        mean, var = x.mean(axis=ax), x.var(axis=ax)
    if mode == "train" or not model_dump:
        rm, rv = outs.get("running_mean_out"), outs.get("running_var_out")
    else:
        rm, rv = ins.get("running_mean"), ins.get("running_var")
    if rm is None or rv is None:
        rm = rv = None
    return {"mean": mean, "var": var, "running_mean": rm, "running_var": rv}


def _monitor_folders(root: Path) -> list[Path]:
    """The folders a monitor wrote into: ``root`` itself, or each rank's ``root/rank<r>``."""
    from bnprobe.recordings.monitor import PARQUET_NAME

    found = [root] if (root / PARQUET_NAME).is_dir() else []
    found += sorted((d for d in root.glob("rank*") if (d / PARQUET_NAME).is_dir()),
                    key=lambda d: int(d.name[4:]) if d.name[4:].isdigit() else -1)
    if not found:
        raise BNProbeError(f"{root}: no {PARQUET_NAME} folder here or in rank*/ (the output of bnprobe.monitor)")
    return found


def load_monitor(folder: str | Path) -> tuple[pd.DataFrame, list[StatsFinding]]:
    """The statistics a :func:`bnprobe.monitor` wrote (every rank's; the files present now, so a growing run
    reads again) as a log (policy: the dtype, or ``rank <r> <dtype>`` for several ranks; layer: the module path,
    ``#k`` for its k-th call in a step after the first; mean/var the batch's, the monitor's other columns kept),
    and its anomalies as findings."""
    import pandas as pd

    from bnprobe.recordings.monitor import ANOMALIES_NAME, PARQUET_NAME

    root = Path(folder)
    if not root.is_dir():
        raise BNProbeError(f"monitor folder {str(root)!r} is not a folder")
    frames, findings = [], []
    folders = _monitor_folders(root)
    for d in folders:
        for f in sorted((d / PARQUET_NAME).glob("step-*.parquet")):
            try:
                frames.append(pd.read_parquet(f))
            except ImportError:
                raise BNProbeError(f"{f}: reading Parquet needs pyarrow (pip install pyarrow)") from None
            except Exception as exc:  # noqa: BLE001 - a damaged part is named, not a traceback
                raise BNProbeError(f"{f}: not a readable Parquet file ({first_line(exc)})") from None
        findings += _monitor_anomalies(d / ANOMALIES_NAME, len(folders) > 1)
    if not frames:
        raise BNProbeError(f"{root}: the monitor has written no step yet")
    df = pd.concat(frames, ignore_index=True)
    if len(df) > MAX_ROWS:
        raise BNProbeError(f"{root}: {len(df)} rows, more than the {MAX_ROWS} plot-stats reads (monitor every k-th "
                           "step: monitor(..., every=k))")
    many = df["rank"].nunique() > 1 or len(folders) > 1
    df["policy"] = [f"rank {r} {t}" if many else str(t) for r, t in zip(df["rank"], df["dtype"])]
    df["layer"] = [str(name) if int(k) == 0 else f"{name}#{int(k)}" for name, k in zip(df["layer"], df["call"])]
    df = df.rename(columns={"batch_mean": "mean", "batch_var": "var"})
    return df, findings


def _monitor_anomalies(path: Path, many: bool) -> list[StatsFinding]:
    """anomalies.csv of one rank as findings (kind "anomaly", at its first step: the reason, the steps it went on to
    and where the call was dumped).  A file of a monitor before anomalies were kept over steps (a ``step`` and a
    ``reasons`` column, a line per anomalous call and step) reads as anomalies of one step each."""
    import csv

    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                first, call = int(row.get("first_step") or row["step"]), int(row["call"])
                last, count = int(row.get("last_step") or first), int(row.get("count") or 1)
                chans = tuple(int(c) for c in (row.get("channels") or "").split())
            except (KeyError, TypeError, ValueError):
                raise BNProbeError(f"{path}: a row without its step, call or channels ({dict(row)!r:.120})") from None
            policy = f"rank {row.get('rank', 0)} {row.get('dtype', '')}" if many else str(row.get("dtype", ""))
            layer = str(row.get("layer", "")) + (f"#{call}" if call else "")
            steps = "" if count == 1 and last == first else f"; to step {last}, seen at {count} steps"
            out.append(StatsFinding("anomaly", policy, layer, first, chans,
                                    f"{row.get('phase', '')}: {row.get('reason', row.get('reasons', ''))}{steps} "
                                    f"(dump: {row.get('dump', '')})"))
    return out


# ---- findings -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StatsFinding:
    kind: str
    policy: str
    layer: str
    step: int
    channels: tuple[int, ...]
    detail: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d


@dataclass(frozen=True)
class Thresholds:
    drift: float = 0.5  # |running_mean - recent batch mean| in recent batch std
    var_ratio: float = 4.0  # running_var vs recent batch var, either way
    collapse: float = 10.0  # var / eps below this: eps dominates the normalisation
    window: int = 10  # recent steps the running estimates are compared with
    momentum: float = MOMENTUM


def find(df: pd.DataFrame, *, eps: float | None = None, thresholds: Thresholds | None = None) -> list[StatsFinding]:
    """Running statistics diverging from the batch's, variance collapsing toward eps (default 1e-5), non-finite
    statistics, negative variances (data to report: a one-pass variance cancelling gives them), and a
    momentum that behaves like the wrong convention."""
    eps = EPS if eps is None else eps
    th = thresholds or Thresholds()
    out: list[StatsFinding] = []

    def first_of(kind: str, policy: str, layer: str, rows: pd.DataFrame, detail: str) -> None:
        """A finding at the first step of ``rows``, naming that step's channels."""
        first = int(rows["step"].min())
        chans = tuple(sorted(rows[rows.step == first].channel.unique().tolist()))
        out.append(StatsFinding(kind, policy, layer, first, chans, detail.format(first=first, n=len(rows))))

    for (policy, layer), g in df.groupby(["policy", "layer"], sort=False):
        g = g.sort_values(["step", "channel"])
        steps = np.sort(g["step"].unique())
        # running statistics a log leaves empty throughout were not recorded; any other NaN/inf is a finding
        cols = ["mean", "var", *(c for c in OPTIONAL_COLUMNS if c in g.columns and g[c].notna().any())]
        finite = np.isfinite(g[cols].to_numpy(dtype=np.float64))
        bad = g[~finite.all(axis=1)]
        if len(bad):
            which = [c for c, ok in zip(cols, finite.all(axis=0)) if not ok]
            first_of("non-finite statistics", policy, layer, bad,
                     f"NaN/inf {', '.join(which)} from step {{first}} ({{n}} entries)")
        # a variance below zero is no variance: a one-pass E[x²] - E[x]² cancelling in its format gives one
        for c, what in (("var", "batch"), ("running_var", "running")):
            if c in cols and (g[c] < 0).any():
                first_of(f"negative {what} variance", policy, layer, g[g[c] < 0],
                         f"{what} variance below 0 from step {{first}} ({{n}} entries): not a variance; a one-pass "
                         "E[x²] - E[x]² that cancels in its format gives this")
        fin = g[np.isfinite(g["var"]) & (g["var"] >= 0)]
        low = fin[fin["var"] < th.collapse * eps]
        if len(low):
            first = int(low["step"].min())
            out.append(StatsFinding("variance collapsing toward eps", policy, layer, first,
                               tuple(sorted(low[low.step == first].channel.unique().tolist())),
                               f"batch variance below {th.collapse:g} x eps (= {th.collapse * eps:.3g}) from step "
                               f"{first}: eps dominates the normalisation there"))
        if "running_mean" not in g.columns or g["running_mean"].isna().all():
            continue
        last = steps[-min(th.window, len(steps)):]
        recent = g[g.step.isin(last)].groupby("channel")[["mean", "var"]].mean()
        final = g[g.step == steps[-1]].set_index("channel")
        with np.errstate(all="ignore"):
            drift = np.abs(final["running_mean"] - recent["mean"]) / np.sqrt(recent["var"] + eps)
            ratio = (final["running_var"] + eps) / (recent["var"] + eps)
        bad_ch = sorted(set(drift.index[drift > th.drift]) | set(ratio.index[(ratio > th.var_ratio) |
                                                                            (ratio < 1 / th.var_ratio)]))
        if len(steps) > th.window and bad_ch:
            with np.errstate(all="ignore"):
                worst_drift, worst_ratio = _max(drift), _max(np.maximum(ratio, 1 / ratio))
            out.append(StatsFinding("running statistics diverge from the batch statistics", policy, layer,
                               int(steps[-1]), tuple(int(c) for c in bad_ch),
                               f"at the last step: running_mean off by up to {worst_drift:.3g} std, running_var "
                               f"x{worst_ratio:.3g} of the last {len(last)} batches'"))
        # the momentum actually applied: (rm_t - rm_{t-1}) / (batch_mean_t - rm_{t-1}), median over channels/steps
        if len(steps) >= 3:
            piv_rm = g.pivot(index="step", columns="channel", values="running_mean")
            piv_m = g.pivot(index="step", columns="channel", values="mean")
            with np.errstate(all="ignore"):
                est = (piv_rm.diff() / (piv_m - piv_rm.shift())).to_numpy()[1:]
            est = est[np.isfinite(est) & (np.abs((piv_m - piv_rm.shift()).to_numpy()[1:]) > 1e-6)]
            if est.size:
                m_est = float(np.median(est))
                if abs(m_est - th.momentum) > 0.25 and abs(m_est - (1 - th.momentum)) < 0.1:
                    out.append(StatsFinding("momentum behaves like the wrong convention", policy, layer,
                                            int(steps[1]), (),
                                       f"the running mean moves {m_est:.3g} of the way to each batch mean: momentum "
                                       f"applied as 1-m (Keras convention) instead of m = {th.momentum:g}"))
                elif abs(m_est - th.momentum) > 0.25:
                    out.append(StatsFinding("momentum behaves like the wrong convention", policy, layer,
                                            int(steps[1]), (),
                                       f"the running mean moves {m_est:.3g} of the way to each batch mean, "
                                       f"expected m = {th.momentum:g}"))
    return out


def _max(v: Any) -> float:
    """The largest finite value of ``v`` (NaN when there is none)."""
    a = np.asarray(v, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else math.nan

"""Every check's result answers the one result protocol (bnprobe.engine.result): ``passed`` and ``bool``, a
``Verdict``, ``notes`` and its rows as a DataFrame; and a Verdict prints, serialises and is written to CSV as the
plain strings did."""

import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bnprobe.engine.result import CheckResult, Verdict
from bnprobe.reports import dumps_json
from bnprobe.recordings import record, write_dump
from bnprobe.core.call import BNCall
from tests.checks.bn_plugins import NumpyBN

SHAPE = (4, 3, 2, 2)


def _call(adapter, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE) + 0.5
    c = SHAPE[1]
    return record(adapter, BNCall(x=x, gamma=rng.uniform(0.5, 1.5, c), beta=rng.normal(0, 0.3, c),
                                  running_mean=np.zeros(c), running_var=np.ones(c), dy=rng.standard_normal(SHAPE),
                                  dtype="fp16"), modes=("train", "backward"))


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    """A bnprobe dump of one small fp16 call of numpy's correct kernel."""
    d = tmp_path_factory.mktemp("results") / "dump"
    write_dump(_call(NumpyBN()), d)
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A sweep root: two ranks of one step, one a wrong backward."""
    r = tmp_path_factory.mktemp("sweep")
    write_dump(_call(NumpyBN(), 0), r / "step0" / "rank0")
    write_dump(_call(NumpyBN("dx-drops-xhat-term"), 1), r / "step0" / "rank1")
    return r


# ---- one small real result of each check ------------------------------------------------------------------------

def _compare(d: Path):
    from bnprobe.checks.compare.precision import compare_precision
    from bnprobe.engine.cases import Case

    return compare_precision(["emulated"], ("fp16",), [Case("c", SHAPE)], budget=False)


def _doctor(d: Path):
    from bnprobe.checks.doctor.diagnosis import doctor

    return doctor(NumpyBN("biased-running-var"), "fp16", stability=False)


def _doctor_recorded(d: Path):
    from bnprobe.checks.doctor.diagnosis import doctor
    from bnprobe.engine.recorded import recording_of

    return doctor(recording_of(f"dump:{d}"), stability=False)


def _fold(d: Path):
    from bnprobe.checks.fold.layer import check_fold, make_layer

    return check_fold(make_layer("conv2d"), "fp16")


def _fold_onnx(d: Path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from bnprobe.checks.fold.onnx_model import check_onnx
    from tests.checks.test_fold_onnx import make_params, write_model

    return check_onnx(write_model(d.parent / "model.onnx", make_params()), ["fp16"])


def _gradcheck(d: Path):
    from bnprobe.checks.gradcheck.gradients import gradcheck

    return gradcheck("reference", "fp64", (4, 2, 3, 3))


def _gradcheck_recorded(d: Path):
    from bnprobe.checks.gradcheck.gradients import gradcheck
    from bnprobe.engine.recorded import recording_of

    return gradcheck(recording_of(f"dump:{d}"))


def _overflow(d: Path):
    from bnprobe.checks.overflow.scan import scan

    x = np.random.default_rng(0).normal(300.0, 1.0, (8, 4, 4, 4))
    return scan("emulated:fp16-acc16:variance=naive", x, dtype="fp16")


def _overflow_recorded(d: Path):
    from bnprobe.checks.overflow.scan import scan
    from bnprobe.engine.recorded import recording_of

    return scan(recording_of(f"dump:{d}"))


def _identify(d: Path):
    from bnprobe.checks.identify.search import identify

    return identify("emulated:fp16", "fp16", passes=1, fresh=False)


def _identify_recorded(d: Path):
    from bnprobe.checks.identify.search import identify
    from bnprobe.engine.recorded import recording_of

    return identify(recording_of(f"dump:{d}"), passes=1)


def _shrink(d: Path):
    from bnprobe.checks.shrink.shrinking import shrink

    return shrink(np.ones((2, 2, 2, 2)), lambda x: True, seconds=5)


def _ranks(d: Path):
    from bnprobe.adapters.syncbn import rank_recordings
    from bnprobe.checks.ranks.check import check_ranks

    rng = np.random.default_rng(0)
    x, c = rng.normal(0.5, 1.5, (8, 3, 3, 3)), 3
    return check_ranks(rank_recordings("syncbn:ranks=4+4", BNCall(x, np.ones(c), np.zeros(c), np.zeros(c), np.ones(c),
                                                                  rng.normal(size=x.shape), dtype="fp32")))


def _rsqrt(d: Path):
    from bnprobe.checks.rsqrt.mathfn import MathSpec, analyze

    return analyze(MathSpec("rsqrt", "fp16", "magic"), (0, 1), domain="samples", samples=256)


def _sweep(d: Path, root: Path):
    from bnprobe.sweep.tasks import SweepResult, SweepSpec, plan, run_sweep

    return SweepResult.of("compare-precision", str(root), run_sweep(plan(root), SweepSpec("compare-precision"),
                                                                    workers=1))


CHECKS: dict[str, Callable] = {
    "compare": _compare, "doctor": _doctor, "doctor recorded": _doctor_recorded, "fold": _fold,
    "fold onnx": _fold_onnx, "gradcheck": _gradcheck, "gradcheck recorded": _gradcheck_recorded,
    "overflow": _overflow, "overflow recorded": _overflow_recorded, "identify": _identify,
    "identify recorded": _identify_recorded, "shrink": _shrink, "ranks": _ranks, "rsqrt": _rsqrt,
}
TYPES = {"compare": "CompareResult", "doctor": "DoctorReport", "doctor recorded": "PerCall", "fold": "FoldReport",
         "fold onnx": "OnnxFoldReport", "gradcheck": "GradcheckResult", "gradcheck recorded": "PerCall",
         "overflow": "OverflowReport", "overflow recorded": "PerCall", "identify": "Identified",
         "identify recorded": "IdentifiedCalls", "shrink": "ShrinkResult", "ranks": "RankReport",
         "rsqrt": "MathAnalysis", "sweep": "SweepResult"}


def answers_the_protocol(res) -> None:
    """The protocol's promises on one result (raises AssertionError where one is broken)."""
    assert isinstance(res, CheckResult), f"{type(res).__name__} is not a CheckResult"
    assert isinstance(res.passed, bool) and bool(res) == res.passed
    assert isinstance(res.verdict, Verdict)
    # a result that passes says PASS (or has no verdict of its own); one that does not, neither
    assert (res.verdict in (Verdict.PASS, Verdict.NONE)) == res.passed
    assert isinstance(res.notes, list) and all(isinstance(n, str) for n in res.notes)
    assert isinstance(res.frame, pd.DataFrame)


@pytest.mark.parametrize("name", [*CHECKS, "sweep"])
def test_every_checks_result_answers_the_protocol(name, dump, root):
    res = _sweep(dump, root) if name == "sweep" else CHECKS[name](dump)
    assert type(res).__name__ == TYPES[name]
    answers_the_protocol(res)
    if name in ("shrink", "rsqrt"):  # a search and an analysis: no verdict of their own, and they pass (exit 0)
        assert res.verdict == Verdict.NONE and res.passed
    elif name in ("doctor", "sweep"):  # a wrong running variance; a wrong backward on one rank
        assert res.verdict == Verdict.FAIL and not res and len(res.frame)
    else:
        assert res.verdict == Verdict.of(res.passed)


def test_the_sweep_reads_each_tasks_verdict_and_notes_from_the_protocol(dump, root):
    res = _sweep(dump, root)
    assert {r["rank"]: r["verdict"] for r in res.rows} == {"0": "PASS", "1": "FAIL"}
    assert all(isinstance(r["verdict"], Verdict) for r in res.rows)  # in process: the members themselves
    assert json.loads(dumps_json(res.to_dict()))["rows"][1]["verdict"] == "FAIL"


class _Broken:
    """A result that answers ``passed`` but whose truth disagrees, whose rows are a list, or lacks a verdict."""

    def __init__(self, what: str) -> None:
        self.what, self.passed, self.notes = what, True, []
        if what != "no verdict":
            self.verdict = Verdict.PASS

    @property
    def frame(self):
        return [] if self.what == "rows a list" else pd.DataFrame()

    def __bool__(self) -> bool:
        return self.what != "bool differs"


@pytest.mark.parametrize("what", ["no verdict", "rows a list", "bool differs"])
def test_the_protocol_check_can_fail(what):
    """Each promise is checked: a result breaking one is caught."""
    with pytest.raises(AssertionError):
        answers_the_protocol(_Broken(what))
    answers_the_protocol(_Broken("none broken"))


# ---- the enum prints as the strings did ---------------------------------------------------------------------------

OLD = {Verdict.PASS: "PASS", Verdict.FAIL: "FAIL", Verdict.WARN: "WARN", Verdict.OK: "ok", Verdict.ERROR: "ERROR",
       Verdict.NOT_FUSED: "not fused", Verdict.NOT_CHECKED: "not checked"}


@pytest.mark.parametrize("v", list(OLD))
def test_a_verdict_prints_as_its_old_string(v):
    s = OLD[v]
    assert v == s and hash(v) == hash(s) and {s: 1}[v] == 1 and Verdict(s) is v
    assert str(v) == s and f"{v}" == s and f"{v:>12}" == f"{s:>12}" and "%s" % v == s and format(v) == s
    assert dumps_json({"verdict": v, "rows": [v]}) == dumps_json({"verdict": s, "rows": [s]})
    assert json.dumps({"v": v}) == json.dumps({"v": s})


def test_a_column_of_verdicts_is_written_as_the_column_of_strings():
    """pandas' CSV and JSON, and the project's JSON of a frame's records, are byte for byte the strings'."""
    members = [Verdict.PASS, Verdict.FAIL, Verdict.WARN, Verdict.OK, Verdict.ERROR, Verdict.NOT_FUSED]
    new = pd.DataFrame({"verdict": members, "x": range(len(members))})
    old = pd.DataFrame({"verdict": [OLD[v] for v in members], "x": range(len(members))})
    assert new.to_csv(index=False) == old.to_csv(index=False)
    assert new.to_json(orient="records") == old.to_json(orient="records")
    assert dumps_json(new.to_dict(orient="records")) == dumps_json(old.to_dict(orient="records"))
    kept = pd.DataFrame({"verdict": pd.Series(members, dtype=object)})  # the members kept in the frame
    assert kept.to_csv(index=False) == old[["verdict"]].to_csv(index=False)
    records = [{"verdict": v} for v in members]  # rows as dicts (the sweep's), framed and written
    assert pd.DataFrame(records).to_csv(index=False) == old[["verdict"]].to_csv(index=False)
    buf = io.StringIO()
    new.to_csv(buf, index=False)
    assert buf.getvalue().splitlines()[1:3] == ["PASS,0", "FAIL,1"]


def test_a_verdict_that_printed_as_its_name_would_be_seen():
    """The checks above can fail: a str-mixin Enum without the overrides formats as ``Verdict.PASS`` (3.11+)."""
    import enum
    import sys

    class Plain(str, enum.Enum):
        PASS = "PASS"

    assert Plain.PASS == "PASS"
    if sys.version_info >= (3, 11):
        assert f"{Plain.PASS}" != "PASS" and str(Plain.PASS) != "PASS"
    assert repr(Verdict.PASS) != "PASS"  # only the text a report writes is the string's, not the repr

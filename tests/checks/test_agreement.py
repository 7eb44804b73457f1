"""One verdict per call across commands: compare-precision and gradcheck judge the same output of the same recorded
call by the same rule, so they agree wherever both judge it, and doctor fails every gradient compare-precision
fails — on a matrix of kernels (correct, and wrong by a chosen amount either side of the bounds) × formats ×
inputs; overflow flags an output exactly where compare-precision fails it with a NaN, an inf or a channel of
zeros (what overflow judges), and doctor and gradcheck fail what overflow flags. Each agreement is shown to be
able to fail: one command's rule loosened, and the matrix catches it."""

import numpy as np
import pytest

from bnprobe.adapters.dump import DumpAdapter
from bnprobe.checks.overflow import outputs as overflow_outputs
from bnprobe.engine import rules
from bnprobe.checks.compare.precision import compare_precision
from bnprobe.checks.doctor.diagnosis import doctor
from bnprobe.checks.gradcheck.gradients import gradcheck
from bnprobe.checks.overflow.scan import scan
from bnprobe.engine.recorded import Recorded
from bnprobe.recordings import load_dump, record, write_dump
from bnprobe.core.call import BNCall
from tests.checks.bn_plugins import NumpyBN, ZeroY

KERNELS = {"correct": lambda: NumpyBN(), "dx+0.1%": lambda: NumpyBN(scaled="dx", scale=1e-3),
           "dx+1%": lambda: NumpyBN(scaled="dx", scale=1e-2), "dx-30%": lambda: NumpyBN(scaled="dx", scale=-0.3),
           "dgamma-mean": lambda: NumpyBN("dgamma-mean"), "dx-drops-mean": lambda: NumpyBN("dx-drops-mean"),
           "eps-max": lambda: NumpyBN("eps-max")}
# var=eps: a channel's variance at ε, where √(max(σ², ε)) is √2 off √(σ² + ε) (at unit scale: a few parts in 10⁶)
INPUTS = {"normal": (0.0, 1.0), "mean=100": (100.0, 1.0), "var=eps": (1.0, 1e-5 ** 0.5)}


def _dump(tmp_path, kernel, fmt, mean, std):
    rng = np.random.default_rng(5)
    x = mean + std * rng.standard_normal((8, 4, 6, 6))
    dy = rng.standard_normal(x.shape) + 0.5  # a non-zero mean per channel, as real losses give
    rec = record(kernel, BNCall(x=x, gamma=rng.uniform(0.5, 1.5, 4), beta=rng.normal(0, 0.1, 4),
                                running_mean=np.zeros(4), running_var=np.ones(4), dy=dy, dtype=fmt),
                 modes=("train", "backward"))
    write_dump(rec, tmp_path)
    return DumpAdapter(load_dump(tmp_path))


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_compare_precision_and_gradcheck_agree_on_every_gradient(tmp_path, fmt, inputs):
    verdicts = {}
    for name, make in KERNELS.items():
        dump = _dump(tmp_path / name, make(), fmt, *INPUTS[inputs])
        rows = compare_precision([dump], budget=False).rows
        compare = {r.tensor: r.verdict == "PASS" for r in rows.itertuples() if r.tensor in ("dx", "dgamma", "dbeta")}
        g = gradcheck(Recorded(dump, dump.calls)).results[0]
        grad = {r.tensor: r.passed for r in g.rows if r.check == "vs-fp64"}
        assert compare == grad, (name, compare, grad)
        verdicts[name] = all(compare.values())
        # doctor fails the gradients wherever compare-precision fails one (it may fail more: its own rule)
        doc = doctor(Recorded(dump, dump.calls)).results[0]
        backward = next(i for i in doc.items if i.name.startswith("backward"))
        assert verdicts[name] or backward.status == "FAIL", (name, compare, backward.evidence)
        assert not (name == "correct" and backward.status == "FAIL"), backward.evidence
    # the matrix is not trivial: the correct kernel passes, the gross bugs fail, in every format and input
    assert verdicts["correct"] and not verdicts["dx-30%"] and not verdicts["dgamma-mean"], verdicts
    assert verdicts["eps-max"] == (inputs != "var=eps"), verdicts


def _eps_max_disagreements(tmp_path) -> list[str]:
    """Where gradcheck's verdict on the ``sqrt(max(var, eps))`` kernel's gradients differs from compare-precision's,
    on dumps of it with a variance at ε."""
    out = []
    for fmt in ("fp16", "bf16", "fp32"):
        dump = _dump(tmp_path / fmt, NumpyBN("eps-max"), fmt, *INPUTS["var=eps"])
        compare = {r.tensor: r.verdict == "PASS" for r in compare_precision([dump], budget=False).rows.itertuples()
                   if r.tensor in ("dx", "dgamma", "dbeta")}
        grad = {r.tensor: r.passed for r in gradcheck(Recorded(dump, dump.calls)).results[0].rows
                if r.check == "vs-fp64"}
        out += [f"{fmt} {t}: compare-precision {'passes' if compare[t] else 'fails'} it, gradcheck "
                f"{'passes' if grad[t] else 'fails'} it" for t in compare if compare[t] != grad.get(t)]
    return out


def test_the_gradient_agreement_catches_a_loosened_gradcheck(tmp_path, monkeypatch):
    """gradcheck forgiving a thousand times compare-precision's bound (its own looser comparison with the golden)
    passes gradients of the eps-max kernel that compare-precision fails."""
    from bnprobe.checks.gradcheck import gradients

    exact = gradients.by_compare
    monkeypatch.setattr(gradients, "by_compare", lambda r, v: exact(r, None if v is None else {
        **v, "verdict": "PASS" if float(v["score"]) <= 1000 * float(v["bound"]) else "FAIL"}))
    found = _eps_max_disagreements(tmp_path)
    assert found and all(f.endswith("compare-precision fails it, gradcheck passes it") for f in found), found


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
def test_doctor_and_gradcheck_fail_the_eps_max_kernel_on_their_own_inputs(fmt):
    """vacancy0x0/Synchronized-BatchNorm-PyTorch#38's kernel, normalising by sqrt(max(var, eps)): its forward and
    backward agree with each other, its gradients are wrong only where a variance nears ε — doctor's diagnostic
    input has such channels, and gradcheck's default input has one, so both fail it (each on its own input); the
    correct kernel passes both."""
    for kernel, wrong in ((NumpyBN("eps-max"), True), (NumpyBN(), False)):
        g = gradcheck(kernel, dtype=fmt)
        failed = {r.tensor for r in g.rows if r.check == "vs-fp64" and not r.passed}
        assert (failed >= {"dx", "dgamma"}) if wrong else not failed, (kernel.name, failed)
        backward = next(i for i in doctor(kernel, dtype=fmt).items if i.name.startswith("backward"))
        assert (backward.status == "FAIL") == wrong, (kernel.name, backward.evidence)


# --- overflow: it flags an output where compare-precision fails it with NaN/inf or a channel of zeros -------------

ANOMALOUS = {"correct": lambda: NumpyBN(), "nan-channel": lambda: NumpyBN("nan-channel"),
             "zero-channel": lambda: NumpyBN("zero-channel"), "zero-y": ZeroY, "dx+1%": lambda: NumpyBN(scaled="dx",
                                                                                                         scale=1e-2)}
OVERFLOW_INPUTS = {"normal": (0.0, 1.0), "mean=100": (100.0, 1.0), "std=8000": (0.0, 8000.0)}


def _in_overflows_scope(dump, tensor: str) -> bool:
    """Whether the recorded output has what overflow judges: a NaN/inf, or a channel entirely zero."""
    rec = dump.calls.calls[0].load()
    kind = "backward" if tensor in ("dx", "dgamma", "dbeta") else "train"
    a = np.asarray(rec.tensors[kind]["outputs"][tensor], dtype=np.float64)
    per_channel = np.moveaxis(a, 1, 0).reshape(a.shape[1], -1) if a.ndim > 1 else a.reshape(-1, 1)
    return bool((~np.isfinite(a)).any() or np.all(per_channel == 0, axis=1).any())


def overflow_disagreements(tmp_path, fmt: str, inputs: str, kernels=ANOMALOUS) -> list[str]:
    """Where overflow and the other commands disagree on a matrix of kernels on one input, in words ([] when none)."""
    out = []
    for name, make in kernels.items():
        dump = _dump(tmp_path / name, make(), fmt, *OVERFLOW_INPUTS[inputs])
        failed = {r.tensor for r in compare_precision([dump], budget=False).rows.itertuples() if r.verdict == "FAIL"}
        res = scan(Recorded(dump, dump.calls)).results[0]
        flagged = {f.stage for f in res.findings if not f.input_borne}
        scope = {t for t in failed if _in_overflows_scope(dump, t)}
        out += [f"{name}: overflow flags {t}, compare-precision passes it" for t in sorted(flagged - failed)]
        out += [f"{name}: compare-precision fails {t} with NaN/inf or zeros, overflow is silent"
                for t in sorted(scope - flagged)]
        doc = doctor(Recorded(dump, dump.calls)).results[0]
        forward = {i.status for i in doc.items if i.name.startswith("training forward")}
        if flagged & {"y", "saved_mean", "saved_invstd"} and "FAIL" not in forward:
            out.append(f"{name}: overflow flags the training forward, doctor passes it")
        grad = {r.tensor for r in gradcheck(Recorded(dump, dump.calls)).results[0].rows if not r.passed}
        out += [f"{name}: overflow flags {t}, gradcheck passes it" for t in sorted(flagged & {"dx", "dgamma", "dbeta"}
                                                                                   - grad)]
        if name == "correct" and (failed or flagged):
            out.append(f"correct: compare-precision fails {sorted(failed)}, overflow flags {sorted(flagged)}")
    return out


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("inputs", list(OVERFLOW_INPUTS))
def test_overflow_flags_what_compare_precision_fails_with_nonfinite_or_zero_values(tmp_path, fmt, inputs):
    assert overflow_disagreements(tmp_path, fmt, inputs) == []


ZERO = {"zero-channel": ANOMALOUS["zero-channel"]}


def test_the_overflow_agreement_catches_a_loosened_overflow(tmp_path, monkeypatch):
    """overflow without its zero-channel rule: compare-precision fails the channel of zeros, overflow says nothing."""
    exact = overflow_outputs._output_findings
    monkeypatch.setattr(overflow_outputs, "_output_findings", lambda *a, **k: [
        f for f in exact(*a, **k) if f.anomaly != "zero_output"])
    assert overflow_disagreements(tmp_path, "fp16", "normal", ZERO) == [
        "zero-channel: compare-precision fails y with NaN/inf or zeros, overflow is silent"]


def test_the_overflow_agreement_catches_a_loosened_compare_precision(tmp_path, monkeypatch):
    """compare-precision forgiving a billion times its bound passes the channel of zeros overflow flags."""
    exact = rules.bound_used
    monkeypatch.setattr(rules, "bound_used", lambda a, g, bound, fmt: exact(a, g, 1e9 * np.asarray(
        bound, dtype=np.float64), fmt))
    assert overflow_disagreements(tmp_path, "fp16", "normal", ZERO) == [
        "zero-channel: overflow flags y, compare-precision passes it"]


@pytest.mark.parametrize("spec,fmt", [("emulated:bf16-acc16", "bf16"), ("emulated:fp16-acc16", "fp16")])
def test_the_16_bit_accumulator_ports_get_one_verdict_from_every_command(tmp_path, spec, fmt):
    """The kernels a user reported doctor calling healthy while compare-precision failed them (bf16-acc16 at mean 20,
    σ 0.5): on a dump of each, compare-precision fails outputs, doctor fails every gradient and forward output
    compare-precision fails, gradcheck agrees on each gradient, and doctor's summary is not healthy."""
    from bnprobe.adapters import get_adapter

    dump = _dump(tmp_path / "d", get_adapter(spec), fmt, 20.0, 0.5)
    rows = compare_precision([dump], budget=False).rows
    failed = {r.tensor for r in rows.itertuples() if r.verdict == "FAIL"}
    assert failed, "the 16-bit accumulations must lose to the careful bench here"
    g = gradcheck(Recorded(dump, dump.calls)).results[0]
    grad = {r.tensor: r.passed for r in g.rows if r.check == "vs-fp64"}
    assert grad == {t: t not in failed for t in grad}, (grad, failed)
    doc = doctor(Recorded(dump, dump.calls)).results[0]
    assert not doc.passed
    backward = next(i for i in doc.items if i.name.startswith("backward"))
    assert backward.status == "FAIL" or not failed & {"dx", "dgamma", "dbeta"}, backward.evidence

"""One package per command, named as the command; each returns values (dataclasses / DataFrames), never prints.

    compare      compare-precision: every output against the FP64 golden, per format
    gradcheck    a backward against finite differences and the golden; a candidate formula
    doctor       the expert's checklist for a kernel, with the bug models it names failures by
    shrink       a failing input reduced to a minimal one
    overflow     where and why a run goes non-finite
    plot_stats   divergence / collapse / wrong momentum in the statistics over training
    fold         BatchNorm folded into a conv / linear layer, a folded file, an ONNX graph
    trace        one run's every stage against the golden
    identify     the policy that reproduces a black-box kernel bit for bit
    rsqrt        what a hardware rsqrt / reciprocal costs, in ULPs
    ranks        a sweep's per-rank SyncBatchNorm check

The entry points are public names of :mod:`bnprobe` (its ``__all__``, loaded on first use); nothing is imported
here, so ``import bnprobe.checks`` stays fast.
"""

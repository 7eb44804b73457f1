"""What each framework's BatchNorm computes, measured by bnprobe itself: the README's table (section "Other
frameworks").  For every framework adapter importable in this interpreter (run it once in each framework's own
environment, as .ci/frameworks makes them) and every format it runs, one Markdown row:

- its convention (running variance, what it saves), from the adapter;
- what ``identify`` finds: the policy that reproduces it bit for bit, or the stage where it departs from bnprobe's
  policy space; the variance algorithm, accumulation, y formula and rsqrt are shown for the stages reproduced bit
  for bit before that ("—" after it: a closest guess is not a finding);
- what it loses against the careful bench: ``compare-precision`` on one shape with the stress inputs (benchmark
  rule), the outputs that fail and the one most worse than careful, with its RMSE ratio.

    python benchmarks/frameworks.py [--adapters jax,keras] [--shape 8,16,14,14]

Each row is printed as soon as it is measured (identify takes about a minute per format on 2 cores)."""

from __future__ import annotations

import argparse
import sys
import time

HEADER = ("| adapter | format | running var | saved | identify: reproduced bit for bit? | variance | accumulate "
          "| y formula | rsqrt | vs careful bench (fails; most worse, RMSE ratio) |")


def _stage_fields(res) -> tuple[str, str, str, str]:  # noqa: ANN001 - Identified
    """The variance algorithm, accumulation, y formula and rsqrt of the identified policy, each only where its
    stage was reproduced bit for bit (the stages searched before the one the kernel departs at); "—" elsewhere."""
    order = list(res.stages)
    pinned = set(order if res.departs is None or res.departs not in order else order[:order.index(res.departs)])
    p = res.policy
    shown = {"variance": p.variance + (", clamped" if p.clamp_var else ""), "mean": p.accumulate,
             "y": p.y_formula + (" (fma)" if p.fma else ""),
             "rsqrt": p.rsqrt + (f" + {p.rsqrt_newton} Newton" if p.rsqrt_newton else "")}
    return tuple(shown[k] if k in pinned else "—" for k in ("variance", "mean", "y", "rsqrt"))  # type: ignore


def row(name: str, fmt: str, shape: str) -> str:
    from bnprobe.adapters import get_adapter
    from bnprobe.engine.cases import select_cases
    from bnprobe.checks.compare.precision import CallOptions, Judging, compare_precision, worse_rows
    from bnprobe.checks.identify.search import identify
    from bnprobe.core.conventions import get_convention

    a = get_adapter(name)
    conv = get_convention(a.capabilities().convention)
    params = "fp32"
    res = identify(a, fmt, params=params)
    found = "yes" if res.departs is None else f"no: departs at the {res.departs} stage"
    var, acc, yf, rs = _stage_fields(res)
    kernels, cases, _ = select_cases([a], shape=shape)
    cmp = compare_precision(kernels, (fmt,), cases, options=CallOptions(params=params),
                            judging=Judging(bench="careful"))
    rows = cmp.rows
    failing = sorted(set(rows.loc[rows["verdict"] != "PASS", "tensor"])) if len(rows) else []
    worse = worse_rows(rows)
    top = worse.loc[worse["rmse_vs_bench"].fillna(float("inf")).idxmax()] if len(worse) else None
    vs = (f"{len(failing)} fail ({', '.join(failing) or 'none'}); "
          + (f"{top['tensor']} on {top['case']}, {top['rmse_vs_bench']:.3g}x" if top is not None else "none worse"))
    return (f"| {name} | {fmt} | {conv.running_var} | {conv.saved} | {found} | {var} | {acc} | {yf} | {rs} "
            f"| {vs} |")


def main(argv: list[str] | None = None) -> int:
    from bnprobe.adapters.frameworks import FRAMEWORKS, why_unavailable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default=",".join(FRAMEWORKS), help="framework adapters (those importable here)")
    ap.add_argument("--shape", default="8,16,14,14", help="the compare-precision input shape (with stress inputs)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.adapters.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        ap.error(f"not a framework adapter: {', '.join(unknown)} (they are {', '.join(FRAMEWORKS)})")
    here = [n for n in names if why_unavailable(n) is None]
    for n in names:
        if n not in here:
            print(f"# {n}: {why_unavailable(n)}", file=sys.stderr)
    if not here:
        return 1
    from bnprobe.adapters import get_adapter

    print(HEADER)
    print("|" + " --- |" * HEADER.count(" | ") + " --- |")
    for n in here:
        for fmt in (f for f in get_adapter(n).capabilities().formats if f != "fp64"):
            t0 = time.perf_counter()
            print(row(n, fmt, args.shape), flush=True)
            print(f"# {n} {fmt}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

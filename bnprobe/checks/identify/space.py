"""identify's search space, stage by stage: the outputs each stage pins (:data:`STAGE_OUTPUTS`), the probes that
tell each field apart (:data:`FIELD_PROBES`), and the candidates each stage tries given the ones before it fixed
(:data:`SPACES`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from bnprobe.kernels.policy import Policy


__all__ = ["STAGES", "STAGE_OUTPUTS", "OUTPUT_STAGE", "FIELD_PROBES", "FORWARD_STAGES", "MODES_OF", "SPACES",
           "rsqrt_space", "infer_only_space", "layout_spaces", "THREADS_TRIED"]

# the outputs each stage pins, in the order it prefers them (the first the kernel returned is used); a forward
# stage whose statistics the kernel does not return is searched through y
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "mean": ("saved_mean",),
    "variance": ("saved_var", "saved_invstd"),
    "rsqrt": ("saved_invstd",),
    "y": ("y",),
    "modes": ("y", "saved_mean", "saved_invstd", "saved_var"),
    "running": ("running_mean", "running_var"),
    "infer": ("y_infer",),
    "backward": ("dx", "dgamma", "dbeta"),
}
STAGES = tuple(STAGE_OUTPUTS)
FORWARD_STAGES = ("mean", "variance", "rsqrt", "y", "modes", "running")
# the stage that reports an output as reproduced or not (the last stage pinning it)
OUTPUT_STAGE = {"saved_mean": "mean", "saved_var": "variance", "saved_invstd": "rsqrt", "y": "y",
                "running_mean": "running", "running_var": "running", "y_infer": "infer", "dx": "backward",
                "dgamma": "backward", "dbeta": "backward"}

# what would tell the candidates of a field apart, for the fields a run could not distinguish
FIELD_PROBES = {
    "accumulate": "sums whose exact value needs more bits than the narrower accumulator keeps (a large value plus "
                  "many small ones)",
    "order": "sums that depend on their order: values spread over many binades, R above the accumulator's precision",
    "lanes": "an FPRev pair (+M, -M among ones) at lane distances 1 to 128",
    "kahan": "a sum whose rounding errors accumulate: many small values after a large one",
    "unroll": "rows of H·W values that are not a multiple of 2 x lanes",
    "sum_format": "sums whose exact value needs more bits than the accumulator keeps, over many terms",
    "saved_format": "the saved statistics' own format (read off the kernel's outputs)",
    "rstd_format": "var + ε swept across binades",
    "unbiased_by": "R where var·fl(R/(R-1)) and Σ/(R-1) round apart",
    "mean_by": "counts R = 3, 7, 49 with sums where s/R and s·fl(1/R) round apart; sums that overflow unless "
               "prescaled",
    "variance": "a large mean over a small spread (mean 1e4, σ 1): one-pass cancels",
    "clamp_var": "a constant channel whose one-pass variance rounds negative",
    "tiles": "a variance merged from tiles of different means",
    "rsqrt": "var + ε swept across binades (the error pattern of an estimate is its signature)",
    "rsqrt_newton": "var + ε swept across binades", "rsqrt_bits": "var + ε swept across binades",
    "sqrt": "var + ε swept across binades", "division": "γ/σ for many γ", "recip": "γ/σ for many γ",
    "recip_newton": "γ/σ for many γ",
    "y_formula": "a large mean with γ not a power of two", "fma": "a large mean with γ not a power of two",
    "compute": "x·invstd products that need more than the storage format's bits",
    "stored_stats": "statistics that need more bits than the parameter format keeps",
    "output_rounding": "y values that fall exactly halfway between two values of the format (ties)",
    "overflow": "values near the format's maximum", "subnormals": "a channel of subnormal values",
    "running_momentum": "a momentum other than 0.5", "running_var": "R small enough that R/(R-1) shows",
    "running_format": "running statistics that need more bits than the parameter format keeps",
    "running_var_sum": "running variances whose update needs more bits than the parameter format keeps",
    "infer_y_formula": "inference with a large running mean and γ not a power of two",
    "backward_formula": "dy with a mean per channel, a large mean in x",
    "backward_fma": "rows of H·W values with a tail (not a multiple of 2 x lanes)",
    "backward_sums": "H·W planes shorter and longer than the vector width, with a tail, over several samples",
    "threads": "sums over rows spread across binades, R not a multiple of the thread count (torch.compile: "
               "channels-last input with few channels)",
    "variance_fma": "squared deviations whose products need more bits than the accumulator keeps",
    "dx_fma": "a channel count that is not a multiple of the vector width, dx that cancels (R = 2)",
    "backward_lanes": "FPRev pairs in dy (the backward's sums)",
    "infer_rsqrt": "inference with running variances across binades",
    "thread_split": "a batch of fewer samples than threads (a split that deals the samples' positions too shows)",
    "path_channels": "channel counts that are multiples of 4, 8 and 16 and counts that are not (a kernel's vector "
                     "path)",
    "channel_path": "channel counts that are multiples of 4, 8 and 16 (a kernel's vector path)",
    "packet_lanes": "channel counts with and without channels left over from whole packets of 8 and 16",
    "newton_form": "var + ε swept across binades",
}



# ---- the search space, stage by stage -------------------------------------------------------------------------

_ORDERS: tuple[dict[str, Any], ...] = (
    {"order": "pairwise"}, {"order": "sequential"}, {"order": "sequential", "kahan": True},
    *({"order": "lanes", "lanes": n} for n in (2, 4, 8, 16, 32, 64, 128)),
    *({"order": "lanes", "lanes": n, "kahan": True} for n in (8, 16)),
    *({"order": "vec", "lanes": n, "unroll": u} for n in (4, 8, 16) for u in (1, 2)),
    {"order": "xla"},
)
_RSQRTS: tuple[dict[str, Any], ...] = (
    {"rsqrt": "exact"},
    {"rsqrt": "sqrt_div", "sqrt": "exact", "division": "exact"},
    # x86's RSQRTPS refined as Eigen's packet rsqrt refines it (TensorFlow's rsqrt on whole packets), or alone; ahead
    # of the other estimates so that a later stage tries it among the ties a 16-bit y leaves
    *({"rsqrt": "rsqrtps", "rsqrt_newton": k, "newton_form": "eigen"} for k in (1, 0, 2)),
    *({"rsqrt": "sqrt_div", "division": "reciprocal", "recip": r, "recip_newton": k}
      for r in ("table", "frecpe", "magic") for k in (1, 2)),
    *({"rsqrt": "magic", "rsqrt_newton": k} for k in (0, 1, 2, 3)),
    *({"rsqrt": "table", "rsqrt_bits": b, "rsqrt_newton": k} for b in (7, 8, 10, 12) for k in (0, 1, 2)),
    *({"rsqrt": "frsqrte", "rsqrt_newton": k} for k in (0, 1, 2)),
    # x86's RSQRTPS refined as XLA's CPU rsqrt refines it (2 steps), or as a hand-written kernel might (1)
    *({"rsqrt": "rsqrtps", "rsqrt_newton": k, "newton_form": "xla"} for k in (2, 1)),
    {"rsqrt": "ascend950"},
    {"rsqrt": "sqrt_div", "rstd_format": "fp64"}, {"rsqrt": "exact", "rstd_format": "fp64"},
    # sqrt(1/(var + eps)) (Paddle, onnxruntime training), and Eigen's fast packet sqrt (Paddle)
    {"rsqrt": "sqrt_recip", "sqrt": "exact"}, {"rsqrt": "sqrt_recip", "sqrt": "eigen_fast"},
    {"rsqrt": "sqrt_div", "sqrt": "eigen_fast", "division": "exact"},
)


#: the thread counts a split by sample is tried with in the first layout's search (probes hold at most 6 samples: 8
#: and 16 stand for every count above, which give each sample its own thread, and split positions too where the split
#: allows it)
THREADS = (2, 3, 4, 8, 16)
#: the channel counts at which a kernel may take a second path (oneDNN: SSE4.1 and AVX2 / AVX-512 vector widths)
PATH_CHANNELS = (0, 4, 8, 16)


def _accumulators(fmt: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(("fp32", fmt if fmt in ("fp16", "bf16") else "fp32", "fp64")))


def _mean_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    """The mean stage's candidates: every one not split across threads says so (a split found in an earlier pass
    does not leak into them: nor does its fused sum of squares, which needs the threads)."""
    for c in _mean_candidates(cur, fmt):
        if "packet_lanes" not in c:
            c = {**c, "packet_lanes": 0}
        if "threads" not in c and cur.thread_split != "rows":  # (a split by sample found earlier: not theirs)
            c = {**c, "threads": None, "thread_split": "rows", "variance_fma": False}
        yield c


def _mean_candidates(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    sum_based = cur.variance if cur.variance in ("naive", "two_pass") else "two_pass"
    for acc in _accumulators(fmt):
        orders = _ORDERS if acc != "fp64" else ({"order": "pairwise"},)
        for o, by in itertools.product(orders, ("divide", "reciprocal", "prescaled")):
            # (an order other than vec takes the backward's fused lanes away: backward_fma needs vec)
            fused = cur.backward_fma if o.get("order") == "vec" else "none"
            yield {"accumulate": acc, "variance": sum_based, "kahan": False, "unroll": 1, **o, "mean_by": by,
                   "backward_fma": fused, "sum_format": None}
    if sum_based == "two_pass":
        # one-pass fp32 statistics, E[x²] − E[x]² (flax, Keras): where the mean is seen only through y, their
        # cancellation shows there more than any order does, so the order is searched with them too
        for o, by in itertools.product(_ORDERS, ("divide", "reciprocal")):
            fused = cur.backward_fma if o.get("order") == "vec" else "none"
            yield {"accumulate": "fp32", "variance": "naive", "kahan": False, "unroll": 1, **o, "mean_by": by,
                   "backward_fma": fused, "sum_format": None}
    if fmt in ("fp32", "fp16", "bf16"):
        # float terms summed in double, in memory order (PyTorch's fp32 CPU kernel), or lanes by position in each
        # row of H·W values (inductor's vectorised reductions)
        for o in ({"order": "sequential", "sum_format": "fp64"}, *({"order": "rowlanes", "lanes": n} for n in (8, 16))):
            yield {"accumulate": "fp32", "variance": sum_based, "kahan": False, "unroll": 1, "sum_format": None,
                   **o, "mean_by": "divide", "backward_fma": "none"}
        # Eigen's dense sums of each row (Paddle), GCC's omp-simd reductions of each row (oneDNN: MindSpore), in
        # the SSE and AVX widths
        for o in (*({"order": "eigen", "lanes": n} for n in (4, 8)),
                  *({"order": "omp_simd", "lanes": n} for n in (1, 4, 8))):
            yield {"accumulate": "fp32", "variance": sum_based, "kahan": False, "unroll": 1, "sum_format": None,
                   **o, "mean_by": "divide", "backward_fma": "none"}
        # torch.compile's CPU reductions: AVX2 or AVX-512 vectors, one of them (fp32) or two (16-bit input widened),
        # with its two-pass variance throughout or its switch to Welford above 1024 values (the threads it splits a
        # channel across, where it does, are the adapter's to declare: Capabilities.threads)
        for lanes, unroll, v in itertools.product((16, 8), (1, 2), ("inductor", "two_pass")):
            yield {"accumulate": "fp32", "variance": v, "kahan": False, "unroll": unroll, "sum_format": None,
                   "order": "inductor", "lanes": lanes, "mean_by": "divide", "backward_fma": "none"}
    # Eigen's reduction over the rows of an NHWC tensor: four interleaved accumulators for the channels in whole
    # packets, the channels left over summed in order (TensorFlow's reduce_mean: Keras on TensorFlow)
    for lanes, by in itertools.product((0, 8, 16), ("divide", "reciprocal")):
        yield {"accumulate": "fp32", "variance": sum_based, "kahan": False, "unroll": 1, "sum_format": None,
               "order": "interleave4", "packet_lanes": lanes, "mean_by": by, "backward_fma": "none"}
    # threads that each sum whole samples (or parts of one) in order, their partials added in thread order (oneDNN's
    # batch normalisation on T threads: lanes = channels, each channel's sum sequential within a thread)
    for threads, split in itertools.product(THREADS, ("samples", "samples_spatial")):
        yield {"accumulate": "fp32", "variance": sum_based, "kahan": False, "unroll": 1, "sum_format": None,
               "order": "sequential", "mean_by": "divide", "backward_fma": "none", "core_parts": 1,
               "threads": threads, "thread_split": split, "variance_fma": cur.variance_fma and cur.threads is not None}
    for acc in _accumulators(fmt):
        for v, lanes, by in itertools.product(("welford", "welford_ascend"), (1, 8, 16, 64), ("divide", "reciprocal")):
            yield {"accumulate": acc, "variance": v, "lanes": lanes, "mean_by": by, "order": "pairwise",
                   "kahan": False, "backward_fma": "none", "sum_format": None}
        for tiles, o in itertools.product((2, 4, 8, 16, 24, 32, 64), ({"order": "pairwise"}, {"order": "sequential"})):
            yield {"accumulate": acc, "variance": "chan", "tiles": tiles, "mean_by": "divide", "kahan": False,
                   "backward_fma": "none", "sum_format": None, **o}


def _variance_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    variances = ("two_pass", "naive") if cur.variance in ("naive", "two_pass") else (cur.variance,)
    # (the variance's division by R too: a Welford or Chan mean does not show it; the threads' sums of squares by
    # fused multiply-adds; a second code path for channel counts that a vector width divides, which fuses them)
    fused = (False, True) if cur.threads is not None else (False,)
    for v, clamp, by, fma, path in itertools.product(variances, (False, True), ("divide", "reciprocal"), fused,
                                                     PATH_CHANNELS):
        yield {"variance": v, "clamp_var": clamp, "mean_by": by if cur.mean_by != "prescaled" else "prescaled",
               "variance_fma": fma, "path_channels": path}


def rsqrt_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    defaults = {"sqrt": "exact", "division": "exact", "recip": "table", "recip_newton": 2, "rsqrt_newton": 0,
                "rsqrt_bits": 12, "rstd_format": None, "newton_form": "standard"}
    for r in _RSQRTS:
        yield {**defaults, **r}


def _y_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    computes = tuple(dict.fromkeys(("fp32" if fmt != "fp64" else "fp64", fmt)))
    narrow = cur.params_format in ("fp16", "bf16")
    formulas = ("xhat", "scale", "affine", "affine_mr")
    for f, fma, comp, stored, rnd in itertools.product(formulas, (False, True), computes,
                                                       (False, True) if narrow else (False,),
                                                       (None, "nearest_away", "toward_zero")):
        yield {"y_formula": f, "fma": fma, "compute": comp, "stored_stats": stored, "output_rounding": rnd}


def _modes_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    for ov, sub in itertools.product(("ieee", "saturate"), ("keep", "flush")):
        yield {"overflow": ov, "subnormals": sub}


def _running_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    formats = tuple(dict.fromkeys(f for f in (None, cur.params_format, "fp64") if f != cur.accumulate))
    for m, v, f, by, wide in itertools.product(("new", "old", "keep"), ("unbiased", "biased"), formats,
                                               ("factor", "divide", "momentum_factor"), (None, "fp64")):
        if by == "momentum_factor" and (v != "unbiased" or wide is not None):
            continue
        if (v == "unbiased" or by == "factor") and (wide is None or f in (None, "fp32") and cur.accumulate == "fp32"):
            yield {"running_momentum": m, "running_var": v, "running_format": f, "unbiased_by": by,
                   "running_var_sum": wide}


def _infer_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    # (a kernel that trains with sqrt(1/(var + eps)) may infer with 1/sqrt(var + eps): Paddle)
    roots = (None, "sqrt_div", "exact") if cur.rsqrt == "sqrt_recip" else (None,)
    for f, r in itertools.product((None, "xhat", "scale", "affine", "affine_mr"), roots):
        if f != cur.y_formula:
            yield {"infer_y_formula": f, "infer_rsqrt": r}


def infer_only_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    """The inference of a kernel that runs nothing else (a deployment runtime): nothing earlier pinned its
    arithmetic, so its format (the elementwise and the statistics' — upcast or the input's own), its formula (folded
    or not, fused multiply-adds) and how it forms 1/√(var + ε) are searched together; the estimates an NPU uses are
    the training search's (a CPU runtime divides and takes square roots)."""
    computes = tuple(dict.fromkeys(("fp32" if fmt != "fp64" else "fp64", fmt)))
    accs = tuple(dict.fromkeys(("fp32" if fmt != "fp64" else "fp64", fmt, "fp64")))
    roots = ({"rsqrt": "exact", "sqrt": "exact", "division": "exact"},
             {"rsqrt": "sqrt_div", "sqrt": "exact", "division": "exact"})
    for f, fma, comp, acc, r, times in itertools.product(("xhat", "scale", "affine"), (False, True), computes, accs,
                                                          roots, (False, True)):
        # (times: 1/σ rounded, then γ·(1/σ), not γ/σ — in inference a set rstd_format says so, forming the rstd in
        # the accumulator: its own format is named)
        yield {"infer_y_formula": f, "y_formula": f, "fma": fma, "compute": comp, "accumulate": acc,
               "rstd_format": acc if times else None, **r}


def _backward_space(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
    # (the sums' order and format are the forward's: the forward's outputs pinned them)
    for f in ("standard", "ascend", "torch", "paddle", "onednn", "inductor", "jax"):
        for fused in (("none", "body", "all") if cur.order == "vec" else ("none",)):
            yield {"backward_formula": f, "backward_fma": fused, "backward_sums": "forward", "backward_lanes": None}
    if cur.order == "omp_simd" and cur.lanes != 1:  # (a backward loop the compiler did not vectorise: oneDNN's)
        for f in ("standard", "onednn"):
            yield {"backward_formula": f, "backward_fma": "none", "backward_sums": "forward", "backward_lanes": 1}
    for f in ("onednn_jit", "keras_tf"):
        yield {"backward_formula": f, "backward_fma": "none", "backward_sums": "forward", "backward_lanes": None}
    # TensorFlow's Eigen gradient recomputes rsqrt by packets: its packet width is the backward's to find when the
    # forward (oneDNN's, say) did not show it
    for lanes in dict.fromkeys((cur.packet_lanes, 8, 16)):
        yield {"backward_formula": "tf_eigen", "backward_fma": "none", "backward_sums": "forward",
               "backward_lanes": None, "packet_lanes": lanes}
    if fmt in ("fp32", "fp64"):
        # or plane by plane, each plane's lanes folded, the planes added in the forward's sum format (PyTorch's fp32
        # and fp64 CPU backward: at::vec::reduce_all, 8 lanes in its AVX2 build, 16 in an AVX-512 one); the lanes
        # are free to search where the forward's statistics do not use them
        free = cur.order in ("sequential", "pairwise") and cur.variance in ("naive", "two_pass")
        for lanes, fused in itertools.product((8, 16) if free else (cur.lanes,), ("none", "tail", "body", "all")):
            yield {"backward_formula": "torch", "backward_sums": "plane_reduce", "lanes": lanes, "backward_fma": fused}


#: the thread counts a channels-last search tries (after the kernel's own, where it says): its sums split across T
#: threads change with T
THREADS_TRIED = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def layout_spaces(threads: int | None = None) -> dict[str, Callable[[Policy, str], Iterator[dict[str, Any]]]]:
    """The candidates a search in another layout tries first, from the recipe found in the first (a kernel's
    channels-last branch is another kernel, but mostly its arithmetic is the other branch's): the sums with lanes =
    channels — each channel's rows in order, on one thread or split across T threads whose partials are added in thread
    order in the sum format or the accumulator (PyTorch CPU; ``threads``, the kernel's own count, tried first) — the
    fused multiply-adds of the threads' sums and of dx; a torch.compile recipe (order=inductor) keeps its own sums,
    with the threads it splits few channels across.  The stages they do not name keep the first layout's spaces."""
    counts = tuple(dict.fromkeys(t for t in (threads, *THREADS_TRIED) if t))

    def mean(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
        if cur.order == "inductor":  # (torch.compile: its own sums, split across its threads where it splits them)
            for t in counts:
                yield {"threads": t}
        base = {"order": "sequential", "kahan": False, "lanes": 64, "unroll": 1, "variance_fma": False,
                "backward_fma": "none", "backward_sums": "forward", "dx_fma": "all", "core_parts": 1,
                "variance": cur.variance if cur.variance in ("naive", "two_pass") else "two_pass",
                "mean_by": "divide" if cur.mean_by == "prescaled" else cur.mean_by}
        wide = "fp64" if cur.accumulate == "fp32" else None
        for combine in dict.fromkeys((cur.sum_format, None, wide)):
            for t in (None, *counts):
                yield {**base, "threads": t, "sum_format": combine}
        yield {**base, "order": "pairwise", "threads": None, "sum_format": None}

    def variance(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
        # (fused sums of squares need threads: with the mean stage's ties, which may set them)
        for fused in (False, True):
            yield {"variance_fma": fused}

    def backward(cur: Policy, fmt: str) -> Iterator[dict[str, Any]]:
        if cur.threads is None:
            yield from _backward_space(cur, fmt)
            return
        # (the vector width over channels: where dx's body ends and its scalar tail begins)
        widths = ((8, 1), (8, 2), (16, 1), (16, 2), (4, 1), (4, 2))
        for fused in ("none", "all"):
            for dx in ("all", "none"):
                yield {"backward_fma": fused, "dx_fma": dx}
            for dx, (lanes, unroll) in itertools.product(("body", "tail"), widths):
                yield {"backward_fma": fused, "dx_fma": dx, "lanes": lanes, "unroll": unroll}

    return {"mean": mean, "variance": variance, "backward": backward}


SPACES: dict[str, Callable[[Policy, str], Iterator[dict[str, Any]]]] = {
    "mean": _mean_space, "variance": _variance_space, "rsqrt": rsqrt_space, "y": _y_space, "modes": _modes_space,
    "running": _running_space, "infer": _infer_space, "backward": _backward_space,
}
MODES_OF = {**{s: ("train",) for s in FORWARD_STAGES}, "infer": ("infer",), "backward": ("backward",)}

"""Policy: every numerical choice a BatchNorm kernel makes, in one frozen value."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, fields, replace

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import get_format
from bnprobe.numerics.reduce import COMBINES, ORDERS, THREAD_SPLITS
from bnprobe.numerics.rounding import OVERFLOWS, SUBNORMALS, RoundingSpec
from bnprobe.numerics.rsqrt import NEWTON_FORMS
from bnprobe.numerics.variance import MEAN_BY, VARIANCES

__all__ = ["Policy", "PRESETS", "get_policy", "Y_FORMULAS", "RSQRT_METHODS", "BACKWARD_FORMULAS", "SQRT_METHODS",
           "DIVISIONS", "RECIP_METHODS",
           "RUNNING_MOMENTA", "RUNNING_VARS", "UNBIASED_BY", "BACKWARD_FMAS", "BACKWARD_SUMS", "DX_FMAS", "PATHS",
           "CAST_POINTS", "FAMILY_ONLY", "DX_FUSES"]

# How y is formed from the statistics:
#   xhat   : xhat = (x - mean) * rstd; y = gamma * xhat + beta
#   scale  : w = gamma * rstd; y = (x - mean) * w + beta          (Ascend BatchNormV3)
#   affine : mult = gamma * rstd; addend = beta - mult * mean; y = mult * x + addend
#            (Ascend TBE BNTrainingUpdate, PyTorch CPU)
#   affine_mr : mult = rstd * gamma; addend = beta - (mean * rstd) * gamma; y = x * mult + addend (Paddle's CPU kernel)
#   xhat_div : xhat = (x - mean) / std, divided rather than multiplied by rstd; y = xhat * gamma + beta, std from
#              rsqrt=sqrt_div (a family layer's: MindSpore's CPU LayerNorm)
Y_FORMULAS: tuple[str, ...] = ("xhat", "scale", "affine", "affine_mr", "xhat_div")
# exact    : rstd = 1/sqrt(var + eps) correctly rounded in one step
# sqrt_div : std = sqrt(var + eps) by the `sqrt` method, then rstd = 1 / std (and gamma / std where a
#            formula needs it) by the `division` method
# magic, table, frsqrte : a hardware estimate refined by rsqrt_newton steps (bnprobe.numerics.rsqrt)
# ascend950 : r = 1/v, sqrt, one Newton step, one FMA-residual correction (Ascend 950)
# sqrt_recip : rstd = sqrt(1/(var + eps)): the reciprocal correctly rounded, then its square root by the `sqrt`
#              method (Paddle's and onnxruntime's CPU training kernels)
# rsqrtps : Intel's x86 estimate (bnprobe.numerics.rsqrt) refined by rsqrt_newton steps (XLA's CPU rsqrt: 2 steps
#           of newton_form=xla)
RSQRT_METHODS: tuple[str, ...] = ("exact", "sqrt_div", "magic", "table", "frsqrte", "ascend950", "sqrt_recip",
                                  "rsqrtps")
# the unbiased running variance needs R/(R-1); with R = 1 training is an error (PyTorch),
# or the factor is taken as 0 (Ascend TBE) or the result is NaN (Ascend BatchNormV3)
UNBIASED_R1: tuple[str, ...] = ("error", "zero", "nan")
# eigen_fast: Eigen 3.3's packet sqrt under EIGEN_FAST_MATH (x·(rsqrtps refined by one Newton step)) on the channels
# that fill whole packets of `lanes` channels, the exact sqrt on the rest (Paddle's CPU kernel)
SQRT_METHODS: tuple[str, ...] = ("exact", "rsqrt", "exp_log", "eigen_fast")
DIVISIONS: tuple[str, ...] = ("exact", "reciprocal")
RECIP_METHODS: tuple[str, ...] = ("exact", "magic", "table", "frecpe")
# where a family layer (LayerNorm, RMSNorm, GroupNorm, InstanceNorm) rounds y: once after γ and β, or x̂ to the storage
# format first (bnprobe.kernels.norms)
CAST_POINTS: tuple[str, ...] = ("after_gamma", "before_gamma")
# the fields only a family layer reads: a BatchNorm kernel is not run with them set
FAMILY_ONLY: tuple[str, ...] = ("cast_point", "offset_format", "eps_format", "rstd_cast", "grad_sum_format", "dx_fuses")
# which product of dx = c1·dy + c2·x + c3 a family layer's PyTorch CPU backward fuses into the first addition
DX_FUSES: tuple[str, ...] = ("x", "dy")
# standard : dx = gamma*rstd*(dy - mean(dy) - xhat*mean(dy*xhat))
# ascend   : dx = (dy + mult*x + addend) * gamma/sigma, mult = -(dgamma/R)/sigma,
#            addend = (mean/sigma)(dgamma/R) - dbeta/R   (BNTrainingReduceGrad)
# torch    : dx = ((dy - mean(dy)) - (x - mean)·k)·invstd·gamma, k = Σ(x - mean)dy·invstd²/R, the first product
#            fused (PyTorch CPU's 16-bit kernels), Σ(x - mean)·dy by fused multiply-adds as backward_fma says
# paddle   : dx = s·((dy·N·HW − Σdy) − ((x − mean)·dγ)·invstd), s = (γ·invstd)/R, dγ = Σ((x − mean)·invstd)·dy,
#            the integer factors each a rounded multiplication (Paddle's CPU kernel)
# onednn   : dγ = Σ(x − mean)·dy·invstd; dx = (dy − (Σdy/R + (((x − mean)·dγ)·invstd)/R))·(γ·invstd), invstd =
#            1/sqrt(var + eps) from the saved variance (oneDNN's ncsp kernel: MindSpore's CPU BatchNormGrad; its
#            nspc C++ loop behind TensorFlow's fused kernel, with the sums split across threads by sample)
# onednn_jit : oneDNN's JIT batch normalisation: in each thread, per sample, Σdy and Σ(x - mean)·dy by fused
#            multiply-adds, the sample's dot times rstd added to the thread's; the threads' partials added in order;
#            dx = (((dy - Σdy/R) - (x - mean)·((dγ·rstd)/R))·γ)·rstd
# tf_eigen : TensorFlow's Eigen FusedBatchNormGrad (its CPU kernel without oneDNN, and with oneDNN for fp16):
#            c0 = rsqrt(var + ε) recomputed from the saved variance, by Eigen's packet rsqrt (rsqrtps, one eigen
#            Newton step) on the channels of whole packets (packet_lanes) and sqrt then divide on the rest; sums by
#            TensorFlow's ReduceOuterDimensions on the policy's threads (row blocks as Eigen's cost model runs them);
#            ȳ = Σdy·fl(1/R); dγ = Σ dy·((x - mean)·c0); m = Σ dy·(x - mean) / R;
#            dx = (γ·c0)·((dy - ȳ) - (x - mean)·((c0·c0)·m)); statistics as constants: dx = dy·(c0·γ)
# keras_tf : TensorFlow's autodiff through Keras 3's layer (tf.nn.moments, tf.nn.batch_normalization), op by op:
#            inv = rstd·γ; gβ = Σdy; gm = -gβ·inv; dγ = rstd·(Σ x·dy + mean·(-gβ)); gv = RsqrtGrad(rstd, (...)·γ);
#            dx = (dy·inv + gm/R) + (2·(gv/R))·(x - mean); sums in the policy's order, RsqrtGrad by packets
#            (packet_lanes: (-1/2·(r·r))·(r·g)) and by scalars ((-1/2·(g·r))·(r·r))
# inductor : torch.compile's decomposition (torch/_decomp native_batch_norm_backward), in the accumulator format:
#            p = Σ(x - mean)·dy, n = fl(1/R); dγ = p·invstd; dx = ((dy - (x - mean)·((p·n)·(invstd·invstd))) - Σdy·n)
#            ·(invstd·γ) (statistics taken as constants: dx = dy·(invstd·γ))
BACKWARD_FORMULAS: tuple[str, ...] = ("standard", "ascend", "torch", "paddle", "onednn", "inductor", "onednn_jit",
                                      "tf_eigen", "keras_tf", "jax")
# backward_fma: which multiply-adds of the backward's Σ(x - mean)·dy are fused: none, the vector body (lanes), the
# tail (order=vec: the scalar tail; plane_reduce: the masked last vector of each plane) or all
BACKWARD_FMAS: tuple[str, ...] = ("none", "body", "tail", "all")
# how the backward takes Σdy and Σ(x - mean)·dy: as the forward's statistics (its order, lanes and accumulator), or
# plane_reduce: PyTorch's fp32/fp64 CPU kernel (batch_norm_cpu_backward_contiguous_impl), each H·W plane reduced by
# at::vec::reduce_all in `lanes` accumulator-format lanes (first vector as the accumulator, a masked partial vector,
# the lanes folded halves first; a plane shorter than the lanes folded in sequence), the planes' results added in
# order in sum_format (double there; the accumulator when None) — see numerics.reduce.plane_reduce
BACKWARD_SUMS: tuple[str, ...] = ("forward", "plane_reduce")
# dx_fma: which channels' dx (backward_formula=torch) fuse dy − Σdy/R − (x − mean)·k into one multiply-add: all,
# none, or with threads (a channels-last row, vectorised across channels) the channels in full vectors of
# lanes x unroll (body) or the remaining ones, done by scalar code (tail); PyTorch's CPU channels-last kernels
# differ by format (measured)
DX_FMAS: tuple[str, ...] = ("all", "body", "tail", "none")
# what the call's momentum m weighs in the running update: the batch's value (PyTorch, TensorFlow's fused kernel,
# MindSpore's primitive: new = (1-m)·old + m·batch) or the old value's (flax, Keras, Paddle: new = m·old + (1-m)·batch)
# keep: the framework's momentum argument is the old value's weight k = 1 - m held as a float32 attribute, and the
# batch's weight 1 - k is formed from it in the update's format (Paddle: new = fl32(k)·old + fl(1 - fl32(k))·batch)
RUNNING_MOMENTA: tuple[str, ...] = ("new", "old", "keep")
# the running variance's update takes the batch variance times R/(R-1) (PyTorch, TF's fused kernel, MindSpore) or
# the biased batch variance itself (flax, Keras, Paddle)
RUNNING_VARS: tuple[str, ...] = ("unbiased", "biased")
# the unbiased variance as var · fl(R/(R-1)), or as Σ(x - mean)² / (R - 1) (PyTorch's CPU kernel), or not formed:
# the running update's batch term is (m · fl(R/(R-1))) · var (momentum_factor: TensorFlow's fused kernels, on
# oneDNN and on Eigen)
UNBIASED_BY: tuple[str, ...] = ("factor", "divide", "momentum_factor")
# A kernel's second code path, taken when path_channels divides the channel count: the fields it changes.
#   onednn_jit : oneDNN's JIT batch normalisation (its C++ loop runs the other channel counts): threads split the
#                samples, then each sample's positions; Σ(x - mean)² by fused multiply-adds;
#                y = fma((x - mean)·(1/√(var + ε)), γ, β); its own backward where the policy's is oneDNN's (onednn;
#                another backward stays: TensorFlow's fp16 gradient is Eigen's on either path)
PATHS: dict[str, dict[str, object]] = {
    "onednn_jit": {"thread_split": "samples_spatial", "variance_fma": True, "y_formula": "xhat", "fma": True,
                   "rsqrt": "sqrt_div", "sqrt": "exact", "division": "exact", "backward_formula": "onednn_jit"},
}


@functools.cache
def _field_types() -> dict[str, tuple[type, ...]]:
    """Each Policy field's types from its annotation (``int | None`` -> (int, NoneType)), read with
    :func:`typing.get_type_hints` rather than by matching the annotation's text."""
    return {name: typing.get_args(t) or (t,) for name, t in typing.get_type_hints(Policy).items()}


@dataclass(frozen=True)
class Policy:
    """Formats, algorithms and rounding for one emulated BatchNorm.

    storage: x, y, dy, dx.  params: gamma, beta, running and saved statistics
    (``None`` = same as storage).  compute: the elementwise normalisation and
    affine.  accumulate: sums, mean, variance, rstd and the running-stat update.
    """

    name: str = "custom"
    storage: str = "fp32"
    params: str | None = None
    compute: str = "fp32"
    accumulate: str = "fp32"
    variance: str = "two_pass"
    order: str = "pairwise"
    lanes: int = 64
    unroll: int = 1  # order=vec: vectors of ``lanes`` per block (PyTorch CPU's 16-bit kernels load 2 x 8 floats)
    tiles: int = 8
    kahan: bool = False
    clamp_var: bool = False
    mean_by: str = "divide"
    rounding: str = "nearest_even"
    output_rounding: str | None = None  # rounding of the final cast of y / dx; None = rounding
    overflow: str = "ieee"
    subnormals: str = "keep"
    y_formula: str = "xhat"
    fma: bool = False
    rsqrt: str = "exact"
    rsqrt_newton: int = 0
    rsqrt_bits: int = 12
    rsqrt_constant: int | None = None
    newton_form: str = "standard"
    sqrt: str = "exact"  # how sqrt(var + eps) is formed where a kernel needs sigma
    # the batch statistics' var + eps, sqrt and rstd in this format, rstd then rounded to accumulate and γ·rstd taken
    # where a formula needs γ/σ; inference forms the running statistics' in accumulate (PyTorch CPU: double, float)
    rstd_format: str | None = None
    division: str = "exact"  # a / b: one rounding, or a * reciprocal(b) as units without a divider do
    recip: str = "table"  # the reciprocal estimate when division="reciprocal"
    recip_newton: int = 2
    recip_bits: int = 12
    backward_formula: str = "standard"
    backward_fma: str = "none"  # BACKWARD_FMAS (order=vec, or backward_sums=plane_reduce)
    backward_sums: str = "forward"  # BACKWARD_SUMS (plane_reduce: with backward_formula=torch)
    # normalise with the batch statistics rounded to the params format, as the interface stores them
    # (PyTorch's CPU kernel does this with same-format parameters: model.half(), model.bfloat16())
    stored_stats: bool = False
    core_parts: int = 1  # cores sharing one channel's reduction (N split across cores)
    core_combine: str = "ordered"  # their partial sums added in core order, or by atomic adds (random order)
    # a second code path for channel counts that path_channels divides (0: none), the policy with PATHS[channel_path]
    # applied: oneDNN's JIT kernel for C a multiple of its vector width (fp32: 4 from SSE4.1 up; bf16, fp16: 16 on
    # AVX-512), its C++ loop otherwise
    path_channels: int = 0
    channel_path: str = "onednn_jit"
    # a kernel vectorised across channels in packets of this many (Eigen on TensorFlow's AVX builds: 8): the channels
    # left over from the last whole packet take the scalar path, sequential sums and 1/√ as sqrt then divide, each
    # rounded (0: every channel takes the policy's order and rsqrt)
    packet_lanes: int = 0
    unbiased_r1: str = "error"
    running_momentum: str = "new"  # RUNNING_MOMENTA
    running_var: str = "unbiased"  # RUNNING_VARS
    running_format: str | None = None  # the format the running update is computed in; None = accumulate
    unbiased_by: str = "factor"  # UNBIASED_BY
    # the format the statistics' sums are carried in when wider than accumulate (PyTorch's fp32 CPU kernel sums
    # float terms in double), each term rounded in accumulate — with backward_sums=plane_reduce also the backward's
    # sums, each plane's result a term; None = accumulate
    sum_format: str | None = None
    # the format the saved mean and invstd (or variance) are returned in; None = the params format (inductor on the
    # CPU returns them in the input's format, whatever the parameters')
    saved_format: str | None = None
    # the format the running variance's update forms its batch term (momentum · unbiased variance) and adds the two
    # terms in, the old term's product staying in the update's format (PyTorch's fp32 CPU kernel: double, its
    # accumulator type); None = the update's format
    running_var_sum: str | None = None
    infer_y_formula: str | None = None  # y's formula in inference when not y_formula (a folded y = A·x + B)
    # the rows (R = N·H·W) each channel's sums run over split across this many threads, as PyTorch CPU's channels-last
    # kernels split them (taken by its NCHW kernels too when H·W = 1: BatchNorm1d on (N, C)): T' = min(T, R) threads
    # take ⌈R/T'⌉ contiguous rows each, add them in order into a buffer in accumulate, and the T buffers are added in
    # thread order in sum_format (None: accumulate); with a wider sum_format (its fp32 kernel) and R ≤ T, one row per
    # thread when 16 < C ≤ 2048, else one thread.  The result depends on T, torch.get_num_threads().  None: no split.
    # With order=inductor: the threads torch.compile's kernels were generated for, where inductor splits a channel's
    # reduction across them (a layout without rows and few channels: bnprobe.numerics.inductor.splits_channels), each
    # thread a contiguous part of the rows (OpenMP's static schedule), the parts merged in thread order.  A family layer
    # (LayerNorm, RMSNorm, GroupNorm, InstanceNorm) splits dγ's and dβ's sums alone so, each thread's buffer in
    # grad_sum_format (PyTorch CPU LayerNorm's backward); each row's statistics are one thread's.  Under
    # backward_formula=torch, the threads its PyTorch CPU kernel runs on: LayerNorm's dγ and dβ updated row by row,
    # by fused multiply-adds, in one grad_sum_format buffer per thread; GroupNorm's backward runs another compiled copy
    # of its per-group loop on one thread; and ATen's sum of one row of 32768 values or more (order=aten) is split
    # across them
    threads: int | None = None
    # how the rows are dealt to the threads (reduce.THREAD_SPLITS): in ⌈R/T'⌉ contiguous blocks (rows, PyTorch), or
    # by sample, as oneDNN's C++ loop (samples) and JIT kernel (samples_spatial) deal them
    thread_split: str = "rows"
    # the threads' Σ(x − mean)² (and naive Σx²) accumulated by fused multiply-adds, s = fma(d, d, s) (GCC contracts
    # PyTorch's `y + (x − mean)·(x − mean)`); needs threads — or, with variance=rowwise, RowwiseMoments' scalar tail
    # m2 += δ·(x − m1) by a fused multiply-add (GCC contracts it in PyTorch's fp16 kernel, not its fp32 and bf16 ones)
    variance_fma: bool = False
    dx_fma: str = "all"  # DX_FMAS (backward_formula=torch)
    # how inference forms 1/sqrt(var + eps) when not as training does (Paddle trains with sqrt(1/(var + eps)) and
    # infers with 1/sqrt(var + eps))
    infer_rsqrt: str | None = None
    # the lanes of the backward's sums when not the forward's (oneDNN's ncsp backward loop is not vectorised: 1)
    backward_lanes: int | None = None
    # where a family layer's y is rounded (CAST_POINTS): once, after γ and β are applied, or x̂ rounded to the storage
    # format before γ multiplies it (HF Llama's RMSNorm); LayerNorm, RMSNorm, GroupNorm and InstanceNorm only
    cast_point: str = "after_gamma"
    # the format a family layer forms offset + w in, for a call with a weight offset (Gemma's RMSNorm: 1 + w);
    # None = the compute format
    offset_format: str | None = None
    # the format a family layer rounds ε to before adding it to the variance (PyTorch's RMSNorm rounded a user's ε to
    # x's 16-bit dtype until pytorch/pytorch#142848); None = the format of the addition
    eps_format: str | None = None
    # the format a family layer rounds rstd to wherever rstd multiplies (amd/IRON#139's RMSNorm cast inv_rms to bf16
    # before its bf16 multiply); the statistics saved are the rstd computed.  None = rstd as computed
    rstd_cast: str | None = None
    # the format a family layer carries dγ's and dβ's sums in (Liger-Kernel#950's tl.sum over a bf16 tensor; PyTorch
    # CPU LayerNorm's per-thread buffers of x's dtype): without threads the terms rounded to it and summed in it in
    # the policy's order; with threads each thread's buffer, every addition formed in accumulate and rounded to it,
    # the buffers then added in thread order in accumulate.  None = accumulate
    grad_sum_format: str | None = None
    # which product a family layer's PyTorch CPU backward (backward_formula=torch) fuses into dx's first addition,
    # dx = c1·dy + c2·x + c3 (DX_FUSES): GCC fuses b·x in LayerNorm's kernel and in GroupNorm's fp16 one,
    # (rstd·γ)·dy in GroupNorm's fp32 and bf16 ones
    dx_fuses: str = "x"
    seed: int = 0  # drives stochastic rounding

    def __post_init__(self) -> None:
        for attr in ("storage", "compute", "accumulate"):
            object.__setattr__(self, attr, get_format(getattr(self, attr)).name)
        for attr in ("params", "running_format", "rstd_format", "sum_format", "saved_format",
                     "running_var_sum", "offset_format", "eps_format", "rstd_cast", "grad_sum_format"):
            if getattr(self, attr) is not None:
                object.__setattr__(self, attr, get_format(getattr(self, attr)).name)
        choices = {
            "variance": VARIANCES, "order": ORDERS, "mean_by": MEAN_BY, "overflow": OVERFLOWS,
            "subnormals": SUBNORMALS, "y_formula": Y_FORMULAS, "rsqrt": RSQRT_METHODS,
            "backward_formula": BACKWARD_FORMULAS, "sqrt": SQRT_METHODS, "division": DIVISIONS,
            "recip": RECIP_METHODS, "newton_form": NEWTON_FORMS, "core_combine": COMBINES,
            "unbiased_r1": UNBIASED_R1, "running_momentum": RUNNING_MOMENTA, "running_var": RUNNING_VARS,
            "infer_y_formula": (None,) + Y_FORMULAS, "unbiased_by": UNBIASED_BY, "backward_fma": BACKWARD_FMAS,
            "backward_sums": BACKWARD_SUMS, "dx_fma": DX_FMAS, "thread_split": THREAD_SPLITS,
            "channel_path": tuple(PATHS), "infer_rsqrt": (None,) + RSQRT_METHODS, "cast_point": CAST_POINTS,
            "dx_fuses": DX_FUSES,
        }
        for attr, valid in choices.items():
            if getattr(self, attr) not in valid:
                raise BNProbeError(f"policy {attr}={getattr(self, attr)!r} is not one of: {', '.join(map(str, valid))}")
        object.__setattr__(self, "rounding", RoundingSpec(self.rounding, self.overflow, self.subnormals).rounding)
        if self.output_rounding is not None:
            object.__setattr__(self, "output_rounding", RoundingSpec(self.output_rounding).rounding)
        for f in fields(self):
            value, takes = getattr(self, f.name), _field_types()[f.name]
            if value is None and type(None) in takes:
                continue
            if int in takes and (isinstance(value, bool) or not isinstance(value, int)):
                raise BNProbeError(f"policy {f.name} must be an integer, got {value!r}")
            if bool in takes and not isinstance(value, bool):
                raise BNProbeError(f"policy {f.name} must be true or false, got {value!r}")
        if not (0 <= min(self.rsqrt_newton, self.recip_newton) <= max(self.rsqrt_newton, self.recip_newton) <= 8) \
                or not 1 <= min(self.rsqrt_bits, self.recip_bits) <= max(self.rsqrt_bits, self.recip_bits) <= 23:
            raise BNProbeError("policy Newton step counts must be 0 to 8 and table bits 1 to 23, got "
                               f"rsqrt_newton={self.rsqrt_newton}, recip_newton={self.recip_newton}, "
                               f"rsqrt_bits={self.rsqrt_bits}, recip_bits={self.recip_bits}")
        # lanes, tiles and core parts are hardware widths: a few thousand at most (each lane holds one accumulator
        # per channel, so 10**9 lanes would be gigabytes of partial sums)
        for name in ("core_parts", "lanes", "tiles", "unroll", "backward_lanes"):
            if getattr(self, name) is not None and not 1 <= getattr(self, name) <= 4096:
                raise BNProbeError(f"policy {name} must be 1 to 4096, got {getattr(self, name)}")
        if self.newton_form == "xla" and self.division == "reciprocal":
            raise BNProbeError("policy newton_form=xla refines XLA's rsqrt; a reciprocal has no such form: give "
                               "division=exact or another newton_form")
        if self.backward_sums == "plane_reduce" and self.backward_formula != "torch":
            raise BNProbeError("policy backward_sums=plane_reduce is the sums of PyTorch's CPU backward: give "
                               "backward_formula=torch")
        if self.threads is not None:
            if not 1 <= self.threads <= 4096:
                raise BNProbeError(f"policy threads must be 1 to 4096 (or none), got {self.threads}")
            if self.order in ("inductor", "aten") or self.variance == "rowwise":
                pass  # (inductor's own split, PyTorch's family kernels' threads: see the field's note)
            elif self.order != "sequential" or self.kahan or self.core_parts != 1 or \
                    self.variance not in ("two_pass", "naive") or self.mean_by == "prescaled" or \
                    self.backward_sums != "forward":
                raise BNProbeError("policy threads splits plain sequential sums of the naive or two-pass variance: "
                                   "give order=sequential (no kahan, core_parts=1, mean_by not prescaled, "
                                   "backward_sums=forward), variance=two_pass or naive")
        if self.dx_fma in ("body", "tail") and self.threads is None:
            raise BNProbeError(f"policy dx_fma={self.dx_fma} names the channels of a row split across threads: give "
                               "threads")
        if self.variance_fma and self.threads is None and self.variance != "rowwise":
            raise BNProbeError("policy variance_fma fuses the threads' sums of squares (or, with variance=rowwise, "
                               "RowwiseMoments' scalar tail): give threads or variance=rowwise")
        if self.backward_fma != "none" and self.order != "vec" and self.backward_sums != "plane_reduce" and \
                not (self.threads and self.backward_fma == "all"):
            raise BNProbeError("policy backward_fma fuses the lanes of order=vec or of backward_sums=plane_reduce (or, "
                               "=all, the threads' sums): give order=vec, backward_sums=plane_reduce or threads")
        if self.variance == "inductor" and self.order != "inductor":
            raise BNProbeError("policy variance=inductor is torch.compile's var_mean, whose sums are order=inductor: "
                               "give order=inductor")
        if self.kahan and self.order == "pairwise":
            raise BNProbeError("policy kahan=True needs order=sequential or order=lanes")
        if self.thread_split != "rows" and self.threads is None:
            raise BNProbeError(f"policy thread_split={self.thread_split} deals rows to threads: give threads")
        for name in ("path_channels", "packet_lanes"):
            if not 0 <= getattr(self, name) <= 4096:
                raise BNProbeError(f"policy {name} must be 0 to 4096, got {getattr(self, name)}")

    @property
    def params_format(self) -> str:
        return self.params or self.storage

    @property
    def spec(self) -> RoundingSpec:
        return RoundingSpec(self.rounding, self.overflow, self.subnormals)

    @property
    def output_spec(self) -> RoundingSpec:
        return RoundingSpec(self.output_rounding or self.rounding, self.overflow, self.subnormals)

    def golden(self) -> Policy:
        """The same algorithm structure with every format fp64 and exact operations: the golden."""
        return replace(self, name=f"{self.name}@fp64", storage="fp64", params="fp64", compute="fp64",
                       accumulate="fp64", rounding="nearest_even", output_rounding=None, overflow="ieee",
                       subnormals="keep", kahan=False, rsqrt="sqrt_div" if self.rsqrt == "sqrt_div" else "exact",
                       sqrt="exact", division="exact", clamp_var=False, core_combine="ordered",
                       running_format=None, rstd_format=None, sum_format=None, saved_format=None, running_var_sum=None,
                       variance_fma=False, infer_rsqrt=None)

    def for_channels(self, channels: int) -> Policy:
        """The policy a call with ``channels`` channels runs: this one, or, when ``path_channels`` divides the count,
        this one with its second path's fields (:data:`PATHS`) applied."""
        if self.path_channels and channels % self.path_channels == 0:
            changes = dict(PATHS[self.channel_path])
            if self.backward_formula != "onednn":
                changes.pop("backward_formula", None)
            return self.with_options(**changes, path_channels=0)
        return self

    def with_options(self, **changes: object) -> Policy:
        """A copy with some fields changed (unknown names are a BNProbeError)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise BNProbeError(f"unknown policy option(s) {', '.join(bad)}; valid: {', '.join(sorted(known))}")
        return replace(self, **changes)

    def describe(self) -> str:
        """One line naming every choice that differs from the defaults."""
        default = Policy()
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name != "name" and getattr(self, f.name) != getattr(default, f.name)]
        return f"{self.name}: " + (", ".join(parts) if parts else "defaults")

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


PRESETS: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("fp64", storage="fp64", params="fp64", compute="fp64", accumulate="fp64"),
        Policy("fp32", storage="fp32", params="fp32", compute="fp32", accumulate="fp32"),
        # mixed precision as cuDNN, Ascend and PyTorch CPU do it: fp16 tensors,
        # fp32 parameters, statistics and arithmetic
        Policy("fp16", storage="fp16", params="fp32", compute="fp32", accumulate="fp32"),
        Policy("bf16", storage="bf16", params="fp32", compute="fp32", accumulate="fp32"),
        # everything in the 16-bit format, a naive port
        Policy("fp16-acc16", storage="fp16", params="fp16", compute="fp16", accumulate="fp16"),
        Policy("bf16-acc16", storage="bf16", params="bf16", compute="bf16", accumulate="bf16"),
    )
}


def _parse_value(key: str, text: str) -> object:
    field = {f.name: f for f in fields(Policy)}[key]
    kind = str(field.type)
    if "bool" in kind:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise BNProbeError(f"policy option {key} takes true/false, got {text!r}")
    if text.lower() == "none" and "None" in kind:
        return None
    if "int" in kind:
        try:
            return int(text, 0)
        except ValueError:
            raise BNProbeError(f"policy option {key} takes an integer, got {text!r}") from None
    return text


def get_policy(spec: str | Policy) -> Policy:
    """A preset by name, optionally with overrides: ``"fp16:variance=naive,order=sequential"``."""
    if isinstance(spec, Policy):
        return spec
    base, colon, rest = spec.strip().partition(":")
    if base not in PRESETS:
        raise BNProbeError(
            f"unknown policy {base!r}; presets: {', '.join(PRESETS)} (add overrides as name:key=value,...)")
    policy = PRESETS[base]
    if colon and not rest.strip():  # a ':' promises overrides: none given is a mistake, not the preset
        raise BNProbeError(f"policy {spec.strip()!r} has no override after ':'; give {base} alone, or "
                           f"{base}:key=value,...")
    if not rest:
        return policy
    changes: dict[str, object] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise BNProbeError(f"policy override {item!r} is not key=value")
        if key not in {f.name for f in fields(Policy)}:
            raise BNProbeError(f"unknown policy option {key!r}; valid: {', '.join(f.name for f in fields(Policy))}")
        changes[key] = _parse_value(key, value.strip())
    return policy.with_options(name=spec.strip(), **changes)


"""Arithmetic in an emulated format: each result formed in float64, rounded once.

Why this is exact: for operands that are already values of a format with
precision p, the float64 result of +, -, x, / and sqrt rounded again to p bits
equals the directly rounded result whenever 53 >= 2p + 2 (Figueroa 1995; Flocq
``Double_rounding.v``).  p = 24 (fp32), 11 (fp16) and 8 (bf16) all qualify; +, -
and x of such operands are in fact exact in float64.  The fused multiply-add is
handled separately: the product is exact in float64 (2p <= 53) and the sum's
error is recovered with TwoSum, then folded in by rounding to odd, which makes
the final single rounding correct (Boldo & Melquiond 2008).

fp64 itself is native IEEE arithmetic (nearest-even); the FMA there is a*b + c
with two roundings, which is documented, since the golden never needs one.

float32 carriers: large elementwise arrays may instead be float32 arrays (every
format here up to fp32 is exactly representable in binary32), which halves the
memory traffic.  An fp32 operation on float32 operands is then IEEE binary32
arithmetic itself, correctly rounded to nearest-even with gradual underflow, so
it equals the float64 result rounded once; events are read off the result
(a non-finite result sends the operation through the float64 route, whose
overflow accounting is exact; an underflow is a zero product or quotient of
nonzero finite operands).  Anything else — another format, another rounding
spec, an operand that is not exactly a binary32 value — takes the float64 route
and is converted back to float32 afterwards, which is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bnprobe.core.errors import BNProbeError
from bnprobe.core.formats import FP32, Format, get_format
from bnprobe.numerics.rounding import RoundingSpec, round_detail

__all__ = ["Arith", "Tally", "TALLY_FIELDS", "add", "sub", "mul", "div", "sqrt", "fma", "fits_float32", "as_carrier"]

_F32 = np.dtype(np.float32)

TALLY_FIELDS: tuple[str, ...] = ("overflow", "saturated", "underflow", "flushed")


class Tally:
    """Counts rounding events per channel (axis 0 of every array it sees)."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.counts: dict[str, np.ndarray] = {k: np.zeros(channels, dtype=np.int64) for k in TALLY_FIELDS}

    def add(self, field: str, mask: np.ndarray) -> None:
        if mask.ndim == 0 or not mask.any():
            return
        if mask.shape[0] != self.channels:
            raise AssertionError(f"tally expects channel-first arrays, got shape {mask.shape}")
        self.counts[field] += mask.reshape(self.channels, -1).sum(axis=1)

    def merge(self, other: Tally) -> None:
        for k in TALLY_FIELDS:
            self.counts[k] += other.counts[k]


def fits_float32(fmt: Format) -> bool:
    """True when every value of ``fmt`` is exactly a binary32 value (fp32, fp16, bf16, FP8)."""
    return FP32.holds(fmt)


def as_carrier(a: object) -> np.ndarray:
    """``a`` as an array of carriers: a float32 array as it is, anything else as float64."""
    arr = np.asarray(a)
    return arr if arr.dtype == _F32 else arr.astype(np.float64, copy=False)


def _is_f32(a: object) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == _F32 and a.ndim > 0


def _exact_f32(a: object) -> np.ndarray | None:
    """``a`` as a float32 array when that is exact (NaN included), else None."""
    arr = np.asarray(a)
    if arr.dtype == _F32:
        return arr
    if arr.dtype.kind not in "fiu":
        return None
    with np.errstate(all="ignore"):
        c = arr.astype(np.float32)
        back = c.astype(arr.dtype) if arr.dtype.kind == "f" else c.astype(np.float64)
        same = (back == arr) | (np.isnan(c) & np.isnan(arr)) if arr.dtype.kind == "f" else back == arr
    return c if bool(np.all(same)) else None


class Arith:
    """Operations in one format with one rounding spec; optionally tallies events.

    All arrays are float64 carriers of ``fmt`` values.  ``rng`` drives stochastic
    rounding and is shared, so a kernel run is reproducible from one seed.
    """

    def __init__(self, fmt: str | Format, spec: RoundingSpec | None = None,
                 rng: np.random.Generator | None = None, *, counting: bool = True) -> None:
        self.fmt = get_format(fmt)
        # False: tallies are ignored (a run nobody reads the trace of): the same values, without counting events
        self.counting = counting
        self.spec = spec or RoundingSpec()
        if self.spec.rounding == "stochastic" and rng is None:
            rng = np.random.default_rng(0)
        self.rng = rng
        self.native = self.fmt.name == "fp64"
        # nearest-even with IEEE overflow and gradual underflow is a plain correct cast for these
        # formats (see rounding._fast_nearest_even), used when no events are being counted
        self._plain = (self.spec == RoundingSpec() and self.fmt.name in ("fp64", "fp32", "fp16"))
        self.fits32 = fits_float32(self.fmt)
        # float32 carriers: fp32 with the default spec is binary32 arithmetic itself (binary32: True);
        # fp16 and bf16 with the default spec are one correct cast from binary32 (numpy, ml_dtypes)
        self.binary32 = self.fmt.name == "fp32" and self.spec == RoundingSpec()
        self._cast32 = self.fmt.name in ("fp16", "bf16") and self.spec == RoundingSpec()

    def __repr__(self) -> str:
        return f"Arith({self.fmt.name}, {self.spec.rounding}, {self.spec.overflow}, {self.spec.subnormals})"

    def round(self, wide: np.ndarray | float, tally: Tally | None = None) -> np.ndarray:
        """Round ``wide`` to this format, recording events in ``tally``.

        float64 in, float64 out; a float32 array (a float32 carrier) comes back as
        float32 when this format fits in binary32.
        """
        if not self.counting:
            tally = None
        if self.fits32 and _is_f32(wide):
            return self.round_narrow(wide, tally)[0]  # type: ignore[arg-type]
        wide = np.asarray(wide, dtype=np.float64)
        if self._plain and (tally is None or wide.ndim == 0):
            if self.native:
                return wide
            with np.errstate(all="ignore"):
                return wide.astype(self.fmt.dtype).astype(np.float64)
        if self._plain:
            # the default spec with events counted: a finite result cannot have overflowed, nothing is
            # saturated or flushed, and underflow shows as fewer nonzeros than before rounding
            with np.errstate(all="ignore"):
                r = wide if self.native else wide.astype(self.fmt.dtype).astype(np.float64)
                if np.isfinite(r.min()) and np.isfinite(r.max()):
                    if np.count_nonzero(r) != np.count_nonzero(wide):
                        tally.add("underflow", (wide != 0) & np.isfinite(wide) & (r == 0))
                    return r
        r, over, sat, flushed = round_detail(
            wide, self.fmt, rounding=self.spec.rounding, overflow=self.spec.overflow,
            subnormals=self.spec.subnormals, rng=self.rng)
        if tally is not None and wide.ndim > 0:
            tally.add("overflow", over)
            tally.add("saturated", sat)
            tally.add("flushed", flushed)
            with np.errstate(invalid="ignore"):
                tally.add("underflow", (wide != 0) & np.isfinite(wide) & (r == 0))
        return r

    def round_narrow(self, w: np.ndarray, tally: Tally | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Round float32 carriers ``w``: ``(result as float32, result in the format's own dtype or None)``,
        with the same values and events as the float64 route.

        The second array is the one a numpy cast made on the way (fp16, bf16), so a caller that stores the
        result in the format's dtype need not convert again.
        """
        if not self.counting:
            tally = None
        if self.binary32:
            return w, w  # binary32 values are fp32 values: nothing rounds
        if self._cast32:
            with np.errstate(all="ignore"):
                narrow = w.astype(self.fmt.dtype)
                r = narrow.astype(np.float32)
                if tally is None:
                    return r, narrow
                if not np.isfinite(np.sum(r)):
                    # only non-finite results can be overflows (nearest-even, IEEE: never saturated/flushed)
                    tally.add("overflow", np.isfinite(w) & ~np.isfinite(r))
                if (r == 0).any():  # an underflow leaves a zero
                    tally.add("underflow", (w != 0) & np.isfinite(w) & (r == 0))
            return r, narrow
        return self.round(w.astype(np.float64), tally).astype(np.float32), None

    def apply(self, f: Callable[..., np.ndarray], *args: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        """``f(*args)`` for one of np.add, np.subtract, np.multiply, np.divide, np.sqrt, rounded once."""
        if self.fits32 and any(_is_f32(a) for a in args):
            return self._apply32(f, args, tally)
        with np.errstate(all="ignore"):
            wide = f(*args)
        return self.round(wide, tally)

    def _apply32(self, f: Callable[..., np.ndarray], args: tuple[np.ndarray, ...], tally: Tally | None) -> np.ndarray:
        """An operation on float32 carriers; the result is a float32 carrier (see the module notes)."""
        if not self.counting:
            tally = None
        if self.binary32:
            a32 = [_exact_f32(a) for a in args]
            if all(a is not None for a in a32):
                with np.errstate(all="ignore"):
                    r = f(*a32)
                    # a sum of finite values is finite or +-inf; NaN/inf anywhere make it non-finite
                    if r.size == 0 or np.isfinite(np.sum(r)):
                        if tally is not None and f in (np.multiply, np.divide) and (r == 0).any():
                            # a zero product/quotient of nonzero finite operands is an underflow
                            a, b = a32
                            under = (r == 0) & (a != 0) & (b != 0 if f is np.multiply else np.isfinite(b))
                            tally.add("underflow", np.broadcast_to(under, r.shape))
                        return r
        with np.errstate(all="ignore"):
            wide = f(*(np.asarray(a, dtype=np.float64) for a in args))
        return self.round(wide, tally).astype(np.float32)

    def add(self, a: np.ndarray, b: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        return self.apply(np.add, a, b, tally=tally)

    def sub(self, a: np.ndarray, b: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        return self.apply(np.subtract, a, b, tally=tally)

    def mul(self, a: np.ndarray, b: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        return self.apply(np.multiply, a, b, tally=tally)

    def div(self, a: np.ndarray, b: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        return self.apply(np.divide, a, b, tally=tally)

    def sqrt(self, a: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        return self.apply(np.sqrt, a, tally=tally)

    def fma(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, tally: Tally | None = None) -> np.ndarray:
        """a*b + c with one rounding (exact for formats up to fp32)."""
        return self.round(fma_wide(a, b, c, native=self.native), tally)


def fma_wide(a: np.ndarray, b: np.ndarray, c: np.ndarray, *, native: bool = False) -> np.ndarray:
    """a*b + c as a float64 that rounds correctly to any format of precision <= 51.

    The product of two operands of at most 26 significant bits is exact in
    float64; TwoSum gives the sum and its exact error; when the sum is inexact
    it is replaced by its round-to-odd neighbour, which preserves the rounding
    direction for every narrower format.
    """
    with np.errstate(all="ignore"):
        a, b, c = (np.asarray(t, dtype=np.float64) for t in (a, b, c))
        p = a * b
        s = p + c
        if native:
            return s
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        finite = np.isfinite(s) & np.isfinite(err)
        bits = s.view(np.uint64) if s.ndim else np.asarray(s).reshape(1).view(np.uint64)
        even = (bits.reshape(s.shape) & np.uint64(1)) == 0
        fix = finite & (err != 0) & even
        if np.any(fix):
            s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s


def _binary(name: str, f: Callable[[Arith], Callable[..., np.ndarray]]) -> Callable[..., np.ndarray]:
    def op(*args: np.ndarray, fmt: str | Format, rounding: str = "nearest_even", overflow: str = "ieee",
           subnormals: str = "keep", rng: np.random.Generator | None = None) -> np.ndarray:
        ar = Arith(fmt, RoundingSpec(rounding, overflow, subnormals), rng)
        for t in args:
            t = np.asarray(t, dtype=np.float64)
            with np.errstate(invalid="ignore"):
                if not ar.native and np.any(ar.round(t)[np.isfinite(t)] != t[np.isfinite(t)]):
                    raise BNProbeError(f"{name}: operands must already be {ar.fmt.name} values (round them first)")
        return f(ar)(*args)

    op.__name__ = name
    op.__doc__ = (f"{name} of values of ``fmt``, formed exactly and rounded once "
                  "(keyword-only rounding / overflow / subnormals as in ``round_to``).")
    return op


add = _binary("add", lambda a: a.add)
sub = _binary("sub", lambda a: a.sub)
mul = _binary("mul", lambda a: a.mul)
div = _binary("div", lambda a: a.div)
sqrt = _binary("sqrt", lambda a: a.sqrt)
fma = _binary("fma", lambda a: a.fma)

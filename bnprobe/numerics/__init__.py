"""Numerics in an emulated format, every operation rounded once: rounding to a format (:mod:`.rounding`), arithmetic
(:mod:`.arith`), sums in an explicit accumulator and order (:mod:`.reduce`), the variance algorithms
(:mod:`.variance`, torch.compile's Welford in :mod:`.inductor`), PyTorch CPU's row kernels (:mod:`.rowwise`) and
rsqrt / reciprocal / Newton as accelerators compute them (:mod:`.rsqrt`)."""

"""The compiled route in one place: numba kernels that take arrays, imported only when a large call runs.

:mod:`.jit` (whether and how to compile), :mod:`.bits` (passes over the bits of fp16/bf16/fp32 data), the kernels'
passes (:mod:`.kernels` chooses, :mod:`.fast` and :mod:`.general` compute, :mod:`.codes` names the policies'
choices, :mod:`.profile` the monitor's one-pass profile), LayerNorm's and RMSNorm's passes (:mod:`.family`) and
the judge's passes (:mod:`.rules`).  Nothing here imports another bnprobe package: what runs compiled is chosen
above and handed arrays."""

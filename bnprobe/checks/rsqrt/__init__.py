"""rsqrt: what a hardware rsqrt / reciprocal costs, in ULPs over every value of a format (:mod:`.mathfn`)."""

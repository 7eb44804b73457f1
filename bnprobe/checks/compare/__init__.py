"""compare-precision: every output of a kernel against the FP64 golden, per format (:mod:`.precision`)."""

"""plot-stats: divergence, collapse and wrong momentum in the statistics over training (:mod:`.stats`)."""

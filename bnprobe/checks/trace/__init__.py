"""trace: one run's every stage against the golden (:mod:`.stages`)."""

"""shrink: a failing input reduced to a minimal one (:mod:`.shrinking`)."""

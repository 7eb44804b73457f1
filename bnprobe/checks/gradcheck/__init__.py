"""gradcheck: a backward against finite differences and the golden, and candidate formulas (:mod:`.gradients`)."""

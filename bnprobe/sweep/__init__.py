"""Sweeps: a check over every BatchNorm call of every step and rank of a dump root, one task per call: the tasks,
their rows and the ways to run them (:mod:`.tasks`), and a command's sweep from its options to its result
(:mod:`.command`)."""

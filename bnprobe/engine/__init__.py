"""What every check runs on: the call's inputs (:mod:`.cases`, :mod:`.recorded`), one engine that runs a kernel
and the FP64 golden (:mod:`.run`), one judge (:mod:`.rules`, its general rules of closeness in :mod:`.closeness`,
with :mod:`.metrics` and the error budget in :mod:`.budget`), the named recipes failures are explained by
(:mod:`.recipes`) and what every check's result answers, its verdict and the result protocol (:mod:`.result`)."""

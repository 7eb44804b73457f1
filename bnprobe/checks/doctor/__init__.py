"""doctor: the expert's checklist for a kernel (:mod:`.diagnosis`: the kernel run on each input, and a dump's
calls), its inputs (:mod:`.inputs`), the judgement of each group of outputs and the checklist's items
(:mod:`.items`), what it returns (:mod:`.report`) and the bug models it names failures by (:mod:`.bugs`)."""

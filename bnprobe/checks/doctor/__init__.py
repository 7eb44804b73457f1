"""doctor: the expert's checklist for a kernel (:mod:`.diagnosis`) and the bug models it names failures by
(:mod:`.bugs`)."""

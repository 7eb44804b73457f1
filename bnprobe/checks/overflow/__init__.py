"""overflow: where, in which channel and why a run goes non-finite: the scan (:mod:`.scan`), the stages traced
(:mod:`.trace`), the outputs observed (:mod:`.outputs`, :mod:`.observe`) and the findings (:mod:`.report`)."""

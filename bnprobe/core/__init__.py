"""The vocabulary every layer shares: the call (:mod:`.call`), the formats (:mod:`.formats`), the frameworks'
conventions (:mod:`.conventions`), the tolerances (:mod:`.tolerances`), what a kernel saves and can do
(:mod:`.kernel`) and the error bnprobe raises (:mod:`.errors`).  It imports no other floor but the compiled
route's, below it."""

"""The vocabulary every layer shares: the call (:mod:`.call`), the formats (:mod:`.formats`), the frameworks'
conventions (:mod:`.conventions`), the tolerances (:mod:`.tolerances`), what a kernel saves and can do
(:mod:`.kernel`) and the error bnprobe raises (:mod:`.errors`).  Imports nothing above it but the compiled route."""

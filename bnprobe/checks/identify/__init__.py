"""identify: the policy that reproduces a black-box kernel bit for bit (:mod:`.search`), its probes
(:mod:`.probes`), its space stage by stage (:mod:`.space`) and what it returns (:mod:`.results`)."""

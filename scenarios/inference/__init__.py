"""The inference (KV-cache decode) scenario (:mod:`.scenario`), its model (:mod:`.model`) and strategies
(:mod:`.strategies`)."""

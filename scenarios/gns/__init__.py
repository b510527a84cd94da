"""The graph network simulator scenario (:mod:`.scenario`) and its model (:mod:`.model`)."""

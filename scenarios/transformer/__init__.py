"""The transformer training scenario (:mod:`.scenario`), its model (:mod:`.model`) and attention
kernels (:mod:`.attention`)."""

"""``partir-emu study``: hardware-modelling sweeps: the grid (:mod:`.space`), what-if spec edits
(:mod:`.whatif`), pricing with shared lowering and caches (:mod:`.evaluate`) and the outputs
(:mod:`.output`)."""

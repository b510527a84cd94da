"""Lowering a sharded program to the per-device SPMD program with explicit collectives
(:mod:`.lower`), loops without unrolling (:mod:`.loops`), halo exchanges (:mod:`.halo`), row lookups
into tiled dims (:mod:`.indexed`) and the casts moved before gathers (:mod:`.gathers`)."""

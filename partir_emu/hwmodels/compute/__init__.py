"""What a device spends computing: per-equation FLOP and byte costs (:mod:`.costs`), whole-program
costs (:mod:`.program`), achieved efficiency (:mod:`.efficiency`), fusion into kernels
(:mod:`.fusion`) and memory (:mod:`.memory`)."""

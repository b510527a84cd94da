"""What runs inside an MPI rank: the job loop (:mod:`.worker`), the emulated devices of this rank
(:mod:`.mesh`), collectives executed with real messages (:mod:`.collectives`: our schedules step by
step in :mod:`.steps`, MPI's own in :mod:`.native`) and timed waits (:mod:`.wait`). Imports mpi4py,
never jax."""

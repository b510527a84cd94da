"""The processes of one MPI launch, seen from outside them: the process table (:mod:`.table`),
supervision of mpiexec with a deadline and clean stop (:mod:`.supervise`), the per-host sentinel
that stops ranks whose launcher is gone (:mod:`.sentinel`) and the watcher that cleans up after a
SIGKILLed launcher (:mod:`.reaper`). Standard library only: none of it imports mpi4py or jax."""

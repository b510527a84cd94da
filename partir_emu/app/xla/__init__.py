"""XLA as the independent reference: our SPMD program vs XLA's own partitioning of the same shardings
(:mod:`.compare`), run in a child process (:mod:`.child`) that reads XLA's HLO (:mod:`.hlo`)."""

"""The step's timeline: compute and communication streams, prefetch and overlap (:mod:`.overlap`),
and the issue rule on one or several communication streams sharing links (:mod:`.issue`)."""

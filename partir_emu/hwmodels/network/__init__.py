"""Pricing collectives on a network: the closed-form cost of one schedule (:mod:`.comm`), the choice
of algorithm (:mod:`.choice`), contention between groups (:mod:`.contention`) and between
collectives in flight together (:mod:`.concurrency`), and steps that do not run in lock-step
(:mod:`.async_steps`)."""

"""Automatic partitioning: the tactic (:mod:`.tactic`), its search space (:mod:`.space`) and the
budgeted search over it (:mod:`.search`)."""

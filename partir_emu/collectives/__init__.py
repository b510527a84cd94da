"""Collective algorithms written once, as schedules (plain data), and their executors.

- ``schedule`` / ``transfers``: a :class:`CollectiveSchedule` is steps of point-to-point transfers
  (kept as flat arrays for built schedules);
- ``patterns`` / ``algorithms`` (with ``alg_torus``, ``alg_gpu``): every algorithm (ring,
  bidirectional ring, recursive, torus, hierarchical, multidim torus, double binary tree, rail) as a
  schedule, built by :func:`build_schedule`;
- ``semantics``: the numpy meaning of each collective (the reference);
- ``workspace`` / ``planner``: the work-buffer layout and the step plan both executors run;
- ``local``: the in-process executor; ``mpi`` (imported on demand: it needs mpi4py), with
  ``mpi_steps``, ``mpi_native`` and ``mpi_wait``: the MPI executor.

The same schedule is run by both executors, priced by the analytical model and replayed by the DES.
"""
from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule, default_algorithm
from partir_emu.collectives.schedule import CollectiveSchedule, Message, Step, Transfer, validate_schedule

__all__ = ["ALGORITHMS", "build_schedule", "default_algorithm", "CollectiveSchedule", "Message", "Step",
           "Transfer", "validate_schedule"]

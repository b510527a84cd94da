"""Collective algorithms written once, as schedules (plain data), and their executors.

The same :class:`~partir_emu.collectives.schedule.CollectiveSchedule` is run by the
in-process executor (``local``), by the MPI executor (``mpi``, imported on
demand: it needs mpi4py), priced by the analytical model and replayed by the DES.
"""
from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule, default_algorithm
from partir_emu.collectives.schedule import CollectiveSchedule, Message, Step, Transfer, validate_schedule

__all__ = ["ALGORITHMS", "build_schedule", "default_algorithm", "CollectiveSchedule", "Message", "Step",
           "Transfer", "validate_schedule"]

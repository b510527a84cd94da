"""partir_emu: a PartIR-style partitioning compiler, an MPI-emulated mesh,
an analytical hardware model and a discrete-event validator.

Importing ``partir_emu`` imports nothing else: every name here loads its module on first use
(``jit``, ``trace`` and ``lower_program`` load jax, which MPI ranks and the hardware models never
need), so the command line can take the stop signals before anything heavy is imported
(:mod:`partir_emu.app.cli.entry`). In a rank of a user's ``mpirun`` that imports it before numpy,
it defaults the BLAS thread variables to the rank's share of the host's cores
(:func:`partir_emu.mpi.environ.set_blas_threads`; a value already set is kept), and the host's first
rank starts the watcher that removes MPICH's shm segments after the job (:mod:`partir_emu.mpi.procs.shmwatch`).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from partir_emu.mpi.environ import set_blas_threads, under_mpirun

set_blas_threads()
if under_mpirun():      # a host's first rank, before MPI starts: MPICH's segments go even if the start-up fails
    from partir_emu.mpi.procs.shmwatch import start_if_first_rank
    start_if_first_rank()

if TYPE_CHECKING:
    from partir_emu.api import jit, lower_program, trace
    from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition, ManualPartition
    from partir_emu.compiler.tracing.tag import tag
    from partir_emu.core.mesh import Mesh
    from partir_emu.core.sharding import Sharding
    from partir_emu.errors import PartirError, PartitionWarning
    from partir_emu.interop import from_partition_specs

__version__ = "0.1.0"
__all__ = ["Mesh", "Sharding", "ManualPartition", "AutomaticPartition", "REPLICATED", "PartirError", "PartitionWarning",
           "jit", "trace", "lower_program", "from_partition_specs", "tag", "__version__"]

_HOME = {"Mesh": "partir_emu.core.mesh", "Sharding": "partir_emu.core.sharding",
         "ManualPartition": "partir_emu.compiler.tactics", "AutomaticPartition": "partir_emu.compiler.tactics",
         "REPLICATED": "partir_emu.compiler.tactics", "PartirError": "partir_emu.errors",
         "PartitionWarning": "partir_emu.errors",
         "jit": "partir_emu.api", "trace": "partir_emu.api", "lower_program": "partir_emu.api",
         "from_partition_specs": "partir_emu.interop", "tag": "partir_emu.compiler.tracing.tag"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'partir_emu' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value          # once: later lookups are plain attribute reads
    return value

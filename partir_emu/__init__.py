"""partir_emu: a PartIR-style partitioning compiler, an MPI-emulated mesh,
an analytical hardware model and a discrete-event validator.

Importing ``partir_emu`` does not import jax; ``jit``, ``trace`` and ``lower_program``
(:mod:`partir_emu.api`) load it on first use (MPI ranks and the hardware models never need it).
"""
from __future__ import annotations

from typing import Any

from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition, ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import PartirError

__version__ = "0.1.0"
__all__ = ["Mesh", "Sharding", "ManualPartition", "AutomaticPartition", "REPLICATED", "PartirError", "jit", "trace",
           "lower_program", "from_partition_specs", "__version__"]

_LAZY = ("jit", "trace", "lower_program")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from partir_emu import api  # here, not at the top: partir_emu.api imports jax, MPI ranks must not
        return getattr(api, name)
    if name == "from_partition_specs":
        from partir_emu import interop  # here, not at the top: partir_emu.interop imports jax, MPI ranks must not
        return interop.from_partition_specs
    raise AttributeError(name)

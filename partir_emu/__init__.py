"""partir_emu: a PartIR-style partitioning compiler, an MPI-emulated mesh,
an analytical hardware model and a discrete-event validator.

Importing ``partir_emu`` does not import jax; the compiler entry points load it
lazily (MPI ranks and the hardware models never need it).
"""
from __future__ import annotations

from partir_emu.compiler.auto import AutomaticPartition
from partir_emu.compiler.tactics import REPLICATED, ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import PartirError

__version__ = "0.1.0"
__all__ = ["Mesh", "Sharding", "ManualPartition", "AutomaticPartition", "REPLICATED", "PartirError", "jit", "trace",
           "__version__"]


def __getattr__(name: str):
    if name in ("jit", "trace"):
        from partir_emu.compiler import api
        return getattr(api, name)
    raise AttributeError(name)

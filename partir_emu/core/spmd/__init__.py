"""The lowered per-device program (:mod:`.program`) and its file format (:mod:`.format`).

The names below are the package's public ones: ``from partir_emu.core.spmd import SpmdProgram``.
"""
from __future__ import annotations

from partir_emu.core.spmd.program import (
    COLLECTIVE_PRIMS,
    COMM_PRIMS,
    FORMAT,
    LOCAL_COLLECTIVE_PRIMS,
    READABLE_VERSIONS,
    VERSION,
    CollectiveStats,
    SpmdProgram,
    check_pairs,
    collective_bytes,
    collective_wire_bytes,
    permute_pairs,
    permute_spec,
    shift_pairs,
)

__all__ = ["COLLECTIVE_PRIMS", "COMM_PRIMS", "FORMAT", "LOCAL_COLLECTIVE_PRIMS", "READABLE_VERSIONS", "VERSION",
           "CollectiveStats", "SpmdProgram", "check_pairs", "collective_bytes", "collective_wire_bytes",
           "permute_pairs", "permute_spec", "shift_pairs"]

"""Which collective algorithm the runtime of each fabric uses, and where each schedule position runs.

:func:`choose_algorithm` is the one place that picks an algorithm for a collective over a placed
group; the analytical model prices the schedule it names, the DES replays it, and the executors
run it (:mod:`partir_emu.collectives.algorithms` builds every schedule).
"""
from __future__ import annotations

from dataclasses import dataclass

from partir_emu.collectives.algorithms import ALGORITHMS
from partir_emu.errors import CollectiveError
from partir_emu.hwmodels.placement import GroupLayout
from partir_emu.hwmodels.topology import Topology

__all__ = ["AlgorithmChoice", "choose_algorithm"]


@dataclass(frozen=True)
class AlgorithmChoice:
    """What to build and where: the requested algorithm, the schedule's ``group_shape`` and
    ``devices_per_node``, and the chip of each schedule position."""

    algorithm: str
    group_shape: tuple[int, ...]
    devices_per_node: int | None
    chips: tuple[int, ...]


def choose_algorithm(kind: str, group: GroupLayout, topology: Topology, algorithm: str | None = None
                     ) -> AlgorithmChoice:
    """The algorithm the runtime would use for ``kind`` over ``group`` (or ``algorithm`` if given).

    TPU torus: ``torus`` (dimension by dimension) when the group spans several physical dims,
    ``bidir_ring`` on one dim with wraparound, ``ring`` on an open line. GPU: ``ring`` inside one
    NVSwitch node or with one GPU per node, ``hierarchical`` when the group spans several nodes with
    several GPUs in each (positions ordered by node, as NCCL orders its ranks); all_to_all on GPUs
    posts every pair at once (``direct``)."""
    chips = group.chips
    dpn = None
    shape: tuple[int, ...] = (group.size,)
    if topology.kind == "gpu":
        chips = tuple(sorted(chips, key=lambda c: (topology.node_of(c), c)))
        dpn = group.per_node
        if algorithm is None:
            if kind == "all_to_all" or (group.nodes > 1 and group.per_node > 1):
                algorithm = "hierarchical"
            else:
                algorithm = "ring"
    else:
        if len(group.factors) > 1:
            shape = group.shape
        if algorithm is None:
            if len(group.factors) > 1:
                algorithm = "torus"
            elif group.is_ring and group.size > 2:
                algorithm = "bidir_ring"
            else:
                algorithm = "ring"
        if algorithm == "hierarchical":
            dpn = group.size
    if algorithm not in ALGORITHMS:
        raise CollectiveError(f"unknown collective algorithm {algorithm!r} for {kind}; use one of {ALGORITHMS}")
    return AlgorithmChoice(algorithm, shape, dpn, chips)


def candidates(kind: str, group: GroupLayout, topology: Topology, algorithm: str | None = None
               ) -> list[AlgorithmChoice]:
    """The algorithms the runtime could use for ``kind`` over ``group``; the caller
    (:meth:`~partir_emu.hwmodels.comm.CommModel.schedule`) prices each on the placement and keeps the
    cheapest (ties: the first). A requested ``algorithm`` is the only candidate."""
    return [choose_algorithm(kind, group, topology, algorithm)]

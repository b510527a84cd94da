"""Which collective algorithm the runtime of each fabric uses, and where each schedule position runs.

:func:`candidates` lists the algorithms the runtime could use for a collective over a placed group
(:func:`choose_algorithm` builds each: its group shape, nodes and chip order; the first is the
fabric's usual default). The analytical model keeps the cheapest candidate's schedule (pricing every
candidate that can still win, :mod:`.comm`), the DES replays that schedule, and the executors run it
(:mod:`partir_emu.collectives.algorithms` builds every schedule).
"""
from __future__ import annotations

from dataclasses import dataclass

from partir_emu.collectives.algorithms import ALGORITHMS, NODE_ALGORITHMS
from partir_emu.errors import CollectiveError
from partir_emu.hwmodels.machine.placement import GroupLayout
from partir_emu.hwmodels.machine.topology import Topology

__all__ = ["AlgorithmChoice", "TREE_ACROSS_NODES_MAX_BYTES", "candidates", "candidate_names", "choose_algorithm"]

TREE_ACROSS_NODES_MAX_BYTES = 8 << 20
"""Largest all-reduce the ``tree`` is a default candidate for across nodes: up to 4 pipeline segments
per half, where its price is within 5 % of the DES (2-64 H100 nodes, ``benchmarks/tree_gpu.py``).
With more segments the price falls below the DES (-6 % at 16 MiB, -10 % at 32 MiB on 8 nodes): the
members' critical path misses part of how the steps of many segments overlap on the NICs."""


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
        if algorithm in NODE_ALGORITHMS:
            dpn = group.size
    if algorithm not in ALGORITHMS:
        raise CollectiveError(f"unknown collective algorithm {algorithm!r} for {kind}; use one of {ALGORITHMS}")
    return AlgorithmChoice(algorithm, shape, dpn, chips)


def candidates(kind: str, group: GroupLayout, topology: Topology, algorithm: str | None = None,
               nbytes: int | None = None) -> list[AlgorithmChoice]:
    """The algorithms the runtime could use for ``kind`` over ``group``; the caller
    (:meth:`~partir_emu.hwmodels.network.comm.CommModel.schedule`) keeps the cheapest on the placement
    (ties: the first, :func:`choose_algorithm`'s default; one that surely costs more is not priced). A requested ``algorithm`` is the
    only candidate. The names are :func:`candidate_names` (``nbytes``: the collective's size, if known)."""
    if algorithm is not None:
        return [choose_algorithm(kind, group, topology, algorithm)]
    return [choose_algorithm(kind, group, topology, a) for a in candidate_names(kind, group, topology, nbytes)]


def candidate_names(kind: str, group: GroupLayout, topology: Topology, nbytes: int | None = None) -> list[str]:
    """The algorithm names :func:`candidates` offers, the default first.

    - TPU torus, group over several physical dims: ``torus`` (one dim at a time) and ``multidim``
      (every dim at once, the data split across them). One dim: the default only (``bidir_ring``
      on a wrapped dim, ``ring`` on an open line).
    - GPU all_reduce: also NCCL's double binary ``tree`` (``2 log2 p`` steps against the ring's
      ``2(p-1)``), inside a node and across nodes. It wins at small sizes: inside a node below about
      2.5 MiB; across nodes with one GPU each (a data-parallel axis) from 4 nodes on, below 256 KiB
      at 8 nodes to a few MiB at 64 (``benchmarks/tree_gpu.py``). Its steps are uneven (some edges
      cross the spine, a parent's NIC serves two children, pipelined segments merge into one
      message), so members run ahead of one another; the price is their asynchronous critical path
      (:mod:`.async_steps`), within 5 % of the DES on 2-64 nodes from 4 KiB to 8 MiB; across nodes
      it is offered up to :data:`TREE_ACROSS_NODES_MAX_BYTES` (any size when ``nbytes`` is None).
    - GPU group over several nodes with several GPUs in each: ``hierarchical`` and ``rail``. A flat
      ring is not offered there: it sends ``d`` times more bytes over each NIC than the
      hierarchical forms (and would be expensive to price at thousands of GPUs).
    - all_to_all and collective_permute: the default only.
    """
    first = choose_algorithm(kind, group, topology).algorithm
    if kind in ("all_to_all", "collective_permute"):
        return [first]
    names = [first]
    if topology.kind == "gpu":
        if first == "hierarchical":
            names.append("rail")
        if kind == "all_reduce" and (group.nodes == 1 or nbytes is None or nbytes <= TREE_ACROSS_NODES_MAX_BYTES):
            names.append("tree")
    elif first == "torus":
        names.append("multidim")
    return names

"""Collective costs: a collective's schedule priced on the placed topology.

The algorithm is written once as a schedule (:mod:`partir_emu.collectives.algorithms`);
here every step of it is priced with an alpha–beta model on the links its
messages cross:

- a message (the transfers of one step between one ``(src, dst)`` pair) takes
  ``sum of link latencies along its route + nbytes / bottleneck bandwidth``,
  where a link crossed by ``k`` messages of the same step gives each ``bw / k``
  (links are directed: the two directions of a cable do not share);
- a step takes as long as its slowest message; a collective is the sum of its steps.

A collective_permute is one step in which every source sends its whole block to its target
(its ``perm``, :func:`~partir_emu.core.spmd.permute_spec`, names the pairs): ``alpha + bytes / bw``
over each message's route, shared where messages cross one link.

All groups of one collective have the same shape, so one representative group
(the one holding device 0) is priced. Contention *between* the concurrent groups
of a collective is modelled only by the DES.

A :class:`CommModel` remembers the prices it computed; give several of them one
:class:`PriceCache` (as :class:`~partir_emu.hwmodels.analytical.Analyzer` does) to keep
the prices between evaluations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.core.ir import itemsize as dtype_itemsize
from partir_emu.core.spmd import permute_pairs
from partir_emu.errors import CollectiveError
from partir_emu.hwmodels.placement import GroupLayout, Placement
from partir_emu.hwmodels.topology import Topology


@dataclass(frozen=True)
class AlgorithmChoice:
    """What to build and where: the requested algorithm, the schedule's ``group_shape`` and
    ``devices_per_node``, and the chip of each schedule position."""

    algorithm: str
    group_shape: tuple[int, ...]
    devices_per_node: int | None
    chips: tuple[int, ...]


@dataclass(frozen=True)
class CollectiveCost:
    kind: str
    algorithm: str            # as built (after the schedule's own fallbacks)
    group_size: int
    nbytes: int
    time_s: float
    steps: int
    messages: int
    max_hops: int


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


def price_schedule(sched: CollectiveSchedule, chips: tuple[int, ...], topology: Topology) -> float:
    """Seconds the schedule takes with position ``i`` on chip ``chips[i]`` (alpha–beta per step)."""
    return _price(sched, chips, topology)[0]


def _price(sched: CollectiveSchedule, chips: tuple[int, ...], topology: Topology) -> tuple[float, int, int]:
    route = topology.route_tuple
    total = 0.0
    nmsg = 0
    max_hops = 0
    for msgs in sched.messages():
        routes = [route(chips[m.src], chips[m.dst]) for m in msgs]
        load: dict[int, int] = {}
        for r in routes:
            for lk in r:
                load[lk.id] = load.get(lk.id, 0) + 1
        step = 0.0
        for m, r in zip(msgs, routes):
            if not r:
                continue
            bw = min(lk.bw_bytes_per_s / load[lk.id] for lk in r)
            t = sum(lk.latency_s for lk in r) + m.nbytes / bw
            step = max(step, t)
            max_hops = max(max_hops, len(r))
        nmsg += len(msgs)
        total += step
    return total, nmsg, max_hops


class PriceCache:
    """Collective prices kept between evaluations: per placement (by its hashable ``Placement.key``:
    topology, mesh and factors), the cost of each (kind, axes, nbytes, dtype, requested algorithm).

    At most ``max_placements`` placements are kept; past that the cache starts afresh (a search over
    placements would otherwise grow it without bound)."""

    def __init__(self, max_placements: int = 64) -> None:
        self.max_placements = max_placements
        self._by_placement: dict[tuple, dict[tuple, CollectiveCost]] = {}

    def for_placement(self, key: tuple) -> dict[tuple, CollectiveCost]:
        """The (mutable) table of prices on the placement with ``key``."""
        table = self._by_placement.get(key)
        if table is None:
            if len(self._by_placement) >= self.max_placements:
                self._by_placement.clear()
            table = self._by_placement[key] = {}
        return table

    def clear(self) -> None:
        self._by_placement.clear()


class CommModel:
    """Prices collectives over mesh axes on one placement; remembers each price by
    (kind, axes, nbytes, dtype, algorithm, perm), in ``prices`` when given (shared between models).
    ``perm`` is a collective_permute's :func:`~partir_emu.core.spmd.permute_spec` (None for the others)."""

    def __init__(self, placement: Placement, algorithms: str | dict[str, str] | None = None,
                 prices: PriceCache | None = None) -> None:
        self.placement = placement
        self.algorithms = algorithms
        self._cache = (prices if prices is not None else PriceCache()).for_placement(placement.key)

    def requested(self, kind: str) -> str | None:
        a = self.algorithms
        return a.get(kind) if isinstance(a, dict) else a

    def cost(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str = "float32",
             perm: tuple | None = None) -> CollectiveCost:
        requested = self.requested(kind)
        key = (kind, axes, nbytes, dtype, requested, perm)
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = self._compute(kind, axes, nbytes, dtype, perm)
        return c

    def schedule(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str = "float32",
                 perm: tuple | None = None) -> tuple[AlgorithmChoice, CollectiveSchedule] | None:
        """The algorithm choice and schedule this model prices for one collective (``None``: no traffic).
        The DES replays exactly this schedule on every group."""
        group = self.placement.group(axes)
        if group.size == 1 or nbytes == 0:
            return None
        choice = choose_algorithm(kind, group, self.placement.topology, self.requested(kind))
        isz = dtype_itemsize(dtype)
        if nbytes % isz:
            isz = math.gcd(nbytes, isz)
        pairs = None
        if kind == "collective_permute":
            # pairs name group positions; the schedule's positions follow choice.chips (GPU: by node)
            at = {c: i for i, c in enumerate(choice.chips)}
            pairs = tuple((at[group.chips[s]], at[group.chips[d]]) for s, d in permute_pairs(dict(perm or ()), group.size))
        sched = build_schedule(kind, choice.group_shape, nbytes, choice.algorithm, itemsize=isz,
                               devices_per_node=choice.devices_per_node, permutation=pairs)
        return choice, sched

    def _compute(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str,
                 perm: tuple | None) -> CollectiveCost:
        built = self.schedule(kind, axes, nbytes, dtype, perm)
        if built is None:
            return CollectiveCost(kind, "none", self.placement.group(axes).size, nbytes, 0.0, 0, 0, 0)
        choice, sched = built
        t, nmsg, hops = _price(sched, choice.chips, self.placement.topology)
        return CollectiveCost(kind, sched.algorithm, len(choice.chips), nbytes, t, sched.num_steps, nmsg, hops)

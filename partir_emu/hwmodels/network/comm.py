"""Collective costs: a collective's schedule priced on the placed topology.

The algorithm is written once as a schedule (:mod:`partir_emu.collectives.algorithms`);
here every step of it is priced with an alpha–beta model on the links its
messages cross:

- a message (the transfers of one step between one ``(src, dst)`` pair) takes
  ``sum of link latencies along its route + nbytes / bottleneck bandwidth``,
  where a link crossed by ``k`` messages of the same step gives each ``bw / k``
  (links are directed: the two directions of a cable do not share);
- a step takes as long as its slowest message; a collective is the sum of its steps.

Every group of the collective runs the schedule at once (as in the DES), so the ``k`` messages of a
step on a link are counted over *all* groups (:mod:`.contention`): two groups whose rings share a
torus dimension each get half of its links. Faults (``link_factors``: degraded links at a fraction
of their bandwidth, failed links routed around, :mod:`partir_emu.hwmodels.machine.links`) change the routes and bandwidths.

A collective_permute is one step in which every source sends its whole block to its target
(its ``perm``, :func:`~partir_emu.core.spmd.permute_spec`, names the pairs): ``alpha + bytes / bw``
over each message's route, shared where messages cross one link.

The runtime's algorithm is the cheapest of its candidates (:mod:`.choice`). A candidate whose members
drift apart is priced by their asynchronous critical path (:mod:`.async_steps`), the costly part; it is
left unpriced when a lower bound from its lock-step pass (:meth:`.contention.Fabric.lockstep`) is above
the cheapest price found (:data:`SKIP_REL`): the choice and its price are those of pricing every candidate.

A :class:`CommModel` remembers the prices it computed; give several of them one
:class:`PriceCache` (as :class:`~partir_emu.hwmodels.analytical.Analyzer` does) to keep
the prices between evaluations.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.core.ir import itemsize as dtype_itemsize
from partir_emu.core.spmd import permute_pairs
from partir_emu.hwmodels.machine.links import Router
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.slices import SLICE_DIM
from partir_emu.hwmodels.machine.topology import Topology
from partir_emu.hwmodels.network.choice import AlgorithmChoice, candidates
from partir_emu.hwmodels.network.contention import Fabric

SKIP_REL = 1e-9
"""A candidate algorithm is left unpriced when its lower bound is above the cheapest price found by more
than this (relative): far beyond rounding, so the choice is exactly the one pricing every candidate makes."""


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


def price_schedule(sched: CollectiveSchedule, chips: tuple[int, ...], topology: Topology) -> float:
    """Seconds the schedule takes run by ONE group, position ``i`` on chip ``chips[i]`` (alpha–beta per
    step, links shared only between this group's messages; no faults)."""
    return Fabric(topology).price(sched, 0, np.array([chips], dtype=np.int64))[0]


class PriceCache:
    """Collective prices kept between evaluations: per placement and faults (the hashable
    ``Placement.key``: topology, mesh and factors, plus the link factors of any faults), the cost of
    each (kind, axes, nbytes, dtype, requested algorithm, perm), and the :class:`~.contention.Fabric`
    (routes, step patterns) they were priced on.

    At most ``max_placements`` placements are kept; past that the cache starts afresh (a search over
    placements would otherwise grow it without bound)."""

    def __init__(self, max_placements: int = 64) -> None:
        self.max_placements = max_placements
        self._by_placement: dict[tuple, dict[tuple, CollectiveCost]] = {}
        self._schedules: dict[tuple, dict[tuple, tuple[AlgorithmChoice, CollectiveSchedule] | None]] = {}
        self._firsts: dict[tuple, dict[tuple, tuple]] = {}
        self._fabrics: dict[tuple, Fabric] = {}
        self._routers: dict[tuple, Router] = {}

    def fabric(self, key: tuple, placement: Placement, link_factors: Mapping[int, float]) -> Fabric:
        """The fabric of the placement with ``key`` (made once); placements on one topology with the same
        faults share its :class:`~partir_emu.hwmodels.machine.links.Router` (and the routes it has found)."""
        fab = self._fabrics.get(key)
        if fab is None:
            if len(self._fabrics) >= self.max_placements:
                self._fabrics.clear()
                self._routers.clear()
            topo = placement.topology
            rkey = (topo.key, tuple(sorted(link_factors.items())))
            router = self._routers.get(rkey)
            if router is None:
                router = self._routers[rkey] = Router(topo, link_factors)
            fab = self._fabrics[key] = Fabric(topo, link_factors, placement, router)
        return fab

    def _table(self, store: dict[tuple, dict], key: tuple) -> dict:
        """``store[key]``, made empty when new; the store starts afresh past ``max_placements``."""
        table = store.get(key)
        if table is None:
            if len(store) >= self.max_placements:
                store.clear()
            table = store[key] = {}
        return table

    def for_placement(self, key: tuple) -> dict[tuple, CollectiveCost]:
        """The (mutable) table of prices on the placement with ``key``."""
        return self._table(self._by_placement, key)

    def schedules(self, key: tuple) -> dict[tuple, tuple[AlgorithmChoice, CollectiveSchedule] | None]:
        """The (mutable) table of chosen schedules on the placement with ``key``: choosing one builds every
        candidate and prices those that can win, and the DES asks again for the schedule the analytical
        model priced."""
        return self._table(self._schedules, key)

    def firsts(self, key: tuple) -> dict[tuple, tuple]:
        """The (mutable) table of candidates and their lock-step passes (:meth:`CommModel.floor`) on the
        placement with ``key``, until a choice among them is made (:meth:`schedules`)."""
        return self._table(self._firsts, key)

    def clear(self) -> None:
        self._by_placement.clear()
        self._schedules.clear()
        self._firsts.clear()
        self._fabrics.clear()
        self._routers.clear()


class CommModel:
    """Prices collectives over mesh axes on one placement; remembers each price by
    (kind, axes, nbytes, dtype, algorithm, perm), in ``prices`` when given (shared between models).
    ``perm`` is a collective_permute's :func:`~partir_emu.core.spmd.permute_spec` (None for the others).
    ``link_factors``: ``{link id: bandwidth factor}`` of faulty links (0 = failed;
    :func:`~partir_emu.hwmodels.machine.links.link_factors` builds it from link names); the prices are kept apart per faults."""

    def __init__(self, placement: Placement, algorithms: str | dict[str, str] | None = None,
                 prices: PriceCache | None = None, link_factors: Mapping[int, float] | None = None) -> None:
        self.placement = placement
        self.algorithms = algorithms
        self.link_factors = dict(link_factors or {})
        cache = prices if prices is not None else PriceCache()
        key = placement.key
        if self.link_factors:
            key = (*key, ("faults", tuple(sorted(self.link_factors.items()))))
        self._cache = cache.for_placement(key)
        self._built = cache.schedules(key)
        self._firsts = cache.firsts(key)
        # the chosen candidate's price, from choosing it to costing it (a schedule chosen by another
        # model on this placement is priced again: the price itself is then kept in ``_cache``)
        self._priced: dict[tuple, tuple[float, int, int] | None] = {}
        self.fabric = cache.fabric(key, placement, self.link_factors)

    @property
    def link_bw(self) -> np.ndarray:
        """Effective bandwidth of each directed link id, bytes/s (degraded factors applied, failed 0)."""
        return self.fabric.link_bw

    def link_bytes(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str = "float32",
                   perm: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(link ids int64, bytes float64)``: the bytes this collective moves over each directed link,
        summed over all its steps and all its groups, on the routes it is priced on (faults included).
        Links it does not use are left out. Kept per collective (the arrays are shared: do not modify)."""
        key = (kind, axes, nbytes, dtype, self.requested(kind), perm)
        hit = self.fabric.link_bytes_cache.get(key)
        if hit is None:
            built = self.schedule(kind, axes, nbytes, dtype, perm)
            if built is None:
                hit = (np.zeros(0, np.int64), np.zeros(0))
            else:
                choice, sched = built
                hit = self.fabric.link_bytes(sched, *self.fabric.groups(axes, choice.chips))
            self.fabric.link_bytes_cache[key] = hit
        return hit

    def blocks_compute(self, axes: tuple[str, ...]) -> bool:
        """Does a collective over ``axes`` block the compute stream? Yes when its groups cross TPU slices
        and the spec says DCN collectives do not overlap compute (``[dcn] overlaps_compute = false``)."""
        topo = self.placement.topology
        if getattr(topo, "dcn_overlaps_compute", True):
            return False
        return SLICE_DIM in self.placement.group(axes).dim_names

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
        The DES replays exactly this schedule on every group (kept: it is not chosen twice)."""
        key = (kind, axes, nbytes, dtype, self.requested(kind), perm)
        if key not in self._built:
            self._built[key] = self._choose(kind, axes, nbytes, dtype, perm)
        return self._built[key]

    def floor(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str = "float32",
              perm: tuple | None = None) -> float:
        """A lower bound of ``cost(...).time_s`` for the price of one lock-step pass over each candidate's
        steps (:meth:`.contention.Fabric.lockstep`; kept: :meth:`cost` continues from it): the price when
        it is known, else the least of the candidates' lock-step sums (members in step) and floors
        (members drifting apart, whose asynchronous critical path is the costly part)."""
        key = (kind, axes, nbytes, dtype, self.requested(kind), perm)
        c = self._cache.get(key)
        if c is not None:
            return c.time_s
        if key in self._built:                              # chosen already (by a DES, say): price it
            return self.cost(kind, axes, nbytes, dtype, perm).time_s
        hit = self._firsts.get(key)
        if hit is None:
            built = self._candidates(kind, axes, nbytes, dtype, perm)
            hit = self._firsts[key] = (built, self._lockstep(axes, built) if built else None)
        firsts = hit[1]
        return min(f.floor if f.uneven else f.seconds for f in firsts) if firsts else 0.0

    def _lockstep(self, axes: tuple[str, ...], built: list[tuple[AlgorithmChoice, CollectiveSchedule]]) -> list:
        fab = self.fabric
        return [fab.lockstep(sched, *fab.groups(axes, choice.chips), floor=True) for choice, sched in built]

    def _candidates(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str, perm: tuple | None
                    ) -> list[tuple[AlgorithmChoice, CollectiveSchedule]] | None:
        """Each candidate algorithm with its schedule (None: no traffic)."""
        group = self.placement.group(axes)
        if group.size == 1 or nbytes == 0:
            return None
        isz = dtype_itemsize(dtype)
        if nbytes % isz:
            isz = math.gcd(nbytes, isz)
        built = []
        for choice in candidates(kind, group, self.placement.topology, self.requested(kind), nbytes):
            pairs = None
            if kind == "collective_permute":
                # pairs name group positions; the schedule's positions follow choice.chips (GPU: by node)
                at = {c: i for i, c in enumerate(choice.chips)}
                pairs = tuple((at[group.chips[s]], at[group.chips[d]])
                              for s, d in permute_pairs(dict(perm or ()), group.size))
            built.append((choice, build_schedule(kind, choice.group_shape, nbytes, choice.algorithm, itemsize=isz,
                                                 devices_per_node=choice.devices_per_node, permutation=pairs)))
        return built

    def _choose(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str, perm: tuple | None
                ) -> tuple[AlgorithmChoice, CollectiveSchedule] | None:
        key = (kind, axes, nbytes, dtype, self.requested(kind), perm)
        hit = self._firsts.pop(key, None)
        built, firsts = hit if hit is not None else (self._candidates(kind, axes, nbytes, dtype, perm), None)
        if not built:
            return None
        if len(built) > 1:
            i, self._priced[key] = self._cheapest(axes, built, firsts)   # _compute takes it: priced once
            return built[i]
        if firsts is not None:                              # its lock-step pass was made for a floor
            choice, sched = built[0]
            self._priced[key] = self.fabric.settle(firsts[0], sched, *self.fabric.groups(axes, choice.chips))
        return built[0]

    def _cheapest(self, axes: tuple[str, ...], built: list[tuple[AlgorithmChoice, CollectiveSchedule]],
                  firsts: list | None = None) -> tuple[int, tuple[float, int, int]]:
        """The index and price of the cheapest candidate (ties: the first), every candidate priced except those
        that surely cost more: a candidate whose members drift apart (priced by the asynchronous critical
        path, the costly part) is skipped when its lower bound (:meth:`.contention.Fabric.lockstep`) is
        above the cheapest price found, beyond :data:`SKIP_REL` (rounding); the choice is the same as
        pricing every candidate's."""
        fab = self.fabric
        firsts = firsts if firsts is not None else self._lockstep(axes, built)
        best = min((f.seconds for f in firsts if not f.uneven), default=math.inf)
        priced: dict[int, tuple[float, int, int]] = {}
        for i in sorted(range(len(built)), key=lambda i: (firsts[i].uneven, firsts[i].floor, i)):
            f = firsts[i]
            if f.uneven and f.floor > best * (1 + SKIP_REL):
                continue
            choice, sched = built[i]
            priced[i] = fab.settle(f, sched, *fab.groups(axes, choice.chips))
            best = min(best, priced[i][0])
        i = min(priced, key=lambda i: (priced[i][0], i))
        return i, priced[i]

    def _compute(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str,
                 perm: tuple | None) -> CollectiveCost:
        built = self.schedule(kind, axes, nbytes, dtype, perm)
        if built is None:
            return CollectiveCost(kind, "none", self.placement.group(axes).size, nbytes, 0.0, 0, 0, 0)
        choice, sched = built
        key = (kind, axes, nbytes, dtype, self.requested(kind), perm)
        priced = self._priced.pop(key, None)
        t, nmsg, hops = priced if priced is not None else self._price(axes, choice, sched)
        return CollectiveCost(kind, sched.algorithm, len(choice.chips), nbytes, t, sched.num_steps, nmsg, hops)

    def _price(self, axes: tuple[str, ...], choice: AlgorithmChoice, sched: CollectiveSchedule
               ) -> tuple[float, int, int]:
        """(seconds, messages of one group, longest route) of ``sched`` run by every group over ``axes``."""
        return self.fabric.price(sched, *self.fabric.groups(axes, choice.chips))

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

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.core.ir import itemsize as dtype_itemsize
from partir_emu.core.spmd import permute_pairs
from partir_emu.hwmodels.algorithm_choice import AlgorithmChoice, candidates
from partir_emu.hwmodels.placement import Placement
from partir_emu.hwmodels.topology import Topology


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
        isz = dtype_itemsize(dtype)
        if nbytes % isz:
            isz = math.gcd(nbytes, isz)
        best: tuple[float, AlgorithmChoice, CollectiveSchedule] | None = None
        options = candidates(kind, group, self.placement.topology, self.requested(kind))
        for choice in options:
            pairs = None
            if kind == "collective_permute":
                # pairs name group positions; the schedule's positions follow choice.chips (GPU: by node)
                at = {c: i for i, c in enumerate(choice.chips)}
                pairs = tuple((at[group.chips[s]], at[group.chips[d]])
                              for s, d in permute_pairs(dict(perm or ()), group.size))
            sched = build_schedule(kind, choice.group_shape, nbytes, choice.algorithm, itemsize=isz,
                                   devices_per_node=choice.devices_per_node, permutation=pairs)
            t = _price(sched, choice.chips, self.placement.topology)[0] if len(options) > 1 else 0.0
            if best is None or t < best[0]:
                best = (t, choice, sched)
        assert best is not None
        return best[1], best[2]

    def _compute(self, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str,
                 perm: tuple | None) -> CollectiveCost:
        built = self.schedule(kind, axes, nbytes, dtype, perm)
        if built is None:
            return CollectiveCost(kind, "none", self.placement.group(axes).size, nbytes, 0.0, 0, 0, 0)
        choice, sched = built
        t, nmsg, hops = _price(sched, choice.chips, self.placement.topology)
        return CollectiveCost(kind, sched.algorithm, len(choice.chips), nbytes, t, sched.num_steps, nmsg, hops)

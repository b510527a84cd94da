"""Route patterns for the DES: batches of routes over the shared :class:`~partir_emu.hwmodels.machine.links.Router`.

:class:`RoutePattern` is a batch of routes (one per flow) as a padded ``[flows, hops]`` matrix of
link ids (``-1`` = padding), the form the flow network's max-min solver works on. A
:class:`FlowRouter` here is the hardware models' router (degraded and failed links,
:mod:`partir_emu.hwmodels.machine.links`) that also builds patterns, cached by their chip pairs, so the route
of a step that repeats (every step of a ring) is built once.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from partir_emu.errors import PartirError
from partir_emu.hwmodels.machine import links as _links
from partir_emu.hwmodels.machine.links import LinkSpecError, link_factors, parse_links
from partir_emu.hwmodels.machine.topology import Topology

__all__ = ["DesError", "FlowClasses", "LinkSpecError", "RoutePattern", "FlowRouter", "SymmetryBroken", "link_factors",
           "parse_links"]


class DesError(PartirError):
    """A bad DES option (straggler, network kind) or an inconsistent run."""


@dataclass(frozen=True)
class RoutePattern:
    """The routes of ``n`` flows: ``links[f]`` lists flow ``f``'s link ids (``-1`` padded)."""

    id: int
    links: np.ndarray          # int32 [n, hops]
    latency_s: np.ndarray      # float64 [n]: sum of the route's link latencies

    @property
    def n(self) -> int:
        return len(self.latency_s)


class SymmetryBroken(Exception):
    """Flows of one class got different rates: the run is redone without flow classes (internal)."""


_class_ids = itertools.count()


@dataclass(frozen=True)
class FlowClasses:
    """The flows of a :class:`RoutePattern` in classes that move alike (same bytes, start, latency, and,
    checked at every rate solve, the same rate): class ``c`` is flows ``flows[ptr[c]:ptr[c+1]]``."""

    flows: np.ndarray          # int64: flow ids, class by class
    ptr: np.ndarray            # int64 [n + 1]
    latency_s: np.ndarray      # float64 [n]: the (common) route latency of each class
    id: int = field(default_factory=lambda: next(_class_ids))
    mult: np.ndarray = field(init=False)      # flows per class

    def __post_init__(self) -> None:
        object.__setattr__(self, "mult", np.diff(self.ptr))

    @property
    def n(self) -> int:
        return len(self.latency_s)

    def expand(self, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(flow ids, flows per class)`` of ``classes``, class after class."""
        lo, mult = self.ptr[classes], self.mult[classes]
        total = int(mult.sum())
        offs = np.repeat(lo - np.concatenate(([0], np.cumsum(mult)[:-1])), mult)
        return self.flows[np.arange(total) + offs], mult


class FlowRouter(_links.Router):
    """The shared router (:class:`partir_emu.hwmodels.machine.links.Router`) that also builds route patterns."""

    def __init__(self, topology: Topology, link_factors: Mapping[int, float] | None = None) -> None:
        super().__init__(topology, link_factors)
        self._patterns: dict[tuple[bytes, bytes], RoutePattern] = {}
        self._ids = itertools.count()

    def pattern(self, src_chips: np.ndarray, dst_chips: np.ndarray) -> RoutePattern:
        """The routes of flows ``src_chips[f] -> dst_chips[f]`` (cached by the chip pairs)."""
        src_chips = np.ascontiguousarray(src_chips, dtype=np.int64)
        dst_chips = np.ascontiguousarray(dst_chips, dtype=np.int64)
        key = (src_chips.tobytes(), dst_chips.tobytes())
        pat = self._patterns.get(key)
        if pat is None:
            pat = self._patterns[key] = self._build(src_chips, dst_chips)
        return pat

    def _build(self, src: np.ndarray, dst: np.ndarray) -> RoutePattern:
        links = self.route_matrix(src, dst)                 # the shared routes (detours included)
        hops = (links >= 0).sum(axis=1)
        if len(hops) and not hops.all():
            f = int(np.argmin(hops))
            raise LinkSpecError(f"a message from chip {int(src[f])} to chip {int(dst[f])} crosses no link; "
                                f"the DES needs distinct chips")
        lat = np.zeros(len(links))
        for h in np.unique(hops).tolist():       # route by route length: the latency sums add up in link order
            fs = np.flatnonzero(hops == h)
            lat[fs] = self.latency[links[fs, :h]].sum(axis=1)
        return RoutePattern(next(self._ids), links.astype(np.int32), lat)

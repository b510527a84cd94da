"""Faulty hardware, shared by both hardware models: degraded and failed links, and routes around them.

:func:`parse_links` names links (``"0->1"``, ``"3-7"``, ``"nvswitch0->5"``, ``"#12"``);
:func:`link_factors` turns ``--degrade-link``/``--fail-link`` options into per-link bandwidth factors
(0 = failed); a :class:`Router` answers "which directed links does a message from chip ``a`` to chip
``b`` cross" exactly as :meth:`~.topology.Topology.route` does (dimension-order on a torus, NVSwitch /
NIC + fabric on GPUs) unless that route crosses a *failed* link; then it takes a shortest detour over
the working links (breadth-first search, ties broken by link id, so the detour is deterministic: on a
torus ring it is the other way round, or a sidestep through a neighbouring line). A *degraded* link
keeps its route but runs at ``factor`` x its bandwidth.

The analytical model prices collectives on these routes and bandwidths; the DES
(:mod:`.des.routing`) builds its flow patterns from the same :class:`Router`.
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np

from partir_emu.errors import PartirError
from partir_emu.hwmodels.topology import Link, Node, Topology


class FaultError(PartirError):
    """A bad fault option (straggler, degraded or failed link) for either hardware model."""


class LinkSpecError(FaultError):
    """A degraded/failed link that does not name a link of the topology, or failures that disconnect it."""


_LINK_RE = re.compile(r"^\s*(#\d+|[^-<>\s]+)\s*(->|-|<->)\s*([^-<>\s]+)\s*$")


def parse_links(text: str, topology: Topology) -> list[Link]:
    """Links named by ``"A->B"`` (one direction), ``"A-B"`` or ``"A<->B"`` (both directions of the
    cable) or ``"#ID"`` (one link by id). ``A``/``B`` are chip numbers or switch names
    (``nvswitch0``, ``leaf1``, ``spine``)."""
    s = text.strip()
    if s.startswith("#") and s[1:].isdigit():
        i = int(s[1:])
        if not 0 <= i < len(topology.links):
            raise LinkSpecError(f"link #{i} does not exist: {topology.describe()} has links #0..#{len(topology.links) - 1}")
        return [topology.links[i]]
    m = _LINK_RE.match(s)
    if not m:
        raise LinkSpecError(f"link {text!r} is not SRC->DST, SRC-DST or #ID (e.g. 0->1, 3-7, gpu0 is 0, "
                            f"nvswitch0->5, leaf0->spine)")
    a, arrow, b = _node(m.group(1)), m.group(2), _node(m.group(3))
    ends = [(a, b)] if arrow == "->" else [(a, b), (b, a)]
    out = []
    for src, dst in ends:
        try:
            out.append(topology.link(src, dst))
        except KeyError:
            raise LinkSpecError(f"there is no link {src}->{dst} in {topology.describe()}; name two neighbouring "
                                f"chips (or a chip and its switch)") from None
    return out


def _node(text: str) -> Node:
    return int(text) if text.isdigit() else text


class Router:
    """Routes (link-id tuples) on ``topology`` with per-link bandwidth factors (0 = failed).

    Subclassed by the DES (:class:`~.des.routing.PatternRouter`) for batches of routes."""

    def __init__(self, topology: Topology, link_factors: Mapping[int, float] | None = None) -> None:
        self.topology = topology
        links = topology.links
        self.bw = np.array([lk.bw_bytes_per_s for lk in links], dtype=np.float64)
        self.latency = np.array([lk.latency_s for lk in links], dtype=np.float64)
        self.factors: dict[int, float] = {}
        for lid, f in (link_factors or {}).items():
            if not 0.0 <= f:
                raise LinkSpecError(f"link factor {f} for {links[lid]} must be >= 0 (0 = failed)")
            self.factors[lid] = self.factors.get(lid, 1.0) * f
        for lid, f in self.factors.items():
            self.bw[lid] *= f
        self.failed = frozenset(lid for lid, f in self.factors.items() if f == 0.0)
        self.rerouted: dict[tuple[int, int], tuple[int, ...]] = {}
        self._routes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._adj: dict[Node, list[Link]] | None = None

    @property
    def num_links(self) -> int:
        return len(self.bw)

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        key = (src, dst)
        r = self._routes.get(key)
        if r is None:
            r = tuple(lk.id for lk in self.topology.route_tuple(src, dst))
            if self.failed and any(i in self.failed for i in r):
                r = self.rerouted[key] = self._detour(src, dst)
            self._routes[key] = r
        return r

    def _detour(self, src: int, dst: int) -> tuple[int, ...]:
        if self._adj is None:
            self._adj = {}
            for lk in self.topology.links:
                if lk.id not in self.failed:
                    self._adj.setdefault(lk.src, []).append(lk)
        prev: dict[Node, Link | None] = {src: None}
        todo = deque([src])
        while todo:
            node = todo.popleft()
            if node == dst:
                break
            for lk in self._adj.get(node, ()):
                if lk.dst not in prev:
                    prev[lk.dst] = lk
                    todo.append(lk.dst)
        if dst not in prev:
            names = ", ".join(str(self.topology.links[i]) for i in sorted(self.failed))
            raise LinkSpecError(f"failed link(s) {names} disconnect chip {src} from chip {dst} in "
                                f"{self.topology.describe()}; fail fewer links")
        path = []
        node: Node = dst
        while prev[node] is not None:
            lk = prev[node]
            path.append(lk.id)
            node = lk.src
        return tuple(reversed(path))

    def describe_faults(self) -> list[str]:
        out = []
        for lid, f in sorted(self.factors.items()):
            lk = self.topology.links[lid]
            out.append(f"{lk} ({'failed' if f == 0 else f'x{f:g} bandwidth'})")
        return out


def link_factors(topology: Topology, degraded: Mapping[str, float] | Iterable[tuple[str, float]] = (),
                 failed: Iterable[str] = ()) -> dict[int, float]:
    """``{link id: bandwidth factor}`` from link names (see :func:`parse_links`)."""
    out: dict[int, float] = {}
    items = degraded.items() if isinstance(degraded, Mapping) else degraded
    for name, f in items:
        f = float(f)
        if not 0.0 < f:
            raise LinkSpecError(f"degraded link {name}: factor {f} must be > 0 (use a failed link for 0)")
        for lk in parse_links(str(name), topology):
            out[lk.id] = out.get(lk.id, 1.0) * f
    for name in failed:
        for lk in parse_links(str(name), topology):
            out[lk.id] = 0.0
    return out

"""Physical topologies as graphs of directed links, and their routing.

Nodes are chips (ints ``0..num_chips-1``, numbered row-major over the physical
dims, the first dim most major) and switches (strings such as ``"nvswitch0"``,
``"leaf1"``, ``"spine"``). Every :class:`Link` is one direction of a physical
connection with its own bandwidth (bidirectional hardware = two links).

``Topology.route(src, dst)`` returns the links a transfer crosses, in order;
its hop count is the length of that list and its latency the sum of the links'.
``Topology.route_matrix(src, dst)`` gives the routes of a batch of transfers as a ``-1`` padded
``[flows, hops]`` array of link ids. On a torus it is the one implementation of the route (array
operations over per-chip neighbour tables); ``route`` is its row for one pair, and the faults router
(:mod:`.links`), the contention pricing and the DES all take their torus routes from it.

- **torus** (TPU ICI): dims ``x, y, z``; a link to each neighbour along each dim,
  and wraparound links where the slice has them. Routing is dimension-order
  (x, then y, then z), shortest way round a wrapped dim (ties go the + way).
- **gpu** (NVSwitch + InfiniBand): dims ``node, gpu``. Inside a node:
  GPU→NVSwitch→GPU (``nvlink_bw_bytes_per_s`` per GPU, each way). Across nodes:
  GPU's NIC→leaf→(spine→leaf)→NIC, one NIC per GPU. ``fat_tree`` puts
  ``nodes_per_leaf`` whole nodes under a leaf; ``rail_optimized`` puts NIC *r*
  of the ``nodes_per_su`` nodes of a scalable unit under leaf *r* of that unit.
  Leaf↔spine links carry the leaf's full downlink bandwidth (non-blocking).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.errors import PlacementError
from partir_emu.hwmodels.machine.specs import GpuClusterSpec

Node = int | str
TORUS_DIM_NAMES = ("x", "y", "z")
GPU_DIM_NAMES = ("node", "gpu")


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a physical link. ``id`` is its index in ``Topology.links``."""

    id: int
    src: Node
    dst: Node
    bw_bytes_per_s: float
    latency_s: float
    kind: str            # "ici" | "nvlink" | "ib"
    label: str = ""

    def __str__(self) -> str:
        return self.label or f"link{self.id} {self.src}->{self.dst}"


class Topology:
    """An immutable link graph. Build with :meth:`torus`, :meth:`gpu_cluster` or :func:`topology_for`.

    ``key`` (a small hashable identity; price caches use it) and the index of links by their ends
    are computed when it is built; a route when first asked for, then kept (``_routes``), since
    it never changes, and so are a torus's neighbour tables (``_walk``, :meth:`torus_tables`).
    ``leaf_of``: GPU clusters, the InfiniBand leaf switch of each GPU's NIC."""

    __slots__ = ("kind", "dims", "dim_names", "wrap", "links", "name", "leaf_of", "key", "_by_ends", "_routes",
                 "_walk")

    def __init__(self, kind: str, dims: tuple[int, ...], dim_names: tuple[str, ...], wrap: tuple[bool, ...],
                 links: tuple[Link, ...], name: str = "", leaf_of: Mapping[int, str] | None = None) -> None:
        self.kind = kind                    # "torus" | "gpu"
        self.dims = dims
        self.dim_names = dim_names
        self.wrap = wrap
        self.links = links
        self.name = name
        self.leaf_of: Mapping[int, str] = dict(leaf_of or {})
        # why no name: prices depend only on what is here, so two specs with the same network (a
        # what-if of the chip's HBM or FLOPs, say) share their collective prices
        self.key: tuple = (kind, dims, wrap, len(links),
                           tuple(sorted({(lk.kind, lk.bw_bytes_per_s, lk.latency_s) for lk in links})),
                           tuple(sorted(set(self.leaf_of.values()))))
        self._by_ends: dict[tuple[Node, Node], Link] = {(lk.src, lk.dst): lk for lk in links}
        self._routes: dict[tuple[int, int], tuple[Link, ...]] = {}
        self._walk: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        return (f"Topology(kind={self.kind!r}, dims={self.dims!r}, dim_names={self.dim_names!r}, wrap={self.wrap!r}, "
                f"links=<{len(self.links)}>, name={self.name!r})")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def torus(cls, dims: tuple[int, ...], wrap: tuple[bool, ...] | None = None, *, link_bw_bytes_per_s: float,
              link_latency_s: float, name: str = "") -> Topology:
        """A 1–3D torus/mesh of chips; ``wrap[d]`` says whether dim d has wraparound links."""
        dims = tuple(int(d) for d in dims)
        if not 1 <= len(dims) <= 3 or min(dims) < 1:
            raise PlacementError(f"torus dims {dims} must be 1 to 3 positive sizes")
        wrap = tuple(bool(w) for w in (wrap if wrap is not None else (True,) * len(dims)))
        if len(wrap) != len(dims):
            raise PlacementError(f"torus wrap flags {wrap} do not match dims {dims}")
        wrap = tuple(w and s > 2 for w, s in zip(wrap, dims))   # on 2 chips the wrap link is the plain link
        names = TORUS_DIM_NAMES[:len(dims)]
        coords, nxt = _neighbours(dims, wrap)
        at = [tuple(c) for c in coords.tolist()]
        links: list[Link] = []
        for chip, ends in enumerate(nxt.tolist()):
            for d, pair in enumerate(ends):
                for other, sign in zip(pair, "+-"):
                    if other >= 0:
                        links.append(Link(len(links), chip, other, link_bw_bytes_per_s, link_latency_s, "ici",
                                          f"ici {names[d]}{sign} {at[chip]}->{at[other]}"))
        return cls("torus", dims, names, wrap, tuple(links), name)

    @classmethod
    def gpu_cluster(cls, num_gpus: int, net: GpuClusterSpec, name: str = "") -> Topology:
        """``num_gpus`` GPUs in whole nodes of ``net.gpus_per_node`` (or one partial node)."""
        g = net.gpus_per_node
        if num_gpus <= g:
            nodes, per = 1, num_gpus
        elif num_gpus % g:
            raise PlacementError(f"{num_gpus} GPUs do not fill whole {name or 'GPU'} nodes of {g}; "
                                 f"use a multiple of {g} devices")
        else:
            nodes, per = num_gpus // g, g
        if nodes > net.max_nodes:
            raise PlacementError(f"{num_gpus} GPUs need {nodes} nodes but {name or 'the spec'} allows at most "
                                 f"{net.max_nodes} (topology.max_nodes)")
        links: list[Link] = []

        def add(src: Node, dst: Node, bw: float, lat: float, kind: str, label: str) -> None:
            links.append(Link(len(links), src, dst, bw, lat, kind, label))

        for chip in range(nodes * per):
            n, i = divmod(chip, per)
            if per > 1:
                add(chip, f"nvswitch{n}", net.nvlink_bw_bytes_per_s, net.nvlink_latency_s, "nvlink",
                    f"nvlink gpu{chip}->nvswitch{n}")
                add(f"nvswitch{n}", chip, net.nvlink_bw_bytes_per_s, net.nvlink_latency_s, "nvlink",
                    f"nvlink nvswitch{n}->gpu{chip}")
        leaf_of: dict[int, str] = {}
        if nodes > 1:
            for chip in range(nodes * per):
                n, i = divmod(chip, per)
                leaf = (f"leaf{n // net.nodes_per_leaf}" if net.fabric == "fat_tree"
                        else f"leaf{n // net.nodes_per_su}.{i}")
                leaf_of[chip] = leaf
                add(chip, leaf, net.nic_bw_bytes_per_s, net.ib_latency_s, "ib", f"ib nic{chip}->{leaf}")
                add(leaf, chip, net.nic_bw_bytes_per_s, net.ib_latency_s, "ib", f"ib {leaf}->nic{chip}")
            ports: dict[str, int] = {}
            for leaf in leaf_of.values():
                ports[leaf] = ports.get(leaf, 0) + 1
            if len(ports) > 1:
                for leaf, k in ports.items():
                    add(leaf, "spine", k * net.nic_bw_bytes_per_s, net.ib_latency_s, "ib", f"ib {leaf}->spine")
                    add("spine", leaf, k * net.nic_bw_bytes_per_s, net.ib_latency_s, "ib", f"ib spine->{leaf}")
        return cls("gpu", (nodes, per), GPU_DIM_NAMES, (False, False), tuple(links), name, leaf_of)

    # -- queries ----------------------------------------------------------------------------------
    @property
    def num_chips(self) -> int:
        return math.prod(self.dims)

    def coords(self, chip: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.dims):
            chip, c = divmod(chip, s)
            out.append(c)
        return tuple(reversed(out))

    def chip_at(self, coords: tuple[int, ...]) -> int:
        return _row_major(coords, self.dims)

    def node_of(self, chip: int) -> int:
        """The host node of a GPU (its ``node`` coordinate); 0 on a torus."""
        return chip // self.dims[1] if self.kind == "gpu" else 0

    def link(self, src: Node, dst: Node) -> Link:
        return self._by_ends[(src, dst)]

    def route(self, src: int, dst: int) -> list[Link]:
        """The directed links a transfer from chip ``src`` to chip ``dst`` crosses, in order."""
        return list(self.route_tuple(src, dst))

    def hops(self, src: int, dst: int) -> int:
        return len(self.route_tuple(src, dst))

    def route_tuple(self, src: int, dst: int) -> tuple[Link, ...]:
        key = (src, dst)
        r = self._routes.get(key)
        if r is None:
            n = self.num_chips
            if not (0 <= src < n and 0 <= dst < n):
                raise PlacementError(f"chip {src if not 0 <= src < n else dst} is not in {self.describe()}")
            r = self._routes[key] = tuple(self._torus_route(src, dst) if self.kind == "torus"
                                          else self._gpu_route(src, dst))
        return r

    def route_matrix(self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> np.ndarray:
        """The routes of transfers ``src[f] -> dst[f]`` (chips) as an ``[F, hops]`` array of link ids,
        ``-1`` padded: row ``f`` is ``route(src[f], dst[f])``. On a torus computed with array operations
        (dimension order, the shorter way round a wrapped dim, a tie the + way); elsewhere pair by pair."""
        src, dst = self.chip_pairs(src, dst)
        if self.kind != "torus":
            return pad_routes([tuple(lk.id for lk in self.route_tuple(s, d)) for s, d in zip(src.tolist(), dst.tolist())])
        return self._torus_walk(src, dst)

    def chip_pairs(self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``src`` and ``dst`` as flat int64 arrays of chips of this topology, one of each per transfer."""
        src = np.asarray(src, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst, dtype=np.int64).reshape(-1)
        if len(src) != len(dst):
            raise PlacementError(f"route_matrix got {len(src)} sources but {len(dst)} destinations; give one each")
        for ends in (src, dst):
            bad = ends[(ends < 0) | (ends >= self.num_chips)]
            if bad.size:
                raise PlacementError(f"chip {int(bad[0])} is not in {self.describe()}")
        return src, dst

    def _torus_walk(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The torus routes of :meth:`route_matrix` (chips known to be on the torus): how many hops which
        way along each dim, then the walk over the neighbour tables, dim by dim."""
        coords, step, nxt, dims, wrap = self._walk_tables()
        delta = coords[dst] - coords[src]                                  # [F, D]
        around = np.mod(delta, dims)
        around = np.where(around > dims - around, around - dims, around)  # shorter way; a tie goes +
        delta = np.where(wrap, around, delta)
        hops = np.abs(delta)
        out = np.full((len(src), max(int(hops.sum(axis=1).max(initial=0)), 1)), -1, dtype=np.int64)
        cur = src.copy()
        pos = np.zeros(len(src), dtype=np.int64)
        for d in range(len(self.dims)):                                     # dimension order
            way = (delta[:, d] < 0).astype(np.int64)                       # 0: + link, 1: - link
            for k in range(int(hops[:, d].max(initial=0))):
                f = np.flatnonzero(hops[:, d] > k)
                out[f, pos[f]] = step[cur[f], d, way[f]]
                cur[f] = nxt[cur[f], d, way[f]]
                pos[f] += 1
        return out

    def torus_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A torus's per-chip tables the routes walk: ``coords[chip]`` (``[n, D]``), and per (dim, + / -
        way) the link to the neighbour ``step[chip, d, k]`` and that neighbour ``nxt[chip, d, k]``
        (``[n, D, 2]``, ``-1`` where an open line ends)."""
        return self._walk_tables()[:3]

    def _walk_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`torus_tables`, and the dim sizes and wraparound flags as arrays (``[D]``, ``[1, D]``)."""
        if self._walk is None:
            if self.kind != "torus":
                raise PlacementError(f"{self.describe()} is not a torus; it has no torus neighbour tables")
            coords, nxt = _neighbours(self.dims, self.wrap)
            by_ends = self._by_ends
            step = np.array([[[by_ends[(c, o)].id if o >= 0 else -1 for o in pair] for pair in ends]
                             for c, ends in enumerate(nxt.tolist())], dtype=np.int64).reshape(nxt.shape)
            self._walk = (coords, step, nxt, np.array(self.dims, dtype=np.int64),
                          np.array(self.wrap, dtype=bool)[None, :])
        return self._walk

    def _torus_route(self, src: int, dst: int) -> list[Link]:
        """One route: the row of :meth:`route_matrix` for the pair."""
        row = self._torus_walk(np.array([src]), np.array([dst]))[0]
        return [self.links[i] for i in row.tolist() if i >= 0]

    def _gpu_route(self, src: int, dst: int) -> list[Link]:
        if src == dst:
            return []
        per = self.dims[1]
        ns, nd = src // per, dst // per
        if ns == nd:
            return [self._by_ends[(src, f"nvswitch{ns}")], self._by_ends[(f"nvswitch{nd}", dst)]]
        leaf_of = self.leaf_of
        ls, ld = leaf_of[src], leaf_of[dst]
        path = [self._by_ends[(src, ls)]]
        if ls != ld:
            path += [self._by_ends[(ls, "spine")], self._by_ends[("spine", ld)]]
        return path + [self._by_ends[(ld, dst)]]

    def describe(self) -> str:
        if self.kind == "torus":
            shape = "x".join(f"{s}{'' if w else '(open)'}" for s, w in zip(self.dims, self.wrap))
            return f"{self.name or 'torus'} {len(self.dims)}D torus {shape} ({self.num_chips} chips)"
        nodes, per = self.dims
        return f"{self.name or 'gpu'} {nodes} node(s) x {per} GPUs (NVSwitch + InfiniBand)"

    __str__ = describe


def _neighbours(dims: tuple[int, ...], wrap: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The chips of a torus ``dims`` (row-major): ``coords`` ``[n, D]``, and ``nxt[chip, d, k]`` its neighbour
    along dim ``d`` the + (``k = 0``) or - (``k = 1``) way, ``-1`` where an open line ends (``wrap[d]`` is
    False). A link runs from each chip to each of its neighbours."""
    n, nd = math.prod(dims), len(dims)
    chips = np.arange(n, dtype=np.int64)
    coords = np.stack(np.unravel_index(chips, dims), axis=1).astype(np.int64).reshape(n, nd)
    nxt = np.full((n, nd, 2), -1, dtype=np.int64)
    stride = n
    for d, s in enumerate(dims):
        stride //= s
        for k, inc in enumerate((1, -1)):
            m = coords[:, d] + inc
            ok = (m >= 0) & (m < s)
            if wrap[d]:
                m, ok = m % s, np.ones(n, dtype=bool)
            ok &= m != coords[:, d]            # a dim of 1 chip has no neighbours
            nxt[ok, d, k] = chips[ok] + (m[ok] - coords[ok, d]) * stride
    return coords, nxt


def pad_routes(routes: Sequence[Sequence[int]]) -> np.ndarray:
    """Routes (link-id sequences) as a ``-1`` padded ``[F, hops]`` matrix (at least one column)."""
    out = np.full((len(routes), max(max(map(len, routes), default=0), 1)), -1, dtype=np.int64)
    by_len: dict[int, list[int]] = {}
    for f, r in enumerate(routes):
        by_len.setdefault(len(r), []).append(f)
    for h, fs in by_len.items():
        if h:
            out[fs, :h] = np.array([routes[f] for f in fs], dtype=np.int64).reshape(len(fs), h)
    return out


def _row_major(coords: tuple[int, ...], dims: tuple[int, ...]) -> int:
    i = 0
    for c, s in zip(coords, dims):
        i = i * s + c
    return i

"""Placement: logical mesh axes → physical topology dims → chips.

Each mesh axis is laid over one or more *factors* of the physical dims: a
factor is ``(dim, size, stride)``, meaning the axis coordinate's digit steps
that physical coordinate by ``stride``. An axis's coordinate is split into its
factors' digits major→minor.

- **default** (``mapping=None`` or ``"default"``): fill the physical dims in order: device ``d``
  (row-major over the mesh) is chip ``d`` (row-major over the physical dims),
  so the last mesh axis takes the innermost physical dim first. An axis whose
  size does not tile the dims it falls on → :class:`PlacementError`.
- **explicit** (``"model=x,batch=yz"`` or ``{"model": "x", "batch": ("y", "z")}``):
  each axis is placed on physical dims (major→minor as listed; GPU dims
  are ``node`` and ``gpu``, join several with ``+``). Sizes must match exactly.
  A dim item is a whole dim (``z``) or a part of one (``z[4]``, also ``z[4/16]``):
  the parts of one dim go major→minor in the order their axes are listed, so
  ``"batch=x+y+z[4],model=z[4]"`` is the default fill of batch=64,model=4 on
  4x4x16 and ``"model=z[4],batch=x+y+z[4]"`` strides model by 4 along z.
  :meth:`Placement.mapping_text` writes any placement in this form.
- **auto** is no placement but a search over them, by price
  (:mod:`.placement_search`); ``Placement(..., "auto")`` says so.

For the devices of a collective group (mesh axes), :meth:`Placement.group`
tells which physical dims it spans, whether each spans a full dim with
wraparound (a ring / torus), how many nodes a GPU group spans, and the chips
of a representative group in group-position order. :meth:`Placement.warnings`
says what is structurally questionable (axes sharing a dim, a GPU axis across
nodes, no wraparound where a ring is possible); :mod:`.placement_search` prices it.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.core.mesh import Mesh
from partir_emu.errors import MeshError, PlacementError
from partir_emu.hwmodels.machine.mapping import Factor, dims_from_mapping, explicit_placement, parse_mapping
from partir_emu.hwmodels.machine.slices import topology_for
from partir_emu.hwmodels.machine.specs import HardwareSpec, TorusSpec
from partir_emu.hwmodels.machine.topology import Topology


@dataclass(frozen=True)
class GroupLayout:
    """The physical shape of the device groups over ``axes`` (all groups have the same shape)."""

    axes: tuple[str, ...]
    size: int
    factors: tuple[Factor, ...]          # non-trivial factors, in group-position order (major→minor)
    dim_names: tuple[str, ...]           # physical dim of each factor
    wrap: tuple[bool, ...]               # factor covers a whole physical dim that has wraparound
    chips: tuple[int, ...]               # chips of the group of device 0, by group position
    nodes: int = 1                       # GPU: nodes one group spans
    per_node: int = 1                    # GPU: group members per node

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(f.size for f in self.factors)

    @property
    def is_ring(self) -> bool:
        """One physical dim, whole, with wraparound."""
        return len(self.factors) == 1 and self.wrap[0]

    @property
    def is_torus(self) -> bool:
        """Every spanned physical dim is whole and wraps."""
        return bool(self.factors) and all(self.wrap)


@dataclass(frozen=True)
class PlacementWarning:
    """Something questionable about a placement: ``kind`` is ``shared_dim`` (several mesh axes on one
    torus dim), ``across_nodes`` (a GPU axis spans nodes) or ``open_line`` (no wraparound where a ring
    is possible); ``text`` says it in one line (without the price: :mod:`.placement_search` adds it)."""

    kind: str
    axes: tuple[str, ...]
    dim: str
    text: str


class Placement:
    """Where each device of ``mesh`` lives on ``topology``. Use :func:`place` to build one from a spec.

    Immutable once built. ``factors`` (per mesh axis, its physical factors) and ``key`` (hashable:
    topology, mesh and factors; price caches use it) are computed when it is built; the chip of
    each device and the layout of the groups over some axes on first request, then kept, since
    they never change."""

    __slots__ = ("mesh", "topology", "mapping", "factors", "key", "_chips", "_groups")

    def __init__(self, mesh: Mesh, topology: Topology,
                 mapping: str | Mapping[str, str | Sequence[str]] | None = None) -> None:
        if mesh.size != topology.num_chips:
            raise PlacementError(f"{mesh} has {mesh.size} devices but {topology.describe()} has "
                                 f"{topology.num_chips} chips; build the topology for the mesh size")
        if isinstance(mapping, str) and mapping.strip().lower() in ("auto", "default"):
            if mapping.strip().lower() == "auto":
                raise PlacementError("placement 'auto' is chosen by pricing a program: use "
                                     "hwmodels.placement_search.search_placement (the CLI does), or give "
                                     "\"default\" or an explicit placement such as \"model=x,batch=yz\"")
            mapping = None
        m = parse_mapping(mapping, mesh, topology) if mapping is not None else None
        self.mesh = mesh
        self.topology = topology
        self.mapping = mapping
        self.factors: dict[str, tuple[Factor, ...]] = (explicit_placement(m, mesh, topology) if m is not None
                                                      else _fill(mesh, topology))
        self._finish()

    @classmethod
    def from_factors(cls, mesh: Mesh, topology: Topology, factors: Mapping[str, Sequence[Factor]]) -> Placement:
        """A placement given by its factors (the search builds them; checked only for covering every chip)."""
        self = cls.__new__(cls)
        self.mesh, self.topology, self.mapping = mesh, topology, None
        self.factors = {a: tuple(factors.get(a, ())) for a in mesh.axis_names}
        covered = math.prod(f.size for fs in self.factors.values() for f in fs)
        if covered != topology.num_chips or any(math.prod(f.size for f in self.factors[a]) != s for a, s in mesh.axes):
            raise PlacementError(f"factors {self.factors} do not place {mesh} on {topology.describe()}")
        self._finish()
        self.mapping = self.mapping_text()
        return self

    def _finish(self) -> None:
        mesh, topology = self.mesh, self.topology
        self.key: tuple = (topology.key, mesh.axes, tuple((a, self.factors[a]) for a in mesh.axis_names))
        self._chips: tuple[int, ...] | None = None           # chip of each device, on first use
        self._groups: dict[tuple[str, ...], GroupLayout] = {}

    def __repr__(self) -> str:
        return f"Placement(mesh={self.mesh!r}, topology={self.topology!r}, mapping={self.mapping!r})"

    def chip_of(self, device: int) -> int:
        """The chip (``Topology`` node id) that hosts mesh device ``device``."""
        table = self._chips
        if table is None:
            table = self._chips = self._chip_table()
        return table[device]

    def _chip_table(self) -> tuple[int, ...]:
        """The chip of every device, as :meth:`_chip` finds one's, with array operations (a placement
        search builds the table of every placement it prices)."""
        topo = self.topology
        if type(topo).chip_at is not Topology.chip_at:          # a topology numbering its own way
            return tuple(self._chip(d) for d in range(self.mesh.size))
        rest = np.arange(self.mesh.size, dtype=np.int64)
        coords = np.zeros((len(topo.dims), self.mesh.size), dtype=np.int64)
        for axis, size in reversed(self.mesh.axes):              # row-major device numbering
            rest, c = np.divmod(rest, size)
            for f in reversed(self.factors[axis]):
                c, digit = np.divmod(c, f.size)
                coords[f.dim] += digit * f.stride
        chip = np.zeros(self.mesh.size, dtype=np.int64)
        for d, size in enumerate(topo.dims):                     # Topology.chip_at: row-major over the dims
            chip = chip * size + coords[d]
        return tuple(chip.tolist())

    def _chip(self, device: int) -> int:
        coords = [0] * len(self.topology.dims)
        for axis, c in self.mesh.coords(device).items():
            for f in reversed(self.factors[axis]):
                c, digit = divmod(c, f.size)
                coords[f.dim] += digit * f.stride
        return self.topology.chip_at(tuple(coords))

    def group(self, axes: Sequence[str]) -> GroupLayout:
        """Physical layout of the groups over ``axes`` (ordered as a collective over ``axes`` orders them)."""
        axes = tuple(axes)
        g = self._groups.get(axes)
        if g is None:
            g = self._groups[axes] = self._layout(axes)
        return g

    def _layout(self, axes: tuple[str, ...]) -> GroupLayout:
        for a in axes:
            try:
                self.mesh.check_axis(a)
            except MeshError as exc:
                raise PlacementError(str(exc)) from None
        topo = self.topology
        factors = tuple(f for a in axes for f in self.factors[a] if f.size > 1)
        wrap = tuple(f.size == topo.dims[f.dim] and topo.wrap[f.dim] for f in factors)
        chips = tuple(self.chip_of(d) for d in self.mesh.groups(axes)[0])
        nodes, per_node = 1, len(chips)
        if topo.kind == "gpu":
            nodes = len({topo.node_of(c) for c in chips})
            per_node = len(chips) // nodes
        return GroupLayout(axes, len(chips), factors, tuple(topo.dim_names[f.dim] for f in factors), wrap, chips,
                           nodes, per_node)

    def describe(self) -> str:
        return ", ".join(f"{a}={self._dims_of(a)}" for a in self.mesh.axis_names) + f" on {self.topology.describe()}"


    def mapping_text(self) -> str | None:
        """This placement as a mapping string :class:`Placement` accepts (``"model=x,batch=y+z[4]"``), or
        ``None`` when no listing order of the axes gives the strides of every shared dim."""
        topo, names = self.topology, self.mesh.axis_names
        after: dict[str, set[str]] = {a: set() for a in names}       # axis -> axes that must be listed later
        for d in range(len(topo.dims)):
            on = sorted(((f.stride, a) for a in names for f in self.factors[a] if f.dim == d and f.size > 1),
                        key=lambda t: -t[0])
            for (_, major), (_, minor) in zip(on, on[1:]):
                after[major].add(minor)
        order: list[str] = []
        ready = [a for a in names if not any(a in v for v in after.values())]
        while ready:
            a = ready.pop(0)
            order.append(a)
            for b in sorted(after.pop(a), key=names.index):
                if not any(b in v for v in after.values()):
                    ready.append(b)
            ready.sort(key=names.index)
        if len(order) != len(names):
            return None
        items = []
        for a in order:
            parts = [topo.dim_names[f.dim] + ("" if f.size == topo.dims[f.dim] else f"[{f.size}]")
                     for f in self.factors[a] if f.size > 1]
            if parts:
                items.append(f"{a}={'+'.join(parts)}")
        return ",".join(items)

    def warnings(self) -> tuple[PlacementWarning, ...]:
        """What is structurally questionable here (no program needed; :mod:`.placement_search` prices it):
        two mesh axes on one torus dim (their groups contend for its links), a GPU axis across nodes that
        would fit in one node, an axis that is no closed ring/torus where whole wraparound dims of its
        size exist."""
        topo, out = self.topology, []
        if topo.kind in ("torus", "slices"):
            for d, name in enumerate(topo.dim_names):
                on = sorted(((f.stride, a, f.size) for a in self.mesh.axis_names for f in self.factors[a]
                             if f.dim == d and f.size > 1), reverse=True)
                if len(on) > 1:
                    axes = tuple(a for _, a, _ in on)
                    verb = "both lie" if len(axes) == 2 else "all lie"
                    out.append(PlacementWarning("shared_dim", axes, name,
                                                f"mesh axes {' and '.join(axes)} {verb} on {name} "
                                                f"({'x'.join(str(s) for *_, s in on)} of {topo.dims[d]}): their "
                                                f"collectives share {name} links"))
            rings = _wrapping_products(topo)
            for a, size in self.mesh.axes:
                g = self.group((a,))
                if size > 2 and not g.is_torus and size in rings:
                    out.append(PlacementWarning("open_line", (a,), "+".join(g.dim_names),
                                                f"mesh axis {a}={size} on {self._dims_of(a)} has no wraparound "
                                                f"links of its own (an open dim or part of one): {rings[size]} "
                                                f"would make it a ring"))
        else:
            per = topo.dims[1]
            for a, size in self.mesh.axes:
                g = self.group((a,))
                if g.nodes > 1 and size <= per:
                    out.append(PlacementWarning("across_nodes", (a,), "node",
                                                f"mesh axis {a}={size} spans {g.nodes} nodes ({g.per_node} GPU(s) "
                                                f"per node): its collectives cross InfiniBand, though it would fit "
                                                f"in one node's {per} GPUs"))
        return tuple(out)

    def _dims_of(self, axis: str) -> str:
        topo = self.topology
        return "+".join(topo.dim_names[f.dim] + ("" if f.size == topo.dims[f.dim] else f"[{f.size}/{topo.dims[f.dim]}]")
                        for f in self.factors[axis] if f.size > 1) or "-"

    __str__ = describe


def place(mesh: Mesh, spec: HardwareSpec, mapping: str | Mapping | None = None,
          slice_dims: Sequence[int] | None = None,
          topology: Callable[[HardwareSpec, int, tuple[int, ...] | None], Topology] = topology_for) -> Placement:
    """Build the topology of ``spec`` for ``mesh.size`` chips and place the mesh on it.

    With an explicit ``mapping`` and no ``slice_dims``, a torus slice is shaped after the mapping
    (each physical dim gets the size of the mesh axis placed on it, when that is unambiguous).
    ``topology(spec, chips, dims)`` builds the topology (an analyzer passes its cache). Builds afresh
    each time; :meth:`~partir_emu.hwmodels.analytical.Analyzer.placement` keeps them."""
    dims = tuple(slice_dims) if slice_dims is not None else None
    if dims is None and mapping is not None and isinstance(spec.network, TorusSpec):   # a TPU spec
        dims = dims_from_mapping(mapping, mesh, len(spec.network.pod_dims))
    return Placement(mesh, topology(spec, mesh.size, dims), mapping)


def _wrapping_products(topo: Topology) -> dict[int, str]:
    """Group sizes a closed ring/torus of whole wraparound dims can have -> those dims (e.g. {16: "z"})."""
    out: dict[int, str] = {}
    wrapping = [d for d in range(len(topo.dims)) if topo.wrap[d] and topo.dims[d] > 2]
    for r in range(1, len(wrapping) + 1):
        for combo in itertools.combinations(wrapping, r):
            out.setdefault(math.prod(topo.dims[d] for d in combo), "+".join(topo.dim_names[d] for d in combo))
    return out


# -- default placement --------------------------------------------------------------------------------
def _fill(mesh: Mesh, topo: Topology) -> dict[str, tuple[Factor, ...]]:
    dim = len(topo.dims) - 1
    stride = 1            # stride already used inside physical dim `dim`
    out: dict[str, tuple[Factor, ...]] = {}
    for name, size in reversed(mesh.axes):
        fs: list[Factor] = []
        left = size
        while left > 1:
            while dim >= 0 and topo.dims[dim] // stride == 1:
                dim, stride = dim - 1, 1
            if dim < 0:
                raise PlacementError(f"mesh axis {name}={size} does not fit {topo.describe()}")
            room = topo.dims[dim] // stride
            take = math.gcd(room, left)
            if take == 1 or (take < left and take < room):
                raise PlacementError(
                    f"mesh axis {name}={size} does not tile physical dim {topo.dim_names[dim]}={topo.dims[dim]} "
                    f"of {topo.describe()} (it falls on {room} remaining positions); choose axis sizes that divide "
                    f"the physical dims, another slice shape, or an explicit placement like "
                    f"\"{name}={topo.dim_names[dim]}\"")
            fs.append(Factor(dim, take, stride))
            stride *= take
            left //= take
        out[name] = tuple(reversed(fs))
    return {n: out[n] for n in mesh.axis_names}



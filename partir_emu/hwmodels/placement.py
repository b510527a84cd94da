"""Placement: logical mesh axes → physical topology dims → chips.

Each mesh axis is laid over one or more *factors* of the physical dims: a
factor is ``(dim, size, stride)``, meaning the axis coordinate's digit steps
that physical coordinate by ``stride``. An axis's coordinate is split into its
factors' digits major→minor.

- **default** (``mapping=None``): fill the physical dims in order: device ``d``
  (row-major over the mesh) is chip ``d`` (row-major over the physical dims),
  so the last mesh axis takes the innermost physical dim first. An axis whose
  size does not tile the dims it falls on → :class:`PlacementError`.
- **explicit** (``"model=x,batch=yz"`` or ``{"model": "x", "batch": ("y", "z")}``):
  each axis is placed on whole physical dims (major→minor as listed; GPU dims
  are ``node`` and ``gpu``, join several with ``+``). Sizes must match exactly.

For the devices of a collective group (mesh axes), :meth:`Placement.group`
tells which physical dims it spans, whether each spans a full dim with
wraparound (a ring / torus), how many nodes a GPU group spans, and the chips
of a representative group in group-position order.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from partir_emu.core.mesh import Mesh
from partir_emu.errors import MeshError, PlacementError
from partir_emu.hwmodels.specs import HardwareSpec
from partir_emu.hwmodels.topology import Topology, topology_for


@dataclass(frozen=True, slots=True)
class Factor:
    dim: int
    size: int
    stride: int


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
        m = _parse_mapping(mapping, mesh, topology) if mapping is not None else None
        self.mesh = mesh
        self.topology = topology
        self.mapping = mapping
        self.factors: dict[str, tuple[Factor, ...]] = (_explicit(m, mesh, topology) if m is not None
                                                      else _fill(mesh, topology))
        self.key: tuple = (topology.key, mesh.axes, tuple((a, self.factors[a]) for a in mesh.axis_names))
        self._chips: tuple[int, ...] | None = None           # chip of each device, on first use
        self._groups: dict[tuple[str, ...], GroupLayout] = {}

    def __repr__(self) -> str:
        return f"Placement(mesh={self.mesh!r}, topology={self.topology!r}, mapping={self.mapping!r})"

    def chip_of(self, device: int) -> int:
        """The chip (``Topology`` node id) that hosts mesh device ``device``."""
        table = self._chips
        if table is None:
            table = self._chips = tuple(self._chip(d) for d in range(self.mesh.size))
        return table[device]

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
        parts = []
        for a in self.mesh.axis_names:
            fs = self.factors[a]
            dims = "+".join(f"{self.topology.dim_names[f.dim]}"
                            + ("" if f.size == self.topology.dims[f.dim] else f"[{f.size}/{self.topology.dims[f.dim]}]")
                            for f in fs if f.size > 1) or "-"
            parts.append(f"{a}={dims}")
        return ", ".join(parts) + f" on {self.topology.describe()}"

    __str__ = describe


def place(mesh: Mesh, spec: HardwareSpec, mapping: str | Mapping | None = None,
          slice_dims: Sequence[int] | None = None) -> Placement:
    """Build the topology of ``spec`` for ``mesh.size`` chips and place the mesh on it.

    With an explicit ``mapping`` and no ``slice_dims``, a torus slice is shaped after the mapping
    (each physical dim gets the size of the mesh axis placed on it, when that is unambiguous).
    Builds afresh each time; :meth:`~partir_emu.hwmodels.analytical.Analyzer.placement` keeps them."""
    dims = tuple(slice_dims) if slice_dims is not None else None
    if dims is None and mapping is not None and spec.kind == "tpu":
        dims = _dims_from_mapping(mapping, mesh, len(spec.network.pod_dims))
    return Placement(mesh, topology_for(spec, mesh.size, dims), mapping)


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


# -- explicit placement -------------------------------------------------------------------------------
def _split_dims(text: str, names: tuple[str, ...]) -> list[str]:
    text = text.strip()
    if "+" in text:
        return [t.strip() for t in text.split("+")]
    if text in names:
        return [text]
    return list(text)


def _parse_mapping(mapping: str | Mapping, mesh: Mesh, topo: Topology) -> dict[str, list[str]]:
    names = topo.dim_names
    if isinstance(mapping, str):
        items = []
        for part in filter(None, (p.strip() for p in mapping.split(","))):
            axis, eq, dims = part.partition("=")
            if not eq:
                raise PlacementError(f"placement item {part!r} in {mapping!r} is not AXIS=DIMS; write e.g. "
                                     f"\"model={names[0]},batch={''.join(names[1:]) or names[0]}\"")
            items.append((axis.strip(), _split_dims(dims, names)))
    else:
        items = [(a, _split_dims(d, names) if isinstance(d, str) else list(d)) for a, d in mapping.items()]
    out: dict[str, list[str]] = {}
    used: dict[str, str] = {}
    for axis, dims in items:
        if axis not in mesh.axis_names:
            raise PlacementError(f"placement names axis {axis!r}, which is not in {mesh}")
        if axis in out:
            raise PlacementError(f"placement places mesh axis {axis!r} twice")
        for d in dims:
            if d not in names:
                raise PlacementError(f"placement of axis {axis!r}: {d!r} is not a physical dim of "
                                     f"{topo.describe()}; its dims are {', '.join(names)}")
            if d in used:
                raise PlacementError(f"physical dim {d!r} is given to both {used[d]!r} and {axis!r}")
            used[d] = axis
        out[axis] = dims
    return out


def _explicit(m: dict[str, list[str]], mesh: Mesh, topo: Topology) -> dict[str, tuple[Factor, ...]]:
    index = {n: i for i, n in enumerate(topo.dim_names)}
    out: dict[str, tuple[Factor, ...]] = {}
    for axis, size in mesh.axes:
        dims = m.get(axis, [])
        phys = math.prod(topo.dims[index[d]] for d in dims)
        if phys != size:
            where = "+".join(dims) or "no physical dim"
            raise PlacementError(
                f"mesh axis {axis}={size} is placed on {where} of size {phys} "
                f"({topo.describe()}); an axis needs physical dims whose sizes multiply to its size "
                f"(choose the dims, or the slice shape with slice_dims=..., to match)")
        out[axis] = tuple(Factor(index[d], topo.dims[index[d]], 1) for d in dims)
    left = [n for n, s in zip(topo.dim_names, topo.dims) if s > 1 and n not in {d for v in m.values() for d in v}]
    if left:
        raise PlacementError(f"physical dim(s) {', '.join(left)} of {topo.describe()} are given to no mesh axis")
    return out


def _dims_from_mapping(mapping: str | Mapping, mesh: Mesh, ndim: int) -> tuple[int, ...] | None:
    names = ("x", "y", "z")[:ndim]
    if isinstance(mapping, str):
        pairs = [p.partition("=") for p in mapping.split(",") if p.strip()]
        items = {a.strip(): _split_dims(d, names) for a, _, d in pairs}
    else:
        items = {a: _split_dims(d, names) if isinstance(d, str) else list(d) for a, d in mapping.items()}
    sizes = dict.fromkeys(names, 1)
    for axis, dims in items.items():
        if axis not in mesh.axis_names or any(d not in sizes for d in dims):
            return None                                   # Placement will report it
        if len(dims) == 1:
            sizes[dims[0]] = mesh.axis_size(axis)
        elif len(dims) > 1:
            return None                                   # ambiguous split: ask for slice_dims
    return tuple(sizes[n] for n in names)

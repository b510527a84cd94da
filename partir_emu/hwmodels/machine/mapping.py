"""Explicit placements: a user's ``--placement`` mapping of mesh axes onto topology dims (``batch=x,model=y:z``),
parsed, checked against the topology and turned into the device-to-chip map a
:class:`~partir_emu.hwmodels.machine.placement.Placement` holds.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from partir_emu.core.mesh import Mesh
from partir_emu.errors import PlacementError
from partir_emu.hwmodels.machine.topology import Topology


@dataclass(frozen=True, slots=True)
class Factor:
    dim: int
    size: int
    stride: int

# -- explicit placement -------------------------------------------------------------------------------
# A part is (dim name, size or None for the whole dim, the written text). "z[4]" (or "z[4/16]") is a part
# of size 4 of dim z; the parts of one dim go major→minor in the order their axes are listed.
Part = tuple[str, int | None, str]

_PART = re.compile(r"^([A-Za-z_][A-Za-z_0-9]*)\s*(?:\[\s*(\d+)\s*(?:/\s*(\d+)\s*)?\])?$")

def _split_dims(text: str, names: tuple[str, ...]) -> list[str]:
    """The dim items of one axis: ``"y+z[4]"``, ``"yz"``, ``"gpu"``, ``"z[4]"``."""
    text = text.strip()
    if "+" in text:
        return [t.strip() for t in text.split("+")]
    if text in names or _PART.match(text) and text.split("[")[0].strip() in names:
        return [text]
    alt = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    tokens = re.findall(rf"(?:{alt})(?:\[[^\]]*\])?", text) if alt else []
    if tokens and "".join(tokens) == text.replace(" ", ""):
        return tokens
    return list(text)

def _part(item: str, axis: str, topo_names: tuple[str, ...], dims: tuple[int, ...], where: str) -> Part:
    m = _PART.match(item.strip())
    name = m.group(1) if m else item.split("[")[0].strip()
    if name not in topo_names:
        raise PlacementError(f"placement of axis {axis!r}: {name!r} is not a physical dim of "
                             f"{where}; its dims are {', '.join(topo_names)}")
    if m is None:
        raise PlacementError(f"placement of axis {axis!r}: {item!r} is not a dim or a part of one; write e.g. "
                             f"\"{name}\" (the whole dim) or \"{name}[2]\" (2 of its positions)")
    full = dims[topo_names.index(name)]
    if m.group(3) is not None and int(m.group(3)) != full:
        raise PlacementError(f"placement of axis {axis!r}: {item!r} says {name} has {m.group(3)} positions "
                             f"but it has {full} in {where}")
    size = int(m.group(2)) if m.group(2) is not None else None
    if size is not None and (size < 1 or full % size):
        raise PlacementError(f"placement of axis {axis!r}: {item!r} takes {size} positions of {name}={full}; "
                             f"use a divisor of {full}")
    return (name, None if size == full else size, item.strip())

def parse_mapping(mapping: str | Mapping, mesh: Mesh, topo: Topology) -> dict[str, list[Part]]:
    names = topo.dim_names
    if isinstance(mapping, str):
        items: list[tuple[str, list[str]]] = []
        for part in filter(None, (p.strip() for p in mapping.split(","))):
            axis, eq, dims_text = part.partition("=")
            if not eq:
                raise PlacementError(f"placement item {part!r} in {mapping!r} is not AXIS=DIMS; write e.g. "
                                     f"\"model={names[0]},batch={''.join(names[1:]) or names[0]}\", "
                                     f"\"auto\" or \"default\"")
            items.append((axis.strip(), _split_dims(dims_text, names)))
    else:
        items = [(a, _split_dims(d, names) if isinstance(d, str) else list(d)) for a, d in mapping.items()]
    out: dict[str, list[Part]] = {}
    whole: dict[str, str] = {}            # dim -> the axis that has it whole
    split: dict[str, str] = {}            # dim -> an axis that has part of it
    for axis, dims in items:
        if axis not in mesh.axis_names:
            raise PlacementError(f"placement names axis {axis!r}, which is not in {mesh}")
        if axis in out:
            raise PlacementError(f"placement places mesh axis {axis!r} twice")
        parts = [_part(item, axis, names, topo.dims, topo.describe()) for item in dims]
        for name, size, _ in parts:
            other = whole.get(name) or (split.get(name) if size is None else None)
            if other is not None or (size is None and name in split):
                raise PlacementError(f"physical dim {name!r} is given to both {other or split[name]!r} and {axis!r}")
            (whole if size is None else split)[name] = axis
        out[axis] = parts
    return out

def explicit_placement(m: dict[str, list[Part]], mesh: Mesh, topo: Topology) -> dict[str, tuple[Factor, ...]]:
    index = {n: i for i, n in enumerate(topo.dim_names)}
    on_dim: dict[int, list[tuple[str, int]]] = {}          # dim -> (axis, size), major first
    for axis in m:
        for name, size, _ in m[axis]:
            i = index[name]
            on_dim.setdefault(i, []).append((axis, size if size is not None else topo.dims[i]))
    stride: dict[tuple[str, int], int] = {}
    for i, shares in on_dim.items():
        total = math.prod(s for _, s in shares)
        if total != topo.dims[i]:
            raise PlacementError(
                f"physical dim {topo.dim_names[i]}={topo.dims[i]} of {topo.describe()} is split into "
                f"{'x'.join(str(s) for _, s in shares)}={total} positions (by {', '.join(a for a, _ in shares)}); "
                f"the parts of one dim must multiply to its size")
        st = 1
        for axis, s in reversed(shares):
            stride[(axis, i)] = st
            st *= s
    out: dict[str, tuple[Factor, ...]] = {}
    for axis, size in mesh.axes:
        parts = m.get(axis, [])
        phys = math.prod(s if s is not None else topo.dims[index[d]] for d, s, _ in parts)
        if phys != size:
            where = "+".join(t for _, _, t in parts) or "no physical dim"
            raise PlacementError(
                f"mesh axis {axis}={size} is placed on {where} of size {phys} "
                f"({topo.describe()}); an axis needs physical dims whose sizes multiply to its size "
                f"(choose the dims, or the slice shape with slice_dims=..., to match)")
        out[axis] = tuple(Factor(index[d], s if s is not None else topo.dims[index[d]], stride[(axis, index[d])])
                          for d, s, _ in parts)
    left = [n for i, (n, s) in enumerate(zip(topo.dim_names, topo.dims)) if s > 1 and i not in on_dim]
    if left:
        raise PlacementError(f"physical dim(s) {', '.join(left)} of {topo.describe()} are given to no mesh axis")
    return out

def dims_from_mapping(mapping: str | Mapping, mesh: Mesh, ndim: int) -> tuple[int, ...] | None:
    names = ("x", "y", "z")[:ndim]
    if isinstance(mapping, str):
        pairs = [p.partition("=") for p in mapping.split(",") if p.strip()]
        items = {a.strip(): _split_dims(d, names) for a, _, d in pairs}
    else:
        items = {a: _split_dims(d, names) if isinstance(d, str) else list(d) for a, d in mapping.items()}
    sizes = dict.fromkeys(names, 1)
    for axis, dims in items.items():
        if axis not in mesh.axis_names or any(d not in sizes for d in dims):
            return None                                   # Placement will report it (or a part: "z[4]")
        if len(dims) == 1:
            sizes[dims[0]] = mesh.axis_size(axis)
        elif len(dims) > 1:
            return None                                   # ambiguous split: ask for slice_dims
    return tuple(sizes[n] for n in names)

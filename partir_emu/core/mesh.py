"""The abstract (compile-time) device mesh: ordered named axes with sizes.

The compiler only ever sees axis names and sizes (like JAX's ``AbstractMesh``);
which MPI rank or which chip a device is, is decided later by ``runtime/`` or
``hwmodels/placement``. Devices are numbered row-major over the axes.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from partir_emu.errors import MeshError

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The paper's schedules and XLA's meshes use a handful of axes; resharding plans and the placement
# search grow with the number of axes (a mesh of thousands of size-1 axes would never finish).
MAX_AXES = 16


@dataclass(frozen=True, eq=False)
class Mesh:
    """``Mesh(batch=2, model=4)`` or ``Mesh.from_items([("batch", 2), ("model", 4)])``."""

    axes: tuple[tuple[str, int], ...]
    _sizes: dict[str, int] = field(init=False, repr=False)     # derived from axes in __init__
    _names: tuple[str, ...] = field(init=False, repr=False)

    def __init__(self, axes: Iterable[tuple[str, int]] | None = None, **sizes: int) -> None:
        items = tuple(axes) if axes is not None else ()
        items = items + tuple(sizes.items())
        object.__setattr__(self, "axes", tuple((str(n), s) for n, s in items))
        self._validate()
        # derived once here (the mesh is immutable): the compiler asks for sizes in its inner loops
        object.__setattr__(self, "_sizes", dict(self.axes))
        object.__setattr__(self, "_names", tuple(n for n, _ in self.axes))

    @classmethod
    def from_items(cls, items: Iterable[tuple[str, int]]) -> Mesh:
        return cls(axes=items)

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """Parse ``"batch=2,model=4"`` (the CLI's ``--mesh`` syntax)."""
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            if not eq:
                raise MeshError(f"mesh item {part!r} in {text!r} is not AXIS=SIZE; write e.g. batch=2,model=4")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise MeshError(f"mesh axis {name.strip()!r} has size {size!r}, which is not an integer") from None
        if not items:
            raise MeshError(f"mesh {text!r} names no axis; write e.g. batch=2,model=4")
        return cls(axes=items)

    def _validate(self) -> None:
        if len(self.axes) > MAX_AXES:
            raise MeshError(f"a mesh of {len(self.axes)} axes ({self.axes[0][0]}, {self.axes[1][0]}, ...): at most "
                            f"{MAX_AXES} are supported; merge axes that tactics never shard apart")
        seen = set()
        for name, size in self.axes:
            if not _AXIS_NAME.match(name):
                raise MeshError(f"mesh axis name {name!r} is not an identifier")
            if name in seen:
                raise MeshError(f"mesh axis {name!r} appears twice in {self}")
            seen.add(name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; every axis needs an integer size >= 1")

    # -- queries -----------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def axis_size(self, name: str) -> int:
        s = self._sizes.get(name)
        if s is not None:
            return s
        raise MeshError(f"axis {name!r} is not in mesh {self}; its axes are {list(self.axis_names)}")

    def group_size(self, axes: Sequence[str]) -> int:
        """Devices in a group over ``axes`` (the product of their sizes)."""
        sizes, n = self._sizes, 1
        for a in axes:
            s = sizes.get(a)
            n *= s if s is not None else self.axis_size(a)  # axis_size raises the MeshError
        return n

    def check_axis(self, name: str) -> str:
        self.axis_size(name)
        return name

    def coords(self, device: int) -> dict[str, int]:
        """Mesh coordinates of a device (row-major numbering)."""
        out = {}
        for name, size in reversed(self.axes):
            device, out[name] = divmod(device, size)
        return {n: out[n] for n in self.axis_names}

    def group_index(self, device: int, axes: Sequence[str]) -> int:
        """Position of ``device`` inside its group over ``axes`` (major→minor in ``axes`` order)."""
        c = self.coords(device)
        i = 0
        for a in axes:
            i = i * self.axis_size(a) + c[a]
        return i

    def groups(self, axes: Sequence[str]) -> list[list[int]]:
        """All device groups over ``axes``; each ordered by mesh coordinates over ``axes``
        (major→minor in the order given). Identical for every backend."""
        return [list(g) for g in _groups(self, tuple(axes))]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and other.axes == self.axes

    def __reduce__(self):   # rebuild through __init__ so the derived tables exist
        return (Mesh, (self.axes,))

    def __hash__(self) -> int:
        return hash(self.axes)

    def to_json(self) -> list[list]:
        return [[n, s] for n, s in self.axes]

    @classmethod
    def from_json(cls, data: list) -> Mesh:
        return cls(axes=[(str(n), int(s)) for n, s in data])

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"

    __repr__ = __str__


@functools.lru_cache(maxsize=256)
def _groups(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """:meth:`Mesh.groups`, kept per (mesh, axes): a mesh is immutable, and pricing asks for the same
    groups on every placement and collective (a study: thousands of times)."""
    others = [n for n in mesh.axis_names if n not in axes]
    result: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for d in range(mesh.size):
        c = mesh.coords(d)
        key = tuple(c[o] for o in others)
        result.setdefault(key, []).append((mesh.group_index(d, axes), d))
    return tuple(tuple(d for _, d in sorted(g)) for _, g in sorted(result.items()))

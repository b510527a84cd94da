"""How one value is laid out over the mesh.

For each tensor dim, the ordered tuple of mesh axes that tile it (major→minor),
plus the tuple of *partial* axes: the value is a pending sum over them (``partial_op``
"sum"; "max"/"min": a pending max or min, what a ``reduce_max`` over a tiled dim leaves).
Axes not mentioned are replicated. Example: ``{0:(batch,), 1:(model,)} partial=()``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partir_emu.core.mesh import Mesh
from partir_emu.errors import ShardingError


@dataclass(frozen=True, slots=True)
class Sharding:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    partial_op: str = "sum"

    def __post_init__(self) -> None:
        if not self.partial and self.partial_op != "sum":     # one spelling of "not partial"
            object.__setattr__(self, "partial_op", "sum")

    @classmethod
    def replicated(cls, ndim: int) -> Sharding:
        return cls(((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def axes(self) -> tuple[str, ...]:
        """Every axis the value uses (tiling then partial)."""
        return tuple(a for d in self.dims for a in d) + self.partial

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def is_replicated(self) -> bool:
        return not any(self.dims) and not self.partial

    def with_dim(self, dim: int, axes: tuple[str, ...]) -> Sharding:
        return Sharding(self.dims[:dim] + (axes,) + self.dims[dim + 1:], self.partial, self.partial_op)

    def with_partial(self, partial: Sequence[str], op: str | None = None) -> Sharding:
        return Sharding(self.dims, tuple(partial), self.partial_op if op is None else op)

    def validate(self, shape: Sequence[int], mesh: Mesh, what: str = "value") -> None:
        if len(shape) != len(self.dims):
            raise ShardingError(f"{what}: sharding {self} has {len(self.dims)} dims but the shape {tuple(shape)} has {len(shape)}")
        seen: set[str] = set()
        for a in self.axes():
            mesh.check_axis(a)
            if a in seen:
                raise ShardingError(f"{what}: mesh axis {a!r} is used twice in sharding {self}; an axis can tile one dim at most")
            seen.add(a)
        for i, (n, d) in enumerate(zip(shape, self.dims)):
            k = mesh.group_size(d)
            if n % k:
                raise ShardingError(f"{what}: dim {i} of size {n} is not divisible by {k} (axes {d} of {mesh}); "
                                    f"choose a size that is a multiple of {k} or another dim")

    def local_shape(self, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        return tuple(n // mesh.group_size(d) for n, d in zip(shape, self.dims))

    def __str__(self) -> str:
        dims = ", ".join(f"{i}:({','.join(d)}{',' if len(d) == 1 else ''})" for i, d in enumerate(self.dims) if d)
        op = "" if self.partial_op == "sum" else f" {self.partial_op}"
        return "{" + dims + "}" + (f" partial{op}=({','.join(self.partial)})" if self.partial else "")

    def to_json(self) -> dict:
        out = {"dims": [list(d) for d in self.dims], "partial": list(self.partial)}
        if self.partial_op != "sum":
            out["partial_op"] = self.partial_op
        return out

    @classmethod
    def from_json(cls, data: dict) -> Sharding:
        return cls(tuple(tuple(d) for d in data["dims"]), tuple(data.get("partial", ())), data.get("partial_op", "sum"))

"""Global arrays ↔ per-device blocks, as a :class:`Sharding` lays them out.

A dim tiled by axes ``(a, b)`` is cut into ``size(a)*size(b)`` equal blocks and
a device holds block ``mesh.group_index(device, (a, b))`` = ``coord_a*size(b)+coord_b``
(major→minor). Axes a sharding does not mention replicate the value. A
*partial* axis means the value is a pending sum over it: :func:`shard` puts the
value on group member 0 of the partial axes and zeros on the others (the
``to_partial`` convention) and :func:`unshard` sums over them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.errors import CollectiveError, EmulationError, ShardingError


def block_slices(sharding: Sharding, mesh: Mesh, device: int, local_shape: Sequence[int]) -> tuple[slice, ...]:
    """Where the device's block sits in the global array."""
    out = []
    for axes, n in zip(sharding.dims, local_shape):
        i = mesh.group_index(device, axes) if axes else 0
        out.append(slice(i * n, (i + 1) * n))
    return tuple(out)


def shard(global_array: np.ndarray, sharding: Sharding, mesh: Mesh, device: int, name: str = "value") -> np.ndarray:
    """The block of ``global_array`` that ``device`` holds (a contiguous copy)."""
    x = np.asarray(global_array)
    sharding.validate(x.shape, mesh, name)
    local = sharding.local_shape(x.shape, mesh)
    block = np.array(x[block_slices(sharding, mesh, device, local)], order="C", copy=True)  # keeps 0-d arrays 0-d
    if sharding.partial and mesh.group_index(device, sharding.partial) != 0:
        return np.zeros_like(block)
    return block


def unshard(locals_by_device: Sequence[np.ndarray], sharding: Sharding, mesh: Mesh,
            name: str = "value") -> np.ndarray:
    """Assemble the global array from every device's block (indexed by device id).

    Replicated copies must be bit-equal, else :class:`EmulationError` naming ``name``.
    Blocks over partial axes are summed in group order.
    """
    if len(locals_by_device) != mesh.size:
        raise ShardingError(f"{name}: unshard needs one block per device of {mesh} ({mesh.size}), "
                            f"got {len(locals_by_device)}")
    blocks = [np.asarray(b) for b in locals_by_device]
    local = blocks[0].shape
    for d, b in enumerate(blocks):
        if b.shape != local or b.dtype != blocks[0].dtype:
            raise EmulationError(f"{name}: device {d} holds {b.dtype.name}{list(b.shape)} but device 0 holds "
                                 f"{blocks[0].dtype.name}{list(local)}")
    if len(local) != sharding.ndim:
        raise ShardingError(f"{name}: sharding {sharding} has {sharding.ndim} dims, the blocks have {len(local)}")
    gshape = tuple(n * mesh.group_size(axes) for n, axes in zip(local, sharding.dims))
    used = set(sharding.axes())
    replicated = [a for a in mesh.axis_names if a not in used]
    # one representative per (block position, partial coordinates); the others must equal it
    reps: dict[tuple, int] = {}
    for d in range(mesh.size):
        c = mesh.coords(d)
        key = tuple(c[a] for a in mesh.axis_names if a not in replicated)
        r = reps.setdefault(key, d)
        if r != d and not _bit_equal(blocks[r], blocks[d]):
            raise EmulationError(
                f"{name}: replicated copies disagree: device {d} {c} differs from device {r} {mesh.coords(r)} "
                f"(mesh axes {replicated} replicate it under sharding {sharding}); the SPMD program lost consistency")
    out = np.zeros(gshape, blocks[0].dtype)
    partial_order = (lambda d: mesh.group_index(d, sharding.partial)) if sharding.partial else None
    for d in sorted(reps.values(), key=partial_order):
        where = block_slices(sharding, mesh, d, local)
        if sharding.partial:
            out[where] += blocks[d]
        else:
            out[where] = blocks[d]
    return out


def _bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


# -- operand layout (the dim the collective works on goes in front, then flat) ----------------
def collective_dims(params: Mapping[str, Any]) -> dict[str, int]:
    """The dims a collective equation's params name (``dim``, ``split_dim``, ``concat_dim``), as
    keywords for the layout functions below and for :func:`partir_emu.collectives.semantics.reference`."""
    return {k: int(params[k]) for k in ("dim", "split_dim", "concat_dim") if k in params}


def flatten_operand(kind: str, x: np.ndarray, *, dim: int = 0, split_dim: int = 0,
                    **_: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    """The flat buffer a schedule works on, and the moved shape to restore from."""
    front = {"all_gather": dim, "reduce_scatter": dim, "all_to_all": split_dim}.get(kind, 0)
    moved = np.moveaxis(x, front, 0) if x.ndim else x
    return np.ascontiguousarray(moved).ravel(), moved.shape


def restore_result(kind: str, r: np.ndarray, x_shape: tuple[int, ...], mshape: tuple[int, ...], p: int,
                   dtype: np.dtype, *, dim: int = 0, split_dim: int = 0, concat_dim: int = 0,
                   **_: Any) -> np.ndarray:
    """Inverse of :func:`flatten_operand` for the collective's result (LocalMesh's layout)."""
    r = r.astype(dtype, copy=False)
    if kind in ("all_reduce", "collective_permute"):
        return r.reshape(x_shape)
    if kind == "all_gather":
        return np.moveaxis(r.reshape((p * mshape[0],) + mshape[1:]), 0, dim)
    if kind == "reduce_scatter":
        return np.moveaxis(r.reshape((mshape[0] // p,) + mshape[1:]), 0, dim)
    if kind == "all_to_all":
        # member j received block j of every member, in group order: (p, s/p, *rest), split_dim in front
        t = np.moveaxis(r.reshape((p, mshape[0] // p) + mshape[1:]), 1, 1 + split_dim)
        t = np.moveaxis(t, 0, concat_dim)
        shape: list[int] = list(t.shape)
        shape[concat_dim:concat_dim + 2] = [shape[concat_dim] * shape[concat_dim + 1]]
        return t.reshape(shape)
    raise CollectiveError(f"unknown collective {kind!r}")

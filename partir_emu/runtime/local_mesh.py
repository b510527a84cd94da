"""The in-process mesh: every device of the mesh runs in this process, in lockstep.

``LocalMesh(mesh, algorithm).run(spmd, global_inputs)`` shards the global
inputs by ``spmd.in_shardings`` (:mod:`layout`), runs the program with
:func:`engine.run_spmd`, and reassembles the global outputs by
``spmd.out_shardings``.

Each collective runs once per device group ``mesh.groups(axes)`` (members in
mesh-coordinate order). With a schedule algorithm (``ring``, ``bidir_ring``,
``recursive``, ``torus``, ``hierarchical``) the data moves exactly as
``partir_emu.collectives`` schedules it, on flat buffers: the collective's dim
is moved to the front so that its blocks are contiguous. ``algorithm='direct'``
applies the plain numpy meaning instead (concatenate / reduce in group order),
as a reference.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Eqn
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArgumentError, CollectiveError, EmulationError, MeshError
from partir_emu.runtime.engine import run_spmd
from partir_emu.runtime.layout import flatten_operand, restore_result, shard, unshard

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@dataclass(frozen=True)
class RunResult:
    outputs: list[np.ndarray]            # global outputs, in program order
    peak_bytes_per_device: list[int]     # by device id (engine.py's convention)
    wall_s: float                        # shard + run + unshard


class LocalMesh:
    """Run SPMD programs on all devices of ``mesh`` inside this process."""

    def __init__(self, mesh: Mesh, algorithm: str = "ring", *, devices_per_node: int | None = None) -> None:
        if algorithm != "direct":
            from partir_emu.collectives.algorithms import ALGORITHMS
            if algorithm not in ALGORITHMS:
                raise CollectiveError(f"unknown collective algorithm {algorithm!r}; use 'direct' or one of {ALGORITHMS}")
        self.mesh = mesh
        self.algorithm = algorithm
        self.devices_per_node = devices_per_node

    def run(self, spmd: SpmdProgram, global_inputs: Sequence[Any]) -> RunResult:
        t0 = time.perf_counter()
        mesh = self.mesh
        if spmd.mesh != mesh:
            raise MeshError(f"the SPMD program was lowered for {spmd.mesh} but this LocalMesh is {mesh}; "
                            f"create LocalMesh({spmd.mesh})")
        arrays = check_global_inputs(spmd, global_inputs)
        local = {d: [shard(x, s, mesh, d, name) for x, s, name in zip(arrays, spmd.in_shardings, spmd.input_names)]
                 for d in range(mesh.size)}
        res = run_spmd(spmd, range(mesh.size), local, self._collective)
        outputs = [unshard([res.outputs[d][k] for d in range(mesh.size)], s, mesh, name)
                   for k, (s, name) in enumerate(zip(spmd.out_shardings, spmd.output_names))]
        for out, name, shape in zip(outputs, spmd.output_names, spmd.global_out_shapes):
            if out.shape != tuple(shape):
                raise EmulationError(f"output {name!r} assembled to shape {list(out.shape)}, but the program "
                                     f"declares the global shape {list(shape)}")
        return RunResult(outputs, [res.peak_bytes[d] for d in range(mesh.size)], time.perf_counter() - t0)

    # -- collectives ----------------------------------------------------------------
    def _collective(self, eqn: Eqn, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        axes = tuple(eqn.params["axes"])
        group_shape = tuple(self.mesh.axis_size(a) for a in axes)
        out: dict[int, np.ndarray] = {}
        for group in self.mesh.groups(axes):
            bufs = [operands[d] for d in group]
            if self.algorithm == "direct" or len(group) == 1:
                res = direct_collective(eqn.prim, bufs, **eqn.params)
            else:
                res = scheduled_collective(eqn.prim, bufs, group_shape, self.algorithm,
                                           devices_per_node=self.devices_per_node, **eqn.params)
            out.update(zip(group, res))
        return out


def check_global_inputs(spmd: SpmdProgram, inputs: Sequence[Any]) -> list[np.ndarray]:
    """The global inputs as arrays, checked against the program's names, shapes and dtypes."""
    names = spmd.input_names
    if len(inputs) != len(names):
        raise ArgumentError(f"the program takes {len(names)} inputs {list(names)}, got {len(inputs)}")
    out = []
    for name, shape, v, x in zip(names, spmd.global_in_shapes, spmd.program.inputs, inputs):
        arr = np.asarray(x)
        if arr.shape != tuple(shape) or arr.dtype != np_dtype(v.dtype):
            raise ArgumentError(f"input {name!r}: expected {v.dtype}{list(shape)}, got {arr.dtype.name}{list(arr.shape)}")
        out.append(arr)
    return out


def direct_collective(kind: str, bufs: Sequence[np.ndarray], *, dim: int = 0, op: str = "sum",
                      split_dim: int = 0, concat_dim: int = 0, **_: Any) -> list[np.ndarray]:
    """The numpy meaning of a collective over one group (members in group order)."""
    p = len(bufs)
    if kind == "all_gather":
        cat = np.concatenate(bufs, axis=dim)
        return [cat] * p
    if kind == "all_reduce":
        return [functools.reduce(_reduce_op(op), bufs)] * p
    if kind == "reduce_scatter":
        return [np.ascontiguousarray(b) for b in np.split(functools.reduce(np.add, bufs), p, axis=dim)]
    if kind == "all_to_all":
        blocks = [np.split(b, p, axis=split_dim) for b in bufs]
        return [np.concatenate([blocks[i][j] for i in range(p)], axis=concat_dim) for j in range(p)]
    raise CollectiveError(f"unknown collective {kind!r}")


def scheduled_collective(kind: str, bufs: Sequence[np.ndarray], group_shape: tuple[int, ...], algorithm: str, *,
                         dim: int = 0, op: str = "sum", split_dim: int = 0, concat_dim: int = 0,
                         devices_per_node: int | None = None, **_: Any) -> list[np.ndarray]:
    """Run a collective over one group through its schedule, on flat buffers."""
    from partir_emu.collectives.algorithms import build_schedule
    from partir_emu.collectives.local import run_schedule

    p = len(bufs)
    x0 = bufs[0]
    params = {"dim": dim, "split_dim": split_dim, "concat_dim": concat_dim}
    flat = [flatten_operand(kind, b, **params) for b in bufs]
    nbytes = x0.nbytes * (p if kind == "all_gather" else 1)
    sched = build_schedule(kind, group_shape, nbytes, algorithm, itemsize=x0.dtype.itemsize,
                           devices_per_node=devices_per_node)
    res = run_schedule(sched, [f for f, _ in flat], op=op if kind == "all_reduce" else "sum")
    return [restore_result(kind, r, x0.shape, flat[0][1], p, x0.dtype, **params) for r in res]


def _reduce_op(op: str) -> np.ufunc:
    try:
        return _REDUCE[op]
    except KeyError:
        raise CollectiveError(f"all_reduce op {op!r} is not one of {tuple(_REDUCE)}") from None

"""The in-process mesh: every device of the mesh runs in this process, in lockstep.

``LocalMesh(mesh, algorithm).run(spmd, global_inputs)`` shards the global
inputs by ``spmd.in_shardings`` (:mod:`layout`), runs the program with
:func:`engine.run_spmd`, and reassembles the global outputs by
``spmd.out_shardings``. Loop equations (their bodies' collectives included) run in the engine,
once per iteration, through the same collective callback.

Each collective runs once per device group ``mesh.groups(axes)`` (members in
mesh-coordinate order). With a schedule algorithm (``ring``, ``bidir_ring``,
``recursive``, ``torus``, ``hierarchical``) the data moves exactly as
``partir_emu.collectives`` schedules it, on flat buffers: the collective's dim
is moved to the front so that its blocks are contiguous; the mesh's
:class:`~partir_emu.collectives.local.LocalExecutor` keeps each schedule's plan.
``algorithm='direct'`` applies the plain numpy meaning instead
(:func:`partir_emu.collectives.semantics.reference`: concatenate / reduce in
group order). ``kernels`` (``"blas"`` or ``"exact"``, :mod:`partir_emu.runtime.kernels`) is the
matmul kernel; the MPI ranks run the same one, on one BLAS thread, so the two meshes compute
bit-identical results on any CPU.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import LocalExecutor
from partir_emu.collectives.semantics import reference
from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Eqn
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram, permute_pairs
from partir_emu.errors import ArgumentError, CollectiveError, EmulationError, MeshError
from partir_emu.runtime.engine import run_spmd
from partir_emu.runtime.kernels import check_kernels
from partir_emu.runtime.layout import collective_dims, flatten_operand, restore_result, shard, unshard


@dataclass(frozen=True)
class RunResult:
    outputs: list[np.ndarray]            # global outputs, in program order
    peak_bytes_per_device: list[int]     # by device id (engine.py's convention)
    wall_s: float                        # shard + run + unshard


class LocalMesh:
    """Run SPMD programs on all devices of ``mesh`` inside this process."""

    def __init__(self, mesh: Mesh, algorithm: str = "ring", *, devices_per_node: int | None = None,
                 kernels: str = "blas") -> None:
        if algorithm != "direct" and algorithm not in ALGORITHMS:
            raise CollectiveError(f"unknown collective algorithm {algorithm!r}; use 'direct' or one of {ALGORITHMS}")
        self.mesh = mesh
        self.algorithm = algorithm
        self.devices_per_node = devices_per_node
        self.kernels = check_kernels(kernels)   # the matmul kernel (runtime/kernels.py)
        self.executor = LocalExecutor()  # keeps the plan of each schedule run (the same one for every group)

    def run(self, spmd: SpmdProgram, global_inputs: Sequence[Any]) -> RunResult:
        t0 = time.perf_counter()
        mesh = self.mesh
        if spmd.mesh != mesh:
            raise MeshError(f"the SPMD program was lowered for {spmd.mesh} but this LocalMesh is {mesh}; "
                            f"create LocalMesh({spmd.mesh})")
        arrays = check_global_inputs(spmd, global_inputs)
        local = {d: [shard(x, s, mesh, d, name) for x, s, name in zip(arrays, spmd.in_shardings, spmd.input_names)]
                 for d in range(mesh.size)}
        res = run_spmd(spmd, range(mesh.size), local, self._collective, kernels=self.kernels)
        outputs = [unshard([res.outputs[d][k] for d in range(mesh.size)], s, mesh, name)
                   for k, (s, name) in enumerate(zip(spmd.out_shardings, spmd.output_names))]
        for out, name, shape in zip(outputs, spmd.output_names, spmd.global_out_shapes):
            if out.shape != tuple(shape):
                raise EmulationError(f"output {name!r} assembled to shape {list(out.shape)}, but the program "
                                     f"declares the global shape {list(shape)}")
        return RunResult(outputs, [res.peak_bytes[d] for d in range(mesh.size)], time.perf_counter() - t0)

    # -- collectives ----------------------------------------------------------------
    def _collective(self, eqn: Eqn, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        kind, axes, dims = eqn.prim, tuple(eqn.params["axes"]), collective_dims(eqn.params)
        op = eqn.params.get("op", "sum") if kind == "all_reduce" else "sum"
        group_shape = tuple(self.mesh.axis_size(a) for a in axes)
        perm = permute_pairs(eqn.params, self.mesh.group_size(axes)) if kind == "collective_permute" else None
        out: dict[int, np.ndarray] = {}
        for group in self.mesh.groups(axes):
            bufs = [operands[d] for d in group]
            if self.algorithm == "direct" or len(group) == 1:
                res = reference(kind, bufs, op, perm, **dims)
            else:
                res = self._scheduled(kind, bufs, group_shape, op, dims, perm)
            out.update(zip(group, res))
        return out

    def _scheduled(self, kind: str, bufs: Sequence[np.ndarray], group_shape: tuple[int, ...], op: str,
                   dims: dict[str, int], perm: tuple[tuple[int, int], ...] | None = None) -> list[np.ndarray]:
        """Run a collective over one group through its schedule, on flat buffers."""
        p = len(bufs)
        x0 = bufs[0]
        flat = [flatten_operand(kind, b, **dims) for b in bufs]
        nbytes = x0.nbytes * (p if kind == "all_gather" else 1)
        sched = build_schedule(kind, group_shape, nbytes, self.algorithm, itemsize=x0.dtype.itemsize,
                               devices_per_node=self.devices_per_node, permutation=perm)
        res = self.executor.run(sched, [f for f, _ in flat], op)
        return [restore_result(kind, r, x0.shape, flat[0][1], p, x0.dtype, **dims) for r in res]


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

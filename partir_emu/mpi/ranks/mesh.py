"""The MPI mesh: ``R`` ranks × ``k`` devices per rank, real MPI traffic for every collective.

Placement: rank ``r`` hosts devices ``[r*k, (r+1)*k)``. Devices are numbered
row-major over the mesh axes (:class:`~partir_emu.core.mesh.Mesh`), so the
minor axes are rank-local: with ``Mesh(batch=4, model=2)`` and ``k=2`` every
``model`` collective is a set of in-rank copies and every ``batch`` collective
crosses ranks.

A rank runs its ``k`` devices in lockstep with :func:`engine.run_spmd`; the
collective callback handles every group ``mesh.groups(axes)`` (group order =
mesh-coordinate order, as in :class:`~partir_emu.runtime.local_mesh.LocalMesh`)
that contains a local device:

- schedule algorithms (``ring``, ``bidir_ring``, ``recursive``, ``torus``,
  ``hierarchical``): the operand's collective dim is moved to the front and
  flattened (exactly as :class:`~partir_emu.runtime.local_mesh.LocalMesh` does), the
  schedule of :mod:`partir_emu.collectives.algorithms` runs through
  :meth:`partir_emu.mpi.ranks.collectives.MpiCollectives.run_schedules` (all groups of one
  collective at once; transfers between devices of one rank are copies, the
  others MPI messages), and the result is restored. The arithmetic and its
  order are the schedule's, so the outputs equal LocalMesh's with the same
  algorithm **bit for bit**;
- ``native``: :meth:`partir_emu.mpi.ranks.collectives.MpiCollectives.run_native` (the MPI
  library's own collective on a cached sub-communicator of the group's
  ranks); equal to LocalMesh up to rounding.

Before each communicating collective every rank takes part in one tiny
``Iallreduce`` (MAX over ``[sig, -sig]``, i.e. max and min at once) of a
signature ``(sequence number, eqn index, prim, dtype, shape, axes, params)``:
ranks that disagree (a different program, a skipped collective, a different
shape) stop with a :class:`CollectiveError` naming the op instead of hanging.
Inside a loop body the eqn index is the loop's (the sequence number tells the iterations
apart); the :class:`~partir_emu.runtime.engine.Position` the engine keeps names the op in
progress reports and errors (``op 2 of the loop body at op 5, iteration 3``).

Waiting never blocks inside MPI (MPICH busy-polls, which starves the other
ranks on a small box): non-blocking calls + ``Test`` + a short sleep.
Only buffer-based (uppercase) mpi4py calls are used; nothing is pickled.

**Message trace.** With ``trace=True`` every transfer the schedule executor
performs is recorded as a row ``(coll, step, src, dst, bytes)`` (``coll`` =
equation index of the collective in the SPMD program, in the program unrolled by
:func:`partir_emu.core.loops.unroll` if it has loops, so each iteration's run of a body
collective is its own ``coll``; ``step`` = schedule
step, ``src``/``dst`` = global device ids, ``bytes`` = payload); rows are
recorded by the rank hosting ``src`` (in-rank copies included) and gathered to
rank 0 with :meth:`MpiMesh.gather_trace`. Native collectives move data inside
the MPI library: they record no rows. The file format is
:mod:`partir_emu.core.msgtrace`.

This module imports mpi4py (which initializes MPI) but never jax.
"""
from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.semantics import reference
from partir_emu.core.ir import Eqn
from partir_emu.core.loops import has_loops, unroll
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram, permute_pairs
from partir_emu.errors import CollectiveError, EmulationError, MeshError
from partir_emu.mpi.faults import FaultInjector
from partir_emu.mpi.jobs import MPI_ALGORITHMS
from partir_emu.mpi.ranks.collectives import MpiCollectives
from partir_emu.mpi.ranks.wait import wait_all
from partir_emu.runtime.engine import EngineResult, Position, run_spmd
from partir_emu.runtime.kernels import check_kernels
from partir_emu.runtime.layout import block_slices, collective_dims, flatten_operand, restore_result, shard
from partir_emu.runtime.progress import OpContext, describe_op


def _representatives(sharding: Sharding, mesh: Mesh) -> list[int]:
    """Per device, the first device holding the same block (same coordinates on every axis the
    sharding tiles or sums over): the one whose copy is gathered."""
    used = [a for a in mesh.axis_names if a in set(sharding.axes())]
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(mesh.coords(d)[a] for a in used), d) for d in range(mesh.size)]


def _digest(block: np.ndarray) -> int:
    """A 64-bit digest of a block's bytes (CRC-32 and Adler-32): replicas must have equal ones."""
    raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8).data     # its bytes, as a memoryview
    return zlib.crc32(raw) << 32 | zlib.adler32(raw)


def _assemble(blocks: Mapping[int, np.ndarray], sharding: Sharding, mesh: Mesh) -> np.ndarray:
    """The global array from one block per representative device, as :func:`unshard` assembles it
    (partial blocks summed in group order)."""
    b0 = next(iter(blocks.values()))
    out = np.zeros(tuple(n * mesh.group_size(axes) for n, axes in zip(b0.shape, sharding.dims)), b0.dtype)
    order = sorted(blocks, key=(lambda d: mesh.group_index(d, sharding.partial)) if sharding.partial else None)
    for d in order:
        where = block_slices(sharding, mesh, d, b0.shape)
        if sharding.partial:
            out[where] += blocks[d]
        else:
            out[where] = blocks[d]
    return out


# -- the mesh -------------------------------------------------------------------------------
_PRIM_CODE = {p: i for i, p in enumerate(COMM_PRIMS)}


class MpiMesh:
    """This rank's share of an ``R × k`` device mesh over ``comm`` (``R = comm.Get_size()``).

    ``progress(context)`` is called when the rank reaches a communicating collective, once its
    participants agree, and when it is done (``context.state``); ``faults`` is the test hook
    (:mod:`partir_emu.mpi.faults`; the default injects nothing).
    """

    def __init__(self, comm: MPI.Intracomm, mesh: Mesh, devices_per_rank: int, algorithm: str = "ring", *,
                 devices_per_node: int | None = None, check: bool = True, timeout_s: float | None = 300.0,
                 trace: bool = False, progress: Callable[[OpContext], None] | None = None,
                 faults: FaultInjector | None = None, kernels: str = "blas") -> None:
        if algorithm not in MPI_ALGORITHMS:
            raise CollectiveError(f"unknown collective algorithm {algorithm!r} for the MPI mesh; "
                                  f"use one of {MPI_ALGORITHMS}")
        k = int(devices_per_rank)
        nranks = comm.Get_size()
        if k < 1 or nranks * k != mesh.size:
            raise MeshError(f"{mesh} has {mesh.size} devices but {nranks} ranks × {k} devices per rank = "
                            f"{nranks * k}; launch {mesh.size // k if k >= 1 and mesh.size % k == 0 else '?'} "
                            f"ranks, or set --devices-per-rank {mesh.size // nranks if mesh.size % nranks == 0 else '?'}")
        self.comm, self.mesh, self.k, self.algorithm = comm, mesh, k, algorithm
        self.rank, self.nranks = comm.Get_rank(), nranks
        self.devices = tuple(range(self.rank * k, (self.rank + 1) * k))
        self.devices_per_node, self.check, self.timeout_s = devices_per_node, check, timeout_s
        self.tracing = trace
        self.progress = progress
        self.faults = faults if faults is not None else FaultInjector()
        self.kernels = check_kernels(kernels)
        self.context = OpContext(devices=self.devices)
        self.collectives = MpiCollectives(comm)  # keeps plans, buffers and sub-communicators until close()
        self._groups: dict[tuple[str, ...], list[list[int]]] = {}
        self._trace_parts: list[np.ndarray] = []
        self._position = Position()               # where run_spmd is (kept by the engine)
        self._coll_ids: list[int] | None = None   # tracing a program with loops: per seq, its unrolled eqn index
        self._seq = 0
        self._tag = 0

    def rank_of(self, device: int) -> int:
        return device // self.k

    def local_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """The groups over ``axes`` that contain a device of this rank (in mesh.groups order)."""
        g = self._groups.get(axes)
        if g is None:
            lo, hi = self.devices[0], self.devices[-1]
            every = self.mesh.groups(axes)
            g = [grp for grp in every if any(lo <= d <= hi for d in grp)]
            self._groups[axes] = g
            if self.algorithm == "native" and self.rank == 0 and len({self._layout(grp) for grp in every}) > 1:
                print(f"partir-emu: warning: with {self.k} devices per rank the groups over {axes} are not laid out "
                      "alike on the ranks; native MPI sums them in different orders, so values replicated across "
                      "those groups may differ in the last bit (a schedule algorithm is bit-exact)", file=sys.stderr)
        return g

    def _layout(self, group: Sequence[int]) -> tuple[int, ...]:
        """How a group's members fall on ranks: the run lengths of equal ranks, in group order."""
        runs: list[int] = []
        prev = None
        for d in group:
            r = self.rank_of(d)
            if r == prev:
                runs[-1] += 1
            else:
                runs.append(1)
            prev = r
        return tuple(runs)

    # -- inputs / outputs ------------------------------------------------------------------
    def shard_inputs(self, spmd: SpmdProgram, global_inputs: Sequence[np.ndarray]) -> dict[int, list[np.ndarray]]:
        """This rank's devices' input blocks, cut from the global inputs."""
        return {d: [shard(x, s, self.mesh, d, name)
                    for x, s, name in zip(global_inputs, spmd.in_shardings, spmd.input_names)]
                for d in self.devices}

    def run(self, spmd: SpmdProgram, local_inputs: Mapping[int, Sequence[np.ndarray]]) -> EngineResult:
        """Run ``spmd`` on this rank's devices (every rank of ``comm`` must call this)."""
        if spmd.mesh != self.mesh:
            raise MeshError(f"the SPMD program was lowered for {spmd.mesh} but this MpiMesh is {self.mesh}")
        self._position = Position()
        self._coll_ids = None
        if self.tracing and has_loops(spmd.program):     # the trace numbers each executed collective
            self._coll_ids = [i for i, e in enumerate(unroll(spmd.program).eqns) if e.prim in COMM_PRIMS]
        self._seq = 0
        return run_spmd(spmd, self.devices, local_inputs, self._collective, self._position, kernels=self.kernels)

    def gather_outputs(self, spmd: SpmdProgram, result: EngineResult) -> tuple[list[np.ndarray] | None, list[int] | None]:
        """Global outputs and per-device peak bytes on rank 0 (``(None, None)`` elsewhere).

        Each distinct block travels once: per output, only its representative devices (the first
        device of each set of replicas, as :func:`unshard` picks them) send their block; every device
        sends a 64-bit digest of its block, so rank 0 still refuses replicas that differ."""
        mesh, k, names = self.mesh, self.k, spmd.output_names
        mine = [[np.asarray(result.outputs[d][j]) for d in self.devices] for j in range(len(names))]
        reps = [_representatives(sh, mesh) for sh in spmd.out_shardings]
        sizes = [bl[0].nbytes for bl in mine]
        send = np.concatenate([np.ascontiguousarray(b).reshape(-1).view(np.uint8) for j, bl in enumerate(mine)
                               for d, b in zip(self.devices, bl) if reps[j][d] == d] + [np.zeros(0, np.uint8)])
        digests = np.array([[_digest(b) for b in bl] for bl in mine], np.uint64).T.copy()  # [device, output]
        peaks = np.array([result.peak_bytes[d] for d in self.devices], np.int64)
        root = self.rank == 0
        counts = [sum(n * sum(rep[d] == d for d in range(r * k, (r + 1) * k)) for rep, n in zip(reps, sizes))
                  for r in range(self.nranks)]
        recv = np.empty(sum(counts), np.uint8) if root else None
        drecv = np.empty((mesh.size, len(names)), np.uint64) if root else None
        precv = np.empty(mesh.size, np.int64) if root else None
        reqs = [self.comm.Igatherv([send, MPI.BYTE], [recv, (counts, np.cumsum([0] + counts[:-1]).tolist()), MPI.BYTE]
                                   if root else None, root=0),
                self.comm.Igather([digests, MPI.UINT64_T], [drecv, MPI.UINT64_T] if root else None, root=0),
                self.comm.Igather([peaks, MPI.INT64_T], [precv, MPI.INT64_T] if root else None, root=0)]
        wait_all(reqs, self.timeout_s, "the output gather to rank 0", bulk=True)
        if not root:
            return None, None
        # why: the three buffers are allocated on the root, which this is
        assert recv is not None and drecv is not None and precv is not None
        blocks: list[dict[int, np.ndarray]] = [{} for _ in names]
        off = 0
        for r in range(self.nranks):  # the order the ranks packed them in
            for j, b0 in enumerate(bl[0] for bl in mine):
                for d in range(r * k, (r + 1) * k):
                    if reps[j][d] == d:
                        blocks[j][d] = recv[off:off + sizes[j]].view(b0.dtype).reshape(b0.shape)
                        off += sizes[j]
        outputs = []
        for j, (name, sh) in enumerate(zip(names, spmd.out_shardings)):
            bad = np.flatnonzero(drecv[:, j] != drecv[reps[j], j])
            if len(bad):
                d, r0 = int(bad[0]), reps[j][int(bad[0])]
                raise EmulationError(
                    f"{name}: replicated copies disagree: device {d} {mesh.coords(d)} differs from device {r0} "
                    f"{mesh.coords(r0)} (mesh axes {[a for a in mesh.axis_names if a not in sh.axes()]} replicate "
                    f"it under sharding {sh}); the SPMD program lost consistency")
            outputs.append(_assemble(blocks[j], sh, mesh))
        return outputs, [int(x) for x in precv]

    def gather_trace(self) -> np.ndarray | None:
        """All ranks' trace rows ``(coll, step, src, dst, bytes)`` on rank 0 (int64, sorted); None elsewhere."""
        rows = np.concatenate(self._trace_parts) if self._trace_parts else np.zeros((0, 5), np.int64)
        rows = np.ascontiguousarray(rows, np.int64)
        counts = np.empty(self.nranks, np.int64) if self.rank == 0 else None
        n = np.array([rows.size], np.int64)
        wait_all([self.comm.Igather([n, MPI.INT64_T], [counts, MPI.INT64_T] if counts is not None else None, root=0)],
                 self.timeout_s, "the message-trace gather")
        if self.rank == 0:
            assert counts is not None   # why: allocated on rank 0, which this is
            allrows = np.empty(int(counts.sum()), np.int64)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            recvspec = [allrows, (counts.tolist(), displs.tolist()), MPI.INT64_T]
        else:
            recvspec = None
        wait_all([self.comm.Igatherv([rows.ravel(), MPI.INT64_T], recvspec, root=0)], self.timeout_s,
                 "the message-trace gather", bulk=True)
        self._trace_parts = []
        if self.rank != 0:
            return None
        table = allrows.reshape(-1, 5)
        return table[np.lexsort((table[:, 3], table[:, 2], table[:, 1], table[:, 0]))]

    def close(self) -> None:
        self.collectives.free()

    # -- collectives -----------------------------------------------------------------------
    def _collective(self, eqn: Eqn, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        out = self._run_collective(eqn, operands)
        self._set_state("computing")
        return out

    def _set_state(self, state: str) -> None:
        self.context.state = state
        if self.progress is not None:
            self.progress(self.context)

    def _run_collective(self, eqn: Eqn, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        pos = self._position
        index, top = pos.index, pos.top
        fault = self.faults.at(self.rank, top)
        fault.reached()
        ctx = self.context
        ctx.index, ctx.eqn, ctx.seq, ctx.loops = index, eqn, self._seq, tuple(pos.loops)
        coll = self._coll_ids[self._seq] if self._coll_ids is not None else index
        self._seq += 1
        self._set_state("waiting for the other ranks")
        fault.entered(self.algorithm == "native")
        axes = tuple(eqn.params["axes"])
        x0 = operands[self.devices[0]]
        if self.check:
            self._agree(top, eqn, x0, axes, fault.mismatch)
        self._set_state("moving data")
        kind, params = eqn.prim, dict(eqn.params)
        groups = self.local_groups(axes)
        p = len(groups[0])
        perm = permute_pairs(params, p) if kind == "collective_permute" else None
        if p == 1:
            return {g[0]: reference(kind, [operands[g[0]]], "sum", perm, **collective_dims(params))[0] for g in groups}
        flat = {d: flatten_operand(kind, x, **params) for d, x in operands.items()}
        op = params.get("op", "sum") if kind == "all_reduce" else "sum"
        results: dict[int, np.ndarray] = {}
        if self.algorithm == "native":
            for g in groups:
                local = {pos: flat[d][0] for pos, d in enumerate(g) if d in flat}
                res = self.collectives.run_native(kind, g, self.rank_of, local, op, tag_base=self._next_tag(2),
                                                  timeout_s=self.timeout_s, permutation=perm)
                for slot, r in res.items():
                    results[g[slot]] = r
        else:
            group_shape = tuple(self.mesh.axis_size(a) for a in axes)
            nbytes = x0.nbytes * (p if kind == "all_gather" else 1)
            sched = build_schedule(kind, group_shape, nbytes, self.algorithm, itemsize=x0.dtype.itemsize,
                                   devices_per_node=self.devices_per_node, permutation=perm)
            jobs = [(sched, g, {pos: flat[d][0] for pos, d in enumerate(g) if d in flat}) for g in groups]
            trace: list | None = [] if self.tracing else None
            res_list = self.collectives.run_schedules(jobs, self.rank_of, op, self._next_tag(len(sched.steps) + 2),
                                                      trace, timeout_s=self.timeout_s, on_step=fault.step)
            fault.done()
            for g, res in zip(groups, res_list):
                for slot, r in res.items():
                    results[g[slot]] = r
            if self.tracing and trace:
                t = np.asarray(trace, np.int64).reshape(-1, 4)
                self._trace_parts.append(np.concatenate([np.full((len(t), 1), coll, np.int64), t], axis=1))
        return {d: restore_result(kind, results[d], x.shape, flat[d][1], p, x.dtype, **params)
                for d, x in operands.items()}

    def _next_tag(self, width: int) -> int:
        t = self._tag
        self._tag += width
        return t

    def _agree(self, index: int, eqn: Eqn, x: np.ndarray, axes: tuple[str, ...], corrupt: bool) -> None:
        """Every rank checks it runs the same collective as every other (max and min in one Iallreduce)."""
        shape = tuple(x.shape) + ((1 << 20,) if corrupt else ())
        fields = ("sequence number", "eqn index", "primitive", "dtype", "shape", "axes", "params")
        params = repr(sorted((k, v) for k, v in eqn.params.items() if k != "axes"))
        sig = np.array([self._seq - 1, index, _PRIM_CODE.get(eqn.prim, -1), x.dtype.num,
                        zlib.crc32(repr(shape).encode()), zlib.crc32(repr(axes).encode()),
                        zlib.crc32(params.encode())], np.int64)
        buf = np.concatenate([sig, -sig])
        out = np.empty_like(buf)
        wait_all([self.comm.Iallreduce([buf, MPI.INT64_T], [out, MPI.INT64_T], MPI.MAX)], self.timeout_s,
                 lambda: f"the agreement check of {describe_op(self.context.index, eqn, self.context.loops)}")
        hi, lo = out[:len(sig)], -out[len(sig):]
        bad = [f for f, a, b in zip(fields, hi, lo) if a != b]
        if bad:
            who = self._disagreement(index, eqn, x.dtype, shape, axes, sig)
            raise CollectiveError(
                f"the ranks disagree on communicating collective #{self._seq - 1} (differ: {', '.join(bad)}): "
                f"{who} — every rank must run the same SPMD program")

    def _disagreement(self, index: int, eqn: Eqn, dtype: np.dtype, shape: tuple[int, ...], axes: tuple[str, ...],
                      sig: np.ndarray) -> str:
        """Which ranks run what (every rank has found the mismatch, so all take part)."""
        nd = 8
        rec = np.array([index, _PRIM_CODE.get(eqn.prim, -1), dtype.num, len(shape)]
                       + [int(n) for n in shape[:nd]] + [-1] * (nd - min(len(shape), nd)) + [int(sig[5])], np.int64)
        allrec = np.empty(rec.size * self.nranks, np.int64)
        wait_all([self.comm.Iallgather([rec, MPI.INT64_T], [allrec, MPI.INT64_T])], self.timeout_s,
                 "the mismatch report")
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, rank_row in enumerate(allrec.reshape(self.nranks, rec.size).tolist()):
            groups.setdefault(tuple(rank_row), []).append(r)
        names: dict[int, str] = {v.num: v.name for v in map(np.dtype, (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                                         np.uint16, np.uint32, np.uint64, np.float16, np.float32,
                                                         np.float64, np.complex64, np.complex128))}
        parts = []
        for row, ranks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            idx, prim, dnum, ndim = row[:4]
            shp = list(row[4:4 + min(ndim, nd)])
            prim_name = COMM_PRIMS[prim] if 0 <= prim < len(COMM_PRIMS) else "?"
            ax = str(axes) if row[-1] == int(sig[5]) else "other axes"
            rs = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks incl. {ranks[0]}"
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {rs} run{'' if len(ranks) > 1 else 's'} op {idx} "
                         f"{prim_name} of {names.get(dnum, f'dtype#{dnum}')}{shp} over {ax}")
        return "; ".join(parts)

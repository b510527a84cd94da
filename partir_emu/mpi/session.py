"""The user's own step on MPI: ``pe.jit(..., backend="mpi")`` in a script under ``mpiexec``.

::

    # train.py, run with: mpiexec -n 4 python train.py
    import partir_emu.mpi as pmpi            # no jax: every rank may import this
    if pmpi.is_root():
        import jax.numpy as jnp
        import partir_emu as pe
        step = ...
        f = pe.jit(step, mesh=pe.Mesh(batch=8), schedule=[...], backend="mpi", devices_per_rank=2)
        loss = f(w, x)                       # rank 0 traces and lowers once, every call runs on all ranks
    else:
        results = pmpi.serve()               # this rank's devices, for each of rank 0's calls

Rank 0 traces and lowers (only it imports jax). For each call it broadcasts a command, the
program when it is new (its JSON text, as ``partir-emu run`` under ``mpirun`` does) and the
global inputs (a JSON header of dtypes and shapes, then the raw bytes: no pickle); every rank
then runs its devices (:func:`partir_emu.mpi.ranks.worker.run_job`, the same code as the CLI's
ranks). The global outputs come back to rank 0; with ``outputs="all"`` (the default) rank 0
broadcasts them too, and :func:`serve` returns them on the other ranks, one list per call.
When rank 0's script ends (``atexit``) or calls :func:`finish`, it sends *stop* and ``serve``
returns. Every wait has a timeout: a rank whose partner died or hangs raises instead of hanging.
"""
from __future__ import annotations

import atexit
import json
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import EmulationError, MeshError
from partir_emu.mpi.ranks import worker
from partir_emu.mpi.ranks.wait import bcast_bytes, wait_all
from partir_emu.runtime.kernels import check_kernels

_STOP, _RUN = 0, 1
DEFAULT_TIMEOUT_S = 300.0
OUTPUTS = ("all", "root")

__all__ = ["is_root", "rank", "size", "run", "serve", "finish", "DEFAULT_TIMEOUT_S"]


class _Session:
    """This process's side of the protocol: the guard (watched by a sentinel), the last program."""

    def __init__(self, timeout_s: float | None) -> None:
        self.comm = MPI.COMM_WORLD
        self.timeout_s = timeout_s
        self.guard = worker.guard_under_mpirun(self.comm, timeout_s)
        self.program: SpmdProgram | None = None
        self.program_id = -1          # rank 0: id() of the program last sent
        self.stopped = False


_SESSION: _Session | None = None


def _session(timeout_s: float | None) -> _Session:
    global _SESSION
    if _SESSION is None:
        _SESSION = _Session(timeout_s)
        if _SESSION.comm.Get_rank() == 0:
            atexit.register(finish)
    return _SESSION


def rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def size() -> int:
    return MPI.COMM_WORLD.Get_size()


def is_root() -> bool:
    """True on rank 0, the rank that traces and lowers (and the only one that imports jax)."""
    return rank() == 0


# -- bytes over Ibcast (a length, then the bytes), every wait bounded ------------------------------------
def _bcast_bytes(s: _Session, data: bytes | None, what: str) -> bytes:
    return bcast_bytes(s.comm, data, s.timeout_s, what)


def _encode_arrays(arrays: Sequence[np.ndarray]) -> bytes:
    """A JSON header line (dtype name and shape of each array), then their bytes back to back."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = json.dumps([{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *(a.tobytes() for a in arrays)])


def _decode_arrays(data: bytes) -> list[np.ndarray]:
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    out, at = [], 8 + n
    for h in head:
        dt = np_dtype(h["dtype"])
        count = int(np.prod(h["shape"], dtype=np.int64))
        out.append(np.frombuffer(data, dt, count, at).reshape(h["shape"]).copy())
        at += count * dt.itemsize
    if at != len(data):
        raise EmulationError(f"rank {rank()}: the arrays from rank 0 have {len(data)} bytes, their header says {at}")
    return out


def _command(s: _Session, header: np.ndarray | None) -> np.ndarray:
    """Rank 0 sends ``[op, new_program, devices_per_rank, outputs_to_all, options length]``; all get it."""
    buf = header if header is not None else np.zeros(5, np.int64)
    wait_all([s.comm.Ibcast([buf, MPI.INT64_T], root=0)], s.timeout_s, "the next command from rank 0")
    return buf


def _step(s: _Session, header: np.ndarray, algorithm: bytes | None, program: bytes | None,
          inputs: bytes | None) -> list[np.ndarray] | None:
    """One call on every rank: receive what is new, run this rank's devices, share the outputs."""
    _, new_program, k, to_all, _ = (int(x) for x in header)
    options = json.loads(_bcast_bytes(s, algorithm, "the run options (algorithm, kernels)"))
    if new_program:
        text = _bcast_bytes(s, program, "the program")
        if program is None:
            with s.guard:
                s.program = SpmdProgram.loads(text, "<program from rank 0>")
    assert s.program is not None
    flat = _decode_arrays(_bcast_bytes(s, inputs, "the inputs"))
    with s.guard:
        job = {"algorithm": options["algorithm"], "kernels": options["kernels"], "devices_per_rank": k}
        res = worker.run_job(s.comm, s.program, job, s.guard, inputs=flat, timeout_s=s.timeout_s)
    outputs = res["outputs"] if res is not None else None
    if to_all:
        data = _bcast_bytes(s, _encode_arrays(outputs) if outputs is not None else None, "the outputs")
        if outputs is None:
            outputs = _decode_arrays(data)
    return outputs


# -- rank 0 ---------------------------------------------------------------------------------------------
def run(spmd: SpmdProgram, flat_inputs: Sequence[np.ndarray], *, devices_per_rank: int = 1,
        algorithm: str = "ring", outputs: str = "all", timeout_s: float | None = DEFAULT_TIMEOUT_S,
        kernels: str = "blas") -> list[np.ndarray]:
    """Rank 0: run ``spmd`` on every rank's devices (the others are in :func:`serve`); returns the
    global outputs. ``pe.jit(..., backend="mpi")`` calls this. ``kernels``: the matmul kernel
    (:mod:`partir_emu.runtime.kernels`)."""
    s = _session(timeout_s)
    if s.comm.Get_rank() != 0:
        raise EmulationError(f"partir_emu.mpi.run is rank 0's; rank {s.comm.Get_rank()} must call serve()")
    if outputs not in OUTPUTS:
        raise EmulationError(f"outputs={outputs!r}: use one of {OUTPUTS}")
    n, nranks = spmd.mesh.size, s.comm.Get_size()
    if nranks * devices_per_rank != n:
        raise MeshError(f"{spmd.mesh} has {n} devices but mpiexec started {nranks} ranks × devices_per_rank "
                        f"{devices_per_rank}; use mpiexec -n {n // devices_per_rank}"
                        f"{'' if n % devices_per_rank == 0 else ' (and a devices_per_rank that divides ' + str(n) + ')'}")
    if s.stopped:
        raise EmulationError("partir_emu.mpi.finish() was called: the other ranks have left serve()")
    new = id(spmd) != s.program_id
    s.program, s.program_id = spmd, id(spmd)
    alg = json.dumps({"algorithm": algorithm, "kernels": check_kernels(kernels)}).encode()
    header = np.array([_RUN, int(new), devices_per_rank, int(outputs == "all"), len(alg)], np.int64)
    _command(s, header)
    out = _step(s, header, alg, spmd.dumps().encode() if new else None,
                _encode_arrays([np.asarray(x) for x in flat_inputs]))
    assert out is not None
    return out


def finish() -> None:
    """Rank 0: tell the ranks in :func:`serve` to return (also done at exit). Idempotent."""
    s = _SESSION
    if s is None or s.stopped or s.comm.Get_rank() != 0:
        return
    s.stopped = True
    _command(s, np.array([_STOP, 0, 0, 0, 0], np.int64))
    s.guard.close()


# -- the other ranks ------------------------------------------------------------------------------------
def serve(timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[list[np.ndarray] | None]:
    """Every rank but 0: run this rank's devices for each call rank 0 makes, until it stops.
    Returns the global outputs of each call (``None`` for calls made with ``outputs="root"``).
    ``timeout_s`` bounds every wait, also the wait for rank 0's next call."""
    s = _session(timeout_s)
    if s.comm.Get_rank() == 0:
        raise EmulationError("partir_emu.mpi.serve() is for ranks other than 0; rank 0 calls the jitted step")
    results: list[list[np.ndarray] | None] = []
    while True:
        header = _command(s, None)
        if int(header[0]) == _STOP:
            break
        out = _step(s, header, None, None, None)
        results.append(out if int(header[3]) else None)
    s.stopped = True
    s.guard.close()
    return results

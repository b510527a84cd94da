"""What one MPI rank does: load or receive an SpmdProgram, read its inputs, run its devices,
gather to rank 0 — and fail loudly.

Entry point (started by :mod:`partir_emu.mpi.launch`, one process per rank)::

    mpiexec -n R python -m partir_emu.mpi.ranks.worker --jobs JOBS.json

The jobs file, the inputs file of each job and rank 0's result files are described in
:mod:`partir_emu.mpi.jobs`. No rank of a worker launch imports jax (nor a model: the
inputs arrive as an .npz). Under a user's ``mpirun … partir-emu run`` the app layer calls the
same :func:`run_job` with a program that rank 0 lowered and broadcast and with the inputs it
made (see :mod:`partir_emu.app.cli.mpi_run`).

Each rank cuts its devices' blocks from the global inputs (:func:`layout.shard`), runs the
step between two barriers, and rank 0 gathers the outputs, the stats and (with
``job["trace"]``) the message trace, written in the format of :mod:`partir_emu.core.msgtrace`.

**Failure behaviour.** Every rank runs under :class:`RankGuard`: an exception prints
``partir-emu rank R device D op K (prim at file:line): Error: message`` to stderr, removes the
job's ``/dev/shm/mpich_shm_*`` file and calls ``MPI_Abort`` (mpiexec then stops every rank);
a watchdog thread does the same after ``timeout`` seconds. With ``progress_dir`` each rank
keeps its progress record (:mod:`partir_emu.runtime.progress`) up to date there and holds an
``flock`` on it while it lives, so the launcher learns which rank died first and in which op,
even when it died without a word (SIGKILL, OOM).
A stop signal (SIGINT/SIGTERM/SIGHUP: mpiexec forwards the user's, the launcher sends
SIGTERM) makes a rank note ``stopped_by`` in its record, remove the segment and exit
128 + signum without a word. Under a user's mpirun :func:`guard_under_mpirun` adds a
:mod:`partir_emu.mpi.procs.sentinel` per host, which names a rank that died without a word (or
the signal that stopped the job) in one line and removes what the ranks could not.
A job's ``"fault": "rank:R:op:K:MODE"`` is a **test hook** that injects a failure
(:mod:`partir_emu.mpi.faults`).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from mpi4py import MPI

from partir_emu.core.msgtrace import trace_header, write_message_trace
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArtifactError, EmulationError
from partir_emu.mpi.bundle import deliver, fetch, pack, unpack
from partir_emu.mpi.faults import parse_fault
from partir_emu.mpi.jobs import job_result_files, load_inputs, read_jobs, write_job_result
from partir_emu.mpi.ranks.guard import START_WALL, RankGuard
from partir_emu.mpi.ranks.hostwatch import guard_under_mpirun
from partir_emu.mpi.ranks.mesh import MpiMesh
from partir_emu.mpi.ranks.wait import bcast_bytes, wait_all
from partir_emu.runtime.local_mesh import check_global_inputs


# -- one job on every rank ------------------------------------------------------------------------
def run_job(comm: MPI.Intracomm, spmd: SpmdProgram, job: dict, guard: RankGuard, *,
            inputs: Sequence[np.ndarray] | None = None, timeout_s: float | None = 300.0) -> dict | None:
    """Run ``spmd`` on this rank's devices; rank 0 gets ``{"outputs", "stats"}``, others None.

    ``inputs``: the global inputs already in hand, else read from ``job["inputs"]`` (.npz).
    """
    t_setup = time.perf_counter()
    rank, nranks = comm.Get_rank(), comm.Get_size()
    k = int(job.get("devices_per_rank") or 1)
    guard.devices = tuple(range(rank * k, (rank + 1) * k))
    guard.set_phase("inputs")
    mesh = MpiMesh(comm, spmd.mesh, k, job.get("algorithm") or "ring", devices_per_node=job.get("devices_per_node"),
                   timeout_s=timeout_s, trace=bool(job.get("trace")), progress=guard.on_op,
                   faults=parse_fault(job.get("fault")), kernels=job.get("kernels") or "blas")
    guard.mesh = mesh
    try:
        if inputs is None:
            if not job.get("inputs"):
                raise ArtifactError("the job names no inputs file (\"inputs\": FILE.npz); see partir_emu.mpi.jobs")
            inputs = load_inputs(job["inputs"], spmd.input_names)
        local = mesh.shard_inputs(spmd, check_global_inputs(spmd, inputs))
        del inputs
        ready = time.time()
        setup_s = time.perf_counter() - t_setup
        guard.set_phase("barrier")
        wait_all([comm.Ibarrier()], timeout_s, "the start barrier (a rank is still setting up)")
        guard.set_phase("step")
        t0 = time.perf_counter()
        res = mesh.run(spmd, local)
        guard.set_phase("barrier")
        wait_all([comm.Ibarrier()], timeout_s, "the end-of-step barrier")
        step_s = time.perf_counter() - t0
        guard.set_phase("gather")
        t1 = time.perf_counter()
        outputs, peaks = mesh.gather_outputs(spmd, res)
        del res, local
        rows = mesh.gather_trace() if job.get("trace") else None
        per_rank = _gather_rank_stats(comm, ready, timeout_s)
        gather_s = time.perf_counter() - t1
    finally:
        mesh.close()
    guard.mesh = None      # kept on failure: the guard names the op
    if rank != 0:
        return None
    stats = {"ranks": nranks, "devices_per_rank": k, "algorithm": mesh.algorithm, "kernels": mesh.kernels,
             "peak_bytes_per_device": peaks, **per_rank, "step_s": step_s, "setup_s": setup_s, "gather_s": gather_s}
    if rows is not None:
        head = trace_header(spmd, ranks=nranks, devices_per_rank=k, algorithm=mesh.algorithm,
                            devices_per_node=job.get("devices_per_node"))
        write_message_trace(job["trace"], head, rows)
    return {"outputs": outputs, "stats": stats}


def _gather_rank_stats(comm: MPI.Intracomm, ready_wall: float, timeout_s: float | None) -> dict:
    """Every rank's start and ready wall times, max RSS and whether it imported jax (on rank 0)."""
    nranks = comm.Get_size()
    mine = np.array([START_WALL, ready_wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
                     float("jax" in sys.modules)], np.float64)
    root = comm.Get_rank() == 0
    every = np.empty(4 * nranks, np.float64) if root else None
    wait_all([comm.Igather([mine, MPI.DOUBLE], [every, MPI.DOUBLE] if root else None, root=0)],
             timeout_s, "the stats gather")
    if not root:
        return {}
    assert every is not None   # why: allocated above on the root, which this is
    table = every.reshape(nranks, 4)
    return {"rss_bytes": [int(x) for x in table[:, 2]], "start_wall": table[:, 0].tolist(),
            "ready_wall": table[:, 1].tolist(), "jax_imported": [bool(x) for x in table[:, 3]]}


# -- under a user's mpirun: a watched guard, a program broadcast from rank 0 ----------------------
def world() -> MPI.Intracomm:
    """``MPI.COMM_WORLD`` (for callers that must not import mpi4py at module level)."""
    return MPI.COMM_WORLD


def broadcast_program(comm: MPI.Intracomm, guard: RankGuard, lower: Callable[[], SpmdProgram],
                      timeout_s: float | None) -> SpmdProgram:
    """Rank 0 calls ``lower()`` (only rank 0 imports jax) and broadcasts the program as JSON
    bytes (``Ibcast`` of its length, then of a uint8 buffer); every rank gets the program.
    If rank 0 cannot lower, it raises the error and the other ranks an EmulationError."""
    rank = comm.Get_rank()
    data, err = b"", None
    if rank == 0:
        try:
            data = lower().dumps().encode()
        except Exception as exc:        # tell the others, then raise it here
            err = exc
    length = np.array([len(data)], np.int64)
    wait_all([comm.Ibcast([length, MPI.INT64_T], root=0)], timeout_s, "the program broadcast from rank 0")
    if err is not None:
        guard.close()
        raise err
    if length[0] == 0:
        guard.close()
        raise EmulationError(f"rank {rank}: rank 0 could not lower the program (see its message)")
    buf = np.frombuffer(data, np.uint8).copy() if rank == 0 else np.empty(int(length[0]), np.uint8)
    wait_all([comm.Ibcast([buf, MPI.BYTE], root=0)], timeout_s, "the program broadcast from rank 0", bulk=True)
    with guard:
        return SpmdProgram.loads(buf.tobytes(), "<broadcast program>")


# -- entry point --------------------------------------------------------------------------------
def receive_bundle(comm: MPI.Intracomm, where: str, token: str, timeout_s: float | None) -> dict[str, bytes]:
    """The job's files (:mod:`partir_emu.mpi.bundle`): rank 0 fetches them from the launcher and
    broadcasts them; every rank gets them in memory."""
    data = fetch(where, token, timeout_s) if comm.Get_rank() == 0 else None
    return unpack(bcast_bytes(comm, data, timeout_s, "the job bundle (programs and inputs)"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m partir_emu.mpi.ranks.worker",
                                 description="one MPI rank of a partir-emu run (started by mpi_launch)")
    ap.add_argument("--jobs", default=None, help="JOBS.json (see partir_emu.mpi.jobs)")
    ap.add_argument("--bundle-from", default=None, metavar="ADDR,...:PORT",
                    help="instead: rank 0 fetches the jobs and their files from the launcher (partir_emu.mpi.bundle)")
    ap.add_argument("--bundle-token", default="", help="with --bundle-from: the launcher's token")
    ap.add_argument("--per-host", action="store_true", help="every host watches its own ranks (several hosts)")
    ap.add_argument("--timeout", type=float, default=None, help="with --per-host: the ranks' timeout")
    ap.add_argument("--report-to", default=None, metavar="ADDR,...:PORT",
                    help="with --per-host: where every host's sentinel reports (the launcher)")
    args = ap.parse_args(argv)
    if (args.jobs is None) == (args.bundle_from is None):
        ap.error("give --jobs FILE or --bundle-from ADDR:PORT")
    comm = MPI.COMM_WORLD
    files: dict[str, bytes] | None = None
    if args.bundle_from or args.per_host:
        timeout = args.timeout
        guard = guard_under_mpirun(comm, timeout, args.report_to)
        with guard:
            if args.bundle_from:
                guard.set_phase("receive the job bundle")
                files = receive_bundle(comm, args.bundle_from, args.bundle_token, timeout)
                spec = json.loads(files["jobs.json"])
            else:
                spec = read_jobs(args.jobs)
    else:
        spec = read_jobs(args.jobs)
        timeout = spec.get("timeout")
        guard = RankGuard(comm, timeout, spec.get("progress_dir"))
    results: dict[str, bytes] = {}
    with guard:
        for j, job in enumerate(spec["jobs"]):
            guard.set_phase("load program", job=j)
            if files is None:
                spmd, inputs = SpmdProgram.load(job["program"]), None
            else:
                spmd = SpmdProgram.loads(files[job["program"]], job["program"])
                inputs = load_inputs(io.BytesIO(files[job["inputs"]]), spmd.input_names)
            trace = job.get("trace")
            if files is not None and trace:      # written here, sent back with the results
                job = {**job, "trace": os.path.join(tempfile.gettempdir(), f"partir-emu-trace-{os.getpid()}.jsonl")}
            res = run_job(comm, spmd, job, guard, inputs=inputs, timeout_s=timeout)
            if res is not None:
                guard.set_phase("write outputs")
                if files is None:
                    write_job_result(job, res["outputs"], res["stats"])
                else:
                    results.update(job_result_files(j, res["outputs"], res["stats"]))
                    if trace:
                        results[f"job-{j}/trace.jsonl"] = Path(job["trace"]).read_bytes()
                        os.unlink(job["trace"])
        guard.set_phase("finalize")
        wait_all([comm.Ibarrier()], timeout, "the final barrier")
        if files is not None and comm.Get_rank() == 0:
            guard.set_phase("send the results")
            deliver(args.bundle_from, args.bundle_token, pack(results), timeout)
    guard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

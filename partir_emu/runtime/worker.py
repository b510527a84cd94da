"""What one MPI rank does: load or receive an SpmdProgram, make its inputs, run its devices,
gather to rank 0 — and fail loudly.

Entry point (started by :mod:`partir_emu.runtime.mpi_launch`, one process per rank)::

    mpiexec -n R python -m partir_emu.runtime.worker --jobs JOBS.json

``JOBS.json`` is ``{"jobs": [JOB, ...], "timeout": seconds, "progress_dir": DIR | null}`` and runs
the jobs one after the other in this one launch (tests batch many programs per ``mpiexec``).
A JOB is::

    {"program": "FILE.json",           # SpmdProgram.save() output; its mesh has R*k devices
     "scenario": "mlp", "preset": null, "overrides": "batch=1024", "seed": 0,
     "inputs": "FILE.npz" | null,      # else every rank generates the inputs (numpy only)
     "algorithm": "ring", "devices_per_rank": k, "devices_per_node": null,
     "out": "DIR",                     # rank 0 writes DIR/outputs.npz and DIR/stats.json
     "trace": "FILE.jsonl" | null}     # message trace (format below)

No rank of a worker launch imports jax. Under a user's ``mpirun … partir-emu run`` the same
:func:`run_job` runs with a program that rank 0 lowered and broadcast (see ``mpi_launch``).

**Inputs** are the scenario's deterministic numpy inputs (same values as
``Experiment.inputs()``; built here without the scenario's jax-aware Adam init), or an
``.npz`` loaded with ``allow_pickle=False`` whose keys are the program's input names
(or ``arr_0 …`` in input order). Each rank cuts its devices' blocks with
:func:`layout.shard`.

**outputs.npz / stats.json** (rank 0): ``out_<j>`` = global output ``j`` (unsharded);
stats: ``peak_bytes_per_device`` (list by device), ``rss_bytes`` (each rank's max RSS),
``ready_wall`` (each rank's ``time.time()`` when its inputs were ready), ``start_wall``
(each rank's start), ``step_s`` (the step between two barriers, on rank 0),
``setup_s``, ``gather_s``, ``ranks``, ``devices_per_rank``, ``jax_imported`` (per rank: was
``jax`` in ``sys.modules`` at the end — the tests hold it False).

**Message trace** (``trace``): JSON Lines. Line 1 is a header::

    {"format": "partir-emu-message-trace", "version": 1, "mesh": [["batch", 4], ...],
     "devices": N, "ranks": R, "devices_per_rank": k, "algorithm": "ring",
     "collectives": {"<coll>": {"prim": ..., "axes": [...], "bytes": full-buffer bytes}}}

then one line per transfer the run made, sorted by ``(coll, step, src, dst)``::

    {"coll": 12, "step": 0, "src": 3, "dst": 4, "bytes": 256}

``coll`` is the equation index of the collective in the SPMD program, ``step`` the
schedule step (transfers of one ``(coll, step)`` run concurrently), ``src``/``dst``
global device ids, ``bytes`` the payload. Transfers between devices of one rank
(memory copies) are included; a hardware model tells them apart with
``src // devices_per_rank == dst // devices_per_rank``. Native collectives
(``--algorithm native``) move data inside MPI and leave no lines.

**Failure behaviour.** Every rank runs under :class:`RankGuard`: an exception prints
``partir-emu rank R device D op K (prim at file:line): Error: message`` to stderr, removes the
job's ``/dev/shm/mpich_shm_*`` file and calls ``MPI_Abort`` (mpiexec then stops every rank);
a watchdog thread does the same after ``timeout`` seconds. With ``progress_dir`` each rank
keeps ``rank-NNNNN.json`` there up to date (pid, devices, phase, current op, shm files) and
holds an ``flock`` on it while it lives, so the launcher learns which rank died first and in
which op, even when it died without a word (SIGKILL, OOM).
``PARTIR_EMU_FAULT=rank:R:op:K:MODE`` is a **test hook** that injects a failure
(:class:`partir_emu.runtime.mpi_mesh.FaultSpec`).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _process_start_wall() -> float:
    """When this process started (wall clock), from /proc; now if unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


START_WALL = _process_start_wall()

TRACE_FORMAT = "partir-emu-message-trace"
TRACE_VERSION = 1
PROGRESS_BYTES = 4096


# -- inputs (numpy only) ------------------------------------------------------------------------
def numpy_inputs(scenario: str, preset: str | None, overrides: Any, seed: int) -> list[np.ndarray]:
    """The scenario's global inputs, flat in jax's order, without importing jax
    (the same values as ``Experiment.inputs()``: ``Scenario.make_inputs`` is numpy-only)."""
    from partir_emu.experiment import flatten
    from scenarios import get_scenario
    sc = get_scenario(scenario)
    return flatten(sc.make_inputs(sc.config(preset, overrides), seed))


# -- progress, watchdog, failure reports ----------------------------------------------------------
def mapped_shm_files() -> list[str]:
    """The ``/dev/shm/mpich_shm_*`` files this process maps (MPICH's node segment)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if path.startswith("/dev/shm/mpich_shm") and path not in out:
                    out.append(path)
    except OSError:
        pass
    return out


class RankGuard:
    """Progress file, watchdog and the report-and-abort path of one rank.

    Use ``with guard:`` around a rank's work. ``context`` is the MpiMesh's OpContext (the op
    being run) once a mesh exists; ``phase`` says what the rank does outside the step.
    """

    def __init__(self, comm, timeout_s: float | None, progress_dir: str | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.phase = "startup"
        self.job = 0
        self.mesh = None          # the current MpiMesh, for its OpContext
        self.devices: tuple[int, ...] = ()
        self.shm = mapped_shm_files()
        self._fd = None
        self._lock = threading.Lock()
        self._aborting = False
        self.error = ""
        if progress_dir:
            # held locked while the rank lives: the launcher learns the moment it dies
            self._fd = os.open(os.path.join(progress_dir, f"rank-{self.rank:05d}.json"),
                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.set_phase("startup")
        self._timer = None
        if timeout_s:
            self._timer = threading.Timer(timeout_s, self._on_timeout, args=(timeout_s,))
            self._timer.daemon = True
            self._timer.start()

    # progress ----------------------------------------------------------------------------------
    def set_phase(self, phase: str, job: int | None = None) -> None:
        self.phase = phase
        if job is not None:
            self.job = job
        self._write_progress()

    def on_op(self, ctx) -> None:
        self._write_progress(ctx)

    def _write_progress(self, ctx=None) -> None:
        if self._fd is None:
            return
        rec = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
               "phase": self.phase, "devices": list(self.devices), "shm": self.shm, "t": time.time()}
        if ctx is None and self.mesh is not None:
            ctx = self.mesh.context
        if ctx is not None and ctx.eqn is not None:
            from partir_emu.runtime.mpi_mesh import short_source
            rec.update(op=ctx.index, prim=ctx.eqn.prim, source=short_source(ctx.eqn.source), state=ctx.state)
        if self.error:
            rec["error"] = self.error[:1000]
        data = json.dumps(rec).encode()[:PROGRESS_BYTES].ljust(PROGRESS_BYTES)
        try:
            os.pwrite(self._fd, data, 0)
        except OSError:
            pass

    # failure -----------------------------------------------------------------------------------
    def where(self, exc: BaseException | None = None) -> str:
        from partir_emu.runtime.mpi_mesh import describe_op, device_str, locate_in_engine
        if exc is not None:
            index, eqn, device = locate_in_engine(exc)
            if eqn is not None and eqn.prim not in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
                return f"{device_str([device] if device is not None else self.devices)} {describe_op(index, eqn)}"
        ctx = self.mesh.context if self.mesh is not None else None
        if ctx is not None and ctx.eqn is not None and self.phase == "step":
            return ctx.describe()
        devs = device_str(self.devices) + " " if self.devices else ""
        return f"{devs}op - ({self.phase})"

    def fail(self, message: str, code: int = 1) -> None:
        """Print ``message``, write it to the progress file, drop the shm segment, abort the job."""
        with self._lock:
            if self._aborting:
                return
            self._aborting = True
        try:
            os.write(2, (message.rstrip() + "\n").encode(errors="replace"))
        except OSError:
            pass
        self.phase = "failed"
        self.error = next((ln for ln in reversed(message.splitlines()) if ln.startswith("partir-emu rank")),
                          message[-1000:])
        self._write_progress()
        for path in self.shm or mapped_shm_files():
            try:
                os.unlink(path)
            except OSError:
                pass
        time.sleep(0.2)      # let mpiexec forward our stderr before MPI_Abort tears the job down
        try:
            self.comm.Abort(code)
        finally:
            os._exit(code)

    def _on_timeout(self, timeout_s: float) -> None:
        self.fail(f"partir-emu rank {self.rank} {self.where()}: timed out after {timeout_s:g} s "
                  f"(--timeout); the job is stopped", code=3)

    def __enter__(self) -> RankGuard:
        return self

    def __exit__(self, et, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, SystemExit) and not exc.code:
            return False
        from partir_emu.errors import PartirError
        detail = "" if isinstance(exc, PartirError) else "".join(traceback.format_exception(et, exc, tb))
        self.fail(f"{detail}partir-emu rank {self.rank} {self.where(exc)}: {type(exc).__name__}: {exc}")
        return False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._fd is not None:
            self.phase = "done"
            self._write_progress()
            os.close(self._fd)
            self._fd = None


# -- one job on every rank ------------------------------------------------------------------------
def run_job(comm, spmd, job: dict, guard: RankGuard, *, inputs: Sequence[np.ndarray] | None = None,
            timeout_s: float | None = 300.0) -> dict | None:
    """Run ``spmd`` on this rank's devices; rank 0 gets ``{"outputs", "stats", "trace"}``.

    ``inputs``: global inputs already in hand, else ``job["inputs"]`` (.npz) or the scenario's.
    """
    from mpi4py import MPI

    from partir_emu.runtime.mpi_mesh import FAULT_ENV, FaultSpec, MpiMesh, wait_all
    t_setup = time.perf_counter()
    rank, nranks = comm.Get_rank(), comm.Get_size()
    k = int(job.get("devices_per_rank") or 1)
    guard.devices = tuple(range(rank * k, (rank + 1) * k))
    guard.set_phase("inputs")
    mesh = MpiMesh(comm, spmd.mesh, k, job.get("algorithm") or "ring", devices_per_node=job.get("devices_per_node"),
                   timeout_s=timeout_s, trace=bool(job.get("trace")), progress=guard.on_op,
                   fault=FaultSpec.parse(os.environ.get(FAULT_ENV)))
    guard.mesh = mesh
    try:
        if inputs is None:
            if job.get("inputs"):
                from partir_emu.experiment import load_inputs_npz
                inputs = load_inputs_npz(job["inputs"], spmd.input_names)
            else:
                inputs = numpy_inputs(job["scenario"], job.get("preset"), job.get("overrides"), int(job.get("seed", 0)))
        from partir_emu.runtime.local_mesh import check_global_inputs
        inputs = check_global_inputs(spmd, inputs)
        local = mesh.shard_inputs(spmd, inputs)
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
        times = np.array([START_WALL, ready, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
                          float("jax" in sys.modules)], np.float64)
        all_times = np.empty(4 * nranks, np.float64) if rank == 0 else None
        wait_all([comm.Igather([times, MPI.DOUBLE], [all_times, MPI.DOUBLE] if rank == 0 else None, root=0)],
                 timeout_s, "the stats gather")
        gather_s = time.perf_counter() - t1
    finally:
        mesh.close()
    guard.mesh = None      # kept on failure: the guard names the op
    if rank != 0:
        return None
    all_times = all_times.reshape(nranks, 4)
    stats = {"ranks": nranks, "devices_per_rank": k, "algorithm": mesh.algorithm,
             "peak_bytes_per_device": peaks, "rss_bytes": [int(x) for x in all_times[:, 2]],
             "start_wall": all_times[:, 0].tolist(), "ready_wall": all_times[:, 1].tolist(),
             "jax_imported": [bool(x) for x in all_times[:, 3]],
             "step_s": step_s, "setup_s": setup_s, "gather_s": gather_s}
    if rows is not None:
        write_trace(job["trace"], rows, spmd, nranks, k, mesh.algorithm)
    return {"outputs": outputs, "stats": stats}


def write_trace(path: str | os.PathLike, rows: np.ndarray, spmd, ranks: int, k: int, algorithm: str) -> None:
    """The message trace file (format in the module docstring)."""
    from partir_emu.core.spmd import COMM_PRIMS, collective_bytes
    colls = {str(i): {"prim": e.prim, "axes": list(e.params["axes"]), "bytes": collective_bytes(e)}
             for i, e in enumerate(spmd.program.eqns) if e.prim in COMM_PRIMS}
    head = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "mesh": spmd.mesh.to_json(), "devices": spmd.mesh.size,
            "ranks": ranks, "devices_per_rank": k, "algorithm": algorithm, "collectives": colls}
    with open(path, "w") as f:
        f.write(json.dumps(head, separators=(",", ":")) + "\n")
        f.writelines(f'{{"coll":{c},"step":{st},"src":{a},"dst":{b},"bytes":{n}}}\n' for c, st, a, b, n in rows.tolist())


def read_trace(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """``(header, transfers)`` of a message trace file."""
    with open(path) as f:
        head = json.loads(f.readline())
        if head.get("format") != TRACE_FORMAT:
            from partir_emu.errors import ArtifactError
            raise ArtifactError(f"{path}: not a partir-emu message trace")
        return head, [json.loads(line) for line in f if line.strip()]


def write_job_result(job: dict, result: dict) -> None:
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "outputs.npz", **{f"out_{j}": x for j, x in enumerate(result["outputs"])})
    (out / "stats.json").write_text(json.dumps(result["stats"]))


def read_job_result(job: dict) -> dict:
    out = Path(job["out"])
    with np.load(out / "outputs.npz", allow_pickle=False) as z:
        outputs = [z[f"out_{j}"] for j in range(len(z.files))]
    return {"outputs": outputs, "stats": json.loads((out / "stats.json").read_text())}


# -- entry point --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m partir_emu.runtime.worker",
                                 description="one MPI rank of a partir-emu run (started by mpi_launch)")
    ap.add_argument("--jobs", required=True, help="JOBS.json (see the module docstring)")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.jobs).read_text())
    timeout = spec.get("timeout")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    guard = RankGuard(comm, timeout, spec.get("progress_dir"))
    with guard:
        from partir_emu.core.spmd import SpmdProgram
        for j, job in enumerate(spec["jobs"]):
            guard.set_phase("load program", job=j)
            spmd = SpmdProgram.load(job["program"])
            res = run_job(comm, spmd, job, guard, timeout_s=timeout)
            if res is not None:
                guard.set_phase("write outputs")
                write_job_result(job, res)
        guard.set_phase("finalize")
        wait_all_done(comm, timeout)
    guard.close()
    return 0


def wait_all_done(comm, timeout_s: float | None) -> None:
    from partir_emu.runtime.mpi_mesh import wait_all
    wait_all([comm.Ibarrier()], timeout_s, "the final barrier")


if __name__ == "__main__":
    sys.exit(main())

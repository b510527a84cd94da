"""The guard of one rank: its progress record (a fixed-size block in a file the launcher and the
sentinel read), its shared-memory segment, the phase it is in, and how it fails (one message, the
record updated, the segment removed, the job aborted). :class:`RankGuard` is what every rank of
:mod:`.worker` (and of the user's own script, :mod:`partir_emu.mpi.session`) runs under.
"""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from mpi4py import MPI

from partir_emu.core.spmd import COMM_PRIMS
from partir_emu.errors import CollectiveError, PartirError
from partir_emu.mpi.failure_report import laggards, positions
from partir_emu.mpi.interrupts import install, restore
from partir_emu.mpi.ranks.mesh import MpiMesh
from partir_emu.runtime.progress import (
    OpContext,
    device_str,
    encode_record,
    engine_spot,
    progress_path,
    read_records,
    short_source,
)


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

def _claim(path: Path) -> bool:
    """True for the first process to create ``path``."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return True
    except OSError:
        return False

def _unlink(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass

class RankGuard:
    """Progress record, watchdog and the report-and-abort path of one rank.

    Use ``with guard:`` around a rank's work. ``mesh`` is the current MpiMesh (its OpContext
    names the op being run) once one exists; ``phase`` says what the rank does outside the step.
    """

    def __init__(self, comm: MPI.Comm, timeout_s: float | None, progress_dir: str | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.phase = "startup"
        self.job = 0
        self.mesh: MpiMesh | None = None
        self.devices: tuple[int, ...] = ()
        self.shm = mapped_shm_files()
        self._fd: int | None = None
        self.progress_dir = progress_dir
        self._lock = threading.Lock()
        self._aborting = False
        self.error = ""
        if progress_dir:
            # held locked while the rank lives: the launcher learns the moment it dies
            self._fd = os.open(progress_path(progress_dir, self.rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.stopped_by = ""
        self.sentinel_watches = False       # under a user's mpirun: a runtime.sentinel watches the host
        self.hosts = 1                      # hosts of the job (more than one: messages name this rank's host)
        self.set_phase("startup")
        self._handlers = install(self._on_signal)
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

    def on_op(self, ctx: OpContext) -> None:
        self._write_progress(ctx)

    def _write_progress(self, ctx: OpContext | None = None) -> None:
        if self._fd is None:
            return
        rec = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
               "phase": self.phase, "devices": list(self.devices), "shm": self.shm, "t": time.time()}
        if ctx is None and self.mesh is not None:
            ctx = self.mesh.context
        if ctx is not None and ctx.eqn is not None:
            rec.update(op=ctx.index, prim=ctx.eqn.prim, source=short_source(ctx.eqn.source), state=ctx.state,
                       seq=ctx.seq, **({"loops": [list(f) for f in ctx.loops]} if ctx.loops else {}))
        if self.error:
            rec["error"] = self.error[:1000]
        if self.stopped_by:
            rec["stopped_by"] = self.stopped_by
        try:
            os.pwrite(self._fd, encode_record(rec), 0)
        except OSError:
            pass

    # failure -----------------------------------------------------------------------------------
    def where(self, exc: BaseException | None = None) -> str:
        if exc is not None:
            spot = engine_spot(exc)
            if spot.eqn is not None and spot.eqn.prim not in COMM_PRIMS:
                return f"{device_str([spot.device] if spot.device is not None else self.devices)} {spot.describe()}"
        ctx = self.mesh.context if self.mesh is not None else None
        if ctx is not None and ctx.eqn is not None and self.phase == "step":
            return ctx.describe()
        devs = device_str(self.devices) + " " if self.devices else ""
        return f"{devs}op - ({self.phase})"

    def fail(self, message: str, code: int = 1, abort: bool = True) -> None:
        """Print ``message``, write it to the progress record, drop the shm segment, abort the job
        (``abort=False``: exit with ``code`` instead, and hydra stops the others; see :meth:`__exit__`).

        Under a user's mpirun (``sentinel_watches``) every rank times out at once: the first
        of the host to claim it prints one line for all, from every rank's record."""
        with self._lock:
            if self._aborting:
                return
            self._aborting = True
        self.phase = "failed"
        self.error = next((ln for ln in reversed(message.splitlines()) if ln.startswith("partir-emu rank")),
                          message[-1000:])
        say = True
        if self.sentinel_watches and self.hosts > 1 and " timed out after " in self.error:
            say = False             # the speaker's sentinel names every host's ranks in one line
        elif self.sentinel_watches and self.progress_dir and " timed out after " in self.error:
            say = _claim(Path(self.progress_dir) / "timeout-reported")
            if say:
                self._write_progress()
                recs = read_records(self.progress_dir)
                why = laggards(recs) or [f"last positions: {positions(recs, len(recs))}"]
                message = "; ".join([self.error, *why])
        if say:
            try:
                os.write(2, (message.rstrip() + "\n").encode(errors="replace"))
            except OSError:
                pass
        self._write_progress()
        _unlink(self.shm or mapped_shm_files())
        # let mpiexec forward our stderr (or the rank that speaks for us its) before MPI_Abort tears the job down
        time.sleep(0.2 if say else 0.5)
        try:
            if abort:
                self.comm.Abort(code)
        finally:
            os._exit(code)

    def _on_signal(self, signum: int, frame: object) -> None:
        """SIGINT/SIGTERM/SIGHUP (mpiexec forwards the user's, the launcher sends SIGTERM):
        say so in the progress record, drop the shm segment and exit 128 + signum at once,
        without a word — whoever stops the job prints the one line about it."""
        if not self._lock.acquire(blocking=False):      # fail() holds it: it is aborting already
            return
        try:
            if self._aborting:
                return
            self._aborting = True
        finally:
            self._lock.release()
        self.stopped_by = signal.Signals(signum).name
        self._write_progress()
        _unlink(self.shm or mapped_shm_files())
        os._exit(128 + signum)

    def who(self) -> str:
        """``'partir-emu rank R'``, with its host when the job has several."""
        return f"partir-emu rank {self.rank}" + (f" on {socket.gethostname()}" if self.hosts > 1 else "")

    def _on_timeout(self, timeout_s: float) -> None:
        self.fail(f"{self.who()} {self.where()}: timed out after {timeout_s:g} s "
                  f"(--timeout); the job is stopped", code=3)

    def __enter__(self) -> RankGuard:
        return self

    def __exit__(self, et, exc, tb) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, SystemExit) and not exc.code:
            return False
        detail = "" if isinstance(exc, PartirError) else "".join(traceback.format_exception(et, exc, tb))
        # across hosts a peer that died surfaces here as an MPI error (its TCP connection reset): exit
        # rather than MPI_Abort, after which mpiexec would leave at once, before the hosts' sentinels
        # (rank 0's speaks for them) said which rank died first; hydra stops the others all the same
        lost_peer = self.hosts > 1 and (isinstance(exc, MPI.Exception) or
                                        (isinstance(exc, CollectiveError) and str(exc).startswith("MPI failed")))
        self.fail(f"{detail}{self.who()} {self.where(exc)}: {type(exc).__name__}: {exc}", abort=not lost_peer)
        return False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        restore(self._handlers)
        self._handlers = {}
        if self._fd is not None:
            self.phase = "done"
            self._write_progress()
            os.close(self._fd)
            self._fd = None

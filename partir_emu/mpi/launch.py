"""Launch MPI ranks for a list of jobs and collect their results.

``MpiRun(jobs, R).start().wait()`` writes the jobs file (:mod:`partir_emu.mpi.jobs`) to a
work dir and starts ``<venv>/bin/mpiexec -n R python -m partir_emu.mpi.ranks.worker --jobs FILE``
under :mod:`partir_emu.mpi.procs.supervise` (own process group, ``MPIEXEC_TIMEOUT`` set, a
deadline of its own). No rank imports jax. Rank 0 writes each job's unsharded outputs (.npz)
and stats (JSON); :meth:`MpiRun.wait` returns them. (:func:`partir_emu.app.cli.mpi_run.launch`
runs jobs that name a scenario, in a temporary work dir.)

:func:`partir_emu.mpi.environ.under_mpirun` tells whether this process is itself a rank of a
user's ``mpirun`` (``PMI_RANK``/``PMI_SIZE``/``OMPI_COMM_WORLD_SIZE``/``PMIX_RANK`` in the environment); then
the app layer runs :func:`partir_emu.mpi.ranks.worker.run_job` in place instead of launching.

**Failures.** A non-zero exit of mpiexec raises :class:`EmulationError` with the ranks'
``partir-emu rank R device D op K …`` lines (:mod:`partir_emu.mpi.failure_report`); for a
rank that died without a word (killed, OOM) the op comes from its progress record. Every run
has a timeout: the ranks' watchdogs (``rank_timeout_s``), ``MPIEXEC_TIMEOUT`` (+3 s) and this
process's wait (+6 s), after which mpiexec's process group and every rank get SIGTERM and,
3 s later, whatever is left SIGKILL. MPICH's ``/dev/shm/mpich_shm_*`` segments left by a
failed run are removed.

**Interrupts.** Ctrl-C, or SIGTERM/SIGHUP turned into
:class:`~partir_emu.mpi.interrupts.Interrupted` by the CLI, reaching :meth:`MpiRun.wait`
(or a caller that calls :meth:`MpiRun.abort`) stop the job the same way with a 1.5 s grace
(the ranks exit at once on SIGTERM, dropping their segment), remove the segments, and note
on the exception what was stopped and removed, for the CLI's one line.

This module imports neither mpi4py nor jax: the launching process is not an MPI rank.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from partir_emu.errors import EmulationError
from partir_emu.mpi.bundle import BundleServer
from partir_emu.mpi.deaths import DeathWatch
from partir_emu.mpi.failure_report import WARNING_PREFIX, failure_message
from partir_emu.mpi.faults import parse_fault
from partir_emu.mpi.hosts import HostOptions
from partir_emu.mpi.interrupts import note, signals_deferred
from partir_emu.mpi.jobs import pack_jobs, read_job_result, unpack_results, write_jobs
from partir_emu.mpi.procs.hostreports import REPORT_WAIT_S, Collector, listen, local_addresses
from partir_emu.mpi.procs.reaper import Reaper
from partir_emu.mpi.procs.sentinel import merged_line
from partir_emu.mpi.procs.shmwatch import CLEANS_ENV
from partir_emu.mpi.procs.supervise import Supervised, cleanup_shm, is_hydra, mpiexec_path
from partir_emu.runtime.progress import read_records

# a rank's own variables, should this process run inside another job; hydra's HYDRA_* are the user's
# settings for our mpiexec (hosts, launcher) and are passed on
_STRIP_ENV = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
ROOT = Path(__file__).resolve().parents[2]
MPIEXEC_SLACK_S = 3.0       # MPIEXEC_TIMEOUT = timeout + this: the ranks' watchdogs fire first ...
WAIT_SLACK_S = 6.0          # ... and this process waits longest, then stops the process group
ABORT_GRACE_S = 1.5         # on an interrupt: SIGTERM, this long, SIGTERM leftovers, this long, SIGKILL


class MpiRun:
    """``mpiexec -n ranks python -m partir_emu.mpi.ranks.worker --jobs FILE`` for a list of jobs.

    ``jobs``: dicts as documented in :mod:`partir_emu.mpi.jobs` (``out`` defaults to a
    directory in ``workdir``). ``timeout_s`` bounds the whole launch; the ranks' own watchdog
    uses ``rank_timeout_s`` (default ``timeout_s``). ``env`` adds environment variables.
    ``fault`` (tests): a :mod:`partir_emu.mpi.faults` spec added to every job.

    ``hosts``: where the ranks run (:class:`~partir_emu.mpi.hosts.HostOptions`). When they may run
    on other machines, each host's ranks are watched on that host (its sentinel; rank 0's speaks
    for all) and the jobs' files travel over MPI (:mod:`partir_emu.mpi.bundle`: mpiexec's standard
    input to rank 0, the results back on its standard output), unless ``shared_workdir`` says every
    host sees ``workdir`` at the same path.
    """

    def __init__(self, jobs: Sequence[dict], ranks: int, *, timeout_s: float = 300.0, workdir: str | os.PathLike,
                 rank_timeout_s: float | None = None, env: dict[str, str] | None = None,
                 mpiexec: str | os.PathLike | None = None, mpiexec_args: Sequence[str] = (),
                 fault: str | None = None, hosts: HostOptions | None = None, shared_workdir: bool = False) -> None:
        self.workdir = Path(workdir).resolve()
        if fault:
            parse_fault(fault)                   # refused here, before anything is launched
        self.jobs = [{"out": str(self.workdir / f"job-{j}"), **job, **({"fault": fault} if fault else {})}
                     for j, job in enumerate(jobs)]
        self.ranks, self.timeout_s = int(ranks), float(timeout_s)
        self.rank_timeout_s = float(rank_timeout_s if rank_timeout_s is not None else timeout_s)
        self.env_extra = dict(env or {})
        self.mpiexec = Path(mpiexec) if mpiexec else mpiexec_path()
        self.mpiexec_args = [*(hosts.mpiexec_args() if hosts else []), *mpiexec_args]
        self.multi_host = (hosts or HostOptions()).multi_host()
        self.bundled = self.multi_host and not shared_workdir
        self.progress_dir = self.workdir / "progress"
        self.server: BundleServer | None = None
        self.collector: Collector | None = None
        self.hosts = hosts or HostOptions()
        self.process: Supervised | None = None
        self.watch: DeathWatch | None = None
        self.reaper: Reaper | None = None
        self.start_wall = 0.0
        self._aborted = False

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_ENV)}
        env["MPIEXEC_TIMEOUT"] = str(int(math.ceil(self.timeout_s + MPIEXEC_SLACK_S)))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if not self.multi_host:             # one host: this process removes the segments itself
            env[CLEANS_ENV] = "1"
        env.update(self.env_extra)
        return env

    def start(self) -> MpiRun:
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        jobs_file = self.workdir / "jobs.json"
        write_jobs(jobs_file, self.jobs, self.rank_timeout_s, self.progress_dir)
        hydra = ["-print-all-exitcodes"] if is_hydra(self.mpiexec) else []
        where = ["--jobs", str(jobs_file)]
        if self.bundled:        # no shared work dir: rank 0 fetches the files from this process
            self.server = BundleServer(pack_jobs(self.jobs, self.rank_timeout_s))
            where = self.server.argv(local_addresses())
        worker = [sys.executable, "-m", "partir_emu.mpi.ranks.worker", *where]
        if self.multi_host:     # every host's sentinel reports to this process (procs.hostreports)
            self.collector = Collector(listen())
            worker += ["--per-host", "--timeout", str(self.rank_timeout_s), "--report-to",
                       f"{','.join(local_addresses())}:{self.collector.sock.getsockname()[1]}"]
        cmd = [str(self.mpiexec), "-n", str(self.ranks), *hydra, *self.mpiexec_args, *worker]
        self.watch = DeathWatch(self.progress_dir)
        try:
            self.process = Supervised(cmd, self._env(), self.workdir, marker=str(self.workdir)).start()
        except EmulationError:
            self.watch.stop()
            raise
        self.start_wall = self.process.start_wall
        assert self.process.proc is not None
        # the watcher that cleans up should this process be SIGKILLed (partir_emu.mpi.procs.reaper)
        self.reaper = Reaper({"pgid": self.process.proc.pid, "marker": str(self.workdir),
                              "progress": str(self.progress_dir), "shm_before": sorted(self.process.shm_before),
                              "since": self.start_wall, "workdir": str(self.workdir),
                              "remove_workdir": self.workdir.name.startswith("partir-emu-")}, self._env())
        return self

    def wait(self) -> list[dict]:
        """Wait for the launch; the jobs' results (``outputs``, ``stats``) or EmulationError."""
        try:
            return self._wait()
        finally:
            if self.process is not None:
                self.process.remove_hwloc()
            if self.reaper is not None:
                self.reaper.stand_down()
            if self.server is not None:
                self.server.close()
            if self.collector is not None:
                self.collector.close()

    def _wait(self) -> list[dict]:
        assert self.process is not None and self.watch is not None, "start() first"
        try:
            rc, timed_out = self.process.wait(self.timeout_s + WAIT_SLACK_S)
        except BaseException as exc:    # Ctrl-C, SIGTERM, SIGHUP (Interrupted): leave nothing behind
            self.abort(exc)
            raise
        if timed_out:
            self.stop(self.read_progress())
            assert self.process.proc is not None   # why: wait() returned, so start() made the process
            rc = self.process.proc.returncode
        text = self.process.output()
        if rc != 0 and "APPLICATION TIMED OUT" in text:    # MPIEXEC_TIMEOUT fired
            timed_out = True
        if timed_out or rc != 0:
            silent = self.watch.silent_deaths()
            self.watch.stop()
            progress = self.read_progress()
            cleanup_shm([s for p in progress for s in p.get("shm", [])], self.process.shm_before, self.start_wall)
            self.process.close_logs()
            msg = failure_message(text, rc, timed_out, progress, silent, self.ranks, self.timeout_s,
                                  self.watch.resolution_s, watched_here=not self.multi_host)
            if self.collector is not None:      # the hosts' sentinels: who died first anywhere, positions
                host_ranks = self.hosts.rank_hosts(self.ranks)
                reports = self.collector.wait(len(host_ranks) or self.ranks, REPORT_WAIT_S)
                line = merged_line(reports, host_ranks) if reports else None
                head, _, rest = msg.partition("\n")
                if line:                        # hydra's teardown text only hides it
                    rest = rest.split("mpiexec output (tail):")[0].rstrip()
                if not line and "is unreachable" not in rest:
                    line = "no host's watcher reported (mpiexec's output follows)"
                msg = "\n".join(x for x in (head, line, rest) if x)
            raise EmulationError(msg)
        self.watch.stop()
        for w in dict.fromkeys(ln for ln in text.splitlines() if ln.startswith(WARNING_PREFIX)):
            print(w, file=sys.stderr)       # the ranks' warnings
        self.process.close_logs()
        try:
            if self.server is not None:
                unpack_results(self.server.results, self.jobs)
            return [read_job_result(job) for job in self.jobs]
        except (OSError, KeyError, ValueError) as exc:
            raise EmulationError(f"the MPI run exited 0 but its results are unreadable ({exc}); "
                                 f"mpiexec output:\n{text[-2000:]}") from None

    def stop(self, progress: list[dict] | None = None, grace_s: float = 3.0) -> None:
        """Stop every process of the launch (mpiexec's group, then leftover ranks by pid)."""
        if self.process is not None and (self.process.running() or progress):
            self.process.stop([p["pid"] for p in (progress or self.read_progress()) if "pid" in p], grace_s)

    def abort(self, exc: BaseException | None = None) -> None:
        """Stop the launch now and remove its ``/dev/shm`` segments (the caller is unwinding
        from ``exc``: an interrupt, or an error of its own while the ranks run). Idempotent.
        What it stopped and removed is noted on ``exc`` for the one-line report
        (:func:`partir_emu.mpi.interrupts.describe`)."""
        if self.process is None or self.process.proc is None or self._aborted:
            return
        self._aborted = True
        with signals_deferred():        # a second Ctrl-C must not leave half of the job running
            running = self.process.running()
            progress = self.read_progress()
            self.stop(progress, grace_s=ABORT_GRACE_S)
            if self.watch is not None:
                self.watch.stop()
            named = {s for p in progress for s in p.get("shm", [])}
            removed = set(cleanup_shm(sorted(named), self.process.shm_before, self.start_wall))
            removed |= {s for s in named if not os.path.exists(s)}     # a stopped rank drops its own
            self.process.close_logs()
        if self.reaper is not None:
            self.reaper.stand_down()
        if exc is not None and running:
            note(exc, stopped=f"the MPI job ({self.ranks} rank{'s' if self.ranks > 1 else ''}, "
                              f"mpiexec pid {self.process.proc.pid})")
        if exc is not None and removed:
            note(exc, removed=f"{len(removed)} /dev/shm segment{'s' if len(removed) > 1 else ''}")

    def read_progress(self) -> list[dict]:
        return read_records(self.progress_dir)

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""


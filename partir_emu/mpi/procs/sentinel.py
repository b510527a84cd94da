"""The watcher of one host's ranks under a user's ``mpiexec``: one line about a dead rank, no leaks.

Under ``mpiexec -n R partir-emu run … --backend mpi`` no launcher of ours is around: when a
rank is killed (SIGKILL, OOM), hydra SIGKILLs the others at once, so no rank can say which
one died, and nobody removes MPICH's ``/dev/shm/mpich_shm_*`` segment. So the first rank on
each host starts this process (:func:`partir_emu.mpi.ranks.worker.guard_under_mpirun`) in a
session of its own, where mpiexec's clean-up does not reach it::

    python -m partir_emu.mpi.procs.sentinel --dir DIR --ranks N [--deadline S] [--speak]
        [--proxy PID --proxy-start T [--launcher PID] [--hwloc FILE]...]

``DIR`` holds the progress records of the host's ``N`` ranks, each ``flock``-ed by its rank
while it lives (:class:`~partir_emu.mpi.deaths.DeathWatch` learns each exit). Once all
``N`` have exited it removes the segments the ranks reported and ``DIR``, and with
``--speak`` (the host of rank 0) prints at most one line to the stderr it shares with the
ranks (mpiexec forwards it, and waits for it to close before it exits). The ``--proxy`` options are
the :class:`~partir_emu.mpi.procs.supervise.ProxyLineage` the starting rank noted (the ranks' parent,
hydra's proxy, and its parent, mpiexec: this process may start seconds later, when they may be gone
already); with them it also removes the proxy's ``/tmp/hydra_hwloc_xmlfile_*`` once the proxy has
ended without doing so (killed with mpiexec):

- a rank that died without a word: ``partir-emu rank R device D op K (…): died without a
  message; it was the first rank to exit, …`` (a rank that failed knowingly printed its own:
  mpiexec exits at once after ``MPI_Abort``, it would not forward a line from here);
- ranks stopped by a signal mpiexec forwarded (Ctrl-C, SIGTERM): ``partir-emu: stopped by
  SIGINT: …``;

- mpiexec gone while the ranks run (the proxy lost its parent, or the proxy itself is gone:
  hydra's proxy should SIGKILL its ranks then, and under load was seen to leave them running for
  a minute, to their own ``--timeout``):
  the ranks are stopped here (SIGTERM, SIGKILL ``GRACE_S`` later) and the line says so;
- nothing after a clean run.

Only the standard library and partir_emu's runtime records: no mpi4py, no jax.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from partir_emu.mpi.deaths import TIE_S, DeathWatch
from partir_emu.mpi.failure_report import silent_death_lines
from partir_emu.mpi.procs.supervise import ProxyLineage, remove_hwloc, remove_segments
from partir_emu.mpi.procs.table import holds_file, is_alive
from partir_emu.runtime.progress import progress_path, read_records

LAUNCHER_SCAN_S = 0.25     # how often the sentinel checks that mpiexec is still there
GRACE_S = 3.0              # SIGTERM to SIGKILL when it stops the ranks itself


def stop_ranks(records: list[dict], progress_dir: str) -> None:
    """SIGTERM the ranks of ``records`` that still run, then SIGKILL those left ``GRACE_S`` later. A
    rank is known by the pid in its record *and* holding its progress file open (its ``flock``): a
    pid reused since is not ours, and a rank the proxy left behind (orphaned) still is."""
    def ours(pid: int, rank: int) -> bool:
        return is_alive(pid) and holds_file(pid, progress_path(progress_dir, rank))

    ranks = [(int(r["pid"]), int(r["rank"])) for r in records
             if isinstance(r.get("pid"), int) and isinstance(r.get("rank"), int)]
    ranks = [(p, r) for p, r in ranks if ours(p, r)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in ranks:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_S
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(ours(p, r) for p, r in ranks):
            time.sleep(0.05)
        ranks = [(p, r) for p, r in ranks if ours(p, r)]


def verdict(silent: list[tuple[float, dict]], records: list[dict], removed: int, tie_s: float = TIE_S) -> str | None:
    """The one line to print once every rank of the host has exited (None: nothing to say)."""
    segs = f"removed {removed} /dev/shm segment{'s' if removed != 1 else ''}"
    first_failure = min((r.get("t", math.inf) for r in records if r.get("phase") == "failed"), default=math.inf)
    silent = [(t, r) for t, r in silent if t < first_failure]    # mpiexec stopped them after a failure
    if silent:
        return "\n".join(silent_death_lines(silent, tie_s=tie_s)) + f"; {segs}"
    stopped = sorted({str(r["stopped_by"]) for r in records if r.get("stopped_by")})
    if stopped and not any(r.get("phase") == "failed" for r in records):
        n = len(records)
        return (f"partir-emu: stopped by {'/'.join(stopped)}: stopped the MPI job's {n} rank{'s' if n != 1 else ''} "
                f"on {socket.gethostname()}; {segs}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m partir_emu.mpi.procs.sentinel", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="the host's progress directory (removed at the end)")
    ap.add_argument("--ranks", type=int, required=True, help="ranks on this host")
    ap.add_argument("--deadline", type=float, default=math.inf, help="give up after this many seconds")
    ap.add_argument("--speak", action="store_true", help="print the line (one host of the job does)")
    ap.add_argument("--proxy", type=int, default=None, help="the ranks' parent (hydra's proxy) on this host")
    ap.add_argument("--proxy-start", type=int, default=0, help="its start time (/proc/PID/stat field 22)")
    ap.add_argument("--launcher", type=int, default=None, help="the proxy's parent as the ranks started (mpiexec)")
    ap.add_argument("--hwloc", action="append", default=[], help="a hwloc file the proxy held")
    args = ap.parse_args(argv)
    lineage = (ProxyLineage(args.proxy, args.proxy_start or None, args.launcher, tuple(args.hwloc))
               if args.proxy else None)
    for s in (signal.SIGINT, signal.SIGHUP):    # the terminal's signals are the ranks' to handle
        signal.signal(s, signal.SIG_IGN)
    watch = DeathWatch(Path(args.dir))
    done = lost = False
    end = time.monotonic() + args.deadline
    while not done and time.monotonic() < end:
        done = watch.wait_exits(args.ranks, min(LAUNCHER_SCAN_S, max(0.0, end - time.monotonic())))
        if not done and not lost and lineage is not None and lineage.lost():
            lost = True                         # mpiexec is gone: nothing will ever finish this job
            stop_ranks(read_records(args.dir), args.dir)
            end = min(end, time.monotonic() + 2 * GRACE_S)
    watch.stop()
    if not done:                                # ranks still alive: their segment is in use
        return 1
    records = read_records(args.dir)
    named = {s for r in records for s in r.get("shm", [])}
    removed = set(remove_segments(named)) | {s for s in named if not os.path.exists(s)}    # a stopped rank drops its own
    shutil.rmtree(args.dir, ignore_errors=True)
    line = (f"partir-emu: mpiexec is gone: stopped the MPI job's {len(records)} rank(s) on {socket.gethostname()}; "
            f"removed {len(removed)} /dev/shm segment(s)" if lost else
            verdict(watch.silent_deaths(settle_s=0.0), records, len(removed), watch.resolution_s))
    if line and args.speak:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except OSError:                         # mpiexec is gone (SIGHUP): nobody to tell
            pass
    if lineage is not None and lineage.hwloc:
        # a proxy killed with mpiexec (SIGHUP) leaves its hwloc file in /tmp; a live one removes it as
        # it ends, which it does only once our stdout and stderr (its pipes) are closed: close them first
        for fd in (1, 2):
            try:
                os.close(fd)
            except OSError:
                pass
        remove_hwloc(lineage.hwloc, lineage.proxy, lineage.proxy_start, wait_s=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

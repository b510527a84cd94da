"""The watcher of one host's ranks under a user's ``mpiexec``: one line about a dead rank, no leaks.

Under ``mpiexec -n R partir-emu run … --backend mpi`` no launcher of ours is around: when a
rank is killed (SIGKILL, OOM), hydra SIGKILLs the others at once, so no rank can say which
one died, and nobody removes MPICH's ``/dev/shm/mpich_shm_*`` segment. So the first rank on
each host starts this process (:func:`partir_emu.mpi.ranks.worker.guard_under_mpirun`) in a
session of its own, where mpiexec's clean-up does not reach it::

    python -m partir_emu.mpi.procs.sentinel --dir DIR --ranks N [--deadline S] [--speak]
        [--proxy PID --proxy-start T [--launcher PID] [--hwloc FILE]...]
        [--listen-fd FD --hosts N | --report ADDR,...:PORT]

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

On several hosts each host's sentinel sees only its own ranks, so the one on rank 0's host (the
speaker: ``--listen-fd``, a socket rank 0 opened) collects the others' reports (``--report``: they
send what they saw instead of printing it; :mod:`partir_emu.mpi.procs.hostreports`) and prints one
line over every host: the first rank to die anywhere with its host, the signal line counting every
host's ranks, on a timeout every rank's last position, and the hosts that never reported.

Only the standard library and partir_emu's runtime records: no mpi4py, no jax.
"""
from __future__ import annotations

import argparse
import json
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
from partir_emu.mpi.failure_report import laggards, positions, ranges, silent_death_lines
from partir_emu.mpi.procs import hostreports
from partir_emu.mpi.procs.supervise import ProxyLineage, remove_hwloc, remove_segments
from partir_emu.mpi.procs.table import holds_file, is_alive
from partir_emu.runtime.progress import progress_path, read_records

LAUNCHER_SCAN_S = 0.25     # how often the sentinel checks that mpiexec is still there
GRACE_S = 3.0              # SIGTERM to SIGKILL when it stops the ranks itself
HOSTS_FILE = "hosts.json"  # the speaker's: {host: [ranks]} of the whole job, written by rank 0


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


def verdict(silent: list[tuple[float, dict]], records: list[dict], removed: int, tie_s: float = TIE_S,
            hosts: Sequence[str] = ()) -> str | None:
    """The one line to print once every rank of the host (with ``hosts``: of every host that
    reported, whose names these are) has exited (None: nothing to say)."""
    segs = f"removed {removed} /dev/shm segment{'s' if removed != 1 else ''}"
    if len(hosts) > 1:
        segs += f" on {len(hosts)} hosts"
    first_failure = min((r.get("t", math.inf) for r in records if r.get("phase") == "failed"), default=math.inf)
    silent = [(t, r) for t, r in silent if t < first_failure]    # mpiexec stopped them after a failure
    if silent:
        return "\n".join(silent_death_lines(silent, tie_s=tie_s, on_host=len(hosts) > 1)) + f"; {segs}"
    stopped = sorted({str(r["stopped_by"]) for r in records if r.get("stopped_by")})
    if stopped and not any(r.get("phase") == "failed" for r in records):
        n = len(records)
        where = f"{len(hosts)} hosts ({', '.join(hosts)})" if len(hosts) > 1 else socket.gethostname()
        return (f"partir-emu: stopped by {'/'.join(stopped)}: stopped the MPI job's {n} rank{'s' if n != 1 else ''} "
                f"on {where}; {segs}")
    timed_out = sorted((r for r in records if " timed out after " in str(r.get("error", ""))), key=lambda r: r["rank"])
    if timed_out and len(hosts) > 1:        # the ranks left it to the speaker: every host's positions
        why = laggards(records, on_host=True) or [f"last positions: {positions(records, len(records), on_host=True)}"]
        return "; ".join([str(timed_out[0]["error"]).split("; last positions")[0], *why])
    return None


def host_report(records: list[dict], silent: list[tuple[float, dict]], removed: int, lost: bool,
                resolution_s: float) -> dict:
    """What a host's sentinel sends the speaker (:mod:`partir_emu.mpi.procs.hostreports`);
    ``resolution_s``: how exact its exit times are (its watch's)."""
    return {"host": socket.gethostname(), "records": records, "silent": [[t, r] for t, r in silent],
            "removed": removed, "lost": lost, "resolution_s": resolution_s}


def merged_line(every: list[dict], host_ranks: dict[str, list[int]]) -> str | None:
    """One line over the hosts' reports (``host_ranks``: every host's ranks, as far as known); hosts
    that did not report are named with their ranks. Exit times tie within the coarsest host's
    resolution."""
    tie_s = max([TIE_S, *(float(rep.get("resolution_s", TIE_S)) for rep in every)])
    records = [r for rep in every for r in rep["records"]]
    silent = sorted(((float(t), r) for rep in every for t, r in rep["silent"]), key=lambda x: x[0])
    removed = sum(int(rep["removed"]) for rep in every)
    hosts = [str(rep["host"]) for rep in every]
    if any(rep.get("lost") for rep in every):
        line: str | None = (f"partir-emu: mpiexec is gone: stopped the MPI job's {len(records)} rank(s) on "
                            f"{len(hosts)} host(s); removed {removed} /dev/shm segment(s)")
    else:
        line = verdict(silent, records, removed, tie_s, hosts=sorted(set(hosts)) if len(host_ranks) > 1 else ())
    missing = {h: rs for h, rs in host_ranks.items() if h not in hosts}
    if line and missing:
        line += "; " + "; ".join(f"no word from {h} (rank{'s' if len(rs) > 1 else ''} {ranges(rs)}): its link is "
                                 f"down or the host is gone" for h, rs in sorted(missing.items()))
    return line


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
    ap.add_argument("--listen-fd", type=int, default=None, help="the speaker: the socket the hosts report to")
    ap.add_argument("--report", default=None, help="ADDR,...:PORT: send this host's report to the speaker")
    args = ap.parse_args(argv)
    collector = hostreports.Collector(socket.socket(fileno=args.listen_fd)) if args.listen_fd is not None else None
    lineage = (ProxyLineage(args.proxy, args.proxy_start or None, args.launcher, tuple(args.hwloc))
               if args.proxy else None)
    out = 2
    if collector is not None and lineage is not None:
        out = _launcher_stderr(lineage.launcher) or 2
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
    host_ranks = _host_ranks(Path(args.dir)) if collector is not None else {}
    named = {s for r in records for s in r.get("shm", [])}
    removed = set(remove_segments(named)) | {s for s in named if not os.path.exists(s)}    # a stopped rank drops its own
    shutil.rmtree(args.dir, ignore_errors=True)
    silent = watch.silent_deaths(settle_s=0.0)
    line = (f"partir-emu: mpiexec is gone: stopped the MPI job's {len(records)} rank(s) on {socket.gethostname()}; "
            f"removed {len(removed)} /dev/shm segment(s)" if lost else
            verdict(silent, records, len(removed), watch.resolution_s))
    if args.report:                             # another host's sentinel speaks for the job
        addrs, _, port = args.report.rpartition(":")
        if hostreports.send(addrs.split(","), int(port),
                            host_report(records, silent, len(removed), lost, watch.resolution_s)):
            line = None
        elif line:
            line += f" (on {socket.gethostname()}: rank 0's host did not answer)"
    elif collector is not None:
        reports = collector.wait(len(host_ranks) - 1)
        line = merged_line([host_report(records, silent, len(removed), lost, watch.resolution_s), *reports],
                           host_ranks)
    if line and (args.speak or args.report):
        try:
            os.write(out, (line + "\n").encode(errors="replace"))
        except OSError:                         # mpiexec is gone (SIGHUP): nobody to tell
            pass
    if lineage is not None and lineage.hwloc:
        # a proxy killed with mpiexec (SIGHUP) leaves its hwloc file in /tmp; a live one removes it as
        # it ends, which it does only once our stdout and stderr (its pipes) are closed: close them first
        for fd in {1, 2, out}:
            try:
                os.close(fd)
            except OSError:
                pass
        remove_hwloc(lineage.hwloc, lineage.proxy, lineage.proxy_start, wait_s=5.0)
    return 0


def _launcher_stderr(pid: int | None) -> int | None:
    """mpiexec's own stderr, opened now (it lives: the sentinel starts with the job), when mpiexec runs
    on this host: across hosts hydra's proxies may end in a teardown before they forward our line."""
    try:
        if pid is None or not Path(f"/proc/{pid}/comm").read_text().startswith("mpiexec"):
            return None
        return os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
    except OSError:
        return None


def _host_ranks(progress_dir: Path) -> dict[str, list[int]]:
    """Every host's ranks, as rank 0 wrote them for the speaker (``hosts.json``) before starting it."""
    try:
        return {str(h): [int(r) for r in rs] for h, rs in json.loads((progress_dir / HOSTS_FILE).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


if __name__ == "__main__":
    sys.exit(main())

"""MPICH's shm segments on every host, also when a job dies in its start-up.

A job stopped inside ``MPI_Init`` (a host unreachable at launch, Ctrl-C while the ranks start)
leaves MPICH's ``/dev/shm/mpich_shm_*`` segment behind on each host whose ranks got that far, and no
rank has a progress record yet for a sentinel to clean up after. So the host's first rank (hydra's
``MPI_LOCALRANKID`` 0), before MPI starts (:func:`start_if_first_rank`, called when ``partir_emu``
is imported in a rank), starts this watcher in a session of its own::

    python -m partir_emu.mpi.procs.shmwatch --proxy PID --proxy-start T --since WALL [--deadline S]

It waits for hydra's proxy on this host (the rank's parent) to end, which it does when the job's
ranks here are gone however the job ended, and then removes the segments made since ``WALL`` that
no process maps any more (:func:`~partir_emu.mpi.procs.supervise.cleanup_shm`), and the proxy's
``/tmp/hydra_hwloc_xmlfile_*`` (a proxy killed in a teardown does not remove its own). A self-launched job
on one host needs none (the launcher does this itself: ``PARTIR_EMU_LAUNCHER_CLEANS``).
Only the standard library.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from partir_emu.mpi.procs.supervise import cleanup_shm, hwloc_files, remove_hwloc, shm_files
from partir_emu.mpi.procs.table import start_time

CLEANS_ENV = "PARTIR_EMU_LAUNCHER_CLEANS"      # set by our single-host launcher: it removes them itself
POLL_S = 0.2


def start_if_first_rank() -> bool:
    """In the first rank of a host under hydra, before MPI starts: start the watcher. True if it did."""
    if os.environ.get("MPI_LOCALRANKID") != "0" or "PMI_RANK" not in os.environ or os.environ.get(CLEANS_ENV):
        return False
    if "mpi4py.MPI" in sys.modules:             # MPI started already: its segment exists, the since would be late
        return False
    proxy = os.getppid()
    cmd = [sys.executable, "-m", "partir_emu.mpi.procs.shmwatch", "--proxy", str(proxy),
           "--proxy-start", str(start_time(proxy) or 0), "--since", repr(time.time())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL"))}
    try:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=env, start_new_session=True)
    except OSError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m partir_emu.mpi.procs.shmwatch", description=__doc__.splitlines()[0])
    ap.add_argument("--proxy", type=int, required=True, help="hydra's proxy on this host (the ranks' parent)")
    ap.add_argument("--proxy-start", type=int, default=0, help="its start time (/proc/PID/stat field 22)")
    ap.add_argument("--since", type=float, required=True, help="segments made since this wall time are the job's")
    ap.add_argument("--deadline", type=float, default=7 * 24 * 3600.0, help="give up after this many seconds")
    args = ap.parse_args(argv)
    before = {p for p in shm_files() if _mtime(p) < args.since - 1}
    hwloc: set[str] = set()         # the proxy's topology file (made as the ranks ask): killed, it leaves it
    end = time.monotonic() + args.deadline
    while start_time(args.proxy) == (args.proxy_start or None) and time.monotonic() < end:
        hwloc |= hwloc_files([args.proxy])
        time.sleep(POLL_S)
    cleanup_shm([], before, args.since)
    if start_time(args.proxy) != (args.proxy_start or None):
        remove_hwloc(hwloc)
    return 0


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


if __name__ == "__main__":
    sys.exit(main())

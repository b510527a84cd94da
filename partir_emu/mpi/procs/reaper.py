"""Who cleans up a launch when its launcher cannot: SIGKILL, the OOM killer, a crash.

A launcher that is stopped by a catchable signal cleans up itself (:meth:`.launch.MpiRun.abort`).
One that is SIGKILLed runs no code, and mpiexec, the ranks, their ``/dev/shm`` segments and the
run's temp dir used to stay until mpiexec's own timeout (the temp dir for good). So each launch
starts this watcher::

    python -m partir_emu.mpi.procs.reaper          # one JSON line on stdin, then waits on stdin

in a session of its own (a terminal's Ctrl-C to the launcher's group does not reach it). It
reads its orders (``pgid``: mpiexec's process group; ``marker``: a string in every rank's
command line; ``progress``: the ranks' progress records; ``shm_before``/``since``: to tell the
run's segments; ``workdir`` and whether to remove it), then blocks reading stdin, whose write end
only the launcher holds. ``done`` from the launcher (its run ended, it cleaned up) ends the watcher
quietly; end of file without it means the launcher is gone: the watcher stops what is left
(:func:`.supervise.stop_left_over`), removes the run's segments and, if asked, its temp dir.
It passes its orders on stdin, not argv, so that no marker is in its own command line (the
launcher's own clean-up stops every process whose command line holds the marker).

Only the standard library and partir_emu's runtime records: no mpi4py, no jax.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from partir_emu.mpi.procs.supervise import cleanup_shm, stop_left_over
from partir_emu.runtime.progress import read_records

DONE = b"done\n"
GRACE_S = 3.0


class Reaper:
    """The launcher's end of one watcher: :meth:`stand_down` once the launch is cleaned up."""

    def __init__(self, orders: Mapping[str, object], env: Mapping[str, str]) -> None:
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "partir_emu.mpi.procs.reaper"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=dict(env), start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(orders)).encode() + b"\n")
        self.proc.stdin.flush()

    def stand_down(self) -> None:
        """The launch is over and cleaned up: the watcher ends without touching anything."""
        proc, self.proc = self.proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(DONE)
            proc.stdin.close()
        except OSError:                 # (it is gone already)
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reap(orders: Mapping) -> None:
    """The launcher is gone: stop its launch's processes, remove its segments and its temp dir."""
    stop_left_over(int(orders["pgid"]), str(orders["marker"]), GRACE_S)
    records = read_records(Path(orders["progress"])) if Path(orders["progress"]).is_dir() else []
    named = [s for r in records for s in r.get("shm", [])]
    cleanup_shm(named, set(orders.get("shm_before", [])), float(orders.get("since", 0.0)))
    if orders.get("remove_workdir"):
        shutil.rmtree(str(orders["workdir"]), ignore_errors=True)


def main() -> int:
    stdin = sys.stdin.buffer
    try:
        orders = json.loads(stdin.readline())
    except ValueError:
        return 2
    rest = stdin.read()                 # blocks until the launcher stands down or is gone
    if rest.startswith(DONE):
        return 0
    reap(orders)
    return 0


if __name__ == "__main__":
    sys.exit(main())

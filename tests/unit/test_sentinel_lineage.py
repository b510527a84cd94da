"""The sentinel stops a host's ranks once their launcher is gone, even when it starts only after
the launcher has died (under load it starts seconds after the rank that spawned it: the fresh-clone
runs saw SIGHUP to mpiexec leave the ranks running for 57 s, to their own ``--timeout``).

Without MPI: a stand-in "launcher" starts a stand-in "proxy", which starts a stand-in "rank" that
holds the ``flock`` on its progress record as a rank does. The rank's lineage is noted while all
live, as :func:`partir_emu.mpi.ranks.worker.guard_under_mpirun` does; then the launcher (or the
proxy) is SIGKILLed, and only then is the sentinel started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partir_emu.mpi.procs.supervise import ProxyLineage
from partir_emu.mpi.procs.table import is_alive, start_time
from partir_emu.runtime.progress import progress_path

RANK = """
import fcntl, json, os, sys, time
sys.path[:0] = [sys.argv[3]]
from partir_emu.runtime.progress import encode_record
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, encode_record({"rank": 0, "pid": os.getpid(), "devices": [0], "phase": "step", "op": 0}))
print(json.dumps({"rank": os.getpid(), "proxy": os.getppid()}), flush=True)
time.sleep(120)
"""
SPAWN = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)"
ROOT = str(Path(__file__).resolve().parents[2])


def _job(tmp: Path) -> tuple[subprocess.Popen, dict]:
    """launcher → proxy → rank; the pids, once the rank holds its record."""
    rank = [sys.executable, "-c", RANK, str(progress_path(tmp, 0)), "", ROOT]
    launcher = subprocess.Popen([sys.executable, "-c", SPAWN, sys.executable, "-c", SPAWN, *rank],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert launcher.stdout is not None
    pids = json.loads(launcher.stdout.readline())
    return launcher, pids


def _sentinel(tmp: Path, lineage: ProxyLineage) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "partir_emu.mpi.procs.sentinel", "--dir", str(tmp), "--ranks", "1",
                           "--deadline", "30", "--speak", *lineage.argv()],
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("gone", ["launcher", "proxy"])
def test_a_sentinel_started_after_the_launcher_died_stops_the_ranks(tmp_path, gone):
    launcher, pids = _job(tmp_path)
    try:
        assert pids["proxy"] != launcher.pid
        lineage = ProxyLineage(pids["proxy"], start_time(pids["proxy"]), launcher.pid)
        assert not lineage.lost()
        os.kill(launcher.pid if gone == "launcher" else pids["proxy"], signal.SIGKILL)
        if gone == "launcher":
            launcher.wait()
        t0 = time.monotonic()
        deadline = t0 + 10
        while not lineage.lost() and time.monotonic() < deadline:   # the kernel reparents the proxy
            time.sleep(0.01)
        assert lineage.lost()
        done = _sentinel(tmp_path, lineage)
        secs = time.monotonic() - t0
    finally:
        for pid in (pids["rank"], pids["proxy"], launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launcher.wait()
    assert done.returncode == 0, done.stderr
    assert not is_alive(pids["rank"])
    assert secs < 15, secs
    assert done.stderr.startswith("partir-emu: mpiexec is gone: stopped the MPI job's 1 rank(s)"), done.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_lineage_without_a_launcher_is_never_lost(tmp_path):
    """A rank whose parent had no parent to note (started by init) is not judged by its lineage."""
    lineage = ProxyLineage(os.getpid(), start_time(os.getpid()), None)
    assert not lineage.lost()
    assert "--launcher" not in lineage.argv()


def test_a_lineage_notes_the_parent_and_its_parent():
    here = ProxyLineage.of_parent()
    assert here.proxy == os.getppid() and here.proxy_start == start_time(os.getppid())
    assert not here.lost()

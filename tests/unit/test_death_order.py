"""Who died first, without MPI: stand-in "ranks" are processes that hold the ``flock`` on their
progress record as a rank does (:class:`partir_emu.mpi.ranks.guard.RankGuard`), killed in a
known order; :class:`DeathWatch` must see that order, and a report must not claim an order
finer than the watch could see."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from partir_emu.mpi.deaths import TIE_S, DeathWatch, exit_statuses
from partir_emu.mpi.failure_report import silent_death_lines
from partir_emu.runtime.progress import encode_record, progress_path

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())          # the record, written once the lock is held
print("locked", flush=True)
time.sleep(120)
"""


def _rank(tmp: Path, rank: int) -> subprocess.Popen:
    path = progress_path(tmp, rank)
    path.touch()
    rec = encode_record({"rank": rank, "devices": [rank], "phase": "step", "op": 3, "prim": "all_reduce",
                         "source": "x.py:1", "state": "moving data"}).decode()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), rec], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    return p


def test_the_watch_sees_the_order_ranks_exit_in(tmp_path):
    procs = [_rank(tmp_path, r) for r in range(3)]
    watch = DeathWatch(tmp_path)
    try:
        time.sleep(0.3)                          # the scanner starts a waiter per record
        for r in (2, 0, 1):                      # 2 first, then 0, then 1, well apart
            procs[r].send_signal(signal.SIGKILL)
            procs[r].wait()
            time.sleep(0.25)
        assert watch.wait_exits(3, 10.0)
        silent = watch.silent_deaths()
    finally:
        watch.stop()
        for p in procs:
            p.kill()
            p.wait()
    assert [int(r["rank"]) for _, r in silent] == [2, 0, 1]
    lines = silent_death_lines(silent, tie_s=watch.resolution_s)
    assert len(lines) == 1 and lines[0].startswith("partir-emu rank 2 device 2 op 3 (all_reduce at x.py:1")
    assert "it was the first rank to exit" in lines[0]


def test_a_busy_process_widens_the_watch_resolution(tmp_path):
    """The stamps are taken when a thread of this process wakes; while another thread holds the
    GIL for long stretches, the watch's resolution must say so."""
    watch = DeathWatch(tmp_path)
    old = sys.getswitchinterval()
    try:
        time.sleep(0.1)
        idle = watch.resolution_s
        sys.setswitchinterval(0.2)               # hand the GIL over only every 200 ms
        end = time.monotonic() + 1.0
        while time.monotonic() < end:            # pure Python: holds the GIL
            pass
    finally:
        sys.setswitchinterval(old)
        watch.stop()
    time.sleep(0.1)
    assert idle == pytest.approx(TIE_S) or idle < 0.05
    assert watch.resolution_s > 0.1, watch.resolution_s


def _silent(times: dict[int, float]) -> list[tuple[float, dict]]:
    return sorted(((t, {"rank": r, "devices": [r], "phase": "step", "op": 1, "prim": "all_reduce",
                        "source": "m.py:2", "state": "moving data"}) for r, t in times.items()), key=lambda x: x[0])


@pytest.mark.parametrize("tie_s, named, which", [
    (TIE_S, [1], "it was the first rank to exit"),
    (0.015, [1, 3], "one of the first ranks to exit"),
    (1.0, [1, 3, 0], "one of the first ranks to exit"),
])
def test_ranks_closer_than_the_resolution_are_named_as_tied(tie_s, named, which):
    lines = silent_death_lines(_silent({1: 10.000, 3: 10.010, 0: 10.300}), tie_s=tie_s)
    assert [int(ln.split()[2]) for ln in lines] == named
    assert all(which in ln for ln in lines)


def test_hydra_statuses_decide_before_the_clock():
    """One rank exited with an error code, the others were killed by hydra: the error code names
    it whatever the (late) stamps say; two ranks killed by a signal leave it to the clock."""
    text = "Exit codes: [host:0] 9,9,768,9\n"
    status = exit_statuses(text)
    assert status == {0: "killed by signal 9", 1: "killed by signal 9", 2: "exit code 3", 3: "killed by signal 9"}
    lines = silent_death_lines(_silent({0: 1.0, 1: 1.001, 2: 1.05, 3: 1.002}), status)
    assert len(lines) == 1 and lines[0].startswith("partir-emu rank 2 ") and "(exit code 3)" in lines[0]
    status = exit_statuses("Exit codes: [host:0] 9,0,9,0\n")
    lines = silent_death_lines(_silent({1: 1.0, 0: 1.5, 2: 1.6, 3: 1.7}), status, tie_s=0.01)
    assert [int(ln.split()[2]) for ln in lines] == [1]


def test_exit_statuses_of_other_output_are_unknown():
    assert exit_statuses("nothing here") == {}
    assert exit_statuses("Exit codes: [a:0] 0\nExit codes: [b:1] 0\n") == {}    # two hosts: no single line


def test_a_rank_gone_before_the_watch_began_counts_as_earliest(tmp_path):
    p = _rank(tmp_path, 0)
    q = _rank(tmp_path, 1)
    p.kill()
    p.wait()
    watch = DeathWatch(tmp_path)
    try:
        time.sleep(0.3)
        q.kill()
        q.wait()
        assert watch.wait_exits(2, 10.0)
        silent = watch.silent_deaths()
    finally:
        watch.stop()
        q.kill()
        q.wait()
    assert [(int(r["rank"]), t == 0.0) for t, r in silent] == [(0, True), (1, False)]


def test_the_watch_thread_stops(tmp_path):
    watch = DeathWatch(tmp_path)
    watch.stop()
    watch._scanner.join(1.0)
    assert not watch._scanner.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "partir-emu-deathwatch" and t.is_alive()]

"""Clean shutdown on every path: SIGINT, SIGTERM and SIGHUP of ``partir-emu run --backend mpi``
(self-launched, and under the user's own ``mpiexec``) and a rank dying under the user's mpiexec.

Each run is a 2-rank ``mlp --size tiny`` job whose rank 1 hangs before its first collective
(the test hook ``--inject-fault rank:1:op:0:hang``, :mod:`partir_emu.mpi.faults`), so it is surely running when
the signal arrives: the test polls the ranks' progress records until both are in the step,
notes every process of the job and the ``/dev/shm`` segments they map, sends the signal, and
then asserts: the job ends within 5 s with exit status 128 + signum, exactly one
``partir-emu`` line and no traceback, and nothing is left — no live process of the job (by
pid + start time, by session, and by the test's ``TMPDIR`` in a process's environment), none
of its shm segments, no temp directory. (Only the job's own segments are checked: other
processes on the box may create and remove theirs meanwhile.)
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partir_emu.mpi.procs.supervise import hwloc_files
from tests.conftest import default_signals, wall
from tests.mpi.conftest import MPIEXEC

EXE = Path(sys.executable).parent / "partir-emu"
RUN = ["run", "mlp", "--size", "tiny", "--strategy", "bp", "--mesh", "batch=2", "--backend", "mpi", "--timeout", "60"]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
STOP_S = wall(5.0)
pytestmark = pytest.mark.wallclock


# -- /proc ---------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """Fields after the command name: [0] state, [1] ppid, [2] pgid, [3] sid, [19] start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _live(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _tree(root: int) -> dict[int, str]:
    """``root`` and its descendants → their start times (an identity that survives pid reuse)."""
    table = {p: st for p in _pids() if (st := _stat(p)) is not None}
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        if p in table:
            out[p] = table[p][19]
            todo += [c for c, st in table.items() if int(st[1]) == p]
    return out


def _mapped_shm(pids) -> set[str]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/maps") as f:
                out |= {ln.rsplit(None, 1)[-1] for ln in f if "/dev/shm/mpich_shm" in ln}
        except OSError:
            pass
    return out


def _with_marker(marker: str) -> list[int]:
    """Live processes whose environment or command line holds ``marker`` (the test's TMPDIR)."""
    out = []
    for p in _pids():
        if p == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (marker.encode() in env or marker.encode() in cmd) and _live(p):
            out.append(p)
    return out


# -- a job ---------------------------------------------------------------------------------------
def _fault(spec: str) -> list[str]:
    """The CLI's hidden test option that makes a rank misbehave (partir_emu.mpi.faults)."""
    return ["--inject-fault", spec]


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, TMPDIR=str(tmp_path), MPIEXEC_TIMEOUT="60",
                JAX_PLATFORMS="cpu")


def _records(pattern: str) -> list[dict]:
    out = []
    for f in sorted(glob.glob(pattern)):
        try:
            out.append(json.loads(Path(f).read_bytes().rstrip(b" \0\n")))
        except (OSError, ValueError):
            pass
    return out


def _wait_for(proc: subprocess.Popen, pattern: str, ranks: int, phase: str | None, timeout_s: float = 60) -> list[dict]:
    """Poll the ranks' progress records until ``ranks`` of them exist (in ``phase``)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        recs = _records(pattern)
        if len(recs) == ranks and all(phase is None or r.get("phase") == phase for r in recs):
            return recs
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended before it was running (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the ranks never reached {phase or 'start-up'}: {_records(pattern)}")


def _assert_nothing_left(tmp_path: Path, tree: dict[int, str], sid: int, shm: set[str]) -> None:
    end = time.monotonic() + 3.0         # the watcher outlives mpiexec by a moment after SIGHUP
    while True:
        alive = [p for p, t in tree.items() if _live(p) and (_stat(p) or [None] * 20)[19] == t]
        alive += [p for p in _pids() if (st := _stat(p)) is not None and int(st[3]) == sid and _live(p)]
        alive += _with_marker(str(tmp_path))
        left_shm = [s for s in shm if os.path.exists(s)]
        temp = [p.name for p in tmp_path.iterdir() if p.name.startswith("partir-emu-")]
        if not (alive or left_shm or temp) or time.monotonic() > end:
            break
        time.sleep(0.1)
    cmds = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in set(alive) if _live(p)}
    assert not alive, f"processes left behind: {cmds}"
    assert not left_shm, f"/dev/shm segments or hydra hwloc files left behind: {left_shm}"
    assert not temp, f"temp directories left behind: {temp}"


def _signal_once_running(proc: subprocess.Popen, pattern: str, sig: signal.Signals, *, group: bool = False):
    """Wait until both ranks are in the step, note the job's processes and shm segments, send
    ``sig`` (to the process group with ``group``, as a terminal's Ctrl-C does) and wait for the
    end: ``(out, err, seconds to stop, process tree, shm segments)``."""
    try:
        recs = _wait_for(proc, pattern, 2, "step")
        tree = _tree(proc.pid)
        shm = _mapped_shm(tree) | {s for r in recs for s in r.get("shm", [])}
        assert shm, "the ranks map no MPICH segment"
        shm |= hwloc_files(tree)           # hydra's per-job file in /tmp: gone after the stop too
        t0 = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=wall(30))
        return out, err, time.monotonic() - t0, tree, shm
    finally:
        if proc.poll() is None:
            proc.kill()


def _partir_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("partir-emu")]


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_signal_to_self_launched_run(tmp_path, sig):
    """``partir-emu run --backend mpi`` stops mpiexec and every rank, removes the shm segment
    and its temp dir, and says so in one line (SIGINT goes to the process group, as Ctrl-C)."""
    proc = subprocess.Popen(default_signals([str(EXE), *RUN, "--devices", "2", *_fault("rank:1:op:0:hang")]), env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err, secs, tree, shm = _signal_once_running(
        proc, str(tmp_path / "partir-emu-mpi-*" / "progress" / "rank-*.json"), sig, group=sig == signal.SIGINT)
    assert secs < STOP_S, f"took {secs:.1f} s to stop"
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert "Traceback" not in err + out, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"partir-emu run: stopped by {sig.name}: stopped the MPI job (2 ranks"), err
    assert "temp dir" in lines[0], err
    _assert_nothing_left(tmp_path, tree, proc.pid, shm)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_signal_to_users_mpiexec(tmp_path, sig):
    """``mpiexec -n 2 partir-emu run …``: mpiexec forwards SIGINT/SIGTERM, the ranks drop their
    segment and exit 128 + signum, and the job's watcher prints one line. SIGHUP kills mpiexec
    itself (hydra then SIGKILLs the ranks): nobody is left to print to, but nothing may leak."""
    proc = subprocess.Popen(default_signals([str(MPIEXEC), "-n", "2", str(EXE), *RUN, "--devices-per-rank", "1", *_fault("rank:1:op:0:hang")]),
                            env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err, secs, tree, shm = _signal_once_running(proc, str(tmp_path / "partir-emu-ranks-*" / "rank-*.json"), sig)
    # (57 s, to the job's --timeout, when the suite ran under nohup and mpiexec inherited SIGHUP
    # ignored: hence default_signals)
    assert secs < STOP_S, f"took {secs:.1f} s to stop; exit {proc.returncode}; stderr: {err[-2000:]}"
    assert "Traceback" not in err + out, err
    if sig == signal.SIGHUP:
        assert proc.returncode == -signal.SIGHUP, (proc.returncode, err)
    else:
        assert proc.returncode == 128 + sig, (proc.returncode, err)
        lines = _partir_lines(err + out)
        assert len(lines) == 1, err
        assert lines[0].startswith(f"partir-emu: stopped by {sig.name}: stopped the MPI job's 2 ranks"), err
    _assert_nothing_left(tmp_path, tree, proc.pid, shm)


@pytest.mark.parametrize("proxy_sig", [signal.SIGSTOP, signal.SIGKILL], ids=["proxy-stopped", "proxy-killed"])
def test_ranks_are_stopped_when_mpiexec_is_gone_and_its_proxy_does_nothing(tmp_path, proxy_sig):
    """mpiexec SIGKILLed while its proxy cannot act (SIGSTOPped, or SIGKILLed so the ranks are
    orphans: under load a proxy was seen to leave its ranks running for a minute, to their own
    --timeout): the host's sentinel sees the proxy lose its parent (or vanish), stops the ranks
    itself; nothing is left behind."""
    proc = subprocess.Popen(default_signals([str(MPIEXEC), "-n", "2", str(EXE), *RUN, "--devices-per-rank", "1", *_fault("rank:1:op:0:hang")]),
                            env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    proxies: list[int] = []
    try:
        recs = _wait_for(proc, str(tmp_path / "partir-emu-ranks-*" / "rank-*.json"), 2, "step")
        tree = _tree(proc.pid)
        shm = _mapped_shm(tree) | {s for r in recs for s in r.get("shm", [])}
        ranks = [int(r["pid"]) for r in recs]
        proxies = sorted({int((_stat(p) or [0, 0])[1]) for p in ranks})
        assert proxies and proc.pid not in proxies
        for p in proxies:
            os.kill(p, proxy_sig)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=wall(10))
        while any(_live(p) for p in ranks) and time.monotonic() - t0 < wall(20):
            time.sleep(0.05)
        secs = time.monotonic() - t0
        assert not any(_live(p) for p in ranks), "the ranks outlived mpiexec"
        assert secs < STOP_S, f"took {secs:.1f} s to stop the ranks"
    finally:
        for p in proxies:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
        if proc.poll() is None:
            proc.kill()
    # (the sentinel's line goes to the ranks' stderr, a pipe to the stopped proxy: nobody reads it)
    _assert_nothing_left(tmp_path, tree, proc.pid, shm)


def test_rank_death_under_users_mpiexec_is_named_once(tmp_path):
    """A rank SIGKILLed in a collective (hydra then SIGKILLs the others): one line names it, its
    device and op; the segment and the progress directory are removed."""
    proc = subprocess.Popen(default_signals([str(MPIEXEC), "-n", "2", str(EXE), *RUN, "--devices-per-rank", "1", *_fault("rank:1:op:0:kill")]),
                            env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        recs = _wait_for(proc, str(tmp_path / "partir-emu-ranks-*" / "rank-*.json"), 2, None)
        tree = _tree(proc.pid)
        shm = _mapped_shm(tree) | {s for r in recs for s in r.get("shm", [])}
        out, err = proc.communicate(timeout=wall(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert shm, "the ranks reported no MPICH segment"
    assert proc.returncode != 0
    assert "Traceback" not in err + out, err
    lines = _partir_lines(err + out)
    assert len(lines) == 1, err
    assert lines[0].startswith("partir-emu rank 1 device 1 op ") and "died without a message" in lines[0], err
    _assert_nothing_left(tmp_path, tree, proc.pid, shm)


def test_bad_input_under_users_mpiexec_prints_once(tmp_path):
    """Every rank raises the same usage error; rank 0 alone prints it."""
    out = subprocess.run([str(MPIEXEC), "-n", "2", str(EXE), "run", "mlp", "--size", "tiny", "--mesh", "batch=3",
                          "--backend", "mpi", "--devices-per-rank", "1"], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=wall(60))
    assert out.returncode == 2, out.stderr
    lines = _partir_lines(out.stderr + out.stdout)
    assert len(lines) == 1 and "error:" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_timeout_under_users_mpiexec_is_reported_once(tmp_path):
    """Every rank's watchdog fires at once; the first to claim it prints one line for all. The job's
    timeout covers start-up too: 4 s let a loaded machine time out before rank 0 reached its first op
    (a fresh clone's run beside the suite), so it is scaled as the other wall-clock limits are."""
    limit = int(wall(3))
    t0 = time.monotonic()
    out = subprocess.run([str(MPIEXEC), "-n", "2", str(EXE), *RUN[:-1], str(limit), "--devices-per-rank", "1",
                          *_fault("rank:1:op:0:hang")],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=wall(60))
    assert out.returncode != 0
    assert time.monotonic() - t0 < wall(30)
    lines = _partir_lines(out.stderr + out.stdout)
    assert len(lines) == 1, out.stderr
    assert f"timed out after {limit} s (--timeout)" in lines[0] and "last positions: rank 0: op " in lines[0], lines[0]
    _assert_nothing_left(tmp_path, {}, -1, set())     # mpiexec exits at MPI_Abort; the watcher a moment later


def test_sigkill_of_the_launcher_leaves_nothing(tmp_path):
    """The launcher SIGKILLed (no code of it runs): its watcher (partir_emu.mpi.procs.reaper) stops
    mpiexec and the ranks, removes their shm segment and the run's temp dir, within 10 s."""
    proc = subprocess.Popen(default_signals([str(EXE), *RUN, "--devices", "2", *_fault("rank:1:op:0:hang")]), env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        recs = _wait_for(proc, str(tmp_path / "partir-emu-mpi-*" / "progress" / "rank-*.json"), 2, "step")
        tree = _tree(proc.pid)
        shm = _mapped_shm(tree) | {s for r in recs for s in r.get("shm", [])}
        assert shm, "the ranks map no MPICH segment"
        shm |= hwloc_files(tree)           # hydra's per-job file in /tmp: gone after the stop too
        ranks = [p for p in tree if p != proc.pid]
        assert ranks, "the launcher has no mpiexec below it"
        proc.kill()
        proc.communicate(timeout=wall(10))
        t0 = time.monotonic()
        while any(_live(p) and (_stat(p) or [None] * 20)[19] == tree[p] for p in ranks) and \
                time.monotonic() - t0 < wall(10):
            time.sleep(0.1)
        del tree[proc.pid]
        # the launcher's own session: the mpiexec group is in a session of its own, checked by tree
        _assert_nothing_left(tmp_path, tree, -1, shm)
        assert time.monotonic() - t0 < wall(10)
    finally:
        if proc.poll() is None:
            proc.kill()

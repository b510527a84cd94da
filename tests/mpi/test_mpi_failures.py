"""Failure behaviour of MPI runs: a rank raising, a rank killed mid-collective, a rank exiting,
a mismatched collective, a hang ended by the ranks' watchdog and by the launcher's timeout.

Each run must end non-zero within 10 s of the failure (timeouts: of the deadline) with a
message naming the rank, its device and the op, leave no process behind (``pgrep -f`` on the
run's unique work dir) and no MPICH segment in /dev/shm. Failures are injected with the
test hook :mod:`partir_emu.mpi.faults` (``rank:R:op:K:MODE``, passed with the job).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wall
from tests.mpi.conftest import lowered, shm_files

MESH = "batch=4"
SLACK_S = wall(10.0)
pytestmark = pytest.mark.wallclock


def _program():
    exp, spmd = lowered("mlp", "bp", MESH)
    comm = [i for i, e in enumerate(spmd.program.eqns) if e.prim in ("all_gather", "all_reduce", "reduce_scatter",
                                                                       "all_to_all")]
    return exp, spmd, comm


def _run(tmp_path: Path, fault: str | None, *, k: int = 1, timeout_s: float = 60, rank_timeout_s=None,
         env: dict | None = None):
    """Launch the mlp/bp program on 4 devices; returns (error or None, seconds, work dir)."""
    from partir_emu.app.cli.mpi_run import ScenarioMpiRun as MpiRun
    from partir_emu.errors import EmulationError
    _, spmd, _ = _program()
    work = tmp_path / "run"
    work.mkdir()
    spmd.save(work / "program.json")
    job = {"program": str(work / "program.json"), "scenario": "mlp", "algorithm": "ring", "devices_per_rank": k}
    run = MpiRun([job], 4 // k, timeout_s=timeout_s, rank_timeout_s=rank_timeout_s, workdir=work, env=env, fault=fault)
    t0 = time.monotonic()
    try:
        run.start().wait()
        err = None
    except EmulationError as exc:
        err = exc
    return err, time.monotonic() - t0, work, run


def _no_leftovers(work: Path, run) -> None:
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left behind: {left.stdout}"
    named = {s for p in run.read_progress() for s in p.get("shm", [])}
    assert named, "the ranks did not report their /dev/shm segment"
    assert not [s for s in named if os.path.exists(s)], f"/dev/shm segments left behind: {named}"


@pytest.fixture(scope="module")
def baseline_s(tmp_path_factory):
    """Seconds for a clean launch of the same job (start-up included)."""
    err, secs, work, run = _run(tmp_path_factory.mktemp("baseline"), None)
    assert err is None, err
    _no_leftovers(work, run)
    return secs


@pytest.mark.parametrize("mode,k,rank", [("raise", 1, 2), ("kill", 1, 2), ("kill", 2, 1), ("exit", 1, 3)])
def test_rank_failure_names_rank_device_op(tmp_path, baseline_s, mode, k, rank):
    _, _, comm = _program()
    op = comm[len(comm) // 2]                     # a collective in the middle of the step
    before = shm_files()
    err, secs, work, run = _run(tmp_path, f"rank:{rank}:op:{op}:{mode}", k=k)
    assert err is not None, "the run must fail"
    msg = str(err)
    devices = f"device {rank}" if k == 1 else f"devices {rank * k}-{rank * k + k - 1}"
    assert f"partir-emu rank {rank} {devices} op {op} (all_reduce at " in msg, msg
    if mode == "raise":
        assert "fault injected" in msg
    if mode == "kill":
        # hydra SIGKILLs the survivors within a millisecond or two: the same status, and exit
        # times a loaded machine cannot always order. The dead rank must be named (above); the
        # report may say it tied with another rather than claim an order it cannot see.
        assert "killed by signal 9" in msg
        assert "it was the first rank to exit" in msg or "one of the first ranks to exit" in msg
    if mode == "exit":
        assert "exit code 3" in msg
    assert secs < baseline_s + SLACK_S, f"took {secs:.1f} s (clean run {baseline_s:.1f} s)"
    _no_leftovers(work, run)
    assert not {s for s in shm_files() - before if s in {Path(x).name for p in run.read_progress()
                                                             for x in p.get("shm", [])}}


def test_mismatched_collective_is_an_error_not_a_hang(tmp_path, baseline_s):
    _, _, comm = _program()
    op = comm[1]
    err, secs, work, run = _run(tmp_path, f"rank:2:op:{op}:mismatch")
    assert err is not None
    msg = str(err)
    assert f"op {op} (all_reduce at " in msg and "disagree" in msg, msg
    assert f"rank 2 runs op {op} all_reduce of float32[" in msg and "ranks 0,1,3 run" in msg, msg
    assert secs < baseline_s + SLACK_S
    _no_leftovers(work, run)


def test_hang_stopped_by_rank_watchdog(tmp_path, baseline_s):
    _, _, comm = _program()
    op = comm[2]
    timeout = 6.0
    err, secs, work, run = _run(tmp_path, f"rank:1:op:{op}:hang", timeout_s=timeout)
    assert err is not None
    msg = str(err)
    assert "timed out after 6 s" in msg, msg
    assert f"partir-emu rank 1 device 1 op {comm[1]} (all_reduce at " in msg and "behind the others" in msg, msg
    assert f"ranks 0,2-3: op {op} (all_reduce at " in msg and "waiting for the other ranks" in msg, msg
    assert secs < timeout + SLACK_S
    _no_leftovers(work, run)


def test_hang_stopped_by_launcher_timeout(tmp_path, baseline_s):
    """Ranks whose own watchdog never fires and an mpiexec that does not time out (both
    disabled here) are stopped by the launcher: SIGTERM to mpiexec's process group, then
    SIGTERM and SIGKILL to leftover ranks."""
    _, _, comm = _program()
    op = comm[2]
    timeout = 3.0
    err, secs, work, run = _run(tmp_path, f"rank:3:op:{op}:hang", timeout_s=timeout, rank_timeout_s=1000,
                                env={"MPIEXEC_TIMEOUT": "1000"})
    assert err is not None
    msg = str(err)
    assert "timed out after 3 s" in msg, msg
    assert f"partir-emu rank 3 device 3 op {comm[1]} (all_reduce at " in msg and "behind the others" in msg, msg
    assert f"ranks 0-2: op {op} (all_reduce at " in msg, msg
    assert secs < timeout + SLACK_S
    _no_leftovers(work, run)


def test_cli_reports_rank_failure_and_exits_nonzero(tmp_path):
    """The user's view: `partir-emu run --backend mpi` prints the rank's message and exits 2."""
    _, _, comm = _program()
    op = comm[3]
    exe = Path(sys.executable).parent / "partir-emu"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([str(exe), "run", "mlp", "--strategy", "bp", "--mesh", MESH, "--backend", "mpi",
                          "--devices", "4", "--devices-per-rank", "2", "--timeout", "60", "--report",
                          str(tmp_path / "r.json"), "--inject-fault", f"rank:1:op:{op}:raise"], capture_output=True, text=True, timeout=wall(120), env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"partir-emu rank 1 devices 2-3 op {op} (all_reduce at " in out.stderr, out.stderr
    assert not (tmp_path / "r.json").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("partir-emu-mpi-")], "temp dir left behind"


def test_rank_failure_under_users_mpirun(tmp_path):
    """Under the user's `mpirun … partir-emu run --backend mpi` a raising rank aborts the job."""
    _, _, comm = _program()
    op = comm[1]
    exe = Path(sys.executable).parent / "partir-emu"
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPIEXEC_TIMEOUT="60")
    t0 = time.monotonic()
    out = subprocess.run([str(mpiexec), "-n", "2", str(exe), "run", "mlp", "--strategy", "bp", "--mesh", MESH,
                          "--backend", "mpi", "--devices-per-rank", "2", "--timeout", "60",
                          "--inject-fault", f"rank:1:op:{op}:raise"],
                         capture_output=True, text=True, timeout=wall(90), env=env)
    assert out.returncode != 0
    assert f"partir-emu rank 1 devices 2-3 op {op} (all_reduce at " in out.stderr + out.stdout, out.stderr
    assert time.monotonic() - t0 < wall(30)


def test_progress_records_are_json(tmp_path, baseline_s):
    """A clean run leaves every rank's progress record at phase 'done'."""
    err, _, work, run = _run(tmp_path, None)
    assert err is None
    recs = run.read_progress()
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3]
    assert all(r["phase"] == "done" for r in recs), json.dumps(recs)[:500]


def test_local_op_failure_names_device_and_op(monkeypatch):
    """A failing non-collective equation is located from the engine's frames: its index,
    primitive, source line and the device being evaluated (no MPI needed)."""
    from partir_emu.mpi.ranks.guard import RankGuard
    from partir_emu.runtime import engine
    from partir_emu.runtime.local_mesh import LocalMesh
    exp, spmd = lowered("mlp", "bp", "batch=4")
    target = next(i for i, e in enumerate(spmd.program.eqns) if e.prim == "dot_general")
    calls = []
    real = engine.eval_eqn

    def flaky(eqn, operands):
        if eqn is spmd.program.eqns[target]:
            calls.append(1)
            if len(calls) == 3:                     # the third device: device 2
                raise FloatingPointError("injected")
        return real(eqn, operands)

    monkeypatch.setattr(engine, "eval_eqn", flaky)
    with pytest.raises(FloatingPointError) as info:
        LocalMesh(exp.mesh).run(spmd, exp.inputs())

    class _Comm:
        def Get_rank(self):
            return 0

    guard = RankGuard(_Comm(), None)
    guard.devices = (0, 1, 2, 3)
    where = guard.where(info.value)
    assert where.startswith(f"device 2 op {target} (dot_general at "), where
    guard.close()

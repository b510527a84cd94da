"""Replaying MPI message traces on the DES; counts and bytes against the schedules."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partir_emu.app.cli.main import main
from partir_emu.core.mesh import Mesh
from partir_emu.core.msgtrace import read_message_trace, write_message_trace
from partir_emu.errors import ArtifactError
from partir_emu.hwmodels.validation.replay import check_trace, expected_rows, replay


def synthetic(algorithm: str = "ring"):
    """A header and the transfers the schedules predict for three collectives on Mesh(batch=2, model=4)."""
    mesh = Mesh(batch=2, model=4)
    head = {"format": "partir-emu-message-trace", "version": 2, "mesh": mesh.to_json(), "devices": 8,
            "ranks": 8, "devices_per_rank": 1, "algorithm": algorithm,
            "collectives": {"3": {"prim": "all_reduce", "axes": ["model"], "bytes": 4096 * 4, "itemsize": 4},
                            "7": {"prim": "all_gather", "axes": ["batch"], "bytes": 2048 * 4, "itemsize": 4},
                            "9": {"prim": "all_reduce", "axes": ["batch", "model"], "bytes": 10 * 4, "itemsize": 4}}}
    rows = np.concatenate([expected_rows(head, c, 4) for c in (3, 7, 9)])
    return head, rows


def test_synthetic_trace_checks_and_replays(tmp_path):
    head, rows = synthetic()
    path = tmp_path / "t.jsonl"
    write_message_trace(path, head, rows)
    h2, r2 = read_message_trace(path)
    np.testing.assert_array_equal(rows, r2)
    chk = check_trace(h2, r2)
    assert chk.ok and chk.transfers[0] == chk.transfers[1] == len(rows)
    assert chk.bytes[0] == chk.bytes[1] == int(rows[:, 4].sum())
    assert [c.itemsize for c in chk.collectives] == [4, 4, 4]
    # one NVSwitch node: each ring message is GPU->switch->GPU, nothing contends: the replay equals the
    # sum of the analytical prices of the three collectives with the same algorithm (to 1e-5: the
    # 10-element all-reduce splits unevenly, and members with the smaller chunks finish a hair earlier)
    rep = replay(h2, r2, "h100")
    assert rep.comm_s == pytest.approx(rep.analytical_comm_s, rel=1e-5)
    assert rep.messages == len(rows) and len(rep.collectives) == 3


def test_tampered_trace_is_caught(tmp_path, capsys):
    head, rows = synthetic()
    path = tmp_path / "t.jsonl"
    write_message_trace(path, head, rows[:-1])
    chk = check_trace(head, rows[:-1])
    assert not chk.ok and chk.transfers[0] == chk.transfers[1] + 1
    (bad,) = [c for c in chk.collectives if not c.equal]
    assert bad.coll == 9 and "expected, not traced" in bad.first_difference
    assert main(["replay", str(path), "--hardware", "tpu-v4"]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    rows2 = rows.copy()
    rows2[0, 4] += 4
    assert not check_trace(head, rows2).ok


def test_replay_cli_report(tmp_path, capsys):
    head, rows = synthetic("bidir_ring")
    path, rep = tmp_path / "t.jsonl", tmp_path / "r.json"
    write_message_trace(path, head, rows)
    assert main(["replay", str(path), "--hardware", "tpu-v4", "--report", str(rep)]) == 0
    assert "EQUAL" in capsys.readouterr().out
    d = json.loads(rep.read_text())
    assert d["check"]["ok"] and d["comm_s"] > 0


def test_bad_trace_files(tmp_path, capsys):
    p = tmp_path / "x.jsonl"
    p.write_text('{"format": "something-else"}\n')
    with pytest.raises(ArtifactError, match="not a partir-emu message trace"):
        read_message_trace(p)
    head, rows = synthetic()
    write_message_trace(p, head, rows)
    with open(p, "a") as f:
        f.write('{"coll": 3}\n')
    assert main(["replay", str(p)]) == 2
    assert "line" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not (Path(sys.executable).parent / "mpiexec").exists() and shutil.which("mpiexec") is None,
                    reason="needs mpiexec (pip install mpich)")
def test_real_mpi_trace_matches_the_schedules(tmp_path):
    """The MPI emulator's own trace (one collective per schedule step per group, in-rank copies
    included) has exactly the transfers and bytes the schedules predict, and replays."""
    trace = tmp_path / "mpi.jsonl"
    cmd = [sys.executable, "-m", "partir_emu.app.cli.main", "run", "mlp", "--strategy", "bp+mp", "--mesh",
           "batch=2,model=2", "--size", "tiny", "--backend", "mpi", "--devices", "4", "--devices-per-rank", "2",
           "--algorithm", "bidir_ring", "--trace-messages", str(trace)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and trace.exists(), f"the MPI run did not produce a trace: {res.stderr[-500:]}"
    head, rows = read_message_trace(trace)
    chk = check_trace(head, rows)
    assert chk.ok, [c for c in chk.collectives if not c.equal]
    assert chk.transfers[1] == len(rows) > 0
    rep = replay(head, rows, "h100")
    assert rep.comm_s > 0 and rep.check.ok

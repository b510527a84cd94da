"""Collective schedules over real MPI: bit-identical to the local executor, native path close.

Each test launches ``mpiexec -n R python tests/mpi/_coll_worker.py`` and reads
the JSON verdict rank 0 prints (see the worker's docstring for what it runs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_coll_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def _launch(ranks: int, k: int, placement: str, native: bool) -> dict:
    env = dict(os.environ)
    env["MPIEXEC_TIMEOUT"] = "90"
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKER), "--k", str(k), "--placement", placement]
    if native:
        cmd.append("--native")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement,native", [
    (2, 1, "block", True),
    (4, 1, "block", True),
    (8, 1, "cyclic", True),
    (2, 4, "block", True),
    (4, 4, "cyclic", True),
    (8, 4, "block", False),
    (16, 1, "cyclic", True),
])
def test_schedules_over_mpi(ranks, k, placement, native):
    res = _launch(ranks, k, placement, native)
    assert res["ranks"] == ranks and res["k"] == k and res["cases"] > 50
    assert res["num_failures"] == 0, res["failures"]
    got, expected = res["trace"]
    assert got == expected, "the trace must record every transfer exactly once"
    assert all(all(m) for m in res["mismatch"]), res["mismatch"]
    assert res["ok"]

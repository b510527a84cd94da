"""The issue-13 algorithms (multidim torus, double binary tree, rail) over real MPI: bit-identical to
the in-process executor on the same random data (the reduction order is the schedule's, so it is
the same on both executors). Launches ``mpiexec -n R python tests/mpi/_alg_worker.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_alg_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement", [(4, 4, "block"), (8, 2, "cyclic"), (2, 4, "cyclic")])
def test_new_algorithms_bit_identical_over_mpi(ranks, k, placement):
    env = dict(os.environ, MPIEXEC_TIMEOUT="120")
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKER), "--k", str(k), "--placement", placement]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1])
    assert res["ranks"] == ranks and res["k"] == k
    assert res["num_failures"] == 0, res["failures"]
    assert {"multidim", "tree", "rail"} <= set(res["built"]), res["built"]
    assert res["ok"]

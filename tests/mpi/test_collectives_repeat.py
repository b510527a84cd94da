"""Re-running a collective with the same plan (early receives, persistent requests) stays bit-exact.

Launches ``mpiexec -n R python tests/mpi/_coll_repeat_worker.py`` and reads the JSON verdict
rank 0 prints.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_coll_repeat_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement", [(4, 1, "block"), (4, 2, "cyclic"), (3, 2, "block")])
def test_repeated_schedules_bit_exact(ranks, k, placement):
    env = dict(os.environ, MPIEXEC_TIMEOUT="90")
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKER), "--k", str(k), "--placement", placement]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1])
    assert res["cases"] > 20 and res["num_failures"] == 0, res["failures"]

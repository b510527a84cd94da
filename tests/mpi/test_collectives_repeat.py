"""Re-running a collective with the same plan (early receives, persistent requests) stays bit-exact.

Launches ``mpiexec -n R python tests/mpi/_coll_repeat_worker.py`` and reads the JSON verdict
rank 0 prints.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.conftest import MPIEXEC, run_worker

WORKER = Path(__file__).with_name("_coll_repeat_worker.py")


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement", [(4, 1, "block"), (4, 2, "cyclic"), (3, 2, "block")])
def test_repeated_schedules_bit_exact(ranks, k, placement):
    res = run_worker(WORKER, ranks, k, placement, 90)
    assert res["cases"] > 20 and res["num_failures"] == 0, res["failures"]

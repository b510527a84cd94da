"""The issue-13 algorithms (multidim torus, double binary tree, rail) over real MPI: bit-identical to
the in-process executor on the same random data (the reduction order is the schedule's, so it is
the same on both executors). Launches ``mpiexec -n R python tests/mpi/_alg_worker.py``."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.conftest import MPIEXEC, run_worker

WORKER = Path(__file__).with_name("_alg_worker.py")


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement", [(4, 4, "block"), (8, 2, "cyclic"), (2, 4, "cyclic")])
def test_new_algorithms_bit_identical_over_mpi(ranks, k, placement):
    res = run_worker(WORKER, ranks, k, placement, 120)
    assert res["ranks"] == ranks and res["k"] == k
    assert res["num_failures"] == 0, res["failures"]
    assert {"multidim", "tree", "rail"} <= set(res["built"]), res["built"]
    assert res["ok"]

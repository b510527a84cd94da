"""Collective schedules over real MPI: bit-identical to the local executor, native path close.

Each test launches ``mpiexec -n R python tests/mpi/_coll_worker.py`` and reads
the JSON verdict rank 0 prints (see the worker's docstring for what it runs).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.conftest import MPIEXEC, run_worker

WORKER = Path(__file__).with_name("_coll_worker.py")


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to the interpreter")
@pytest.mark.parametrize("ranks,k,placement,native", [
    (4, 1, "block", True),
    (2, 4, "block", True),
    (4, 4, "cyclic", True),
    (8, 4, "block", False),
    (16, 1, "cyclic", True),
])
def test_schedules_over_mpi(ranks, k, placement, native):
    res = run_worker(WORKER, ranks, k, placement, 90, *(["--native"] if native else []))
    assert res["ranks"] == ranks and res["k"] == k and res["cases"] > 50
    assert res["num_failures"] == 0, res["failures"]
    got, expected = res["trace"]
    assert got == expected, "the trace must record every transfer exactly once"
    assert all(all(m) for m in res["mismatch"]), res["mismatch"]
    assert res["ok"]

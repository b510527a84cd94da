"""BLAS threads of a rank under a user's mpirun (issue 25): its share of the host's cores, set before
numpy loads OpenBLAS, in every launch mode; a value the user set is kept; outside MPI nothing is set.

Each case runs a fresh interpreter (the variables only matter before numpy is loaded)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from partir_emu.mpi.environ import BLAS_ENV, LOCAL_SIZE_ENV, MPI_ENV

PROBE = ("import json, os, sys; {pre}import partir_emu, numpy; "
         "print(json.dumps({{v: os.environ.get(v) for v in {vars!r}}}))")


def _run(env_extra: dict[str, str], pre: str = "") -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in (*MPI_ENV, *LOCAL_SIZE_ENV, *BLAS_ENV, "OMPI_COMM_WORLD_RANK")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre, vars=list(BLAS_ENV))], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("local", ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE"])
def test_a_rank_gets_its_share_of_the_hosts_cores(local):
    got = _run({"PMI_RANK": "0", "PMI_SIZE": "4", local: "2"})
    assert got == dict.fromkeys(BLAS_ENV, str(max(1, CORES // 2)))


def test_more_ranks_than_cores_get_one_thread_each_and_an_unknown_count_one():
    assert _run({"PMI_RANK": "3", "MPI_LOCALNRANKS": str(4 * CORES)}) == dict.fromkeys(BLAS_ENV, "1")
    assert _run({"OMPI_COMM_WORLD_SIZE": "2"}) == dict.fromkeys(BLAS_ENV, "1")


def test_what_the_user_set_is_kept_and_outside_mpi_nothing_is_set():
    got = _run({"PMI_RANK": "0", "MPI_LOCALNRANKS": "1", "OPENBLAS_NUM_THREADS": "7"})
    assert got["OPENBLAS_NUM_THREADS"] == "7" and got["OMP_NUM_THREADS"] == str(CORES)
    assert _run({}) == dict.fromkeys(BLAS_ENV)


def test_after_numpy_is_loaded_nothing_is_changed():
    """OpenBLAS read the variables when numpy loaded: setting them later would only mislead."""
    assert _run({"PMI_RANK": "0", "MPI_LOCALNRANKS": "1"}, pre="import numpy; ") == dict.fromkeys(BLAS_ENV)

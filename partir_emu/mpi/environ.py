"""What the environment says about MPI, read with the standard library only (no numpy, no mpi4py):
whether this process is a rank of a user's ``mpirun``, its rank, and how many BLAS threads it
should run.

A rank's BLAS threads matter: OpenBLAS (numpy's) starts one thread per core at load time, so
``k`` ranks on a host of ``c`` cores run ``k × c`` busy threads, and on 2 cores a step ran 3-5×
slower under a user's ``mpirun`` than under our own launcher, which sets one thread per rank
(issue 25). :func:`set_blas_threads` gives every launch mode the same rule, *before numpy is
loaded*: ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` each default to the
cores this process may use divided by the ranks on its host (``MPI_LOCALNRANKS`` from MPICH's
hydra, ``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI, ``PMIX_LOCAL_SIZE`` from PMIx; one thread when
none says), at least one. A value the user set is kept.
"""
from __future__ import annotations

import os
import sys

MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
LOCAL_SIZE_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE")
BLAS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def under_mpirun() -> bool:
    """True inside a process started by mpirun/mpiexec (an MPI rank)."""
    return any(v in os.environ for v in MPI_ENV)


def mpirun_rank() -> int | None:
    """This process's rank under a user's mpirun (from the environment, without MPI), else None."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            pass
    return None


def local_ranks() -> int | None:
    """How many ranks of this job run on this host, as the launcher says (None: it does not)."""
    for var in LOCAL_SIZE_ENV:
        try:
            n = int(os.environ[var])
        except (KeyError, ValueError):
            continue
        if n >= 1:
            return n
    return None


def blas_threads() -> int:
    """The BLAS threads of one rank: this process's cores over the ranks on its host (one if the
    launcher does not say how many share the host), at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):        # not Linux
        cores = os.cpu_count() or 1
    n = local_ranks()
    return max(1, cores // n) if n else 1


def set_blas_threads() -> bool:
    """Under a user's mpirun, default the BLAS thread variables (module docstring) if numpy is not
    loaded yet (after, OpenBLAS has read them already). True if it set any."""
    if not under_mpirun() or "numpy" in sys.modules:
        return False
    missing = [v for v in BLAS_ENV if v not in os.environ]
    if missing:
        k = str(blas_threads())
        for v in missing:
            os.environ[v] = k
    return bool(missing)

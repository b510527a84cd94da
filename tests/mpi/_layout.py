"""What every collective worker under ``mpiexec`` starts with: its devices' layout over the ranks.

``--k`` devices per rank, placed ``block`` (device d on rank d // k) or ``cyclic`` (d % ranks); a
worker's own flags are added as ``store_true`` switches. Imported by the ``_*_worker.py`` scripts,
which run as ``python tests/mpi/_x_worker.py`` (this directory first on ``sys.path``).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mpi4py import MPI


class Layout(NamedTuple):
    args: argparse.Namespace
    comm: Any
    me: int                       # this rank
    nranks: int
    k: int                        # devices per rank
    n_dev: int                    # devices in all
    rank_of: Callable[[int], int]


def layout(switches: Sequence[str] = ()) -> Layout:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--placement", choices=("block", "cyclic"), default="block")
    for s in switches:
        ap.add_argument(s, action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    me, nranks, k = comm.Get_rank(), comm.Get_size(), args.k
    rank_of = (lambda d: d // k) if args.placement == "block" else (lambda d: d % nranks)
    return Layout(args, comm, me, nranks, k, nranks * k, rank_of)

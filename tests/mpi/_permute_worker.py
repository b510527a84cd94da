"""Worker for tests/mpi/test_collective_permute_mpi.py, run under ``mpiexec -n R``.

Usage: ``_permute_worker.py DIR K ALGORITHM``. ``DIR`` holds ``case*.json`` (SpmdPrograms) and
``case*.in.npz`` (their global inputs, by input name); every rank loads them, runs each on an
:class:`~partir_emu.mpi.ranks.mesh.MpiMesh` with ``K`` devices per rank, and rank 0 writes the
global outputs to ``case*.out.<ALGORITHM>.k<K>.npz`` and (schedule algorithms) the message trace
to ``case*.trace.<ALGORITHM>.k<K>.jsonl``. It never imports jax.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from partir_emu.core.msgtrace import trace_header, write_message_trace
from partir_emu.core.spmd import SpmdProgram
from partir_emu.mpi.ranks.mesh import MpiMesh


def main() -> None:
    work, k, algorithm = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    comm = MPI.COMM_WORLD
    for path in sorted(work.glob("case*.json")):
        spmd = SpmdProgram.load(path)
        with np.load(path.with_suffix(".in.npz")) as f:
            inputs = [f[name] for name in spmd.input_names]
        tracing = algorithm != "native"
        mesh = MpiMesh(comm, spmd.mesh, k, algorithm, timeout_s=30.0, trace=tracing)
        try:
            res = mesh.run(spmd, mesh.shard_inputs(spmd, inputs))
            outputs, _ = mesh.gather_outputs(spmd, res)
            rows = mesh.gather_trace() if tracing else None
        finally:
            mesh.close()
        if comm.Get_rank() == 0:
            np.savez(path.with_suffix(f".out.{algorithm}.k{k}.npz"), *outputs)
            if tracing:
                head = trace_header(spmd, ranks=comm.Get_size(), devices_per_rank=k, algorithm=algorithm)
                write_message_trace(path.with_suffix(f".trace.{algorithm}.k{k}.jsonl"), head, rows)


if __name__ == "__main__":
    main()

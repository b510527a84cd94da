"""Worker for tests/mpi/test_collectives_repeat.py, run under ``mpiexec -n R``.

Every kind x algorithm runs three times in a row with the same tags (the third call uses the
persistent requests the executor makes on the second), then once with other tags, for groups
whose members share ranks (``--k`` devices per rank, block or cyclic placement). Each output must
equal the local executor's bit for bit. Rank 0 prints one JSON line with the verdict.
"""
from __future__ import annotations

import json
import sys

import numpy as np
from _layout import layout  # a sibling script module: this directory is sys.path[0]

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import run_schedule
from partir_emu.collectives.schedule import KINDS
from partir_emu.mpi.ranks.collectives import MpiCollectives


def main() -> int:
    args, comm, me, nranks, k, p, rank_of = layout()
    group = list(range(p))
    ex = MpiCollectives(comm)
    failures, cases = [], 0
    for kind in KINDS:
        if kind == "collective_permute":
            continue
        for alg in ALGORITHMS:
            for n in (p * 6, p * 1024):
                sched = build_schedule(kind, (p,), n * 4, alg, devices_per_node=2)
                rng = np.random.default_rng(n + cases)
                data = [rng.standard_normal(n // p if kind == "all_gather" else n).astype(np.float32)
                        for _ in range(p)]
                want = run_schedule(sched, data, "sum")
                local = {pos: data[pos] for pos in range(p) if rank_of(pos) == me}
                cases += 1
                for rep, tag in enumerate((100, 100, 100, 5000)):
                    out = ex.run_schedule(sched, group, rank_of, local, "sum", tag, timeout_s=30.0)
                    for pos, got in out.items():
                        if not np.array_equal(got.view(np.uint8), np.asarray(want[pos]).view(np.uint8)):
                            failures.append(f"rank {me} {kind}[{alg}] n={n} call {rep} pos {pos}: != local")
    ex.free()
    every = comm.gather(failures, root=0)
    if me == 0:
        flat = [f for fs in every for f in fs]
        print(json.dumps({"cases": cases, "num_failures": len(flat), "failures": flat[:20]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

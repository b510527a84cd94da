"""Worker for tests/mpi/test_algorithms_mpi.py, run under ``mpiexec -n R``.

Every rank hosts ``k`` devices (``block``: devices ``r*k .. r*k+k-1``; ``cyclic``: ``d % R``). For
the algorithms of issue 13 (``multidim`` on 2-D and 3-D groups, the double binary ``tree`` with
and without pipelining, ``rail`` over nodes of several devices) and their kinds, the MPI schedule
executor must give the bits of the in-process executor (the one LocalMesh runs) on the same random
data, and both must be close to the numpy reference. Rank 0 prints one JSON line with the verdict.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import zlib

import numpy as np
from _layout import layout  # a sibling script module: this directory is sys.path[0]

from partir_emu.collectives.algorithms import build_schedule
from partir_emu.collectives.local import run_schedule
from partir_emu.collectives.semantics import reference
from partir_emu.mpi.ranks.collectives import MpiCollectives

TIMEOUT_S = 30.0


def cases(n_dev: int) -> list[tuple[str, str, tuple[int, ...], list[list[int]], int | None, int]]:
    """``(kind, algorithm, group_shape, groups, devices_per_node, elements)``."""
    out = []
    every = list(range(n_dev))
    rev = every[::-1]
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        if n_dev == 16:
            out.append((kind, "multidim", (4, 4), [every], None, 16 * 37))
            out.append((kind, "multidim", (2, 2, 4), [rev], None, 16 * 5))
            out.append((kind, "rail", (16,), [every], 4, 16 * 11))
        out.append((kind, "multidim", (2, n_dev // 2), [every], None, n_dev * 9))
        out.append((kind, "rail", (n_dev,), [rev], 2, n_dev * 7))
    for p in sorted({n_dev, n_dev - 1, 3}):
        out.append(("all_reduce", "tree", (p,), [every[:p]], None, p * 13 + 5))
    out.append(("all_reduce", "tree", (n_dev,), [rev], None, (1 << 20) + 3))    # 4 MiB: pipelined
    out.append(("all_reduce", "multidim", (2, n_dev // 2), [every], None, 1))  # one element: empty chunks
    return out


def main() -> int:
    args, comm, me, nranks, k, n_dev, rank_of = layout()
    t0 = time.monotonic()
    ex = MpiCollectives(comm)
    failures: list[str] = []
    built: list[str] = []
    tag = 0
    for ci, (kind, alg, shape, groups, dpn, n) in enumerate(cases(n_dev)):
        p = len(groups[0])
        for dtype in ("float32", "float64"):
            isz = np.dtype(dtype).itemsize
            sched = build_schedule(kind, shape, n * isz, alg, itemsize=isz, devices_per_node=dpn)
            built.append(sched.algorithm)
            rng = np.random.default_rng(zlib.crc32(repr((ci, dtype)).encode()))
            size = n // p if kind == "all_gather" else n
            data = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(dtype) for _ in range(p)]
            label = f"{kind}[{alg}->{sched.algorithm}] shape={shape} n={n} {dtype}"
            try:
                jobs = [(sched, g, {pos: data[pos] for pos in range(p) if rank_of(g[pos]) == me})
                        for g in groups if any(rank_of(d) == me for d in g)]
                outs = ex.run_schedules(jobs, rank_of, "sum", tag, timeout_s=TIMEOUT_S)
                want = run_schedule(sched, data, "sum")
                ref = reference(kind, data, "sum", None)
                for (_, _g, loc), out in zip(jobs, outs):
                    for pos in loc:
                        if out[pos].dtype != want[pos].dtype or out[pos].tobytes() != want[pos].tobytes():
                            failures.append(f"rank {me} {label} pos {pos}: MPI bits != local bits")
                        if not np.allclose(want[pos], ref[pos], rtol=1e-4, atol=1e-3):
                            failures.append(f"rank {me} {label} pos {pos}: local != numpy reference")
            except Exception as e:  # report, keep going
                failures.append(f"rank {me} {label}: {type(e).__name__}: {e}")
                traceback.print_exc(file=sys.stderr)
            tag += 1000
    ex.free()
    gathered = comm.gather(failures, root=0)
    if me == 0:
        flat = [f for fs in gathered for f in fs]
        print(json.dumps({"ok": not flat, "ranks": nranks, "k": k, "placement": args.placement,
                          "cases": len(built), "built": sorted(set(built)), "failures": flat[:20],
                          "num_failures": len(flat), "seconds": round(time.monotonic() - t0, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

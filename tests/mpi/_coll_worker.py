"""Worker for tests/mpi/test_collectives_mpi.py, run under ``mpiexec -n R``.

Every rank hosts ``k`` devices (``--placement block``: devices ``r*k .. r*k+k-1``;
``cyclic``: device ``d`` on rank ``d % R``). For several families of groups
(the whole mesh, rows and strided columns of a 2-row mesh, a shuffled order,
the mesh as a 2-D torus) and every kind x algorithm, the MPI schedule executor
must equal the local executor bit for bit, and the native path must be close
to the numpy reference. Rank 0 prints one JSON line with the verdict.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import zlib

import numpy as np
from _layout import layout  # a sibling script module: this directory is sys.path[0]

from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import run_schedule
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule, Step, Transfer
from partir_emu.collectives.semantics import reference
from partir_emu.errors import CollectiveError
from partir_emu.mpi.ranks.collectives import MpiCollectives

TIMEOUT_S = 30.0


def families(n_dev: int, seed: int) -> list[tuple[str, list[list[int]], tuple[int, ...]]]:
    fams = [("all", [list(range(n_dev))], (n_dev,))]
    rng = np.random.default_rng(seed)
    fams.append(("shuffled", [rng.permutation(n_dev).tolist()], (n_dev,)))
    if n_dev >= 4 and n_dev % 2 == 0:
        b = n_dev // 2
        fams.append(("rows", [[r * b + j for j in range(b)] for r in range(2)], (b,)))
        fams.append(("cols", [[r * b + j for r in range(2)] for j in range(b)], (2,)))
        fams.append(("mesh2d", [list(range(n_dev))], (2, b)))
    if n_dev >= 8 and n_dev % 4 == 0:
        s = n_dev // 4
        fams.append(("strided2x2", [[j + i * s for i in range(4)] for j in range(s)], (2, 2)))
    return fams


def inputs(kind: str, p: int, n: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    size = n // p if kind == "all_gather" else n
    if dtype == "int32":
        return [rng.integers(-1000, 1000, size).astype(np.int32) for _ in range(p)]
    return [rng.standard_normal(size).astype(np.float32) for _ in range(p)]


def main() -> int:
    args, comm, me, nranks, k, n_dev, rank_of = layout(("--native",))
    t0 = time.monotonic()
    failures: list[str] = []
    cases = 0
    trace: list = []
    expected_transfers = 0
    ex = MpiCollectives(comm)
    tag = 0
    for fam_i, (fam, groups, shape) in enumerate(families(n_dev, seed=7)):
        p = len(groups[0])
        mine = [g for g in groups if any(rank_of(d) == me for d in g)]
        for kind in KINDS:
            for alg in ALGORITHMS:
                sizes = [p * 6, 1, p * 6 + 3] if kind == "all_reduce" else [p * 6]
                for si, n in enumerate(sizes):
                    if kind == "collective_permute" and alg != "ring":
                        continue
                    dtype = "int32" if (si == 0 and alg == "ring") else "float32"
                    op = "max" if (dtype == "int32" and kind in ("all_reduce", "reduce_scatter")) else "sum"
                    perm = tuple((i, (i + 1 + fam_i) % p) for i in range(p) if i % 3 != 1) \
                        if kind == "collective_permute" else None
                    sched = build_schedule(kind, shape, n * 4, alg, devices_per_node=2, permutation=perm)
                    expected_transfers += len(groups) * sum(len(s.transfers) for s in sched.steps)
                    cases += 1
                    seed = zlib.crc32(repr((fam_i, kind, alg, n)).encode())
                    data = {tuple(g): inputs(kind, p, n, dtype, seed + gi) for gi, g in enumerate(groups)}
                    jobs = [(sched, g, {pos: data[tuple(g)][pos] for pos in range(p) if rank_of(g[pos]) == me})
                            for g in mine]
                    label = f"{fam} {kind}[{alg}->{sched.algorithm}] shape={shape} n={n} {dtype} {op}"
                    try:
                        if cases % 2:
                            outs = ex.run_schedules(jobs[::-1], rank_of, op, tag, trace, timeout_s=TIMEOUT_S)
                            outs = outs[::-1]
                        else:
                            outs = [ex.run_schedule(s, g, rank_of, loc, op, tag, trace, timeout_s=TIMEOUT_S)
                                    for s, g, loc in jobs]
                        for (_, g, loc), out in zip(jobs, outs):
                            want = run_schedule(sched, data[tuple(g)], op)
                            for pos in loc:
                                if not (out[pos].dtype == want[pos].dtype and np.array_equal(out[pos], want[pos])):
                                    failures.append(f"rank {me} {label} group {g} pos {pos}: schedule != local")
                        if args.native:
                            for _, g, loc in jobs:
                                got = ex.run_native(kind, g, rank_of, loc, op, permutation=perm, tag_base=tag,
                                                    timeout_s=TIMEOUT_S)
                                ref = reference(kind, data[tuple(g)], op, perm)
                                for pos in loc:
                                    if not np.allclose(got[pos], ref[pos], rtol=1e-5, atol=1e-5):
                                        failures.append(f"rank {me} {label} group {g} pos {pos}: native != reference")
                    except Exception as e:  # report, keep going
                        failures.append(f"rank {me} {label}: {type(e).__name__}: {e}")
                        traceback.print_exc(file=sys.stderr)
                    tag += 1000
    for label, jobs_all in extra_cases(n_dev):
        cases += 1
        try:
            mine = [(sc, g, {pos: b[pos] for pos in range(len(g)) if rank_of(g[pos]) == me}) for sc, g, b in jobs_all]
            mine = [j for j in mine if j[2]]
            outs = ex.run_schedules(mine, rank_of, "sum", tag, trace, timeout_s=TIMEOUT_S)
            expected_transfers += sum(len(sc.table()) for sc, _, _ in jobs_all)
            for (sc, g, loc), out in zip(mine, outs):
                want = run_schedule(sc, [b for s2, g2, b in jobs_all if g2 is g][0])
                for pos in loc:
                    if out[pos].tobytes() != want[pos].tobytes() or out[pos].dtype != want[pos].dtype:
                        failures.append(f"rank {me} {label} group {g} pos {pos}: schedule != local")
        except Exception as e:  # report, keep going
            failures.append(f"rank {me} {label}: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stderr)
        tag += 1000
    mismatch = check_mismatch(ex, rank_of, n_dev) if nranks >= 2 else []
    ex.free()
    total_traced = comm.allreduce(len(trace))
    all_failures = comm.gather(failures, root=0)
    all_mismatch = comm.gather(mismatch, root=0)
    if me == 0:
        flat = [f for fs in all_failures for f in fs]
        mm_ok = all(all(m) for m in all_mismatch)
        ok = not flat and total_traced == expected_transfers and mm_ok
        print(json.dumps({"ok": ok, "ranks": nranks, "k": k, "placement": args.placement, "cases": cases,
                          "failures": flat[:20], "num_failures": len(flat),
                          "trace": [total_traced, expected_transfers], "mismatch": all_mismatch,
                          "seconds": round(time.monotonic() - t0, 2)}), flush=True)
    return 0


def hand_schedule(steps, p: int = 3, n_chunks: int = 3, chunk_elems: int = 2) -> CollectiveSchedule:
    cb = 4 * chunk_elems
    return CollectiveSchedule(kind="all_reduce", algorithm="ring", group_shape=(p,), nbytes=cb * n_chunks,
                              num_chunks=n_chunks, itemsize=4, chunk_bytes=(cb,) * n_chunks,
                              steps=tuple(Step(tuple(Transfer(s, d, cb * k, c, r, k) for s, d, c, r, k in st))
                                          for st in steps))


def extra_cases(n_dev: int) -> list[tuple[str, list]]:
    """Schedules no algorithm builds: two reduces into one chunk in a step (applied in order), a member
    sending a chunk it receives in the same step (sends its old value), runs of two chunks; and two
    jobs of different dtypes in one call (their parts share messages)."""
    rng = np.random.default_rng(3)
    out = []
    if n_dev >= 3:
        g = [0, 1, n_dev - 1]
        sched = hand_schedule([
            [(2, 0, 0, True, 1), (1, 0, 0, True, 1), (1, 2, 1, True, 1), (0, 1, 1, True, 1), (2, 1, 2, True, 1),
             (0, 1, 2, True, 1)],
            [(0, 1, 0, False, 1), (0, 2, 0, False, 1), (1, 0, 1, False, 2), (2, 0, 1, True, 1)],
            [(0, 2, 1, False, 2), (2, 1, 1, False, 1), (1, 2, 2, False, 1)],
        ])
        bufs = [(rng.standard_normal(6) * 1e6).astype(np.float32) for _ in range(3)]
        out.append(("hand-made", [(sched, g, bufs)]))
    if n_dev >= 2:
        g1, g2 = list(range(n_dev)), list(range(n_dev))[::-1]
        s1 = build_schedule("all_reduce", (n_dev,), n_dev * 3 * 8 + 8, "bidir_ring", itemsize=8)
        s2 = build_schedule("all_gather", (n_dev,), n_dev * 5 * 2, "ring", itemsize=2)
        b1 = [rng.standard_normal(n_dev * 3 + 1) for _ in range(n_dev)]
        b2 = [rng.integers(-100, 100, 5).astype(np.int16) for _ in range(n_dev)]
        out.append(("float64+int16 jobs", [(s1, g1, b1), (s2, g2, b2)]))
    return out


def check_mismatch(ex: MpiCollectives, rank_of, n_dev: int) -> list[bool]:
    """Ranks 0 and 1 disagree on a collective: both must raise CollectiveError, then still work."""
    me = ex.comm.Get_rank()
    if me > 1:
        return []
    d0 = next(d for d in range(n_dev) if rank_of(d) == 0)
    d1 = next(d for d in range(n_dev) if rank_of(d) == 1)
    group = [d0, d1]
    pos = 0 if me == 0 else 1
    results = []
    variants = [  # (kind, nbytes, dtype) per rank
        (("all_reduce", 32, np.float32), ("all_reduce", 64, np.float32)),
        (("all_reduce", 32, np.float32), ("all_reduce", 32, np.int32)),
        (("all_reduce", 32, np.float32), ("all_gather", 32, np.float32)),
    ]
    for i, variant in enumerate(variants):
        kind, nbytes, dtype = variant[pos]
        sched = build_schedule(kind, (2,), nbytes, "ring")
        buf = np.ones(sched.input_nbytes // 4, dtype)
        try:
            ex.run_schedule(sched, group, rank_of, {pos: buf}, tag_base=10_000 * (i + 1), timeout_s=10)
            results.append(False)
        except CollectiveError as e:
            results.append("disagree" in str(e))
    try:  # native: sizes differ
        ex.run_native("all_reduce", group, rank_of, {pos: np.ones(4 + 4 * pos, np.float32)}, timeout_s=10)
        results.append(False)
    except CollectiveError as e:
        results.append("disagree" in str(e))
    if me == 0:  # rank 1 never joins this one: rank 0 must time out with a clear error, not hang
        # (rank 0 only receives here: a send left unmatched would upset MPI_Finalize, and after a real
        # timeout the runtime aborts anyway)
        sched = build_schedule("collective_permute", (2,), 64, permutation=((1, 0),))
        try:
            ex.run_schedule(sched, group, rank_of, {0: np.ones(16, np.float32)}, tag_base=80_000, timeout_s=1)
            results.append(False)
        except CollectiveError as e:
            results.append("timed out" in str(e))
    sched = build_schedule("all_reduce", (2,), 64, "ring")  # and the pair still works afterwards
    out = ex.run_schedule(sched, group, rank_of, {pos: np.full(16, pos + 1, np.float32)}, tag_base=90_000,
                          timeout_s=10)
    results.append(bool(np.array_equal(out[pos], np.full(16, 3, np.float32))))
    return results


if __name__ == "__main__":
    sys.exit(main())

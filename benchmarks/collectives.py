"""Bus bandwidth of the collective paths against raw mpi4py, side by side in one mpiexec run.

For each rank count R (default 8, 16, 32, 64; one emulated device per rank) it launches
``mpiexec -n R`` once (with ``MPIEXEC_TIMEOUT`` and a subprocess timeout) and, for every
kind (all_reduce, all_gather, reduce_scatter, all_to_all) and size, measures in turn

- **raw**: mpi4py's blocking ``comm.Allreduce`` / ``Allgather`` / ``Reduce_scatter_block`` /
  ``Alltoall`` on preallocated numpy buffers over ``COMM_WORLD``;
- **native**: :func:`partir_emu.collectives.mpi.run_native_mpi` (non-blocking MPI collective on a
  cached sub-communicator, waited on with ``Test`` + short sleeps);
- each **schedule** algorithm through :func:`partir_emu.collectives.mpi.run_schedule_mpi`: ring,
  bidir_ring, recursive, torus (the ranks as a 2-D group, e.g. 4x4) and hierarchical
  (``devices_per_node=4``). A fallback is shown as ``asked->built`` (all_to_all has no ring:
  ring, bidir_ring and recursive build ``pairwise``, hierarchical builds ``direct``).

Timing: one warm-up call (which also builds and caches the schedule and its plan and checks the
result against raw with ``allclose``), then ``reps`` calls, each after a ``Barrier``, timed with
``MPI.Wtime``; a call's time is the max over ranks; the table shows the median. Native and
schedule calls run with ``check=False`` (no header exchange: in the emulator
:class:`~partir_emu.runtime.mpi_mesh.MpiMesh` runs its own agreement check per collective);
the summary shows what ``check=True`` adds to a 1 KiB all_reduce.

Bus bandwidth (nccl-tests ``PERFORMANCE.md``): ``algbw = size / time``; ``busbw = algbw x
2(p-1)/p`` for all_reduce and ``x (p-1)/p`` for all_gather, reduce_scatter and all_to_all.
``size`` is the per-rank input for all_reduce, reduce_scatter and all_to_all and the gathered
output for all_gather (nccl-tests' convention). Numbers are GB/s (1e9 B/s) of float32 data.

Sizes go 1 KiB .. 64 MiB by powers of 4, capped per rank count (``--cap``) so the whole run
stays near 10 minutes on a 2-core machine; the output says where it capped.

    python benchmarks/collectives.py                     # the full table (about 10 minutes here)
    python benchmarks/collectives.py --ranks 8 --max-bytes 1M --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALGS = ("ring", "bidir_ring", "recursive", "torus", "hierarchical")
DPN = 4
KIB, MIB = 1 << 10, 1 << 20
SIZES = [KIB * 4 ** i for i in range(9)]                       # 1 KiB .. 64 MiB
DEFAULT_CAP = {8: 64 * MIB, 16: 16 * MIB, 32: 1 * MIB, 64: 64 * KIB}


def torus_shape(r: int) -> tuple[int, int]:
    a = 1 << ((r.bit_length() - 1) // 2)
    while r % a:
        a //= 2
    return (a, r // a)


def busbw_factor(kind: str, p: int) -> float:
    return 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


# ------------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> int:
    import numpy as np
    from mpi4py import MPI

    from partir_emu.collectives.algorithms import build_schedule
    from partir_emu.collectives.mpi import SubcommCache, run_native_mpi, run_schedule_mpi

    comm = MPI.COMM_WORLD
    me, R = comm.Get_rank(), comm.Get_size()
    subcomms = SubcommCache(comm)
    group = list(range(R))
    ident = int  # device d lives on rank d
    timeout = args.op_timeout

    def emit(rec: dict) -> None:
        if me == 0:
            print(json.dumps(rec), flush=True)

    def raw_call(kind, x, out):
        if kind == "all_reduce":
            comm.Allreduce([x, MPI.FLOAT], [out, MPI.FLOAT], MPI.SUM)
        elif kind == "all_gather":
            comm.Allgather([x, MPI.FLOAT], [out, MPI.FLOAT])
        elif kind == "reduce_scatter":
            comm.Reduce_scatter_block([x, MPI.FLOAT], [out, MPI.FLOAT], MPI.SUM)
        else:
            comm.Alltoall([x, MPI.FLOAT], [out, MPI.FLOAT])
        return out

    def timed(fn, reps):
        times = np.zeros(reps)
        for i in range(reps):
            comm.Barrier()
            t0 = MPI.Wtime()
            fn()
            times[i] = MPI.Wtime() - t0
        worst = np.empty_like(times)
        comm.Allreduce(times, worst, MPI.MAX)
        return float(np.median(worst)), worst.tolist()

    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    algs = [a for a in ALGS if a in args.algorithms.split(",")]
    shape = torus_shape(R)
    rng = np.random.default_rng(1234 + me)
    t_start = time.monotonic()
    for kind in kinds:
        for size in [s for s in SIZES if s <= args.max_bytes]:
            n = size // 4
            if n % R:
                continue
            x = rng.standard_normal(n // R if kind == "all_gather" else n).astype(np.float32)
            out = np.empty(n // R if kind == "reduce_scatter" else n, np.float32)
            reps = args.reps if size <= args.big else max(2, args.reps // 2)
            ref = raw_call(kind, x, out).copy()
            t, _ = timed(lambda kind=kind, x=x, out=out: raw_call(kind, x, out), reps)
            emit({"kind": kind, "ranks": R, "size": size, "path": "raw", "built": "raw", "t": t, "ok": True})
            variants = [("native", None)] + [(a, a) for a in algs]
            for name, alg in variants:
                if alg is None:
                    def call(check=False, kind=kind, x=x):
                        return run_native_mpi(kind, subcomms, group, ident, {me: x}, check=check, timeout_s=timeout)[me]
                    built = "native"
                else:
                    sched = build_schedule(kind, shape if alg == "torus" else (R,), size, alg, itemsize=4,
                                           devices_per_node=DPN)
                    built = sched.algorithm

                    def call(check=False, sched=sched, x=x):
                        return run_schedule_mpi(sched, comm, group, ident, {me: x}, check=check,
                                                timeout_s=timeout)[me]
                got = call()  # warm-up: builds and caches; checked against raw
                ok = bool(np.allclose(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max()))))
                ok = bool(comm.allreduce(ok, MPI.LAND))
                t, _ = timed(call, reps)
                rec = {"kind": kind, "ranks": R, "size": size, "path": name, "built": built, "t": t, "ok": ok}
                if size == SIZES[0] and kind == "all_reduce":  # what the header check adds, interleaved
                    pair = [timed(lambda c=call, ck=ck: c(check=ck), 2 * reps)[0] for _ in range(2) for ck in (False, True)]
                    rec["t_nocheck"], rec["t_check"] = min(pair[0::2]), min(pair[1::2])
                emit(rec)
    subcomms.free()
    emit({"done": True, "ranks": R, "seconds": time.monotonic() - t_start})
    return 0


# ------------------------------------------------------------------------------------ driver
def launch(ranks: int, args: argparse.Namespace, max_bytes: int) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(args.timeout)), PYTHONPATH=str(ROOT))
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--max-bytes", str(max_bytes), "--reps", str(args.reps), "--big", str(args.big), "--kinds", args.kinds,
           "--algorithms", args.algorithms, "--op-timeout", str(args.op_timeout)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 30, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"mpiexec -n {ranks} did not finish in {args.timeout + 30:.0f} s") from e
    recs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not any(r.get("done") for r in recs):
        raise SystemExit(f"mpiexec -n {ranks} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    print(f"# {ranks} ranks: mpiexec wall {time.perf_counter() - t0:.1f} s", flush=True)
    return [r for r in recs if not r.get("done")]


def _num(x: float) -> str:
    return f"{x:.3f}" if x >= 0.1 else f"{x:.2g}"


def table(kind: str, ranks: int, recs: list[dict], algs: list[str]) -> list[str]:
    p = ranks
    f = busbw_factor(kind, p)
    rows = {}
    built = {}
    for r in recs:
        rows.setdefault(r["size"], {})[r["path"]] = r
        built[r["path"]] = r["built"]
    heads = ["size", "raw", "native", "ratio"]
    for a in algs:
        name = a if built.get(a, a) == a else f"{a}->{built[a]}"
        if a == "torus" and built.get(a) == "torus":
            name = "torus{}x{}".format(*torus_shape(ranks))
        if a == "hierarchical" and built.get(a) == "hierarchical":
            name = f"hier(dpn={DPN})"
        heads += [name, "ratio"]
    w = [max(8, len(h) + 1) for h in heads]
    lines = [f"{kind}, {ranks} ranks  (busbw GB/s; ratio = path / raw)",
             "".join(h.rjust(x) for h, x in zip(heads, w))]
    for size in sorted(rows):
        row = rows[size]
        raw = row["raw"]["t"]

        def bw(t, size=size):
            return size / t * f / 1e9
        cells = [fmt_size(size), _num(bw(raw))]
        for path in ["native"] + algs:
            r = row.get(path)
            if r is None:
                cells += ["-", "-"]
                continue
            mark = "" if r["ok"] else "!"
            cells += [_num(bw(r["t"])) + mark, f"{raw / r['t']:.2f}"]
        lines.append("".join(c.rjust(x) for c, x in zip(cells, w)))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,16,32,64", help="rank counts (default %(default)s)")
    ap.add_argument("--max-bytes", type=parse_size, default=64 * MIB, help="largest size (default 64M)")
    ap.add_argument("--cap", default=",".join(f"{r}:{fmt_size(c).replace(' ', '')}" for r, c in DEFAULT_CAP.items()),
                    help="per rank count size caps R:SIZE,... (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per cell, halved above --big (default 5)")
    ap.add_argument("--big", type=parse_size, default=MIB, help="size above which reps are halved (default 1M)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--algorithms", default=",".join(ALGS))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec run (default %(default)s)")
    ap.add_argument("--op-timeout", type=float, default=300, help="timeout_s of each collective call")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    caps = {int(r): parse_size(c) for r, c in (x.split(":") for x in args.cap.split(",") if x)}
    algs = [a for a in ALGS if a in args.algorithms.split(",")]
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    print(f"# collectives benchmark: float32, sizes {fmt_size(SIZES[0])}..{fmt_size(args.max_bytes)} by x4, "
          f"reps {args.reps} (halved above {fmt_size(args.big)}), 1 device per rank, {os.cpu_count()} cores")
    t0 = time.perf_counter()
    allrecs: list[dict] = []
    for r in (int(x) for x in args.ranks.split(",")):
        mb = min(args.max_bytes, caps.get(r, args.max_bytes))
        if mb < args.max_bytes:
            print(f"# {r} ranks: sizes capped at {fmt_size(mb)} to keep the run short on this machine")
        print(f"# {r} ranks: load average before the run {os.getloadavg()[0]:.1f} (this machine: {os.cpu_count()} cores)")
        recs = launch(r, args, mb)
        allrecs += recs
        for kind in kinds:
            print()
            print("\n".join(table(kind, r, [x for x in recs if x["kind"] == kind], algs)))
        print(flush=True)
    # summary
    print("summary (median over every kind, rank count and size of path busbw / raw busbw; worst cell):")
    cells: dict[tuple, dict] = {}
    for x in allrecs:
        cells.setdefault((x["kind"], x["ranks"], x["size"]), {})[x["path"]] = x
    bad = [x for x in allrecs if not x["ok"]]
    for path in ["native"] + algs:
        ratios = [(c["raw"]["t"] / c[path]["t"], k) for k, c in cells.items() if path in c and "raw" in c]
        if not ratios:
            continue
        med = statistics.median(r for r, _ in ratios)
        worst = min(ratios)
        goal = 0.9 if path == "native" else 0.5
        below = sum(r < goal for r, _ in ratios)
        by_kind = "  ".join(f"{k}={statistics.median(r for r, kk in ratios if kk[0] == k):.2f}" for k in kinds
                            if any(kk[0] == k for _, kk in ratios))
        big = [r for r, k in ratios if k[2] >= MIB]
        small = [r for r, k in ratios if k[2] < MIB]
        split = "  ".join(f"{name} {statistics.median(v):.2f} ({sum(x >= goal for x in v)}/{len(v)} meet)"
                          for name, v in (("<1MiB", small), (">=1MiB", big)) if v)
        print(f"  {path:>13}: median {med:.2f}  (goal >= {goal}; {below}/{len(ratios)} cells below)  "
              f"worst {worst[0]:.2f} at {worst[1][0]} {worst[1][1]} ranks {fmt_size(worst[1][2])}")
        print(f"  {'':>13}  by size: {split};  by kind: {by_kind}")
    for r in sorted({k[1] for k in cells}):
        c = cells.get(("all_reduce", r, SIZES[0]), {})
        parts = [f"{p} {c[p]['t_nocheck'] * 1e3:.2f}->{c[p]['t_check'] * 1e3:.2f}" for p in ["native"] + algs
                 if p in c and "t_check" in c[p]]
        if parts:
            print(f"  check=True (header exchange) at {fmt_size(SIZES[0])} all_reduce, {r} ranks, ms: " + ", ".join(parts))
    print(f"  results checked against raw (allclose): {'all ok' if not bad else f'{len(bad)} MISMATCHES (marked !)'}")
    print(f"  total wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bus bandwidth of the collective paths against raw mpi4py, interleaved in one mpiexec run.

For each rank count R (default 8, 16, 32, 64; one emulated device per rank) it launches
``mpiexec -n R`` once (with ``MPIEXEC_TIMEOUT`` and a subprocess timeout) and, for every
kind (all_reduce, all_gather, reduce_scatter, all_to_all) and size, compares

- **raw**: mpi4py's blocking ``comm.Allreduce`` / ``Allgather`` / ``Reduce_scatter_block`` /
  ``Alltoall`` on preallocated numpy buffers over ``COMM_WORLD``;
- **native**: :meth:`partir_emu.mpi.ranks.collectives.MpiCollectives.run_native` (non-blocking MPI collective on a
  cached sub-communicator, waited on with ``Test`` + short sleeps);
- each **schedule** algorithm through :meth:`partir_emu.mpi.ranks.collectives.MpiCollectives.run_schedule`: ring,
  bidir_ring, recursive, torus (the ranks as a 2-D group, e.g. 4x4) and hierarchical
  (``devices_per_node=4``). A fallback is shown as ``asked->built`` (all_to_all has no ring:
  ring, bidir_ring and recursive build ``pairwise``, hierarchical builds ``direct``).

Timing is interleaved, because the machine is shared and its load drifts: per size, one
warm-up call of every path (which builds and caches the schedule and its plan and checks the
result against raw with ``allclose``), then ``reps`` rounds; a round times every path once, in
an order rotated from round to round, raw included. A sample is ``inner`` back-to-back calls
after a ``Barrier`` (``inner`` grows for small sizes so a sample lasts long enough to time, and
shrinks with the rank count),
timed with ``MPI.Wtime``; its time is the max over ranks. A cell's time is the median of its
samples, and its ratio the median over rounds of ``raw time / path time`` measured in the same
round (paired, so load that changes between rounds cancels). Native and schedule calls run
with ``check=False`` (no header exchange: in the emulator
:class:`~partir_emu.mpi.ranks.mesh.MpiMesh` runs its own agreement check per collective);
the summary shows what ``check=True`` adds to a small all_reduce. The load average is printed
before and after each mpiexec run.

Bus bandwidth (nccl-tests ``PERFORMANCE.md``): ``algbw = size / time``; ``busbw = algbw x
2(p-1)/p`` for all_reduce and ``x (p-1)/p`` for all_gather, reduce_scatter and all_to_all.
``size`` is the per-rank input for all_reduce, reduce_scatter and all_to_all and the gathered
output for all_gather (nccl-tests' convention). Numbers are GB/s (1e9 B/s) of float32 data.

Sizes go 1 KiB .. 64 MiB by powers of 4, capped per rank count (``--cap``); the output says
where it capped. The goal (issue 9) is judged on sizes of at least 64 KiB.

    python benchmarks/collectives.py --quick             # 8 and 16 ranks, fewer sizes, < 3 minutes
    python benchmarks/collectives.py                     # the full table (8-32 ranks: 12 min here at 7 rounds)
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
GOAL_MIN_BYTES = 64 * KIB                                      # the goal counts cells from this size up
SAMPLE_BYTES = 256 * KIB                                       # a sample moves at least this much (inner calls)
MAX_INNER = 16
QUICK = {8: (16 * KIB, 4 * MIB), 16: (64 * KIB, MIB)}           # --quick: rank count -> (smallest, largest) size


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
    import numpy as np  # why: the driver process never needs numpy or MPI
    from mpi4py import MPI

    from partir_emu.collectives.algorithms import build_schedule
    from partir_emu.mpi.ranks.collectives import MpiCollectives

    comm = MPI.COMM_WORLD
    me, R = comm.Get_rank(), comm.Get_size()
    ex = MpiCollectives(comm)
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

    def sample(fn, inner):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(inner):
            fn()
        return (MPI.Wtime() - t0) / inner

    def paths_for(kind, size, x):
        out = [("native", "native", lambda check=False: ex.run_native(kind, group, ident, {me: x}, check=check,
                                                                       timeout_s=timeout)[me])]
        for alg in algs:
            sched = build_schedule(kind, shape if alg == "torus" else (R,), size, alg, itemsize=4,
                                   devices_per_node=DPN)
            out.append((alg, sched.algorithm,
                        lambda check=False, sched=sched: ex.run_schedule(sched, group, ident, {me: x}, check=check,
                                                                         timeout_s=timeout)[me]))
        return out

    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    algs = [a for a in ALGS if a in args.algorithms.split(",")]
    sizes = [s for s in SIZES if args.min_bytes <= s <= args.max_bytes]
    shape = torus_shape(R)
    rng = np.random.default_rng(1234 + me)
    t_start = time.monotonic()
    for kind in kinds:
        for size in sizes:
            n = size // 4
            if n % R:
                continue
            x = rng.standard_normal(n // R if kind == "all_gather" else n).astype(np.float32)
            out = np.empty(n // R if kind == "reduce_scatter" else n, np.float32)
            reps = args.reps if size <= args.big else max(3, args.reps // 2)
            inner = max(1, min(MAX_INNER, SAMPLE_BYTES // size, 128 // R))  # many ranks: each call is long
            ref = raw_call(kind, x, out).copy()
            paths = [("raw", "raw", lambda kind=kind, x=x, out=out: raw_call(kind, x, out))] + paths_for(kind, size, x)
            ok = {}
            for name, _, call in paths[1:]:  # warm-up: builds and caches; checked against raw
                got = call()
                good = bool(np.allclose(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max()))))
                ok[name] = bool(comm.allreduce(good, MPI.LAND))
            times = np.zeros((reps, len(paths)))
            for rnd in range(reps):  # interleaved: every path once per round, the order rotated
                for i in range(len(paths)):
                    j = (i + rnd) % len(paths)
                    times[rnd, j] = sample(paths[j][2], inner)
            worst = np.empty_like(times)
            comm.Allreduce(times, worst, MPI.MAX)
            for j, (name, built, call) in enumerate(paths):
                col = worst[:, j]
                rec = {"kind": kind, "ranks": R, "size": size, "path": name, "built": built,
                       "t": float(np.median(col)), "ratio": float(np.median(worst[:, 0] / col)),
                       "ok": ok.get(name, True), "reps": reps, "inner": inner}
                if size == sizes[0] and kind == "all_reduce" and name != "raw":  # what the header check adds
                    pair = np.array([[sample(lambda c=call, ck=ck: c(check=ck), inner) for ck in (False, True)]
                                     for _ in range(reps)])
                    wp = np.empty_like(pair)
                    comm.Allreduce(pair, wp, MPI.MAX)
                    rec["t_nocheck"], rec["t_check"] = float(np.median(wp[:, 0])), float(np.median(wp[:, 1]))
                emit(rec)
    ex.free()
    emit({"done": True, "ranks": R, "seconds": time.monotonic() - t_start})
    return 0


# ------------------------------------------------------------------------------------ driver
def launch(ranks: int, args: argparse.Namespace, min_bytes: int, max_bytes: int) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(args.timeout)), PYTHONPATH=str(ROOT))
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--max-bytes", str(max_bytes), "--min-bytes", str(min_bytes), "--reps", str(args.reps),
           "--big", str(args.big), "--kinds", args.kinds, "--algorithms", args.algorithms,
           "--op-timeout", str(args.op_timeout)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 30, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"mpiexec -n {ranks} did not finish in {args.timeout + 30:.0f} s") from e
    recs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not any(r.get("done") for r in recs):
        raise SystemExit(f"mpiexec -n {ranks} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    print(f"# {ranks} ranks: mpiexec wall {time.perf_counter() - t0:.1f} s, load average after "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    return [r for r in recs if not r.get("done")]


def _num(x: float) -> str:
    return f"{x:.3f}" if x >= 0.1 else f"{x:.2g}"


def table(kind: str, ranks: int, recs: list[dict], algs: list[str]) -> list[str]:
    f = busbw_factor(kind, ranks)
    rows: dict[int, dict[str, dict]] = {}
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
    lines = [f"{kind}, {ranks} ranks  (busbw GB/s from median times; ratio = median over rounds of raw time / "
             "path time)", "".join(h.rjust(x) for h, x in zip(heads, w))]
    for size in sorted(rows):
        row = rows[size]
        cells = [fmt_size(size), _num(size / row["raw"]["t"] * f / 1e9)]
        for path in ["native"] + algs:
            r = row.get(path)
            if r is None:
                cells += ["-", "-"]
                continue
            cells += [_num(size / r["t"] * f / 1e9) + ("" if r["ok"] else "!"), f"{r['ratio']:.2f}"]
        lines.append("".join(c.rjust(x) for c, x in zip(cells, w)))
    return lines


def summary(allrecs: list[dict], kinds: list[str], algs: list[str]) -> list[str]:
    lines = [f"summary (per path: median over cells of the paired ratio path busbw / raw busbw; the goal counts "
             f"cells >= {fmt_size(GOAL_MIN_BYTES)}):"]
    for path in ["native"] + algs:
        cells = [(r["ratio"], (r["kind"], r["ranks"], r["size"])) for r in allrecs if r["path"] == path]
        if not cells:
            continue
        goal = 0.9 if path == "native" else 0.5
        big = [c for c in cells if c[1][2] >= GOAL_MIN_BYTES]
        small = [c for c in cells if c[1][2] < GOAL_MIN_BYTES]
        judged = big or cells
        worst = min(judged)
        by_kind = "  ".join(f"{k}={statistics.median(r for r, c in judged if c[0] == k):.2f}" for k in kinds
                            if any(c[0] == k for _, c in judged))
        lines.append(f"  {path:>13}: >={fmt_size(GOAL_MIN_BYTES)} median {statistics.median(r for r, _ in judged):.2f} "
                     f"(goal >= {goal}; {sum(r >= goal for r, _ in judged)}/{len(judged)} cells meet)  "
                     f"worst {worst[0]:.2f} at {worst[1][0]} {worst[1][1]} ranks {fmt_size(worst[1][2])}"
                     + (f"  | <{fmt_size(GOAL_MIN_BYTES)} median {statistics.median(r for r, _ in small):.2f}"
                        if small else ""))
        lines.append(f"  {'':>13}  by kind (>= {fmt_size(GOAL_MIN_BYTES)}): {by_kind}")
    for r in sorted({x["ranks"] for x in allrecs}):
        c = [x for x in allrecs if x["ranks"] == r and "t_check" in x]
        if c:
            lines.append(f"  check=True (header exchange) at {fmt_size(c[0]['size'])} all_reduce, {r} ranks, ms: "
                         + ", ".join(f"{x['path']} {x['t_nocheck'] * 1e3:.2f}->{x['t_check'] * 1e3:.2f}" for x in c))
    bad = [x for x in allrecs if not x["ok"]]
    lines.append(f"  results checked against raw (allclose): "
                 f"{'all ok' if not bad else f'{len(bad)} MISMATCHES (marked !)'}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="8 ranks 16 KiB..4 MiB and 16 ranks 64 KiB..1 MiB, 3 rounds: under 3 minutes on a "
                    "2-core machine")
    ap.add_argument("--ranks", default="8,16,32,64", help="rank counts (default %(default)s)")
    ap.add_argument("--min-bytes", type=parse_size, default=KIB, help="smallest size (default 1K)")
    ap.add_argument("--max-bytes", type=parse_size, default=64 * MIB, help="largest size (default 64M)")
    ap.add_argument("--cap", default=",".join(f"{r}:{fmt_size(c).replace(' ', '')}" for r, c in DEFAULT_CAP.items()),
                    help="per rank count size caps R:SIZE,... (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per cell, halved (>= 3) above --big "
                    "(default %(default)s)")
    ap.add_argument("--big", type=parse_size, default=MIB, help="size above which rounds are halved (default 1M)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--algorithms", default=",".join(ALGS))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mpiexec run (default %(default)s)")
    ap.add_argument("--op-timeout", type=float, default=300, help="timeout_s of each collective call")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.ranks, args.reps, args.timeout = ",".join(map(str, QUICK)), 3, 150
        args.min_bytes, args.max_bytes = min(lo for lo, _ in QUICK.values()), max(hi for _, hi in QUICK.values())
        caps = {r: hi for r, (_, hi) in QUICK.items()}
    else:
        caps = {int(r): parse_size(c) for r, c in (x.split(":") for x in args.cap.split(",") if x)}
    algs = [a for a in ALGS if a in args.algorithms.split(",")]
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    print(f"# collectives benchmark: float32, sizes {fmt_size(args.min_bytes)}..{fmt_size(args.max_bytes)} by x4, "
          f"{args.reps} interleaved rounds (halved above {fmt_size(args.big)}), 1 device per rank, "
          f"{os.cpu_count()} cores")
    t0 = time.perf_counter()
    allrecs: list[dict] = []
    for r in (int(x) for x in args.ranks.split(",")):
        mb = min(args.max_bytes, caps.get(r, args.max_bytes))
        if mb < args.max_bytes:
            print(f"# {r} ranks: sizes capped at {fmt_size(mb)} to keep the run short on this machine")
        print(f"# {r} ranks: load average before the run {os.getloadavg()[0]:.1f} (this machine: "
              f"{os.cpu_count()} cores)", flush=True)
        recs = launch(r, args, QUICK[r][0] if args.quick else args.min_bytes, mb)
        allrecs += recs
        for kind in kinds:
            print()
            print("\n".join(table(kind, r, [x for x in recs if x["kind"] == kind], algs)))
        print(flush=True)
    print("\n".join(summary(allrecs, kinds, algs)))
    print(f"  total wall {time.perf_counter() - t0:.0f} s, load average (1/5/15 min) "
          + "/".join(f"{x:.1f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DES scale: a flat H100 ring all-reduce and the 4096-chip t48 step, aggregated vs the reference path.

The anchor is the DES's own reference path (``aggregate=False``: one step plan per schedule step,
a simpy event per rate update, every member and flow on its own) on sizes where it is feasible,
next to simpy's raw event rate on this machine. The aggregated path (shared step shapes, member and
flow symmetry classes, lock-step spans, eager rate updates; ``hwmodels/des/classes.py``,
``hwmodels/des/lockstep.py``) must give the same step
time (the relative difference is printed) in less time. Then the issue-13 goals at 4096 chips: the
flat ring (goal <= 30 s, <= 2 GB) and the t48 step (``transformer --preset t48 --strategy bp+mp+z3
--mesh batch=512,model=8 --hardware tpu-v4``; goal <= 30 s under load), each quiet and under a load
this script makes (``--load`` busy-loop processes, one per core by default), on the default fill
placement and on the one ``--placement auto`` (the CLI's default) picks.

Every case runs in a fresh child process, so its peak RSS (``ru_maxrss``) is its own; it includes
the analytical pricing and the schedule the DES needs (``simulate_des`` end to end). Wall and CPU
seconds are both printed: the machine is shared, CPU time is the steadier figure.

    python benchmarks/des_scale.py                       # anchor 256..1024, then 4096 ring and t48
    python benchmarks/des_scale.py --sizes 256 --repeats 1 --no-t48
    python benchmarks/des_scale.py --sizes ""            # the goals only
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
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def ring_case(p: int, aggregate: bool, nbytes: int) -> dict:
    """One flat ring all-reduce of ``nbytes`` over ``p`` H100s (in this process)."""
    import resource

    from partir_emu.core.ir import Eqn, Program, Var
    from partir_emu.core.mesh import Mesh
    from partir_emu.core.sharding import Sharding
    from partir_emu.core.spmd import SpmdProgram
    from partir_emu.hwmodels.des import simulate_des
    x, y = Var(0, (nbytes // 4,), "float32"), Var(1, (nbytes // 4,), "float32")
    prog = Program((x,), ("x",), (Eqn("all_reduce", (x,), (y,), {"axes": ("x",), "op": "sum"}),), (y,), ("y",))
    spmd = SpmdProgram(Mesh(x=p), prog, (Sharding.replicated(1),), (Sharding.replicated(1),), (x.shape,), (y.shape,))
    c0, t0 = time.process_time(), time.perf_counter()
    rep = simulate_des(spmd, "h100", algorithms="ring", aggregate=aggregate, progress=None)
    return {"step_s": rep.step_s, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "events": rep.events, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def t48_case(chips: int, aggregate: bool, placement: str = "default") -> dict:
    """The t48 bp+mp+z3 training step on ``chips`` TPU v4 chips, overlap on (in this process), on the
    default fill placement or, with ``placement="auto"``, on the one the CLI's search picks (the
    search is timed apart: ``search_s``)."""
    import resource

    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    from partir_emu.hwmodels.analytical import Analyzer
    from partir_emu.hwmodels.des import simulate_des
    from partir_emu.hwmodels.machine.search import resolve_placement
    t0 = time.perf_counter()
    spmd = Experiment("transformer", "bp+mp+z3", Mesh(batch=chips // 8, model=8), "t48").lower().spmd
    lower_s = time.perf_counter() - t0
    analyzer = Analyzer()
    t0 = time.perf_counter()
    place, _, _ = resolve_placement(spmd, "tpu-v4", placement, analyzer, overlap=True)
    search_s = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    rep = simulate_des(spmd, "tpu-v4", place, overlap=True, aggregate=aggregate, progress=None, analyzer=analyzer)
    return {"step_s": rep.step_s, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "events": rep.events, "lower_s": lower_s, "search_s": search_s, "placement": place.describe(),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class Load:
    """``n`` CPU-bound processes (a Python busy loop each) for the duration of a ``with``: the
    "under load" of the goals, made here rather than hoped for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=10)


def child(kind: str, size: int, aggregate: bool, nbytes: int | str) -> dict:
    """Run one case in a fresh interpreter (its own peak RSS); progress lines pass through on stderr.
    For ``kind="t48"``, ``nbytes`` is the placement (``default`` or ``auto``)."""
    cmd = [sys.executable, __file__, "--child", kind, str(size), str(int(aggregate)), str(nbytes)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512,1024", help="ring sizes for the anchor comparison")
    ap.add_argument("--repeats", type=int, default=3, help="runs per anchor case (medians)")
    ap.add_argument("--big", type=int, default=4096, help="chips for the goal figures")
    ap.add_argument("--nbytes", type=int, default=256 << 20, help="all-reduce buffer per GPU")
    ap.add_argument("--no-t48", action="store_true")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2,
                    help="busy-loop processes alongside the loaded goal runs (default: one per core)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, size, agg, nbytes = args.child
        res = ring_case(int(size), agg == "1", int(nbytes)) if kind == "ring" else t48_case(int(size), agg == "1", nbytes)
        print(json.dumps(res))
        return 0

    from benchmarks.des_speed import simpy_raw_rate
    print(f"simpy raw event rate (timeouts only, this machine, this run): {simpy_raw_rate():,.0f} events/s")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"flat H100 ring all-reduce of {args.nbytes >> 20} MiB, reference (aggregate=False) vs aggregated, "
          f"medians of {args.repeats}")
    print(f"{'GPUs':>6}{'ref wall s':>12}{'ref cpu s':>11}{'ref events':>12}{'agg wall s':>12}{'agg cpu s':>11}"
          f"{'agg events':>12}{'cpu ratio':>10}{'step ms':>11}{'rel diff':>10}")
    for p in (int(x) for x in args.sizes.split(",") if x):
        runs = {a: [child("ring", p, a, args.nbytes) for _ in range(args.repeats)] for a in (False, True)}
        med = {a: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "events")}
               for a, rs in runs.items()}
        ref, agg = runs[False][0]["step_s"], runs[True][0]["step_s"]
        print(f"{p:>6}{med[False]['wall_s']:>12.2f}{med[False]['cpu_s']:>11.2f}{med[False]['events']:>12,.0f}"
              f"{med[True]['wall_s']:>12.2f}{med[True]['cpu_s']:>11.2f}{med[True]['events']:>12,.0f}"
              f"{med[False]['cpu_s'] / med[True]['cpu_s']:>9.1f}x{agg * 1e3:>11.4f}{abs(agg - ref) / ref:>10.1e}",
              flush=True)

    print(f"\ngoals at {args.big} chips (aggregated, one run each, end to end incl. pricing and schedules; "
          f"'loaded': {args.load} busy-loop processes run alongside, on {os.cpu_count()} cores):")
    for loaded in (False, True):
        with Load(args.load if loaded else 0):
            r = child("ring", args.big, True, args.nbytes)
        ok = r["wall_s"] <= 30 and r["rss_mb"] <= 2048
        print(f"flat ring all-reduce{' (loaded)' if loaded else ''}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
              f"peak RSS {r['rss_mb']:,.0f} MB, {r['events']:,} events, step {r['step_s'] * 1e3:.4f} ms "
              f"(goal <= 30 s, <= 2 GB: {'met' if ok else 'NOT met'})", flush=True)
    if args.no_t48:
        return 0
    for placement in ("default", "auto"):
        for loaded in (False, True):
            with Load(args.load if loaded else 0):
                r = child("t48", args.big, True, placement)
            print(f"t48 bp+mp+z3 step, {placement} placement{' (loaded)' if loaded else ''}: {r['wall_s']:.1f} s "
                  f"wall, {r['cpu_s']:.1f} s CPU, peak RSS {r['rss_mb']:,.0f} MB, {r['events']:,} events, step "
                  f"{r['step_s'] * 1e3:.3f} ms (lowering {r['lower_s']:.1f} s and placement {r['search_s']:.1f} s "
                  f"apart; {r['placement']}; goal <= 30 s under load"
                  f"{': ' + ('met' if r['wall_s'] <= 30 else 'NOT met') if loaded else ''})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

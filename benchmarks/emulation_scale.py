"""How far the MPI emulation scales on this box, against JAX's own CPU emulation.

For each device count N (default 64, 256, 1024) it runs, end to end and as a user would,

- ``partir-emu run SCENARIO --strategy bp --mesh batch=N --set batch=N --backend mpi
  --devices N --devices-per-rank k --algorithm A`` (fresh process: import, trace + lower,
  launch mpiexec with N/k ranks, step, gather, jax.jit reference, verify), once per algorithm
  (default ``recursive`` — a schedule, bit-identical to LocalMesh — and ``native`` MPI);
- JAX's emulation in a fresh process with ``jax_num_cpu_devices=N``: the same step under
  ``jax.jit`` with NamedShardings equivalent to ``bp`` (the batch dim of every batch input over
  all N devices, parameters and optimizer state replicated), inputs placed, compiled, run once
  (``step_s`` = that first call, compile included) and fetched;

and prints devices, ranks, devices per rank, launch, step and total wall time, peak memory and
the ratio of our total to JAX's. Peak memory: ours = the sum of every rank's max RSS plus the
launcher's; JAX's = its process's max RSS. With ``--repeat R`` each number is the median of R runs.

``--one-per-rank 256`` additionally runs N=256 with one device per rank (256 MPI ranks).

    python benchmarks/emulation_scale.py                       # the table the README quotes
    python benchmarks/emulation_scale.py --devices 1024 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ranks per device count: a few ranks with many devices each start fast on a 2-core box
DEFAULT_LAYOUT = {64: 8, 256: 16, 1024: 16}


def _run_timed(cmd: list[str], env: dict, timeout: float) -> tuple[int, float, int, str]:
    """(returncode, wall seconds, max RSS bytes of the process, stdout+stderr)."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return proc.returncode, wall, ru.ru_maxrss * 1024, out.read().decode(errors="replace")


def run_ours(scenario: str, n: int, ranks: int, algorithm: str, timeout: float) -> dict:
    exe = Path(sys.executable).parent / "partir-emu"
    with tempfile.TemporaryDirectory(prefix="emulation-scale-") as tmp:
        rep = Path(tmp) / "report.json"
        cmd = [str(exe), "run", scenario, "--strategy", "bp", "--mesh", f"batch={n}", "--set", f"batch={n}",
               "--backend", "mpi", "--devices", str(n), "--devices-per-rank", str(n // ranks),
               "--algorithm", algorithm, "--timeout", str(timeout), "--report", str(rep)]
        rc, wall, _, text = _run_timed(cmd, dict(os.environ), timeout + 60)
        if rc != 0 or not rep.exists():
            raise SystemExit(f"partir-emu failed (exit {rc}):\n{text[-3000:]}")
        r = json.loads(rep.read_text())
    return {"verified": r["verified"], "launch_s": r["launch_s"], "step_s": r["step_s"], "total_s": wall,
            "mem_bytes": r["rss_bytes_total"] + r["launcher_rss_bytes"], "ranks": r["ranks"],
            "devices_per_rank": r["devices_per_rank"]}


def run_jax(scenario: str, n: int, timeout: float) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--jax-child", str(n), "--scenario", scenario]
    rc, wall, rss, text = _run_timed(cmd, env, timeout)
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise SystemExit(f"the JAX emulation failed (exit {rc}):\n{text[-3000:]}")
    r = json.loads(lines[-1])
    return {"launch_s": r["setup_s"], "step_s": r["step_s"], "total_s": wall, "mem_bytes": rss}


def jax_child(scenario: str, n: int) -> None:
    """The JAX side, in its own process: ``jax_num_cpu_devices=n``, bp as NamedShardings."""
    t0 = time.perf_counter()
    import jax
    jax.config.update("jax_num_cpu_devices", n)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from scenarios import get_scenario
    sc = get_scenario(scenario)
    cfg = sc.config(None, f"batch={n}")
    step = sc.make_step(cfg)
    params, opt, batch = sc.make_inputs(cfg, 0)
    mesh = jax.make_mesh((n,), ("batch",))
    repl = NamedSharding(mesh, P())
    shard0 = NamedSharding(mesh, P("batch"))
    in_sh = (jax.tree.map(lambda _: repl, params), jax.tree.map(lambda _: repl, opt),
             jax.tree.map(lambda _: shard0, batch))
    args = jax.device_put((params, opt, batch), in_sh)
    f = jax.jit(step, in_shardings=in_sh, out_shardings=(repl, in_sh[0], in_sh[1]))
    jax.block_until_ready(args)
    t1 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    t2 = time.perf_counter()
    [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
    assert len(jax.devices()) == n
    print(json.dumps({"setup_s": t1 - t0, "step_s": t2 - t1}))


def _median(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="64,256,1024", help="device counts (default %(default)s)")
    ap.add_argument("--scenario", default="mlp", help="scenario at its tiny size with batch=N (default %(default)s)")
    ap.add_argument("--algorithms", default="recursive,native", help="MPI collective algorithms (default %(default)s)")
    ap.add_argument("--ranks", default=None, help="N:R,... ranks per device count (default 64:8,256:16,1024:16)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; medians are printed")
    ap.add_argument("--one-per-rank", type=int, default=None, metavar="N",
                    help="also run N devices with one device per rank (e.g. 256)")
    ap.add_argument("--no-jax", action="store_true", help="skip JAX's emulation")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--jax-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jax_child is not None:
        jax_child(args.scenario, args.jax_child)
        return 0
    layout = dict(DEFAULT_LAYOUT)
    if args.ranks:
        layout.update({int(a): int(b) for a, b in (x.split(":") for x in args.ranks.split(","))})
    devices = [int(x) for x in args.devices.split(",")]
    algorithms = args.algorithms.split(",")
    cells = [(n, layout.get(n, max(1, n // 64)), a) for n in devices for a in algorithms]
    if args.one_per_rank:
        cells.append((args.one_per_rank, args.one_per_rank, algorithms[0]))

    head = (f"{'devices':>7} {'ranks':>5} {'dev/rank':>8} {'backend':<15} {'launch_s':>8} {'step_s':>8} "
            f"{'total_s':>8} {'peak_mem_GiB':>12} {'vs_jax':>6}  verified")
    print(f"scenario {args.scenario} (tiny, batch=N), strategy bp; {os.cpu_count()} cores; "
          f"medians of {args.repeat} run(s)")
    print(head)
    print("-" * len(head))
    jax_rows: dict[int, dict] = {}
    for n in dict.fromkeys(devices):
        if not args.no_jax:
            jax_rows[n] = _median([run_jax(args.scenario, n, args.timeout) for _ in range(args.repeat)])
        for cn, ranks, alg in [c for c in cells if c[0] == n]:
            r = _median([run_ours(args.scenario, cn, ranks, alg, args.timeout) for _ in range(args.repeat)])
            ratio = f"{r['total_s'] / jax_rows[n]['total_s']:6.2f}" if n in jax_rows else "     -"
            print(f"{cn:>7} {r['ranks']:>5} {r['devices_per_rank']:>8} {'mpi ' + alg:<15} {r['launch_s']:>8.2f} "
                  f"{r['step_s']:>8.2f} {r['total_s']:>8.2f} {r['mem_bytes'] / 2**30:>12.2f} {ratio}  "
                  f"{'yes' if r['verified'] else 'NO'}", flush=True)
        if n in jax_rows:
            j = jax_rows[n]
            print(f"{n:>7} {'-':>5} {'-':>8} {'jax cpu devices':<15} {j['launch_s']:>8.2f} {j['step_s']:>8.2f} "
                  f"{j['total_s']:>8.2f} {j['mem_bytes'] / 2**30:>12.2f} {1.0:6.2f}  -", flush=True)
    for cn, ranks, alg in cells:
        if cn not in dict.fromkeys(devices):
            r = run_ours(args.scenario, cn, ranks, alg, args.timeout)
            print(f"{cn:>7} {r['ranks']:>5} {r['devices_per_rank']:>8} {'mpi ' + alg:<15} {r['launch_s']:>8.2f} "
                  f"{r['step_s']:>8.2f} {r['total_s']:>8.2f} {r['mem_bytes'] / 2**30:>12.2f}      -  "
                  f"{'yes' if r['verified'] else 'NO'}", flush=True)
    print("launch_s: mpiexec start to the last rank holding its inputs (JAX: import, inputs placed); "
          "step_s: one step (JAX: first call, compile included); total_s: the whole command.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

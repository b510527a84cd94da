"""The double binary tree all-reduce across H100 nodes against the ring: closed form, analytical, DES.

Hardware: H100 (DGX nodes of 8 GPUs, one 50 GB/s NDR NIC per GPU, fat tree of 4 nodes per leaf).
Mesh ``Mesh(data=q, model=8)`` (``q`` nodes); the all-reduce runs over ``data`` (``q`` members, one
GPU per node, every edge over InfiniBand; 8 such groups at once, one per rail, on their own NICs) or,
with ``--all``, over every GPU (``8q`` members, edges inside a node over NVSwitch).

Closed forms (``A``: the route's latency, ``B``: 50 GB/s, ``N``: bytes):

- ring: ``2(p-1)`` steps of ``A + N/(pB)``, ``A`` the longest route of a ring edge (exact, every step
  alike);
- tree: the round-based two-tree form (Sanders, Speck & Traeff 2009; NCCL's tree): ``2H + S - 1``
  rounds (``H = floor(log2 p)``, ``S`` pipeline segments per half) of ``A_max + (N/2S)/B``. It is a
  reference, not the model's price: it charges every round its longest route and ignores that two
  children share a parent's NIC and that members run ahead of one another.

The analytical model prices uneven steps by the members' asynchronous critical path
(:mod:`partir_emu.hwmodels.network.async_steps`); the DES runs them.

    python benchmarks/tree_gpu.py [--nodes 2 4 8 16] [--kib 4 64 256 1024 4096] [--all]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_all_reduce(mesh, nbytes: int, axes: tuple[str, ...]):
    """An SpmdProgram with one f32 all-reduce of a replicated ``nbytes`` buffer over ``axes``."""
    from partir_emu.core.ir import Eqn, Program, Var
    from partir_emu.core.sharding import Sharding
    from partir_emu.core.spmd import SpmdProgram
    x, y = Var(0, (nbytes // 4,), "float32"), Var(1, (nbytes // 4,), "float32")
    eqn = Eqn("all_reduce", (x,), (y,), {"axes": axes, "op": "sum"})
    prog = Program((x,), ("x",), (eqn,), (y,), ("y",))
    return SpmdProgram(mesh, prog, (Sharding.replicated(1),), (Sharding.replicated(1),), (x.shape,), (y.shape,))


def closed_form(alg: str, p: int, nbytes: float, a_max: float, a_ring: float, B: float) -> float:
    """Seconds of the ring (exact) or the round-based two-tree reference (module docstring)."""
    from partir_emu.collectives.alg_gpu import tree_segments
    if alg == "ring":
        return 2 * (p - 1) * (a_ring + nbytes / p / B)
    S = tree_segments(p, int(nbytes))
    return (2 * int(math.log2(p)) + S - 1) * (a_max + nbytes / 2 / S / B)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--kib", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 4096])
    ap.add_argument("--all", action="store_true", help="all-reduce over every GPU (data, model)")
    args = ap.parse_args(argv)
    from partir_emu.core.mesh import Mesh
    from partir_emu.hwmodels import load_spec, place, simulate
    from partir_emu.hwmodels.des import simulate_des

    spec = load_spec("h100")
    B = spec.network.nic_bw_bytes_per_s
    axes = ("data", "model") if args.all else ("data",)
    print(f"h100, all-reduce over {axes}; closed form / analytical / DES in us; err = analytical vs DES")
    print(f"{'nodes':>5} {'KiB':>6} | {'tree cf':>8} {'ana':>8} {'DES':>8} {'err':>7} | {'ring cf':>8} {'ana':>8} "
          f"{'DES':>8} {'err':>7} | default")
    worst = 0.0
    for q in args.nodes:
        mesh = Mesh(data=q, model=8)
        pl = place(mesh, spec)
        group = pl.group(axes)
        p = group.size
        chips = sorted(group.chips, key=lambda c: (pl.topology.node_of(c), c))
        lat = [sum(lk.latency_s for lk in pl.topology.route(s, d)) for s in chips for d in chips if s != d]
        ring_lat = max(sum(lk.latency_s for lk in pl.topology.route(chips[i], chips[(i + 1) % p])) for i in range(p))
        for kib in args.kib:
            n = kib * 1024
            spmd = one_all_reduce(mesh, n, axes)
            row = f"{q:>5} {kib:>6} |"
            for alg in ("tree", "ring"):
                ana = simulate(spmd, spec, pl, algorithms=alg).step_s
                des = simulate_des(spmd, spec, pl, algorithms=alg).step_s
                cf = closed_form(alg, p, n, max(lat), ring_lat, B)
                err = ana / des - 1
                if alg == "tree":
                    worst = max(worst, abs(err))
                row += f" {cf * 1e6:8.1f} {ana * 1e6:8.1f} {des * 1e6:8.1f} {err:+7.1%} |"
            best = simulate(spmd, spec, pl).collectives[0]
            print(f"{row} {best.algorithm} {best.time_s * 1e6:.1f}", flush=True)
    print(f"tree: max |analytical - DES| / DES = {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

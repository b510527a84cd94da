"""A 16x16 torus all-reduce of 256 MiB: one dimension at a time (``torus``) against all dimensions at
once (``multidim``), in the analytical model, the DES and the closed form (issue 13, part 3).

Hardware: TPU v5e (a full 16x16 pod: both dims wrap; ICI link bandwidth ``B`` one way and ``A``
latency per hop from the spec). Mesh ``Mesh(x=16, y=16)`` placed ``x=x, y=y``; one all-reduce
over both axes of ``N = 256 MiB`` float32.

Closed form (alpha-beta of the phases; each phase is a set of bidirectional rings, every ring
direction carrying half the phase's data, one hop per message):

- ``torus``: reduce-scatter x then y, all-gather y then x. Phase on a dim of ``s`` holding ``D``
  bytes: ``s-1`` steps of ``A + D/(2 s B)``. ``D = N`` on the first dim, ``N/s_x`` on the second.
- ``multidim``: two parts of ``N/2``; part 0 runs x then y, part 1 y then x, in the same steps:
  step time ``A + (N/2)/(2 s B)`` while both parts are on their first dim, then on their second.

    python benchmarks/torus_allreduce.py [--mib 256] [--side 16] [--no-des]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def closed_form(kind_alg: str, sides: tuple[int, ...], nbytes: float, A: float, B: float) -> float:
    """Seconds of an all-reduce over a torus with dims ``sides`` (see the module docstring)."""
    parts = len(sides) if kind_alg == "multidim" else 1
    data = nbytes / parts
    t = 0.0
    for s in sides:                      # reduce-scatter phases (all parts step together)
        t += (s - 1) * (A + data / (2 * s * B))
        data /= s
    return 2 * t                         # the all-gather phases mirror them


def one_all_reduce(mesh, nbytes: int):
    """An SpmdProgram with one f32 all-reduce over every mesh axis (a replicated input of ``nbytes``)."""
    from partir_emu.core.ir import Eqn, Program, Var
    from partir_emu.core.sharding import Sharding
    from partir_emu.core.spmd import SpmdProgram
    x = Var(0, (nbytes // 4,), "float32")
    y = Var(1, (nbytes // 4,), "float32")
    eqn = Eqn("all_reduce", (x,), (y,), {"axes": tuple(mesh.axis_names), "op": "sum"})
    prog = Program((x,), ("x",), (eqn,), (y,), ("y",))
    return SpmdProgram(mesh, prog, (Sharding.replicated(1),), (Sharding.replicated(1),), (x.shape,), (y.shape,))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--side", type=int, default=16)
    ap.add_argument("--no-des", action="store_true", help="skip the DES (the slow part)")
    args = ap.parse_args(argv)
    from partir_emu.core.mesh import Mesh
    from partir_emu.hwmodels import load_spec, place, simulate
    from partir_emu.hwmodels.des import simulate_des

    spec = load_spec("tpu-v5e")
    A, B = spec.network.link_latency_s, spec.network.link_bw_bytes_per_s
    n = args.mib << 20
    mesh = Mesh(x=args.side, y=args.side)
    pl = place(mesh, spec, "x=x,y=y")
    spmd = one_all_reduce(mesh, n)
    print(f"{pl.topology.describe()}; all-reduce of {args.mib} MiB over (x, y); A={A * 1e6:g} us, B={B / 1e9:g} GB/s")
    print(f"{'algorithm':<18} {'closed form':>12} {'analytical':>12} {'DES':>12} {'DES wall':>9}")
    res = {}
    for alg in ("torus", "multidim", None):
        ana = simulate(spmd, spec, pl, algorithms=alg)    # alg None: the default choice (cheapest candidate)
        cf = closed_form(alg or ana.collectives[0].algorithm, (args.side, args.side), n, A, B)
        des_s, wall = float("nan"), 0.0
        if not args.no_des:
            t0 = time.perf_counter()
            des_s = simulate_des(spmd, spec, pl, algorithms=alg).step_s
            wall = time.perf_counter() - t0
        name = alg or f"default({ana.collectives[0].algorithm})"
        res[alg] = (cf, ana.step_s, des_s)
        print(f"{name:<18} {cf * 1e3:>10.3f}ms {ana.step_s * 1e3:>10.3f}ms {des_s * 1e3:>10.3f}ms {wall:>8.1f}s")
    (c0, a0, d0), (c1, a1, d1) = res["torus"], res["multidim"]
    print(f"ratio torus/multidim: closed form {c0 / c1:.3f}x, analytical {a0 / a1:.3f}x, DES {d0 / d1:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

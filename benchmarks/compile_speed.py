"""Compile speed: partir_emu's partition + lower vs JAX/XLA's SPMD compile, same program.

Builds a 48-layer decoder transformer training step (forward, grad, Adam),
partitions and lowers it with ``bp+mp+z3`` on a 3-axis mesh, then — in the same
process, on the same number of emulated CPU devices — times
``jax.jit(step, in_shardings=..., out_shardings=...).lower(...).compile()``
with the NamedShardings equivalent to our input/output shardings.

Reported: equation count; ours (trace, partition+lower, total); JAX's (lower,
compile, total); the ratio ours/JAX on the totals (both include tracing).
Medians over ``--repeat`` runs for ours; JAX is compiled ``--jax-repeat`` times
(it is slow; its cache is cleared between runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="pod=2,batch=4,model=4")
    ap.add_argument("--set", default="layers=48,d_model=1024,heads=16,d_ff=4096,seq=256,vocab=8192,batch=32")
    ap.add_argument("--strategy", default="bp+mp+z3")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--jax-repeat", type=int, default=1)
    args = ap.parse_args()

    from partir_emu.core.mesh import Mesh
    mesh = Mesh.parse(args.mesh)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    jax.config.update("jax_num_cpu_devices", mesh.size)

    from partir_emu.api import lower_program, trace
    from scenarios import get_scenario
    from scenarios.common import STATE_OUTPUTS

    sc = get_scenario("transformer")
    cfg = sc.config("t48", args.set)
    step = sc.make_step(cfg)
    abstract = sc.abstract_inputs(cfg)
    schedule = sc.strategy(args.strategy, mesh, cfg)

    t_trace, t_lower, low = [], [], None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        prog = trace(step, *abstract)
        t1 = time.perf_counter()
        low = lower_program(prog, mesh, schedule, STATE_OUTPUTS)
        t2 = time.perf_counter()
        t_trace.append(t1 - t0)
        t_lower.append(t2 - t1)
    ours_trace, ours_lower = statistics.median(t_trace), statistics.median(t_lower)
    spmd = low.spmd

    # the equivalent NamedShardings
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    jmesh = jax.make_mesh(tuple(s for _, s in mesh.axes), mesh.axis_names,
                          axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh.axes))

    def spec(sh):
        return NamedSharding(jmesh, P(*[tuple(d) if d else None for d in sh.dims]))

    leaves, tree = jax.tree_util.tree_flatten(abstract)
    in_sh = jax.tree_util.tree_unflatten(tree, [spec(s) for s in spmd.in_shardings])
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(step, *abstract))
    out_sh = jax.tree_util.tree_unflatten(out_tree, [spec(s) for s in spmd.out_shardings])
    t_jl, t_jc = [], []
    for _ in range(args.jax_repeat):
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh).lower(*abstract)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        t_jl.append(t1 - t0)
        t_jc.append(t2 - t1)
    jl, jc = statistics.median(t_jl), statistics.median(t_jc)

    st = spmd.stats()
    print(f"model: transformer t48 {cfg}")
    print(f"mesh: {mesh} ({mesh.size} devices), strategy {args.strategy}, {len(schedule)} tactics")
    print(f"equations: {len(prog.eqns)} traced, {len(spmd.program.eqns)} in the SPMD program; "
          f"collectives: {st.count}")
    print(f"ours  trace {ours_trace:7.3f} s   partition+lower {ours_lower:7.3f} s   total {ours_trace + ours_lower:7.3f} s"
          f"   (median of {args.repeat})")
    print(f"jax   lower {jl:7.3f} s   compile         {jc:7.3f} s   total {jl + jc:7.3f} s"
          f"   (median of {args.jax_repeat})")
    print(f"ratio ours/jax: partition+lower vs lower+compile {ours_lower / (jl + jc):.3f}; "
          f"totals {(ours_trace + ours_lower) / (jl + jc):.3f}")


if __name__ == "__main__":
    main()

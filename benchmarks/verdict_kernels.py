"""The verdict under every OpenBLAS kernel: no correct run called wrong, every broken one far off.

For each ``OPENBLAS_CORETYPE`` (default: the machine's own, Haswell, SkylakeX where the CPU has
AVX-512, Prescott) a child process runs the sweep: every strategy of every scenario (mlp,
transformer, transformer in bfloat16, unet, gns, inference prefill and decode) at its emulation
size, on the first 4-device mesh that carries it, over ``--seeds`` seeds (default 20), each run on
the in-process mesh and judged by :mod:`partir_emu.runtime.verdict` against the unpartitioned step
(jax.jit, float64, and the program in other summation orders). Then the deliberately broken
programs, on the first seed:

- ``max``: the first ``all_reduce`` of the program takes the max instead of the sum;
- ``drop``: the first ``all_reduce`` is skipped (its operand used in its place): the replicas then
  disagree and assembling the outputs refuses, or the verdict fails;
- ``halo``: the first ``collective_permute`` (a halo exchange) shifts the other way.

Per kernel it prints the kernel OpenBLAS reports, the number of runs, the correct runs that failed
(must be 0), the largest ``excess / allowance`` of a correct run (the verdict's margin: below 1 it
passes) and the smallest ``excess / allowance`` of a broken run (the issue asks ≥ 10).

    python benchmarks/verdict_kernels.py                    # every kernel, 20 seeds (~25 min on 2 cores)
    python benchmarks/verdict_kernels.py --seeds 3 --kernels default,Prescott
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESHES = ("batch=2,model=2", "spatial=4", "batch=2,spatial=2")
CONFIGS = (("mlp", None), ("transformer", None), ("transformer", "precision=bf16"), ("unet", None), ("gns", None),
           ("inference", "phase=prefill"), ("inference", "phase=decode"))


def _has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _break(spmd, how: str):
    """``spmd`` with its first all_reduce a max or dropped, or its first collective_permute reversed;
    None if the program has no such collective."""
    prog = spmd.program
    eqns = list(prog.eqns)
    prim = "collective_permute" if how == "halo" else "all_reduce"
    k = next((i for i, e in enumerate(eqns) if e.prim == prim), None)
    if k is None:
        return None
    e = eqns[k]
    if how == "max":
        eqns[k] = dataclasses.replace(e, params={**e.params, "op": "max"})
    elif how == "halo":
        if "shift" not in e.params:
            return None
        eqns[k] = dataclasses.replace(e, params={**e.params, "shift": -int(e.params["shift"])})
    else:
        lost, kept = e.outputs[0], e.inputs[0]
        rest = [dataclasses.replace(x, inputs=tuple(kept if a == lost else a for a in x.inputs)) for x in eqns[k + 1:]]
        outs = tuple(kept if o == lost else o for o in prog.outputs)
        return dataclasses.replace(spmd, program=dataclasses.replace(prog, eqns=tuple(eqns[:k] + rest), outputs=outs))
    return dataclasses.replace(spmd, program=dataclasses.replace(prog, eqns=tuple(eqns)))


def sweep(seeds: int) -> dict:
    """The child: every case, every seed; the broken programs."""
    from threadpoolctl import threadpool_info

    from partir_emu.app.experiment import Experiment, flatten
    from partir_emu.core.mesh import Mesh
    from partir_emu.errors import PartirError
    from partir_emu.runtime.local_mesh import LocalMesh
    from scenarios import get_scenario

    kernel = next((i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"), "?")
    runs = failed = 0
    worst_ok: dict[str, tuple[float, str]] = {}      # by precision: float32, bfloat16
    broken: dict[str, list[tuple[float, str]]] = {}
    t0 = time.perf_counter()
    for scenario, overrides in CONFIGS:
        sc = get_scenario(scenario)
        prec = "bfloat16" if overrides and "bf16" in overrides else "float32"
        ref_exp = Experiment(scenario, "bp", Mesh(batch=1), None, overrides)
        refs_by_seed: dict[int, object] = {}
        for strategy in sorted(sc.strategies):
            exp = Experiment(scenario, strategy, Mesh.parse(sc.first_mesh(strategy, MESHES)), None, overrides)
            low = exp.lower()
            local = LocalMesh(exp.mesh)
            for seed in range(seeds):
                inputs = flatten(exp.scenario.make_inputs(exp.cfg, seed))
                if seed not in refs_by_seed:
                    refs_by_seed[seed] = ref_exp.references(inputs)
                v = exp.check(local.run(low.spmd, inputs).outputs, inputs, low.spmd.output_names, refs_by_seed[seed])
                runs += 1
                failed += not v.verified
                w = v.worst
                if w is not None and w.over > worst_ok.get(prec, (0.0, ""))[0]:
                    worst_ok[prec] = (w.over, f"{scenario}{' ' + overrides if overrides else ''} {strategy} "
                                              f"seed {seed}: {v.summary()}")
            for how in ("max", "drop", "halo"):
                bad = _break(low.spmd, how)
                if bad is None:
                    continue
                inputs = flatten(exp.scenario.make_inputs(exp.cfg, 0))
                what = f"{scenario}{' ' + overrides if overrides else ''} {strategy} {how}"
                try:
                    out = local.run(bad, inputs).outputs
                except PartirError as exc:         # the replicas disagree: refused before any verdict
                    broken.setdefault(prec, []).append((float("inf"), f"{what}: refused ({type(exc).__name__})"))
                    continue
                v = exp.check(out, inputs, low.spmd.output_names, refs_by_seed[0])
                w = v.worst
                broken.setdefault(prec, []).append((w.over if w is not None and not v.verified else 0.0,
                                                    f"{what}: {v.summary()}"))
    every = [b for bs in broken.values() for b in bs]
    return {"kernel": kernel, "runs": runs, "failed": failed, "worst_correct": worst_ok,
            "broken": len(every), "broken_passed": sum(b[0] <= 1 for b in every),
            "refused": sum(b[0] == float("inf") for b in every),
            "least_broken": {p: min(bs) for p, bs in broken.items()}, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--kernels", default=None, help="comma-separated OPENBLAS_CORETYPE values ('default': unset)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per kernel")
    args = ap.parse_args()
    if args.child:
        json.dump(sweep(args.seeds), sys.stdout)
        return 0
    kernels = args.kernels.split(",") if args.kernels else ["default", "Haswell", *(["SkylakeX"] if _has_avx512() else []),
                                                            "Prescott"]
    print(f"verdict sweep: {len(CONFIGS)} configurations x every strategy x {args.seeds} seeds, per OpenBLAS kernel")
    ok = True
    for k in kernels:
        env = dict(os.environ)
        env.pop("OPENBLAS_CORETYPE", None)
        if k != "default":
            env["OPENBLAS_CORETYPE"] = k
        proc = subprocess.run([sys.executable, __file__, "--child", "--seeds", str(args.seeds)], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            print(f"{k}: child failed\n{proc.stderr[-3000:]}")
            ok = False
            continue
        r = json.loads(proc.stdout)
        print(f"\nOPENBLAS_CORETYPE={k} (OpenBLAS reports {r['kernel']}): {r['runs']} correct runs, "
              f"{r['failed']} called wrong; {r['broken']} broken runs ({r['refused']} refused when the outputs "
              f"were assembled), {r['broken_passed']} passed; {r['seconds']:.0f} s")
        for prec, (over, what) in sorted(r["worst_correct"].items()):
            print(f"  {prec}: largest excess/allowance of a correct run {over:.3f}  ({what[:260]})")
        for prec, (over, what) in sorted(r["least_broken"].items()):
            print(f"  {prec}: smallest excess/allowance of a broken run {over:.3g}  ({what[:260]})")
        ok = ok and r["failed"] == 0 and r["broken_passed"] == 0 and min(v[0] for v in r["least_broken"].values()) >= 10
    print("\nresult:", "every correct run verified and every broken run failed by >= 10x its allowance" if ok
          else "NOT MET (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A 48-layer transformer written as ``lax.scan`` vs written unrolled: program size and the time to
trace, partition and price it, next to jax's own cost for the same two functions.

    python benchmarks/loops.py [--layers 48] [--repeats 3] [--size tiny|t48] [--strategy bp+mp+z3]

For each form (``layers_as=loop`` and ``layers_as=unrolled``) of ``transformer --size SIZE`` with
``--layers`` layers (abstract inputs: nothing is allocated):

- ``eqns``: equations of the SpmdProgram text (a loop body counted once: ``core.loops.static_eqn_count``);
- ``trace``, ``lower``: ``partir_emu`` tracing and partitioning + lowering (medians, s);
- ``price``: one cold ``simulate`` (a new ``Analyzer``) of the lowered program on tpu-v4 with overlap (the analytical model
  prices a body once and multiplies; the unrolled program is priced equation by equation);
- ``jax lower``: the anchor, ``jax.jit(step).lower(*args)`` (jax traces and emits StableHLO for the
  same function: a scan is one ``while`` for jax too).

The ratios (unrolled / loop) are printed per column. The SpmdPrograms execute the same
collectives per step (asserted here, and in tests/integration/test_loop_partition.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import partir_emu as pe  # noqa: E402
from partir_emu.compiler.api import partition_and_lower  # noqa: E402
from partir_emu.core.loops import static_eqn_count  # noqa: E402
from partir_emu.hwmodels.analytical import Analyzer, simulate  # noqa: E402
from scenarios.common import get_scenario  # noqa: E402

SC = get_scenario("transformer")


def _abstract(cfg: dict):
    def sds(tree):
        return {k: sds(v) if isinstance(v, dict) else jax.ShapeDtypeStruct(v, np.float32) for k, v in tree.items()}
    params = sds(SC.param_shapes(cfg))
    batch = {k: jax.ShapeDtypeStruct(s, dt) for k, (s, dt) in SC.batch_shapes(cfg).items()}
    opt = {"mu": params, "nu": params, "count": jax.ShapeDtypeStruct((), np.int32)}
    return params, opt, batch


def _median(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def measure(form: str, args: argparse.Namespace) -> dict:
    cfg = SC.complete_config(dict(SC.presets[args.size], layers=args.layers, layers_as=form))
    mesh = pe.Mesh(**{k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    inputs = _abstract(cfg)
    # a new step function for every repeat: jax caches traces per function object, so reusing one
    # would time the cache (for us and for the anchor)
    t_trace, prog = _median(lambda: pe.trace(SC.make_step(cfg), *inputs), args.repeats)
    schedule = SC.strategies[args.strategy](mesh, cfg)
    t_lower, low = _median(lambda: partition_and_lower(prog, mesh, schedule, state_outputs={"1": "params", "2": "opt"}),
                           args.repeats)
    # a fresh Analyzer per call: a cold price (program analysis, fusion, schedule), as for a new program
    t_price, rep = _median(lambda: simulate(low.spmd, "tpu-v4", overlap=True, analyzer=Analyzer()), args.repeats)
    t_jax, _ = _median(lambda: jax.jit(SC.make_step(cfg)).lower(*inputs), args.repeats)
    return {"eqns": static_eqn_count(low.spmd.program), "trace": t_trace, "lower": t_lower, "price": t_price,
            "jax lower": t_jax, "step_s": rep.step_s, "collectives": low.spmd.stats().to_json()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="t48")
    ap.add_argument("--strategy", default="bp+mp+z3")
    ap.add_argument("--mesh", default="batch=64,model=8")
    args = ap.parse_args(argv)
    rows = {form: measure(form, args) for form in ("loop", "unrolled")}
    loop, unrolled = rows["loop"], rows["unrolled"]
    print(f"transformer --size {args.size} --set layers={args.layers} --strategy {args.strategy} --mesh {args.mesh}; "
          f"medians of {args.repeats}, seconds")
    cols = ("eqns", "trace", "lower", "price", "jax lower")
    print(f"{'form':<10}" + "".join(f"{c:>12}" for c in cols) + f"{'step (model)':>16}")
    for form, r in rows.items():
        cells = "".join(f"{r[c]:>12}" if c == "eqns" else f"{r[c]:>12.3f}" for c in cols)
        print(f"{form:<10}{cells}{r['step_s'] * 1e3:>13.2f} ms")
    print(f"{'unrolled/loop':<10}" + "".join(f"{unrolled[c] / loop[c]:>11.1f}x" for c in cols))
    same = loop["collectives"] == unrolled["collectives"]
    print(f"same collectives per step: {'yes' if same else 'NO'}; predicted step: loop "
          f"{loop['step_s'] * 1e3:.2f} ms, unrolled {unrolled['step_s'] * 1e3:.2f} ms "
          f"({(loop['step_s'] / unrolled['step_s'] - 1) * 100:+.1f} %)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

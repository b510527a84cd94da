"""The child process of ``partir-emu compare-xla``: XLA compiles our exported shardings.

``python -m partir_emu.app.xla_child`` reads one JSON request on stdin and writes one JSON
answer on stdout. It runs in a fresh interpreter because jax fixes its device count when its
backend starts: this process sets ``jax_num_cpu_devices`` before anything touches a device,
and the parent's jax (one CPU device, or a real accelerator) is left alone.

Request: ``{"devices": N, "cases": [{"scenario", "strategy", "mesh": "batch=2,model=2", "size",
"overrides", "seed", "run": bool, "hlo_path": str | null}]}``. For each case the step is
lowered by partir-emu, its shardings exported with :func:`partir_emu.interop.to_jax`, and
``jax.jit(step, in_shardings, out_shardings)`` compiled for N CPU devices. The answer has both
programs' collectives (:mod:`partir_emu.app.xla_hlo`); with ``run`` also the largest
difference between XLA's outputs and our LocalMesh's on the same inputs, and whether every XLA
output came back with the sharding we exported. A PartirError is returned as ``error`` (the
parent reports it as bad input); anything else fails the process.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import numpy as np

from partir_emu.app.experiment import ATOL, RTOL, Experiment, verify
from partir_emu.app.xla_hlo import collectives, spmd_collectives
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError
from partir_emu.interop import to_jax
from partir_emu.runtime.local_mesh import LocalMesh


def compile_case(case: dict) -> dict:
    """One scenario × strategy × mesh: lower, export, compile with XLA (and run both, if asked)."""
    exp = Experiment(case["scenario"], case["strategy"], Mesh.parse(case["mesh"]), case.get("size"),
                     case.get("overrides"), case.get("seed", 0))
    low = exp.lower()
    step = exp.make_step()
    abstract = exp.scenario.abstract_inputs(exp.cfg)
    in_tree = jax.tree_util.tree_structure(abstract)
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(step, *abstract))
    sh = to_jax(low, in_tree=in_tree, out_tree=out_tree)
    fn = sh.jit(step)
    t0 = time.perf_counter()
    compiled = fn.lower(*abstract).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    if case.get("hlo_path"):
        with open(case["hlo_path"], "w") as f:
            f.write(hlo)
    out: dict[str, Any] = {
        "ours": [c.to_json() for c in spmd_collectives(low.spmd)],
        "xla": [c.to_json() for c in collectives(hlo, exp.mesh)],
        "compile_s": compile_s, "jax_version": jax.__version__,
        "in_specs": {n: str(s) for n, s in sh.in_specs.items()},
        "out_specs": {n: str(s) for n, s in sh.out_specs.items()},
    }
    if case.get("run"):
        out.update(_run_both(exp, low, fn, in_tree, sh))
    return out


def _run_both(exp: Experiment, low: Any, fn: Any, in_tree: Any, sh: Any) -> dict:
    """Our LocalMesh and XLA's program on the same inputs: per output the largest |difference|
    and its largest ratio to ``atol + rtol |ours|``, and the verdict of
    :func:`~partir_emu.app.experiment.verify` (rtol 1e-5, atol 1e-6, the end-to-end tests' criterion)."""
    inputs = exp.inputs(low.spmd.input_names)
    ours = LocalMesh(exp.mesh).run(low.spmd, inputs).outputs
    got = jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, inputs)))
    res = [np.asarray(x) for x in got]
    layout_ok = all(r.sharding.is_equivalent_to(jax.sharding.NamedSharding(sh.mesh, w), r.ndim)
                    for r, w in zip(got, sh.out_specs.values()))
    diffs = {}
    for name, a, b in zip(low.spmd.output_names, ours, res):
        a64, b64 = np.asarray(a, np.float64), b.astype(np.float64)
        d = np.abs(a64 - b64)
        diffs[name] = {"max_abs": float(d.max()) if d.size else 0.0,
                       "worst_ratio": float((d / (ATOL + RTOL * np.abs(a64))).max()) if d.size else 0.0}
    ver = verify(res, ours, low.spmd.output_names, rtol=RTOL, atol=ATOL)
    return {"diffs": diffs, "layout_ok": layout_ok, "outputs": len(res), "verified": ver.verified}


def main() -> int:
    req = json.load(sys.stdin)
    jax.config.update("jax_num_cpu_devices", int(req["devices"]))   # before the backend starts
    answers = []
    for case in req["cases"]:
        try:
            answers.append(compile_case(case))
        except PartirError as exc:
            answers.append({"error": str(exc)})
    json.dump({"cases": answers, "devices": len(jax.devices())}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The child process of ``partir-emu compare-xla``: XLA compiles our exported shardings.

``python -m partir_emu.app.xla.child`` reads one JSON request on stdin and writes one JSON
answer on stdout. It runs in a fresh interpreter because jax fixes its device count when its
backend starts: this process sets ``jax_num_cpu_devices`` before anything touches a device,
and the parent's jax (one CPU device, or a real accelerator) is left alone. A mesh smaller
than ``devices`` uses the first devices, so one child serves meshes of several sizes.

Request: ``{"devices": N, "cases": [{"scenario", "strategy", "mesh": "batch=2,model=2", "size",
"overrides", "seed", "run": bool, "hlo_path": str | null}]}``. For each case the step is
lowered by partir-emu, its shardings exported with :func:`partir_emu.interop.to_jax`, and
``jax.jit(step, in_shardings, out_shardings)`` compiled for the mesh's CPU devices. The answer
has both programs' collectives (:mod:`partir_emu.app.xla.hlo`) and whether the compiled
executable reports exactly the exported in/out shardings (``layout_ok``); with ``run`` also
how XLA's outputs compare with our LocalMesh's on the same inputs:

- ``elementwise``: every element within ``atol 1e-6 + rtol 1e-5 |ours|`` (``diffs`` has, per
  output, the largest difference and its largest ratio to that tolerance);
- when that fails, which rounding explains in two cases (Adam turns the rounding of a
  near-zero gradient into a full ``±lr`` step; a bfloat16 program rounds at 2⁻⁸), both runs are
  judged against the float64 reference as ``partir-emu run`` judges ours (:mod:`partir_emu.runtime.verdict`:
  within the reach of correct runs in other summation orders, element by element), with the
  references computed once per configuration: ``xla_verified``, ``ours_verified``.

``verified`` (:func:`compare_outputs`) is true when the elementwise check holds, or both runs'
verdicts do (``criterion: normwise``); outputs of other shapes fail (``criterion: shape``). The arrays
XLA returns must carry the exported shardings too (``layout_mismatches``). A PartirError is
returned as ``error`` (the parent reports it as bad input); anything else fails the process.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from partir_emu.api import lower_program
from partir_emu.app.experiment import ATOL, RTOL, Experiment
from partir_emu.app.xla.hlo import collectives, spmd_collectives
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError
from partir_emu.interop import JaxShardings, to_jax
from partir_emu.runtime.local_mesh import LocalMesh
from partir_emu.runtime.verdict import References, Verdict, compute_precision, judge_references, reduction_length

# (scenario, size, overrides, seed) -> References: the inputs depend on the configuration only, so
# every strategy and mesh of one configuration shares its references
_REFERENCES: dict[tuple[str, str, str, int], References] = {}


@dataclass(frozen=True)
class _Traced:
    """What every strategy and mesh of one configuration shares: its step, traced once here and
    once by jax (``jax.jit`` retraces only what its shardings change)."""

    step: Any
    abstract: Any                 # (params, opt, batch) as ShapeDtypeStructs
    in_tree: Any
    out_tree: Any
    in_ranks: list[int]
    out_ranks: list[int]
    program: Program


_TRACED: dict[tuple[str, str, str], _Traced] = {}


def _config_key(exp: Experiment) -> tuple[str, str, str]:
    return exp.scenario_name, exp.preset or exp.scenario.default_preset, json.dumps(exp.overrides, sort_keys=True)


def _traced(exp: Experiment) -> _Traced:
    key = _config_key(exp)
    if key not in _TRACED:
        step = exp.make_step()
        abstract = exp.scenario.abstract_inputs(exp.cfg)
        out_avals = jax.eval_shape(step, *abstract)
        _TRACED[key] = _Traced(step, abstract, jax.tree_util.tree_structure(abstract),
                               jax.tree_util.tree_structure(out_avals),
                               [len(x.shape) for x in jax.tree_util.tree_leaves(abstract)],
                               [len(x.shape) for x in jax.tree_util.tree_leaves(out_avals)], exp.program)
    return _TRACED[key]


def compile_case(case: dict) -> dict:
    """One scenario × strategy × mesh: lower, export, compile with XLA (and run both, if asked)."""
    exp = Experiment(case["scenario"], case["strategy"], Mesh.parse(case["mesh"]), case.get("size"),
                     case.get("overrides"), case.get("seed", 0))
    tr = _traced(exp)
    low = lower_program(tr.program, exp.mesh, exp.schedule, dict(exp.scenario.state_outputs))    # what exp.lower() does, traced once
    sh = to_jax(low, in_tree=tr.in_tree, out_tree=tr.out_tree)
    step, abstract = tr.step, tr.abstract
    t0 = time.perf_counter()
    compiled = sh.jit(step).lower(*abstract).compile()
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
        "layout_mismatches": _layout_mismatches(compiled, sh, tr.in_ranks, tr.out_ranks),
    }
    if case.get("run"):
        out.update(_run_both(exp, tr, low, compiled, sh))
        out["layout_mismatches"] += out.pop("array_mismatches")
    out["layout_ok"] = not out["layout_mismatches"]
    return out


def _equivalent(got: Any, sh: JaxShardings, spec: Any, ndim: int) -> bool:
    return got.is_equivalent_to(NamedSharding(sh.mesh, spec), ndim)


def _layout_mismatches(compiled: Any, sh: JaxShardings, in_ranks: Sequence[int], out_ranks: Sequence[int]) -> list[str]:
    """Inputs and outputs whose sharding in the compiled executable is not the exported one
    (``"output 'name': exported P(...), XLA P(...)"``), empty when XLA kept them all."""
    bad = []
    got_in = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    for (name, spec), got, ndim in zip(sh.in_specs.items(), got_in, in_ranks):
        if not _equivalent(got, sh, spec, ndim):
            bad.append(f"input {name!r}: exported {spec}, XLA {getattr(got, 'spec', got)}")
    got_out = jax.tree_util.tree_leaves(compiled.output_shardings)
    for (name, spec), got, ndim in zip(sh.out_specs.items(), got_out, out_ranks):
        if not _equivalent(got, sh, spec, ndim):
            bad.append(f"output {name!r}: exported {spec}, XLA {getattr(got, 'spec', got)}")
    if len(got_in) != len(sh.in_specs) or len(got_out) != len(sh.out_specs):
        bad.append(f"XLA has {len(got_in)} inputs and {len(got_out)} outputs, the export "
                   f"{len(sh.in_specs)} and {len(sh.out_specs)}")
    return bad


def _run_both(exp: Experiment, tr: _Traced, low: Any, compiled: Any, sh: JaxShardings) -> dict:
    """Our LocalMesh and XLA's executable on the same inputs (see the module docstring)."""
    names = low.spmd.output_names
    inputs = exp.inputs(low.spmd.input_names)
    ours = [np.asarray(x) for x in LocalMesh(exp.mesh).run(low.spmd, inputs).outputs]
    got = jax.tree_util.tree_leaves(compiled(*jax.tree_util.tree_unflatten(tr.in_tree, inputs)))
    res = [np.asarray(x) for x in got]
    arrays_bad = [f"output {n!r} array: exported {w}, returned {getattr(r.sharding, 'spec', r.sharding)}"
                  for n, r, w in zip(names, got, sh.out_specs.values()) if not _equivalent(r.sharding, sh, w, r.ndim)]
    out = compare_outputs(names, ours, res, lambda: _references(exp, inputs), tr.program)
    out["array_mismatches"] = arrays_bad
    return out


def _references(exp: Experiment, inputs: Sequence[np.ndarray]) -> References:
    key = (*_config_key(exp), exp.seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = exp.references(inputs)
    return _REFERENCES[key]


def compare_outputs(names: Sequence[str], ours: Sequence[np.ndarray], res: Sequence[np.ndarray],
                    references: Callable[[], References], program: Program) -> dict:
    """XLA's outputs ``res`` against ours (see the module docstring): ``verified``, ``criterion``
    (``elementwise``, ``normwise`` or ``shape``), per-output ``diffs``, and for ``normwise`` the
    verdicts. ``references()`` is called only when the elementwise check fails."""
    if len(res) != len(ours) or any(a.shape != b.shape for a, b in zip(ours, res)):
        got = [(n, list(a.shape), list(b.shape)) for n, a, b in zip(names, ours, res) if a.shape != b.shape]
        return {"diffs": {}, "outputs": len(res), "elementwise": False, "verified": False, "criterion": "shape",
                "shapes": f"{len(ours)} outputs ours, {len(res)} XLA's; (name, ours, XLA) differing: {got[:3]}"}
    diffs, elementwise = {}, True
    for name, a, b in zip(names, ours, res):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        d = np.abs(a64 - b64)
        ratio = d / (ATOL + RTOL * np.abs(a64))
        diffs[name] = {"max_abs": float(d.max()) if d.size else 0.0, "worst_ratio": float(ratio.max()) if d.size else 0.0}
        elementwise = elementwise and bool(np.allclose(b64, a64, rtol=RTOL, atol=ATOL))
    out: dict[str, Any] = {"diffs": diffs, "outputs": len(res), "elementwise": elementwise,
                           "verified": elementwise, "criterion": "elementwise"}
    if not elementwise:
        out.update(_normwise(names, ours, res, references(), program))
    return out


def _normwise(names: Sequence[str], ours: Sequence[np.ndarray], res: Sequence[np.ndarray], refs: References,
              program: Program) -> dict:
    """Both runs' verdicts against float64 (module docstring); ``normwise`` is XLA's worst output."""
    k, precision = reduction_length(program), compute_precision(program)
    xla_v = judge_references(res, refs, names, k, precision=precision)
    ours_v = judge_references(ours, refs, names, k, precision=precision)
    return {"verified": xla_v.verified and ours_v.verified, "criterion": "normwise", "normwise": _worst(xla_v),
            "xla_verified": xla_v.verified, "ours_verified": ours_v.verified,
            "xla_verdict": _worst(xla_v), "ours_verdict": _worst(ours_v)}


def _worst(v: Verdict) -> dict:
    """The verdict's worst output: name, relative error, jax.jit's own error, bound, and the failing outputs."""
    w = v.worst
    return {"verified": v.verified, "worst_output": w.name if w else "", "err": w.err if w else 0.0,
            "baseline_err": w.baseline_err if w else 0.0, "reach": w.reach if w else 0.0,
            "excess": w.excess if w else 0.0, "bound": w.bound if w else 0.0,
            "failing": [c.name for c in v.outputs if not c.ok]}


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

"""The model behind :func:`partir_emu.testing.predict`: a scenario lowered as ``partir-emu simulate``
lowers it (the same experiment, placement search, stack and model FLOPs, so a figure here is the
figure the command prints), or a user's lowered step, priced by the analytical model.

Lowering is the slow part, so lowered scenarios are kept for the process (a claims suite prices
one configuration on several chips, or checks it against a baseline and against another
configuration); every hardware spec, stack and placement is priced afresh. Loaded only when a test
predicts: the plugin itself stays light.
"""
from __future__ import annotations

import functools
from typing import Any

from partir_emu.app.claims.prediction import Prediction, as_mesh, as_overrides, count_collectives
from partir_emu.app.cli.simulate import choose_placement, model_flops_per_device
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import UsageError
from partir_emu.hwmodels.analytical import Analyzer, simulate
from partir_emu.hwmodels.compute.stack import load_stack
from partir_emu.hwmodels.machine.specs import load_spec


@functools.lru_cache(maxsize=64)
def _lowered(scenario: str, strategy: str, mesh: Mesh, size: str | None, overrides: str | None) -> tuple[Any, Any]:
    exp = Experiment(scenario, strategy, mesh, size, overrides)
    return exp, exp.lower().spmd


@functools.lru_cache(maxsize=1)
def _analyzer() -> Analyzer:
    return Analyzer()


def predict(what: Any, strategy: str | None = None, mesh: Any = None, hardware: str = "tpu-v4", *,
            size: str | None = None, set: Any = None, stack: str = "xla", placement: str | None = None,
            overlap: bool = True, label: str | None = None) -> Prediction:
    """:func:`partir_emu.testing.predict` (its docstring says what each argument is)."""
    spec = load_spec(hardware).with_stack(load_stack(stack))
    if isinstance(what, str):
        if strategy is None or mesh is None:
            raise UsageError(f"predict({what!r}): a scenario needs strategy= and mesh= (e.g. strategy='bp', "
                             f"mesh='batch=8')")
        m = as_mesh(mesh)
        exp, spmd = _lowered(what, strategy, m, size, as_overrides(set))
        model_flops = model_flops_per_device(exp)
        inputs: dict[str, Any] = {"scenario": what, "strategy": strategy, "mesh": dict(m.axes),
                                  "size": size, "set": as_overrides(set)}
        name = label or f"{what} {strategy} on {m}"
    else:
        if strategy is not None or mesh is not None or size is not None or set is not None:
            raise UsageError("predict: strategy, mesh, size and set describe a scenario; a lowered step carries "
                             "its own mesh and schedule (pass the Lowered or SpmdProgram alone)")
        spmd = getattr(what, "spmd", what)
        if not hasattr(spmd, "collectives") or not hasattr(spmd, "mesh"):
            raise UsageError(f"predict: {type(what).__name__} is neither a scenario name, a Lowered nor an "
                             f"SpmdProgram")
        model_flops = None
        inputs = {"program": f"{len(spmd.program.eqns)} equations", "mesh": dict(spmd.mesh.axes)}
        name = label or f"user step on {spmd.mesh}"
    analyzer = _analyzer()
    placed = choose_placement(spmd, spec, placement, analyzer, overlap=overlap)
    sim = simulate(spmd, spec, placed.placement, overlap=overlap, analyzer=analyzer, model_flops=model_flops)
    inputs.update(hardware=spec.name, stack=spec.stack.name, placement=sim.placement, overlap=overlap)
    return Prediction(f"{name} x {spec.name} ({spec.stack.name})", inputs, sim.step_s, sim.compute_s,
                      sim.exposed_comm_s, int(sim.peak_bytes_per_device), float(sim.needed_bytes), int(sim.hbm_bytes),
                      bool(sim.fits), float(sim.flops_per_device), count_collectives(spmd), sim)


__all__ = ["predict"]

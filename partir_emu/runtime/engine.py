"""The lockstep SPMD executor shared by the in-process mesh and the MPI mesh.

:func:`run_spmd` runs one :class:`SpmdProgram` on a set of devices hosted by
this process, equation by equation, all devices in lockstep (an env per
device, ``read``/``write``, one loop):

- a communicating collective (``all_gather``, ``all_reduce``,
  ``reduce_scatter``, ``all_to_all``) is handed to the ``collective``
  callback with every hosted device's operand; the callback owns the
  communication (in-process schedules, MPI, ...);
- the local collectives ``all_slice`` (keep block ``group_index`` of ``dim``)
  and ``to_partial`` (the value on group member 0, zeros elsewhere), and
  ``axis_index`` (this device's index along a mesh axis, int32) are evaluated
  per device without traffic, by the ``per_device`` facet of their registry entry;
- everything else runs per device through the interpreter (the ``impl`` facet).

Peak memory per device: buffers are released by the one liveness analysis
(:func:`partir_emu.core.analysis.liveness`, whose docstring states the convention), which the
memory model in ``hwmodels`` also counts by. Here the size of a value is measured as ``.nbytes``
of the numpy array actually held, so the test that holds the two equal checks real allocations
against shapes, not two copies of one rule. The peak is sampled after each equation's outputs
are allocated, while its inputs are still live.

``peak_bytes[device]`` is the largest sample.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.core.analysis import liveness
from partir_emu.core.ir import Atom, Eqn, Literal, Var
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.errors import ArgumentError
from partir_emu.primitives import get
from partir_emu.runtime.interpreter import check_inputs, coerce_result, eval_eqn, output_value

Collective = Callable[[Eqn, dict[int, np.ndarray]], dict[int, np.ndarray]]


@dataclass(frozen=True)
class EngineResult:
    outputs: dict[int, list[np.ndarray]]   # device → local program outputs
    peak_bytes: dict[int, int]             # device → peak live bytes (convention above)


def run_spmd(spmd: SpmdProgram, devices: Sequence[int], local_inputs: Mapping[int, Sequence[np.ndarray]],
             collective: Collective) -> EngineResult:
    """Run ``spmd`` in lockstep on ``devices``, from each device's local input blocks."""
    prog, mesh = spmd.program, spmd.mesh
    devices = list(devices)
    missing = [d for d in devices if d not in local_inputs]
    if missing:
        raise ArgumentError(f"no local inputs for devices {missing}")
    plan = liveness(prog)
    env: dict[int, dict[Var, np.ndarray]] = {d: {} for d in devices}
    live = dict.fromkeys(devices, 0)
    peak = dict.fromkeys(devices, 0)

    def read(d: int, a: Atom) -> Any:
        return a if isinstance(a, Literal) else env[d][a]

    def write(d: int, v: Var, x: np.ndarray) -> None:
        if v not in env[d]:
            live[d] += x.nbytes
        env[d][v] = x

    def release(d: int, vs: Sequence[Var]) -> None:
        for v in vs:
            live[d] -= env[d].pop(v).nbytes

    for d in devices:
        for v, x in zip(prog.inputs, check_inputs(prog, local_inputs[d], f"SPMD program (device {d}, local blocks)")):
            write(d, v, x)
        for v, c in prog.consts:
            write(d, v, np.asarray(c))
        peak[d] = live[d]
        release(d, plan.at_start)

    for i, eqn in enumerate(prog.eqns):
        if eqn.prim in COMM_PRIMS:
            results = collective(eqn, {d: read(d, eqn.inputs[0]) for d in devices})
            outs = {d: [coerce_result(results[d], eqn.outputs[0], eqn)] for d in devices}
        elif (entry := get(eqn.prim)) is not None and entry.per_device is not None:
            rule = entry.per_device
            outs = {d: [coerce_result(rule(*[read(d, a) for a in eqn.inputs], mesh, d, **eqn.params),
                                      eqn.outputs[0], eqn)] for d in devices}
        else:
            outs = {d: eval_eqn(eqn, [read(d, a) for a in eqn.inputs]) for d in devices}
        for d in devices:
            for v, x in zip(eqn.outputs, outs[d]):
                write(d, v, x)
            peak[d] = max(peak[d], live[d])
            release(d, plan.after[i])

    outputs = {d: [output_value(read(d, o)) for o in prog.outputs] for d in devices}
    return EngineResult(outputs, peak)

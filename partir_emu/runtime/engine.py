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
  per device without traffic;
- everything else runs per device through ``interpreter.impl_rules``.

Peak memory convention (per device; the analytical model in ``hwmodels``
computes the same number from shapes, and a test holds them byte-equal):

1. The size of a value is ``prod(local shape) * itemsize(dtype)`` — here
   measured as ``.nbytes`` of the numpy array actually held (a view counts
   at its full logical size; nothing is assumed to alias). Literals occupy
   nothing. A value is counted once however many times it is used.
2. Before equation 0, every program input and every const is live; the
   first peak sample is their sum.
3. Inputs and consts that no equation reads and that are not program outputs
   are then released (they count in that first sample only).
4. At equation ``i``: all its outputs are allocated while all its inputs are
   still live; the peak is sampled (``live`` after adding the outputs). Then
   released: each input whose last use is ``i``, and each output that no later
   equation reads; in both cases unless it is a program output.
5. Program outputs are never released. Collectives follow the same rule
   (operand and result live together; a schedule's scratch is not counted).

``peak_bytes[device]`` is the largest sample.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.errors import ArgumentError, EmulationError
from partir_emu.runtime.interpreter import check_inputs, coerce_result, eval_eqn, output_value

Collective = Callable[[Eqn, dict[int, np.ndarray]], dict[int, np.ndarray]]


@dataclass(frozen=True)
class EngineResult:
    outputs: dict[int, list[np.ndarray]]   # device → local program outputs
    peak_bytes: dict[int, int]             # device → peak live bytes (convention above)


@dataclass(frozen=True)
class ReleasePlan:
    """Which values are released when (rules 3 and 4 of the module docstring)."""

    at_start: tuple[Var, ...]
    after: tuple[tuple[Var, ...], ...]      # after[i]: released once equation i has run


def release_plan(program: Program) -> ReleasePlan:
    """When each value is released under the peak-memory convention of this module."""
    keep = {o for o in program.outputs if isinstance(o, Var)}
    last: dict[Var, int] = {}
    for i, e in enumerate(program.eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                last[a] = i
    at_start = tuple(v for v in dict.fromkeys([*program.inputs, *(v for v, _ in program.consts)])
                     if v not in last and v not in keep)
    after: list[list[Var]] = [[] for _ in program.eqns]
    for v, i in last.items():
        if v not in keep:
            after[i].append(v)
    for i, e in enumerate(program.eqns):
        after[i].extend(o for o in e.outputs if o not in last and o not in keep)
    return ReleasePlan(at_start, tuple(tuple(dict.fromkeys(a)) for a in after))


# -- per-device local primitives ------------------------------------------------------
def _all_slice(x: np.ndarray, mesh: Mesh, device: int, *, axes: Sequence[str], dim: int, **_: Any) -> np.ndarray:
    p = mesh.group_size(axes)
    n, r = divmod(x.shape[dim], p)
    if r:
        raise EmulationError(f"all_slice over {tuple(axes)} (group of {p}) of a dim of size {x.shape[dim]}: not divisible")
    i = mesh.group_index(device, axes)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(i * n, (i + 1) * n)
    return np.array(x[tuple(idx)])  # a real copy: the block is a buffer of its own


def _to_partial(x: np.ndarray, mesh: Mesh, device: int, *, axes: Sequence[str], **_: Any) -> np.ndarray:
    return x if mesh.group_index(device, axes) == 0 else np.zeros_like(x)


def _axis_index(mesh: Mesh, device: int, *, axes: Sequence[str] = (), axis: str | None = None,
                **_: Any) -> np.ndarray:
    return np.asarray(mesh.group_index(device, (axis,) if axis is not None else tuple(axes)), np.int32)


device_rules: dict[str, Callable[..., np.ndarray]] = {
    "all_slice": _all_slice,
    "to_partial": _to_partial,
    "axis_index": _axis_index,
}


def run_spmd(spmd: SpmdProgram, devices: Sequence[int], local_inputs: Mapping[int, Sequence[np.ndarray]],
             collective: Collective) -> EngineResult:
    """Run ``spmd`` in lockstep on ``devices``, from each device's local input blocks."""
    prog, mesh = spmd.program, spmd.mesh
    devices = list(devices)
    missing = [d for d in devices if d not in local_inputs]
    if missing:
        raise ArgumentError(f"no local inputs for devices {missing}")
    plan = release_plan(prog)
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
        elif eqn.prim in device_rules:
            rule = device_rules[eqn.prim]
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

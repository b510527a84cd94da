"""The lockstep SPMD executor shared by the in-process mesh and the MPI mesh.

:func:`run_spmd` runs one :class:`SpmdProgram` on a set of devices hosted by
this process, equation by equation, all devices in lockstep (an env per
device, ``read``/``write``, one loop):

- a communicating collective (``all_gather``, ``all_reduce``,
  ``reduce_scatter``, ``all_to_all``, ``collective_permute``) is handed to the ``collective``
  callback with every hosted device's operand; the callback owns the
  communication (in-process schedules, MPI, ...);
- the local collectives ``all_slice`` (keep block ``group_index`` of ``dim``)
  and ``to_partial`` (the value on group member 0, zeros elsewhere), and
  ``axis_index`` (this device's index along a mesh axis, int32) are evaluated
  per device without traffic, by the ``per_device`` facet of their registry entry;
- a ``loop`` equation (:mod:`partir_emu.core.loops`) runs its body once per iteration, every
  device in lockstep, by the same rules (a collective in the body reaches the same callback
  once per iteration); ``xs[i]`` rows are views and ``y`` rows are written into the stacked
  outputs allocated once, so a loop costs no copies beyond its results;
- everything else runs per device through the interpreter (the ``impl`` facet).

:class:`Position` says where the run is (the equation index in the innermost program and, per
enclosing loop, its equation index and iteration, and the equation and device being run); the MPI
mesh reads it to name a collective inside a loop body. An exception that leaves :func:`run_spmd`
carries a snapshot of it (:func:`partir_emu.runtime.progress.engine_spot` reads it), so a rank's
failure report names the equation, the iteration and the device without reading any frame.

Peak memory per device: buffers are released by the one liveness analysis
(:func:`partir_emu.core.analysis.liveness`, whose docstring states the convention, loops in its
rule 5), which the memory model in ``hwmodels`` also counts by. Here the size of a value is
measured as ``.nbytes`` of the numpy array actually held (a literal bound to a Var, as a literal
carry, counts its Var's size), so the test that holds the two equal checks real allocations
against shapes, not two copies of one rule. The peak is sampled after each equation's outputs
are allocated, while its inputs are still live; a loop's sample adds the largest peak of its
body over the iterations (each body run counted from its own start point).

``peak_bytes[device]`` is the largest sample.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.core.analysis import Liveness, liveness
from partir_emu.core.dtypes import np_dtype
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import LOOP, iteration_order
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.errors import ArgumentError
from partir_emu.primitives import get
from partir_emu.runtime.interpreter import (
    check_inputs,
    coerce_result,
    eval_eqn,
    loop_args,
    new_ys,
    output_value,
    put_rows,
)
from partir_emu.runtime.kernels import kernels as numerics
from partir_emu.runtime.progress import EngineSpot, mark_spot

Collective = Callable[[Eqn, dict[int, np.ndarray]], dict[int, np.ndarray]]


@dataclass(frozen=True)
class EngineResult:
    outputs: dict[int, list[np.ndarray]]   # device → local program outputs
    peak_bytes: dict[int, int]             # device → peak live bytes (convention above)


@dataclass
class Position:
    """Where a lockstep run is: ``index`` is the equation being run in the innermost program;
    ``loops`` holds, outermost first, ``(equation index, iteration)`` of each enclosing loop."""

    index: int = -1
    loops: list[tuple[int, int]] = field(default_factory=list)
    eqn: Eqn | None = None            # the equation at ``index`` (None: none yet)
    device: int | None = None         # the device it runs for, while it runs per device

    def spot(self) -> EngineSpot:
        """A snapshot (what an exception carries out of :func:`run_spmd`)."""
        if self.eqn is None:
            return EngineSpot(device=self.device)
        return EngineSpot(self.index, self.eqn, self.device, tuple(self.loops))

    @property
    def top(self) -> int:
        """The equation index in the SPMD program itself (the outermost loop's, inside a body)."""
        return self.loops[0][0] if self.loops else self.index


def run_spmd(spmd: SpmdProgram, devices: Sequence[int], local_inputs: Mapping[int, Sequence[np.ndarray]],
             collective: Collective, position: Position | None = None, *, kernels: str = "blas") -> EngineResult:
    """Run ``spmd`` in lockstep on ``devices``, from each device's local input blocks, under
    :func:`partir_emu.runtime.kernels.kernels` (``kernels``: ``"blas"`` or ``"exact"``).
    ``position`` (optional) is kept up to date while it runs (see :class:`Position`)."""
    prog = spmd.program
    devices = list(devices)
    missing = [d for d in devices if d not in local_inputs]
    if missing:
        raise ArgumentError(f"no local inputs for devices {missing}")
    args = {d: check_inputs(prog, local_inputs[d], f"SPMD program (device {d}, local blocks)") for d in devices}
    pos = position if position is not None else Position()
    pos.index, pos.eqn, pos.device = -1, None, None
    pos.loops.clear()
    run = _Lockstep(spmd.mesh, devices, collective, pos)
    try:
        with numerics(kernels):
            results, peak = run.run_block(prog, args)
    except Exception as exc:
        mark_spot(exc, pos.spot())
        raise
    outputs = {d: [output_value(x) for x in results[d]] for d in devices}
    return EngineResult(outputs, peak)


def _size(x: Any, v: Var) -> int:
    """Bytes a value takes: the array's own ``nbytes``; a literal bound to ``v`` takes ``v``'s size."""
    return v.nbytes if isinstance(x, Literal) else x.nbytes


def _array(x: Any, a: Atom) -> Any:
    """A collective's operand as an array (a literal carry or const is materialized)."""
    return np.asarray(x.value, np_dtype(a.dtype)) if isinstance(x, Literal) else x


class _Lockstep:
    """One run: the devices, the collective callback, the position, each program's liveness."""

    def __init__(self, mesh: Mesh, devices: list[int], collective: Collective, position: Position) -> None:
        self.mesh, self.devices, self.collective, self.position = mesh, devices, collective, position
        self._plans: dict[int, tuple[Program, Liveness]] = {}

    def plan(self, program: Program) -> Liveness:
        got = self._plans.get(id(program))
        if got is None or got[0] is not program:
            got = self._plans[id(program)] = (program, liveness(program))
        return got[1]

    def run_block(self, program: Program, args: Mapping[int, Sequence[Any]]) -> tuple[dict[int, list], dict[int, int]]:
        """Run ``program`` on every device from ``args`` (its inputs per device): its results and
        its peak live bytes per device, counted from its own start point."""
        devices, pos = self.devices, self.position
        plan = self.plan(program)
        env: dict[int, dict[Var, Any]] = {d: {} for d in devices}
        live = dict.fromkeys(devices, 0)

        def read(d: int, a: Atom) -> Any:
            return a if isinstance(a, Literal) else env[d][a]

        def write(d: int, v: Var, x: Any) -> None:
            if v not in env[d]:
                live[d] += _size(x, v)
            env[d][v] = x

        def release(d: int, vs: Sequence[Var]) -> None:
            for v in vs:
                live[d] -= _size(env[d].pop(v), v)

        for d in devices:
            for v, x in zip(program.inputs, args[d]):
                write(d, v, x)
            for v, c in program.consts:
                write(d, v, np.asarray(c))
        peak = dict(live)
        for d in devices:
            release(d, plan.at_start)

        for i, eqn in enumerate(program.eqns):
            pos.index, pos.eqn = i, eqn
            extra: Mapping[int, int] | None = None
            if eqn.prim == LOOP:
                outs, extra = self._run_loop(i, eqn, {d: [read(d, a) for a in eqn.inputs] for d in devices})
                pos.index, pos.eqn = i, eqn
            else:
                outs = self._run_eqn(eqn, read)
            for d in devices:
                for v, x in zip(eqn.outputs, outs[d]):
                    write(d, v, x)
                peak[d] = max(peak[d], live[d] + (extra[d] if extra else 0))
                release(d, plan.after[i])
        return {d: [read(d, o) for o in program.outputs] for d in devices}, peak

    def _run_eqn(self, eqn: Eqn, read: Callable[[int, Atom], Any]) -> dict[int, list]:
        """One equation that is not a loop, on every device."""
        devices = self.devices
        if eqn.prim in COMM_PRIMS:
            a = eqn.inputs[0]
            results = self.collective(eqn, {d: _array(read(d, a), a) for d in devices})
            return {d: [coerce_result(results[d], eqn.outputs[0], eqn)] for d in devices}
        entry = get(eqn.prim)
        pos = self.position
        out: dict[int, list] = {}
        if entry is not None and entry.per_device is not None:
            rule, mesh = entry.per_device, self.mesh
            for d in devices:
                pos.device = d
                out[d] = [coerce_result(rule(*[read(d, a) for a in eqn.inputs], mesh, d, **eqn.params),
                                        eqn.outputs[0], eqn)]
        else:
            for d in devices:
                pos.device = d
                out[d] = eval_eqn(eqn, [read(d, a) for a in eqn.inputs])
        pos.device = None
        return out

    def _run_loop(self, i: int, eqn: Eqn, operands: Mapping[int, list]) -> tuple[dict[int, list], dict[int, int]]:
        """A loop equation at index ``i``: its results per device, and per device the largest peak
        of one body run (rule 5 of :mod:`partir_emu.core.analysis`; 0 if it never runs)."""
        devices, loops = self.devices, self.position.loops
        body, nk = eqn.params["body"], int(eqn.params["num_carry"])
        split = {d: loop_args(eqn, operands[d]) for d in devices}
        carry = {d: split[d][1] for d in devices}
        ys = {d: new_ys(eqn) for d in devices}
        body_peak = dict.fromkeys(devices, 0)
        loops.append((i, -1))
        for it in iteration_order(eqn):
            loops[-1] = (i, it)
            args = {d: [*split[d][0], *carry[d], *(x[it] for x in split[d][2])] for d in devices}
            outs, peak = self.run_block(body, args)
            for d in devices:
                carry[d] = outs[d][:nk]
                put_rows(ys[d], it, outs[d][nk:])
                body_peak[d] = max(body_peak[d], peak[d])
        loops.pop()
        return {d: [*carry[d], *ys[d]] for d in devices}, body_peak

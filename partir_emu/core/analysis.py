"""Analyses over a :class:`Program`, each written once and shared by every pass that needs it.

- :func:`liveness`: when each value dies. The runtime releases buffers by it
  (``runtime/engine``) and the memory model counts bytes by it
  (``hwmodels/memory``), so both follow one convention:

  1. Every :class:`Var` is its own buffer (no aliasing); a Var used several times
     (``mul x x``, an input listed twice) is one buffer. Literals take no memory.
  2. At the start point the program inputs and constants are live.
  3. An input or constant that no equation reads and that is not a program output
     is released right after the start point.
  4. While equation ``i`` runs its inputs and outputs are all live; right after it,
     each input whose last use is ``i`` is released, and each output that no later
     equation reads; program outputs are never released.
  5. A ``loop`` equation (:mod:`partir_emu.core.loops`) is an equation as in rule 4 (its operands
     and all its results, the stacked ``ys`` whole, live while it runs); on top of that sample
     comes the peak of its body by these same rules, the body's inputs (the iteration's consts,
     carry and x rows) being live at the body's start point as its own buffers. One iteration's
     body values are all released before the next starts, so the loop's peak is that one sum.
     Precisely: the body's peak includes its start point; a body input counts its Var's size
     even where the loop passes a literal (a literal carry or const); a loop of ``length`` 0
     runs no body, so its sample is rule 4's alone.

- :func:`dependencies`: the producer equations of each equation's operands (the
  analytical overlap schedule and the DES op streams wait on them).
- :func:`dead_code_elimination`: drop the equations nothing reads.

Users and producers per value are :meth:`Program.users` and :meth:`Program.producers`
(kept on the Program, which computes each map once).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.core.ir import Atom, Eqn, Program, Var


@dataclass(frozen=True)
class Liveness:
    """When each value of a program is released (rules 3 and 4 of the module docstring)."""

    initial: tuple[Var, ...]               # inputs then constants, each once: live at the start point
    last_use: Mapping[int, int]            # Var.id -> last equation reading it (len(eqns): a program output)
    at_start: tuple[Var, ...]              # released right after the start point
    after: tuple[Sequence[Var], ...]       # after[i]: released right after equation i (read only)


def liveness(program: Program) -> Liveness:
    """The :class:`Liveness` of ``program``: one pass to find last uses, one to list dead outputs."""
    eqns = program.eqns
    end = len(eqns)
    last: dict[int, int] = {}
    var: dict[int, Var] = {}
    for i, e in enumerate(eqns):
        for a in e.inputs:
            if type(a) is Var:
                last[a.id] = i
                var[a.id] = a
    for o in program.outputs:
        if type(o) is Var:
            last[o.id] = end
    initial = tuple({v.id: v for v in (*program.inputs, *(v for v, _ in program.consts))}.values())
    at_start = tuple(v for v in initial if v.id not in last)
    # a list only where something is released, built in place: this is on the analytical model's cold path
    after: list = [()] * end
    for vid, i in last.items():
        if i != end:
            g = after[i]
            if g:
                g.append(var[vid])
            else:
                after[i] = [var[vid]]
    for i, e in enumerate(eqns):
        for o in e.outputs:
            if o.id not in last:
                after[i] = [*after[i], o]
    return Liveness(initial, last, at_start, tuple(after))


def dependencies(program: Program) -> tuple[tuple[int, ...], ...]:
    """Per equation, the equations producing its operands, in operand order (an operand that is a
    program input, a constant or a literal has none). Keyed by Var id, not by Var as
    :meth:`Program.producers` is: a Var hashes in Python, and this runs on every DES or overlap run."""
    producer: dict[int, int] = {}
    out = []
    for i, e in enumerate(program.eqns):
        out.append(tuple([producer[a.id] for a in e.inputs if type(a) is Var and a.id in producer]))
        for o in e.outputs:
            producer[o.id] = i
    return tuple(out)


def dead_code_elimination(eqns: Sequence[Eqn], consts: Iterable[tuple[Var, np.ndarray]],
                          outputs: Iterable[Atom]) -> tuple[list[Eqn], list[tuple[Var, np.ndarray]]]:
    """The equations and constants that the ``outputs`` need, in their order (every supported
    primitive is pure). jax's backward pass leaves values nothing reads (e.g. the zeros cotangent
    of a masked ``where``): lowered unsharded they would distort memory and time at full size."""
    live = {o for o in outputs if isinstance(o, Var)}
    kept = []
    for e in reversed(eqns):
        if any(o in live for o in e.outputs):
            kept.append(e)
            live.update(a for a in e.inputs if isinstance(a, Var))
    kept.reverse()
    return kept, [(v, c) for v, c in consts if v in live]

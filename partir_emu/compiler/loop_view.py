"""Loops as the partitioner sees them: every body once, linked to its loop by identity equations.

A ``loop`` equation (:mod:`partir_emu.core.loops`) is partitioned without unrolling. Before any
tactic, :func:`flatten` replaces each loop by its body's equations, once, framed by *link*
equations that say how the body's values relate to the loop's operands and results:

``loop_enter``  body const input  = const operand                (same tiling, dim for dim)
``loop_carry``  body carry input  = carry init  =  body carry output   (all three tiled alike)
``loop_row``    body x row        = xs operand without its leading dim (the iteration dim, blocked)
``loop_exit``   carry result      = body carry output
``loop_stack``  ys result         = body y rows with a leading iteration dim (blocked)

Propagation (:mod:`.propagate`) runs on this flat program unchanged: the link equations are
ordinary equations with factor rules, so a tiling reaches the body from the loop's operands
(stacked per-layer weights give their per-iteration tiling to the body's row), leaves it through
the results, and goes round the carry: ``loop_carry`` ties the carry's input and output, so the
carry's tiling is a fixed point of propagating through the body (the worklist revisits until
nothing changes; where the body disagrees the usual conflict is recorded and the lowering
reshards the carry at the end of the body). The iteration dim is blocked, so a stacked value is
never tiled on it.

The lowering (:mod:`partir_emu.compiler.lowering.lower`) turns each :class:`Region` back into one ``loop`` equation whose
body is the body's equations lowered once; the link equations themselves are never lowered.
Their rules never make a pending sum pass through (``linear=False``): a loop's operands and a
body's outputs are always whole values.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.loops import LOOP, parts

ENTER, CARRY, ROW, EXIT, STACK = "loop_enter", "loop_carry", "loop_row", "loop_exit", "loop_stack"
LINK_PRIMS = frozenset({ENTER, CARRY, ROW, EXIT, STACK})


@dataclass(frozen=True)
class Region:
    """Where one loop's link and body equations sit in the flat program (indices into its eqns)."""

    loop: Eqn            # the loop equation of the traced program
    start: int           # first entering link
    body_start: int      # first body equation
    body_end: int        # one past the last body equation (first exiting link)
    end: int             # one past the last exiting link


def flatten(program: Program) -> tuple[Program, Mapping[int, Region]]:
    """The flat program (bodies inlined once between link equations) and its loop regions,
    keyed by their ``start``; ``program`` itself (no copy) when it has no loops."""
    if not any(e.prim == LOOP for e in program.eqns):
        return program, {}
    eqns: list[Eqn] = []
    consts: list[tuple[Var, np.ndarray]] = list(program.consts)
    regions: dict[int, Region] = {}
    _emit(program.eqns, eqns, consts, regions)
    flat = Program(program.inputs, program.input_names, tuple(eqns), program.outputs, program.output_names,
                   tuple(consts))
    return flat, regions


def _emit(src: tuple[Eqn, ...], eqns: list[Eqn], consts: list, regions: dict[int, Region]) -> None:
    for e in src:
        if e.prim != LOOP:
            eqns.append(e)
            continue
        lp = parts(e)
        body, nc, nk = lp.body, len(lp.consts), len(lp.carry)
        start = len(eqns)
        for a, bv in zip(lp.consts, body.inputs):
            eqns.append(Eqn(ENTER, (a,), (bv,), {}, e.source))
        for k, (a, bv) in enumerate(zip(lp.carry, body.inputs[nc:])):
            eqns.append(Eqn(CARRY, (a, body.outputs[k]), (bv,), {}, e.source))
        for x, bv in zip(lp.xs, body.inputs[nc + nk:]):
            eqns.append(Eqn(ROW, (x,), (bv,), {}, e.source))
        consts.extend(body.consts)
        body_start = len(eqns)
        _emit(body.eqns, eqns, consts, regions)
        body_end = len(eqns)
        for k, o in enumerate(lp.carry_out):
            eqns.append(Eqn(EXIT, (body.outputs[k],), (o,), {}, e.source))
        for y, o in zip(body.outputs[nk:], lp.ys):
            eqns.append(Eqn(STACK, (y,), (o,), {}, e.source))
        regions[start] = Region(e, start, body_start, body_end, len(eqns))


def link_rule(e: Eqn) -> FactorRule:
    """The factor rule of a link equation (see the module docstring)."""
    b = RuleBuilder()
    out = e.outputs[0]
    if e.prim in (ENTER, EXIT, CARRY):
        dims = b.fresh_dims(out.shape)
        ops = [dims if isinstance(a, Var) else () for a in e.inputs]
        return b.rule(ops, [dims])
    if e.prim == ROW:
        it = b.new(e.inputs[0].shape[0], blocked=True)
        dims = b.fresh_dims(out.shape)
        return b.rule([((it,), *dims)], [dims])
    assert e.prim == STACK, e.prim
    it = b.new(out.shape[0], blocked=True)
    dims = b.fresh_dims(out.shape[1:])
    return b.rule([dims if isinstance(e.inputs[0], Var) else ()], [((it,), *dims)])


__all__ = ["LINK_PRIMS", "Region", "flatten", "link_rule"]

"""Collectives over positional axes: what ``jax.vmap(f, axis_name=...)`` leaves of ``lax.psum``,
``pmean``, ``pmax`` and ``pmin`` in ``f`` (Equinox's ``BatchNorm(axis_name=...)``, any per-example
code that reduces over its vmapped batch by name).

vmap's batching rule writes such a collective as the same primitive over the batch dim's position
(``psum[axes=(0,)]``), and its transpose as one over no axes at all (``psum[axes=()]``). Outside a
mapped context (no ``shard_map``, no ``pmap``), which is all jax can trace these from, that is a
plain reduction: ``reduce_sum``/``reduce_max``/``reduce_min`` over those dims, and the identity
when there are none. A collective over a *named* axis is shard_map's or pmap's: partir_emu
partitions the unmapped step itself, so that one stays unsupported, and is named as such.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partir_emu.core.ir import Eqn, Literal, Var

Atom = Var | Literal

REDUCTIONS = {"psum": "reduce_sum", "pmax": "reduce_max", "pmin": "reduce_min"}


def named_axes(e: Any) -> str:
    """``""`` if collective ``e`` reduces over positional axes only (and all its devices), else the
    reason it cannot be traced, for the unsupported report."""
    named = [a for a in e.params.get("axes", ()) if not isinstance(a, int)]
    if named:
        return (f"{e.primitive.name} over the named axis {', '.join(map(repr, named))} (a collective of "
                "shard_map or pmap: give partir_emu the step without the mapping, it partitions it itself)")
    if e.params.get("axis_index_groups") is not None:
        return f"{e.primitive.name} with axis_index_groups"
    return ""


def positional_reduction(b: Any, e: Any, ins: Sequence[Atom], where: str, kernel: str) -> list[Atom]:
    """The outputs of ``e`` (a psum/pmax/pmin over positional axes, one output per operand): each
    operand reduced over those dims, or the operand itself when there are none."""
    axes = tuple(sorted(int(a) for a in e.params["axes"]))
    if not axes:
        return list(ins)
    outs: list[Atom] = []
    for x, ov in zip(ins, e.outvars):
        out = b.new_var(ov.aval)
        b.eqns.append(Eqn(REDUCTIONS[e.primitive.name], (x,), (out,), {"axes": axes}, where, kernel))
        outs.append(out)
    return outs


__all__ = ["REDUCTIONS", "named_axes", "positional_reduction"]

"""All-reduce code motion out of a loop: a loop-carried sum is reduced once, after the loop.

Gradient accumulation (``microbatches=K``) lowers, under data parallelism, to a body that
all-reduces each micro-batch's gradients and adds them to the carried sum::

    loop:  g = ...;  c = all_reduce[axes](g);  acc = acc + c

(``add``, or ``add_any``: jax's transpose of a loop accumulates the cotangent of each loop constant,
a scan's per-layer weights say, in the carry this way: a pipeline's stage weights every tick).

A sum of all-reduces is the all-reduce of the sum, so the body can add the device's own partial
gradient and the loop reduce once: ``acc`` is carried as a pending sum over ``axes`` (before the
loop the initial value is put on group member 0, zeros elsewhere: ``to_partial``) and one
``all_reduce`` follows the loop. This is what DDP's ``no_sync``, Megatron-LM's gradient accumulation
and XLA's ``WhileLoopAllReduceCodeMotion`` pass do; it moves K all-reduces to one, and the
accumulator keeps its size (the all-reduce's input and output have the same local shape).

A **reduce-scatter** into a sharded accumulator (ZeRO/FSDP) is not moved: carrying the pending sum
would keep the whole gradient on every device, the memory ZeRO exists to save (PyTorch FSDP reduces
each micro-batch without ``no_sync``; XLA's pass moves a reduce-scatter only when asked).

The same holds for a **scatter-add** into the carry, ``acc = scatter_add(acc, idx, c)``: an interleaved
(circular) pipeline's stage weights are stacked per virtual stage and each tick's gradient is added to
the row its index picks (jax's transpose of the dynamic row lookup). For a fixed index a scatter-add
is linear in the accumulator and the updates together, so the sum over the group commutes with it
provided every member of the group adds at the same index: the index must be *uniform over the
all-reduce's axes*, which the caller proves from layouts (a literal, a body input whose layout is
neither tiled nor pending over those axes, or a value the body computes from such values alone).
Without the rewrite, a circular pipeline all-reduced every layer's gradient on every tick
(measured: 13 all-reduces over ``batch`` in the tiny test pipeline's backward loop instead of 1).

The rule is the patterns above and nothing looser: the carry-in is read by that one ``add`` (or
``scatter-add``, as its operand) only and is not itself a body output, the ``all_reduce`` (op sum) is
read by that equation only (as a summand, or the scatter's updates), and the sum is read by nothing in
the body (it is the carry-out). Anything else keeps its per-iteration reduction.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from partir_emu.core.ir import Atom, Program, Var

ACCUMULATES = ("add", "add_any")


@dataclass(frozen=True)
class Sunk:
    """Carry ``k`` (index among the carries) accumulates a sum whose ``all_reduce`` over ``axes``
    moved out of the body."""

    k: int
    axes: tuple[str, ...]


def sink_all_reduces(body: Program, nc: int, nk: int, eligible: frozenset[int],
                     uniform: Callable[[Atom, tuple[str, ...]], bool] = lambda a, axes: False,
                     ) -> tuple[Program, tuple[Sunk, ...]]:
    """Rewrite the local loop ``body`` (``nc`` consts, ``nk`` carries) so each carry of ``eligible``
    that matches the module's pattern adds its partial value; returns the new body and the carries
    moved, whose reduction the caller emits after the loop (and whose operand it makes partial).
    ``uniform(a, axes)``: whether body value ``a`` is the same on every member of a group over
    ``axes`` (a scatter-add's index must be; the default proves nothing, so scatter-adds stay)."""
    users, prod = body.users(), body.producers()
    outputs = [o for o in body.outputs if isinstance(o, Var)]
    eqns = list(body.eqns)
    dead: set[int] = set()
    sunk: list[Sunk] = []
    for k in sorted(eligible):
        c, out = body.inputs[nc + k], body.outputs[k]
        if not isinstance(out, Var) or out not in prod or outputs.count(out) != 1 or c in outputs:
            continue
        i = prod[out]
        e = eqns[i]
        if users.get(c) != [i] or users.get(out):
            continue
        if e.prim in ACCUMULATES and len(e.inputs) == 2:
            other = e.inputs[1] if e.inputs[0] == c else e.inputs[0] if e.inputs[1] == c else None
        elif e.prim == "scatter-add" and len(e.inputs) == 3 and e.inputs[0] == c and c not in e.inputs[1:]:
            other = e.inputs[2]
        else:
            continue
        if not isinstance(other, Var) or other == c or other not in prod or users.get(other) != [i]:
            continue
        j = prod[other]
        ar = eqns[j]
        if ar.prim != "all_reduce" or ar.params.get("op", "sum") != "sum" or j in dead:
            continue
        if e.prim == "scatter-add" and not uniform(e.inputs[1], tuple(ar.params["axes"])):
            continue
        x = ar.inputs[0]
        if not isinstance(x, Var) or x.shape != other.shape or x.dtype != other.dtype:
            continue
        eqns[i] = replace(e, inputs=tuple(x if a == other else a for a in e.inputs))
        dead.add(j)
        sunk.append(Sunk(k, tuple(ar.params["axes"])))
    if not sunk:
        return body, ()
    kept = tuple(e for n, e in enumerate(eqns) if n not in dead)
    return replace(body, eqns=kept), tuple(sunk)


__all__ = ["ACCUMULATES", "Sunk", "sink_all_reduces"]

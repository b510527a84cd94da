"""Lowering a loop region (:mod:`partir_emu.compiler.loop_view`) back into one ``loop`` equation, its body lowered once.

The body's layout is what propagation decided for the body's own input values: each const and
carry input keeps its tiling in every iteration, each x row the tiling of its body value (the
stacked operand is the same tiling with an untiled iteration dim in front), and each y row the
tiling its stacked result has under the iteration dim. So:

1. before the loop, each operand is resharded to the layout its body input has (a stacked weight
   tiled by ZeRO-3 or Megatron stays tiled; the body gathers its row when it needs it, once per
   iteration, and frees it again);
2. the body's equations are lowered into a list of their own, which becomes the loop's body
   program (its constants stay with it);
3. at the end of the body each carry output is resharded to the carry input's layout (a no-op when
   propagation reached its fixed point without conflict), a pending sum resolved there, and each y
   row to its stacked layout, its pending sum resolved too (each layer's weight gradient of a scan
   over layers all-reduced in the body, where it overlaps the layers still to come, as the unrolled
   model's do), but in a loop that is itself in a loop's body: there the stacked result keeps the
   rows' pending sum (``sum``; stacking is linear), so that the enclosing loop can accumulate it
   as one (step 4): a scan over layers inside gradient accumulation or a pipeline's ticks reduces
   its weight gradients once a step, not once a layer, micro-batch and tick;
4. an all-reduce whose result is only accumulated into a carry moves out of the body
   (:mod:`.sink`): the carry enters as a pending sum and is all-reduced once after the loop;
5. the loop's results take those layouts; readers after the loop reshard from them as from any
   equation's result.

A narrowing cast of a gathered value in the body is moved before its gather there too
(:func:`.rematerialise_gathers.cast_before_gather`), so a bf16 body gathers bf16 rows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from partir_emu.compiler.loop_view import Region
from partir_emu.compiler.lowering.gathers import body_clusters, cast_before_gather, rematerialise_gathers
from partir_emu.compiler.lowering.sink import sink_all_reduces
from partir_emu.compiler.state import ShardingState
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import loop_eqn, parts
from partir_emu.core.mesh import Mesh
from partir_emu.core.registry import get as get_primitive
from partir_emu.core.sharding import Sharding


class LoopLowerer(Protocol):
    """What :func:`lower_loop` needs of the lowering that calls it (:class:`.lower.Lowerer`): its
    state, where it is, the per-value layouts and local values it keeps, and the ranges it lowers."""

    state: ShardingState
    mesh: Mesh
    at: int
    eqns: list[Eqn]
    origin: list[int]
    actual: dict[Var, Sharding]
    local: dict[Var, Var]
    primal_cone: frozenset[int]
    loop_depth: int

    def new_var(self, shape: Any, dtype: Any) -> Var: ...
    def emit(self, prim: str, ins: Any, out_shape: Any, dtype: Any, params: Any, source: str = "") -> Var: ...
    def append(self, e: Eqn) -> None: ...
    def reshard(self, v: Var, target: Sharding, why: str) -> Var: ...
    def lower_range(self, start: int, end: int) -> None: ...


def _to(lw: LoopLowerer, a: Atom, target: Sharding, why: str) -> Atom:
    return a if isinstance(a, Literal) else lw.reshard(a, target, why)


def _stacked_row(lw: LoopLowerer, o: Atom, row: Sharding) -> Sharding:
    """The layout a y row of a loop nested in another loop's body leaves the body in: ``row``, keeping
    the row's pending sum when it has one (see step 3 of the module docstring)."""
    if not isinstance(o, Var) or not lw.loop_depth:
        return row
    have = lw.actual[o]
    if have.partial and have.partial_op == "sum" and not set(have.partial) & set(row.axes()):
        return row.with_partial(have.partial)
    return row


def _uniform_in(body: Program, rows: list[Sharding]) -> Callable[[Atom, tuple[str, ...]], bool]:
    """Whether a value of the local ``body`` is the same on every device of a group over ``axes``: a
    literal or body constant; a body input whose layout (``rows``) is neither tiled nor pending over
    ``axes`` (the devices of such a group hold the same block); or a value the body computes from
    such values alone by an equation that is not device dependent (no ``axis_index``-like per-device
    primitive, no collective). Used to prove a scatter-add's index the same on every device whose
    sum :func:`.sink.sink_all_reduces` moves after the loop."""
    layout = dict(zip(body.inputs, rows))
    consts = {v for v, _ in body.consts}
    prod = body.producers()

    def uniform(a: Atom, axes: tuple[str, ...]) -> bool:
        memo: dict[Var, bool] = {}

        def go(v: Atom) -> bool:
            if not isinstance(v, Var) or v in consts:
                return True
            if v in memo:
                return memo[v]
            if v in layout:
                s = layout[v]
                ok = not (set(s.axes()) | set(s.partial)) & set(axes)
            elif v in prod:
                e = body.eqns[prod[v]]
                p = get_primitive(e.prim)
                ok = (p is not None and p.per_device is None and not p.communicates and e.prim != "loop"
                      and all(go(x) for x in e.inputs))
            else:
                ok = False
            memo[v] = ok
            return ok
        return go(a)
    return uniform


def lower_loop(lw: LoopLowerer, r: Region) -> None:
    """Emit region ``r`` as one loop equation on ``lw`` (see the module docstring)."""
    st, mesh = lw.state, lw.mesh
    lp = parts(r.loop)
    body, nc, nk = lp.body, len(lp.consts), len(lp.carry)
    where = f"loop at {r.loop.source or '?'}"
    lw.at = r.start
    # 1. the body's input layouts, and the operands moved to them
    rows = [Sharding(tuple(st.value_dims[bv])) for bv in body.inputs]
    operands: list[Atom] = []
    for k, (a, s) in enumerate(zip((*lp.consts, *lp.carry), rows)):
        operands.append(_to(lw, a, s, f"operand {k} of {where}"))
    for j, (x, s) in enumerate(zip(lp.xs, rows[nc + nk:])):
        operands.append(_to(lw, x, Sharding(((), *s.dims)), f"stacked operand {j} of {where}"))
    # 2. the body, lowered once into its own list
    saved = lw.eqns, lw.origin
    lw.eqns, lw.origin = [], []
    body_ins = []
    for bv, s in zip(body.inputs, rows):
        lv = lw.new_var(s.local_shape(bv.shape, mesh), bv.dtype)
        lw.actual[bv], lw.local[bv] = s, lv
        body_ins.append(lv)
    for v, _ in body.consts:
        lw.actual[v], lw.local[v] = Sharding.replicated(v.ndim), v
    lw.loop_depth += 1
    lw.lower_range(r.body_start, r.body_end)
    lw.loop_depth -= 1
    # 3. the body's outputs in the loop's layouts
    lw.at = r.body_end
    outs: list[Atom] = [_to(lw, o, rows[nc + k], f"carry {k} of {where}") for k, o in enumerate(body.outputs[:nk])]
    y_rows = [_stacked_row(lw, o, Sharding(tuple(st.value_dims[y])[1:])) for o, y in zip(body.outputs[nk:], lp.ys)]
    outs += [_to(lw, o, s, f"row of result {j} of {where}") for j, (o, s) in enumerate(zip(body.outputs[nk:], y_rows))]
    body_eqns, body_origin = lw.eqns, lw.origin
    lw.eqns, lw.origin = saved
    local_body = Program(tuple(body_ins), body.input_names, tuple(body_eqns), tuple(outs), body.output_names,
                         body.consts)
    local_body, moved = cast_before_gather(local_body)
    origin = [body_origin[j] for j in moved]
    clusters = body_clusters(local_body, origin, lw.primal_cone)
    if clusters is not None:      # forward and backward in one iteration: each pass gathers its own
        local_body = rematerialise_gathers(local_body, clusters)
    # 4. an accumulated all-reduce moves out of the loop (:mod:`.sink`): its carry enters as a
    # pending sum, and the loop's result is reduced once
    lw.at = r.start
    local_body, sunk = sink_all_reduces(local_body, nc, nk, frozenset(
        k for k in range(nk) if isinstance(operands[nc + k], Var)), _uniform_in(local_body, rows))
    for m in sunk:
        op = operands[nc + m.k]
        pending = _sunk_sum(lw, op, m.axes)
        operands[nc + m.k] = pending if pending is not None else \
            lw.emit("to_partial", [op], op.shape, op.dtype, {"axes": m.axes}, f"carry {m.k} of {where}, reduced after the loop")
    # 5. the loop equation and its results' layouts
    results: list[Var] = []
    for v, s in zip((*lp.carry_out, *lp.ys), (*rows[nc:nc + nk], *(Sharding(((), *s.dims), s.partial) for s in y_rows))):
        lv = lw.new_var(s.local_shape(v.shape, mesh), v.dtype)
        lw.actual[v], lw.local[v] = s, lv
        results.append(lv)
    loop_out = list(results)
    for m in sunk:
        loop_out[m.k] = lw.new_var(results[m.k].shape, results[m.k].dtype)
    lw.append(loop_eqn(operands[:nc], operands[nc:nc + nk], operands[nc + nk:], loop_out[:nk], loop_out[nk:],
                       local_body, lp.length, lp.reverse, r.loop.source, r.loop.kernel))
    for m in sunk:
        lw.append(Eqn("all_reduce", (loop_out[m.k],), (results[m.k],), {"axes": m.axes, "op": "sum"},
                      f"carry {m.k} of {where}, {_REDUCED_AFTER}"))


_REDUCED_AFTER = "reduced once after the loop"


def _sunk_sum(lw: LoopLowerer, op: Atom, axes: tuple[str, ...]) -> Atom | None:
    """The pending sum behind ``op`` when ``op`` is the all-reduce over ``axes`` that an earlier loop's
    sunk carry was reduced by: the next loop carries that pending sum on (the loops of a 1F1B step,
    ``scenarios/transformer/pipeline_1f1b.py``, accumulate the same weight gradients in turn), so the
    gradients are reduced once after the last loop, not once after each. The earlier all-reduce stays
    for any other reader; :func:`drop_unread_reductions` removes it when there is none."""
    for e in reversed(lw.eqns):
        if op in e.outputs:
            if e.prim == "all_reduce" and e.params == {"axes": axes, "op": "sum"} and _REDUCED_AFTER in e.source:
                return e.inputs[0]
            return None
    return None


def drop_unread_reductions(program: Program) -> Program:
    """``program`` without the after-loop all-reduces (:func:`_sunk_sum`) whose result nothing reads."""
    read = {a for e in program.eqns for a in e.inputs} | set(program.outputs)
    eqns = tuple(e for e in program.eqns if not (e.prim == "all_reduce" and _REDUCED_AFTER in e.source
                                                 and e.outputs[0] not in read))
    return program if len(eqns) == len(program.eqns) else replace(program, eqns=eqns)


__all__ = ["LoopLowerer", "drop_unread_reductions", "lower_loop"]

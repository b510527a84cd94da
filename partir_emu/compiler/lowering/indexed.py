"""Row lookups into a tiled dim: the masked local gather and scatter of a vocab-parallel embedding.

When the indexed dim of a row lookup (:func:`partir_emu.primitives.indexing.looked_up_dim`: one
index per position into a dim whose one-element slice is dropped, ``table[tokens]`` and its
scatter-add gradient) is tiled by mesh axes, device ``j`` of the group holds rows
``[j·b, (j+1)·b)`` of the table (``b`` the local size). The lowering then emits, instead of
gathering the table (Megatron's vocab-parallel embedding):

1. the global index clamped as the primitive's mode clamps it (``CLIP`` and, for a gather,
   ``PROMISE_IN_BOUNDS``, which XLA clamps too), so that every device agrees on which row is meant;
2. ``index - j·b`` (``axis_index`` over the tiling axes, times ``b``);
3. the local gather or scatter with mode ``FILL_OR_DROP``: a gather yields zeros for a row this
   device does not hold (``fill_value`` 0), so the result is the pending sum the rule declared,
   resolved by one all_reduce of the looked-up rows ([B, S, D], never [V, D]); a scatter drops the
   updates that land outside the block, so the result is the tiled table, with no collective.

``FILL_OR_DROP`` gathers keep the dim blocked (their fill value for an out-of-range index is not
a sum of zeros), and a scatter that drops out-of-range updates needs no clamp.
"""
from __future__ import annotations

from typing import Any

from partir_emu.core.ir import Atom, Eqn, Literal, Var
from partir_emu.primitives import localize_params
from partir_emu.primitives.indexing import looked_up_dim

_LOOKUPS = ("gather", "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max")


def lower_indexed(lw: Any, i: int, e: Eqn, ins: list[Atom], outs: list[Var]) -> bool | None:
    """Lower global equation ``i`` (``e``, local operands ``ins``, results ``outs``) as a masked local
    lookup when its looked-up dim is tiled (see the module docstring); None otherwise."""
    if e.prim not in _LOOKUPS:
        return None
    d = looked_up_dim(e)
    if d is None:
        return None
    (f,) = lw.state.rules[i].operands[0][d]
    axes = lw.state.eqn_factors[i].get(f, ())
    if not axes:
        return None
    idx = ins[1]
    assert isinstance(idx, Var)
    dt, src = idx.dtype, f"masked lookup of {e.prim} at {e.source}"
    mode = str(e.params.get("mode"))
    gather = e.prim == "gather"
    if "CLIP" in mode or (gather and "FILL_OR_DROP" not in mode):
        top = e.inputs[0].shape[d] - 1
        idx = lw.emit("clamp", [Literal(0, dt), idx, Literal(top, dt)], idx.shape, dt, {}, src)
    pos = lw.emit("axis_index", [], (), "int32", {"axes": tuple(axes)}, src)
    start = lw.emit("mul", [pos, Literal(ins[0].shape[d], "int32")], (), "int32", {}, src)
    if dt != "int32":
        start = lw.emit("convert_element_type", [start], (), dt, {"new_dtype": dt}, src)
    start = lw.emit("broadcast_in_dim", [start], idx.shape, dt, {"shape": idx.shape, "broadcast_dimensions": ()}, src)
    local_idx = lw.emit("sub", [idx, start], idx.shape, dt, {}, src)
    new_ins = [ins[0], local_idx, *ins[2:]]
    params = localize_params(e, new_ins, outs)
    params["mode"] = "FILL_OR_DROP"
    if gather:
        params["fill_value"] = False if e.outputs[0].dtype == "bool" else 0
    lw.append(Eqn(e.prim, tuple(new_ins), tuple(outs), params, e.source, e.kernel))
    return True


__all__ = ["lower_indexed"]

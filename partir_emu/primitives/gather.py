"""gather and scatter-add as an embedding lookup and its gradient use them.

gather: the index batch dims are shared with the result's batch dims; operand
dims taken whole (slice size = dim size) are shared with the result's offset
dims; indexed dims are blocked. scatter-add: the update's scatter dims are
*reduction* factors (each device adds its own updates: the result is partial
and the accumulator operand must carry the same partial axes)."""
from __future__ import annotations

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.primitives import register


@register("gather")
def gather_rule(eqn: Eqn) -> FactorRule:
    operand, indices = eqn.inputs
    out = eqn.outputs[0]
    dn = eqn.params["dimension_numbers"]
    slice_sizes = eqn.params["slice_sizes"]
    offset_dims = tuple(dn["offset_dims"])
    collapsed = set(dn["collapsed_slice_dims"])
    start_map = set(dn["start_index_map"])
    obatch = tuple(dn.get("operand_batching_dims", ()))
    ibatch = tuple(dn.get("start_indices_batching_dims", ()))
    b = RuleBuilder()
    odims: list = [None] * out.ndim
    idims: list = [None] * indices.ndim
    xdims: list = [None] * operand.ndim
    # result batch dims <-> indices dims (all but the trailing index vector dim)
    batch_out = [d for d in range(out.ndim) if d not in offset_dims]
    ind_batch = list(range(indices.ndim - 1))
    for od, idim in zip(batch_out, ind_batch):
        f = (b.new(out.shape[od]),)
        odims[od] = idims[idim] = f
    idims[-1] = (b.new(indices.shape[-1], blocked=True),)
    for k, idim in zip(obatch, ibatch):
        xdims[k] = idims[idim]
    window = [d for d in range(operand.ndim) if d not in collapsed and d not in obatch]
    for od, xd in zip(offset_dims, window):
        full = slice_sizes[xd] == operand.shape[xd] and xd not in start_map
        if full:
            f = (b.new(operand.shape[xd]),)
            odims[od] = xdims[xd] = f
        else:
            odims[od] = (b.new(out.shape[od], blocked=True),)
    for d in range(operand.ndim):
        if xdims[d] is None:
            xdims[d] = (b.new(operand.shape[d], blocked=True),)
    return b.rule([xdims, idims], [odims])


@register("scatter-add")
def scatter_add_rule(eqn: Eqn) -> FactorRule:
    operand, indices, updates = eqn.inputs
    dn = eqn.params["dimension_numbers"]
    uwin = tuple(dn["update_window_dims"])
    inserted = set(dn["inserted_window_dims"])
    to_operand = set(dn["scatter_dims_to_operand_dims"])
    obatch = tuple(dn.get("operand_batching_dims", ()))
    ibatch = tuple(dn.get("scatter_indices_batching_dims", ()))
    b = RuleBuilder()
    xdims: list = [None] * operand.ndim
    idims: list = [None] * indices.ndim
    udims: list = [None] * updates.ndim
    scatter_u = [d for d in range(updates.ndim) if d not in uwin]
    for ud, idim in zip(scatter_u, range(indices.ndim - 1)):
        f = (b.new(updates.shape[ud]),)   # not in the result: a reduction factor
        udims[ud] = idims[idim] = f
    idims[-1] = (b.new(indices.shape[-1], blocked=True),)
    for k, idim in zip(obatch, ibatch):
        xdims[k] = idims[idim]
    window = [d for d in range(operand.ndim) if d not in inserted and d not in obatch]
    for ud, xd in zip(uwin, window):
        if updates.shape[ud] == operand.shape[xd] and xd not in to_operand:
            f = (b.new(operand.shape[xd]),)
            udims[ud] = xdims[xd] = f
        else:
            udims[ud] = (b.new(updates.shape[ud], blocked=True),)
    for d in range(operand.ndim):
        if xdims[d] is None:
            xdims[d] = (b.new(operand.shape[d], blocked=True),)
    return b.rule([xdims, idims, udims], [xdims], partial_operands=(0,))

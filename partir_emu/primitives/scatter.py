"""The scatters: ``scatter`` (``x.at[i].set``), ``scatter-add`` (the gradient of a gather),
``scatter-mul``, ``scatter-min`` and ``scatter-max``.

Rules. The operand's window dims that an update covers whole (and that no index addresses) are
shared with the updates; the operand's batching dims are shared with the indices' batching dims;
a row lookup's indexed dim (``gather.looked_up_dim``: the vocabulary of an embedding gradient)
is shared by operand and result: tiled, each device applies the updates that land in its block
(indices shifted, the others dropped: :mod:`partir_emu.compiler.indexed`); every other operand
dim is blocked. The updates' scatter dims (one per index vector):

- ``scatter-add``: *reduction* factors. Each device adds its own updates: the result is partial
  and the accumulator operand must carry the same partial axes.
- the others: blocked. A set, product, min or max of updates that two devices hold cannot be
  completed by a sum, so the updates of one scattered row must all be on one device.

numpy impls with XLA semantics on the normalized ``ScatterDimensionNumbers`` dict (the last dim of
``indices`` is the index vector): ``CLIP`` clamps each start; ``FILL_OR_DROP`` and
``PROMISE_IN_BOUNDS`` drop a window that does not fit entirely (what XLA does). Repeated indices
combine in order (``add``/``mul``/``min``/``max`` at every one; for ``scatter`` the last update
wins, where jax leaves the winner unspecified).

Cost: read the updates and indices, read-modify-write the touched rows.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives._costs import Cost, elems, nbytes_of
from partir_emu.primitives.gather import in_bounds, looked_up_dim, starts_of, window_index


# -- rules ------------------------------------------------------------------------------
def scatter_rule(eqn: Eqn) -> FactorRule:
    operand, indices, updates = eqn.inputs
    dn = eqn.params["dimension_numbers"]
    uwin = tuple(dn["update_window_dims"])
    inserted = set(dn["inserted_window_dims"])
    to_operand = set(dn["scatter_dims_to_operand_dims"])
    obatch = tuple(dn.get("operand_batching_dims", ()))
    ibatch = tuple(dn.get("scatter_indices_batching_dims", ()))
    summed = eqn.prim == "scatter-add"
    b = RuleBuilder()
    xdims: list = [None] * operand.ndim
    idims: list = [None] * indices.ndim
    udims: list = [None] * updates.ndim
    scatter_u = [d for d in range(updates.ndim) if d not in uwin]
    for ud, idim in zip(scatter_u, range(indices.ndim - 1)):
        # batching dims reach the result through the operand; the others are reduced (add) or blocked
        f = (b.new(updates.shape[ud], blocked=not summed and idim not in ibatch),)
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
    lookup = looked_up_dim(eqn)
    if lookup is not None:
        # rows into a tiled dim (an embedding gradient into a vocab-parallel table): each device
        # applies the updates that land in its block (compiler/indexed); updates stay whole
        xdims[lookup] = (b.new(operand.shape[lookup]),)
    for d in range(operand.ndim):
        if xdims[d] is None:
            xdims[d] = (b.new(operand.shape[d], blocked=True),)
    return b.rule([xdims, idims, udims], [xdims], partial_operands=(0,) if summed else ())


# -- impls ------------------------------------------------------------------------------
Combine = Callable[[np.ndarray, tuple, np.ndarray], None]   # (out, index arrays, values), in place


def _set(out: np.ndarray, where: tuple, vals: np.ndarray) -> None:
    out[where] = vals


def _scatter(combine: Combine) -> Callable[..., np.ndarray]:
    def impl(operand: np.ndarray, indices: np.ndarray, updates: np.ndarray, *,
             dimension_numbers: Mapping[str, Any], mode: str = "FILL_OR_DROP", **_: Any) -> np.ndarray:
        dn = dimension_numbers
        uwd = tuple(dn["update_window_dims"])
        inserted = tuple(dn["inserted_window_dims"])
        index_map = tuple(dn["scatter_dims_to_operand_dims"])
        obd = tuple(dn.get("operand_batching_dims", ()))
        operand = np.asarray(operand)
        idx = np.asarray(indices).astype(np.int64)
        upd = np.asarray(updates)
        batch = idx.shape[:-1]
        nb = len(batch)
        usd = [d for d in range(upd.ndim) if d not in uwd]
        upd = np.transpose(upd, usd + list(uwd))  # batch dims first, then window dims
        window_dims = [d for d in range(operand.ndim) if d not in inserted and d not in obd]
        sizes = [1] * operand.ndim
        for j, d in enumerate(window_dims):
            sizes[d] = upd.shape[nb + j]
        upper = [n - k for n, k in zip(operand.shape, sizes)]
        starts = starts_of(idx, operand.ndim, index_map, obd, dn.get("scatter_indices_batching_dims", ()))
        out = np.array(operand, copy=True)
        if "CLIP" in str(mode):
            starts = [np.clip(s, 0, u) for s, u in zip(starts, upper)]
            mask = None
        else:
            mask = in_bounds(starts, index_map, upper, batch)
        where = [np.broadcast_to(i, upd.shape) for i in window_index(starts, sizes, window_dims, nb)]
        vals = upd.astype(out.dtype, copy=False)
        if mask is not None and not mask.all():
            m = np.broadcast_to(mask.reshape(batch + (1,) * len(window_dims)), upd.shape)
            where, vals = [i[m] for i in where], vals[m]
        combine(out, tuple(where), vals)
        return out
    return impl


# -- cost -------------------------------------------------------------------------------
def scatter_cost(e: Eqn) -> Cost:
    # operand, indices, updates: read updates and indices, read-modify-write the touched rows
    idx, upd = nbytes_of(e.inputs[1]), nbytes_of(e.inputs[2])
    return float(elems(e.inputs[2])), float(idx + 3 * upd)


_COMBINE: dict[str, Combine] = {
    "scatter": _set,
    "scatter-add": np.add.at,
    "scatter-mul": np.multiply.at,
    "scatter-min": np.minimum.at,
    "scatter-max": np.maximum.at,
}
register(*(Primitive(name, kind="memory", rule=scatter_rule, impl=_scatter(c), cost=scatter_cost,
                     summands=(0, 2) if name == "scatter-add" else ()) for name, c in _COMBINE.items()))

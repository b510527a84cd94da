"""Indexing: gather, as an embedding lookup uses it, and the scatters (its gradients; below).

**Gather.**

Rule: the index batch dims are shared with the result's batch dims; operand dims taken whole
(slice size = dim size) are shared with the result's offset dims; indexed dims are blocked,
except a row lookup's (:func:`looked_up_dim`: an embedding table's vocabulary), which is a
reduction factor: tiled, each device looks up the rows it holds (indices shifted by its block's
start, out-of-block positions zero) and the result is a pending sum; the lowering emits that
masked local lookup (:mod:`partir_emu.compiler.lowering.indexed`), Megatron's vocab-parallel embedding.

numpy impl with XLA semantics. Parameters are the normalized ``GatherDimensionNumbers`` dict
(with operand/indices batching dims). As in jax, the last dim of ``indices`` is the index
vector. ``CLIP`` and ``PROMISE_IN_BOUNDS`` clamp each start so the slice fits (what XLA does);
``FILL_OR_DROP`` returns ``fill_value`` for a slice whose start is out of bounds (default NaN /
most negative int / max uint / True). The index helpers are shared with the scatters.

Cost: a gather reads what it keeps. Lowering localizes its ``slice_sizes``.

**Scatter.** The scatters: ``scatter`` (``x.at[i].set``), ``scatter-add`` (the gradient of a gather),
``scatter-mul``, ``scatter-min`` and ``scatter-max``.

Rules. The operand's window dims that an update covers whole (and that no index addresses) are
shared with the updates; the operand's batching dims are shared with the indices' batching dims;
a row lookup's indexed dim (:func:`looked_up_dim`: the vocabulary of an embedding gradient)
is shared by operand and result: tiled, each device applies the updates that land in its block
(indices shifted, the others dropped: :mod:`partir_emu.compiler.lowering.indexed`); every other operand
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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_float
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives.costs import Cost, elems, nbytes_of, read_what_you_keep_cost


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
    lookup = looked_up_dim(eqn)
    if lookup is not None and "FILL_OR_DROP" not in str(eqn.params.get("mode")):
        # the looked-up dim (an embedding's vocabulary): tiled, each device looks up the rows it
        # holds and yields zeros for the others, so the result is a pending sum (compiler/indexed)
        xdims[lookup] = (b.new(operand.shape[lookup]),)
    for d in range(operand.ndim):
        if xdims[d] is None:
            xdims[d] = (b.new(operand.shape[d], blocked=True),)
    return b.rule([xdims, idims], [odims])


def looked_up_dim(eqn: Eqn) -> int | None:
    """The operand dim a gather or scatter indexes, when it is a row lookup: one index per
    position (index vector of length 1) into a dim whose slice is one element and is dropped
    from the window (``emb[tokens]`` and its scatter-add gradient); None otherwise."""
    dn = eqn.params["dimension_numbers"]
    gather = eqn.prim == "gather"
    index_map = tuple(dn["start_index_map"] if gather else dn["scatter_dims_to_operand_dims"])
    dropped = set(dn["collapsed_slice_dims"] if gather else dn["inserted_window_dims"])
    if len(index_map) != 1 or eqn.inputs[1].shape[-1] != 1 or index_map[0] not in dropped:
        return None
    if dn.get("operand_batching_dims"):
        return None
    return index_map[0]


# -- impls ------------------------------------------------------------------------------
def starts_of(idx: np.ndarray, ndim: int, index_map: Sequence[int], operand_batching: Sequence[int],
            indices_batching: Sequence[int]) -> list[np.ndarray]:
    """Per operand dim, the start of each slice, broadcastable to the batch shape ``idx.shape[:-1]``."""
    batch = idx.shape[:-1]
    nb = len(batch)
    starts = [np.zeros((1,) * nb, np.int64) for _ in range(ndim)]
    for k, d in enumerate(index_map):
        starts[d] = idx[..., k]
    for od, ib in zip(operand_batching, indices_batching):
        shape = [1] * nb
        shape[ib] = batch[ib]
        starts[od] = np.arange(batch[ib], dtype=np.int64).reshape(shape)
    return starts


def window_index(starts: list[np.ndarray], sizes: Sequence[int], window_dims: Sequence[int],
                  nb: int) -> tuple[np.ndarray, ...]:
    """Operand index arrays, broadcastable to ``batch + window`` shape."""
    nw = len(window_dims)
    out = []
    for d, s in enumerate(starts):
        s = s.reshape(s.shape + (1,) * nw)
        if d in window_dims:
            j = window_dims.index(d)
            s = s + np.arange(sizes[d], dtype=np.int64).reshape((1,) * (nb + j) + (-1,) + (1,) * (nw - j - 1))
        out.append(s)
    return tuple(out)


def in_bounds(starts: list[np.ndarray], dims: Sequence[int], upper: Sequence[int], batch: tuple[int, ...]) -> np.ndarray:
    ok = np.ones(batch, bool)
    for d in dims:
        ok &= (starts[d] >= 0) & (starts[d] <= upper[d])
    return ok


def _default_fill(dt: np.dtype) -> Any:
    if is_float(dt):
        return np.nan
    if dt == np.bool_:
        return True
    return np.iinfo(dt).min if dt.kind == "i" else np.iinfo(dt).max


def _gather(operand: np.ndarray, indices: np.ndarray, *, dimension_numbers: Mapping[str, Any],
            slice_sizes: Sequence[int], mode: str = "CLIP", fill_value: Any = None, **_: Any) -> np.ndarray:
    dn = dimension_numbers
    offset_dims = tuple(dn["offset_dims"])
    collapsed = tuple(dn["collapsed_slice_dims"])
    index_map = tuple(dn["start_index_map"])
    obd = tuple(dn.get("operand_batching_dims", ()))
    operand = np.asarray(operand)
    idx = np.asarray(indices).astype(np.int64)
    batch = idx.shape[:-1]
    nb = len(batch)
    starts = starts_of(idx, operand.ndim, index_map, obd, dn.get("start_indices_batching_dims", ()))
    upper = [n - k for n, k in zip(operand.shape, slice_sizes)]
    fill = "FILL_OR_DROP" in str(mode)
    mask = in_bounds(starts, index_map, upper, batch) if fill else None
    starts = [np.clip(s, 0, u) for s, u in zip(starts, upper)]
    window_dims = [d for d in range(operand.ndim) if d not in collapsed and d not in obd]
    wshape = tuple(slice_sizes[d] for d in window_dims)
    res = np.broadcast_to(operand[window_index(starts, slice_sizes, window_dims, nb)], batch + wshape)
    if mask is not None:
        fv = _default_fill(operand.dtype) if fill_value is None else fill_value
        res = np.where(mask.reshape(batch + (1,) * len(wshape)), res, np.asarray(fv).astype(operand.dtype))
    # output: offset dims hold the window dims in order, the others the batch dims in order
    rank = nb + len(wshape)
    batch_pos = [p for p in range(rank) if p not in offset_dims]
    perm = [nb + offset_dims.index(p) if p in offset_dims else batch_pos.index(p) for p in range(rank)]
    return np.transpose(res, perm)


# -- costs and localisation -------------------------------------------------------------
def gather_localize(e: Eqn, ins: Sequence[Any], outs: Sequence[Any]) -> dict:
    """A slice that took a whole operand dim takes the whole local dim."""
    p = dict(e.params)
    g, loc = e.inputs[0].shape, ins[0].shape
    p["slice_sizes"] = tuple(lo if s == gs else s for s, gs, lo in zip(p["slice_sizes"], g, loc))
    return p


register(
    Primitive("gather", kind="memory", rule=gather_rule, impl=_gather, cost=read_what_you_keep_cost,
              localize=gather_localize),
)


# -- scatter -----------------------------------------------------------------------------------------
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

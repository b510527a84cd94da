"""gather, as an embedding lookup uses it (the scatters, its gradients, are in ``scatter``).

Rule: the index batch dims are shared with the result's batch dims; operand dims taken whole
(slice size = dim size) are shared with the result's offset dims; indexed dims are blocked,
except a row lookup's (:func:`looked_up_dim`: an embedding table's vocabulary), which is a
reduction factor: tiled, each device looks up the rows it holds (indices shifted by its block's
start, out-of-block positions zero) and the result is a pending sum; the lowering emits that
masked local lookup (:mod:`partir_emu.compiler.indexed`), Megatron's vocab-parallel embedding.

numpy impl with XLA semantics. Parameters are the normalized ``GatherDimensionNumbers`` dict
(with operand/indices batching dims). As in jax, the last dim of ``indices`` is the index
vector. ``CLIP`` and ``PROMISE_IN_BOUNDS`` clamp each start so the slice fits (what XLA does);
``FILL_OR_DROP`` returns ``fill_value`` for a slice whose start is out of bounds (default NaN /
most negative int / max uint / True). The index helpers here are shared with ``scatter``.

Cost: a gather reads what it keeps. Lowering localizes its ``slice_sizes``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_float
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives._costs import read_what_you_keep_cost


# -- rules ------------------------------------------------------------------------------
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

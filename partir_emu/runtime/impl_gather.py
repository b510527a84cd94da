"""numpy implementations of ``gather`` and ``scatter-add`` with XLA semantics.

Parameters are the normalized ``GatherDimensionNumbers`` / ``ScatterDimensionNumbers``
dicts (with operand/indices batching dims). As in jax, the last dim of
``indices`` is the index vector. Modes:

- gather: ``CLIP`` and ``PROMISE_IN_BOUNDS`` clamp each start so the slice fits
  (what XLA does); ``FILL_OR_DROP`` returns ``fill_value`` for a slice whose
  start is out of bounds (default NaN / most negative int / max uint / True).
- scatter-add: ``CLIP`` clamps; ``FILL_OR_DROP`` and ``PROMISE_IN_BOUNDS`` drop a
  window that does not fit entirely (what XLA does).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_float


def _starts(idx: np.ndarray, ndim: int, index_map: Sequence[int], operand_batching: Sequence[int],
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


def _window_index(starts: list[np.ndarray], sizes: Sequence[int], window_dims: Sequence[int],
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


def _in_bounds(starts: list[np.ndarray], dims: Sequence[int], upper: Sequence[int], batch: tuple[int, ...]) -> np.ndarray:
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
    starts = _starts(idx, operand.ndim, index_map, obd, dn.get("start_indices_batching_dims", ()))
    upper = [n - k for n, k in zip(operand.shape, slice_sizes)]
    fill = "FILL_OR_DROP" in str(mode)
    mask = _in_bounds(starts, index_map, upper, batch) if fill else None
    starts = [np.clip(s, 0, u) for s, u in zip(starts, upper)]
    window_dims = [d for d in range(operand.ndim) if d not in collapsed and d not in obd]
    wshape = tuple(slice_sizes[d] for d in window_dims)
    res = np.broadcast_to(operand[_window_index(starts, slice_sizes, window_dims, nb)], batch + wshape)
    if mask is not None:
        fv = _default_fill(operand.dtype) if fill_value is None else fill_value
        res = np.where(mask.reshape(batch + (1,) * len(wshape)), res, np.asarray(fv).astype(operand.dtype))
    # output: offset dims hold the window dims in order, the others the batch dims in order
    rank = nb + len(wshape)
    batch_pos = [p for p in range(rank) if p not in offset_dims]
    perm = [nb + offset_dims.index(p) if p in offset_dims else batch_pos.index(p) for p in range(rank)]
    return np.transpose(res, perm)


def _scatter_add(operand: np.ndarray, indices: np.ndarray, updates: np.ndarray, *,
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
    starts = _starts(idx, operand.ndim, index_map, obd, dn.get("scatter_indices_batching_dims", ()))
    out = np.array(operand, copy=True)
    if "CLIP" in str(mode):
        starts = [np.clip(s, 0, u) for s, u in zip(starts, upper)]
        mask = None
    else:
        mask = _in_bounds(starts, index_map, upper, batch)
    where = [np.broadcast_to(i, upd.shape) for i in _window_index(starts, sizes, window_dims, nb)]
    vals = upd.astype(out.dtype, copy=False)
    if mask is not None and not mask.all():
        m = np.broadcast_to(mask.reshape(batch + (1,) * len(window_dims)), upd.shape)
        where, vals = [i[m] for i in where], vals[m]
    np.add.at(out, tuple(where), vals)
    return out


rules = {
    "gather": _gather,
    "scatter-add": _scatter_add,
}

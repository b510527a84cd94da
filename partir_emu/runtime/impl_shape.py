"""numpy implementations of the shape primitives: broadcast, reshape, transpose,
squeeze/expand_dims, concatenate, slice, pad, dynamic_slice/update, rev, iota, split.

Rules may return views of their operands; no rule ever writes into an operand.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype


def _broadcast_in_dim(x: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_: Any) -> np.ndarray:
    x = np.asarray(x)
    expanded = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        expanded[dst] = x.shape[src]
    return np.broadcast_to(x.reshape(expanded), tuple(shape))


def _reshape(x: np.ndarray, new_sizes: Sequence[int], dimensions: Sequence[int] | None = None, **_: Any) -> np.ndarray:
    if dimensions is not None:
        x = np.transpose(x, dimensions)
    return np.reshape(x, tuple(new_sizes))


def _slice(x: np.ndarray, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None = None, **_: Any) -> np.ndarray:
    strides = strides or (1,) * len(start_indices)
    return x[tuple(slice(s, e, k) for s, e, k in zip(start_indices, limit_indices, strides))]


def _pad(x: np.ndarray, padval: Any, padding_config: Sequence[Sequence[int]], **_: Any) -> np.ndarray:
    """lax.pad: (low, high, interior) per dim; low/high may be negative (crop)."""
    x = np.asarray(x)
    full, place, crop = [], [], []
    for n, (lo, hi, interior) in zip(x.shape, padding_config):
        inner = n + max(n - 1, 0) * interior
        size = max(lo, 0) + inner + max(hi, 0)
        full.append(size)
        place.append(slice(max(lo, 0), max(lo, 0) + inner, interior + 1))
        crop.append(slice(max(-lo, 0), size - max(-hi, 0)))
    out = np.full(full, padval, dtype=x.dtype)
    out[tuple(place)] = x
    return out[tuple(crop)]


def _clamped_starts(shape: Sequence[int], sizes: Sequence[int], starts: Sequence[Any]) -> list[int]:
    # lax clamps dynamic start indices so that the slice fits in the operand
    return [min(max(int(s), 0), n - k) for s, n, k in zip(starts, shape, sizes)]


def _dynamic_slice(x: np.ndarray, *starts: Any, slice_sizes: Sequence[int], **_: Any) -> np.ndarray:
    st = _clamped_starts(x.shape, slice_sizes, starts)
    return x[tuple(slice(s, s + k) for s, k in zip(st, slice_sizes))]


def _dynamic_update_slice(x: np.ndarray, update: Any, *starts: Any, **_: Any) -> np.ndarray:
    update = np.asarray(update)
    st = _clamped_starts(x.shape, update.shape, starts)
    out = np.array(x, copy=True)
    out[tuple(slice(s, s + k) for s, k in zip(st, update.shape))] = update
    return out


def _iota(*, dtype: str, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
    dt = np_dtype(dtype)
    r = np.arange(shape[dimension], dtype=dt if dt.kind in "iuf" else np.int64)
    expanded = [1] * len(shape)
    expanded[dimension] = shape[dimension]
    return np.broadcast_to(r.reshape(expanded), tuple(shape))


def _split(x: np.ndarray, sizes: Sequence[int], axis: int, **_: Any) -> list[np.ndarray]:
    bounds = np.cumsum(sizes)[:-1]
    return np.split(x, bounds, axis=axis)


rules = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": lambda x, permutation, **_: np.transpose(x, permutation),
    "squeeze": lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)),
    "expand_dims": lambda x, dimensions, **_: np.expand_dims(x, tuple(dimensions)),
    "concatenate": lambda *xs, dimension, **_: np.concatenate([np.asarray(x) for x in xs], axis=dimension),
    "slice": _slice,
    "pad": _pad,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "rev": lambda x, dimensions, **_: np.flip(x, tuple(dimensions)) if dimensions else x,
    "iota": _iota,
    "split": _split,
}

"""numpy implementations of reductions and contractions: reduce_*, argmax/argmin,
cumulative scans (cumsum, cumprod, cummax, cummin) and dot_general."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype


def _reduce(f: Callable[..., np.ndarray], keep_dtype: bool = False) -> Callable[..., np.ndarray]:
    def rule(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
        # keep_dtype: accumulate in the operand's type as XLA does (numpy widens ints)
        return f(x, axis=tuple(axes), dtype=x.dtype) if keep_dtype else f(x, axis=tuple(axes))
    return rule


def _reduce_logical(ufunc: np.ufunc) -> Callable[..., np.ndarray]:
    def rule(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
        return ufunc.reduce(x, axis=tuple(axes))
    return rule


def _arg(f: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def rule(x: np.ndarray, *, axes: Sequence[int], index_dtype: str, **_: Any) -> np.ndarray:
        (axis,) = axes
        return f(x, axis=axis).astype(np_dtype(index_dtype))
    return rule


def _cumulative(f: Callable[[np.ndarray, int], np.ndarray]) -> Callable[..., np.ndarray]:
    def rule(x: np.ndarray, *, axis: int, reverse: bool = False, **_: Any) -> np.ndarray:
        if reverse:
            return np.flip(f(np.flip(x, axis), axis), axis)
        return f(x, axis)
    return rule


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, *, dimension_numbers: Any,
                 preferred_element_type: str | None = None, **_: Any) -> np.ndarray:
    """Output dims: batch, lhs free, rhs free (each in operand order), as lax.dot_general."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    if preferred_element_type is not None:  # accumulate in the requested type
        dt = np_dtype(preferred_element_type)
        lhs, rhs = lhs.astype(dt, copy=False), rhs.astype(dt, copy=False)
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    bshape = [lhs.shape[d] for d in lb]
    lfs, rfs = [lhs.shape[d] for d in lf], [rhs.shape[d] for d in rf]
    csize = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    b, m, n = int(np.prod(bshape, dtype=np.int64)), int(np.prod(lfs, dtype=np.int64)), int(np.prod(rfs, dtype=np.int64))
    lt = np.transpose(lhs, (*lb, *lf, *lc)).reshape(b, m, csize)
    rt = np.transpose(rhs, (*rb, *rc, *rf)).reshape(b, csize, n)
    if lt.dtype == np.bool_:  # a bool contraction is an "or" of "and"s
        out = np.matmul(lt.astype(np.int32), rt.astype(np.int32)) != 0
    else:
        out = np.matmul(lt, rt)
    return out.reshape((*bshape, *lfs, *rfs))


rules = {
    "reduce_sum": _reduce(np.sum, keep_dtype=True),
    "reduce_prod": _reduce(np.prod, keep_dtype=True),
    "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min),
    "reduce_and": _reduce_logical(np.bitwise_and),
    "reduce_or": _reduce_logical(np.bitwise_or),
    "argmax": _arg(np.argmax),
    "argmin": _arg(np.argmin),
    "cumsum": _cumulative(lambda x, a: np.cumsum(x, axis=a, dtype=x.dtype)),
    "cumprod": _cumulative(lambda x, a: np.cumprod(x, axis=a, dtype=x.dtype)),
    "cummax": _cumulative(lambda x, a: np.maximum.accumulate(x, axis=a)),
    "cummin": _cumulative(lambda x, a: np.minimum.accumulate(x, axis=a)),
    "dot_general": _dot_general,
}

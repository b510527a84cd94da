"""Reductions, cumulative scans, sort and top_k.

Rules: tiling a summed dim makes the result a pending sum; tiling the reduced dim of max/min a
pending max/min (each device reduces its block; an ``all_reduce(max)`` of the small result
resolves it: a vocab-parallel softmax needs no gathered logits); the reduced dim of argmax/prod/
and/or, a scanned dim, a sorted dim and top_k's dim are blocked (each device would need the whole row).
Costs: 1 FLOP per input element (``n·⌈log2 n⌉`` per row for sort, ``n·⌈log2 k⌉`` for top_k),
kind ``reduction``.

A bfloat16 ``reduce_sum`` accumulates in bfloat16, as XLA CPU does (each add in float32, rounded),
in XLA's tree order (:func:`_tree_sum_low`); jnp.sum/mean upcast bfloat16 to float32 themselves, so
this order matters for the sums lax emits directly (the transposes of broadcasts in gradients).
A bfloat16 ``cumsum`` adds left to right rounding each step; XLA CPU lowers it as jax's
associative scan (another order), so it agrees to bfloat16 rounding, not bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import is_low_float, np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives.costs import Cost, elems, in_bytes, out_bytes, reduction_cost


# -- rules ------------------------------------------------------------------------------
def reduce_rule(eqn: Eqn) -> FactorRule:
    x = eqn.inputs[0]
    axes = set(eqn.params["axes"])
    b = RuleBuilder()
    summed = eqn.prim == "reduce_sum"
    op = _PENDING.get(eqn.prim)
    dims = [(b.new(n, blocked=(i in axes and op is None)),) for i, n in enumerate(x.shape)]
    out = [d for i, d in enumerate(dims) if i not in axes]
    return b.rule([dims], [out], linear=summed, reduce_op=op or "sum")


# reductions that may run over a tiled dim: each device reduces its block, then the partial results
# combine by this op (an all_reduce of the small result); the others (prod, and/or, argmax) block it
_PENDING = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


def scan_rule(eqn: Eqn) -> FactorRule:
    x = eqn.inputs[0]
    b = RuleBuilder()
    dims = [(b.new(n, blocked=(i == eqn.params["axis"])),) for i, n in enumerate(x.shape)]
    return b.rule([dims], [dims])


# -- impls ------------------------------------------------------------------------------
def _reduce(f: Callable[..., np.ndarray], keep_dtype: bool = False) -> Callable[..., np.ndarray]:
    def impl(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
        # keep_dtype: accumulate in the operand's type as XLA does (numpy widens ints)
        return f(x, axis=tuple(axes), dtype=x.dtype) if keep_dtype else f(x, axis=tuple(axes))
    return impl


_XLA_WINDOW = 32   # XLA CPU's TreeReductionRewriter window


def _reduce_sum(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
    x = np.asarray(x)
    if is_low_float(x.dtype):
        return _tree_sum_low(x, tuple(axes))
    return np.sum(x, axis=tuple(axes), dtype=x.dtype)   # XLA accumulates in the operand's type (numpy widens ints)


def _tree_sum_low(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """A bfloat16/float16 sum as XLA CPU computes it: every addition in float32 rounded back to
    the narrow type (the accumulator IS bfloat16), in the order of XLA's tree-reduction rewrite:
    while a reduced dim has size >= 32, every such dim is padded with zeros to a multiple of 32
    (half the padding in front) and summed in windows of 32 (a dim under 32 is one window; window
    elements in row-major order); the last window sums are summed in row-major order."""
    axes = tuple(sorted(a % x.ndim for a in axes))
    keep = [d for d in range(x.ndim) if d not in axes]
    x = np.transpose(x, keep + list(axes))
    k, w = len(keep), _XLA_WINDOW
    kshape = x.shape[:k]
    while any(n >= w for n in x.shape[k:]):
        rshape = x.shape[k:]
        pads = [-n % w if n >= w else 0 for n in rshape]
        x = np.pad(x, [(0, 0)] * k + [(p // 2, p - p // 2) for p in pads])
        split = [((n + p) // w, w) if n >= w else (1, n) for n, p in zip(rshape, pads)]
        x = x.reshape(*kshape, *(s for pair in split for s in pair))
        r = len(rshape)
        x = np.transpose(x, list(range(k)) + [k + 2 * i for i in range(r)] + [k + 2 * i + 1 for i in range(r)])
        x = _sequential_sum(x.reshape(*x.shape[:k + r], -1))
    return _sequential_sum(x.reshape(*kshape, -1))


def _sequential_sum(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis, left to right from 0, rounding to ``x``'s dtype after each add."""
    dt = x.dtype
    acc = np.zeros(x.shape[:-1], np.float32)
    for i in range(x.shape[-1]):
        acc = (acc + x[..., i].astype(np.float32)).astype(dt).astype(np.float32)
    return acc.astype(dt)


def _reduce_logical(ufunc: np.ufunc) -> Callable[..., np.ndarray]:
    def impl(x: np.ndarray, *, axes: Sequence[int], **_: Any) -> np.ndarray:
        return ufunc.reduce(x, axis=tuple(axes))
    return impl


def _arg(f: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def impl(x: np.ndarray, *, axes: Sequence[int], index_dtype: str, **_: Any) -> np.ndarray:
        (axis,) = axes
        return f(x, axis=axis).astype(np_dtype(index_dtype))
    return impl


def _cumulative(f: Callable[[np.ndarray, int], np.ndarray]) -> Callable[..., np.ndarray]:
    def impl(x: np.ndarray, *, axis: int, reverse: bool = False, **_: Any) -> np.ndarray:
        if reverse:
            return np.flip(f(np.flip(x, axis), axis), axis)
        return f(x, axis)
    return impl


_RULE_AND_IMPL: dict[str, tuple[Callable[[Eqn], FactorRule], Callable[..., Any]]] = {
    "reduce_sum": (reduce_rule, _reduce_sum),
    "reduce_prod": (reduce_rule, _reduce(np.prod, keep_dtype=True)),
    "reduce_max": (reduce_rule, _reduce(np.max)),
    "reduce_min": (reduce_rule, _reduce(np.min)),
    "reduce_and": (reduce_rule, _reduce_logical(np.bitwise_and)),
    "reduce_or": (reduce_rule, _reduce_logical(np.bitwise_or)),
    "argmax": (reduce_rule, _arg(np.argmax)),
    "argmin": (reduce_rule, _arg(np.argmin)),
    "cumsum": (scan_rule, _cumulative(lambda x, a: np.cumsum(x, axis=a, dtype=x.dtype))),
    "cumprod": (scan_rule, _cumulative(lambda x, a: np.cumprod(x, axis=a, dtype=x.dtype))),
    "cummax": (scan_rule, _cumulative(lambda x, a: np.maximum.accumulate(x, axis=a))),
    "cummin": (scan_rule, _cumulative(lambda x, a: np.minimum.accumulate(x, axis=a))),
}
register(*(Primitive(name, kind="reduction", rule=rule, impl=impl, cost=reduction_cost,
                     summands=(0,) if name in ("reduce_sum", "cumsum") else ())
           for name, (rule, impl) in _RULE_AND_IMPL.items()))


# -- sort: one entry, every facet -------------------------------------------------------
def sort_rule(eqn: Eqn) -> FactorRule:
    """All operands and results share one shape: the sorted dim is blocked, the others are
    shared factors (sorting rows is independent across them)."""
    dim = eqn.params["dimension"]
    b = RuleBuilder()
    dims = [(b.new(n, blocked=(i == dim)),) for i, n in enumerate(eqn.inputs[0].shape)]
    return b.rule([dims] * len(eqn.inputs), [dims] * len(eqn.outputs))


def _sort(*operands: np.ndarray, dimension: int, num_keys: int = 1, **_: Any) -> list[np.ndarray]:
    """``lax.sort``: order every operand by the first ``num_keys`` operands, lexicographically.

    As jax's comparator: -0.0 equals 0.0 and every NaN sorts last, equal to the other NaNs
    (numpy's float order is the same); ties keep their order (the sort is stable whatever
    ``is_stable`` says; jax leaves the order of ties unspecified then)."""
    keys = [np.asarray(k) for k in operands[:num_keys]]
    order = np.lexsort(keys[::-1], axis=dimension)   # lexsort's last key is the primary one
    return [np.take_along_axis(np.asarray(x), order, axis=dimension) for x in operands]


def sort_cost(e: Eqn) -> Cost:
    x = e.inputs[0]
    dim = e.params.get("dimension", x.ndim - 1)
    n = x.shape[dim] if x.ndim else 1
    return float(elems(x) * max(1, math.ceil(math.log2(max(n, 2))))), float(in_bytes(e) + out_bytes(e))


register(Primitive("sort", kind="reduction", rule=sort_rule, impl=_sort, cost=sort_cost))


# -- top_k: one entry, every facet ------------------------------------------------------
def top_k_rule(eqn: Eqn) -> FactorRule:
    """The selected dim is blocked in the operand and (separately) in both results; the other
    dims are shared (rows are independent)."""
    x = eqn.inputs[0]
    axis = eqn.params.get("axis", x.ndim - 1) % x.ndim
    b = RuleBuilder()
    xdims = [(b.new(n, blocked=(i == axis)),) for i, n in enumerate(x.shape)]
    odims = [d if i != axis else (b.new(eqn.params["k"], blocked=True),) for i, d in enumerate(xdims)]
    return b.rule([xdims], [odims, odims])


def _descending_key(x: np.ndarray) -> np.ndarray:
    """Unsigned keys whose ascending order is ``x``'s descending total order (as XLA's TopK:
    NaN above +inf, +0.0 above -0.0)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    width = x.dtype.itemsize
    u = x.view(np.dtype(f"u{width}"))
    sign = np.array(1 << (8 * width - 1), u.dtype)
    if x.dtype.kind == "i":
        asc = u ^ sign
    elif x.dtype.kind == "u":
        asc = u
    else:   # floats (numpy and ml_dtypes): sign-magnitude to two's-complement order
        asc = np.where(u & sign, ~u, u | sign)
    return ~asc


def _top_k(x: np.ndarray, *, k: int, axis: int = -1, **_: Any) -> list[np.ndarray]:
    """``lax.top_k``: the k largest along ``axis``, ties to the lower index."""
    x = np.asarray(x)
    order = np.argsort(_descending_key(x), axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int32)]


def top_k_cost(e: Eqn) -> Cost:
    k = int(e.params["k"])
    return float(elems(e.inputs[0]) * max(1, math.ceil(math.log2(max(k, 2))))), float(in_bytes(e) + out_bytes(e))


register(Primitive("top_k", kind="reduction", rule=top_k_rule, impl=_top_k, cost=top_k_cost))

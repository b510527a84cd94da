"""Integer bit primitives: shifts, ``population_count``, ``clz`` and ``bitcast_convert_type``.

Semantics are XLA's, which differ from numpy's where C leaves things undefined: a shift by an
amount >= the bit width (or by a negative amount, read as unsigned) gives 0, or the sign fill
for ``shift_right_arithmetic``; ``shift_right_logical`` of a signed int shifts its bits as
unsigned. ``bitcast_convert_type`` reinterprets bytes in the machine's (little-endian) order,
as XLA CPU does: to a narrower type it adds a trailing dim of ``ratio`` elements, to a wider
type it consumes one.

Rules: the shifts and counts are elementwise (``elementwise_rule``); a bitcast between equal
widths too, and between different widths its leading dims are shared and the trailing dim it
adds or consumes is blocked (it holds the bytes of one element). Costs: 1 op per element;
a bitcast is a memory op (a copy, unfused).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives._costs import copy_cost, elementwise_cost
from partir_emu.primitives.elementwise import elementwise_rule


def _unsigned(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "i" else x


def _shift(kind: str) -> Callable[..., np.ndarray]:
    def impl(x: Any, y: Any, **_: Any) -> np.ndarray:
        if isinstance(x, (int, bool)) and not isinstance(y, (int, bool)):   # a weak literal takes the other's type
            x = np.asarray(x).astype(np.asarray(y).dtype)
        x = np.asarray(x)
        y = np.asarray(y).astype(x.dtype)
        x, y = np.broadcast_arrays(x, y)
        nbits = 8 * x.dtype.itemsize
        amount = _unsigned(np.ascontiguousarray(y))
        ok = amount < nbits
        safe = np.where(ok, amount, 0).astype(amount.dtype)
        if kind == "left":
            return np.where(ok, _unsigned(np.ascontiguousarray(x)) << safe, 0).astype(_unsigned(x).dtype).view(x.dtype)
        if kind == "logical":
            ux = _unsigned(np.ascontiguousarray(x))
            return np.where(ok, ux >> safe, 0).astype(ux.dtype).view(x.dtype)
        fill = np.where(x < 0, -1, 0).astype(x.dtype)   # arithmetic: sign fill
        return np.where(ok, x >> safe.astype(x.dtype), fill).astype(x.dtype)
    return impl


def _population_count(x: Any, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    return np.bitwise_count(_unsigned(np.ascontiguousarray(x))).astype(x.dtype)   # of the bits, not |x|


def _clz(x: Any, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    v = _unsigned(np.ascontiguousarray(x)).astype(np.uint64)
    nbits = 8 * x.dtype.itemsize
    length = np.zeros(x.shape, np.int64)
    for s in (32, 16, 8, 4, 2, 1):   # binary search for the highest set bit
        if s < nbits:
            t = v >> np.uint64(s)
            hit = t != 0
            length += np.where(hit, s, 0)
            v = np.where(hit, t, v)
    return (nbits - length - (v != 0)).astype(x.dtype)


def _bitcast(x: Any, new_dtype: str, **_: Any) -> np.ndarray:
    x = np.ascontiguousarray(x)
    dt = np_dtype(new_dtype)
    if dt.itemsize == x.dtype.itemsize:
        return x.view(dt)
    if dt.itemsize < x.dtype.itemsize:
        return x.view(dt).reshape(x.shape + (x.dtype.itemsize // dt.itemsize,))
    return x.view(dt).reshape(x.shape[:-1])


def bitcast_rule(eqn: Eqn) -> FactorRule:
    x, out = eqn.inputs[0], eqn.outputs[0]
    if x.ndim == out.ndim:
        return elementwise_rule(eqn)
    b = RuleBuilder()
    lead = b.fresh_dims(x.shape if x.ndim < out.ndim else out.shape)
    extra = (b.new(out.shape[-1] if out.ndim > x.ndim else x.shape[-1], blocked=True),)
    if x.ndim < out.ndim:
        return b.rule([lead], [list(lead) + [extra]])
    return b.rule([list(lead) + [extra]], [lead])


register(
    Primitive("shift_left", kind="elementwise", rule=elementwise_rule, impl=_shift("left"), cost=elementwise_cost),
    Primitive("shift_right_logical", kind="elementwise", rule=elementwise_rule, impl=_shift("logical"),
              cost=elementwise_cost),
    Primitive("shift_right_arithmetic", kind="elementwise", rule=elementwise_rule, impl=_shift("arithmetic"),
              cost=elementwise_cost),
    Primitive("population_count", kind="elementwise", rule=elementwise_rule, impl=_population_count,
              cost=elementwise_cost),
    Primitive("clz", kind="elementwise", rule=elementwise_rule, impl=_clz, cost=elementwise_cost),
    Primitive("bitcast_convert_type", kind="memory", rule=bitcast_rule, impl=_bitcast, cost=copy_cost),
)

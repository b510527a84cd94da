"""The cost conventions every entry's ``cost`` facet follows, and the helpers they share.

A cost is ``(flops, hbm_bytes)`` of one equation on its (local) shapes. No fusion is
modelled: every equation reads its operands from HBM and writes its results back.

- elementwise ops: 1 FLOP per output element; bytes = operands + results.
- ``dot_general``: ``2·batch·M·N·K`` FLOPs; bytes = operands + result.
- reductions, cumulative ops: 1 FLOP per input element; ``sort``: ``n·⌈log2 n⌉`` per row.
- layout ops (reshape, transpose, broadcast, concatenate, pad, ...): 0 FLOPs,
  bytes = operands + results. Slicing ops read only what they keep (2 × result);
  in-place updates (``dynamic_update_slice``, ``scatter-add``) touch only the update region.
- communicating collectives cost 0 here: the communication model prices them.
  ``all_slice`` and ``to_partial`` are local memory ops; ``axis_index`` is free.

An operand that appears twice is read once; Literals take no bytes.

The analytical model calls these once per equation of programs with tens of thousands
of equations, so the size of a buffer is memoized on its ``(shape, dtype)`` by
:func:`buffer_bytes` (an explicit ``functools.cache`` on a pure function).
"""
from __future__ import annotations

import functools
import math
from typing import Any

from partir_emu.core.ir import Atom, Eqn, Var, itemsize

Cost = tuple[float, float]


@functools.cache
def buffer_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense buffer of ``shape`` and ``dtype`` (memoized: a pure function)."""
    return math.prod(shape) * itemsize(dtype)


def nbytes_of(v: Any) -> int:
    """Bytes of a Var's buffer; Literals take none."""
    return buffer_bytes(v.shape, v.dtype) if type(v) is Var else 0


def elems(v: Atom) -> int:
    return math.prod(v.shape)


def in_bytes(e: Eqn) -> int:
    """Bytes of the distinct operands (a value read twice is read once)."""
    ins = e.inputs
    if len(ins) == 1:
        return nbytes_of(ins[0])
    if len(ins) == 2:
        a, b = ins
        return nbytes_of(a) if a is b or a == b else nbytes_of(a) + nbytes_of(b)
    seen: set[int] = set()
    total = 0
    for a in ins:
        if type(a) is Var and a.id not in seen:
            seen.add(a.id)
            total += nbytes_of(a)
    return total


def out_bytes(e: Eqn) -> int:
    outs = e.outputs
    if len(outs) == 1:
        return nbytes_of(outs[0])
    return sum(nbytes_of(o) for o in outs)


# -- costs shared by several families ---------------------------------------------------
def elementwise_cost(e: Eqn) -> Cost:
    o = e.outputs[0]
    out = buffer_bytes(o.shape, o.dtype)
    return float(out // itemsize(o.dtype)), float(in_bytes(e) + out)


def reduction_cost(e: Eqn) -> Cost:
    return float(elems(e.inputs[0])), float(in_bytes(e) + out_bytes(e))


def copy_cost(e: Eqn) -> Cost:
    return 0.0, float(in_bytes(e) + out_bytes(e))


def read_what_you_keep_cost(e: Eqn) -> Cost:
    # slice / dynamic_slice / gather / all_slice: read the kept region (+ index operands), write it
    idx = sum(nbytes_of(a) for a in e.inputs[1:])
    return 0.0, float(2 * out_bytes(e) + idx)


def write_only_cost(e: Eqn) -> Cost:
    return 0.0, float(out_bytes(e))


def free_cost(e: Eqn) -> Cost:
    return 0.0, 0.0

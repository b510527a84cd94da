"""``scan`` and ``cond`` for the tracer, for now by rewriting them into straight-line equations.

- ``scan`` (``lax.scan``, ``fori_loop`` with static bounds, Flax ``nn.scan``) is **unrolled**: the
  body is inlined ``length`` times (in reverse for ``reverse=True``); iteration ``i`` reads
  ``xs[i]`` (``slice`` + ``squeeze`` on the leading dim) and the per-iteration ``ys`` are stacked
  (``broadcast_in_dim`` + ``concatenate``). The program grows with the trip count, which is
  what a loop op in the SpmdProgram (partitioning the body once) will remove; until then this
  makes such models trace, partition and verify at all.
- ``cond`` computes **every branch** and picks each output with ``select_n`` on the branch index,
  which is exact for the pure functions jax traces (an untaken branch's infinities are
  discarded by the select, in the gradient too) and costs every branch. A branch index known
  at trace time picks its branch alone.
- ``empty`` (jax's uninitialised buffer, which cond's gradient uses) becomes zeros.
- ``while`` (a trip count known only at run time) stays unsupported.

The equations emitted here carry the ``scan``'s own source line and kernel tag.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.ir import Eqn, Literal, Var

Atom = Var | Literal


def _new(b: Any, shape: Sequence[int], dtype: str) -> Var:
    v = Var(b.next_id, tuple(int(d) for d in shape), dtype)
    b.next_id += 1
    return v


def _emit(b: Any, prim: str, ins: Sequence[Atom], shape: Sequence[int], dtype: str, params: dict,
          where: str, kernel: str) -> Var:
    out = _new(b, shape, dtype)
    b.eqns.append(Eqn(prim, tuple(ins), (out,), params, where, kernel))
    return out


def _row(b: Any, x: Var, i: int, where: str, kernel: str) -> Var:
    """``x[i]`` along the leading dim."""
    start = (i,) + (0,) * (len(x.shape) - 1)
    limit = (i + 1,) + tuple(x.shape[1:])
    one = _emit(b, "slice", (x,), (1, *x.shape[1:]), x.dtype,
                {"start_indices": start, "limit_indices": limit, "strides": None}, where, kernel)
    return _emit(b, "squeeze", (one,), x.shape[1:], x.dtype, {"dimensions": (0,)}, where, kernel)


def _stack(b: Any, rows: Sequence[Atom], shape: Sequence[int], dtype: str, where: str, kernel: str) -> Atom:
    """The rows stacked on a new leading dim (``shape`` is the stacked shape)."""
    if not rows:
        return b.const(np.zeros(tuple(shape), dtype))
    row_shape = tuple(shape[1:])
    lifted = [_emit(b, "broadcast_in_dim", (r,), (1, *row_shape), dtype,
                    {"shape": (1, *row_shape), "broadcast_dimensions": tuple(range(1, len(row_shape) + 1))},
                    where, kernel) for r in rows]
    if len(lifted) == 1:
        return lifted[0]
    return _emit(b, "concatenate", lifted, shape, dtype, {"dimension": 0}, where, kernel)


def unroll_scan(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """The outputs of scan equation ``e`` (its carries, then its stacked ys), body inlined per step."""
    p = e.params
    body, n = p["jaxpr"], int(p["length"])
    nc, ncar = int(p["num_consts"]), int(p["num_carry"])
    consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + ncar]), list(ins[nc + ncar:])
    ys: dict[int, list[Atom]] = {}
    for i in (range(n - 1, -1, -1) if p.get("reverse") else range(n)):
        rows = [_row(b, x, i, where, kernel) if isinstance(x, Var) else x for x in xs]
        outs = b.inline(body.jaxpr, body.consts, [*consts, *carry, *rows], where, stack)
        carry, ys[i] = list(outs[:ncar]), list(outs[ncar:])
    stacked = []
    for j, ov in enumerate(e.outvars[ncar:]):
        shape, dtype = shape_of(ov)
        stacked.append(_stack(b, [ys[i][j] for i in range(n)], shape, dtype, where, kernel))
    return [*carry, *stacked]


def select_cond(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """The outputs of cond equation ``e``: every branch inlined, each output a ``select_n``."""
    index, ops = ins[0], list(ins[1:])
    branches = e.params["branches"]
    if isinstance(index, Literal):          # known at trace time: that branch alone (lax clamps it)
        k = min(max(int(index.value), 0), len(branches) - 1)
        return b.inline(branches[k].jaxpr, branches[k].consts, ops, where, stack)
    results = [b.inline(br.jaxpr, br.consts, ops, where, stack) for br in branches]
    outs: list[Atom] = []
    for j, ov in enumerate(e.outvars):
        cases = [r[j] for r in results]
        if all(c is cases[0] for c in cases):
            outs.append(cases[0])
            continue
        shape, dtype = shape_of(ov)
        cases = [c if isinstance(c, Var) else
                 _emit(b, "broadcast_in_dim", (c,), shape, dtype, {"shape": shape, "broadcast_dimensions": ()},
                       where, kernel) for c in cases]
        outs.append(_emit(b, "select_n", (index, *cases), shape, dtype, {}, where, kernel))
    return outs


def empty_as_zeros(b: Any, e: Any, ins: Sequence[Atom], where: str, stack: str, kernel: str,
                   shape_of: Callable[[Any], tuple[tuple[int, ...], str]]) -> list[Atom]:
    """``empty`` (an uninitialised buffer; cond's gradient makes its untaken branch's residuals
    with it): zeros, a well-defined value for a buffer nothing may read before writing it."""
    shape, dtype = shape_of(e.outvars[0])
    zero = Literal(False if dtype == "bool" else 0, dtype)
    return [_emit(b, "broadcast_in_dim", (zero,), shape, dtype, {"shape": shape, "broadcast_dimensions": ()},
                  where, kernel)]


__all__ = ["empty_as_zeros", "select_cond", "unroll_scan"]

"""Every primitive partir_emu supports, one module per family, each entry registered in
:mod:`partir_emu.core.registry` with all of its facets (sharding rule, numpy impl, cost,
kind, localisation, traceability).

Importing this package fills the registry; its consumers (compiler, runtime, hwmodels) read
the registry through the names re-exported here, so that they always see it filled.
:func:`rule_for` is the sharding rule of one equation.

Families: ``elementwise`` (with the special functions numpy lacks), ``bits`` (shifts, bit counts,
bitcasts, and jax.random's threefry primitives), ``shape``, ``reduce`` (reductions, scans, sort,
top_k), ``dot`` (dot_general and the matmul kernels every contraction runs on), ``conv``
(convolutions), ``window`` (pooling: reduce_window_*, select_and_scatter_add), ``indexing`` (gather;
scatter set/add/mul/min/max), ``collectives`` (the SPMD primitives lowering emits); ``costs``: the
cost conventions they share.
"""
from __future__ import annotations

from partir_emu.core.factors import FactorRule
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import KINDS, Primitive, get, lookup, names, registered
from partir_emu.errors import UnsupportedPrimitiveError
from partir_emu.primitives import (  # noqa: F401  (register)
    bits,
    collectives,
    conv,
    dot,
    elementwise,
    indexing,
    reduce,
    shape,
    window,
)

__all__ = ["KINDS", "Primitive", "get", "localize_params", "lookup", "names", "registered", "rule_for"]


def localize_params(e: Eqn, ins, outs) -> dict:
    """The parameters of ``e`` for its local operands ``ins`` and results ``outs``: the ``localize``
    facet of its registry entry rewrites those that spell out global sizes; the others are kept."""
    entry = get(e.prim)
    if entry is None or entry.localize is None:
        return dict(e.params)
    return entry.localize(e, ins, outs)


def rule_for(eqn: Eqn) -> FactorRule:
    """The factor rule of one equation; UnsupportedPrimitiveError names a primitive without one."""
    entry = get(eqn.prim)
    if entry is None or entry.rule is None:
        raise UnsupportedPrimitiveError(
            f"primitive {eqn.prim!r} at {eqn.source or '?'} has no sharding rule "
            f"(no {'entry' if entry is None else 'rule facet'} in partir_emu.primitives)")
    return entry.rule(eqn)

"""Every primitive partir_emu supports, one module per family, each entry registered in
:mod:`partir_emu.core.registry` with all of its facets.

Importing this package fills the registry. :func:`rule_for` is the sharding rule of one
equation.
"""
from __future__ import annotations

from collections.abc import Callable

from partir_emu.core.factors import FactorRule
from partir_emu.core.ir import Eqn
from partir_emu.errors import UnsupportedPrimitiveError

# transitional: the sharding facet only (the registry entries replace this table)
sharding_rules: dict[str, Callable[[Eqn], FactorRule]] = {}


def register(*prims: str):
    def deco(fn):
        for p in prims:
            sharding_rules[p] = fn
        return fn
    return deco


def rule_for(eqn: Eqn) -> FactorRule:
    """The factor rule of one equation; UnsupportedPrimitiveError names a primitive without one."""
    try:
        fn = sharding_rules[eqn.prim]
    except KeyError:
        raise UnsupportedPrimitiveError(
            f"primitive {eqn.prim!r} at {eqn.source or '?'} has no sharding rule") from None
    return fn(eqn)


from partir_emu.primitives import dot, elementwise, gather, reduce, shape  # noqa: E402,F401  (families register)

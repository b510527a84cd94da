"""Sharding rules: one einsum-like factor mapping per primitive (the TMR).

Every dim of every operand and result maps to a tuple of *factors*
(major→minor; a reshape gives compound dims). A factor that appears in operands
but in no result is a *reduction* factor: tiling it makes the result a pending
sum (partial) over the tiling axes. A *blocked* factor must stay untiled (the
sliced dim of a slice, the reduced dim of a max, an iota...).

``sharding_rules`` maps a primitive name to ``rule(eqn) -> FactorRule``; the
rule families live in the sibling modules and register themselves at import.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from partir_emu.compiler.ir import Eqn
from partir_emu.errors import UnsupportedPrimitiveError

Dims = tuple[tuple[int, ...], ...]   # per tensor dim: the factors it is made of


@dataclass(frozen=True)
class FactorRule:
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    sizes: tuple[int, ...]                       # size of each factor
    blocked: frozenset[int] = frozenset()
    # operands that must carry the reduction's partial axes (the accumulator of a scatter-add)
    partial_operands: tuple[int, ...] = ()
    # pending sums pass through (linear in every operand, all partial alike)
    linear: bool = False
    reduction: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        res = {f for dims in self.results for d in dims for f in d}
        ops = {f for dims in self.operands for d in dims for f in d}
        object.__setattr__(self, "reduction", frozenset(ops - res))


class RuleBuilder:
    """Allocates factors while a rule is written."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.blocked: set[int] = set()

    def new(self, size: int, blocked: bool = False) -> int:
        self.sizes.append(int(size))
        f = len(self.sizes) - 1
        if blocked or size == 1:
            self.blocked.add(f)
        return f

    def fresh_dims(self, shape, blocked: bool = False) -> Dims:
        return tuple((self.new(n, blocked),) for n in shape)

    def rule(self, operands, results, **kw) -> FactorRule:
        return FactorRule(tuple(tuple(tuple(d) for d in o) for o in operands),
                          tuple(tuple(tuple(d) for d in r) for r in results),
                          tuple(self.sizes), frozenset(self.blocked), **kw)


sharding_rules: dict[str, Callable[[Eqn], FactorRule]] = {}


def register(*prims: str):
    def deco(fn):
        for p in prims:
            sharding_rules[p] = fn
        return fn
    return deco


def rule_for(eqn: Eqn) -> FactorRule:
    try:
        fn = sharding_rules[eqn.prim]
    except KeyError:
        raise UnsupportedPrimitiveError(
            f"primitive {eqn.prim!r} at {eqn.source or '?'} has no sharding rule") from None
    return fn(eqn)


import partir_emu.compiler.rules.dot  # noqa: E402,F401  (the rule families register themselves)
import partir_emu.compiler.rules.elementwise  # noqa: E402,F401
import partir_emu.compiler.rules.gather  # noqa: E402,F401
import partir_emu.compiler.rules.reduce  # noqa: E402,F401
import partir_emu.compiler.rules.shape  # noqa: E402,F401

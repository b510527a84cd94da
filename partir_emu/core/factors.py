"""The vocabulary of sharding rules: one einsum-like factor mapping per equation (the TMR).

Every dim of every operand and result maps to a tuple of *factors*
(major→minor; a reshape gives compound dims). A factor that appears in operands
but in no result is a *reduction* factor: tiling it makes the result a pending
sum (partial) over the tiling axes. A *blocked* factor must stay untiled (the
sliced dim of a slice, the reduced dim of a max, an iota...).

A primitive's rule is the ``rule`` facet of its registry entry
(:mod:`partir_emu.core.registry`); the entries live in :mod:`partir_emu.primitives`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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

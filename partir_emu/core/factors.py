"""The vocabulary of sharding rules: one einsum-like factor mapping per equation (the TMR).

Every dim of every operand and result maps to a tuple of *factors*
(major→minor; a reshape gives compound dims). A factor that appears in operands
but in no result is a *reduction* factor: tiling it makes the result a pending
sum (partial) over the tiling axes (a pending max or min for ``reduce_op`` max/min). A *blocked* factor must stay untiled (the
sliced dim of a slice, the reduced dim of a max, an iota...). A *halo* factor may
be tiled, but then each device also reads border elements of its neighbours' blocks
(the spatial dim of a convolution or pooling window): the lowering exchanges them
(:mod:`partir_emu.compiler.lowering.halo`).

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
    # factors whose tiling needs a halo exchange (windows straddle the block borders)
    halo: frozenset[int] = frozenset()
    # how the partial results of a tiled reduction factor combine: "sum", or "max"/"min" (a
    # reduce_max over a tiled dim: each device's max, then an all_reduce(max))
    reduce_op: str = "sum"
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

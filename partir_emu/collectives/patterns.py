"""Communication patterns on one line of members, the bricks of every algorithm.

A pattern returns *raw steps*: a list of steps, each a list of
``(src, dst, chunk, reduce)`` tuples over group positions. ``segs[k]`` is the
list of chunk ids that member ``members[k]`` owns (all_gather) or ends up
responsible for (reduce_scatter). Independent patterns run concurrently when
their steps are zipped by :func:`merge`, and one after the other when their
step lists are concatenated.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

RawStep = list[tuple[int, int, int, bool]]


def merge(*step_lists: list[RawStep]) -> list[RawStep]:
    """Run patterns concurrently: step ``s`` of the result is step ``s`` of each, in argument order."""
    n = max((len(s) for s in step_lists), default=0)
    return [[t for sl in step_lists if s < len(sl) for t in sl[s]] for s in range(n)]


def ring_reduce_scatter(members: Sequence[int], segs: Sequence[Sequence[int]], reverse: bool = False) -> list[RawStep]:
    """Ring reduce-scatter: ``p-1`` steps; at step ``s`` member ``k`` adds segment ``k-s-1`` into ``k+1``."""
    p, d = len(members), (-1 if reverse else 1)
    return [[(members[k], members[(k + d) % p], c, True)
             for k in range(p) for c in segs[(k - d * (s + 1)) % p]] for s in range(p - 1)]


def ring_all_gather(members: Sequence[int], segs: Sequence[Sequence[int]], reverse: bool = False) -> list[RawStep]:
    """Ring all-gather: ``p-1`` steps; at step ``s`` member ``k`` forwards segment ``k-s`` to ``k+1``."""
    p, d = len(members), (-1 if reverse else 1)
    return [[(members[k], members[(k + d) % p], c, False)
             for k in range(p) for c in segs[(k - d * s) % p]] for s in range(p - 1)]


def halving_reduce_scatter(members: Sequence[int], segs: Sequence[Sequence[int]]) -> list[RawStep]:
    """Recursive halving (power-of-two ``p``): ``log2 p`` steps at distances ``p/2, ..., 1``.

    At distance ``d`` member ``k`` sends its partner ``k ^ d`` the half of its
    current range that the partner keeps, so after the last step ``k`` holds
    segment ``k`` reduced over everyone.
    """
    p = len(members)
    steps, mask = [], p // 2
    while mask:
        hi = ~(2 * mask - 1)
        steps.append([(members[k], members[k ^ mask], c, True)
                      for k in range(p) for j in range(p)
                      if (j & hi) == (k & hi) and (j & mask) != (k & mask) for c in segs[j]])
        mask //= 2
    return steps


def doubling_all_gather(members: Sequence[int], segs: Sequence[Sequence[int]]) -> list[RawStep]:
    """Recursive doubling (power-of-two ``p``): ``log2 p`` steps at distances ``1, 2, ..., p/2``."""
    p = len(members)
    steps, mask = [], 1
    while mask < p:
        low = ~(mask - 1)
        steps.append([(members[k], members[k ^ mask], c, False)
                      for k in range(p) for j in range(p) if (j & low) == (k & low) for c in segs[j]])
        mask *= 2
    return steps


def pairwise_exchange(members: Sequence[int], held: Callable[[int, int], Sequence[int]]) -> list[RawStep]:
    """Pairwise exchange: ``p-1`` steps; at step ``s`` member ``k`` sends ``held(k, k+s)`` to ``k+s``.

    ``held(k, j)`` lists the chunks member ``members[k]`` must hand to ``members[j]``.
    """
    p = len(members)
    return [[(members[k], members[(k + s) % p], c, False) for k in range(p) for c in held(k, (k + s) % p)]
            for s in range(1, p)]

"""Communication patterns on one line of members, the bricks of every algorithm.

A pattern returns *raw steps*: a list of steps, each a list of
``(src, dst, first_chunk, count, reduce)`` tuples over group positions.
``segs[k]`` is a list of chunk runs ``(first, count)`` that member
``members[k]`` owns (all-gather) or ends up responsible for (reduce-scatter).
Independent patterns run concurrently when their steps are zipped by
:func:`merge`, and one after the other when their step lists are concatenated.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

Run = tuple[int, int]
RawStep = list[tuple[int, int, int, int, bool]]


def merge(*step_lists: list[RawStep]) -> list[RawStep]:
    """Run patterns concurrently: step ``s`` of the result is step ``s`` of each, in argument order."""
    n = max((len(s) for s in step_lists), default=0)
    return [[t for sl in step_lists if s < len(sl) for t in sl[s]] for s in range(n)]


def span(segs: Sequence[Sequence[Run]], lo: int, hi: int) -> list[Run]:
    """The runs of ``segs[lo:hi]``, adjacent runs joined."""
    out: list[Run] = []
    for seg in segs[lo:hi]:
        for a, k in seg:
            if out and out[-1][0] + out[-1][1] == a:
                out[-1] = (out[-1][0], out[-1][1] + k)
            else:
                out.append((a, k))
    return out


def _spanner(segs: Sequence[Sequence[Run]]) -> Callable[[int, int], list[Run]]:
    """``span`` over ``segs``, in O(1) when the segments are equal consecutive runs."""
    first = segs[0][0] if segs and len(segs[0]) == 1 else None
    if first and all(len(s) == 1 and s[0] == (first[0] + j * first[1], first[1]) for j, s in enumerate(segs)):
        a0, size = first
        return lambda lo, hi: [(a0 + lo * size, (hi - lo) * size)]
    return lambda lo, hi: span(segs, lo, hi)


def ring_reduce_scatter(members: Sequence[int], segs: Sequence[Sequence[Run]], reverse: bool = False) -> list[RawStep]:
    """Ring reduce-scatter: ``p-1`` steps; at step ``s`` member ``k`` adds segment ``k-s-1`` into ``k+1``."""
    p, d = len(members), (-1 if reverse else 1)
    return [[(members[k], members[(k + d) % p], a, n, True)
             for k in range(p) for a, n in segs[(k - d * (s + 1)) % p]] for s in range(p - 1)]


def ring_all_gather(members: Sequence[int], segs: Sequence[Sequence[Run]], reverse: bool = False) -> list[RawStep]:
    """Ring all-gather: ``p-1`` steps; at step ``s`` member ``k`` forwards segment ``k-s`` to ``k+1``."""
    p, d = len(members), (-1 if reverse else 1)
    return [[(members[k], members[(k + d) % p], a, n, False)
             for k in range(p) for a, n in segs[(k - d * s) % p]] for s in range(p - 1)]


def halving_reduce_scatter(members: Sequence[int], segs: Sequence[Sequence[Run]]) -> list[RawStep]:
    """Recursive halving (power-of-two ``p``): ``log2 p`` steps at distances ``p/2, ..., 1``.

    At distance ``d`` member ``k`` sends its partner ``k ^ d`` the half of its
    current range of segments that the partner keeps (segments ``lo .. lo+d-1``
    with ``lo = (k ^ d) & ~(d-1)``), so after the last step ``k`` holds segment
    ``k`` reduced over everyone.
    """
    p, sp = len(members), _spanner(segs)
    steps, mask = [], p // 2
    while mask:
        step = []
        for k in range(p):
            lo = (k ^ mask) & ~(mask - 1)
            step += [(members[k], members[k ^ mask], a, n, True) for a, n in sp(lo, lo + mask)]
        steps.append(step)
        mask //= 2
    return steps


def doubling_all_gather(members: Sequence[int], segs: Sequence[Sequence[Run]]) -> list[RawStep]:
    """Recursive doubling (power-of-two ``p``): ``log2 p`` steps at distances ``1, 2, ..., p/2``.

    Before distance ``d`` member ``k`` holds segments ``lo .. lo+d-1`` with
    ``lo = k & ~(d-1)`` and sends them all to ``k ^ d``.
    """
    p, sp = len(members), _spanner(segs)
    steps, mask = [], 1
    while mask < p:
        step = []
        for k in range(p):
            lo = k & ~(mask - 1)
            step += [(members[k], members[k ^ mask], a, n, False) for a, n in sp(lo, lo + mask)]
        steps.append(step)
        mask *= 2
    return steps


def pairwise_exchange(members: Sequence[int], held: Callable[[int, int], Sequence[Run]]) -> list[RawStep]:
    """Pairwise exchange: ``p-1`` steps; at step ``s`` member ``k`` sends ``held(k, k+s)`` to ``k+s``.

    ``held(k, j)`` lists the chunk runs member ``members[k]`` must hand to ``members[j]``.
    """
    p = len(members)
    return [[(members[k], members[(k + s) % p], a, n, False) for k in range(p) for a, n in held(k, (k + s) % p)]
            for s in range(1, p)]


# ------------------------------------------------------------------------------------------------
# The same patterns on numpy arrays, for many lines at once (what build_schedule uses).
#
# ``members``, ``first`` and ``count`` are ``[L, p]`` int arrays: line ``l`` has members
# ``members[l]`` and member ``members[l, k]`` owns (or is responsible for) the single chunk run
# ``(first[l, k], count[l, k])``. A pattern gives one ``ArrayStep`` per step: the
# ``(src, dst, first_chunk, count)`` arrays of its transfers and their ``reduce`` flag (a bool or
# an array), in the order :func:`merge` gives the lines' own patterns run concurrently (line by
# line, then member by member). Several patterns run concurrently with :func:`merge_arrays`.
ArrayStep = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, 'bool | np.ndarray']


def _2d(x) -> np.ndarray:
    a = np.asarray(x, np.int64)
    return a.reshape(1, -1) if a.ndim == 1 else a


def ring_arrays(members, first, count, *, gather: bool, reverse: bool = False) -> Iterator[ArrayStep]:
    """:func:`ring_all_gather` (``gather``) or :func:`ring_reduce_scatter` of every line, as arrays
    (made step by step)."""
    members, first, count = _2d(members), _2d(first), _2d(count)
    p = members.shape[1]
    d = -1 if reverse else 1
    k = np.arange(p)
    dst = members[:, (k + d) % p].ravel()
    src = members.ravel()
    for s in range(p - 1):
        seg = (k - d * s) % p if gather else (k - d * (s + 1)) % p
        yield src, dst, first[:, seg].ravel(), count[:, seg].ravel(), not gather


def bidir_ring_arrays(members, first, count, back_first, *, gather: bool) -> Iterator[ArrayStep]:
    """Per line, a ring one way over runs ``first`` merged with a ring the other way over runs
    ``back_first`` (same counts): ``merge(fwd_line0, back_line0)`` for each line, lines merged."""
    members, first, count, back_first = _2d(members), _2d(first), _2d(count), _2d(back_first)
    fwd = ring_arrays(members, first, count, gather=gather)
    back = ring_arrays(members, back_first, count, gather=gather, reverse=True)
    L = members.shape[0]
    for f, b in zip(fwd, back):
        yield tuple(np.stack([x.reshape(L, -1), y.reshape(L, -1)], axis=1).ravel() for x, y in zip(f[:4], b[:4])) \
            + (f[4],)


def recursive_arrays(p: int, *, gather: bool) -> list[ArrayStep]:
    """:func:`doubling_all_gather` / :func:`halving_reduce_scatter` over positions ``0..p-1`` owning
    chunk ``k`` each (power-of-two ``p``)."""
    k = np.arange(p, dtype=np.int64)
    masks = []
    m = 1 if gather else p // 2
    while (m < p) if gather else m:
        masks.append(m)
        m = m * 2 if gather else m // 2
    out = []
    for m in masks:
        lo = (k & ~(m - 1)) if gather else ((k ^ m) & ~(m - 1))
        out.append((k, k ^ m, lo, np.full(p, m, np.int64), not gather))
    return out


def pairwise_arrays(p: int) -> list[ArrayStep]:
    """:func:`pairwise_exchange` over positions ``0..p-1`` where ``k`` hands ``j`` chunk ``k*p + j``."""
    k = np.arange(p, dtype=np.int64)
    one = np.ones(p, np.int64)
    return [(k, (k + s) % p, k * p + (k + s) % p, one, False) for s in range(1, p)]


def merge_arrays(*step_lists: list[ArrayStep]) -> list[ArrayStep]:
    """:func:`merge` for array steps."""
    n = max((len(s) for s in step_lists), default=0)
    out = []
    for s in range(n):
        parts = [sl[s] for sl in step_lists if s < len(sl)]
        red = np.concatenate([np.broadcast_to(np.asarray(p[4], bool), p[0].shape) for p in parts])
        out.append(tuple(np.concatenate([p[i] for p in parts]) for i in range(4)) + (red,))
    return out


def list_to_arrays(steps: list[RawStep]) -> list[ArrayStep]:
    """Raw list steps as array steps."""
    out = []
    for st in steps:
        a = np.array([t[:4] for t in st], np.int64).reshape(-1, 4)
        out.append((a[:, 0], a[:, 1], a[:, 2], a[:, 3], np.array([bool(t[4]) for t in st], bool)))
    return out

"""Communication patterns on lines of members, the bricks of every algorithm.

A pattern gives its steps as :data:`ArrayStep` tuples of numpy arrays, for many
lines at once (see the comment above :func:`ring_arrays`). The torus all_to_all,
which routes chunk by chunk, builds *raw steps* instead: a list of steps, each a
list of ``(src, dst, first_chunk, count, reduce)`` tuples over group positions
(:func:`pairwise_exchange`), run concurrently when zipped by :func:`merge` and
converted with :func:`list_to_arrays`.
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


def pairwise_exchange(members: Sequence[int], held: Callable[[int, int], Sequence[Run]]) -> list[RawStep]:
    """Pairwise exchange: ``p-1`` steps; at step ``s`` member ``k`` sends ``held(k, k+s)`` to ``k+s``.

    ``held(k, j)`` lists the chunk runs member ``members[k]`` must hand to ``members[j]``.
    """
    p = len(members)
    return [[(members[k], members[(k + s) % p], a, n, False) for k in range(p) for a, n in held(k, (k + s) % p)]
            for s in range(1, p)]


# ------------------------------------------------------------------------------------------------
# Patterns on numpy arrays, for many lines at once (what build_schedule uses).
#
# ``members``, ``first`` and ``count`` are ``[L, p]`` int arrays: line ``l`` has members
# ``members[l]`` and member ``members[l, k]`` owns (all-gather) or ends up responsible for
# (reduce-scatter) the single chunk run ``(first[l, k], count[l, k])``. A pattern gives one
# ``ArrayStep`` per step: the ``(src, dst, first_chunk, count)`` arrays of its transfers and their
# ``reduce`` flag (a bool or an array), line by line, then member by member (the lines run
# concurrently).
ArrayStep = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, 'bool | np.ndarray']


def _2d(x) -> np.ndarray:
    a = np.asarray(x, np.int64)
    return a.reshape(1, -1) if a.ndim == 1 else a


def ring_arrays(members, first, count, *, gather: bool, reverse: bool = False) -> Iterator[ArrayStep]:
    """A ring all-gather (``gather``) or reduce-scatter on every line, made step by step: ``p-1``
    steps; at step ``s`` member ``k`` sends to ``k+1`` (``k-1`` if ``reverse``) its run ``k-s``
    (all-gather, stored) or adds its run ``k-s-1`` into it (reduce-scatter)."""
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
        s, d, c, n = (np.stack([x.reshape(L, -1), y.reshape(L, -1)], axis=1).ravel() for x, y in zip(f[:4], b[:4]))
        yield s, d, c, n, f[4]


def recursive_arrays(p: int, *, gather: bool) -> list[ArrayStep]:
    """Recursive doubling (all-gather) or halving (reduce-scatter) over positions ``0..p-1``, position
    ``k`` owning chunk ``k`` (power-of-two ``p``): ``log2 p`` steps at distances ``d = 1, 2, ..., p/2``
    (doubling) or ``p/2, ..., 1`` (halving). Doubling: ``k`` holds chunks ``lo .. lo+d-1`` with
    ``lo = k & ~(d-1)`` and sends them all to ``k ^ d``. Halving: ``k`` adds into ``k ^ d`` the chunks
    the partner keeps, ``lo .. lo+d-1`` with ``lo = (k ^ d) & ~(d-1)``; at the end ``k`` holds chunk
    ``k`` reduced over everyone."""
    k = np.arange(p, dtype=np.int64)
    masks = []
    m = 1 if gather else p // 2
    while (m < p) if gather else m:
        masks.append(m)
        m = m * 2 if gather else m // 2
    out: list[ArrayStep] = []
    for m in masks:
        lo = (k & ~(m - 1)) if gather else ((k ^ m) & ~(m - 1))
        out.append((k, k ^ m, lo, np.full(p, m, np.int64), not gather))
    return out


def pairwise_arrays(p: int) -> list[ArrayStep]:
    """:func:`pairwise_exchange` over positions ``0..p-1`` where ``k`` hands ``j`` chunk ``k*p + j``."""
    k = np.arange(p, dtype=np.int64)
    one = np.ones(p, np.int64)
    return [(k, (k + s) % p, k * p + (k + s) % p, one, False) for s in range(1, p)]


def list_to_arrays(steps: list[RawStep]) -> list[ArrayStep]:
    """Raw list steps as array steps."""
    out: list[ArrayStep] = []
    for st in steps:
        a = np.array([t[:4] for t in st], np.int64).reshape(-1, 4)
        out.append((a[:, 0], a[:, 1], a[:, 2], a[:, 3], np.array([bool(t[4]) for t in st], bool)))
    return out

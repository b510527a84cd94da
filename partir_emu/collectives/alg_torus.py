"""Torus algorithms: dimension by dimension (``torus``) and all dimensions at once (``multidim``).

``torus`` reduce-scatters along one physical dim after another (each dim a set of bidirectional
rings), so at any moment only one dim's links carry data. ``multidim`` cuts the data into ``D``
parts (``D`` = number of dims larger than 1) and runs part ``j`` through the same dim-by-dim
algorithm with the dim order rotated by ``j`` (dims ``j, j+1, ..., j-1``); the parts run in the
same steps, so at every phase every dim's links carry one part (on a torus with equal dims, the
bandwidth term is ``1/D`` of ``torus``'s; the number of steps, hence the latency term, is the same).

Block numbering. In part ``j`` (dim order ``order_j``) block ``b`` has the *rank* of its
coordinates permuted by ``order_j``, read row-major: the blocks a member owns after the first
``k`` phases of part ``j`` are then a run of consecutive ranks, as in ``torus``. The chunk of
(part ``j``, ring direction ``h``, block ``b``) is ``(2j + h) * p + rank_j(b)``.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import numpy as np

from partir_emu.collectives.patterns import ArrayStep, bidir_ring_arrays


def torus_phase(shape: tuple[int, ...], t: int, gather: bool) -> Iterable[ArrayStep]:
    """All lines along dim ``t`` at once, each a bidirectional ring. Member ``v`` of a line
    owns the blocks whose coords agree with it on dims ``< t`` and equal ``v`` on dim ``t``:
    a run of ``prod(shape[t+1:])`` blocks in each half."""
    p = math.prod(shape)
    size = math.prod(shape[t + 1:])
    idx = np.arange(p).reshape(shape)
    # lines: every base with coordinate 0 on dim t, in row-major order; members along dim t
    members = np.moveaxis(idx, t, -1).reshape(-1, shape[t])
    los = (members // size) * size  # the member's index with dims > t zeroed
    return bidir_ring_arrays(members, los, np.full(members.shape, size, np.int64), p + los, gather=gather)


def torus(shape: tuple[int, ...], gather: bool) -> Iterable[ArrayStep]:
    """``torus``: reduce-scatter dims in order, all-gather them reversed."""
    dims = [t for t in range(len(shape)) if shape[t] > 1]
    return itertools.chain.from_iterable(torus_phase(shape, t, gather) for t in (reversed(dims) if gather else dims))


def part_orders(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The dim order of each ``multidim`` part: the non-trivial dims rotated by ``j``, then the rest."""
    dims = [t for t in range(len(shape)) if shape[t] > 1]
    rest = [t for t in range(len(shape)) if shape[t] == 1]
    return [tuple(dims[j:] + dims[:j] + rest) for j in range(len(dims))]


def _ranks(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``(rank_of, pos_of)``: the rank of each position's coords permuted by ``order`` (row-major)
    and its inverse."""
    pos_of = np.arange(math.prod(shape)).reshape(shape).transpose(order).ravel()
    rank_of = np.empty_like(pos_of)
    rank_of[pos_of] = np.arange(len(pos_of))
    return rank_of, pos_of


def multidim_layout(shape: tuple[int, ...]) -> tuple[int, list[int]]:
    """``(m, layout)`` of ``multidim``: ``m = 2D`` pieces per block; piece ``q`` of block ``b`` is the
    chunk ``q * p + rank_{q // 2}(b)`` (part ``q // 2``, direction ``q % 2``)."""
    p = math.prod(shape)
    orders = part_orders(shape)
    m = 2 * len(orders)
    ranks = [_ranks(shape, o)[0] for o in orders]
    return m, [q * p + int(ranks[q // 2][b]) for b in range(p) for q in range(m)]


def _part(shape: tuple[int, ...], j: int, order: tuple[int, ...], gather: bool) -> Iterator[ArrayStep]:
    """Part ``j``: ``torus`` over the permuted shape, positions mapped back, chunks offset by ``2jp``."""
    p = math.prod(shape)
    pshape = tuple(shape[t] for t in order)
    _, pos_of = _ranks(shape, order)
    for src, dst, first, count, red in torus(pshape, gather):
        yield pos_of[src], pos_of[dst], first + 2 * j * p, count, red


def multidim(shape: tuple[int, ...], gather: bool) -> Iterator[ArrayStep]:
    """``multidim`` all-gather (``gather``) or reduce-scatter: every part's steps merged step by step
    (the parts have equal step counts: each crosses every dim once)."""
    parts = [_part(shape, j, o, gather) for j, o in enumerate(part_orders(shape))]
    for steps in zip(*parts):
        n = [len(s[0]) for s in steps]
        red = np.concatenate([np.broadcast_to(np.asarray(s[4], bool), (k,)) for s, k in zip(steps, n)])
        src, dst, first, count = (np.concatenate([s[i] for s in steps]) for i in range(4))
        yield src, dst, first, count, red

"""Every collective algorithm, written once as a :class:`CollectiveSchedule`.

``build_schedule(kind, group_shape, nbytes, algorithm)`` is the single entry
point. Positions are row-major over ``group_shape``. Requested algorithms and
what is built (``schedule.algorithm`` records the latter):

==============  ==========================================  ===========================================
algorithm       all_gather / reduce_scatter / all_reduce    all_to_all
==============  ==========================================  ===========================================
ring            unidirectional ring over positions 0..p-1   pairwise exchange (p-1 steps)
bidir_ring      data in two halves, one each way round      pairwise exchange
recursive       doubling / halving / Rabenseifner (RS+AG);  pairwise exchange
                ``'ring'`` when p is not a power of two
torus           per dim a bidir ring: RS dims in order, AG  dim by dim pairwise exchange; one
                dims reversed; ``'bidir_ring'`` if only     non-trivial dim: ``'pairwise'``
                one dim is larger than 1
hierarchical    nodes of ``devices_per_node`` consecutive   ``'direct'`` (one step, all pairs)
                positions: RS in node, ring across nodes,
                AG in node; ``'ring'`` unless
                ``1 < devices_per_node < p`` divides p
==============  ==========================================  ===========================================

collective_permute is always ``'direct'``: one step, ``src -> dst`` per pair.
all_reduce accepts sizes not divisible by ``p`` (chunks split like
``np.array_split``; empty chunks are never sent); the other kinds need the
per-member blocks to be whole.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Sequence

from partir_emu.collectives.patterns import (
    RawStep,
    doubling_all_gather,
    halving_reduce_scatter,
    merge,
    pairwise_exchange,
    ring_all_gather,
    ring_reduce_scatter,
)
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule, Step, Transfer, check_permutation
from partir_emu.errors import CollectiveError

ALGORITHMS: tuple[str, ...] = ("ring", "bidir_ring", "recursive", "torus", "hierarchical")


def build_schedule(kind: str, group_shape: tuple[int, ...], nbytes: int, algorithm: str = "ring", *,
                   itemsize: int = 4, devices_per_node: int | None = None,
                   permutation: tuple[tuple[int, int], ...] | None = None) -> CollectiveSchedule:
    """The schedule of ``kind`` over a group of shape ``group_shape`` moving ``nbytes`` per device.

    ``nbytes`` is the gathered output size for all_gather and the input size
    for every other kind; it must be a multiple of ``itemsize`` (the element
    size of the buffers the executors will get). Results are cached.
    """
    if kind not in KINDS:
        raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    if algorithm not in ALGORITHMS:
        raise CollectiveError(f"unknown collective algorithm {algorithm!r} for {kind}; use one of {ALGORITHMS}")
    shape = _check_shape(group_shape)
    p = math.prod(shape)
    itemsize = _as_int(itemsize, "itemsize", "a positive int (the dtype's itemsize)")
    nbytes = _as_int(nbytes, "nbytes", f"a non-negative multiple of itemsize={itemsize}")
    if itemsize < 1:
        raise CollectiveError(f"itemsize={itemsize} must be a positive int (the dtype's itemsize)")
    if nbytes < 0 or nbytes % itemsize:
        raise CollectiveError(f"{kind} nbytes={nbytes} must be a non-negative multiple of itemsize={itemsize}")
    n = nbytes // itemsize
    if kind in ("all_gather", "reduce_scatter", "all_to_all") and n % p:
        raise CollectiveError(
            f"{kind} over group {shape} (p={p}) needs an element count divisible by p, got {n} "
            f"({nbytes} bytes / itemsize {itemsize}); pad the buffer or use all_reduce")
    if devices_per_node is not None:
        devices_per_node = _as_int(devices_per_node, "devices_per_node", "a positive int or None")
        if devices_per_node < 1:
            raise CollectiveError(f"devices_per_node={devices_per_node} must be a positive int or None")
    perm = check_permutation(permutation, p) if kind == "collective_permute" else None
    if kind != "collective_permute" and permutation is not None:
        raise CollectiveError(f"permutation is only meaningful for collective_permute, not {kind}")
    actual = _resolve(kind, shape, algorithm, devices_per_node)
    return _build(kind, shape, n, actual, itemsize, devices_per_node if actual == "hierarchical" else None, perm)


def default_algorithm(kind: str, group_shape: tuple[int, ...], devices_per_node: int | None = None) -> str:
    """A sensible algorithm: hierarchical across nodes, torus over several dims, else (bidir) ring."""
    if kind not in KINDS:
        raise CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    shape = _check_shape(group_shape)
    p = math.prod(shape)
    if kind == "collective_permute":
        return "ring"
    if devices_per_node is not None and 1 < devices_per_node < p and p % devices_per_node == 0:
        return "hierarchical"
    if sum(d > 1 for d in shape) >= 2:
        return "torus"
    return "bidir_ring" if p > 2 else "ring"


# ------------------------------------------------------------------ helpers
def _as_int(value: object, name: str, what: str) -> int:
    if isinstance(value, bool):
        raise CollectiveError(f"{name}={value!r} must be {what}")
    try:
        return operator.index(value)
    except TypeError as e:
        raise CollectiveError(f"{name}={value!r} must be {what}") from e


def _check_shape(group_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in group_shape)
    except (TypeError, ValueError) as e:
        raise CollectiveError(f"group_shape {group_shape!r} must be a tuple of positive ints") from e
    if not shape or any(d < 1 for d in shape):
        raise CollectiveError(f"group_shape {group_shape!r} must be a non-empty tuple of positive ints")
    return shape


def _resolve(kind: str, shape: tuple[int, ...], algorithm: str, dpn: int | None) -> str:
    """The algorithm actually built for a request (see the module table)."""
    p = math.prod(shape)
    if algorithm == "hierarchical" and dpn is None:
        raise CollectiveError(
            f"algorithm 'hierarchical' for {kind} over {shape} needs devices_per_node; pass it or pick another")
    if kind == "collective_permute":
        return "direct"
    multi_dim = sum(d > 1 for d in shape) >= 2
    if kind == "all_to_all":
        if algorithm == "torus" and multi_dim:
            return "torus"
        return "direct" if algorithm == "hierarchical" else "pairwise"
    if algorithm == "recursive" and p & (p - 1):
        return "ring"
    if algorithm == "torus" and not multi_dim:
        return "bidir_ring"
    if algorithm == "hierarchical" and not (1 < dpn < p and p % dpn == 0):
        return "ring"
    return algorithm


def _split(n: int, k: int) -> list[int]:
    """Sizes of ``np.array_split(range(n), k)``."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


@functools.lru_cache(maxsize=512)
def _build(kind: str, shape: tuple[int, ...], n: int, algorithm: str, itemsize: int, dpn: int | None,
           perm: tuple[tuple[int, int], ...] | None) -> CollectiveSchedule:
    p = math.prod(shape)
    m = 2 if algorithm in ("bidir_ring", "torus") and kind not in ("all_to_all", "collective_permute") else 1
    if kind == "collective_permute":
        elems = [n] * p
    elif kind == "all_to_all":
        elems = [n // p] * (p * p)
    else:
        elems = [e for b in _split(n, p) for e in _split(b, m)]
    raw = _RAW[kind](algorithm, shape, m, dpn, perm)
    chunk_bytes = tuple(e * itemsize for e in elems)
    steps = []
    for rs in raw:
        ts = tuple(Transfer(s, d, chunk_bytes[c], c, r) for s, d, c, r in rs if chunk_bytes[c])
        if ts:
            steps.append(Step(ts))
    return CollectiveSchedule(kind=kind, algorithm=algorithm, group_shape=shape, nbytes=n * itemsize,
                              num_chunks=len(elems), steps=tuple(steps), chunk_bytes=chunk_bytes,
                              itemsize=itemsize, permutation=perm)


def _blocks(p: int, m: int) -> list[list[int]]:
    return [[b * m + h for h in range(m)] for b in range(p)]


def _halves(segs: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Split segments of 2-chunk blocks into the forward half and the backward half."""
    return [[c for c in s if c % 2 == 0] for s in segs], [[c for c in s if c % 2 == 1] for s in segs]


def _line_rs(members: Sequence[int], segs: list[list[int]], algorithm: str) -> list[RawStep]:
    if algorithm in ("bidir_ring", "torus"):
        fwd, bwd = _halves(segs)
        return merge(ring_reduce_scatter(members, fwd), ring_reduce_scatter(members, bwd, reverse=True))
    if algorithm == "recursive":
        return halving_reduce_scatter(members, segs)
    return ring_reduce_scatter(members, segs)


def _line_ag(members: Sequence[int], segs: list[list[int]], algorithm: str) -> list[RawStep]:
    if algorithm in ("bidir_ring", "torus"):
        fwd, bwd = _halves(segs)
        return merge(ring_all_gather(members, fwd), ring_all_gather(members, bwd, reverse=True))
    if algorithm == "recursive":
        return doubling_all_gather(members, segs)
    return ring_all_gather(members, segs)


# ------------------------------------------------------------------- torus
def _torus_phase(shape: tuple[int, ...], t: int, m: int, gather: bool) -> list[RawStep]:
    """All lines along dim ``t`` at once; member ``v`` of a line owns the blocks whose
    coords agree with it on dims ``< t`` and equal ``v`` on dim ``t``."""
    coords = list(itertools.product(*(range(d) for d in shape)))
    index = {c: i for i, c in enumerate(coords)}
    owned: dict[tuple[int, ...], list[int]] = {}  # coords[:t+1] -> chunks, in block order
    for b, bc in enumerate(coords):
        owned.setdefault(bc[:t + 1], []).extend(b * m + h for h in range(m))
    lines = []
    for base in coords:
        if base[t] != 0:
            continue
        members = [index[base[:t] + (v,) + base[t + 1:]] for v in range(shape[t])]
        segs = [owned[base[:t] + (v,)] for v in range(shape[t])]
        lines.append((_line_ag if gather else _line_rs)(members, segs, "torus"))
    return merge(*lines)


def _torus_rs(shape: tuple[int, ...], m: int) -> list[RawStep]:
    return [s for t in range(len(shape)) if shape[t] > 1 for s in _torus_phase(shape, t, m, False)]


def _torus_ag(shape: tuple[int, ...], m: int) -> list[RawStep]:
    return [s for t in reversed(range(len(shape))) if shape[t] > 1 for s in _torus_phase(shape, t, m, True)]


# ------------------------------------------------------------ hierarchical
def _hier_rs(p: int, d: int) -> list[RawStep]:
    q = p // d
    intra = merge(*(ring_reduce_scatter([nd * d + l for l in range(d)], [[n2 * d + l for n2 in range(q)]
                                                                          for l in range(d)])
                    for nd in range(q)))
    inter = merge(*(ring_reduce_scatter([nd * d + l for nd in range(q)], [[nd * d + l] for nd in range(q)])
                    for l in range(d)))
    return intra + inter


def _hier_ag(p: int, d: int) -> list[RawStep]:
    q = p // d
    inter = merge(*(ring_all_gather([nd * d + l for nd in range(q)], [[nd * d + l] for nd in range(q)])
                    for l in range(d)))
    intra = merge(*(ring_all_gather([nd * d + l for l in range(d)], [[n2 * d + l for n2 in range(q)]
                                                                      for l in range(d)])
                    for nd in range(q)))
    return inter + intra


# ------------------------------------------------------------- per kind
def _raw_all_gather(algorithm, shape, m, dpn, perm) -> list[RawStep]:
    p = math.prod(shape)
    if algorithm == "torus":
        return _torus_ag(shape, m)
    if algorithm == "hierarchical":
        return _hier_ag(p, dpn)
    return _line_ag(range(p), _blocks(p, m), algorithm)


def _raw_reduce_scatter(algorithm, shape, m, dpn, perm) -> list[RawStep]:
    p = math.prod(shape)
    if algorithm == "torus":
        return _torus_rs(shape, m)
    if algorithm == "hierarchical":
        return _hier_rs(p, dpn)
    return _line_rs(range(p), _blocks(p, m), algorithm)


def _raw_all_reduce(algorithm, shape, m, dpn, perm) -> list[RawStep]:
    return _raw_reduce_scatter(algorithm, shape, m, dpn, perm) + _raw_all_gather(algorithm, shape, m, dpn, perm)


def _raw_all_to_all(algorithm, shape, m, dpn, perm) -> list[RawStep]:
    p = math.prod(shape)
    if algorithm == "direct":
        return [[(i, j, i * p + j, False) for i in range(p) for j in range(p) if i != j]]
    if algorithm == "pairwise":
        return pairwise_exchange(range(p), lambda k, j: (k * p + j,))
    # torus: route every chunk dim by dim; in phase t it moves along dim t to its destination's coordinate
    coords = list(itertools.product(*(range(d) for d in shape)))
    index = {c: i for i, c in enumerate(coords)}
    holder = [i for i in range(p) for _ in range(p)]  # chunk i*p + j starts at i
    steps: list[RawStep] = []
    for t in range(len(shape)):
        if shape[t] == 1:
            continue
        by_member: dict[int, dict[int, list[int]]] = {}
        for c, h in enumerate(holder):
            dest_v = coords[c % p][t]
            if coords[h][t] != dest_v:
                by_member.setdefault(h, {}).setdefault(dest_v, []).append(c)
        lines = []
        for base in coords:
            if base[t] == 0:
                members = [index[base[:t] + (v,) + base[t + 1:]] for v in range(shape[t])]
                lines.append(pairwise_exchange(members, lambda k, j, ms=members: by_member.get(ms[k], {}).get(j, ())))
        steps += merge(*lines)
        for c, h in enumerate(holder):
            holder[c] = index[coords[h][:t] + (coords[c % p][t],) + coords[h][t + 1:]]
    return steps


def _raw_collective_permute(algorithm, shape, m, dpn, perm) -> list[RawStep]:
    return [[(s, d, s, False) for s, d in perm if s != d]]


_RAW = {
    "all_gather": _raw_all_gather,
    "reduce_scatter": _raw_reduce_scatter,
    "all_reduce": _raw_all_reduce,
    "all_to_all": _raw_all_to_all,
    "collective_permute": _raw_collective_permute,
}

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
multidim        data in one part per non-trivial dim, part  as ``torus``
                ``j`` runs ``torus`` with the dims rotated
                by ``j``, all parts in the same steps;
                ``'bidir_ring'`` on one non-trivial dim
tree            all_reduce: NCCL double binary tree,        ``'pairwise'``
                pipelined; other kinds: ``'ring'``
rail            as hierarchical (same positions talk        ``'direct'``
                across nodes: one rail each) but one
                NVSwitch step in node and recursive
                halving/doubling across nodes
==============  ==========================================  ===========================================

``multidim`` is in :mod:`~partir_emu.collectives.alg_torus`, ``tree`` and ``rail`` in
:mod:`~partir_emu.collectives.alg_gpu`.

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
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from partir_emu.collectives import alg_gpu, alg_torus
from partir_emu.collectives.patterns import (
    ArrayStep,
    RawStep,
    Run,
    bidir_ring_arrays,
    list_to_arrays,
    merge,
    pairwise_arrays,
    pairwise_exchange,
    recursive_arrays,
    ring_arrays,
)
from partir_emu.collectives.schedule import KINDS, CollectiveSchedule, check_permutation
from partir_emu.collectives.transfers import TableSteps, TransferTable
from partir_emu.errors import CollectiveError

ALGORITHMS: tuple[str, ...] = ("ring", "bidir_ring", "recursive", "torus", "hierarchical", "multidim", "tree", "rail")
NODE_ALGORITHMS: frozenset[str] = frozenset({"hierarchical", "rail"})   # those that need devices_per_node


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
    return _build(kind, shape, n, actual, itemsize, devices_per_node if actual in NODE_ALGORITHMS else None, perm)


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
def _as_int(value: Any, name: str, what: str) -> int:
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
    if algorithm in NODE_ALGORITHMS and dpn is None:
        raise CollectiveError(
            f"algorithm {algorithm!r} for {kind} over {shape} needs devices_per_node; pass it or pick another")
    if kind == "collective_permute":
        return "direct"
    multi_dim = sum(d > 1 for d in shape) >= 2
    if kind == "all_to_all":
        if algorithm in ("torus", "multidim") and multi_dim:
            return "torus"
        return "direct" if algorithm in NODE_ALGORITHMS else "pairwise"
    if algorithm == "recursive" and p & (p - 1):
        return "ring"
    if algorithm in ("torus", "multidim") and not multi_dim:
        return "bidir_ring"
    # dpn is not None here for a node algorithm (refused above): the check only narrows the type
    if algorithm in NODE_ALGORITHMS and not (dpn is not None and 1 < dpn < p and p % dpn == 0):
        return "ring"
    if algorithm == "tree" and (kind != "all_reduce" or p < 2):
        return "ring"
    return algorithm


def _split(n: int, k: int) -> list[int]:
    """Sizes of ``np.array_split(range(n), k)``."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def _layout(kind: str, algorithm: str, shape: tuple[int, ...], dpn: int | None, nbytes: int
            ) -> tuple[int, list[int]]:
    """``(m, layout)``: pieces per block and the chunk id of each piece, numbered so that
    what the algorithm moves together is a run of consecutive ids."""
    p = math.prod(shape)
    if kind in ("all_to_all", "collective_permute"):
        n = p * p if kind == "all_to_all" else p
        return 1, list(range(n))
    if algorithm in ("bidir_ring", "torus"):  # piece (b, h) -> h*p + b: each direction's half is a run
        return 2, [h * p + b for b in range(p) for h in range(2)]
    if algorithm == "multidim":
        return alg_torus.multidim_layout(shape)
    if algorithm == "tree":  # identity: tree A takes the first half of the chunks, tree B the second
        m = alg_gpu.tree_layout(p, nbytes)
        return m, list(range(p * m))
    if algorithm in NODE_ALGORITHMS:  # block b -> (local index)*q + node: a node-local segment is a run
        assert dpn is not None   # why: _resolve refuses a node algorithm without devices_per_node
        q = p // dpn
        return 1, [(b % dpn) * q + b // dpn for b in range(p)]
    return 1, list(range(p))


@functools.lru_cache(maxsize=512)  # a pure memo: schedules are immutable and a program asks for the same ones often
def _build(kind: str, shape: tuple[int, ...], n: int, algorithm: str, itemsize: int, dpn: int | None,
           perm: tuple[tuple[int, int], ...] | None) -> CollectiveSchedule:
    p = math.prod(shape)
    m, layout = _layout(kind, algorithm, shape, dpn, n * itemsize)
    if kind == "collective_permute":
        piece_elems = [n] * p
    elif kind == "all_to_all":
        piece_elems = [n // p] * (p * p)
    else:
        piece_elems = [e for b in _split(n, p) for e in _split(b, m)]
    chunk_bytes = np.zeros(len(layout), np.int64)
    chunk_bytes[np.asarray(layout, np.int64)] = np.asarray(piece_elems, np.int64) * itemsize
    prefix = np.zeros(len(layout) + 1, np.int64)
    np.cumsum(chunk_bytes, out=prefix[1:])
    raw: Iterable[ArrayStep]
    if algorithm == "tree":
        raw = alg_gpu.tree_all_reduce(p, m, alg_gpu.tree_segments(p, n * itemsize))
    else:
        raw = _RAW[kind](algorithm, shape, dpn, perm)
    table = _table(raw, prefix)
    return CollectiveSchedule(kind=kind, algorithm=algorithm, group_shape=shape, nbytes=n * itemsize,
                              num_chunks=len(layout), steps=TableSteps(table),
                              chunk_bytes=tuple(chunk_bytes.tolist()), itemsize=itemsize, permutation=perm,
                              layout=() if layout == sorted(layout) else tuple(layout))


def _table(raw: Iterable[ArrayStep], prefix: np.ndarray) -> TransferTable:
    """Raw steps as a table: transfers of 0 bytes dropped, a transfer that continues the previous
    one of its step (same src, dst and reduce, next chunk) joined to it, empty steps dropped."""
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    sizes = [0]
    for r in raw:
        src, dst, a, k = (np.asarray(x, np.int64) for x in r[:4])
        red = np.broadcast_to(np.asarray(r[4], bool), src.shape)
        keep = prefix[a + k] > prefix[a]
        if not keep.all():
            src, dst, a, k, red = src[keep], dst[keep], a[keep], k[keep], red[keep]
        if not len(src):
            continue
        new = np.ones(len(src), bool)
        new[1:] = ~((src[1:] == src[:-1]) & (dst[1:] == dst[:-1]) & (red[1:] == red[:-1]) & (a[1:] == a[:-1] + k[:-1]))
        if not new.all():
            first = np.flatnonzero(new)
            k = np.add.reduceat(k, first)
            src, dst, a, red = src[first], dst[first], a[first], red[first]
        for col, x in zip(cols, (src, dst, a, k)):
            col.append(x.astype(np.int32))
        cols[4].append(np.array(red, bool))
        sizes.append(len(src))
    ptr = np.cumsum(sizes, dtype=np.int64)
    if len(sizes) == 1:
        z = np.zeros(0, np.int32)
        return TransferTable(ptr, z, z, z, z, z.astype(bool), prefix=prefix)
    src_a, dst_a, chunk_a, count_a, red_a = (np.concatenate(c) for c in cols)
    return TransferTable(ptr, src_a, dst_a, chunk_a, count_a, red_a, prefix=prefix)


def _flat(algorithm: str, p: int, gather: bool) -> Iterable[ArrayStep]:
    """ring / bidir_ring / recursive over positions 0..p-1."""
    if algorithm == "recursive":
        return recursive_arrays(p, gather=gather)
    b = np.arange(p)
    if algorithm == "bidir_ring":
        return bidir_ring_arrays(b, b, np.ones(p, np.int64), p + b, gather=gather)
    return ring_arrays(b, b, np.ones(p, np.int64), gather=gather)


# ------------------------------------------------------------ hierarchical
def _hier(p: int, d: int, gather: bool) -> Iterable[ArrayStep]:
    """Node-local ring over segments (one run of q blocks per local index), then a ring
    across nodes among equal local indices; all-gather runs the two phases the other way."""
    q = p // d
    nd, lo = np.meshgrid(np.arange(q), np.arange(d), indexing="ij")  # [q, d]
    intra = ring_arrays(nd * d + lo, lo * q, np.full((q, d), q, np.int64), gather=gather)
    inter = ring_arrays((nd * d + lo).T, (lo * q + nd).T, np.ones((d, q), np.int64), gather=gather)
    return itertools.chain(inter, intra) if gather else itertools.chain(intra, inter)


# ------------------------------------------------------------- per kind
def _raw_one_way(algorithm, shape, dpn, gather: bool) -> Iterable[ArrayStep]:
    """all_gather (``gather``) or reduce_scatter: the same pattern, data flowing the other way."""
    if algorithm == "torus":
        return alg_torus.torus(shape, gather)
    if algorithm == "multidim":
        return alg_torus.multidim(shape, gather)
    if algorithm == "hierarchical":
        return _hier(math.prod(shape), dpn, gather)
    if algorithm == "rail":
        return alg_gpu.rail(math.prod(shape), dpn, gather)
    return _flat(algorithm, math.prod(shape), gather)


def _raw_all_gather(algorithm, shape, dpn, perm) -> Iterable[ArrayStep]:
    return _raw_one_way(algorithm, shape, dpn, True)


def _raw_reduce_scatter(algorithm, shape, dpn, perm) -> Iterable[ArrayStep]:
    return _raw_one_way(algorithm, shape, dpn, False)


def _raw_all_reduce(algorithm, shape, dpn, perm) -> Iterable[ArrayStep]:
    return itertools.chain(_raw_reduce_scatter(algorithm, shape, dpn, perm), _raw_all_gather(algorithm, shape, dpn, perm))


def _raw_all_to_all(algorithm, shape, dpn, perm) -> Iterable[ArrayStep]:
    p = math.prod(shape)
    if algorithm == "direct":
        i, j = np.nonzero(~np.eye(p, dtype=bool))
        return [(i, j, i * p + j, np.ones(len(i), np.int64), False)]
    if algorithm == "pairwise":
        return pairwise_arrays(p)
    return list_to_arrays(_torus_all_to_all(shape))


def _torus_all_to_all(shape: tuple[int, ...]) -> list[RawStep]:
    """Route every chunk dim by dim; in phase t it moves along dim t to its destination's coordinate."""
    p = math.prod(shape)
    coords = list(itertools.product(*(range(d) for d in shape)))
    index = {c: i for i, c in enumerate(coords)}
    holder = [i for i in range(p) for _ in range(p)]  # chunk i*p + j starts at i
    steps: list[RawStep] = []
    for t in range(len(shape)):
        if shape[t] == 1:
            continue
        by_member: dict[int, dict[int, list[Run]]] = {}
        for c, h in enumerate(holder):
            dest_v = coords[c % p][t]
            if coords[h][t] != dest_v:
                by_member.setdefault(h, {}).setdefault(dest_v, []).append((c, 1))
        lines = []
        for base in coords:
            if base[t] == 0:
                members = [index[base[:t] + (v,) + base[t + 1:]] for v in range(shape[t])]
                lines.append(pairwise_exchange(members, functools.partial(_held_by, members, by_member)))
        steps += merge(*lines)
        for c, h in enumerate(holder):
            holder[c] = index[coords[h][:t] + (coords[c % p][t],) + coords[h][t + 1:]]
    return steps


def _held_by(members: Sequence[int], by_member: dict[int, dict[int, list[Run]]], k: int, j: int) -> Sequence[Run]:
    """What member ``k`` of ``members`` sends member ``j`` in one pairwise line."""
    return by_member.get(members[k], {}).get(j, ())


def _raw_collective_permute(algorithm, shape, dpn, perm) -> Iterable[ArrayStep]:
    pairs = [(s, d) for s, d in perm if s != d]
    if not pairs:
        return []
    a = np.array(pairs, np.int64)
    return [(a[:, 0], a[:, 1], a[:, 0], np.ones(len(a), np.int64), False)]


_RAW = {
    "all_gather": _raw_all_gather,
    "reduce_scatter": _raw_reduce_scatter,
    "all_reduce": _raw_all_reduce,
    "all_to_all": _raw_all_to_all,
    "collective_permute": _raw_collective_permute,
}

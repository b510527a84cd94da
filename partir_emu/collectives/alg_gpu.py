"""GPU algorithms: NCCL's double binary tree (``tree``) and rail-optimized hierarchical (``rail``).

**tree** (all_reduce only; Sanders et al. 2009, NCCL 2.4): two binary trees over the ``p``
positions, each reducing half of the data up to its root and broadcasting it back down. Tree A is
the balanced in-order tree over positions ``0..p-1``; tree B is the same tree shifted by one
position, so the leaves of A (about half the positions) are inner nodes of B and the load per GPU
is balanced. Each half is cut into ``S`` segments and pipelined: a node of height ``h`` (leaves
0) adds segment ``s`` into its parent at step ``s + h``; a node of depth ``d`` sends segment ``s``
down to its children at step ``H + s + d`` (``H``: the root's height), once the root has it
complete. ``2H + S - 1`` steps, ``H = floor(log2 p)``: latency ``O(log p)``, against ``2(p-1)``
steps for a ring.

**rail** (reduce_scatter, all_gather, all_reduce over nodes of ``d`` GPUs; positions ordered by
node): like ``hierarchical``, position ``lo`` of every node works on segment ``lo`` and talks across
nodes only to position ``lo`` of the other nodes, i.e. to the GPU on its own rail (on a
rail-optimized fabric one leaf switch, no spine, inside a scalable unit). It differs in using each
fabric as the crossbar it is: inside a node one step over NVSwitch (every GPU sends each other GPU
its segment at once) instead of a ring of ``d-1`` steps; across nodes, per rail, recursive halving
/ doubling (``log2 q`` steps; a ring when ``q`` is not a power of two) instead of a ring of ``q-1``.
Same bytes per link as ``hierarchical``, far fewer steps.

Chunk numbering as ``hierarchical``: block ``b = node*d + lo`` is chunk ``lo*q + node``.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import numpy as np

from partir_emu.collectives.patterns import ArrayStep, recursive_arrays, ring_arrays

SEGMENT_BYTES = 1 << 20        # tree pipeline segment per half: below ~2 MiB a tree runs unpipelined (S = 1)
MAX_SEGMENTS = 64
MAX_SEGMENT_TRANSFERS = 1 << 14    # cap S*p so pricing a large tree stays cheap (segments x members)


# -------------------------------------------------------------------------------------------- tree
def tree_segments(p: int, nbytes: int) -> int:
    """Pipeline segments per tree for ``nbytes`` over ``p`` positions."""
    cap = max(1, min(MAX_SEGMENTS, MAX_SEGMENT_TRANSFERS // max(p, 1)))
    return max(1, min(cap, math.ceil(nbytes / 2 / SEGMENT_BYTES)))


def tree_layout(p: int, nbytes: int) -> int:
    """Pieces per block of the tree schedule: even, and enough for ``tree_segments`` per half."""
    return 2 * math.ceil(tree_segments(p, nbytes) / p)


def _in_order_tree(p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(parent, height, depth)`` of the balanced in-order binary tree over ``0..p-1`` (root: parent -1)."""
    parent = np.full(p, -1, np.int64)
    height = np.zeros(p, np.int64)
    depth = np.zeros(p, np.int64)

    def build(lo: int, hi: int, par: int, d: int) -> int:
        if lo > hi:
            return -1
        mid = (lo + hi) // 2
        parent[mid], depth[mid] = par, d
        hs = [height[c] for c in (build(lo, mid - 1, mid, d + 1), build(mid + 1, hi, mid, d + 1)) if c >= 0]
        height[mid] = 1 + max(hs) if hs else 0
        return mid

    build(0, p - 1, -1, 0)
    return parent, height, depth


def _tree_steps(p: int, label: np.ndarray, segs: np.ndarray, sizes: np.ndarray) -> list[list[ArrayStep]]:
    """Per step, the transfers of one pipelined tree whose node ``i`` is position ``label[i]``;
    segment ``s`` is the chunk run ``(segs[s], sizes[s])``."""
    parent, height, depth = _in_order_tree(p)
    root_h = int(height.max())
    S = len(segs)
    nodes = np.flatnonzero(parent >= 0)                 # every non-root node, in position order
    steps: list[list[ArrayStep]] = [[] for _ in range(2 * root_h + S - 1)]
    for s in range(S):
        for h in np.unique(height[nodes]):
            v = nodes[height[nodes] == h]               # senders of height h add segment s at step s + h
            steps[s + h].append((label[v], label[parent[v]], np.full(len(v), segs[s]), np.full(len(v), sizes[s]), True))
        for d in np.unique(depth[nodes]):
            v = nodes[depth[nodes] == d]                # receivers at depth d, sent at step H + s + d - 1
            steps[root_h + s + d - 1].append((label[parent[v]], label[v], np.full(len(v), segs[s]),
                                              np.full(len(v), sizes[s]), False))
    return steps


def tree_all_reduce(p: int, m: int, segments: int) -> Iterator[ArrayStep]:
    """The double binary tree over ``p`` positions and ``p*m`` chunks (tree A: the first half), each
    half pipelined in ``segments`` runs of chunks."""
    half = p * m // 2
    runs = [len(r) for r in np.array_split(np.arange(half), min(half, segments)) if len(r)]
    segs = np.cumsum([0] + runs[:-1])
    sizes = np.asarray(runs)
    k = np.arange(p)
    trees = [_tree_steps(p, k, segs, sizes)]
    if p > 2:
        trees.append(_tree_steps(p, (k + 1) % p, segs + half, sizes))
    else:                                               # two members: one edge; B sends the other way
        trees.append(_tree_steps(p, k[::-1].copy(), segs + half, sizes))
    for parts in itertools.zip_longest(*trees, fillvalue=[]):
        flat = [a for part in parts for a in part]
        if flat:
            yield _concat(flat)


def _concat(steps: list[ArrayStep]) -> ArrayStep:
    red = np.concatenate([np.broadcast_to(np.asarray(s[4], bool), (len(s[0]),)) for s in steps])
    src, dst, first, count = (np.concatenate([np.asarray(s[i], np.int64) for s in steps]) for i in range(4))
    return src, dst, first, count, red


# -------------------------------------------------------------------------------------------- rail
def _direct_in_node(q: int, d: int, gather: bool) -> list[ArrayStep]:
    """One step over NVSwitch on every node: member ``lo`` sends each other member ``lo2`` segment
    ``lo2`` (reduce-scatter: its contribution, added) or its own segment ``lo`` (all-gather)."""
    if d < 2:
        return []
    nd, lo, lo2 = (x.ravel() for x in np.meshgrid(np.arange(q), np.arange(d), np.arange(d), indexing="ij"))
    keep = lo != lo2
    nd, lo, lo2 = nd[keep], lo[keep], lo2[keep]
    seg = lo if gather else lo2
    return [(nd * d + lo, nd * d + lo2, seg * q, np.full(len(nd), q), not gather)]


def _across_nodes(q: int, d: int, gather: bool) -> Iterable[ArrayStep]:
    """Per rail ``lo``, the segment's ``q`` chunks reduce-scattered / all-gathered across the nodes:
    recursive halving / doubling when ``q`` is a power of two, else a ring."""
    if q & (q - 1):
        nd, lo = np.meshgrid(np.arange(q), np.arange(d), indexing="ij")
        return ring_arrays((nd * d + lo).T, (lo * q + nd).T, np.ones((d, q), np.int64), gather=gather)
    out: list[ArrayStep] = []
    for src, dst, first, count, red in recursive_arrays(q, gather=gather):
        rail = np.repeat(np.arange(d), q)
        out.append((np.tile(src, d) * d + rail, np.tile(dst, d) * d + rail, rail * q + np.tile(first, d),
                    np.tile(count, d), red))
    return out


def rail(p: int, d: int, gather: bool) -> Iterable[ArrayStep]:
    """``rail`` reduce-scatter (in node, then across nodes per rail) or all-gather (the reverse)."""
    q = p // d
    if gather:
        return itertools.chain(_across_nodes(q, d, True), _direct_in_node(q, d, True))
    return itertools.chain(_direct_in_node(q, d, False), _across_nodes(q, d, False))

"""The asynchronous critical path of a collective whose members drift apart (uneven steps).

The lock-step price (:meth:`.contention.Fabric.price`: each step as long as its slowest message,
steps summed) assumes every member starts step ``s + 1`` together. Real runtimes have no barrier
per step: the MPI executor posts a step's receives while the previous step is in flight
(:mod:`partir_emu.mpi.ranks.steps`), and NCCL's connections have receive buffers posted ahead
of the kernel; so a member enters step ``s + 1`` as soon as its own messages of step ``s`` are
delivered and sends at once (the DES runs exactly this, :mod:`.des.collective`). With uneven steps
(a slow link: degraded, or a detour sharing another GPU's NIC; routes of different lengths; a NIC
serving more messages than others, or messages of different sizes) that has effects the lock-step
sum misses:

- members away from the slow link run ahead (the critical path can be *shorter* than the sum). The
  double binary tree across nodes shows it most: some edges cross the spine, a parent's NIC serves
  two children, and members wait only for their own: on 8 H100 nodes at 4 KiB the DES takes 16.4 us,
  the lock-step sum 22.4 us (``benchmarks/tree_gpu.py``);
- messages of different sizes on one link share it fairly: the small one is done first and the large
  one then has the link to itself (a fixed ``bw / k`` share would charge it ``k`` times its bytes);
- an early member's next-step message to the slow member crosses the slow member's link *while* the
  message the slow member still waits for is arriving; the link is shared fairly (InfiniBand and
  NVLink arbitrate per flow), so the awaited message is delayed by what the early one takes of the
  link, and the slow member's own next send (which needs the data it awaits) starts that much later.
  Measured on 32 H100 (4 nodes), ``rail`` all-reduce of 64 MB, NIC ``0-leaf0`` at 1/4: member 0's
  4 MB halving message takes 0.482 ms instead of 0.322 ms because member 8's 2 MB next-step
  message arrives over the same link (0.16 ms); the DES takes 1.541 ms, the lock-step sum 1.221 ms.

:func:`async_critical_path` walks the steps with per-member entry times (every group, member
``g * p + position``): a message leaves when its sender enters the step and takes its latency plus
the time its bytes need on its slowest link, the step's messages over each link sharing it fairly
(processor sharing, :func:`_fair_busy`; messages that start apart compete only while both send,
:func:`_staggered_busy`); a member enters the next step when all its messages of this step are done.
Next-step messages whose sender enters early, and that cross the bottleneck link of a still-running
message, delay it (and are delayed) by the bytes they move on that link meanwhile (processor sharing:
``min(their bytes, its remaining bytes) / link bandwidth``). The price of an uneven collective is this
path (:meth:`.contention.Fabric.price`), within 5 % of the DES on the tree across 2-64 H100 nodes up
to 8 MiB (``tests/unit/test_tree_across_nodes.py``).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from partir_emu.hwmodels.machine.links import Router
from partir_emu.hwmodels.network.messages import Messages


class Fabric(Protocol):
    """What the asynchronous critical path reads of a :class:`.contention.Fabric`: its router and
    the routes of a step pattern's flows (``pattern(...).links``: per flow, its link ids, -1 padded)."""

    router: Router

    def pattern(self, token: int, chips: np.ndarray, pairs: np.ndarray, p: int) -> Any: ...


_PAIR_CAP = 64                 # flows over one link priced pairwise with their start times
DRIFT_S = 1e-9
"""Messages of a step whose times differ by less than this finish together in the DES (its resolution,
:mod:`.des.network`): below it a step is even."""
_MAX_MEMO = 256                # step shapes and (shape, bytes) kept per collective


class _Flows(NamedTuple):
    """One step's messages in every group: flow ``g * K + k`` is message ``k`` of group ``g``."""

    src: np.ndarray               # member ids
    dst: np.ndarray
    x: np.ndarray                 # bytes
    lat: np.ndarray               # route latency
    inv: np.ndarray               # seconds per byte through its slowest link, shared fairly (``busy`` / x)
    load: np.ndarray              # per link id: messages of the step crossing it
    links: np.ndarray             # [F, H] route link ids, -1 padded
    busy: np.ndarray              # [F, H] seconds it needs on each link of its route, shared fairly


def _flows(fab: Fabric, msgs: Messages, s: int, token: int, chips: np.ndarray, memo: dict
           ) -> _Flows:
    """Step ``s``'s flows; ``memo`` keeps their routes per step shape (a ring repeats one shape every
    step), and their times per shape and bytes."""
    G, p = chips.shape
    lo, hi = int(msgs.ptr[s]), int(msgs.ptr[s + 1])
    pairs, nbytes = msgs.pair[lo:hi], msgs.nbytes[lo:hi]
    key = pairs.tobytes()
    full = key + nbytes.tobytes()
    hit = memo.get(full)
    if hit is not None:
        return hit
    shape = memo.get(key)
    if shape is None:
        links = fab.pattern(token, chips, pairs, p).links
        router = fab.router
        valid = links >= 0
        load = np.bincount(links[valid], minlength=router.num_links).astype(np.float64)
        lat = np.where(valid, router.latency[np.where(valid, links, 0)], 0.0).sum(axis=1)
        base = (np.arange(G, dtype=np.int64) * p)[:, None]
        none = np.zeros(0)                                     # x, inv, busy: per step's bytes, below
        shape = memo[key] = _Flows((base + pairs // p).ravel(), (base + pairs % p).ravel(), none, lat,
                                   none, load, links, none)
    x = np.tile(nbytes, G)
    busy = _fair_busy(shape.links, x, fab.router.bw, shape.load)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(x > 0, busy.max(axis=1, initial=0.0) / np.where(x > 0, x, 1.0), 0.0)
    hit = shape._replace(x=x, inv=inv, busy=busy)
    if len(memo) < _MAX_MEMO:                                  # steps of one shape often repeat their bytes too
        memo[full] = hit
    return hit


def _fair_busy(links: np.ndarray, x: np.ndarray, bw: np.ndarray, load: np.ndarray) -> np.ndarray:
    """``[F, H]`` seconds each flow needs on each link of its route when the step's flows over that
    link (``load[link]`` of them) start together and share it fairly (processor sharing, as the DES's
    max-min rates on one link): flow ``k`` is done after ``sum_j min(x_j, x_k) / bw``. Flows of equal
    size give the lock-step share ``k x / bw``; a small flow leaves the link to a larger one once it
    is done."""
    busy = np.zeros(links.shape)
    f, h = np.nonzero(links >= 0)
    if not f.size:
        return busy
    lk, xs = links[f, h], x[f]
    if xs.min() == xs.max():                                   # one size: the lock-step share, no sort
        busy[f, h] = xs * load[lk] / bw[lk]
        return busy
    order = np.lexsort((xs, lk))                               # by link, then size
    f, h, lk, xs = f[order], h[order], lk[order], xs[order]
    first = np.flatnonzero(np.r_[True, lk[1:] != lk[:-1]])
    gid = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(lk)]))
    n = np.diff(np.r_[first, len(lk)])[gid]
    rank = np.arange(len(lk)) - first[gid]
    smaller = np.cumsum(xs) - xs                               # bytes of the link's smaller flows
    smaller -= smaller[first][gid]
    busy[f, h] = (smaller + (n - rank) * xs) / bw[lk]
    return busy


def _ragged(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])``, vectorised."""
    total = int(lens.sum())
    offsets = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return offsets + np.arange(total)


class _Pairs(NamedTuple):
    """The ordered pairs of a step shape's flows that share a link (of at most ``_PAIR_CAP`` flows):
    pair ``i`` is flows ``fa[i]`` and ``fb[i]`` on cell ``cell[i]`` (cell = one link of one flow's
    route); cell ``j`` is hop ``h[j]`` of flow ``f[j]``, over link ``lk[j]``."""

    fa: np.ndarray
    fb: np.ndarray
    cell: np.ndarray
    f: np.ndarray
    h: np.ndarray
    lk: np.ndarray


def _pairs(links: np.ndarray) -> _Pairs | None:
    f, h = np.nonzero(links >= 0)
    if not f.size:
        return None
    lk = links[f, h]
    order = np.argsort(lk, kind="stable")
    f, h, lk = f[order], h[order], lk[order]
    first = np.flatnonzero(np.r_[True, lk[1:] != lk[:-1]])
    n = np.diff(np.r_[first, len(lk)])
    ok = (n > 1) & (n <= _PAIR_CAP)
    if not ok.any():
        return None
    g_first, g_n = first[ok], n[ok]
    cells = _ragged(g_first, g_n)                              # the cells of those links
    per = np.repeat(g_n, g_n)                                  # each cell's link: its flow count
    a = np.repeat(cells, per)                                  # every ordered pair of flows on a link
    b = _ragged(np.repeat(g_first, g_n), per)
    at = np.empty(len(lk), dtype=np.int64)                     # cell -> its row among `cells`
    at[cells] = np.arange(len(cells))
    return _Pairs(f[a], f[b], at[a], f[cells], h[cells], lk[cells])


def _staggered_busy(cur: _Flows, r: np.ndarray, bw: np.ndarray, memo: dict) -> np.ndarray:
    """``busy`` with the flows' own start times ``r``: on a link, a flow that started earlier competes
    only with the bytes it still has left when the other starts (at its fair-share rate so far), and
    one that starts later only while the other still sends; flows that start together give
    :func:`_fair_busy`. Links with more than ``_PAIR_CAP`` flows keep the simultaneous share. Which
    flows share a link depends on the step's shape only: ``memo`` keeps it per shape."""
    busy = cur.busy.copy()
    key = ("pairs", id(cur.links))                             # (the shape's links: one array per shape)
    if key not in memo:
        memo[key] = (_pairs(cur.links), cur.links)             # (holding the array keeps its id unique)
    pr = memo[key][0]
    if pr is None:
        return busy
    with np.errstate(divide="ignore"):
        rate = np.where(cur.inv > 0, 1.0 / np.where(cur.inv > 0, cur.inv, 1.0), 0.0)   # bytes/s so far
    fa, fb = pr.fa, pr.fb
    d = r[fa] - r[fb]                                          # how much later a started than b
    left_b = np.maximum(cur.x[fb] - np.maximum(d, 0.0) * rate[fb], 0.0)     # b's bytes left when a starts
    left_a = np.maximum(cur.x[fa] - np.maximum(-d, 0.0) * rate[fa], 0.0)    # (a with itself: its bytes)
    tot = np.bincount(pr.cell, weights=np.minimum(left_a, left_b), minlength=len(pr.f))
    busy[pr.f, pr.h] = tot / bw[pr.lk]
    return busy


def _cells(links: np.ndarray, memo: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(flow, hop, link)`` of every link of every route in ``links`` (cached per step shape: a ring
    asks for the same shape at every step)."""
    key = ("cells", id(links))
    hit = memo.get(key)
    if hit is None:
        f, h = np.nonzero(links >= 0)
        hit = memo[key] = (f, h, links[f, h], links)          # (holding the array keeps its id unique)
    return hit[0], hit[1], hit[2]


def _interference(cur: _Flows, r: np.ndarray, f0: np.ndarray, nxt: _Flows, rho: np.ndarray,
                  bw: np.ndarray, memo: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(delay per link, delay per next-step flow)``: a next-step flow sent at ``rho`` while the
    message that crosses one of its links last (sent from ``r``; delivered at ``f0`` without it, a
    route's latency after its last byte left, as in the DES) is still sending shares that link with
    it for ``min(its bytes, that message's bytes left)``."""
    L = len(bw)
    k, h, kl = _cells(cur.links, memo)
    sent = f0 - cur.lat                                       # its last byte leaves (then: latency)
    last = np.full(L, -np.inf)
    np.maximum.at(last, kl, sent[k])
    crit = np.full(L, -1, dtype=np.int64)                     # the message sending last on each link
    top = sent[k] == last[kl]
    crit[kl[top]] = k[top]
    j, h, link = _cells(nxt.links, memo)
    c = crit[link]
    keep = c >= 0
    j, link, c = j[keep], link[keep], c[keep]
    early = rho[j] < last[link] * (1 - 1e-12)
    j, link, c = j[early], link[early], c[early]
    left = np.maximum(cur.x[c] - np.maximum(0.0, rho[j] - r[c]) / cur.inv[c], 0.0)
    # what the early flow moves over the link while both send: no more than the message's bytes left
    # (fair sharing), nor than its own bottleneck lets through in the time they overlap
    both = np.minimum(last[link], rho[j] + nxt.x[j] * nxt.inv[j]) - np.maximum(rho[j], r[c])
    moved = np.minimum(left, np.maximum(both, 0.0) / nxt.inv[j])
    over = moved / bw[link]
    delay = np.zeros(L)
    np.add.at(delay, link, over)
    extra = np.zeros(len(nxt.x))
    np.add.at(extra, j, over)
    return delay, extra


def _delayed(cur: _Flows, r: np.ndarray, f0: np.ndarray, delay: np.ndarray, memo: dict) -> np.ndarray:
    """When each message is done: on every link of its route it needs its bytes at its fair share of
    the link (``busy``) plus the link time the early flows took (work conservation on the link)."""
    k, h, kl = _cells(cur.links, memo)
    if not k.size:
        return f0
    on_link = r[k] + cur.lat[k] + cur.busy[k, h] + (f0 - r - cur.lat - cur.x * cur.inv)[k] + delay[kl]
    done = f0.copy()
    np.maximum.at(done, k, on_link)
    return done


def drifts(times: np.ndarray, inv: np.ndarray, nbytes: np.ndarray, skewed: bool) -> bool:
    """Whether members drift apart in some of these steps: two messages that move (``inv > 0``) take
    times more than :data:`DRIFT_S` apart (``times[steps, U, K]``, ``inv[U, K]``, ``nbytes[steps, K]``).
    ``skewed``: the routes or link shares differ; if not, only bytes that differ can make times differ.
    Below :data:`DRIFT_S` (an uneven split's one element more per chunk, an empty chunk) the DES
    finishes them together, at the latest, i.e. in lock step."""
    if not skewed and bool((nbytes.max(axis=1) == nbytes.min(axis=1)).all()):
        return False
    moves = np.broadcast_to(inv[None, :, :] > 0, times.shape)
    hi = np.where(moves, times, -np.inf).max(axis=(1, 2))
    lo = np.where(moves, times, np.inf).min(axis=(1, 2))
    return bool((hi - lo > DRIFT_S).any())


def async_critical_path(fab: Fabric, msgs: Messages, token: int, chips: np.ndarray, memo: dict | None = None
                        ) -> float:
    """Seconds until the last member of any group ``chips`` finishes (module docstring). ``memo``: step
    shapes and their flows (:func:`_flows`), link-sharing pairs (:func:`_staggered_busy`) and route
    cells, for these groups on ``fab`` only (the caller keeps one per groups token: collectives of one
    kind over the same groups, whatever their bytes, repeat the same step shapes); default a new one."""
    steps = np.flatnonzero(np.diff(msgs.ptr)).tolist()
    if not steps:
        return 0.0
    entry = np.zeros(chips.size)
    bw = fab.router.bw
    memo = {} if memo is None else memo
    cur = _flows(fab, msgs, steps[0], token, chips, memo)
    extra = np.zeros(len(cur.x))
    for i in range(len(steps)):
        nxt = _flows(fab, msgs, steps[i + 1], token, chips, memo) if i + 1 < len(steps) else None
        r = entry[cur.src]
        if r.size and float(r.max() - r.min()) > DRIFT_S:          # members apart: flows start at their own times
            busy = _staggered_busy(cur, r, bw, memo)
            with np.errstate(divide="ignore", invalid="ignore"):
                inv = np.where(cur.x > 0, busy.max(axis=1, initial=0.0) / np.where(cur.x > 0, cur.x, 1.0), 0.0)
            cur = cur._replace(busy=busy, inv=inv)
        f0 = r + cur.lat + cur.x * cur.inv + extra
        done = f0
        if nxt is not None:
            ahead = entry.copy()                                 # next-step entry times without the delays
            np.maximum.at(ahead, cur.src, f0)
            np.maximum.at(ahead, cur.dst, f0)
            delay, extra = _interference(cur, r, f0, nxt, ahead[nxt.src], bw, memo)
            done = _delayed(cur, r, f0, delay, memo)
        np.maximum.at(entry, cur.src, done)
        np.maximum.at(entry, cur.dst, done)
        if nxt is None:
            break
        cur = nxt
    return float(entry.max())

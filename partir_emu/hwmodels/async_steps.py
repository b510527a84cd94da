"""The asynchronous critical path of a collective whose members drift apart (uneven steps).

The lock-step price (:meth:`.contention.Fabric.price`: each step as long as its slowest message,
steps summed) assumes every member starts step ``s + 1`` together. Real runtimes have no barrier
per step: the MPI executor posts a step's receives while the previous step is in flight
(:mod:`partir_emu.collectives.mpi_steps`), and NCCL's connections have receive buffers posted ahead
of the kernel; so a member enters step ``s + 1`` as soon as its own messages of step ``s`` are
delivered and sends at once (the DES runs exactly this, :mod:`.des.collective`). With a slow link
(degraded, or a detour sharing another GPU's NIC) that has two effects the lock-step sum misses:

- members away from the slow link run ahead (the critical path can be *shorter* than the sum);
- an early member's next-step message to the slow member crosses the slow member's link *while* the
  message the slow member still waits for is arriving; the link is shared fairly (InfiniBand and
  NVLink arbitrate per flow), so the awaited message is delayed by what the early one takes of the
  link, and the slow member's own next send (which needs the data it awaits) starts that much later.
  Measured on 32 H100 (4 nodes), ``rail`` all-reduce of 64 MB, NIC ``0-leaf0`` at 1/4: member 0's
  4 MB halving message takes 0.482 ms instead of 0.322 ms because member 8's 2 MB next-step
  message arrives over the same link (0.16 ms); the DES takes 1.541 ms, the lock-step sum 1.221 ms.

:func:`async_critical_path` walks the steps with per-member entry times (every group, member
``g * p + position``): a message leaves when its sender enters the step and takes its latency plus
its bytes at its lock-step share of its bottleneck link; a member enters the next step when all its
messages of this step are done. Next-step messages whose sender enters early, and that cross the
bottleneck link of a still-running message, delay it (and are delayed) by the bytes they move on
that link meanwhile (processor sharing: ``min(their bytes, its remaining bytes) / link bandwidth``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:                     # why: contention imports this module (no cycle at run time)
    from partir_emu.hwmodels.contention import Fabric, Messages


class _Flows(NamedTuple):
    """One step's messages in every group: flow ``g * K + k`` is message ``k`` of group ``g``."""

    src: np.ndarray               # member ids
    dst: np.ndarray
    x: np.ndarray                 # bytes
    lat: np.ndarray               # route latency
    inv: np.ndarray               # seconds per byte at the lock-step share of the bottleneck
    load: np.ndarray              # per link id: messages of the step crossing it
    links: np.ndarray             # [F, H] route link ids, -1 padded


def _flows(fab: Fabric, msgs: Messages, s: int, token: int, chips: np.ndarray, memo: dict[bytes, _Flows]
           ) -> _Flows:
    """Step ``s``'s flows; ``memo`` keeps them per step shape (a ring repeats one shape every step)."""
    G, p = chips.shape
    lo, hi = int(msgs.ptr[s]), int(msgs.ptr[s + 1])
    pairs = msgs.pair[lo:hi]
    key = pairs.tobytes()
    hit = memo.get(key)
    if hit is not None:
        return hit._replace(x=np.tile(msgs.nbytes[lo:hi], G))
    links = fab._pattern(token, chips, pairs, p).links
    router = fab.router
    valid = links >= 0
    ids = np.where(valid, links, 0)
    load = np.bincount(links[valid], minlength=router.num_links).astype(np.float64)
    share = np.where(valid, router.bw[ids] / np.maximum(load[ids], 1.0), np.inf)
    with np.errstate(divide="ignore"):
        inv = 1.0 / share.min(axis=1)
    lat = np.where(valid, router.latency[ids], 0.0).sum(axis=1)
    base = (np.arange(G, dtype=np.int64) * p)[:, None]
    hit = memo[key] = _Flows((base + pairs // p).ravel(), (base + pairs % p).ravel(),
                             np.tile(msgs.nbytes[lo:hi], G), lat, inv, load, links)
    return hit


def _interference(cur: _Flows, r: np.ndarray, f0: np.ndarray, nxt: _Flows, rho: np.ndarray,
                  bw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(delay per link, delay per next-step flow)``: a next-step flow sent at ``rho`` while the
    message that crosses one of its links last (sent from ``r``; delivered at ``f0`` without it, a
    route's latency after its last byte left, as in the DES) is still sending shares that link with
    it for ``min(its bytes, that message's bytes left)``."""
    L = len(bw)
    k, h = np.nonzero(cur.links >= 0)
    kl = cur.links[k, h]
    sent = f0 - cur.lat                                       # its last byte leaves (then: latency)
    last = np.full(L, -np.inf)
    np.maximum.at(last, kl, sent[k])
    crit = np.full(L, -1, dtype=np.int64)                     # the message sending last on each link
    top = sent[k] == last[kl]
    crit[kl[top]] = k[top]
    j, h = np.nonzero(nxt.links >= 0)
    link = nxt.links[j, h]
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


def _delayed(cur: _Flows, r: np.ndarray, f0: np.ndarray, delay: np.ndarray, bw: np.ndarray) -> np.ndarray:
    """When each message is done: on every link of its route it needs its bytes at that link's
    lock-step share plus the link time the early flows took (work conservation on the link)."""
    k, h = np.nonzero(cur.links >= 0)
    if not k.size:
        return f0
    kl = cur.links[k, h]
    on_link = r[k] + cur.lat[k] + cur.x[k] * cur.load[kl] / bw[kl] + (f0 - r - cur.lat - cur.x * cur.inv)[k] + delay[kl]
    done = f0.copy()
    np.maximum.at(done, k, on_link)
    return done


def async_critical_path(fab: Fabric, msgs: Messages, token: int, chips: np.ndarray) -> float:
    """Seconds until the last member of any group ``chips`` finishes (module docstring)."""
    steps = np.flatnonzero(np.diff(msgs.ptr)).tolist()
    if not steps:
        return 0.0
    entry = np.zeros(chips.size)
    bw = fab.router.bw
    memo: dict[bytes, _Flows] = {}
    cur = _flows(fab, msgs, steps[0], token, chips, memo)
    extra = np.zeros(len(cur.x))
    for i in range(len(steps)):
        nxt = _flows(fab, msgs, steps[i + 1], token, chips, memo) if i + 1 < len(steps) else None
        r = entry[cur.src]
        f0 = r + cur.lat + cur.x * cur.inv + extra
        done = f0
        if nxt is not None:
            ahead = entry.copy()                                 # next-step entry times without the delays
            np.maximum.at(ahead, cur.src, f0)
            np.maximum.at(ahead, cur.dst, f0)
            delay, extra = _interference(cur, r, f0, nxt, ahead[nxt.src], bw)
            done = _delayed(cur, r, f0, delay, bw)
        np.maximum.at(entry, cur.src, done)
        np.maximum.at(entry, cur.dst, done)
        if nxt is None:
            break
        cur = nxt
    return float(entry.max())

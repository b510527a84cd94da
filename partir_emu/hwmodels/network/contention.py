"""Contention-aware pricing of a collective schedule: every group at once, each link shared by its load.

A collective over mesh axes runs in every group over those axes at the same time (the DES runs them
all, :func:`~.des.collective.make_groups`). A :class:`Fabric` prices one step of the schedule from
the messages of *every* group: a directed link crossed by ``k`` messages of the step (whatever their
group) gives each ``bw / k``; a message takes ``sum of its links' latencies + nbytes / its bottleneck
bandwidth``; a step lasts as long as its slowest message; a collective is the sum of its steps. With
one group, or groups on disjoint links, this is the per-group alpha–beta closed form.

Routes and bandwidths come from a :class:`~partir_emu.hwmodels.machine.links.Router`, so degraded links (``bw × factor``) and
failed links (routes detour around them) are priced as the DES sees them.

Everything is vectorised: a step's flows (messages × groups) form a *pattern* (their routes as a
padded link-id matrix, the per-flow latency and seconds per byte); steps with the same
``(src, dst)`` pairs share one pattern, built once (rings repeat one pattern every step), and all
steps of a pattern are priced in one array expression. Link loads are ``np.bincount`` over the
pattern's link ids.

A price is two passes: :meth:`Fabric.lockstep` (the lock-step sum, whether members drift apart, and on
request a lower bound of the price: each member's own messages alone on their routes, step after step)
and :meth:`Fabric.settle` (the asynchronous critical path when they drift). A caller choosing among
candidate schedules settles only those whose bound can still win (:mod:`.comm`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.hwmodels.machine.links import Router
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.topology import Topology
from partir_emu.hwmodels.network.async_steps import async_critical_path, drifts
from partir_emu.hwmodels.network.messages import Messages, schedule_messages

_MAX_PATTERN_CELLS = 1 << 24  # link-id cells of the patterns kept per fabric (128 MiB); past that it starts afresh
_BLOCK = 1 << 22              # elements per priced block of steps (bounds the temporary arrays)
_MAX_ASYNC_MEMO = 1024        # entries of an asynchronous critical path's memo kept per groups (then afresh)


@dataclass(frozen=True)
class Pattern:
    """The flows of one step pattern run by every group: flow ``g * K + k`` is message ``k`` of group ``g``."""

    links: np.ndarray          # int64 [G*K, H] link ids, -1 padded
    lat: np.ndarray            # float64 [U, K]: per distinct group row, each message's route latency
    inv_bw: np.ndarray         # float64 [U, K]: seconds per byte at the message's shared bottleneck (0: no link)
    hops: int                  # longest route
    lat_f: np.ndarray          # float64 [G*K]: per flow, its route latency
    inv_f: np.ndarray          # float64 [G*K]: per flow, seconds per byte through its slowest link alone
    by_src: np.ndarray         # int64 [G*K]: the flows ordered by sending member (``g * p + src``)
    src_first: np.ndarray      # int64: where each sending member's flows start in ``by_src``
    senders: np.ndarray        # int64: those members


class Lockstep(NamedTuple):
    """What one pass over a schedule's steps finds (:meth:`Fabric.lockstep`)."""

    seconds: float             # the lock-step sum: the price when ``uneven`` is False
    uneven: bool               # members drift apart: the price is the asynchronous critical path
    floor: float               # a lower bound of the price either way (:meth:`Fabric.lockstep`)
    messages: int              # messages of one group
    hops: int                  # longest route


def _uneven(pat: Pattern) -> bool:
    """Whether the network treats the messages of a step differently (routes of different latency or
    bottleneck share: faults, detours, mixed hops), so that members drift apart. Bytes that differ
    by an uneven split (one element per chunk) do not count: they leave the lock-step sum exact."""
    moves = pat.inv_bw > 0
    if not moves.any():
        return False
    lat, inv = pat.lat[moves], pat.inv_bw[moves]
    return bool(lat.max() - lat.min() > 1e-9 * lat.max() or inv.max() - inv.min() > 1e-9 * inv.max())


def _add_floor(own: np.ndarray, pat: Pattern, nb: np.ndarray) -> None:
    """Add to each sending member's ``own`` the sum, over the steps ``nb`` (``[steps, K]`` bytes), of its
    slowest message of the step alone on its route (:meth:`Fabric.lockstep`)."""
    G = len(pat.lat_f) // max(1, nb.shape[1])
    per = max(1, _BLOCK // max(1, len(pat.lat_f)))
    for lo in range(0, len(nb), per):
        t = pat.lat_f[None, :] + np.tile(nb[lo:lo + per], (1, G)) * pat.inv_f[None, :]
        own[pat.senders] += np.maximum.reduceat(t[:, pat.by_src], pat.src_first, axis=1).sum(axis=0)


class Fabric:
    """Routes and effective link bandwidths of a topology with its faults (``link_factors``:
    ``{link id: factor}``, 0 = failed), and the contention-aware prices of schedules on it.
    :meth:`groups` needs the ``placement`` (the mesh on this topology)."""

    def __init__(self, topology: Topology, link_factors: Mapping[int, float] | None = None,
                 placement: Placement | None = None, router: Router | None = None) -> None:
        self.placement = placement
        self.router = router if router is not None else Router(topology, link_factors)
        self._groups: dict[tuple, tuple[int, np.ndarray]] = {}
        self._chip_table: np.ndarray | None = None
        self._patterns: dict[tuple[int, bytes], Pattern] = {}
        self._cells = 0                                       # link-id cells held by the patterns
        self.link_bytes_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._async: dict[int, dict] = {}                    # per groups token: async_critical_path's memo

    @property
    def link_bw(self) -> np.ndarray:
        """Bandwidth of each link id in bytes/s, degraded factors applied (failed: 0)."""
        return self.router.bw

    # -- groups ------------------------------------------------------------------------------------
    def groups(self, axes: tuple[str, ...], chips: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """``(token, chips[G, p])``: every group over ``axes``, positions in the order ``chips`` gives the
        representative group (the one of device 0), as :func:`~.des.collective.make_groups` orders them
        (GPU: each group by node, then chip). ``token`` names the array in the pattern cache."""
        key = (axes, chips)
        hit = self._groups.get(key)
        if hit is None:
            hit = self._groups[key] = (len(self._groups), self._build_groups(axes, chips))
        return hit

    def _build_groups(self, axes: tuple[str, ...], chips: tuple[int, ...]) -> np.ndarray:
        pl = self.placement
        assert pl is not None, "Fabric.groups needs the placement"
        topo = pl.topology
        table = self._chip_table
        if table is None:                                      # device -> chip, once per fabric
            table = self._chip_table = np.array([pl.chip_of(d) for d in range(pl.mesh.size)], dtype=np.int64)
        rows = table[np.array(pl.mesh.groups(axes), dtype=np.int64)]          # [G, p], mesh order
        rep = rows[0].tolist()
        if topo.kind == "gpu" and list(chips) == sorted(rep, key=lambda c: (topo.node_of(c), c)):
            node = np.array([topo.node_of(c) for c in range(topo.num_chips)], dtype=np.int64)
            order = np.lexsort((rows, node[rows]), axis=1)
            return np.take_along_axis(rows, order, axis=1)
        at = {c: j for j, c in enumerate(rep)}
        return rows[:, [at[c] for c in chips]]

    # -- patterns ----------------------------------------------------------------------------------
    def pattern(self, token: int, chips: np.ndarray, pairs: np.ndarray, p: int) -> Pattern:
        """The flows of one step pattern (``pairs``: its ``src * p + dst``) run by every group of
        ``chips``, kept by ``(token, pairs)`` (``token``: the caller's key for ``chips``)."""
        key = (token, pairs.tobytes())
        pat = self._patterns.get(key)
        if pat is None:
            pat = self._build_pattern(chips, pairs, p)
            if self._cells + pat.links.size > _MAX_PATTERN_CELLS:
                self._patterns.clear()
                self._cells = 0
            self._patterns[key] = pat
            self._cells += pat.links.size
        return pat

    def _build_pattern(self, chips: np.ndarray, pairs: np.ndarray, p: int) -> Pattern:
        G, K = chips.shape[0], len(pairs)
        links = self.router.route_matrix(chips[:, pairs // p].ravel(), chips[:, pairs % p].ravel())
        valid = links >= 0
        hops = int(valid.sum(axis=1).max(initial=0))
        ids = np.where(valid, links, 0)
        load = np.bincount(links[valid], minlength=self.router.num_links).astype(np.float64)
        with np.errstate(divide="ignore"):
            share = np.where(valid, self.router.bw[ids] / np.maximum(load[ids], 1.0), np.inf)
            inv = 1.0 / share.min(axis=1)                      # 0 for a flow that crosses no link
        lat = np.where(valid, self.router.latency[ids], 0.0).sum(axis=1)
        with np.errstate(divide="ignore"):
            inv_f = 1.0 / np.where(valid, self.router.bw[ids], np.inf).min(axis=1, initial=np.inf)
        src = ((np.arange(G, dtype=np.int64) * p)[:, None] + pairs[None, :] // p).ravel()
        by_src = np.argsort(src, kind="stable")
        first = np.flatnonzero(np.r_[True, src[by_src][1:] != src[by_src][:-1]])
        lat_f = lat
        lat, inv = lat.reshape(G, K), inv.reshape(G, K)
        if G > 1:                                              # symmetric groups collapse to one row
            rows = np.concatenate((lat, inv), axis=1)
            # (the rows are only ever reduced by max/min: which copy of a row is kept, and in which
            # order, changes no price; most patterns are all one row, checked without sorting)
            rows = rows[:1] if bool((rows == rows[0]).all()) else np.unique(rows, axis=0)
            lat, inv = rows[:, :K], rows[:, K:]
        return Pattern(links, lat, inv, hops, lat_f, inv_f, by_src, first, src[by_src][first])

    def _runs(self, msgs: Messages, token: int, chips: np.ndarray) -> Iterator[tuple[Pattern, np.ndarray]]:
        """The schedule's non-empty steps grouped by pattern, in blocks: ``(pattern, nbytes[steps, K])``."""
        ptr, pair = msgs.ptr, msgs.pair
        counts = np.diff(ptr)
        steps = np.flatnonzero(counts)
        if not steps.size:
            return
        shape = msgs.shape
        known = shape is not None
        if shape is not None:                                  # built step by step: shapes are known
            which = np.unique(shape[steps], return_inverse=True)[1].ravel()
        else:
            # a cheap signature per step; steps that share it are checked to be identical below
            w = (pair * 0x9E3779B1 + 0x7F4A7C15) % 2_147_483_647
            sig = np.stack((counts[steps], np.add.reduceat(pair, ptr[steps]), np.add.reduceat(w, ptr[steps])), axis=1)
            _, which = np.unique(sig, axis=0, return_inverse=True)
            which = which.ravel()
        for u in range(int(which.max()) + 1):
            ss = steps[which == u]
            K = int(counts[ss[0]])
            first = pair[ptr[ss[0]]:ptr[ss[0]] + K]
            pat = self.pattern(token, chips, first, msgs.p)
            per = max(1, _BLOCK // K)
            for lo in range(0, len(ss), per):
                ix = ptr[ss[lo:lo + per]][:, None] + np.arange(K)[None, :]
                if known:
                    yield pat, msgs.nbytes[ix]
                    continue
                same = (pair[ix] == first[None, :]).all(axis=1)
                yield pat, msgs.nbytes[ix[same]]
                for i in np.flatnonzero(~same).tolist():       # a signature collision (rare): on its own
                    yield self.pattern(token, chips, pair[ix[i]], msgs.p), msgs.nbytes[ix[i]][None, :]

    # -- prices ------------------------------------------------------------------------------------
    def price(self, sched: CollectiveSchedule, token: int, chips: np.ndarray) -> tuple[float, int, int]:
        """``(seconds, messages of one group, longest route)`` of ``sched`` run by the groups ``chips``.

        The lock-step sum (each step as long as its slowest message) is exact when the network treats
        every message of a step alike. When it does not (a degraded or failed link, a detour, routes of
        different lengths, several messages of different sizes on one link), members drift apart, and the
        price is their asynchronous critical path (:func:`.async_steps.async_critical_path`): a member
        that finished a step early already sends its next step's message (which shares the slow
        member's link with the message that member still waits for); one that waits for nothing slow
        runs ahead, so a tree whose edges cross the spine or not is priced below the lock-step sum."""
        return self.settle(self.lockstep(sched, token, chips), sched, token, chips)

    def lockstep(self, sched: CollectiveSchedule, token: int, chips: np.ndarray, floor: bool = False) -> Lockstep:
        """The first part of :meth:`price`: one pass over the steps. With ``floor``, also a lower bound of
        the price: the largest, over members, of the sum over steps of the member's slowest own message
        as if it had every link of its route to itself (a member enters the next step no earlier than
        each message it sends in this one is done: at least its route's latency plus its bytes at its
        slowest link's bandwidth; sharing, drift and interference only add). :meth:`settle` gives the price."""
        msgs = schedule_messages(sched)
        total = 0.0
        hops = 0
        uneven = False
        own = np.zeros(chips.size) if floor else None
        for pat, nb in self._runs(msgs, token, chips):
            hops = max(hops, pat.hops)
            U, K = pat.lat.shape
            per = max(1, _BLOCK // max(1, U * K))
            skewed = _uneven(pat)
            for lo in range(0, len(nb), per):
                b = nb[lo:lo + per]
                times = pat.lat[None, :, :] + b[:, None, :] * pat.inv_bw[None, :, :]
                total += float(times.max(axis=(1, 2)).sum())
                uneven = uneven or drifts(times, pat.inv_bw, b, skewed)
            if own is not None:
                _add_floor(own, pat, nb)
        return Lockstep(total, uneven, float(own.max(initial=0.0)) if own is not None else 0.0, len(msgs.pair), hops)

    def settle(self, first: Lockstep, sched: CollectiveSchedule, token: int, chips: np.ndarray
               ) -> tuple[float, int, int]:
        """:meth:`price` from its :meth:`lockstep` pass: the asynchronous critical path if members drift."""
        total = first.seconds
        if first.uneven:
            memo = self._async.get(token)
            if memo is None or len(memo) > _MAX_ASYNC_MEMO:
                memo = self._async[token] = {}
            total = async_critical_path(self, schedule_messages(sched), token, chips, memo)
        return total, first.messages, first.hops

    def link_bytes(self, sched: CollectiveSchedule, token: int, chips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(link ids, bytes)``: what ``sched`` moves over each directed link, summed over its steps
        and every group (links that carry nothing are left out)."""
        acc = np.zeros(self.router.num_links)
        G = chips.shape[0]
        for pat, nb in self._runs(schedule_messages(sched), token, chips):
            flow = np.tile(nb.sum(axis=0), G)
            valid = pat.links >= 0
            w = np.broadcast_to(flow[:, None], pat.links.shape)[valid]
            acc += np.bincount(pat.links[valid], weights=w, minlength=len(acc))
        ids = np.flatnonzero(acc)
        return ids.astype(np.int64), acc[ids]

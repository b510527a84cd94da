"""The flow-level network: messages share directed links by max-min fair rates (a fluid model).

Every message in flight is a *flow* on its route (:class:`~.routing.RoutePattern`).
Whenever the set of flows changes (a flow starts or finishes) the rates are
recomputed by progressive filling: the link with the smallest fair share
``remaining capacity / flows still unfixed`` is saturated, its flows get that
share, and so on (max-min fairness). Between changes rates are constant, so the
model jumps from one flow completion to the next. A flow of ``n`` bytes on a
route of latency ``L`` (sum of its links' latencies, cut-through) is delivered
``L`` after its last byte leaves: alone on its route it takes ``L + n / min bw``,
exactly the analytical model's price of a message.

Flows are handled in *batches* (the flows of one step of one collective over all
its groups), as numpy arrays; rates are cached by the set of active batches, so
the steps of a ring — identical routes, step after step — are solved once. Flows
due to finish within ``resolution_s`` (1 ns) of each other finish together: far
below any latency, and without it messages that differ by one element (uneven
splits) would each cost an event.

Why flows and not store-and-forward chunks (:mod:`.chunked`, ``network="chunk"``):
a chunk model needs ``chunks × hops`` events per message and its uncontended
time is ``L + n/B + (hops-1)·chunk/B`` — off the closed form by the pipeline fill
unless chunks are small (and then slower still); the flow model is exact when
nothing contends and takes O(1) events per batch of messages. Measured
(``benchmarks/des_speed.py``) on a 64-chip step with 2-hop routes and shared
links: chunks of 64 KiB to 4 MiB agree with the flow model within 0.1 % and take
20x to 200x its wall time.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import simpy

from partir_emu.hwmodels.des.protocols import ContentionSink, Delivered
from partir_emu.hwmodels.des.routing import RoutePattern, Router


def max_min_rates(links: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max-min fair rates of flows ``links[f]`` (padded link ids, ``-1`` = none) on links of capacity ``cap``.

    Returns ``(rates, flows per link)``. Progressive filling: each round fixes every flow that
    crosses a link whose fair share is the smallest of the round."""
    nf = len(links)
    nl = len(cap)
    rates = np.zeros(nf)
    flat = links.ravel()
    valid = flat >= 0
    counts = np.bincount(flat[valid], minlength=nl)
    cnt = counts.astype(np.float64)
    capr = cap.astype(np.float64).copy()
    share = np.empty(nl + 1)
    share[nl] = np.inf                        # the padding index -1 reads this
    active = np.arange(nf)
    act_links = links
    while active.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(capr, cnt, out=share[:nl])
        share[:nl][cnt <= 0] = np.inf
        fs = share[act_links].min(axis=1)
        m = fs.min()
        if not np.isfinite(m):                # flows without links (cannot happen for routed flows)
            rates[active] = np.inf
            break
        fix = fs <= m * (1.0 + 1e-12)
        rates[active[fix]] = m
        fl = act_links[fix].ravel()
        dec = np.bincount(fl[fl >= 0], minlength=nl)
        capr -= dec * m
        np.maximum(capr, 0.0, out=capr)
        cnt -= dec
        keep = ~fix
        active = active[keep]
        act_links = act_links[keep]
    return rates, counts


class _Batch:
    __slots__ = ("route", "key", "n", "on_delivered", "owner")

    def __init__(self, route: RoutePattern, idx: np.ndarray | None, n: int, on_delivered: Delivered,
                 owner: ContentionSink | None) -> None:
        self.route = route
        self.key = (route.id, None if idx is None else idx.tobytes())
        self.n = n                        # flows still in flight
        self.on_delivered = on_delivered
        self.owner = owner


class FlowNetwork:
    """Max-min fair flows over the router's links, driven by ``env``.

    The flows in flight are kept as one set of arrays (batch after batch, each batch's
    flows contiguous), so an event costs a few array operations whatever the number of
    batches."""

    kind = "flow"

    def __init__(self, env: simpy.Environment, router: Router, recorder: Any = None,
                 resolution_s: float = 1e-9) -> None:
        self.env = env
        self.resolution_s = resolution_s
        self.router = router
        self.cap = router.bw
        self.link_bytes = np.zeros(router.num_links)
        self.link_max_flows = np.zeros(router.num_links, dtype=np.int64)
        self.recorder = recorder
        self._batches: list[_Batch] = []
        self._links = np.zeros((0, 1), dtype=np.int32)
        self._rem = np.zeros(0)
        self._rate = np.zeros(0)
        self._lat = np.zeros(0)
        self._fid = np.zeros(0, dtype=np.int64)
        self._bstats = np.zeros((0, 3), dtype=np.int64)  # per batch: max flows on a link, that link, own flows
        self._t = 0.0
        self._dirty = False
        self._version = 0
        self._cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.flows = 0
        self.batches = 0
        self.solves = 0
        self.recomputes = 0

    # -- API ------------------------------------------------------------------------------------
    def send(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray, on_delivered: Delivered,
             owner: ContentionSink | None = None) -> None:
        """Start flows ``idx`` of ``route`` (all when ``None``) now, ``nbytes[k]`` bytes for the k-th.
        ``on_delivered(flow ids or None for all, time)`` is called as they arrive (maybe in parts)."""
        links = route.links if idx is None else route.links[idx]
        n = len(links)
        if not n:
            return
        self._advance()
        nbytes = np.asarray(nbytes, dtype=np.float64)
        self._batches.append(_Batch(route, idx, n, on_delivered, owner))
        self._bstats = np.concatenate((self._bstats, [[0, -1, 0]]))
        self.flows += n
        self.batches += 1
        h, w = self._links.shape[1], links.shape[1]
        if w > h:
            self._links = np.pad(self._links, ((0, 0), (0, w - h)), constant_values=-1)
        elif w < h:
            links = np.pad(links, ((0, 0), (0, h - w)), constant_values=-1)
        self._links = np.concatenate((self._links, links))
        self._rem = np.concatenate((self._rem, nbytes))
        self._rate = np.concatenate((self._rate, np.zeros(n)))
        self._lat = np.concatenate((self._lat, route.latency_s if idx is None else route.latency_s[idx]))
        self._fid = np.concatenate((self._fid, np.arange(n) if idx is None else idx))
        fl = links.ravel()
        ok = fl >= 0
        self.link_bytes += np.bincount(fl[ok], weights=np.repeat(nbytes, links.shape[1])[ok],
                                       minlength=len(self.cap))
        self._touch()

    @property
    def busy(self) -> bool:
        return bool(self._batches)

    # -- the fluid dynamics -----------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt
        self._t = now

    def _touch(self) -> None:
        if not self._dirty:
            self._dirty = True
            ev = self.env.event()
            ev.callbacks.append(self._settle)
            ev.succeed()

    def _settle(self, _ev=None) -> None:
        """Recompute rates for the current flows and schedule the next completion."""
        self._dirty = False
        self._advance()
        self._version += 1
        if not self._batches:
            if self.recorder is not None:
                self.recorder.link_rates(self.env.now, None, None)
            return
        self.recomputes += 1
        key = tuple(b.key for b in self._batches)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._solve()
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = hit
        self._rate, stats = hit
        bs = self._bstats
        upd = stats[:, 0] > bs[:, 0]
        bs[upd, :2] = stats[upd, :2]
        np.maximum(bs[:, 2], stats[:, 2], out=bs[:, 2])
        if self.recorder is not None:
            self.recorder.link_rates(self.env.now, self._links, self._rate)
        tnext = float((self._rem / self._rate).min())
        version = self._version
        ev = self.env.timeout(max(tnext, 0.0))
        ev.callbacks.append(lambda _e: self._complete(version))

    def _solve(self) -> tuple[np.ndarray, np.ndarray]:
        self.solves += 1
        links = self._links
        rates, counts = max_min_rates(links, self.cap)
        np.maximum(self.link_max_flows, counts, out=self.link_max_flows)
        # per batch: the most flows (of anyone) on one of its links, which link, and its own most
        sizes = np.array([b.n for b in self._batches])
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        ext = np.append(counts, -1)
        per = ext[links]
        j = per.argmax(axis=1)
        fmax = per[np.arange(len(per)), j]
        flink = links[np.arange(len(per)), j]
        bmax = np.maximum.reduceat(fmax, starts)
        batch_of = np.repeat(np.arange(len(sizes)), sizes)
        first = np.flatnonzero(fmax == bmax[batch_of])
        _, pick = np.unique(batch_of[first], return_index=True)
        nl = len(self.cap)
        ok = links >= 0
        pair = (np.repeat(batch_of, links.shape[1]).reshape(links.shape) * nl + links)[ok]
        upair, cnt = np.unique(pair, return_counts=True)
        own = np.zeros(len(sizes), dtype=np.int64)
        np.maximum.at(own, upair // nl, cnt)
        stats = np.stack((bmax, flink[first[pick]], own), axis=1).astype(np.int64)
        return rates, stats

    def _complete(self, version: int) -> None:
        if version != self._version:
            return                      # superseded by a later change
        self._advance()
        # flows due within the time resolution finish together (a nanosecond is far below any
        # latency; without it, messages that differ by one element would each be an event)
        with np.errstate(divide="ignore", invalid="ignore"):
            left = self._rem / self._rate          # flows started at this instant have no rate yet: inf
        done = left <= self.resolution_s + max(0.0, float(left.min()))
        sizes = np.array([b.n for b in self._batches])
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        ndone = np.add.reduceat(done, starts) if len(starts) else sizes
        finished = []
        alive = []
        bkeep = np.ones(len(self._batches), dtype=bool)
        for j, (b, at, k) in enumerate(zip(self._batches, starts.tolist(), ndone.tolist())):
            if k == 0:
                alive.append(b)
                continue
            sub = done[at:at + b.n]
            if k == b.n:
                finished.append((b.on_delivered, None if b.key[1] is None else self._fid[at:at + b.n],
                                 self._lat[at:at + b.n]))
                bkeep[j] = False
                if b.owner is not None:
                    b.owner.contention(*self._bstats[j].tolist())
                continue
            fid = self._fid[at:at + b.n]
            finished.append((b.on_delivered, fid[sub], self._lat[at:at + b.n][sub]))
            b.n -= k
            b.key = (b.route.id, fid[~sub].tobytes())
            alive.append(b)
        keep = ~done
        self._links, self._rem = self._links[keep], self._rem[keep]
        self._rate, self._lat, self._fid = self._rate[keep], self._lat[keep], self._fid[keep]
        self._batches = alive
        self._bstats = self._bstats[bkeep]
        for cb, ids, lat in finished:
            self._deliver(cb, ids, lat)
        self._touch()

    def _deliver(self, cb: Delivered, ids: np.ndarray | None, lat: np.ndarray) -> None:
        lo, hi = lat.min(), lat.max()
        if lo == hi:
            self._later(cb, ids, float(lo))
            return
        if ids is None:
            ids = np.arange(len(lat))
        vals, inv = np.unique(lat, return_inverse=True)
        for k, v in enumerate(vals):
            self._later(cb, ids[inv == k], float(v))

    def _later(self, cb: Delivered, ids: np.ndarray | None, delay: float) -> None:
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: cb(ids, self.env.now))

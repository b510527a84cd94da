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
the steps of a ring — identical routes, step after step — are solved once.

Why flows and not store-and-forward chunks (:mod:`.chunked`, ``network="chunk"``):
a chunk model needs ``chunks × hops`` events per message and its uncontended
time is ``L + n/B + (hops-1)·chunk/B`` — off the closed form by the pipeline fill
unless chunks are tiny (and then slower still); the flow model is exact when
nothing contends and takes O(1) events per batch of messages. The measured
comparison is in ``benchmarks/des_speed.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import simpy

from partir_emu.hwmodels.des.routing import RoutePattern, Router

Delivered = Callable[[np.ndarray | None, float], None]


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
    __slots__ = ("route", "idx", "key", "links", "lat", "remaining", "size0", "rate", "on_delivered", "owner")

    def __init__(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray,
                 on_delivered: Delivered, owner: Any) -> None:
        self.route = route
        self.idx = idx
        self.key = (route.id, None if idx is None else idx.tobytes())
        self.links = route.links if idx is None else route.links[idx]
        self.lat = route.latency_s if idx is None else route.latency_s[idx]
        self.remaining = np.array(nbytes, dtype=np.float64)
        self.size0 = self.remaining.copy()
        self.rate = np.zeros(len(self.remaining))
        self.on_delivered = on_delivered
        self.owner = owner


class FlowNetwork:
    """Max-min fair flows over the router's links, driven by ``env``."""

    kind = "flow"

    def __init__(self, env: simpy.Environment, router: Router, recorder: Any = None) -> None:
        self.env = env
        self.router = router
        self.cap = router.bw
        self.link_bytes = np.zeros(router.num_links)
        self.link_max_flows = np.zeros(router.num_links, dtype=np.int64)
        self.recorder = recorder
        self._batches: list[_Batch] = []
        self._t = 0.0
        self._dirty = False
        self._version = 0
        self._cache: dict[tuple, tuple[list[np.ndarray], list[tuple[int, int, int]]]] = {}
        self.flows = 0
        self.batches = 0
        self.solves = 0
        self.recomputes = 0

    # -- API ------------------------------------------------------------------------------------
    def send(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray, on_delivered: Delivered,
             owner: Any = None) -> None:
        """Start flows ``idx`` of ``route`` (all when ``None``) now, ``nbytes[k]`` bytes for the k-th.
        ``on_delivered(flow ids or None for all, time)`` is called as they arrive (maybe in parts)."""
        b = _Batch(route, idx, nbytes, on_delivered, owner)
        if not len(b.remaining):
            return
        self._advance()
        self._batches.append(b)
        self.flows += len(b.remaining)
        self.batches += 1
        fl = b.links.ravel()
        ok = fl >= 0
        self.link_bytes += np.bincount(fl[ok], weights=np.repeat(b.remaining, b.links.shape[1])[ok],
                                       minlength=len(self.cap))
        self._touch()

    @property
    def busy(self) -> bool:
        return bool(self._batches)

    # -- the fluid dynamics -----------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        if dt > 0:
            for b in self._batches:
                b.remaining -= b.rate * dt
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
                self.recorder.link_rates(self.env.now, None)
            return
        self.recomputes += 1
        key = tuple(b.key for b in self._batches)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._solve()
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = hit
        rates, stats = hit
        tnext = np.inf
        for b, r, st in zip(self._batches, rates, stats):
            b.rate = r
            if b.owner is not None:
                b.owner.contention(*st)
            t = (b.remaining / r).min()
            if t < tnext:
                tnext = t
        if self.recorder is not None:
            self.recorder.link_rates(self.env.now, self._batches)
        version = self._version
        ev = self.env.timeout(max(tnext, 0.0))
        ev.callbacks.append(lambda _e: self._complete(version))

    def _solve(self) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        self.solves += 1
        bs = self._batches
        if len(bs) == 1:
            links = bs[0].links
        else:
            h = max(b.links.shape[1] for b in bs)
            links = np.full((sum(len(b.remaining) for b in bs), h), -1, dtype=np.int32)
            at = 0
            for b in bs:
                n, w = b.links.shape
                links[at:at + n, :w] = b.links
                at += n
        rates, counts = max_min_rates(links, self.cap)
        np.maximum(self.link_max_flows, counts, out=self.link_max_flows)
        out, stats, at = [], [], 0
        for b in bs:
            n = len(b.remaining)
            out.append(rates[at:at + n])
            at += n
            fl = b.links.ravel()
            fl = fl[fl >= 0]
            own = np.bincount(fl, minlength=len(self.cap))
            used = np.unique(fl)
            worst = int(used[np.argmax(counts[used])])
            stats.append((int(counts[worst]), worst, int(own.max())))
        return out, stats

    def _complete(self, version: int) -> None:
        if version != self._version:
            return                      # superseded by a later change
        self._advance()
        now = self.env.now
        finished: list[tuple[Delivered, np.ndarray | None, np.ndarray]] = []
        alive: list[_Batch] = []
        for b in self._batches:
            done = b.remaining <= np.maximum(1e-9 * b.size0, 1e-6)
            if done.all():
                finished.append((b.on_delivered, b.idx, b.lat))
                continue
            if done.any():
                sub = np.flatnonzero(done)
                full = np.arange(b.route.n) if b.idx is None else b.idx
                finished.append((b.on_delivered, full[sub], b.lat[sub]))
                keep = ~done
                b.idx = full[keep]
                b.key = (b.route.id, b.idx.tobytes())
                b.links, b.lat = b.links[keep], b.lat[keep]
                b.remaining, b.size0, b.rate = b.remaining[keep], b.size0[keep], b.rate[keep]
            alive.append(b)
        if not finished:                # rounding: finish the flow closest to done
            b = min(self._batches, key=lambda x: (x.remaining / x.rate).min())
            b.remaining[int(np.argmin(b.remaining / b.rate))] = 0.0
            return self._complete(version)
        self._batches = alive
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

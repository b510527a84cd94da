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

**Flow classes.** A batch may come as :class:`~.routing.FlowClasses`: flows that
start together with the same bytes and latency and move alike (members of a
symmetric collective, :mod:`partir_emu.hwmodels.des.classes`). The network then keeps one entry per
class (remaining bytes, rate), so an event costs array operations over classes,
not flows. Rates are still solved over every flow (only when the set of batches
is new) and each class's flows must get one rate, else that batch goes on flow by
flow and its collective member by member (exact: until then they moved alike).
Bytes per link are summed per class and spread over the links at the end. Flows
due to finish within ``resolution_s`` (1 ns) of each other finish together, at the
time the LAST of them is due (without it, messages that differ by one element —
uneven splits — would each cost an event; finishing them at the earliest time ran
members ahead of the closed form by up to 1 ns a step). A flow already due is never
held back by one that starts at its completion instant.
"""
from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np
import simpy

from partir_emu.hwmodels.des.network.meter import LinkBytes
from partir_emu.hwmodels.des.network.rates import (
    SAME_INSTANT,
    Part,
    Solution,
    flow_matrix,
    solve,
)
from partir_emu.hwmodels.des.network.routing import FlowClasses, FlowRouter, RoutePattern, SymmetryBroken
from partir_emu.hwmodels.des.protocols import ContentionSink, Delivered

__all__ = ["Batch", "FluidNetwork"]

_CACHE_MAX = 1 << 15        # rate solutions kept (sets of batches in flight; a 4096-chip step meets ~25k)
_EMPTY_F = np.zeros(0)
_EMPTY_I = np.zeros(0, dtype=np.int64)


class Batch:
    """Flows sent together (one step of one collective over all its groups), while some are in flight."""

    __slots__ = ("route", "classes", "key", "n", "on_delivered", "owner", "sent")

    def __init__(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None, n: int,
                 on_delivered: Delivered, owner: ContentionSink | None) -> None:
        self.route = route
        self.classes = classes
        self.key = (route.id, -1 if classes is None else classes.id, None if idx is None else idx.tobytes())
        self.n = n                        # entries (flows, or classes of flows) still in flight
        self.on_delivered = on_delivered
        self.owner = owner
        self.sent = (route, classes, idx)  # as sent: its links (:meth:`.spans.FlowNetwork.links_of`) until all delivered


class FluidNetwork:
    """Max-min fair flows over the router's links, driven by ``env`` (:class:`.spans.FlowNetwork` adds
    the lock-step spans the DES runs on).

    The entries in flight (flows, or classes of flows) are kept as one set of arrays (batch after
    batch, each batch's entries contiguous), so an event costs a few array operations whatever the
    number of batches."""

    kind = "flow"

    def __init__(self, env: simpy.Environment, router: FlowRouter, recorder: Any = None,
                 resolution_s: float = 1e-9, eager: bool = False) -> None:
        self.env = env
        # eager: after a delivery or completion callback, settle the rates at once when no other event
        # is due at this instant (instead of through one more simpy event); the same flows at the same
        # time, so the same rates. Not with a trace recorder (it keeps one rate sample per instant).
        self.eager = eager and recorder is None
        self._in_cb = False
        self._scheduled = False
        self.resolution_s = resolution_s
        self.router = router
        self.cap = router.bw
        self.meter = LinkBytes(router.num_links)
        self.link_max_flows = np.zeros(router.num_links, dtype=np.int64)
        self.recorder = recorder
        self._batches: list[Batch] = []
        self._rem = np.zeros(0)
        self._rate = np.zeros(0)
        self._lat = np.zeros(0)
        self._uid = np.zeros(0, dtype=np.int64)          # entry id in its batch's route (flow) or classes
        self._bstats: list[list[int]] = []   # per batch: max flows on a link, that link, own flows (few batches)
        self._t = 0.0
        self._dirty = False
        self._version = 0
        self._wakes: set[float] = set()       # eager: instants a wake-up is pending for
        self._target = -1.0                   # eager: the one that completes flows
        self._cache: dict[tuple, tuple[np.ndarray, list[tuple[int, int, int]]]] = {}
        self.flows = 0
        self.batches = 0
        self.solves = 0
        self.splits = 0                 # class batches that had to go on flow by flow
        self.recomputes = 0

    # -- API ------------------------------------------------------------------------------------
    def send(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray, on_delivered: Delivered,
             owner: ContentionSink | None = None, classes: FlowClasses | None = None) -> None:
        """Start flows ``idx`` of ``route`` (all when ``None``) now, ``nbytes[k]`` bytes for the k-th.
        With ``classes``, ``idx`` names classes of flows (each of its flows carries ``nbytes[k]``).
        ``on_delivered(ids or None for all, time)`` is called as they arrive (maybe in parts)."""
        total = route.n if classes is None else classes.n
        n = total if idx is None else len(idx)
        if not n:
            return
        batch = Batch(route, classes, idx, n, on_delivered, owner)
        self._before_send(route, classes, idx)
        self._advance()
        nbytes = np.asarray(nbytes, dtype=np.float64)
        self._batches.append(batch)
        self._bstats.append([0, -1, 0])
        if classes is None:
            self.flows += n
            lat = route.latency_s
        else:
            self.flows += int(classes.ptr[-1]) if idx is None else int(classes.mult[idx].sum())
            lat = classes.latency_s
        self.batches += 1
        lat = lat if idx is None else lat[idx]
        uid = np.arange(n) if idx is None else idx
        if len(self._batches) == 1:     # (the network was idle: nothing to append to)
            self._rem, self._rate, self._lat, self._uid = nbytes.copy(), np.zeros(n), lat, uid
        else:
            self._rem = np.concatenate((self._rem, nbytes))
            self._rate = np.concatenate((self._rate, np.zeros(n)))
            self._lat = np.concatenate((self._lat, lat))
            self._uid = np.concatenate((self._uid, uid))
        self.account(route, classes, idx, nbytes, owner, None)     # bytes per link
        self._touch()

    @property
    def busy(self) -> bool:
        return bool(self._batches)

    def _before_send(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> None:
        """What a subclass does before a batch starts (:class:`.spans.FlowNetwork`: break the spans in its way)."""

    def account(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None,
                nbytes: np.ndarray, owner: ContentionSink | None, row: tuple[int, int, int] | None) -> None:
        """Count bytes that moved without being sent here (a span's steps): flows, bytes per link and,
        with ``row``, its contention and one batch."""
        if row is not None:
            self.batches += 1
            self.flows += (route.n if classes is None else int(classes.ptr[-1])) if idx is None else (
                len(idx) if classes is None else int(classes.mult[idx].sum()))
            if owner is not None:
                owner.contention(*row)
        self.meter.add(route, classes, idx, nbytes)

    @property
    def link_bytes(self) -> np.ndarray:
        """Bytes each link carried so far."""
        return self.meter.per_link()

    # -- the fluid dynamics -----------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt
        self._t = now

    def _touch(self) -> None:
        self._dirty = True
        if not self._in_cb and not self._scheduled:
            self._schedule_settle()

    def _schedule_settle(self) -> None:
        self._scheduled = True
        ev = self.env.event()
        ev.callbacks.append(self._settle_event)
        ev.succeed()

    def _flush(self) -> None:
        """End of a callback of ours: settle now if nothing else happens at this instant, else later."""
        if self._dirty and not self._scheduled:
            if self.env.peek() > self.env.now:
                self._settle()
            else:
                self._schedule_settle()

    def _settle_event(self, _ev: simpy.Event) -> None:
        self._scheduled = False
        self._settle()

    def _settle(self) -> None:
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
            key = tuple(b.key for b in self._batches)      # a class split into flows changes its key
            if len(self._cache) > _CACHE_MAX:
                self._cache.clear()
            self._cache[key] = hit
        self._rate, stats = hit
        for row, (f, lk, own) in zip(self._bstats, stats):
            if f > row[0]:
                row[0], row[1] = f, lk
            if own > row[2]:
                row[2] = own
        if self.recorder is not None:
            links, mult = self._flows()
            self.recorder.link_rates(self.env.now, links, np.repeat(self._rate, mult))
        tnext = self._next_completion()
        if self.eager:
            self._arm(tnext)
            return
        version = self._version
        ev = self.env.timeout(tnext)
        ev.callbacks.append(lambda _e: self._complete(version))

    def _next_completion(self) -> float:
        """Delay to the next completion: the latest due time among the flows due within
        ``resolution_s`` of the earliest (they finish together, at the time the last of them is due:
        a member's step ends with its last message anyway, so merging early would run it ahead);
        0 when some flow is due now (those finish now, alone)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            left = self._rem / self._rate
        m = float(left.min())
        if m <= SAME_INSTANT * self.env.now:
            return 0.0                  # flows due now (a send came at their completion): never held back
        if len(left) > 1:
            m = float(left[left <= m + self.resolution_s].max())
        return m

    def _arm(self, delay: float) -> None:
        """Wake up at the next completion, ``delay`` from now. A wake already pending for that instant
        (the same flows' completion, recomputed after an unrelated change: equal to 1e-12) is reused
        rather than adding one more event; the others stay pending and are ignored when they fire."""
        t = self.env.now + delay
        for w in self._wakes:
            if abs(w - t) <= SAME_INSTANT * t:
                self._target = w
                return
        self._wakes.add(t)
        self._target = t
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: self._wake(t))

    def _wake(self, t: float) -> None:
        self._wakes.discard(t)
        if t == self._target:
            self._target = -1.0
            self._complete(self._version)

    def _parts(self) -> list[Part]:
        """The batches in flight with the ids of their entries still in flight."""
        parts, at = [], 0
        for b in self._batches:
            parts.append((b.route, b.classes, self._uid[at:at + b.n]))
            at += b.n
        return parts

    def _flows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every flow in flight as a padded link matrix (entry after entry), and the flows per entry."""
        return flow_matrix(self._parts())

    def _solve(self) -> Solution:
        self.solves += 1
        while True:
            hit, bad, counts = solve(self._parts(), self.cap)
            if not bad.any():
                break
            self._split(bad)
        np.maximum(self.link_max_flows, counts, out=self.link_max_flows)
        return hit

    def _split(self, bad: np.ndarray) -> None:
        """The batches holding an entry whose flows got different rates go on flow by flow (exact: until
        now its flows moved alike); their owner goes on member by member and is told the ids are flows."""
        rem, lat, uid = [], [], []
        at = 0
        for b in self._batches:
            lo, hi = at, at + b.n
            at = hi
            if b.classes is None or not bad[lo:hi].any():
                rem.append(self._rem[lo:hi])
                lat.append(self._lat[lo:hi])
                uid.append(self._uid[lo:hi])
                continue
            if b.owner is None or not hasattr(b.owner, "expand"):
                raise SymmetryBroken("flows of one class got different rates and their owner cannot split")
            flows, mult = b.classes.expand(self._uid[lo:hi])
            rem.append(np.repeat(self._rem[lo:hi], mult))
            lat.append(b.route.latency_s[flows])
            uid.append(flows)
            b.classes, b.n, b.key = None, len(flows), (b.route.id, -1, flows.tobytes())
            # its owner (hasattr expand: a CollectiveRun) takes flows=True: the ids are flows now
            b.on_delivered = functools.partial(cast(Any, b.on_delivered), flows=True)
            b.owner.expand()
            self.splits += 1
        self._rem, self._lat, self._uid = np.concatenate(rem), np.concatenate(lat), np.concatenate(uid)
        self._rate = np.zeros(len(self._rem))

    def _complete(self, version: int) -> None:
        if version != self._version:
            return                      # superseded by a later change
        self._advance()
        # the flows of the merge window (_next_completion) are due now, up to float rounding; flows
        # started at this instant have no rate yet (inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            left = self._rem / self._rate
        done = left <= SAME_INSTANT * self.env.now
        batches = self._batches
        starts, at = [], 0
        for b in batches:
            starts.append(at)
            at += b.n
        ks = [int(done.sum())] if len(batches) == 1 else np.add.reduceat(done, starts).tolist()
        everyone = sum(ks) == len(done)
        finished = []
        alive, stats = [], []
        for b, lo, k, row in zip(batches, starts, ks, self._bstats):
            hi = lo + b.n
            if k == 0:
                alive.append(b)
                stats.append(row)
            elif k == b.n:
                finished.append((b.on_delivered, None if b.key[2] is None else self._uid[lo:hi], self._lat[lo:hi]))
                if b.owner is not None:
                    b.owner.contention(*row)
            else:
                uid, sub = self._uid[lo:hi], done[lo:hi]
                finished.append((b.on_delivered, uid[sub], self._lat[lo:hi][sub]))
                b.n -= k
                b.key = (b.key[0], b.key[1], uid[~sub].tobytes())
                alive.append(b)
                stats.append(row)
        if everyone:                    # (lock step: every entry finishes at once)
            self._rem, self._rate, self._lat, self._uid = _EMPTY_F, _EMPTY_F, _EMPTY_F, _EMPTY_I
        else:
            keep = ~done
            self._rem, self._rate = self._rem[keep], self._rate[keep]
            self._lat, self._uid = self._lat[keep], self._uid[keep]
        self._batches, self._bstats = alive, stats
        for cb, ids, lat in finished:
            self._deliver(cb, ids, lat)
        self._dirty = True
        if self.eager:
            self._flush()
        elif not self._scheduled:
            self._schedule_settle()

    def _deliver(self, cb: Delivered, ids: np.ndarray | None, lat: np.ndarray) -> None:
        lo, hi = (float(lat[0]),) * 2 if len(lat) == 1 else (float(lat.min()), float(lat.max()))
        if lo == hi:
            self._later(cb, ids, lo)
            return
        if ids is None:
            ids = np.arange(len(lat))
        vals, inv = np.unique(lat, return_inverse=True)
        for k, v in enumerate(vals):
            self._later(cb, ids[inv == k], float(v))

    def _later(self, cb: Delivered, ids: np.ndarray | None, delay: float) -> None:
        ev = self.env.timeout(delay)
        if not self.eager:
            ev.callbacks.append(lambda _e: cb(ids, self.env.now))
            return

        def fire(_e: simpy.Event) -> None:
            self._in_cb = True
            try:
                cb(ids, self.env.now)
            finally:
                self._in_cb = False
            self._flush()
        ev.callbacks.append(fire)

"""The issue rule of the overlap schedule: which collective a communication stream starts, and when.

The rule, shared with the DES (:func:`stream_prereqs`, used by
:func:`partir_emu.hwmodels.des.stream.compile_stream`): a device has ``k`` communication streams,
each running one collective at a time. When a stream is free it starts, among the collectives that
are ready, the one needed first (the priority of :mod:`.overlap`); if none is ready, the first to
become ready. A collective issued goes to the lowest-numbered free stream, and it starts once it is
ready and the collective issued before it *on that stream* has finished. With ``k = 1`` this is the
single stream of :func:`issue_one_stream`, the faster loop kept for that case.

Collectives in flight together share links: each advances through its standalone time, phase by
phase, at the speed :class:`~partir_emu.hwmodels.network.concurrency.Contention` gives for the set in flight, recomputed
whenever one starts, changes phase or finishes (a fluid event loop). Issue times never decrease
(the next issue is at the earliest stream free time or later), so the compute stream's walk and the
FIFO of :func:`issue_one_stream` carry over unchanged.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

from partir_emu.hwmodels.network.concurrency import Contention

_INF = math.inf


class IssueGraph(NamedTuple):
    """What the issue loops read of a program's collectives (numbered 0..C-1 in program order;
    built once per program by :func:`.overlap.build_plan`)."""

    prods: tuple[tuple[int, ...], ...]      # the collectives producing c's operand
    users: tuple[tuple[int, ...], ...]      # the collectives reading c's result
    keys: tuple[int, ...]                   # c's priority key: priority * C + c (lower issues first)


def stream_prereqs(order: Sequence[int], stream: Sequence[int]) -> list[int]:
    """Per collective, the collective it waits for under the stream rule (the one issued before it on
    the same stream; -1: none). ``order``: issue order; ``stream``: each collective's stream."""
    last: dict[int, int] = {}
    out = [-1] * len(stream)
    for c in order:
        s = stream[c]
        out[c] = last.get(s, -1)
        last[s] = c
    return out


def round_robin(order: Sequence[int], k: int) -> list[int]:
    """Streams by issue rank modulo ``k`` (the rule for a schedule made for fewer streams: rank ``r``
    waits for rank ``r - k``)."""
    out = [0] * len(order)
    for r, c in enumerate(order):
        out[c] = r % k
    return out


def issue_streams(graph: IssueGraph, events: list[int], ekeys: list[int], Pev: list[float], tc: list[float], k: int,
                  keys: Sequence[int] | None = None, contention: Contention | None = None
                  ) -> tuple[list[float], list[float], list[int], list[tuple[int, float]], list[int]]:
    """As :func:`issue_one_stream` (per collective start and finish, issue order, stalls) on ``k``
    streams, plus each collective's stream. ``contention`` (with ``keys``: per collective, its index in
    the contention's collectives) slows collectives in flight together; None: they do not interact."""
    run = _Loop(graph, events, ekeys, Pev, tc, k, keys, contention)
    C = len(tc)
    while True:
        run.walk()
        if run.done == C:
            break
        t_f, first = run.next_finish()
        t_r = run.next_ready()
        if first >= 0 and t_f <= max(run.t, t_r):            # a collective finishes first
            run.finish_at(t_f, first)
        else:
            assert t_r < _INF, "stream schedule stuck: no collective in flight and none ready"
            run.issue_at(max(run.t, t_r))
    return run.start, run.finish, run.order, run.stalls, run.stream


class _Loop:
    """The state of :func:`issue_streams`: the compute stream's walk (as :func:`issue_one_stream`), the
    ready queues, the streams and the collectives in flight with their remaining standalone seconds."""

    def __init__(self, graph: IssueGraph, events: list[int], ekeys: list[int], Pev: list[float], tc: list[float], k: int,
                 keys: Sequence[int] | None, contention: Contention | None) -> None:
        C = len(tc)
        self.events, self.ekeys, self.Pev, self.tc = events, ekeys, Pev, tc
        self.keys = keys
        self.contention = contention if keys is not None else None
        self.users, self.pkeys = graph.users, graph.keys
        self.pending = [len(p) for p in graph.prods]
        self.prod_done = [0.0] * C
        self.comp_ready = [-1.0] * C
        self.finish = [-1.0] * C
        self.start = [0.0] * C
        self.stream = [0] * C
        self.order: list[int] = []
        self.fifo_t: list[float] = []             # ready times, non-decreasing
        self.fifo_k: list[int] = []               # priority keys prio * C + c
        self.late: list[tuple[float, int]] = []   # collective-fed: (ready time, key)
        self.avail: list[int] = []
        self.stalls: list[tuple[int, float]] = []
        self.free_streams = list(range(k))        # a heap of free stream ids
        self.active: list[int] = []               # collectives in flight
        self.rem: dict[int, float] = {}           # their remaining standalone seconds in their phase
        self.phase: dict[int, int] = {}           # their phase (.concurrency)
        self.speed: dict[int, float] = {}
        self.shares: dict[int, list[float]] = {}  # per distinct collective: its phases' time shares
        self.t = self.D = 0.0
        self.e = self.h = self.nf = self.done = 0

    def walk(self) -> None:
        """Advance the compute frontier up to a wait on a collective not finished yet."""
        events, Pev, E = self.events, self.Pev, len(self.events)
        e, D = self.e, self.D
        while e < E:
            ev = events[e]
            if ev >= 0:
                kk = self.ekeys[e]
                if kk >= 0:                                   # no collective producer: FIFO
                    self.fifo_t.append(Pev[e] + D)
                    self.fifo_k.append(kk)
                    self.nf += 1
                elif self.pending[ev]:
                    self.comp_ready[ev] = Pev[e] + D
                else:
                    heapq.heappush(self.late, (max(Pev[e] + D, self.prod_done[ev]), self.pkeys[ev]))
            else:
                f = self.finish[~ev]
                if f < 0.0:                                   # not finished yet
                    break
                if f - Pev[e] > D:
                    D = f - Pev[e]
                    self.stalls.append((e, D))
            e += 1
        self.e, self.D = e, D

    def next_finish(self) -> tuple[float, int]:
        t_f, first = _INF, -1
        for c in self.active:
            tf = self.t + self.rem[c] / self.speed[c]
            if tf < t_f:
                t_f, first = tf, c
        return t_f, first

    def next_ready(self) -> float:
        """When the first waiting collective is ready (inf: none, or no stream free)."""
        t_r = _INF
        if self.free_streams:
            if self.avail:                                    # drained earlier, still waiting
                return self.t
            if self.h < self.nf:
                t_r = self.fifo_t[self.h]
            if self.late and self.late[0][0] < t_r:
                t_r = self.late[0][0]
        return t_r

    def _advance(self, to: float) -> None:
        dt = to - self.t
        if dt > 0.0:
            for c in self.active:
                self.rem[c] -= self.speed[c] * dt
        self.t = max(self.t, to)

    def _rates(self) -> None:
        active, speed = self.active, self.speed
        if self.contention is None or len(active) < 2:
            for c in active:
                speed[c] = 1.0
            return
        keys, start, phase = self.keys, self.start, self.phase
        assert keys is not None
        for c, s in zip(active, self.contention.speeds([(keys[c], phase[c], start[c]) for c in active])):
            speed[c] = s

    def _complete(self, c: int) -> None:
        t = self.t
        self.finish[c] = t
        heapq.heappush(self.free_streams, self.stream[c])
        self.done += 1
        for d in self.users[c]:
            if t > self.prod_done[d]:
                self.prod_done[d] = t
            self.pending[d] -= 1
            if not self.pending[d] and self.comp_ready[d] >= 0.0:
                heapq.heappush(self.late, (max(self.comp_ready[d], self.prod_done[d]), self.pkeys[d]))

    def _phases(self, c: int) -> list[float]:
        """Standalone seconds of each phase of ``c`` (one phase without contention)."""
        if self.contention is None:
            return [self.tc[c]]
        assert self.keys is not None
        k = self.keys[c]
        sh = self.shares.get(k)
        if sh is None:
            sh = self.shares[k] = self.contention.shares(k)
        return [self.tc[c] * x for x in sh]

    def _enter(self, c: int, phase: int) -> bool:
        """Put ``c`` in its first phase from ``phase`` that takes time; False when none is left."""
        durs = self._phases(c)
        while phase < len(durs) and durs[phase] <= 0.0:
            phase += 1
        if phase == len(durs):
            return False
        self.phase[c], self.rem[c] = phase, durs[phase]
        return True

    def finish_at(self, t_f: float, first: int) -> None:
        """Advance to ``t_f`` where ``first`` (and any other at the same time) ends its phase; those
        without a next phase finish."""
        self._advance(t_f)
        tc, rem = self.tc, self.rem
        ended = [c for c in self.active if c == first or rem[c] <= 1e-12 * tc[c]]
        for c in ended:
            if self._enter(c, self.phase[c] + 1):
                continue
            self.active.remove(c)
            del rem[c]
            self._complete(c)
        self._rates()

    def issue_at(self, now: float) -> None:
        """Advance to ``now`` and start the ready collective needed first on the earliest free stream."""
        self._advance(now)
        t, avail = self.t, self.avail
        fifo_t, fifo_k = self.fifo_t, self.fifo_k
        while self.h < self.nf and fifo_t[self.h] <= t:
            heapq.heappush(avail, fifo_k[self.h])
            self.h += 1
        while self.late and self.late[0][0] <= t:
            heapq.heappush(avail, heapq.heappop(self.late)[1])
        c = heapq.heappop(avail) % len(self.tc)
        self.start[c] = t
        self.stream[c] = heapq.heappop(self.free_streams)
        self.order.append(c)
        if self.tc[c] > 0.0 and self._enter(c, 0):
            self.active.append(c)
            self._rates()
        else:                                                 # nothing to send: done at once
            self._complete(c)


def issue_one_stream(graph: IssueGraph, events: list[int], ekeys: list[int], Pev: list[float], tc: list[float]
                     ) -> tuple[list[float], list[float], list[int], list[tuple[int, float]]]:
    """The rule on one stream: per collective start and finish, the issue order, and (event index,
    stall) where the compute stream's stall grew (``events``, ``ekeys``: the compute stream's walk;
    ``Pev``: compute time before each event, without stalls; ``tc``: standalone seconds). The decisions
    of :func:`issue_streams` with ``k = 1`` (tested) in one pass: the analytical fast path."""
    C = len(tc)
    E = len(events)
    users, keys = graph.users, graph.keys
    pending = [len(p) for p in graph.prods]
    prod_done = [0.0] * C
    comp_ready = [-1.0] * C                  # collective-fed: reached time, once the walk passed it
    finish = [-1.0] * C
    start = [0.0] * C
    order: list[int] = []
    fifo_t: list[float] = []                 # ready times, non-decreasing
    fifo_k: list[int] = []                   # priority keys prio * C + c
    late: list[tuple[float, int]] = []       # collective-fed: (ready time, key)
    avail: list[int] = []                    # keys of collectives ready by `free`
    stalls: list[tuple[int, float]] = []
    free = D = 0.0
    e = h = nf = 0
    push, pop = heapq.heappush, heapq.heappop
    add_t, add_k, issue = fifo_t.append, fifo_k.append, order.append
    for n_issued in range(C + 1):
        while e < E:                                          # advance the compute frontier
            ev = events[e]
            if ev >= 0:
                k = ekeys[e]
                if k >= 0:                                    # no collective producer: FIFO
                    add_t(Pev[e] + D)
                    add_k(k)
                    nf += 1
                elif pending[ev]:
                    comp_ready[ev] = Pev[e] + D
                else:
                    push(late, (max(Pev[e] + D, prod_done[ev]), keys[ev]))
            else:
                f = finish[~ev]
                if f < 0.0:                                   # not issued yet
                    break
                if f - Pev[e] > D:
                    D = f - Pev[e]
                    stalls.append((e, D))
            e += 1
        if n_issued == C:                                     # the walk went through the last waits
            break
        while h < nf and fifo_t[h] <= free:
            push(avail, fifo_k[h])
            h += 1
        while late and late[0][0] <= free:
            push(avail, pop(late)[1])
        if avail:
            c = pop(avail) % C
        else:                                                 # idle until the first becomes ready
            if late and (h >= nf or late[0][0] < fifo_t[h]):
                free, k = pop(late)
            else:
                free, k = fifo_t[h], fifo_k[h]
                h += 1
            if (h < nf and fifo_t[h] <= free) or (late and late[0][0] <= free):
                push(avail, k)                                # ties: the best priority goes first
                while h < nf and fifo_t[h] <= free:
                    push(avail, fifo_k[h])
                    h += 1
                while late and late[0][0] <= free:
                    push(avail, pop(late)[1])
                k = pop(avail)
            c = k % C
        start[c] = free
        free += tc[c]
        finish[c] = free
        issue(c)
        for d in users[c]:
            if free > prod_done[d]:
                prod_done[d] = free
            pending[d] -= 1
            if not pending[d] and comp_ready[d] >= 0.0:
                push(late, (max(comp_ready[d], prod_done[d]), keys[d]))
    return start, finish, order, stalls

"""The timeline engine: one step's compute stream and ``k`` communication streams, on any network model.

The issue rule (shared with the DES, which replays its decisions: :func:`.issue.stream_prereqs`):
a device has ``k`` communication streams, each running one collective at a time. When a stream is
free it starts, among the collectives that are ready, the one needed first (the priority of
:mod:`.overlap`); if none is ready, the first to become ready. A collective issued goes to the
lowest-numbered free stream. How long a collective takes is the network model's answer
(:mod:`.networks`: the closed form, links shared by the contention-aware analytical model, or the
DES's flow network), so two timelines made with different models differ by the model alone.

The engine is an event loop over three kinds of event: the compute stream reaches a collective's
ready point or waits for one (the *walk*, :class:`_Frontier`), a collective finishes (the network
model says when), a stream issues. A finish at the same instant as an issue is handled first.
Issue times never decrease (the next issue is at the earliest stream free time or later).

:func:`.issue.issue_one_stream` is this engine with ``k = 1`` on :class:`.networks.Standalone` in
one pass, the analytical fast path; a test holds the two equal.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from partir_emu.hwmodels.timeline.issue import IssueGraph
from partir_emu.hwmodels.timeline.networks import NetworkModel

_INF = math.inf


class Timeline:
    """What the engine returns: per collective its start, finish and stream; the issue order; and
    ``(event index, stall)`` wherever the compute stream's total stall grew."""

    __slots__ = ("start", "finish", "stream", "order", "stalls")

    def __init__(self, num_collectives: int) -> None:
        self.start = [0.0] * num_collectives
        self.finish = [-1.0] * num_collectives      # -1: not finished yet
        self.stream = [0] * num_collectives
        self.order: list[int] = []
        self.stalls: list[tuple[int, float]] = []


class _Frontier:
    """The compute stream's walk and the collectives waiting to be issued.

    ``events``: the walk in order (``c >= 0``: collective ``c`` is ready once reached; ``~c``: the
    compute stream waits for ``c``); ``event_keys``: per ready event its priority key, or -1 if the
    collective also waits for collectives producing its operand; ``compute_before``: compute seconds
    before each event, without stalls."""

    def __init__(self, graph: IssueGraph, events: Sequence[int], event_keys: Sequence[int],
                 compute_before: Sequence[float], out: Timeline) -> None:
        C = len(out.start)
        self.events, self.event_keys, self.compute_before = events, event_keys, compute_before
        self.users, self.keys = graph.users, graph.keys
        self.out = out
        self.producers_left = [len(p) for p in graph.prods]
        self.producers_done = [0.0] * C          # when the last producer finished so far
        self.reached = [-1.0] * C                # collective-fed: when the walk reached its ready point
        self.fifo_time: list[float] = []         # compute-fed ready times, non-decreasing
        self.fifo_key: list[int] = []
        self.fifo_head = 0
        self.fed: list[tuple[float, int]] = []   # collective-fed: heap of (ready time, key)
        self.ready: list[int] = []               # heap of keys of collectives ready by now
        self.next_event = 0
        self.stall = 0.0

    def walk(self) -> None:
        """Advance the compute stream up to a wait on a collective not finished yet."""
        events, before, finish = self.events, self.compute_before, self.out.finish
        e, stall = self.next_event, self.stall
        while e < len(events):
            ev = events[e]
            if ev >= 0:
                key = self.event_keys[e]
                if key >= 0:                                  # no collective producer: FIFO
                    self.fifo_time.append(before[e] + stall)
                    self.fifo_key.append(key)
                elif self.producers_left[ev]:
                    self.reached[ev] = before[e] + stall
                else:
                    heapq.heappush(self.fed, (max(before[e] + stall, self.producers_done[ev]), self.keys[ev]))
            else:
                f = finish[~ev]
                if f < 0.0:
                    break
                if f - before[e] > stall:
                    stall = f - before[e]
                    self.out.stalls.append((e, stall))
            e += 1
        self.next_event, self.stall = e, stall

    def first_ready(self, now: float) -> float:
        """When the first collective not issued yet is ready (``now`` if one is; inf: none known)."""
        if self.ready:
            return now
        t = self.fifo_time[self.fifo_head] if self.fifo_head < len(self.fifo_time) else _INF
        if self.fed and self.fed[0][0] < t:
            t = self.fed[0][0]
        return t

    def take(self, now: float) -> int:
        """The ready collective needed first, at ``now`` (one is ready)."""
        times, keys = self.fifo_time, self.fifo_key
        while self.fifo_head < len(times) and times[self.fifo_head] <= now:
            heapq.heappush(self.ready, keys[self.fifo_head])
            self.fifo_head += 1
        while self.fed and self.fed[0][0] <= now:
            heapq.heappush(self.ready, heapq.heappop(self.fed)[1])
        return heapq.heappop(self.ready) % len(self.out.start)

    def finished(self, c: int, t: float) -> None:
        """``c`` finished at ``t``: its users may become ready."""
        self.out.finish[c] = t
        for d in self.users[c]:
            if t > self.producers_done[d]:
                self.producers_done[d] = t
            self.producers_left[d] -= 1
            if not self.producers_left[d] and self.reached[d] >= 0.0:
                heapq.heappush(self.fed, (max(self.reached[d], self.producers_done[d]), self.keys[d]))


def run(graph: IssueGraph, events: Sequence[int], event_keys: Sequence[int], compute_before: Sequence[float],
        streams: int, network: NetworkModel) -> Timeline:
    """The timeline of one step (module docstring) with ``streams`` communication streams whose
    collectives take what ``network`` says (see :class:`_Frontier` for the walk's arguments)."""
    C = len(graph.keys)
    out = Timeline(C)
    frontier = _Frontier(graph, events, event_keys, compute_before, out)
    free = list(range(streams))                   # a heap of free stream ids
    now = 0.0
    done = 0
    while True:
        frontier.walk()
        if done == C:
            return out
        t_ready = frontier.first_ready(now) if free else _INF
        target = max(now, t_ready)
        when, finished = network.run_until(target)
        if finished:
            now = when
            for c in finished:
                frontier.finished(c, when)
                heapq.heappush(free, out.stream[c])
            done += len(finished)
            continue
        if t_ready == _INF:
            raise AssertionError("timeline stuck: no collective in flight and none ready (an internal error)")
        now = target
        c = frontier.take(now)
        out.start[c] = now
        out.stream[c] = heapq.heappop(free)
        out.order.append(c)
        network.begin(c, now)

"""The issue rule's pieces shared by the timeline engine, its fast path and the DES.

- :class:`IssueGraph`: what the rule reads of a program's collectives;
- :func:`stream_prereqs` / :func:`round_robin`: the stream each collective runs on and the one it
  waits for there (the DES gates on these: :func:`partir_emu.hwmodels.des.stream.compile_stream`);
- :func:`issue_one_stream`: the rule of :mod:`.engine` on one stream with standalone collective
  times, in one pass (the analytical fast path; a test holds it equal to the engine).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

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


def issue_one_stream(graph: IssueGraph, events: list[int], ekeys: list[int], Pev: list[float], tc: list[float]
                     ) -> tuple[list[float], list[float], list[int], list[tuple[int, float]]]:
    """The rule on one stream: per collective start and finish, the issue order, and (event index,
    stall) where the compute stream's stall grew (``events``, ``ekeys``: the compute stream's walk;
    ``Pev``: compute time before each event, without stalls; ``tc``: standalone seconds). The decisions
    of :func:`.engine.run` with one stream on :class:`.networks.Standalone` (tested) in one pass."""
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

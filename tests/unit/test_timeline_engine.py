"""The timeline engine (hwmodels/timeline/engine.py) on random step graphs: its fast path is the
same rule, the network model is the only thing a timeline depends on besides the program, and the
rule's invariants hold on k streams. Pure (no jax)."""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.hwmodels.timeline import engine
from partir_emu.hwmodels.timeline.issue import IssueGraph, issue_one_stream, stream_prereqs
from partir_emu.hwmodels.timeline.networks import Shared, Standalone


def _random_step(seed: int):
    """A random step: C collectives, each ready at a compute position and waited for later, some
    fed by earlier collectives; compute times per position (some 0, as inside fused groups)."""
    rng = np.random.default_rng(seed)
    C = int(rng.integers(1, 14))
    N = int(rng.integers(C + 1, 4 * C + 3))                # compute positions
    ready = sorted(rng.integers(0, N, size=C).tolist())
    wait = [int(rng.integers(r, N + 1)) for r in ready]
    prods = [tuple(sorted({int(p) for p in rng.integers(0, c, size=int(rng.integers(0, 3)))})) if c else ()
             for c in range(C)]
    priority = list(wait)
    users: list[list[int]] = [[] for _ in range(C)]
    for c in range(C - 1, -1, -1):
        for p in prods[c]:
            users[p].append(c)
            priority[p] = min(priority[p], priority[c])
    keys = tuple(priority[c] * C + c for c in range(C))
    evs = sorted([(r, 0, c) for c, r in enumerate(ready)] + [(w, 1, ~c) for c, w in enumerate(wait) if w < N])
    events = [e[2] for e in evs]
    event_keys = [-1 if e < 0 or prods[e] else keys[e] for e in events]
    times = rng.exponential(1.0, size=N) * (rng.random(N) < 0.8)
    P = np.concatenate(([0.0], np.cumsum(times)))
    before = P[[e[0] for e in evs]].tolist()
    tc = (rng.exponential(1.5, size=C) * (rng.random(C) < 0.9)).tolist()
    graph = IssueGraph(tuple(prods), tuple(tuple(u) for u in users), keys)
    return graph, events, event_keys, before, tc, ready, P


def _stall_at(line: engine.Timeline, num_events: int) -> list[float]:
    """Per event of the walk, the compute stream's total stall when it got there."""
    out = [0.0] * num_events
    for e, d in line.stalls:
        out[e:] = [d] * (num_events - e)
    return out


class _NoContention:
    """A contention model under which nothing slows anything (two phases, to exercise phase changes)."""

    def shares(self, index: int) -> list[float]:
        return [0.25, 0.75]

    def speeds(self, active):
        return [1.0] * len(active)


class _HalfSpeed:
    """Any two in flight go at half speed each (one shared link, both bandwidth-bound)."""

    def shares(self, index: int) -> list[float]:
        return [1.0]

    def speeds(self, active):
        return [1.0 / len(active)] * len(active)


@pytest.mark.parametrize("seed", range(0, 300, 30))
def test_fast_path_is_the_engine_on_one_stream(seed):
    for s in range(seed, seed + 30):
        _fast_path_case(s)


def _fast_path_case(seed: int) -> None:
    graph, events, ekeys, before, tc, _, _ = _random_step(seed)
    start, finish, order, stalls = issue_one_stream(graph, events, ekeys, before, tc)
    line = engine.run(graph, events, ekeys, before, 1, Standalone(tc))
    assert line.order == order and line.stalls == stalls and line.stream == [0] * len(tc)
    assert line.start == pytest.approx(start, rel=1e-12, abs=1e-12)
    assert line.finish == pytest.approx(finish, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("k", [2, 3])
def test_only_the_network_model_matters(k):
    """A contention model that slows nothing gives the closed form's timeline exactly, phases and all."""
    for seed in range(150):
        _same_timeline(seed, k)


def _same_timeline(seed: int, k: int) -> None:
    graph, events, ekeys, before, tc, _, _ = _random_step(seed)
    keys = list(range(len(tc)))
    a = engine.run(graph, events, ekeys, before, k, Standalone(tc))
    b = engine.run(graph, events, ekeys, before, k, Shared(tc, _NoContention(), keys))  # type: ignore[arg-type]
    assert a.order == b.order and a.stream == b.stream
    assert b.finish == pytest.approx(a.finish, rel=1e-12, abs=1e-12)
    # the stall in effect at each event (a phase split may grow it by an ulp at one more event)
    assert _stall_at(b, len(events)) == pytest.approx(_stall_at(a, len(events)), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rule_invariants_on_k_streams(k):
    """Every collective starts once ready, after its producers and its stream predecessor finished;
    at most k in flight; sharing only ever stretches a collective (list scheduling on k streams may
    still end sooner with a slower network: Graham's anomalies, so no claim on the step)."""
    for seed in range(150):
        _invariants(seed, k)


def _invariants(seed: int, k: int) -> None:
    graph, events, ekeys, before, tc, _, _ = _random_step(seed)
    fast = engine.run(graph, events, ekeys, before, k, Standalone(tc))
    slow = engine.run(graph, events, ekeys, before, k, Shared(tc, _HalfSpeed(), list(range(len(tc)))))  # type: ignore[arg-type]
    for line in (fast, slow):
        assert sorted(line.order) == list(range(len(tc)))
        stall_at = _stall_at(line, len(events))
        reached = {ev: before[i] + stall_at[i] for i, ev in enumerate(events) if ev >= 0}
        for c in range(len(tc)):
            assert line.start[c] >= reached[c] - 1e-12
            assert all(line.start[c] >= line.finish[p] - 1e-12 for p in graph.prods[c])
            assert line.finish[c] >= line.start[c] + tc[c] * (1 - 1e-12) - 1e-12
        for c, p in enumerate(stream_prereqs(line.order, line.stream)):
            assert p < 0 or line.start[c] >= line.finish[p] - 1e-12
        edges = sorted([(t, 1) for t in line.start] + [(t, -1) for t in line.finish], key=lambda x: (x[0], x[1]))
        assert max(np.cumsum([d for _, d in edges])) <= k
    if k == 1:
        assert slow.finish == pytest.approx(fast.finish, rel=1e-12, abs=1e-12)   # one in flight: nothing shares


def test_two_sharing_one_link_take_twice_as_long():
    """Closed form: two equal bandwidth-bound collectives issued together on k = 2 streams, each at half
    speed, both finish at 2 T (and one stream: T then 2 T)."""
    graph = IssueGraph(((), ()), ((), ()), (0, 1))
    events, ekeys, before = [0, 1, ~0, ~1], [0, 1, -1, -1], [0.0, 0.0, 0.0, 0.0]
    two = engine.run(graph, events, ekeys, before, 2, Shared([3.0, 3.0], _HalfSpeed(), [0, 1]))  # type: ignore[arg-type]
    assert two.start == [0.0, 0.0] and two.finish == pytest.approx([6.0, 6.0]) and two.stream == [0, 1]
    one = engine.run(graph, events, ekeys, before, 1, Shared([3.0, 3.0], _HalfSpeed(), [0, 1]))  # type: ignore[arg-type]
    assert one.finish == pytest.approx([3.0, 6.0])

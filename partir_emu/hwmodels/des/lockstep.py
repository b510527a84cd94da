"""Lock-step spans: the steps of a collective that nothing can disturb, priced ahead in one event.

A ring or torus collective takes hundreds of steps, each two events in the flow network (its flows
complete, then they are delivered a latency later). When a set of members enters a step together,
talks only among itself (*closed*: every flow of the step that touches it starts and ends in it) and
its flows of that step use links nobody else uses, each flow's max-min rate is its rate alone
(:meth:`~.network.FlowNetwork.alone`), so the step's end is known now. If every flow completes and
is delivered at one instant, the members enter the next step together, and so on: a :class:`Span`
is the longest such run of steps whose links are all free now. Its links are reserved
(:meth:`~.network.FlowNetwork.reserve`) and one event is scheduled at its end.

Nothing is assumed about the future: whoever sends on a reserved link first *breaks* the span
(:meth:`Span.break_at`): the steps done by then are counted, the current step's flows are sent with
the bytes they still have (or, in the latency phase, their delivery is scheduled) and the members
go on through the ordinary path. Until then the flows had those links to themselves, so the answer
is the event-by-event one (the float operations are the same, ``t + delay`` then ``+ latency``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partir_emu.hwmodels.des.network.rates import SAME_INSTANT
from partir_emu.hwmodels.des.plans import FlowStep
from partir_emu.hwmodels.des.protocols import SpanNetwork, SpanRun


class SpanStep(NamedTuple):
    plan: FlowStep
    idx: np.ndarray | None       # the members' flows (entries) of the step, None = all
    nbytes: np.ndarray           # bytes per entry
    rate: np.ndarray             # per entry, alone
    row: tuple[int, int, int]    # its contention row
    t0: float                    # sent
    t1: float                    # every flow completes
    t2: float                    # every flow delivered: the members enter the next step


class Span:
    """Steps ``s0 .. s0 + len(steps) - 1`` of ``members`` of ``run``, priced ahead (module docstring)."""

    def __init__(self, run: SpanRun, net: SpanNetwork, members: np.ndarray, s0: int,
                 steps: list[SpanStep], links: np.ndarray) -> None:
        self.run, self.net, self.members, self.s0, self.steps = run, net, members, s0, steps
        self.live = True
        self.sid = net.reserve(links, self.break_at)
        run.live_spans.add(self)
        t_end = steps[-1].t2
        net.call_later(t_end - net.env.now, lambda _now: self._end(t_end))

    def _count(self, steps: list[SpanStep]) -> None:
        run, net = self.run, self.net
        for st in steps:
            net.account(st.plan.route, st.plan.classes, st.idx, st.nbytes, run, st.row)

    def _end(self, t_end: float) -> None:
        if not self.live:
            return
        self.live = False
        self.run.live_spans.discard(self)
        self.net.release(self.sid)
        self._count(self.steps)
        run, n = self.run, self.members.size
        for k in range(self.s0, self.s0 + len(self.steps) - 1):
            run.leave(k, n)
        run.enter(self.members, self.s0 + len(self.steps), t_end)

    def cancel(self, now: float) -> None:
        """Hand the members back now (their run goes on member by member: :meth:`CollectiveRun.expand`)."""
        self.net.release(self.sid)
        self.break_at(now)

    def break_at(self, now: float) -> None:
        """Someone needs a reserved link at ``now`` (the network already released them): hand the
        members back to the ordinary path in the state they have now.

        The run's state is set now; the flows still to send go on the network at this same instant,
        through an event (a break can come from inside the network's own bookkeeping)."""
        self.live = False
        run, net, members = self.run, self.net, self.members
        run.live_spans.discard(self)
        # the step under way: the first that ends later (or, at the span's very end, the last)
        k = next((i for i, st in enumerate(self.steps) if st.t2 > now), len(self.steps) - 1)
        st = self.steps[k]
        self._count(self.steps[:k])
        for j in range(self.s0, self.s0 + k):
            run.leave(j, members.size)
        s = self.s0 + k
        run.cur[members] = s
        if now < st.t1 and st.t2 > now:
            # transmitting: send what is left, at the rates they had alone so far
            left = np.maximum(st.nbytes - st.rate * (now - st.t0), 0.0)
            net.account(st.plan.route, st.plan.classes, st.idx, st.nbytes - left, None, None)
            net.call_later(0.0, lambda _now: run.post(st.plan, s, st.idx, left))
            return
        # delivered already or in flight on the wire: they enter the next step when it is delivered
        self._count([st])
        classes = run.classes

        def enter(_now: float) -> None:
            units = members
            if run.classes is not classes:      # expanded since: classes to members
                assert classes is not None
                units = classes.expand(members)
            run.enter(units, s + 1, st.t2)
        net.call_later(max(st.t2 - now, 0.0), enter)


def closed(plan: FlowStep, inside: np.ndarray) -> bool:
    """Every flow of ``plan`` that touches ``inside`` (bool per member) starts and ends in it."""
    return not (inside[plan.src] != inside[plan.dst]).any()


class _Plan(NamedTuple):
    """What a span of some members from some step would be, whatever the network holds: its steps
    (step, flows, bytes, rates alone, contention row, time to complete, latency), the distinct links
    of its steps and the first of its steps that uses each."""

    steps: list[tuple[FlowStep, np.ndarray | None, np.ndarray, np.ndarray, tuple[int, int, int], float, float]]
    links: np.ndarray
    first: np.ndarray


_MISSING = object()
_CACHE_MAX = 1 << 15         # span plans kept (then forgotten at once)
MAX_STEPS = 256              # steps one span prices ahead (then the next span starts: one event per 256 steps)
MAX_LINKS = 1 << 18          # link entries one span holds (a 4096-member ring step alone has 4096)


def _alone_together(run: SpanRun, net: SpanNetwork, plan: FlowStep, members: np.ndarray, mb: bytes) -> bool:
    """``members`` all have flows in ``plan``'s step and talk only among themselves (cached per step
    shape and members: a ring's classes ask this at every step)."""
    key = (id(plan.src), mb)
    ok = net.span_plans.get(key)
    if ok is None:
        ok = bool(plan.count0[members].all())
        if ok and members.size < run.M:
            idx = run.index_of(plan, members)
            inside = np.zeros(run.M, dtype=bool)
            inside[members] = True
            # (what they send must stay inside, checked first: it fails fastest)
            ok = idx is not None and bool(idx.size) and bool(inside[plan.dst[idx]].all()) and closed(plan, inside)
        net.span_plans[key] = ok
    return ok


def _template(run: SpanRun, net: SpanNetwork, members: np.ndarray, s: int, mb: bytes) -> _Plan:
    steps: list = []
    links: list[np.ndarray] = []
    total = 0
    for k in range(s, min(len(run.plans), s + MAX_STEPS)):
        plan = run.plans[k]
        if not _alone_together(run, net, plan, members, mb):
            break
        idx = run.index_of(plan, members)
        lk = net.links_of(plan.route, plan.classes, idx)
        total += len(lk)
        if total > MAX_LINKS and steps:
            break
        got = net.alone(plan.route, plan.classes, idx)
        if got is None:
            break
        rate, stats = got
        nbytes = plan.nbytes if idx is None else plan.nbytes[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            left = nbytes / rate
        m = float(left.min())
        if not m > 0:
            break
        if len(left) > 1:
            top = float(left.max())
            if top > m + net.resolution_s:
                break               # its flows finish apart: the members leave the step at different times
            m = top
        lat = plan.route.latency_s if plan.classes is None else plan.classes.latency_s
        lat = lat if idx is None else lat[idx]
        lo = float(lat.min())
        if float(lat.max()) != lo:
            break
        steps.append((plan, idx, nbytes, rate, stats[0], m, lo))
        links.append(lk)
    if not links:
        return _Plan(steps, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    every = np.concatenate(links)
    step_of = np.repeat(np.arange(len(links)), [len(x) for x in links])
    ulinks, at = np.unique(every, return_index=True)      # (the first occurrence is in the first step)
    return _Plan(steps, ulinks, step_of[at])


def plan_span(run: SpanRun, net: SpanNetwork, members: np.ndarray, s: int, now: float) -> Span | None:
    """The span of ``members`` entering step ``s`` at ``now`` (module docstring), or ``None`` when it
    would be shorter than two steps (then the ordinary path is as cheap). What the span would be
    apart from the network's state is kept per (plans, members, step) in ``net.span_plans``."""
    if len(net.span_plans) > _CACHE_MAX:
        net.span_plans.clear()
    mb = members.tobytes()
    if not _alone_together(run, net, run.plans[s], members, mb):
        return None
    key = (id(run.plans), mb, s)
    tpl = net.span_plans.get(key, _MISSING)
    if tpl is _MISSING:
        tpl = _template(run, net, members, s, mb)
        if len(tpl.steps) < 2:
            tpl = None                        # (kept small: a cache of subsets that cannot span)
        net.span_plans[key] = tpl
    if tpl is None:
        return None
    k = net.free_steps(tpl.links, tpl.first, len(tpl.steps))     # steps whose links are all free
    if k < 2:
        return None
    steps = []
    t = now
    for plan, idx, nbytes, rate, row, m, lat in tpl.steps[:k]:
        if not m > SAME_INSTANT * t:
            break
        t1 = t + m
        t2 = t1 + lat
        steps.append(SpanStep(plan, idx, nbytes, rate, row, t, t1, t2))
        t = t2
    if len(steps) < 2:
        return None
    return Span(run, net, members, s, steps, tpl.links[tpl.first < len(steps)])

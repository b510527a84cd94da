"""One collective of the program, run by all its groups at once over the network.

The schedule (:mod:`partir_emu.collectives.algorithms`) is the one the
analytical model prices (``CommModel.schedule``); every group of the
collective runs it, so step ``s`` is the batch of its messages in every group.
Members advance on their own (no global barrier per step): member ``m`` enters
step ``s + 1`` once every message of step ``s`` it sends or receives has been
delivered (``sendrecv`` semantics; a step's sends carry what the member holds
*after* the previous step — it cannot send data it does not have yet). It
enters step 0 when its device opens the collective's gate (input computed,
communication stream free). Members are numbered ``g * p + position``;
everything per member is a numpy array, so a collective over 4096 chips in
lock step costs a handful of array operations per step.
"""
from __future__ import annotations

from typing import cast

import numpy as np

from partir_emu.hwmodels.des.classes import MemberClasses
from partir_emu.hwmodels.des.lockstep import Span, plan_span
from partir_emu.hwmodels.des.plans import FlowStep, Groups, build_plan, make_groups, step_plans
from partir_emu.hwmodels.des.protocols import CollectiveHost, SpanNetwork

__all__ = ["CollectiveRun", "Groups", "FlowStep", "build_plan", "make_groups", "step_plans"]


_MISSES = 256               # failed span attempts in a row after which a run stops trying (.lockstep)


class CollectiveRun:
    """The state of one collective: which step each member is in, and when it started and finished.
    It sends its flows on ``host.network`` and tells ``host.collective_done`` where it finished.

    With ``classes`` (:mod:`.classes`) the plans are over member classes and so is every array here
    (``M`` classes of the ``N`` members); :attr:`t_start` and :attr:`t_end` are still per member."""

    def __init__(self, host: CollectiveHost, ci: int, index: int, prim: str, axes: tuple[str, ...], nbytes: int,
                 algorithm: str, groups: Groups, plans: list[FlowStep],
                 reduced: tuple[MemberClasses, list[FlowStep]] | None = None) -> None:
        self.host = host
        self.ci = ci                      # position among the program's communicating collectives
        self.index = index                # equation index
        self.prim = prim
        self.axes = axes
        self.nbytes = nbytes
        self.algorithm = algorithm
        self.groups = groups
        self.member_plans = plans
        classes, self.plans = (None, plans) if reduced is None else reduced
        self.class_plans = self.plans
        self.classes = classes
        self.N = groups.devices.size
        self.M = self.N if classes is None else classes.n      # units: members, or classes of members
        self.dev = groups.devices.ravel()
        self.cur = np.full(self.M, -1, dtype=np.int64)
        self._t0 = np.full(self.M, np.nan)
        self._t1 = np.full(self.M, np.nan)
        self._count: dict[int, np.ndarray] = {}
        self._left: dict[int, int] = {}     # per step: members that have left it
        self._out: dict[tuple[int, bytes], np.ndarray] = {}   # over classes: flows sent by a subset of classes
        self.finished = 0
        self.max_flows = 0                # most flows seen on one of its links (any collective's)
        self.worst_link = -1
        self.max_own = 0                  # most flows of this collective's step on one link
        self.group_max = max((pl.group_max for pl in plans), default=0)
        # lock-step spans (.lockstep): on a network that supports them, with no per-message overhead
        spans = bool(getattr(host.network, "spans", False)) and host.message_overhead_s <= 0
        self._span_net = cast(SpanNetwork, host.network) if spans else None    # (the flow network, eager)
        self._spans = spans
        self.live_spans: set[Span] = set()
        self._misses = 0                  # span attempts that failed in a row

    @property
    def num_steps(self) -> int:
        return len(self.plans)

    @property
    def t_start(self) -> np.ndarray:
        """When each member entered step 0."""
        return self._t0 if self.classes is None else self._t0[self.classes.of_member]

    @property
    def t_end(self) -> np.ndarray:
        """When each member finished."""
        return self._t1 if self.classes is None else self._t1[self.classes.of_member]

    # -- network callbacks ----------------------------------------------------------------------
    def contention(self, flows: int, link: int, own: int) -> None:
        if flows > self.max_flows:
            self.max_flows, self.worst_link = flows, link
        if own > self.max_own:
            self.max_own = own

    # -- member progress -------------------------------------------------------------------------
    def start(self, devices: np.ndarray, t: float) -> None:
        """The gate opened for ``devices`` at ``t``: they enter step 0."""
        members = self.groups.member_of_device[devices]
        if self.classes is not None:
            units = np.unique(self.classes.of_member[members])
            if int(self.classes.size[units].sum()) == members.size:
                members = units
            else:
                self._expand()                      # part of a class opens now: go on member by member
        self._t0[members] = t
        self.enter(members, 0, t)

    def expand(self) -> None:
        """Go on member by member (the network found a class whose flows no longer move alike)."""
        if self.classes is not None:
            self._expand()

    def _expand(self) -> None:
        """From classes to members (every member of a class is in its class's state, so this is exact);
        flows already sent over classes are delivered as such (:meth:`_delivered` translates)."""
        for span in list(self.live_spans):         # (in class terms: hand them back first)
            span.cancel(self.host.env.now)
        assert self.classes is not None
        of = self.classes.of_member
        self.cur, self._t0, self._t1 = self.cur[of], self._t0[of], self._t1[of]
        self._count = {s: c[of] for s, c in self._count.items()}
        self._left = {s: int((self.cur > s).sum()) for s in self._count}
        self._out.clear()
        self.classes, self.plans, self.M = None, self.member_plans, self.N

    def _counts(self, s: int) -> np.ndarray:
        c = self._count.get(s)
        if c is None:
            c = self._count[s] = self.plans[s].count0.copy()
        return c

    def enter(self, members: np.ndarray, s: int, t: float) -> None:
        S = len(self.plans)
        while members.size:
            if s > 0:
                self.leave(s - 1, members.size)
            if s >= S:
                self._finish(members, t)
                return
            self.cur[members] = s
            if self._spans and self._span_net is not None:
                if plan_span(self, self._span_net, members, s, self.host.env.now) is not None:
                    self._misses = 0
                    return                                      # (a span ends them or hands them back)
                self._misses += 1
                self._spans = self._misses < _MISSES         # (members drifting apart all along: stop trying)
            plan = self.plans[s]
            self._send(plan, s, members, t)
            members = members[self._counts(s)[members] == 0]   # nothing to send or receive in step s
            s += 1

    def leave(self, s: int, n: int) -> None:
        """``n`` members are done with step ``s``: once all are, its counters go (a ring over 4096
        members has 8190 steps of 4096 counters)."""
        left = self._left.get(s, 0) + n
        if left >= self.M:
            self._left.pop(s, None)
            self._count.pop(s, None)
        else:
            self._left[s] = left

    def index_of(self, plan: FlowStep, members: np.ndarray) -> np.ndarray | None:
        """The flows (entries) of ``plan`` that ``members`` send; ``None``: all of them."""
        if members.size == self.M:
            return None
        if self.classes is not None:              # few classes, few distinct subsets: remember them
            okey = (id(plan.src), members.tobytes())
            idx = self._out.get(okey)
            if idx is None:
                idx = self._out[okey] = plan.out_flows(members)
            return idx
        return plan.out_flows(members)

    def _send(self, plan: FlowStep, s: int, members: np.ndarray, t: float) -> None:
        idx = self.index_of(plan, members)
        if idx is not None and not idx.size:
            return
        overhead = self.host.message_overhead_s
        if overhead <= 0:
            self.post(plan, s, idx, plan.nbytes if idx is None else plan.nbytes[idx])
            return
        # each message costs its sender `overhead` to post, one after the other
        ids = np.arange(len(plan.src)) if idx is None else idx
        ranks = plan.rank[ids]
        for r in np.unique(ranks).tolist():
            sel = ids[ranks == r]
            ev = self.host.env.timeout((r + 1) * overhead)

            def post(_e: object, sel: np.ndarray = sel) -> None:
                self.post(plan, s, sel, plan.nbytes[sel])
            ev.callbacks.append(post)

    def post(self, plan: FlowStep, s: int, idx: np.ndarray | None, nbytes: np.ndarray) -> None:
        """Send flows ``idx`` (all: ``None``) of step ``s`` now, ``nbytes`` each; deliveries go to :meth:`_delivered`."""
        def cb(ids: np.ndarray | None, when: float, flows: bool = False, s: int = s,
               over: bool = plan.classes is not None) -> None:
            self._delivered(s, ids, when, over and not flows)
        kw = {} if plan.classes is None else {"classes": plan.classes}
        self.host.network.send(plan.route, idx, nbytes, cb, self, **kw)

    def _delivered(self, s: int, ids: np.ndarray | None, t: float, over_classes: bool = False) -> None:
        if over_classes and self.classes is None and ids is not None:   # sent over classes, expanded since
            fc = self.class_plans[s].classes
            assert fc is not None
            ids = fc.expand(ids)[0]
        plan = self.plans[s]
        cnt = self._counts(s)
        if ids is None:
            cnt -= plan.count0
            cand = np.flatnonzero((cnt == 0) & (self.cur == s))
        else:
            both = np.concatenate((plan.src[ids], plan.dst[ids]))
            if plan.dsrc is None or plan.ddst is None:
                np.subtract.at(cnt, both, 1)
            else:
                np.subtract.at(cnt, both, np.concatenate((plan.dsrc[ids], plan.ddst[ids])))
            cand = both[(cnt[both] == 0) & (self.cur[both] == s)]
            if cand.size > 1:                       # (few classes: a set is cheaper than np.unique)
                cand = np.unique(cand) if cand.size > 64 else np.array(sorted(set(cand.tolist())), dtype=np.int64)
        if cand.size:
            self.enter(cand, s + 1, t)

    def _finish(self, members: np.ndarray, t: float) -> None:
        self.cur[members] = len(self.plans)
        self._t1[members] = t
        if self.classes is not None:
            members = self.classes.expand(members)
        self.finished += members.size
        if self.finished == self.N:
            self._count.clear()
            self._left.clear()
        self.host.collective_done(self.ci, self.dev[members], t, self.finished == self.N)

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

from dataclasses import dataclass

import numpy as np

from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.hwmodels.des.protocols import CollectiveHost
from partir_emu.hwmodels.des.routing import RoutePattern, Router
from partir_emu.hwmodels.placement import Placement


@dataclass(frozen=True)
class Groups:
    """The groups of a collective over ``axes``: ``devices[g, pos]`` and ``chips[g, pos]`` in schedule order."""

    axes: tuple[str, ...]
    devices: np.ndarray          # int64 [G, p]
    chips: np.ndarray            # int64 [G, p]
    member_of_device: np.ndarray  # int64 [N]

    @property
    def p(self) -> int:
        return self.devices.shape[1]


def make_groups(placement: Placement, axes: tuple[str, ...]) -> Groups:
    """Every group over ``axes`` with positions ordered as ``comm.choose_algorithm`` orders the
    representative group (GPU: by node, then chip, as NCCL orders ranks)."""
    topo = placement.topology
    rows, chip_rows = [], []
    for g in placement.mesh.groups(axes):
        chips = [placement.chip_of(d) for d in g]
        if topo.kind == "gpu":
            order = sorted(range(len(g)), key=lambda i: (topo.node_of(chips[i]), chips[i]))
            g, chips = [g[i] for i in order], [chips[i] for i in order]
        rows.append(g)
        chip_rows.append(chips)
    devices = np.array(rows, dtype=np.int64)
    member = np.empty(devices.size, dtype=np.int64)
    member[devices.ravel()] = np.arange(devices.size)
    return Groups(axes, devices, np.array(chip_rows, dtype=np.int64), member)


@dataclass(frozen=True)
class StepPlan:
    """Step ``s`` of a schedule over all groups: its flows (one per message per group)."""

    src: np.ndarray              # member id of each flow's sender
    dst: np.ndarray
    nbytes: np.ndarray           # float64
    rank: np.ndarray             # index of the flow among its sender's messages of the step
    route: RoutePattern
    count0: np.ndarray           # per member: flows it sends or receives in the step
    by_src: np.ndarray           # flow ids sorted by sender
    src_ptr: np.ndarray          # by_src[src_ptr[m]:src_ptr[m+1]] are member m's flows
    group_max: int               # max messages of one group on one link (what the analytical model sees)

    def out_flows(self, members: np.ndarray) -> np.ndarray:
        lo, hi = self.src_ptr[members], self.src_ptr[members + 1]
        n = hi - lo
        if not n.any():
            return np.zeros(0, dtype=np.int64)
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(n)[:-1])), n)
        return np.sort(self.by_src[np.arange(n.sum()) + starts])


def step_plans(sched: CollectiveSchedule, groups: Groups, router: Router) -> list[StepPlan]:
    """The flows of every step of ``sched`` run by every group."""
    G, p = groups.devices.shape
    out = []
    for msgs in sched.messages():
        ms = np.array([m.src for m in msgs], dtype=np.int64)
        md = np.array([m.dst for m in msgs], dtype=np.int64)
        mb = np.array([m.nbytes for m in msgs], dtype=np.float64)
        out.append(build_plan(ms, md, mb, G, p, groups.chips.ravel(), router))
    return out


def build_plan(ms: np.ndarray, md: np.ndarray, mb: np.ndarray, G: int, p: int, chips: np.ndarray,
               router: Router) -> StepPlan:
    """One step: messages ``ms[k] -> md[k]`` of ``mb[k]`` bytes (positions in a group of ``p``), run by
    each of ``G`` groups; member ``g*p + pos`` sits on chip ``chips[g*p + pos]``."""
    M = G * p
    K = len(ms)
    seen: dict[int, int] = {}
    rk = np.array([seen.__setitem__(s, seen.get(s, -1) + 1) or seen[s] for s in ms.tolist()], dtype=np.int64)
    base = (np.arange(G, dtype=np.int64) * p)[:, None]
    src = (base + ms[None, :]).ravel()
    dst = (base + md[None, :]).ravel()
    route = router.pattern(chips[src], chips[dst])
    count0 = np.bincount(src, minlength=M) + np.bincount(dst, minlength=M)
    by_src = np.argsort(src, kind="stable")
    src_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=M))))
    g0 = route.links[:K].ravel()
    group_max = int(np.bincount(g0[g0 >= 0]).max()) if (g0 >= 0).any() else 0
    return StepPlan(src, dst, np.tile(mb, G), np.tile(rk, G), route, count0, by_src, src_ptr, group_max)


class CollectiveRun:
    """The state of one collective: which step each member is in, and when it started and finished.
    It sends its flows on ``host.network`` and tells ``host.collective_done`` where it finished."""

    def __init__(self, host: CollectiveHost, ci: int, index: int, prim: str, axes: tuple[str, ...], nbytes: int,
                 algorithm: str, groups: Groups, plans: list[StepPlan]) -> None:
        self.host = host
        self.ci = ci                      # position among the program's communicating collectives
        self.index = index                # equation index
        self.prim = prim
        self.axes = axes
        self.nbytes = nbytes
        self.algorithm = algorithm
        self.groups = groups
        self.plans = plans
        self.M = groups.devices.size
        self.dev = groups.devices.ravel()
        self.cur = np.full(self.M, -1, dtype=np.int64)
        self.t_start = np.full(self.M, np.nan)
        self.t_end = np.full(self.M, np.nan)
        self._count: dict[int, np.ndarray] = {}
        self.finished = 0
        self.max_flows = 0                # most flows seen on one of its links (any collective's)
        self.worst_link = -1
        self.max_own = 0                  # most flows of this collective's step on one link
        self.group_max = max((pl.group_max for pl in plans), default=0)

    @property
    def num_steps(self) -> int:
        return len(self.plans)

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
        self.t_start[members] = t
        self._enter(members, 0, t)

    def _counts(self, s: int) -> np.ndarray:
        c = self._count.get(s)
        if c is None:
            c = self._count[s] = self.plans[s].count0.copy()
        return c

    def _enter(self, members: np.ndarray, s: int, t: float) -> None:
        S = len(self.plans)
        while members.size:
            if s >= S:
                self._finish(members, t)
                return
            self.cur[members] = s
            plan = self.plans[s]
            self._send(plan, s, members, t)
            members = members[self._counts(s)[members] == 0]   # nothing to send or receive in step s
            s += 1

    def _send(self, plan: StepPlan, s: int, members: np.ndarray, t: float) -> None:
        idx = None if members.size == self.M else plan.out_flows(members)
        if idx is not None and not idx.size:
            return
        host = self.host
        overhead = host.message_overhead_s
        cb = lambda ids, when, s=s: self._delivered(s, ids, when)
        if overhead <= 0:
            host.network.send(plan.route, idx, plan.nbytes if idx is None else plan.nbytes[idx], cb, self)
            return
        # each message costs its sender `overhead` to post, one after the other
        ids = np.arange(plan.route.n) if idx is None else idx
        ranks = plan.rank[ids]
        for r in np.unique(ranks).tolist():
            sel = ids[ranks == r]
            ev = host.env.timeout((r + 1) * overhead)
            ev.callbacks.append(lambda _e, sel=sel: host.network.send(plan.route, sel, plan.nbytes[sel], cb, self))

    def _delivered(self, s: int, ids: np.ndarray | None, t: float) -> None:
        plan = self.plans[s]
        cnt = self._counts(s)
        if ids is None:
            cnt -= plan.count0
            cand = np.flatnonzero((cnt == 0) & (self.cur == s))
        else:
            both = np.concatenate((plan.src[ids], plan.dst[ids]))
            np.subtract.at(cnt, both, 1)
            cand = both[(cnt[both] == 0) & (self.cur[both] == s)]
            if cand.size > 1:
                cand = np.unique(cand)
        if cand.size:
            self._enter(cand, s + 1, t)

    def _finish(self, members: np.ndarray, t: float) -> None:
        self.cur[members] = len(self.plans)
        self.t_end[members] = t
        self.finished += members.size
        if self.finished == self.M:
            self._count.clear()
        self.host.collective_done(self.ci, self.dev[members], t, self.finished == self.M)

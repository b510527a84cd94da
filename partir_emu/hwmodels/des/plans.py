"""Step plans: the flows of each step of a collective's schedule run by every group at once.

A :class:`FlowStep` is one step over all ``G`` groups of ``p`` members (member ``g * p + position``):
its flows (one per message per group), their routes and what each member sends and receives.
:func:`step_plans` builds them from the schedule's transfer table, one plan per distinct step shape
(the steps of a ring share their routes and differ only in bytes); :mod:`.classes` rewrites them
over symmetry classes of members.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from partir_emu.collectives.schedule import CollectiveSchedule
from partir_emu.hwmodels.des.network.routing import FlowClasses, FlowRouter, RoutePattern
from partir_emu.hwmodels.machine.placement import Placement


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


_WHOLE_TABLE = 1 << 22      # transfers up to which step_plans reads the table's nbytes column whole


@dataclass(frozen=True)
class FlowStep:
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
    # over member classes (.classes): "members" are classes, a flow is a class of flows, and a delivery
    # counts dsrc[f] (ddst[f]) messages of each member of its sender's (receiver's) class
    classes: FlowClasses | None = None
    dsrc: np.ndarray | None = None
    ddst: np.ndarray | None = None

    def out_flows(self, members: np.ndarray) -> np.ndarray:
        lo, hi = self.src_ptr[members], self.src_ptr[members + 1]
        n = hi - lo
        if not n.any():
            return np.zeros(0, dtype=np.int64)
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(n)[:-1])), n)
        return np.sort(self.by_src[np.arange(n.sum()) + starts])


def step_plans(sched: CollectiveSchedule, groups: Groups, router: FlowRouter, aggregate: bool = True) -> list[FlowStep]:
    """The flows of every step of ``sched`` run by every group.

    ``aggregate``: read the schedule's transfer table and build one plan per distinct step *shape*
    (its ``(src, dst)`` pairs): the steps of a ring share their routes, member counts and flow
    orders, and differ only in bytes (kept once per distinct byte vector). ``False``: one plan per
    step from :meth:`CollectiveSchedule.messages` (the reference the tests hold it equal to)."""
    G, p = groups.devices.shape
    chips = groups.chips.ravel()
    if not aggregate:
        out = []
        for msgs in sched.messages():
            ms = np.array([m.src for m in msgs], dtype=np.int64)
            md = np.array([m.dst for m in msgs], dtype=np.int64)
            mb = np.array([m.nbytes for m in msgs], dtype=np.float64)
            out.append(build_plan(ms, md, mb, G, p, chips, router))
        return out
    tab = sched.table()
    ptr = tab.ptr.tolist()
    # bytes per transfer; on a large table from the chunk sizes, one step at a time (a 4096-member ring has
    # 33 M transfers: the table's whole nbytes column would be a 270 MB temporary)
    nb_all = tab.nbytes if len(tab) <= _WHOLE_TABLE else None
    prefix = np.concatenate(([0], np.cumsum(np.asarray(sched.chunk_bytes, dtype=np.int64))))
    shapes: dict[bytes, tuple[FlowStep, np.ndarray]] = {}
    sizes: dict[bytes, np.ndarray] = {}
    out = []
    for s in range(tab.num_steps):
        lo, hi = ptr[s], ptr[s + 1]
        src, dst = tab.src[lo:hi], tab.dst[lo:hi]
        key = src.tobytes() + dst.tobytes()
        hit = shapes.get(key)
        if hit is None:
            pair = src.astype(np.int64) * p + dst
            uniq, first, inv = np.unique(pair, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")             # messages in first-appearance order
            rank_of = np.empty(len(order), dtype=np.int64)
            rank_of[order] = np.arange(len(order))
            ms, md = uniq[order] // p, uniq[order] % p
            proto = build_plan(ms, md, np.zeros(len(ms)), G, p, chips, router)
            hit = shapes[key] = (proto, rank_of[inv.ravel()])
        proto, msg_of = hit
        if nb_all is not None:
            nb = nb_all[lo:hi].astype(np.float64)
        else:
            c = tab.chunk[lo:hi].astype(np.int64)
            nb = (prefix[c + tab.count[lo:hi]] - prefix[c]).astype(np.float64)
        per_msg = np.bincount(msg_of, weights=nb, minlength=len(proto.nbytes) // G)
        bkey = per_msg.tobytes()
        tiled = sizes.get(bkey)
        if tiled is None:
            tiled = sizes[bkey] = np.tile(per_msg, G)
        out.append(replace(proto, nbytes=tiled))
    return out


def build_plan(ms: np.ndarray, md: np.ndarray, mb: np.ndarray, G: int, p: int, chips: np.ndarray,
               router: FlowRouter) -> FlowStep:
    """One step: messages ``ms[k] -> md[k]`` of ``mb[k]`` bytes (positions in a group of ``p``), run by
    each of ``G`` groups; member ``g*p + pos`` sits on chip ``chips[g*p + pos]``."""
    M = G * p
    K = len(ms)
    sent: dict[int, int] = {}          # messages of each sender so far: a message's rank among its sender's
    ranks = []
    for s in ms.tolist():
        ranks.append(sent.get(s, 0))
        sent[s] = ranks[-1] + 1
    rk = np.array(ranks, dtype=np.int64)
    base = (np.arange(G, dtype=np.int64) * p)[:, None]
    src = (base + ms[None, :]).ravel()
    dst = (base + md[None, :]).ravel()
    route = router.pattern(chips[src], chips[dst])
    count0 = np.bincount(src, minlength=M) + np.bincount(dst, minlength=M)
    by_src = np.argsort(src, kind="stable")
    src_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=M))))
    g0 = route.links[:K].ravel()
    group_max = int(np.bincount(g0[g0 >= 0]).max()) if (g0 >= 0).any() else 0
    return FlowStep(src, dst, np.tile(mb, G), np.tile(rk, G), route, count0, by_src, src_ptr, group_max)



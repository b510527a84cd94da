"""Symmetry classes of a collective's members, and its step plans over classes instead of members.

A ring all-reduce over 4096 GPUs in 512 nodes has 4096 members, but a member's timeline depends
only on where it sits relative to the node, leaf-switch and scalable-unit boundaries: members at
the same place in their node and leaf move in lock step. :func:`member_classes` finds such classes
by *colour refinement* over the step plans: start with one colour; a flow's colour is its bytes,
route latency, bottleneck capacity, hop count and send rank plus its sender's and receiver's
colours; a member's next colour is its colour and, per distinct plan, the multiset of colours of
the flows it sends and receives. Repeat until the number of colours is stable (an *equitable*
partition: every member of a class sends and receives the same numbers of flows of each flow class).

:func:`reduce_plans` rewrites the plans over classes: a "member" is a class, a flow is a class of
flows with its multiplicity (:class:`~partir_emu.hwmodels.des.network.routing.FlowClasses`), and each delivery counts for
``mult / class size`` messages of each member. :class:`~.collective.CollectiveRun` runs them
unchanged. Exactness does not rest on the refinement alone; what it cannot see is checked while
running, and a failed check only makes the simulation finer, never different:

- devices that open a collective at different times: the classes are seeded with who opens it
  first and who finished their last collective together (the later openers); a later opening that
  cuts a class sends that collective on member by member (:meth:`~.collective.CollectiveRun.start`);
- contention the classes do not foresee (another collective's flows, a fault): the network checks
  at every rate solve that the flows of a class share one rate, else that batch goes on flow by
  flow and its collective member by member (:meth:`~.network.FlowNetwork._split`).

Stragglers, degraded or failed links and asymmetric contention thus give finer classes or the
per-member path; the tests hold the result equal to the reference path (``aggregate=False``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from partir_emu.hwmodels.des.network.routing import FlowClasses, FlowRouter
from partir_emu.hwmodels.des.plans import FlowStep

MAX_ROUNDS = 4096          # refinement rounds (each splits a class; past this, no classes)
MIN_GAIN = 2               # use classes only if they are at least this many times fewer than members


@dataclass(frozen=True)
class MemberClasses:
    """``of_member[m]``: the class of member ``m``; class ``c`` is ``members[ptr[c]:ptr[c+1]]``."""

    of_member: np.ndarray
    members: np.ndarray
    ptr: np.ndarray

    @property
    def n(self) -> int:
        return len(self.ptr) - 1

    @property
    def size(self) -> np.ndarray:
        return np.diff(self.ptr)

    def expand(self, classes: np.ndarray) -> np.ndarray:
        """The members of ``classes``, class after class."""
        lo, cnt = self.ptr[classes], np.diff(self.ptr)[classes]
        offs = np.repeat(lo - np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)
        return self.members[np.arange(int(cnt.sum())) + offs]


def _ids(*cols: np.ndarray) -> np.ndarray:
    """Dense ids of the distinct rows of the given columns (column by column: 1-d sorts, no overflow)."""
    key: np.ndarray | None = None
    for c in cols:
        inv = np.unique(np.asarray(c), return_inverse=True)[1].ravel()
        if key is None:
            key = inv
        else:
            key = np.unique(key * (int(inv.max()) + 1) + inv, return_inverse=True)[1].ravel()
    assert key is not None
    return key


class_ids = _ids


def _member_sig(M: int, src: np.ndarray, dst: np.ndarray, fid: np.ndarray, F: int) -> np.ndarray:
    """Per member, an id of the multiset of (role, flow colour) over its flows of one plan."""
    m = np.concatenate((src, dst))
    k = np.concatenate((fid, fid + F))
    order = np.lexsort((k, m))
    m, k = m[order], k[order]
    cnt = np.bincount(m, minlength=M)
    w = int(cnt.max()) if M else 0
    mat = np.full((M, max(w, 1)), -1, dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(cnt)[:-1]))
    mat[m, np.arange(len(m)) - start[m]] = k
    return _ids(*mat.T)


def _static_keys(plan: FlowStep, router: FlowRouter) -> np.ndarray:
    """Per flow: an id of (bytes, route latency, bottleneck capacity, hops, rank)."""
    links = plan.route.links
    ok = links >= 0
    cap = np.where(ok, router.bw[np.where(ok, links, 0)], np.inf).min(axis=1)
    return _ids(plan.nbytes, plan.route.latency_s, cap, ok.sum(axis=1), plan.rank)


def member_classes(plans: list[FlowStep], M: int, router: FlowRouter,
                   seed: np.ndarray | None = None) -> tuple[np.ndarray, list[FlowStep]]:
    """``(class of each member, the distinct plans)`` by colour refinement (module docstring), from
    the colours ``seed`` (e.g. which members start first) or one colour."""
    distinct = list({(id(pl.src), id(pl.nbytes)): pl for pl in plans}.values())
    static = [_static_keys(pl, router) for pl in distinct]
    colour = np.zeros(M, dtype=np.int64) if seed is None else _ids(seed)
    n = int(colour.max()) + 1 if M else 0
    for _ in range(MAX_ROUNDS):
        cols = [colour]
        for pl, sk in zip(distinct, static):
            fid = _ids(sk, colour[pl.src], colour[pl.dst])
            cols.append(_member_sig(M, pl.src, pl.dst, fid, int(fid.max()) + 1 if len(fid) else 0))
        new = _ids(*cols)
        m = int(new.max()) + 1 if M else 0
        colour = new
        if m == n:
            return colour, distinct
        n = m
    return np.arange(M, dtype=np.int64), distinct      # not stable yet: one member per class (no gain)


def reduce_plans(plans: list[FlowStep], M: int, router: FlowRouter,
                 seed: np.ndarray | None = None) -> tuple[MemberClasses, list[FlowStep]] | None:
    """The plans over member classes (refined from ``seed``), or ``None`` when there is too little
    symmetry to gain."""
    if not plans:
        return None
    colour, distinct = member_classes(plans, M, router, seed)
    C = int(colour.max()) + 1
    if C * MIN_GAIN > M:
        return None
    order = np.argsort(colour, kind="stable")
    size = np.bincount(colour, minlength=C)
    classes = MemberClasses(colour, order, np.concatenate(([0], np.cumsum(size))))
    reduced: dict[tuple[int, int], FlowStep] = {}
    for pl, sk in zip(distinct, [_static_keys(pl, router) for pl in distinct]):
        r = _reduce(pl, sk, colour, size, C)
        if r is None:
            return None
        reduced[(id(pl.src), id(pl.nbytes))] = r
    return classes, [reduced[(id(pl.src), id(pl.nbytes))] for pl in plans]


def _reduce(pl: FlowStep, sk: np.ndarray, colour: np.ndarray, size: np.ndarray, C: int) -> FlowStep | None:
    fid = _ids(sk, colour[pl.src], colour[pl.dst])
    F = int(fid.max()) + 1 if len(fid) else 0
    flows = np.argsort(fid, kind="stable")
    mult = np.bincount(fid, minlength=F)
    ptr = np.concatenate(([0], np.cumsum(mult)))
    rep = flows[ptr[:-1]]
    src, dst = colour[pl.src[rep]], colour[pl.dst[rep]]
    if (mult % size[src]).any() or (mult % size[dst]).any():
        return None                       # not equitable (cannot happen after refinement): per member
    count0 = np.zeros(C, dtype=np.int64)
    count0[colour] = pl.count0
    if (count0[colour] != pl.count0).any():
        return None
    by_src = np.argsort(src, kind="stable")
    src_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=C))))
    fc = FlowClasses(flows.astype(np.int64), ptr.astype(np.int64), pl.route.latency_s[rep])
    return replace(pl, src=src, dst=dst, nbytes=pl.nbytes[rep], rank=pl.rank[rep], count0=count0, by_src=by_src,
                   src_ptr=src_ptr, classes=fc, dsrc=mult // size[src], ddst=mult // size[dst])

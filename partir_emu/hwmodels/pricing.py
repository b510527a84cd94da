"""Pricing one run of a per-device program on a chip and a placement: the analytical model's core.

:func:`price` turns a :class:`~.program_costs.ProgramAnalysis` into per-equation times, the step,
and the memory profile:

- compute equations: their fused groups' times (:func:`~.program_costs.compute_times`);
- communicating collectives: their price on the placement (``comm.CommModel``; each distinct
  (prim, axes, bytes, dtype, permutation) priced once);
- a ``loop`` equation: ``length`` × the step of its body, the body priced once by this same function
  (its own fusion groups, since a loop is a fusion boundary; its own overlap schedule). Iterations are
  sequential: everything of iteration ``i``, its asynchronous collectives included, completes before
  iteration ``i + 1`` starts, as in an XLA while loop without collective pipelining; so every
  iteration takes the body's step, and the body is never unrolled. In its enclosing program's overlap
  schedule a loop is a barrier (:mod:`partir_emu.hwmodels.timeline.overlap`);
- without overlap the step is compute + communication; with overlap the schedule of :mod:`partir_emu.hwmodels.timeline.overlap`
  (``comm_streams`` communication streams, concurrent collectives sharing links: :mod:`partir_emu.hwmodels.network.concurrency`),
  and the memory profile with the prefetch buffers of that schedule, loop bodies with their own
  schedules' (rule 5 of :mod:`partir_emu.core.analysis`).

:func:`totals` sums FLOPs, HBM bytes, the fusion summary and the breakdowns over *every iteration*
(a body's × its length), and :func:`collective_rows` lists every executed collective with its start
(one row per iteration of a body collective), so a loop program reports what its unrolled form does.
With several communication streams a row's time and ``comm_s`` are the collectives' durations in the
schedule (slowed by the others in flight, :mod:`partir_emu.hwmodels.network.concurrency`), not their standalone prices.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.hwmodels.compute.costs import KINDS
from partir_emu.hwmodels.compute.memory import MemoryProfile, peak_memory
from partir_emu.hwmodels.compute.program import ProgramAnalysis, ProgramCosts, compute_times
from partir_emu.hwmodels.machine.specs import HardwareSpec
from partir_emu.hwmodels.network.comm import CollectiveCost, CommModel
from partir_emu.hwmodels.network.concurrency import Contention
from partir_emu.hwmodels.report import CollectiveRow
from partir_emu.hwmodels.timeline.overlap import OverlapSchedule, overlap_memory, schedule


@dataclass(frozen=True, eq=False)
class Priced:
    """One run of a program, priced (a loop body's run: one iteration)."""

    analysis: ProgramAnalysis
    times: np.ndarray                # per equation: fused group time on its last equation, collective price,
                                     # loop: length × its body's step
    costs: list[CollectiveCost]      # per distinct collective (``ProgramCosts.comm_keys``)
    compute_s: float                 # every iteration of every loop counted
    comm_s: float
    step_s: float
    sched: OverlapSchedule | None           # with overlap
    memory: MemoryProfile            # with overlap: the schedule's
    bodies: Mapping[int, Priced]     # per loop equation: its body, priced once
    walked: int                      # equations walked: this program's, each body's once


def price(entry: ProgramAnalysis, spec: HardwareSpec, model: CommModel, overlap: bool,
          prefetch_bytes: int | None = None, comm_streams: int = 1, compute_scale: float = 1.0,
          memory: bool = True) -> Priced:
    """Price one run of ``entry``'s program (module docstring). ``compute_scale`` multiplies every
    compute equation's time (loop bodies' too: a uniformly slower or faster chip); ``comm_streams`` is
    the number of collectives the overlap schedule may run at once (:func:`partir_emu.hwmodels.timeline.overlap.schedule`).
    ``memory=False`` (a placement search, which ranks by step only): the memory profile is the
    program-order one, not the overlap schedule's (which holds prefetch buffers); times and step are the same."""
    pc = entry.costs
    times = compute_times(pc, spec)
    if compute_scale != 1.0:
        times = times * compute_scale
    keys = wire_keys(pc.comm_keys, spec)
    costs = [model.cost(*key) for key in keys]
    is_comm = pc.is_comm
    if costs:
        times[pc.comm_index] = np.array([c.time_s for c in costs])[pc.comm_inverse]
    bodies: dict[int, Priced] = {}
    compute_s = float(times[~is_comm].sum())
    comm_s = float(times[is_comm].sum())
    walked = len(times)
    for lc in pc.loops:
        b = bodies[lc.index] = price(lc.body, spec, model, overlap, prefetch_bytes, comm_streams, compute_scale,
                                     memory)
        times[lc.index] = lc.length * b.step_s
        compute_s += lc.length * b.compute_s
        comm_s += lc.length * b.comm_s
        walked += b.walked
    mem = pc.memory_for(entry.program, spec.stack.saved_activations)
    sched = None
    if overlap:
        plan = entry.overlap_plan()
        contention = Contention.of(model, keys) if comm_streams > 1 and len(keys) else None
        sched = schedule(plan, times, prefetch_bytes, comm_streams, contention, pc.comm_inverse.tolist(),
                         blocking=blocking_collectives(pc, model))
        step_s = sched.step_s
        if contention is not None:          # collectives in flight together last longer than priced alone
            comm_s += float(np.sum(np.subtract(sched.finish, sched.start))) - float(times[is_comm].sum())
        if memory:
            mem = overlap_memory(plan, entry.program, _with_bodies(entry, bodies, spec.stack.saved_activations), sched)
    else:
        step_s = compute_s + comm_s
    return Priced(entry, times, costs, compute_s, comm_s, float(step_s), sched, mem, bodies, walked)


def blocking_collectives(pc: ProgramCosts, model: CommModel) -> tuple[int, ...]:
    """The collectives of ``pc`` (program order) that block the compute stream on ``model``'s placement
    (:meth:`~.network.comm.CommModel.blocks_compute`: across TPU slices whose DCN does not overlap compute)."""
    if not len(pc.comm_keys) or getattr(model.placement.topology, "dcn_overlaps_compute", True):
        return ()
    blocks = [model.blocks_compute(key[1]) for key in pc.comm_keys]
    return tuple(c for c, k in enumerate(pc.comm_inverse.tolist()) if blocks[k])


def wire_keys(keys: Sequence[tuple], spec: HardwareSpec) -> list[tuple]:
    """``ProgramCosts.comm_keys`` as the stack moves them (:meth:`.compute.stack.StackSpec.wire`: fp32
    gradient reductions of a 16-bit program); the keys themselves when the stack changes nothing."""
    st = spec.stack
    if st.gradient_reduce_dtype == "as_traced":
        return list(keys)
    return [(prim, axes, *st.wire(prim, axes, nbytes, dtype), perm) for prim, axes, nbytes, dtype, perm in keys]


def _with_bodies(entry: ProgramAnalysis, bodies: Mapping[int, Priced], policy: str) -> MemoryProfile:
    """The program-order profile of ``entry`` with each loop point holding its body's profile as priced
    (with overlap, the body's schedule's): the analysis' own when no body's differs; else computed
    and kept by the bodies' peaks and breakdowns."""
    pc = entry.costs
    ran = {lc.index: bodies[lc.index].memory for lc in pc.loops if lc.length > 0}
    if all(ran[lc.index] is lc.body.costs.memory_for(lc.body.program, policy) for lc in pc.loops if lc.length > 0):
        return pc.memory_for(entry.program, policy)
    key = (policy, *((i, m.peak_bytes, tuple(sorted(m.breakdown.items()))) for i, m in ran.items()))
    memo = entry.memo
    hit = memo.get(key)
    if hit is None:
        if len(memo) > 16:
            memo.clear()
        hit = memo[key] = peak_memory(entry.program, ran, policy)
    return hit


# -- what the report sums over every iteration --------------------------------------------------------
@dataclass(frozen=True)
class Totals:
    flops: float
    hbm_bytes: float
    dot_flops: float
    fusion: dict[str, float]
    by_kind: dict[str, dict[str, float]]
    by_prim: dict[str, dict[str, float]]
    by_coll: dict[str, dict[str, float]]
    by_axes: dict[str, dict[str, float]]


def totals(pr: Priced, spec: HardwareSpec) -> Totals:
    """FLOPs, HBM traffic, matmul FLOPs, fusion summary and breakdowns of one run of ``pr``'s program,
    a loop's body counted ``length`` times. In ``by_op_kind`` and ``by_prim`` a fused group's time and
    bytes count under its dominant equation; counts are of executed equations (a loop equation itself
    is not counted: its body's equations are)."""
    pc = pr.analysis.costs
    fplan = pc.fusion.plan(spec.kernels)
    n = len(pr.times)
    rep_t, rep_b = np.zeros(n), np.zeros(n)
    rep_t[fplan.rep] = pr.times[fplan.last]
    rep_b[fplan.rep] = fplan.bytes
    rep_t[pc.loop_index] = 0.0                   # the loop's time is its body's, counted below
    by_kind, by_prim, by_coll, by_axes = _breakdowns(pc, rep_t, rep_b, pr.costs)
    out = Totals(float(pc.flops.sum()), float(fplan.bytes.sum()), float(fplan.dot_flops.sum()),
                 fplan.summary(float(pc.bytes.sum())), by_kind, by_prim, by_coll, by_axes)
    for lc in pc.loops:
        k = lc.length
        if not k:
            continue                             # a body that never runs adds no row, not even a zero one
        sub = totals(pr.bodies[lc.index], spec)
        out = Totals(out.flops + k * sub.flops, out.hbm_bytes + k * sub.hbm_bytes, out.dot_flops + k * sub.dot_flops,
                     {key: v + k * sub.fusion[key] for key, v in out.fusion.items()},
                     *(_merge(a, b, k) for a, b in ((out.by_kind, sub.by_kind), (out.by_prim, sub.by_prim),
                                                    (out.by_coll, sub.by_coll), (out.by_axes, sub.by_axes))))
    return out


def _merge(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], k: int) -> dict[str, dict[str, float]]:
    """``a`` plus ``k`` × ``b``, row by row (a fresh dict)."""
    out = {key: dict(row) for key, row in a.items()}
    for key, row in b.items():
        t = out.setdefault(key, dict.fromkeys(row, 0))
        for f, v in row.items():
            t[f] += k * v
    return out


def _breakdowns(pc: ProgramCosts, times: np.ndarray, byts: np.ndarray, costs: list[CollectiveCost]
                ) -> tuple[dict, ...]:
    """Time, count, FLOPs and bytes by op kind and by primitive (``times`` and ``byts`` per equation, a
    fused group's on its dominant equation; counts are of equations, loop equations left out); time,
    count and bytes by collective kind and by mesh axes."""
    nk = len(KINDS)
    counted = np.ones(len(times))
    counted[pc.loop_index] = 0.0
    ksums = [np.bincount(pc.kind, weights=w, minlength=nk).tolist() for w in (counted, times, pc.flops, byts)]
    by_kind = {name: {"count": int(ksums[0][k]), "time_s": ksums[1][k], "flops": ksums[2][k], "bytes": ksums[3][k]}
               for k, name in enumerate(KINDS) if ksums[0][k]}
    m = len(pc.prim_names)
    sums = [np.bincount(pc.prim_index, weights=w, minlength=m).tolist()
            for w in (counted, times, pc.flops, byts)]
    by_prim = {name: {"count": int(sums[0][j]), "time_s": sums[1][j], "flops": sums[2][j], "bytes": sums[3][j]}
               for j, name in enumerate(pc.prim_names) if sums[0][j]}
    by_coll: dict[str, dict[str, float]] = {}
    by_axes: dict[str, dict[str, float]] = {}
    counts = np.bincount(pc.comm_inverse, minlength=len(costs)).tolist() if costs else []
    for (prim, axes, *_), c, cnt in zip(pc.comm_keys, costs, counts):
        for table, key in ((by_coll, prim), (by_axes, ",".join(axes))):
            d = table.setdefault(key, {"count": 0, "time_s": 0.0, "bytes": 0})
            d["count"] += cnt
            d["time_s"] += cnt * c.time_s
            d["bytes"] += cnt * c.nbytes          # as moved (a stack's fp32 gradient reductions: twice the traced)
    return by_kind, by_prim, by_coll, by_axes


class CollectiveRows(Sequence[CollectiveRow]):
    """:func:`collective_rows` of ``pr``, built when first read: a report's rows (one per executed
    collective, ~2,000 on a 48-layer step) are most of a warm evaluation's time, and a search or a
    study that ranks by the step never reads them. A tuple for every reader: equal to, and hashing
    like, the tuple of its rows."""

    __slots__ = ("_pr", "_rows")

    def __init__(self, pr: Priced) -> None:
        self._pr: Priced | None = pr
        self._rows: tuple[CollectiveRow, ...] | None = None

    def _all(self) -> tuple[CollectiveRow, ...]:
        if self._rows is None:
            assert self._pr is not None
            self._rows, self._pr = tuple(collective_rows(self._pr)), None
        return self._rows

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, i: Any) -> Any:                      # an index or a slice, as a tuple takes
        return self._all()[i]

    def __iter__(self) -> Iterator[CollectiveRow]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CollectiveRows):
            other = other._all()
        return self._all() == other

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"CollectiveRows(<{len(self)} rows>)"


def collective_rows(pr: Priced) -> list[CollectiveRow]:
    """Every collective one run of ``pr``'s program executes, in program order with loops expanded
    (iteration by iteration, in execution order), each with its start. A body's rows are built once
    and shifted per iteration (a report of a 48-layer loop lists ~48× its body's collectives)."""
    new = tuple.__new__                  # CollectiveRow._make without its length check: rows are built here
    return [new(CollectiveRow, r) for r in _rows(pr)]


def _rows(pr: Priced) -> list[tuple]:
    """The fields of :func:`collective_rows` for a run starting at 0, ``at`` relative to the run."""
    pc = pr.analysis.costs
    times, sched = pr.times, pr.sched
    # per equation: when the compute stream starts it (without overlap: the sum of the ones before)
    eqn_start = (sched.compute_finish - times if sched is not None
                 else np.concatenate(([0.0], np.cumsum(times)[:-1])))
    inverse = pc.comm_inverse.tolist()
    out: list[tuple] = []
    loops = list(pc.loops)
    li = 0
    end: tuple[int, str, tuple[str, ...], int, str, tuple | None] = (len(times), "", (), 0, "", None)
    for c, (i, prim, axes, nbytes, *_) in enumerate((*pc.comm, end)):   # ``end`` flushes the last loops
        while li < len(loops) and loops[li].index < i:
            lc = loops[li]
            li += 1
            body = pr.bodies[lc.index]
            inner = _rows(body)
            begin = float(eqn_start[lc.index])
            for k, it in enumerate(lc.iterations):
                t0, pre = begin + k * body.step_s, (lc.index, it)
                out += [(*r[:7], t0 + r[7], pre + r[8]) for r in inner]
        if c == len(pc.comm):
            break
        cost = pr.costs[inverse[c]]
        start = sched.start[c] if sched is not None else float(eqn_start[i])
        took = sched.finish[c] - start if sched is not None and sched.streams > 1 else cost.time_s
        out.append((i, prim, axes, nbytes, cost.group_size, cost.algorithm, took, start, ()))
    return out

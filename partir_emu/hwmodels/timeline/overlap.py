"""Compute/communication overlap as the chip's compiler and runtime do it: one decision logic for
the analytical model and the DES.

Collectives are asynchronous (start/done). A device runs

- a **compute stream**: the compute equations in program order; it waits only where an equation
  needs a collective's result (its *wait point*);
- a **communication stream**: one collective at a time. When it is free it starts, among the
  collectives that are *ready*, the one needed first: priority = the program position of its
  first consumer (XLA's latency-hiding scheduler and NCCL's stream do this; not program order).
  With ``comm_streams = k`` there are ``k`` such streams and collectives in flight together share
  links (:mod:`.engine` with :class:`.networks.Shared`).

Readiness of collective ``c``: the compute stream has *reached* position ``ready_pos[c]`` (every
compute equation before that index finished) and the collectives producing its operand are done.
``ready_pos`` is one past the last compute producer, except for

- **ZeRO-3 parameter all-gathers** (an ``all_gather`` whose operand is a program input, possibly
  through a cast/reshape chain that we hoist with it): prefetched, i.e. ready from the start as
  long as the *prefetched-but-not-yet-needed* gathered bytes stay within ``prefetch_bytes``. The
  gathers are issued in the order they are needed, so the budget rule is static: gather ``k`` (in
  need order) may start once the compute stream has reached the consumer of gather ``j``, the last
  one that must be consumed for gathers ``j+1..k`` to fit (``j = k``: on demand, no prefetch).
- views: a reshape/transpose/convert chain between a collective and its consumer is part of that
  consumer (it fuses into it); the compute stream waits at the first real consumer. So gradient
  reduce-scatters/all-reduces, needed only by the optimizer, hide behind the rest of the backward
  pass, while a Megatron activation all-reduce blocks the next op.

Times are per equation; with fusion (:mod:`partir_emu.hwmodels.compute.fusion`) a group's time sits on its last equation and
the others are 0. A collective's operand is ready one past its producer: exact when that producer
is its group's last equation, which fusion ensures for any value a collective reads (that read
closes the group; on the t48 transformer no collective reads an earlier member).

**Loops** (:mod:`partir_emu.core.loops`). A ``loop`` equation is a *barrier* of its program's
schedule: it runs on the compute stream for its whole time (``length`` × the step of its body, whose
own schedule this same module makes), every collective before it in the program is waited for before
it starts, and none after it is ready before it ends. Iterations are sequential: everything of
iteration ``i``, its asynchronous collectives included, completes before iteration ``i + 1`` starts
(an XLA while loop without collective pipelining: no gather of iteration ``i + 1`` is prefetched
during iteration ``i``); inside the body, gathers of the body's inputs (a layer's weight row) are
prefetched from the iteration's start within the budget, as any parameter gather.

``prefetch_bytes=None`` takes one *FSDP unit*: the largest total gathered bytes of the
parameters under one top-level name prefix (``params/layer_3``: one layer's weights; each
parameter counted once). That prefetches about one layer ahead, as PyTorch FSDP (one unit
in flight) and XLA's scheduler in a scanned layer loop do.

:class:`OverlapPlan` is what does not depend on the times (computed once per program; the
Analyzer keeps it); :func:`schedule` is the per-evaluation list schedule, a loop over collectives
and wait points only. Its ``order`` (issue order) and ``ready_pos`` are what the DES replays
(:func:`partir_emu.hwmodels.des.stream.compile_stream`), so where nothing contends both agree.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from partir_emu.core.analysis import dependencies
from partir_emu.core.ir import Program, Var
from partir_emu.errors import UsageError
from partir_emu.hwmodels.compute.memory import MemoryProfile, breakdown_at, prefetch_peak
from partir_emu.hwmodels.network.concurrency import Contention
from partir_emu.hwmodels.timeline import engine
from partir_emu.hwmodels.timeline.issue import IssueGraph, issue_one_stream
from partir_emu.hwmodels.timeline.networks import NetworkModel, Shared, Standalone

VIEW_PRIMS = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim", "squeeze",
                        "expand_dims", "copy", "reduce_sum", "reduce_max", "reduce_min"})
"""Single-operand ops that keep the element count (a cast, a reshape, a sum over unit dims): free
views that a compiler fuses into their consumer (or hoists with a parameter's all-gather)."""


def _is_view(e) -> Var | None:
    """The operand of ``e`` if ``e`` is a view (see :data:`VIEW_PRIMS`), else None."""
    if e.prim not in VIEW_PRIMS or len(e.outputs) != 1:
        return None
    vs = [a for a in e.inputs if type(a) is Var]
    if len(vs) != 1 or math.prod(vs[0].shape) != math.prod(e.outputs[0].shape):
        return None
    return vs[0]


class _Walk(NamedTuple):
    ready: tuple[int, ...]        # per collective, with one budget
    events: list[int]             # c: collective c ready; ~c: the compute stream waits for c
    event_pos: np.ndarray         # the compute position of each event
    keys: list[int]               # ready events: priority key (priority * C + c), -1 if collective-fed
    wait: tuple[int, ...]         # per collective: where the compute stream waits for it (num_eqns: end)


@dataclass
class OverlapPlan:
    """The time-independent part of the overlap schedule of one program (see the module docstring).
    Collectives are numbered 0..C-1 in program order (as ``ProgramCosts.comm``). Built once per
    program (:func:`build_plan`; ``Analyzer.overlap_plan`` keeps it), it also keeps what the budgets
    asked so far need: the event walk per budget, and for the memory model the program-order live
    bytes as an array and the breakdowns at the peaks found (at most 16 of each)."""

    num_eqns: int
    comm_eqns: np.ndarray                       # equation index of collective c
    base_ready: tuple[int, ...]                 # compute position c's operand needs (prefetchable: its floor)
    wait_pos: tuple[int, ...]                   # equation where the compute stream waits for c (num_eqns: end)
    priority: tuple[int, ...]                   # program position of c's first (transitive) need
    coll_prods: tuple[tuple[int, ...], ...]     # collectives producing c's operand
    coll_users: tuple[tuple[int, ...], ...]
    prefetch: tuple[int, ...]                   # prefetchable gathers in need order
    prefetch_bytes_out: np.ndarray              # their gathered (output) bytes
    prefetch_names: tuple[str, ...]             # the program input each gathers
    default_prefetch_bytes: int                 # one FSDP unit (module docstring)
    floor: tuple[int, ...] = ()                 # per collective: one past the last loop before it (0: none)
    _ready: dict[tuple, _Walk] = field(default_factory=dict, repr=False)       # by (budget, blocking)
    _waits: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    _live: tuple | None = field(default=None, repr=False)    # (profile, its live bytes as an array)
    _breakdowns: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)
    graph: IssueGraph = field(default_factory=lambda: IssueGraph((), (), ()), repr=False)
    _compute: np.ndarray | None = field(default=None, repr=False)       # per equation: 1.0 compute, 0.0 collective

    def ready_pos(self, prefetch_bytes: int | None = None) -> tuple[int, ...]:
        """Per collective, the compute position after which it may start, with this budget."""
        return self._walk(prefetch_bytes).ready

    def _walk(self, prefetch_bytes: int | None, blocking: tuple[int, ...] = ()) -> _Walk:
        if prefetch_bytes is not None and not prefetch_bytes >= 0:
            raise UsageError(f"prefetch_bytes={prefetch_bytes!r}: give the bytes of ZeRO-3 all-gathers that may "
                             f"be in flight ahead of need (>= 0; 0 gathers on demand), or None for one layer")
        budget = self.default_prefetch_bytes if prefetch_bytes is None else int(prefetch_bytes)
        hit = self._ready.get((budget, blocking))
        if hit is not None:
            return hit
        ready = list(self.base_ready)
        if self.prefetch:
            cum = np.concatenate(([0], np.cumsum(self.prefetch_bytes_out)))
            # j = m - 1 with m the first gather that may still be in flight alongside gather k
            m = np.searchsorted(cum, cum[1:] - budget, side="left")
            for k, g in enumerate(self.prefetch):
                j = int(m[k]) - 1
                ready[g] = self.priority[self.prefetch[j]] if j >= 0 else 0
                if self.floor and ready[g] < self.floor[g]:
                    ready[g] = self.floor[g]
        # a blocking collective is waited for where it becomes ready (the compute stream stops there):
        # at the latest of its own ready point and its collective producers' (program order: producers first)
        wait = list(self.wait_pos)
        if blocking:
            eff = list(ready)
            for c, ps in enumerate(self.coll_prods):
                for q in ps:
                    eff[c] = max(eff[c], eff[q])
            for c in blocking:
                wait[c] = min(wait[c], eff[c])
        # the compute stream's events in order: collective c is ready (c >= 0) where it reaches
        # ready[c], before the waits at that position (~c: wait for c)
        evs = sorted([(r, 0, c) for c, r in enumerate(ready)]
                     + [(w, 1, ~c) for c, w in enumerate(wait) if w < self.num_eqns])
        fed = [bool(p) for p in self.coll_prods]
        keys = [-1 if e[2] < 0 or fed[e[2]] else self.graph.keys[e[2]] for e in evs]
        walk = _Walk(tuple(ready), [e[2] for e in evs], np.array([e[0] for e in evs], dtype=np.int64), keys,
                     tuple(wait))
        if len(self._ready) > 16:
            self._ready.clear()
        self._ready[(budget, blocking)] = walk
        return walk

    @property
    def waits(self) -> tuple[tuple[int, int], ...]:
        """(wait equation, collective) for waits inside the program, by equation."""
        return self._waits


def overlap_memory(plan: OverlapPlan, program: Program, profile: MemoryProfile, sched: OverlapSchedule
                   ) -> MemoryProfile:
    """The peak memory of ``sched`` (``profile``: the program-order one, loop points holding the body
    profiles of their own schedules): the prefetch buffers count from the equation running when their
    gather started (:func:`partir_emu.hwmodels.compute.memory.prefetch_peak`)."""
    pf = np.array(plan.prefetch, dtype=np.int64)
    if not len(pf):
        return profile
    if plan._live is None or plan._live[0] is not profile:
        plan._live = (profile, np.array(profile.live_bytes, dtype=np.float64))
        plan._breakdowns.clear()
    starts = np.array(sched.start)[pf]
    issued = np.searchsorted(sched.compute_finish, starts, side="right")
    peak, at, extra = prefetch_peak(plan._live[1], issued, plan.comm_eqns[pf], plan.prefetch_bytes_out)
    if not extra:
        return profile
    bd = plan._breakdowns.get(at)
    if bd is None:
        if len(plan._breakdowns) > 16:
            plan._breakdowns.clear()
        bd = plan._breakdowns[at] = breakdown_at(program, at, profile.bodies, profile.policy)
    out = {**bd, "prefetch_buffers": bd.get("prefetch_buffers", 0) + extra}
    return MemoryProfile(peak, at, out, (), profile.input_bytes, policy=profile.policy)


def build_plan(program: Program, is_comm: np.ndarray, deps: tuple[tuple[int, ...], ...] | None = None,
               barriers: Sequence[int] | np.ndarray = ()) -> OverlapPlan:
    """The :class:`OverlapPlan` of ``program`` (``is_comm``: per equation, a communicating collective;
    ``barriers``: the loop equations, see the module docstring)."""
    eqns = program.eqns
    n = len(eqns)
    deps = dependencies(program) if deps is None else deps
    comm_eqns = np.flatnonzero(is_comm)
    cpos = {int(e): c for c, e in enumerate(comm_eqns.tolist())}
    C = len(cpos)
    alias = [-1] * n                 # view equation of collective c's result -> c
    hoist: dict[int, str] = {}       # view equation computing from a program input only -> its name
    names = {v.id: name for v, name in zip(program.inputs, program.input_names)}
    wait = [n] * C
    ready = [0] * C
    prods: list[set[int]] = [set() for _ in range(C)]
    prefetchable: dict[int, str] = {}
    for i, e in enumerate(eqns):
        ps = deps[i]
        c = cpos.get(i)
        if c is not None:
            roots = []
            for j in ps:
                if j in cpos:
                    prods[c].add(cpos[j])
                elif alias[j] >= 0:
                    prods[c].add(alias[j])
                elif j in hoist:
                    roots.append(hoist[j])
                else:
                    ready[c] = max(ready[c], j + 1)
            if e.prim == "all_gather" and not prods[c] and ready[c] == 0:
                src = e.inputs[0]        # a Var, or a Literal (no input name)
                name = roots[0] if roots else names.get(src.id, "") if type(src) is Var else ""
                prefetchable[c] = name
                ready[c] = 0
            continue
        v = _is_view(e)
        if v is not None:
            if not ps:
                hoist[i] = names.get(v.id, "")
                continue
            j = ps[0]
            if j in cpos or alias[j] >= 0:
                alias[i] = cpos[j] if j in cpos else alias[j]
                continue
            if j in hoist:
                hoist[i] = hoist[j]
                continue
        for j in ps:
            cj = cpos[j] if j in cpos else alias[j]
            if cj >= 0 and wait[cj] == n:
                wait[cj] = i
    floor = _barriers(comm_eqns, barriers, wait, ready)
    priority = list(wait)
    users: list[list[int]] = [[] for _ in range(C)]
    for c in range(C - 1, -1, -1):
        for p in prods[c]:
            users[p].append(c)
            if priority[c] < priority[p]:
                priority[p] = priority[c]
    pf = sorted(prefetchable, key=lambda g: (priority[g], g))
    out_bytes = np.array([eqns[int(comm_eqns[g])].outputs[0].nbytes for g in pf], dtype=np.float64)
    plan = OverlapPlan(n, comm_eqns, tuple(ready), tuple(wait), tuple(priority),
                       tuple(tuple(sorted(p)) for p in prods), tuple(tuple(u) for u in users), tuple(pf),
                       out_bytes, tuple(prefetchable[g] for g in pf), _fsdp_unit_bytes(pf, prefetchable, out_bytes),
                       floor)
    plan._waits = tuple(sorted((w, c) for c, w in enumerate(wait) if w < n))
    plan.graph = IssueGraph(plan.coll_prods, plan.coll_users, tuple(priority[c] * C + c for c in range(C)))
    plan._compute = (~np.asarray(is_comm, dtype=bool)).astype(np.float64)
    return plan


def _barriers(comm_eqns: np.ndarray, barriers: Sequence[int] | np.ndarray, wait: list[int],
              ready: list[int]) -> tuple[int, ...]:
    """Make each loop equation a barrier (module docstring): a collective before it is waited for at
    it at the latest; one after it is ready one past it at the earliest (its floor, returned; () when
    there is no loop). ``wait`` and ``ready`` are updated in place."""
    if not len(barriers):
        return ()
    bars = sorted(int(b) for b in barriers)
    floor = []
    for c, e in enumerate(comm_eqns.tolist()):
        k = bisect.bisect_right(bars, e)
        if k < len(bars) and wait[c] > bars[k]:
            wait[c] = bars[k]
        f = bars[k - 1] + 1 if k else 0
        if ready[c] < f:
            ready[c] = f
        floor.append(f)
    return tuple(floor)


def _fsdp_unit_bytes(pf: list[int], names: dict[int, str], out_bytes: np.ndarray) -> int:
    """The largest total gathered bytes under one top-level name prefix, each parameter once."""
    per_param: dict[str, float] = {}
    for g, b in zip(pf, out_bytes.tolist()):
        name = names[g] or f"#{g}"
        per_param[name] = max(per_param.get(name, 0.0), b)
    units: dict[str, float] = {}
    for name, b in per_param.items():
        unit = "/".join(name.split("/")[:2])
        units[unit] = units.get(unit, 0.0) + b
    return int(max(units.values(), default=0.0))


@dataclass(frozen=True)
class OverlapSchedule:
    """One overlapped step: times per collective (program order) and the decisions the DES replays."""

    step_s: float
    start: list[float]            # per collective
    finish: list[float]
    order: list[int]              # collectives in the order the communication streams issued them
    ready_pos: tuple[int, ...]    # per collective (with the budget used)
    compute_finish: np.ndarray    # per equation: when the compute stream finished it (collectives: 0 length)
    stream: list[int] | None = None   # per collective: its communication stream (None: all on stream 0)
    streams: int = 1              # communication streams the schedule was made for
    wait_pos: tuple[int, ...] = ()    # per collective: where the compute stream waits for it (the plan's,
                                      # or its ready point for a blocking one); () = the plan's


def schedule(plan: OverlapPlan, times: np.ndarray, prefetch_bytes: int | None = None, comm_streams: int = 1,
             contention: Contention | None = None, keys: Sequence[int] | None = None,
             network: NetworkModel | None = None, blocking: tuple[int, ...] = ()) -> OverlapSchedule:
    """The list schedule of the module docstring on per-equation ``times`` (collectives' entries are
    their standalone durations; compute entries may be 0, e.g. inside a fused group).

    One pass over the compute stream's events (collective ready, wait) and the issues: the frontier
    advances until a wait whose collective is not issued yet; then the stream issues the
    highest-priority collective ready by the time it is free (or the first to become ready). A ready
    time ``P[ready_pos] + stall`` grows along the walk, so collectives without collective producers
    queue in a plain FIFO; only collective-fed ones need a heap.

    ``comm_streams > 1``: that many communication streams (the timeline engine, :mod:`.engine`, the
    rule the DES shares); collectives in flight together slow each other by ``contention`` (:mod:`partir_emu.hwmodels.network.concurrency`; ``keys``:
    per collective, its index there, as ``ProgramCosts.comm_inverse``). ``network``: run the engine on
    this network model instead (the DES's flow network: :mod:`partir_emu.hwmodels.des.engine_network`);
    the collectives' entries of ``times`` then matter only to the models that read them. ``blocking``:
    collectives (sorted indices) the compute stream waits for where they become ready, e.g. collectives
    across TPU slices whose spec says they do not overlap compute (``[dcn] overlaps_compute``)."""
    if not (isinstance(comm_streams, (int, np.integer)) and comm_streams >= 1):
        raise UsageError(f"comm_streams={comm_streams!r}: give the number of collectives a device may run at "
                         f"once (an integer >= 1; 1 = one communication stream)")
    comm_eqns = plan.comm_eqns
    walk = plan._walk(prefetch_bytes, tuple(blocking))
    P = np.zeros(plan.num_eqns + 1)                       # compute time before each equation, no stalls
    np.cumsum(times * plan._compute, out=P[1:])
    Pev = P[walk.event_pos].tolist()
    tc = times[comm_eqns].tolist()
    stream = None
    if comm_streams == 1 and network is None:
        start, finish, order, stalls = issue_one_stream(plan.graph, walk.events, walk.keys, Pev, tc)
    else:
        net = network if network is not None else (Standalone(tc) if contention is None or keys is None
                                                     else Shared(tc, contention, keys))
        line = engine.run(plan.graph, walk.events, walk.keys, Pev, int(comm_streams), net)
        start, finish, order, stalls, stream = line.start, line.finish, line.order, line.stalls, line.stream
    D = stalls[-1][1] if stalls else 0.0
    end = float(P[-1]) + D
    last = max(finish, default=0.0)
    # compute finish of equation i: P[i+1] + the stall of the last wait at or before i that grew it
    bounds = np.concatenate(([0], walk.event_pos[[k for k, _ in stalls]], [plan.num_eqns]))
    stall = np.repeat([0.0] + [d for _, d in stalls], np.diff(bounds))
    return OverlapSchedule(end if end > last else last, start, finish, order, walk.ready, P[1:] + stall, stream,
                           int(comm_streams), walk.wait if blocking else ())

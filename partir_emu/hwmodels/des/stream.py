"""The op stream a device runs: one step of the program compiled into a list of actions.

``Compute(dur)``   a run of compute equations with nothing in between that talks to a collective
``Ready(c)``       the input of collective ``c`` is computed: one of the prerequisites of its gate
``Wait(c)``        the next equation reads the output of collective ``c`` (or the step ends)

Without overlap a collective is ``Ready(c), Wait(c)`` at its place in the program
(everything sequential, as ``analytical.simulate(overlap=False)``). With overlap
the device runs the schedule the analytical model decided (:mod:`partir_emu.hwmodels.timeline.overlap`, as a
chip runs the order its compiler fixed): ``Ready(c)`` where the compute stream
reaches ``ready_pos[c]`` (ZeRO-3 gathers: where the prefetch budget lets them go),
``Wait(c)`` at its first real consumer, and the collectives in the schedule's
issue order. A collective's **gate** opens for a device when all its prerequisites
have fired there: its ``Ready``, the collectives that produce its input, and the
collective issued before it on its communication stream (a stream runs one collective
at a time; :func:`partir_emu.hwmodels.timeline.issue.stream_prereqs`, the rule the analytical schedule follows:
the schedule's streams when it was priced with ``comm_streams`` streams, else rank ``r``
in issue order waits for rank ``r - comm_streams``).

**Loops are run, not multiplied.** A ``loop`` equation's place in the stream holds its body's
stream once per iteration (nested loops likewise), so the DES simulates every iteration and every
collective instance on the network. ``c`` numbers collective *instances* in program order with
loops expanded (iteration by iteration, in execution order): the order of the analytical model's
rows (:func:`..pricing.collective_rows`). Each iteration's stream ends with the waits of its
collectives that nothing in the body read, so iteration ``i + 1`` starts once everything of
iteration ``i`` is done, and the collectives before a loop are waited for before it (the barrier of
:mod:`partir_emu.hwmodels.timeline.overlap`): the analytical model's iteration semantics. The times and decisions come from
the analytical model's :class:`~..pricing.Priced` run (each body priced and scheduled once).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from partir_emu.hwmodels.pricing import Priced
from partir_emu.hwmodels.timeline.issue import round_robin, stream_prereqs

COMPUTE, READY, WAIT = 0, 1, 2


@dataclass(frozen=True)
class Action:
    kind: int
    coll: int = -1            # READY / WAIT: collective instance (0..C-1)
    dur: float = 0.0          # COMPUTE: seconds on a device of speed factor 1
    first: int = -1           # COMPUTE: equation range [first, last] (in its own, innermost, program)
    last: int = -1
    name: str = ""            # COMPUTE: what dominates it (for the trace)


@dataclass(frozen=True)
class OpStream:
    actions: tuple[Action, ...]
    comm_eqns: tuple[int, ...]                 # per collective instance: its equation (innermost program)
    prereqs: tuple[tuple[int, ...], ...]       # per collective instance: instances its gate waits for
    comm: tuple[tuple, ...] = ()               # per instance: (index, prim, axes, nbytes, dtype, perm)
    at: tuple[tuple[int, ...], ...] = ()       # per instance: (loop equation, iteration) per enclosing loop


def compile_stream(priced: Priced, overlap: bool, comm_streams: int = 1) -> OpStream:
    """The actions of one device's op stream for the run ``priced`` (see the module docstring); with
    overlap its schedules (``Priced.sched``, each body's own) are the decisions replayed."""
    b = _Builder(overlap, _instances(priced))
    order = b.emit(priced, 0, ())
    prereqs = [set(p) for p in b.prods]
    # the stream rule (partir_emu.hwmodels.timeline.issue): each instance waits for the one issued before it on its stream; the
    # streams are the schedules' when they were made for comm_streams, else by issue rank modulo it
    streams = b.stream if overlap and _made_for(priced, comm_streams) else round_robin(order, comm_streams)
    for c, p in enumerate(stream_prereqs(order, streams)):
        if p >= 0:
            prereqs[c].add(p)
    assert sum(a.kind == WAIT for a in b.actions) == len(order) == len(b.comm)
    return OpStream(tuple(b.actions), tuple(b.index), tuple(tuple(sorted(p)) for p in prereqs), tuple(b.comm),
                    tuple(b.at))


def _made_for(pr: Priced, comm_streams: int) -> bool:
    """Whether ``pr``'s schedules (its own and every body's) were made for ``comm_streams`` streams."""
    if pr.sched is None or pr.sched.streams != comm_streams:
        return False
    return all(_made_for(b, comm_streams) for b in pr.bodies.values())


def _instances(pr: Priced) -> int:
    """Collective instances one run of ``pr``'s program executes."""
    pc = pr.analysis.costs
    return len(pc.comm) + sum(lc.length * _instances(pr.bodies[lc.index]) for lc in pc.loops)


class _Builder:
    """Appends one run's actions and collective instances (recursively through loop bodies)."""

    def __init__(self, overlap: bool, total: int) -> None:
        self.overlap = overlap
        self.actions: list[Action] = []
        self.index = [-1] * total
        self.comm: list[tuple] = [()] * total
        self.at: list[tuple[int, ...]] = [()] * total
        self.prods: list[tuple[int, ...]] = [()] * total
        self.stream = [0] * total                 # per instance: its stream in its schedule
        self._count: dict[int, int] = {}

    def count(self, pr: Priced) -> int:
        n = self._count.get(id(pr))
        if n is None:
            n = self._count[id(pr)] = _instances(pr)
        return n

    def emit(self, pr: Priced, base: int, at: tuple[int, ...]) -> list[int]:
        """Append one run of ``pr``'s program, its instances numbered from ``base``; its issue order."""
        pc = pr.analysis.costs
        comm_idx = pc.comm_index.tolist()
        loops = {lc.index: lc for lc in pc.loops}
        gid, loop_base = self._number(pr, base)
        if self.overlap:
            plan = pr.analysis.overlap_plan()
            prods = plan.coll_prods
        else:
            deps = pr.analysis.dependencies()
            cpos = {e: c for c, e in enumerate(comm_idx)}
            prods = tuple(tuple(cpos[j] for j in deps[e] if j in cpos) for e in comm_idx)
        local_stream = pr.sched.stream if self.overlap and pr.sched is not None else None
        for c, g in enumerate(gid):
            if local_stream is not None:
                self.stream[g] = local_stream[c]
            self.index[g] = comm_idx[c]
            self.comm[g] = pc.comm[c]
            self.at[g] = at
            self.prods[g] = tuple(gid[q] for q in prods[c])
        spliced: dict[int, list[int]] = {}

        def splice(i: int) -> None:
            lc, body = loops[i], pr.bodies[i]
            nb = self.count(body)
            order = spliced[i] = []
            for k, it in enumerate(lc.iterations):
                order += self.emit(body, loop_base[i] + k * nb, (*at, i, it))

        local = self._overlap_actions(pr, gid, splice) if self.overlap else self._plain_actions(pr, gid, splice)
        # the run's issue order: each segment between loops in its schedule's order, then the loop's
        # (a loop is a barrier: nothing before it is issued after it, nothing after it before it)
        bars = sorted(loops)
        segs: list[list[int]] = [[] for _ in range(len(bars) + 1)]
        for c in local:
            segs[bisect.bisect_right(bars, comm_idx[c])].append(gid[c])
        out = segs[0]
        for i, seg in zip(bars, segs[1:]):
            out += spliced[i] + seg
        return out

    def _number(self, pr: Priced, base: int) -> tuple[list[int], dict[int, int]]:
        """Instance numbers of the run's own collectives, and where each loop's instances start."""
        pc = pr.analysis.costs
        gid, loop_base = [], {}
        nxt = base
        li, loops = 0, pc.loops
        for i in (*pc.comm_index.tolist(), len(pc.flops)):
            while li < len(loops) and loops[li].index < i:
                lc = loops[li]
                loop_base[lc.index] = nxt
                nxt += lc.length * self.count(pr.bodies[lc.index])
                li += 1
            gid.append(nxt)
            nxt += 1
        return gid[:-1], loop_base

    def _compute_runs(self, pr: Priced) -> tuple[list[int], Callable[[], None]]:
        """A run of pending compute equations and the ``flush`` that appends it as one ``Compute``
        action (what dominates it names it in the trace)."""
        eqns, times, acts = pr.analysis.program.eqns, pr.times, self.actions
        run: list[int] = []

        def flush() -> None:
            if run:
                ts = times[run]
                name = eqns[run[int(np.argmax(ts))]].prim
                acts.append(Action(COMPUTE, dur=float(ts.sum()), first=run[0], last=run[-1],
                                   name=name if len(run) == 1 else f"{name}+{len(run) - 1}"))
                run.clear()
        return run, flush

    def _plain_actions(self, pr: Priced, gid: list[int], splice: Callable[[int], None]) -> list[int]:
        """Without overlap: each collective ``Ready, Wait`` at its place. Returns the issue order (local)."""
        pc = pr.analysis.costs
        cpos = {e: c for c, e in enumerate(pc.comm_index.tolist())}
        loops = set(pc.loop_index.tolist())
        run, flush = self._compute_runs(pr)
        acts = self.actions
        for i in range(len(pr.times)):
            if i in cpos:
                flush()
                acts += [Action(READY, gid[cpos[i]]), Action(WAIT, gid[cpos[i]])]
            elif i in loops:
                flush()
                splice(i)
            else:
                run.append(i)
        flush()
        return list(range(len(cpos)))

    def _overlap_actions(self, pr: Priced, gid: list[int], splice: Callable[[int], None]) -> list[int]:
        """The overlap schedule: ``Ready`` where the compute stream reaches ``ready_pos``, ``Wait`` at
        the first real consumer (a loop: before it). Returns the schedule's issue order (local)."""
        plan, sched = pr.analysis.overlap_plan(), pr.sched
        assert sched is not None
        n = len(pr.times)
        readies: dict[int, list[int]] = {}
        for c in sched.order:
            readies.setdefault(sched.ready_pos[c], []).append(c)
        waits: dict[int, list[int]] = {}
        for c, w in enumerate(sched.wait_pos or plan.wait_pos):
            waits.setdefault(w, []).append(c)
        loops = set(pr.analysis.costs.loop_index.tolist())
        comm = pr.analysis.costs.is_comm.tolist()
        run, flush = self._compute_runs(pr)
        acts = self.actions
        for i in range(n + 1):
            if i in readies or i in waits:
                flush()
                acts += [Action(READY, gid[c]) for c in readies.get(i, ())]
                acts += [Action(WAIT, gid[c]) for c in waits.get(i, ())]
            if i < n and not comm[i]:
                if i in loops:
                    flush()
                    splice(i)
                else:
                    run.append(i)
        flush()
        return list(sched.order)

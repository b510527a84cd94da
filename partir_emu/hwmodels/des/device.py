"""Devices: the op stream each device executes, as simpy processes.

A device runs its SpmdProgram as a *compute stream* (compute equations in
program order, each taking its roofline time from the analytical model's cost
rules) and one or more *communication streams* (the collectives, in program
order). The op stream is compiled once into a list of actions:

``Compute(dur)``   a run of compute equations with nothing in between that talks to a collective
``Ready(c)``       the input of collective ``c`` is computed: one of the prerequisites of its gate
``Wait(c)``        the next equation reads the output of collective ``c`` (or the step ends)

Without overlap a collective is ``Ready(c), Wait(c)`` at its place in the program
(everything sequential, as ``analytical.simulate(overlap=False)``). With overlap
the device runs the schedule the analytical model decided (:mod:`..overlap`, as a
chip runs the order its compiler fixed): ``Ready(c)`` where the compute stream
reaches ``ready_pos[c]`` (ZeRO-3 gathers: where the prefetch budget lets them go),
``Wait(c)`` at its first real consumer, and the collectives in the schedule's
issue order. A collective's **gate** opens for a device when all its prerequisites
have fired there: its ``Ready``, the collectives that produce its input, and the
collective ``comm_streams`` places earlier in issue order (a stream runs one
collective at a time).

**SPMD symmetry.** Every device runs the same program with the same local shapes,
so devices whose timelines are identical need not be simulated one by one: a
:class:`Walker` process runs the op stream for a *set* of devices (an
equivalence class: same compute speed, same arrival times). At a ``Wait`` the
class splits if its devices' collective finished at different times, and devices
released at the same time with the same speed are merged again into one walker.
A straggler (a device with a slow-down factor) starts in a class of its own. The
collectives themselves are always simulated for every device on the network.
With ``symmetry=False`` every device is its own process (a test holds the two equal
with ``merge_window_s=0``; see :class:`WaitPoint` for the merge window).
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from partir_emu.core.analysis import dependencies
from partir_emu.core.ir import Program
from partir_emu.hwmodels.des.protocols import CollectiveOpener, ComputeSink
from partir_emu.hwmodels.overlap import OverlapPlan, Schedule

COMPUTE, READY, WAIT = 0, 1, 2


@dataclass(frozen=True)
class Action:
    kind: int
    coll: int = -1            # READY / WAIT: collective position (0..C-1)
    dur: float = 0.0          # COMPUTE: seconds on a device of speed factor 1
    first: int = -1           # COMPUTE: equation range [first, last]
    last: int = -1
    name: str = ""            # COMPUTE: what dominates it (for the trace)


@dataclass(frozen=True)
class OpStream:
    actions: tuple[Action, ...]
    comm_eqns: tuple[int, ...]                 # equation index of collective c
    prereqs: tuple[tuple[int, ...], ...]       # per collective: collectives its gate waits for


def compile_stream(program: Program, is_comm: np.ndarray, times: np.ndarray, overlap: bool,
                   comm_streams: int = 1, plan: OverlapPlan | None = None, sched: Schedule | None = None
                   ) -> OpStream:
    """The actions of one device's op stream (see the module docstring); with overlap, ``plan`` and
    ``sched`` are the overlap schedule's decisions (:func:`..overlap.schedule` on the same program)."""
    if overlap:
        if plan is None or sched is None:
            raise ValueError("compile_stream(overlap=True) needs the overlap plan and schedule")
        return _overlap_stream(program, is_comm, times, comm_streams, plan, sched)
    comm_eqns = tuple(int(i) for i in np.flatnonzero(is_comm))
    cpos = {e: c for c, e in enumerate(comm_eqns)}
    deps = dependencies(program)
    prereqs = []
    for c, e in enumerate(comm_eqns):          # the collectives producing c's input, and c's stream predecessor
        pre = {cpos[j] for j in deps[e] if j in cpos}
        if c >= comm_streams:
            pre.add(c - comm_streams)
        prereqs.append(tuple(sorted(pre)))
    acts, run, flush = _compute_runs(program, times)
    for i in range(len(program.eqns)):
        if i in cpos:
            flush()
            acts += [Action(READY, cpos[i]), Action(WAIT, cpos[i])]
        else:
            run.append(i)
    flush()
    return OpStream(tuple(acts), comm_eqns, tuple(prereqs))


def _compute_runs(program: Program, times: np.ndarray) -> tuple[list[Action], list[int], object]:
    """An action list, a run of pending compute equations and the ``flush`` that turns it into one
    ``Compute`` action (what dominates it names it in the trace)."""
    eqns = program.eqns
    acts: list[Action] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            ts = times[run]
            name = eqns[run[int(np.argmax(ts))]].prim
            acts.append(Action(COMPUTE, dur=float(ts.sum()), first=run[0], last=run[-1],
                               name=name if len(run) == 1 else f"{name}+{len(run) - 1}"))
            run.clear()
    return acts, run, flush


def _overlap_stream(program: Program, is_comm: np.ndarray, times: np.ndarray, comm_streams: int,
                    plan: OverlapPlan, sched: Schedule) -> OpStream:
    """The op stream of the overlap schedule: Ready where the compute stream reaches ``ready_pos``,
    Wait at the first real consumer, collectives gated by their producers and by the one
    ``comm_streams`` places earlier in the schedule's issue order."""
    n = len(program.eqns)
    C = len(plan.comm_eqns)
    prereqs = [set(p) for p in plan.coll_prods]
    for rank, c in enumerate(sched.order):
        if rank >= comm_streams:
            prereqs[c].add(sched.order[rank - comm_streams])
    readies: dict[int, list[int]] = {}
    for c in sched.order:
        readies.setdefault(sched.ready_pos[c], []).append(c)
    waits: dict[int, list[int]] = {}
    for c, w in enumerate(plan.wait_pos):
        waits.setdefault(w, []).append(c)
    acts, run, flush = _compute_runs(program, times)
    comm = is_comm.tolist()
    for i in range(n + 1):
        if i in readies or i in waits:
            flush()
            acts += [Action(READY, c) for c in readies.get(i, ())]
            acts += [Action(WAIT, c) for c in waits.get(i, ())]
        if i < n and not comm[i]:
            run.append(i)
    flush()
    assert sum(a.kind == WAIT for a in acts) == C
    return OpStream(tuple(acts), tuple(int(e) for e in plan.comm_eqns), tuple(tuple(sorted(p)) for p in prereqs))


class Devices:
    """The device side of one simulated step: the op stream, a :class:`Gate` per collective, a
    :class:`WaitPoint` where the stream reads each collective, and the :class:`Walker` processes.

    It sees the rest of the simulation only through ``opener`` (a gate opened: start the
    collective there) and ``recorder`` (compute spans for the trace); the simulation tells it
    through :meth:`collective_done` when a collective finished on some devices."""

    def __init__(self, env: simpy.Environment, stream: OpStream, num_devices: int, opener: CollectiveOpener,
                 recorder: ComputeSink | None = None, merge_window_s: float = 0.0, symmetry: bool = True) -> None:
        self.env = env
        self.stream = stream
        self.num_devices = num_devices
        self.opener = opener
        self.recorder = recorder
        self.symmetry = symmetry
        self.merge_window_s = merge_window_s if symmetry else 0.0     # one process per device: nothing merges
        C = len(stream.comm_eqns)
        self.gates = [Gate(self, c, len(stream.prereqs[c])) for c in range(C)]
        self.dependents: list[list[int]] = [[] for _ in range(C)]
        for c, pre in enumerate(stream.prereqs):
            for q in pre:
                self.dependents[q].append(c)
        self.wait_points: dict[int, WaitPoint] = {
            a.coll: WaitPoint(self, a.coll, pos + 1) for pos, a in enumerate(stream.actions) if a.kind == WAIT}
        self.coll_done = [np.zeros(num_devices, dtype=bool) for _ in range(C)]
        self.device_end = np.full(num_devices, np.nan)
        self.walkers = 0            # processes started
        self.live = 0               # processes running now
        self.max_live = 0

    def start(self, factor: np.ndarray) -> None:
        """Every device starts the stream at time 0; ``factor[d]``: device ``d``'s compute slow-down."""
        for f in np.unique(factor).tolist():
            self.spawn(np.flatnonzero(factor == f), f, 0)

    def spawn(self, devices: np.ndarray, factor: float, pos: int, lag: float = 0.0) -> None:
        """Run the stream from action ``pos`` for ``devices`` (one walker, or one per device)."""
        if self.symmetry:
            self.walkers += 1
            self.env.process(Walker(self, devices, factor, pos, lag).run())
            return
        for d in devices.tolist():
            self.walkers += 1
            self.env.process(Walker(self, np.array([d]), factor, pos).run())

    def collective_done(self, c: int, devices: np.ndarray, t: float) -> None:
        """Collective ``c`` finished on ``devices`` at ``t``: fire the gates waiting for it, release the waits."""
        self.coll_done[c][devices] = True
        for q in self.dependents[c]:
            self.gates[q].fire(devices, t)
        self.wait_points[c].release(devices)


class Gate:
    """Opens collective ``c`` for a device once all its prerequisites fired there."""

    def __init__(self, devs: Devices, c: int, n_prereqs: int) -> None:
        self.devs = devs
        self.c = c
        self.need = np.full(devs.num_devices, n_prereqs + 1, dtype=np.int32)    # + its own Ready

    def fire(self, devices: np.ndarray, t: float) -> None:
        need = self.need
        need[devices] -= 1
        opened = devices[need[devices] == 0]
        if opened.size:
            self.devs.opener.open_collective(self.c, opened, t)


class WaitPoint:
    """Where the compute stream reads collective ``c``: devices wait here until ``c`` is done for them.

    Devices released at the same time with the same speed continue as one walker. With a
    merge window ``w > 0``, devices released within ``w`` of the first release of a *round*
    continue together from the latest release time of the round (a barrier among them): the
    early ones would idle at their next collective anyway, since every member of a
    collective waits, through the data, for the latest one. This keeps a desynchronized
    pod (e.g. after an all-reduce of one scalar, whose members finish microseconds apart)
    from splitting into thousands of single-device processes. ``w = 0``: exact per-device timing."""

    def __init__(self, devs: Devices, c: int, resume_at: int) -> None:
        self.devs = devs
        self.c = c
        self.resume_at = resume_at
        self.pending: dict[float, np.ndarray] = {}      # speed factor -> bool mask over devices
        self.rounds: dict[float, list] = {}             # speed factor -> [device arrays, latest release]

    def arrive(self, devices: np.ndarray, factor: float) -> np.ndarray:
        """``devices`` reach the wait now: returns those whose collective is done (they go on)."""
        done = self.devs.coll_done[self.c][devices]
        if done.all():
            return devices
        mask = self.pending.get(factor)
        if mask is None:
            mask = self.pending[factor] = np.zeros(self.devs.num_devices, dtype=bool)
        mask[devices[~done]] = True
        return devices[done]

    def release(self, devices: np.ndarray) -> None:
        devs = self.devs
        window = devs.merge_window_s
        now = devs.env.now
        for factor, mask in self.pending.items():
            sel = devices[mask[devices]]
            if not sel.size:
                continue
            mask[sel] = False
            if window <= 0:
                devs.spawn(sel, factor, self.resume_at)
                continue
            rnd = self.rounds.get(factor)
            if rnd is None:
                rnd = self.rounds[factor] = [[], now]
                ev = devs.env.timeout(window)
                ev.callbacks.append(lambda _e, f=factor, r=rnd: self._flush(f, r))
            rnd[0].append(sel)
            rnd[1] = now
            if not mask.any():                  # everyone waiting here is released: go now
                self._flush(factor, rnd)

    def _flush(self, factor: float, rnd: list) -> None:
        if self.rounds.get(factor) is not rnd:
            return                              # already flushed
        del self.rounds[factor]
        devices = np.concatenate(rnd[0]) if len(rnd[0]) > 1 else rnd[0][0]
        self.devs.spawn(devices, factor, self.resume_at, lag=self.devs.env.now - rnd[1])


class Walker:
    """A simpy process running the op stream from action ``pos`` for a set of devices of one speed.
    ``lag``: how far behind ``env.now`` its timeline is (merge window); the next compute absorbs it."""

    def __init__(self, devs: Devices, devices: np.ndarray, factor: float, pos: int, lag: float = 0.0) -> None:
        self.devs = devs
        self.devices = devices
        self.factor = factor
        self.pos = pos
        self.lag = lag

    def run(self) -> Generator[simpy.Event, Any, None]:
        devs = self.devs
        env = devs.env
        acts = devs.stream.actions
        devices, factor, lag = self.devices, self.factor, self.lag
        rec = devs.recorder
        devs.live += 1
        devs.max_live = max(devs.max_live, devs.live)
        try:
            yield from self._run(env, acts, devices, factor, lag, rec)
        finally:
            devs.live -= 1

    def _run(self, env: simpy.Environment, acts: tuple[Action, ...], devices: np.ndarray, factor: float,
             lag: float, rec: ComputeSink | None) -> Generator[simpy.Event, Any, None]:
        devs = self.devs
        for pos in range(self.pos, len(acts)):
            a = acts[pos]
            if a.kind == COMPUTE:
                if a.dur > 0:
                    t0 = env.now - lag
                    dur = a.dur * factor
                    if lag > 0:
                        dur, lag = max(0.0, dur - lag), max(0.0, lag - dur)
                    if dur > 0:
                        yield env.timeout(dur)
                    if rec is not None:
                        rec.compute(devices, t0, env.now - lag, a)
            elif a.kind == READY:
                devs.gates[a.coll].fire(devices, env.now)
            else:
                devices = devs.wait_points[a.coll].arrive(devices, factor)
                if not devices.size:
                    return
        devs.device_end[devices] = env.now

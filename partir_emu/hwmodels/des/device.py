"""Devices: the op stream each device executes, as simpy processes.

A device runs its SpmdProgram as a *compute stream* (compute equations in
program order, each taking its roofline time from the analytical model's cost
rules) and one or more *communication streams* (the collectives). The op stream
(:mod:`.stream`: ``Compute``, ``Ready``, ``Wait`` actions, loops run iteration by
iteration) is compiled once. A collective's **gate** opens for a device when all
its prerequisites have fired there: its ``Ready``, the collectives that produce its
input, and the collective ``comm_streams`` places earlier in issue order (a stream
runs one collective at a time).

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
from typing import Any

import numpy as np
import simpy

from partir_emu.hwmodels.des.protocols import CollectiveOpener, ComputeSink
from partir_emu.hwmodels.des.stream import COMPUTE, READY, WAIT, Action, OpStream, compile_stream

__all__ = ["COMPUTE", "READY", "WAIT", "Action", "Devices", "Gate", "OpStream", "WaitPoint", "Walker",
           "compile_stream"]

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

                def close_round(_ev: simpy.Event, f: float = factor, r: list = rnd) -> None:
                    self._flush(f, r)             # defaults bind this iteration's round
                ev.callbacks.append(close_round)
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

"""The DES's flow network as a network model of the timeline engine (:mod:`..timeline.engine`).

The DES proper (:mod:`.model`) replays the analytical model's issue decisions: each device walks
its op stream and opens a collective where the analytical schedule issued it. Here instead the
*engine* decides, on the DES's collective timings: every collective it begins runs as the DES
runs it (every group at once, each message routed over directed links and sharing them max-min
fairly with everything in flight, :mod:`.network.flows`), and the engine learns when it finished
by running the simpy clock forward (:class:`FlowModel`). So :func:`des_timeline` and
``analytical.simulate(overlap=True)`` are one engine on two network models: where they differ,
the network model is the whole reason (a test holds this against the DES on cases where nothing
breaks SPMD symmetry).

Scope: every device opens a collective at once (no stragglers: the engine schedules one device's
timeline) and the program has no loops (the engine schedules one program; loops' iterations run
as the DES runs them only in :func:`.model.simulate_des`). A collective finishes when it finished
on every device.
"""
from __future__ import annotations

import math

import numpy as np

from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des.model import DesOptions, Simulation
from partir_emu.hwmodels.des.network.routing import DesError
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.specs import HardwareSpec
from partir_emu.hwmodels.pricing import blocking_collectives
from partir_emu.hwmodels.timeline.overlap import OverlapSchedule, schedule


class _Hosted(Simulation):
    """A step simulation whose collectives the engine opens; their finishes are collected, not
    handed to device walkers (none run)."""

    finished_now: list[int]

    def collective_done(self, ci: int, devices: np.ndarray, t: float, complete: bool) -> None:
        if complete:
            self.colls_finished += 1
            self.finished_now.append(ci)


class FlowModel:
    """The network model (:class:`..timeline.networks.NetworkModel`) of ``sim``'s flow network."""

    def __init__(self, sim: _Hosted) -> None:
        self.sim = sim
        self.env = sim.env
        self.devices = np.arange(sim.num_devices)
        sim.finished_now = []

    def begin(self, c: int, t: float) -> None:
        if t > self.env.now:
            self.env.run(until=t)
        self.sim.open_collective(c, self.devices, self.env.now)

    def run_until(self, t: float) -> tuple[float, list[int]]:
        env, done = self.env, self.sim.finished_now
        while not done and env.peek() <= t:
            env.step()
        if done:
            when = env.now
            while env.peek() <= when:                 # the rest of that instant: finishes together
                env.step()
            out, self.sim.finished_now = list(done), []
            return when, out
        if t > env.now and not math.isinf(t):
            env.run(until=t)
        return t, []


def des_timeline(spmd: SpmdProgram, spec: HardwareSpec | str, placement: Placement | str | None = None, *,
                 comm_streams: int = 1, prefetch_bytes: int | None = None, analyzer: Analyzer | None = None,
                 options: DesOptions | None = None) -> OverlapSchedule:
    """The overlapped step of ``spmd`` scheduled by the timeline engine on the DES's flow network
    (module docstring); compute times are the analytical model's, as in the DES."""
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(spec)
    options = options if options is not None else DesOptions(comm_streams=comm_streams)
    if options.stragglers or options.network != "flow":
        raise DesError("des_timeline schedules one device on the flow network: give no stragglers and "
                       "network='flow' (simulate_des runs every device)")
    place = analyzer.placement(spmd.mesh, spec, placement)
    sim = _Hosted(spmd, spec, place, True, None, options, analyzer, prefetch_bytes)
    entry = analyzer.entry(spmd.program)
    if entry.costs.loops:
        raise DesError(f"des_timeline takes a program without loops ({len(entry.costs.loops)} loop equations "
                       f"here); simulate_des runs loops iteration by iteration")
    priced = analyzer.price(spmd.program, spec, sim.comm_model, True, prefetch_bytes, comm_streams)
    return schedule(entry.overlap_plan(), priced.times, prefetch_bytes, comm_streams, network=FlowModel(sim),
                    blocking=blocking_collectives(entry.costs, sim.comm_model))

"""The discrete-event model of one training step: devices, collectives and the network in simpy.

``simulate_des(spmd, spec)`` answers the question ``analytical.simulate`` answers,
from the same inputs and the same costs, one level finer:

- **compute**: each device runs its op stream (:mod:`.device`); an equation
  takes exactly the analytical roofline time (``analytical.compute_times``);
- **collectives**: each expands into the schedule the analytical model prices
  (``CommModel.schedule``, algorithm from ``choose_algorithm``), run by *every*
  group of the collective at once (:mod:`.collective`);
- **network**: every message is routed over directed links (``Topology.route``,
  detours around failed links) and shares them with every other message in
  flight — of the other groups, of other collectives — by max-min fair rates
  (:mod:`.network`; ``network="chunk"`` for store-and-forward chunks).

Where nothing contends the DES reproduces the analytical closed forms; where
links are shared (concurrent groups of a collective, an axis placed over
several or partial physical dims, several communication streams, degraded or
failed links), compute and communication overlap, or one device is slow, it
shows what the closed form cannot. See :mod:`.device` for the SPMD-symmetry
shortcut that keeps a 4096-chip step cheap, and :mod:`.classes` for its
counterpart inside a collective: members and flows that move alike are simulated
once, with their multiplicity (``aggregate=False``: the reference path, every
member and flow on its own; the tests hold the two equal to 1e-9).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des.classes import MemberClasses, class_ids, reduce_plans
from partir_emu.hwmodels.des.collective import CollectiveRun, FlowStep, Groups, make_groups, step_plans
from partir_emu.hwmodels.des.device import Devices
from partir_emu.hwmodels.des.network.chunked import ChunkNetwork
from partir_emu.hwmodels.des.network.routing import DesError, FlowRouter, SymmetryBroken, link_factors
from partir_emu.hwmodels.des.network.spans import FlowNetwork
from partir_emu.hwmodels.des.protocols import Network
from partir_emu.hwmodels.des.report import DesCollectiveRow, DesReport, LinkRow, Progress, Recorder, write_chrome_trace
from partir_emu.hwmodels.des.stream import OpStream, compile_stream
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.specs import HardwareSpec
from partir_emu.hwmodels.network.comm import CommModel

NETWORKS = ("flow", "chunk")


@dataclass(frozen=True)
class DesOptions:
    """Knobs of the DES beyond what the analytical model takes.

    ``stragglers``: ``{device: factor}``, that device's compute takes ``factor`` × as long.
    ``degraded_links``: ``{"A->B" | "A-B" | "#id": factor}`` bandwidth factors (``A-B``: both
    directions). ``failed_links``: links that carry nothing (routes detour around them).
    ``comm_streams``: collectives a device runs at once (1 = as the analytical overlap model).
    ``message_overhead_s``: a sender posts its messages of a step one after another, this long each.
    ``merge_window_s``: devices whose collective finishes within this window resume together from
    the latest of their times (see :class:`~.device.WaitPoint`; 0 = exact per-device timing).
    ``symmetry=False`` simulates every device as its own process (no merging; slower).
    ``aggregate=False`` takes the reference path: one step plan per schedule step from the schedule's
    message objects and a deferred rate update after every change (slow at thousands of chips; the
    tests hold the aggregated path equal to it).
    """

    network: str = "flow"
    chunk_bytes: int = 1 << 20
    comm_streams: int = 1
    stragglers: Mapping[int, float] = field(default_factory=dict)
    degraded_links: Mapping[str, float] = field(default_factory=dict)
    failed_links: tuple[str, ...] = ()
    message_overhead_s: float = 0.0
    merge_window_s: float = 50e-6
    symmetry: bool = True
    aggregate: bool = True
    trace: bool = False
    trace_devices: int = 8
    progress: bool | None = False          # None: once the run has lasted 5 s (.progress)
    top_links: int = 20

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise DesError(f"unknown DES network {self.network!r}; use one of {', '.join(NETWORKS)}")
        if int(self.chunk_bytes) < 1:
            raise DesError(f"chunk_bytes={self.chunk_bytes} must be a positive number of bytes")
        if int(self.comm_streams) < 1:
            raise DesError(f"comm_streams={self.comm_streams} must be at least 1")
        if self.merge_window_s < 0:
            raise DesError(f"merge_window_s={self.merge_window_s} must be >= 0")
        if self.message_overhead_s < 0:
            raise DesError(f"message_overhead_s={self.message_overhead_s} must be >= 0")
        for d, f in self.stragglers.items():
            if not (isinstance(d, int) and d >= 0) or not f > 0:
                raise DesError(f"straggler {d}:{f}: give a device number >= 0 and a slow-down factor > 0")

    def to_json(self) -> dict[str, Any]:
        return {"network": self.network, "chunk_bytes": self.chunk_bytes, "comm_streams": self.comm_streams,
                "stragglers": {str(k): v for k, v in self.stragglers.items()},
                "degraded_links": dict(self.degraded_links), "failed_links": list(self.failed_links),
                "message_overhead_s": self.message_overhead_s, "merge_window_s": self.merge_window_s,
                "symmetry": self.symmetry, "aggregate": self.aggregate}


class Simulation:
    """One step of ``spmd`` on a placement: build with the inputs, then :meth:`run`.

    It wires the parts together and is the only one that knows them all: the devices
    (:class:`~.device.Devices`) open collectives through :meth:`open_collective`; each collective
    (:class:`~.collective.CollectiveRun`) sends on :attr:`network` and reports through
    :meth:`collective_done` (the :class:`~.protocols.CollectiveHost` and
    :class:`~.protocols.CollectiveOpener` protocols)."""

    def __init__(self, spmd: SpmdProgram, spec: HardwareSpec, placement: Placement, overlap: bool,
                 algorithms: str | dict[str, str] | None, options: DesOptions,
                 analyzer: Analyzer | None = None, prefetch_bytes: int | None = None) -> None:
        self._t_built = time.perf_counter()
        analyzer = analyzer if analyzer is not None else Analyzer()
        self.spmd = spmd
        self.spec = spec
        self.placement = placement
        self.overlap = overlap
        self.options = options
        self.num_devices = n = spmd.mesh.size
        bad = [d for d in options.stragglers if d >= n]
        if bad:
            raise DesError(f"straggler device {bad[0]} is not in {spmd.mesh} (devices 0..{n - 1})")
        topo = placement.topology
        factors = link_factors(topo, options.degraded_links, options.failed_links)
        self.router = FlowRouter(topo, factors)
        self.comm_model = CommModel(placement, algorithms, analyzer.prices, factors)   # faults: same choice
        # the device runs the times and (with overlap) the order the analytical model's scheduler fixed
        # (as a chip runs its compiler's schedule), priced with the same collective costs; loops are
        # run iteration by iteration (.stream)
        priced = analyzer.price(spmd.program, spec, self.comm_model, overlap, prefetch_bytes, options.comm_streams)
        self.stream: OpStream = compile_stream(priced, overlap, options.comm_streams)
        self.comm = self.stream.comm            # per collective instance: (index, prim, axes, nbytes, dtype, perm)
        self.factor = np.ones(n)
        for d, f in options.stragglers.items():
            self.factor[d] = f
        self._trace_links: list[int] = []
        if options.trace:
            devs = list(range(min(n, options.trace_devices))) + list(options.stragglers)
            chips = {placement.chip_of(d) for d in devs}
            self._trace_links = [lk.id for lk in topo.links if lk.src in chips or lk.dst in chips] + list(factors)
        self._groups: dict[tuple[str, ...], Groups] = {}
        # step plans per distinct collective (prim, axes, nbytes, dtype, perm): its schedule is fixed by the
        # placement and algorithms of this simulation, so repeats of a collective share their plans
        self._plans: dict[tuple[str, tuple[str, ...], int, str, tuple | None], list[FlowStep]] = {}
        # the same over member classes (None: too little symmetry), for collectives every device opens at once
        self._reduced: dict[tuple, tuple[MemberClasses, list[FlowStep]] | None] = {}
        # flow classes need the flow network, no trace recorder (it follows single flows) and the option
        self.use_classes = options.aggregate and options.network == "flow" and not options.trace
        self.wall_s = 0.0
        self._fresh()

    def _fresh(self) -> None:
        """The simulation state, ready to run (again, after :class:`~partir_emu.hwmodels.des.network.routing.SymmetryBroken`)."""
        options, n = self.options, self.num_devices
        self.env = simpy.Environment()
        self.recorder: Recorder | None = None
        if options.trace:
            devs = list(range(min(n, options.trace_devices))) + list(options.stragglers)
            self.recorder = Recorder(devs, self._trace_links, n, self.router.bw)
        self._network: Network
        if options.network == "flow":
            self._network = FlowNetwork(self.env, self.router, self.recorder, eager=options.aggregate)
        else:
            self._network = ChunkNetwork(self.env, self.router, options.chunk_bytes, self.recorder)
        self.devices = Devices(self.env, self.stream, n, self, self.recorder, options.merge_window_s,
                               options.symmetry)
        self.runs: list[CollectiveRun | None] = [None] * len(self.comm)
        self.colls_finished = 0
        self.step_s = float("nan")
        self.events = 0
        self._finished_with = np.zeros(n, dtype=np.int64)   # per device: its last collective-finish event
        self._finish_events = 0

    # -- the protocols: what devices and collectives call -----------------------------------------
    @property
    def network(self) -> Network:
        return self._network

    @property
    def message_overhead_s(self) -> float:
        return self.options.message_overhead_s

    @property
    def device_end(self) -> np.ndarray:
        """When each device finished the step (NaN until it has)."""
        return self.devices.device_end

    def open_collective(self, c: int, devices: np.ndarray, t: float) -> None:
        run = self.runs[c]
        if run is None:
            run = self.runs[c] = self._make_run(c, devices)
        run.start(devices, t)

    def collective_done(self, ci: int, devices: np.ndarray, t: float, complete: bool) -> None:
        self._finish_events += 1
        self._finished_with[devices] = self._finish_events
        self.devices.collective_done(ci, devices, t)
        if complete:
            self.colls_finished += 1

    def _make_run(self, c: int, first: np.ndarray) -> CollectiveRun:
        """Collective ``c``'s run, over member classes when it is symmetric enough; the ``first`` devices
        to open it seed the classes (those opening it later must then form whole classes)."""
        index, prim, axes, nbytes, dtype, perm = self.comm[c]
        nbytes, dtype = self.spec.stack.wire(prim, axes, nbytes, dtype)      # as the analytical model prices it
        groups = self._groups.get(axes)
        if groups is None:
            groups = self._groups[axes] = make_groups(self.placement, axes)
        built = self.comm_model.schedule(prim, axes, nbytes, dtype, perm)
        if built is None:
            return CollectiveRun(self, c, index, prim, axes, nbytes, "none", groups, [])
        choice, sched = built
        assert tuple(groups.chips[0].tolist()) == tuple(choice.chips), (axes, choice.chips)
        key = (prim, axes, nbytes, dtype, perm)
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = step_plans(sched, groups, self.router, self.options.aggregate)
        if self.use_classes:
            seed = None
            if first.size < self.num_devices:
                # the others open it later, as the collectives it waits for finish for them: seed the
                # classes with who finished their last collective together, and who opens it first
                together = self._finished_with[groups.devices.ravel()]
                opened = np.zeros(groups.devices.size, dtype=np.int64)
                opened[groups.member_of_device[first]] = 1
                seed = class_ids(together, opened)
            ckey = (key, None if seed is None else seed.tobytes())
            if ckey not in self._reduced:
                self._reduced[ckey] = reduce_plans(plans, groups.devices.size, self.router, seed)
            red = self._reduced[ckey]
            if red is not None:
                return CollectiveRun(self, c, index, prim, axes, nbytes, sched.algorithm, groups, plans, red)
        return CollectiveRun(self, c, index, prim, axes, nbytes, sched.algorithm, groups, plans)

    # -- running ------------------------------------------------------------------------------------
    def run(self) -> DesReport:
        """Simulate the step. A class of flows whose flows get different rates goes on flow by flow
        (:class:`~.network.FlowNetwork`); should that ever be impossible, the step is simulated
        again without classes (:class:`~partir_emu.hwmodels.des.network.routing.SymmetryBroken`, a safety net)."""
        try:
            return self._run()
        except SymmetryBroken:
            self.use_classes = False
            self._fresh()
            return self._run()

    def _run(self) -> DesReport:
        t0 = time.perf_counter()
        self.devices.start(self.factor)
        C = len(self.comm)
        # the clock starts with the simulation's construction (pricing and schedules count as waiting)
        bar = Progress(C, "DES", self.options.progress, t0=self._t_built)
        bar.update(0, "collectives, t=0 ms")          # (auto mode: only if pricing and schedules took 5 s)
        env = self.env
        step = env.step
        n = 0
        try:
            while True:
                step()
                n += 1
                if not n & 0x3FF and bar.due:
                    bar.update(self._done(), f"collectives, t={env.now * 1e3:.3f} ms")
        except simpy.core.EmptySchedule:
            pass
        bar.close(self.colls_finished, f"collectives, t={env.now * 1e3:.3f} ms")
        self.events = n
        self.wall_s = time.perf_counter() - t0
        if np.isnan(self.device_end).any():
            stuck = int(np.flatnonzero(np.isnan(self.device_end))[0])
            raise DesError(f"DES deadlock: device {stuck} never finished the step (an internal error; "
                           f"{self.colls_finished} of {C} collectives completed)")
        self.step_s = float(self.device_end.max())
        return self.report()

    def _done(self) -> float:
        """Collectives finished, plus the fraction of its steps each unfinished one has done (a single
        4096-member ring all-reduce is one collective of 8190 steps)."""
        part = 0.0
        for run in self.runs:
            if run is not None and run.num_steps and run.finished < run.M:
                part += float(np.clip(run.cur, 0, run.num_steps).sum()) / (run.M * run.num_steps)
        return self.colls_finished + part

    def report(self) -> DesReport:
        spec, placement, topo = self.spec, self.placement, self.placement.topology
        step = self.step_s
        rows = []
        comm0 = 0.0
        for run, at in zip(self.runs, self.stream.at):
            assert run is not None
            m0 = int(run.groups.member_of_device[0])
            t0, t1 = float(run.t_start[m0]), float(run.t_end[m0])
            comm0 += t1 - t0
            dur = float(np.max(run.t_end - run.t_start))
            rows.append(DesCollectiveRow(run.index, run.prim, run.axes, run.nbytes, run.groups.p, run.algorithm,
                                         run.num_steps, t0, t1, dur, run.max_flows, run.max_own, run.group_max,
                                         str(topo.links[run.worst_link]) if run.worst_link >= 0 else "", at))
        compute0 = float(sum(a.dur for a in self.stream.actions if a.kind == 0)) * float(self.factor[0])
        net = self.network
        bw = self.router.bw
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(bw > 0, net.link_bytes / (bw * step), 0.0) if step > 0 else np.zeros(len(bw))
        used = net.link_bytes > 0
        order = np.lexsort((-net.link_bytes, -util))[:self.options.top_links]     # busiest first
        links = tuple(LinkRow(int(i), str(topo.links[i]), topo.links[i].kind, float(net.link_bytes[i]),
                              float(util[i]), int(net.link_max_flows[i]), self.router.factors.get(int(i), 1.0))
                      for i in order if used[i])
        return DesReport(
            spec=spec.name, topology=topo.describe(), placement=placement.describe(), mesh=str(self.spmd.mesh),
            num_devices=self.num_devices, overlap=self.overlap, network=net.kind, step_s=step,
            compute_s=compute0, comm_s=comm0, exposed_comm_s=step - compute0,
            device_end_min_s=float(self.device_end.min()), device_end_max_s=float(self.device_end.max()),
            mean_link_utilization=float(util[used].mean()) if used.any() else 0.0,
            max_link_utilization=float(util.max()) if len(util) else 0.0,
            links_used=int(used.sum()), num_links=len(bw), events=self.events, wall_s=self.wall_s,
            flows=int(net.flows), walkers=self.devices.walkers, classes=self.devices.max_live, options=self.options.to_json(),
            faults=tuple(self.router.describe_faults()), rerouted_routes=len(self.router.rerouted),
            collectives=tuple(rows), top_links=links, link_utilization=tuple(util.tolist()))

    def chrome_trace(self) -> dict[str, Any]:
        if self.recorder is None:
            raise DesError("the simulation was run without trace=True; there is no trace to export")
        return self.recorder.chrome_trace(self)


def simulate_des(spmd: SpmdProgram, spec: HardwareSpec | str, placement: Placement | str | Mapping | None = None,
                 overlap: bool = False, *, algorithms: str | dict[str, str] | None = None,
                 slice_dims: tuple[int, ...] | None = None, options: DesOptions | None = None,
                 trace_path: str | None = None, analyzer: Analyzer | None = None, prefetch_bytes: int | None = None,
                 **kw: Any) -> DesReport:
    """Simulate one step of ``spmd`` on ``spec`` hardware; same arguments as ``analytical.simulate``
    plus :class:`DesOptions` (or its fields as keywords). ``trace_path`` writes a Perfetto trace."""
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(spec)
    if options is None:
        options = DesOptions(**kw)
    elif kw:
        raise DesError(f"pass DES options either as options= or as keywords, not both ({', '.join(kw)})")
    if trace_path is not None and not options.trace:
        options = DesOptions(**{**options.__dict__, "trace": True})
    placement = analyzer.placement(spmd.mesh, spec, placement, slice_dims)
    sim = Simulation(spmd, spec, placement, overlap, algorithms, options, analyzer, prefetch_bytes)
    rep = sim.run()
    if trace_path is not None:
        write_chrome_trace(sim.chrome_trace(), trace_path)
    return rep

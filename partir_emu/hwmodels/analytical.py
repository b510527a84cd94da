"""The analytical simulator: step time, breakdowns and peak memory of an SpmdProgram.

``simulate(spmd, spec)`` walks the per-device program once (an interpreter over
equations, like every other pass):

- compute equations are grouped into the kernels the chip's compiler would form
  (:mod:`partir_emu.hwmodels.compute.fusion`, from the spec's ``[compiler]`` table); a kernel takes
  ``max(matmul + vector time, boundary bytes / achieved HBM bw)`` plus any launch
  overhead, at the achievable fractions of ``[efficiency]`` (:mod:`partir_emu.hwmodels.compute.efficiency`),
  all on its last equation (the others take 0). ``costs.cost_rules`` gives each
  equation's FLOPs and unfused bytes. In ``by_op_kind`` and ``by_prim`` a kernel's
  time and bytes count under its dominant equation (its dot, else its last
  reduction, else its last elementwise op); counts are of equations;
- a communicating collective takes the price of its algorithm's schedule on the
  placed topology, run by all its groups at once, each link shared by the messages that cross it
  (``comm.CommModel``, :mod:`partir_emu.hwmodels.network.contention`);
- faults (:mod:`partir_emu.hwmodels.machine.links`): degraded links run at their factor of the bandwidth and failed links are
  routed around (both change the collective prices); a straggler (``{device: factor}``) makes the
  step follow the slowest device's timeline: every compute time × the largest factor (each device
  waits for it at the collectives; the DES shows the finer picture);
- without overlap the step is the sum of both; with ``overlap=True`` the schedule
  of :mod:`partir_emu.hwmodels.timeline.overlap`: asynchronous collectives on one communication stream, issued
  by need (ZeRO-3 gathers prefetched within ``prefetch_bytes``), compute in program order;
- peak memory per device from buffer liveness (``memory.peak_memory``);
- a ``loop`` equation (``lax.scan`` and friends, :mod:`partir_emu.core.loops`) takes ``length`` × the
  step of its body, the body priced once by the same rules (its own fusion groups: a loop is a fusion
  boundary; its own overlap schedule) and never unrolled. Iterations are sequential: everything of
  iteration ``i``, its asynchronous collectives included, completes before iteration ``i + 1``
  starts, as in an XLA while loop without collective pipelining (so a loop program is never faster
  than its unrolled form, which may overlap across iterations). FLOPs, bytes, collective counts and
  rows, and the breakdowns count every iteration; memory by rule 5 of :mod:`partir_emu.core.analysis`.
  The work lives in :mod:`.program_costs` (the analysis) and :mod:`.pricing` (times, step, totals).

The per-program analysis (FLOPs, bytes, liveness, dependencies) does not depend
on the hardware, and a collective's price depends only on the placement: an
:class:`Analyzer` keeps both (and the spec files and placements it resolved)
between evaluations, so re-pricing one program on many specs or placements is
cheap. There is no process-global analyzer: whoever evaluates owns one (the CLI one per command, a
search one per search) and passes it on; ``simulate(...)`` without ``analyzer=`` starts cold.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels.bounds import StepBound
from partir_emu.hwmodels.compute.fusion_plan import Groupings
from partir_emu.hwmodels.compute.memory import MemoryProfile
from partir_emu.hwmodels.compute.program import (
    LoopCosts,
    ProgramAnalysis,
    ProgramCosts,
    analyze,
    compute_times,
    has_fp8_matmuls,
)
from partir_emu.hwmodels.machine.links import (
    FaultError,
    check_stragglers,
    describe_stragglers,
    link_factors,
    straggler_scale,
)
from partir_emu.hwmodels.machine.placement import Placement, place
from partir_emu.hwmodels.machine.slices import topology_for
from partir_emu.hwmodels.machine.specs import HardwareSpec, SpecLoader
from partir_emu.hwmodels.machine.topology import Topology
from partir_emu.hwmodels.network.comm import CommModel, PriceCache
from partir_emu.hwmodels.pricing import CollectiveRows, Priced, price, totals, wire_keys
from partir_emu.hwmodels.report import CollectiveRow, SimReport
from partir_emu.hwmodels.ring_buffers import RingBuffer, mpmd_profile, ring_buffers
from partir_emu.hwmodels.timeline.overlap import OverlapPlan

__all__ = ["Analyzer", "CollectiveRow", "LoopCosts", "Priced", "ProgramAnalysis", "ProgramCosts",
           "SimReport", "analyze", "compute_times", "simulate"]


class Analyzer:
    """What repeated evaluations (a search, a sweep, a benchmark) reuse, owned by whoever evaluates.

    - the analysis of the last ``max_programs`` programs (recently used kept; a program is matched
      by identity, and kept alive while it is here; a loop body's inside its program's);
    - collective prices per placement (:class:`~partir_emu.hwmodels.network.comm.PriceCache`);
    - the spec files read (:class:`~partir_emu.hwmodels.machine.specs.SpecLoader`), the topologies
      built (by spec, chips and slice) and the placements built on them, by (mesh axes, spec,
      mapping, slice) (hashable keys; at most ``max_placements``);
    - the steps a placement search found, by everything the steps depend on (:meth:`step_key`), so
      a spec that differs only in what no step reads (its HBM capacity, its name) is not searched
      again (:func:`~partir_emu.hwmodels.machine.search.search_placement`; at most ``max_placements``);
    - the fusion groupings of its programs by structure (:class:`.compute.fusion_plan.Groupings`): a program of
      the structure of one analysed before (another mesh of one strategy) is grouped as it was.

    ``eqns_priced`` counts the work done: equations analysed, plus equations walked by each pricing
    (a loop body once per pricing, whatever its length).

    A new Analyzer starts cold; :meth:`clear` forgets everything, ``prices.clear()`` the prices."""

    def __init__(self, max_programs: int = 8, max_placements: int = 128) -> None:
        self.max_programs = max_programs
        self.max_placements = max_placements
        self.specs = SpecLoader()
        self.prices = PriceCache()
        self._programs: list[ProgramAnalysis] = []              # least recently used first
        self._placements: dict[tuple, Placement] = {}
        self._topologies: dict[tuple, Topology] = {}
        self.searches: dict[tuple, tuple] = {}                  # step_key -> (program, steps, complete)
        self.groupings = Groupings()                            # fusion groupings by program structure
        self.eqns_priced = 0

    def clear(self) -> None:
        self._programs.clear()
        self._placements.clear()
        self._topologies.clear()
        self.searches.clear()
        self.prices.clear()
        self.specs.clear()
        self.groupings.clear()

    def entry(self, program: Program) -> ProgramAnalysis:
        """The kept :class:`ProgramAnalysis` of ``program`` (analysed now if it is not kept)."""
        progs = self._programs
        if progs and progs[-1].program is program:              # the usual case: the same program again
            return progs[-1]
        for i, e in enumerate(progs):
            if e.program is program:
                progs.append(progs.pop(i))
                return e
        e = ProgramAnalysis(program, analyze(program))
        e.costs.fusion.shared = self.groupings
        self.eqns_priced += e.costs.static_eqns
        progs.append(e)
        if len(progs) > self.max_programs:
            del progs[0]
        return e

    def analysis(self, program: Program) -> ProgramCosts:
        """:func:`analyze` of ``program``, computed once while it is kept."""
        return self.entry(program).costs

    def dependencies(self, program: Program) -> tuple[tuple[int, ...], ...]:
        """The producer equations of each equation (``core.analysis.dependencies``), computed once."""
        return self.entry(program).dependencies()

    def overlap_plan(self, program: Program) -> OverlapPlan:
        """The time-independent part of the overlap schedule (:func:`partir_emu.hwmodels.timeline.overlap.build_plan`), computed once."""
        return self.entry(program).overlap_plan()

    def spec(self, spec: HardwareSpec | str) -> HardwareSpec:
        return self.specs.load(spec)

    def topology(self, spec: HardwareSpec, chips: int, slice_dims: Sequence[int] | None = None) -> Topology:
        """:func:`~partir_emu.hwmodels.machine.topology.topology_for`, built once per (spec, chips, slice)."""
        key = (spec, chips, tuple(slice_dims) if slice_dims is not None else None)
        hit = self._topologies.get(key)
        if hit is None:
            if len(self._topologies) >= self.max_placements:
                self._topologies.clear()
            hit = self._topologies[key] = topology_for(spec, chips, key[2])
        return hit

    def placement(self, mesh: Mesh, spec: HardwareSpec, mapping: Placement | str | Mapping | None = None,
                  slice_dims: Sequence[int] | None = None) -> Placement:
        """``mapping`` if it is a Placement, else :func:`~partir_emu.hwmodels.machine.placement.place` (kept)."""
        if isinstance(mapping, Placement):
            return mapping
        try:
            key: tuple | None = (mesh.axes, spec, repr(mapping), tuple(slice_dims) if slice_dims is not None else None)
            hit = self._placements.get(key) if key is not None else None
        except TypeError:            # unhashable mapping values: build afresh
            key, hit = None, None
        if hit is not None:
            return hit
        placement = place(mesh, spec, mapping, slice_dims, topology=self.topology)
        if key is not None:
            if len(self._placements) >= self.max_placements:
                self._placements.clear()
            self._placements[key] = placement
        return placement

    def price(self, program: Program, spec: HardwareSpec, model: CommModel, overlap: bool,
              prefetch_bytes: int | None = None, comm_streams: int = 1, compute_scale: float = 1.0,
              memory: bool = True) -> Priced:
        """The times, step and memory of one run of ``program`` (:func:`.pricing.price`), on what this
        analyzer keeps."""
        pr = price(self.entry(program), spec, model, overlap, prefetch_bytes, comm_streams=comm_streams,
                   compute_scale=compute_scale, memory=memory)
        self.eqns_priced += pr.walked
        return pr

    def _model(self, spmd: SpmdProgram, placement: Placement, algorithms: str | dict[str, str] | None,
               comm_streams: int, stragglers: Mapping[int, float] | None,
               degraded_links: Mapping[str, float] | None, failed_links: Sequence[str]
               ) -> tuple[CommModel, dict[int, float]]:
        """The collective model of a run on ``placement`` with its faults, and the checked stragglers."""
        if int(comm_streams) != comm_streams or comm_streams < 1:
            raise FaultError(f"comm_streams={comm_streams} must be a whole number >= 1")
        slow = check_stragglers(stragglers, spmd.mesh.size)
        factors = link_factors(placement.topology, degraded_links or {}, failed_links)
        return CommModel(placement, algorithms, self.prices, factors), slow

    def comm_model(self, spmd: SpmdProgram, placement: Placement, *, algorithms: str | dict[str, str] | None = None,
                   comm_streams: int = 1, stragglers: Mapping[int, float] | None = None,
                   degraded_links: Mapping[str, float] | None = None, failed_links: Sequence[str] = (),
                   **_: object) -> CommModel:
        """The collective model :meth:`step` prices ``placement`` with (its prices kept in ``prices``)."""
        return self._model(spmd, placement, algorithms, comm_streams, stragglers, degraded_links, failed_links)[0]

    def wire_keys(self, program: Program, spec: HardwareSpec) -> list[tuple]:
        """The distinct collectives of ``program`` as :meth:`step` prices them on ``spec`` (its stack's wire types)."""
        return wire_keys(self.entry(program).costs.comm_keys, spec)

    def step_bound(self, spmd: SpmdProgram, spec: HardwareSpec, overlap: bool, *, prefetch_bytes: int | None = None,
                   comm_streams: int = 1, stragglers: Mapping[int, float] | None = None, **_: object
                   ) -> StepBound | None:
        """Lower bounds of :meth:`step` on any placement from some collective prices (:mod:`.bounds`)."""
        scale = straggler_scale(check_stragglers(stragglers, spmd.mesh.size), spmd.mesh.size)
        return StepBound.of(self.entry(spmd.program), spec, overlap, prefetch_bytes, int(comm_streams), scale)

    def step_key(self, spmd: SpmdProgram, spec: HardwareSpec, overlap: bool,
                 slice_dims: Sequence[int] | None = None, **options: object) -> tuple | None:
        """Everything :meth:`step` reads besides the placement, hashable: the program (by identity: keep
        it alive beside the key), the compute time of each of its equations and its loop bodies' on
        ``spec``, the stack (its wire types), the spec's whole network table and the topology's key (its
        links: what the collective prices read; the network table also says how the schedule treats
        them), the slice, ``overlap`` and the other options of :meth:`step`. Two specs with equal keys
        give every placement of the program the same step; None when an option does not hash."""
        options.pop("model_flops", None)                        # step ignores it
        try:
            opts = tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, Mapping) else
                                 tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()))
            hash(opts)
        except TypeError:
            return None
        topo = self.topology(spec, spmd.mesh.size, slice_dims)
        return (id(spmd.program), spmd.mesh, _times_bytes(self.entry(spmd.program), spec), spec.stack, spec.network,
                topo.key, None if slice_dims is None else tuple(slice_dims), bool(overlap), opts)

    def remember_search(self, key: tuple, value: tuple) -> None:
        if len(self.searches) >= self.max_placements:
            del self.searches[next(iter(self.searches))]        # the oldest
        self.searches[key] = value

    def step(self, spmd: SpmdProgram, spec: HardwareSpec | str,
             placement: Placement | str | Mapping | None = None, overlap: bool = False, *,
             algorithms: str | dict[str, str] | None = None, slice_dims: tuple[int, ...] | None = None,
             prefetch_bytes: int | None = None, comm_streams: int = 1,
             stragglers: Mapping[int, float] | None = None, degraded_links: Mapping[str, float] | None = None,
             failed_links: Sequence[str] = (), model_flops: float | None = None) -> float:
        """``simulate(...).step_s`` without the report (no overlap memory profile, no breakdowns, no
        collective rows): what a placement search ranks by, at a fraction of the cost. ``model_flops``
        is accepted and ignored (it changes only the report's MFU)."""
        spec = self.spec(spec)
        placement = self.placement(spmd.mesh, spec, placement, slice_dims)
        model, slow = self._model(spmd, placement, algorithms, comm_streams, stragglers, degraded_links, failed_links)
        return self.price(spmd.program, spec, model, overlap, prefetch_bytes, int(comm_streams),
                          straggler_scale(slow, spmd.mesh.size), memory=False).step_s

    def simulate(self, spmd: SpmdProgram, spec: HardwareSpec | str,
                 placement: Placement | str | Mapping | None = None, overlap: bool = False, *,
                 algorithms: str | dict[str, str] | None = None,
                 slice_dims: tuple[int, ...] | None = None, prefetch_bytes: int | None = None,
                 model_flops: float | None = None, comm_streams: int = 1,
                 stragglers: Mapping[int, float] | None = None, degraded_links: Mapping[str, float] | None = None,
                 failed_links: Sequence[str] = ()) -> SimReport:
        """As the module's :func:`simulate`, with what this analyzer keeps."""
        spec = self.spec(spec)
        placement = self.placement(spmd.mesh, spec, placement, slice_dims)
        model, slow = self._model(spmd, placement, algorithms, comm_streams, stragglers, degraded_links, failed_links)
        faults = tuple(model.fabric.router.describe_faults() + describe_stragglers(slow))
        pr = self.price(spmd.program, spec, model, overlap, prefetch_bytes, int(comm_streams),
                        straggler_scale(slow, spmd.mesh.size))
        tot = totals(pr, spec)
        mem = program_mem = pr.memory
        rings = ring_buffers(spmd.meta) if spec.stack.pipeline == "mpmd" else ()
        if rings:
            mem = mpmd_profile(spmd.program, program_mem, rings)
        step_s = pr.step_s
        peak_s = step_s * spec.flops_bf16_per_s
        return SimReport(
            spec=spec.name, topology=placement.topology.describe(), placement=placement.describe(),
            mesh=str(spmd.mesh), num_devices=spmd.mesh.size, overlap=overlap, step_s=float(step_s),
            compute_s=pr.compute_s, comm_s=pr.comm_s, exposed_comm_s=float(step_s) - pr.compute_s,
            flops_per_device=tot.flops, hbm_traffic_bytes=tot.hbm_bytes,
            peak_bytes_per_device=mem.peak_bytes, hbm_bytes=spec.hbm_bytes, fits=mem.peak_bytes <= spec.fits_bytes,
            memory=dict(mem.breakdown), peak_at=mem.peak_at, by_op_kind=tot.by_kind, by_prim=tot.by_prim,
            by_collective=tot.by_coll, by_axes=tot.by_axes,
            hfu=tot.dot_flops / peak_s if peak_s > 0 else 0.0,
            mfu=(float(model_flops) / peak_s if peak_s > 0 else 0.0) if model_flops is not None else None,
            fusion=tot.fusion, collectives=CollectiveRows(pr), faults=faults, comm_streams=int(comm_streams),
            stack=spec.stack.name, needed_bytes=spec.stack.needed_bytes(mem.peak_bytes),
            program_peak_bytes=program_mem.peak_bytes,
            notes=_notes(pr, spec) + _mpmd_notes(rings, spec, program_mem, mem))


def _notes(pr: Priced, spec: HardwareSpec) -> tuple[str, ...]:
    """What the report says about how it priced the program: FP8 matmuls on a chip without FP8 units."""
    if spec.flops_fp8_per_s is None and has_fp8_matmuls(pr.analysis.costs, spec):
        return (f"{spec.name} has no FP8 matrix units (its spec gives no flops_fp8_per_s): the FP8 matmuls are "
                f"priced at its bf16 rate, as XLA converts their operands to a type the chip multiplies",)
    return ()


def _mpmd_notes(rings: Sequence[RingBuffer], spec: HardwareSpec, program: MemoryProfile,
                mpmd: MemoryProfile) -> tuple[str, ...]:
    """What the report says when a stack's MPMD pipeline holds fewer stash slots than the program."""
    if mpmd is program:
        return ()
    held = ", ".join(f"{rb.held} of the {rb.slots} slots of the {rb.what}" for rb in rings)
    return (f"the {spec.stack.name} stack runs each pipeline stage as its own program (MPMD): stage 0 holds "
            f"{held}; the peak is {mpmd.peak_bytes / 2 ** 30:.3f} GiB as it runs, "
            f"{program.peak_bytes / 2 ** 30:.3f} GiB as the lowered program runs in lock-step",)


def _times_bytes(entry: ProgramAnalysis, spec: HardwareSpec) -> bytes:
    """The compute time of every equation of ``entry``'s program and of its loop bodies on ``spec``, as bytes."""
    out = [compute_times(entry.costs, spec).tobytes()]
    out += [_times_bytes(lc.body, spec) for lc in entry.costs.loops]
    return b"|".join(out)


"""The analyzer of callers that pass none (``simulate(spmd, spec)``, ``simulate_des``): repeated
evaluations of a program stay cheap without any setup. Pass your own to own what is kept."""


# -- the simulator ------------------------------------------------------------------------------------
def simulate(spmd: SpmdProgram, spec: HardwareSpec | str, placement: Placement | str | Mapping | None = None,
             overlap: bool = False, *, algorithms: str | dict[str, str] | None = None,
             slice_dims: tuple[int, ...] | None = None, analyzer: Analyzer | None = None,
             prefetch_bytes: int | None = None, model_flops: float | None = None, comm_streams: int = 1,
             stragglers: Mapping[int, float] | None = None, degraded_links: Mapping[str, float] | None = None,
             failed_links: Sequence[str] = ()) -> SimReport:
    """Predict one step of ``spmd`` on ``spec`` hardware.

    ``placement``: a :class:`Placement`, a mapping string such as ``"model=x,batch=yz"`` (or dict), or
    ``None`` for the default placement; ``slice_dims`` picks a TPU slice shape. ``algorithms`` overrides
    the collective algorithm, for all kinds (a name) or per kind (``{"all_reduce": "ring"}``).
    ``analyzer`` keeps analyses, prices and placements between calls (default: a new one, cold).
    ``prefetch_bytes``: with overlap, the ZeRO-3 all-gather bytes in flight ahead of need (default:
    one FSDP unit, :mod:`partir_emu.hwmodels.timeline.overlap`; 0: gather on demand); the peak memory counts them.
    ``model_flops``: the model's FLOPs per device per step (``Scenario.model_flops``: 6·N per token plus
    attention, no recompute); gives ``mfu`` (else ``None``). ``hfu`` counts the program's matmul FLOPs.
    ``comm_streams``: with overlap, how many collectives may run at once (:mod:`partir_emu.hwmodels.timeline.overlap`).
    Faults (:mod:`partir_emu.hwmodels.machine.links`; bad values raise :class:`~partir_emu.hwmodels.machine.links.FaultError`): ``stragglers`` ``{device:
    factor}`` (compute ``factor`` x slower), ``degraded_links`` ``{"A->B" | "A-B" | "#id": factor}``,
    ``failed_links`` (names; routes detour around them). The report lists them in ``faults``."""
    return (analyzer if analyzer is not None else Analyzer()).simulate(
        spmd, spec, placement, overlap, algorithms=algorithms, slice_dims=slice_dims, prefetch_bytes=prefetch_bytes,
        model_flops=model_flops, comm_streams=comm_streams, stragglers=stragglers, degraded_links=degraded_links,
        failed_links=failed_links)

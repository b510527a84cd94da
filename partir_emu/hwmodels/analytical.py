"""The analytical simulator: step time, breakdowns and peak memory of an SpmdProgram.

``simulate(spmd, spec)`` walks the per-device program once (an interpreter over
equations, like every other pass):

- compute equations are grouped into the kernels the chip's compiler would form
  (:mod:`.fusion`, from the spec's ``[compiler]`` table); a kernel takes
  ``max(matmul + vector time, boundary bytes / achieved HBM bw)`` plus any launch
  overhead, at the achievable fractions of ``[efficiency]`` (:mod:`.efficiency`),
  all on its last equation (the others take 0). ``costs.cost_rules`` gives each
  equation's FLOPs and unfused bytes. In ``by_op_kind`` and ``by_prim`` a kernel's
  time and bytes count under its dominant equation (its dot, else its last
  reduction, else its last elementwise op); counts are of equations;
- a communicating collective takes the price of its algorithm's schedule on the
  placed topology (``comm.CommModel``);
- without overlap the step is the sum of both; with ``overlap=True`` the schedule
  of :mod:`.overlap`: asynchronous collectives on one communication stream, issued
  by need (ZeRO-3 gathers prefetched within ``prefetch_bytes``), compute in program order;
- peak memory per device from buffer liveness (``memory.peak_memory``).

The per-program analysis (FLOPs, bytes, liveness, dependencies) does not depend
on the hardware, and a collective's price depends only on the placement: an
:class:`Analyzer` keeps both (and the spec files and placements it resolved)
between evaluations, so re-pricing one program on many specs or placements is
cheap. ``simulate(...)`` without ``analyzer=`` uses :data:`DEFAULT_ANALYZER`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from partir_emu.core.analysis import dependencies
from partir_emu.core.ir import Program
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram, collective_bytes, permute_spec
from partir_emu.hwmodels.comm import CollectiveCost, CommModel, PriceCache
from partir_emu.hwmodels.costs import KINDS, cost_rules, eqn_cost, op_kind
from partir_emu.hwmodels.fusion import FusionCache, eqn_times
from partir_emu.hwmodels.memory import MemoryProfile, peak_memory
from partir_emu.hwmodels.overlap import OverlapPlan, Schedule, build_plan, overlap_memory, schedule
from partir_emu.hwmodels.placement import Placement, place
from partir_emu.hwmodels.specs import MATMUL_16BIT_DTYPES, HardwareSpec, SpecLoader

_RATE_MM16, _RATE_MM32, _RATE_VEC = 0, 1, 2


class CollectiveRow(NamedTuple):
    """One communicating collective of the program, priced (a NamedTuple: cheap to build in bulk)."""

    index: int                # equation index
    prim: str
    axes: tuple[str, ...]
    nbytes: int               # full buffer per device (nccl-tests "size")
    group_size: int
    algorithm: str
    time_s: float
    start_s: float = 0.0      # with overlap: when it starts on the communication stream

    def to_json(self) -> dict:
        return {"index": self.index, "prim": self.prim, "axes": list(self.axes), "nbytes": self.nbytes,
                "group_size": self.group_size, "algorithm": self.algorithm, "time_s": self.time_s,
                "start_s": self.start_s}


@dataclass(frozen=True)
class SimReport:
    """What ``simulate`` predicts for one step on one device (all devices run the same program)."""

    spec: str
    topology: str
    placement: str
    mesh: str
    num_devices: int
    overlap: bool
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float           # step_s - compute_s: communication not hidden behind compute
    flops_per_device: float
    hbm_traffic_bytes: float        # bytes moved to/from HBM by compute ops
    peak_bytes_per_device: int
    hbm_bytes: int                  # HBM capacity of one chip
    fits: bool
    memory: dict[str, int]          # breakdown of the peak (memory.CATEGORIES)
    peak_at: int
    by_op_kind: dict[str, dict[str, float]]
    by_prim: dict[str, dict[str, float]]
    by_collective: dict[str, dict[str, float]]
    by_axes: dict[str, dict[str, float]]
    hfu: float                      # matmul FLOPs per device (recompute included) / (step_s * bf16 peak)
    mfu: float | None               # model_flops / (step_s * bf16 peak); None when no model_flops was given
    fusion: dict[str, float]        # kernels, fused groups, hand kernels, bytes saved (fusion.FusionPlan.summary)
    collectives: tuple[CollectiveRow, ...] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "spec", "topology", "placement", "mesh", "num_devices", "overlap", "step_s", "compute_s", "comm_s",
            "exposed_comm_s", "flops_per_device", "hbm_traffic_bytes", "peak_bytes_per_device", "hbm_bytes",
            "fits", "memory", "peak_at", "hfu", "mfu", "fusion", "by_op_kind", "by_prim", "by_collective", "by_axes")}
        d["collectives"] = [r.to_json() for r in self.collectives]
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def table(self, top: int = 10) -> str:
        """A readable summary: totals, memory, time by op kind, by collective, by axes, slowest collectives."""
        gib = 2 ** 30
        lines = [f"{self.spec} | {self.topology}",
                 f"placement: {self.placement}",
                 f"step {_t(self.step_s)}  = compute {_t(self.compute_s)} + comm {_t(self.comm_s)}"
                 + (f" (overlap on, exposed comm {_t(self.exposed_comm_s)})" if self.overlap else ""),
                 f"flops/device {self.flops_per_device:.3g}   HBM traffic {self.hbm_traffic_bytes / 1e9:.3g} GB",
                 f"HFU {100 * self.hfu:.1f}%   MFU " + (f"{100 * self.mfu:.1f}%" if self.mfu is not None
                                                      else "- (no model FLOPs given)"),
                 _fusion_line(self.fusion),
                 f"peak memory {self.peak_bytes_per_device / gib:.3f} GiB of {self.hbm_bytes / gib:.3f} GiB"
                 f" -> {'fits' if self.fits else 'DOES NOT FIT'}",
                 "  " + "  ".join(f"{k} {v / gib:.3f}" for k, v in self.memory.items() if v), ""]
        lines.append(f"{'op kind':<14}{'count':>7}{'time':>12}{'share':>8}{'GFLOP':>12}{'GB':>10}")
        total = self.step_s if not self.overlap else self.compute_s + self.comm_s
        for k, r in sorted(self.by_op_kind.items(), key=lambda kv: -kv[1]["time_s"]):
            lines.append(f"{k:<14}{int(r['count']):>7}{_t(r['time_s']):>12}{_pct(r['time_s'], total):>8}"
                         f"{r['flops'] / 1e9:>12.3f}{r['bytes'] / 1e9:>10.3f}")
        if self.by_collective:
            lines += ["", f"{'collective':<16}{'count':>7}{'time':>12}{'MB':>12}"]
            for k, r in sorted(self.by_collective.items(), key=lambda kv: -kv[1]["time_s"]):
                lines.append(f"{k:<16}{int(r['count']):>7}{_t(r['time_s']):>12}{r['bytes'] / 1e6:>12.3f}")
            lines += ["", f"{'axes':<16}{'count':>7}{'time':>12}{'MB':>12}"]
            for k, r in sorted(self.by_axes.items(), key=lambda kv: -kv[1]["time_s"]):
                lines.append(f"{k:<16}{int(r['count']):>7}{_t(r['time_s']):>12}{r['bytes'] / 1e6:>12.3f}")
            lines += ["", f"slowest collectives (of {len(self.collectives)}):",
                      f"{'eqn':>6} {'prim':<15}{'axes':<14}{'MB':>10}{'algorithm':>14}{'time':>12}"]
            for r in sorted(self.collectives, key=lambda r: -r.time_s)[:top]:
                lines.append(f"{r.index:>6} {r.prim:<15}{','.join(r.axes):<14}{r.nbytes / 1e6:>10.3f}"
                             f"{r.algorithm:>14}{_t(r.time_s):>12}")
        return "\n".join(lines)

    __str__ = table


def _fusion_line(f: Mapping[str, float]) -> str:
    return (f"fusion: {int(f['kernels'])} kernels ({int(f['fused_groups'])} fused groups, "
            f"{int(f['hand_kernels'])} hand-fused), HBM bytes {f['fused_bytes'] / 1e9:.3g} GB "
            f"(unfused {f['unfused_bytes'] / 1e9:.3g} GB, saved {f['bytes_saved'] / 1e9:.3g} GB)")


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.1f}%" if total > 0 else "-"


# -- per-program analysis (hardware independent) ----------------------------------------------------------
@dataclass(frozen=True)
class ProgramCosts:
    flops: np.ndarray            # per equation
    bytes: np.ndarray
    rate_class: np.ndarray       # _RATE_MM16 | _RATE_MM32 | _RATE_VEC
    kind: np.ndarray             # index into KINDS
    prim_index: np.ndarray       # index into prim_names
    prim_names: tuple[str, ...]
    comm: tuple[tuple[int, str, tuple[str, ...], int, str, tuple | None], ...]   # (index, prim, axes, nbytes, dtype, perm)
    memory: MemoryProfile
    comm_index: np.ndarray       # equation index of each entry of ``comm``
    comm_keys: tuple[tuple[str, tuple[str, ...], int, str, tuple | None], ...]   # distinct comm[1:], first seen first
    comm_inverse: np.ndarray     # for each entry of ``comm``: its index in ``comm_keys``
    is_comm: np.ndarray          # per equation: a communicating collective?
    fusion: FusionCache          # the groups the chip's compiler forms, per compiler variant (built on demand)


_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def analyze(program: Program) -> ProgramCosts:
    """FLOPs, bytes, kinds, collectives and liveness of a program (hardware independent; computed afresh:
    :meth:`Analyzer.analysis` keeps it)."""
    n = len(program.eqns)
    flops = [0.0] * n
    byts = [0.0] * n
    rate = [_RATE_VEC] * n
    kind = [0] * n
    pidx = [0] * n
    prim_ids: dict[str, int] = {}
    comm = []
    rules, kinds, kind_index = cost_rules, op_kind, _KIND_INDEX
    for i, e in enumerate(program.eqns):
        prim = e.prim
        rule = rules.get(prim)
        f, b = rule(e) if rule is not None else eqn_cost(e)
        flops[i] = f
        byts[i] = b
        k = kinds[prim]
        kind[i] = kind_index[k]
        p = prim_ids.get(prim)
        if p is None:
            p = prim_ids[prim] = len(prim_ids)
        pidx[i] = p
        if k == "matmul":
            rate[i] = _RATE_MM16 if e.inputs[0].dtype in MATMUL_16BIT_DTYPES else _RATE_MM32
        elif k == "collective":
            comm.append((i, prim, tuple(e.params["axes"]), collective_bytes(e), e.inputs[0].dtype,
                         permute_spec(e.params) if prim == "collective_permute" else None))
    keys: dict[tuple, int] = {}
    inverse = [keys.setdefault(c[1:], len(keys)) for c in comm]
    comm_index = np.array([c[0] for c in comm], dtype=np.int64)
    is_comm = np.zeros(n, dtype=bool)
    is_comm[comm_index] = True
    flops_arr, bytes_arr = np.array(flops), np.array(byts)
    pc = ProgramCosts(flops_arr, bytes_arr, np.array(rate, dtype=np.int8), np.array(kind, dtype=np.int8),
                      np.array(pidx, dtype=np.int32), tuple(prim_ids), tuple(comm), peak_memory(program),
                      comm_index, tuple(keys), np.array(inverse, dtype=np.int64), is_comm,
                      FusionCache(program, flops_arr, bytes_arr))
    return pc


# -- what repeated evaluations reuse ------------------------------------------------------------------
class _Analysis:
    """One program's analysis, and its dependencies and overlap plan once something asked for them."""

    __slots__ = ("program", "costs", "deps", "plan")

    def __init__(self, program: Program, costs: ProgramCosts) -> None:
        self.program = program
        self.costs = costs
        self.deps: tuple[tuple[int, ...], ...] | None = None
        self.plan: OverlapPlan | None = None


class Analyzer:
    """What repeated evaluations (a search, a sweep, a benchmark) reuse, owned by whoever evaluates.

    - the analysis of the last ``max_programs`` programs (recently used kept; a program is matched
      by identity, and kept alive while it is here);
    - collective prices per placement (:class:`~partir_emu.hwmodels.comm.PriceCache`);
    - the spec files read (:class:`~partir_emu.hwmodels.specs.SpecLoader`) and the placements
      built, by (mesh axes, spec, mapping, slice) (hashable keys; at most ``max_placements``).

    A new Analyzer starts cold; :meth:`clear` forgets everything, ``prices.clear()`` the prices."""

    def __init__(self, max_programs: int = 8, max_placements: int = 128) -> None:
        self.max_programs = max_programs
        self.max_placements = max_placements
        self.specs = SpecLoader()
        self.prices = PriceCache()
        self._programs: list[_Analysis] = []                    # least recently used first
        self._placements: dict[tuple, Placement] = {}

    def clear(self) -> None:
        self._programs.clear()
        self._placements.clear()
        self.prices.clear()
        self.specs.clear()

    def _entry(self, program: Program) -> _Analysis:
        progs = self._programs
        if progs and progs[-1].program is program:              # the usual case: the same program again
            return progs[-1]
        for i, e in enumerate(progs):
            if e.program is program:
                progs.append(progs.pop(i))
                return e
        e = _Analysis(program, analyze(program))
        progs.append(e)
        if len(progs) > self.max_programs:
            del progs[0]
        return e

    def analysis(self, program: Program) -> ProgramCosts:
        """:func:`analyze` of ``program``, computed once while it is kept."""
        return self._entry(program).costs

    def dependencies(self, program: Program) -> tuple[tuple[int, ...], ...]:
        """The producer equations of each equation (``core.analysis.dependencies``), computed once."""
        e = self._entry(program)
        if e.deps is None:
            e.deps = dependencies(program)
        return e.deps

    def overlap_plan(self, program: Program) -> OverlapPlan:
        """The time-independent part of the overlap schedule (:func:`.overlap.build_plan`), computed once."""
        e = self._entry(program)
        if e.plan is None:
            e.plan = build_plan(program, e.costs.is_comm, self.dependencies(program))
        return e.plan

    def spec(self, spec: HardwareSpec | str) -> HardwareSpec:
        return self.specs.load(spec)

    def placement(self, mesh: Mesh, spec: HardwareSpec, mapping: Placement | str | Mapping | None = None,
                  slice_dims: Sequence[int] | None = None) -> Placement:
        """``mapping`` if it is a Placement, else :func:`~partir_emu.hwmodels.placement.place` (kept)."""
        if isinstance(mapping, Placement):
            return mapping
        try:
            key: tuple | None = (mesh.axes, spec, repr(mapping), tuple(slice_dims) if slice_dims is not None else None)
            hit = self._placements.get(key)
        except TypeError:            # unhashable mapping values: build afresh
            key, hit = None, None
        if hit is not None:
            return hit
        placement = place(mesh, spec, mapping, slice_dims)
        if key is not None:
            if len(self._placements) >= self.max_placements:
                self._placements.clear()
            self._placements[key] = placement
        return placement

    def simulate(self, spmd: SpmdProgram, spec: HardwareSpec | str,
                 placement: Placement | str | Mapping | None = None, overlap: bool = False, *,
                 algorithms: str | dict[str, str] | None = None,
                 slice_dims: tuple[int, ...] | None = None, prefetch_bytes: int | None = None,
                 model_flops: float | None = None) -> SimReport:
        """As the module's :func:`simulate`, with what this analyzer keeps."""
        spec = self.spec(spec)
        placement = self.placement(spmd.mesh, spec, placement, slice_dims)
        pc = self.analysis(spmd.program)
        times = compute_times(pc, spec)
        model = CommModel(placement, algorithms, self.prices)
        # all collectives with the same (prim, axes, nbytes, dtype, perm) cost the same: price each distinct one once
        costs = [model.cost(*key) for key in pc.comm_keys]
        is_comm = pc.is_comm
        if costs:
            times[pc.comm_index] = np.array([c.time_s for c in costs])[pc.comm_inverse]
        compute_s = float(times[~is_comm].sum())
        comm_s = float(times[is_comm].sum())
        mem = pc.memory
        if overlap:
            plan = self.overlap_plan(spmd.program)
            sched = _overlap_schedule(plan, times, prefetch_bytes)
            step_s, comm_starts = sched.step_s, sched.start
            mem = overlap_memory(plan, spmd.program, mem, sched)
        else:
            step_s = compute_s + comm_s
            comm_starts = np.concatenate(([0.0], np.cumsum(times)[:-1]))[pc.comm_index].tolist() if pc.comm else []
        rows = [CollectiveRow(i, prim, axes, nbytes, c.group_size, c.algorithm, c.time_s, s0)
                for (i, prim, axes, nbytes, *_), c, s0 in zip(pc.comm, (costs[k] for k in pc.comm_inverse.tolist()),
                                                              comm_starts)]
        fplan = pc.fusion.plan(spec.compiler)
        # a fused group's time and bytes are reported under its dominant equation (FusionPlan.rep)
        rep_t, rep_b = np.zeros(len(times)), np.zeros(len(times))
        rep_t[fplan.rep] = times[fplan.last]
        rep_b[fplan.rep] = fplan.bytes
        by_kind, by_prim, by_coll, by_axes = _breakdowns(pc, rep_t, rep_b, costs)
        flops_total = float(pc.flops.sum())
        peak_s = step_s * spec.flops_bf16_per_s
        return SimReport(
            spec=spec.name, topology=placement.topology.describe(), placement=placement.describe(),
            mesh=str(spmd.mesh), num_devices=spmd.mesh.size, overlap=overlap, step_s=float(step_s),
            compute_s=compute_s, comm_s=comm_s, exposed_comm_s=float(step_s) - compute_s,
            flops_per_device=flops_total, hbm_traffic_bytes=float(fplan.bytes.sum()),
            peak_bytes_per_device=mem.peak_bytes, hbm_bytes=spec.hbm_bytes, fits=mem.peak_bytes <= spec.hbm_bytes,
            memory=dict(mem.breakdown), peak_at=mem.peak_at, by_op_kind=by_kind, by_prim=by_prim,
            by_collective=by_coll, by_axes=by_axes,
            hfu=float(fplan.dot_flops.sum()) / peak_s if peak_s > 0 else 0.0,
            mfu=(float(model_flops) / peak_s if peak_s > 0 else 0.0) if model_flops is not None else None,
            fusion=fplan.summary(float(pc.bytes.sum())), collectives=tuple(rows))


DEFAULT_ANALYZER = Analyzer()
"""The analyzer of callers that pass none (``simulate(spmd, spec)``, ``simulate_des``): repeated
evaluations of a program stay cheap without any setup. Pass your own to own what is kept."""


# -- the simulator ------------------------------------------------------------------------------------
def simulate(spmd: SpmdProgram, spec: HardwareSpec | str, placement: Placement | str | Mapping | None = None,
             overlap: bool = False, *, algorithms: str | dict[str, str] | None = None,
             slice_dims: tuple[int, ...] | None = None, analyzer: Analyzer | None = None,
             prefetch_bytes: int | None = None, model_flops: float | None = None) -> SimReport:
    """Predict one step of ``spmd`` on ``spec`` hardware.

    ``placement``: a :class:`Placement`, a mapping string such as ``"model=x,batch=yz"`` (or dict), or
    ``None`` for the default placement; ``slice_dims`` picks a TPU slice shape. ``algorithms`` overrides
    the collective algorithm, for all kinds (a name) or per kind (``{"all_reduce": "ring"}``).
    ``analyzer`` keeps analyses, prices and placements between calls (default :data:`DEFAULT_ANALYZER`).
    ``prefetch_bytes``: with overlap, the ZeRO-3 all-gather bytes in flight ahead of need (default:
    one FSDP unit, :mod:`.overlap`; 0: gather on demand); the peak memory counts them.
    ``model_flops``: the model's FLOPs per device per step (``Scenario.model_flops``: 6·N per token plus
    attention, no recompute); gives ``mfu`` (else ``None``). ``hfu`` counts the program's matmul FLOPs."""
    return (analyzer if analyzer is not None else DEFAULT_ANALYZER).simulate(
        spmd, spec, placement, overlap, algorithms=algorithms, slice_dims=slice_dims, prefetch_bytes=prefetch_bytes,
        model_flops=model_flops)


def _breakdowns(pc: ProgramCosts, times: np.ndarray, byts: np.ndarray, costs: list[CollectiveCost]
                ) -> tuple[dict, ...]:
    """Time, count, FLOPs and bytes by op kind and by primitive (``times`` and ``byts`` per equation, a
    fused group's on its dominant equation; counts are of equations); time, count and bytes by
    collective kind and by mesh axes."""
    nk = len(KINDS)
    ksums = [np.bincount(pc.kind, weights=w, minlength=nk).tolist() for w in (None, times, pc.flops, byts)]
    by_kind = {name: {"count": int(ksums[0][k]), "time_s": ksums[1][k], "flops": ksums[2][k], "bytes": ksums[3][k]}
               for k, name in enumerate(KINDS) if ksums[0][k]}
    m = len(pc.prim_names)
    sums = [np.bincount(pc.prim_index, weights=w, minlength=m).tolist()
            for w in (None, times, pc.flops, byts)]
    by_prim = {name: {"count": int(sums[0][j]), "time_s": sums[1][j], "flops": sums[2][j], "bytes": sums[3][j]}
               for j, name in enumerate(pc.prim_names)}
    by_coll: dict[str, dict[str, float]] = {}
    by_axes: dict[str, dict[str, float]] = {}
    counts = np.bincount(pc.comm_inverse, minlength=len(costs)).tolist() if costs else []
    for (prim, axes, nbytes, *_), c, cnt in zip(pc.comm_keys, costs, counts):
        for table, key in ((by_coll, prim), (by_axes, ",".join(axes))):
            d = table.setdefault(key, {"count": 0, "time_s": 0.0, "bytes": 0})
            d["count"] += cnt
            d["time_s"] += cnt * c.time_s
            d["bytes"] += cnt * nbytes
    return by_kind, by_prim, by_coll, by_axes


def compute_times(pc: ProgramCosts, spec: HardwareSpec) -> np.ndarray:
    """Seconds of every equation on one chip of ``spec`` (a fresh array; the DES reuses it): the fused
    groups of ``spec.compiler`` priced by ``hwmodels.fusion`` (a group's time on its last equation, zero
    on its other equations). A spec without a ``[compiler]`` table prices every equation alone."""
    return eqn_times(pc.fusion.plan(spec.compiler), spec)


def _overlap_schedule(plan: OverlapPlan, times: np.ndarray, prefetch_bytes: int | None) -> Schedule:
    """The overlapped step (:func:`.overlap.schedule`): collectives asynchronous on one communication
    stream, issued by need, ZeRO-3 gathers prefetched within ``prefetch_bytes``; compute in program order."""
    return schedule(plan, times, prefetch_bytes)

"""The hardware-independent analysis of a per-device program, and its compute times on a chip.

:func:`analyze` computes, once per program, what every pricing reuses: per-equation FLOPs and
unfused bytes (``costs.cost_rules``), op kinds, the communicating collectives (and which of them
are priced alike), and on demand the program-order memory profiles (``memory.peak_memory``, per
stack policy) and the fusion plans (per compiler variant). A ``loop`` equation's body is analysed once, recursively
(:class:`LoopCosts`), whatever its length: the pricing (:mod:`partir_emu.hwmodels.pricing`) walks it once and
multiplies. :class:`ProgramAnalysis` adds the dependencies and the overlap plan, built when first
asked for. :func:`compute_times` prices the fused groups on one chip.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from partir_emu.core.analysis import dependencies
from partir_emu.core.ir import Program
from partir_emu.core.loops import LOOP
from partir_emu.core.spmd import collective_bytes, permute_spec
from partir_emu.hwmodels.compute.costs import KINDS, cost_rules, eqn_cost, op_kind
from partir_emu.hwmodels.compute.fusion import FusionCache
from partir_emu.hwmodels.compute.kernel_times import eqn_times
from partir_emu.hwmodels.compute.memory import MemoryProfile, peak_memory
from partir_emu.hwmodels.machine.specs import MATMUL_16BIT_DTYPES, HardwareSpec
from partir_emu.hwmodels.timeline.overlap import OverlapPlan, build_plan

_RATE_MM16, _RATE_MM32, _RATE_VEC = 0, 1, 2


# -- per-program analysis (hardware independent) ----------------------------------------------------------
@dataclass(frozen=True)
class ProgramCosts:
    flops: np.ndarray            # per equation (a loop equation: 0; its body's are in ``loops``)
    bytes: np.ndarray
    rate_class: np.ndarray       # _RATE_MM16 | _RATE_MM32 | _RATE_VEC
    kind: np.ndarray             # index into KINDS
    prim_index: np.ndarray       # index into prim_names
    prim_names: tuple[str, ...]
    comm: tuple[tuple[int, str, tuple[str, ...], int, str, tuple | None], ...]   # (index, prim, axes, nbytes, dtype, perm)
    comm_index: np.ndarray       # equation index of each entry of ``comm``
    comm_keys: tuple[tuple[str, tuple[str, ...], int, str, tuple | None], ...]   # distinct comm[1:], first seen first
    comm_inverse: np.ndarray     # for each entry of ``comm``: its index in ``comm_keys``
    is_comm: np.ndarray          # per equation: a communicating collective?
    fusion: FusionCache          # the groups the chip's compiler forms, per compiler variant (built on demand)
    loops: tuple[LoopCosts, ...] = ()     # the loop equations, in program order, each with its body's analysis
    loop_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))   # their indices
    _saved: dict[str, MemoryProfile] = field(default_factory=dict, repr=False, compare=False)
    _program: Program | None = field(default=None, repr=False, compare=False)     # the program analysed

    @property
    def memory(self) -> MemoryProfile:
        """The program-order profile, loop bodies included (rule 5), every value in HBM (policy
        ``"program"``, the runtime's convention); built when first asked for (a stack's pricing asks
        for its own policy's, :meth:`memory_for`)."""
        assert self._program is not None
        return self.memory_for(self._program, "program")

    def memory_for(self, program: Program, policy: str) -> MemoryProfile:
        """The program-order profile of ``program`` (the one analysed) when the stack keeps what
        ``policy`` says for the backward pass (:mod:`.residuals`; built once per policy, loop
        bodies by the same policy)."""
        hit = self._saved.get(policy)
        if hit is None:
            hit = self._saved[policy] = peak_memory(
                program, {lc.index: lc.body.costs.memory_for(lc.body.program, policy)
                          for lc in self.loops if lc.length > 0}, policy)
        return hit

    @property
    def static_eqns(self) -> int:
        """Equations of the program text, each loop body once (what one pricing walks)."""
        return len(self.flops) + sum(lc.body.costs.static_eqns for lc in self.loops)


@dataclass(frozen=True)
class LoopCosts:
    """A loop equation of a program: where it is, how often its body runs, the body's analysis."""

    index: int
    length: int
    iterations: tuple[int, ...]          # the iteration indices in execution order (reversed loops: n-1..0)
    body: ProgramAnalysis


_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def analyze(program: Program) -> ProgramCosts:
    """FLOPs, bytes, kinds, collectives and liveness of a program (hardware independent; computed afresh:
    :meth:`Analyzer.analysis` keeps it). A loop body is analysed once, recursively (``ProgramCosts.loops``);
    the loop equation itself costs nothing here (it is a fusion boundary, priced from its body)."""
    n = len(program.eqns)
    flops = [0.0] * n
    byts = [0.0] * n
    rate = [_RATE_VEC] * n
    kind = [0] * n
    pidx = [0] * n
    prim_ids: dict[str, int] = {}
    comm = []
    loops = []
    rules, kinds, kind_index = cost_rules, op_kind, _KIND_INDEX
    for i, e in enumerate(program.eqns):
        prim = e.prim
        p = prim_ids.get(prim)
        if p is None:
            p = prim_ids[prim] = len(prim_ids)
        pidx[i] = p
        if prim == LOOP:
            body = e.params["body"]
            length = int(e.params["length"])
            its = tuple(range(length - 1, -1, -1) if e.params.get("reverse") else range(length))
            loops.append(LoopCosts(i, length, its, ProgramAnalysis(body, analyze(body))))
            kind[i] = kind_index["free"]
            continue
        rule = rules.get(prim)
        f, b = rule(e) if rule is not None else eqn_cost(e)
        flops[i] = f
        byts[i] = b
        k = kinds[prim]
        kind[i] = kind_index[k]
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
                      np.array(pidx, dtype=np.int32), tuple(prim_ids), tuple(comm),
                      comm_index, tuple(keys), np.array(inverse, dtype=np.int64), is_comm,
                      FusionCache(program, flops_arr, bytes_arr), tuple(loops),
                      np.array([lc.index for lc in loops], dtype=np.int64), _program=program)
    return pc


class ProgramAnalysis:
    """One program's analysis, and its dependencies and overlap plan once something asked for them
    (a loop body's is kept inside its enclosing program's :class:`ProgramCosts`)."""

    __slots__ = ("program", "costs", "deps", "plan", "memo")

    def __init__(self, program: Program, costs: ProgramCosts) -> None:
        self.program = program
        self.costs = costs
        self.deps: tuple[tuple[int, ...], ...] | None = None
        self.plan: OverlapPlan | None = None
        self.memo: dict[tuple, MemoryProfile] = {}     # memory profiles with bodies' schedules (pricing)

    def dependencies(self) -> tuple[tuple[int, ...], ...]:
        if self.deps is None:
            self.deps = dependencies(self.program)
        return self.deps

    def overlap_plan(self) -> OverlapPlan:
        if self.plan is None:
            self.plan = build_plan(self.program, self.costs.is_comm, self.dependencies(), self.costs.loop_index)
        return self.plan


def compute_times(pc: ProgramCosts, spec: HardwareSpec) -> np.ndarray:
    """Seconds of every equation on one chip of ``spec`` (a fresh array; the DES reuses it): the fused
    groups of ``spec.compiler`` priced by ``hwmodels.fusion`` (a group's time on its last equation, zero
    on its other equations). A spec without a ``[compiler]`` table prices every equation alone. A loop
    equation takes 0 here: its time is its body's (:func:`partir_emu.hwmodels.pricing.price`)."""
    return eqn_times(pc.fusion.plan(spec.kernels), spec)


def has_fp8_matmuls(pc: ProgramCosts, spec: HardwareSpec) -> bool:
    """Whether the program (loop bodies included) has an FP8 x FP8 matmul, as ``spec``'s compiler groups it."""
    return bool(pc.fusion.plan(spec.kernels).dot_fp8.any()) or any(has_fp8_matmuls(lc.body.costs, spec)
                                                                   for lc in pc.loops)

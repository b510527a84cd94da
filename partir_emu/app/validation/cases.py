"""The validation suites: cases named by scenario, lowered here, compared by :mod:`partir_emu.hwmodels.validation.des`.

``run_suite(cases)`` lowers each program once (the one program cache,
:class:`partir_emu.app.programs.ProgramCache`, in memory and optionally on disk), then compares the
analytical model and the DES on it (``hwmodels.des.validate.compare``) and gathers a
:class:`~partir_emu.hwmodels.validation.des.ValidationReport`.

Suites: ``default`` (>= 40 cases, 8 to 2048 chips, TPU v4 and H100 fat tree / rail-optimized, MLP and
transformer strategies; at least half exercise a mechanism beyond the closed form: group
contention, several streams, stragglers, degraded and failed links, NIC sharing; about a minute),
``closed-form`` (its closed-form cases) and ``quick`` (its 8-chip MLP cases, seconds). The catalogue
of cases and of the mutations they catch is ``docs/validation.md``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from partir_emu.app.experiment import Experiment
from partir_emu.app.programs import ProgramCache
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.machine.links import Router, link_factors
from partir_emu.hwmodels.machine.placement import place
from partir_emu.hwmodels.machine.slices import chips_limit
from partir_emu.hwmodels.machine.specs import load_spec
from partir_emu.hwmodels.validation.des import MAX_MAX, MEDIAN_MAX, Case, CaseResult, compare
from partir_emu.hwmodels.validation.report import ValidationReport
from partir_emu.limits import loads


class ValidationError(PartirError):
    """An unknown suite or an unusable case."""


def _c(scenario: str, strategy: str, hardware: str, mesh: str, **kw: Any) -> Case:
    if scenario == "mlp":
        kw.setdefault("preset", "full")
        kw.setdefault("overrides", "layers=2")
    else:
        kw.setdefault("preset", "t32")
        kw.setdefault("overrides", "layers=2")
    return Case(scenario, strategy, hardware, mesh, **kw)


_RAIL = "topology.fabric=rail_optimized"
# scalable units of 2 nodes whose spine uplinks are oversubscribed 4:1 (hwmodels/machine/superpod.py)
_SU = "topology.fabric=rail_optimized,topology.nodes_per_su=2,topology.spine_oversubscription=4"
_GC = "group-contention"
_NIC = "nic-sharing"

# The closed-form cases: one group alone, no faults, one stream (both models must agree to rounding).
_CLOSED_FORM = (
    # TPU v4 (3D torus; 8 and 64 chips without / with wraparound, 256 and 2048 chips)
    _c("mlp", "bp", "tpu-v4", "batch=8"),
    _c("mlp", "mp", "tpu-v4", "model=8"),
    _c("mlp", "bp+mp", "tpu-v4", "batch=2,model=4"),
    _c("mlp", "z3", "tpu-v4", "batch=8"),
    _c("mlp", "bp", "tpu-v4", "batch=64"),
    _c("mlp", "bp+mp", "tpu-v4", "batch=16,model=4"),
    _c("mlp", "z3", "tpu-v4", "batch=64"),
    _c("transformer", "bp", "tpu-v4", "batch=256"),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", placement="model=x,batch=yz"),
    _c("transformer", "bp+mp", "tpu-v4", "batch=128,model=16"),
    _c("transformer", "bp+mp+z3", "tpu-v4", "batch=128,model=16"),
    # H100 (NVSwitch nodes, InfiniBand fat tree; rail-optimized leaves)
    _c("mlp", "bp", "h100", "batch=8"),
    _c("mlp", "mp", "h100", "model=8"),
    _c("mlp", "bp+mp", "h100", "batch=2,model=4"),
    _c("mlp", "bp", "h100", "batch=64"),
    _c("mlp", "bp+mp", "h100", "batch=8,model=8"),
    _c("mlp", "z3", "h100", "batch=64"),
    _c("transformer", "bp", "h100", "batch=64"),
    _c("transformer", "bp+mp", "h100", "batch=8,model=8"),
    _c("transformer", "bp+mp+z3", "h100", "batch=8,model=8"),
    _c("transformer", "bp+mp", "h100", "batch=8,model=8", overlap=True),
    _c("transformer", "bp+mp", "h100", "batch=64,model=8"),
    _c("transformer", "bp+mp+z3", "h100", "batch=64,model=8"),
    _c("mlp", "bp+mp", "h100", "batch=16,model=4", hw_overrides=_RAIL),
    _c("mlp", "bp+mp", "h100", "batch=4,model=16", hw_overrides=_RAIL),
    # latency-bound: the small MLP's messages are a few KiB, so the per-hop latency is most of the time
    _c("mlp", "bp", "tpu-v4", "batch=8", preset="small", overrides=None),
    _c("mlp", "bp", "tpu-v4", "batch=64", preset="small", overrides=None),
    _c("mlp", "mp", "tpu-v4", "model=8", preset="small", overrides=None),
    _c("mlp", "bp", "h100", "batch=64", preset="small", overrides=None),
    _c("mlp", "z3", "h100", "batch=64", preset="small", overrides=None),
    # FP8: the projections' and MLPs' dots at the H100's FP8 rate, their E4M3 weights gathered (ZeRO-3)
    _c("transformer", "bp+mp+z3", "h100", "batch=8,model=8", overrides="layers=2,precision=fp8"),
    # mixture of experts (GShard's bp+ep): all_to_alls over the expert axis, on a v4 torus dim and
    # across 8 H100 nodes (one GPU of each: every pair's message crosses InfiniBand)
    _c("transformer", "bp+ep", "tpu-v4", "batch=8,expert=8", overrides="layers=2,experts=8"),
    _c("transformer", "bp+ep", "h100", "expert=8,batch=8", overrides="layers=2,experts=8"),
    # pipeline parallelism (GPipe, 4 stages, 8 micro-batches): a collective_permute between stages every
    # tick, on a v4 torus dim and across 4 H100 nodes; ring attention (cp): key/value blocks round a
    # ring of 8 v4 chips and of 4 H100 nodes
    _c("transformer", "bp+pp", "tpu-v4", "batch=16,stage=4", overrides="layers=4,pipeline=4,microbatches=8"),
    _c("transformer", "bp+pp", "h100", "batch=8,stage=4", overrides="layers=4,pipeline=4,microbatches=8"),
    _c("transformer", "cp", "tpu-v4", "context=8", overrides="layers=2,attention=ring,ring_blocks=8"),
    _c("transformer", "bp+cp", "h100", "batch=8,context=4", overrides="layers=2,attention=ring,ring_blocks=4"),
)

# Beyond the closed form: what the DES models that one group priced alone does not show.
_MECHANISMS = (
    # groups of one collective sharing links: strided groups, two mesh axes on one torus dim
    _c("mlp", "bp+mp", "tpu-v4", "batch=8,model=8", mechanism=_GC),          # batch strided over y
    _c("mlp", "bp+mp", "tpu-v4", "batch=2,model=32", mechanism=_GC),         # batch strided over x
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", mechanism=_GC),  # batch and model on z
    _c("transformer", "bp+mp+z3", "tpu-v4", "batch=64,model=4", mechanism=_GC),
    _c("transformer", "bp+mp", "tpu-v4", "batch=16,model=16", mechanism=_GC),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", overlap=True, mechanism=_GC),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", slice_dims="4x4x16", mechanism=_GC),
    _c("transformer", "bp+mp", "tpu-v4", "batch=128,model=2", mechanism=_GC),
    # H100 scalable units: every group of an axis across units shares its unit's oversubscribed uplink
    _c("mlp", "bp", "h100", "su=2,batch=16", hw_overrides=_SU, mechanism=_GC),
    _c("transformer", "bp+mp+z3", "h100", "batch=8,model=8", hw_overrides=_SU, mechanism=_GC),
    # several communication streams: collectives on disjoint and on shared dims at once
    _c("mlp", "bp+mp", "tpu-v4", "batch=2,model=4", overlap=True, comm_streams=2),
    _c("mlp", "bp+mp", "tpu-v4", "batch=16,model=4", overlap=True, comm_streams=2),                 # disjoint
    _c("mlp", "bp+mp+z3", "tpu-v4", "batch=16,model=4", overlap=True, comm_streams=2),
    _c("mlp", "bp+mp", "tpu-v4", "batch=16,model=4", overlap=True, comm_streams=4),
    _c("mlp", "bp+mp", "tpu-v4", "batch=8,model=8", overlap=True, comm_streams=2),                  # shared y
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", placement="model=x,batch=yz", overlap=True,
       comm_streams=2),                                                                               # disjoint
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", overlap=True, comm_streams=2),         # shared z
    _c("transformer", "bp+mp+z3", "tpu-v4", "batch=64,model=4", overlap=True, comm_streams=2),
    _c("mlp", "bp+mp", "h100", "batch=8,model=8", overlap=True, comm_streams=2),     # NVLink and IB at once
    # stragglers: one chip computes 1.5x / 2x slower
    _c("mlp", "bp", "tpu-v4", "batch=8", stragglers=((3, 1.5),)),
    _c("mlp", "z3", "tpu-v4", "batch=8", stragglers=((3, 1.5),)),
    _c("mlp", "bp+mp", "tpu-v4", "batch=2,model=4", stragglers=((0, 2.0),)),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", stragglers=((17, 2.0),)),
    _c("mlp", "mp", "h100", "model=8", stragglers=((0, 1.5),)),
    _c("transformer", "bp", "h100", "batch=64", stragglers=((5, 2.0),)),
    _c("transformer", "bp+mp", "h100", "batch=8,model=8", overlap=True, stragglers=((0, 1.5),)),
    # degraded links: a torus ring link, an NVLink port, a NIC at 1/4 or 1/2 bandwidth
    _c("mlp", "bp", "tpu-v4", "batch=8", degraded_links=(("0->1", 0.25),)),
    _c("mlp", "mp", "tpu-v4", "model=8", degraded_links=(("0-1", 0.5),)),
    _c("mlp", "bp", "tpu-v4", "batch=64", degraded_links=(("0->1", 0.25),)),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", degraded_links=(("0-1", 0.5),)),
    _c("mlp", "mp", "h100", "model=8", degraded_links=(("0-nvswitch0", 0.5),)),
    _c("mlp", "bp", "h100", "batch=64", degraded_links=(("0->leaf0", 0.5),)),
    _c("mlp", "bp", "h100", "batch=64", degraded_links=(("0-leaf0", 0.25),)),
    # failed links: routes detour (the other way round a ring, a sidestep, another GPU's NIC)
    _c("mlp", "bp", "tpu-v4", "batch=8", failed_links=("0-1",)),
    _c("mlp", "bp", "tpu-v4", "batch=64", failed_links=("0-1",)),
    _c("mlp", "bp+mp", "tpu-v4", "batch=16,model=4", failed_links=("0-1",)),
    _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", failed_links=("0-1",)),
    _c("mlp", "bp", "h100", "batch=64", failed_links=("0-leaf0",)),
    # H100: several GPUs' cross-node traffic on one NIC or leaf uplink (fat tree vs rail-optimized)
    _c("mlp", "bp+mp", "h100", "batch=8,model=8", degraded_links=(("leaf0->spine", 0.125),), mechanism=_NIC),
    _c("mlp", "bp", "h100", "batch=64", degraded_links=(("leaf0->spine", 0.125),), mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=8,model=8", failed_links=("0-leaf0",), mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=8,model=8", failed_links=("0-leaf0.0",), hw_overrides=_RAIL, mechanism=_NIC),
    _c("mlp", "bp", "h100", "batch=64", failed_links=("0-leaf0.0",), hw_overrides=_RAIL, mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=4,model=16", overlap=True, comm_streams=2, mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=4,model=16", overlap=True, comm_streams=2, hw_overrides=_RAIL,
       mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=16,model=4", overlap=True, comm_streams=2, mechanism=_NIC),
    # H100 double binary tree across nodes (batch over 8 / 16 nodes, one GPU each; small all-reduces):
    # a parent's NIC serves two children and some edges cross the spine, so members run ahead of one
    # another (their asynchronous critical path; in lock step these all-reduces would be priced 20-37 %
    # above the DES, benchmarks/tree_gpu.py)
    _c("mlp", "bp+mp", "h100", "batch=8,model=8", preset="small", overrides=None, mechanism=_NIC),
    _c("mlp", "bp+mp", "h100", "batch=16,model=8", preset="small", overrides=None, mechanism=_NIC),
    # TPU slices over DCN: the chips of a host share its NIC; ICI inside each slice at the same time
    _c("transformer", "bp+z3@batch", "tpu-v5e", "dcn=2,batch=16", slice_dims="2x4x4",
       overrides="layers=2,batch=64", mechanism=_NIC),
    _c("mlp", "bp", "tpu-v5e", "dcn=4,batch=16", slice_dims="4x4x4", mechanism=_NIC),
    # with overlap: the DCN all-reduces block the compute stream ([dcn] overlaps_compute = false)
    _c("transformer", "bp+z3@batch", "tpu-v5e", "dcn=2,batch=16", slice_dims="2x4x4",
       overrides="layers=2,batch=64", overlap=True, mechanism=_NIC),
)

SUITES: dict[str, tuple[Case, ...]] = {"default": _CLOSED_FORM + _MECHANISMS}
SUITES["closed-form"] = _CLOSED_FORM
SUITES["quick"] = tuple(c for c in SUITES["default"] if c.devices <= 8 and c.scenario == "mlp")


def get_suite(name: str) -> tuple[Case, ...]:
    if name not in SUITES:
        raise ValidationError(f"unknown validation suite {name!r}; suites: {', '.join(sorted(SUITES))}")
    return SUITES[name]


# -- lowering (the only step that needs the compiler; Experiment.lower imports it) -----------------
def case_program(case: Case, programs: ProgramCache) -> SpmdProgram:
    """The lowered program of ``case``, from (or into) ``programs`` (:mod:`partir_emu.app.programs`)."""
    return programs.spmd(Experiment(case.scenario, case.strategy, Mesh.parse(case.mesh), case.preset, case.overrides))


def run_case(case: Case, programs: ProgramCache, analyzer: Analyzer | None = None, **des_kw: Any) -> CaseResult:
    """Lower (or reuse) the program of ``case`` and compare the two models on it."""
    return compare(case, case_program(case, programs), analyzer, **des_kw)


def run_suite(cases: Sequence[Case] | str = "default", *, cache_dir: str | os.PathLike | None = None,
              programs: ProgramCache | None = None, on_case: Callable[[int, int, CaseResult], None] | None = None,
              **des_kw: Any) -> ValidationReport:
    """Run every case; ``on_case(i, n, result)`` after each (for progress). ``programs``: lowered programs
    to reuse (e.g. between runs of one process); else a :class:`ProgramCache` over ``cache_dir``.
    A fresh :class:`Analyzer` prices the suite, so nothing priced before the call is reused."""
    name = cases if isinstance(cases, str) else "custom"
    cases = get_suite(cases) if isinstance(cases, str) else tuple(cases)
    programs = programs if programs is not None else ProgramCache(cache_dir)
    lower0 = programs.lower_s
    analyzer = Analyzer()           # the suite's: specs, placements, prices and analyses shared by its cases
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        r = run_case(case, programs, analyzer, **des_kw)
        results.append(r)
        if on_case is not None:
            on_case(i, len(cases), r)
    return ValidationReport(name, tuple(results), time.perf_counter() - t0, programs.lower_s - lower0)


_FORMAT = ("write one JSON object per line with scenario, strategy, hardware, mesh (strings) and optional "
           "preset, overrides, placement, hw_overrides, slice_dims, mechanism (strings), overlap (true/false), "
           "comm_streams (int >= 1), stragglers ({\"3\": 1.5}), degraded_links ({\"0->1\": 0.25}) and "
           "failed_links ([\"0-1\"])")
_STR_FIELDS = ("scenario", "strategy", "hardware", "mesh")
_OPT_STR_FIELDS = ("preset", "overrides", "placement", "hw_overrides", "slice_dims", "mechanism")
_OTHER_FIELDS = ("overlap", "comm_streams", "stragglers", "degraded_links", "failed_links")


def read_cases(path: str | os.PathLike) -> list[Case]:
    """The cases of a JSON-lines file, each checked (:func:`parse_cases`); errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_cases(f, str(path))
    except UnicodeDecodeError as exc:
        raise ValidationError(f"--cases {path}: not a text file (byte {exc.start} is not UTF-8); {_FORMAT}") from None
    except OSError as exc:
        raise ValidationError(f"--cases {path}: {exc.strerror}") from None


def parse_cases(lines: Iterable[str], where: str = "cases") -> list[Case]:
    """Cases from JSON lines (``{"scenario": ..., "strategy": ..., "hardware": ..., "mesh": ..., ...}``),
    each checked before any is run (scenario, size, strategy, mesh and hardware exist and fit)."""
    out = []
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        at = f"{where}: case line {i + 1}"
        d = loads(line, at, ValidationError, "validation case")
        out.append(check_case(_case(d, at), at))
    if not out:
        raise ValidationError(f"{where}: no cases; {_FORMAT}")
    return out


def _case(d: Any, at: str) -> Case:
    if not isinstance(d, dict):
        raise ValidationError(f"{at}: a {type(d).__name__}, not a JSON object; {_FORMAT}")
    unknown = sorted(set(d) - set(_STR_FIELDS) - set(_OPT_STR_FIELDS) - set(_OTHER_FIELDS))
    missing = [k for k in _STR_FIELDS if k not in d]
    if unknown or missing:
        raise ValidationError(f"{at}: " + (f"unknown field {unknown[0]!r}" if unknown else f"no {missing[0]!r}")
                              + f"; {_FORMAT}")
    bad = [k for k in _STR_FIELDS if not isinstance(d[k], str)]
    bad += [k for k in _OPT_STR_FIELDS if d.get(k) is not None and not isinstance(d[k], str)]
    if "overlap" in d and not isinstance(d["overlap"], bool):
        bad.append("overlap")
    if "comm_streams" in d and not (isinstance(d["comm_streams"], int) and not isinstance(d["comm_streams"], bool)
                                    and d["comm_streams"] >= 1):
        bad.append("comm_streams")
    if bad:
        raise ValidationError(f"{at}: field {bad[0]!r} is {d[bad[0]]!r}; {_FORMAT}")
    kw = {k: v for k, v in d.items() if k not in ("stragglers", "degraded_links", "failed_links")}
    kw["stragglers"] = tuple((_int_key(k, at), f) for k, f in _factors(d, "stragglers", at))
    kw["degraded_links"] = tuple(_factors(d, "degraded_links", at))
    failed = d.get("failed_links", [])
    if not (isinstance(failed, list) and all(isinstance(x, str) for x in failed)):
        raise ValidationError(f"{at}: field 'failed_links' is {failed!r}; {_FORMAT}")
    kw["failed_links"] = tuple(failed)
    return Case(**kw)


def _factors(d: dict, name: str, at: str) -> list[tuple[str, float]]:
    """``{"key": factor}`` (or ``[[key, factor], ...]``) as (key, factor) pairs, factors positive numbers."""
    v = d.get(name, {})
    pairs = list(v.items()) if isinstance(v, dict) else v
    ok = isinstance(pairs, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], (int, float))
        and not isinstance(p[1], bool) and p[1] > 0 for p in pairs)
    if not ok:
        raise ValidationError(f"{at}: field {name!r} is {v!r}; {_FORMAT}")
    return [(str(k), float(f)) for k, f in pairs]


def _int_key(k: str, at: str) -> int:
    if not k.isdigit():
        raise ValidationError(f"{at}: straggler {k!r} is not a device number; {_FORMAT}")
    return int(k)


def check_case(case: Case, at: str) -> Case:
    """``case`` if everything it names exists and fits (without lowering); else ValidationError naming ``at``."""
    try:
        mesh = Mesh.parse(case.mesh)
        spec = load_spec(case.hardware)
        most = chips_limit(spec, case.slice_tuple())
        if mesh.size > most:
            raise ValidationError(f"mesh {case.mesh} has {mesh.size} devices but {spec.name} has at most "
                                  f"{most} chips")
        exp = Experiment(case.scenario, case.strategy, mesh, case.preset, case.overrides)
        exp.scenario.strategy(case.strategy, mesh, exp.cfg)
        _check_conditions(case, mesh)
    except PartirError as exc:
        raise ValidationError(f"{at}: {exc}") from None
    return case


def _check_conditions(case: Case, mesh: Mesh) -> None:
    """The hardware variant, slice, stragglers and links of ``case`` exist on its placement."""
    spec = load_spec(case.hardware, case.spec_overrides() or None)
    topology = place(mesh, spec, case.placement, case.slice_tuple()).topology
    bad = [dev for dev, _ in case.stragglers if dev >= mesh.size]
    if bad:
        raise ValidationError(f"straggler device {bad[0]} is not in {case.mesh} (devices 0..{mesh.size - 1})")
    Router(topology, link_factors(topology, case.degraded_links, case.failed_links))


__all__ = ["MAX_MAX", "MEDIAN_MAX", "SUITES", "Case", "CaseResult", "ValidationError",
           "ValidationReport", "check_case", "get_suite", "parse_cases", "read_cases", "run_case", "run_suite"]

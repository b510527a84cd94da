"""Pricing a study's configurations: each distinct program lowered once (configurations that differ
only in hardware, what-if or placement share it), each spec loaded once, one
:class:`~partir_emu.hwmodels.analytical.Analyzer` for the whole study (its caches of per-equation
costs, topologies and placements are what make the configurations after the first cheap), the
placement searched per configuration as ``partir-emu simulate`` searches it.

A configuration that cannot be lowered (a mesh the model cannot take), placed (more chips than the
pod) or that does not fit in HBM is a row with its reason: reported, never dropped.

:func:`sensitivity` answers "which spec field moves this step most": each of the chip's
:data:`SENSITIVITY_FIELDS` scaled by 2 on its own, the step's relative change. :func:`des_check`
replays a configuration in the discrete-event model on the same placement.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from partir_emu.app import checks
from partir_emu.app.cli.simulate import choose_placement, model_flops_per_device
from partir_emu.app.experiment import Experiment
from partir_emu.app.study.space import Config
from partir_emu.app.study.whatif import Edit, WhatIf, apply
from partir_emu.errors import PartirError
from partir_emu.hwmodels.analytical import Analyzer, simulate
from partir_emu.hwmodels.compute.stack import StackSpec, load_stack
from partir_emu.hwmodels.des.model import simulate_des
from partir_emu.hwmodels.machine.slices import chips_limit

GIB = 2 ** 30
FIGURES = ("step_s", "compute_s", "exposed_comm_s", "mfu", "hfu", "peak_gib", "needed_gib", "hbm_gib", "fits",
           "chip_s", "placement")
SENSITIVITY_FIELDS = {"tpu": ("flops", "hbm_bw", "ici_bw", "ici_latency", "dcn_bw"),
                      "gpu": ("flops", "hbm_bw", "nvlink_bw", "nic_bw", "ib_latency")}


@dataclass
class Row:
    """One configuration's outcome: ``status`` is ``ok``, ``does not fit``, ``does not lower`` or
    ``does not place``; the figures are there for every row that was priced."""

    config: Config
    status: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    sim: Any = field(default=None, repr=False)
    placement: Any = field(default=None, repr=False)    # the Placement priced (sim.placement is its label)
    sensitivity: dict[str, float] = field(default_factory=dict)
    des_step_s: float | None = None

    @property
    def priced(self) -> bool:
        return "step_s" in self.figures

    @staticmethod
    def from_json(d: dict) -> Row:
        """A row a worker sent (:meth:`to_json`); its ``sim`` and ``placement`` objects stay there."""
        cfg = Config.from_json(d)
        figures = {k: d[k] for k in FIGURES if k in d}
        return Row(cfg, d["status"], d["reason"], figures, sensitivity=dict(d.get("sensitivity", {})),
                   des_step_s=d.get("des_step_s"))

    def to_json(self) -> dict:
        out = {**self.config.to_json(), "status": self.status, "reason": self.reason, **self.figures}
        if self.sensitivity:
            out["sensitivity"] = dict(self.sensitivity)
        if self.des_step_s is not None:
            out["des_step_s"] = self.des_step_s
        return out


class Study:
    """The shared state of one study (module docstring)."""

    def __init__(self, stack: str | StackSpec = "xla", placement: str | None = None, overlap: bool = True) -> None:
        self.stack = load_stack(stack)
        self.placement = placement
        self.overlap = overlap
        # a study walks programs in grid order, each priced on every spec before the next: 32 programs kept
        # lets a second pass (sensitivity, --des-top, a re-run) find their analyses
        self.analyzer = Analyzer(max_programs=32)
        self._lowered: dict[tuple, Any] = {}
        self._specs: dict[tuple[str, WhatIf], Any] = {}
        # (program, spec up to its HBM capacity) -> (placement, report): a what-if of the capacity alone
        # (``hbm_gb=64``) changes what fits, never a time, so its configurations reuse the search and report
        self._twins: dict[tuple, tuple[Any, Any]] = {}
        self.lower_s = 0.0
        self.price_s = 0.0          # everything after lowering, ...
        self.analyse_s = 0.0        # ... of which the work a program's configurations share (:meth:`analyse`)

    def cold_copy(self) -> Study:
        """A study over the same lowered programs with nothing priced yet (a new Analyzer): what pricing
        them again costs (``benchmarks/study_speed.py`` repeats its measurement with it)."""
        out = Study(self.stack, self.placement, self.overlap)
        out._lowered = self._lowered
        return out

    def spec(self, hardware: str, what_if: WhatIf) -> Any:
        key = (hardware, what_if)
        if key not in self._specs:
            self._specs[key] = apply(hardware, what_if).with_stack(self.stack)
        return self._specs[key]

    def lowered(self, cfg: Config) -> Any:
        """(experiment, SPMD program, model FLOPs per device), or the PartirError lowering raised."""
        key = cfg.lowering_key
        if key not in self._lowered:
            t0 = time.perf_counter()
            try:
                exp = Experiment(cfg.scenario, cfg.strategy, cfg.mesh, cfg.size, cfg.overrides, strict=False)
                self._lowered[key] = (exp, exp.lower().spmd, model_flops_per_device(exp))
            except PartirError as exc:
                self._lowered[key] = exc
            # the lowered programs (tens of thousands of objects each) live as long as the study: out of
            # the cyclic collector's way, whose full passes would walk them again and again while pricing
            # (the lowering's own garbage collected first, so none of it is kept)
            gc.collect()
            gc.freeze()
            self.lower_s += time.perf_counter() - t0
        return self._lowered[key]

    def price(self, cfg: Config, spec: Any = None) -> Row:
        spec = spec if spec is not None else self.spec(cfg.hardware, cfg.what_if)
        try:
            checks.check_fits_hardware(cfg.mesh, chips_limit(spec, None), spec.name)
        except PartirError as exc:
            return Row(cfg, "does not place", str(exc))
        low = self.lowered(cfg)
        if isinstance(low, PartirError):
            return Row(cfg, "does not lower", str(low))
        _, spmd, model_flops = low
        t0 = time.perf_counter()
        twin_key = (cfg.lowering_key, timing_twin(spec))
        try:
            twin = self._twins.get(twin_key)
            if twin is not None:         # priced on a spec that times every kernel and transfer alike
                placement, sim = twin
                sim = _renamed(sim, spec)
            else:
                with _settled():
                    self.analyse(spmd, spec)
                    # prune: the study keeps the best placement only (the same one, not every candidate's step)
                    placement = choose_placement(spmd, spec, self.placement, self.analyzer, overlap=self.overlap,
                                                 prune=True).placement
                    sim = simulate(spmd, spec, placement, overlap=self.overlap, analyzer=self.analyzer,
                                   model_flops=model_flops)
                self._twins[twin_key] = (placement, sim)
        except PartirError as exc:
            return Row(cfg, "does not place", str(exc))
        finally:
            self.price_s += time.perf_counter() - t0
        figures = {"step_s": sim.step_s, "compute_s": sim.compute_s, "exposed_comm_s": sim.exposed_comm_s,
                   "mfu": sim.mfu, "hfu": sim.hfu, "peak_gib": sim.peak_bytes_per_device / GIB,
                   "needed_gib": float(sim.needed_bytes) / GIB, "hbm_gib": sim.hbm_bytes / GIB,
                   "fits": bool(sim.fits), "chip_s": cfg.mesh.size * sim.step_s, "placement": sim.placement}
        status, reason = "ok", ""
        if not sim.fits:
            status = "does not fit"
            reason = f"needs {figures['needed_gib']:.1f} of {figures['hbm_gib']:.1f} GiB per device"
        return Row(cfg, status, reason, figures, sim, placement)

    def analyse(self, spmd: Any, spec: Any) -> None:
        """What every configuration of ``spmd``'s program shares, done on its first (and kept by the
        Analyzer): the program's analysis, its overlap plan and memory profile under the study's stack,
        and the fusion plan of ``spec``'s compiler; the time taken adds to ``analyse_s``."""
        t0 = time.perf_counter()
        entry = self.analyzer.entry(spmd.program)
        entry.overlap_plan()
        entry.costs.memory_for(entry.program, spec.stack.saved_activations)
        entry.costs.fusion.plan(spec.kernels)
        self.analyse_s += time.perf_counter() - t0

    def run(self, configs: Sequence[Config], on_row: Callable[[int, Row], None] | None = None) -> list[Row]:
        rows = []
        for i, cfg in enumerate(configs):
            rows.append(self.price(cfg))
            if on_row is not None:
                on_row(i, rows[-1])
        return rows


@contextlib.contextmanager
def _settled() -> Iterator[None]:
    """One configuration's pricing out of the cyclic collector's way: what it keeps (the program's analysis
    and fusion plans, the placement search's prices, patterns and routes: hundreds of thousands of
    objects the study holds to its end, or until the Analyzer lets them go, then freed by their
    reference counts) would be walked again and again by the collector's full passes (a fifth of a t48
    pricing pass). The collector waits until the configuration is priced, collects its garbage (so none
    of it is kept), then sets what is left aside (``gc.freeze``), as :meth:`Study.lowered` does."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()
            gc.freeze()


def _renamed(sim: Any, spec: Any) -> Any:
    """A twin's report (:func:`timing_twin`) for ``spec``: its name where the topology and placement
    name the chip, its HBM capacity and what fits in it."""
    topology = spec.name + sim.topology[len(sim.spec):] if sim.topology.startswith(sim.spec + " ") else sim.topology
    return dataclasses.replace(sim, spec=spec.name, topology=topology,
                               placement=sim.placement.replace(f" on {sim.topology}", f" on {topology}"),
                               hbm_bytes=spec.hbm_bytes, fits=sim.peak_bytes_per_device <= spec.fits_bytes)


def timing_twin(spec: Any) -> Any:
    """``spec`` without what only decides what fits (its name and HBM capacity): two specs equal here
    price every kernel and transfer alike (the analytical model reads ``hbm_bytes`` only for ``fits``)."""
    return dataclasses.replace(spec, name="", hbm_bytes=0, path="", description="", kernels_measured_as=spec.kernel_chip)


def sensitivity(study: Study, row: Row, factor: float = 2.0) -> dict[str, float]:
    """``{alias: (step with that field x factor) / step - 1}`` for the chip's fields."""
    base = row.figures["step_s"]
    spec = study.spec(row.config.hardware, row.config.what_if)
    out: dict[str, float] = {}
    for alias in SENSITIVITY_FIELDS[spec.kind]:
        wi = WhatIf((*row.config.what_if.edits, Edit(alias, "*", factor)))
        try:
            moved = study.price(row.config, study.spec(row.config.hardware, wi))
        except PartirError:              # the chip has no such table (a TPU spec without [dcn])
            continue
        if moved.priced:
            out[alias] = moved.figures["step_s"] / base - 1.0
    return out


def des_check(study: Study, row: Row) -> float:
    """The configuration's step in the discrete-event model, on the placement the analytical model chose."""
    low = study.lowered(row.config)
    if isinstance(low, PartirError):
        raise low
    spec = study.spec(row.config.hardware, row.config.what_if)
    if row.placement is None:                    # a row a worker priced: its Placement stayed there
        row.placement = study.price(row.config).placement
    _, spmd, _ = low
    return float(simulate_des(spmd, spec, row.placement, study.overlap, analyzer=study.analyzer).step_s)


def ranked(rows: Sequence[Row], key: str = "step_s") -> list[Row]:
    """Best first: rows that fit by ``key`` (step or chip-seconds), then those that do not fit, then
    the rest (not lowered, not placed) in grid order."""
    ok = sorted((r for r in rows if r.status == "ok"), key=lambda r: r.figures[key])
    misfit = sorted((r for r in rows if r.status == "does not fit"), key=lambda r: r.figures[key])
    return ok + misfit + [r for r in rows if not r.priced]


__all__ = ["SENSITIVITY_FIELDS", "Row", "Study", "des_check", "ranked", "sensitivity", "timing_twin"]

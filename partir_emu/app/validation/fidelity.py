"""``partir-emu fidelity``: predicted step times against published measurements.

For each case of the data file (:mod:`partir_emu.app.validation.fidelity_data`) it builds the transformer
config from the case's ``--set`` keys, traces it abstractly (no arrays), partitions it with the
case's strategy on the case's mesh, and simulates one step on the case's hardware spec with
overlap on. The predicted step time goes back into the source's metric with the source's own FLOP
convention, so ``error_pct = 100·(predicted − measured) / measured`` compares like with like
(for TFLOP/s per chip a too-slow prediction is a negative error). The conventions (``F`` = FLOPs
of a step over all chips; step_s = F / (TFLOP/s per chip · 1e12 · chips)):

- ``megatron_eq3``: ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` (arXiv 2104.04473 eq. 3);
- ``maxtext_6n``: ``F = 6·N·B·s`` (MaxText, 2023-04);
- ``maxtext_6n_attn``: ``F = 6·N·B·s + 12·H·l·dh·s²·B`` (MaxText, from 2023-06);
- ``iteration_time``: the source gives seconds per step (arXiv 2205.05198 Table 5).

The cases share one :class:`~partir_emu.hwmodels.analytical.Analyzer` (spec files, placements,
collective prices) and a :class:`ProgramCache` of lowered programs, so a caller that runs the same
cases twice (the tests) lowers each once.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from partir_emu.app import checks
from partir_emu.app.cli.simulate import model_flops_per_device
from partir_emu.app.experiment import Experiment
from partir_emu.app.plotting import new_figure
from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.fidelity_data import CONVENTIONS, FidelityDataError, PublishedRun
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError
from partir_emu.hwmodels.analytical import Analyzer, SimReport, simulate
from partir_emu.hwmodels.compute.stack import StackSpec, load_stack
from partir_emu.hwmodels.machine.slices import chips_limit
from partir_emu.hwmodels.machine.specs import HardwareSpec, load_spec

# the targets of issue 10 over the required cases (tests/integration/test_fidelity.py pins them)
MEDIAN_TARGET_PCT = 5.0
MAX_TARGET_PCT = 12.0


@dataclass(frozen=True)
class FidelityResult:
    """One case, predicted."""

    case: PublishedRun
    params: int
    flops_per_step: float | None        # by the source's convention (None: it reports the step time)
    measured_step_s: float
    predicted_step_s: float
    predicted: float                    # in the case's metric
    sim: SimReport                      # its mfu (model FLOPs) and hfu (matmul FLOPs executed) are predictions
    model_flops_per_device: float
    measured_mfu: float                 # the same model FLOPs over the measured step (comparable to sim.mfu)
    peak_flops: float = 0.0             # the chip's bf16 peak FLOP/s (the spec's)

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.case.measured) / self.case.measured

    def to_json(self) -> dict[str, Any]:
        c = self.case
        sim = self.sim
        return {
            "case": c.case, "group": c.group, "source": c.source, "hardware": c.hardware, "stack": c.stack,
            "chips": c.chips,
            "strategy": c.strategy, "mesh": dict(c.mesh), "set": dict(c.set), "params": self.params,
            "metric": c.metric, "convention": c.convention, "convention_formula": CONVENTIONS[c.convention].formula,
            "flops_per_step": self.flops_per_step, "measured": c.measured, "predicted": self.predicted,
            "error_pct": self.error_pct, "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s, "mfu": sim.mfu, "hfu": sim.hfu,
            "model_flops_per_device": self.model_flops_per_device, "measured_mfu": self.measured_mfu,
            "published_mfu": c.published_mfu, "published_hfu": c.published_hfu,
            "compute_s": sim.compute_s, "comm_s": sim.comm_s, "exposed_comm_s": sim.exposed_comm_s,
            "peak_bytes_per_device": sim.peak_bytes_per_device, "fits": sim.fits,
            "by_op_kind": sim.by_op_kind, "by_collective": sim.by_collective, "by_axes": sim.by_axes,
        }


def explain(r: FidelityResult) -> str:
    """Why the prediction of ``r`` is what it is: predicted against measured, the time by op kind
    with the rate each kind achieved, communication by mesh axes and how much of it is exposed,
    memory by category, and what the model leaves out (``fidelity --case NAME --explain``)."""
    c, sim = r.case, r.sim
    gap_s = r.measured_step_s - r.predicted_step_s
    lines = [f"== {c.case}: {c.hardware} x {c.chips} running {c.stack}, {c.strategy} on {dict(c.mesh)}, "
             f"global batch {c.global_batch}",
             f"source: {c.source}",
             f"measured {c.measured:.4g} {c.metric} -> step {r.measured_step_s:.4f} s by {c.convention} "
             f"({CONVENTIONS[c.convention].formula})",
             f"predicted {r.predicted:.4g} {c.metric}, step {r.predicted_step_s:.4f} s: error {r.error_pct:+.1f}% "
             f"(the measured step is {abs(gap_s):.4f} s {'longer' if gap_s > 0 else 'shorter'}: "
             f"{100 * abs(gap_s) / r.predicted_step_s:.1f}% of the prediction)",
             f"MFU predicted {_pct(sim.mfu)}, from the measured step {_pct(r.measured_mfu)}, published "
             f"{_pct(c.published_mfu)};  HFU predicted {_pct(sim.hfu)}, published {_pct(c.published_hfu)}", "",
             f"{'op kind':<14}{'time s':>10}{'of compute':>12}{'TFLOP/s':>10}{'of peak':>9}{'GB/s':>10}   "
             f"(of peak: of the bf16 matmul peak)"]
    for kind, row in sorted(sim.by_op_kind.items(), key=lambda kv: -kv[1]["time_s"]):
        t = row["time_s"]
        rate = row["flops"] / t if t > 0 else 0.0
        share = f"{100 * t / sim.compute_s:.1f}%" if kind != "collective" and sim.compute_s > 0 else "-"
        lines.append(f"{kind:<14}{t:>10.4f}{share:>12}{rate / 1e12:>10.1f}"
                     f"{(f'{100 * rate / r.peak_flops:.1f}%' if kind == 'matmul' and r.peak_flops else '-'):>9}"
                     f"{(row['bytes'] / t / 1e9 if t > 0 else 0.0):>10.0f}")
    lines += ["", f"communication {sim.comm_s:.4f} s in all, exposed {sim.exposed_comm_s:.4f} s "
                  f"({100 * sim.exposed_comm_s / sim.step_s if sim.step_s else 0.0:.1f}% of the step)"]
    for axes, row in sorted(sim.by_axes.items(), key=lambda kv: -kv[1]["time_s"]):
        lines.append(f"  over ({axes}): {int(row['count'])} collectives, {row['bytes'] / 1e9:.3f} GB, "
                     f"{row['time_s']:.4f} s")
    gib = 2 ** 30
    lines += ["", f"memory: peak {sim.peak_bytes_per_device / gib:.2f} GiB (needs {sim.needed_bytes / gib:.2f} GiB with "
                  f"the {c.stack} stack's allocator and reserved memory) of {sim.hbm_bytes / gib:.2f} GiB "
                  f"-> {'fits' if sim.fits else 'DOES NOT FIT (the run did run)'}",
              "  " + "  ".join(f"{k} {v / gib:.2f}" for k, v in sim.memory.items() if v),
              "", _stack_line(c.stack, c.hardware), *_dcn_lines(c, sim),
              "not in the model yet: per-op CPU dispatch, NCCL kernels slowing the compute they overlap, FSDP's "
              "copy-in/copy-out (a stack's fitted compute_fraction stands in for what they cost; issue 23)"]
    return "\n".join(lines)


def experiment(case: PublishedRun) -> Experiment:
    """The case as an Experiment (cheap: nothing traced yet; its config and strategy are checked)."""
    exp = Experiment(case.scenario, case.strategy, Mesh.parse(case.mesh_text), None, case.overrides)
    exp.scenario.strategy(case.strategy, exp.mesh, exp.cfg)
    return exp


def run_case(case: PublishedRun, programs: ProgramCache, analyzer: Analyzer, *,
             spec: HardwareSpec | None = None, stack: StackSpec | None = None) -> FidelityResult:
    """Lower (or reuse) the case's program, simulate it with overlap on, convert to the case's metric.
    ``spec`` and ``stack`` replace the case's hardware file and stack profile (calibration tries
    variants of them). Any PartirError (a --set key the scenario lacks, a mesh that does not fit)
    names the case."""
    try:
        exp = experiment(case)
        spmd = programs.spmd(exp)
        spec = (spec if spec is not None else analyzer.spec(case.hardware)).with_stack(
            stack if stack is not None else load_stack(case.stack))
        checks.check_fits_hardware(exp.mesh, chips_limit(spec, case.slice_dims), spec.name)
        model_flops = model_flops_per_device(exp)
        sim = simulate(spmd, spec, case.placement, overlap=True, model_flops=model_flops, analyzer=analyzer,
                       slice_dims=case.slice_dims)
    except PartirError as exc:
        raise FidelityDataError(f"{case.where or case.case}: {exc}") from None
    params = int(exp.scenario.param_count(exp.cfg))
    flops = case.flops_per_step(exp.cfg, params)
    measured_s = case.measured_step_s(flops)
    return FidelityResult(case, params, flops, measured_s, sim.step_s, case.to_metric(sim.step_s, flops), sim,
                          model_flops, model_flops / (measured_s * spec.flops_bf16_per_s), spec.flops_bf16_per_s)


@dataclass(frozen=True)
class FidelityReport:
    results: tuple[FidelityResult, ...]
    failures: tuple[tuple[PublishedRun, str], ...]      # cases that could not be run, with the reason
    wall_s: float
    lower_s: float

    def abs_errors(self, group: str | None = "required") -> list[float]:
        return [abs(r.error_pct) for r in self.results if group is None or r.case.group == group]

    def summary(self, group: str | None = "required") -> dict[str, Any]:
        errs = self.abs_errors(group)
        return {"n": len(errs), "median_abs_error_pct": statistics.median(errs) if errs else None,
                "max_abs_error_pct": max(errs) if errs else None}

    def misfits(self) -> list[FidelityResult]:
        """The runs the model says do not fit in HBM: every case is a run that ran, so each is a miss."""
        return [r for r in self.results if not r.sim.fits]

    def memory_line(self) -> str:
        miss = self.misfits()
        line = f"memory: {len(self.results) - len(miss)} of {len(self.results)} runs that ran are predicted to fit"
        return line + "".join(f"; {r.case.case} needs {r.sim.needed_bytes / 2**30:.1f} of "
                              f"{r.sim.hbm_bytes / 2**30:.1f} GiB" for r in miss)

    def to_json(self) -> dict[str, Any]:
        req = self.summary("required")
        groups = sorted({r.case.group for r in self.results})
        return {
            "cases": [r.to_json() for r in self.results],
            "failed": [{"case": c.case, "group": c.group, "error": why} for c, why in self.failures],
            "median_abs_error_pct": req["median_abs_error_pct"], "max_abs_error_pct": req["max_abs_error_pct"],
            "targets": {"median_abs_error_pct": MEDIAN_TARGET_PCT, "max_abs_error_pct": MAX_TARGET_PCT},
            "by_group": {g: self.summary(g) for g in groups}, "all": self.summary(None),
            "memory": {"n": len(self.results), "not_fitting": [r.case.case for r in self.misfits()]},
            "overlap": True, "wall_s": self.wall_s, "lower_s": self.lower_s,
        }

    def table(self) -> str:
        w = max([17, *(len(r.case.case) + 1 for r in self.results), *(len(c.case) + 1 for c, _ in self.failures)])
        ws = max([13, *(len(r.case.stack) + 1 for r in self.results)])
        head = (f"{'case':<{w}}{'hardware':<9}{'stack':<{ws}}{'chips':>6}  {'metric':<16}{'measured':>9}{'predicted':>10}"
                f"{'error':>9}{'step meas':>11}{'step pred':>11}{'MFU pred':>10}{'MFU pub':>9}{'HFU pred':>10}"
                f"{'HFU pub':>9}")
        lines = [head, "-" * len(head)]
        for r in self.results:
            c = r.case
            lines.append(f"{c.case:<{w}}{c.hardware:<9}{c.stack:<{ws}}{c.chips:>6}  {c.metric:<16}{c.measured:>9.4g}"
                         f"{r.predicted:>10.4g}{r.error_pct:>+8.1f}%{r.measured_step_s:>10.3f}s"
                         f"{r.predicted_step_s:>10.3f}s{_pct(r.sim.mfu):>10}{_pct(c.published_mfu):>9}"
                         f"{_pct(r.sim.hfu):>10}{_pct(c.published_hfu):>9}")
        for c, why in self.failures:
            lines.append(f"{c.case:<{w}}{c.hardware:<9}{c.stack:<{ws}}{c.chips:>6}  FAILED: {why}")
        for g in sorted({r.case.group for r in self.results}):
            s = self.summary(g)
            lines.append(f"{g}: median |error| {s['median_abs_error_pct']:.1f}%, max {s['max_abs_error_pct']:.1f}% "
                         f"(n = {s['n']})" + (f"; targets <= {MEDIAN_TARGET_PCT:g}% and <= {MAX_TARGET_PCT:g}%"
                                              if g == "required" else ""))
        if self.results:
            lines.append(self.memory_line())
        lines.append("MFU/HFU pub: as the source prints it (Megatron's '% of peak' counts the recomputation: "
                     "an HFU); error = (predicted - measured) / measured in the source's metric")
        lines.append(f"({self.wall_s:.1f} s, of which lowering {self.lower_s:.1f} s)")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Measured vs predicted step time (log-log), one labelled point per case, with ±5 % and ±12 % bands."""
        fig = new_figure((6.4, 6.0))
        ax = fig.subplots()
        xs = [r.measured_step_s for r in self.results] + [r.predicted_step_s for r in self.results]
        lo, hi = min(xs) / 1.5, max(xs) * 1.5
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
        for f, style in ((MEDIAN_TARGET_PCT, ":"), (MAX_TARGET_PCT, "--")):
            ax.plot([lo, hi], [lo * (1 + f / 100), hi * (1 + f / 100)], "k" + style, lw=0.6, label=f"±{f:g}%")
            ax.plot([lo, hi], [lo * (1 - f / 100), hi * (1 - f / 100)], "k" + style, lw=0.6)
        colors = {"required": "tab:blue", "extra": "tab:orange"}
        for g in sorted({r.case.group for r in self.results}):
            rs = [r for r in self.results if r.case.group == g]
            ax.scatter([r.measured_step_s for r in rs], [r.predicted_step_s for r in rs], s=24,
                       c=colors.get(g, "tab:gray"), label=g)
            for r in rs:
                ax.annotate(r.case.case, (r.measured_step_s, r.predicted_step_s), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured step time (s, from the published number)")
        ax.set_ylabel("predicted step time (s)")
        s = self.summary("required")
        title = "partir-emu fidelity"
        if s["n"]:
            title += f": required median |error| {s['median_abs_error_pct']:.1f}%, max {s['max_abs_error_pct']:.1f}%"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)


def _dcn_lines(case: PublishedRun, sim: SimReport) -> list[str]:
    """For a run on several slices: how the model runs its DCN (``explain``)."""
    row = sim.by_axes.get("dcn")
    if row is None or case.slice_dims is None:
        return []
    spec = load_spec(case.hardware)
    dcn = getattr(spec.network, "dcn", None)
    if dcn is None:
        return []
    return [f"dcn: {case.slice_dims[0]} slices; each host NIC at {dcn.achieved_fraction:.3f} of its nominal "
            f"{dcn.host_bw_bytes_per_s / 1e9:g} GB/s and its latency over that (fitted: `fidelity --fits`); "
            + ("the collectives across slices overlap compute" if dcn.overlaps_compute else
               f"the {int(row['count'])} collectives across slices ({row['time_s']:.4f} s) block the compute "
               f"stream where they start ([dcn] overlaps_compute = false)")]


def _stack_line(name: str, hardware: str) -> str:
    """What the case's stack profile changes in the prediction (``explain``)."""
    st = load_stack(name)
    k = st.kernel
    kernel = ("priced as its GEMMs" if k is None else
              f"{k.name}, measured on {hardware}" if hardware in k.chips() else
              f"{k.name}, not measured on {hardware} (measured on {', '.join(k.chips())}): priced as its GEMMs")
    return (f"stack {st.name}: causal flash blocks skipped: {'yes' if st.attention_causal_skip else 'no'}; attention "
            f"kernel: {kernel}; gradient reductions: {st.gradient_reduce_dtype.replace('_', ' ')}; saved for the "
            f"backward: {st.saved_activations}; memory beside the tensors: "
            f"{st.reserved_bytes / 1e9:g} GB reserved + {100 * st.allocator_overhead:g}% of the peak for the allocator; "
            f"kernels: {'one per framework op (eager)' if st.eager else 'as the chip compiler fuses them'}"
            + ("" if st.compute_fraction == 1.0 else
               f"; each at {st.compute_fraction:.3f} of its modelled rate (fitted: `fidelity --fits`)"))


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def run_cases(cases: Sequence[PublishedRun], *, programs: ProgramCache | None = None, analyzer: Analyzer | None = None,
              on_case: Callable[[PublishedRun], None] | None = None) -> FidelityReport:
    """Run every case; a case that cannot be built or simulated is reported in ``failures``, not raised."""
    programs = programs if programs is not None else ProgramCache()
    analyzer = analyzer if analyzer is not None else Analyzer()
    t0 = time.perf_counter()
    lower0 = programs.lower_s
    results, failures = [], []
    for case in cases:
        if on_case is not None:
            on_case(case)
        try:
            results.append(run_case(case, programs, analyzer))
        except PartirError as exc:
            failures.append((case, str(exc)))
    return FidelityReport(tuple(results), tuple(failures), time.perf_counter() - t0, programs.lower_s - lower0)


__all__ = ["MAX_TARGET_PCT", "MEDIAN_TARGET_PCT", "FidelityResult", "FidelityReport",
           "experiment", "run_case", "run_cases"]

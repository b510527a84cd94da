"""Per-chip calibration from published measurements, and how well it generalises.

Where no microbenchmark of a chip's matrix unit is public (TPUs: no MXU GEMM sweep in our
references), its sustained matmul fraction (``[efficiency] matmul_peak_fraction`` of its spec)
is *fitted*: the one value for which the chip's published training runs in the fidelity data
file (every case of that chip on one slice, whatever its group: :func:`chip_fit_cases`) are
predicted with a median step-time error of zero. It is one number per chip, never per case, and this module is how it was obtained:
``partir-emu fidelity --fit tpu-v4`` prints it, the spec's ``_source`` string quotes it, and a
test re-fits it from the data and compares.

Because a fit to the cases it is then judged on proves little, the command also prints the
**leave-one-out** error of every case: the error it gets when the fraction is fitted to the
chip's *other* cases only. That is the error to expect on a run of that chip we have not seen.

The predicted step time falls monotonically as the fraction grows (more matmul throughput,
nothing else changes), so the fit is a bracketed root search (a safeguarded secant in log f) on
``median(log(predicted / measured))``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.fidelity import run_case
from partir_emu.app.validation.fidelity_data import FidelityDataError, PublishedRun
from partir_emu.errors import SpecError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.compute.stack import StackSpec
from partir_emu.hwmodels.machine.specs import HardwareSpec
from partir_emu.limits import load_toml

LOW, HIGH = 0.2, 1.0      # the fraction is searched in this interval
TOLERANCE = 1e-4          # the search stops when the bracket is this narrow


def with_matmul_fraction(spec: HardwareSpec, fraction: float) -> HardwareSpec:
    """``spec`` with ``[efficiency] matmul_peak_fraction`` replaced (nothing else changes)."""
    return dataclasses.replace(spec, efficiency=dataclasses.replace(spec.efficiency, matmul_peak_fraction=fraction))


def log_errors(cases: Sequence[PublishedRun], spec: HardwareSpec, programs: ProgramCache, analyzer: Analyzer) -> list[float]:
    """``log(predicted step / measured step)`` of each case on ``spec``."""
    out = []
    for case in cases:
        r = run_case(case, programs, analyzer, spec=spec)
        out.append(math.log(r.predicted_step_s / r.measured_step_s))
    return out


def chip_fit_cases(cases: Sequence[PublishedRun], chip: str, spec: HardwareSpec) -> list[PublishedRun]:
    """The cases ``chip``'s matmul fraction is fitted on: its runs on one slice. A run on several slices
    joined by DCN (a slice shape with a leading slice count) tests the network model on top of the
    chip; fitted on too, the compute constant would absorb what the DCN model misses."""
    pod_dims = len(getattr(spec.network, "pod_dims", ()))
    return [c for c in cases if c.hardware == chip and not (c.slice_dims and len(c.slice_dims) > pod_dims)]


def fit_fraction(cases: Sequence[PublishedRun], spec: HardwareSpec, programs: ProgramCache, analyzer: Analyzer) -> float:
    """The matmul fraction for which the median log step-time error of ``cases`` is zero (clamped to
    [LOW, HIGH]: a chip whose runs need more than its peak says so by hitting HIGH)."""
    return zero_median(lambda f: statistics.median(log_errors(cases, with_matmul_fraction(spec, f), programs, analyzer)),
                       guess=spec.efficiency.matmul_peak_fraction)


def stack_source(stack: StackSpec) -> str:
    """The ``compute_fraction_source`` of a stack profile ("" if it has none)."""
    return dict(stack.sources).get("efficiency.compute_fraction_source", "")


def is_fitted_stack(stack: StackSpec) -> bool:
    """Does the stack profile say its compute fraction is a fit to published runs?"""
    return stack_source(stack).lstrip().lower().startswith("fit")


def fit_stack_fraction(cases: Sequence[PublishedRun], stack: StackSpec, programs: ProgramCache, analyzer: Analyzer,
                       specs: Mapping[str, HardwareSpec] | None = None) -> float:
    """The stack's ``compute_fraction`` for which the median log step-time error of its ``cases`` is
    zero (each case on its chip's spec, ``specs[chip]`` where given: the chips' own fits first)."""
    mine = [c for c in cases if c.stack == stack.name]
    if not mine:
        raise FidelityDataError(f"no case runs stack {stack.name!r} to fit its compute_fraction on")

    def median_error(f: float) -> float:
        st = dataclasses.replace(stack, compute_fraction=f)
        errs = [math.log(r.predicted_step_s / r.measured_step_s)
                for c in mine for r in [run_case(c, programs, analyzer, spec=(specs or {}).get(c.hardware), stack=st)]]
        return statistics.median(errs)

    return zero_median(median_error, guess=stack.compute_fraction)


def zero_median(median_error: Callable[[float], float], low: float = LOW, guess: float | None = None) -> float:
    """The fraction f in [low, HIGH] where ``median_error`` (falling as f grows: more throughput, a
    faster step) is zero; clamped at the ends. A safeguarded secant search in ``x = log f`` from
    ``guess`` (default: HIGH; the value a spec holds now is a good one: a refit then takes 1-2
    evaluations): a step whose time is all compute takes ``1/f``, so its error is ``g(x0) - (x - x0)``
    and the first step ``x = x0 + g(x0)`` lands on the root; the secant corrects for the part of the
    step f does not scale, and a step that would leave the bracket goes to an end not priced yet, or
    bisects the bracket. Each evaluation prices every case anew, so this takes 3-4 of them where
    bisection took 13. Stops when the error is below 1e-7 (a step time to 1e-7 relative) or the
    bracket is TOLERANCE wide in f."""
    x_lo, x_hi = math.log(low), math.log(HIGH)
    g_lo: float | None = None           # not priced yet: an end is priced only if the search gets there
    g_hi: float | None = None
    x = x_hi if guess is None else min(max(math.log(guess), x_lo), x_hi)
    x_prev: float | None = None
    g_prev = 0.0
    for _ in range(64):
        g = median_error(math.exp(x))
        if abs(g) < 1e-7:
            return math.exp(x)
        if g > 0:                       # predicted too slow: the root is above x
            if x >= math.log(HIGH):
                return HIGH             # still too slow at the highest fraction searched
            x_lo, g_lo = x, g
        else:
            if x <= math.log(low):
                return low              # still too fast at the lowest fraction searched
            x_hi, g_hi = x, g
        if math.exp(x_hi) - math.exp(x_lo) < TOLERANCE:
            break
        nxt = x + g if x_prev is None or g == g_prev else x - g * (x - x_prev) / (g - g_prev)
        if not x_lo < nxt < x_hi:       # outside the bracket: an end not priced yet, else bisect
            nxt = (x_hi if nxt >= x_hi and g_hi is None else x_lo if nxt <= x_lo and g_lo is None
                   else (x_lo + x_hi) / 2)
        x_prev, g_prev, x = x, g, nxt
    return math.exp(x)


@dataclass(frozen=True)
class Calibration:
    """A chip's fitted fraction, each case's error with it, and its leave-one-out error."""

    chip: str
    fraction: float
    spec_fraction: float
    spec_source: str
    cases: tuple[str, ...]
    in_sample_pct: tuple[float, ...]
    leave_one_out_pct: tuple[float | None, ...]   # None: the chip has a single case

    def table(self) -> str:
        lines = [f"{self.chip}: fitted matmul_peak_fraction {self.fraction:.3f} (spec file: {self.spec_fraction:.3f})",
                 f"  spec source: {self.spec_source}",
                 f"  {'case':<20}{'error, fitted to all':>22}{'leave-one-out':>16}"]
        for name, e, loo in zip(self.cases, self.in_sample_pct, self.leave_one_out_pct):
            lines.append(f"  {name:<20}{e:>+21.1f}%{'-' if loo is None else f'{loo:+.1f}%':>16}")
        lines.append("  (error of the step time, predicted vs measured; leave-one-out: fitted to the chip's other "
                     "cases only, the error to expect on an unseen run)")
        return "\n".join(lines)


def calibrate(chip: str, cases: Sequence[PublishedRun], *, programs: ProgramCache | None = None,
              analyzer: Analyzer | None = None) -> Calibration:
    """Fit ``chip``'s matmul fraction to its cases among ``cases`` and measure how it generalises."""
    programs = programs if programs is not None else ProgramCache()
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(chip)
    mine = chip_fit_cases(cases, chip, spec)
    if not mine:
        raise FidelityDataError(f"--fit {chip}: the data file has no single-slice case on {chip!r}; "
                                f"chips with cases: {sorted({c.hardware for c in cases})}")
    fraction = fit_fraction(mine, spec, programs, analyzer)
    fitted = with_matmul_fraction(spec, fraction)
    in_sample = [100 * math.expm1(e) for e in log_errors(mine, fitted, programs, analyzer)]
    loo: list[float | None] = []
    for i, case in enumerate(mine):
        others = mine[:i] + mine[i + 1:]
        if not others:
            loo.append(None)
            continue
        f_i = fit_fraction(others, spec, programs, analyzer)
        (e,) = log_errors([case], with_matmul_fraction(spec, f_i), programs, analyzer)
        loo.append(100 * math.expm1(e))
    return Calibration(chip, fraction, spec.efficiency.matmul_peak_fraction,
                       fraction_source(spec), tuple(c.case for c in mine),
                       tuple(in_sample), tuple(loo))


def field_source(spec: HardwareSpec, table: str, name: str) -> str:
    """The ``[table] name_source`` string of the spec's file ("" if it has none)."""
    try:
        data = load_toml(spec.path, SpecError, "hardware spec")
    except SpecError:
        return ""
    return str(data.get(table, {}).get(f"{name}_source", ""))


def fraction_source(spec: HardwareSpec) -> str:
    """The ``matmul_peak_fraction_source`` string of the spec's file ("" if it has none)."""
    return field_source(spec, "efficiency", "matmul_peak_fraction")


__all__ = ["Calibration", "calibrate", "field_source", "fit_fraction", "fit_stack_fraction", "fraction_source", "is_fitted_stack",
           "log_errors", "stack_source", "with_matmul_fraction", "zero_median"]

"""Out-of-sample errors by construction: ``partir-emu fidelity --holdout source|chip|stack`` and
``--fits``.

Every constant of the model that is *fitted* to the published runs, rather than sourced from a
datasheet or a microbenchmark, is listed by :func:`fitted_constants` with the cases it was fitted
on (``--fits``). Today these are the sustained matmul fractions of the chips whose spec says
``matmul_peakfraction_source = "fit: ..."`` (:mod:`.calibrate`: one number per chip, the median
step-time error of the chip's cases zero), the DCN fractions of the chips whose spec says
``achieved_fraction_source = "fit: ..."`` (:mod:`.dcn_fit`: one number per chip, fitted on how its
multi-slice runs grow from one slice) and the compute fractions of the stacks whose profile
says ``compute_fraction_source = "fit: ..."`` (one number per stack, fitted after the chips'; a
stack with no case left to fit on runs at the modelled rate, 1.0: the prior of an unseen stack).

``--holdout KEY`` splits the cases by ``KEY`` (the case's ``source_id``, ``hardware`` or ``stack``).
For each group it refits every fitted constant on the *other* groups' cases only and predicts
the group's cases with those constants: the error of each case is then an error on a run the
model was not fitted to. A fitted chip with no case left to fit on takes the mean of the other
fitted chips' refitted fractions (the prior an unseen chip of the family gets, as tpu-v3 and
tpu-v5p do in their spec files); with no fitted chip left at all, its cases cannot be predicted
out of sample and are reported as such (``None``), never with the in-sample value.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.calibrate import (
    chip_fit_cases,
    fit_fraction,
    fit_stack_fraction,
    fraction_source,
    is_fitted_stack,
    with_matmul_fraction,
)
from partir_emu.app.validation.dcn_fit import (
    dcn_fit_pairs,
    dcn_of,
    fit_dcn_fraction,
    fit_dcn_fractions,
    is_dcn_fitted,
    with_dcn_fraction,
)
from partir_emu.app.validation.fidelity import run_case
from partir_emu.app.validation.fidelity_data import FidelityDataError, PublishedRun
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.compute.stack import StackSpec, load_stack

HOLDOUT_KEYS = ("source", "chip", "stack")


def group_of(case: PublishedRun, key: str) -> str:
    """The case's group under ``--holdout key``."""
    if key == "source":
        return case.source_id
    if key == "chip":
        return case.hardware
    if key == "stack":
        return case.stack
    raise FidelityDataError(f"--holdout {key!r}: use one of {', '.join(HOLDOUT_KEYS)}")


def is_fitted(chip: str, analyzer: Analyzer) -> bool:
    """Does ``chip``'s spec say its matmul fraction is a fit to published runs?"""
    return fraction_source(analyzer.spec(chip)).lstrip().lower().startswith("fit")


@dataclass(frozen=True)
class FittedConstant:
    name: str                      # e.g. "tpu-v4 [efficiency] matmul_peak_fraction"
    value: float                   # in the spec file
    refit: float                   # fitted now from the data file's cases
    cases: tuple[str, ...]         # the cases it is fitted on


def fitted_constants(cases: Sequence[PublishedRun], *, programs: ProgramCache | None = None,
                     analyzer: Analyzer | None = None) -> list[FittedConstant]:
    """Every fitted constant with the cases of ``cases`` it is fitted on (``--fits``)."""
    programs = programs if programs is not None else ProgramCache()
    analyzer = analyzer if analyzer is not None else Analyzer()
    out = []
    for chip in sorted({c.hardware for c in cases}):
        if not is_fitted(chip, analyzer):
            continue
        spec = analyzer.spec(chip)
        mine = chip_fit_cases(cases, chip, spec)
        out.append(FittedConstant(f"{chip} [efficiency] matmul_peak_fraction", spec.efficiency.matmul_peak_fraction,
                                  fit_fraction(mine, spec, programs, analyzer), tuple(c.case for c in mine)))
    for chip in sorted({c.hardware for c in cases}):
        spec = analyzer.spec(chip)
        pairs = dcn_fit_pairs(cases, chip)
        if pairs and is_dcn_fitted(spec):
            out.append(FittedConstant(f"{chip} [dcn] achieved_fraction", dcn_of(spec).achieved_fraction,
                                      fit_dcn_fraction(pairs, spec, programs, analyzer), tuple(c.case for c, _ in pairs)))
    for stack in fitted_stacks(cases):
        mine = [c for c in cases if c.stack == stack.name]
        out.append(FittedConstant(f"stack {stack.name} [efficiency] compute_fraction", stack.compute_fraction,
                                  fit_stack_fraction(mine, stack, programs, analyzer), tuple(c.case for c in mine)))
    return out


def fitted_stacks(cases: Sequence[PublishedRun]) -> list[StackSpec]:
    """The stack profiles of ``cases`` whose compute fraction is a fit."""
    return [st for name in sorted({c.stack for c in cases}) if is_fitted_stack(st := load_stack(name))]


def fits_table(consts: Sequence[FittedConstant]) -> str:
    lines = [f"{'fitted constant':<50}{'spec':>8}{'refit':>8}  fitted on"]
    for k in consts:
        lines.append(f"{k.name:<50}{k.value:>8.3f}{k.refit:>8.3f}  {', '.join(k.cases)}")
    lines.append("(every other constant of the hardware specs and stack profiles is sourced: `partir-emu hardware NAME`)")
    return "\n".join(lines)


@dataclass(frozen=True)
class HeldOut:
    case: PublishedRun
    group: str
    fraction: float | None         # the refitted matmul fraction it was predicted with (None: not fitted)
    error_pct: float | None        # None: no fit possible without the held-out group
    stack_fraction: float | None = None   # the refitted stack compute fraction (None: not fitted)
    dcn_fraction: float | None = None     # the refitted DCN fraction of a multi-slice run (None: not one)


@dataclass(frozen=True)
class HoldoutReport:
    key: str
    rows: tuple[HeldOut, ...]

    def errors(self) -> list[float]:
        return [abs(r.error_pct) for r in self.rows if r.error_pct is not None]

    def table(self) -> str:
        w = max([17, *(len(r.case.case) + 1 for r in self.rows)])
        lines = [f"--holdout {self.key}: each group predicted with constants fitted on the other groups only",
                 f"{'case':<{w}}{'group':<36}{'fraction':>9}{'stack':>7}{'dcn':>7}{'held-out error':>16}"]
        for r in self.rows:
            frac, sfrac, dfrac = ("-" if v is None else f"{v:.3f}" for v in (r.fraction, r.stack_fraction, r.dcn_fraction))
            err = "no fit possible" if r.error_pct is None else f"{r.error_pct:+.1f}%"
            lines.append(f"{r.case.case:<{w}}{r.group[:35]:<36}{frac:>9}{sfrac:>7}{dfrac:>7}{err:>16}")
        errs = self.errors()
        if errs:
            lines.append(f"held out by {self.key}: median |error| {statistics.median(errs):.1f}%, max {max(errs):.1f}% "
                         f"(n = {len(errs)} of {len(self.rows)})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        errs = self.errors()
        return {"holdout": self.key, "cases": [{"case": r.case.case, "group": r.group, "fraction": r.fraction,
                                                "stack_fraction": r.stack_fraction, "dcn_fraction": r.dcn_fraction,
                                                "error_pct": r.error_pct}
                                               for r in self.rows],
                "median_abs_error_pct": statistics.median(errs) if errs else None,
                "max_abs_error_pct": max(errs) if errs else None}


def holdout(cases: Sequence[PublishedRun], key: str, *, programs: ProgramCache | None = None,
            analyzer: Analyzer | None = None) -> HoldoutReport:
    """Every case predicted with the fitted constants refitted without its ``key`` group."""
    programs = programs if programs is not None else ProgramCache()
    analyzer = analyzer if analyzer is not None else Analyzer()
    groups = list(dict.fromkeys(group_of(c, key) for c in cases))
    fitted = {c.hardware for c in cases if is_fitted(c.hardware, analyzer)}
    dcn_chips = {c.hardware for c in cases if c.one_slice is not None and is_dcn_fitted(analyzer.spec(c.hardware))}
    stacks = {st.name: st for st in fitted_stacks(cases)}
    rows: list[HeldOut] = []
    for g in groups:
        train = [c for c in cases if group_of(c, key) != g]
        fractions = {chip: fit_fraction(mine, analyzer.spec(chip), programs, analyzer)
                     for chip in sorted(fitted) if (mine := chip_fit_cases(train, chip, analyzer.spec(chip)))}
        prior = statistics.mean(fractions.values()) if fractions else None
        specs = {chip: with_matmul_fraction(analyzer.spec(chip), f) for chip, f in fractions.items()}
        held = [c for c in cases if group_of(c, key) == g]
        dcn_specs = {chip: specs.get(chip, analyzer.spec(chip)) for chip in dcn_chips}
        need = dcn_chips & {c.hardware for c in held if c.one_slice is not None}
        dcn = fit_dcn_fractions(train, sorted(need), dcn_specs, programs, analyzer)
        if need - set(dcn):          # a chip with no multi-slice run left takes the other chips' mean
            dcn.update(fit_dcn_fractions(train, sorted(dcn_chips - need), dcn_specs, programs, analyzer))
        dcn_prior = statistics.mean(dcn.values()) if dcn else None
        stack_fractions = {name: fit_stack_fraction(train, st, programs, analyzer, specs)
                           for name, st in stacks.items()
                           if any(c.stack == name for c in held) and any(c.stack == name for c in train)}
        for case in held:
            spec = analyzer.spec(case.hardware)
            if case.hardware in fitted:
                f = fractions.get(case.hardware, prior)
                if f is None:
                    rows.append(HeldOut(case, g, None, None))
                    continue
                spec = with_matmul_fraction(spec, f)
            else:
                f = None
            d = None
            if case.hardware in dcn_chips and case.one_slice is not None:      # a multi-slice run
                d = dcn.get(case.hardware, dcn_prior)
                if d is None:
                    rows.append(HeldOut(case, g, f, None))
                    continue
                spec = with_dcn_fraction(spec, d)
            stack, sf = None, None
            if case.stack in stacks:      # refitted without the group; an unseen stack at the modelled rate
                sf = stack_fractions.get(case.stack, 1.0)
                stack = dataclasses.replace(stacks[case.stack], compute_fraction=sf)
            r = run_case(case, programs, analyzer, spec=spec, stack=stack)
            rows.append(HeldOut(case, g, f, r.error_pct, sf, d))
    order = {c.case: i for i, c in enumerate(cases)}
    return HoldoutReport(key, tuple(sorted(rows, key=lambda r: order[r.case.case])))


__all__ = ["HOLDOUT_KEYS", "FittedConstant", "HeldOut", "HoldoutReport", "fits_table", "fitted_constants",
           "fitted_stacks", "group_of", "holdout", "is_fitted"]

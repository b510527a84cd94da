"""The data-centre network as TPU multi-slice runs achieved it: ``[dcn] achieved_fraction``, fitted.

No published figure gives what a collective across TPU slices achieves on the data-centre network
(DCN): the spec's ``[dcn]`` host NIC bandwidth is the nominal 2.5e10 B/s per host of the scaling
book and its latency a documented estimate. MaxText's multi-slice tables measure it indirectly: the
same model on 1, 2, 4, ... 32 slices, each slice running FSDP over ICI, the slices data-parallel over
DCN. The step grows with the slice count, and by how much is a measurement of the DCN collectives
alone: the chip, the model and the ICI collectives are the same on every row.

So the fit uses how the step *grows*, never its level: for a multi-slice case ``c`` and its
single-slice run ``r`` (the case's ``one_slice``), the error is

    log( (predicted_c / predicted_r) / (measured_c / measured_r) )

and ``achieved_fraction`` is the value in [LOW_DCN, 1] where the median of these errors over the
chip's multi-slice cases is zero (:func:`.calibrate.zero_median`; a larger fraction, a faster DCN, a
smaller ratio). The chip's matmul fraction (fitted on single-slice runs only) cancels out of the
ratio to first order, so the two fits do not trade against each other. ``fidelity --fits`` lists the
value with its cases; ``fidelity --holdout`` refits it without the held-out group (a chip left without
multi-slice cases takes the mean of the other chips' fractions, as the matmul fractions do).

The fraction scales the host NIC's bandwidth and divides its latency
(:class:`~partir_emu.hwmodels.machine.specs.DcnSpec`): one number for how far the DCN path as the
runtime drives it (host-mediated transfers, TCP) is from its nominal figures.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from partir_emu.app.programs import ProgramCache
from partir_emu.app.validation.calibrate import field_source, zero_median
from partir_emu.app.validation.fidelity import run_case
from partir_emu.app.validation.fidelity_data import FidelityDataError, PublishedRun
from partir_emu.errors import SpecError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.machine.specs import DcnSpec, HardwareSpec, TorusSpec

LOW_DCN = 0.05          # the fraction is searched in [LOW_DCN, 1]


def dcn_of(spec: HardwareSpec) -> DcnSpec:
    """The spec's ``[dcn]`` table (a TPU spec that joins slices), or a SpecError naming the spec."""
    dcn = getattr(spec.network, "dcn", None)
    if not isinstance(dcn, DcnSpec):
        raise SpecError(f"{spec.name}: the spec has no [dcn] table; a DCN fraction needs one")
    return dcn


def with_dcn_fraction(spec: HardwareSpec, fraction: float) -> HardwareSpec:
    """``spec`` with ``[dcn] achieved_fraction`` replaced (nothing else changes)."""
    dcn = dataclasses.replace(dcn_of(spec), achieved_fraction=fraction)
    net = spec.network
    assert isinstance(net, TorusSpec), "dcn_of: only a TPU torus spec has a [dcn] table"
    return dataclasses.replace(spec, network=dataclasses.replace(net, dcn=dcn))


def dcn_source(spec: HardwareSpec) -> str:
    """The ``[dcn] achieved_fraction_source`` string of the spec's file ("" if it has none)."""
    return field_source(spec, "dcn", "achieved_fraction")


def is_dcn_fitted(spec: HardwareSpec) -> bool:
    """Does the spec say its DCN fraction is a fit to published runs?"""
    return dcn_source(spec).lstrip().lower().startswith("fit")


def dcn_fit_pairs(cases: Sequence[PublishedRun], chip: str) -> list[tuple[PublishedRun, PublishedRun]]:
    """``(multi-slice case, its single-slice run)`` for ``chip``'s cases whose ``one_slice`` is among
    ``cases`` (a held-out reference leaves its multi-slice runs out of the fit too)."""
    by_name = {c.case: c for c in cases}
    return [(c, by_name[c.one_slice]) for c in cases
            if c.hardware == chip and c.one_slice is not None and c.one_slice in by_name]


def growth_log_errors(pairs: Sequence[tuple[PublishedRun, PublishedRun]], spec: HardwareSpec,
                      programs: ProgramCache, analyzer: Analyzer) -> list[float]:
    """Per pair, ``log`` of the predicted over the measured growth of the step from one slice."""
    refs: dict[str, float] = {}
    out = []
    for c, r in pairs:
        if r.case not in refs:
            ref = run_case(r, programs, analyzer, spec=spec)
            refs[r.case] = ref.predicted_step_s / ref.measured_step_s
        got = run_case(c, programs, analyzer, spec=spec)
        out.append(math.log(got.predicted_step_s / got.measured_step_s / refs[r.case]))
    return out


def fit_dcn_fraction(pairs: Sequence[tuple[PublishedRun, PublishedRun]], spec: HardwareSpec, programs: ProgramCache,
                     analyzer: Analyzer) -> float:
    """The ``achieved_fraction`` for which the median growth error of ``pairs`` is zero (module docstring)."""
    if not pairs:
        raise FidelityDataError(f"no multi-slice case of {spec.name} with its one_slice run to fit the DCN on")
    return zero_median(lambda f: statistics.median(
        growth_log_errors(pairs, with_dcn_fraction(spec, f), programs, analyzer)), low=LOW_DCN,
        guess=dcn_of(spec).achieved_fraction)


def fit_dcn_fractions(cases: Sequence[PublishedRun], chips: Sequence[str], specs: Mapping[str, HardwareSpec],
                      programs: ProgramCache, analyzer: Analyzer) -> dict[str, float]:
    """Per chip of ``chips`` with multi-slice pairs among ``cases``, its fitted DCN fraction on
    ``specs[chip]`` (the chip's spec with its matmul fraction as the caller fitted it)."""
    return {chip: fit_dcn_fraction(pairs, specs[chip], programs, analyzer)
            for chip in chips if (pairs := dcn_fit_pairs(cases, chip))}


__all__ = ["LOW_DCN", "dcn_fit_pairs", "dcn_of", "dcn_source", "fit_dcn_fraction", "fit_dcn_fractions", "growth_log_errors",
           "is_dcn_fitted", "with_dcn_fraction"]

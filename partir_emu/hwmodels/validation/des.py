"""Analytical model vs DES on given SpmdPrograms: per-case errors, statistics per mechanism, rankings,
tables, plots.

:func:`compare` prices one lowered program with ``Analyzer.simulate`` and runs it through
``simulate_des`` on the same placement and under the same conditions (overlap, communication
streams, stragglers, degraded and failed links: :meth:`Case.inputs`), and reports the predicted and
simulated step times and ``rel_err = |analytical - DES| / DES``. An input the analytical model does
not take is reported (``why``, ``details["analytical_ignores"]``), not silently dropped. Where the
analytical model is optimistic (DES slower), :func:`explain` says why, from the DES's per-collective
contention records: concurrent groups of one collective sharing a link, other collectives' flows on
it, or members running ahead of each other inside a collective. :class:`ValidationReport` gathers
the results: error statistics overall and per mechanism (:data:`MECHANISMS`: what a case exercises
beyond the alpha-beta closed form), the ranking of strategies per (model, hardware, devices,
conditions) under each model, a table and a scatter plot.

A :class:`Case` only *names* what was compared (scenario, strategy, hardware, mesh, conditions);
building the programs from scenarios, and the suites of cases, live in the app layer
(:mod:`partir_emu.app.validation.cases`). The acceptance thresholds are :data:`MEDIAN_MAX` and
:data:`MAX_MAX` (so that one mechanism priced 20 % wrong fails) with identical rankings; the
mutation catalogue (``docs/validation.md``, ``tests/integration/test_mutations.py``) checks that they can fail.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError
from partir_emu.hwmodels.analytical import Analyzer, SimReport
from partir_emu.hwmodels.des.model import DesOptions, simulate_des
from partir_emu.hwmodels.des.report import DesReport
from partir_emu.hwmodels.machine.specs import load_spec

MEDIAN_MAX = 0.02
MAX_MAX = 0.10


MECHANISMS = ("closed-form", "group-contention", "streams", "straggler", "degraded-link", "failed-link",
              "nic-sharing")
"""The labels a case's ``mechanism`` usually takes: what the DES models there beyond the alpha-beta
closed form of one group alone (any other label is allowed; the report groups by it)."""


@dataclass(frozen=True)
class Case:
    """One comparison: the program (scenario, size, strategy, mesh), the hardware (``hw_overrides``:
    ``"topology.fabric=rail_optimized"``, spec fields as :func:`~partir_emu.hwmodels.machine.specs.load_spec`
    takes them), the placement, and the conditions both models get: ``overlap``, ``comm_streams``,
    ``stragglers`` (``((device, factor), ...)``), ``degraded_links`` (``(("0->1", 0.25), ...)``) and
    ``failed_links``. ``mechanism`` labels what the case exercises (:data:`MECHANISMS`); left empty, it
    is derived from the conditions (``"closed-form"`` when there are none)."""

    scenario: str
    strategy: str
    hardware: str
    mesh: str                                   # "batch=16,model=4"
    preset: str | None = None
    overrides: str | None = None
    placement: str | None = None                # "model=x,batch=yz"
    overlap: bool = False
    hw_overrides: str | None = None             # "topology.fabric=rail_optimized"
    slice_dims: str | None = None               # TPU slice shape "4x4x16" (default: the spec's default slice)
    comm_streams: int = 1
    stragglers: tuple[tuple[int, float], ...] = ()
    degraded_links: tuple[tuple[str, float], ...] = ()
    failed_links: tuple[str, ...] = ()
    mechanism: str = ""

    def __post_init__(self) -> None:
        if not self.mechanism:          # frozen: set once, here, so equal cases stay equal
            object.__setattr__(self, "mechanism", self._derived_mechanism())

    def _derived_mechanism(self) -> str:
        if self.failed_links:
            return "failed-link"
        if self.degraded_links:
            return "degraded-link"
        if self.stragglers:
            return "straggler"
        if self.comm_streams > 1:
            return "streams"
        return "closed-form"

    @property
    def model(self) -> str:
        return f"{self.scenario}/{self.preset or 'default'}" + (f"[{self.overrides}]" if self.overrides else "")

    @property
    def conditions(self) -> str:
        """The hardware variant and the fault / stream inputs, compactly (empty when there are none)."""
        parts = [self.hw_overrides] if self.hw_overrides else []
        if self.slice_dims:
            parts.append(f"slice {self.slice_dims}")
        if self.comm_streams != 1:
            parts.append(f"streams={self.comm_streams}")
        parts += [f"slow {d}x{f:g}" for d, f in self.stragglers]
        parts += [f"link {k}x{f:g}" for k, f in self.degraded_links]
        parts += [f"fail {k}" for k in self.failed_links]
        return " ".join(parts)

    @property
    def label(self) -> str:
        return (f"{self.strategy}@{self.mesh}" + (f" [{self.placement}]" if self.placement else "")
                + (" overlap" if self.overlap else "") + (f" {self.conditions}" if self.conditions else ""))

    @property
    def ranking_key(self) -> tuple:
        """Strategies are ranked against each other on the same model, hardware and chip count, under
        the same placement, overlap and conditions."""
        return (self.model, self.hardware, self.devices, self.overlap, self.placement, self.conditions)

    @property
    def devices(self) -> int:
        n = 1
        for part in self.mesh.split(","):
            n *= int(part.split("=")[1])
        return n

    def inputs(self) -> dict[str, Any]:
        """The keyword arguments both models take for this case's conditions."""
        return {"comm_streams": self.comm_streams, "stragglers": dict(self.stragglers),
                "degraded_links": dict(self.degraded_links), "failed_links": tuple(self.failed_links)}

    def slice_tuple(self) -> tuple[int, ...] | None:
        """``slice_dims`` as a tuple of ints (None: the default slice)."""
        if not self.slice_dims:
            return None
        try:
            return tuple(int(d) for d in self.slice_dims.lower().split("x"))
        except ValueError:
            raise ValidationCaseError(f"slice {self.slice_dims!r}: write AxBxC, e.g. 4x4x16") from None

    def spec_overrides(self) -> dict[str, Any]:
        """``hw_overrides`` as :func:`~partir_emu.hwmodels.machine.specs.load_spec` takes them."""
        out: dict[str, Any] = {}
        for item in (self.hw_overrides or "").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise ValidationCaseError(f"hardware override {item!r}: write FIELD=VALUE, e.g. "
                                          f"topology.fabric=rail_optimized")
            out[key.strip()] = _scalar(value.strip())
        return out


class ValidationCaseError(PartirError):
    """A case whose hardware overrides cannot be read."""


def _scalar(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


# -- one case -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaseResult:
    case: Case
    analytical_s: float
    des_s: float
    compute_s: float
    analytical_comm_s: float
    des_wall_s: float
    events: int
    why: str = ""
    details: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rel_err(self) -> float:
        return abs(self.analytical_s - self.des_s) / self.des_s if self.des_s > 0 else 0.0

    @property
    def signed_err(self) -> float:
        """(analytical - DES) / DES: negative when the analytical model is optimistic."""
        return (self.analytical_s - self.des_s) / self.des_s if self.des_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        c = self.case
        return {"scenario": c.scenario, "preset": c.preset, "overrides": c.overrides, "strategy": c.strategy,
                "hardware": c.hardware, "mesh": c.mesh, "devices": c.devices, "placement": c.placement,
                "overlap": c.overlap, "model": c.model, "label": c.label, "mechanism": c.mechanism,
                "hw_overrides": c.hw_overrides, "slice_dims": c.slice_dims, "comm_streams": c.comm_streams,
                "stragglers": [list(x) for x in c.stragglers], "degraded_links": [list(x) for x in c.degraded_links],
                "failed_links": list(c.failed_links),
                "analytical_s": self.analytical_s, "des_s": self.des_s, "rel_err": self.rel_err,
                "signed_err": self.signed_err, "compute_s": self.compute_s,
                "analytical_comm_s": self.analytical_comm_s, "des_wall_s": self.des_wall_s, "events": self.events,
                "why": self.why, **self.details}


def compare(case: Case, spmd: SpmdProgram, analyzer: Analyzer | None = None, **des_kw: Any) -> CaseResult:
    """Price ``spmd`` (the program ``case`` names) with both models on the case's hardware and placement,
    under the same conditions (streams, stragglers, degraded and failed links); ``analyzer`` (default
    a new one) is shared by both, so the program is analysed once. ``des_kw``: further
    :class:`~.model.DesOptions` fields (or ``options=``), the case's conditions win."""
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(case.hardware) if not case.hw_overrides else load_spec(case.hardware, case.spec_overrides())
    placement = analyzer.placement(spmd.mesh, spec, case.placement, case.slice_tuple())
    inputs = case.inputs()
    ana_kw, ignored = analytical_inputs(analyzer, inputs)
    ana = analyzer.simulate(spmd, spec, placement, overlap=case.overlap, **ana_kw)
    options = des_kw.pop("options", None)
    options = replace(options, **inputs) if options is not None else DesOptions(**{**des_kw, **inputs})
    des = simulate_des(spmd, spec, placement, case.overlap, analyzer=analyzer, options=options)
    why, details = explain(ana, des)
    if ignored:
        note = f"the analytical model does not take {', '.join(ignored)} (yet): priced without"
        why = f"{note}; {why}" if why else note
        details["analytical_ignores"] = ignored
    details["placement_described"] = placement.describe()
    return CaseResult(case, ana.step_s, des.step_s, ana.compute_s, ana.comm_s, des.wall_s, des.events, why, details)


def analytical_inputs(analyzer: Analyzer, inputs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The part of ``inputs`` that ``analyzer.simulate`` takes, and the names of the non-default inputs it
    does not take (those the analytical model cannot price yet: the case then measures that gap)."""
    params = inspect.signature(analyzer.simulate).parameters
    takes = {k: v for k, v in inputs.items() if k in params}
    ignored = [k for k, v in inputs.items() if k not in params and v and v != 1]
    return takes, ignored


def explain(ana: SimReport, des: DesReport, threshold: float = 0.005) -> tuple[str, dict[str, Any]]:
    """Why the DES is slower than the analytical model (empty when it is not, by more than ``threshold``):
    the collectives that take longer in the DES, grouped by cause, largest excess first."""
    if des.step_s <= ana.step_s * (1 + threshold):
        return "", {}
    by_index = {(r.at, r.index): r for r in ana.collectives}
    causes: dict[tuple, list[float]] = {}
    for r in des.collectives:
        a = by_index.get((r.at, r.index))
        if a is None:
            continue
        extra = r.duration_s - a.time_s
        if extra <= 1e-12 + 1e-6 * a.time_s:
            continue
        if r.contention == "groups":
            key = ("groups", r.prim, r.axes, r.worst_link, r.max_link_flows, r.group_link_flows)
        elif r.contention == "other":
            key = ("other", r.prim, r.axes, r.worst_link, r.max_link_flows, r.own_link_flows)
        else:
            key = ("async", r.prim, r.axes, "", 0, 0)
        causes.setdefault(key, []).append(extra)
    parts: list[str] = []
    rows: list[dict] = []
    gap = des.step_s - ana.step_s
    for key, extras in sorted(causes.items(), key=lambda kv: -sum(kv[1])):
        kind, prim, axes, link, k, base = key
        total = sum(extras)
        if rows and total < 0.01 * gap:
            break
        what = f"{len(extras)} {prim} over ({','.join(axes)}) +{total * 1e3:.3f} ms"
        if kind == "groups":
            why = f"contention on link {link}: {k} flows of the collective's concurrent groups where one group puts {base}"
        elif kind == "other":
            why = f"contention on link {link}: {k} flows, {k - base} of them from other collectives in flight"
        else:
            why = "members run ahead of each other inside the collective (no step barrier), so steps overlap"
        parts.append(f"{what}: {why}")
        rows.append({"cause": kind, "prim": prim, "axes": list(axes), "link": link, "count": len(extras),
                     "extra_s": total})
    head = f"DES {gap * 1e3:.3f} ms slower ({100 * gap / des.step_s:.1f}%)"
    return head + ("; " + "; ".join(parts[:3]) if parts else ""), {"causes": rows}



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
(:mod:`partir_emu.app.validate_cases`). The acceptance thresholds are :data:`MEDIAN_MAX` and
:data:`MAX_MAX` (so that one mechanism priced 20 % wrong fails) with identical rankings; the
mutation catalogue (``docs/validation.md``, ``tests/test_mutations.py``) checks that they can fail.
"""
from __future__ import annotations

import inspect
import json
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError
from partir_emu.hwmodels.analytical import DEFAULT_ANALYZER, Analyzer, SimReport
from partir_emu.hwmodels.des.model import DesOptions, simulate_des
from partir_emu.hwmodels.des.report import DesReport
from partir_emu.hwmodels.specs import load_spec

MEDIAN_MAX = 0.02
MAX_MAX = 0.10


MECHANISMS = ("closed-form", "group-contention", "streams", "straggler", "degraded-link", "failed-link",
              "nic-sharing")
"""The labels a case's ``mechanism`` usually takes: what the DES models there beyond the alpha-beta
closed form of one group alone (any other label is allowed; the report groups by it)."""


@dataclass(frozen=True)
class Case:
    """One comparison: the program (scenario, size, strategy, mesh), the hardware (``hw_overrides``:
    ``"topology.fabric=rail_optimized"``, spec fields as :func:`~partir_emu.hwmodels.specs.load_spec`
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
        """``hw_overrides`` as :func:`~partir_emu.hwmodels.specs.load_spec` takes them."""
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
    ``DEFAULT_ANALYZER``) is shared by both, so the program is analysed once. ``des_kw``: further
    :class:`~.model.DesOptions` fields (or ``options=``), the case's conditions win."""
    analyzer = analyzer if analyzer is not None else DEFAULT_ANALYZER
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


# -- the suite --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ValidationReport:
    suite: str
    results: tuple[CaseResult, ...]
    wall_s: float
    lower_s: float

    @property
    def median_rel_err(self) -> float:
        return statistics.median(r.rel_err for r in self.results) if self.results else 0.0

    @property
    def max_rel_err(self) -> float:
        return max((r.rel_err for r in self.results), default=0.0)

    @property
    def mean_rel_err(self) -> float:
        return statistics.fmean(r.rel_err for r in self.results) if self.results else 0.0

    def by_mechanism(self) -> dict[str, dict[str, Any]]:
        """Per mechanism label (in :data:`MECHANISMS` order, then others by name): the number of cases,
        the median, mean and max of |analytical - DES| / DES, the worst case and its signed error."""
        groups: dict[str, list[CaseResult]] = {}
        for r in self.results:
            groups.setdefault(r.case.mechanism, []).append(r)
        order = sorted(groups, key=lambda m: (MECHANISMS.index(m) if m in MECHANISMS else len(MECHANISMS), m))
        out = {}
        for m in order:
            rs = groups[m]
            worst = max(rs, key=lambda r: r.rel_err)
            out[m] = {"n": len(rs), "median": statistics.median(r.rel_err for r in rs),
                      "mean": statistics.fmean(r.rel_err for r in rs), "max": worst.rel_err,
                      "worst": f"{worst.case.hardware} {worst.case.model} {worst.case.label}",
                      "worst_signed": worst.signed_err}
        return out

    def rankings(self) -> list[dict[str, Any]]:
        groups: dict[tuple, list[CaseResult]] = {}
        for r in self.results:
            groups.setdefault(r.case.ranking_key, []).append(r)
        out = []
        for key, rs in groups.items():
            if len(rs) < 2:
                continue
            ana = [r.case.label for r in sorted(rs, key=lambda r: (r.analytical_s, r.case.label))]
            des = [r.case.label for r in sorted(rs, key=lambda r: (r.des_s, r.case.label))]
            model, hw, n, overlap, placement, conditions = key
            out.append({"model": model, "hardware": hw, "devices": n, "overlap": overlap, "placement": placement,
                        "conditions": conditions, "analytical": ana, "des": des, "agree": ana == des})
        return out

    @property
    def rankings_agree(self) -> bool:
        return all(r["agree"] for r in self.rankings())

    def passed(self, median_max: float = MEDIAN_MAX, max_max: float = MAX_MAX) -> bool:
        return self.median_rel_err <= median_max and self.max_rel_err <= max_max and self.rankings_agree

    def failures(self, median_max: float = MEDIAN_MAX, max_max: float = MAX_MAX) -> list[str]:
        out = []
        if self.median_rel_err > median_max:
            out.append(f"median |analytical - DES| / DES = {100 * self.median_rel_err:.2f}% > {100 * median_max:g}%")
        if self.max_rel_err > max_max:
            worst = max(self.results, key=lambda r: r.rel_err)
            out.append(f"max |analytical - DES| / DES = {100 * self.max_rel_err:.2f}% > {100 * max_max:g}% "
                       f"({worst.case.model} {worst.case.label} on {worst.case.hardware})")
        for r in self.rankings():
            if not r["agree"]:
                out.append(f"rankings differ for {r['model']} on {r['hardware']} x{r['devices']}: "
                           f"analytical {r['analytical']} vs DES {r['des']}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"suite": self.suite, "cases": [r.to_json() for r in self.results],
                "median_rel_err": self.median_rel_err, "max_rel_err": self.max_rel_err,
                "mean_rel_err": self.mean_rel_err, "by_mechanism": self.by_mechanism(), "rankings": self.rankings(),
                "rankings_agree": self.rankings_agree, "thresholds": {"median": MEDIAN_MAX, "max": MAX_MAX},
                "passed": self.passed(), "wall_s": self.wall_s, "lower_s": self.lower_s}

    def table(self) -> str:
        lines = [f"validation suite {self.suite!r}: {len(self.results)} cases, analytical vs DES",
                 f"{'model':<26}{'hardware':<8}{'chips':>6}  {'strategy@mesh conditions':<64}{'analytical':>12}"
                 f"{'DES':>12}{'error':>8}"]
        for r in self.results:
            c = r.case
            lines.append(f"{c.model[:25]:<26}{c.hardware:<8}{c.devices:>6}  {c.label[:63]:<64}"
                         f"{_ms(r.analytical_s):>12}{_ms(r.des_s):>12}{100 * r.signed_err:>+7.2f}%")
        lines += ["", f"|analytical - DES| / DES: median {100 * self.median_rel_err:.2f}%, mean "
                      f"{100 * self.mean_rel_err:.2f}%, max {100 * self.max_rel_err:.2f}%   (limits "
                      f"{100 * MEDIAN_MAX:g}% / {100 * MAX_MAX:g}%)"]
        lines += ["", *self.mechanism_table().splitlines()]
        lines += ["", "strategy rankings (fastest first):"]
        for rk in self.rankings():
            extra = ((" overlap" if rk["overlap"] else "") + (f" [{rk['placement']}]" if rk["placement"] else "")
                     + (f" {rk['conditions']}" if rk["conditions"] else ""))
            lines.append(f"  {rk['model']} on {rk['hardware']} x{rk['devices']}{extra}: "
                         f"{'agree' if rk['agree'] else 'DIFFER'}")
            lines.append(f"    analytical: {' < '.join(rk['analytical'])}")
            if not rk["agree"]:
                lines.append(f"    DES:        {' < '.join(rk['des'])}")
        why = [r for r in self.results if r.why]
        if why:
            lines += ["", "where the analytical model is optimistic:"]
            for r in why:
                lines.append(f"  {r.case.model} {r.case.label} on {r.case.hardware}: {r.why}")
        lines.append("")
        lines.append("PASS" if self.passed() else "FAIL: " + "; ".join(self.failures()))
        lines.append(f"({self.wall_s:.1f} s, of which lowering {self.lower_s:.1f} s)")
        return "\n".join(lines)

    def mechanism_table(self) -> str:
        """|analytical - DES| / DES per mechanism: cases, median, mean, max and the worst case."""
        lines = ["error per mechanism (|analytical - DES| / DES):",
                 f"  {'mechanism':<18}{'n':>4}{'median':>9}{'mean':>9}{'max':>9}  worst case (signed error)"]
        for m, st in self.by_mechanism().items():
            lines.append(f"  {m:<18}{st['n']:>4}{100 * st['median']:>8.2f}%{100 * st['mean']:>8.2f}%"
                         f"{100 * st['max']:>8.2f}%  {100 * st['worst_signed']:+6.1f}% {st['worst'][:90]}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """Scatter of predicted vs simulated step time (log-log) with the MEDIAN_MAX and MAX_MAX bands."""
        from matplotlib.figure import Figure  # why: a heavy import (~0.3 s), needed only to draw

        fig = Figure(figsize=(6.4, 6.0))
        ax = fig.subplots()
        colors = {"tpu-v4": "tab:blue", "h100": "tab:green"}
        markers = {"mlp": "o", "transformer": "s"}
        xs = [r.des_s * 1e3 for r in self.results] + [r.analytical_s * 1e3 for r in self.results]
        lo, hi = min(xs) / 1.5, max(xs) * 1.5
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="analytical = DES")
        for f, style in ((MEDIAN_MAX, ":"), (MAX_MAX, "--")):
            ax.plot([lo, hi], [lo * (1 + f), hi * (1 + f)], "k" + style, lw=0.6, label=f"±{100 * f:g}%")
            ax.plot([lo, hi], [lo * (1 - f), hi * (1 - f)], "k" + style, lw=0.6)
        seen = set()
        for r in self.results:
            key = (r.case.hardware, r.case.scenario)
            ax.scatter(r.des_s * 1e3, r.analytical_s * 1e3, c=colors.get(r.case.hardware, "tab:gray"),
                       marker=markers.get(r.case.scenario, "^"), s=18 + 6 * len(str(r.case.devices)),
                       label=f"{key[1]} on {key[0]}" if key not in seen else None, alpha=0.8)
            seen.add(key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("DES step time (ms)")
        ax.set_ylabel("analytical step time (ms)")
        ax.set_title(f"analytical vs DES, suite {self.suite!r}: median {100 * self.median_rel_err:.2f}%, "
                     f"max {100 * self.max_rel_err:.2f}%", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"

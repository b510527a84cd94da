"""The report of a validation run (analytical vs DES on given cases): per case the two step times and
their difference, the medians and maxima against the limits, and the mechanisms the cases cover;
as a table, as JSON, and as the verdict the command exits with.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from partir_emu.hwmodels.validation.des import MAX_MAX, MECHANISMS, MEDIAN_MAX, CaseResult


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

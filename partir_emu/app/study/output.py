"""A study's outputs: the ranked table (best first), CSV and JSON (one row per configuration with
every figure and its inputs), the Pareto front of step time against per-device memory or against
cost (chips x step) as a PNG, and the sensitivity table."""
from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence

from partir_emu.app.atomic import atomic_path, write_text_atomic
from partir_emu.app.plotting import new_figure
from partir_emu.app.study.evaluate import Row
from partir_emu.app.study.space import Config

COLUMNS = ("scenario", "size", "set", "strategy", "mesh", "chips", "hardware", "what_if", "status", "step_s",
           "compute_s", "exposed_comm_s", "mfu", "hfu", "peak_gib", "needed_gib", "hbm_gib", "fits", "chip_s",
           "placement", "des_step_s", "reason")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def _hw(c: Config) -> str:
    return c.hardware + (f"[{c.what_if.label}]" if c.what_if.edits else "")


def table(rows: Sequence[Row], top: int | None = None) -> str:
    """The ranked rows as text: the first ``top`` priced rows and every row that was not priced."""
    shown = [r for r in rows if r.priced][:top] if top else [r for r in rows if r.priced]
    lines = [f"{'#':>3}  {'step':>9}  {'MFU':>6}  {'peak GiB':>9}  {'chip-s':>9}  {'hardware':<22} {'chips':>5}  "
             f"{'strategy':<12} {'mesh':<20} {'set':<18} status"]
    for i, r in enumerate(shown, 1):
        f, c = r.figures, r.config
        mfu = "" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
        des = f"  DES {_ms(r.des_step_s)}" if r.des_step_s is not None else ""
        lines.append(f"{i:>3}  {_ms(f['step_s']):>9}  {mfu:>6}  {f['peak_gib']:>9.2f}  {f['chip_s']:>9.1f}  "
                     f"{_hw(c):<22} "
                     f"{c.mesh.size:>5}  {c.strategy:<12} {c.to_json()['mesh']:<20} {c.overrides or '':<18} "
                     f"{r.status}{' (' + r.reason + ')' if r.reason else ''}{des}")
    hidden = sum(r.priced for r in rows) - len(shown)
    if hidden > 0:
        lines.append(f"     ... {hidden} more priced configuration(s) in the CSV/JSON")
    for r in rows:
        if not r.priced:
            c = r.config
            lines.append(f"  -  {_hw(c)} {c.mesh.size} chips {c.strategy} {c.to_json()['mesh']} "
                         f"{c.overrides or ''}: {r.status}: {r.reason}")
    return "\n".join(lines)


def sensitivity_table(rows: Sequence[Row]) -> str:
    """Per configuration with a sensitivity: each field x2 and the step's change, largest first."""
    out = []
    for i, r in enumerate(rows, 1):
        if not r.sensitivity:
            continue
        c = r.config
        moved = sorted(r.sensitivity.items(), key=lambda kv: kv[1])
        out.append(f"{i:>3}  {_hw(c)} {c.mesh.size} chips {c.strategy} {c.to_json()['mesh']}: "
                   + ", ".join(f"{k} x2 {100 * v:+.1f}%" for k, v in moved))
    return "sensitivity (step change with one spec field doubled, the largest gain first):\n" + "\n".join(out) \
        if out else ""


def to_csv(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[*COLUMNS, "sensitivity"], extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        d = r.to_json()
        d["sensitivity"] = ";".join(f"{k}={v:.4f}" for k, v in r.sensitivity.items())
        w.writerow({k: ("" if d.get(k) is None else d.get(k)) for k in [*COLUMNS, "sensitivity"]})
    return buf.getvalue()


def write_csv(path: str | os.PathLike, rows: Sequence[Row]) -> None:
    write_text_atomic(path, to_csv(rows))


def pareto(rows: Sequence[Row], x: str = "peak_gib") -> list[Row]:
    """The rows no other fitting row beats on both the step and ``x`` (``peak_gib`` or ``chip_s``)."""
    pts = sorted((r for r in rows if r.status == "ok"), key=lambda r: (r.figures[x], r.figures["step_s"]))
    front, best = [], float("inf")
    for r in pts:
        if r.figures["step_s"] < best:
            front.append(r)
            best = r.figures["step_s"]
    return front


def plot(path: str | os.PathLike, rows: Sequence[Row], x: str = "peak_gib") -> None:
    """Step time against ``x`` for every priced row (those that do not fit hollow), the front joined."""
    fig = new_figure((7, 4.5))
    ax = fig.subplots()
    for hw in sorted({_hw(r.config) for r in rows if r.priced}):
        ok = [r for r in rows if _hw(r.config) == hw and r.status == "ok"]
        miss = [r for r in rows if _hw(r.config) == hw and r.status == "does not fit"]
        pts = ax.scatter([r.figures[x] for r in ok], [r.figures["step_s"] for r in ok], s=14, label=hw)
        ax.scatter([r.figures[x] for r in miss], [r.figures["step_s"] for r in miss], s=14,
                   facecolors="none", edgecolors=pts.get_facecolor()[0] if ok else None)
    front = pareto(rows, x)
    ax.plot([r.figures[x] for r in front], [r.figures["step_s"] for r in front], "k-", lw=1, label="Pareto front")
    ax.set_xlabel({"peak_gib": "peak memory per device (GiB)", "chip_s": "cost: chips x step (chip-seconds)"}[x])
    ax.set_ylabel("step time (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("partir-emu study (hollow: does not fit in HBM)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


__all__ = ["COLUMNS", "pareto", "plot", "sensitivity_table", "table", "to_csv", "write_csv"]

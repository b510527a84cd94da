"""Baselines: a prediction's figures snapshotted in a JSON file reviewed in git, and checked.

``Baselines.check(prediction)`` compares the prediction's figures
(:data:`~partir_emu.app.claims.prediction.FIGURES`) with the test's snapshot file and fails with one line
per figure that moved more than its tolerance::

    baseline tests/claims/baselines/test_zoo/test_mlp.json (mlp bp on batch=8 x tpu-v4 (xla)):
      step_s: 1.204 ms -> 1.391 ms (+15.5 % of the step; tolerance 2 %)
      collectives all_reduce@batch: 4 -> 5
    (if the change is intended: pytest --partir-update-baselines, then review the diff)

With ``update=True`` (pytest's ``--partir-update-baselines``) the file is (re)written instead and
the check passes. A missing file is a failure that says how to make it: a baseline is never taken
silently.

Tolerances (``DEFAULT_TOLERANCES``; a test passes its own): time figures move by at most that
fraction *of the baseline's step time* (so an exposed-communication figure near zero is not judged
by its own tiny size); ``peak_bytes`` and ``flops_per_device`` by that fraction of themselves;
``fits`` and every collective count must be equal.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partir_emu.app.atomic import write_json_atomic
from partir_emu.app.claims.assertions import ClaimFailed
from partir_emu.app.claims.prediction import FIGURES, TIME_FIGURES, Prediction
from partir_emu.errors import UsageError

DEFAULT_TOLERANCES: dict[str, float] = {"step_s": 0.02, "compute_s": 0.02, "exposed_comm_s": 0.02,
                                        "peak_bytes": 0.01, "flops_per_device": 0.001}
FORMAT = 1


def baseline_name(test_name: str, name: str = "") -> str:
    """A file name for a test (its parameters included) and an optional snapshot name."""
    stem = re.sub(r"[^A-Za-z0-9_.+=-]+", "_", test_name).strip("_") or "test"
    return f"{stem}-{re.sub(r'[^A-Za-z0-9_.+=-]+', '_', name)}.json" if name else f"{stem}.json"


def _fmt(key: str, v: Any) -> str:
    if key in TIME_FIGURES:
        return f"{v * 1e3:.4g} ms" if v < 1 else f"{v:.4g} s"
    if key == "peak_bytes":
        return f"{v / 2 ** 30:.4g} GiB"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def diff_figures(old: Mapping[str, Any], new: Mapping[str, Any], tolerances: Mapping[str, float]) -> list[str]:
    """One line per figure of ``new`` that differs from ``old`` beyond its tolerance."""
    lines: list[str] = []
    step = float(old.get("step_s") or 0.0)
    for key in FIGURES:
        if key not in old:
            lines.append(f"{key}: not in the baseline (now {_fmt(key, new[key])})")
            continue
        a, b = old[key], new[key]
        if key == "collectives":
            for k in sorted(set(a) | set(b)):
                if a.get(k, 0) != b.get(k, 0):
                    lines.append(f"collectives {k}: {a.get(k, 0)} -> {b.get(k, 0)}")
        elif key == "fits":
            if bool(a) != bool(b):
                lines.append(f"fits: {bool(a)} -> {bool(b)}")
        else:
            tol = float(tolerances.get(key, DEFAULT_TOLERANCES.get(key, 0.0)))
            scale = step if key in TIME_FIGURES else abs(float(a))
            moved = abs(float(b) - float(a))
            if moved > tol * scale + 1e-300:
                rel = (float(b) - float(a)) / scale if scale else float("inf")
                of = " of the step" if key in TIME_FIGURES else ""
                lines.append(f"{key}: {_fmt(key, a)} -> {_fmt(key, b)} ({100 * rel:+.1f} %{of}; "
                             f"tolerance {100 * tol:g} %)")
    return lines


class Baselines:
    """The snapshots of one test: files ``directory / baseline_name(test_name, name)``."""

    def __init__(self, directory: str | os.PathLike, test_name: str, *, update: bool = False,
                 tolerances: Mapping[str, float] | None = None,
                 update_with: str = "pytest --partir-update-baselines") -> None:
        self.directory = Path(directory)
        self.test_name = test_name
        self.update = update
        self.tolerances = {**DEFAULT_TOLERANCES, **(tolerances or {})}
        self.update_with = update_with       # the command that rewrites the snapshots, for the messages
        self.written: list[Path] = []

    def path(self, name: str = "") -> Path:
        return self.directory / baseline_name(self.test_name, name)

    def check(self, pred: Prediction, name: str = "", *, tolerances: Mapping[str, float] | None = None) -> None:
        """Compare ``pred`` with the snapshot ``name`` of this test (or write it, when updating)."""
        __tracebackhide__ = True      # pytest: show the figures that moved, not this frame
        tol = {**self.tolerances, **(tolerances or {})}
        unknown = set(tol) - set(DEFAULT_TOLERANCES)
        if unknown:
            raise UsageError(f"baseline tolerances: unknown figure(s) {sorted(unknown)}; tolerances apply to "
                             f"{sorted(DEFAULT_TOLERANCES)} (fits and collective counts are exact)")
        path = self.path(name)
        figures = pred.figures()
        if self.update:
            self._write(path, pred, figures, tol)
            return
        if not path.exists():
            raise ClaimFailed(f"no baseline {path} for {pred.label}: run {self.update_with} to "
                              f"write it, then review and commit it")
        try:
            data = json.loads(path.read_text())
            old = data["figures"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ClaimFailed(f"baseline {path} is not a partir-emu baseline ({exc}); rewrite it with "
                              f"{self.update_with}") from None
        lines = diff_figures(old, figures, tol)
        if lines:
            raise ClaimFailed(f"baseline {path} ({pred.label}):\n  " + "\n  ".join(lines)
                              + f"\n(if the change is intended: {self.update_with}, then review the diff)")

    def _write(self, path: Path, pred: Prediction, figures: dict[str, Any], tol: Mapping[str, float]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"format": FORMAT, "label": pred.label, "inputs": pred.inputs, "figures": figures,
                                 "tolerances": dict(sorted(tol.items()))})
        self.written.append(path)


__all__ = ["DEFAULT_TOLERANCES", "Baselines", "baseline_name", "diff_figures"]

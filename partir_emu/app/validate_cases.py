"""The validation suites: cases named by scenario, lowered here, compared by :mod:`partir_emu.hwmodels.des.validate`.

``run_suite(cases)`` lowers each program once (cached per scenario, size, strategy and
mesh, in memory and optionally on disk, see :class:`ProgramCache`), then compares the
analytical model and the DES on it (``hwmodels.des.validate.compare``) and gathers a
:class:`~partir_emu.hwmodels.des.validate.ValidationReport`.

The default suite (>= 20 cases, 8 to 2048 chips, TPU v4 and H100, MLP and
transformer strategies) runs in well under a CI minute budget; its acceptance
thresholds are ``MEDIAN_MAX`` and ``MAX_MAX`` with identical rankings.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from partir_emu.app.atomic import atomic_path
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import ArtifactError, PartirError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des.validate import MAX_MAX, MEDIAN_MAX, Case, CaseResult, ValidationReport, compare
from partir_emu.hwmodels.specs import load_spec


class ValidationError(PartirError):
    """An unknown suite or an unusable case."""


def _c(scenario: str, strategy: str, hardware: str, mesh: str, **kw: Any) -> Case:
    if scenario == "mlp":
        kw.setdefault("preset", "full")
        kw.setdefault("overrides", "layers=2")
    else:
        kw.setdefault("preset", "t32")
        kw.setdefault("overrides", "layers=2")
    return Case(scenario, strategy, hardware, mesh, **kw)


SUITES: dict[str, tuple[Case, ...]] = {
    "default": (
        # TPU v4 (3D torus; 8 and 64 chips without / with wraparound, 256 and 2048 chips)
        _c("mlp", "bp", "tpu-v4", "batch=8"),
        _c("mlp", "mp", "tpu-v4", "model=8"),
        _c("mlp", "bp+mp", "tpu-v4", "batch=2,model=4"),
        _c("mlp", "z3", "tpu-v4", "batch=8"),
        _c("mlp", "bp", "tpu-v4", "batch=64"),
        _c("mlp", "bp+mp", "tpu-v4", "batch=16,model=4"),
        _c("mlp", "bp+mp", "tpu-v4", "batch=8,model=8"),      # batch strided over y: its groups share links
        _c("mlp", "z3", "tpu-v4", "batch=64"),
        _c("transformer", "bp", "tpu-v4", "batch=256"),
        _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4"),
        _c("transformer", "bp+mp+z3", "tpu-v4", "batch=64,model=4"),
        _c("transformer", "bp+mp", "tpu-v4", "batch=16,model=16"),
        _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", placement="model=x,batch=yz"),
        _c("transformer", "bp+mp", "tpu-v4", "batch=64,model=4", overlap=True),
        _c("transformer", "bp+mp", "tpu-v4", "batch=128,model=16"),
        _c("transformer", "bp+mp+z3", "tpu-v4", "batch=128,model=16"),
        # H100 (NVSwitch nodes, InfiniBand fat tree)
        _c("mlp", "bp", "h100", "batch=8"),
        _c("mlp", "mp", "h100", "model=8"),
        _c("mlp", "bp+mp", "h100", "batch=2,model=4"),
        _c("mlp", "bp", "h100", "batch=64"),
        _c("mlp", "bp+mp", "h100", "batch=8,model=8"),
        _c("mlp", "z3", "h100", "batch=64"),
        _c("transformer", "bp", "h100", "batch=64"),
        _c("transformer", "bp+mp", "h100", "batch=8,model=8"),
        _c("transformer", "bp+mp+z3", "h100", "batch=8,model=8"),
        _c("transformer", "bp+mp", "h100", "batch=8,model=8", overlap=True),
        _c("transformer", "bp+mp", "h100", "batch=64,model=8"),
        _c("transformer", "bp+mp+z3", "h100", "batch=64,model=8"),
    ),
}
SUITES["quick"] = tuple(c for c in SUITES["default"] if c.devices <= 64 and c.scenario == "mlp")


def get_suite(name: str) -> tuple[Case, ...]:
    if name not in SUITES:
        raise ValidationError(f"unknown validation suite {name!r}; suites: {', '.join(sorted(SUITES))}")
    return SUITES[name]


# -- lowering (the only step that needs the compiler; Experiment.lower imports it) -----------------
class ProgramCache:
    """Lowered SpmdPrograms per (scenario, preset, overrides, strategy, mesh); on disk too if ``directory``."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self._mem: dict[tuple, Any] = {}
        self.lower_s = 0.0

    def get(self, case: Case) -> SpmdProgram:
        key = (case.scenario, case.preset, case.overrides, case.strategy, case.mesh)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        path = None
        if self.directory is not None:
            name = "_".join(str(k).replace("/", "-").replace(",", "-").replace("=", "") for k in key) + ".json"
            path = self.directory / name
            spmd = _load_cached(path)
            if spmd is not None:
                self._mem[key] = spmd
                return spmd
        t0 = time.perf_counter()
        spmd = Experiment(case.scenario, case.strategy, Mesh.parse(case.mesh), case.preset, case.overrides).lower().spmd
        self.lower_s += time.perf_counter() - t0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:     # a concurrent reader sees the old entry or the whole new one
                spmd.save(tmp)
        self._mem[key] = spmd
        return spmd


def _load_cached(path: Path) -> SpmdProgram | None:
    """The cached program at ``path``; None when there is none, or (with a one-line warning) when it is
    unreadable, e.g. truncated by a killed writer: it is then lowered again and rewritten."""
    if not path.is_file():
        return None
    try:
        return SpmdProgram.load(path)
    except (ArtifactError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        print(f"partir-emu validate: warning: ignoring unreadable cache entry {path} ({why}); lowering it again",
              file=sys.stderr)
        return None


def run_case(case: Case, programs: ProgramCache, analyzer: Analyzer | None = None, **des_kw: Any) -> CaseResult:
    """Lower (or reuse) the program of ``case`` and compare the two models on it."""
    return compare(case, programs.get(case), analyzer, **des_kw)


def run_suite(cases: Sequence[Case] | str = "default", *, cache_dir: str | os.PathLike | None = None,
              on_case: Callable[[int, int, CaseResult], None] | None = None, **des_kw: Any) -> ValidationReport:
    """Run every case; ``on_case(i, n, result)`` after each (for progress)."""
    name = cases if isinstance(cases, str) else "custom"
    cases = get_suite(cases) if isinstance(cases, str) else tuple(cases)
    programs = ProgramCache(cache_dir)
    analyzer = Analyzer()           # the suite's: specs, placements, prices and analyses shared by its cases
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        r = run_case(case, programs, analyzer, **des_kw)
        results.append(r)
        if on_case is not None:
            on_case(i, len(cases), r)
    return ValidationReport(name, tuple(results), time.perf_counter() - t0, programs.lower_s)


_FORMAT = ("write one JSON object per line with scenario, strategy, hardware, mesh (strings) and optional "
           "preset, overrides, placement (strings) and overlap (true/false)")
_STR_FIELDS = ("scenario", "strategy", "hardware", "mesh")
_OPT_STR_FIELDS = ("preset", "overrides", "placement")


def read_cases(path: str | os.PathLike) -> list[Case]:
    """The cases of a JSON-lines file, each checked (:func:`parse_cases`); errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_cases(f, str(path))
    except UnicodeDecodeError as exc:
        raise ValidationError(f"--cases {path}: not a text file (byte {exc.start} is not UTF-8); {_FORMAT}") from None
    except OSError as exc:
        raise ValidationError(f"--cases {path}: {exc.strerror}") from None


def parse_cases(lines: Iterable[str], where: str = "cases") -> list[Case]:
    """Cases from JSON lines (``{"scenario": ..., "strategy": ..., "hardware": ..., "mesh": ..., ...}``),
    each checked before any is run (scenario, size, strategy, mesh and hardware exist and fit)."""
    out = []
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        at = f"{where}: case line {i + 1}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{at}: not JSON ({exc}); {_FORMAT}") from None
        out.append(check_case(_case(d, at), at))
    if not out:
        raise ValidationError(f"{where}: no cases; {_FORMAT}")
    return out


def _case(d: Any, at: str) -> Case:
    if not isinstance(d, dict):
        raise ValidationError(f"{at}: a {type(d).__name__}, not a JSON object; {_FORMAT}")
    unknown = sorted(set(d) - set(_STR_FIELDS) - set(_OPT_STR_FIELDS) - {"overlap"})
    missing = [k for k in _STR_FIELDS if k not in d]
    if unknown or missing:
        raise ValidationError(f"{at}: " + (f"unknown field {unknown[0]!r}" if unknown else f"no {missing[0]!r}")
                              + f"; {_FORMAT}")
    bad = [k for k in _STR_FIELDS if not isinstance(d[k], str)]
    bad += [k for k in _OPT_STR_FIELDS if d.get(k) is not None and not isinstance(d[k], str)]
    if "overlap" in d and not isinstance(d["overlap"], bool):
        bad.append("overlap")
    if bad:
        raise ValidationError(f"{at}: field {bad[0]!r} is {d[bad[0]]!r}; {_FORMAT}")
    return Case(**d)


def check_case(case: Case, at: str) -> Case:
    """``case`` if everything it names exists and fits (without lowering); else ValidationError naming ``at``."""
    try:
        mesh = Mesh.parse(case.mesh)
        spec = load_spec(case.hardware)
        if mesh.size > spec.network.max_chips:
            raise ValidationError(f"mesh {case.mesh} has {mesh.size} devices but {spec.name} has at most "
                                  f"{spec.network.max_chips} chips")
        exp = Experiment(case.scenario, case.strategy, mesh, case.preset, case.overrides)
        exp.scenario.strategy(case.strategy, mesh, exp.cfg)
    except PartirError as exc:
        raise ValidationError(f"{at}: {exc}") from None
    return case


__all__ = ["MAX_MAX", "MEDIAN_MAX", "SUITES", "Case", "CaseResult", "ProgramCache", "ValidationError",
           "ValidationReport", "check_case", "get_suite", "parse_cases", "read_cases", "run_case", "run_suite"]

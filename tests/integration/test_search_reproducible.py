"""The searches stop on counts, never on the clock: the same command gives the same decisions,
runner-up and price on a fast machine and on a loaded one.

"Loaded" is made deterministic here: the modules' clocks are replaced by one that advances
1,000 s at every reading, so any wall-clock limit would fire at once."""
from __future__ import annotations

import dataclasses
import itertools
import types

import pytest

from partir_emu.api import lower_program
from partir_emu.app.experiment import Experiment
from partir_emu.compiler.auto import search as auto_search
from partir_emu.compiler.tactics import AutomaticPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import TacticError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.machine import search as placement_search
from partir_emu.hwmodels.machine.specs import load_spec


def _slow_clock() -> types.SimpleNamespace:
    ticks = itertools.count()
    return types.SimpleNamespace(perf_counter=lambda: 1000.0 * next(ticks))


def _auto(exp: Experiment) -> list:
    low = exp.lower()
    return [(label, r.decisions, r.cost, r.runner_up, r.evaluations, r.stopped)
            for label, r in low.final_state.auto_results]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,mesh", [("mlp", "batch=2,model=2"), ("gns", "batch=2,model=2")])
def test_auto_partition_gives_the_same_strategy_however_slow_the_clock(monkeypatch, scenario, mesh):
    quiet = _auto(Experiment(scenario, "bp+auto", Mesh.parse(mesh), "tiny"))
    monkeypatch.setattr(auto_search, "time", _slow_clock())
    loaded = _auto(Experiment(scenario, "bp+auto", Mesh.parse(mesh), "tiny"))
    assert quiet and loaded == quiet
    assert all(stopped != "time" for *_, stopped in quiet)


def _with_time_limit(exp: Experiment, seconds: float) -> list:
    return [dataclasses.replace(t, seconds=seconds) if isinstance(t, AutomaticPartition) else t for t in exp.schedule]


def test_a_time_limit_is_a_safety_net_that_says_so(monkeypatch):
    monkeypatch.setattr(auto_search, "time", _slow_clock())
    exp = Experiment("mlp", "bp+auto", Mesh(batch=2, model=2), "tiny")
    low = lower_program(exp.program, exp.mesh, _with_time_limit(exp, 5.0), dict(exp.scenario.state_outputs))
    (label, res), = low.final_state.auto_results
    assert res.stopped == "time"
    assert "not reproducible" in res.report(label)
    with pytest.raises(TacticError, match="seconds=0"):
        lower_program(exp.program, exp.mesh, _with_time_limit(exp, 0.0), dict(exp.scenario.state_outputs))


def test_placement_search_gives_the_same_choice_however_slow_the_clock(monkeypatch):
    spmd = Experiment("mlp", "bp+mp", Mesh(batch=16, model=4), preset="small").lower().spmd
    spec = load_spec("tpu-v4")
    quiet = placement_search.search_placement(spmd, spec, Analyzer())
    monkeypatch.setattr(placement_search, "time", _slow_clock())
    loaded = placement_search.search_placement(spmd, spec, Analyzer())
    assert (loaded.mapping, loaded.step_s, loaded.runner_up_mapping, loaded.candidates) == \
        (quiet.mapping, quiet.step_s, quiet.runner_up_mapping, quiet.candidates)

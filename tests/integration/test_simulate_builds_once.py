"""One ``partir-emu simulate`` builds the hardware it prices once: one topology, and
each placement it prices built once (an explicit placement: exactly one), however many stages
(the early check of ``--placement``, the placement search, the simulation) look at them.

Counted by wrapping the constructors (every build goes through them), on the CLI in-process.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from partir_emu.app.cli.main import main
from partir_emu.hwmodels.machine import placement as placement_mod
from partir_emu.hwmodels.machine import topology as topology_mod

pytestmark = pytest.mark.xdist_group("simulate-once")

RUN = ["simulate", "transformer", "--size", "tiny", "--strategy", "bp+mp", "--mesh", "batch=2,model=2",
       "--hardware", "tpu-v4", "--quiet"]


@pytest.fixture
def builds(monkeypatch):
    counts: Counter[str] = Counter()
    for mod, cls in ((topology_mod, "Topology"), (placement_mod, "Placement")):
        real = getattr(mod, cls).__init__

        def counted(self, *a, _real=real, _name=cls, **k):
            counts[_name] += 1
            _real(self, *a, **k)
        monkeypatch.setattr(getattr(mod, cls), "__init__", counted)
    return counts


@pytest.mark.parametrize("placement", ["model=x,batch=y", "default"])
def test_an_explicit_placement_is_built_once_on_one_topology(builds, placement, tmp_path, capsys):
    assert main([*RUN, "--placement", placement, "--report", str(tmp_path / "r.json")]) == 0
    assert builds["Topology"] == 1, builds
    assert builds["Placement"] == 1, builds


def test_the_search_builds_each_candidate_once_on_one_topology(builds, tmp_path, capsys):
    assert main([*RUN, "--placement", "auto", "--report", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    candidates = len(rep["placement_search"]["candidates"])
    assert builds["Topology"] == 1, builds
    assert builds["Placement"] == candidates, (builds, candidates)

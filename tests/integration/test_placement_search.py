"""Placement warnings (structural), the placement search (against brute force and a human's choice),
part-of-a-dim mapping strings, and ``--placement auto | default | explicit`` on the command line."""
from __future__ import annotations

import json

import pytest

from partir_emu.app.cli.main import main
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh
from partir_emu.errors import PlacementError
from partir_emu.hwmodels.analytical import Analyzer, simulate
from partir_emu.hwmodels.machine.placement import Placement, place
from partir_emu.hwmodels.machine.search import enumerate_placements, resolve_placement, search_placement
from partir_emu.hwmodels.machine.slices import topology_for
from partir_emu.hwmodels.machine.specs import load_spec
from tests.unit.test_hw_analytical import MM, Builder

pytestmark = pytest.mark.xdist_group("placement_search")    # its cached programs and references: made once, on one worker

V4 = load_spec("tpu-v4")
H100 = load_spec("h100")


@pytest.fixture(scope="module")
def mlp_256():
    """mlp bp+mp on batch=64,model=4 (256 chips): the issue's mesh shape."""
    return Experiment("mlp", "bp+mp", Mesh(batch=64, model=4), preset="small").lower().spmd


@pytest.fixture(scope="module")
def mlp_h100():
    return Experiment("mlp", "bp+mp", Mesh(batch=8, model=8), preset="small").lower().spmd


# -- warnings (structural) ----------------------------------------------------------------------------
def test_default_fill_on_4x4x16_puts_two_axes_on_z():
    pl = place(Mesh(batch=64, model=4), V4, slice_dims=(4, 4, 16))
    assert pl.mapping_text() == "batch=x+y+z[4],model=z[4]"
    shared = [w for w in pl.warnings() if w.kind == "shared_dim"]
    assert [(w.axes, w.dim) for w in shared] == [(("batch", "model"), "z")]
    assert "mesh axes batch and model both lie on z (4x4 of 16)" in shared[0].text
    assert ("model",) in [w.axes for w in pl.warnings() if w.kind == "open_line"]     # x=4 would be a ring
    good = place(Mesh(batch=64, model=4), V4, "model=x,batch=y+z", slice_dims=(4, 4, 16))
    assert good.warnings() == ()


def test_gpu_axis_across_nodes_warns():
    swapped = place(Mesh(batch=8, model=8), H100, "batch=gpu,model=node")
    [w] = swapped.warnings()
    assert w.kind == "across_nodes" and w.axes == ("model",) and "spans 8 nodes" in w.text
    assert "InfiniBand" in w.text
    assert place(Mesh(batch=64), H100).warnings() == ()        # cannot fit in a node: nothing to warn about
    assert place(Mesh(batch=4, model=2), H100).warnings() == ()    # one node


# -- mapping strings with parts of a dim --------------------------------------------------------------
def test_part_of_a_dim_mapping_and_round_trip():
    mesh, topo = Mesh(batch=64, model=4), topology_for(V4, 256, (4, 4, 16))
    minor = Placement(mesh, topo, "batch=x+y+z[4],model=z[4]")      # listed later: minor (stride 1)
    assert minor.key == Placement(mesh, topo).key                     # that is the default fill
    major = Placement(mesh, topo, "model=z[4],batch=x+y+z[4/16]")
    assert major.group(("model",)).chips == (0, 4, 8, 12) and minor.group(("model",)).chips == (0, 1, 2, 3)
    places, n = enumerate_placements(mesh, topo, limit=1000)
    assert n >= len(places) > 4 and places[0].key == minor.key       # the default fill first
    for p in places:                                                  # every candidate's text gives it back
        assert Placement(mesh, topo, p.mapping_text()).key == p.key


@pytest.mark.parametrize("mapping, match", [
    ("model=z[3],batch=x+y+z[4]", r"takes 3 positions of z=16; use a divisor of 16"),
    ("model=z[4],batch=x+y+z[2]", r"z=16 .* is split into 4x2=8 positions"),
    ("model=z[4/8],batch=x+y+z[4]", r"says z has 8 positions but it has 16"),
    ("model=z,batch=x+y+z[4]", r"physical dim 'z' is given to both 'model' and 'batch'"),
    ("model=q[4],batch=x+y+z", r"'q' is not a physical dim"),
    ("model=z[ab],batch=x+y+z[4]", r"'z\[ab\]' is not a dim or a part of one; write e.g. \"z\" .* \"z\[2\]\""),
    ("auto", r"placement 'auto' is chosen by pricing a program"),
])
def test_bad_mapping_text(mapping, match):
    with pytest.raises(PlacementError, match=match):
        Placement(Mesh(batch=64, model=4), topology_for(V4, 256, (4, 4, 16)), mapping)


def test_enumeration_drops_symmetric_twins():
    topo = topology_for(V4, 64, (4, 4, 4))
    places, _ = enumerate_placements(Mesh(batch=16, model=4), topo, limit=1000)
    texts = [p.mapping_text() for p in places]
    # x, y and z are interchangeable on 4x4x4: model on one whole dim is one candidate, not three
    assert sum(1 for t in texts if t.endswith("model=x") or t.endswith("model=y") or t.endswith("model=z")
               or t.startswith("model=x,") or t.startswith("model=y,") or t.startswith("model=z,")) == 1
    assert len(set(texts)) == len(texts)


# -- the search ---------------------------------------------------------------------------------------
def _brute_force(spmd, spec, slice_dims=None):
    an = Analyzer()
    topo = topology_for(spec, spmd.mesh.size, slice_dims)
    places, _ = enumerate_placements(spmd.mesh, topo, limit=10_000)
    return {p.mapping_text(): simulate(spmd, spec, p, analyzer=an).step_s for p in places}


def test_search_picks_the_cheapest_on_4x4x16(mlp_256):
    choice = search_placement(mlp_256, V4, Analyzer(), slice_dims=(4, 4, 16), limit=10_000)
    brute = _brute_force(mlp_256, V4, (4, 4, 16))
    assert dict(choice.candidates) == pytest.approx(brute, rel=1e-12)
    assert choice.step_s == pytest.approx(min(brute.values()), rel=1e-12)
    assert choice.runner_up_step_s == sorted(brute.values())[1]
    assert choice.default_mapping == "batch=x+y+z[4],model=z[4]"
    human = simulate(mlp_256, V4, "model=x,batch=y+z", slice_dims=(4, 4, 16)).step_s
    assert choice.step_s <= human * (1 + 1e-12) and choice.step_s < choice.default_step_s
    assert choice.mapping != choice.default_mapping          # the two-axes-on-z default is avoided
    assert any("both lie on z" in w and "x the best one" in w for w in choice.default_warnings)
    assert Placement(mlp_256.mesh, choice.best.topology, choice.mapping).key == choice.best.key
    assert choice.search_s > 0 and choice.candidates[0] == (choice.mapping, choice.step_s)
    lines = choice.lines()
    assert lines[0].startswith(f"placement: {choice.mapping}  step ") and lines[1].startswith("runner-up: ")
    assert lines[2].startswith(f"default fill: {choice.default_mapping}") and "searched 7 placements" in lines[-1]


def test_search_on_gpus_prices_the_across_node_axis(mlp_h100):
    choice = search_placement(mlp_h100, H100, Analyzer())
    brute = _brute_force(mlp_h100, H100)
    assert choice.step_s == pytest.approx(min(brute.values()), rel=1e-12)
    human = brute["batch=node,model=gpu"]           # tensor parallel inside the node
    assert choice.step_s <= human
    swapped = brute["batch=gpu,model=node"]
    assert swapped > choice.step_s                  # model's all-reduces over InfiniBand cost more
    placement, search, warnings = resolve_placement(mlp_h100, H100, "batch=gpu,model=node")
    assert placement.mapping_text() == "batch=gpu,model=node" and search is not None
    [w] = warnings
    assert w.startswith("mesh axis model=8 spans 8 nodes") and \
        f"this placement costs {swapped / choice.step_s:.2f}x the best one ({choice.mapping})" in w


def test_ties_prefer_the_default_fill_then_the_text():
    # no collectives: every placement costs the same, so the default fill wins, then the first text
    b = Builder()
    x, w = b.input("x", (256, 256)), b.input("w", (256, 256))
    spmd = b.build([b.eq("dot_general", (x, w), (256, 256), dimension_numbers=MM)], Mesh(a=4, b=16))
    choice = search_placement(spmd, V4, Analyzer())
    assert len(choice.candidates) > 2 and len({s for _, s in choice.candidates}) == 1
    assert choice.mapping == choice.default_mapping == "a=x,b=y+z"
    rest = [t for t, _ in choice.candidates[1:]]
    assert choice.runner_up_mapping == rest[0] == min(rest) and rest == sorted(rest)
    assert choice.warnings == () and choice.default_warnings == ()


def test_library_default_is_still_the_fill(mlp_256):
    rep = simulate(mlp_256, V4, slice_dims=(4, 4, 16))
    assert rep.placement == place(mlp_256.mesh, V4, slice_dims=(4, 4, 16)).describe()


# -- command line -------------------------------------------------------------------------------------
SMALL = ["mlp", "--strategy", "bp+mp", "--size", "small", "--mesh", "batch=64,model=4", "--slice", "4x4x16"]


def test_cli_auto_prints_choice_and_runner_up(capsys, tmp_path):
    path = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "placement (auto): " in out and "runner-up: " in out and "default fill avoided: mesh axes batch" in out
    rep = json.loads(path.read_text())
    search = rep["placement_search"]
    assert rep["placement_mode"] == "auto" and rep["placement_mapping"] == search["mapping"]
    assert rep["step_s"] == pytest.approx(search["step_s"], rel=1e-12)
    assert search["runner_up"] and search["runner_up_step_s"] >= search["step_s"]
    assert f"placement (auto): {search['mapping']}" in out


def test_cli_explicit_and_default_win_over_auto(capsys, tmp_path):
    path = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, "--placement", "model=x,batch=y+z", "--report", str(path)]) == 0
    rep = json.loads(path.read_text())
    assert rep["placement_mode"] == "explicit" and rep["placement"].startswith("batch=y+z, model=x")
    assert rep["placement_search"] is None and rep["placement_warnings"] == []
    capsys.readouterr()
    assert main(["simulate", *SMALL, "--placement", "default", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["placement_mode"] == "default" and rep["placement_mapping"] == "batch=x+y+z[4],model=z[4]"
    assert "warning: placement: mesh axes batch and model both lie on z (4x4 of 16)" in out
    assert "the best one (" in out and "best found: " in out


def test_cli_bad_placement_is_a_clear_error(capsys):
    assert main(["simulate", *SMALL, "--placement", "model=z[3],batch=x+y+z"]) == 2
    assert "use a divisor of 16" in capsys.readouterr().err
    assert main(["simulate", *SMALL, "--placement", "model"]) == 2
    assert "is not AXIS=DIMS" in capsys.readouterr().err


def test_simulate_des_runs_on_the_chosen_placement(capsys, tmp_path):
    path = tmp_path / "des.json"
    assert main(["simulate-des", "mlp", "--strategy", "bp+mp", "--size", "tiny", "--mesh", "batch=8,model=8",
                 "--hardware", "h100", "--report", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["placement_mode"] == "auto" and "placement (auto): " in out
    assert rep["analytical_s"] == pytest.approx(rep["placement_search"]["step_s"], rel=1e-12)

"""The DES on whole programs: agreement with the analytical model, SPMD symmetry, options, trace, report."""
from __future__ import annotations

import functools
import io
import json

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import Placement, load_spec, place, simulate
from partir_emu.hwmodels.des import DesError, DesOptions, simulate_des
from partir_emu.hwmodels.des.model import Simulation
from partir_emu.hwmodels.des.report import Progress
from partir_emu.hwmodels.machine.links import FaultError
from tests.unit.test_des_collectives import ring_topo, torus_topo

pytestmark = pytest.mark.xdist_group("des_model")    # its cached programs and references: made once, on one worker


@functools.cache
def lowered(scenario: str, strategy: str, mesh: str, preset: str = "tiny", overrides: str | None = None):
    from partir_emu.app.experiment import Experiment
    return Experiment(scenario, strategy, Mesh.parse(mesh), preset, overrides).lower().spmd


@pytest.mark.parametrize("hardware", ["tpu-v4", "h100"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("scenario, strategy, mesh", [
    ("mlp", "bp+mp", "batch=2,model=4"),
    ("transformer", "bp+mp+z3", "batch=2,model=4"),
    ("transformer", "z2", "batch=8"),
])
def test_whole_step_equals_analytical_where_nothing_contends(scenario, strategy, mesh, overlap, hardware):
    spmd = lowered(scenario, strategy, mesh)
    ana = simulate(spmd, hardware, overlap=overlap)
    des = simulate_des(spmd, hardware, overlap=overlap)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)
    assert des.compute_s == pytest.approx(ana.compute_s, rel=1e-9)
    assert len(des.collectives) == len(ana.collectives)
    for a, d in zip(ana.collectives, des.collectives):
        assert (a.index, a.prim, a.axes, a.nbytes) == (d.index, d.prim, d.axes, d.nbytes)
        assert d.duration_s == pytest.approx(a.time_s, rel=1e-9, abs=1e-15)
    assert sum(d.duration_s for d in des.collectives) == pytest.approx(ana.comm_s, rel=1e-9)
    assert des.comm_s <= ana.comm_s * (1 + 1e-9)   # device 0 may leave a tiny all-reduce early
    assert des.classes == 1                    # lock step: one equivalence class all along


def test_symmetry_shortcut_equals_one_process_per_device():
    """With a straggler the devices fall into several classes; the class-based simulation (no merge
    window) must give every device the same timeline as one process per device."""
    spmd = lowered("transformer", "bp+mp", "batch=4,model=2")
    spec = load_spec("tpu-v4")
    pl = place(spmd.mesh, spec)
    runs = []
    for symmetry in (True, False):
        sim = Simulation(spmd, spec, pl, True, None,
                         DesOptions(stragglers={3: 1.3, 6: 0.9}, merge_window_s=0.0, symmetry=symmetry))
        rep = sim.run()
        runs.append((rep, sim.device_end.copy(), [r.t_end.copy() for r in sim.runs]))
    (r1, end1, t1), (r2, end2, t2) = runs
    assert r1.step_s == r2.step_s
    np.testing.assert_array_equal(end1, end2)
    for a, b in zip(t1, t2):
        np.testing.assert_array_equal(a, b)
    assert r2.classes == spmd.mesh.size and 1 < r1.classes < spmd.mesh.size
    assert r1.step_s > simulate(spmd, spec, pl, overlap=True).step_s


def test_merge_window_keeps_the_step_time():
    """A scalar all-reduce desynchronizes the pod by microseconds; merging devices released within the
    window changes the step by less than the window (here: not measurably)."""
    spmd = lowered("transformer", "bp+mp", "batch=16,model=4", "t32", "layers=1")
    exact = simulate_des(spmd, "tpu-v4", merge_window_s=0.0)
    merged = simulate_des(spmd, "tpu-v4")
    assert merged.step_s == pytest.approx(exact.step_s, rel=1e-6)
    assert merged.classes <= exact.classes


def test_contention_is_reported_per_collective_and_link():
    """The axis-across-dims case of test_des_collectives inside a program: the report names the link."""
    from tests.unit.test_des_collectives import Prog
    pl = Placement(Mesh(b=8, a=2), torus_topo((4, 4)))
    b = Prog(pl.mesh)
    x = b.input((1 << 20,))
    spmd = b.build([b.coll("all_reduce", x, ("b",))])
    rep = simulate_des(spmd, "tpu-v4", pl)
    (row,) = rep.collectives
    assert row.contention == "groups" and "ici y+" in row.worst_link
    assert "flows of its groups" in rep.table()
    util = np.array(rep.link_utilization)
    assert util.max() <= 1 + 1e-9 and rep.max_link_utilization == pytest.approx(util.max())
    assert rep.links_used == int((util > 0).sum())


def test_chunk_network_agrees_with_flows_on_a_program():
    spmd = lowered("mlp", "bp+mp", "batch=2,model=4")
    flow = simulate_des(spmd, "tpu-v4")
    for chunk in (1 << 12, 1 << 16):
        ch = simulate_des(spmd, "tpu-v4", network="chunk", chunk_bytes=chunk)
        assert ch.step_s == pytest.approx(flow.step_s, rel=0.02)
        assert ch.network == "chunk"


def test_options_are_checked():
    spmd = lowered("mlp", "bp", "batch=4")
    for kw, msg in ((dict(network="packet"), "unknown DES network"), (dict(comm_streams=0), "comm_streams"),
                    (dict(stragglers={1: 0}), "slow-down factor"), (dict(merge_window_s=-1), "merge_window_s"),
                    (dict(degraded_links={"0->1": 0}), "factor 0"), (dict(failed_links=("zz",)), "SRC->DST")):
        with pytest.raises((DesError, FaultError), match=msg):    # link faults are both models' input
            simulate_des(spmd, "tpu-v4", Placement(spmd.mesh, ring_topo(4)), **kw)
    with pytest.raises(DesError, match="not both"):
        simulate_des(spmd, "tpu-v4", options=DesOptions(), comm_streams=2)


def _check_chrome_trace(trace: dict, step_s: float, devices: list[int]) -> None:
    """The Chrome trace-event format: a traceEvents list of dicts with ph, pid, ts (µs), and per phase
    X: name, tid, dur >= 0; C: name, numeric args; M: process_name / thread_name with args.name."""
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    seen_tids = set()
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "C", "M") and isinstance(e["pid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
            continue
        assert isinstance(e["name"], str) and isinstance(e["ts"], (int, float))
        assert -1e-6 <= e["ts"] <= step_s * 1e6 * (1 + 1e-9) + 1e-6
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0
            assert e["ts"] + e["dur"] <= step_s * 1e6 * (1 + 1e-9) + 1e-6
            seen_tids.add(e["tid"])
        else:
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    for d in devices:
        assert 2 * d in seen_tids and 2 * d + 1 in seen_tids      # compute and comm tracks


def test_chrome_trace_is_valid(tmp_path):
    spmd = lowered("transformer", "bp+mp", "batch=2,model=4")
    path = tmp_path / "t.json"
    rep = simulate_des(spmd, "h100", overlap=True, trace_path=str(path), trace_devices=3, stragglers={6: 1.2},
                       degraded_links={"0->nvswitch0": 0.5})
    trace = json.loads(path.read_text())
    _check_chrome_trace(trace, rep.step_s, [0, 1, 2, 6])
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert "nvlink gpu0->nvswitch0" in counters
    assert any(e["ph"] == "X" and e.get("cat") == "collective" for e in trace["traceEvents"])


def test_progress_bar_only_when_asked(capsys):
    spmd = lowered("mlp", "bp+mp", "batch=2,model=4")
    simulate_des(spmd, "tpu-v4", progress=True)
    assert "DES [" in capsys.readouterr().err
    simulate_des(spmd, "tpu-v4", progress=False)
    assert capsys.readouterr().err == ""
    buf = io.StringIO()                       # auto mode: not a tty -> silent
    p = Progress(10, "x", None, buf)
    p.update(5, force=True)
    p.close()
    assert buf.getvalue() == ""


def test_report_json_roundtrip():
    spmd = lowered("mlp", "bp+mp", "batch=2,model=4")
    rep = simulate_des(spmd, "tpu-v4", stragglers={1: 1.5})
    d = json.loads(rep.dumps())
    for k in ("step_s", "compute_s", "comm_s", "collectives", "top_links", "events", "events_per_s", "options"):
        assert k in d
    assert d["options"]["stragglers"] == {"1": 1.5}
    assert d["device_end_max_s"] == pytest.approx(rep.step_s)


def test_busy_link_counters_are_bucketed():
    from partir_emu.hwmodels.des.report import _bucket_means
    means = _bucket_means([(0.0, 1.0), (1.0, 0.0), (1.5, 0.5)], np.array([0.0, 0.5, 1.0, 2.0]))
    np.testing.assert_allclose(means, [1.0, 1.0, 0.25])           # (0.5·0 + 0.5·0.5) / 1
    spmd = lowered("transformer", "bp+mp", "batch=2,model=4")
    sim = Simulation(spmd, load_spec("tpu-v4"), place(spmd.mesh, load_spec("tpu-v4")), False, None,
                     DesOptions(trace=True, trace_devices=2))
    sim.recorder.max_points = 20
    rep = sim.run()
    trace = sim.chrome_trace()
    _check_chrome_trace(trace, rep.step_s, [0, 1])
    per_link: dict[str, int] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            per_link[e["name"]] = per_link.get(e["name"], 0) + 1
    assert per_link and max(per_link.values()) <= 20

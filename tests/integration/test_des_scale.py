"""The DES at scale: the aggregated path (shared step shapes, symmetric flow classes, eager rate
updates) gives the step times of the reference path (``aggregate=False``) to 1e-9, on rings, tori,
GPU nodes, with a straggler and with a degraded or failed link; long runs show progress on stderr."""
from __future__ import annotations

import io

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import Placement, load_spec, place
from partir_emu.hwmodels.des import DesOptions, simulate_des
from partir_emu.hwmodels.des import classes as classes_mod
from partir_emu.hwmodels.des import report as progress_mod
from partir_emu.hwmodels.des.model import Simulation
from partir_emu.hwmodels.des.report import Progress
from tests.integration.test_des_model import lowered
from tests.unit.test_des_collectives import one_collective, ring_topo


def _same(spmd, spec, placement=None, algorithms=None, overlap=False, **kw):
    """The aggregated and the reference DES on one input: every time they report, to 1e-9."""
    fast = simulate_des(spmd, spec, placement, overlap, algorithms=algorithms, **kw)
    ref = simulate_des(spmd, spec, placement, overlap, algorithms=algorithms, aggregate=False, **kw)
    assert fast.options["aggregate"] and not ref.options["aggregate"]
    assert fast.step_s == pytest.approx(ref.step_s, rel=1e-9)
    assert fast.device_end_min_s == pytest.approx(ref.device_end_min_s, rel=1e-9)
    assert len(fast.collectives) == len(ref.collectives)
    for a, b in zip(fast.collectives, ref.collectives):
        assert (a.index, a.prim, a.axes, a.algorithm, a.steps) == (b.index, b.prim, b.axes, b.algorithm, b.steps)
        assert a.start_s == pytest.approx(b.start_s, rel=1e-9, abs=1e-15)
        assert a.end_s == pytest.approx(b.end_s, rel=1e-9, abs=1e-15)
        assert a.duration_s == pytest.approx(b.duration_s, rel=1e-9, abs=1e-15)
        # the worst link is one of those with the most flows: among equals, which one depends on flow order
        assert (a.max_link_flows, a.own_link_flows, a.group_link_flows, bool(a.worst_link)) == \
            (b.max_link_flows, b.own_link_flows, b.group_link_flows, bool(b.worst_link))
    np.testing.assert_allclose(fast.link_utilization, ref.link_utilization, rtol=1e-9, atol=1e-15)
    assert fast.flows == ref.flows
    return fast, ref


def _class_runs(spmd, spec, placement, algorithms=None, **kw) -> tuple[int, int, bool]:
    """(runs over member classes, runs, classes still on at the end) of one aggregated simulation."""
    sim = Simulation(spmd, spec, placement, False, algorithms, DesOptions(**kw))
    sim.run()
    return sum(r.classes is not None for r in sim.runs), len(sim.runs), sim.use_classes


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algorithm", ["ring", "bidir_ring", "recursive"])
def test_ring_collectives_aggregated_equal_reference(kind, algorithm):
    p = 12                                   # uneven chunks: steps of one shape differ in bytes
    pl = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(pl.mesh, kind, ("x",), p * p * 4 * 1001)
    _same(spmd, load_spec("tpu-v4"), pl, algorithm)


@pytest.mark.parametrize("kind", KINDS)
def test_torus_groups_sharing_dimensions_aggregated_equal_reference(kind):
    spec = load_spec("tpu-v4")               # two axes on one torus dimension: groups contend
    pl = place(Mesh(a=4, b=4, c=4), spec, "a=x,b=y,c=z")
    spmd = one_collective(pl.mesh, kind, ("b", "c"), 16 * 16 * 4 * 512)
    _same(spmd, spec, pl, "ring")
    _same(spmd, spec, pl, "torus")


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", None])
def test_gpu_nodes_aggregated_equal_reference(algorithm):
    """64 H100s in 8 nodes, two nodes per leaf switch: NVLink inside, InfiniBand across (a spine hop
    between leaves): members run ahead of each other inside a step."""
    spec = load_spec("h100", {"topology.nodes_per_leaf": 2})
    pl = place(Mesh(x=64), spec)
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), 64 * 4 * 3001)
    fast, ref = _same(spmd, spec, pl, algorithm)
    assert fast.events < ref.events          # the eager rate updates save events, not time
    assert _class_runs(spmd, spec, pl, algorithm) == (1, 1, True)


def test_classes_are_few_on_a_symmetric_ring_and_off_where_nothing_repeats():
    spec = load_spec("h100", {"topology.nodes_per_leaf": 2})
    pl = place(Mesh(x=128), spec)
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), 128 * 4 * 64)
    sim = Simulation(spmd, spec, pl, False, "ring", DesOptions())
    sim.run()
    run = sim.runs[0]
    assert run.classes is not None and run.M == 16     # position in a leaf of 2 nodes x 8 GPUs
    assert run.N == 128 and run.classes.size.sum() == 128
    p = 8                                              # a ring with one degraded link: no two members alike
    ring = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(ring.mesh, "all_gather", ("x",), 64 << 10)
    assert _class_runs(spmd, load_spec("tpu-v4"), ring, "ring", degraded_links={"3->4": 0.5}) == (0, 1, True)


def test_broken_symmetry_falls_back_to_members_with_the_same_answer(monkeypatch):
    """Blind the refinement to link capacities: the degraded link's flow lands in a class with
    full-speed flows, the network sees their rates differ, that batch goes on flow by flow and the
    collective member by member, with the reference path's answer."""
    real = classes_mod._static_keys
    monkeypatch.setattr(classes_mod, "_static_keys",
                        lambda plan, router: classes_mod._ids(plan.nbytes, plan.rank))
    p = 16
    pl = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), 64 << 20)
    spec = load_spec("tpu-v4")
    sim = Simulation(spmd, spec, pl, False, "ring", DesOptions(degraded_links={"3->4": 0.25}))
    sim.run()
    assert sim.network.splits >= 1 and sim.runs[0].classes is None    # the run went on member by member
    _same(spmd, spec, pl, "ring", degraded_links={"3->4": 0.25})
    monkeypatch.setattr(classes_mod, "_static_keys", real)
    assert _class_runs(spmd, spec, pl, "ring") == (1, 1, True)


@pytest.mark.slow
def test_whole_steps_with_straggler_and_faults_aggregated_equal_reference():
    spmd = lowered("transformer", "bp+mp+z3", "batch=2,model=4")
    for hw in ("tpu-v4", "h100"):
        _same(spmd, hw, overlap=True)
        _same(spmd, hw, overlap=True, stragglers={3: 1.7})
        _same(spmd, hw, overlap=True, comm_streams=2, stragglers={0: 1.3})
    spmd = lowered("mlp", "bp+mp", "batch=8,model=8")
    _same(spmd, "tpu-v4", overlap=True, degraded_links={"#5": 0.25})
    _same(spmd, "tpu-v4", overlap=False, failed_links=("#7",), stragglers={9: 2.0})
    _same(spmd, "h100", overlap=True, message_overhead_s=2e-6)


def test_degraded_link_ring_aggregated_equal_reference():
    p = 8
    pl = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), 64 << 20)
    fast, _ = _same(spmd, load_spec("tpu-v4"), pl, "ring", degraded_links={"3->4": 0.5})
    assert "x0.5 bandwidth" in fast.faults[0]


def test_progress_is_shown_on_stderr_for_a_long_run(monkeypatch, capsys):
    """Auto mode (the command line's default) stays silent for short runs and reports long ones:
    here 'long' is forced by a zero threshold, so the test does not depend on the machine's speed."""
    spmd = lowered("mlp", "bp+mp", "batch=2,model=4")
    simulate_des(spmd, "tpu-v4", progress=None)
    assert capsys.readouterr().err == ""     # shorter than the 5 s threshold
    monkeypatch.setattr(progress_mod, "AUTO_DELAY_S", 0.0)
    monkeypatch.setattr(progress_mod, "LINE_EVERY_S", 0.0)
    simulate_des(spmd, "tpu-v4", progress=None)
    err = capsys.readouterr().err
    assert "DES [" in err and "100.0%" in err and "collectives" in err
    assert err.endswith("\n")                # not a terminal: whole lines, no carriage returns
    assert "\r" not in err


def test_progress_counts_steps_of_a_running_collective():
    buf = io.StringIO()
    bar = Progress(1, "DES", True, buf, line_every_s=0.0)
    bar.update(0.25, "collectives")
    bar.close(1, "collectives")
    lines = buf.getvalue().splitlines()
    assert "25.0% 0.25/1" in lines[0] and "100.0% 1/1" in lines[-1]


def test_options_json_names_the_path():
    assert DesOptions().to_json()["aggregate"] is True
    assert DesOptions(aggregate=False).to_json()["aggregate"] is False


@pytest.mark.parametrize("eager", [False, True])
def test_flows_due_within_the_resolution_finish_at_the_latest_and_due_flows_are_not_held(eager):
    """Uneven pieces (one element apart) finish together, at the time the LAST of them is due, never
    earlier (merging early ran members ahead of the analytical model by up to 1 ns per step); a flow
    already due is never held back by one started at its completion instant."""
    import simpy

    from partir_emu.hwmodels.des.network.routing import FlowRouter
    from partir_emu.hwmodels.des.network.spans import FlowNetwork
    from tests.unit.test_des_collectives import A, B

    env = simpy.Environment()
    net = FlowNetwork(env, FlowRouter(ring_topo(4)), eager=eager)
    got: dict[str, list[float]] = {}

    def rec(name):
        return lambda ids, t, flows=False: got.setdefault(name, []).append(t)

    # two flows on disjoint links, due 0.4 ns apart (inside the 1 ns window): one completion event
    pat = net.router.pattern(np.array([0, 2]), np.array([1, 3]))
    n0, n1 = 4.5e6, 4.5e6 + 0.4e-9 * B
    net.send(pat, None, np.array([n0, n1]), rec("pair"))
    env.run()
    assert got["pair"] == [pytest.approx(A + n1 / B, rel=1e-12, abs=0)]
    assert got["pair"][0] >= A + n1 / B * (1 - 1e-15)

    # a flow due at T; at T (before its completion is processed) a second flow starts on the same
    # link, due 0.3 ns later: the first is delivered at T + A, not held to the second's completion
    env = simpy.Environment()
    net = FlowNetwork(env, FlowRouter(ring_topo(4)), eager=eager)
    got.clear()
    one = net.router.pattern(np.array([0]), np.array([1]))
    T = 1000 / B
    net.send(one, None, np.array([1000.0]), rec("first"))
    ev = env.timeout(T)
    ev.callbacks.append(lambda _e: net.send(one, None, np.array([0.3e-9 * B]), rec("second")))
    env.run()
    assert got["first"] == [pytest.approx(T + A, rel=1e-12, abs=0)]
    assert got["second"] == [pytest.approx(T + 0.3e-9 + A, rel=1e-9, abs=0)]

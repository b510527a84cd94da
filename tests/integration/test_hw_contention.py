"""The contention- and fault-aware analytical model (hwmodels.contention, comm, links) against closed
forms (exact) and against the DES (the independent check).

Notation: p members, n bytes of the full buffer, A latency per hop, B one-way bandwidth per link.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from partir_emu.app.cli.main import main
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import Placement, load_spec, place, simulate
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.machine.links import FaultError, LinkSpecError, link_factors
from partir_emu.hwmodels.network.comm import CommModel, price_schedule
from tests.unit.test_des_collectives import MM, A, B, Prog, one_collective, ring_topo, torus_topo


def test_two_groups_sharing_a_ring_each_get_half_the_bandwidth():
    """8-chip ring (wrap), Mesh(a=4, b=2): the default placement puts b on x with stride 1 (partial)
    and a on x with stride 2, so a's groups are {0,2,4,6} and {1,3,5,7}: open lines of stride 2, the
    unidirectional ring. Every message crosses 2 + links (6->0 wraps as 6->7->0), and every + link
    carries one message of each group: each runs at B/2. All-gather, 3 steps of n/4:
    3 (2A + (n/4)/(B/2)); one group alone would be 3 (2A + (n/4)/B)."""
    n = 64 << 20
    pl = Placement(Mesh(a=4, b=2), ring_topo(8))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_gather", ("a",), n)
    ana = simulate(spmd, spec, pl)
    des = simulate_des(spmd, spec, pl)
    assert ana.collectives[0].algorithm == "ring"
    assert ana.step_s == pytest.approx(3 * (2 * A + (n / 4) / (B / 2)), rel=1e-9)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-6)
    model = CommModel(pl)
    choice, sched = model.schedule("all_gather", ("a",), n)
    assert price_schedule(sched, choice.chips, pl.topology) == pytest.approx(3 * (2 * A + (n / 4) / B), rel=1e-9)
    # every + link carries 2 groups x 3 steps x n/4; the - links nothing
    ids, byts = model.link_bytes("all_gather", ("a",), n)
    plus = sorted(pl.topology.link(i, (i + 1) % 8).id for i in range(8))
    assert sorted(ids.tolist()) == plus
    assert byts == pytest.approx(np.full(8, 2 * 3 * n / 4))
    assert model.link_bw[plus] == pytest.approx(np.full(8, B))


def test_v4_4x4x16_two_axes_on_z_matches_the_des():
    """The issue's case: 256 chips as a 4x4x16 v4 slice, Mesh(batch=16, data=4, model=4) by the default
    fill: model on z stride 1, data on z stride 4 (both partial: open lines), batch on x+y. The
    all-reduce over data: 4 groups per z line (one per model coordinate) cross the same z links. Priced
    one group alone it is ~4x cheaper than the DES; priced with every group it agrees."""
    spec = load_spec("tpu-v4")
    mesh = Mesh(batch=16, data=4, model=4)
    pl = place(mesh, spec, None, (4, 4, 16))
    assert "data=z[4/16], model=z[4/16]" in pl.describe()
    n = 64 << 20
    spmd = one_collective(mesh, "all_reduce", ("data",), n)
    ana, des = simulate(spmd, spec, pl), simulate_des(spmd, spec, pl)
    assert ana.step_s == pytest.approx(des.step_s, rel=0.05)
    choice, sched = CommModel(pl).schedule("all_reduce", ("data",), n)
    alone = price_schedule(sched, choice.chips, pl.topology)
    assert des.step_s / alone > 3.5                    # what the analytical model missed before
    # model (stride 1, neighbours): its groups do not share links, both models agree with the closed form
    spmd_m = one_collective(mesh, "all_reduce", ("model",), n)
    choice_m, sched_m = CommModel(pl).schedule("all_reduce", ("model",), n)
    ana_m, des_m = simulate(spmd_m, spec, pl), simulate_des(spmd_m, spec, pl)
    assert ana_m.step_s == pytest.approx(price_schedule(sched_m, choice_m.chips, pl.topology), rel=1e-9)
    assert des_m.step_s == pytest.approx(ana_m.step_s, rel=1e-6)


def test_degraded_link_on_a_ring_closed_form_and_des():
    """8-chip ring, unidirectional ring all-gather, link 3->4 at 1/4: member 3 sends n/8 over it every
    step and the step waits for it: 7 (A + 4 (n/8)/B), in both models."""
    p, n = 8, 64 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    ana = simulate(spmd, spec, pl, algorithms="ring", degraded_links={"3->4": 0.25})
    des = simulate_des(spmd, spec, pl, algorithms="ring", degraded_links={"3->4": 0.25})
    assert ana.step_s == pytest.approx((p - 1) * (A + 4 * n / p / B), rel=1e-9)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-6)
    assert ana.faults == (f"{pl.topology.link(3, 4)} (x0.25 bandwidth)",)
    healthy = simulate(spmd, spec, pl, algorithms="ring")
    assert healthy.step_s == pytest.approx((p - 1) * (A + n / p / B), rel=1e-9) and not healthy.faults


def test_failed_link_detours_the_other_way_round():
    """Same ring, 3->4 failed: 3's message goes 7 hops the - way (unused by the unidirectional ring):
    each step 7A + (n/8)/B, in both models; the failed link carries nothing, the detour's links do."""
    p, n = 8, 8 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    ana = simulate(spmd, spec, pl, algorithms="ring", failed_links=("3->4",))
    des = simulate_des(spmd, spec, pl, algorithms="ring", failed_links=("3->4",))
    assert ana.step_s == pytest.approx((p - 1) * ((p - 1) * A + n / p / B), rel=1e-9)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-6)
    topo = pl.topology
    model = CommModel(pl, "ring", link_factors=link_factors(topo, failed=("3->4",)))
    assert model.cost("all_gather", ("x",), n).max_hops == p - 1
    ids, byts = model.link_bytes("all_gather", ("x",), n)
    got = dict(zip(ids.tolist(), byts.tolist()))
    assert topo.link(3, 4).id not in got and model.link_bw[topo.link(3, 4).id] == 0.0
    minus = [topo.link(i, (i - 1) % p).id for i in range(p) if i != 4]      # 3 -> 2 -> ... -> 5 -> 4
    assert all(got[i] == pytest.approx((p - 1) * n / p) for i in minus)


def test_faults_are_part_of_the_price_cache_key():
    p, n = 8, 8 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    an = Analyzer()
    t0 = an.simulate(spmd, "tpu-v4", pl, algorithms="ring").step_s
    t1 = an.simulate(spmd, "tpu-v4", pl, algorithms="ring", degraded_links={"3->4": 0.5}).step_s
    t2 = an.simulate(spmd, "tpu-v4", pl, algorithms="ring").step_s
    assert t1 > 1.5 * t0 and t2 == t0


def test_two_axes_on_one_torus_dim_with_a_degraded_link():
    """A 2-D torus, an axis over both dims (groups share the y links) and a degraded link: the DES
    (max-min flows) and the analytical model (every group's messages per link) agree."""
    pl = Placement(Mesh(b=8, a=2), torus_topo((4, 4)))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_reduce", ("b",), 64 << 20)
    kw = {"degraded_links": {"0-1": 0.5}}
    ana, des = simulate(spmd, spec, pl, **kw), simulate_des(spmd, spec, pl, **kw)
    assert ana.step_s == pytest.approx(des.step_s, rel=0.05)
    assert ana.step_s > 1.05 * simulate(spmd, spec, pl).step_s


def _matmul_then_all_reduce(p: int = 8):
    pl = Placement(Mesh(x=p), ring_topo(p))
    b = Prog(pl.mesh)
    x, w = b.input((2048, 4096), "bfloat16"), b.input((4096, 4096), "bfloat16")
    y = b.eq("dot_general", (x, w), (2048, 4096), "bfloat16", dimension_numbers=MM)
    v = b.input((64, 1024))
    z = b.eq("all_reduce", (v,), (64, 1024), axes=("x",), op="sum")
    return b.build([y, z]), pl


def test_straggler_on_a_compute_bound_program():
    """A big matmul and a small all-reduce; device 5 computes 2x slower. Everyone waits for it at the
    collective: the step is 2 x compute + comm in the analytical model, within 5 % of the DES."""
    spmd, pl = _matmul_then_all_reduce()
    spec = load_spec("tpu-v4")
    base = simulate(spmd, spec, pl)
    assert base.compute_s > 10 * base.comm_s                 # compute-bound
    ana = simulate(spmd, spec, pl, stragglers={5: 2.0})
    des = simulate_des(spmd, spec, pl, stragglers={5: 2.0})
    assert ana.step_s == pytest.approx(2 * base.compute_s + base.comm_s, rel=1e-9)
    assert ana.step_s == pytest.approx(des.step_s, rel=0.05)
    assert ana.faults == ("device 5 (x2 compute time)",)
    # a faster device alone changes nothing; every device faster does
    assert simulate(spmd, spec, pl, stragglers={5: 0.5}).step_s == pytest.approx(base.step_s, rel=1e-12)
    every = simulate(spmd, spec, pl, stragglers=dict.fromkeys(range(8), 0.5))
    assert every.step_s == pytest.approx(0.5 * base.compute_s + base.comm_s, rel=1e-9)


@pytest.mark.parametrize("kw, exc, match", [
    ({"stragglers": {9: 2.0}}, FaultError, "straggler device 9"),
    ({"stragglers": {1: -1.0}}, FaultError, "slow-down factor > 0"),
    ({"stragglers": {1: float("nan")}}, FaultError, "1:nan"),
    ({"degraded_links": {"0->2": 0.5}}, LinkSpecError, "no link 0->2"),
    ({"degraded_links": {"0->1": 0.0}}, LinkSpecError, "factor 0.0 must be > 0"),
    ({"failed_links": ("pigeon",)}, LinkSpecError, "'pigeon'"),
    ({"comm_streams": 0}, FaultError, "comm_streams=0"),
])
def test_bad_fault_input_names_the_value(kw, exc, match):
    spmd, pl = _matmul_then_all_reduce()
    with pytest.raises(exc, match=match):
        simulate(spmd, "tpu-v4", pl, **kw)


def test_failed_links_that_disconnect_are_an_error():
    pl = Placement(Mesh(x=4), ring_topo(4, wrap=False))
    spmd = one_collective(pl.mesh, "all_gather", ("x",), 4096)
    with pytest.raises(LinkSpecError, match="disconnect chip"):
        simulate(spmd, "tpu-v4", pl, failed_links=("1-2",))


def test_simulate_cli_fault_options(tmp_path, capsys):
    rep = tmp_path / "r.json"
    base = ["simulate", "mlp", "--strategy", "bp", "--mesh", "batch=8", "--size", "tiny", "--placement", "default"]
    assert main(base + ["--report", str(rep)]) == 0
    healthy = json.loads(rep.read_text())
    assert main(base + ["--report", str(rep), "--straggler", "3:2", "--degrade-link", "0-1:0.25",
                        "--fail-link", "2-3", "--overlap", "--comm-streams", "2"]) == 0
    out = capsys.readouterr().out
    d = json.loads(rep.read_text())
    assert "faults: " in out and "device 3 (x2 compute time)" in out and "(failed)" in out
    assert len(d["faults"]) == 5 and d["comm_streams"] == 2 and not healthy["faults"]
    assert d["compute_s"] == pytest.approx(2 * healthy["compute_s"], rel=1e-9)
    for bad, msg in ((["--straggler", "x"], "DEVICE:FACTOR"), (["--degrade-link", "0-1:nan"], "LINK:FACTOR"),
                     (["--fail-link", "0-9"], "no link 0->9"), (["--straggler", "8:2"], "straggler device 8")):
        assert main(base + bad) == 2
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("faults", [{"stragglers": {3: 2.0}}, {"degraded_links": {"0-1": 0.25}},
                                    {"failed_links": ("0-1",)}], ids=["straggler", "degraded", "failed"])
def test_whole_program_with_faults_matches_the_des(faults):
    """A lowered transformer step (8 chips on a 2x2x2 v4 slice) with one fault: both models take it as
    an input, and the DES replays the schedule the analytical model chose on the faulty fabric (on the
    failed link the algorithm choice differs from the healthy one)."""
    from tests.integration.test_des_model import lowered
    spmd = lowered("transformer", "bp+mp", "batch=2,model=4")
    healthy = simulate(spmd, "tpu-v4", overlap=True)
    ana = simulate(spmd, "tpu-v4", overlap=True, **faults)
    des = simulate_des(spmd, "tpu-v4", overlap=True, **faults)
    assert ana.step_s > 1.005 * healthy.step_s                  # tiny: latency-bound, the fault costs ~1 %+
    assert ana.step_s == pytest.approx(des.step_s, rel=0.02)
    assert [a.algorithm for a in ana.collectives] == [d.algorithm for d in des.collectives]


@pytest.mark.slow
@pytest.mark.parametrize("dims, wrap, failed", [((8,), (True,), ()), ((8,), (True,), ("0-1",)), ((8,), (False,), ()),
                                                ((4, 4), (True, True), ("0-1",)), ((2, 4, 3), (False, False, True), ()),
                                                ((4, 4, 16), (True, True, True), ("5->6",))])
def test_route_matrix_is_route_for_every_pair(dims, wrap, failed):
    """The array router (torus: dimension order by array operations; failed links: the BFS detour) gives
    exactly the routes of Router.route, for every pair of chips."""
    from partir_emu.hwmodels.machine.links import Router
    from partir_emu.hwmodels.machine.topology import Topology
    topo = Topology.torus(dims, wrap, link_bw_bytes_per_s=B, link_latency_s=A)
    n = topo.num_chips
    src, dst = np.repeat(np.arange(n), n), np.tile(np.arange(n), n)
    fast = Router(topo, link_factors(topo, failed=failed)).route_matrix(src, dst)
    slow = Router(topo, link_factors(topo, failed=failed))
    assert [tuple(r[r >= 0].tolist()) for r in fast] == [slow.route(s, d) for s, d in zip(src.tolist(), dst.tolist())]

"""GPU scalable units joined by a core through oversubscribed spine uplinks
(partir_emu.hwmodels.machine.superpod): the spec field and its source, routes, uplink bandwidths,
the closed-form price of a ring across units, the DES on the same routes, and the errors."""
from __future__ import annotations

import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.errors import PlacementError, SpecError
from partir_emu.hwmodels import Placement, load_spec, simulate, topology_for
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.machine.superpod import CORE, ScalableUnits
from partir_emu.hwmodels.machine.topology import Topology
from partir_emu.hwmodels.network.comm import CommModel
from tests.unit.test_hw_analytical import Builder

NIC, LAT = 50e9, 1e-6           # h100: NDR 400 Gb/s per NIC, 1 us per InfiniBand hop


def _spec(ratio: float, fabric: str = "rail_optimized", **kw):
    return load_spec("h100", {"topology.fabric": fabric, "topology.nodes_per_su": 2,
                              "topology.spine_oversubscription": ratio, **{f"topology.{k}": v for k, v in kw.items()}})


def test_the_spec_gives_the_superpod_ratio_and_one_unit_keeps_the_one_spine():
    h100 = load_spec("h100")
    assert h100.network.spine_oversubscription == 1.0 and h100.network.nodes_per_su == 32
    assert "SuperPOD" in h100.sources["spine_oversubscription"] and "1:7" in h100.sources["spine_oversubscription"]
    assert load_spec("a100").network.spine_oversubscription is None
    one = topology_for(h100, 256)                             # 32 nodes: one unit, as before
    assert type(one) is Topology and [str(lk.dst) for lk in one.route(0, 8 * 31)] == ["leaf0", "spine", "leaf7", "248"]
    assert type(topology_for(load_spec("a100"), 512)) is Topology      # no field: one spine at any size
    two = topology_for(h100, 512)
    assert isinstance(two, ScalableUnits) and two.units == 2 and "2 scalable units" in two.describe()


def test_routes_cross_the_core_only_between_units_and_the_uplink_is_the_units_nics_over_the_ratio():
    t = topology_for(_spec(4.0), 32)                          # 4 nodes, 2 per unit, rail leaves
    assert [str(lk.dst) for lk in t.route(1, 9)] == ["leaf0.1", "9"]                      # same rail, same unit
    assert [str(lk.dst) for lk in t.route(1, 10)] == ["leaf0.1", "spine0", "leaf0.2", "10"]
    cross = t.route(1, 17)
    assert [str(lk.dst) for lk in cross] == ["leaf0.1", "spine0", CORE, "spine1", "leaf1.1", "17"]
    assert cross[2].bw_bytes_per_s == 16 * NIC / 4 and cross[1].bw_bytes_per_s == 2 * NIC
    assert all(lk.latency_s == LAT for lk in cross)
    fat = topology_for(_spec(2.0, "fat_tree", nodes_per_leaf=1), 32)
    assert [str(lk.dst) for lk in fat.route(1, 17)] == ["leaf0", "spine0", CORE, "spine1", "leaf2", "17"]


@pytest.mark.parametrize("units", [2, 4])
@pytest.mark.parametrize("ratio", [1.0, 4.0])
def test_a_ring_across_units_takes_the_uplink_share_in_closed_form(units, ratio):
    """Every GPU all-reduces n bytes with its peers in the other units (one group per GPU of a unit,
    all at once): a ring of S steps twice, each moving n/S per GPU; the 16 GPUs of a unit share its
    uplink of 16 NICs / ratio, so each runs at nic_bw / ratio (the NIC itself at ratio 1), 6 hops:
    2(S-1) * (n/S * ratio / nic_bw + 6 * latency)."""
    t = topology_for(_spec(ratio), 16 * units)
    n = 64 << 20
    cost = CommModel(Placement(Mesh(su=units, batch=16), t)).cost("all_reduce", ("su",), n, "float32")
    assert cost.algorithm == "ring"
    assert cost.time_s == pytest.approx(2 * (units - 1) * (n / units * ratio / NIC + 6 * LAT), rel=1e-9)


def test_the_des_takes_the_same_routes_and_shares_the_uplink():
    b = Builder()
    x = b.input("x", (8 << 20,))
    y = b.eq("all_reduce", (x,), x.shape, axes=("su",), op="sum")
    spmd = b.build([y], Mesh(su=2, batch=16))
    for ratio in (1.0, 4.0):
        spec = _spec(ratio)
        a, d = simulate(spmd, spec), simulate_des(spmd, spec)
        assert d.step_s == pytest.approx(a.step_s, rel=1e-6)
    assert simulate(spmd, _spec(4.0)).comm_s > 3.5 * simulate(spmd, _spec(1.0)).comm_s


def test_what_a_unit_cannot_be_is_named():
    with pytest.raises(PlacementError, match=r"scalable unit of 2 nodes .* not whole leaves of 4 nodes"):
        topology_for(_spec(2.0, "fat_tree"), 32)
    with pytest.raises(SpecError, match=r"topology.spine_oversubscription = 0.5 is outside"):
        _spec(0.5)

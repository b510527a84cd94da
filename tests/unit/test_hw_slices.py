"""TPU slices joined by DCN (partir_emu.hwmodels.machine.slices): routes, host NIC sharing, the
closed-form price of a ring across slices, and the errors of what a spec cannot build."""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.errors import PartirError, PlacementError, SpecError
from partir_emu.hwmodels import Placement, load_spec, topology_for
from partir_emu.hwmodels.machine.slices import SlicedTopology, chips_limit
from partir_emu.hwmodels.machine.topology import Topology
from partir_emu.hwmodels.network.comm import CommModel

V5E = load_spec("tpu-v5e")
DCN = V5E.network.dcn


def test_the_spec_carries_its_dcn_and_slices_are_asked_for_never_assumed():
    assert DCN is not None and DCN.chips_per_host == 8 and DCN.host_bw_bytes_per_s == 2.5e10
    assert V5E.network.pod_chips == V5E.network.max_chips == 256
    assert chips_limit(V5E) == 256 and chips_limit(V5E, (4, 16, 16)) == 1024 and chips_limit(V5E, (16, 16)) == 256
    t = topology_for(V5E, 512, (2, 16, 16))
    assert isinstance(t, SlicedTopology) and t.dims == (2, 16, 16) and t.dim_names == ("slice", "x", "y")
    assert topology_for(V5E, 256).kind == "torus"                      # one pod: no DCN
    assert topology_for(V5E, 64, (4, 4, 4)).describe().startswith(
        "tpu-v5e 4 slice(s) of 2D torus 4(open)x4(open) (16 chips) joined by DCN")
    with pytest.raises(PlacementError, match=r"--slice 2x16x16"):        # more than a pod: say how
        topology_for(V5E, 512)


def test_routes_inside_a_slice_are_the_slice_torus_routes_moved_to_the_slice():
    t = topology_for(V5E, 3 * 64, (3, 8, 8))
    one = Topology.torus((8, 8), (False, False), link_bw_bytes_per_s=1.0, link_latency_s=1.0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 200), rng.integers(0, 64, 200)
    local = one.route_matrix(a, b)
    for s in range(3):
        got = t.route_matrix(a + 64 * s, b + 64 * s)[:, :local.shape[1]]
        want = np.where(local >= 0, local + s * len(one.links), -1)
        assert np.array_equal(got, want)
        for row in got[:5]:
            assert all(t.links[i].kind == "ici" and t.links[i].src // 64 == s for i in row if i >= 0)


def test_a_transfer_across_slices_crosses_pcie_both_nics_and_pcie():
    t = topology_for(V5E, 512, (2, 16, 16))
    route = t.route(3, 256 + 17)
    assert [lk.kind for lk in route] == ["pcie", "dcn", "dcn", "pcie"]
    assert [lk.src for lk in route] == [3, "host0", "dcn", "host34"]       # chip 273 is on host 273 // 8
    # the NIC as achieved: the nominal bandwidth times the spec's achieved fraction, the latency over it
    assert route[1].bw_bytes_per_s == pytest.approx(DCN.host_bw_bytes_per_s * DCN.achieved_fraction, rel=1e-15)
    assert route[1].latency_s == pytest.approx(DCN.latency_s / DCN.achieved_fraction, rel=1e-15)
    assert route[0].bw_bytes_per_s == DCN.pcie_bw_bytes_per_s
    assert {t.route(c, 256 + c)[1].id for c in range(8)} == {route[1].id}    # a host's 8 chips share its NIC
    assert t.route(8, 264)[1].id != route[1].id


@pytest.mark.parametrize("slices", [2, 4])
def test_a_ring_all_reduce_across_slices_is_the_closed_form_with_the_nic_shared(slices):
    """Every chip all-reduces n bytes with its peers in the other slices (one group per chip of a
    slice, all at once): a ring of S steps twice, each moving n/S bytes per chip, 8 chips per NIC:
    2(S-1) * (n/S * 8 / host_bw + latency of the route)."""
    t = topology_for(V5E, slices * 64, (slices, 8, 8))
    placement = Placement(Mesh(dcn=slices, batch=64), t)
    n = 64 << 20
    cost = CommModel(placement).cost("all_reduce", ("dcn",), n, "float32")
    assert cost.algorithm == "ring"
    f = DCN.achieved_fraction
    per_step = n / slices * DCN.chips_per_host / (f * DCN.host_bw_bytes_per_s) + 2 * DCN.latency_s / f
    assert cost.time_s == pytest.approx(2 * (slices - 1) * per_step, rel=1e-9)


def test_the_achieved_fraction_scales_the_nic_alone():
    """At fraction 1 the NIC is the nominal figure; at 0.5 a DCN ring takes the closed form with half
    the NIC bandwidth and twice its latency, while ICI and PCIe are untouched."""
    nominal = load_spec("tpu-v5e", overrides={"dcn.achieved_fraction": 1.0})
    half = load_spec("tpu-v5e", overrides={"dcn.achieved_fraction": 0.5})
    t1, t2 = topology_for(nominal, 128, (2, 8, 8)), topology_for(half, 128, (2, 8, 8))
    for a, b in zip(t1.links, t2.links):
        scale = 0.5 if a.kind == "dcn" else 1.0
        assert b.bw_bytes_per_s == a.bw_bytes_per_s * scale and b.latency_s == a.latency_s / scale
    assert t1.route(0, 64)[1].bw_bytes_per_s == DCN.host_bw_bytes_per_s
    with pytest.raises(SpecError, match=r"dcn.achieved_fraction = 1.5 is outside"):
        load_spec("tpu-v5e", overrides={"dcn.achieved_fraction": 1.5})


def test_a_spec_without_dcn_cannot_build_slices_and_bad_dcn_fields_are_named():
    v3 = load_spec("tpu-v3")
    with pytest.raises(PlacementError, match=r"no \[dcn\] table"):
        topology_for(v3, 128, (2, 8, 8))
    with pytest.raises(PlacementError, match="dcn.max_slices"):
        topology_for(V5E, 257 * 4, (257, 2, 2))
    with pytest.raises(PlacementError, match="equal slices"):
        topology_for(V5E, 300, (7, 4, 4))
    with pytest.raises(SpecError, match="dcn.chips_per_host"):
        load_spec("tpu-v5e", overrides={"dcn.chips_per_host": 3})
    with pytest.raises(SpecError, match="unknown field dcn.hosts"):
        load_spec("tpu-v5e", overrides={"dcn.hosts": 3})
    assert issubclass(SpecError, PartirError)

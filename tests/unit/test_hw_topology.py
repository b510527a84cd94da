"""Topologies (links, wraparound, routing) and placement of mesh axes on physical dims."""
from __future__ import annotations

from collections import Counter

import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.errors import PlacementError
from partir_emu.hwmodels import Placement, Topology, load_spec, place, topology_for
from partir_emu.hwmodels.machine.slices import default_slice


def _torus(dims, wrap=None):
    return Topology.torus(dims, wrap, link_bw_bytes_per_s=1e11, link_latency_s=1e-6)


# -- torus ----------------------------------------------------------------------------------------
def test_torus_links_per_chip_and_ids():
    t = _torus((4, 4, 4))
    assert len(t.links) == 64 * 6
    assert [lk.id for lk in t.links] == list(range(len(t.links)))
    out = Counter(lk.src for lk in t.links)
    assert set(out.values()) == {6}
    open_ = _torus((4, 4), (False, False))
    assert len(open_.links) == 2 * (2 * 4 * 3)         # 3 cables per row/column, 4 rows and 4 columns, 2 ways


def test_dimension_order_routing_takes_the_short_way_round():
    t = _torus((8, 8))
    r = t.route(t.chip_at((0, 0)), t.chip_at((7, 2)))
    assert [t.coords(lk.dst) for lk in r] == [(7, 0), (7, 1), (7, 2)]   # x first (wrapping back), then y
    assert t.hops(t.chip_at((0, 0)), t.chip_at((4, 0))) == 4             # a tie goes the + way
    assert t.route(t.chip_at((0, 0)), t.chip_at((4, 0)))[0].label.startswith("ici x+")
    assert t.route(5, 5) == []
    o = _torus((8,), (False,))
    assert o.hops(7, 0) == 7 and all("x-" in lk.label for lk in o.route(7, 0))


def test_route_is_a_connected_path_of_directed_links():
    t = _torus((4, 4, 4))
    for src, dst in [(0, 63), (5, 42), (17, 3)]:
        r = t.route(src, dst)
        assert r[0].src == src and r[-1].dst == dst
        assert all(a.dst == b.src for a, b in zip(r, r[1:]))
        assert sum(lk.latency_s for lk in r) == pytest.approx(1e-6 * len(r))


@pytest.mark.parametrize("spec, n, dims, wrap", [
    ("tpu-v4", 64, (4, 4, 4), (True,) * 3),
    ("tpu-v4", 32, (2, 4, 4), (False,) * 3),
    ("tpu-v4", 128, (4, 4, 8), (True,) * 3),
    ("tpu-v5e", 256, (16, 16), (True, True)),
    ("tpu-v5e", 64, (8, 8), (False, False)),
    ("tpu-v5e", 128, (8, 16), (False, True)),
    ("tpu-v3", 1024, (32, 32), (True, True)),
    ("tpu-v5p", 8960, (16, 20, 28), (True,) * 3),
])
def test_default_slices_and_wraparound_rules(spec, n, dims, wrap):
    t = topology_for(load_spec(spec), n)
    assert (t.dims, t.wrap) == (dims, wrap)


def test_slice_errors():
    v5e = load_spec("tpu-v5e")
    with pytest.raises(PlacementError, match="512 chips do not fit a pod of 16x16"):
        default_slice(v5e.network, 512)
    with pytest.raises(PlacementError, match="does not fit the tpu-v5e pod"):
        topology_for(v5e, 64, (32, 2))
    with pytest.raises(PlacementError, match="has 32 chips, not 64"):
        topology_for(v5e, 64, (4, 8))


# -- GPU ------------------------------------------------------------------------------------------
def test_gpu_routes():
    spec = load_spec("h100")
    t = topology_for(spec, 64)                         # 8 nodes, 4 per leaf
    assert t.dims == (8, 8)
    intra = t.route(0, 5)
    assert [lk.kind for lk in intra] == ["nvlink", "nvlink"] and intra[0].dst == "nvswitch0"
    same_leaf = t.route(3, 3 * 8 + 6)
    assert [str(lk.dst) for lk in same_leaf] == ["leaf0", "30"]
    cross = t.route(1, 5 * 8 + 1)
    assert [str(lk.dst) for lk in cross] == ["leaf0", "spine", "leaf1", "41"]
    assert cross[1].bw_bytes_per_s == 32 * spec.network.nic_bw_bytes_per_s
    rail = topology_for(load_spec("h100", {"topology.fabric": "rail_optimized"}), 64)
    assert [str(lk.dst) for lk in rail.route(1, 5 * 8 + 1)] == ["leaf0.1", "41"]
    assert [str(lk.dst) for lk in rail.route(1, 5 * 8 + 2)] == ["leaf0.1", "spine", "leaf0.2", "42"]


def test_gpu_partial_node_and_errors():
    spec = load_spec("a100")
    t = topology_for(spec, 4)
    assert t.dims == (1, 4) and all(lk.kind == "nvlink" for lk in t.links)
    with pytest.raises(PlacementError, match="12 GPUs do not fill whole a100 nodes of 8"):
        topology_for(spec, 12)


# -- placement ------------------------------------------------------------------------------------
def test_default_placement_fills_dims_in_order():
    spec = load_spec("tpu-v4")
    pl = place(Mesh(batch=4, model=16), spec)
    assert pl.topology.dims == (4, 4, 4)
    assert [pl.chip_of(d) for d in range(64)] == list(range(64))
    assert pl.group(("batch",)).dim_names == ("x",) and pl.group(("batch",)).is_ring
    g = pl.group(("model",))
    assert g.dim_names == ("y", "z") and g.is_torus and not g.is_ring and g.shape == (4, 4)
    assert str(pl).startswith("batch=x, model=y+z")


def test_default_placement_splits_a_dim():
    pl = place(Mesh(data=2, model=8), load_spec("tpu-v5e"))     # 4x4 open
    g = pl.group(("data",))
    assert g.chips == (0, 8) and g.dim_names == ("x",) and g.wrap == (False,)
    assert pl.group(("model",)).dim_names == ("x", "y")


def test_explicit_placement():
    spec = load_spec("tpu-v4")
    pl = place(Mesh(batch=16, model=4), spec, "model=x,batch=yz")
    assert pl.topology.dims == (4, 4, 4)
    # device (batch=b, model=m) sits at x=m, (y, z) = divmod(b, 4)
    mesh = pl.mesh
    for d in range(mesh.size):
        c = mesh.coords(d)
        assert pl.topology.coords(pl.chip_of(d)) == (c["model"], *divmod(c["batch"], 4))
    assert pl.group(("model",)).chips == (0, 16, 32, 48)
    same = place(Mesh(batch=16, model=4), spec, {"model": "x", "batch": ("y", "z")})
    assert [same.chip_of(d) for d in range(64)] == [pl.chip_of(d) for d in range(64)]
    gpu = place(Mesh(data=4, model=8), load_spec("h100"), "data=node,model=gpu")
    assert gpu.group(("data",)).nodes == 4 and gpu.group(("model",)).nodes == 1


def test_explicit_placement_shapes_the_slice():
    pl = place(Mesh(a=8, b=16), load_spec("tpu-v5e"), "a=x,b=y")
    assert pl.topology.dims == (8, 16) and pl.topology.wrap == (False, True)
    assert pl.group(("b",)).is_ring and not pl.group(("a",)).is_ring


@pytest.mark.parametrize("mesh, mapping, match", [
    (Mesh(batch=4, model=16), "model=x,batch=yz", r"mesh axis batch=4 is placed on y\+z of size 16"),
    (Mesh(batch=4, model=16), "model=yz,batch=w", r"'w' is not a physical dim .* its dims are x, y, z"),
    (Mesh(batch=4, model=16), "model=yz,batch=y", r"physical dim 'y' is given to both 'model' and 'batch'"),
    (Mesh(batch=4, model=16), "model=yz,data=x", r"placement names axis 'data', which is not in"),
    (Mesh(batch=4, model=16), "model=yz", r"mesh axis batch=4 is placed on no physical dim"),
    (Mesh(batch=4, model=16), "model yz", r"is not AXIS=DIMS"),
])
def test_placement_errors(mesh, mapping, match):
    with pytest.raises(PlacementError, match=match):
        Placement(mesh, _torus((4, 4, 4)), mapping)


def test_placement_size_errors():
    with pytest.raises(PlacementError, match="has 32 devices but .* has 64 chips"):
        Placement(Mesh(a=32), _torus((4, 4, 4)))
    with pytest.raises(PlacementError, match=r"mesh axis b=3 does not tile physical dim y=2 .*\"b=y\""):
        Placement(Mesh(a=2, b=3), _torus((3, 2)))
    with pytest.raises(PlacementError, match=r"4 node\(s\).*'gpu' is given to both|data=4 is placed on gpu"):
        place(Mesh(data=4, model=8), load_spec("h100"), "data=gpu,model=node")
    with pytest.raises(PlacementError, match="axis 'nope' is not in mesh"):
        place(Mesh(data=4, model=8), load_spec("h100")).group(("nope",))

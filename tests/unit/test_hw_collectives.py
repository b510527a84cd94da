"""Collective prices against closed forms derived on paper (alpha-beta per step, exact to 1e-9).

Notation: p members, n bytes of the full buffer (nccl-tests "size"), a = latency per hop,
B = one-way bandwidth per link.
"""
from __future__ import annotations

import math

import pytest

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import CollectiveError
from partir_emu.hwmodels import Placement, Topology, choose_algorithm, load_spec, place, simulate
from partir_emu.hwmodels.network.comm import CommModel

A, B = 1e-6, 4.5e10
REL = 1e-9


def ring_topo(p: int, wrap: bool = True) -> Topology:
    return Topology.torus((p,), (wrap,), link_bw_bytes_per_s=B, link_latency_s=A)


def cost(placement: Placement, kind: str, axes: tuple[str, ...], n: int, algorithm: str | None = None):
    return CommModel(placement, algorithm).cost(kind, axes, n, "float32")


@pytest.mark.parametrize("p", [3, 4, 8, 16])
def test_ring_all_reduce(p):
    n = p * 4096 * 4
    c = cost(Placement(Mesh(x=p), ring_topo(p)), "all_reduce", ("x",), n, "ring")
    assert c.algorithm == "ring"
    assert c.time_s == pytest.approx(2 * (p - 1) / p * n / B + 2 * (p - 1) * A, rel=REL)


@pytest.mark.parametrize("p", [4, 8, 16])
def test_bidirectional_ring_all_reduce_is_default_on_a_wrapped_dim(p):
    n = p * 4096 * 4
    pl = Placement(Mesh(x=p), ring_topo(p))
    c = cost(pl, "all_reduce", ("x",), n)
    assert c.algorithm == "bidir_ring"
    # two rings, each carrying half the data on its own direction of every link
    assert c.time_s == pytest.approx((p - 1) / p * n / B + 2 * (p - 1) * A, rel=REL)


@pytest.mark.parametrize("p", [4, 8])
def test_ring_without_wraparound(p):
    """On an open line the ring's closing message walks back over p-1 hops (on the reverse links,
    which nothing else uses): every step costs (p-1)a + (n/p)/B."""
    n = p * 1024 * 4
    pl = Placement(Mesh(x=p), ring_topo(p, wrap=False))
    assert choose_algorithm("all_reduce", pl.group(("x",)), pl.topology).algorithm == "ring"
    c = cost(pl, "all_reduce", ("x",), n)
    assert c.time_s == pytest.approx(2 * (p - 1) * ((p - 1) * A + n / p / B), rel=REL)
    # bidirectional ring on an open line: each direction's closing message shares the other ring's links
    c2 = cost(pl, "all_reduce", ("x",), n, "bidir_ring")
    assert c2.time_s == pytest.approx(2 * (p - 1) * ((p - 1) * A + n / (2 * p) / (B / 2)), rel=REL)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("p", [4, 8])
def test_ring_all_gather_reduce_scatter(kind, p):
    n = p * 2048 * 4
    pl = Placement(Mesh(x=p), ring_topo(p))
    assert cost(pl, kind, ("x",), n, "ring").time_s == pytest.approx((p - 1) / p * n / B + (p - 1) * A, rel=REL)
    assert cost(pl, kind, ("x",), n).time_s == pytest.approx((p - 1) / p * n / (2 * B) + (p - 1) * A, rel=REL)


@pytest.mark.parametrize("p", [4, 6, 8])
def test_ring_all_to_all_pairwise(p):
    """Pairwise exchange: at step s every member sends n/p bytes s places on; the shortest way is
    d = min(s, p-s) hops, and each link on that direction carries d messages: d(a + (n/p)/B)."""
    n = p * p * 64 * 4
    pl = Placement(Mesh(x=p), ring_topo(p))
    c = cost(pl, "all_to_all", ("x",), n, "ring")
    assert c.algorithm == "pairwise"
    assert c.time_s == pytest.approx(sum(min(s, p - s) for s in range(1, p)) * (A + n / p / B), rel=REL)


def test_2d_torus_all_reduce_dimension_wise():
    """v5e 16x16 (full dims wrap): reduce-scatter over x (bidirectional, a-1 steps of n/(2a)),
    then y on the n/a shard, then all-gather back in reverse."""
    spec = load_spec("tpu-v5e")
    pl = place(Mesh(x=16, y=16), spec)
    assert pl.topology.wrap == (True, True)
    a_, b_ = 16, 16
    n = a_ * b_ * 2 * 1024 * 4
    c = cost(pl, "all_reduce", ("x", "y"), n, "torus")
    assert c.algorithm == "torus"
    bw, lat = spec.network.link_bw_bytes_per_s, spec.network.link_latency_s
    expect = 2 * ((a_ - 1) * (lat + n / (2 * a_) / bw) + (b_ - 1) * (lat + n / (2 * a_ * b_) / bw))
    assert c.time_s == pytest.approx(expect, rel=REL)


@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 4, 8)])
def test_3d_torus_all_reduce_dimension_wise(dims):
    spec = load_spec("tpu-v4")
    mesh = Mesh(a=dims[0], b=dims[1], c=dims[2])
    pl = place(mesh, spec, "a=x,b=y,c=z")
    assert pl.topology.dims == dims and pl.topology.wrap == (True, True, True)
    n = math.prod(dims) * 2 * 256 * 4
    c = cost(pl, "all_reduce", ("a", "b", "c"), n, "torus")
    bw, lat = spec.network.link_bw_bytes_per_s, spec.network.link_latency_s
    expect, shard = 0.0, n
    for d in dims:
        expect += (d - 1) * (lat + shard / (2 * d) / bw)
        shard /= d
    assert c.time_s == pytest.approx(2 * expect, rel=REL)


def test_3d_slice_without_wraparound_is_slower():
    spec = load_spec("tpu-v4")
    n = 32 * 2 * 1024 * 4
    wrapped = place(Mesh(a=2, b=4, c=4), spec)                     # 2x4x4: not whole cubes, no wrap
    assert wrapped.topology.wrap == (False, False, False)
    open_t = cost(wrapped, "all_reduce", ("b",), n).time_s
    cube = place(Mesh(a=4, b=4, c=4), spec)
    wrap_t = cost(cube, "all_reduce", ("b",), n).time_s
    assert open_t > 1.9 * wrap_t


def test_nvswitch_node():
    """8 GPUs on one NVSwitch: every ring message crosses GPU->switch->GPU (2 hops), each link used
    by one message per step."""
    spec = load_spec("h100")
    nv = spec.network
    pl = place(Mesh(model=8), spec)
    n = 8 * 4096 * 4
    c = cost(pl, "all_reduce", ("model",), n, "ring")
    assert c.algorithm == "ring"
    step = 2 * nv.nvlink_latency_s + n / 8 / nv.nvlink_bw_bytes_per_s
    assert c.time_s == pytest.approx(14 * step, rel=REL)
    ag = cost(pl, "all_gather", ("model",), n)
    assert ag.time_s == pytest.approx(7 * step, rel=REL)
    # all_to_all posts all pairs at once: 7 messages share each GPU's up and down link
    a2a = cost(pl, "all_to_all", ("model",), n)
    assert a2a.algorithm == "direct"
    assert a2a.time_s == pytest.approx(2 * nv.nvlink_latency_s + 7 * (n / 8) / nv.nvlink_bw_bytes_per_s, rel=REL)


def _hier_expect(nv, d: int, q: int, n: int, ib_hops: int) -> float:
    p = d * q
    intra = (d - 1) * (2 * nv.nvlink_latency_s + (n / d) / nv.nvlink_bw_bytes_per_s)
    inter = (q - 1) * (ib_hops * nv.ib_latency_s + (n / p) / nv.nic_bw_bytes_per_s)
    return 2 * (intra + inter)


def test_hierarchical_across_nodes_same_leaf():
    """4 DGX H100 under one leaf: reduce-scatter in node (d-1 steps of n/d over NVLink), ring across
    nodes per rail (q-1 steps of n/p over NIC->leaf->NIC), all-gather back."""
    spec = load_spec("h100")
    pl = place(Mesh(data=4, model=8), spec)
    n = 32 * 1024 * 4
    c = cost(pl, "all_reduce", ("data", "model"), n, "hierarchical")
    assert c.algorithm == "hierarchical"
    assert c.time_s == pytest.approx(_hier_expect(spec.network, 8, 4, n, 2), rel=REL)


def test_hierarchical_fat_tree_vs_rail_optimized():
    """8 nodes: a fat tree with 4 nodes per leaf sends the node 3->4 and 7->0 messages through the
    spine (4 hops; the spine links have the leaf's full bandwidth, so the NIC stays the bottleneck);
    rail-optimized leaves keep every same-rail message at 2 hops."""
    mesh = Mesh(data=8, model=8)
    n = 64 * 1024 * 4
    fat = load_spec("h100")
    c = cost(place(mesh, fat), "all_reduce", ("data", "model"), n, "hierarchical")
    assert c.time_s == pytest.approx(_hier_expect(fat.network, 8, 8, n, 4), rel=REL)
    rail = load_spec("h100", {"topology.fabric": "rail_optimized"})
    c2 = cost(place(mesh, rail), "all_reduce", ("data", "model"), n, "hierarchical")
    assert c2.time_s == pytest.approx(_hier_expect(rail.network, 8, 8, n, 2), rel=REL)


@pytest.mark.parametrize("q, hops", [(2, 2), (4, 4)])
def test_ring_across_nodes_one_gpu_per_node(q, hops):
    """A100 fat tree has 2 nodes per leaf: 2 nodes talk through their leaf (2 hops); on 4 nodes the
    slowest ring message goes leaf->spine->leaf (4 hops)."""
    spec = load_spec("a100")
    nv = spec.network
    pl = place(Mesh(data=q, model=8), spec)
    n = q * 1024 * 4
    c = cost(pl, "all_reduce", ("data",), n, "ring")
    assert c.algorithm == "ring"
    assert c.max_hops == hops
    expect = 2 * (q - 1) * (hops * nv.ib_latency_s + n / q / nv.nic_bw_bytes_per_s)
    assert c.time_s == pytest.approx(expect, rel=REL)


def test_group_order_does_not_matter_for_hierarchical():
    """A group listed minor axis first still prices as node-major hierarchical."""
    spec = load_spec("h100")
    pl = place(Mesh(data=4, model=8), spec)
    n = 32 * 1024 * 4
    assert cost(pl, "all_reduce", ("model", "data"), n).time_s == pytest.approx(
        cost(pl, "all_reduce", ("data", "model"), n).time_s, rel=REL)


def test_trivial_group_costs_nothing_and_unknown_algorithm_errors():
    pl = Placement(Mesh(x=4, y=1), ring_topo(4))
    assert cost(pl, "all_reduce", ("y",), 1024).time_s == 0.0
    with pytest.raises(CollectiveError, match="unknown collective algorithm 'nope'"):
        cost(pl, "all_reduce", ("x",), 1024, "nope")


def test_simulate_prices_the_collective_rows():
    p = 8
    mesh = Mesh(x=p)
    x = Var(0, (p * 1024,), "float32")
    y = Var(1, (p * 1024,), "float32")
    prog = Program((x,), ("x",), (Eqn("all_reduce", (x,), (y,), {"axes": ("x",), "op": "sum"}),), (y,), ("y",))
    spmd = SpmdProgram(mesh, prog, (Sharding.replicated(1),), (Sharding.replicated(1),), ((p * 1024,),),
                       ((p * 1024,),))
    spec = load_spec("tpu-v5e")
    topo = Topology.torus((p,), (True,), link_bw_bytes_per_s=spec.network.link_bw_bytes_per_s,
                          link_latency_s=spec.network.link_latency_s)
    for algorithm, factor in (("ring", 1), ("bidir_ring", 2)):
        r = simulate(spmd, spec, Placement(mesh, topo), algorithms={"all_reduce": algorithm})
        n = y.nbytes
        expect = 2 * (p - 1) / p * n / (factor * spec.network.link_bw_bytes_per_s) \
            + 2 * (p - 1) * spec.network.link_latency_s
        assert r.comm_s == pytest.approx(expect, rel=REL)
        assert r.step_s == pytest.approx(expect, rel=REL)
        (row,) = r.collectives
        assert (row.prim, row.axes, row.nbytes, row.algorithm) == ("all_reduce", ("x",), n, algorithm)
        assert r.by_axes["x"]["time_s"] == pytest.approx(expect, rel=REL)

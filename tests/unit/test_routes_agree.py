"""Every public route entry point gives the same links for every pair of chips.

The routes are asked for in three ways: ``Topology.route`` (one pair, :class:`Link` objects),
``links.Router.route`` / ``Router.route_matrix`` / ``Router.routes`` (one pair / a batch, link ids,
with degraded and failed links; the analytical model's contention pricing uses the matrix) and the DES's
``des.network.routing.FlowRouter.pattern`` (a batch as the flow network's padded matrix). They must agree on every
pair, and the torus routes must be the documented ones: dimension order (x, then y, then z), the
shorter way round a wrapped dim with a tie going the + way, straight along an open line, and around a
failed link by a detour that crosses no failed link.
"""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.hwmodels import Topology, load_spec, topology_for
from partir_emu.hwmodels.des.network import routing as des_routing
from partir_emu.hwmodels.machine.links import Router, link_factors


def _torus(dims: tuple[int, ...], wrap: tuple[bool, ...]) -> Topology:
    return Topology.torus(dims, wrap, link_bw_bytes_per_s=1e11, link_latency_s=1e-6)


# (id, topology builder, degraded links, failed links)
CASES = [
    ("v4-4x4x4", lambda: topology_for(load_spec("tpu-v4"), 64, (4, 4, 4)), {}, ()),
    ("v5e-4x8-open", lambda: topology_for(load_spec("tpu-v5e"), 32, (4, 8)), {}, ()),
    ("v5e-4x16-open-x", lambda: topology_for(load_spec("tpu-v5e"), 64, (4, 16)), {}, ()),
    ("v4-4x4x16", lambda: topology_for(load_spec("tpu-v4"), 256, (4, 4, 16)), {}, ()),
    ("4x4x16-open-z", lambda: _torus((4, 4, 16), (True, True, False)), {}, ()),
    ("v4-2x4x4-open", lambda: topology_for(load_spec("tpu-v4"), 32, (2, 4, 4)), {}, ()),
    ("odd-3x5", lambda: _torus((3, 5), (True, True)), {}, ()),
    ("ring-8", lambda: _torus((8,), (True,)), {}, ()),
    ("v4-4x4x4-faulty", lambda: topology_for(load_spec("tpu-v4"), 64, (4, 4, 4)), {"2-3": 0.5, "16->32": 0.25},
     ("0-1", "5->6", "0->16")),
    ("v5e-4x8-open-failed", lambda: topology_for(load_spec("tpu-v5e"), 32, (4, 8)), {}, ("9-10",)),
    ("h100-2-nodes", lambda: topology_for(load_spec("h100"), 16), {}, ()),
    ("h100-4-nodes-2-per-leaf", lambda: topology_for(load_spec("h100", {"topology.nodes_per_leaf": 2}), 32), {}, ()),
    ("h100-4-nodes-rail", lambda: topology_for(load_spec("h100", {"topology.fabric": "rail_optimized"}), 32),
     {"leaf0.1->spine": 0.5}, ("0-leaf0.0",)),
]


def _all_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.repeat(np.arange(n), n), np.tile(np.arange(n), n)


def _rows(matrix: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(r[r >= 0].tolist()) for r in matrix]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    _, build, degraded, failed = request.param
    topo = build()
    factors = link_factors(topo, degraded, failed)
    src, dst = _all_pairs(topo.num_chips)
    return topo, factors, src, dst


@pytest.mark.slow
def test_router_route_and_route_matrix_agree(case):
    topo, factors, src, dst = case
    router = Router(topo, factors)
    one_by_one = [router.route(s, d) for s, d in zip(src.tolist(), dst.tolist())]
    assert _rows(Router(topo, factors).route_matrix(src, dst)) == one_by_one
    assert Router(topo, factors).routes(src, dst) == one_by_one
    # and in any order and batch size (the first pairs alone, the pairs reversed)
    assert _rows(Router(topo, factors).route_matrix(src[:7], dst[:7])) == one_by_one[:7]
    assert _rows(Router(topo, factors).route_matrix(src[::-1], dst[::-1])) == one_by_one[::-1]


@pytest.mark.slow
def test_router_follows_topology_route_unless_a_link_failed(case):
    topo, factors, src, dst = case
    router = Router(topo, factors)
    failed = {lid for lid, f in factors.items() if f == 0}
    detours = 0
    for s, d in zip(src.tolist(), dst.tolist()):
        plain = tuple(lk.id for lk in topo.route(s, d))
        assert plain == tuple(lk.id for lk in topo.route_tuple(s, d)) and len(plain) == topo.hops(s, d)
        got = router.route(s, d)
        if failed.isdisjoint(plain):
            assert got == plain, (s, d)
            continue
        detours += 1
        assert failed.isdisjoint(got) and (s, d) in router.rerouted
        path = [topo.links[i] for i in got]
        assert path[0].src == s and path[-1].dst == d and all(a.dst == b.src for a, b in zip(path, path[1:]))
        if topo.kind == "torus":      # round the other way or a sidestep: never more than 2 hops longer
            assert len(got) <= len(plain) + 2, (s, d, got)
    assert (detours > 0) == bool(failed)
    assert len(router.rerouted) == detours


def test_des_patterns_are_the_routes(case):
    topo, factors, src, dst = case
    keep = src != dst                     # the DES refuses a message to itself
    src, dst = src[keep], dst[keep]
    router = des_routing.FlowRouter(topo, factors)
    pat = router.pattern(src, dst)
    expect = _rows(Router(topo, factors).route_matrix(src, dst))
    assert _rows(pat.links) == expect
    assert pat.links.shape[1] == max(map(len, expect))
    assert pat.latency_s == pytest.approx([sum(topo.links[i].latency_s for i in r) for r in expect])
    assert router.pattern(src, dst) is pat                      # kept by its chip pairs
    if any(f == 0 for f in factors.values()):
        assert router.rerouted


@pytest.mark.slow
def test_torus_routes_are_dimension_order_shortest_way_ties_plus(case):
    """The hop count and direction along each dim, from the coordinates alone (closed form)."""
    topo, factors, src, dst = case
    if topo.kind != "torus":
        pytest.skip("dimension-order routing is the torus's")
    for s, d in zip(src.tolist(), dst.tolist()):
        moves = [lk.label.split()[1] for lk in topo.route(s, d)]     # "x+", "y-", ...
        expect = []
        for name, size, wrap, a, b in zip(topo.dim_names, topo.dims, topo.wrap, topo.coords(s), topo.coords(d)):
            if wrap:
                fwd = (b - a) % size
                n, sign = (fwd, "+") if fwd <= size - fwd else (size - fwd, "-")
            else:
                n, sign = abs(b - a), "+" if b > a else "-"
            expect += [name + sign] * n
        assert moves == expect, (s, d)


def test_gpu_routes_go_through_the_switches(case):
    topo, factors, src, dst = case
    if topo.kind != "gpu":
        pytest.skip("GPU fabric routes")
    per = topo.dims[1]
    for s, d in zip(src.tolist(), dst.tolist()):
        r = topo.route(s, d)
        if s == d:
            assert r == []
        elif s // per == d // per:
            assert [lk.dst for lk in r] == [f"nvswitch{s // per}", d]
        else:
            same_leaf = topo.leaf_of[s] == topo.leaf_of[d]
            assert [lk.kind for lk in r] == ["ib"] * (2 if same_leaf else 4)
            assert r[0].dst == topo.leaf_of[s] and r[-1].src == topo.leaf_of[d]

"""The double binary tree all-reduce across H100 nodes (``collectives/alg_gpu.py``): its closed form,
the analytical price (members' asynchronous critical path, ``hwmodels/network/async_steps.py``) against the
DES, and the per-collective choice (``hwmodels/network/choice.py``).

Setting: ``Mesh(data=q, model=8)`` on H100 (DGX nodes of 8 GPUs, one NIC of ``B`` = 50 GB/s per GPU,
fat tree of 4 nodes per leaf); the all-reduce runs over ``data``: ``q`` members, one GPU per node, 8
such groups at once on their own NICs. ``a``: a route under one leaf (NIC -> leaf -> NIC, 2 IB hops),
``c``: a route over the spine (4 hops); ``N`` bytes; below 2 MiB the tree is unpipelined (one segment
of ``N/2`` per tree), so every message moves ``N/2`` and ``b = N/2B``.
"""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import load_spec, place, simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.network.async_steps import DRIFT_S, _fair_busy, drifts
from partir_emu.hwmodels.network.choice import TREE_ACROSS_NODES_MAX_BYTES
from partir_emu.hwmodels.network.comm import CommModel
from tests.unit.test_multidim_tree_rail_algorithms import one_all_reduce

REL = 1e-9
KIB, MIB = 1 << 10, 1 << 20
SPEC = load_spec("h100")
NET = SPEC.network
A, C, B = 2 * NET.ib_latency_s, 4 * NET.ib_latency_s, NET.nic_bw_bytes_per_s


def both(q: int, n: int, alg: str | None) -> tuple[float, float, str]:
    """(analytical, DES, algorithm) of one all-reduce of ``n`` bytes over ``data`` on ``q`` nodes."""
    mesh = Mesh(data=q, model=8)
    pl = place(mesh, SPEC)
    spmd = one_all_reduce(mesh, n, ("data",))
    ana = simulate(spmd, SPEC, pl, algorithms=alg)
    return ana.step_s, simulate_des(spmd, SPEC, pl, algorithms=alg).step_s, ana.collectives[0].algorithm


def tree_4_nodes(n: float) -> float:
    """4 nodes under one leaf (every route ``a``). Tree A: root 1; 1 <- 0, 2; 2 <- 3. Tree B (shifted by
    one): root 2; 2 <- 1, 3; 3 <- 0. Step 0: 0 -> 1, 0 -> 3 share 0's NIC, 1 -> 2, 3 -> 2 share 2's: all
    ``a + 2b``. Step 1: 2 -> 1, 3 -> 2, ``a + b``. Step 2: the roots send to two children each, ``a + 2b``.
    Step 3: 2 -> 3, 3 -> 0, ``a + b``. Every member waits in every step: ``4a + 6b = 4a + 3 N/B``."""
    return 4 * A + 3 * n / B


def tree_8_nodes(n: float) -> float:
    """8 nodes, 0-3 under leaf 0 and 4-7 under leaf 1. Tree A: 3 <- 1, 5; 1 <- 0, 2; 5 <- 4, 6; 6 <- 7.
    Tree B: 4 <- 2, 6; 2 <- 1, 3; 6 <- 5, 7; 7 <- 0. Edges 3-5, 2-4 and 0-7 cross the spine (``c``).
    Members move on as their own messages arrive (entry times, ``c > a``):

    - up 0 (leaves; 0 sends two): 0 and 7 leave at ``c + 2b``, 4 at ``a + b``, the rest at ``a + 2b``;
    - up 1 (1 -> 3, 6 -> 5, 2 -> 4, 7 -> 6): 1, 3, 5 at ``2a + 3b``; 2, 4, 6, 7 at ``a + c + 3b``;
    - up 2 (5 -> 3 over the spine, 6 -> 4 under a leaf): both arrive at ``2a + c + 4b``;
    - down 1 (the roots 3 and 4 send to two children): ``2a + 2c + 6b`` over the spine, ``3a + c + 6b`` not;
    - down 2 (1, 2, 5, 6 send to two children each): the last leave at ``3a + 2c + 8b``;
    - down 3 (6 -> 7, then 7 -> 0 over the spine): ``4a + 2c + 9b``.

    Priced in lock step (every step its slowest message) it would be ``5c + a + 9b``."""
    return 4 * A + 2 * C + 4.5 * n / B


@pytest.mark.parametrize("n", [4 * KIB, 256 * KIB, MIB])
def test_tree_closed_form_on_4_and_8_nodes(n):
    ana4, des4, _ = both(4, n, "tree")
    assert ana4 == pytest.approx(tree_4_nodes(n), rel=REL) and des4 == pytest.approx(ana4, rel=REL)
    ana8, des8, _ = both(8, n, "tree")
    assert ana8 == pytest.approx(tree_8_nodes(n), rel=REL) and des8 == pytest.approx(ana8, rel=REL)
    assert ana8 < 5 * C + A + 4.5 * n / B                       # below the lock-step sum
    ring4 = CommModel(place(Mesh(data=4, model=8), SPEC), "ring").cost("all_reduce", ("data",), n).time_s
    assert ring4 == pytest.approx(6 * (A + n / 4 / B), rel=REL)


@pytest.mark.parametrize("q,n", [(2, 4 * KIB), (4, 4 * MIB), (8, 64 * KIB), (8, 4 * MIB), (16, 16 * KIB),
                                 (16, MIB), (16, 4 * MIB), (32, 8 * MIB)])
def test_tree_across_nodes_analytical_within_5_percent_of_the_des(q, n):
    """Pipelined (from 2 MiB) and not: uneven steps (a parent's NIC serves two children, spine or leaf
    routes, merged segments), priced by the members' asynchronous critical path."""
    ana, des, alg = both(q, n, "tree")
    assert alg == "tree" and ana == pytest.approx(des, rel=0.05)


def test_choice_tree_small_ring_large_across_nodes():
    """4 nodes: tree 4a + 3 N/B against ring 6a + 1.5 N/B, equal at N* = 4aB/3 (133 KB): the default
    takes the tree below and the ring above. From 8 to 16 nodes the tree wins at small sizes and the
    ring at large ones (where the tree is not offered: above 8 MiB). With 8 GPUs per node the
    hierarchical forms stay cheaper (the flat tree crosses NICs log2 p times)."""
    cross = 4 * A * B / 3
    for n, want in [(4 * KIB, "tree"), (int(cross / 1.5) // 4 * 4, "tree"), (int(cross * 1.5) // 4 * 4, "ring")]:
        ana, des, alg = both(4, n, None)
        assert alg == want and des == pytest.approx(ana, rel=REL)
    for q in (8, 16):
        assert both(q, 4 * KIB, None)[2] == "tree"
        assert both(q, 4 * MIB, None)[2] == "ring"
        assert both(q, 2 * TREE_ACROSS_NODES_MAX_BYTES, None)[2] == "ring"
    pl = place(Mesh(data=8, model=8), SPEC)
    for n in (4 * KIB, MIB):
        c = CommModel(pl).cost("all_reduce", ("data", "model"), n)
        assert c.algorithm == "rail"
        assert c.time_s < CommModel(pl, "tree").cost("all_reduce", ("data", "model"), n).time_s


def test_fair_sharing_of_one_link_and_uneven_bytes():
    """Flows of 1 and 2 bytes started together on one link of 1 B/s: the small one is done after 2 s,
    the large one after 3 s (not 4, as at a fixed half share); equal flows give the k x / bw share."""
    links, load = np.array([[0, 1], [0, 2]]), np.array([2.0, 1.0, 1.0])
    busy = _fair_busy(links, np.array([1.0, 2.0]), np.ones(3), load)
    assert busy.tolist() == [[2.0, 1.0], [3.0, 2.0]]
    assert _fair_busy(links, np.array([2.0, 2.0]), np.ones(3), load)[:, 0].tolist() == [4.0, 4.0]
    assert _fair_busy(links, np.array([2.0, 2.0 + 1e-9]), np.ones(3), load)[:, 0] == pytest.approx([4.0, 4.0])
    # a step drifts when its messages' times differ by more than the DES's resolution (1 ns)
    inv, lat = np.full((1, 2), 1 / B), np.full((1, 2), A)
    for nb, want in [([2 * MIB, MIB], True), ([MIB, MIB], False), ([8.0, 4.0], False), ([4.0, 0.0], False)]:
        b = np.array([nb])
        assert drifts(lat[None] + b[:, None, :] * inv[None], inv, b, False) == want
    assert drifts(np.array([[[A, A + 2 * DRIFT_S]]]), inv, np.ones((1, 2)), True)


def test_one_fabric_prices_each_size_as_a_fresh_one():
    """A fabric keeps the asynchronous critical path's step shapes per groups (``Fabric._async``): trees
    of several sizes over the same groups priced on one model (the sizes interleaved, one asked twice)
    are priced exactly as on a fresh model each (a memo that kept a step's times by its shape alone
    would give the first size's price to the others)."""
    pl = place(Mesh(data=8, model=8), SPEC)
    shared = CommModel(pl, "tree")
    for n in (4 * KIB, MIB, 64 * KIB, 4 * KIB + 512, MIB):
        got = shared.cost("all_reduce", ("data",), n).time_s
        assert got == CommModel(pl, "tree").cost("all_reduce", ("data",), n).time_s
    assert shared.fabric._async                                  # the uneven trees went through the memo

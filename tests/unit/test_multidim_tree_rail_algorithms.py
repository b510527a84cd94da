"""Issue 13 part 3: the multi-dimensional torus (``multidim``), the double binary ``tree`` and the
rail-optimized hierarchical (``rail``) algorithms, and the per-collective choice among candidates.

Each algorithm is a schedule: it must pass ``validate_schedule``, compute the numpy reference on the
in-process executor (the one LocalMesh runs), and be priced by the analytical model and the DES as
its alpha-beta closed form says. Notation: ``A`` latency per hop, ``B`` bandwidth per link one way,
``N`` bytes of the full buffer.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from partir_emu.app.cli.simulate import parse_algorithms
from partir_emu.collectives.algorithms import ALGORITHMS, build_schedule
from partir_emu.collectives.local import run_schedule
from partir_emu.collectives.schedule import validate_schedule
from partir_emu.collectives.semantics import reference
from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels import load_spec, place, simulate
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.network.choice import candidate_names
from partir_emu.hwmodels.network.comm import CommModel
from partir_emu.runtime.local_mesh import LocalMesh

REL = 1e-9
MIB = 1 << 20


def one_all_reduce(mesh: Mesh, nbytes: int, axes: tuple[str, ...] | None = None) -> SpmdProgram:
    """One f32 all-reduce of a replicated ``nbytes`` buffer over ``axes`` (default: every axis)."""
    x, y = Var(0, (nbytes // 4,), "float32"), Var(1, (nbytes // 4,), "float32")
    eqn = Eqn("all_reduce", (x,), (y,), {"axes": tuple(axes or mesh.axis_names), "op": "sum"})
    prog = Program((x,), ("x",), (eqn,), (y,), ("y",))
    return SpmdProgram(mesh, prog, (Sharding.replicated(1),), (Sharding.replicated(1),), (x.shape,), (y.shape,))


# -- correctness: validate_schedule and the numpy reference -----------------------------------------------
CASES = [("multidim", s, None) for s in [(4, 4), (2, 3), (3, 5), (2, 2, 3), (4, 1, 4), (3, 3, 3)]] \
    + [("tree", (p,), None) for p in [2, 3, 5, 7, 8, 13, 16]] \
    + [("rail", (p,), d) for p, d in [(8, 2), (12, 4), (16, 4), (6, 3), (32, 8), (40, 4)]]


@pytest.mark.parametrize("alg,shape,dpn", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_new_schedule_validates_and_computes_the_reference(alg, shape, dpn, kind):
    p = math.prod(shape)
    rng = np.random.default_rng(p)
    sizes = [p * 6, 1, p * 6 + 3, 5 * p + 1] if kind == "all_reduce" else [p * 6, p * 50]
    for n, dtype in zip(sizes, ["float32", "float64", "int32", "float32"]):
        sched = build_schedule(kind, shape, n * np.dtype(dtype).itemsize, alg, itemsize=np.dtype(dtype).itemsize,
                               devices_per_node=dpn)
        assert sched.algorithm == (alg if kind == "all_reduce" or alg != "tree" else "ring")
        validate_schedule(sched)
        size = n // p if kind == "all_gather" else n
        bufs = [(rng.standard_normal(size) * 100).astype(dtype) for _ in range(p)]
        got = run_schedule(sched, bufs)
        for g, want in zip(got, reference(kind, bufs, "sum", None)):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-4)


def test_pipelined_tree_validates_and_computes_the_reference():
    """8 MiB over 5 members: 4 segments per tree half, steps 2H + S - 1 = 2*2 + 4 - 1."""
    p, n = 5, 2 * MIB
    sched = build_schedule("all_reduce", (p,), n * 4, "tree")
    assert sched.num_steps == 2 * 2 + 4 - 1
    validate_schedule(sched)
    rng = np.random.default_rng(1)
    bufs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    np.testing.assert_allclose(run_schedule(sched, bufs)[3], sum(b.astype(np.float64) for b in bufs), rtol=1e-4,
                               atol=1e-4)


def test_multidim_splits_the_data_evenly_across_dims():
    """Each of the D parts carries N/D: on 4x4x4 every step of the reduce-scatter moves, per member, one
    message along each of the three dims (both ways), each of the same size."""
    sched = build_schedule("reduce_scatter", (4, 4, 4), 64 * 6 * 4 * 8, "multidim")
    assert sched.num_steps == 3 * 3
    first = sched.messages()[0]
    assert len({m.nbytes for m in first}) == 1 and len(first) == 64 * 6    # 64 members x 3 dims x 2 ways
    assert sched.total_bytes_sent() == build_schedule("reduce_scatter", (4, 4, 4), 64 * 6 * 4 * 8,
                                                      "torus").total_bytes_sent()


def test_local_mesh_runs_the_new_algorithms():
    """LocalMesh with ``algorithm=`` builds the new schedules for a program's all-reduce over two axes."""
    mesh = Mesh(a=2, b=4)
    spmd = one_all_reduce(mesh, 4 * 8 * 6)
    x = np.random.default_rng(0).standard_normal(48).astype(np.float32)
    for alg, dpn in [("multidim", None), ("tree", None), ("rail", 4)]:
        out = LocalMesh(mesh, alg, devices_per_node=dpn).run(spmd, [x]).outputs[0]
        np.testing.assert_allclose(out, 8 * x, rtol=1e-6)


# -- closed forms -------------------------------------------------------------------------------------------
def torus_closed_form(sides: tuple[int, ...], n: float, A: float, B: float, parts: int) -> float:
    """All-reduce over a wrapped torus: per dim a bidirectional ring phase (``s-1`` steps, each way half the
    phase's data); ``parts`` parts step together, each on its own dim (1: ``torus``; len(sides): ``multidim``)."""
    data, t = n / parts, 0.0
    for s in sides:
        t += (s - 1) * (A + data / (2 * s * B))
        data /= s
    return 2 * t


def test_16x16_multidim_is_2x_torus_in_all_three_models():
    """The issue's figure: v5e 16x16, 256 MiB all-reduce over both dims."""
    spec = load_spec("tpu-v5e")
    A, B = spec.network.link_latency_s, spec.network.link_bw_bytes_per_s
    mesh, n = Mesh(x=16, y=16), 256 * MIB
    pl = place(mesh, spec, "x=x,y=y")
    spmd = one_all_reduce(mesh, n)
    t = {}
    for alg in ("torus", "multidim"):
        cf = torus_closed_form((16, 16), n, A, B, 1 if alg == "torus" else 2)
        ana = simulate(spmd, spec, pl, algorithms=alg)
        des = simulate_des(spmd, spec, pl, algorithms=alg)
        assert ana.collectives[0].algorithm == alg
        assert ana.step_s == pytest.approx(cf, rel=REL)
        assert des.step_s == pytest.approx(cf, rel=1e-6)
        t[alg] = (cf, ana.step_s, des.step_s)
    ratios = [a / b for a, b in zip(t["torus"], t["multidim"])]
    assert all(1.95 < r < 2.0 for r in ratios), ratios          # 2x on bytes, the same 60 latency terms
    assert simulate(spmd, spec, pl).collectives[0].algorithm == "multidim"   # and the choice takes it


@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 4, 8)])
def test_3d_multidim_closed_form(dims):
    """3 parts of N/3. Equal dims: every step, each part on its own dim: the closed form above.
    4x4x8: part j's phase on the 8-dim is longer, so parts meet on a dim for some steps; only
    bounds hold (faster than torus, no faster than the equal-split closed form)."""
    spec = load_spec("tpu-v4")
    A, B = spec.network.link_latency_s, spec.network.link_bw_bytes_per_s
    pl = place(Mesh(a=dims[0], b=dims[1], c=dims[2]), spec, "a=x,b=y,c=z")
    n = math.prod(dims) * 6 * 1024 * 4
    t = CommModel(pl, "multidim").cost("all_reduce", ("a", "b", "c"), n).time_s
    t_torus = CommModel(pl, "torus").cost("all_reduce", ("a", "b", "c"), n).time_s
    cf = max(torus_closed_form(tuple(np.roll(dims, -j)), n, A, B, 3) for j in range(3))
    if len(set(dims)) == 1:
        assert t == pytest.approx(cf, rel=REL)
    else:
        assert cf <= t < t_torus


def tree_nvswitch_8(n: float, A: float, B: float) -> float:
    """Unpipelined double binary tree on 8 GPUs of one NVSwitch (every message 2 hops, 2A), by hand.
    Tree A (in order): root 3; 1 <- 0, 2; 5 <- 4, 6; 6 <- 7. Tree B: the same shifted by one. Up: step 0
    the leaves send (1, 2 and 6 each receive 2 halves: load 2), steps 1-2 one message per link; down: the
    roots send to 2 children (uplink load 2), then 1, 5 (A) and 2, 6 (B) to 2 each, then 6 -> 7, 7 -> 0.
    Per-step bandwidth loads 2, 1, 1, 2, 2, 1 halves of N/2: 6 steps, 12A + 4.5 N/B."""
    return 12 * A + 4.5 * n / B


def test_tree_closed_form_and_latency_advantage_at_small_sizes():
    spec = load_spec("h100")
    A, B = spec.network.nvlink_latency_s, spec.network.nvlink_bw_bytes_per_s
    pl = place(Mesh(model=8), spec)
    for n in (4096, 64 * 1024, MIB):
        tree = CommModel(pl, "tree").cost("all_reduce", ("model",), n)
        ring = CommModel(pl, "ring").cost("all_reduce", ("model",), n)
        assert tree.steps == 6 and ring.steps == 14             # 2 log2 p against 2 (p - 1)
        assert tree.time_s == pytest.approx(tree_nvswitch_8(n, A, B), rel=REL)
        assert ring.time_s == pytest.approx(14 * (2 * A + n / 8 / B), rel=REL)
        assert tree.time_s < 0.8 * ring.time_s


def test_choice_tree_small_ring_large_at_the_closed_form_crossover():
    """12A + 4.5 N/B = 28A + 1.75 N/B at N* = 16 A B / 2.75 (2.5 MiB on H100 NVLink): the default takes
    the tree below, the ring above (pipelining, S > 1 from 2 MiB, keeps the tree dearer per byte)."""
    spec = load_spec("h100")
    A, B = spec.network.nvlink_latency_s, spec.network.nvlink_bw_bytes_per_s
    pl = place(Mesh(model=8), spec)
    cross = 16 * A * B / 2.75
    for n, want in [(1024, "tree"), (int(cross / 1.5) // 4 * 4, "tree"), (int(cross * 1.5) // 4 * 4, "ring"),
                    (256 * MIB, "ring")]:
        c = CommModel(pl).cost("all_reduce", ("model",), n)
        assert c.algorithm == want, (n, c)
        assert c.time_s == min(CommModel(pl, a).cost("all_reduce", ("model",), n).time_s for a in ("ring", "tree"))


def rail_closed_form(net, d: int, q: int, n: float, ib_hops: int) -> float:
    """``rail`` all-reduce, q a power of two: one NVSwitch step in node (d-1 messages of N/d share each
    GPU's uplink), log2 q halving steps per rail (N/p x q/2, q/4, ..., 1: (q-1) N/p in all), mirrored."""
    p = d * q
    intra = 2 * net.nvlink_latency_s + (d - 1) * (n / d) / net.nvlink_bw_bytes_per_s
    inter = math.log2(q) * ib_hops * net.ib_latency_s + (q - 1) * (n / p) / net.nic_bw_bytes_per_s
    return 2 * (intra + inter)


def test_rail_closed_form_and_choice_across_nodes():
    """8 DGX H100 on a rail-optimized fabric (32 nodes per scalable unit): every cross-node message of
    ``rail`` stays on its rail's leaf (2 IB hops), like ``hierarchical``'s, but in log2 q steps."""
    spec = load_spec("h100", {"topology.fabric": "rail_optimized"})
    mesh = Mesh(data=8, model=8)
    pl = place(mesh, spec)
    for n in (64 * 1024, 64 * MIB):
        c = CommModel(pl, "rail").cost("all_reduce", ("data", "model"), n)
        assert c.algorithm == "rail" and c.max_hops == 2 and c.steps == 2 * (1 + 3)
        assert c.time_s == pytest.approx(rail_closed_form(spec.network, 8, 8, n, 2), rel=REL)
        h = CommModel(pl, "hierarchical").cost("all_reduce", ("data", "model"), n)
        assert c.time_s < h.time_s
        assert CommModel(pl).cost("all_reduce", ("data", "model"), n).time_s == min(
            CommModel(pl, a).cost("all_reduce", ("data", "model"), n).time_s for a in ("hierarchical", "rail"))


# -- choice ---------------------------------------------------------------------------------------------
def test_candidates_and_requested_algorithm():
    v5e, h100 = load_spec("tpu-v5e"), load_spec("h100")
    tpu = place(Mesh(x=16, y=16), v5e, "x=x,y=y")
    assert candidate_names("all_reduce", tpu.group(("x", "y")), tpu.topology) == ["torus", "multidim"]
    assert candidate_names("all_reduce", tpu.group(("x",)), tpu.topology) == ["bidir_ring"]
    gpu = place(Mesh(data=4, model=8), h100)
    assert candidate_names("all_reduce", gpu.group(("data", "model")), gpu.topology) == ["hierarchical", "rail", "tree"]
    assert candidate_names("all_reduce", gpu.group(("data",)), gpu.topology) == ["ring", "tree"]
    # across nodes the tree is offered up to 8 MiB (where its price is checked against the DES)
    assert candidate_names("all_reduce", gpu.group(("data",)), gpu.topology, 16 * MIB) == ["ring"]
    assert candidate_names("all_reduce", gpu.group(("model",)), gpu.topology, 16 * MIB) == ["ring", "tree"]
    assert candidate_names("all_gather", gpu.group(("data", "model")), gpu.topology) == ["hierarchical", "rail"]
    assert candidate_names("all_reduce", gpu.group(("model",)), gpu.topology) == ["ring", "tree"]
    assert candidate_names("all_to_all", gpu.group(("model",)), gpu.topology) == ["hierarchical"]
    # a requested algorithm is the only one priced, even where another is cheaper
    n = 256 * MIB
    assert CommModel(tpu, "torus").cost("all_reduce", ("x", "y"), n).algorithm == "torus"
    assert CommModel(tpu, {"all_reduce": "multidim"}).cost("all_reduce", ("x", "y"), n).algorithm == "multidim"
    assert {"multidim", "tree", "rail"} <= set(ALGORITHMS)
    assert parse_algorithms("multidim") == "multidim"
    assert parse_algorithms("all_reduce=tree,all_gather=rail") == {"all_reduce": "tree", "all_gather": "rail"}


def test_every_candidate_is_priced_on_512_gpus():
    """512 H100 (64 nodes): hierarchical, rail and tree all priced for an all-reduce of each size
    (how fast: benchmarks/simulate_speed.py, not a timed test)."""
    spec = load_spec("h100")
    pl = place(Mesh(data=64, model=8), spec)
    got = [CommModel(pl).cost("all_reduce", ("data", "model"), n) for n in (64 * 1024, 16 * MIB, 256 * MIB)]
    assert all(c.time_s > 0 and c.group_size == 512 for c in got)
    assert got[0].time_s < got[1].time_s < got[2].time_s


# -- the DES replays the chosen schedules ------------------------------------------------------------------
@pytest.mark.parametrize("hardware,mesh,axes,n,want", [
    ("h100", Mesh(model=8), None, 64 * 1024, "tree"),
    ("h100", Mesh(data=4, model=8), None, 256 * 1024, "rail"),
    ("h100", Mesh(data=4, model=8), None, 8 * MIB, "rail"),
    ("tpu-v4", Mesh(a=4, b=4, c=4), ("b", "c"), 16 * 6 * 1024 * 4, "multidim"),
    ("tpu-v4", Mesh(a=4, b=4, c=4), None, 64 * 6 * 1024 * 4, "multidim"),
])
def test_des_equals_analytical_on_the_new_defaults(hardware, mesh, axes, n, want):
    """Even steps (every message of a step alike): the DES, members running on their own, gives the
    lock-step price exactly."""
    spec = load_spec(hardware)
    pl = place(mesh, spec, "a=x,b=y,c=z" if hardware == "tpu-v4" else None)
    spmd = one_all_reduce(mesh, n, axes)
    ana, des = simulate(spmd, spec, pl), simulate_des(spmd, spec, pl)
    assert ana.collectives[0].algorithm == want
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)


def test_tree_across_nodes_runs_ahead_in_the_des():
    """8 nodes, one GPU each, fat tree of 4 nodes per leaf: some tree edges cross the spine (4 hops),
    some stay under a leaf (2). Priced in lock step (every step its slowest message) it would be
    5c + a + 4.5 N/B; members move on when their own messages are in, so both models give the critical
    path 4a + 2c + 4.5 N/B (hand-derived in ``tests/unit/test_tree_across_nodes.py``), and the default takes
    the tree over the ring (2 log2 p against 2 (p - 1) steps)."""
    spec = load_spec("h100")
    mesh = Mesh(data=8, model=8)
    pl = place(mesh, spec)
    spmd = one_all_reduce(mesh, 4096, ("data",))
    ana, des = simulate(spmd, spec, pl, algorithms="tree"), simulate_des(spmd, spec, pl, algorithms="tree")
    a, c = 2 * spec.network.ib_latency_s, 4 * spec.network.ib_latency_s
    lock_step = 5 * c + a + 4.5 * 4096 / spec.network.nic_bw_bytes_per_s
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9) and ana.step_s < 0.8 * lock_step
    assert simulate(spmd, spec, pl).collectives[0].algorithm == "tree"

"""The DES against the analytical closed forms where nothing contends, and against hand
calculations where links are shared, degraded or failed.

Notation: p members, n bytes of the full buffer, A latency per hop, B one-way bandwidth per link.
"""
from __future__ import annotations

import itertools

import pytest

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels import Placement, Topology, load_spec, place, simulate
from partir_emu.hwmodels.des import DesError, simulate_des
from partir_emu.hwmodels.machine.links import LinkSpecError

A, B = 1e-6, 4.5e10
MM = (((1,), (0,)), ((), ()))


def ring_topo(p: int, wrap: bool = True) -> Topology:
    return Topology.torus((p,), (wrap,), link_bw_bytes_per_s=B, link_latency_s=A)


def torus_topo(dims: tuple[int, ...]) -> Topology:
    return Topology.torus(dims, (True,) * len(dims), link_bw_bytes_per_s=B, link_latency_s=A)


class Prog:
    """A hand-written SpmdProgram (the compiler is tested elsewhere)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.ids = itertools.count()
        self.inputs: list[Var] = []
        self.eqns: list[Eqn] = []

    def input(self, shape, dtype: str = "float32") -> Var:
        v = Var(next(self.ids), tuple(shape), dtype)
        self.inputs.append(v)
        return v

    def eq(self, prim: str, ins, shape, dtype: str = "float32", **params) -> Var:
        out = Var(next(self.ids), tuple(shape), dtype)
        self.eqns.append(Eqn(prim, tuple(ins), (out,), params))
        return out

    def coll(self, kind: str, x: Var, axes: tuple[str, ...]) -> Var:
        g = self.mesh.group_size(axes)
        n = x.shape[0]
        if kind == "all_gather":
            return self.eq(kind, (x,), (n * g,), axes=axes, dim=0)
        if kind == "reduce_scatter":
            return self.eq(kind, (x,), (n // g,), axes=axes, dim=0)
        if kind == "all_to_all":
            return self.eq(kind, (x,), (n,), axes=axes, split_dim=0, concat_dim=0)
        return self.eq(kind, (x,), (n,), axes=axes, op="sum")

    def build(self, outputs) -> SpmdProgram:
        outputs = tuple(outputs)
        prog = Program(tuple(self.inputs), tuple(f"in{i}" for i in range(len(self.inputs))), tuple(self.eqns),
                       outputs, tuple(f"out{i}" for i in range(len(outputs))))
        return SpmdProgram(self.mesh, prog, tuple(Sharding.replicated(v.ndim) for v in self.inputs),
                           tuple(Sharding.replicated(len(o.shape)) for o in outputs),
                           tuple(v.shape for v in self.inputs), tuple(o.shape for o in outputs))


def one_collective(mesh: Mesh, kind: str, axes: tuple[str, ...], nbytes: int) -> SpmdProgram:
    """``kind`` over ``axes`` with a full buffer of ``nbytes`` (f32)."""
    b = Prog(mesh)
    g = mesh.group_size(axes)
    elems = nbytes // 4
    x = b.input((elems // g if kind == "all_gather" else elems,))
    return b.build([b.coll(kind, x, axes)])


def both(spmd: SpmdProgram, spec, placement, algorithm=None, **kw):
    ana = simulate(spmd, spec, placement, algorithms=algorithm, overlap=kw.pop("overlap", False))
    des = simulate_des(spmd, spec, placement, ana.overlap, algorithms=algorithm, **kw)
    return ana, des


# -- uncontended: DES == analytical closed form -------------------------------------------------------
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _ring_case(algorithm):
    spec = load_spec("tpu-v4")
    p = 8
    return spec, Placement(Mesh(x=p), Topology.torus(
        (p,), (True,), link_bw_bytes_per_s=spec.network.link_bw_bytes_per_s,
        link_latency_s=spec.network.link_latency_s)), ("x",)


def _torus_case(algorithm):
    spec = load_spec("tpu-v4")                # 4x4x4, all dims wrap; 4 groups over y and z, one per x plane
    pl = place(Mesh(a=4, b=4, c=4), spec, "a=x,b=y,c=z")
    return spec, pl, ("b", "c")


def _nvswitch_case(algorithm):
    spec = load_spec("h100")
    return spec, place(Mesh(model=8), spec), ("model",)


def _fat_tree_case(algorithm):
    spec = load_spec("h100", {"topology.nodes_per_leaf": 1})   # 2 nodes under 2 leaves: through the spine
    return spec, place(Mesh(data=2, model=8), spec), ("data", "model")


TOPOLOGIES = {"ring": _ring_case, "torus": _torus_case, "nvswitch": _nvswitch_case, "fat_tree": _fat_tree_case}
ALGORITHMS = ("ring", "bidir_ring", "recursive", "torus", "hierarchical", None)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a or "default")
@pytest.mark.parametrize("kind", KINDS)
def test_uncontended_single_collective_matches_closed_form(topology, algorithm, kind):
    spec, pl, axes = TOPOLOGIES[topology](algorithm)
    g = pl.mesh.group_size(axes)
    if algorithm == "hierarchical" and topology in ("ring", "torus"):
        algorithm = None                     # hierarchical needs nodes: only on GPUs
    if kind == "all_to_all" and topology in ("torus", "fat_tree") and algorithm not in (None, "hierarchical") \
            and (topology, algorithm) != ("torus", "torus"):
        pytest.skip("pairwise all-to-all over a flattened torus / several nodes is contended inside its "
                    "steps: see test_pairwise_all_to_all_members_run_ahead")
    n = g * g * 2 * 1024 * 4                 # divisible for every kind, bandwidth-dominated
    spmd = one_collective(pl.mesh, kind, axes, n)
    ana, des = both(spmd, spec, pl, algorithm)
    (row,) = des.collectives
    assert row.algorithm == ana.collectives[0].algorithm
    assert ana.step_s > 0
    assert des.step_s == pytest.approx(ana.step_s, rel=0.01), (row.algorithm, des.step_s, ana.step_s)
    if row.algorithm != "direct":            # direct: flows of one GPU share its uplink, as priced
        assert row.max_link_flows == row.group_link_flows


def test_uncontended_ring_all_reduce_closed_form_exactly():
    p, n = 8, 8 * 1 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), n)
    _, des = both(spmd, spec, pl, "ring")
    assert des.step_s == pytest.approx(2 * (p - 1) / p * n / B + 2 * (p - 1) * A, rel=1e-9)
    _, des2 = both(spmd, spec, pl)            # bidirectional: half the bandwidth term
    assert des2.step_s == pytest.approx((p - 1) / p * n / B + 2 * (p - 1) * A, rel=1e-9)


@pytest.mark.parametrize("topology", ["torus", "fat_tree"])
def test_pairwise_all_to_all_members_run_ahead(topology):
    """Pairwise exchange flattened over 64 chips: at step k member i sends to i+k, and the messages
    of one step cross the network unevenly (1 to 6 torus hops; NVLink or NIC). Priced step by step in
    lock step, max-min rates give the lock-step sum (the analytical price is no less); but a member whose
    messages of step k were quick starts step k+1 while others are still in step k, and their flows
    meet on the links: the DES (per-member sendrecv, as MPI's pairwise all-to-all runs) is slower.
    Not a closed-form case; the direction is what the test holds."""
    import numpy as np

    from partir_emu.hwmodels.des import FlowRouter, max_min_rates
    from partir_emu.hwmodels.network.comm import CommModel

    if topology == "torus":
        spec = load_spec("tpu-v4")
        pl, axes = place(Mesh(a=4, b=4, c=4), spec, "a=x,b=y,c=z"), ("a", "b", "c")
    else:
        spec = load_spec("h100")
        pl, axes = place(Mesh(data=8, model=8), spec), ("data", "model")
    g = pl.mesh.group_size(axes)
    n = g * g * 2 * 1024 * 4
    ana, des = both(one_collective(pl.mesh, "all_to_all", axes, n), spec, pl, "ring")
    choice, sched = CommModel(pl, "ring").schedule("all_to_all", axes, n)
    router, lockstep = FlowRouter(pl.topology), 0.0
    for msgs in sched.messages():
        pat = router.pattern(np.array([choice.chips[m.src] for m in msgs]), np.array([choice.chips[m.dst] for m in msgs]))
        rates, _ = max_min_rates(pat.links, router.bw)
        lockstep += float((pat.latency_s + np.array([m.nbytes for m in msgs]) / rates).max())
    # the analytical price is the members' critical path (hwmodels/network/async_steps.py): early flows take a
    # share of the slow links, flows that start apart share less; within 1 % of the lock-step sum here
    # (0.2 % below it on the torus), and the DES is slower than lock step
    assert ana.step_s >= 0.99 * lockstep
    assert des.step_s > 1.005 * lockstep


# -- contended: DES differs from the analytical model, by a hand calculation --------------------------
def test_axis_across_two_torus_dims_groups_share_links():
    """Mesh(b=8, a=2) on a 4x4 torus (both dims wrap): the default placement puts b on x (all 4)
    and on y with stride 2 (y in {0,2} for a=0, {1,3} for a=1). b's torus all-reduce:

    - x phase: bidirectional rings on whole wrapped x lines, 3 RS + 3 AG steps of n/8, one flow
      per link: A + (n/8)/B each, in both models;
    - y phase: 1 RS + 1 AG step of n/8 between y=0 and y=2 (2 hops, the + way round). The other b
      group's messages (y=1 -> 3 and 3 -> 1) cross the same y+ links: 2 flows per link, so each
      message runs at B/2: 2A + 2(n/8)/B per step. The analytical model counts the messages of every
      group on a link (hwmodels.contention), so it sees the same.

    both = 6(A + n/8B) + 2(2A + 2n/8B) = 10A + 1.25 n/B (priced one group alone: 10A + n/B)."""
    n = 64 << 20
    pl = Placement(Mesh(b=8, a=2), torus_topo((4, 4)))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_reduce", ("b",), n)
    ana, des = both(spmd, spec, pl)
    assert ana.step_s == pytest.approx(10 * A + 1.25 * n / B, rel=1e-9)
    assert des.step_s == pytest.approx(10 * A + 1.25 * n / B, rel=1e-6)
    (row,) = des.collectives
    assert (row.max_link_flows, row.own_link_flows, row.group_link_flows, row.contention) == (2, 2, 1, "groups")
    assert row.worst_link.startswith("ici y+")


def test_two_axes_collectives_share_links():
    """A 4-chip ring (wrap), Mesh(a=2, b=2): b groups {0,1},{2,3} are neighbours; a groups {0,2},{1,3}
    send 2 hops the + way. Two independent all-reduces of n bytes (p=2 ring: RS then AG, n/2 each),
    run concurrently on two communication streams.

    Flows on the + links: 0->1 carries b(0->1), a(0->2), a(3->1); 2->3 carries b(2->3), a(2->0),
    a(1->3): 3 flows each, so every + flow runs at B/3 (max-min); b's - flows run at B but a member
    waits for its + message. Each step takes ~ (n/2)/(B/3) = 1.5 n/B, so b takes ~3 n/B instead of
    n/B + 2A alone, and the step ~3 n/B. The analytical model (one stream; the two a groups share
    the + links, each message at B/2) says a: 2 n/B + 4A, b: n/B + 2A, step 3 n/B + 6A."""
    n = 64 << 20
    pl = Placement(Mesh(a=2, b=2), ring_topo(4))
    spec = load_spec("tpu-v4")
    b = Prog(pl.mesh)
    x, y = b.input((n // 4,)), b.input((n // 4,))
    spmd = b.build([b.coll("all_reduce", x, ("a",)), b.coll("all_reduce", y, ("b",))])
    ana, des = both(spmd, spec, pl, overlap=True, comm_streams=2)
    assert ana.step_s == pytest.approx(3 * n / B + 6 * A, rel=1e-9)
    assert des.step_s == pytest.approx(3 * n / B, rel=1e-3)
    ra, rb = des.collectives
    assert rb.duration_s == pytest.approx(3 * n / B, rel=1e-3)
    assert rb.contention == "other" and rb.max_link_flows == 3
    # one stream: b alone takes its closed form; the step is the same (the + links are the bottleneck)
    des1 = simulate_des(spmd, spec, pl, True)
    assert des1.collectives[1].duration_s == pytest.approx(n / B + 2 * A, rel=1e-9)
    assert des1.collectives[0].duration_s == pytest.approx(2 * n / B + 4 * A, rel=1e-9)   # a: 2 flows per + link
    assert des1.step_s == pytest.approx(3 * n / B + 6 * A, rel=1e-9)


def test_degraded_link_slows_every_ring_step():
    """8-chip ring, unidirectional ring all-gather, link 3->4 at half bandwidth. Member 3 sends n/8 over
    it at every step and cannot start the next before it is delivered, so each of the 7 steps takes
    A + 2(n/8)/B: DES - analytical = 7 (n/8)/B exactly (the analytical model knows no degradation)."""
    p, n = 8, 64 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    ana, des = both(spmd, spec, pl, "ring", degraded_links={"3->4": 0.5})
    assert ana.step_s == pytest.approx((p - 1) * (A + n / p / B), rel=1e-9)
    assert des.step_s == pytest.approx((p - 1) * (A + 2 * n / p / B), rel=1e-9)
    assert des.step_s - ana.step_s == pytest.approx((p - 1) * n / p / B, rel=1e-6)
    assert "x0.5 bandwidth" in des.faults[0]
    top = des.top_links[0]                    # busiest: the same bytes on half the bandwidth
    assert top.label == str(pl.topology.link(3, 4)) and top.bw_factor == 0.5
    assert top.utilization == pytest.approx(2 * des.top_links[1].utilization, rel=1e-9)


def test_failed_link_reroutes_the_other_way_round():
    """Same ring, link 3->4 failed: 3's message goes 3->2->1->0->7->6->5->4 on the - links (7 hops,
    unused by the unidirectional ring, so full bandwidth). Each step now takes 7A + (n/8)/B:
    DES - analytical = 7 · 6A (latency only)."""
    p, n = 8, 8 << 20
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    ana, des = both(spmd, spec, pl, "ring", failed_links=("3->4",))
    assert des.step_s == pytest.approx((p - 1) * ((p - 1) * A + n / p / B), rel=1e-9)
    assert des.step_s - ana.step_s == pytest.approx((p - 1) * (p - 2) * A, rel=1e-6)
    assert des.rerouted_routes == 1 and "failed" in des.faults[0]


def test_failed_link_that_disconnects_is_an_error():
    pl = Placement(Mesh(x=4), ring_topo(4, wrap=False))
    spmd = one_collective(pl.mesh, "all_gather", ("x",), 4096)
    with pytest.raises(LinkSpecError, match="disconnect chip"):
        simulate_des(spmd, "tpu-v4", pl, failed_links=("1-2",))
    with pytest.raises(LinkSpecError, match="no link 0->2"):
        simulate_des(spmd, "tpu-v4", pl, failed_links=("0->2",))


def test_latency_bound_messages_pay_the_posting_overhead():
    """A small all-reduce on 4 chips (bidirectional ring: 2 messages per member per step, 6 steps).
    With a per-message overhead o a member posts its two messages at o and 2o: every step is 2o
    longer, the collective 12 o longer than the alpha-beta price (which has no such term)."""
    p, n, o = 4, 4096, 2e-6
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    spmd = one_collective(pl.mesh, "all_reduce", ("x",), n)
    ana, des = both(spmd, spec, pl, message_overhead_s=o)
    assert ana.collectives[0].algorithm == "bidir_ring"
    assert des.step_s - ana.step_s == pytest.approx(2 * (p - 1) * 2 * o, rel=1e-6)


def test_chunked_store_and_forward_pays_the_pipeline_fill():
    """Neighbour messages (1 hop): store-and-forward chunks equal the closed form. A ring without
    wraparound sends its closing message back p-1 hops: S&F adds (hops-1)·chunk/B per step."""
    p, n, chunk = 4, 4 << 20, 64 << 10
    spec = load_spec("tpu-v4")
    pl = Placement(Mesh(x=p), ring_topo(p))
    spmd = one_collective(pl.mesh, "all_gather", ("x",), n)
    ana, des = both(spmd, spec, pl, "ring", network="chunk", chunk_bytes=chunk)
    assert des.network == "chunk"
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)
    open_pl = Placement(Mesh(x=p), ring_topo(p, wrap=False))
    ana2, des2 = both(spmd, spec, open_pl, "ring", network="chunk", chunk_bytes=chunk)
    assert des2.step_s - ana2.step_s == pytest.approx((p - 1) * (p - 2) * chunk / B, rel=1e-6)
    flow = simulate_des(spmd, spec, open_pl, algorithms="ring")
    assert flow.step_s == pytest.approx(ana2.step_s, rel=1e-9)


def test_straggler_delays_everyone_by_its_extra_compute():
    """A matmul then an all-reduce over all 8 devices; device 5 computes 1.5x slower. Every member
    of the collective waits for its input, so the step grows by exactly 0.5 × the matmul."""
    p = 8
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    b = Prog(pl.mesh)
    x, w = b.input((512, 2048), "bfloat16"), b.input((2048, 2048), "bfloat16")
    y = b.eq("dot_general", (x, w), (512, 2048), "bfloat16", dimension_numbers=MM)
    z = b.eq("all_reduce", (y,), (512, 2048), "bfloat16", axes=("x",), op="sum")
    spmd = b.build([z])
    ana = simulate(spmd, spec, pl)
    mm = ana.compute_s                 # the matmul, the only compute op, as priced (with its efficiency)
    assert mm >= 2 * 512 * 2048 * 2048 / spec.flops_bf16_per_s
    des = simulate_des(spmd, spec, pl, stragglers={5: 1.5})
    assert des.step_s - ana.step_s == pytest.approx(0.5 * mm, rel=1e-6)
    exact = simulate_des(spmd, spec, pl, stragglers={5: 1.5}, symmetry=False)
    assert exact.step_s == pytest.approx(des.step_s, rel=1e-12)
    with pytest.raises(DesError, match="straggler device 9"):
        simulate_des(spmd, spec, pl, stragglers={9: 2.0})


def test_overlap_matches_the_analytical_overlap_schedule():
    """An all-gather independent of a matmul: with overlap both models hide the shorter one."""
    p = 8
    pl = Placement(Mesh(x=p), ring_topo(p))
    spec = load_spec("tpu-v4")
    b = Prog(pl.mesh)
    x, w = b.input((1024, 4096), "bfloat16"), b.input((4096, 4096), "bfloat16")
    v = b.input((1 << 20,))
    y = b.eq("dot_general", (x, w), (1024, 4096), "bfloat16", dimension_numbers=MM)
    g = b.coll("all_gather", v, ("x",))
    spmd = b.build([y, g])
    for overlap in (False, True):
        ana, des = both(spmd, spec, pl, overlap=overlap)
        assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)
    mm = 2 * 1024 * 4096 * 4096 / spec.flops_bf16_per_s
    assert des.step_s == pytest.approx(max(mm, ana.comm_s), rel=1e-9)


def test_failed_link_on_a_2d_torus_sidesteps():
    """4x4 torus, x+ link (0,0)->(1,0) failed: the detour is the shortest working path, a 3-hop sidestep
    through the neighbouring row (not 3 hops the other way round x, which ties — BFS takes the first
    found, by link id, deterministically); both directions of a cable fail with A-B."""
    from partir_emu.hwmodels.des import FlowRouter
    from partir_emu.hwmodels.des.network.routing import link_factors
    topo = torus_topo((4, 4))
    a, b = topo.chip_at((0, 0)), topo.chip_at((1, 0))
    r = FlowRouter(topo, link_factors(topo, failed=(f"{a}-{b}",)))
    fwd, back = r.route(a, b), r.route(b, a)
    assert len(fwd) == 3 and len(back) == 3
    failed = {topo.link(a, b).id, topo.link(b, a).id}
    assert not failed & set(fwd) and not failed & set(back)
    assert topo.links[fwd[0]].src == a and topo.links[fwd[-1]].dst == b
    assert r.route(topo.chip_at((0, 1)), topo.chip_at((1, 1))) == (topo.link(topo.chip_at((0, 1)), topo.chip_at((1, 1))).id,)

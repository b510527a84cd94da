"""Several communication streams (hwmodels/timeline/issue.py, hwmodels/network/concurrency.py): one stream rule for the
analytical schedule and the DES, concurrent collectives sharing links, and agreement with the DES.

Closed forms are written from the standalone prices the model gives (``T``) and the latency part
of them; the DES is the reference where collectives share links."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from partir_emu.core.mesh import Mesh
from partir_emu.errors import UsageError
from partir_emu.hwmodels import simulate
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.des.stream import compile_stream
from partir_emu.hwmodels.network.comm import CommModel
from partir_emu.hwmodels.network.concurrency import Contention, link_use
from partir_emu.hwmodels.timeline import engine
from partir_emu.hwmodels.timeline.issue import issue_one_stream, round_robin, stream_prereqs
from partir_emu.hwmodels.timeline.networks import Standalone
from partir_emu.hwmodels.timeline.overlap import schedule
from tests.unit.test_hw_analytical import Builder

pytestmark = pytest.mark.xdist_group("hw_streams")    # its cached programs and references: made once, on one worker

V4 = dict(placement="a=x,b=y", slice_dims=(4, 4, 1))        # a on the x ring, b on the y ring


@functools.cache
def lowered(scenario: str, strategy: str, mesh: str, preset: str = "tiny", overrides: str | None = None):
    from partir_emu.app.experiment import Experiment
    return Experiment(scenario, strategy, Mesh.parse(mesh), preset, overrides).lower().spmd


def _pair(c1: tuple, c2: tuple, mesh: Mesh | None = None):
    """Two independent collectives (prim, axes, elements) of float32 inputs, both program outputs."""
    b = Builder()
    outs = []
    for i, (prim, axes, n) in enumerate((c1, c2)):
        x = b.input(f"x{i}", (n,))
        if prim == "all_gather":
            outs.append(b.eq(prim, (x,), (n * 4 ** len(axes),), axes=axes, dim=0))
        else:
            outs.append(b.eq(prim, (x,), (n,), axes=axes, op="sum"))
    return b.build(outs, mesh or Mesh(a=4, b=4))


def _both(spmd, hardware: str, k: int, **kw):
    return (simulate(spmd, hardware, overlap=True, comm_streams=k, **kw),
            simulate_des(spmd, hardware, overlap=True, comm_streams=k, **kw))


def _rel(des: float, ana: float) -> float:
    return des / ana - 1.0


# -- the rule -----------------------------------------------------------------------------------------
def test_stream_rule_unit():
    """Each collective waits for the one issued before it on its stream; rank modulo k otherwise."""
    order = [2, 0, 1, 3]                                      # issue order; results are per collective
    assert stream_prereqs(order, [0, 0, 0, 0]) == [2, 0, -1, 1]              # one stream: the previous
    assert stream_prereqs(order, [1, 0, 1, 0]) == [2, -1, -1, 1]
    assert round_robin(order, 2) == [1, 0, 0, 1]
    assert stream_prereqs(order, round_robin(order, 2)) == [-1, 2, -1, 0]    # rank r waits for rank r - 2


@pytest.mark.slow
@pytest.mark.parametrize("case", [("transformer", "bp+mp+z3", "batch=2,model=4", "tiny", None),
                                  ("transformer", "z3", "batch=4", "small", None),
                                  ("transformer", "bp+mp", "batch=2,model=4", "tiny", "layers_as=loop")])
def test_one_stream_is_unchanged(case):
    """k = 1 through the k-stream loop gives exactly the single-stream schedule (order, starts,
    finishes); the schedule keeps no streams (the DES's rule: wait for the previous in issue order)."""
    spmd = lowered(*case)
    an = Analyzer()
    spec = an.spec("tpu-v4")
    model = CommModel(an.placement(spmd.mesh, spec), None, an.prices)
    pr = an.price(spmd.program, spec, model, True)
    plan = an.overlap_plan(spmd.program)
    walk = plan._walk(None)
    P = np.concatenate(([0.0], np.cumsum(pr.times * plan._compute)))
    Pev = P[walk.event_pos].tolist()
    tc = pr.times[plan.comm_eqns].tolist()
    one = issue_one_stream(plan.graph, walk.events, walk.keys, Pev, tc)
    many = engine.run(plan.graph, walk.events, walk.keys, Pev, 1, Standalone(tc))
    assert many.order == one[2] and many.stream == [0] * len(tc) and many.stalls == one[3]
    assert many.start == pytest.approx(one[0], rel=1e-12, abs=0)
    assert many.finish == pytest.approx(one[1], rel=1e-12, abs=0)
    assert pr.sched is not None and pr.sched.stream is None and pr.sched.streams == 1


def test_k_streams_schedule_obeys_the_rule():
    """With k = 2 and 3: every collective starts once ready and once its stream predecessor is done;
    never more than k in flight; the DES gates on the same predecessors."""
    spmd = lowered("transformer", "bp+mp+z3", "batch=4,model=4", "small")
    an = Analyzer()
    spec = an.spec("tpu-v4")
    for k in (2, 3):
        model = CommModel(an.placement(spmd.mesh, spec, "batch=x,model=y", (4, 4, 1)), None, an.prices)
        pr = an.price(spmd.program, spec, model, True, None, k)
        s = pr.sched
        assert s is not None and s.streams == k and s.stream is not None and set(s.stream) == set(range(k))
        prev = stream_prereqs(s.order, s.stream)
        for c, p in enumerate(prev):
            if p >= 0:
                assert s.start[c] >= s.finish[p] - 1e-15
            assert s.start[c] >= _reached(s, s.ready_pos[c]) - 1e-15
        ev = sorted([(t, 1) for t in s.start] + [(t, -1) for t in s.finish], key=lambda x: (x[0], x[1]))
        assert max(np.cumsum([d for _, d in ev])) <= k
        assert max(np.cumsum([d for _, d in ev])) == k                           # it does use them
        st = compile_stream(pr, True, k)
        for c, p in enumerate(prev):
            assert p < 0 or p in st.prereqs[c]


def _reached(sched, pos: int) -> float:
    return float(sched.compute_finish[pos - 1]) if pos > 0 else 0.0


def test_bad_comm_streams_names_the_value():
    spmd = _pair(("all_reduce", ("a",), 64), ("all_reduce", ("b",), 64))
    an = Analyzer()
    plan = an.overlap_plan(spmd.program)
    with pytest.raises(UsageError, match="comm_streams=0"):
        schedule(plan, np.zeros(plan.num_eqns), None, 0)


# -- links shared by concurrent collectives ------------------------------------------------------------
def test_contention_model_unit():
    """Disjoint links: full speed; the same collective issued together: T_lat + 2 T_bw; a
    latency-bound collective next to a bandwidth-bound one barely slows it."""
    spmd = _pair(("all_reduce", ("a",), 1 << 22), ("all_reduce", ("b",), 1 << 22))
    an = Analyzer()
    spec = an.spec("tpu-v4")
    model = CommModel(an.placement(spmd.mesh, spec, V4["placement"], V4["slice_dims"]), None, an.prices)
    big_a, big_b = ("all_reduce", ("a",), 1 << 24, "float32", None), ("all_reduce", ("b",), 1 << 24, "float32", None)
    small_a = ("all_reduce", ("a",), 1 << 10, "float32", None)
    con = Contention.of(model, [big_a, big_b, small_a])
    (ua,) = link_use(model, big_a).phases                    # a ring: one phase
    phi = ua.bw_frac
    assert ua.share == 1.0 and 0.9 < phi < 1.0 and ua.util.max() == pytest.approx(1.0)
    assert not set(ua.links.tolist()) & set(link_use(model, big_b).phases[0].links.tolist())
    assert con.speeds([(0, 0, 0.0), (1, 0, 0.0)]) == [1.0, 1.0]
    lock = con.speeds([(0, 0, 0.0), (0, 0, 0.0)])
    assert lock == pytest.approx([1 / (1 + phi)] * 2, rel=1e-12)
    late = con.speeds([(0, 0, 0.0), (0, 0, 1e-3)])           # not in lock step: the other's φ counts
    assert late == pytest.approx([1 / (1 + phi ** 2)] * 2, rel=1e-12)
    s_big, s_small = con.speeds([(0, 0, 0.0), (2, 0, 0.0)])
    assert s_big > 0.99 and s_small < 1.0


def test_phases_of_a_hierarchical_all_reduce():
    """A collective whose steps change links (H100 hierarchical: NVLink, then InfiniBand, then NVLink)
    has one phase per run of steps on the same links; their shares add up to its standalone time."""
    spmd = _pair(("all_reduce", ("a", "b"), 1 << 20), ("all_reduce", ("a",), 1 << 20))
    an = Analyzer()
    spec = an.spec("h100")
    model = CommModel(an.placement(spmd.mesh, spec), None, an.prices)
    use = link_use(model, ("all_reduce", ("a",), 1 << 22, "float32", None))
    assert model.cost("all_reduce", ("a",), 1 << 22).algorithm == "hierarchical"
    topo = model.placement.topology
    kinds = [{topo.links[i].kind for i in ph.links.tolist()} for ph in use.phases]
    assert len(use.phases) >= 2 and {"ib"} in kinds and {"nvlink"} in kinds
    assert sum(ph.share for ph in use.phases) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("n", [1 << 18, 1 << 22])
def test_disjoint_dims_run_concurrently(n):
    """All-reduces over the x and y rings with two streams: both run at full speed together, so the
    communication takes half as long; the DES agrees within 2 %."""
    spmd = _pair(("all_reduce", ("a",), n), ("all_reduce", ("b",), n))
    one, one_des = _both(spmd, "tpu-v4", 1, **V4)
    two, two_des = _both(spmd, "tpu-v4", 2, **V4)
    T = one.collectives[0].time_s
    assert one.collectives[1].time_s == pytest.approx(T, rel=1e-12)
    assert one.step_s == pytest.approx(2 * T, rel=1e-9) and one_des.step_s == pytest.approx(one.step_s, rel=1e-9)
    assert two.step_s == pytest.approx(T, rel=1e-9)
    assert [r.time_s for r in two.collectives] == pytest.approx([T, T], rel=1e-9)
    assert two.step_s / one.step_s == pytest.approx(0.5, rel=1e-9)
    err = _rel(two_des.step_s, two.step_s)
    assert abs(err) < 0.02, f"analytical {two.step_s:.6e} s vs DES {two_des.step_s:.6e} s: {err:+.3%}"
    assert two_des.step_s / one_des.step_s == pytest.approx(0.5, rel=0.02)


@pytest.mark.parametrize("hardware, kw", [("tpu-v4", V4), ("h100", {})])
@pytest.mark.parametrize("n", [1 << 16, 1 << 22])
def test_shared_dims_no_speedup(hardware, kw, n):
    """Two equal all-reduces over the same axis: issued together they share every link in every
    phase, each takes T_lat + 2 T_bw; the step saves only one latency part (no speed-up for bandwidth-bound sizes).
    The DES agrees within 5 %."""
    spmd = _pair(("all_reduce", ("a",), n), ("all_reduce", ("a",), n))
    one, one_des = _both(spmd, hardware, 1, **kw)
    two, two_des = _both(spmd, hardware, 2, **kw)
    an = Analyzer()
    spec = an.spec(hardware)
    model = CommModel(an.placement(spmd.mesh, spec, kw.get("placement"), kw.get("slice_dims")), None, an.prices)
    key = ("all_reduce", ("a",), 4 * n, "float32", None)
    T = model.cost(*key).time_s
    t_bw = T * sum(ph.share * ph.bw_frac for ph in link_use(model, key).phases)
    assert two.step_s == pytest.approx(T + t_bw, rel=1e-9)
    assert one.step_s == pytest.approx(2 * T, rel=1e-9)
    err = _rel(two_des.step_s, two.step_s)
    assert abs(err) < 0.05, f"analytical {two.step_s:.6e} s vs DES {two_des.step_s:.6e} s: {err:+.3%}"
    if n >= 1 << 22:                                          # bandwidth-bound: no speed-up in either model
        assert two.step_s / one.step_s > 0.97 and two_des.step_s / one_des.step_s > 0.97


@pytest.mark.parametrize("hardware, kw", [("tpu-v4", V4), ("h100", {})])
@pytest.mark.parametrize("c1, c2", [
    (("all_reduce", ("a",), 1 << 20), ("all_reduce", ("a",), 1 << 10)),
    (("all_reduce", ("a",), 1 << 20), ("all_reduce", ("a",), 1 << 16)),
    (("all_reduce", ("a", "b"), 1 << 20), ("all_reduce", ("a",), 1 << 20)),
    (("all_reduce", ("a", "b"), 1 << 20), ("all_reduce", ("b",), 1 << 18)),
    (("all_reduce", ("a", "b"), 1 << 18), ("all_reduce", ("b",), 1 << 16)),
    (("all_gather", ("a",), 1 << 18), ("all_reduce", ("a",), 1 << 20)),
])
def test_mixed_pairs_agree_with_the_des(hardware, kw, c1, c2):
    """Different collectives in flight together (partly shared links, different sizes, algorithms and
    phases): the analytical step within 5 % of the DES's (measured: at most 4.7 %, the model taking
    their byte-moving phases as independent where, started together, they partly coincide)."""
    spmd = _pair(c1, c2)
    two, two_des = _both(spmd, hardware, 2, **kw)
    err = _rel(two_des.step_s, two.step_s)
    assert abs(err) < 0.05, f"analytical {two.step_s:.6e} s vs DES {two_des.step_s:.6e} s: {err:+.3%}"


# -- whole programs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("case, hardware, kw", [
    (("transformer", "bp+mp", "batch=4,model=4", "small"), "tpu-v4", {"placement": "batch=x,model=y",
                                                                      "slice_dims": (4, 4, 1)}),
    (("transformer", "bp+mp+z3", "batch=4,model=4", "small"), "tpu-v4", {"placement": "batch=x,model=y",
                                                                         "slice_dims": (4, 4, 1)}),
    (("transformer", "bp+mp", "batch=4,model=4", "small", "layers_as=loop"), "tpu-v4",
     {"placement": "batch=x,model=y", "slice_dims": (4, 4, 1)}),
    (("transformer", "z3", "batch=16", "small"), "tpu-v4", {}),
    (("transformer", "bp+mp", "batch=4,model=4", "small"), "h100", {}),
    (("mlp", "bp+mp", "batch=2,model=4", "tiny"), "tpu-v4", {}),
])
def test_scenarios_agree_with_the_des(case, hardware, kw, k):
    """Scenario steps with overlap and k streams: the analytical step within 2 % of the DES, and
    faster than with one stream where collectives on different axes overlap."""
    spmd = lowered(*case)
    one = simulate(spmd, hardware, overlap=True, **kw)
    ana, des = _both(spmd, hardware, k, **kw)
    err = _rel(des.step_s, ana.step_s)
    assert abs(err) < 0.02, f"{case} k={k}: analytical {ana.step_s:.6e} s vs DES {des.step_s:.6e} s: {err:+.3%}"
    assert ana.step_s <= one.step_s * (1 + 1e-12)


def test_memory_with_streams():
    """Gathers on demand: the peak is the same with any number of streams. With the default budget,
    more streams start prefetches earlier: the peak may grow, by at most the budget, and counts them."""
    spmd = lowered("transformer", "z3", "batch=16", "small")
    an = Analyzer()
    plain = an.simulate(spmd, "tpu-v4")
    on_demand = [an.simulate(spmd, "tpu-v4", overlap=True, prefetch_bytes=0, comm_streams=k) for k in (1, 2, 4)]
    assert {r.peak_bytes_per_device for r in on_demand} == {plain.peak_bytes_per_device}
    budget = an.overlap_plan(spmd.program).default_prefetch_bytes
    peaks = [an.simulate(spmd, "tpu-v4", overlap=True, comm_streams=k) for k in (1, 2, 4)]
    for r in peaks:
        assert plain.peak_bytes_per_device <= r.peak_bytes_per_device <= plain.peak_bytes_per_device + budget
        assert sum(r.memory.values()) == r.peak_bytes_per_device
    assert peaks[1].peak_bytes_per_device >= peaks[0].peak_bytes_per_device
    assert peaks[1].memory.get("prefetch_buffers", 0) > 0


def test_compute_scale():
    """compute_scale multiplies every compute equation, loop bodies too; collectives keep their price."""
    spmd = lowered("transformer", "bp+mp", "batch=2,model=4", "tiny", "layers_as=loop")
    an = Analyzer()
    spec = an.spec("tpu-v4")
    model = CommModel(an.placement(spmd.mesh, spec), None, an.prices)
    a = an.price(spmd.program, spec, model, False)
    b = an.price(spmd.program, spec, model, False, None, 1, 2.5)
    assert b.compute_s == pytest.approx(2.5 * a.compute_s, rel=1e-12) and b.comm_s == pytest.approx(a.comm_s, rel=1e-12)
    assert b.step_s == pytest.approx(2.5 * a.compute_s + a.comm_s, rel=1e-12)

"""Overlap as the hardware does it (hwmodels/timeline/overlap.py): asynchronous collectives issued by need,
ZeRO-3 all-gathers prefetched within a budget, gradient reductions behind the backward pass, the
prefetch buffers in the peak memory, and the DES running the same schedule.

The hand-built programs have closed forms written from the per-equation times the model gives
(``t[i]``), so each schedule decision is checked exactly; the transformer checks the mechanisms
on a real ZeRO-3 step."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from partir_emu.core.ir import Literal
from partir_emu.core.mesh import Mesh
from partir_emu.hwmodels import load_spec, simulate
from partir_emu.hwmodels.analytical import Analyzer, compute_times
from partir_emu.hwmodels.des import simulate_des
from partir_emu.hwmodels.timeline.overlap import schedule
from tests.unit.test_hw_analytical import Builder

pytestmark = pytest.mark.xdist_group("hw_overlap")    # its cached programs and references: made once, on one worker

REL = 1e-9
MM = (((1,), (0,)), ((), ()))

ANALYZER = Analyzer()          # one session for the module: analyses kept between its tests


def eqn_times(spmd, spec: str, rep) -> np.ndarray:
    """Per-equation seconds as the analytical model priced them (compute, then each collective's row)."""
    t = compute_times(ANALYZER.analysis(spmd.program), load_spec(spec))
    for r in rep.collectives:
        t[r.index] = r.time_s
    return t


# -- hand-built programs, closed forms ---------------------------------------------------------------
def _layers(L: int = 4, m: int = 16384, k: int = 1024):
    """h = x; per layer: g_l = all_gather(params/layer_l/w) (sharded 4 ways), h = h @ g_l."""
    b = Builder()
    h = b.input("x", (m, k))
    gathers, dots = [], []
    for layer in range(L):
        w = b.input(f"params/layer_{layer}/w", (k // 4, k))
        g = b.eq("all_gather", (w,), (k, k), axes=("x",), dim=0)
        h = b.eq("dot_general", (h, g), (m, k), dimension_numbers=MM)
        gathers.append(len(b.eqns) - 2)
        dots.append(len(b.eqns) - 1)
    return b.build([h], Mesh(x=4)), gathers, dots


@pytest.mark.parametrize("hardware", ["h100", "tpu-v4"])
def test_prefetch_closed_forms(hardware):
    """G (one gather) <= T (one matmul). Default budget = one layer's gathered weights: gather l+1
    starts when the compute stream reaches layer l's matmul (gather 2 at G + T, not at 2G), and the
    step is G + L*T (only the first gather is exposed). Unlimited budget: back to back, same step.
    Budget 0: each gather waits for the compute stream to reach its matmul: L*(G + T), as without
    overlap."""
    spmd, gathers, dots = _layers()
    L = len(dots)
    plain = simulate(spmd, hardware)
    t = eqn_times(spmd, hardware, plain)
    G, T = t[gathers[0]], t[dots[0]]
    assert 0 < G <= T and all(t[g] == G for g in gathers) and all(t[d] == T for d in dots)
    assert plain.step_s == pytest.approx(L * (G + T), rel=REL)
    plan = ANALYZER.overlap_plan(spmd.program)
    assert plan.default_prefetch_bytes == 1024 * 1024 * 4           # one layer: one [k, k] f32 weight
    default = simulate(spmd, hardware, overlap=True)
    assert default.step_s == pytest.approx(G + L * T, rel=REL)
    starts = [r.start_s for r in default.collectives]
    assert starts[:3] == pytest.approx([0.0, G, G + T], rel=REL)
    unlimited = simulate(spmd, hardware, overlap=True, prefetch_bytes=10**12)
    assert unlimited.step_s == pytest.approx(G + L * T, rel=REL)
    assert [r.start_s for r in unlimited.collectives] == pytest.approx([k * G for k in range(L)], rel=REL)
    none = simulate(spmd, hardware, overlap=True, prefetch_bytes=0)
    assert none.step_s == pytest.approx(L * (G + T), rel=REL)
    assert [r.start_s for r in none.collectives] == pytest.approx([k * (G + T) for k in range(L)], rel=REL)
    # memory: one prefetched [k, k] buffer at most, on top of program order; none without prefetch
    assert none.peak_bytes_per_device == plain.peak_bytes_per_device
    assert plain.peak_bytes_per_device <= default.peak_bytes_per_device <= (
        plain.peak_bytes_per_device + plan.default_prefetch_bytes)
    assert unlimited.peak_bytes_per_device >= default.peak_bytes_per_device
    for rep in (default, unlimited, none):
        assert sum(rep.memory.values()) == rep.peak_bytes_per_device


def _gradients():
    """A backward step: g1 = exp(a); r1 = reduce_scatter(g1); v1 = reshape(r1) (a view: fuses into
    its consumer); b = tanh(a); c = tanh(b) (the rest of the backward pass); r2 = reduce_scatter(c);
    the optimizer: o1 = v1 * 2, o2 = r2 * 2."""
    n = 1 << 22
    b = Builder()
    a = b.input("a", (n,))
    g1 = b.eq("exp", (a,), (n,))
    r1 = b.eq("reduce_scatter", (g1,), (n // 4,), axes=("x",), dim=0)
    v1 = b.eq("reshape", (r1,), (n // 8, 2), new_sizes=(n // 8, 2), dimensions=None)
    t1 = b.eq("tanh", (a,), (n,))
    c = b.eq("tanh", (t1,), (n,))
    r2 = b.eq("reduce_scatter", (c,), (n // 4,), axes=("x",), dim=0)
    o1 = b.eq("mul", (v1, Literal(2.0, "float32")), (n // 8, 2))
    o2 = b.eq("mul", (r2, Literal(2.0, "float32")), (n // 4,))
    return b.build([o1, o2], Mesh(x=4))


@pytest.mark.parametrize("hardware", ["h100", "tpu-v4"])
def test_gradient_reductions_hide_behind_the_backward_pass(hardware):
    """r1 starts when g1 is done and runs behind b, c; the view v1 does not block the compute
    stream; r2 starts when c is done or the stream is free; the optimizer waits for each."""
    spmd = _gradients()
    plain = simulate(spmd, hardware)
    t = eqn_times(spmd, hardware, plain)
    X = t[0] + t[2] + t[3] + t[4]                    # compute reaches r2's producer's end
    s_r2 = max(X, t[0] + t[1])
    e_o1 = max(X, t[0] + t[1]) + t[6]                # o1 waits for r1 (through the view)
    expect = max(e_o1, s_r2 + t[5]) + t[7]
    over = simulate(spmd, hardware, overlap=True)
    assert over.step_s == pytest.approx(expect, rel=REL)
    assert [r.start_s for r in over.collectives] == pytest.approx([t[0], s_r2], rel=REL)
    assert over.step_s < plain.step_s and over.exposed_comm_s < plain.exposed_comm_s
    des = simulate_des(spmd, hardware, overlap=True)
    assert des.step_s == pytest.approx(over.step_s, rel=1e-9)


def test_the_stream_issues_by_need_not_program_order():
    """A (first in the program) is needed last, B first: B goes first. u = exp(B), v = A * 2:
    step = tB + max(tu, tA) + tv; in program order it would be tA + tB + tu + tv. A chained
    gather of A's result (needed by nothing) runs after A."""
    n = 1 << 20
    b = Builder()
    x, y = b.input("x", (n,)), b.input("y", (n,))
    A = b.eq("all_reduce", (x,), (n,), axes=("x",), op="sum")
    B = b.eq("all_reduce", (y,), (n,), axes=("x",), op="sum")
    u = b.eq("exp", (B,), (n,))
    v = b.eq("mul", (A, Literal(2.0, "float32")), (n,))
    g = b.eq("all_gather", (A,), (4 * n,), axes=("x",), dim=0)
    spmd = b.build([u, v, g], Mesh(x=4))
    plain = simulate(spmd, "h100")
    t = eqn_times(spmd, "h100", plain)
    tA, tB, tu, tv, tg = (t[i] for i in range(5))
    over = simulate(spmd, "h100", overlap=True)
    assert [r.start_s for r in over.collectives] == pytest.approx([tB, 0.0, tA + tB], rel=REL)
    assert over.step_s == pytest.approx(max(tB + max(tu, tA) + tv, tA + tB + tg), rel=REL)
    assert simulate_des(spmd, "h100", overlap=True).step_s == pytest.approx(over.step_s, rel=1e-9)


# -- a ZeRO-3 transformer ---------------------------------------------------------------------------------
@functools.cache
def _z3(strategy: str = "z3", mesh: str = "batch=4"):
    from partir_emu.app.experiment import Experiment
    return Experiment("transformer", strategy, Mesh.parse(mesh), "small", None).lower().spmd


def _reached(sched, pos: int) -> float:
    """When the compute stream has finished every equation before ``pos``."""
    return float(sched.compute_finish[pos - 1]) if pos > 0 else 0.0


def test_z3_prefetch_budget_and_gradient_overlap():
    spmd = _z3()
    an = Analyzer()
    plain = an.simulate(spmd, "h100")
    over = an.simulate(spmd, "h100", overlap=True)
    none = an.simulate(spmd, "h100", overlap=True, prefetch_bytes=0)
    plan = an.overlap_plan(spmd.program)
    t = eqn_times(spmd, "h100", plain)
    sched = schedule(plan, t)
    assert sched.step_s == pytest.approx(over.step_s, rel=REL)
    assert len(plan.prefetch) > 0 and plan.default_prefetch_bytes > 0
    # exposed communication shrinks; without prefetch it shrinks less
    assert over.exposed_comm_s < none.exposed_comm_s < plain.exposed_comm_s
    assert over.step_s < none.step_s < plain.step_s

    # forward gathers of layer i+1 start before layer i's forward compute ends
    by_name: dict[str, int] = {}
    for g, name in zip(plan.prefetch, plan.prefetch_names):
        by_name.setdefault(name, g)                  # in need order: the first is the forward gather
    layers = sorted({name.split("/")[1] for name in by_name if name.startswith("params/layer_")})
    assert len(layers) >= 2
    fwd = {lay: [g for name, g in by_name.items() if name.split("/")[1:2] == [lay]] for lay in layers}
    for prev, nxt in zip(layers, layers[1:]):
        prev_end = max(float(sched.compute_finish[plan.priority[g]]) for g in fwd[prev])
        assert min(sched.start[g] for g in fwd[nxt]) < prev_end, (prev, nxt)

    # at most the budget is in flight ahead of need when a gather starts (a lone bigger one is on demand)
    nbytes = dict(zip(plan.prefetch, plan.prefetch_bytes_out.tolist()))
    budget = plan.default_prefetch_bytes
    for g in plan.prefetch:
        t0 = sched.start[g]
        flying = sum(b for h, b in nbytes.items() if sched.start[h] <= t0 < _reached(sched, plan.priority[h]))
        assert flying <= budget or flying == nbytes[g] and t0 >= _reached(sched, plan.priority[g])

    # with budget 0 no gather starts before the compute stream reaches its consumer
    s0 = schedule(plan, t, 0)
    assert all(s0.start[g] >= _reached(s0, plan.priority[g]) - 1e-15 for g in plan.prefetch)

    # gradient reduce-scatters run during the backward pass (it ends with the last one's producer)
    rs = [c for c, e in enumerate(plan.comm_eqns.tolist()) if spmd.program.eqns[e].prim == "reduce_scatter"]
    last_grad = max(plan.base_ready[c] for c in rs) - 1
    backward_end = float(sched.compute_finish[last_grad])
    assert all(plan.wait_pos[c] > last_grad for c in rs)     # only the optimizer waits for them
    # issued as their gradients appear, not after the backward pass; how many also *finish* inside it
    # depends on the chip's compute/network balance (the small preset's GEMMs are short on H100)
    assert sum(sched.finish[c] < backward_end for c in rs) >= len(rs) // 3
    assert sched.order != sorted(sched.order)       # not program order

    # peak memory: the prefetch buffers count, within the budget
    assert plain.peak_bytes_per_device <= over.peak_bytes_per_device <= plain.peak_bytes_per_device + budget
    assert over.peak_bytes_per_device > plain.peak_bytes_per_device
    assert over.memory["prefetch_buffers"] > 0 and sum(over.memory.values()) == over.peak_bytes_per_device
    assert none.peak_bytes_per_device == plain.peak_bytes_per_device


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["h100", "tpu-v4"])
@pytest.mark.parametrize("strategy, mesh", [("z3", "batch=4"), ("bp+mp+z3", "batch=2,model=4")])
@pytest.mark.parametrize("prefetch", [None, 0])
def test_des_runs_the_same_overlapped_schedule(hardware, strategy, mesh, prefetch):
    """Nothing contends (one communication stream): the DES replays the analytical decisions and
    agrees to 1e-9, as on non-overlapped steps (tests/integration/test_des_model.py)."""
    spmd = _z3(strategy, mesh)
    ana = simulate(spmd, hardware, overlap=True, prefetch_bytes=prefetch)
    des = simulate_des(spmd, hardware, overlap=True, prefetch_bytes=prefetch)
    assert des.step_s == pytest.approx(ana.step_s, rel=1e-9)
    # the same issue order (device 0 may leave a scalar all-reduce early and enter the next one
    # early, waiting inside: so compare the order, and the step, not each start)
    assert [r.index for r in sorted(des.collectives, key=lambda r: r.start_s)] == [
        r.index for r in sorted(ana.collectives, key=lambda r: r.start_s)]


def test_bad_prefetch_budget_names_the_value():
    from partir_emu.errors import UsageError
    spmd, _, _ = _layers(L=2, m=64, k=64)
    with pytest.raises(UsageError, match="prefetch_bytes=-1"):
        simulate(spmd, "h100", overlap=True, prefetch_bytes=-1)


def test_gathers_through_a_cast_are_prefetched_and_views_do_not_block():
    """bf16 compute with f32 master weights: all_gather(convert(params/w)) is still a parameter
    gather (the cast is hoisted with it); a gather of a computed value is not prefetchable, and a
    reshape of a collective's result is not where the compute stream waits."""
    b = Builder()
    x = b.input("x", (64, 64), "bfloat16")
    w = b.input("params/layer_0/w", (16, 64))
    wc = b.eq("convert_element_type", (w,), (16, 64), "bfloat16", new_dtype="bfloat16", weak_type=False)
    g = b.eq("all_gather", (wc,), (64, 64), "bfloat16", axes=("x",), dim=0)
    y = b.eq("dot_general", (x, g), (64, 64), "bfloat16", dimension_numbers=MM)
    r = b.eq("all_reduce", (y,), (64, 64), "bfloat16", axes=("x",), op="sum")
    v = b.eq("reshape", (r,), (4096,), "bfloat16", new_sizes=(4096,), dimensions=None)
    e = b.eq("exp", (x,), (64, 64), "bfloat16")
    o = b.eq("mul", (v, Literal(2.0, "bfloat16")), (4096,), "bfloat16")
    spmd = b.build([o, e], Mesh(x=4))
    plan = Analyzer().overlap_plan(spmd.program)
    assert plan.prefetch == (0,) and plan.prefetch_names == ("params/layer_0/w",)
    assert plan.ready_pos() == (0, 3) and plan.ready_pos(0) == (2, 3)    # budget 0: when y is reached
    assert plan.wait_pos == (2, 6)          # the all_reduce: at o, not at the reshape
    assert plan.priority == (2, 6)

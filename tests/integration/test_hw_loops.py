"""The hardware models run ``loop`` equations (core/loops.py): the analytical model prices the body once
and multiplies, the memory model follows rule 5 of core/analysis.py, the DES runs every iteration.

Iteration semantics (hwmodels/pricing.py, hwmodels/timeline/overlap.py): everything of iteration i, its
asynchronous collectives included, completes before iteration i+1 starts (an XLA while loop without
collective pipelining), and a loop is a barrier of its enclosing program's overlap schedule. So a loop
program takes exactly the time of its unrolled form (``loops.unroll``) when the unrolled form has
nothing to overlap across iterations, and at least that time otherwise. The programs below are built
so that each case is one or the other, and say why.
"""
from __future__ import annotations

import functools
import itertools
import json

import pytest

from partir_emu.core.ir import Literal, Program
from partir_emu.core.loops import unroll
from partir_emu.core.mesh import Mesh
from partir_emu.core.sharding import Sharding
from partir_emu.core.spmd import SpmdProgram
from partir_emu.hwmodels import peak_memory, simulate
from partir_emu.hwmodels.analytical import Analyzer, compute_times
from partir_emu.hwmodels.des import simulate_des
from tests.loop_programs import MM, SPMD_PROGRAMS, Build
from tests.unit.test_hw_analytical import unfused

pytestmark = pytest.mark.xdist_group("hw_loops")    # its cached programs and references: made once, on one worker

REL = 1e-9
HARDWARE = ["h100", "tpu-v4"]
MESH = Mesh(x=4)


def _spmd(prog: Program, mesh: Mesh = MESH) -> SpmdProgram:
    rep = Sharding.replicated
    return SpmdProgram(mesh, prog, tuple(rep(v.ndim) for v in prog.inputs), tuple(rep(len(o.shape)) for o in prog.outputs),
                       tuple(v.shape for v in prog.inputs), tuple(o.shape for o in prog.outputs))


def _same_table(a: dict, b: dict) -> None:
    """Two breakdown tables (name -> {field: number}) equal to ``REL``."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=REL), k


def _unrolled(spmd: SpmdProgram) -> SpmdProgram:
    return SpmdProgram(spmd.mesh, unroll(spmd.program), spmd.in_shardings, spmd.out_shardings,
                       spmd.global_in_shapes, spmd.global_out_shapes)


# -- programs ---------------------------------------------------------------------------------------
def _serial_body(ids, m: int, k: int) -> Program:
    """(h, u; w, w2) -> (all_reduce(h @ w), u @ w2): the all_reduce overlaps the second matmul."""
    b = Build(ids)
    w, w2, h, u = b.var((k, k)), b.var((k, k)), b.var((m, k)), b.var((m, k))
    y = b.eq("dot_general", [h, w], (m, k), dimension_numbers=MM)
    r = b.eq("all_reduce", [y], (m, k), axes=("x",), op="sum")
    u2 = b.eq("dot_general", [u, w2], (m, k), dimension_numbers=MM)
    return b.program([w, w2, h, u], [r, u2])


def serial(length: int, m: int = 2048, k: int = 1024) -> SpmdProgram:
    """A loop whose unrolled form has nothing to overlap across iterations: iteration i+1 starts with
    the matmul that reads iteration i's all_reduce (program order), and the carries are produced by a
    collective or a matmul, which no fusion joins to the next iteration's ops."""
    ids = itertools.count()
    top = Build(ids)
    w, w2, h0, u0 = top.var((k, k)), top.var((k, k)), top.var((m, k)), top.var((m, k))
    h, u = top.loop([w, w2], [h0, u0], [], _serial_body(ids, m, k), length)
    return _spmd(top.program([w, w2, h0, u0], [h, u]))


def z3(length: int, m: int = 16384, k: int = 1024) -> SpmdProgram:
    """A ZeRO-3-like layer loop: g = all_gather(w shard), h = tanh(h @ g). Unrolled, the gather of
    layer i+1 (of a program input) is prefetched during layer i; the loop does not pipeline across
    iterations, so its gathers are all exposed."""
    ids = itertools.count()
    top = Build(ids)
    w, h0 = top.var((k // 4, k)), top.var((m, k))
    b = Build(ids)
    wb, hb = b.var((k // 4, k)), b.var((m, k))
    g = b.eq("all_gather", [wb], (k, k), axes=("x",), dim=0)
    y = b.eq("dot_general", [hb, g], (m, k), dimension_numbers=MM)
    hn = b.eq("tanh", [y], (m, k))
    (h,) = top.loop([w], [h0], [], b.program([wb, hb], [hn]), length)
    return _spmd(top.program([w, h0], [h]))


def stacked(length: int, reverse: bool = False, m: int = 1024, k: int = 512) -> SpmdProgram:
    """Per-layer weight shards stacked on a leading dim (xs) and a per-layer all_reduced sum (ys)."""
    ids = itertools.count()
    top = Build(ids)
    ws, h0 = top.var((length, k // 4, k)), top.var((m, k))
    b = Build(ids)
    hb, wb = b.var((m, k)), b.var((k // 4, k))
    a = b.eq("tanh", [hb], (m, k))
    g = b.eq("all_gather", [wb], (k, k), axes=("x",), dim=0)
    y = b.eq("dot_general", [a, g], (m, k), dimension_numbers=MM)
    s = b.eq("all_reduce", [b.eq("reduce_sum", [y], (), axes=(0, 1))], (), axes=("x",), op="sum")
    h, sums = top.loop([], [h0], [ws], b.program([hb, wb], [y, s]), length, reverse)
    out = top.eq("mul", [sums, Literal(0.5, "float32")], (length,))
    return _spmd(top.program([ws, h0], [h, out]))


def fenced(length: int, m: int = 2048, k: int = 1024) -> SpmdProgram:
    """The serial loop between outer collectives: a = all_reduce(p) before it (read only after it),
    g = all_gather(w shard) after it (of a program input: prefetchable), y = h @ g, o = 2 a."""
    ids = itertools.count()
    top = Build(ids)
    p, ws, w, w2, h0, u0 = (top.var((1 << 20,)), top.var((k // 4, k)), top.var((k, k)), top.var((k, k)),
                            top.var((m, k)), top.var((m, k)))
    a = top.eq("all_reduce", [p], (1 << 20,), axes=("x",), op="sum")
    h, u = top.loop([w, w2], [h0, u0], [], _serial_body(ids, m, k), length)
    g = top.eq("all_gather", [ws], (k, k), axes=("x",), dim=0)
    y = top.eq("dot_general", [h, g], (m, k), dimension_numbers=MM)
    o = top.eq("mul", [a, Literal(2.0, "float32")], (1 << 20,))
    return _spmd(top.program([p, ws, w, w2, h0, u0], [y, o, u]))


def nested(outer: int, inner: int, m: int = 1024, k: int = 512) -> SpmdProgram:
    """An outer loop whose body runs the serial loop ``inner`` times, then all_reduces h: nothing to
    overlap across iterations at either level (the next iteration starts with the matmul reading h)."""
    ids = itertools.count()
    top = Build(ids)
    w, w2, h0, u0 = top.var((k, k)), top.var((k, k)), top.var((m, k)), top.var((m, k))
    ob = Build(ids)
    wo, w2o, ho, uo = ob.var((k, k)), ob.var((k, k)), ob.var((m, k)), ob.var((m, k))
    hi, ui = ob.loop([wo, w2o], [ho, uo], [], _serial_body(ids, m, k), inner)
    r = ob.eq("all_reduce", [hi], (m, k), axes=("x",), op="max")
    body = ob.program([wo, w2o, ho, uo], [r, ui])
    h, u = top.loop([w, w2], [h0, u0], [], body, outer)
    return _spmd(top.program([w, w2, h0, u0], [h, u]))


# -- the analytical model ---------------------------------------------------------------------------
@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("make", [lambda n: serial(n), lambda n: nested(n, 3)], ids=["serial", "nested"])
@pytest.mark.parametrize("length", [1, 4])
def test_loop_equals_unrolled_without_cross_iteration_overlap(make, length, overlap, hardware):
    """Nothing to overlap across iterations (see the programs): the loop is priced as its unrolled form,
    step, compute, communication, FLOPs, HBM bytes and every per-kind/per-collective total."""
    spmd = make(length)
    loop = simulate(spmd, hardware, overlap=overlap)
    flat = simulate(_unrolled(spmd), hardware, overlap=overlap)
    assert loop.step_s == pytest.approx(flat.step_s, rel=REL)
    assert loop.compute_s == pytest.approx(flat.compute_s, rel=REL)
    assert loop.comm_s == pytest.approx(flat.comm_s, rel=REL)
    assert loop.flops_per_device == pytest.approx(flat.flops_per_device, rel=REL)
    assert loop.hbm_traffic_bytes == pytest.approx(flat.hbm_traffic_bytes, rel=REL)
    assert loop.hfu == pytest.approx(flat.hfu, rel=REL)
    _same_table(loop.by_collective, flat.by_collective)
    _same_table(loop.by_axes, flat.by_axes)
    _same_table(loop.by_prim, flat.by_prim)
    _same_table(loop.by_op_kind, flat.by_op_kind)
    assert loop.fusion == pytest.approx(flat.fusion, rel=REL)
    assert [(r.prim, r.nbytes, r.time_s) for r in loop.collectives] == [
        (r.prim, r.nbytes, r.time_s) for r in flat.collectives]
    assert [r.start_s for r in loop.collectives] == pytest.approx([r.start_s for r in flat.collectives], rel=REL,
                                                                   abs=1e-15)
    if overlap:       # the all_reduce does hide behind the second matmul, inside each iteration
        assert loop.step_s < simulate(spmd, hardware).step_s


@pytest.mark.parametrize("hardware", HARDWARE)
def test_a_loop_is_a_barrier_of_the_outer_schedule(hardware):
    """With overlap, the all_reduce before the loop completes before the loop starts (A), the gather
    after it starts when it ends: step = A + loop + G + dot + mul, though both could hide behind the
    loop's compute in the unrolled form (which is therefore faster). The DES runs the same."""
    L = 3
    spmd = fenced(L)
    an = Analyzer()
    over = an.simulate(spmd, hardware, overlap=True)
    A, G = (r.time_s for r in over.collectives if not r.at)
    loop = an.simulate(serial(L), hardware, overlap=True).step_s
    t = compute_times(an.analysis(spmd.program), an.spec(hardware))
    dot, mul = t[3], t[4]
    assert over.step_s == pytest.approx(A + loop + G + dot + mul, rel=REL)
    starts = [r.start_s for r in over.collectives]
    assert starts[0] == 0 and starts[-1] == pytest.approx(A + loop, rel=REL)
    assert [r.at for r in over.collectives] == [(), *[(1, i) for i in range(L)], ()]
    flat = an.simulate(_unrolled(spmd), hardware, overlap=True)
    assert flat.step_s < over.step_s
    des = simulate_des(spmd, hardware, overlap=True)
    assert des.step_s == pytest.approx(over.step_s, rel=REL)
    assert [r.start_s for r in des.collectives] == pytest.approx(starts, rel=REL)


@pytest.mark.parametrize("hardware", HARDWARE)
def test_zero3_loop_is_not_pipelined_across_iterations(hardware):
    """Without overlap the Z3 loop is its unrolled form. With overlap the unrolled form prefetches
    layer i+1's gather behind layer i's matmul (G + L*T); the loop exposes every gather (L*(G + T))."""
    L = 4
    spmd = z3(L)
    plain, flat_plain = simulate(spmd, hardware), simulate(_unrolled(spmd), hardware)
    assert plain.step_s == pytest.approx(flat_plain.step_s, rel=REL)
    over, flat_over = simulate(spmd, hardware, overlap=True), simulate(_unrolled(spmd), hardware, overlap=True)
    G = plain.collectives[0].time_s
    T = (plain.step_s - L * G) / L
    assert 0 < G <= T
    assert over.step_s == pytest.approx(L * (G + T), rel=REL) == plain.step_s
    assert flat_over.step_s == pytest.approx(G + L * T, rel=REL)
    assert over.step_s > flat_over.step_s
    assert [r.at for r in over.collectives] == [(0, i) for i in range(L)]


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("overlap", [False, True])
def test_time_is_linear_in_the_length(hardware, overlap):
    """step(L) = outer + L * body step, for L = 1, 4, 48 (the outer mul over the ys grows with L too,
    so compare the serial loop, whose outer program is the loop alone)."""
    s1, s4, s48 = (simulate(serial(n), hardware, overlap=overlap).step_s for n in (1, 4, 48))
    assert s4 == pytest.approx(4 * s1, rel=REL) and s48 == pytest.approx(48 * s1, rel=REL)
    rep = simulate(serial(48), hardware, overlap=overlap)
    assert rep.by_collective["all_reduce"]["count"] == 48 and len(rep.collectives) == 48
    assert rep.by_prim["dot_general"]["count"] == 96


def test_stacked_rows_and_reverse_against_the_unrolled_form():
    """xs rows and ys stacking: the unrolled form adds a slice + squeeze per row read and a broadcast +
    concatenate to stack the ys, which the loop (rows read in place, ys written in place) does not
    run. Priced each alone (no fusion, the roofline of tests/unit/test_hw_analytical.py), the loop is the
    unrolled form minus exactly those equations. Reversed, the same time, iterations n-1..0."""
    spec = unfused("h100")
    L = 4
    spmd = stacked(L)
    an = Analyzer()
    loop = an.simulate(spmd, spec)
    flat_spmd = _unrolled(spmd)
    flat = an.simulate(flat_spmd, spec)
    t = compute_times(an.analysis(flat_spmd.program), spec)
    extra = sum(t[i] for i, e in enumerate(flat_spmd.program.eqns)
                if e.prim in ("slice", "squeeze", "broadcast_in_dim", "concatenate"))
    assert extra > 0
    assert loop.step_s == pytest.approx(flat.step_s - extra, rel=REL)
    rev = an.simulate(stacked(L, reverse=True), spec)
    assert rev.step_s == pytest.approx(loop.step_s, rel=REL)
    assert [r.at for r in rev.collectives][::2] == [(0, i) for i in range(L - 1, -1, -1)]
    assert [r.prim for r in rev.collectives] == ["all_gather", "all_reduce"] * L


@pytest.mark.parametrize("overlap", [False, True])
def test_pricing_a_loop_walks_its_body_once(overlap):
    """48 layers: the loop program's equations are priced once each; the unrolled form's 48 times."""
    L = 48
    spmd = stacked(L)
    loop_an, flat_an = Analyzer(), Analyzer()
    loop = loop_an.simulate(spmd, "h100", overlap=overlap)
    flat = flat_an.simulate(_unrolled(spmd), "h100", overlap=overlap)
    assert loop.flops_per_device == pytest.approx(flat.flops_per_device, rel=REL)
    assert flat_an.eqns_priced > 20 * loop_an.eqns_priced
    before = loop_an.eqns_priced
    loop_an.simulate(spmd, "tpu-v4", overlap=overlap)        # analysis kept: one walk of program + body
    body = spmd.program.eqns[0].params["body"]
    assert loop_an.eqns_priced - before == len(spmd.program.eqns) + len(body.eqns)


# -- memory (rule 5) ----------------------------------------------------------------------------------
def test_peak_memory_by_hand():
    """h[m, k] carried over W[L, k, k] (xs); body y = h @ w_i, r = all_reduce(y), outputs (r, y).
    Body: start h_b + w_b; the dot adds y (peak of the body: 2mk + kk), then h_b, w_b go; the
    all_reduce holds y + r. Outer loop point: h + W + carry out + ys whole = mk + L kk + mk + L mk,
    plus the body's peak. In elements: 4mk + (L+1) kk + L mk."""
    m, k, L = 256, 128, 4
    ids = itertools.count()
    top = Build(ids)
    h0, ws = top.var((m, k)), top.var((L, k, k))
    b = Build(ids)
    hb, wb = b.var((m, k)), b.var((k, k))
    y = b.eq("dot_general", [hb, wb], (m, k), dimension_numbers=MM)
    r = b.eq("all_reduce", [y], (m, k), axes=("x",), op="sum")
    h, ys = top.loop([], [h0], [ws], b.program([hb, wb], [r, y]), L)
    spmd = _spmd(top.program([h0, ws], [h, ys]))
    expect = 4 * (4 * m * k + (L + 1) * k * k + L * m * k)
    assert expect == 1376256
    prof = peak_memory(spmd)
    assert prof.peak_bytes == expect and prof.peak_at == 0
    assert sum(prof.breakdown.values()) == expect
    # priced for a stack (policy "residuals"), the loop runs in its operands' buffers: the carry out
    # takes over the donated h0, and the body's h_b is h0 itself (live at the body's peak, the dot)
    rep = simulate(spmd, "h100")
    shared = 4 * (m * k + m * k)
    assert rep.peak_bytes_per_device == expect - shared and sum(rep.memory.values()) == expect - shared


def test_prefetch_buffers_inside_a_body():
    """The stacked body: a = tanh(h); g = all_gather(w_i); y = a @ g. With overlap the gather is issued
    at the iteration's start, so g is live while tanh runs: the body's tanh point gains g's bytes,
    which makes it the body's peak (h + a + w_i + g = 2mk + kk/4 + kk against 2mk + kk at the dot,
    plus the ys row and the all_reduced scalar, which come later). The loop point adds the body's
    peak of its own schedule; without prefetch (budget 0) nothing changes."""
    m, k, L = 1024, 512, 4
    spmd = stacked(L, m=m, k=k)
    plain = simulate(spmd, "h100")
    over = simulate(spmd, "h100", overlap=True)
    none = simulate(spmd, "h100", overlap=True, prefetch_bytes=0)
    outer = 4 * (m * k + L * (k // 4) * k + L)                    # h0, W, ys (L scalars); the carry out
    #                                                               takes over h0's buffer (donated)
    body_plain = 4 * (2 * m * k + k * k)                          # the dot point: a + g + y
    body_over = 4 * (m * k + (k // 4) * k + k * k)                # the tanh point: a + w_i + g (h is h0)
    assert plain.peak_bytes_per_device == outer + body_plain
    assert over.peak_bytes_per_device == outer + body_over
    assert none.peak_bytes_per_device == plain.peak_bytes_per_device
    assert over.memory["prefetch_buffers"] == 4 * k * k
    assert sum(over.memory.values()) == over.peak_bytes_per_device


# -- the DES runs every iteration -----------------------------------------------------------------
CASES = {"serial4": lambda: serial(4, 512, 256), "z3_4": lambda: z3(4, 512, 256), "fenced2": lambda: fenced(2, 512, 256),
         "stacked3": lambda: stacked(3, m=256, k=256), "stacked3_reverse": lambda: stacked(3, True, 256, 256),
         "nested2x3": lambda: nested(2, 3, 256, 256), **{f"rt_{k}": v for k, v in SPMD_PROGRAMS.items()}}


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_des_runs_the_loop_and_equals_analytical(name, overlap, hardware):
    """Nothing contends (one communication stream, each collective's groups disjoint): the DES, which
    simulates every iteration's collectives on the network, agrees with body × length to 1e-9."""
    spmd = CASES[name]()
    ana = simulate(spmd, hardware, overlap=overlap)
    des = simulate_des(spmd, hardware, overlap=overlap)
    assert des.compute_s == pytest.approx(ana.compute_s, rel=REL)
    assert [(r.at, r.index, r.prim, r.nbytes) for r in des.collectives] == [
        (r.at, r.index, r.prim, r.nbytes) for r in ana.collectives]
    assert len(des.collectives) == len(spmd.collectives())
    # rt_nested all-reduces 3 floats over 2 devices: the ring's chunks are uneven (8 and 4 bytes), so its
    # members drift apart; the analytical model prices that by the members' asynchronous critical path
    # (hwmodels/network/async_steps.py), which is what the DES runs: every collective and the step agree
    for a, d in zip(ana.collectives, des.collectives):
        assert a.time_s == pytest.approx(d.duration_s, rel=REL, abs=1e-18), (a, d)
    assert des.step_s == pytest.approx(ana.step_s, rel=REL)
    assert sum(d.duration_s for d in des.collectives) == pytest.approx(ana.comm_s, rel=REL, abs=1e-15)


def test_uneven_chunks_are_priced_by_the_critical_path():
    """A flat all_reduce of 3 floats over 2 devices: uneven chunks (members run ahead of the lock-step
    sum); the analytical model's asynchronous critical path equals the DES, and stays at or above the
    lock-step floor (``Fabric.price``)."""
    b = Build(itertools.count())
    x = b.var((3,))
    spmd = _spmd(b.program([x], [b.eq("all_reduce", [x], (3,), axes=("y",), op="sum")]), Mesh(x=2, y=2))
    ana, des = simulate(spmd, "h100"), simulate_des(spmd, "h100")
    assert ana.step_s == pytest.approx(des.step_s, rel=REL)


def test_des_iteration_boundaries():
    """Every iteration of the serial loop starts when the previous one's all_reduce is done."""
    spmd = serial(4, 512, 256)
    des = simulate_des(spmd, "h100", overlap=True)
    ana = simulate(spmd, "h100", overlap=True)
    step = ana.step_s / 4
    starts = [r.start_s for r in des.collectives]
    assert starts == pytest.approx([starts[0] + i * step for i in range(4)], rel=REL)
    assert des.collectives[-1].end_s <= des.step_s * (1 + REL)


def test_des_options_on_a_loop(tmp_path):
    """The chunk network, one process per device and the Perfetto trace run loop programs too: the
    trace holds every iteration's compute spans."""
    spmd = stacked(3, m=256, k=256)
    flow = simulate_des(spmd, "tpu-v4", overlap=True)
    chunk = simulate_des(spmd, "tpu-v4", overlap=True, network="chunk", chunk_bytes=1 << 14)
    assert chunk.step_s == pytest.approx(flow.step_s, rel=0.02)
    solo = simulate_des(spmd, "tpu-v4", overlap=True, symmetry=False, merge_window_s=0.0)
    assert solo.step_s == pytest.approx(flow.step_s, rel=REL)
    path = tmp_path / "trace.json"
    simulate_des(spmd, "tpu-v4", overlap=True, trace_path=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    dots = [e for e in events if e.get("cat") == "compute" and e["name"].startswith("dot_general") and e["tid"] == 0]
    assert len(dots) == 3 and len({e["ts"] for e in dots}) == 3


# -- a lowered scan transformer (scenarios/transformer/scenario.py, layers_as=loop) ------------------------------
@functools.cache
def _scan_transformer(strategy: str, mesh: str, layers: int) -> SpmdProgram:
    from partir_emu.app.experiment import Experiment  # why: jax, only for this tier of tests
    return Experiment("transformer", strategy, Mesh.parse(mesh), "tiny", f"layers_as=loop,layers={layers}").lower().spmd


@pytest.mark.parametrize("strategy, mesh", [("bp+mp", "batch=2,model=2"), ("z3", "batch=4")])
def test_scan_transformer_priced_and_simulated(strategy, mesh):
    """The compiler's own loop programs: the DES runs every layer and agrees with the analytical model;
    FLOPs and collectives are the unrolled form's; pricing walks a fraction of the unrolled equations."""
    spmd = _scan_transformer(strategy, mesh, 8)
    flat = _unrolled(spmd)
    for overlap in (False, True):
        an, flat_an = Analyzer(), Analyzer()
        ana = an.simulate(spmd, "h100", overlap=overlap)
        ref = flat_an.simulate(flat, "h100", overlap=overlap)
        assert flat_an.eqns_priced > 3 * an.eqns_priced          # 8 layers, and the optimizer outside the loop
        des = simulate_des(spmd, "h100", overlap=overlap, analyzer=an)
        assert des.step_s == pytest.approx(ana.step_s, rel=REL)
        assert len(ana.collectives) == len(des.collectives) == len(flat.collectives()) == len(ref.collectives)
        assert ana.flops_per_device == pytest.approx(ref.flops_per_device, rel=REL)
        _same_table(ana.by_collective, ref.by_collective)

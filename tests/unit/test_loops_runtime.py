"""Programs with ``loop`` equations run and are stored: the reference interpreter, the lockstep
engine on the in-process mesh (collectives in bodies, reversed, nested, zero-length loops, a
literal carry and const), the peak-memory convention (rule 5 of ``core.analysis``), the file
format, the executed-collective counts, and where an error inside a body is reported.

The reference for every run is the same program with its loops unrolled (``loops.unroll``):
equal bit for bit."""
from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from partir_emu.core.ir import Eqn
from partir_emu.core.loops import unroll, walk
from partir_emu.core.spmd import COMM_PRIMS, SpmdProgram
from partir_emu.errors import ArtifactError, UnsupportedPrimitiveError
from partir_emu.hwmodels.compute.memory import peak_memory
from partir_emu.mpi.failure_report import laggards, positions
from partir_emu.runtime.engine import run_spmd
from partir_emu.runtime.interpreter import eval_program
from partir_emu.runtime.layout import shard
from partir_emu.runtime.local_mesh import LocalMesh
from partir_emu.runtime.progress import engine_spot
from tests.loop_programs import GLOBAL_PROGRAMS, SPMD_PROGRAMS, Build, global_inputs, rule5_peak, tiny_spmd


def _bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _unrolled(spmd: SpmdProgram) -> SpmdProgram:
    return SpmdProgram(spmd.mesh, unroll(spmd.program), spmd.in_shardings, spmd.out_shardings,
                       spmd.global_in_shapes, spmd.global_out_shapes)


# -- the reference interpreter -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GLOBAL_PROGRAMS))
def test_eval_program_equals_unrolled(name):
    prog = GLOBAL_PROGRAMS[name]()
    assert any(e.prim == "loop" for e in prog.eqns) and not any(e.prim == "loop" for e in unroll(prog).eqns)
    ins = global_inputs([v.shape for v in prog.inputs], seed=3)
    got, want = eval_program(prog, ins), eval_program(unroll(prog), ins)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _bits(g, w), (name, g, w)
        assert g.flags.writeable and g.flags.owndata


def test_eval_program_scan_by_hand():
    """The scan against a plain numpy loop (forward and reversed): the loop op means what it says."""
    for reverse in (False, True):
        prog = GLOBAL_PROGRAMS["scan_reverse" if reverse else "scan"]()
        w, c0, xs = global_inputs([v.shape for v in prog.inputs], seed=4)
        bias = prog.eqns[0].params["body"].consts[0][1]
        c, sums, pre = c0, np.zeros(5, np.float32), np.zeros((5, 4), np.float32)
        for i in (range(4, -1, -1) if reverse else range(5)):
            pre[i] = w @ c + xs[i]
            c = np.tanh(pre[i] + bias)
            sums[i] = c.sum()
        out = eval_program(prog, [w, c0, xs])
        np.testing.assert_allclose(out[0], c, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out[1], sums, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[2], 2 * pre, rtol=1e-5, atol=1e-5)


def test_literal_carry_and_zero_length_values():
    lit = GLOBAL_PROGRAMS["literal"]()
    xs = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    c, ys = eval_program(lit, [xs])
    assert c.dtype == np.float32 and c.shape == () and c == np.prod(xs + 2.0, dtype=np.float32)
    assert _bits(ys, np.full(4, 3.0, np.float32))
    zero = GLOBAL_PROGRAMS["zero_length"]()
    c0 = np.arange(3, dtype=np.float32)
    c, ys = eval_program(zero, [c0, np.zeros((0, 3), np.float32)])
    assert _bits(c, c0) and _bits(ys, np.zeros((0, 3), np.float32))


# -- the lockstep engine on the in-process mesh ----------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPMD_PROGRAMS))
@pytest.mark.parametrize("algorithm", ["ring", "direct", "bidir_ring"])
def test_local_mesh_equals_unrolled(name, algorithm):
    spmd = SPMD_PROGRAMS[name]()
    ins = global_inputs(spmd.global_in_shapes, seed=5)
    got = LocalMesh(spmd.mesh, algorithm).run(spmd, ins)
    want = LocalMesh(spmd.mesh, algorithm).run(_unrolled(spmd), ins)
    for g, w in zip(got.outputs, want.outputs):
        assert _bits(g, w), name
    # rule 5 of core.analysis: the memory model's figure, and the rule restated here from shapes
    assert got.peak_bytes_per_device == [peak_memory(spmd).peak_bytes] * spmd.mesh.size
    assert got.peak_bytes_per_device == [rule5_peak(spmd.program)] * spmd.mesh.size


def test_peak_memory_by_hand():
    """c[4] over xs[3, 4] on Mesh(a=2); body: s = c + x_i, t = all_reduce(s), outputs (t, s).
    Body: start c16 + x16 = 32; add +16 = 48 (peak), c and x go; all_reduce +16 = 32.
    Outer: start c0 16 + xs 48 = 64; the loop's results c_out 16 + ys 48 -> 128, plus the body's 48."""
    spmd = tiny_spmd()
    res = LocalMesh(spmd.mesh).run(spmd, global_inputs(spmd.global_in_shapes))
    assert res.peak_bytes_per_device == [176, 176] and peak_memory(spmd).peak_bytes == 176
    c0, xs = global_inputs(spmd.global_in_shapes)
    c = c0
    for x in xs:
        c = 2 * (c + x)
    np.testing.assert_allclose(res.outputs[0], c, rtol=1e-6)


def test_engine_body_collectives_reach_the_callback_once_per_iteration():
    spmd = SPMD_PROGRAMS["nested"]()
    seen: list[str] = []
    lm = LocalMesh(spmd.mesh, "direct")

    def spy(eqn: Eqn, operands):
        seen.append(eqn.prim)
        return lm._collective(eqn, operands)

    ins = global_inputs(spmd.global_in_shapes)
    local = {d: [shard(x, s, spmd.mesh, d, n) for x, s, n in zip(ins, spmd.in_shardings, spmd.input_names)]
             for d in range(spmd.mesh.size)}
    run_spmd(spmd, range(spmd.mesh.size), local, spy)
    assert seen == [e.prim for e in spmd.collectives()]
    assert seen == [e.prim for e in unroll(spmd.program).eqns if e.prim in COMM_PRIMS]
    assert len(seen) == 2 * (3 * 3 + 1)


def test_a_long_loop_writes_every_row():
    """1000 iterations over a stacked xs[1000, 256] (rows are views, ys rows written in place; its
    time per iteration is benchmarks/loops.py's, not a timed test)."""
    ids = itertools.count()
    top = Build(ids)
    c0, xs = top.var((256,)), top.var((1000, 256))
    b = Build(ids)
    c, x = b.var((256,)), b.var((256,))
    cn = b.eq("add", [c, x], (256,))
    body = b.program([c, x], [cn, cn])
    prog = top.program([c0, xs], top.loop([], [c0], [xs], body, 1000))
    ins = global_inputs([(256,), (1000, 256)])
    c_out, ys = eval_program(prog, ins)
    np.testing.assert_allclose(ys, ins[0] + np.cumsum(ins[1], axis=0), rtol=1e-4, atol=1e-4)


# -- counts, printing, the file format ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPMD_PROGRAMS))
def test_stats_count_what_runs(name):
    spmd = SPMD_PROGRAMS[name]()
    flat = _unrolled(spmd)
    assert [e.prim for e in spmd.collectives()] == [e.prim for e in flat.collectives()]
    assert spmd.stats().to_json() == flat.stats().to_json()
    static = spmd.static_collectives()
    assert sum(n for _, n in static) == len(flat.collectives())
    assert len(static) == sum(1 for e, _ in walk(spmd.program) if e.prim in COMM_PRIMS)


def test_stats_of_nested_loops():
    st = SPMD_PROGRAMS["nested"]().stats()
    assert st.count == {"all_gather": 6, "collective_permute": 6, "all_reduce": 8}
    assert SPMD_PROGRAMS["zero_length"]().stats().count == {}


@pytest.mark.parametrize("name", sorted(SPMD_PROGRAMS))
def test_file_format_round_trip(name, tmp_path):
    spmd = SPMD_PROGRAMS[name]()
    path = tmp_path / "p.json"
    spmd.save(path)
    back = SpmdProgram.load(path)
    assert json.loads(path.read_text())["version"] == 2
    assert back.pretty() == spmd.pretty()
    assert "loop[" in back.pretty() and "all_reduce" in back.pretty()
    assert back.dumps() == spmd.dumps()
    ins = global_inputs(spmd.global_in_shapes, seed=9)
    a, b = LocalMesh(spmd.mesh).run(spmd, ins), LocalMesh(spmd.mesh).run(back, ins)
    assert all(_bits(x, y) for x, y in zip(a.outputs, b.outputs))
    assert a.peak_bytes_per_device == b.peak_bytes_per_device


def test_file_format_reads_version_1_and_names_bad_versions(tmp_path):
    flat = _unrolled(SPMD_PROGRAMS["tiny"]())
    d = flat.to_json()
    d["version"] = 1
    assert SpmdProgram.from_json(d).pretty() == flat.pretty()
    d["version"] = 3
    with pytest.raises(ArtifactError, match="format version 3; this partir_emu reads version 1 or 2"):
        SpmdProgram.from_json(d, "x.json")
    body = SPMD_PROGRAMS["tiny"]().to_json()
    del body["eqns"][0]["params"]["body"]["eqns"]
    with pytest.raises(ArtifactError, match="malformed SPMD program"):
        SpmdProgram.from_json(body)


def test_pretty_prints_bodies_indented():
    text = SPMD_PROGRAMS["nested"]().pretty()
    lines = text.splitlines()
    loops = [ln for ln in lines if " = loop[" in ln]
    assert len(loops) == 2
    assert any(ln.startswith("      ") and "all_gather" in ln for ln in lines)   # the inner body, two levels in


# -- where an error inside a body is reported ----------------------------------------------------
def test_error_inside_a_body_names_the_iteration():
    spmd = SPMD_PROGRAMS["layers"]()
    loop = spmd.program.eqns[0]
    body = loop.params["body"]
    bad = [Eqn("fft", e.inputs, e.outputs, {}, "layer.py:7") if e.prim == "tanh" else e for e in body.eqns]
    nbody = dataclasses.replace(body, eqns=tuple(bad))
    nloop = dataclasses.replace(loop, params={**loop.params, "body": nbody})
    prog = dataclasses.replace(spmd.program, eqns=(nloop, *spmd.program.eqns[1:]))
    broken = dataclasses.replace(spmd, program=prog)
    with pytest.raises(UnsupportedPrimitiveError) as info:
        LocalMesh(spmd.mesh).run(broken, global_inputs(spmd.global_in_shapes))
    spot = engine_spot(info.value)
    tanh_at = [e.prim for e in body.eqns].index("tanh")
    assert (spot.index, spot.eqn.prim, spot.loops, spot.device) == (tanh_at, "fft", ((0, 0),), 0)
    assert spot.describe() == f"op {tanh_at} of the loop body at op 0, iteration 0 (fft at layer.py:7)"


def test_failure_report_orders_ranks_by_their_collective_number():
    """Two ranks wait in iteration 2 of a body collective, one computes in iteration 1: the op index
    alone (the same in every iteration) cannot tell who is behind; ``seq`` does."""
    def rec(rank, seq, it, state):
        return {"rank": rank, "phase": "step", "devices": [rank], "op": 4, "loops": [[1, it]], "seq": seq,
                "prim": "all_reduce", "source": "m.py:3", "state": state}
    recs = [rec(0, 7, 2, "waiting for the other ranks"), rec(1, 7, 2, "waiting for the other ranks"),
            rec(2, 4, 1, "computing")]
    lines = laggards(recs)
    assert len(lines) == 1 and lines[0].startswith("partir-emu rank 2 device 2 op 4 of the loop body at op 1, "
                                                   "iteration 1 (all_reduce at m.py:3; computing)")
    assert "wait in op 4 of the loop body at op 1, iteration 2" in lines[0]
    assert "ranks 0-1: op 4 of the loop body at op 1, iteration 2" in positions(recs, 3)
